// The MoE combine steps shared by the batch layer (device/combine.cu) and the streamed layer
// (device/stream.cu): scatter expert output rows to their owners, signal the owners, wait for every
// source's signal, and reduce each token's top-k rows in a fixed order. The kernels differ only in how
// they name a row's owner row, which generations they signal and accept, and where the routing lives.
#pragma once

#include <stdint.h>

#include <cuda_bf16.h>

#include <symmring/protocol.cuh>

namespace symmring {

// Warp per pool row: rows [num_rows] of pool_out ([rows][hidden] bf16) to the owner's combine rows
// ([tokens][num_topk][hidden] bf16, symmetric) at (owner_token(src), k), with 16-byte stores over NVLink.
// row_src[row] = {src_rank, chunk-local token, k, chunk} (moe_dispatch_pull); owner_token maps it to the
// owner's token row.
template <class OwnerToken>
__device__ inline void scatter_rows(const RingDescriptor& d, const __nv_bfloat16* pool_out, const int4* row_src,
                                    int num_rows, __nv_bfloat16* combine_rows, OwnerToken owner_token) {
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;  // 8 bf16 per 16-byte vector
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / 32; row < num_rows;
         row += gridDim.x * warps_per_block) {
        const int4 src = row_src[row];
        __nv_bfloat16* owner_rows = peer_ptr(d, combine_rows, src.x);
        int4* dst = reinterpret_cast<int4*>(owner_rows + (owner_token(src) * d.num_topk + src.z) * d.hidden);
        const int4* from = reinterpret_cast<const int4*>(pool_out + int64_t(row) * d.hidden);
        for (int v = lane; v < vecs_per_row; v += 32) dst[v] = from[v];
    }
}

// Block-level, after this PE's scatter: release its rows, then SET combine_ready[this rank] = gen on
// every owner.
__device__ inline void signal_owners(const RingDescriptor& d, uint64_t* combine_ready, uint64_t gen) {
    if (threadIdx.x == 0) nvshmem_fence();  // release: pairs with the acquire in wait_sources
    __syncthreads();
    for (int owner = threadIdx.x; owner < d.num_ranks; owner += blockDim.x)
        nvshmemx_signal_op(combine_ready + d.rank, gen, NVSHMEM_SIGNAL_SET, owner);
}

// Thread 0: bounded wait until every source rank's combine_ready word on this PE equals gen (at_least:
// is >= gen), acquire. On timeout the error record (kind combine, peer = the late source) is written.
__device__ inline void wait_sources(const RingDescriptor& d, const uint64_t* combine_ready, uint64_t gen,
                                    int chunk_idx, bool at_least) {
    for (int src = 0; src < d.num_ranks; ++src) {
        Deadline deadline(d);
        uint64_t observed;
        // acquire: pairs with the release fence of signal_owners on rank `src`.
        while ((observed = ld_acquire_sys(combine_ready + src)) != gen && !(at_least && observed > gen)) {
            if (deadline.expired(d)) {
                if (!deadline.aborted)
                    record_error(d, kErrorCombine, src, slot_of(chunk_idx, d.num_slots), chunk_idx, gen,
                                 observed, 0);
                return;
            }
        }
    }
}

// Warp per token t in [token_begin, token_begin + num_tokens): y[t] = bf16(sum_k w[t][k] * rows[t][k]),
// k = 0..K-1 in that order, float32 accumulation; entries whose expert is outside [0, num_experts) (the
// mask -1) contribute nothing. topk_idx / topk_weights: [tokens][K]; combine_rows: [tokens][K][hidden];
// y: row stride y_row_stride elements; all indexed by t.
__device__ inline void reduce_tokens(const RingDescriptor& d, const __nv_bfloat16* combine_rows,
                                     const int32_t* topk_idx, const float* topk_weights, __nv_bfloat16* y,
                                     int64_t y_row_stride, int64_t token_begin, int num_tokens) {
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;
    const int K = d.num_topk;
    for (int i = blockIdx.x * warps_per_block + threadIdx.x / 32; i < num_tokens; i += gridDim.x * warps_per_block) {
        const int64_t token = token_begin + i;
        const int32_t* token_idx = topk_idx + token * K;
        const float* token_weights = topk_weights + token * K;
        const __nv_bfloat16* rows = combine_rows + token * K * d.hidden;
        for (int v = lane; v < vecs_per_row; v += 32) {
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

}  // namespace symmring
