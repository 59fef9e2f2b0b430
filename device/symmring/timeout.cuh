// Bounded waits and the device error record.
//
// Every spin-wait in symmring is bounded by RingDescriptor::timeout_ns, measured with %globaltimer (a
// nanosecond clock shared by all SMs). A wait that expires writes the error record (layout.py ERROR_*
// words: kind, rank, peer, slot, chunk, expected, observed, missing mask) and returns false; the kernel
// then exits cleanly. No trap(): a trap leaves a sticky CUDA error that is blamed on the next launch and
// makes the process unusable. The host turns the record into ProtocolTimeout (kernels.check_errors()).
//
// First error wins: the kind word is claimed with atomicCAS(0 -> kind), so the record names the wait
// that expired first, not the cascade of waits that bail out after it. Once a record is pending every
// later wait on this PE gives up at its next check instead of waiting a full timeout of its own.
#pragma once
#include <stdint.h>

#include "descriptor.cuh"

namespace symmring {

// Bound used when RingDescriptor::timeout_ns is 0 (env.DEFAULT_TIMEOUT_S).
constexpr uint64_t kDefaultTimeoutNs = 60ull * 1000ull * 1000ull * 1000ull;
// Polls between two reads of the clock and of the error record (keeps the spin loop tight).
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

// Whether some wait on this PE already expired (volatile: the record is written by other blocks/kernels).
__device__ __forceinline__ bool error_pending(const RingDescriptor& desc) {
    return *reinterpret_cast<volatile int64_t*>(error_record(desc) + kErrKind) != kErrorNone;
}

// Write the error record unless an earlier error already claimed it.
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
}

// A deadline for one bounded wait: call expired() once per poll; it reads the clock (and the error
// record) only every kPollsPerCheck polls.
struct Deadline {
    uint64_t start_ns;
    uint64_t limit_ns;
    uint32_t polls;
    bool aborted;  // true when the wait gave up because another wait already recorded an error

    __device__ __forceinline__ explicit Deadline(const RingDescriptor& desc)
        : start_ns(globaltimer_ns()), limit_ns(timeout_ns_of(desc)), polls(0), aborted(false) {}

    __device__ __forceinline__ bool expired(const RingDescriptor& desc) {
        if (++polls % kPollsPerCheck != 0) return false;
        if (error_pending(desc)) {
            aborted = true;
            return true;
        }
        return globaltimer_ns() - start_ns > limit_ns;
    }
};

}  // namespace symmring
