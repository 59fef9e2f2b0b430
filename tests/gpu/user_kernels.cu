// "User" kernels for the GPU tests: they publish and consume through <symmring/protocol.cuh> only, the
// way a producer kernel outside symmring would (docs/GPU.md, "Publishing from your own kernel").
//
// Payload values are a hash of (rank, chunk, generation, part, element), so a consumer checks every
// word it reads without a reference copy, and a value left over from an earlier lap, call or graph
// replay (an older generation) never matches.
#include <stdint.h>

#include <symmring/protocol.cuh>

using namespace symmring;

namespace {

__device__ __forceinline__ uint32_t mix32(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return static_cast<uint32_t>(z ^ (z >> 31));
}

// Element `e` of payload part `part` (0 x, 1 x_sf, 2 topk_idx, 3 topk_weights) of (rank, chunk, gen).
__device__ __forceinline__ uint32_t payload_word(int rank, int chunk, uint64_t gen, int part, uint64_t e) {
    return mix32((gen << 24) ^ (uint64_t(rank) << 16) ^ (uint64_t(part) << 12) ^ (e * 0x2545F4914F6CDD1Dull) ^
                 uint64_t(chunk));
}

// Valid tokens of (rank, chunk): every count 0..T occurs, zero-token chunks included. Mirrored by
// user_num_valid() in tests/gpu/gpu_helpers.py.
__device__ __forceinline__ int user_num_valid(int rank, int chunk, int tokens_per_slot) {
    return (rank * 7 + chunk * 5 + 3) % (tokens_per_slot + 1);
}

__device__ __forceinline__ uint64_t row_words(const RingDescriptor& d) { return x_row_bytes(d) / 4; }

// Random delay of up to max_ns nanoseconds (xorshift state per thread).
__device__ __forceinline__ void random_delay(uint64_t& state, uint32_t max_ns) {
    if (max_ns == 0) return;
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const uint32_t ns = static_cast<uint32_t>(state % max_ns);
    if (ns > 0) __nanosleep(ns);
}

// All threads of the block: write the payload of (d.rank, chunk, gen) into slot `slot`.
__device__ void write_payload(const RingDescriptor& d, int chunk, uint64_t gen, int num_valid) {
    const int slot = slot_of(chunk, d.num_slots);
    auto* x = reinterpret_cast<uint32_t*>(x_of(d, slot));
    auto* sf = reinterpret_cast<uint32_t*>(x_sf_of(d, slot));
    auto* idx = reinterpret_cast<uint32_t*>(topk_idx_of(d, slot));
    auto* w = reinterpret_cast<uint32_t*>(topk_weights_of(d, slot));
    const uint64_t nx = uint64_t(num_valid) * row_words(d), nsf = uint64_t(num_valid) * d.num_sf;
    const uint64_t nk = uint64_t(num_valid) * d.num_topk;
    for (uint64_t e = threadIdx.x; e < nx; e += blockDim.x) x[e] = payload_word(d.rank, chunk, gen, 0, e);
    for (uint64_t e = threadIdx.x; e < nsf; e += blockDim.x) sf[e] = payload_word(d.rank, chunk, gen, 1, e);
    for (uint64_t e = threadIdx.x; e < nk; e += blockDim.x) {
        idx[e] = payload_word(d.rank, chunk, gen, 2, e) % d.num_experts;
        w[e] = payload_word(d.rank, chunk, gen, 3, e);
    }
}

// All threads of the block: mismatches between (x, sf, idx, w, meta) and the payload of (src, chunk, gen).
__device__ uint64_t check_payload(const RingDescriptor& d, int src, int chunk, uint64_t gen, const uint32_t* x,
                                  const uint32_t* sf, const uint32_t* idx, const uint32_t* w,
                                  const int64_t* meta) {
    const int num_valid = user_num_valid(src, chunk, d.tokens_per_slot);
    uint64_t bad = 0;
    if (threadIdx.x == 0) {
        bad += meta[kMetaTokenBase] != chunk_token_base(chunk, d.tokens_per_slot);
        bad += meta[kMetaNumValid] != num_valid;
        bad += meta[kMetaChunkIdx] != chunk;
        bad += meta[kMetaPayloadGen] != static_cast<int64_t>(gen);
    }
    const uint64_t nx = uint64_t(num_valid) * row_words(d), nsf = uint64_t(num_valid) * d.num_sf;
    const uint64_t nk = uint64_t(num_valid) * d.num_topk;
    for (uint64_t e = threadIdx.x; e < nx; e += blockDim.x) bad += x[e] != payload_word(src, chunk, gen, 0, e);
    for (uint64_t e = threadIdx.x; e < nsf; e += blockDim.x) bad += sf[e] != payload_word(src, chunk, gen, 1, e);
    for (uint64_t e = threadIdx.x; e < nk; e += blockDim.x) {
        bad += idx[e] != payload_word(src, chunk, gen, 2, e) % d.num_experts;
        bad += w[e] != payload_word(src, chunk, gen, 3, e);
    }
    return bad;
}

}  // namespace

// Soak: block 0 produces chunks 0..num_chunks-1 of this PE (acquire, write, publish route and layout in
// an order that alternates), block 1 consumes every chunk of every PE straight from the owner's slot
// (wait_ready, check every word in place, ack). Random delays of up to max_delay_ns on both sides.
// stats: [0] mismatched words, [1] slot reads checked, [2] bytes checked, [3] chunks produced.
extern "C" __global__ void user_soak(const RingDescriptor* desc_ptr, int num_chunks, unsigned int max_delay_ns,
                                     unsigned long long seed, unsigned long long* stats) {
    const RingDescriptor& d = *desc_ptr;
    const uint64_t base = load_gen_base(d);
    uint64_t rng = seed ^ (uint64_t(d.rank) << 32) ^ (uint64_t(blockIdx.x) << 48) ^ (threadIdx.x + 1);
    if (blockIdx.x == 0) {
        for (int chunk = 0; chunk < num_chunks; ++chunk) {
            const uint64_t gen = generation(base, chunk);
            if (!acquire_slot(d, chunk, /*reset=*/true)) return;  // timed out: record written
            const int num_valid = user_num_valid(d.rank, chunk, d.tokens_per_slot);
            if (threadIdx.x == 0) random_delay(rng, max_delay_ns);
            __syncthreads();
            write_payload(d, chunk, gen, num_valid);
            if (threadIdx.x == 0) write_meta(d, chunk, chunk_token_base(chunk, d.tokens_per_slot), num_valid, gen);
            if (chunk & 1) {
                publish_layout(d, chunk, gen);
                if (threadIdx.x == 0) random_delay(rng, max_delay_ns);
                publish_route(d, chunk, gen);
            } else {
                publish_route(d, chunk, gen);
                if (threadIdx.x == 0) random_delay(rng, max_delay_ns);
                publish_layout(d, chunk, gen);
            }
        }
        if (threadIdx.x == 0) atomicAdd(stats + 3, static_cast<unsigned long long>(num_chunks));
        return;
    }
    uint64_t bad = 0, reads = 0, bytes = 0;
    for (int chunk = 0; chunk < num_chunks; ++chunk) {
        const uint64_t gen = generation(base, chunk);
        const int slot = slot_of(chunk, d.num_slots);
        for (int i = 0; i < d.num_ranks; ++i) {
            const int src = (d.rank + chunk + i) % d.num_ranks;  // vary the order sources are visited
            if (!wait_ready(d, chunk, src, gen)) goto done;
            const auto* x = peer_ptr(d, reinterpret_cast<const uint32_t*>(x_of(d, slot)), src);
            const auto* sf = peer_ptr(d, reinterpret_cast<const uint32_t*>(x_sf_of(d, slot)), src);
            const auto* idx = peer_ptr(d, reinterpret_cast<const uint32_t*>(topk_idx_of(d, slot)), src);
            const auto* w = peer_ptr(d, reinterpret_cast<const uint32_t*>(topk_weights_of(d, slot)), src);
            const auto* meta = peer_ptr(d, static_cast<const int64_t*>(meta_of(d, slot)), src);
            if (x == nullptr || meta == nullptr) {  // not load/store reachable: this test needs P2P
                bad += 1;
            } else {
                bad += check_payload(d, src, chunk, gen, x, sf, idx, w, meta);
            }
            if (threadIdx.x == 0) {
                const int num_valid = user_num_valid(src, chunk, d.tokens_per_slot);
                reads += 1;
                bytes += uint64_t(num_valid) * (x_row_bytes(d) + 4ull * d.num_sf + 8ull * d.num_topk);
                random_delay(rng, max_delay_ns);
            }
            ack(d, chunk, src);
        }
    }
done:
    if (bad) atomicAdd(stats + 0, static_cast<unsigned long long>(bad));
    if (threadIdx.x == 0) {
        atomicAdd(stats + 1, static_cast<unsigned long long>(reads));
        atomicAdd(stats + 2, static_cast<unsigned long long>(bytes));
    }
}

// Fill the producer's source tensors of chunk `chunk` with the payload of (d.rank, chunk, generation read
// from gen_base): what a router/TopK/layout kernel would write before the ready-made producer copies it.
extern "C" __global__ void user_fill(const RingDescriptor* desc_ptr, int chunk, uint32_t* x, uint32_t* sf,
                                     uint32_t* idx, uint32_t* w) {
    const RingDescriptor& d = *desc_ptr;
    const uint64_t gen = expected_generation(d, chunk);
    const int num_valid = user_num_valid(d.rank, chunk, d.tokens_per_slot);
    const uint64_t nx = uint64_t(num_valid) * row_words(d), nsf = uint64_t(num_valid) * d.num_sf;
    const uint64_t nk = uint64_t(num_valid) * d.num_topk;
    const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
    for (uint64_t e = blockIdx.x * blockDim.x + threadIdx.x; e < nx; e += stride)
        x[e] = payload_word(d.rank, chunk, gen, 0, e);
    for (uint64_t e = blockIdx.x * blockDim.x + threadIdx.x; e < nsf; e += stride)
        sf[e] = payload_word(d.rank, chunk, gen, 1, e);
    for (uint64_t e = blockIdx.x * blockDim.x + threadIdx.x; e < nk; e += stride) {
        idx[e] = payload_word(d.rank, chunk, gen, 2, e) % d.num_experts;
        w[e] = payload_word(d.rank, chunk, gen, 3, e);
    }
}

// Check what the ready-made consumer pulled for (src, chunk) against the payload of the current
// generation. One block. stats: [0] mismatched words, [1] chunks checked.
extern "C" __global__ void user_check(const RingDescriptor* desc_ptr, int chunk, int src, const uint32_t* x,
                                      const uint32_t* sf, const uint32_t* idx, const uint32_t* w,
                                      const long long* meta, unsigned long long* stats) {
    const RingDescriptor& d = *desc_ptr;
    const uint64_t gen = expected_generation(d, chunk);
    const uint64_t bad = check_payload(d, src, chunk, gen, x, sf, idx, w, reinterpret_cast<const int64_t*>(meta));
    if (bad) atomicAdd(stats + 0, static_cast<unsigned long long>(bad));
    if (threadIdx.x == 0) atomicAdd(stats + 1, 1ull);
}

// One thread: spin `delay_ns` nanoseconds (%globaltimer), then SET this PE's copy of the symmetric word `word` to
// `value` (as another PE's raise_abort would store into this PE's abort word). Launched BEFORE the wait it must
// end, so the store never needs a launch while that wait spins (test_abort_word_ends_a_running_wait_at_once).
extern "C" __global__ void user_store_after(uint64_t* word, unsigned long long value, unsigned long long delay_ns) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const uint64_t start = globaltimer_ns();
    while (globaltimer_ns() - start < delay_ns) __nanosleep(1000);
    nvshmemx_signal_op(word, value, NVSHMEM_SIGNAL_SET, nvshmem_my_pe());
}
