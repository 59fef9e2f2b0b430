// Where the TMA kernels' time goes, by role: a developer's probe (tools/fused_probe.py --profile, docs/FUSED.md).
//
// Built only with SYMMRING_FUSED_PROFILE defined (a probe tree's `#define` ahead of the includes); otherwise every
// macro below is empty and the kernels' code is unchanged. With it, the producer (thread 0) and math warpgroup 0's
// thread 0 add the SM's cycles of their phases into shared memory (one slot per phase, each written by one
// thread) and, at the end, into the global array `symmring_fused_profile` that the probe reads, zeroes and divides
// by the calls it timed. Per block, `kBlockNs` adds the block's span (globaltimer) and `kLastEndNs` keeps the
// latest end, against the earliest start in `kFirstStartNs`: the launch's imbalance across blocks. The epilogue and
// item slots are stamped on wg64t's paths (its L1 items and L2 pairs); wg128t's items and wg64t's single-block L2
// items (hidden / 128 odd) count in the waits, the K blocks and the loop's total only.
#pragma once

namespace symmring_moe {
namespace fused {
namespace profile {

enum Slot : int {
    // the producer (thread 0)
    kProducerCycles,   // its whole loop
    kEmptyWait,        // waiting for a free ring stage
    kQueueWait,        // waiting for a free queue entry
    kArrivalWait,      // claim_l2_weights: an L2 item's claims and arrival reads (the claims' empty waits too)
    kProducerItems,    // items pushed
    kLateArrivals,     // L2 items whose arrivals were not seen at the first claim
    // math warpgroup 0's thread 0
    kMathCycles,       // its whole loop
    kPopWait,          // waiting for the next item
    kFullWait,         // waiting for a full stage
    kWgmma,            // the K block's wgmma, issue to wait_group 0
    kPromote,          // the promotion (and any wait on its scales)
    kL1Epilogue,       // an L1 item after its main loop: SwiGLU, amax exchange, quantisation, stores, release
    kAmaxWait,         //   of which the wait for the other warpgroup's row maxima
    kRelease,          //   of which the fences, the warpgroup's stored barrier and the arrival
    kL2Epilogue,       // an L2 item after its main loop: its stores
    kKBlocks,          // K blocks computed
    kMathItems,        // items computed
    // the launch (globaltimer, ns)
    kBlockNs,          // the blocks' spans, summed
    kFirstStartNs,     // the earliest block start (atomicMin; the probe sets it to ~0 first)
    kLastEndNs,        // the latest block end (atomicMax)
    kSlots
};

}  // namespace profile
}  // namespace fused
}  // namespace symmring_moe

#if defined(SYMMRING_FUSED_PROFILE)
#include <moe/fused_common.cuh>  // now_ns: globaltimer

extern "C" {
__device__ unsigned long long symmring_fused_profile[symmring_moe::fused::profile::kSlots];
}

namespace symmring_moe {
namespace fused {
namespace profile {

__device__ __forceinline__ unsigned long long* block_slots() {
    __shared__ unsigned long long slots[kSlots];
    return slots;
}

// The SM's cycle counter (not clock(): the kernels' bounded waits name a parameter `clock`).
__device__ __forceinline__ unsigned cycles() {
    unsigned c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
    return c;
}

// Whether this thread records: the producer's thread 0 and math warpgroup 0's thread 0.
__device__ __forceinline__ bool recorder() { return threadIdx.x == 0 || threadIdx.x == 128; }

__device__ __forceinline__ void add(int slot, unsigned long long v) {
    if (recorder()) block_slots()[slot] += v;
}

// At the block's start, before its barrier: zero the slots, take the start time.
__device__ __forceinline__ unsigned long long start() {
    if (threadIdx.x == 0)
        for (int s = 0; s < kSlots; ++s) block_slots()[s] = 0;
    return now_ns();
}

// At a recorder's end: its role's slots into the global array; the math, which ends last, also the block's span.
__device__ __forceinline__ void flush(unsigned long long started_ns) {
    if (!recorder()) return;
    const bool producer = threadIdx.x == 0;
    const int first = producer ? kProducerCycles : kMathCycles, last = producer ? kMathCycles : kBlockNs;
    for (int s = first; s < last; ++s) atomicAdd(&symmring_fused_profile[s], block_slots()[s]);
    if (!producer) {
        const unsigned long long end = now_ns();
        atomicAdd(&symmring_fused_profile[kBlockNs], end - started_ns);
        atomicMin(&symmring_fused_profile[kFirstStartNs], started_ns);
        atomicMax(&symmring_fused_profile[kLastEndNs], end);
    }
}

}  // namespace profile
}  // namespace fused
}  // namespace symmring_moe

#define FUSED_PROFILE_STAMP(var) const unsigned var = ::symmring_moe::fused::profile::cycles()
#define FUSED_PROFILE_ADD(slot, since) \
    ::symmring_moe::fused::profile::add(::symmring_moe::fused::profile::slot, \
                                        ::symmring_moe::fused::profile::cycles() - (since))
#define FUSED_PROFILE_COUNT(slot, n) ::symmring_moe::fused::profile::add(::symmring_moe::fused::profile::slot, (n))
#define FUSED_PROFILE_START(var) const unsigned long long var = ::symmring_moe::fused::profile::start()
#define FUSED_PROFILE_FLUSH(started) ::symmring_moe::fused::profile::flush(started)
#else
#define FUSED_PROFILE_STAMP(var) (void)0
#define FUSED_PROFILE_ADD(slot, since) (void)0
#define FUSED_PROFILE_COUNT(slot, n) (void)0
#define FUSED_PROFILE_START(var) (void)0
#define FUSED_PROFILE_FLUSH(started) (void)0
#endif
