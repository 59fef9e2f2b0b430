// The math of the 128-row wgmma kernel (moe_fused_experts_wg128t, fused_experts_tma.cu): items of a whole
// 128-row group, the two math warpgroups splitting its ROWS (warpgroup w: rows [64 w, 64 w + 64)) over one B tile,
// where wg64's split a 64-row item's columns. A stage holds 128 A rows and 128 B rows (two boxes of 64: gate and
// up of 64 intermediate columns in L1, two 64-column halves of an output block in L2), each warpgroup runs wg64's
// two m64n64k32 streams on them: 32 KB per 2 M multiply-adds from L2, against wg64's 40 KB (L1) and 24 KB per
// 1 M (L2).
//
//   * L1 item (128 rows, intermediate block n1) in two passes over K: columns [0, 64) of n1, then [64, 128)
//     (gate and up of each in one thread's registers, as wg64). The first pass's SwiGLU values wait in shared
//     memory (each thread its own 32 floats) while the second pass runs: both passes' accumulators and partial
//     sums in registers at once would not fit. A row's 128 columns are in one warpgroup, so its amax is a
//     shuffle within the row's quad: no exchange between the warpgroups.
//   * L2 item (128 rows, output block n2): the 64-column halves of n2 as wg64's two streams.
// The promotion (wg64's, element by element) and both epilogues round exactly as wg64's and the unfused
// engines', and the amax is a maximum over the same 128 values: the same bits.
#pragma once

#include <moe/fused_wgmma.cuh>

namespace symmring_moe {
namespace fused {
namespace wg128 {

constexpr int kBlockM = 128;  // rows per item: one aligned group
constexpr int kWgRows = 64;   // each math warpgroup's rows: wgmma's M
constexpr int kBoxRows = 64;  // B rows per stream (a TMA box of the weights' maps)
constexpr int kL1Passes = kTileN / kBoxRows;  // an L1 item's 128 intermediate columns, 64 a pass
static_assert(kBlockM == kAlign, "an item is one aligned group: one m block per group");
static_assert(kBlockM / kWgRows == wg::kMathWarpgroups, "one 64-row slice per math warpgroup");

// Each thread's first-pass SwiGLU values of an L1 item, value i at [wg][i][t] (conflict-free).
struct Keep {
    float v[wg::kMathWarpgroups][wg::kFrag][128];
};

}  // namespace wg128
}  // namespace fused
}  // namespace symmring_moe

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace symmring_moe {
namespace fused {
namespace wg128 {

using wg::acc_col;
using wg::acc_row;
using wg::kFrag;

// One K block of one math warpgroup: part[h] = A[its 64 rows, 128] * B[rows [64 h, 64 h + 64), 128]^T (4 k steps,
// scale-d 0 on the first); committed, not waited.
__device__ __forceinline__ void wgmma_k_block(float (&part)[2][kFrag], const uint8_t* a_tile, const uint8_t* b_tile,
                                              int wg) {
    const uint64_t a_desc = wg::smem_desc(a_tile + wg * kWgRows * kBlockK);
    uint64_t b_desc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) b_desc[h] = wg::smem_desc(b_tile + h * kBoxRows * kBlockK);
    wg::wgmma_fence();  // the partial sums' registers were read by the last promotion
#pragma unroll
    for (int h = 0; h < 2; ++h) wg::wgmma_m64n64k32<0>(part[h], a_desc, b_desc[h]);
#pragma unroll
    for (int k = 1; k < kBlockK / 32; ++k)
#pragma unroll
        for (int h = 0; h < 2; ++h) wg::wgmma_m64n64k32<1>(part[h], wg::desc_at_k(a_desc, k), wg::desc_at_k(b_desc[h], k));
    wg::wgmma_commit();
}

// SwiGLU of one L1 pass into acc[0] (gate acc[0], up acc[1]), this thread's maxima of its two rows raised.
__device__ __forceinline__ void swiglu_pass(float (&acc)[2][kFrag], float (&row_amax)[2]) {
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
        const float v = swiglu(acc[0][i], acc[1][i], div::CallFreeDivision());
        acc[0][i] = v;
        row_amax[i % 4 / 2] = fmaxf(row_amax[i % 4 / 2], fabsf(v));
    }
}

__device__ __forceinline__ void keep_pass(Keep& keep, const float (&v)[kFrag], int wg, int t) {
#pragma unroll
    for (int i = 0; i < kFrag; ++i) keep.v[wg][i][t] = v[i];
}

// The L1 item's end: each row's amax over its 128 columns (the quad's four lanes), its scale, and the fp8
// intermediate stored: the first pass's values (kept) at columns [0, 64) of n1, the second's (v) at [64, 128).
__device__ __forceinline__ void l1_store(const FusedExpertsArgs& p, const Work& w, const Keep& keep,
                                         const float (&v)[kFrag], float (&row_amax)[2], int wg, int t, int row0,
                                         int n1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_amax[h] = fmaxf(row_amax[h], __shfl_xor_sync(0xffffffffu, row_amax[h], 1));
        row_amax[h] = fmaxf(row_amax[h], __shfl_xor_sync(0xffffffffu, row_amax[h], 2));
        const int row = row0 + wg * kWgRows + acc_row(t, 2 * h);
        const float scale = fp8_scale(row_amax[h], div::CallFreeDivision());
        if (row >= p.num_rows) continue;
        const div::ByDivisor by_scale(scale);  // one reciprocal for the row's 32 divisions
        if (t % 4 == 0) *act_scale(p, row, n1) = scale;
        uint8_t* act_row = p.act + static_cast<long long>(row) * p.inter + n1 * kTileN;
#pragma unroll
        for (int j = 0; j < kFrag / 4; ++j) {
            const int i = 4 * j + 2 * h, col = acc_col(t, 4 * j);
            *reinterpret_cast<__nv_fp8x2_storage_t*>(act_row + col) =
                quantize_pair(keep.v[wg][i][t], keep.v[wg][i + 1][t], scale, by_scale);
            *reinterpret_cast<__nv_fp8x2_storage_t*>(act_row + kBoxRows + col) =
                quantize_pair(v[i], v[i + 1], scale, by_scale);
        }
    }
}

// L2 epilogue: the bf16 output of this warpgroup's 64 rows, the two 64-column halves of n2.
__device__ __forceinline__ void l2_store(const FusedExpertsArgs& p, const float (&acc)[2][kFrag], int wg, int t,
                                         int row0, int n2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + wg * kWgRows + acc_row(t, 2 * h);
        if (row >= p.num_rows) continue;
        __nv_bfloat16* dst = out_row(p, row);
        if (dst == nullptr) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int j = 0; j < kFrag / 4; ++j) {
                const int col = n2 * kTileN + half * kBoxRows + acc_col(t, 4 * j);
                *reinterpret_cast<__nv_bfloat162*>(dst + col) =
                    __floats2bfloat162_rn(acc[half][4 * j + 2 * h], acc[half][4 * j + 2 * h + 1]);
            }
    }
}

}  // namespace wg128
}  // namespace fused
}  // namespace symmring_moe
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
