// The chunk-ready ring protocol on the device. Mirrors symmring/protocol.py (same names where possible):
// generation(base, chunk) = base + chunk + 1, slot_of(chunk, S) = chunk % S, acknowledgement bit of rank
// q = bit q % 64 of word q / 64, a fresh slot's mask is full, and a consumer reads a slot only when BOTH
// ready generations equal the expected one.
//
// Who signals where (one word per slot and kind, no fan-out):
//   * Ready generations live on the OWNER of the slot. The owner publishes with a local
//     nvshmemx_signal_op(SET) and every consumer polls the owner's word over NVLink. One store per
//     publication, whatever the number of consumers: the producer's cost does not grow with the ranks,
//     and a consumer polls exactly the word of the source it needs (polling is a read hit in the
//     owner's L2 once the line is cached, and costs the owner nothing).
//   * Acknowledgement bits live on the owner too: each consumer ORs its bit into the owner's mask, and
//     the owner polls its own memory before reusing the slot.
//
// Ordering points (NVSHMEM 3.4.5 over P2P: signal_op SET is a plain volatile store, ADD/OR are relaxed
// system atomics; nvshmem_fence() is __threadfence_system(); signal_wait_until has no acquire):
//   (1) publish:   payload stores; __syncthreads; nvshmem_fence (release); signal SET.
//   (2) wait_ready: ld.acquire.sys of the owner's word; __syncthreads before other threads read.
//   (3) ack:       last payload read; __syncthreads; nvshmem_fence (release); atomic fetch-OR of our bit
//                  (kErrorDoubleAck if it was already set).
//   (4) acquire_slot: ld.acquire.sys of the own mask until complete; reset to 0 (ordered before the next
//                  publication by fence (1)).
// (1) pairs with (2); (3) pairs with (4). Every acquire that pairs with another GPU's release is
// ld.acquire.sys (system scope); a volatile poll followed by __threadfence() (gpu scope) is not one.
//
// Detectors (each records a typed error and aborts the ring on every PE, timeout.cuh): check_payload after
// the acquire of readiness (kErrorStalePayload: another chunk or generation; kErrorCallMismatch: another
// call's identity), ack (kErrorDoubleAck); every wait gives up when another PE aborted (kErrorAborted). The
// host's reset (collective) is the one way back.
//
// Generations come from the device-resident gen_base word (RingDescriptor::gen_base_ptr), never from a
// kernel argument, so a CUDA Graph replay computes fresh generations; end_call() advances the word. The call
// identity (call_identity: the number in the call word RingDescriptor::call_ptr, also advanced by end_call,
// and the layer, a kernel argument constant for a layer) goes into every meta row a producer writes, and a
// consumer compares it with its own: ranks whose call sequences diverged (the same generations, another
// layer's or another call's payload) get a named error instead of rows.
//
// Usage from a user kernel (every function here is called by ALL threads of a block unless noted):
//
//     #include <symmring/protocol.cuh>
//     extern "C" __global__ void my_producer(const symmring::RingDescriptor* desc_ptr, int chunk) {
//         const auto& desc = *desc_ptr;
//         const uint64_t gen = symmring::expected_generation(desc, chunk);
//         if (!symmring::acquire_slot(desc, chunk, /*reset=*/true)) return;  // timed out: record written
//         ... write x / x_sf / topk_idx / topk_weights / meta of slot_of(chunk) ...
//         symmring::publish_route(desc, chunk, gen);
//         symmring::publish_layout(desc, chunk, gen);
//     }
#pragma once
#include <stdint.h>

#include <nvshmem.h>
#include <nvshmemx.h>

#include "chain_stamps.cuh"
#include "descriptor.cuh"
#include "timeout.cuh"

namespace symmring {

// --- the arithmetic (protocol.py) -----------------------------------------------------------------

constexpr uint64_t kGenNone = 0;           // protocol.GEN_NONE: no chunk carries it
constexpr int kRanksPerMaskWord = 64;      // protocol.RANKS_PER_MASK_WORD
constexpr int kCallLayerBits = 16;         // protocol.CALL_LAYER_BITS
constexpr int kCallNumberBits = 63 - kCallLayerBits;  // protocol.CALL_NUMBER_BITS

__device__ __forceinline__ uint64_t generation(uint64_t base, int chunk_idx) {
    return base + static_cast<uint64_t>(chunk_idx) + 1;
}
__device__ __forceinline__ uint64_t next_base(uint64_t base, int num_chunks) {
    return base + static_cast<uint64_t>(num_chunks);
}
// protocol.call_identity: the call number (modulo 2^kCallNumberBits) above the layer (modulo 2^kCallLayerBits).
__device__ __forceinline__ uint64_t call_identity(uint64_t number, int layer) {
    return ((number & ((1ull << kCallNumberBits) - 1)) << kCallLayerBits) |
           (static_cast<uint64_t>(layer) & ((1ull << kCallLayerBits) - 1));
}
__device__ __forceinline__ int slot_of(int chunk_idx, int num_slots) { return chunk_idx % num_slots; }
__device__ __forceinline__ int64_t chunk_token_base(int chunk_idx, int tokens_per_slot) {
    return static_cast<int64_t>(chunk_idx) * tokens_per_slot;
}
__device__ __forceinline__ int chunk_valid_tokens(int64_t num_tokens, int chunk_idx, int tokens_per_slot) {
    const int64_t left = num_tokens - chunk_token_base(chunk_idx, tokens_per_slot);
    return static_cast<int>(left <= 0 ? 0 : (left < tokens_per_slot ? left : tokens_per_slot));
}
__device__ __forceinline__ bool is_ready(uint64_t route_gen, uint64_t layout_gen, uint64_t expected) {
    return route_gen == expected && layout_gen == expected;
}
__device__ __forceinline__ int mask_words(int num_ranks) {
    return (num_ranks + kRanksPerMaskWord - 1) / kRanksPerMaskWord;
}
__device__ __forceinline__ int ack_word(int rank) { return rank / kRanksPerMaskWord; }
__device__ __forceinline__ uint64_t ack_bit(int rank) { return 1ull << (rank % kRanksPerMaskWord); }
// Word `word_idx` of the required (= full, = initial) mask of `num_ranks` consumers.
__device__ __forceinline__ uint64_t required_mask_word(int word_idx, int num_ranks) {
    const int bits = num_ranks - word_idx * kRanksPerMaskWord;
    return bits >= kRanksPerMaskWord ? ~0ull : (bits <= 0 ? 0ull : ((1ull << bits) - 1));
}

// --- loads and stores of protocol words -------------------------------------------------------------

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* ptr, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// Whether this PE reaches `pe` with NVSHMEM one-sided operations (transport rdma: the peer's bit in the
// descriptor's rdma_mask; symmring/transport.py). Never for this PE itself.
__device__ __forceinline__ bool is_rdma_peer(const RingDescriptor& desc, int pe) {
    if (desc.rdma_mask_ptr == 0 || pe == desc.rank) return false;
    const uint64_t word = reinterpret_cast<const uint64_t*>(desc.rdma_mask_ptr)[pe / kRanksPerMaskWord];
    return (word >> (pe % kRanksPerMaskWord)) & 1ull;
}

// Address of `pe`'s copy of a symmetric location, or nullptr when it is not load/store reachable or the
// peer is an rdma peer (then the NVSHMEM RMA/AMO paths are used). Own PE: the local address. Callers
// decide once per peer (per block or warp), never per element.
template <typename T>
__device__ __forceinline__ T* peer_ptr(const RingDescriptor& desc, T* local, int pe) {
    if (pe == desc.rank) return local;
    if (is_rdma_peer(desc, pe)) return nullptr;
    return static_cast<T*>(nvshmem_ptr(const_cast<void*>(static_cast<const void*>(local)), pe));
}

// Block-level, in every block `block` of `num_blocks` that share one copy: get block `block`'s share of
// `num_bytes` bytes of `pe`'s copy of the symmetric location `src_local` into local `dst` (blocking
// nvshmemx_getmem_block: the bytes are in `dst` when it returns). The rdma path's pull.
__device__ inline void get_share_block(void* dst, const void* src_local, int pe, uint64_t num_bytes, uint64_t block,
                                       uint64_t num_blocks) {
    if (num_bytes == 0) return;
    const uint64_t share = (num_bytes + num_blocks - 1) / num_blocks;
    const uint64_t begin = share * block;
    if (begin >= num_bytes) return;
    const uint64_t len = begin + share > num_bytes ? num_bytes - begin : share;
    nvshmemx_getmem_block(static_cast<uint8_t*>(dst) + begin, static_cast<const uint8_t*>(src_local) + begin, len,
                          pe);
}

// Acquire-load of `pe`'s copy of the word at `local` (peer = the pointer from peer_ptr, may be null).
__device__ __forceinline__ uint64_t load_word_acquire(const uint64_t* peer, uint64_t* local, int pe) {
    if (peer != nullptr) return ld_acquire_sys(peer);
    const uint64_t v = nvshmem_uint64_atomic_fetch(local, pe);
    __threadfence_system();  // acquire for the fallback path: later payload reads after the fetch
    return v;
}

// --- regions of a slot --------------------------------------------------------------------------------

__device__ __forceinline__ uint64_t* route_ready_word(const RingDescriptor& d, int slot) {
    return reinterpret_cast<uint64_t*>(d.route_ready_ptr) + slot;
}
__device__ __forceinline__ uint64_t* layout_ready_word(const RingDescriptor& d, int slot) {
    return reinterpret_cast<uint64_t*>(d.layout_ready_ptr) + slot;
}
__device__ __forceinline__ uint64_t* ack_mask_of(const RingDescriptor& d, int slot) {
    return reinterpret_cast<uint64_t*>(d.ack_mask_ptr) + static_cast<int64_t>(slot) * d.mask_words;
}
__device__ __forceinline__ int64_t* meta_of(const RingDescriptor& d, int slot) {
    return reinterpret_cast<int64_t*>(d.meta_ptr) + static_cast<int64_t>(slot) * kMetaColumns;
}
__device__ __forceinline__ uint8_t* x_of(const RingDescriptor& d, int slot) {
    return reinterpret_cast<uint8_t*>(d.x_ptr) + slot * d.x_slot_stride;
}
__device__ __forceinline__ float* x_sf_of(const RingDescriptor& d, int slot) {
    return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(d.x_sf_ptr) + slot * d.x_sf_slot_stride);
}
__device__ __forceinline__ int32_t* topk_idx_of(const RingDescriptor& d, int slot) {
    return reinterpret_cast<int32_t*>(reinterpret_cast<uint8_t*>(d.topk_idx_ptr) + slot * d.topk_slot_stride);
}
__device__ __forceinline__ float* topk_weights_of(const RingDescriptor& d, int slot) {
    return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(d.topk_weights_ptr) +
                                    slot * d.topk_slot_stride);
}
__device__ __forceinline__ uint64_t x_row_bytes(const RingDescriptor& d) {
    return static_cast<uint64_t>(d.hidden) * d.x_elem_bytes;
}

// --- generations ------------------------------------------------------------------------------------

// This PE's generation base. Written only by end_call() on this PE, ordered by the stream (or graph).
__device__ __forceinline__ uint64_t load_gen_base(const RingDescriptor& d) {
    return ld_relaxed_sys(reinterpret_cast<const uint64_t*>(d.gen_base_ptr));
}
__device__ __forceinline__ uint64_t expected_generation(const RingDescriptor& d, int chunk_idx) {
    return generation(load_gen_base(d), chunk_idx);
}
// This PE's call number (RingDescriptor::call_ptr): written only by end_call() (and a refused call) on this
// PE, ordered by the stream (or graph), like the generation base.
__device__ __forceinline__ uint64_t load_call_number(const RingDescriptor& d) {
    return ld_relaxed_sys(reinterpret_cast<const uint64_t*>(d.call_ptr));
}
// The identity of this PE's current call of layer `layer` (what its producers write and its consumers expect).
__device__ __forceinline__ uint64_t expected_call(const RingDescriptor& d, int layer) {
    return call_identity(load_call_number(d), layer);
}
// One thread: count one more call of this PE (a call's end; a call refused inside a step).
__device__ __forceinline__ void advance_call_number(const RingDescriptor& d) {
    auto* word = reinterpret_cast<uint64_t*>(d.call_ptr);
    st_relaxed_sys(word, ld_relaxed_sys(word) + 1);
}
// One thread: advance the generation base after a call of `num_chunks` chunks, and the call number (the
// end-of-call kernel; the last kernel of the call that reads either).
__device__ __forceinline__ void end_call(const RingDescriptor& d, int num_chunks) {
    auto* word = reinterpret_cast<uint64_t*>(d.gen_base_ptr);
    st_relaxed_sys(word, next_base(ld_relaxed_sys(word), num_chunks));
    advance_call_number(d);
}

// --- producer side ------------------------------------------------------------------------------------

namespace detail {

// One thread: bounded wait until every word of the chunk's slot mask holds its required bits, or (when
// `other_ready` is not null) until that word of this PE holds `gen`. One deadline for the whole wait.
// Returns false on timeout (error record kind reuse) or abort.
__device__ inline bool wait_slot_free(const RingDescriptor& d, int chunk_idx, const uint64_t* other_ready,
                                      uint64_t gen) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    const uint64_t* mask = ack_mask_of(d, slot);
    Deadline deadline(d);
    int w = 0;
    uint64_t required = 0, observed = 0;
    for (;;) {
        // acquire: pairs with the release fence in ack(); the consumers' reads of the previous generation
        // are complete before we overwrite the slot. A word seen complete stays complete until the slot is
        // acquired: the owner clears the mask only after a wait saw every word complete (the other part of
        // a split producer, whose publication this wait then also accepts below).
        for (; w < d.mask_words; ++w) {
            required = required_mask_word(w, d.num_ranks);
            observed = ld_acquire_sys(mask + w);
            if ((observed & required) != required) break;
        }
        if (w == d.mask_words) return true;
        // acquire: pairs with the release in the other part's publication (signal_generation), which that
        // part issued after its own wait for this slot saw the mask complete.
        if (other_ready != nullptr && ld_acquire_sys(other_ready) == gen) return true;
        if (deadline.expired(d)) {
            // peer: the lowest consumer whose acknowledgement is missing (the rank that failed to act, named
            // in the abort word the other PEs read), not this waiting owner.
            const uint64_t missing = required & ~observed;
            const int peer = missing != 0 ? w * kRanksPerMaskWord + (__ffsll(static_cast<long long>(missing)) - 1)
                                          : d.rank;
            deadline.give_up(d, kErrorReuse, peer, slot, chunk_idx, required, observed, missing);
            return false;
        }
    }
}

}  // namespace detail

// Block-level: wait until every required consumer acknowledged the slot's previous use, then (reset=true)
// clear the mask for the next one. Returns false on timeout (error record written, kind reuse) or abort.
// With several blocks, let every block wait with reset=false and one block (grid_last_block) reset.
__device__ inline bool wait_reusable(const RingDescriptor& d, int chunk_idx, bool reset) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        ok = detail::wait_slot_free(d, chunk_idx, nullptr, 0) ? 1 : 0;
        if (ok && reset) {
            // Ordered before this generation's publication by the release fence in publish().
            uint64_t* mask = ack_mask_of(d, slot_of(chunk_idx, d.num_slots));
            for (int w = 0; w < d.mask_words; ++w) st_relaxed_sys(mask + w, 0ull);
        }
    }
    __syncthreads();
    return ok != 0;
}

// Block-level, for a chunk whose route and layout parts are written and published by two launches that
// each acquire the slot (RingKernels.produce(parts="route") and produce(parts="layout"), either order, one
// stream or two): wait until the slot is reusable as in wait_reusable, OR until `other_ready_local` (this
// PE's ready word of the OTHER part: route_ready_word / layout_ready_word) holds `gen` -- the other part
// then already acquired the slot for this generation and may have cleared the mask, so waiting for a
// complete mask would never end. Never resets: the caller resets the mask before its own publication
// (grid_publish(..., reset_mask=true, ...)). Both parts may reset: a consumer acknowledges `gen` only
// after it saw BOTH publications, each released after its part's reset, so no reset clears a bit of
// `gen`. Returns false on timeout (kind reuse) or abort.
__device__ inline bool wait_reusable_or_published(const RingDescriptor& d, int chunk_idx,
                                                  const uint64_t* other_ready_local, uint64_t gen) {
    __shared__ int ok;
    if (threadIdx.x == 0) ok = detail::wait_slot_free(d, chunk_idx, other_ready_local, gen) ? 1 : 0;
    __syncthreads();
    return ok != 0;
}

// Block-level alias: the producer's "acquire slot" (wait reusable + reset), for single-block producers.
__device__ __forceinline__ bool acquire_slot(const RingDescriptor& d, int chunk_idx, bool reset = true) {
    return wait_reusable(d, chunk_idx, reset);
}

// One thread, after the payload stores of all threads are ordered before it (__syncthreads, or the
// grid_last_block handshake): release the payload, then SET the owner-side generation word.
__device__ __forceinline__ void signal_generation(const RingDescriptor& d, uint64_t* word, uint64_t gen) {
    nvshmem_fence();  // release: pairs with the acquire in wait_ready(); payload before the signal
    nvshmemx_signal_op(word, gen, NVSHMEM_SIGNAL_SET, d.rank);
}

// Block-level: publish route readiness (topk_idx, topk_weights and meta) of chunk `chunk_idx`.
__device__ __forceinline__ void publish_route(const RingDescriptor& d, int chunk_idx, uint64_t gen) {
    __syncthreads();  // every thread's payload stores precede thread 0's release fence
    if (threadIdx.x == 0) signal_generation(d, route_ready_word(d, slot_of(chunk_idx, d.num_slots)), gen);
}

// Block-level: publish layout readiness (x, x_sf) of chunk `chunk_idx`.
__device__ __forceinline__ void publish_layout(const RingDescriptor& d, int chunk_idx, uint64_t gen) {
    __syncthreads();  // every thread's payload stores precede thread 0's release fence
    if (threadIdx.x == 0) signal_generation(d, layout_ready_word(d, slot_of(chunk_idx, d.num_slots)), gen);
}

// One thread: write the slot's metadata row (part of the route payload); `call_id`: this call's identity
// (expected_call(d, layer)).
__device__ __forceinline__ void write_meta(const RingDescriptor& d, int chunk_idx, int64_t token_base,
                                           int num_valid, uint64_t gen, uint64_t call_id) {
    int64_t* meta = meta_of(d, slot_of(chunk_idx, d.num_slots));
    meta[kMetaTokenBase] = token_base;
    meta[kMetaNumValid] = num_valid;
    meta[kMetaChunkIdx] = chunk_idx;
    meta[kMetaPayloadGen] = static_cast<int64_t>(gen);
    meta[kMetaCallId] = static_cast<int64_t>(call_id);
}
// write_meta of layer 0 (a ring of one kind of call: user kernels, symmring_produce without a layer).
__device__ __forceinline__ void write_meta(const RingDescriptor& d, int chunk_idx, int64_t token_base,
                                           int num_valid, uint64_t gen) {
    write_meta(d, chunk_idx, token_base, num_valid, gen, expected_call(d, 0));
}

// --- consumer side ------------------------------------------------------------------------------------

// One thread: bounded wait (one deadline for both words) until both of `src_rank`'s ready words of the
// chunk's slot equal `expected`. Returns false on timeout (error record: kind route_ready or layout_ready,
// peer = src_rank). Other threads may read the payload after it returns true once a barrier orders them
// after this thread (wait_ready), or several threads each poll their own source. extra_ns: as Deadline's.
__device__ inline bool poll_ready(const RingDescriptor& d, int chunk_idx, int src_rank, uint64_t expected,
                                  uint64_t extra_ns = 0) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    uint64_t* route_local = route_ready_word(d, slot);
    uint64_t* layout_local = layout_ready_word(d, slot);
    const uint64_t* route = peer_ptr(d, route_local, src_rank);
    const uint64_t* layout = peer_ptr(d, layout_local, src_rank);
    Deadline deadline(d, extra_ns);
    for (;;) {
        // acquire: pairs with the release fence of the publications (signal_generation) on src_rank.
        const uint64_t route_gen = load_word_acquire(route, route_local, src_rank);
        const uint64_t layout_gen = load_word_acquire(layout, layout_local, src_rank);
        if (is_ready(route_gen, layout_gen, expected)) return true;
        if (deadline.expired(d)) {
            const bool route_late = route_gen != expected;
            deadline.give_up(d, route_late ? kErrorRoute : kErrorLayout, src_rank, slot, chunk_idx, expected,
                             route_late ? route_gen : layout_gen, 0);
            return false;
        }
    }
}

// Block-level: poll_ready by thread 0, then the block's barrier. Returns false on timeout.
__device__ inline bool wait_ready(const RingDescriptor& d, int chunk_idx, int src_rank, uint64_t expected) {
    __shared__ int ok;
    if (threadIdx.x == 0) ok = poll_ready(d, chunk_idx, src_rank, expected);
    __syncthreads();  // the other threads read the payload only after thread 0's acquire
    return ok != 0;
}

// Block-level: bounded wait until `src_rank`'s copy of ONE ready word of the chunk's slot (`word_local`:
// route_ready_word or layout_ready_word, this PE's address) equals `expected`. For consumers that use the
// route payload before the layout is published (count on topk_idx while x is still being written); a
// read of x / x_sf still needs the layout word. Returns false on timeout (error record `kind`).
// `deadline`: thread 0's Deadline of the whole wait, when one kernel waits for several words in turn (both
// parts of a chunk: one bound for all of them, docs/PROTOCOL.md section 10); other threads pass any value.
__device__ inline bool wait_published(const RingDescriptor& d, int chunk_idx, int src_rank, uint64_t* word_local,
                                      uint64_t expected, ErrorKind kind, Deadline& deadline) {
    __shared__ int ok;
    if (threadIdx.x == 0) {
        const uint64_t* word = peer_ptr(d, word_local, src_rank);
        uint64_t observed;
        ok = 1;
        // acquire: pairs with the release fence of the publication (signal_generation) on src_rank.
        while ((observed = load_word_acquire(word, word_local, src_rank)) != expected) {
            if (deadline.expired(d)) {
                deadline.give_up(d, kind, src_rank, slot_of(chunk_idx, d.num_slots), chunk_idx, expected,
                                 observed, 0);
                ok = 0;
                break;
            }
        }
    }
    __syncthreads();  // the other threads read the payload only after thread 0's acquire
    return ok != 0;
}

// wait_published with a deadline of its own (one word).
__device__ inline bool wait_published(const RingDescriptor& d, int chunk_idx, int src_rank, uint64_t* word_local,
                                      uint64_t expected, ErrorKind kind) {
    Deadline deadline(d);
    return wait_published(d, chunk_idx, src_rank, word_local, expected, kind, deadline);
}

// One thread, after the acquire of `src_rank`'s route readiness of chunk `chunk_idx` at generation
// `expected_gen` (wait_ready or wait_published(route) returned true; in another thread of the block, with
// the __syncthreads that ends those waits in between): whether the slot's meta row names that chunk and
// generation (kMetaChunkIdx, kMetaPayloadGen) and this PE's call (kMetaCallId == `expected_id`, this PE's
// expected_call(d, layer)), all written by write_meta before the route publication. On another chunk or
// generation (a slot overwritten while in use) it records kErrorStalePayload (peer = src_rank, expected =
// expected_gen, observed = the payload generation found, missing = the chunk index found); on another call
// (the ranks' call sequences diverged: the same generations from another layer's or another call's
// publication) kErrorCallMismatch (expected = expected_id, observed = the identity found); either aborts the
// ring and returns false: do not use the payload. One more word read than the generation check alone.
__device__ inline bool check_payload(const RingDescriptor& d, int chunk_idx, int src_rank, uint64_t expected_gen,
                                     uint64_t expected_id) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    int64_t* meta_local = meta_of(d, slot);
    const int64_t* meta = peer_ptr(d, meta_local, src_rank);
    int64_t gen, idx, id;
    if (meta != nullptr) {
        gen = static_cast<int64_t>(ld_relaxed_sys(reinterpret_cast<const uint64_t*>(meta + kMetaPayloadGen)));
        idx = static_cast<int64_t>(ld_relaxed_sys(reinterpret_cast<const uint64_t*>(meta + kMetaChunkIdx)));
        id = static_cast<int64_t>(ld_relaxed_sys(reinterpret_cast<const uint64_t*>(meta + kMetaCallId)));
    } else {
        gen = nvshmem_int64_g(meta_local + kMetaPayloadGen, src_rank);
        idx = nvshmem_int64_g(meta_local + kMetaChunkIdx, src_rank);
        id = nvshmem_int64_g(meta_local + kMetaCallId, src_rank);
    }
    if (static_cast<uint64_t>(gen) != expected_gen || idx != chunk_idx) {
        record_error(d, kErrorStalePayload, src_rank, slot, chunk_idx, expected_gen, static_cast<uint64_t>(gen),
                     static_cast<uint64_t>(idx));
        return false;
    }
    if (static_cast<uint64_t>(id) != expected_id) {
        record_error(d, kErrorCallMismatch, src_rank, slot, chunk_idx, expected_id, static_cast<uint64_t>(id), 0);
        return false;
    }
    return true;
}
// check_payload of layer 0 (the write_meta overload without an identity).
__device__ inline bool check_payload(const RingDescriptor& d, int chunk_idx, int src_rank, uint64_t expected_gen) {
    return check_payload(d, chunk_idx, src_rank, expected_gen, expected_call(d, 0));
}

// Block-level: acknowledge `src_rank`'s slot of chunk `chunk_idx` after this PE's last read of it
// (payload and metadata). With several reading blocks, call it from one block after all finished
// (grid_last_block). Sets this PE's bit in the owner's mask with an atomic fetch-OR; if the bit was
// already set (this PE acknowledged the generation twice, or acknowledged a slot the owner never
// acquired), records kErrorDoubleAck (peer = src_rank, expected = the bit, observed = the mask word
// before the OR) and aborts the ring. A second acknowledgement that arrives after the owner reset the
// mask for the next generation cannot be told apart from a first one.
__device__ inline void ack(const RingDescriptor& d, int chunk_idx, int src_rank) {
    __syncthreads();  // every thread's reads of the slot precede thread 0's release fence
    if (threadIdx.x == 0) {
        const int slot = slot_of(chunk_idx, d.num_slots);
        uint64_t* word = ack_mask_of(d, slot) + ack_word(d.rank);
        const uint64_t bit = ack_bit(d.rank);
        nvshmem_fence();  // release: pairs with the acquire in wait_reusable(); reads before the bit
        // System-scope atomicOr through the P2P mapping (NVSHMEM's remote AMO where there is none).
        const uint64_t before = nvshmem_uint64_atomic_fetch_or(word, bit, src_rank);
        if (before & bit) record_error(d, kErrorDoubleAck, src_rank, slot, chunk_idx, bit, before, 0);
    }
}

// --- grid helpers -------------------------------------------------------------------------------------

// Programmatic dependent launch (symmring/pdl.py): a kernel the host may launch while the previous kernel
// on its stream still runs calls grid_dependency_wait before it touches memory (it returns once that kernel
// completed and its writes are visible: stream order), then grid_dependents_launch to let the next one
// start the same way. Both are no-ops for a plain launch.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Block-level: true in exactly one block, the last of the grid to arrive; every block's earlier memory
// operations are ordered before whatever that block does next. `counter` (device memory, zero before the
// launch) is reset to zero by the last block so the next launch or graph replay finds it clean.
__device__ inline bool grid_last_block(unsigned int* counter) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int num_blocks = gridDim.x * gridDim.y * gridDim.z;
        __threadfence();  // release at gpu scope: this block's work before its arrival
        const unsigned int prev = atomicAdd(counter, 1u);
        last = prev == num_blocks - 1;
        if (last) {
            __threadfence();  // acquire: the other blocks' work before what the last block does next
            atomicExch(counter, 0u);
        }
    }
    __syncthreads();
    return last != 0;
}

// Block-level, in every block of a grid that wrote (parts of) chunk `chunk_idx`'s payload into its slot,
// after its stores: the last block to arrive publishes for the whole grid. With `reset_mask` (the grid
// acquired the slot: every block waited with wait_reusable(..., reset=false) before writing) it first
// clears the acknowledgement mask; the reset is ordered before the publications by their release fence
// (ordering points (4) then (1)). `counter`: as for grid_last_block.
__device__ inline void grid_publish(const RingDescriptor& d, int chunk_idx, uint64_t gen, unsigned int* counter,
                                    bool reset_mask, bool route, bool layout) {
    if (!grid_last_block(counter)) return;
    if (threadIdx.x != 0) return;
    CHAIN_STAMP_ANY(4);
    const int slot = slot_of(chunk_idx, d.num_slots);
    if (reset_mask) {
        uint64_t* mask = ack_mask_of(d, slot);
        for (int w = 0; w < d.mask_words; ++w) st_relaxed_sys(mask + w, 0ull);
    }
    // One release for both words (a system-scope fence takes ~2 us on an H100): pairs with wait_ready's acquire
    // of either; the mask's reset and every block's payload stores precede it.
    if (route || layout) nvshmem_fence();
    if (route) nvshmemx_signal_op(route_ready_word(d, slot), gen, NVSHMEM_SIGNAL_SET, d.rank);
    CHAIN_STAMP_ANY(5);
    if (layout) nvshmemx_signal_op(layout_ready_word(d, slot), gen, NVSHMEM_SIGNAL_SET, d.rank);
    CHAIN_STAMP_ANY(6);
}

}  // namespace symmring
