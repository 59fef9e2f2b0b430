// The experts of one pass in ONE persistent kernel: L1 (gate and up), SwiGLU, fp8 quantisation, L2.
//
// Input: the pool the fp8 dispatch writes (docs/MOE_GPU.md "fp8 pool layout"): fp8 e4m3 rows, one float32
// scale per row and 128 channels, every local expert's group starting at a multiple of 128 rows, m_indices
// naming each row's expert (-1 for padding). Weights: fp8 e4m3 with one float32 scale per 128x128 block.
// Output: bf16 rows at the pool rows' places, which moe_combine_scatter sends.
//
// Work (docs/FUSED.md): a fixed grid (the engine's SM budget) takes items from one ticket counter, in order:
//   * L1 items (m block, n1): rows [m * kBlockM, +kBlockM) times 128 gate columns AND the same 128 up
//     columns of intermediate block n1, K = hidden. The epilogue keeps both in registers, applies SwiGLU
//     (float32 of the bf16-rounded L1 values, as the unfused engines), finds each row's amax over the 128
//     columns (a block reduction in shared memory) and writes the fp8 intermediate and its scale: h never
//     leaves the chip, and the 128-column block is exactly one 1x128 quantisation group. Then it releases
//     the m block's arrival counter.
//   * L2 items (m block, n2): the same rows times 128 output columns, K = inter; each first waits (acquire,
//     bounded) until all inter / 128 L1 items of its m block arrived, then reads their fp8 rows (through L2:
//     cp.async.cg, never the non-coherent path) and writes bf16 output.
// Every L1 ticket precedes every L2 ticket, and a ticket is drawn only by a running block, so an L2 item
// waits only for items that running blocks already hold and that wait for nothing: no block needs another
// to be resident, whatever the grid or the SMs other work holds (the RFC's progress rule).
//
// Math: mma.sync m16n8k32 e4m3 (sm_89+), float32 partial sums over one 128-wide K block, promoted with the
// row's activation scale times the weight block's scale, as the Triton kernels do. 8 warps; warp w owns
// output columns [16 w, 16 w + 16) of the tile (for L1: of gate and of up alike), every row of it. Operands
// stream through a cp.async ring in shared memory (kStagesOf: 5 stages at 16 rows, 4 at 32; rows padded to
// 144 bytes: conflict-free 32-bit fragment loads). The wgmma kernel (fused_experts_wgmma.cu) keeps this work
// list, the epilogues and the arrival protocol (fused_common.cuh); docs/FUSED.md says what comes next.
#include <moe/fused_common.cuh>

namespace symmring_moe {
namespace fused {

constexpr int kWarps = kThreads / 32;
constexpr int kRowBytes = kBlockK + 16;    // shared row pitch: 36 words, so 8 rows x 4 lanes hit 32 banks
// Ring stages: as many as fit beside the registers (m32 at 5 stages spills). At small row counts an item
// streams weights and is latency bound: its speed is the bytes in flight (stages - 1) per SM.
template <int kBlockM>
constexpr int kStagesOf = kBlockM <= 16 ? 5 : 4;
constexpr int kMaxRowsB = 2 * kTileN;      // L1 loads gate and up rows

template <int kBlockM>
struct Shared {
    uint8_t a[kStagesOf<kBlockM>][kBlockM][kRowBytes];
    uint8_t b[kStagesOf<kBlockM>][kMaxRowsB][kRowBytes];
    float amax[kWarps][kBlockM];
    int item;
    int timed_out;
};

// --- the mma.sync main loop ------------------------------------------------------------------------

__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// --- one tile: acc[m tile][n8 tile][4] += A[rows, K] * B[cols, K]^T, block-scaled ------------------------

template <int kBlockM, int kHalves>
__device__ __forceinline__ void load_stage(Shared<kBlockM>& sm, const Operands& op, int stage, int kb) {
    const int tid = threadIdx.x;
    constexpr int kChunks = kBlockK / 16;
    for (int c = tid; c < kBlockM * kChunks; c += kThreads) {
        const int r = c / kChunks, col = (c % kChunks) * 16;
        const bool valid = op.row0 + r < op.rows_valid;
        const uint8_t* src = op.a + (valid ? (op.row0 + r) * op.a_stride : 0) + kb * kBlockK + col;
        cp_async_16(&sm.a[stage][r][col], src, valid);
    }
    for (int c = tid; c < kHalves * kTileN * kChunks; c += kThreads) {
        const int r = c / kChunks, col = (c % kChunks) * 16;
        // A select, not an index: a dynamically indexed array of the struct would live in local memory.
        const long long grow = (r < kTileN ? op.b_row0[0] : op.b_row0[1]) + (r % kTileN);
        cp_async_16(&sm.b[stage][r][col], op.b + grow * op.b_stride + kb * kBlockK + col, true);
    }
}

// Shared B row of warp w's n8 tile j (kHalves * 2 tiles per warp: two per half).
__device__ __forceinline__ int b_tile_row(int j, int warp) { return (j / 2) * kTileN + warp * 16 + (j % 2) * 8; }

template <int kBlockM, int kHalves>
__device__ __forceinline__ void tile_gemm(Shared<kBlockM>& sm, const Operands& op,
                                          float (&acc)[kBlockM / 16][2 * kHalves][4]) {
    constexpr int kMTiles = kBlockM / 16, kNTiles = 2 * kHalves, kStages = kStagesOf<kBlockM>;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mt][j][c] = 0.0f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < op.num_kb) load_stage<kBlockM, kHalves>(sm, op, s, s);
        cp_async_commit();
    }
    for (int kb = 0; kb < op.num_kb; ++kb) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // stage kb landed for every thread; stage kb - 1 is free to refill
        const int next = kb + kStages - 1;
        if (next < op.num_kb) load_stage<kBlockM, kHalves>(sm, op, next % kStages, next);
        cp_async_commit();

        // This K block's scales (issued before the MMAs: their latency hides behind them).
        float sa[kMTiles][2], sb[kHalves];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = op.row0 + mt * 16 + g + 8 * h;
                sa[mt][h] = r < op.rows_valid ? __ldcg(op.a_sf + r * op.a_sf_row + kb * op.a_sf_col) : 0.0f;
            }
#pragma unroll
        for (int h = 0; h < kHalves; ++h) sb[h] = __ldg(op.b_sf[h] + kb);

        float part[kMTiles][kNTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) part[mt][j][c] = 0.0f;

        const int stage = kb % kStages;
#pragma unroll
        for (int ks = 0; ks < kBlockK; ks += 32) {
            uint32_t bf[kNTiles][2];
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) {
                const uint8_t* row = sm.b[stage][b_tile_row(j, warp) + g];
                bf[j][0] = *reinterpret_cast<const uint32_t*>(row + ks + 4 * t);
                bf[j][1] = *reinterpret_cast<const uint32_t*>(row + ks + 16 + 4 * t);
            }
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const uint8_t* lo = sm.a[stage][mt * 16 + g];
                const uint8_t* hi = sm.a[stage][mt * 16 + g + 8];
                const uint32_t af[4] = {*reinterpret_cast<const uint32_t*>(lo + ks + 4 * t),
                                        *reinterpret_cast<const uint32_t*>(hi + ks + 4 * t),
                                        *reinterpret_cast<const uint32_t*>(lo + ks + 16 + 4 * t),
                                        *reinterpret_cast<const uint32_t*>(hi + ks + 16 + 4 * t)};
#pragma unroll
                for (int j = 0; j < kNTiles; ++j) mma_e4m3(part[mt][j], af, bf[j]);
            }
        }
        // Promote: acc += partial * (activation scale of the row * weight scale of the block).
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[mt][j][c] += part[mt][j][c] * (sa[mt][c / 2] * sb[j / 2]);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring before the next item refills it
}

// --- L1 + SwiGLU + quantisation ---------------------------------------------------------------------------

template <int kBlockM>
__device__ void l1_item(Shared<kBlockM>& sm, const FusedExpertsArgs& p, const Work& w, int item) {
    const Item it = item_of<kBlockM>(p, w, item, true);
    if (it.expert < 0) return;
    const int m_block = it.m_block, n1 = it.n_block, row0 = it.row0, e = it.expert;
    const Operands op = l1_operands(p, w, e, n1, row0);
    constexpr int kMTiles = kBlockM / 16;
    float acc[kMTiles][4][4];  // n8 tiles 0, 1: gate; 2, 3: up (the same columns)
    tile_gemm<kBlockM, 2>(sm, op, acc);

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    float row_amax[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        row_amax[mt][0] = row_amax[mt][1] = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float v = swiglu(acc[mt][j][c], acc[mt][j + 2][c], HardwareDivision());
                acc[mt][j][c] = v;
                row_amax[mt][c / 2] = fmaxf(row_amax[mt][c / 2], fabsf(v));
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_amax[mt][h] = fmaxf(row_amax[mt][h], __shfl_xor_sync(0xffffffffu, row_amax[mt][h], 1));
            row_amax[mt][h] = fmaxf(row_amax[mt][h], __shfl_xor_sync(0xffffffffu, row_amax[mt][h], 2));
            if (t == 0) sm.amax[warp][mt * 16 + g + 8 * h] = row_amax[mt][h];
        }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mt * 16 + g + 8 * h, row = row0 + r;
            float amax = 0.0f;
#pragma unroll
            for (int v = 0; v < kWarps; ++v) amax = fmaxf(amax, sm.amax[v][r]);
            const float scale = fp8_scale(amax, HardwareDivision());
            if (row >= p.num_rows) continue;
            if (warp == 0 && t == 0) *act_scale(p, row, n1) = scale;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const __nv_fp8x2_storage_t q = quantize_pair(acc[mt][j][2 * h], acc[mt][j][2 * h + 1], scale,
                                                               HardwareDivision());
                const int col = n1 * kTileN + warp * 16 + j * 8 + 2 * t;
                *reinterpret_cast<__nv_fp8x2_storage_t*>(p.act + static_cast<long long>(row) * p.inter + col) = q;
            }
        }
    __syncthreads();  // every thread's stores precede the release below (and sm.amax is free again)
    release_arrival(p, m_block);
}

// --- L2 ---------------------------------------------------------------------------------------------------

template <int kBlockM>
__device__ void l2_item(Shared<kBlockM>& sm, const FusedExpertsArgs& p, const Work& w, int item) {
    const Item it = item_of<kBlockM>(p, w, item, false);
    if (it.expert < 0) return;
    const int m_block = it.m_block, n2 = it.n_block, row0 = it.row0, e = it.expert;
    const bool timed_out = l2_arrivals_expired(p, w, m_block, sm.timed_out);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    constexpr int kMTiles = kBlockM / 16;
    float acc[kMTiles][2][4];
    if (timed_out) {  // no finite garbage: the tile is NaN and status names it
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[mt][j][c] = __int_as_float(0x7fc00000);
    } else {
        tile_gemm<kBlockM, 1>(sm, l2_operands(p, w, e, n2, row0), acc);
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mt * 16 + g + 8 * h;
            if (row >= p.num_rows) continue;
            __nv_bfloat16* dst = out_row(p, row);
            if (dst == nullptr) continue;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = n2 * kTileN + warp * 16 + j * 8 + 2 * t;
                *reinterpret_cast<__nv_bfloat162*>(dst + col) =
                    __floats2bfloat162_rn(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
            }
        }
}

// --- the persistent kernel ---------------------------------------------------------------------------------

template <int kBlockM>
__device__ void run(const FusedExpertsArgs& p) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    Shared<kBlockM>& sm = *reinterpret_cast<Shared<kBlockM>*>(smem_raw);
    if (!shared_memory_fits(p, sizeof(Shared<kBlockM>))) return;  // a launch the host sized wrong
    const Work w = work_of<kBlockM>(p);
    run_items(p, w, sm.item, [&](int item) { l1_item<kBlockM>(sm, p, w, item); },
              [&](int item) { l2_item<kBlockM>(sm, p, w, item); });
}

}  // namespace fused
}  // namespace symmring_moe

using symmring_moe::FusedExpertsArgs;

// One kernel per rows-per-item: 16 for decode-sized groups, 32 for larger ones (the engine picks by its
// rows-per-expert bound). 64 rows hold 128 float32 accumulators per thread at 8 warps and spill (ptxas: 255
// registers, 52 bytes): larger row tiles wait for wgmma, whose accumulators a warpgroup shares.
// Grid: the SM budget; block: 256 threads; dynamic shared memory: Shared<kBlockM>.
extern "C" __global__ void __launch_bounds__(256, 1) moe_fused_experts_m16(const FusedExpertsArgs args) {
    symmring_moe::fused::run<16>(args);
}

extern "C" __global__ void __launch_bounds__(256, 1) moe_fused_experts_m32(const FusedExpertsArgs args) {
    symmring_moe::fused::run<32>(args);
}
