// Where the small-batch chain's time goes, phase by phase: a developer's probe (tools/chain_probe.py).
//
// Built only with SYMMRING_CHAIN_STAMPS defined (a probe tree's `#define` ahead of the includes of
// device/moe/producer.cu, dispatch.cu and combine.cu, as device/moe/fused_profile.cuh); otherwise both macros are
// empty and the kernels' code is unchanged. With it, CHAIN_STAMP(slot) has thread 0 of block 0 write %globaltimer
// (ns, one clock for every SM) into `symmring_chain_stamps[slot]`, and CHAIN_STAMP_ANY(slot) the thread that runs it
// (the grid's last block, in grid_publish and the fused dispatch's acknowledgement). Each module has its own array;
// the probe zeroes the three before a replay and reads them after it. Slots, by kernel (tools/chain_probe.py
// names them):
//   moe_produce_chunk_fp8  0 start, 1 slot free, 2 route written, 3 layout written (block 0), 4 last block,
//                          5 route ready signalled, 6 layout ready signalled (grid_publish)
//   moe_dispatch_fused_fp8 8 start, 9 sources waited, 10 counted and scanned, 11 rows pulled (block 0),
//                          12 last block (EARLY), 13 acknowledged
//   moe_combine_fused      16 start, 17 scanned (and the first ticket), 18 scatter done (block 0), 19 the
//                          signalling block, 20 signalled, 21 sources waited, 22 reduced (block 0)
#pragma once

#ifdef SYMMRING_CHAIN_STAMPS
__device__ unsigned long long symmring_chain_stamps[32];

#define CHAIN_STAMP_ANY(slot)                                                         \
    do {                                                                              \
        unsigned long long now_;                                                      \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now_));                      \
        symmring_chain_stamps[slot] = now_;                                           \
    } while (0)
#define CHAIN_STAMP(slot)                                                             \
    do {                                                                              \
        if (blockIdx.x == 0 && threadIdx.x == 0) CHAIN_STAMP_ANY(slot);               \
    } while (0)
#else
#define CHAIN_STAMP_ANY(slot) \
    do {                      \
    } while (0)
#define CHAIN_STAMP(slot) \
    do {                  \
    } while (0)
#endif
