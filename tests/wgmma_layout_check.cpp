// device/moe/wgmma_layout.cuh on the CPU (tests/test_wgmma_layout.py builds this with g++): the wgmma kernel's
// shared memory placement, descriptors and accumulator indexing against the PTX ISA's definitions, restated here
// independently of the header:
//   * the matrix descriptor's fields (PTX "Matrix Descriptor Format": start address, LBO, SBO (x & 0x3FFFF) >> 4 in
//     bits 0-13, 16-29, 32-45; base offset in 49-51; swizzle mode in 62-63: 0 none, 1 128B, 2 64B, 3 32B);
//   * how wgmma reads a K-major operand through it (PTX "Shared Memory Matrix Layout", K-major canonical layouts:
//     Swizzle<B,4,3> o ((8,m),(T,2k)):((W/16 T, SBO),(1,T)), W the swizzle width, T 16 e4m3 elements), the
//     swizzle applied to the address bits (its pattern repeats on W * 8-byte boundaries: base offset 0);
//   * the m64nNk32 float32 accumulator fragment (PTX figure "WGMMA .m64nNk32 register fragment layout for
//     accumulator matrix D", as CUTLASS's CLayout_64xN states it: thread (4, 8, 4) : (128, 1, 16), value
//     (2, 2, N/8) : (64, 8, 512) over the column-major 64 x N tile).
// Usage: wgmma_layout_check; prints the count of checks and of failures, exits 1 on any.
#include <cstdint>
#include <cstdio>
#include <vector>

#include <moe/wgmma_layout.cuh>

using namespace symmring_moe::fused::wg;

static long checks = 0, failures = 0;

static void expect(bool ok, const char* what, long a = 0, long b = 0, long c = 0) {
    ++checks;
    if (ok) return;
    if (failures++ < 20) std::printf("FAIL %s (%ld, %ld, %ld)\n", what, a, b, c);
}

struct Fields {
    uint32_t start, lbo, sbo, base_offset, mode;
    uint64_t other;  // bits outside every field: must be 0
};

static Fields decode(uint64_t desc) {
    Fields f;
    f.start = static_cast<uint32_t>(desc & 0x3FFF) << 4;
    f.lbo = static_cast<uint32_t>((desc >> 16) & 0x3FFF) << 4;
    f.sbo = static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4;
    f.base_offset = static_cast<uint32_t>((desc >> 49) & 0x7);
    f.mode = static_cast<uint32_t>(desc >> 62);
    f.other = desc & ~(0x3FFFull | (0x3FFFull << 16) | (0x3FFFull << 32) | (0x7ull << 49) | (0x3ull << 62));
    return f;
}

// The shared address wgmma reads for byte k (0-31: one k32 step of e4m3) of row r of a K-major operand described by
// `desc`; -1 for a descriptor this model does not cover (no swizzle, a non-zero base offset).
static long wgmma_reads(uint64_t desc, int r, int k) {
    const Fields f = decode(desc);
    const int bits = f.mode == 1 ? 3 : f.mode == 2 ? 2 : f.mode == 3 ? 1 : 0;  // Swizzle<bits, 4, 3>
    if (bits == 0 || f.base_offset != 0) return -1;
    const uint32_t width = 16u << bits;  // bytes per row of the pattern: 128, 64, 32
    if (static_cast<uint32_t>(k) >= width) return -1;  // a k step must fit in one swizzled row
    const uint32_t linear = f.start + static_cast<uint32_t>(r % 8) * width + static_cast<uint32_t>(r / 8) * f.sbo + k;
    const uint32_t mask = (1u << bits) - 1;
    return static_cast<long>(linear ^ (((linear >> 7) & mask) << 4));
}

// Tiles of `rows` rows at every 1024-byte aligned start below 228 KB: wgmma's byte (row r, K byte 32 s + k) is
// where the cp.async of chunk (32 s + k) / 16 of row r put it, and the tile's bytes are each written once.
static void check_operand_tiles(int rows) {
    for (uint32_t tile = 0; tile + rows * kTileRowBytes <= 228 * 1024; tile += kSwizzleAtom) {
        const uint64_t desc = smem_desc_at(tile);
        const Fields f = decode(desc);
        expect(f.start == tile && f.mode == 1 && f.sbo == 8 * kTileRowBytes && f.base_offset == 0 && f.other == 0,
               "descriptor fields (start, 128B mode, SBO 1024, base offset 0, nothing else)", tile, f.mode, f.sbo);
        std::vector<int> written(rows * kTileRowBytes, 0);
        for (int r = 0; r < rows; ++r)
            for (int chunk = 0; chunk < kTileRowBytes / 16; ++chunk) {
                const uint32_t at = swizzled(r, chunk);
                expect(at % 16 == 0 && at + 16 <= written.size(), "chunk inside the tile", r, chunk, at);
                if (at % 16 == 0 && at + 16 <= written.size())
                    for (int b = 0; b < 16; ++b) ++written[at + b];
            }
        for (size_t i = 0; i < written.size(); ++i) expect(written[i] == 1, "every tile byte written once", tile, i);
        for (int s = 0; s < kTileRowBytes / kKStepBytes; ++s) {
            const uint64_t step = desc_at_k(desc, s);
            for (int r = 0; r < rows; ++r)
                for (int k = 0; k < kKStepBytes; ++k) {
                    const int kbyte = s * kKStepBytes + k;
                    const long want = tile + swizzled(r, kbyte / 16) + kbyte % 16;
                    expect(wgmma_reads(step, r, k) == want, "wgmma reads the byte cp.async wrote", tile + r, kbyte,
                           wgmma_reads(step, r, k));
                }
        }
    }
}

// The accumulator fragment: acc_row / acc_col against CUTLASS's CLayout_64xN, every element of the 64 x 64 tile
// held once, and what the epilogues rely on: a value's row depends on i only through i % 4 / 2 (one activation
// scale per row half), values 4 j + 2 h and 4 j + 2 h + 1 are adjacent columns from acc_col(t, 4 j) (the paired
// stores), and the four lanes of a quad (t ^ 1, t ^ 2) hold the same rows (the amax shuffles).
static void check_accumulator() {
    constexpr int kN = 64, kValues = 64 * kN / 128;
    std::vector<int> held(64 * kN, 0);
    for (int t = 0; t < 128; ++t)
        for (int i = 0; i < kValues; ++i) {
            const int idx = 128 * (t % 4) + (t / 4 % 8) + 16 * (t / 32) + 64 * (i % 2) + 8 * (i / 2 % 2) + 512 * (i / 4);
            const int row = acc_row(t, i), col = acc_col(t, i);
            expect(row == idx % 64 && col == idx / 64, "acc_row / acc_col as CLayout_64xN", t, i, row * 1000 + col);
            if (row >= 0 && row < 64 && col >= 0 && col < kN) ++held[row * kN + col];
            expect(row == acc_row(t, 2 * (i % 4 / 2)), "row from i % 4 / 2", t, i);
            expect(col == acc_col(t, 4 * (i / 4)) + i % 2, "pairs of adjacent columns", t, i);
            expect(acc_row(t ^ 1, i) == row && acc_row(t ^ 2, i) == row, "a quad holds the same rows", t, i);
        }
    for (int e = 0; e < 64 * kN; ++e) expect(held[e] == 1, "every accumulator element held once", e / kN, e % kN);
}

// The epilogues' 16-byte stores, simulated for the 128 threads of a warpgroup on a fragment of random values: the
// packing (l1_value, l2_value), the quad's transpose as the kernels run it (two exchanges through exchange_slot,
// word_at and take_words; the shuffle is the partner's lane in the same quad), the reordering (l1_ordered). Every
// stored element must be the fragment's value at the row and column it is stored to, a quad's four 16-byte stores
// must cover 64 contiguous bytes of its row, and every element of a warpgroup's 64 x 64 tile must be stored once.
static void quad_transpose_sim(uint32_t (&lanes)[4][4]) {
    for (int bit = 2; bit >= 1; bit /= 2) {  // as the kernels' quad_transpose: distance 2, then 1
        uint32_t before[4][4];
        for (int q = 0; q < 4; ++q)
            for (int k = 0; k < 4; ++k) before[q][k] = lanes[q][k];
        for (int q = 0; q < 4; ++q) {
            int turn = 0;  // the shuffle's stand-in: the partner's word of this turn, from its state before
            quad_exchange(lanes[q], q, bit, [&](uint32_t, int b) {
                const int partner = q ^ b;
                return word_at(before[partner], exchange_slot(partner, b, turn++));
            });
        }
    }
}

static void check_quad_stores(uint32_t seed) {
    constexpr int kValues = 32;
    uint32_t state = seed;
    auto next = [&] { return state = state * 1664525u + 1013904223u; };
    std::vector<uint32_t> frag(128 * kValues);  // the value of (thread, i): a random byte (L1) or half word (L2)
    for (auto& v : frag) v = next() >> 8;
    std::vector<int> at(64 * 64, -1);  // (row, col) -> thread * kValues + i
    for (int t = 0; t < 128; ++t)
        for (int i = 0; i < kValues; ++i) at[acc_row(t, i) * 64 + acc_col(t, i)] = t * kValues + i;
    for (int l2 = 0; l2 < 2; ++l2) {
        const uint32_t mask = l2 ? 0xFFFFu : 0xFFu;
        const int per_word = l2 ? 2 : 4, bits = l2 ? 16 : 8;
        std::vector<int> stored(64 * 64, 0);
        for (int quad = 0; quad < 32; ++quad)
            for (int h = 0; h < 2; ++h)
                for (int g = 0; g < (l2 ? 2 : 1); ++g) {
                    uint32_t lanes[4][4];
                    for (int q = 0; q < 4; ++q)
                        for (int k = 0; k < 4; ++k) {
                            uint32_t word = 0;
                            for (int e = 0; e < per_word; ++e) {
                                const int i = l2 ? l2_value(h, g, k, e) : l1_value(h, k, e);
                                word |= (frag[(4 * quad + q) * kValues + i] & mask) << (bits * e);
                            }
                            lanes[q][k] = word;
                        }
                    quad_transpose_sim(lanes);
                    const int row = acc_row(4 * quad, 2 * h);
                    for (int q = 0; q < 4; ++q) {
                        const int col0 = l2 ? l2_column(q, g) : l1_column(q);
                        const int bytes = l2 ? 2 : 1;
                        expect(col0 * bytes == (l2 ? l2_column(0, g) * 2 : 0) + 16 * q,
                               "a quad's stores: 64 contiguous bytes", quad, q, col0);
                        for (int c = 0; c < 16 / bytes; ++c) {
                            const uint32_t word = l2 ? lanes[q][c / 2] : l1_ordered(lanes[q], c / 4);
                            const uint32_t got = (word >> (bits * (c % per_word))) & mask;
                            const int col = col0 + c;
                            expect(col < 64, "stored inside the warpgroup's 64 columns", quad, q, col);
                            if (col >= 64) continue;
                            ++stored[row * 64 + col];
                            const int src = at[row * 64 + col];
                            expect(src >= 0 && (frag[src] & mask) == got, l2 ? "L2 store: the fragment's value"
                                                                               : "L1 store: the fragment's value",
                                   row, col, static_cast<long>(got));
                        }
                    }
                }
        for (int e = 0; e < 64 * 64; ++e) expect(stored[e] == 1, "every element stored once", l2, e / 64, e % 64);
    }
}

int main() {
    check_operand_tiles(64);   // A (64 rows) and each warpgroup's B rows (64 of a half)
    check_operand_tiles(256);  // a whole L1 B tile: gate then up rows
    check_accumulator();
    for (uint32_t seed = 1; seed <= 64; ++seed) check_quad_stores(seed);
    std::printf("checks %ld failures %ld\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
