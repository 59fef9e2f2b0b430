// MoE dispatch kernels (symmring.moe.gpu.stages, wait/count/scan/pull/ack): gather, from every source rank's
// ring slot, the token rows routed to this PE's experts into an expert-contiguous pool: dequantised to bf16
// (moe_dispatch_pull, for bf16 experts) or as fp8 rows with their scales (moe_dispatch_pull_fp8).
//
// Launch order on one stream (each kernel starts after the previous one ended, which orders its reads
// after the acquire of moe_dispatch_wait). An expert window of chunks [c0, c1] (one chunk for the batch
// path) runs: for each chunk wait(route) + count (counts accumulate over the window), one scan, then for
// each chunk wait(layout) + pull; the batch path, whose producers all ran before, waits for both parts
// at once.
//   moe_dispatch_wait   one block per source rank: bounded wait for the chunk's route and/or layout
//                       generation (acquire); with the route part, snapshots the source's meta token_base
//                       (so nothing after the pull reads the slot); with clear_counts (a window's first
//                       chunk), block 0 also clears the per-expert counters.
//   moe_dispatch_stage  rdma sources only (symmring/transport.py): get the waited parts of each rdma source's
//                       slot into this PE's staging ring (one slot per source), which the kernels below then
//                       read instead of the peer's mapping (source_slot); no launch without rdma peers.
//   moe_dispatch_count  count the (token, k) entries of every source routed to each local expert.
//   moe_dispatch_scan   one block: exclusive scan -> row offsets (each group aligned to `align` rows), group
//                       ends for torch._grouped_mm (int32), the rows spanned; starts each reservation cursor
//                       at its group; checks the counts against the plan's bounds (below).
//   moe_dispatch_pull   one warp per (source rank, token): reserve one pool row per local expert of the
//                       token (atomic cursor: rows of an expert come in no fixed order, which changes
//                       no result since every row is computed independently and combine reduces in
//                       a fixed k order), pull the row over NVLink with 16-byte loads, dequantise, and
//                       record its source (rank, token, k) and weight.
//   moe_dispatch_pull_fp8  the same for the fp8 engines: rows stay fp8 (bytes and scales copied, no
//                       dequantisation) and every row's local expert goes to m_indices (the contiguous
//                       layout: with align 128 from the scan, every expert's group starts at a multiple of 128
//                       rows; rows of m_indices that no pull wrote hold -1: the layer fills them once and the
//                       combine scatter puts -1 back after reading each row, so every window starts clean).
//   moe_dispatch_ack    EARLY acknowledgement policy: acknowledge every owner's slot right after the pull.
//   moe_dispatch_fused_fp8  the small-batch schedule: wait + count + scan + pull_fp8 (+ the EARLY ack) of one
//                       chunk in ONE kernel. Every block waits for every source and counts every entry itself
//                       (a few thousand at decode sizes), so it derives the same group offsets as every other
//                       block and, from the entries before its own range of tokens, where its rows start in
//                       each group: no grid-wide handshake, and rows land in a fixed (flat entry) order. All
//                       threads of a block copy its tokens' rows (16-byte vectors, several loads in flight).
//   moe_dispatch_fused_fp8_small  the same with one load in flight per thread: decode sizes (less code).
// Counts and offsets never leave the device: no host synchronisation inside the layer.
//
// Capacity: the pool holds a budget's rows (symmring.moe.workspace_plan), not the worst routing's. A window whose
// rows (the scan's total, padding included) exceed it runs in passes (PassRows): each pass pulls only the
// entries whose window row falls in its range, the experts compute the pass, the combine scatters it, so no
// routing overflows the pool or is truncated. The host launches a routing-independent bound of passes; a
// pass past the window's rows pulls, computes and scatters nothing.
// Expert ids outside [0, num_experts) (the mask -1) are skipped.
//
// Bounds (device/moe/bounds.cuh): the host's bound of passes, the pool rows and the rows any one expert holds
// come from its plan of the call. Counts beyond them (ranks that planned different calls, a stale slot) are a
// pool_overflow error, recorded before any row is placed (moe_dispatch_scan, moe_dispatch_fused_fp8), which
// aborts the ring on every PE; every row index is also checked against its pass's rows where it is written.
// A pull that finds an error pending puts its pass's group ids back to -1 (clear_group_ids), so the engine
// after it computes nothing from rows a failed call left marked.
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <moe/args.cuh>
#include <moe/bounds.cuh>
#include <moe/warp.cuh>
#include <symmring/protocol.cuh>

using namespace symmring;
using symmring_moe::ChunkArgs;
using symmring_moe::DispatchCountArgs;
using symmring_moe::DispatchFusedArgs;
using symmring_moe::DispatchPullArgs;
using symmring_moe::DispatchPullFp8Args;
using symmring_moe::DispatchScanArgs;
using symmring_moe::DispatchStageArgs;
using symmring_moe::DispatchWaitArgs;
using symmring_moe::PassRows;
using symmring_moe::kPlanAbandoned;
using symmring_moe::kPlanRows;
using symmring_moe::kPlanRowsLost;
using symmring_moe::kOverflowExpertRows;
using symmring_moe::kOverflowWindowRows;
using symmring_moe::lanes_below;
using symmring_moe::record_overflow;
using symmring_moe::warp_inclusive_sum;

namespace {

// Bits of the MoE status word (stages.STATUS_*): problems that are not protocol timeouts.
enum MoeStatus : int { kStatusNoPeerMapping = 1, kStatusBadExpertId = 2 };
// Words of the bad-expert record (stages.BAD_ID_*): the first id outside [-1, num_experts) seen.
enum BadIdWord : int { kBadIdValue = 0, kBadIdRank = 1, kBadIdToken = 2, kBadIdK = 3, kBadIdWords = 4 };

// One source rank's slot as this PE reads it: meta row, routing, rows and (fp8 rings; else null) scales.
// A p2p source: its copy through the P2P mapping (peer_ptr). An rdma source (is_rdma_peer): the copy that
// moe_dispatch_stage got into slot `src_rank` of this PE's staging ring `stage` (null when this PE has no
// rdma peer). Decided once per block and source; the loops below read whichever it is the same way.
struct SourceSlot {
    const int64_t* meta;
    const int32_t* idx;
    const float* weights;
    const uint8_t* x;
    const float* x_sf;
};
__device__ __forceinline__ SourceSlot source_slot(const RingDescriptor& d, const RingDescriptor* stage, int slot,
                                                  int src_rank) {
    if (stage != nullptr && is_rdma_peer(d, src_rank)) {
        const RingDescriptor& st = *stage;
        return {meta_of(st, src_rank), topk_idx_of(st, src_rank), topk_weights_of(st, src_rank), x_of(st, src_rank),
                d.num_sf > 0 ? x_sf_of(st, src_rank) : nullptr};
    }
    return {peer_ptr(d, meta_of(d, slot), src_rank), peer_ptr(d, topk_idx_of(d, slot), src_rank),
            peer_ptr(d, topk_weights_of(d, slot), src_rank), peer_ptr(d, x_of(d, slot), src_rank),
            d.num_sf > 0 ? peer_ptr(d, x_sf_of(d, slot), src_rank) : nullptr};
}

// False (and the status bit set) when a source's slot can be read neither through a mapping nor from a
// staged copy (an rdma peer without a staging ring: the layer always passes one when it has rdma peers).
__device__ __forceinline__ bool slot_reachable(const SourceSlot& from, int* status) {
    const bool ok = from.meta != nullptr && from.x != nullptr;
    if (!ok) atomicOr(status, kStatusNoPeerMapping);
    return ok;
}

__device__ __forceinline__ int num_valid_of(const RingDescriptor& d, const SourceSlot& from) {
    int64_t n = *reinterpret_cast<const volatile int64_t*>(from.meta + kMetaNumValid);
    // A corrupt count must not index past the slot.
    return static_cast<int>(n < 0 ? 0 : (n > d.tokens_per_slot ? d.tokens_per_slot : n));
}

// An expert id outside [-1, num_experts) at entry `entry` (token * K + k) of src_rank's chunk: set
// kStatusBadExpertId and, the first time, the bad-id record (value, source rank, logical token, k).
__device__ __forceinline__ void flag_bad_id(const RingDescriptor& d, int chunk_idx, int expert, int src_rank,
                                            int64_t entry, int* status, int* bad_id) {
    if ((atomicOr(status, kStatusBadExpertId) & kStatusBadExpertId) != 0) return;
    bad_id[kBadIdValue] = expert;
    bad_id[kBadIdRank] = src_rank;
    bad_id[kBadIdToken] = static_cast<int>(chunk_token_base(chunk_idx, d.tokens_per_slot) + entry / d.num_topk);
    bad_id[kBadIdK] = static_cast<int>(entry % d.num_topk);
}

// Grid-stride over every thread of the grid (any shape): the group ids of pool rows [0, rows) back to -1
// (padding; nothing with m_indices null). For a dispatch that returns at entry because an error is pending:
// the combine scatter that puts a window's ids back returned at entry too, and the engine after this pass
// reads its rows' ids, which must then name no group (every engine skips padding rows), least of all a
// group of another shape with more experts (the ids are shared by every fp8 shape of the workspace).
__device__ __forceinline__ void clear_group_ids(int* m_indices, int rows) {
    if (m_indices == nullptr) return;
    const int64_t block = int64_t(blockIdx.y) * gridDim.x + blockIdx.x;
    const int64_t threads = int64_t(gridDim.x) * gridDim.y * blockDim.x;
    for (int64_t i = block * blockDim.x + threadIdx.x; i < rows; i += threads) m_indices[i] = -1;
}

}  // namespace

// Parts of a chunk moe_dispatch_wait waits for (stages.WAIT_*).
enum WaitParts : int { kWaitRoute = 1, kWaitLayout = 2 };

// Block r waits for source rank r's chunk: its route and/or layout generation (acquire; ONE deadline for both
// parts, so a route that arrives late leaves the layout only the rest of the bound). With the
// route part, thread 0 then checks the meta row (this chunk, generation and call of layer `layer`:
// check_payload) and copies the source's meta token_base into token_base[r] (the caller passes the
// chunk's row of a [window][num_ranks] array). With clear_counts, block 0 zeroes `counts`
// [num_local_experts] for moe_dispatch_count.
extern "C" __global__ void moe_dispatch_wait(const DispatchWaitArgs args) {
    const RingDescriptor& d = *args.desc;
    if (blockIdx.x == 0 && args.clear_counts)
        for (int e = threadIdx.x; e < args.num_local_experts; e += blockDim.x) args.counts[e] = 0;
    if (error_pending(d)) return;
    const int src_rank = blockIdx.x;
    const int slot = slot_of(args.chunk_idx, d.num_slots);
    const uint64_t gen = expected_generation(d, args.chunk_idx);
    Deadline deadline(d);  // one bound for both parts (thread 0's is used): not a bound per part
    if (args.parts & kWaitRoute) {
        // acquire: pairs with the route publication of moe_produce_route on src_rank.
        if (!wait_published(d, args.chunk_idx, src_rank, route_ready_word(d, slot), gen, kErrorRoute, deadline)) return;
        __shared__ int fresh;
        // A stale slot or another call's payload: a typed error, not data.
        if (threadIdx.x == 0) fresh = check_payload(d, args.chunk_idx, src_rank, gen, expected_call(d, args.layer));
        __syncthreads();
        if (!fresh) return;
        if (threadIdx.x == 0) {
            int64_t* meta_local = meta_of(d, slot);
            const int64_t* meta = peer_ptr(d, meta_local, src_rank);
            // rdma source: a get of the word (after the acquire above, as the load).
            args.token_base[src_rank] = meta != nullptr ? meta[kMetaTokenBase]
                                                        : nvshmem_int64_g(meta_local + kMetaTokenBase, src_rank);
        }
    }
    // acquire: pairs with the layout publication of moe_produce_layout_* on src_rank.
    if (args.parts & kWaitLayout)
        wait_published(d, args.chunk_idx, src_rank, layout_ready_word(d, slot), gen, kErrorLayout, deadline);
}

// The rdma transport's pull (symmring/transport.py): get the chunk's `parts` (kWaitRoute: the meta row,
// topk_idx and topk_weights of the valid tokens; kWaitLayout: their x rows and x_sf scales) of source rank
// blockIdx.y's slot into slot blockIdx.y of this PE's staging ring `stage_ptr` (symmetric memory, so a valid
// local buffer of a get on every NVSHMEM transport); moe_dispatch_count / _pull / _pull_fp8 / _fused_fp8
// then read those sources there (source_slot). Grid (blocks per source, num_ranks): the blocks of a source
// share its bytes; blocks of p2p sources and of this PE return at once. Readiness: acquired by
// moe_dispatch_wait earlier on the stream (wait = 0), or (wait != 0: the small-batch schedule, whose fused
// dispatch has no wait kernel before it) polled here first by thread 0 of every block (poll_ready: both
// parts, bounded, acquire). Every get is blocking (nvshmemx_getmem_block returns with the bytes in the
// staging slot), so the end of this kernel orders them before the next kernel on the stream.
extern "C" __global__ void moe_dispatch_stage(const DispatchStageArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    const int src_rank = blockIdx.y;
    if (!is_rdma_peer(d, src_rank)) return;
    const RingDescriptor& st = *args.stage;
    const int slot = slot_of(args.chunk_idx, d.num_slots);
    int64_t* meta_local = meta_of(d, slot);
    __shared__ int ok;
    __shared__ int num_valid;
    if (threadIdx.x == 0) {
        // acquire (wait != 0): pairs with the release of the source's publications (grid_publish).
        ok = !args.wait || poll_ready(d, args.chunk_idx, src_rank, expected_generation(d, args.chunk_idx));
        if (ok) {
            const int64_t n = nvshmem_int64_g(meta_local + kMetaNumValid, src_rank);
            num_valid = static_cast<int>(n < 0 ? 0 : (n > d.tokens_per_slot ? d.tokens_per_slot : n));
        }
    }
    __syncthreads();  // the other threads get the payload only after thread 0's acquire
    if (!ok) return;
    const uint64_t block = blockIdx.x, num_blocks = gridDim.x, n = static_cast<uint64_t>(num_valid);
    if (args.parts & kWaitRoute) {
        if (block == 0) nvshmemx_getmem_block(meta_of(st, src_rank), meta_local, kMetaColumns * sizeof(int64_t), src_rank);
        const uint64_t topk_bytes = n * d.num_topk * sizeof(int32_t);
        get_share_block(topk_idx_of(st, src_rank), topk_idx_of(d, slot), src_rank, topk_bytes, block, num_blocks);
        get_share_block(topk_weights_of(st, src_rank), topk_weights_of(d, slot), src_rank, topk_bytes, block,
                        num_blocks);
    }
    if (args.parts & kWaitLayout) {
        get_share_block(x_of(st, src_rank), x_of(d, slot), src_rank, n * x_row_bytes(d), block, num_blocks);
        if (d.num_sf > 0)
            get_share_block(x_sf_of(st, src_rank), x_sf_of(d, slot), src_rank, n * d.num_sf * sizeof(float), block,
                            num_blocks);
    }
}

// counts[e] += number of (token, k) entries of every source rank routed to local expert e. Grid:
// (token blocks, num_ranks); one thread per (token, k) entry; shared-memory histogram per block. An expert id
// outside [-1, num_experts) sets kStatusBadExpertId and, the first time, the bad-id record (value, source
// rank, logical token, k); the entry is then skipped like a masked one, so nothing else breaks, and
// check_errors() names it (no host sync in the layer).
extern "C" __global__ void moe_dispatch_count(const DispatchCountArgs args) {
    extern __shared__ int block_counts[];
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    const int src_rank = blockIdx.y;
    const int slot = slot_of(args.chunk_idx, d.num_slots);
    for (int e = threadIdx.x; e < args.num_local_experts; e += blockDim.x) block_counts[e] = 0;
    __syncthreads();
    const SourceSlot from = source_slot(d, args.stage, slot, src_rank);
    if (slot_reachable(from, args.status)) {
        const int num_valid = num_valid_of(d, from);
        const int32_t* idx = from.idx;
        const int64_t num_entries = int64_t(num_valid) * d.num_topk;
        for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_entries;
             i += int64_t(gridDim.x) * blockDim.x) {
            const int expert = idx[i];
            const int local = expert - args.expert_begin;
            if (local >= 0 && local < args.num_local_experts) {
                atomicAdd(&block_counts[local], 1);
            } else if (expert < -1 || expert >= d.num_experts) {
                flag_bad_id(d, args.chunk_idx, expert, src_rank, i, args.status, args.bad_id);
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < args.num_local_experts; e += blockDim.x)
        if (block_counts[e]) atomicAdd(&args.counts[e], block_counts[e]);
}

// One block: the expert-contiguous row layout of the pool. With a = align (1: packed rows), expert e's group
// starts at begin[e] = sum over e' < e of align_up(counts[e'], a), so every group starts at a multiple of a
// (the contiguous layout of the fp8 engines: a = 128); group_end[e] = begin[e] + counts[e] (int32; with a = 1
// the cumulative ends torch._grouped_mm takes as `offs`); total[0] = the rows spanned, padding included;
// cursor[e] = begin[e] (moe_dispatch_pull* reserve rows from it). Blocked scan: each thread sums a
// contiguous run of experts, then a shared-memory scan over the threads' sums.
// The plan's bounds of the window whose first chunk is chunk_idx: an expert with more than rows_per_expert
// rows, or a total past window_rows (the rows its passes cover), records pool_overflow (bounds.cuh), which
// aborts the ring, and leaves an empty layout (every group empty, total 0): the pulls after this kernel
// return at entry, so no row is dropped silently, and an engine that reads group_end (the torch engine)
// computes no row past the pool.
extern "C" __global__ void moe_dispatch_scan(const DispatchScanArgs args) {
    const RingDescriptor& d = *args.desc;
    extern __shared__ int partial[];  // [blockDim.x]
    __shared__ int overflow;
    const int per_thread = (args.num_local_experts + blockDim.x - 1) / blockDim.x;
    const int first = threadIdx.x * per_thread;
    auto span = [align = args.align](int count) { return (count + align - 1) / align * align; };
    int sum = 0;
    for (int e = first; e < first + per_thread && e < args.num_local_experts; ++e) sum += span(args.counts[e]);
    partial[threadIdx.x] = sum;
    if (threadIdx.x == 0) overflow = 0;
    __syncthreads();
    // Hillis-Steele inclusive scan of the per-thread sums.
    for (int offset = 1; offset < blockDim.x; offset *= 2) {
        const int add = threadIdx.x >= offset ? partial[threadIdx.x - offset] : 0;
        __syncthreads();
        partial[threadIdx.x] += add;
        __syncthreads();
    }
    for (int e = first; e < first + per_thread && e < args.num_local_experts; ++e) {
        if (args.counts[e] > args.rows_per_expert) {
            overflow = 1;
            record_overflow(d, kOverflowExpertRows, d.rank, args.chunk_idx, args.rows_per_expert, args.counts[e],
                            args.expert_begin + e);
        }
    }
    const int rows = partial[blockDim.x - 1];
    if (threadIdx.x == blockDim.x - 1 && rows > args.window_rows) {
        overflow = 1;
        record_overflow(d, kOverflowWindowRows, d.rank, args.chunk_idx, args.window_rows, rows);
    }
    __syncthreads();
    const bool empty = overflow != 0;
    int running = empty ? 0 : partial[threadIdx.x] - sum;  // exclusive prefix of this thread's run
    for (int e = first; e < first + per_thread && e < args.num_local_experts; ++e) {
        args.begin[e] = running;
        args.cursor[e] = running;
        args.group_end[e] = running + (empty ? 0 : args.counts[e]);
        running += empty ? 0 : span(args.counts[e]);
    }
    if (threadIdx.x == blockDim.x - 1) args.total[0] = empty ? 0 : rows;
}

// One warp (all 32 lanes; lane k holds `row`, the pool row of the token's entry k, and rows_mask the lanes
// with one): copy the token's row `src` [hidden] of T as it is into every reserved row of pool_x [rows][hidden],
// one 16-byte vector per lane and step (16 / sizeof(T) elements; hidden a multiple of them). Every lane runs
// every step (shuffles need the whole warp); lanes past the row idle.
template <typename T>
__device__ __forceinline__ void copy_token_row(const T* src, int row, unsigned rows_mask, T* pool_x, int hidden,
                                               int lane) {
    constexpr int kPerLane = 16 / sizeof(T);
    for (int col0 = 0; col0 < hidden; col0 += 32 * kPerLane) {
        const int col = col0 + lane * kPerLane;
        const bool active = col < hidden;
        int4 raw = make_int4(0, 0, 0, 0);
        if (active) raw = *reinterpret_cast<const int4*>(src + col);
        for (unsigned m = rows_mask; m; m &= m - 1) {
            const int dst_row = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
            if (active) *reinterpret_cast<int4*>(pool_x + int64_t(dst_row) * hidden + col) = raw;
        }
    }
}

// One warp (all 32 lanes; lane k holds `row`, the pool row of the token's entry k, and rows_mask the lanes
// with one): copy the token's fp8 row `src` [hidden] (16 bytes per lane and step) and its num_sf float32
// scales `src_sf` into every reserved row: pool_x [rows][hidden] bytes, pool_sf element (row, j) at
// row * sf_row_stride + j * sf_col_stride (row-major or MN-major, the layout DeepGEMM reads).
__device__ __forceinline__ void copy_token_fp8(const uint8_t* src, const float* src_sf, int row, unsigned rows_mask,
                                               uint8_t* pool_x, float* pool_sf, long long sf_row_stride,
                                               long long sf_col_stride, int hidden, int num_sf, int lane) {
    // Lane j < num_sf also carries scale j of the token (num_sf = hidden / 128 <= 32 lanes per step).
    for (int j0 = 0; j0 < num_sf; j0 += 32) {
        const int j = j0 + lane;
        const float scale = j < num_sf ? src_sf[j] : 0.0f;
        for (unsigned m = rows_mask; m; m &= m - 1) {
            const int dst_row = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
            if (j < num_sf) pool_sf[int64_t(dst_row) * sf_row_stride + int64_t(j) * sf_col_stride] = scale;
        }
    }
    copy_token_row(src, row, rows_mask, pool_x, hidden, lane);
}

// The passes of a window (docs/PROTOCOL.md 9.1c): the window's rows, expert-contiguous and aligned (the scan's
// begin[]), may exceed the pool; pass p holds window rows [pass_begin, pass_begin + pass_rows), a multiple of
// the alignment, so every group in it still starts aligned. The first pass (pass_begin == 0) reserves each
// entry's window row from the atomic cursor and, when the window has more passes (entry_rows not null),
// records it in entry_rows[src_rank][token][k]; later passes read it there, so every pass sees the same
// rows and each entry lands in exactly one pass (PassRows, moe/args.cuh: the pull kernels' `pass`).

// Lane k of the warp of (source rank, token): the pool row of entry k in this pass when its expert is local
// (its window row from the atomic cursor, global or shared, holding the expert's next free row: rows of an
// expert come in no fixed order, which changes no result since every row is computed independently and
// combine reduces in a fixed k order), recording row_src[row] = {src_rank, token, k, chunk_idx},
// row_weight[row] and (aligned pools) m_indices[row] = the local expert. -1 when not local or in another pass.
__device__ __forceinline__ int reserve_row(const RingDescriptor& d, const int32_t* idx, const float* weights,
                                           int token, int lane, int src_rank, int chunk_idx, int* cursor,
                                           int4* row_src, float* row_weight, int* m_indices,
                                           int expert_begin, int num_local_experts, const PassRows& pass) {
    if (lane >= d.num_topk) return -1;
    const int64_t entry = int64_t(token) * d.num_topk + lane;
    const int local = idx[entry] - expert_begin;
    if (local < 0 || local >= num_local_experts) return -1;
    int* entry_row = pass.entry_rows == nullptr ? nullptr
        : pass.entry_rows + (int64_t(src_rank) * d.tokens_per_slot * d.num_topk + entry);
    int window_row;
    if (pass.pass_begin == 0) {
        window_row = atomicAdd(&cursor[local], 1);
        if (entry_row != nullptr) *entry_row = window_row;
    } else {
        window_row = *entry_row;  // written by the first pass of this window (an earlier kernel on the stream)
    }
    const int row = window_row - pass.pass_begin;
    if (row < 0 || row >= pass.pass_rows) return -1;
    row_src[row] = make_int4(src_rank, token, lane, chunk_idx);
    row_weight[row] = weights[entry];
    if (m_indices != nullptr) m_indices[row] = local;
    return row;
}

// The body of moe_dispatch_pull and moe_dispatch_pull_fp8 (source rank blockIdx.y of chunk chunk_idx; nothing
// but clear_group_ids when an error is pending, nothing when the slot is unreachable): one warp per valid
// token (grid-stride) reserves the
// token's pool rows (reserve_row; m_indices null: not recorded) and, when it got any, the whole warp calls
// copy_token(from, token, row, rows_mask, hidden, fp8, lane) to copy the token's row into them (lane k holds
// `row`, the pool row of entry k or -1; rows_mask: the lanes with one; hidden and fp8, whether the ring's rows
// are fp8: read from the descriptor once, before the loop).
template <typename CopyToken>
__device__ __forceinline__ void pull_tokens(const RingDescriptor& d, int chunk_idx, int* cursor, int4* row_src,
                                            float* row_weight, int* m_indices, int expert_begin,
                                            int num_local_experts, int* status, const RingDescriptor* stage,
                                            const PassRows& pass, CopyToken copy_token) {
    if (error_pending(d)) {
        clear_group_ids(m_indices, pass.pass_rows);
        return;
    }
    const int src_rank = blockIdx.y;
    const int slot = slot_of(chunk_idx, d.num_slots);
    const SourceSlot from = source_slot(d, stage, slot, src_rank);
    if (!slot_reachable(from, status)) return;
    const int num_valid = num_valid_of(d, from);
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int hidden = d.hidden;
    const bool fp8 = d.x_format == kXFormatFp8E4M3;

    for (int token = blockIdx.x * warps_per_block + threadIdx.x / 32; token < num_valid;
         token += gridDim.x * warps_per_block) {
        const int row = reserve_row(d, from.idx, from.weights, token, lane, src_rank, chunk_idx, cursor, row_src,
                                    row_weight, m_indices, expert_begin, num_local_experts, pass);
        const unsigned rows_mask = __ballot_sync(0xffffffffu, row >= 0);
        if (rows_mask == 0) continue;
        copy_token(from, token, row, rows_mask, hidden, fp8, lane);
    }
}

// One warp per (source rank, token): reserve a pool row for each of the token's local experts (this pass's:
// PassRows), copy the token's x row from the source slot into every reserved row as bf16 (fp8: dequantised
// with the token's per-128-channel scales), and record row_src[row] = {src_rank, token, k, chunk_idx} and
// row_weight[row]. Grid: (token blocks, num_ranks); num_topk <= 32.
extern "C" __global__ void moe_dispatch_pull(const DispatchPullArgs args) {
    const RingDescriptor& d = *args.desc;
    auto copy_token = [&](const SourceSlot& from, int token, int row, unsigned rows_mask, int hidden, bool fp8,
                          int lane) {
        if (fp8) {
            // 16 fp8 channels per lane and step (one 16-byte load), written as 32 bytes of bf16.
            const uint8_t* src = from.x + int64_t(token) * hidden;
            const float* sf = from.x_sf + int64_t(token) * d.num_sf;
            // Every lane runs every step (shuffles need the whole warp); lanes past the row idle.
            for (int col0 = 0; col0 < hidden; col0 += 32 * 16) {
                const int col = col0 + lane * 16;
                const bool active = col < hidden;
                int4 out[2];
                if (active) {
                    const int4 raw = *reinterpret_cast<const int4*>(src + col);
                    const float scale = sf[col / d.sf_group_size];  // 16 | sf_group_size (layer-checked)
                    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
                    __nv_bfloat162* out_pairs = reinterpret_cast<__nv_bfloat162*>(out);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        // e4m3 -> half is exact; float(q) * scale is the reference's dequantisation.
                        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
                        out_pairs[i] = __floats2bfloat162_rn(f.x * scale, f.y * scale);
                    }
                }
                for (unsigned m = rows_mask; m; m &= m - 1) {
                    const int dst_row = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
                    if (!active) continue;
                    int4* dst = reinterpret_cast<int4*>(args.pool_x + int64_t(dst_row) * hidden + col);
                    dst[0] = out[0];
                    dst[1] = out[1];
                }
            }
        } else {
            // bf16: 8 channels per lane and step.
            copy_token_row(reinterpret_cast<const __nv_bfloat16*>(from.x) + int64_t(token) * hidden, row, rows_mask,
                           args.pool_x, hidden, lane);
        }
    };
    pull_tokens(d, args.chunk_idx, args.cursor, args.row_src, args.row_weight, nullptr, args.expert_begin,
                args.num_local_experts, args.status, args.stage, args.pass, copy_token);
}

// One block, after moe_dispatch_pull (the last read of every source's slot; its meta was snapshotted by
// moe_dispatch_wait): the EARLY acknowledgement of every owner's slot. ack() fences first (release: pairs
// with the acquire in the owner's wait_reusable).
extern "C" __global__ void moe_dispatch_ack(const ChunkArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    for (int owner = 0; owner < d.num_ranks; ++owner) ack(d, args.chunk_idx, owner);
}

// The fp8 pool (the fp8 engines): as moe_dispatch_pull, but the rows stay fp8. One warp per (source rank,
// token): reserve a row per local expert of the token (m_indices[row] = its local expert), copy the token's
// fp8 row (16 bytes per lane and step) and its num_sf float32 scales from the source slot into every reserved
// row: pool_x [rows][hidden] bytes, pool_sf element (row, j) at row * sf_row_stride + j * sf_col_stride (so the
// scales can be laid out row-major or MN-major, the layout DeepGEMM reads). Needs an fp8 ring.
extern "C" __global__ void moe_dispatch_pull_fp8(const DispatchPullFp8Args args) {
    const RingDescriptor& d = *args.desc;
    auto copy_token = [&](const SourceSlot& from, int token, int row, unsigned rows_mask, int hidden, bool /*fp8*/,
                          int lane) {
        copy_token_fp8(from.x + int64_t(token) * hidden, from.x_sf + int64_t(token) * d.num_sf, row, rows_mask,
                       args.pool_x, args.pool_sf, args.sf_row_stride, args.sf_col_stride, hidden, d.num_sf, lane);
    };
    pull_tokens(d, args.chunk_idx, args.cursor, args.row_src, args.row_weight, args.m_indices, args.expert_begin,
                args.num_local_experts, args.status, args.stage, args.pass, copy_token);
}

// The small-batch schedule's dispatch of one chunk into an fp8 pool (see the header): wait, count, scan, pull
// and (ack_now: EARLY) acknowledge, in one grid. The chunk's tokens of all sources, in source order, are cut
// into gridDim.x contiguous ranges, one per block (block b: positions [b * n / G, (b + 1) * n / G)).
// Dynamic shared memory: 4 * num_ranks pointers, then (2 * num_local_experts + num_ranks + 1) ints.
//   1. Thread r < num_ranks waits for both of source r's generations (one deadline, acquire), reads its valid
//      count and token base (block 0 stores the base into token_base[r] for the combine) and its payload
//      pointers.
//   2. Every block counts every entry per local expert, and separately the entries of tokens before its range.
//   3. Warp 0 scans the counts (groups aligned to `align` rows): block 0 writes counts, begin, group_end and
//      total (as moe_dispatch_count and _scan would); every block starts its cursor of expert e at begin[e] +
//      (entries of e before its range). Every block checks the plan's bounds (pool_rows: the window's rows
//      the engine and the scale layout cover; rows_per_expert): past them, block 0 records pool_overflow
//      (bounds.cuh; it aborts the ring) and every block returns before placing any row (each block derives
//      the same counts).
//   4. Per pass of up to kPassEntries entries of its range: warp 0 gives each local entry its row in flat
//      order (__match_any_sync ranks the entries of one expert within 32 entries), so rows land in a fixed
//      order; all threads record row_src / row_weight / m_indices and copy the fp8 rows (16-byte vectors,
//      kLoadsInFlight loads per thread before the stores) and scales into every row, as moe_dispatch_pull_fp8.
// Every block waits on peers' producers, so the grid is at most stages.Kernels.spin_blocks (PROTOCOL.md 9.2).
// counter: a zeroed device word for the EARLY acknowledgement's grid handshake (unused otherwise). With an
// error pending at entry the grid only puts the group ids of rows [0, pool_rows) back to -1 (clear_group_ids),
// unless an experts kernel runs beside it (args.plan): that kernel is told by the plan's words instead.
namespace {

// Entries (token, k) of a block's range handled per pass of the fused dispatch (shared memory: 8 KB).
constexpr int kPassEntries = 1024;
// 16-byte loads each thread of the fused dispatch issues before their stores (and index loads before their
// atomics): 8 in moe_dispatch_fused_fp8; 1 in moe_dispatch_fused_fp8_small, which the host takes where a block
// holds at most one token and the count's entries are at most two rounds of the block's threads (one more per
// source past the first; stages.SMALL_DISPATCH_ENTRIES). There eight loads in flight gain nothing and the unrolled
// loops' code is what costs: a decode call fetches the kernel cold after the experts kernel, and the small build's
// 69 KB instead of 132 KB of sm_90a code took 3-9 us off its count and pull on an H100 (docs/FUSED.md "The
// dispatch's code").
constexpr int kLoadsWide = 8;
constexpr int kLoadsSmall = 1;

// Thread 0 of block 0: the plan word of an experts kernel beside the dispatch (args.plan; release at gpu scope:
// the group layout and the m_indices the plan wrote before it): `blocks` (this grid) or kPlanAbandoned.
__device__ __forceinline__ void publish_plan(const DispatchFusedArgs& args, int blocks) {
    if (args.plan == nullptr) return;
    __threadfence();
    atomicExch(args.plan, blocks);
}

// The kernel's body (below): every return of it passes the kernel's last wait. Returns whether the block placed
// its rows (false: an error pending or recorded, counts past the bounds); every thread of a block returns alike.
template <int kLoadsInFlight>
__device__ __forceinline__ bool dispatch_fused(const DispatchFusedArgs& args) {
    CHAIN_STAMP(8);
    const RingDescriptor& d = *args.desc;
    const int K = d.num_topk;
    const int R = d.num_ranks;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    const int32_t** src_idx = reinterpret_cast<const int32_t**>(shared_bytes);  // [num_ranks] per source:
    const float** src_weights = reinterpret_cast<const float**>(src_idx + R);    // the slot's payload,
    const uint8_t** src_x = reinterpret_cast<const uint8_t**>(src_weights + R);  // peer pointers
    const float** src_sf = reinterpret_cast<const float**>(src_x + R);
    int* counts = reinterpret_cast<int*>(src_sf + R);     // [num_local_experts]
    int* cursor = counts + args.num_local_experts;        // [num_local_experts]: entries before the range, then rows
    int* first_token = cursor + args.num_local_experts;   // [num_ranks + 1]: each source's first token's position
    __shared__ int entry_local[kPassEntries];             // the pass's entries: local expert or -1
    __shared__ int entry_row[kPassEntries];               // ... and their pool rows (-1: not local)
    __shared__ int failed;
    __shared__ int overflow;  // the counts exceed the plan's bounds: no row is placed
    __shared__ int pending;   // an error pending at entry: read once, so that the whole block returns alike
    if (threadIdx.x == 0) pending = error_pending(d);
    __syncthreads();
    if (pending) {
        // Beside an experts kernel the group ids stay as they are: it learns of the lost rows from the plan's
        // words, and the tables of its blocks must agree (MoE.reset() clears the ids before the next call).
        if (args.plan == nullptr) clear_group_ids(args.m_indices, args.pool_rows);
        if (blockIdx.x == 0 && threadIdx.x == 0) publish_plan(args, kPlanAbandoned);
        return false;
    }
    const int slot = slot_of(args.chunk_idx, d.num_slots);
    const uint64_t gen = expected_generation(d, args.chunk_idx);
    const uint64_t call_id = expected_call(d, args.layer);
    if (threadIdx.x == 0) failed = overflow = 0;
    for (int e = threadIdx.x; e < args.num_local_experts; e += blockDim.x) counts[e] = cursor[e] = 0;
    __syncthreads();

    // 1. Thread r waits for source r's route and layout (one deadline for both words; num_ranks <= blockDim).
    if (threadIdx.x < R) {
        const int src = threadIdx.x;
        int valid = 0;
        // acquire: pairs with the release in grid_publish of moe_produce_chunk_fp8 on src. Then the slot must
        // hold this call's chunk (a stale payload or another call's is a typed error, not silent data).
        const SourceSlot from = source_slot(d, args.stage, slot, src);
        // Started beside this PE's own producer (PDL, no stage), whose wait for the slot's acknowledgements may
        // begin after this one: twice the bound for its words, so a peer that never acknowledged is named by the
        // producer's reuse record, not by this wait.
        const uint64_t extra_ns = src == d.rank && args.stage == nullptr ? timeout_ns_of(d) : 0;
        if (!slot_reachable(from, args.status) || !poll_ready(d, args.chunk_idx, src, gen, extra_ns) ||
            !check_payload(d, args.chunk_idx, src, gen, call_id)) {
            failed = 1;
        } else {
            valid = num_valid_of(d, from);
            if (blockIdx.x == 0) args.token_base[src] = from.meta[kMetaTokenBase];
            src_idx[src] = from.idx;
            src_weights[src] = from.weights;
            src_x[src] = from.x;
            src_sf[src] = from.x_sf;
        }
        first_token[src + 1] = valid;
    }
    __syncthreads();  // the other threads read the payload only after the waiting threads' acquires
    CHAIN_STAMP(9);
    if (failed) {
        if (blockIdx.x == 0 && threadIdx.x == 0) publish_plan(args, kPlanAbandoned);
        return false;
    }
    if (threadIdx.x == 0) {
        first_token[0] = 0;
        for (int r = 0; r < R; ++r) first_token[r + 1] += first_token[r];
    }
    __syncthreads();
    const int num_tokens = first_token[R];
    const int range_begin = static_cast<int>(int64_t(blockIdx.x) * num_tokens / gridDim.x);
    const int range_end = static_cast<int>(int64_t(blockIdx.x + 1) * num_tokens / gridDim.x);
    auto source_of = [&](int pos) {
        int src = 0;
        while (pos >= first_token[src + 1]) ++src;
        return src;
    };

    // Block 0 always counts (it writes the group layout); a block with an empty range has no rows to place.
    if (range_begin < range_end || blockIdx.x == 0) {
        // 2. Count every entry, source by source, kLoadsInFlight loads per thread before their atomics; those
        //    of tokens before this block's range also into cursor.
        for (int src = 0; src < R; ++src) {
            const int32_t* idx = src_idx[src];
            const int64_t num_entries = int64_t(first_token[src + 1] - first_token[src]) * K;
            for (int64_t i0 = threadIdx.x; i0 < num_entries; i0 += kLoadsInFlight * blockDim.x) {
                int expert[kLoadsInFlight];
#pragma unroll
                for (int u = 0; u < kLoadsInFlight; ++u) {
                    const int64_t i = i0 + int64_t(u) * blockDim.x;
                    expert[u] = i < num_entries ? idx[i] : -1;  // -1: masked, skipped
                }
#pragma unroll
                for (int u = 0; u < kLoadsInFlight; ++u) {
                    const int64_t i = i0 + int64_t(u) * blockDim.x;
                    const int local = expert[u] - args.expert_begin;
                    if (local >= 0 && local < args.num_local_experts) {
                        atomicAdd(&counts[local], 1);
                        if (first_token[src] + i / K < range_begin) atomicAdd(&cursor[local], 1);
                    } else if ((expert[u] < -1 || expert[u] >= d.num_experts) && blockIdx.x == 0) {
                        flag_bad_id(d, args.chunk_idx, expert[u], src, i, args.status, args.bad_id);
                    }
                }
            }
        }
        __syncthreads();

        // 3. Warp 0: exclusive scan of the aligned group spans (each lane a contiguous run of experts).
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            const int per_lane = (args.num_local_experts + 31) / 32;
            const int first = lane * per_lane;
            const int last = min(first + per_lane, args.num_local_experts);
            auto span = [align = args.align](int count) { return (count + align - 1) / align * align; };
            int sum = 0;
            for (int e = first; e < last; ++e) sum += span(counts[e]);
            const int inclusive = warp_inclusive_sum(sum, lane);
            int running = inclusive - sum;
            for (int e = first; e < last; ++e) {
                if (blockIdx.x == 0) {
                    args.expert_counts[e] = counts[e];
                    args.begin[e] = running;
                    args.group_end[e] = running + counts[e];
                }
                cursor[e] += running;
                running += span(counts[e]);
                if (counts[e] > args.rows_per_expert) {
                    overflow = 1;
                    if (blockIdx.x == 0)
                        record_overflow(d, kOverflowExpertRows, d.rank, args.chunk_idx, args.rows_per_expert, counts[e],
                                        args.expert_begin + e);
                }
            }
            if (lane == 31 && inclusive > args.pool_rows) {
                overflow = 1;
                if (blockIdx.x == 0)
                    record_overflow(d, kOverflowWindowRows, d.rank, args.chunk_idx, args.pool_rows, inclusive);
            }
            if (blockIdx.x == 0 && lane == 31) args.total[0] = inclusive;
        }
        __syncthreads();
        CHAIN_STAMP(10);
        if (overflow) {  // every block saw the same counts: none places a row
            if (blockIdx.x == 0 && threadIdx.x == 0) publish_plan(args, kPlanAbandoned);
            return false;
        }
        // The plan: the expert of every live 64-row block's first row ahead of the pull (which writes the same id
        // there again), so an experts kernel beside the dispatch decodes its items and streams their weights while
        // the rows arrive. Block 0's range starts at token 0: its cursors are the groups' first rows.
        if (args.plan != nullptr && blockIdx.x == 0) {
            for (int e = threadIdx.x; e < args.num_local_experts; e += blockDim.x)
                for (int r = cursor[e]; r < cursor[e] + counts[e]; r += kPlanRows) args.m_indices[r] = e;
            __syncthreads();  // every thread's writes before thread 0's release
            if (threadIdx.x == 0) publish_plan(args, static_cast<int>(gridDim.x));
        }
    }

    // 4. This block's range, kPassEntries entries (whole tokens) per pass.
    const int tokens_per_pass = kPassEntries / K;  // K <= 32 (stages.MAX_TOPK)
    const int vecs_per_row = d.hidden / 16;         // 16 fp8 bytes per vector (hidden % 128 == 0: layer-checked)
    const int num_sf = d.num_sf;
    for (int pass_begin = range_begin; pass_begin < range_end; pass_begin += tokens_per_pass) {
        const int pass_tokens = min(tokens_per_pass, range_end - pass_begin);
        const int pass_entries = pass_tokens * K;
        // 4a. Every entry's local expert (-1: not local).
        for (int j = threadIdx.x; j < pass_entries; j += blockDim.x) {
            const int pos = pass_begin + j / K;
            const int src = source_of(pos);
            const int local = src_idx[src][int64_t(pos - first_token[src]) * K + j % K] - args.expert_begin;
            entry_local[j] = local >= 0 && local < args.num_local_experts ? local : -1;
        }
        __syncthreads();
        // 4b. Warp 0: rows in flat entry order. Lanes holding the same expert take consecutive rows in lane
        //     order; the highest of them moves the expert's cursor past them.
        if (threadIdx.x < 32) {
            for (int j0 = 0; j0 < pass_entries; j0 += 32) {
                const int j = j0 + static_cast<int>(threadIdx.x);
                const int local = j < pass_entries ? entry_local[j] : -1;
                const unsigned same = __match_any_sync(0xffffffffu, local);
                int row = -1;
                if (local >= 0) row = cursor[local] + __popc(same & lanes_below());
                __syncwarp();  // every lane read its expert's cursor before the highest lane moves it
                if (local >= 0 && (same >> threadIdx.x) == 1u) cursor[local] += __popc(same);
                if (row >= args.pool_rows) row = -1;  // within the checked total; the bound of every write below
                if (j < pass_entries) entry_row[j] = row;
                __syncwarp();
            }
        }
        __syncthreads();
        // 4c. Bookkeeping of every placed entry, as reserve_row.
        for (int j = threadIdx.x; j < pass_entries; j += blockDim.x) {
            const int row = entry_row[j];
            if (row < 0) continue;
            const int pos = pass_begin + j / K;
            const int src = source_of(pos);
            const int token = pos - first_token[src];
            args.row_src[row] = make_int4(src, token, j % K, args.chunk_idx);
            args.row_weight[row] = src_weights[src][int64_t(token) * K + j % K];
            args.m_indices[row] = entry_local[j];
        }
        // 4d. The rows: every 16-byte vector of a pass token into each of its rows, loads first.
        const int num_vecs = pass_tokens * vecs_per_row;
        for (int i0 = threadIdx.x; i0 < num_vecs; i0 += kLoadsInFlight * blockDim.x) {
            int4 raw[kLoadsInFlight];
#pragma unroll
            for (int u = 0; u < kLoadsInFlight; ++u) {
                const int i = i0 + u * blockDim.x;
                raw[u] = make_int4(0, 0, 0, 0);
                if (i < num_vecs) {
                    const int pos = pass_begin + i / vecs_per_row;
                    const int src = source_of(pos);
                    raw[u] = reinterpret_cast<const int4*>(src_x[src] + int64_t(pos - first_token[src]) * d.hidden)
                        [i % vecs_per_row];
                }
            }
#pragma unroll
            for (int u = 0; u < kLoadsInFlight; ++u) {
                const int i = i0 + u * blockDim.x;
                if (i >= num_vecs) break;
                const int t = i / vecs_per_row;
                for (int k = 0; k < K; ++k) {
                    const int row = entry_row[t * K + k];
                    if (row >= 0)
                        reinterpret_cast<int4*>(args.pool_x + int64_t(row) * d.hidden)[i % vecs_per_row] = raw[u];
                }
            }
        }
        // ... and every scale.
        for (int i = threadIdx.x; i < pass_tokens * num_sf; i += blockDim.x) {
            const int t = i / num_sf;
            const int j = i % num_sf;
            const int pos = pass_begin + t;
            const int src = source_of(pos);
            const float scale = src_sf[src][int64_t(pos - first_token[src]) * num_sf + j];
            for (int k = 0; k < K; ++k) {
                const int row = entry_row[t * K + k];
                if (row >= 0) args.pool_sf[int64_t(row) * args.sf_row_stride + int64_t(j) * args.sf_col_stride] = scale;
            }
        }
        __syncthreads();  // the next pass reuses entry_local / entry_row
    }
    CHAIN_STAMP(11);
    // EARLY: the pulls were this PE's last reads of every source's slot (the meta was read in step 1).
    if (args.ack_now && grid_last_block(args.counter)) {
        if (threadIdx.x == 0) CHAIN_STAMP_ANY(12);
        for (int owner = 0; owner < R; ++owner) ack(d, args.chunk_idx, owner);
        if (threadIdx.x == 0) CHAIN_STAMP_ANY(13);
    }
    return true;
}

// Launched with PDL (stages.Kernels.launch) after the fused producer, whose launch lets it start once every producer
// block runs (each passed its own wait: every kernel before the producer has completed). What it reads of the
// producer is the slot, behind the acquire of the ready words, so it does not wait for the producer's end first: its
// launch, prologue and poll overlap the producer. It waits at its end, so that its own end still follows the
// producer's (stream order for the kernels after it, which read what the producer wrote beside the slot). rdma
// sources: the stage kernel before it fills the staged copies, read with no word of their own: stream order first.
// With args.plan every block, whatever its path through the body, then releases its rows to the experts kernel
// beside it (DispatchFusedArgs::plan): that kernel starts before this one ends (PDL), reads the rows by TMA (the async
// proxy) once the count reaches the plan's grid.
template <int kLoadsInFlight>
__device__ __forceinline__ void dispatch_fused_kernel(const DispatchFusedArgs& args) {
    if (args.stage != nullptr) grid_dependency_wait();
    grid_dependents_launch();
    const bool placed = dispatch_fused<kLoadsInFlight>(args);
    if (args.plan != nullptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("fence.proxy.async.global;" ::: "memory");  // this thread's row stores before TMA reads of them
#endif
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();  // release at gpu scope: pairs with the experts kernel's acquire of the count
            atomicAdd(args.plan + 1, placed ? 1 : kPlanRowsLost);
        }
    }
    grid_dependency_wait();
}

}  // namespace

extern "C" __global__ void moe_dispatch_fused_fp8(const DispatchFusedArgs args) {
    dispatch_fused_kernel<kLoadsWide>(args);
}

// The same with one load in flight per thread: decode sizes (kLoadsSmall above).
extern "C" __global__ void moe_dispatch_fused_fp8_small(const DispatchFusedArgs args) {
    dispatch_fused_kernel<kLoadsSmall>(args);
}
