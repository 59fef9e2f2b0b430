// symmring-jit: sm_90a
// symmring-jit: whole-program
// The fused experts kernel with a warp-specialised TMA + wgmma main loop: moe_fused_experts_wg64t.
//
// The same items, wgmma streams, promotion and epilogues as wg64 (fused_wgmma.cuh; so the same bits), with the
// loads taken off the math warps, as DeepGEMM's and CUTLASS's sm90 warp-specialised kernels do:
//   * 3 warpgroups (384 threads). Warpgroup 0 is the producer: its thread 0 draws the tickets (fused_common.cuh),
//     waits for an L2 item's L1 arrivals and issues the TMA loads of every K block; the warpgroup gives its
//     registers back (setmaxnreg 40). Warpgroups 1 and 2 are math warpgroups 0 and 1 of wg64 (setmaxnreg 232).
//   * A ring of kStages stages, each with a full mbarrier (the producer's arrive.expect_tx of the stage's bytes;
//     the TMA copies complete the transaction) and an empty mbarrier (one arrival per math warp once its wgmma
//     on the stage is done). The ring's stage and phase run on across items: no drain between them.
//   * TMA copies of 128-byte rows with CU_TENSOR_MAP_SWIZZLE_128B into 1024-byte aligned tiles: exactly the
//     swizzled K-major layout wg64's cp.async stores and the descriptors of wgmma_layout.cuh describe. Rows past
//     the map's rows (the pass's num_rows) arrive as zeros, as wg64 zero-fills them.
//   * The tensor maps (symmring.moe.gpu.tensor_map) are members of the __grid_constant__ parameter.
// Items, tickets and the L1 -> L2 arrival protocol are block-wide, as in wg64: every thread of the three
// warpgroups takes the same __syncthreads; the producer warpgroup's item functions mirror the math ones'.
//
// The intermediate is written by other blocks' L1 epilogues (generic proxy) and read here by TMA (async proxy):
// the writers fence.proxy.async.global before the release, the TMA thread after its acquire.
//
// Built for another target than sm_90a, the kernel records kStatusWrongTarget and computes nothing.
#include <moe/fused_wgmma.cuh>

namespace symmring_moe {
namespace fused {
namespace wg {
namespace tma {

constexpr int kStages = 5;
constexpr int kBlockThreads = 128 * (1 + kMathWarpgroups);  // the producer warpgroup, then the math ones
constexpr int kMathWarps = 4 * kMathWarpgroups;              // the empty barriers' arrivals per phase
constexpr int kProducerRegisters = 40, kMathRegisters = 232;
static_assert(kProducerRegisters * 128 + kMathRegisters * 128 * kMathWarpgroups <= 65536,
              "the warpgroups' registers after setmaxnreg must fit the SM's 64K");
constexpr uint32_t kATileBytes = kBlockM * kBlockK;
constexpr uint32_t kBHalfBytes = kTileN * kBlockK;  // one TMA box of B: 128 rows

struct Shared {
    uint8_t a[kStages][kATileBytes];
    uint8_t b[kStages][2 * kBHalfBytes];  // L1: gate rows then up rows; L2: the first 128 rows
    uint64_t full[kStages];
    uint64_t empty[kStages];
    float amax[kMathWarpgroups][kBlockM];
    int item;
    int timed_out;
    int stalled;  // a ring wait expired: every later wait gives up at once (Clock)
};
static_assert(kATileBytes % kSwizzleAtom == 0 && kBHalfBytes % kSwizzleAtom == 0,
              "tiles must keep the 1024-byte alignment of the swizzle atom");

// The launch's dynamic shared memory: the layout plus the slack to align its base up to 1024 bytes.
constexpr uint32_t kDynamicSharedBytes = sizeof(Shared) + kSwizzleAtom;
static_assert(kDynamicSharedBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");

}  // namespace tma
}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace symmring_moe {
namespace fused {
namespace wg {
namespace tma {

// --- PTX wrappers: mbarrier, TMA, setmaxnreg (sm_90) ------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// The barriers' initialisation, visible to the async proxy (the TMA unit completes transactions on them).
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t addr, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
    return done != 0;
}

// The box of `map` at (inner element c0, row c1) into `dst`; its bytes complete a transaction of `bar`.
__device__ __forceinline__ void tma_load_2d(uint8_t* dst, const TensorMap* map, uint64_t* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
            "r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
        : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Global memory written through the generic proxy, ordered with TMA reads (the async proxy) of it.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// --- the ring: one position per K block, stage and phase running on across items ---------------------------

// The bound of the ring's waits. They need only this block's progress (its TMA copies, its math warps), so they
// expire only on a fault of the kernel itself; then the first to expire records kStatusPipelineStalled and
// raises sm.stalled, every wait after it gives up at once, and the items run on to the end without the ring
// (no tile computed: NaN), so the kernel exits and the host names the error instead of hanging.
// The bound is the engine's timeout, at least kRingWaitFloorNs: a ring wait takes microseconds, and a short
// protocol timeout (a test of the L2 arrival expiry) must not pass for a stall.
constexpr uint64_t kRingWaitFloorNs = 1000ull * 1000ull * 1000ull;
struct Clock {
    volatile int* stalled;
    int* status;
    uint64_t timeout_ns;
};

// Wait until the barrier's phase of parity `parity` completed; false when the bound expired or another wait's did.
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, uint32_t parity, const Clock& clock) {
    const uint32_t addr = smem_addr(bar);
    if (mbar_try_wait(addr, parity)) return true;
    if (*clock.stalled) return false;
    const uint64_t deadline = now_ns() + clock.timeout_ns;
    for (uint32_t polls = 0;; ++polls) {
        if (mbar_try_wait(addr, parity)) return true;
        if (polls % 64 == 63 && (*clock.stalled || now_ns() > deadline)) {
            *clock.stalled = 1;
            atomicCAS(clock.status, 0, kStatusPipelineStalled);
            return false;
        }
    }
}

struct Ring {
    uint32_t kb = 0;  // K blocks through the ring so far (this thread's count; every role counts the same)
    __device__ __forceinline__ int stage() const { return static_cast<int>(kb % kStages); }
    __device__ __forceinline__ uint32_t phase() const { return (kb / kStages) & 1u; }
};

// --- the producer: thread 0 of warpgroup 0 ------------------------------------------------------------------

// Every K block of one item: wait for the stage to be free, expect its bytes, issue the copies of A (64 rows
// from a_row) and kHalves B boxes (128 rows from b_row[h]).
template <int kHalves>
__device__ __forceinline__ void produce(Shared& sm, Ring& ring, const Clock& clock, const TensorMap* a_map,
                                        const TensorMap* b_map, int a_row, const int (&b_row)[2], int num_kb) {
    if (threadIdx.x != 0 || *clock.stalled) return;  // stalled: the ring's phases mean nothing any more
    for (int kb = 0; kb < num_kb; ++kb, ++ring.kb) {
        const int s = ring.stage();
        // A fresh barrier's "previous" phase counts as done: the first round needs no math warp's arrival.
        if (!mbar_wait(&sm.empty[s], ring.phase() ^ 1u, clock)) return;
        mbar_arrive_expect_tx(&sm.full[s], kATileBytes + kHalves * kBHalfBytes);
        tma_load_2d(sm.a[s], a_map, &sm.full[s], kb * kBlockK, a_row);
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
            tma_load_2d(sm.b[s] + h * kBHalfBytes, b_map, &sm.full[s], kb * kBlockK, b_row[h]);
    }
}

// --- the math warpgroups: acc[half][32] += A[64 rows, K] * B[this warpgroup's 64 columns of the half, K]^T ---

template <int kHalves>
__device__ __forceinline__ void tile_gemm(Shared& sm, Ring& ring, const Clock& clock, const Operands& op,
                                          float (&acc)[kHalves][kFrag], int wg, int t) {
    const bool stalled = *clock.stalled;  // read once: a flag raised in between must not leave a tile of zeros
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < kFrag; ++i) acc[h][i] = stalled ? __int_as_float(0x7fc00000) : 0.0f;
    if (stalled) return;  // the ring's phases mean nothing any more: no tile (NaN)
    float sa[2], sb[kHalves];
    load_scales<kHalves>(op, t, 0, sa, sb);  // one block ahead, as wg64
    float part[kHalves][kFrag];
    for (int kb = 0; kb < op.num_kb; ++kb, ++ring.kb) {
        float sa_next[2], sb_next[kHalves];
        load_scales<kHalves>(op, t, kb + 1 < op.num_kb ? kb + 1 : kb, sa_next, sb_next);
        const int s = ring.stage();
        if (!mbar_wait(&sm.full[s], ring.phase(), clock)) {  // stalled: no data, no tile
#pragma unroll
            for (int h = 0; h < kHalves; ++h) fill_nan(acc[h]);
            return;
        }
        wgmma_k_block<kHalves>(part, sm.a[s], sm.b[s], wg);
        wgmma_wait_all();
#pragma unroll
        for (int h = 0; h < kHalves; ++h) fence_operands(part[h]);
        if (threadIdx.x % 32 == 0) mbar_arrive(&sm.empty[s]);  // this warp's wgmma no longer reads the stage
        promote<kHalves>(acc, part, sa, sb, sa_next, sb_next);
    }
}

// --- items: the producer's and the math warpgroups' halves, with the same block barriers --------------------

// B rows of an item in the 2D view of its weights: expert e's rows start at e * rows_per_expert.
__device__ __forceinline__ void b_rows(const Operands& op, int e, int rows_per_expert, int (&row)[2]) {
    row[0] = e * rows_per_expert + op.b_row0[0];
    row[1] = e * rows_per_expert + op.b_row0[1];
}

template <bool kProducer>
__device__ __forceinline__ void l1_item(Shared& sm, Ring& ring, const Clock& clock, const FusedExpertsTmaArgs& args,
                                        const Work& w, int item) {
    const FusedExpertsArgs& p = args.experts;
    const Item it = item_of<kBlockM>(p, w, item, true);
    if (it.expert < 0) return;
    const Operands op = l1_operands(p, w, it.expert, it.n_block, it.row0);
    if (kProducer) {
        int row[2];
        b_rows(op, it.expert, 2 * p.inter, row);
        produce<2>(sm, ring, clock, &args.pool_x_map, &args.w13_map, it.row0, row, op.num_kb);
        __syncthreads();  // the math warpgroups' row maxima
        __syncthreads();  // their stores of the intermediate
        release_arrival(p, it.m_block);
    } else {
        const int wg = threadIdx.x / 128 - 1, t = threadIdx.x % 128;
        float acc[2][kFrag];  // [0]: gate, [1]: up, this warpgroup's 64 columns of n1 in both
        tile_gemm<2>(sm, ring, clock, op, acc, wg, t);
        l1_swiglu_amax(acc, sm.amax, wg, t);
        __syncthreads();  // both warpgroups' halves of every row's amax
        l1_quantize_store(p, w, acc, sm.amax, wg, t, it.row0, it.n_block);
        fence_proxy_async_global();  // the stores before other blocks' TMA reads of them (after the release)
        __syncthreads();  // every thread's stores precede the release (and sm.amax is free again)
    }
}

template <bool kProducer>
__device__ __forceinline__ void l2_item(Shared& sm, Ring& ring, const Clock& clock, const FusedExpertsTmaArgs& args,
                                        const Work& w, int item) {
    const FusedExpertsArgs& p = args.experts;
    const Item it = item_of<kBlockM>(p, w, item, false);
    if (it.expert < 0) return;
    const bool timed_out = l2_arrivals_expired(p, w, it.m_block, sm.timed_out);
    const Operands op = l2_operands(p, w, it.expert, it.n_block, it.row0);
    if (kProducer) {
        if (timed_out) return;
        fence_proxy_async_global();  // thread 0's acquire of the intermediate, then its TMA reads of it
        int row[2];
        b_rows(op, it.expert, p.hidden, row);
        produce<1>(sm, ring, clock, &args.act_map, &args.w_down_map, it.row0, row, op.num_kb);
    } else {
        const int wg = threadIdx.x / 128 - 1, t = threadIdx.x % 128;
        float acc[1][kFrag];
        if (timed_out) {
            fill_nan(acc[0]);
        } else {
            tile_gemm<1>(sm, ring, clock, op, acc, wg, t);
        }
        l2_store(p, acc[0], wg, t, it.row0, it.n_block);
    }
}

// --- the persistent kernel ---------------------------------------------------------------------------------

__device__ __forceinline__ void run(const FusedExpertsTmaArgs& args) {
    extern __shared__ __align__(16) uint8_t tma_smem_raw[];
    const FusedExpertsArgs& p = args.experts;
    if (!shared_memory_fits(p, kDynamicSharedBytes)) return;  // a launch the host sized wrong
    const uint32_t base = smem_addr(tma_smem_raw);
    Shared& sm = *reinterpret_cast<Shared*>(tma_smem_raw + ((0u - base) % kSwizzleAtom));  // 1024-byte aligned
    if (threadIdx.x == 0) {
        sm.stalled = 0;
        for (int s = 0; s < kStages; ++s) {
            mbar_init(&sm.full[s], 1);  // the producer's arrive.expect_tx; the copies complete the bytes
            mbar_init(&sm.empty[s], kMathWarps);
        }
        fence_barrier_init();
        prefetch_tensor_map(&args.pool_x_map);
        prefetch_tensor_map(&args.act_map);
        prefetch_tensor_map(&args.w13_map);
        prefetch_tensor_map(&args.w_down_map);
    }
    __syncthreads();
    const Work w = work_of<kBlockM>(p);
    const Clock clock{&sm.stalled, p.status, p.timeout_ns > kRingWaitFloorNs ? p.timeout_ns : kRingWaitFloorNs};
    Ring ring;
    if (threadIdx.x < 128) {
        setmaxnreg_dec<kProducerRegisters>();
        run_items(p, w, sm.item, [&](int item) { l1_item<true>(sm, ring, clock, args, w, item); },
                  [&](int item) { l2_item<true>(sm, ring, clock, args, w, item); });
    } else {
        setmaxnreg_inc<kMathRegisters>();
        run_items(p, w, sm.item, [&](int item) { l1_item<false>(sm, ring, clock, args, w, item); },
                  [&](int item) { l2_item<false>(sm, ring, clock, args, w, item); });
    }
}

}  // namespace tma
}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

using symmring_moe::FusedExpertsTmaArgs;

// 64 rows per item, TMA + wgmma (sm_90a). Grid: the SM budget; block: 384 threads (a producer warpgroup, two
// math warpgroups); dynamic shared memory: fused::wg::tma::kDynamicSharedBytes.
extern "C" __global__ void __launch_bounds__(symmring_moe::fused::wg::tma::kBlockThreads, 1)
    moe_fused_experts_wg64t(const __grid_constant__ FusedExpertsTmaArgs args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    symmring_moe::fused::wg::tma::run(args);
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicCAS(args.experts.status, 0, symmring_moe::fused::kStatusWrongTarget);
#endif
}
