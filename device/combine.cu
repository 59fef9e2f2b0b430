// MoE combine kernels (symmring.moe.gpu): send every expert output row back to the rank that owns its
// token, then reduce each token's top-k rows in a fixed order.
//
// Combine buffer: a symmetric allocation holding, on every PE, rows [tokens_per_slot][num_topk][hidden]
// bf16 (the (token, k) place of every entry of the owner's tokens) and a signal word per source rank,
// combine_ready[num_ranks] (uint64).
//
// Launch order on one stream:
//   moe_combine_scatter  one warp per pool row: store the row into its owner's combine buffer at
//                        (token, k) over NVLink (16-byte stores).
//   moe_combine_signal   one block: release, then SET combine_ready[this rank] = generation on every
//                        owner, and acknowledge every owner's ring slot (the CONSERVATIVE policy:
//                        this PE read the slots during dispatch and is now done with the chunk).
//   moe_combine_wait     one block: bounded wait until every rank's combine_ready word on this PE
//                        equals the generation (acquire).
//   moe_combine_reduce   one warp per token: y[t] = sum over k = 0..K-1 (in that order) of
//                        topk_weights[t][k] * row(t, k), float32 accumulation, bf16 result; entries
//                        whose expert is outside [0, num_experts) (the mask -1) contribute nothing.
//                        Block 0 then ends the call: generation base + 1 (device-resident, so a
//                        graph replay gets a fresh generation; no later kernel of the call reads it).
//
// Reuse of the combine buffer: a rank writes into an owner's buffer for call n+1 only after it saw the
// owner's call-n+1 publication, which the owner enqueues after its call-n reduce (stream order).
#include <stdint.h>

#include <cuda_bf16.h>

#include <symmring/protocol.cuh>

using namespace symmring;

// Rows [num_rows] of pool_out ([capacity][hidden] bf16; num_rows read from total[0] on the device) to
// their owners' combine rows. row_src[row] = {src_rank, token, k, chunk} as recorded by moe_dispatch_pull.
extern "C" __global__ void moe_combine_scatter(const RingDescriptor* desc_ptr, const __nv_bfloat16* pool_out,
                                               const int4* row_src, const int* total,
                                               __nv_bfloat16* combine_rows) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    const int num_rows = total[0];
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;  // 8 bf16 per 16-byte vector
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / 32; row < num_rows;
         row += gridDim.x * warps_per_block) {
        const int4 src = row_src[row];
        __nv_bfloat16* owner_rows = peer_ptr(d, combine_rows, src.x);
        int4* dst = reinterpret_cast<int4*>(owner_rows + (int64_t(src.y) * d.num_topk + src.z) * d.hidden);
        const int4* from = reinterpret_cast<const int4*>(pool_out + int64_t(row) * d.hidden);
        for (int v = lane; v < vecs_per_row; v += 32) dst[v] = from[v];
    }
}

// One block of at least num_ranks threads, after moe_combine_scatter: tell every owner that this PE's
// rows of the chunk are in place, and acknowledge every owner's slot.
extern "C" __global__ void moe_combine_signal(const RingDescriptor* desc_ptr, int chunk_idx,
                                              uint64_t* combine_ready) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    const uint64_t gen = expected_generation(d, chunk_idx);
    if (threadIdx.x == 0) nvshmem_fence();  // release: pairs with the acquire in moe_combine_wait
    __syncthreads();
    for (int owner = threadIdx.x; owner < d.num_ranks; owner += blockDim.x)
        nvshmemx_signal_op(combine_ready + d.rank, gen, NVSHMEM_SIGNAL_SET, owner);
    // CONSERVATIVE acknowledgement: after this PE's combine of the chunk. ack() fences first (release:
    // pairs with the acquire in the owner's wait_reusable).
    for (int owner = 0; owner < d.num_ranks; ++owner) ack(d, chunk_idx, owner);
}

// One block: bounded wait until every source rank's combine_ready word on this PE equals the chunk's
// generation; acquire, so moe_combine_reduce (the next kernel) reads the rows they stored.
extern "C" __global__ void moe_combine_wait(const RingDescriptor* desc_ptr, int chunk_idx,
                                            const uint64_t* combine_ready) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d) || threadIdx.x != 0) return;
    const uint64_t gen = expected_generation(d, chunk_idx);
    for (int src = 0; src < d.num_ranks; ++src) {
        Deadline deadline(d);
        uint64_t observed;
        // acquire: pairs with the release fence in moe_combine_signal on rank `src`.
        while ((observed = ld_acquire_sys(combine_ready + src)) != gen) {
            if (deadline.expired(d)) {
                if (!deadline.aborted)
                    record_error(d, kErrorCombine, src, slot_of(chunk_idx, d.num_slots), chunk_idx, gen,
                                 observed, 0);
                return;
            }
        }
    }
}

// One warp per token of this PE's chunk: y[t] = bf16(sum_k w[t][k] * rows[t][k]) in k order, skipping
// masked entries. y has row stride y_row_stride elements; tokens >= num_valid are not touched.
extern "C" __global__ void moe_combine_reduce(const RingDescriptor* desc_ptr, int chunk_idx,
                                              const __nv_bfloat16* combine_rows, __nv_bfloat16* y,
                                              long long y_row_stride, int num_valid) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    // Every kernel of this call that reads the base ran before this one (stream order).
    if (blockIdx.x == 0 && threadIdx.x == 0) end_call(d, /*num_chunks=*/1);
    const int slot = slot_of(chunk_idx, d.num_slots);
    const int32_t* idx = topk_idx_of(d, slot);
    const float* weights = topk_weights_of(d, slot);
    const int lane = threadIdx.x % 32;
    const int warps_per_block = blockDim.x / 32;
    const int vecs_per_row = d.hidden / 8;
    for (int token = blockIdx.x * warps_per_block + threadIdx.x / 32; token < num_valid;
         token += gridDim.x * warps_per_block) {
        const int32_t* token_idx = idx + int64_t(token) * d.num_topk;
        const float* token_weights = weights + int64_t(token) * d.num_topk;
        const __nv_bfloat16* rows = combine_rows + int64_t(token) * d.num_topk * d.hidden;
        for (int v = lane; v < vecs_per_row; v += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int k = 0; k < d.num_topk; ++k) {
                const int expert = token_idx[k];
                if (expert < 0 || expert >= d.num_experts) continue;  // masked: contributes nothing
                const float w = token_weights[k];
                const int4 raw = reinterpret_cast<const int4*>(rows + int64_t(k) * d.hidden)[v];
                const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __bfloat1622float2(pairs[i]);
                    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
                    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
                }
            }
            int4 out;
            __nv_bfloat162* out_pairs = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
            for (int i = 0; i < 4; ++i) out_pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
            *reinterpret_cast<int4*>(y + int64_t(token) * y_row_stride + v * 8) = out;
        }
    }
}
