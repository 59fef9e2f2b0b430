// Bounded waits, the device error record and the ring's abort word.
//
// Every spin-wait in symmring is bounded by RingDescriptor::timeout_ns, measured with %globaltimer (a
// nanosecond clock shared by all SMs). A wait that expires writes the error record (layout.py ERROR_*
// words: kind, rank, peer, slot, chunk, expected, observed, missing mask) and returns false; the kernel
// then exits cleanly. No trap(): a trap leaves a sticky CUDA error that is blamed on the next launch and
// makes the process unusable. The host turns the record into a named error (kernels.check_errors()).
//
// First error wins: the kind word is claimed with atomicCAS(0 -> kind), so the record names the wait
// that expired first, not the cascade of waits that bail out after it. Once a record is pending every
// later wait on this PE gives up at its next check instead of waiting a full timeout of its own.
//
// Abort: the PE whose record_error claims its record for its own error (any kind but kErrorAborted) also
// raises the abort word of every other PE (nvshmem_uint64_atomic_compare_swap 0 -> packed word: a
// system-scope atomicCAS through the P2P mapping; the first abort wins on each PE). Every wait checks its
// own PE's abort word with the clock (Deadline) and gives up at that check, recording kErrorAborted with
// the origin PE; kernels that test error_pending() at entry return at once. The word is self-contained
// (origin, its error kind, its peer and chunk in one 64-bit value), so it needs no ordering with any other
// store. Only reset (collective, after every device is idle) clears records and abort words.
#pragma once
#include <stdint.h>

#include <nvshmem.h>
#include <nvshmemx.h>

#include "descriptor.cuh"

namespace symmring {

// Bound used when RingDescriptor::timeout_ns is 0 (env.DEFAULT_TIMEOUT_S).
constexpr uint64_t kDefaultTimeoutNs = 60ull * 1000ull * 1000ull * 1000ull;
// Polls between two reads of the clock, the error record and the abort word (keeps the spin loop tight).
constexpr uint32_t kPollsPerCheck = 64;

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint64_t timeout_ns_of(const RingDescriptor& desc) {
    return desc.timeout_ns ? desc.timeout_ns : kDefaultTimeoutNs;
}

__device__ __forceinline__ int64_t* error_record(const RingDescriptor& desc) {
    return reinterpret_cast<int64_t*>(desc.error_ptr);
}

__device__ __forceinline__ uint64_t* abort_word_of(const RingDescriptor& desc) {
    return reinterpret_cast<uint64_t*>(desc.abort_ptr);
}

// Whether this PE's error record is claimed (volatile: written by other blocks and kernels of this PE).
__device__ __forceinline__ bool record_pending(const RingDescriptor& desc) {
    return *reinterpret_cast<volatile int64_t*>(error_record(desc) + kErrKind) != kErrorNone;
}

// This PE's abort word (0: no PE aborted the ring). Relaxed system-scope load: other GPUs write it.
__device__ __forceinline__ uint64_t load_abort_word(const RingDescriptor& desc) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(abort_word_of(desc)) : "memory");
    return v;
}

// The abort word PE `origin` raises for its error `kind` about (peer, chunk) (layout.unpack_abort reads
// it). A chunk outside [0, kAbortChunkMax) is stored as kAbortChunkMax.
__device__ __forceinline__ uint64_t pack_abort(int origin, ErrorKind kind, int peer, int chunk) {
    constexpr uint64_t kField = (1ull << kAbortFieldBits) - 1;
    constexpr uint64_t kChunkMax = kAbortChunkMax;
    const uint64_t c = (chunk < 0 || static_cast<uint64_t>(chunk) > kChunkMax) ? kChunkMax
                                                                                 : static_cast<uint64_t>(chunk);
    return (1ull << kAbortFlagShift) | ((static_cast<uint64_t>(kind) & 0x7f) << kAbortKindShift) |
           ((static_cast<uint64_t>(origin) & kField) << kAbortOriginShift) |
           ((static_cast<uint64_t>(peer) & kField) << kAbortPeerShift) | (c << kAbortChunkShift);
}
__device__ __forceinline__ int abort_origin(uint64_t word) {
    return static_cast<int>((word >> kAbortOriginShift) & ((1ull << kAbortFieldBits) - 1));
}

// Whether this PE must stop: some wait of this PE already recorded an error, or another PE raised this
// PE's abort word. Kernels test it at entry and return at once.
__device__ __forceinline__ bool error_pending(const RingDescriptor& desc) {
    return record_pending(desc) || load_abort_word(desc) != 0;
}

// One thread: raise the abort word of every other PE (the first abort wins on each). One atomic per PE,
// no wait. System-scope atomicCAS through the P2P mapping (NVSHMEM's remote AMO where there is none).
__device__ inline void raise_abort(const RingDescriptor& desc, ErrorKind kind, int peer, int chunk) {
    const uint64_t word = pack_abort(desc.rank, kind, peer, chunk);
    uint64_t* local = abort_word_of(desc);
    for (int pe = 0; pe < desc.num_ranks; ++pe)
        if (pe != desc.rank) nvshmem_uint64_atomic_compare_swap(local, 0ull, word, pe);
}

// One thread: write the error record unless an earlier error already claimed it. The PE that claims it
// for its own error (any kind but kErrorAborted) then aborts the ring on every other PE.
__device__ inline void record_error(const RingDescriptor& desc, ErrorKind kind, int peer, int slot,
                                    int chunk, uint64_t expected, uint64_t observed, uint64_t missing) {
    int64_t* err = error_record(desc);
    auto* kind_word = reinterpret_cast<unsigned long long*>(err + kErrKind);
    if (atomicCAS(kind_word, 0ull, static_cast<unsigned long long>(kind)) != 0ull) return;
    err[kErrRank] = desc.rank;
    err[kErrPeer] = peer;
    err[kErrSlot] = slot;
    err[kErrChunk] = chunk;
    err[kErrExpected] = static_cast<int64_t>(expected);
    err[kErrObserved] = static_cast<int64_t>(observed);
    err[kErrMissing] = static_cast<int64_t>(missing);
    __threadfence_system();  // the record is complete before the kernel ends (host reads after sync)
    if (kind != kErrorAborted) raise_abort(desc, kind, peer, chunk);
}

// A deadline for one bounded wait. Make ONE per wait call, before its loop over words or sources, so the
// bound is not restarted per word or source. Call expired() once per poll; it reads the clock, the error
// record and the abort word only every kPollsPerCheck polls. When it returns true, call give_up(...) with
// what the wait awaited: it records the wait's own timeout, or kErrorAborted naming the origin when another
// PE aborted the ring, or nothing when this PE already holds a record.
struct Deadline {
    uint64_t start_ns;
    uint64_t limit_ns;
    uint32_t polls;
    bool aborted;         // the wait gave up because of an earlier error (this PE's record or an abort word)
    uint64_t abort_seen;  // the abort word that ended the wait (0: none)

    // extra_ns: added to the ring's bound, for a wait that may start before the wait it depends on (bounded still).
    __device__ __forceinline__ explicit Deadline(const RingDescriptor& desc, uint64_t extra_ns = 0)
        : start_ns(globaltimer_ns()), limit_ns(timeout_ns_of(desc) + extra_ns), polls(0), aborted(false),
          abort_seen(0) {}

    __device__ __forceinline__ bool expired(const RingDescriptor& desc) {
        if (++polls % kPollsPerCheck != 0) return false;
        if (record_pending(desc)) {
            aborted = true;
            return true;
        }
        const uint64_t word = load_abort_word(desc);
        if (word != 0) {
            aborted = true;
            abort_seen = word;
            return true;
        }
        return globaltimer_ns() - start_ns > limit_ns;
    }

    // One thread, after expired() returned true; kind..missing: the record of this wait's own timeout.
    // Aborted by another PE: kErrorAborted with peer = the origin PE, slot, chunk and expected of this
    // wait, observed = the abort word (the origin's kind, peer and chunk), missing = `kind` (what this
    // wait awaited).
    __device__ __forceinline__ void give_up(const RingDescriptor& desc, ErrorKind kind, int peer, int slot,
                                            int chunk, uint64_t expected, uint64_t observed, uint64_t missing) {
        if (abort_seen != 0)
            record_error(desc, kErrorAborted, abort_origin(abort_seen), slot, chunk, expected, abort_seen,
                         static_cast<uint64_t>(kind));
        else if (!aborted)
            record_error(desc, kind, peer, slot, chunk, expected, observed, missing);
    }
};

}  // namespace symmring
