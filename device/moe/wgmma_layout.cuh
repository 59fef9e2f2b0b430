// Where the wgmma kernel (fused_experts_wgmma.cu) puts its operands in shared memory and where wgmma finds its
// results: the 128-byte swizzle of the cp.async stores, the shared memory matrix descriptor of a K-major e4m3
// tile and its advance per k32 step, and the m64nNk32 float32 accumulator fragment (which thread holds which
// row and column). Host and device alike: tests/test_wgmma_layout.py builds this header with g++
// (tests/wgmma_layout_check.cpp) and checks it against the PTX ISA's definitions of those layouts.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define SYMMRING_LAYOUT_FN __host__ __device__ __forceinline__ constexpr
#else
#define SYMMRING_LAYOUT_FN inline constexpr
#endif

namespace symmring_moe {
namespace fused {
namespace wg {

constexpr int kTileRowBytes = 128;  // one 128-wide K block of e4m3 per tile row: the 128B swizzle's width
constexpr int kSwizzleAtom = 1024;  // 8 rows x 128 bytes: the 128B swizzle pattern's period (tile alignment)
constexpr int kKStepBytes = 32;     // K of one wgmma m64nNk32 in e4m3 bytes

// Byte offset in a tile of 16-byte chunk `chunk` of row `r` under the 128-byte swizzle: chunk c ^ (r % 8).
SYMMRING_LAYOUT_FN uint32_t swizzled(int r, int chunk) {
    return static_cast<uint32_t>(r * kTileRowBytes + ((chunk ^ (r % 8)) << 4));
}

// The shared memory descriptor of a K-major tile of 128-byte rows with the 128-byte swizzle starting at shared
// address `addr` (1024-byte aligned): start address >> 4 in bits 0-13, LBO in bits 16-29 (unused for swizzled
// K-major layouts; 1 by convention), SBO = 1024 B between 8-row groups (>> 4) in bits 32-45, base offset 0 in
// bits 49-51 (the tile starts on the pattern's period), swizzle mode 1 (128B) in bits 62-63.
SYMMRING_LAYOUT_FN uint64_t smem_desc_at(uint32_t addr) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
           (static_cast<uint64_t>(kSwizzleAtom >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// The descriptor advanced by k steps of 32 bytes along K inside the swizzle atom: the start address only (the
// hardware swizzles the address it forms, so the base offset stays 0).
SYMMRING_LAYOUT_FN uint64_t desc_at_k(uint64_t desc, int k) {
    return desc + static_cast<uint64_t>(k * kKStepBytes >> 4);
}

// The m64nNk32 float32 accumulator: value i of thread t (0-127) of the warpgroup is row 16 (t / 32) + (t % 32) / 4
// + 8 (i % 4 / 2), column 8 (i / 4) + 2 (t % 4) + i % 2. So values 2p and 2p + 1 are adjacent columns of one row,
// and the four lanes of a quad hold the same rows.
SYMMRING_LAYOUT_FN int acc_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * (i % 4 / 2); }
SYMMRING_LAYOUT_FN int acc_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + i % 2; }

}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe
