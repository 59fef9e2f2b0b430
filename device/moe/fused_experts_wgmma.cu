// symmring-jit: sm_90a
// The fused experts kernel with a Hopper wgmma main loop: moe_fused_experts_wg64.
//
// The same work list, tickets, arrival protocol, pool layout, scale promotion and epilogue arithmetic as the
// mma.sync kernels of fused_experts.cu (all in fused_common.cuh; docs/FUSED.md), with 64 rows per item and
// `wgmma.mma_async m64n64k32 e4m3` (sm_90a: the line above asks symmring.jit for that target on cc 9.0).
//
// Two math warpgroups (256 threads), no producer warp: every thread issues its share of the cp.async loads.
// The items' split between the warpgroups, the wgmma streams, the promotion and the epilogues are in
// fused_wgmma.cuh, shared with the TMA kernel wg64t (fused_experts_tma.cu).
// Per 128-wide K block: 4 k steps of wgmma into fresh partial sums (scale-d 0 on the first), commit, wait,
// then acc += part * (row scale x weight block scale), as the mma.sync kernels promote.
//
// Shared memory: a 4-stage ring of A (64 rows) and B (256 rows for L1, 128 for L2) tiles of 128-byte rows,
// K-major as both operands sit in global memory (pool rows [rows, hidden], weights [N, K]; fp8 wgmma takes
// K-major only). Rows are stored with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)) in
// tiles aligned to 1024 bytes, which is what the descriptors say (swizzle mode 1 = 128B, SBO 1024 B =
// 8 rows x 128 B; a k step of 32 bytes inside the 128-byte swizzle atom adds 32 bytes to the start address).
// Those layouts and the accumulator fragment's are in wgmma_layout.cuh, which a CPU test checks against the PTX ISA.
// cp.async writes through the generic proxy and wgmma reads through the async proxy: each thread fences
// (fence.proxy.async) after its copies landed and before the barrier that precedes the wgmma.
//
// The epilogues divide with fused_div.cuh's call-free IEEE division (the same bits as __fdiv_rn): a call in
// the kernel would make ptxas serialise every wgmma.
//
// Built for another target than sm_90a (a cc 8.9 or 10.x device, or a compile without the marker), the kernel
// records kStatusWrongTarget and computes nothing; the engine picks it only on cc 9.0.
#include <moe/fused_wgmma.cuh>

namespace symmring_moe {
namespace fused {
namespace wg {

constexpr int kStages = 4;
constexpr int kWarpgroups = kThreads / 128;
static_assert(kWarpgroups == kMathWarpgroups, "every warpgroup of wg64 is a math warpgroup");

// Every tile is a multiple of 1024 bytes, so with the struct at a 1024-byte aligned address each tile is too.
struct Shared {
    uint8_t a[kStages][kBlockM * kBlockK];
    uint8_t b[kStages][2 * kTileN * kBlockK];  // L1: gate rows then up rows; L2: the first 128 rows
    float amax[kWarpgroups][kBlockM];
    int item;
    int timed_out;
};
static_assert(kBlockM * kBlockK % kSwizzleAtom == 0 && 2 * kTileN * kBlockK % kSwizzleAtom == 0 &&
                  kWgCols * kBlockK % kSwizzleAtom == 0,
              "tiles (and each warpgroup's B rows in them) must keep the 1024-byte alignment of the swizzle atom");

// The launch's dynamic shared memory: the layout plus the slack to align its base up to 1024 bytes.
constexpr uint32_t kDynamicSharedBytes = sizeof(Shared) + kSwizzleAtom;
static_assert(kDynamicSharedBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");

}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace symmring_moe {
namespace fused {
namespace wg {

// --- one tile: acc[half][32] += A[64 rows, K] * B[this warpgroup's 64 columns of the half, K]^T -------------

template <int kHalves>
__device__ __forceinline__ void load_stage(Shared& sm, const Operands& op, int stage, int kb) {
    constexpr int kChunks = kBlockK / 16;
    constexpr int kAChunks = kBlockM * kChunks, kBChunks = kHalves * kTileN * kChunks;
    static_assert(kAChunks % kThreads == 0 && kBChunks % kThreads == 0, "every thread copies whole rounds");
#pragma unroll
    for (int i = 0; i < kAChunks / kThreads; ++i) {
        const int c = threadIdx.x + i * kThreads, r = c / kChunks, chunk = c % kChunks;
        const bool valid = op.row0 + r < op.rows_valid;
        const uint8_t* src = op.a + (valid ? (op.row0 + r) * op.a_stride : 0) + kb * kBlockK + chunk * 16;
        cp_async_16(sm.a[stage] + swizzled(r, chunk), src, valid);
    }
#pragma unroll
    for (int i = 0; i < kBChunks / kThreads; ++i) {
        const int c = threadIdx.x + i * kThreads, r = c / kChunks, chunk = c % kChunks;
        // A select, not an index: a dynamically indexed array of the struct would live in local memory.
        const long long grow = (r < kTileN ? op.b_row0[0] : op.b_row0[1]) + (r % kTileN);
        cp_async_16(sm.b[stage] + swizzled(r, chunk), op.b + grow * op.b_stride + kb * kBlockK + chunk * 16, true);
    }
}

template <int kHalves>
__device__ __forceinline__ void tile_gemm(Shared& sm, const Operands& op, float (&acc)[kHalves][kFrag]) {
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < kFrag; ++i) acc[h][i] = 0.0f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < op.num_kb) load_stage<kHalves>(sm, op, s, s);
        cp_async_commit();
    }
    // The K block's scales are loaded one block ahead: issued just before the wgmma of their own block, their
    // latency (an L2 round trip under load) outlasted it, and the promotion waited on them (Nsight Compute: the
    // largest stall was L1TEX scoreboard, 35% of the cycles between issues).
    float sa[2], sb[kHalves];
    load_scales<kHalves>(op, t, 0, sa, sb);
    float part[kHalves][kFrag];
    for (int kb = 0; kb < op.num_kb; ++kb) {
        cp_async_wait<kStages - 2>();
        fence_proxy_async();  // this thread's copies of stage kb (generic proxy) before wgmma reads them (async)
        __syncthreads();      // every thread's copies of stage kb landed; every warpgroup is done with stage kb - 1

        // The next K block's scales (the last block reloads its own: no branch), used after the next wgmma.
        float sa_next[2], sb_next[kHalves];
        load_scales<kHalves>(op, t, kb + 1 < op.num_kb ? kb + 1 : kb, sa_next, sb_next);

        const int stage = kb % kStages;
        wgmma_k_block<kHalves>(part, sm.a[stage], sm.b[stage], wg);
        // While the tensor cores multiply: refill the stage block kb - 1 used (every warpgroup waited for its
        // wgmma before the barrier above), so the copies' issue no longer stands between two wgmma groups.
        const int next = kb + kStages - 1;
        if (next < op.num_kb) load_stage<kHalves>(sm, op, next % kStages, next);
        cp_async_commit();
        wgmma_wait_all();
#pragma unroll
        for (int h = 0; h < kHalves; ++h) fence_operands(part[h]);

        promote<kHalves>(acc, part, sa, sb, sa_next, sb_next);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warpgroup is done with the ring before the next item refills it
}

// --- L1 + SwiGLU + quantisation ---------------------------------------------------------------------------

__device__ __forceinline__ void l1_item(Shared& sm, const FusedExpertsArgs& p, const Work& w, int item) {
    const Item it = item_of<kBlockM>(p, w, item, true);
    if (it.expert < 0) return;
    const int m_block = it.m_block, n1 = it.n_block, row0 = it.row0, e = it.expert;
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    bool live[2];
    live_rows(p, row0, t, live);
    float acc[2][kFrag];  // [0]: gate, [1]: up, this warpgroup's 64 columns of n1 in both
    tile_gemm<2>(sm, l1_operands(p, w, e, n1, row0), acc);

    l1_swiglu_amax(acc, sm.amax, wg, t);
    __syncthreads();  // both warpgroups' halves of every row's amax
    l1_quantize_store(p, w, acc, sm.amax, live, wg, t, row0, n1);
    __syncthreads();  // every thread's stores precede the release below (and sm.amax is free again)
    release_arrival(p, m_block);
}

// --- L2 ---------------------------------------------------------------------------------------------------

__device__ __forceinline__ void l2_item(Shared& sm, const FusedExpertsArgs& p, const Work& w, int item) {
    const Item it = item_of<kBlockM>(p, w, item, false);
    if (it.expert < 0) return;
    const int m_block = it.m_block, n2 = it.n_block, row0 = it.row0, e = it.expert;
    const bool timed_out = l2_arrivals_expired(p, w, m_block, sm.timed_out);
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    bool live[2];
    live_rows(p, row0, t, live);
    float acc[1][kFrag];
    if (timed_out) {  // no finite garbage: the tile is NaN and status names it
        fill_nan(acc[0]);
    } else {
        tile_gemm<1>(sm, l2_operands(p, w, e, n2, row0), acc);
    }
    l2_store(p, acc[0], live, wg, t, row0, n2);
}

// --- the persistent kernel ---------------------------------------------------------------------------------

__device__ __forceinline__ void run(const FusedExpertsArgs& p) {
    extern __shared__ __align__(16) uint8_t wg_smem_raw[];
    if (!shared_memory_fits(p, kDynamicSharedBytes)) return;  // a launch the host sized wrong
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem_raw));
    Shared& sm = *reinterpret_cast<Shared*>(wg_smem_raw + ((0u - base) % kSwizzleAtom));  // 1024-byte aligned
    const Work w = work_of<kBlockM>(p);
    run_items(p, w, sm.item, [&](int item) { l1_item(sm, p, w, item); }, [&](int item) { l2_item(sm, p, w, item); });
}

}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

using symmring_moe::FusedDivProbeArgs;
using symmring_moe::FusedExpertsArgs;

// The epilogue's division on n pairs: q[i] = a[i] / b[i] (fused_div.cuh), for the GPU test to compare with
// torch's IEEE division bit for bit. Any target. Grid and block: any, covering n.
extern "C" __global__ void moe_fused_div_probe(const FusedDivProbeArgs args) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < args.n) args.q[i] = symmring_moe::fused::div::divide(args.a[i], args.b[i]);
}

// 64 rows per item, wgmma (sm_90a). Grid: the SM budget; block: 256 threads (two warpgroups); dynamic shared
// memory: fused::wg::kDynamicSharedBytes.
extern "C" __global__ void __launch_bounds__(256, 1) moe_fused_experts_wg64(const FusedExpertsArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    symmring_moe::fused::wg::run(args);
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicCAS(args.status, 0, symmring_moe::fused::kStatusWrongTarget);
#endif
}
