// MoE combine kernels (symmring.moe.stages, combine_*): send every expert output row back to the rank that
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
//                        owner's snapshot token_base (moe_dispatch_wait) + the chunk-local token.
//   moe_combine_signal   one block: release, then SET combine_ready[this rank] = the generation of the
//                        window's last chunk on every owner; with ack_now (the CONSERVATIVE policy)
//                        acknowledge the window's chunks too (this PE is now done with them).
//   moe_combine_wait     one thread: bounded wait until every rank's combine_ready word on this PE is >=
//                        that generation (acquire; PROTOCOL.md 7.1: a consumer may signal chunk c + 1
//                        before the owner saw chunk c, and generations only grow, so >= admits no stale
//                        value).
//   moe_combine_reduce   one warp per token of the window: y[t] = sum over k = 0..K-1 (in that order) of
//                        topk_weights[t][k] * row(t, k), float32 accumulation, bf16 result, the routing
//                        read from the owner's LOCAL buffers (never the slot, which EARLY may already have
//                        handed back); entries whose expert is outside [0, num_experts) (the mask -1)
//                        contribute nothing. With end_call_chunks > 0 (a single-stream schedule whose last
//                        kernel this is) block 0 then ends the call.
//
// The small-batch schedule fuses each pair into one grid:
//   moe_combine_send     moe_combine_scatter, then the last block to arrive signals (and with ack_now
//                        acknowledges) as moe_combine_signal.
//   moe_combine_finish   every block waits (as moe_combine_wait) before its share of moe_combine_reduce;
//                        with end_call_chunks > 0 the last block to arrive ends the call (after every block
//                        read the generation base).
//
// Reuse of the combine buffer: a rank writes into an owner's buffer for call n+1 only after it saw the
// owner's call-n+1 publication, which the owner enqueues after its call-n reduce (stream order).
#include <stdint.h>

#include <cuda_bf16.h>

#include <symmring/protocol.cuh>

using namespace symmring;

namespace {

// 16-byte vectors (8 channels) of a token's row one warp of the reduce handles: one per lane.
constexpr int kReduceSliceVecs = 32;

// Grid-stride, one warp per pool row of [0, num_rows): the body of moe_combine_scatter. A p2p owner gets
// the row by 16-byte stores through its mapping; an rdma owner (is_rdma_peer: peer_ptr is null) by one
// warp-wide non-blocking put (nvshmemx_putmem_nbi_warp), and every thread of a warp that issued one calls
// nvshmem_quiet before leaving: its puts are COMPLETE (delivered into the owner's memory) before this grid's
// arrival and the signal that follows it (signal_owners, after the kernel or grid_last_block). A fence
// would only order delivery of this thread's later operations to the same PE, and the signal is another
// thread's (and, in moe_combine_signal, another kernel's). The branch is per row (warp-uniform).
__device__ __forceinline__ void scatter_rows(const RingDescriptor& d, const __nv_bfloat16* pool_out,
                                             const int4* row_src, int num_rows, const long long* token_base,
                                             int window_begin, int* m_indices, __nv_bfloat16* combine_rows) {
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;  // 8 bf16 per 16-byte vector
    bool put_any = false;  // warp-uniform: this warp issued an rdma put
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / 32; row < num_rows;
         row += gridDim.x * warps_per_block) {
        if (m_indices != nullptr && m_indices[row] < 0) continue;  // padding (the whole warp skips it)
        const int4 src = row_src[row];
        const int64_t token = token_base[int64_t(src.w - window_begin) * d.num_ranks + src.x] + src.y;
        const int64_t offset = (token * d.num_topk + src.z) * d.hidden;
        const __nv_bfloat16* from_row = pool_out + int64_t(row) * d.hidden;
        __nv_bfloat16* owner_rows = peer_ptr(d, combine_rows, src.x);
        if (owner_rows != nullptr) {
            int4* dst = reinterpret_cast<int4*>(owner_rows + offset);
            const int4* from = reinterpret_cast<const int4*>(from_row);
            for (int v = lane; v < vecs_per_row; v += 32) dst[v] = from[v];
        } else {
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
// release (the rows this grid stored before; with several blocks, after their grid handshake).
__device__ __forceinline__ void signal_owners(const RingDescriptor& d, uint64_t* combine_ready, uint64_t gen) {
    __syncthreads();
    for (int owner = threadIdx.x; owner < d.num_ranks; owner += blockDim.x) {
        // release, in every signalling thread: pairs with the acquire in wait_sources on `owner`.
        nvshmem_fence();
        nvshmemx_signal_op(combine_ready + d.rank, gen, NVSHMEM_SIGNAL_SET, owner);
    }
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

// Grid-stride, one warp per (token t of [token_begin, token_begin + num_valid), slice of 256 channels): the
// body of moe_combine_reduce. A token's row is cut into slices so a small batch still spreads over the GPU
// (one warp streaming K rows of 7168 channels alone takes tens of microseconds); every element is the same
// k-ordered float32 sum whichever warp computes it.
__device__ __forceinline__ void reduce_tokens(const RingDescriptor& d, const __nv_bfloat16* combine_rows,
                                              const int32_t* topk_idx, const float* topk_weights, __nv_bfloat16* y,
                                              long long y_row_stride, int token_begin, int num_valid) {
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;
    const int slices = (vecs_per_row + kReduceSliceVecs - 1) / kReduceSliceVecs;
    const int K = d.num_topk;
    const int64_t items = int64_t(num_valid) * slices;
    for (int64_t item = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32; item < items;
         item += int64_t(gridDim.x) * warps_per_block) {
        const int64_t token = int64_t(token_begin) + item / slices;
        const int32_t* token_idx = topk_idx + token * K;
        const float* token_weights = topk_weights + token * K;
        const __nv_bfloat16* rows = combine_rows + token * K * d.hidden;
        {
            const int v = static_cast<int>(item % slices) * kReduceSliceVecs + lane;
            if (v >= vecs_per_row) continue;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int k = 0; k < K; ++k) {
                const int expert = token_idx[k];
                if (expert < 0 || expert >= d.num_experts) continue;  // masked: contributes nothing
                const float w = token_weights[k];
                const int4 raw = reinterpret_cast<const int4*>(rows + int64_t(k) * d.hidden)[v];
                const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float2 f = __bfloat1622float2(pairs[j]);
                    acc[2 * j] = fmaf(w, f.x, acc[2 * j]);
                    acc[2 * j + 1] = fmaf(w, f.y, acc[2 * j + 1]);
                }
            }
            int4 out;
            __nv_bfloat162* out_pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
            for (int j = 0; j < 4; ++j) out_pairs[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
            *reinterpret_cast<int4*>(y + token * y_row_stride + v * 8) = out;
        }
    }
}

}  // namespace

// Rows [total[0]] of pool_out ([rows][hidden] bf16) to the owners' combine rows at (logical token, k).
// row_src[row] = {src_rank, chunk-local token, k, chunk} (moe_dispatch_pull); token_base: [window][num_ranks],
// the snapshots of moe_dispatch_wait for the window that starts at chunk window_begin. m_indices (aligned
// pools, else null): rows holding -1 are padding and skipped; every other row's entry is put back to -1
// after its row is sent, so the next window's pool starts with no row marked.
extern "C" __global__ void moe_combine_scatter(const RingDescriptor* desc_ptr, const __nv_bfloat16* pool_out,
                                               const int4* row_src, const int* total, const long long* token_base,
                                               int window_begin, int* m_indices, __nv_bfloat16* combine_rows) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    scatter_rows(d, pool_out, row_src, total[0], token_base, window_begin, m_indices, combine_rows);
}

// One block, after moe_combine_scatter of the window [chunk_begin, chunk_end]: tell every owner that this
// PE's rows of those chunks are in place (one signal, the last chunk's generation: the release covers
// every row, and owners wait with >=); with ack_now (CONSERVATIVE) acknowledge every chunk of the window.
extern "C" __global__ void moe_combine_signal(const RingDescriptor* desc_ptr, int chunk_begin, int chunk_end,
                                              uint64_t* combine_ready, int ack_now) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    signal_owners(d, combine_ready, expected_generation(d, chunk_end));  // the rows: an earlier kernel
    if (!ack_now) return;
    // CONSERVATIVE: after this PE's combine of the window; ack() fences (release: pairs with wait_reusable).
    for (int chunk = chunk_begin; chunk <= chunk_end; ++chunk)
        for (int owner = 0; owner < d.num_ranks; ++owner) ack(d, chunk, owner);
}

// One thread: bounded wait until every source rank's combine_ready word on this PE is >= the chunk's
// generation (acquire), so moe_combine_reduce (the next kernel) reads the rows they stored. On timeout the
// error record (kind combine, peer = the late source) is written.
extern "C" __global__ void moe_combine_wait(const RingDescriptor* desc_ptr, int chunk_idx,
                                            const uint64_t* combine_ready) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d) || threadIdx.x != 0) return;
    wait_sources(d, chunk_idx, combine_ready, expected_generation(d, chunk_idx));
}

// One warp per token t in [token_begin, token_begin + num_valid): y[t] = bf16(sum_k w[t][k] * rows[t][k]) in
// k order, float32, masked entries skipped. topk_idx / topk_weights: the owner's local [n][K] routing of the
// whole call; combine_rows: [max_tokens][K][hidden] by logical token; y: row stride y_row_stride elements.
// end_call_chunks > 0: this is the call's last kernel that reads the generation base (single-stream
// schedules): block 0 advances it by that many chunks (no other block reads it).
extern "C" __global__ void moe_combine_reduce(const RingDescriptor* desc_ptr, const __nv_bfloat16* combine_rows,
                                              const int32_t* topk_idx, const float* topk_weights, __nv_bfloat16* y,
                                              long long y_row_stride, int token_begin, int num_valid,
                                              int end_call_chunks) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    if (end_call_chunks > 0 && blockIdx.x == 0 && threadIdx.x == 0) end_call(d, end_call_chunks);
    reduce_tokens(d, combine_rows, topk_idx, topk_weights, y, y_row_stride, token_begin, num_valid);
}

// The small-batch schedule, after the experts: moe_combine_scatter + moe_combine_signal of the window
// [chunk_begin, chunk_end] in one grid. Each block stores its rows, then releases them at system scope
// before its arrival (the owners are other GPUs); the last block to arrive signals every owner and, with
// ack_now (CONSERVATIVE), acknowledges the window's chunks. counter: a zeroed device word (reset by the
// last block).
extern "C" __global__ void moe_combine_send(const RingDescriptor* desc_ptr, const __nv_bfloat16* pool_out,
                                            const int4* row_src, const int* total, const long long* token_base,
                                            int window_begin, int* m_indices, __nv_bfloat16* combine_rows,
                                            int chunk_begin, int chunk_end, uint64_t* combine_ready, int ack_now,
                                            unsigned int* counter) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    scatter_rows(d, pool_out, row_src, total[0], token_base, window_begin, m_indices, combine_rows);
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();  // this block's peer stores before its arrival
    if (!grid_last_block(counter)) return;
    signal_owners(d, combine_ready, expected_generation(d, chunk_end));
    if (!ack_now) return;
    for (int chunk = chunk_begin; chunk <= chunk_end; ++chunk)
        for (int owner = 0; owner < d.num_ranks; ++owner) ack(d, chunk, owner);
}

// The small-batch schedule's last kernel: moe_combine_wait + moe_combine_reduce of the window ending at
// chunk_idx. Thread 0 of every block waits for every source (acquire), then the block reduces its tokens.
// With end_call_chunks > 0 the last block to arrive ends the call: every block has read the generation base
// by then. counter: a zeroed device word (used only with end_call_chunks > 0).
extern "C" __global__ void moe_combine_finish(const RingDescriptor* desc_ptr, int chunk_idx,
                                              const uint64_t* combine_ready, const __nv_bfloat16* combine_rows,
                                              const int32_t* topk_idx, const float* topk_weights, __nv_bfloat16* y,
                                              long long y_row_stride, int token_begin, int num_valid,
                                              int end_call_chunks, unsigned int* counter) {
    __shared__ int ok;
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    if (threadIdx.x == 0) ok = wait_sources(d, chunk_idx, combine_ready, expected_generation(d, chunk_idx));
    __syncthreads();  // the other threads read the rows only after thread 0's acquire
    if (!ok) return;
    reduce_tokens(d, combine_rows, topk_idx, topk_weights, y, y_row_stride, token_begin, num_valid);
    if (end_call_chunks > 0 && grid_last_block(counter) && threadIdx.x == 0) end_call(d, end_call_chunks);
}
