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

#include <symmring/combine.cuh>
#include <symmring/protocol.cuh>

using namespace symmring;

// Rows [num_rows] of pool_out ([capacity][hidden] bf16; num_rows read from total[0] on the device) to
// their owners' combine rows at the chunk-local token. row_src[row] = {src_rank, token, k, chunk}.
extern "C" __global__ void moe_combine_scatter(const RingDescriptor* desc_ptr, const __nv_bfloat16* pool_out,
                                               const int4* row_src, const int* total,
                                               __nv_bfloat16* combine_rows) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    scatter_rows(d, pool_out, row_src, total[0], combine_rows, [](int4 src) { return int64_t(src.y); });
}

// One block of at least num_ranks threads, after moe_combine_scatter: tell every owner that this PE's
// rows of the chunk are in place, and acknowledge every owner's slot.
extern "C" __global__ void moe_combine_signal(const RingDescriptor* desc_ptr, int chunk_idx,
                                              uint64_t* combine_ready) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    signal_owners(d, combine_ready, expected_generation(d, chunk_idx));
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
    wait_sources(d, combine_ready, expected_generation(d, chunk_idx), chunk_idx, /*at_least=*/false);
}

// One warp per token of this PE's chunk: y[t] = bf16(sum_k w[t][k] * rows[t][k]) in k order, skipping
// masked entries, with the routing from the PE's own slot. y has row stride y_row_stride elements;
// tokens >= num_valid are not touched.
extern "C" __global__ void moe_combine_reduce(const RingDescriptor* desc_ptr, int chunk_idx,
                                              const __nv_bfloat16* combine_rows, __nv_bfloat16* y,
                                              long long y_row_stride, int num_valid) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    // Every kernel of this call that reads the base ran before this one (stream order).
    if (blockIdx.x == 0 && threadIdx.x == 0) end_call(d, /*num_chunks=*/1);
    const int slot = slot_of(chunk_idx, d.num_slots);
    reduce_tokens(d, combine_rows, topk_idx_of(d, slot), topk_weights_of(d, slot), y, y_row_stride, 0, num_valid);
}
