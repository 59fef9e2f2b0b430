// Ready-made ring kernels (wrapped by symmring/kernels.py) and the tiny kernels behind the nvshmem
// backend's host primitives (symmring/backends/nvshmem.py).
//
// SM budget: the waiting kernels here (consume, acquire, word_wait) spin while they wait, so the Python
// wrappers launch them with a bounded grid (kernels.MAX_SPIN_BLOCKS blocks, far below the SM count) and
// the producer always finds free SMs. Correctness never depends on overlap: every wait is bounded and
// kernels enqueued in protocol.enqueue_order() complete when executed one at a time.
#include <stdint.h>

#include <symmring/protocol.cuh>

using namespace symmring;

namespace {

// Parts a produce/publish launch handles (kernels.PRODUCE_*).
enum ProduceFlags : int { kProduceAcquire = 1, kProduceRoute = 2, kProduceLayout = 4 };
// Options of a consume launch (kernels.CONSUME_*).
enum ConsumeFlags : int { kConsumeAck = 1 };
// Word operations of the host primitives (backends.nvshmem._WORD_OPS).
enum WordOp : int { kOpSet = 0, kOpAdd = 1, kOpOr = 2 };
// Comparisons of word_wait (backends.nvshmem._CMP_CODES, the order of backends.base.CMP).
enum WordCmp : int { kCmpEq = 0, kCmpNe = 1, kCmpGe = 2, kCmpGt = 3, kCmpLe = 4, kCmpLt = 5 };

// Loads each thread keeps in flight per step of copy_bytes (memory-level parallelism).
constexpr int kCopyUnroll = 4;

// Grid-strided copy of `num_bytes` bytes, 16 bytes per load/store when both ends allow it, kCopyUnroll
// independent loads in flight per thread. Plain (coherent) loads: slot memory is rewritten between
// generations, so never the non-coherent path.
__device__ inline void copy_bytes(void* dst, const void* src, uint64_t num_bytes, uint64_t thread_idx,
                                  uint64_t num_threads) {
    const bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | num_bytes) & 15) == 0;
    if (vec) {
        auto* d = static_cast<int4*>(dst);
        auto* s = static_cast<const int4*>(src);
        const uint64_t n = num_bytes / 16;
        uint64_t i = thread_idx;
        for (; i + (kCopyUnroll - 1) * num_threads < n; i += kCopyUnroll * num_threads) {
            int4 v[kCopyUnroll];
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) v[u] = s[i + u * num_threads];
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) d[i + u * num_threads] = v[u];
        }
        for (; i < n; i += num_threads) d[i] = s[i];
    } else {
        auto* d = static_cast<uint8_t*>(dst);
        auto* s = static_cast<const uint8_t*>(src);
        for (uint64_t i = thread_idx; i < num_bytes; i += num_threads) d[i] = s[i];
    }
}

// Copy from `pe`'s copy of a symmetric region: load/store over NVLink when reachable, else a get.
__device__ inline void pull_bytes(const RingDescriptor& d, void* dst, const void* src_local, int pe,
                                  uint64_t num_bytes) {
    if (num_bytes == 0) return;
    const void* src = peer_ptr(d, src_local, pe);
    if (src != nullptr) {
        copy_bytes(dst, src, num_bytes, uint64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                   uint64_t(gridDim.x) * blockDim.x);
        return;
    }
    // rdma (or no P2P mapping): each block gets its share with a blocking block-wide get.
    get_share_block(dst, src_local, pe, num_bytes, blockIdx.x, gridDim.x);
}

__device__ __forceinline__ bool compare(uint64_t v, int cmp, uint64_t value) {
    switch (cmp) {
        case kCmpEq: return v == value;
        case kCmpNe: return v != value;
        case kCmpGe: return v >= value;
        case kCmpGt: return v > value;
        case kCmpLe: return v <= value;
        default: return v < value;
    }
}

}  // namespace

// Copy one chunk from user tensors (contiguous, row-major) into this PE's slot and publish it.
//   flags: kProduceAcquire (wait for the slot's previous acknowledgements and reset the mask),
//          kProduceRoute (topk_idx, topk_weights, meta), kProduceLayout (x, x_sf). A launch of ONE part
//          with kProduceAcquire (the split producer: route and layout by two launches, either order, one
//          stream or two) also stops waiting once the other part of this generation is published: that
//          part acquired the slot already and may have reset the mask (wait_reusable_or_published).
//   counter: a zeroed device word private to this (slot, parts) pair (kernels.py owns them).
//   generation_override: 0 in normal use. Non-zero publishes that generation instead of the one read
//          from gen_base: only for tests that show why generations must not be baked into a graph.
//   layer: the layer of the call identity the meta row carries (expected_call; 0 for a ring of one kind of call).
extern "C" __global__ void symmring_produce(const RingDescriptor* desc_ptr, int chunk_idx, const void* x,
                                            const float* x_sf, const int32_t* topk_idx,
                                            const float* topk_weights, long long token_base, int num_valid,
                                            int flags, unsigned int* counter,
                                            unsigned long long generation_override, int layer) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    const uint64_t gen = generation_override ? generation_override : expected_generation(d, chunk_idx);
    const int slot = slot_of(chunk_idx, d.num_slots);
    if (flags & kProduceAcquire) {
        const bool route = flags & kProduceRoute, layout = flags & kProduceLayout;
        const uint64_t* other = route ? layout_ready_word(d, slot) : route_ready_word(d, slot);
        const bool ok = route == layout ? wait_reusable(d, chunk_idx, /*reset=*/false)
                                        : wait_reusable_or_published(d, chunk_idx, other, gen);
        if (!ok) return;
    }

    const uint64_t thread_idx = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t num_threads = uint64_t(gridDim.x) * blockDim.x;
    if (flags & kProduceLayout) {
        copy_bytes(x_of(d, slot), x, uint64_t(num_valid) * x_row_bytes(d), thread_idx, num_threads);
        if (d.num_sf > 0)
            copy_bytes(x_sf_of(d, slot), x_sf, uint64_t(num_valid) * d.num_sf * sizeof(float), thread_idx,
                       num_threads);
    }
    if (flags & kProduceRoute) {
        const uint64_t topk_bytes = uint64_t(num_valid) * d.num_topk * sizeof(int32_t);
        copy_bytes(topk_idx_of(d, slot), topk_idx, topk_bytes, thread_idx, num_threads);
        copy_bytes(topk_weights_of(d, slot), topk_weights, topk_bytes, thread_idx, num_threads);
        if (thread_idx == 0) write_meta(d, chunk_idx, token_base, num_valid, gen, expected_call(d, layer));
    }
    grid_publish(d, chunk_idx, gen, counter, (flags & kProduceAcquire) != 0, (flags & kProduceRoute) != 0,
                 (flags & kProduceLayout) != 0);
}

// Acquire a slot for chunk `chunk_idx` (wait for every acknowledgement of its previous use, then reset
// the mask). One block. For producers that write the slot themselves before publishing.
extern "C" __global__ void symmring_acquire(const RingDescriptor* desc_ptr, int chunk_idx) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    acquire_slot(d, chunk_idx, /*reset=*/true);
}

// Publish route and/or layout readiness of a slot whose payload was written earlier in stream order
// (by another kernel or a copy): the release fence here orders those writes before the signal.
extern "C" __global__ void symmring_publish(const RingDescriptor* desc_ptr, int chunk_idx, int flags,
                                            unsigned long long generation_override) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    const uint64_t gen = generation_override ? generation_override : expected_generation(d, chunk_idx);
    if (flags & kProduceRoute) publish_route(d, chunk_idx, gen);
    if (flags & kProduceLayout) publish_layout(d, chunk_idx, gen);
}

// Wait for chunk `chunk_idx` of `src_rank`, pull its valid rows over NVLink into local buffers and
// (kConsumeAck) acknowledge it. out_meta receives the slot's kMetaColumns metadata words. Buffers hold
// tokens_per_slot rows; only num_valid rows are written. `layer`: the layer of the call identity the slot
// must carry (as symmring_produce's).
extern "C" __global__ void symmring_consume(const RingDescriptor* desc_ptr, int chunk_idx, int src_rank,
                                            void* out_x, float* out_x_sf, int32_t* out_topk_idx,
                                            float* out_topk_weights, long long* out_meta, int flags,
                                            unsigned int* counter, unsigned long long generation_override,
                                            int layer) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    const uint64_t gen = generation_override ? generation_override : expected_generation(d, chunk_idx);
    const int slot = slot_of(chunk_idx, d.num_slots);
    if (!wait_ready(d, chunk_idx, src_rank, gen)) return;
    __shared__ int payload_ok;
    // After wait_ready's acquire: this chunk, generation and call.
    if (threadIdx.x == 0) payload_ok = check_payload(d, chunk_idx, src_rank, gen, expected_call(d, layer));
    __syncthreads();
    if (!payload_ok) return;

    int64_t* meta_local = meta_of(d, slot);
    const int64_t* meta = peer_ptr(d, meta_local, src_rank);
    __shared__ int64_t meta_words[kMetaColumns];
    if (threadIdx.x < kMetaColumns) {
        meta_words[threadIdx.x] = meta != nullptr
            ? *reinterpret_cast<const volatile int64_t*>(meta + threadIdx.x)
            : nvshmem_int64_g(reinterpret_cast<const int64_t*>(meta_local) + threadIdx.x, src_rank);
    }
    __syncthreads();
    int64_t num_valid = meta_words[kMetaNumValid];
    // A corrupt count must not write past the caller's buffers.
    num_valid = num_valid < 0 ? 0 : (num_valid > d.tokens_per_slot ? d.tokens_per_slot : num_valid);
    if (blockIdx.x == 0 && threadIdx.x < kMetaColumns) out_meta[threadIdx.x] = meta_words[threadIdx.x];

    pull_bytes(d, out_x, x_of(d, slot), src_rank, uint64_t(num_valid) * x_row_bytes(d));
    if (d.num_sf > 0)
        pull_bytes(d, out_x_sf, x_sf_of(d, slot), src_rank, uint64_t(num_valid) * d.num_sf * sizeof(float));
    const uint64_t topk_bytes = uint64_t(num_valid) * d.num_topk * sizeof(int32_t);
    pull_bytes(d, out_topk_idx, topk_idx_of(d, slot), src_rank, topk_bytes);
    pull_bytes(d, out_topk_weights, topk_weights_of(d, slot), src_rank, topk_bytes);

    if ((flags & kConsumeAck) && grid_last_block(counter)) ack(d, chunk_idx, src_rank);
}

// Acknowledge chunk `chunk_idx` of `src_rank` (the CONSERVATIVE policy: after the chunk's combine).
extern "C" __global__ void symmring_ack(const RingDescriptor* desc_ptr, int chunk_idx, int src_rank) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    ack(d, chunk_idx, src_rank);
}

// End of a call of `num_chunks` chunks: advance the device-resident generation base and the call number
// (graph-safe).
extern "C" __global__ void symmring_end_call(const RingDescriptor* desc_ptr, int num_chunks) {
    if (blockIdx.x == 0 && threadIdx.x == 0) end_call(*desc_ptr, num_chunks);
}

// --- the asynchronous error latch (kernels.AsyncErrorLatch) -------------------------------------------

// Words of the latch's host-mapped status (kernels.LATCH_*): the error record, the abort word, then the flag.
enum LatchWord : int32_t { kLatchAbort = kErrorWords, kLatchFlag = kErrorWords + 1, kLatchWords = kErrorWords + 2 };

// Enqueued last in every call of a layer (after its last kernel on the caller's stream, in a CUDA graph too).
// Nothing to do unless this PE has an error pending (its record, or another PE's abort): then every thread
// fills `poison` (num_poison 16-bit words: the call's bf16 output) with NaN, and thread 0 copies the record and
// the abort word into `host_status` (pinned, host-mapped memory the host polls without synchronising) and
// sets its flag, once: the first latched error stays until the host clears it (reset). A kernel of this call
// that returned early because of an error did so before this one started (stream order), and errors stay
// pending until reset, so every block sees it: an output that was not completely written is always poisoned.
extern "C" __global__ void symmring_error_latch(const RingDescriptor* desc_ptr, unsigned long long* host_status,
                                                unsigned short* poison, long long num_poison) {
    const RingDescriptor& d = *desc_ptr;
    if (!error_pending(d)) return;
    constexpr unsigned short kBf16NaN = 0x7fc0;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_poison; i += stride)
        poison[i] = kBf16NaN;
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    volatile unsigned long long* status = host_status;
    if (status[kLatchFlag] != 0) return;
    const volatile int64_t* record = error_record(d);
    for (int w = 0; w < kErrorWords; ++w) status[w] = static_cast<unsigned long long>(record[w]);
    status[kLatchAbort] = load_abort_word(d);
    __threadfence_system();  // release: the words before the flag the host reads first
    status[kLatchFlag] = 1ull;
}

// --- host primitives of the nvshmem backend (one thread each) -----------------------------------------

// SET/ADD (signal ops, relaxed) or OR (atomic, relaxed) on `pe`'s copy of `word`.
extern "C" __global__ void symmring_word_op(uint64_t* word, unsigned long long value, int pe, int op) {
    if (op == kOpSet) nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_SET, pe);
    else if (op == kOpAdd) nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_ADD, pe);
    else nvshmem_uint64_atomic_or(word, value, pe);
}

// Relaxed load of `pe`'s copy of `word` into out[0].
extern "C" __global__ void symmring_word_read(uint64_t* word, int pe, unsigned long long* out) {
    const uint64_t* peer = static_cast<const uint64_t*>(nvshmem_ptr(word, pe));
    out[0] = peer != nullptr ? ld_relaxed_sys(peer) : nvshmem_uint64_atomic_fetch(word, pe);
}

// Bounded poll of `pe`'s copy of `word` until compare(word, cmp, value); acquire on success.
// out[0] = 1 when satisfied, 0 on timeout; out[1] = the last value observed.
extern "C" __global__ void symmring_word_wait(uint64_t* word, int pe, int cmp, unsigned long long value,
                                              unsigned long long timeout_ns, unsigned long long* out) {
    const uint64_t* peer = static_cast<const uint64_t*>(nvshmem_ptr(word, pe));
    const uint64_t start_ns = globaltimer_ns();
    uint64_t observed = 0;
    for (uint32_t polls = 1;; ++polls) {
        // acquire: pairs with the publisher's fence before its signal.
        observed = load_word_acquire(peer, word, pe);
        if (compare(observed, cmp, value)) {
            out[0] = 1;
            break;
        }
        if (polls % kPollsPerCheck == 0 && globaltimer_ns() - start_ns > timeout_ns) {
            out[0] = 0;
            break;
        }
    }
    out[1] = observed;
}

// Release fence over all earlier stores of this PE, in stream order (host fence()).
extern "C" __global__ void symmring_fence() { nvshmem_fence(); }

// --- protocol benchmark ---------------------------------------------------------------------------------

// Ping-pong of publications: the initiator publishes value first+i on its own word (fence + SET, exactly
// publish()), the responder observes it by polling the initiator's word over NVLink (acquire) and
// publishes the same value on its own word, which the initiator observes. out[0] = elapsed ns measured by
// the initiator, out[1] = rounds completed. One-way latency = out[0] / (2 * rounds). rdma != 0 polls the
// other word with NVSHMEM's remote atomic fetch (the rdma transport's wait) even where it is mapped.
extern "C" __global__ void symmring_bench_pingpong(uint64_t* own_word, uint64_t* other_word, int other_pe,
                                                   int num_rounds, int initiator,
                                                   unsigned long long first_value,
                                                   unsigned long long timeout_ns, unsigned long long* out,
                                                   int rdma) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t* other = rdma ? nullptr : static_cast<const uint64_t*>(nvshmem_ptr(other_word, other_pe));
    const int own_pe = nvshmem_my_pe();
    const uint64_t start_ns = globaltimer_ns();
    int round = 0;
    for (; round < num_rounds; ++round) {
        const uint64_t value = first_value + round;
        if (initiator) {
            nvshmem_fence();  // release: as in publish()
            nvshmemx_signal_op(own_word, value, NVSHMEM_SIGNAL_SET, own_pe);
        }
        uint32_t polls = 0;
        bool late = false;
        // acquire: pairs with the other side's fence + SET.
        while (load_word_acquire(other, other_word, other_pe) != value) {
            if (++polls % kPollsPerCheck == 0 && globaltimer_ns() - start_ns > timeout_ns) { late = true; break; }
        }
        if (late) break;
        if (!initiator) {
            nvshmem_fence();  // release: as in publish()
            nvshmemx_signal_op(own_word, value, NVSHMEM_SIGNAL_SET, own_pe);
        }
    }
    out[0] = globaltimer_ns() - start_ns;
    out[1] = round;
}
