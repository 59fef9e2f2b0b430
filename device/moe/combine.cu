// MoE combine kernels (symmring.moe.gpu.stages, combine_*): send every expert output row back to the rank that
// owns its token, then reduce each token's top-k rows in a fixed order.
//
// Combine buffer: a symmetric allocation holding, on every PE, a signal word per source rank,
// combine_ready[num_ranks] (uint64), and rows [max_tokens][num_topk][hidden] bf16: the (token, k) place of
// every entry of the owner's tokens over the WHOLE call, by logical token row, so the chunks of one call
// never share rows.
//
// Launch order on one stream, per expert window [c0, c1] (one chunk for the batch path):
//   moe_combine_scatter  one warp per pool row: store the row into its owner's combine buffer at
//                        (logical token, k) over NVLink (16-byte stores); the logical token is the
//                        owner's snapshot token_base (moe_dispatch_wait) + the chunk-local token. With
//                        rows_sent the engine's epilogue stored them there itself (the fused engine:
//                        FusedExpertsArgs::send_peers), and this pass only checks each row's token and
//                        frees the row.
//   moe_combine_signal   one block: release, then SET combine_ready[this rank] = the generation of the
//                        window's last chunk on every owner; with ack_now (the CONSERVATIVE policy)
//                        acknowledge the window's chunks too (this PE is now done with them).
//   moe_combine_wait     one thread: bounded wait until every rank's combine_ready word on this PE is >=
//                        that generation (acquire; PROTOCOL.md 7.1: a consumer may signal chunk c + 1
//                        before the owner saw chunk c, and generations only grow, so >= admits no stale
//                        value).
//   moe_combine_reduce   one warp per (token of the window, 256 channels): y[t] = sum over k = 0..K-1 (in that order) of
//                        topk_weights[t][k] * row(t, k), float32 accumulation, bf16 result, the routing
//                        read from the owner's LOCAL buffers (never the slot, which EARLY may already have
//                        handed back); entries whose expert is outside [0, num_experts) (the mask -1)
//                        contribute nothing. With end_call_chunks > 0 (a single-stream schedule whose last
//                        kernel this is) block 0 then ends the call.
//
// The small-batch schedule runs all four in ONE grid after the experts:
//   moe_combine_fused    scatter of the live rows (from the group counts: no padding row is visited) in items
//                        that blocks take from a ticket counter (rows_sent: the fused engine stored them; only
//                        their tokens are checked and the rows freed); the block whose item completes the scatter
//                        signals (and with ack_now acknowledges) as moe_combine_signal, then every block waits
//                        as moe_combine_wait and reduces its share of the tokens as moe_combine_reduce (the
//                        same reduce_tokens, so the same bits); with end_call_chunks > 0 the grid's last draw
//                        ends the call. A block waits only once every scatter item is taken by a running
//                        block, so the grid needs no residency (see the kernel).
//
// Reuse of the combine buffer: a rank writes into an owner's buffer for call n+1 only after it saw the
// owner's call-n+1 publication, which the owner enqueues after its call-n reduce (stream order).
//
// Bounds (device/moe/bounds.cuh): a row's logical token (the owner's snapshot token_base + the chunk-local
// token, both from the owner's slot) must lie in [0, combine_tokens), the rows every PE's combine buffer holds
// (the workspace's max_tokens); the fused combine's rows, found from the dispatch's counts, lie below
// pool_rows. A row past either is not sent: pool_overflow is recorded (it aborts the ring).
#include <stdint.h>

#include <cuda_bf16.h>

#include <moe/args.cuh>
#include <moe/bounds.cuh>
#include <moe/call_tokens.cuh>
#include <moe/warp.cuh>
#include <symmring/protocol.cuh>

using namespace symmring;
using symmring_moe::CombineFusedArgs;
using symmring_moe::CombineReduceArgs;
using symmring_moe::CombineScatterArgs;
using symmring_moe::CombineSignalArgs;
using symmring_moe::CombineWaitArgs;
using symmring_moe::kOverflowCombineToken;
using symmring_moe::kOverflowWindowRows;
using symmring_moe::record_overflow;
using symmring_moe::warp_inclusive_sum;

namespace {

// 16-byte vectors (8 channels) of a token's row one warp of the reduce handles: one per lane.
constexpr int kReduceSliceVecs = 32;
// Rows of a token the reduce loads before their fmas.
constexpr int kReduceRowsInFlight = 8;
// 16-byte vectors each thread of the small-batch scatter loads before their stores.
constexpr int kScatterLoadsInFlight = 4;

// Grid-stride, one warp per pool row of [0, num_rows): the body of moe_combine_scatter. A p2p owner gets
// the row by 16-byte stores through its mapping; an rdma owner (is_rdma_peer: peer_ptr is null) by one
// warp-wide non-blocking put (nvshmemx_putmem_nbi_warp), and every thread of a warp that issued one calls
// nvshmem_quiet before leaving: its puts are COMPLETE (delivered into the owner's memory) before this grid's
// end and the signal that follows it (signal_owners: moe_combine_signal; moe_combine_fused quiets the same way
// before each scatter item's arrival). A fence would only order delivery of this thread's later operations to
// the same PE, and the signal is another thread's (and, in moe_combine_signal, another kernel's). The branch is
// per row (warp-uniform). A row whose logical token lies outside [0, combine_tokens) is not sent
// (pool_overflow, bounds.cuh).
// With `rows_sent` (the engine sent every row itself: fused_common.cuh out_row) the pass only checks each row's
// token and marks the row free again.
__device__ __forceinline__ void scatter_rows(const RingDescriptor& d, const __nv_bfloat16* pool_out,
                                             const int4* row_src, int num_rows, const long long* token_base,
                                             int window_begin, int* m_indices, __nv_bfloat16* combine_rows,
                                             int combine_tokens, bool rows_sent) {
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;  // 8 bf16 per 16-byte vector
    bool put_any = false;  // warp-uniform: this warp issued an rdma put
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / 32; row < num_rows;
         row += gridDim.x * warps_per_block) {
        if (m_indices != nullptr && m_indices[row] < 0) continue;  // padding (the whole warp skips it)
        const int4 src = row_src[row];
        const int64_t token = token_base[int64_t(src.w - window_begin) * d.num_ranks + src.x] + src.y;
        if (token < 0 || token >= combine_tokens) {  // warp-uniform
            if (lane == 0) record_overflow(d, kOverflowCombineToken, src.x, src.w, combine_tokens, token);
            continue;
        }
        const int64_t offset = (token * d.num_topk + src.z) * d.hidden;
        const __nv_bfloat16* from_row = pool_out + int64_t(row) * d.hidden;
        __nv_bfloat16* owner_rows = rows_sent ? nullptr : peer_ptr(d, combine_rows, src.x);
        if (owner_rows != nullptr) {
            int4* dst = reinterpret_cast<int4*>(owner_rows + offset);
            const int4* from = reinterpret_cast<const int4*>(from_row);
            for (int v = lane; v < vecs_per_row; v += 32) dst[v] = from[v];
        } else if (!rows_sent) {
            nvshmemx_putmem_nbi_warp(combine_rows + offset, from_row, size_t(d.hidden) * sizeof(__nv_bfloat16), src.x);
            put_any = true;
        }
        if (m_indices != nullptr) {
            __syncwarp();  // every lane read m_indices[row] above before lane 0 clears it
            if (lane == 0) m_indices[row] = -1;
        }
    }
    if (put_any) nvshmem_quiet();  // this thread's puts delivered before the grid's arrival (see above)
}

// Block-level, one block: SET combine_ready[this rank] = gen on every owner, each signalling thread after a
// release (the rows this grid stored before; in moe_combine_fused, after the acquire of every item's arrival).
__device__ __forceinline__ void signal_owners(const RingDescriptor& d, uint64_t* combine_ready, uint64_t gen) {
    __syncthreads();
    for (int owner = threadIdx.x; owner < d.num_ranks; owner += blockDim.x) {
        // release, in every signalling thread: pairs with the acquire in wait_sources on `owner`.
        nvshmem_fence();
        nvshmemx_signal_op(combine_ready + d.rank, gen, NVSHMEM_SIGNAL_SET, owner);
    }
}

// moe_combine_fused's work distribution: tickets instead of blockIdx, so no block waits for another that may not
// be resident (see the kernel). counters[0] counts the finished scatter items, counters[1] the tickets drawn.

// One thread, with `t` the value its draw (atomicAdd(tickets, 1)) returned: the ticket. Every block draws until
// it holds a ticket >= gridDim.x (the scatter items), so a launch makes exactly 2 * gridDim.x draws; the last one
// resets the word for the next launch or graph replay (stream order; nothing of this launch draws again) and,
// with end_call_chunks > 0, ends the call: every block read the generation base before its first draw (a fence
// in between), and this draw came after every other draw (one atomic word).
__device__ inline int ticket_drawn(const RingDescriptor& d, unsigned int* tickets, unsigned int t,
                                   int end_call_chunks) {
    if (t == 2u * gridDim.x - 1u) {
        __threadfence();  // acquire: after every block's draws (and its read of the generation base before them)
        atomicExch(tickets, 0u);
        if (end_call_chunks > 0) end_call(d, end_call_chunks);
    }
    return static_cast<int>(t);
}

// One thread, with `before` the value its item's arrival (atomicAdd(arrivals, 1), after a release at system
// scope) returned: whether that arrival completed all `num_items` scatter items. True in exactly one block,
// after an acquire (every item's stores are then ordered before what it does next: the signal); that block
// resets the word (no other arrival of this launch follows).
__device__ inline bool item_arrived(unsigned int* arrivals, unsigned int before, unsigned int num_items) {
    if (before != num_items - 1u) return false;
    __threadfence();  // acquire: every item's stores before the signal
    atomicExch(arrivals, 0u);
    return true;
}

// One thread: bounded wait (one deadline) until every source's combine_ready word on this PE is >= gen
// (acquire). False on timeout (error record: kind combine, peer = the first late source).
__device__ inline bool wait_sources(const RingDescriptor& d, int chunk_idx, const uint64_t* combine_ready,
                                    uint64_t gen) {
    Deadline deadline(d);
    for (int src = 0; src < d.num_ranks; ++src) {
        uint64_t observed;
        // acquire: pairs with the release fence of signal_owners on rank `src`.
        while ((observed = ld_acquire_sys(combine_ready + src)) < gen) {
            if (deadline.expired(d)) {
                deadline.give_up(d, kErrorCombine, src, slot_of(chunk_idx, d.num_slots), chunk_idx, gen, observed, 0);
                return false;
            }
        }
    }
    return true;
}

// One warp: the 16-byte vector v (8 channels, one per lane; `active` false past the row: those lanes only
// join the shuffles) of the reduced row of one token, y_row[v] = bf16(sum over k = 0..K-1, in that order, of
// w[k] * rows[k][v]) in float32, masked entries (expert outside [0, num_experts)) skipped. Lane k holds entry
// k's expert and weight (K <= 32) and the rows are loaded kReduceRowsInFlight at a time before their fmas,
// so a token costs a few memory latencies instead of K; the sum's order is the same whatever the batching.
__device__ __forceinline__ void reduce_vector(const RingDescriptor& d, const __nv_bfloat16* rows,
                                              const int32_t* token_idx, const float* token_weights, int v,
                                              bool active, __nv_bfloat16* y_row, int lane) {
    const int K = d.num_topk;
    const int lane_expert = lane < K ? token_idx[lane] : -1;
    const float lane_weight = lane < K ? token_weights[lane] : 0.0f;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k0 = 0; k0 < K; k0 += kReduceRowsInFlight) {
        int4 raw[kReduceRowsInFlight];
        float w[kReduceRowsInFlight];
        bool use[kReduceRowsInFlight];
#pragma unroll
        for (int u = 0; u < kReduceRowsInFlight; ++u) {
            const int k = k0 + u;
            const int expert = __shfl_sync(0xffffffffu, lane_expert, k % 32);
            w[u] = __shfl_sync(0xffffffffu, lane_weight, k % 32);
            use[u] = active && k < K && expert >= 0 && expert < d.num_experts;  // masked: contributes nothing
            raw[u] = use[u] ? reinterpret_cast<const int4*>(rows + int64_t(k) * d.hidden)[v] : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kReduceRowsInFlight; ++u) {
            if (!use[u]) continue;
            const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 f = __bfloat1622float2(pairs[j]);
                acc[2 * j] = fmaf(w[u], f.x, acc[2 * j]);
                acc[2 * j + 1] = fmaf(w[u], f.y, acc[2 * j + 1]);
            }
        }
    }
    if (!active) return;
    int4 out;
    __nv_bfloat162* out_pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) out_pairs[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    reinterpret_cast<int4*>(y_row)[v] = out;
}

// Grid-stride, one warp per (token t of [token_begin, token_begin + num_valid), slice of 256 channels): the
// body of moe_combine_reduce and of moe_combine_fused's reduce. A token's row is cut into slices so a small
// batch still spreads over the GPU (one warp streaming K rows of 7168 channels alone takes tens of
// microseconds); every element is the same k-ordered float32 sum whichever warp computes it.
__device__ __forceinline__ void reduce_tokens(const RingDescriptor& d, const __nv_bfloat16* combine_rows,
                                              const int32_t* topk_idx, const float* topk_weights, __nv_bfloat16* y,
                                              long long y_row_stride, int token_begin, int num_valid) {
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;
    const int slices = (vecs_per_row + kReduceSliceVecs - 1) / kReduceSliceVecs;
    const int K = d.num_topk;
    const int64_t items = int64_t(num_valid) * slices;
    // Warp-uniform bounds (reduce_vector shuffles).
    for (int64_t item = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32; item < items;
         item += int64_t(gridDim.x) * warps_per_block) {
        const int64_t token = int64_t(token_begin) + item / slices;
        const int v = static_cast<int>(item % slices) * kReduceSliceVecs + lane;
        reduce_vector(d, combine_rows + token * K * d.hidden, topk_idx + token * K, topk_weights + token * K, v,
                      v < vecs_per_row, y + token * y_row_stride, lane);
    }
}

}  // namespace

// This pass's rows of pool_out ([rows][hidden] bf16: window rows [pass_begin, pass_begin + pass_rows), the
// first min(total[0] - pass_begin, pass_rows) of them live) to the owners' combine rows at (logical token, k).
// row_src[row] = {src_rank, chunk-local token, k, chunk} (moe_dispatch_pull); token_base: [window][num_ranks],
// the snapshots of moe_dispatch_wait for the window that starts at chunk window_begin. m_indices (aligned
// pools, else null): rows holding -1 are padding and skipped; every other row's entry is put back to -1
// after its row is sent, so the next window's pool starts with no row marked.
extern "C" __global__ void moe_combine_scatter(const CombineScatterArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    const int live = args.total[0] - args.pass_begin;
    scatter_rows(d, args.pool_out, args.row_src, live < 0 ? 0 : (live > args.pass_rows ? args.pass_rows : live),
                 args.token_base, args.window_begin, args.m_indices, args.combine_rows, args.combine_tokens,
                 args.rows_sent != 0);
}

// One block, after moe_combine_scatter of the window [chunk_begin, chunk_end]: tell every owner that this
// PE's rows of those chunks are in place (one signal, the last chunk's generation: the release covers
// every row, and owners wait with >=); with ack_now (CONSERVATIVE) acknowledge every chunk of the window.
extern "C" __global__ void moe_combine_signal(const CombineSignalArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    signal_owners(d, args.combine_ready, expected_generation(d, args.chunk_end));  // the rows: an earlier kernel
    if (!args.ack_now) return;
    // CONSERVATIVE: after this PE's combine of the window; ack() fences (release: pairs with wait_reusable).
    for (int chunk = args.chunk_begin; chunk <= args.chunk_end; ++chunk)
        for (int owner = 0; owner < d.num_ranks; ++owner) ack(d, chunk, owner);
}

// One thread: bounded wait until every source rank's combine_ready word on this PE is >= the chunk's
// generation (acquire), so moe_combine_reduce (the next kernel) reads the rows they stored. On timeout the
// error record (kind combine, peer = the late source) is written.
extern "C" __global__ void moe_combine_wait(const CombineWaitArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d) || threadIdx.x != 0) return;
    wait_sources(d, args.chunk_idx, args.combine_ready, expected_generation(d, args.chunk_idx));
}

// One warp per token t in [token_begin, token_begin + num_valid): y[t] = bf16(sum_k w[t][k] * rows[t][k]) in
// k order, float32, masked entries skipped. topk_idx / topk_weights: the owner's local [n][K] routing of the
// whole call; combine_rows: [max_tokens][K][hidden] by logical token; y: row stride y_row_stride elements.
// end_call_chunks > 0: this is the call's last kernel that reads the generation base (single-stream
// schedules): block 0 advances it by that many chunks (no other block reads it).
extern "C" __global__ void moe_combine_reduce(const CombineReduceArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    const int num_valid = symmring_moe::call_valid_tokens(args.call_tokens, args.token_begin, args.num_valid);
    if (args.end_call_chunks > 0 && blockIdx.x == 0 && threadIdx.x == 0) end_call(d, args.end_call_chunks);
    reduce_tokens(d, args.combine_rows, args.topk_idx, args.topk_weights, args.y, args.y_row_stride, args.token_begin,
                  num_valid);
}

// The small-batch schedule after the experts, in ONE grid: moe_combine_scatter + moe_combine_signal +
// moe_combine_wait + moe_combine_reduce of the one-chunk window `chunk_idx`. It needs NO grid-wide residency:
// whatever number of its blocks is resident (down to one, beside another stream's kernels, NCCL or another
// MPS client holding the other SMs), it completes.
//   1. Scatter, in gridDim.x items taken from a ticket counter (counters[1]), never by blockIdx: a block draws
//      tickets until it holds one >= gridDim.x. Item t is what block t of a grid-stride loop over gridDim.x
//      blocks sends, of this PE's live pool rows (expert e's rows [begin[e], begin[e] + counts[e]), from the fused
//      dispatch; padding rows are never touched) to their owners' combine rows, over 16-byte vectors with
//      kScatterLoadsInFlight loads per thread before their stores (rdma owners: warp-wide puts, then
//      nvshmem_quiet); m_indices of each row set back to -1. The block then releases the item's stores at
//      system scope and counts it (counters[0]).
//   2. The block whose arrival completes the gridDim.x items signals every owner (as moe_combine_signal) and,
//      with ack_now (CONSERVATIVE), acknowledges the chunk.
//   3. Thread 0 of every block waits for every source's signal (as moe_combine_wait: bounded, acquire), then
//      the block reduces its share of this PE's tokens by blockIdx (reduce_tokens, as moe_combine_reduce).
//   4. With end_call_chunks > 0 the grid's last draw ends the call: every block read the generation base
//      before its first draw.
// Forward progress: a block waits (step 3) only after it drew a ticket >= gridDim.x, i.e. once every scatter
// ticket was drawn -- by blocks that were running then and finish their items with no wait of their own -- so
// this PE's own signal always comes, however many blocks are resident; the blocks that could not be resident
// run later and find it set. Only the peers' signals can hold step 3, bounded by the ring's timeout. The grid is
// at most stages.Kernels.spin_blocks all the same: the PEs sharing a GPU under MPS leave the kernels they wait
// for free SMs (docs/PROTOCOL.md 9.2).
// token_base: the chunk's row of the dispatch's [window][num_ranks] snapshot. pool_rows: the window's rows (the
// dispatch's bound); combine_tokens: the tokens of every combine buffer (bounds.cuh). Dynamic shared memory:
// num_ranks pointers and int64 bases, then (2 * num_local_experts + 1) ints. counters: two zeroed device words,
// the items' arrivals then the tickets, each reset by the launch's last arrival or last draw (a block that
// returns at entry on a pending error leaves them set: MoE.reset() zeroes them, the one recovery path).
extern "C" __global__ void moe_combine_fused(const CombineFusedArgs args) {
    grid_dependency_wait();  // launched with PDL (stages.Kernels.launch): stream order from here
    CHAIN_STAMP(16);
    grid_dependents_launch();
    const RingDescriptor& d = *args.desc;
    // After the wait:
    const int num_valid = symmring_moe::call_valid_tokens(args.call_tokens, args.token_begin, args.num_valid);
    const int R = d.num_ranks;
    const int E = args.num_local_experts;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    __nv_bfloat16** owner_rows = reinterpret_cast<__nv_bfloat16**>(shared_bytes);  // [num_ranks] peer pointers
    long long* owner_base = reinterpret_cast<long long*>(owner_rows + R);         // [num_ranks] token bases
    int* live_before = reinterpret_cast<int*>(owner_base + R);  // [E + 1]: live rows of the experts before e
    int* group_begin = live_before + E + 1;                      // [E]
    __shared__ int ok;
    __shared__ int any_rdma;     // some owner is an rdma peer (peer_ptr null): its rows go by puts
    __shared__ int ticket;       // this block's current ticket (step 1)
    __shared__ int signals;      // this block's arrival completed the scatter: it signals (step 2)
    __shared__ uint64_t gen;     // the chunk's generation, read once per block before its first draw
    if (error_pending(d)) return;
    if (threadIdx.x == 0) any_rdma = signals = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        owner_rows[r] = peer_ptr(d, args.combine_rows, r);
        owner_base[r] = args.token_base[r];
        if (owner_rows[r] == nullptr) any_rdma = 1;
    }
    // Warp 0: exclusive scan of the live rows per expert (each lane a contiguous run of experts).
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int per_lane = (E + 31) / 32;
        const int first = lane * per_lane;
        const int last = min(first + per_lane, E);
        int sum = 0;
        for (int e = first; e < last; ++e) sum += args.expert_counts[e];
        const int inclusive = warp_inclusive_sum(sum, lane);
        int running = inclusive - sum;
        for (int e = first; e < last; ++e) {
            live_before[e] = running;
            group_begin[e] = args.begin[e];
            running += args.expert_counts[e];
        }
        if (lane == 31) live_before[E] = inclusive;
    }
    // Warp 1 (while warp 0 scans): the generation, then the block's first ticket.
    if (threadIdx.x == (blockDim.x > 32 ? 32 : 0)) {
        gen = expected_generation(d, args.chunk_idx);
        __threadfence();  // the generation base read before the draw (the grid's last draw may end the call)
        ticket = ticket_drawn(d, args.counters + 1, atomicAdd(args.counters + 1, 1u), args.end_call_chunks);
    }
    __syncthreads();
    CHAIN_STAMP(17);

    // 1. Scatter items. Live row i is row begin[e] + i - live_before[e] of the expert e with live_before[e] <= i
    //    < live_before[e + 1] (a binary search; empty experts have equal bounds and are never found).
    const int num_items = gridDim.x;
    const int vecs_per_row = d.hidden / 8;  // 8 bf16 per 16-byte vector
    const int64_t num_vecs = int64_t(live_before[E]) * vecs_per_row;
    const int64_t num_threads = int64_t(num_items) * blockDim.x;
    auto row_of_live = [&](int i) {  // -1 (and pool_overflow) past the pool: the dispatch checked it already
        int lo = 0, hi = E - 1;  // the last e with live_before[e] <= i
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (live_before[mid] <= i) lo = mid; else hi = mid - 1;
        }
        const int row = group_begin[lo] + i - live_before[lo];
        if (row >= 0 && row < args.pool_rows) return row;
        record_overflow(d, kOverflowWindowRows, d.rank, args.chunk_idx, args.pool_rows, row);
        return -1;
    };
    auto token_ok = [&](int64_t token, const int4& src) {  // the owner's combine rows hold it
        if (token >= 0 && token < args.combine_tokens) return true;
        record_overflow(d, kOverflowCombineToken, src.x, args.chunk_idx, args.combine_tokens, token);
        return false;
    };
    for (int item = ticket; item < num_items; item = ticket) {
        // rows_sent: the engine's L2 epilogue stored the rows (fused_common.cuh out_row); each live row's token is
        // checked (a row past its owner's combine rows was not stored) and the row freed, as scatter_rows does.
        for (int i = item * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
             args.rows_sent && i < live_before[E]; i += static_cast<int>(num_threads)) {
            const int row = row_of_live(i);
            if (row < 0) continue;
            const int4 src = args.row_src[row];
            token_ok(owner_base[src.x] + src.y, src);
            args.m_indices[row] = -1;
        }
        for (int64_t i0 = int64_t(item) * blockDim.x + threadIdx.x; !args.rows_sent && i0 < num_vecs;
             i0 += kScatterLoadsInFlight * num_threads) {
            int4 raw[kScatterLoadsInFlight];
            int4 src[kScatterLoadsInFlight];
            int row[kScatterLoadsInFlight];
#pragma unroll
            for (int u = 0; u < kScatterLoadsInFlight; ++u) {
                const int64_t i = i0 + u * num_threads;
                row[u] = i < num_vecs ? row_of_live(static_cast<int>(i / vecs_per_row)) : -1;
                if (row[u] < 0) continue;
                raw[u] = reinterpret_cast<const int4*>(args.pool_out + int64_t(row[u]) * d.hidden)[i % vecs_per_row];
                src[u] = args.row_src[row[u]];  // {owner, chunk-local token, k, chunk}
            }
#pragma unroll
            for (int u = 0; u < kScatterLoadsInFlight; ++u) {
                if (row[u] < 0) continue;
                const int64_t v = (i0 + u * num_threads) % vecs_per_row;
                const int64_t token = owner_base[src[u].x] + src[u].y;
                __nv_bfloat16* owner = owner_rows[src[u].x];
                if (owner != nullptr && token_ok(token, src[u]))
                    reinterpret_cast<int4*>(owner + (token * d.num_topk + src[u].z) * d.hidden)[v] = raw[u];
                if (v == 0) args.m_indices[row[u]] = -1;  // the engine read it in an earlier kernel
            }
        }
        // Rows of rdma owners: one warp-wide non-blocking put per row, and nvshmem_quiet by every thread that
        // put before the item's arrival (as scatter_rows: the puts are delivered before the signal).
        if (any_rdma && !args.rows_sent) {  // (rows_sent: every owner is mapped, the layer's rule; kept explicit)
            const int warp = threadIdx.x / 32;
            const int warps_per_block = blockDim.x / 32;
            bool put_any = false;
            for (int i = item * warps_per_block + warp; i < live_before[E]; i += num_items * warps_per_block) {
                const int row = row_of_live(i);  // warp-uniform
                if (row < 0) continue;
                const int4 src = args.row_src[row];
                if (owner_rows[src.x] != nullptr) continue;
                const int64_t token = owner_base[src.x] + src.y;
                if (!token_ok(token, src)) continue;
                nvshmemx_putmem_nbi_warp(args.combine_rows + (token * d.num_topk + src.z) * d.hidden,
                                         args.pool_out + int64_t(row) * d.hidden,
                                         size_t(d.hidden) * sizeof(__nv_bfloat16), src.x);
                put_any = true;
            }
            if (put_any) nvshmem_quiet();
        }
        __syncthreads();  // every thread's stores (and quiets) of the item before thread 0's release
        if (threadIdx.x == 0) {
            __threadfence_system();  // release: the item's peer stores before its arrival (the owners read them)
            // The arrival and the next draw, both in flight at once (neither needs the other's value).
            const unsigned int before = atomicAdd(args.counters, 1u);
            const unsigned int drawn = atomicAdd(args.counters + 1, 1u);
            if (item_arrived(args.counters, before, num_items)) signals = 1;
            ticket = ticket_drawn(d, args.counters + 1, drawn, args.end_call_chunks);
        }
        __syncthreads();
    }

    // 2. The block that completed the scatter signals (release in signal_owners, after its acquire of every
    //    item's arrival). Its draw above was past the items: the scatter is over.
    CHAIN_STAMP(18);
    if (signals) {
        if (threadIdx.x == 0) CHAIN_STAMP_ANY(19);
        signal_owners(d, args.combine_ready, gen);
        // CONSERVATIVE: after this PE's combine of the chunk; ack() fences (release: pairs with wait_reusable).
        if (args.ack_now)
            for (int owner = 0; owner < R; ++owner) ack(d, args.chunk_idx, owner);
    }

    // 3. Every source's rows, then this block's share of the reduce.
    if (threadIdx.x == 0 && signals) CHAIN_STAMP_ANY(20);
    if (threadIdx.x == 0) ok = wait_sources(d, args.chunk_idx, args.combine_ready, gen);
    __syncthreads();  // the other threads read the rows only after thread 0's acquire
    CHAIN_STAMP(21);
    if (!ok) return;
    reduce_tokens(d, args.combine_rows, args.topk_idx, args.topk_weights, args.y, args.y_row_stride, args.token_begin,
                  num_valid);
    CHAIN_STAMP(22);
}
