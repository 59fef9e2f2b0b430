// Where the wgmma kernel (fused_experts_wgmma.cu) puts its operands in shared memory and where wgmma finds its
// results: the 128-byte swizzle of the cp.async stores, the shared memory matrix descriptor of a K-major e4m3
// tile and its advance per k32 step, and the m64nNk32 float32 accumulator fragment (which thread holds which
// row and column), and how the epilogues regroup a row's values within a quad for 16-byte stores. Host and device
// alike: tests/test_wgmma_layout.py builds this header with g++ (tests/wgmma_layout_check.cpp) and checks it
// against the PTX ISA's definitions of those layouts.
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

// --- the epilogues' 16-byte stores -----------------------------------------------------------------------------
// A quad (lanes t % 4 == q of four consecutive threads) holds the same two rows (acc_row), each row's 64 columns
// spread two at a time over its lanes. Stored as they come, a row takes 16 stores of two bytes (L1's e4m3) or 8 of
// four (L2's bf16) per lane. The epilogues instead pack a row half's values into words, transpose each group of four
// words within the quad (quad_transpose: word s of lane q becomes word q of lane s), and store 16 contiguous bytes
// per lane: a quad's store instruction then writes 64 contiguous bytes of a row.

// The quad's transpose runs as two exchanges, with the lane at distance `bit` (2, then 1): lane q hands over the
// two words whose index differs from q in that bit and takes its partner's into the same places. The k-th (0, 1)
// of those places:
SYMMRING_LAYOUT_FN int exchange_slot(int q, int bit, int k) { return ((q & bit) ^ bit) + k * (3 - bit); }

// w[i] for an i known only at run time, without indexing an array (which would put it in local memory).
SYMMRING_LAYOUT_FN uint32_t word_at(const uint32_t (&w)[4], int i) {
    return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
}

// One exchange's arrival: the partner's k-th handed-over word into this lane's k-th place.
SYMMRING_LAYOUT_FN void take_words(uint32_t (&w)[4], int q, int bit, uint32_t first, uint32_t second) {
    const int a = exchange_slot(q, bit, 0), b = exchange_slot(q, bit, 1);
    w[0] = a == 0 ? first : b == 0 ? second : w[0];
    w[1] = a == 1 ? first : b == 1 ? second : w[1];
    w[2] = a == 2 ? first : b == 2 ? second : w[2];
    w[3] = a == 3 ? first : b == 3 ? second : w[3];
}

// One exchange: the two words lane q hands over go through exchange(word, bit), which returns the partner's word of
// the same turn (the kernels: a shuffle; the CPU check: the partner's word from its state before the exchange),
// and land where this lane's own were. The quad's transpose is the exchange at distance 2, then at distance 1.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Exchange>
SYMMRING_LAYOUT_FN void quad_exchange(uint32_t (&w)[4], int q, int bit, Exchange&& exchange) {
    const uint32_t first = exchange(word_at(w, exchange_slot(q, bit, 0)), bit);
    const uint32_t second = exchange(word_at(w, exchange_slot(q, bit, 1)), bit);
    take_words(w, q, bit, first, second);
}

// L1 (e4m3): a row half h (rows acc_row(t, 2 h)) packs into 4 words, byte b of word k being value l1_value(h, k, b)
// of the fragment: pairs 2 k and 2 k + 1, so word k holds columns 16 k + 2 q + {0, 1, 8, 9}. After the transpose
// lane q holds columns 16 q + 2 s + {0, 1, 8, 9} in word s, which low_halves / high_halves put in order: its 16
// bytes are columns l1_column(q) + [0, 16) of the warpgroup's 64.
SYMMRING_LAYOUT_FN int l1_value(int h, int k, int b) { return 4 * (2 * k + b / 2) + 2 * h + b % 2; }
SYMMRING_LAYOUT_FN int l1_column(int q) { return 16 * q; }
SYMMRING_LAYOUT_FN uint32_t low_halves(uint32_t a, uint32_t b) { return (a & 0xFFFFu) | (b << 16); }
SYMMRING_LAYOUT_FN uint32_t high_halves(uint32_t a, uint32_t b) { return (a >> 16) | (b & 0xFFFF0000u); }
// Word m of lane q's 16 bytes from its transposed words: columns 4 m + [0, 4).
SYMMRING_LAYOUT_FN uint32_t l1_ordered(const uint32_t (&w)[4], int m) {
    return m < 2 ? low_halves(w[2 * m], w[2 * m + 1]) : high_halves(w[2 * m - 4], w[2 * m - 3]);
}

// L2 (bf16): a row half h packs into 8 words, element e (0 low, 1 high) of word 4 g + k being value
// l2_value(h, g, k, e): word j holds columns 8 j + 2 q + {0, 1}. Each group g of four words is transposed on its
// own: lane q then holds the 8 columns of word 4 g + q in order, columns l2_column(q, g) + [0, 8).
SYMMRING_LAYOUT_FN int l2_value(int h, int g, int k, int e) { return 4 * (4 * g + k) + 2 * h + e; }
SYMMRING_LAYOUT_FN int l2_column(int q, int g) { return 8 * (4 * g + q); }

}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe
