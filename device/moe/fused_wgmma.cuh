// What the two wgmma kernels share: moe_fused_experts_wg64 (fused_experts_wgmma.cu, every thread copies with
// cp.async) and moe_fused_experts_wg64t (fused_experts_tma.cu, a producer warpgroup loads by TMA). Both run two
// math warpgroups over the same 64-row items with the same m64n64k32 e4m3 wgmma streams, the same per-K-block
// promotion and the same epilogues, so they give the same bits (docs/FUSED.md).
//
//   * L1 item (64 rows, intermediate block n1): math warpgroup w computes gate columns [64 w, 64 w + 64) and the
//     same up columns of n1 as two m64n64 streams, so SwiGLU pairs gate and up in one thread's registers;
//     the row amax over the 128 columns is a cross-warpgroup reduction in shared memory.
//   * L2 item (64 rows, output block n2): math warpgroup w computes output columns [64 w, 64 w + 64); wg64t's L2
//     pair (two output blocks) runs the L1 item's two streams, one per block.
#pragma once

#include <moe/fused_common.cuh>
#include <moe/fused_div.cuh>
#include <moe/wgmma_layout.cuh>

namespace symmring_moe {
namespace fused {
namespace wg {

constexpr int kBlockM = 64;                          // rows per item: wgmma's M
constexpr int kMathWarpgroups = 2;
constexpr int kWgCols = kTileN / kMathWarpgroups;    // 64: each math warpgroup's columns of a 128-column half
constexpr int kFrag = kBlockM * kWgCols / 128;       // 32 float32 accumulators per thread per m64n64 stream
static_assert(kBlockK == kTileRowBytes, "a tile row is one K block of e4m3: the 128B swizzle's width");
static_assert(kFrag == 32, "an m64n64 accumulator is 32 floats per thread");

}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace symmring_moe {
namespace fused {
namespace wg {

// --- PTX wrappers (sm_90a) ----------------------------------------------------------------------------------

// The descriptor of the K-major, 128B-swizzled tile at `tile` (1024-byte aligned; wgmma_layout.cuh).
__device__ __forceinline__ uint64_t smem_desc(const uint8_t* tile) {
    return smem_desc_at(static_cast<uint32_t>(__cvta_generic_to_shared(tile)));
}

__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Every committed group but the newest is complete (the one before it may now be read).
__device__ __forceinline__ void wgmma_wait_all_but_newest() {
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}

// Ties the registers to this point of the program: reads of the partial sums stay after the wgmma wait.
__device__ __forceinline__ void fence_operands(float (&d)[kFrag]) {
#pragma unroll
    for (int i = 0; i < kFrag; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (+)= A[64 x 32] * B[64 x 32]^T, both e4m3 K-major in shared memory; kAccumulate 0: d = A * B^T.
// d[i] of thread t of the warpgroup: row acc_row(t, i), column acc_col(t, i) (wgmma_layout.cuh).
template <int kAccumulate>
__device__ __forceinline__ void wgmma_m64n64k32(float (&d)[kFrag], uint64_t a_desc, uint64_t b_desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a_desc), "l"(b_desc), "r"(kAccumulate));
}

// One K block of one math warpgroup: part[h] = A[64 rows, 128] * B[its 64 columns of half h, 128]^T, A at
// `a_tile`, half h's 128 B rows at b_tile + h * 128 rows (4 k steps, scale-d 0 on the first); committed, not waited.
template <int kHalves>
__device__ __forceinline__ void wgmma_k_block(float (&part)[kHalves][kFrag], const uint8_t* a_tile,
                                              const uint8_t* b_tile, int wg) {
    const uint64_t a_desc = smem_desc(a_tile);
    uint64_t b_desc[kHalves];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) b_desc[h] = smem_desc(b_tile + (h * kTileN + wg * kWgCols) * kBlockK);
    wgmma_fence();  // the partial sums' registers were read by the last promotion
#pragma unroll
    for (int h = 0; h < kHalves; ++h) wgmma_m64n64k32<0>(part[h], a_desc, b_desc[h]);
#pragma unroll
    for (int k = 1; k < kBlockK / 32; ++k)
#pragma unroll
        for (int h = 0; h < kHalves; ++h) wgmma_m64n64k32<1>(part[h], desc_at_k(a_desc, k), desc_at_k(b_desc[h], k));
    wgmma_commit();
}

// --- scales and promotion ---------------------------------------------------------------------------------

// K block kb's weight block scale of each half (the TMA kernels' activation scales come with the stage).
template <int kHalves>
__device__ __forceinline__ void load_weight_scales(const Operands& op, int kb, float (&sb)[kHalves]) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h) sb[h] = __ldg(op.b_sf[h] + kb);
}

// K block kb's scales for this thread's fragment: the activation scale of its two rows (0 past the valid rows)
// and each half's weight block scale.
template <int kHalves>
__device__ __forceinline__ void load_scales(const Operands& op, int t, int kb, float (&sa)[2], float (&sb)[kHalves]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = op.row0 + acc_row(t, 2 * h);  // the rows of values i with i % 4 / 2 == h
        sa[h] = r < op.rows_valid ? __ldcg(op.a_sf + r * op.a_sf_row + kb * op.a_sf_col) : 0.0f;
    }
    load_weight_scales<kHalves>(op, kb, sb);
}

// acc += partial * (activation scale of the row * weight scale of the block).
template <int kHalves>
__device__ __forceinline__ void accumulate(float (&acc)[kHalves][kFrag], const float (&part)[kHalves][kFrag],
                                           const float (&sa)[2], const float (&sb)[kHalves]) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < kFrag; ++i) acc[h][i] += part[h][i] * (sa[i % 4 / 2] * sb[h]);
}

// accumulate, then the next block's scales become the current ones.
template <int kHalves>
__device__ __forceinline__ void promote(float (&acc)[kHalves][kFrag], const float (&part)[kHalves][kFrag],
                                        float (&sa)[2], float (&sb)[kHalves], const float (&sa_next)[2],
                                        const float (&sb_next)[kHalves]) {
    accumulate<kHalves>(acc, part, sa, sb);
#pragma unroll
    for (int h = 0; h < 2; ++h) sa[h] = sa_next[h];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) sb[h] = sb_next[h];
}

// --- the epilogues (math warpgroup wg, thread t of it) ----------------------------------------------------

// L1, first half: SwiGLU into acc[0] and this warpgroup's row maxima into amax[wg]; the caller then waits at a
// block barrier for the other warpgroup's. The division's fast path runs for every value and its slow path (a
// value fast_divide leaves: denormal or extreme operands) in a second pass that no warp enters without such a
// value: swiglu's bits, with the path every item runs a third of its former length (session 18: the L1 epilogue
// from ~45 to ~3.6 us per item, docs/FUSED.md).
__device__ __forceinline__ void l1_swiglu_amax(float (&acc)[2][kFrag], float (&amax)[kMathWarpgroups][kBlockM], int wg,
                                               int t) {
    uint32_t slow = 0;  // bit i: value i needs the slow path (acc[0][i] then still holds its gate)
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
        const SwigluTerms s = swiglu_terms(acc[0][i], acc[1][i]);
        float q;
        if (div::fast_divide(s.gate, s.den, div::divisor_of(s.den), q)) {
            acc[0][i] = q * s.up;
        } else {
            slow |= 1u << i;
        }
    }
    if (slow != 0) {
#pragma unroll
        for (int i = 0; i < kFrag; ++i)
            if (slow >> i & 1u) acc[0][i] = swiglu(acc[0][i], acc[1][i], div::CallFreeDivision());
    }
    float row_amax[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kFrag; ++i) row_amax[i % 4 / 2] = fmaxf(row_amax[i % 4 / 2], fabsf(acc[0][i]));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_amax[h] = fmaxf(row_amax[h], __shfl_xor_sync(0xffffffffu, row_amax[h], 1));
        row_amax[h] = fmaxf(row_amax[h], __shfl_xor_sync(0xffffffffu, row_amax[h], 2));
        if (t % 4 == 0) amax[wg][acc_row(t, 2 * h)] = row_amax[h];  // the quad's lanes hold the same rows
    }
}

// The quad's transpose of four words (wgmma_layout.cuh): word s of lane q becomes word q of lane s. Every lane of
// the warp takes part (shuffles), so no row is skipped before it.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int q) {
    const auto shuffle = [](uint32_t word, int bit) { return __shfl_xor_sync(0xffffffffu, word, bit); };
    quad_exchange(w, q, 2, shuffle);
    quad_exchange(w, q, 1, shuffle);
}

// Whether this thread's two rows (row halves 0 and 1 of the item at row0) hold tokens: inside the pass and not
// padding. Only those are stored: padding rows of the intermediate and the output are never read (an L2 row, like
// any GEMM row, depends on its own A row alone; the combine takes live rows), and at small batches they are most
// of an item's 64 rows. Read at the item's start, so that the load's latency hides behind the main loop.
__device__ __forceinline__ void live_rows(const FusedExpertsArgs& p, int row0, int t, bool (&live)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + acc_row(t, 2 * h);
        live[h] = row < p.num_rows && p.m_indices[row] >= 0;
    }
}

// L1, second half: each row's scale from both warpgroups' maxima, the fp8 intermediate of the live rows and their
// scales stored, 16 bytes per lane (a quad: its row's 64 columns of this warpgroup in one store instruction). The
// quotients go into acc[1] (the up values, spent), the slow path's in a second pass as in l1_swiglu_amax.
__device__ __forceinline__ void l1_quantize_store(const FusedExpertsArgs& p, const Work& w, float (&acc)[2][kFrag],
                                                  const float (&amax)[kMathWarpgroups][kBlockM],
                                                  const bool (&live)[2], int wg, int t, int row0, int n1) {
    const int q = t % 4;
    float scale[2];
    div::Divisor by_scale[2];  // one reciprocal for a row's 32 divisions
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = acc_row(t, 2 * h);
        float row_amax = 0.0f;
#pragma unroll
        for (int v = 0; v < kMathWarpgroups; ++v) row_amax = fmaxf(row_amax, amax[v][r]);
        scale[h] = fp8_scale(row_amax, div::CallFreeDivision());
        by_scale[h] = div::divisor_of(scale[h]);
    }
    uint32_t slow = 0;
#pragma unroll
    for (int i = 0; i < kFrag; ++i)
        if (!div::fast_divide(acc[0][i], scale[i % 4 / 2], by_scale[i % 4 / 2], acc[1][i])) slow |= 1u << i;
    if (slow != 0) {
#pragma unroll
        for (int i = 0; i < kFrag; ++i)
            if (slow >> i & 1u) acc[1][i] = div::slow_quotient(acc[0][i], scale[i % 4 / 2]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + acc_row(t, 2 * h);
        uint32_t words[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint32_t low = fp8_pair(acc[1][l1_value(h, k, 0)], acc[1][l1_value(h, k, 1)]);
            const uint32_t high = fp8_pair(acc[1][l1_value(h, k, 2)], acc[1][l1_value(h, k, 3)]);
            words[k] = low | high << 16;
        }
        quad_transpose(words, q);
        if (!live[h]) continue;
        if (wg == 0 && q == 0) *act_scale(p, row, n1) = scale[h];
        const int col = n1 * kTileN + wg * kWgCols + l1_column(q);
        *reinterpret_cast<uint4*>(p.act + static_cast<long long>(row) * p.inter + col) =
            make_uint4(l1_ordered(words, 0), l1_ordered(words, 1), l1_ordered(words, 2), l1_ordered(words, 3));
    }
}

// The bits of two floats as a bf16 pair (a in the low half), rounded to nearest even.
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return static_cast<uint32_t>(__bfloat16_as_ushort(v.x)) | static_cast<uint32_t>(__bfloat16_as_ushort(v.y)) << 16;
}

// L2: the bf16 output tile of this warpgroup's columns of n2, its live rows, 16 bytes per lane (a quad: 64
// contiguous bytes of its row per store instruction).
__device__ __forceinline__ void l2_store(const FusedExpertsArgs& p, const float (&acc)[kFrag], const bool (&live)[2],
                                         int wg, int t, int row0, int n2) {
    const int q = t % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        __nv_bfloat16* dst = live[h] ? out_row(p, row0 + acc_row(t, 2 * h)) : nullptr;
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            uint32_t words[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) words[k] = bf16x2_bits(acc[l2_value(h, g, k, 0)], acc[l2_value(h, g, k, 1)]);
            quad_transpose(words, q);
            if (dst == nullptr) continue;
            const int col = n2 * kTileN + wg * kWgCols + l2_column(q, g);
            *reinterpret_cast<uint4*>(dst + col) = make_uint4(words[0], words[1], words[2], words[3]);
        }
    }
}

// An L2 tile whose wait for its L1 items expired: NaN, no finite garbage (the status names it).
__device__ __forceinline__ void fill_nan(float (&acc)[kFrag]) {
#pragma unroll
    for (int i = 0; i < kFrag; ++i) acc[i] = __int_as_float(0x7fc00000);
}

}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
