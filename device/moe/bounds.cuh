// The plan's bounds on the MoE kernels' data-indexed writes (device/moe/dispatch.cu, combine.cu; included as
// <moe/bounds.cuh>).
//
// The host sizes every launch from its plan (symmring.moe.gpu.plan: a window's pool rows, the rows any one
// expert may hold) and the workspace (the combine rows of max_tokens tokens); the device indexes those buffers
// with counts, cursors and token bases it reads from the routing and the peers' metadata. Where the data
// exceeds what the plan promised (ranks that planned different calls, a stale or corrupt slot) nothing is
// written past the buffer: the kernel records a pool_overflow error (kErrorPoolOverflow, which aborts the ring
// on every PE, so no rank waits for rows that never come or reduces rows that were never written) and skips
// the write. The host names it (symmring.errors.PoolOverflow; docs/PROTOCOL.md section 10).
#pragma once
#include <stdint.h>

#include <symmring/protocol.cuh>

namespace symmring_moe {

// Which bound a pool_overflow record names: the low byte of its `missing` word (layout.OVERFLOW_*); the
// global expert id of kOverflowExpertRows sits above it (missing >> 8).
enum OverflowBound : int {
    kOverflowWindowRows = 0,    // the window's rows (the scan's total) exceed the rows its passes cover
    kOverflowExpertRows = 1,    // one expert's rows exceed the plan's rows_per_expert (the engines trust it)
    kOverflowCombineToken = 2,  // a row's logical token lies outside its owner's combine rows
};

// One thread: record that `found` exceeds `bound` (what: OverflowBound; peer: the PE whose rows or combine
// buffer it concerns; expert: the global expert id for kOverflowExpertRows, else 0) for chunk `chunk_idx`.
// First error wins (record_error), which then aborts the ring on every other PE. Not inlined: the loops that
// check a bound per row keep the error path out of their code.
__device__ __noinline__ inline void record_overflow(const symmring::RingDescriptor& d, OverflowBound what,
                                                    int peer, int chunk_idx, int64_t bound, int64_t found,
                                                    int expert = 0) {
    symmring::record_error(d, symmring::kErrorPoolOverflow, peer, symmring::slot_of(chunk_idx, d.num_slots),
                           chunk_idx, static_cast<uint64_t>(bound), static_cast<uint64_t>(found),
                           static_cast<uint64_t>(what) | (static_cast<uint64_t>(expert) << 8));
}

}  // namespace symmring_moe
