// Streamed MoE kernels (symmring.moe.gpu_streamed): the chunk-aware pieces of the streamed path. The
// producer kernels (device/producer.cu) and the dispatch count/scan/pull (device/dispatch.cu) already take
// a chunk index and per-chunk pointers and are reused as they are; what they hard-code for the
// one-chunk batch call is replaced here:
//
//   stream_wait_slot        producer side, one block: wait until the chunk's slot is reusable (every
//                           consumer acknowledged chunk - num_slots), acquire, no reset (moe_produce_route
//                           then finds the mask complete and resets it). One spinning block instead of the
//                           route kernel's 16, and the timeline shows the producer's wait apart from its work.
//   stream_wait_route       route readiness of every source only (count and scan need only the route
//                           payload, so they overlap the producer's layout); snapshots every source's meta
//                           token_base into a local array, so nothing after the pull reads the slot (EARLY).
//                           clear_counts: only for the first chunk of an expert window (the counts of a
//                           window's chunks accumulate, so its experts run one grouped GEMM).
//   stream_wait_layout      layout readiness of every source, before moe_dispatch_pull.
//   stream_ack              EARLY policy: acknowledge every owner's slot right after the pull.
//   stream_combine_scatter  rows to the owner's combine buffer at the LOGICAL token row (token_base from
//                           the snapshot of the row's chunk + chunk-local token), so chunks of one call
//                           never share rows.
//   stream_combine_signal   SET combine_ready[this rank] = the generation of the window's last chunk on
//                           every owner; with ack_now (CONSERVATIVE) acknowledge the window's chunks.
//   stream_combine_wait     wait until every source's word is >= the chunk's generation (PROTOCOL.md
//                           section 7.1: a consumer may signal chunk c + 1 before the owner saw chunk c,
//                           and generations only grow, so >= admits no stale value).
//   stream_combine_reduce   one warp per token of the chunk's logical rows, reading topk from the
//                           owner's LOCAL routing buffers (never the slot, which EARLY may already have
//                           handed back to the producer). Does not end the call.
//   stream_end_call         one thread, after the last chunk on every stream: generation base + num_chunks.
//   stream_stamp            one thread: stamps[idx] = %globaltimer (the timeline of `bench stream`).
//   stream_sleep            one thread: spin for a given number of ns (tests: a deliberately slow producer
//                           or consumer).
//   stream_spin_probe       the consumer's wait loop on a word nobody sets, for a bounded time, on a
//                           chosen number of blocks (bench stream --spin-check: does spinning slow the
//                           producer's kernels?).
//
// An expert window is a run of consecutive chunks [chunk_begin, chunk_end] whose rows share the expert
// pool and one grouped GEMM (StreamedMoE(expert_window=W), W <= num_slots); W = 1 is chunk-local pools.
#include <stdint.h>

#include <cuda_bf16.h>

#include <symmring/combine.cuh>
#include <symmring/protocol.cuh>

using namespace symmring;

namespace {

// Thread 0 of the block: bounded wait until `src_rank`'s copy of `word_local` (a ready word of the chunk's
// slot) equals `expected` (acquire); then the whole block. False on timeout (error record `kind`).
__device__ inline bool wait_word(const RingDescriptor& d, int chunk_idx, int src_rank, uint64_t* word_local,
                                 uint64_t expected, ErrorKind kind) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        const uint64_t* word = peer_ptr(d, word_local, src_rank);
        Deadline deadline(d);
        uint64_t observed;
        ok = 1;
        // acquire: pairs with the release fence of the publication (signal_generation) on src_rank.
        while ((observed = load_word_acquire(word, word_local, src_rank)) != expected) {
            if (deadline.expired(d)) {
                if (!deadline.aborted)
                    record_error(d, kind, src_rank, slot_of(chunk_idx, d.num_slots), chunk_idx, expected,
                                 observed, 0);
                ok = 0;
                break;
            }
        }
    }
    __syncthreads();  // the other threads read the payload only after thread 0's acquire
    return ok != 0;
}

}  // namespace

// One block: wait until every consumer acknowledged the slot's previous use (chunk - num_slots), acquire;
// no reset (moe_produce_route, next on the stream, resets the mask before it publishes).
extern "C" __global__ void stream_wait_slot(const RingDescriptor* desc_ptr, int chunk_idx) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    wait_reusable(d, chunk_idx, /*reset=*/false);  // acquire: pairs with the release fence in ack()
}

// Route readiness alone (the layout may still be running): block r waits for source rank r's route
// generation of the chunk (bounded, acquire), then thread 0 copies the source's meta token_base into
// token_base[r] (the caller passes the chunk's row of a [window][num_ranks] array). With clear_counts,
// block 0 also zeroes counts for moe_dispatch_count (the first chunk of an expert window).
extern "C" __global__ void stream_wait_route(const RingDescriptor* desc_ptr, int chunk_idx, int* counts,
                                             int num_local_experts, long long* token_base, int clear_counts) {
    const RingDescriptor& d = *desc_ptr;
    if (blockIdx.x == 0 && clear_counts)
        for (int e = threadIdx.x; e < num_local_experts; e += blockDim.x) counts[e] = 0;
    if (error_pending(d)) return;
    const int src_rank = blockIdx.x;
    const int slot = slot_of(chunk_idx, d.num_slots);
    // acquire: pairs with the route publication of moe_produce_route on src_rank.
    if (!wait_word(d, chunk_idx, src_rank, route_ready_word(d, slot), expected_generation(d, chunk_idx),
                   kErrorRoute))
        return;
    if (threadIdx.x == 0) {
        const int64_t* meta = peer_ptr(d, meta_of(d, slot), src_rank);
        // A null mapping is reported by moe_dispatch_count's status bit; use the protocol's own base here.
        token_base[src_rank] = meta != nullptr ? meta[kMetaTokenBase]
                                               : chunk_token_base(chunk_idx, d.tokens_per_slot);
    }
}

// Block r waits for source rank r's layout generation of the chunk (bounded, acquire), before
// moe_dispatch_pull reads x / x_sf. Together with stream_wait_route this is wait_ready's "both
// generations equal the expected one", split so that counting and the scan overlap the layout.
extern "C" __global__ void stream_wait_layout(const RingDescriptor* desc_ptr, int chunk_idx) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    const int src_rank = blockIdx.x;
    // acquire: pairs with the layout publication of moe_produce_layout_* on src_rank.
    wait_word(d, chunk_idx, src_rank, layout_ready_word(d, slot_of(chunk_idx, d.num_slots)),
              expected_generation(d, chunk_idx), kErrorLayout);
}

// One block, after moe_dispatch_pull (the last read of every source's slot, meta included): EARLY
// acknowledgement of every owner's slot. ack() fences first (release: pairs with the acquire in the
// owner's wait_reusable).
extern "C" __global__ void stream_ack(const RingDescriptor* desc_ptr, int chunk_idx) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    for (int owner = 0; owner < d.num_ranks; ++owner) ack(d, chunk_idx, owner);
}

// Rows [total[0]] of pool_out ([capacity][hidden] bf16) to their owners' combine rows at the logical
// token row token_base[chunk - window_begin][src] + token. row_src[row] = {src_rank, chunk-local token, k,
// chunk} (moe_dispatch_pull); token_base: [window][num_ranks], the snapshots of stream_wait_route.
extern "C" __global__ void stream_combine_scatter(const RingDescriptor* desc_ptr, const __nv_bfloat16* pool_out,
                                                  const int4* row_src, const int* total,
                                                  const long long* token_base, int window_begin,
                                                  __nv_bfloat16* combine_rows) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    const int num_ranks = d.num_ranks;
    scatter_rows(d, pool_out, row_src, total[0], combine_rows, [=](int4 src) {
        return token_base[int64_t(src.w - window_begin) * num_ranks + src.x] + src.y;
    });
}

// One block, after stream_combine_scatter of the window [chunk_begin, chunk_end]: tell every owner that
// this PE's rows of those chunks are in place (one signal, the last chunk's generation: the release fence
// covers every row, and owners wait with >=); with ack_now (CONSERVATIVE) acknowledge every chunk too.
extern "C" __global__ void stream_combine_signal(const RingDescriptor* desc_ptr, int chunk_begin, int chunk_end,
                                                 uint64_t* combine_ready, int ack_now) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    signal_owners(d, combine_ready, expected_generation(d, chunk_end));
    if (!ack_now) return;
    // CONSERVATIVE: after this PE's combine of the window; ack() fences (release: pairs with wait_reusable).
    for (int chunk = chunk_begin; chunk <= chunk_end; ++chunk)
        for (int owner = 0; owner < d.num_ranks; ++owner) ack(d, chunk, owner);
}

// One thread: bounded wait until every source rank's combine_ready word on this PE is >= the chunk's
// generation (acquire), so stream_combine_reduce (the next kernel) reads the rows they stored.
extern "C" __global__ void stream_combine_wait(const RingDescriptor* desc_ptr, int chunk_idx,
                                               const uint64_t* combine_ready) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d) || threadIdx.x != 0) return;
    wait_sources(d, combine_ready, expected_generation(d, chunk_idx), chunk_idx, /*at_least=*/true);
}

// One warp per token t in [token_begin, token_begin + num_valid): y[t] = bf16(sum_k w[t][k] * rows[t][k])
// in k order, float32, masked entries skipped. topk_idx / topk_weights: the owner's local [n][K] routing
// of the whole call; combine_rows: [max_tokens][K][hidden] by logical token; y: row stride y_row_stride.
extern "C" __global__ void stream_combine_reduce(const RingDescriptor* desc_ptr, const __nv_bfloat16* combine_rows,
                                                 const int32_t* topk_idx, const float* topk_weights,
                                                 __nv_bfloat16* y, long long y_row_stride, int token_begin,
                                                 int num_valid) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    reduce_tokens(d, combine_rows, topk_idx, topk_weights, y, y_row_stride, token_begin, num_valid);
}

// One thread, after every kernel of the call on every stream (the layer joins the streams first):
// advance the generation base by the call's chunk count.
extern "C" __global__ void stream_end_call(const RingDescriptor* desc_ptr, int num_chunks) {
    if (blockIdx.x == 0 && threadIdx.x == 0) end_call(*desc_ptr, num_chunks);
}

// One thread: stamps[idx] = the device's nanosecond clock (runs when the stream's previous kernel ended).
extern "C" __global__ void stream_stamp(unsigned long long* stamps, int idx) {
    if (blockIdx.x == 0 && threadIdx.x == 0) stamps[idx] = globaltimer_ns();
}

// One thread: spin for duration_ns (bounded by the argument; a test's deliberately slow producer).
extern "C" __global__ void stream_sleep(unsigned long long duration_ns) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const uint64_t start = globaltimer_ns();
    while (globaltimer_ns() - start < duration_ns) __nanosleep(1000);
}

// Blocks 0..gridDim.x-1, thread 0 of each: the consumer's wait loop (ld.acquire.sys of a word, %globaltimer
// deadline) on `word`, which nobody sets to `until`, for duration_ns. Measures what a waiting consumer
// costs the kernels that run beside it (bench stream --spin-check); not part of the layer.
extern "C" __global__ void stream_spin_probe(const unsigned long long* word, unsigned long long until,
                                             unsigned long long duration_ns) {
    if (threadIdx.x != 0) return;
    const uint64_t start = globaltimer_ns();
    while (ld_acquire_sys(reinterpret_cast<const uint64_t*>(word)) != until &&
           globaltimer_ns() - start < duration_ns) {
    }
}
