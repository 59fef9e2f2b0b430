// symmring-jit: sm_90a
// symmring-jit: whole-program
// The fused experts kernel with a warp-specialised TMA + wgmma main loop: moe_fused_experts_wg64t.
//
// The same wgmma streams, promotion and epilogues as wg64 (fused_wgmma.cuh; so the same bits) on wg64's items, but
// for L2 items of two output blocks where hidden / 128 is even (with_l2_pairs), with the loads taken off the math
// warps, as DeepGEMM's and CUTLASS's sm90 warp-specialised kernels do:
//   * 3 warpgroups (384 threads). Warpgroup 0 is the producer: its thread 0 draws the tickets, skips padding,
//     waits for an L2 item's L1 arrivals, pushes the item into a queue of kQueue entries in shared memory and
//     issues the TMA loads of its K blocks; the warpgroup gives its registers back (setmaxnreg 48) and its other
//     threads leave. Warpgroups 1 and 2 are math warpgroups 0 and 1 of wg64 (setmaxnreg 224): they pop items
//     and compute them. After the set-up no barrier spans the block, so the producer runs on into the next items
//     while the math warpgroups finish one (its epilogue, its stores): no drain of the ring between items.
//   * A ring of kStages stages, each with a full mbarrier (the producer's arrive.expect_tx of the stage's bytes;
//     the TMA copies complete the transaction) and an empty mbarrier (one arrival per math warp once its wgmma
//     on the stage is done). The ring's stage and phase run on across items.
//   * The queue's entries have full and empty mbarriers likewise; the two math warpgroups exchange an L1 item's
//     row maxima through a third pair (amax_ready, double-buffered). Each math warpgroup releases its own
//     arrival of an L1 item after its stores (kArrivalsPerL1Item per item), so no barrier spans them either.
//   * TMA copies of 128-byte rows with CU_TENSOR_MAP_SWIZZLE_128B into 1024-byte aligned tiles: exactly the
//     swizzled K-major layout wg64's cp.async stores and the descriptors of wgmma_layout.cuh describe. Rows past
//     the map's rows (the pass's num_rows) arrive as zeros, as wg64 zero-fills them.
//   * The tensor maps (symmring.moe.gpu.tensor_map) are members of the __grid_constant__ parameter.
//   * A stage's scales come with it: the activation scales by one more TMA copy per 64 A rows from the MN-major
//     scales (the pool's, the intermediate's), the weight block scale of each B box by a 4-byte cp.async whose
//     landing is the full barrier's second arrival. The math warps read no global memory in the main loop.
// Tickets and the L1 -> L2 arrival protocol are wg64's (fused_common.cuh), with the waits at the producer.
//
// The intermediate is written by other blocks' L1 epilogues (generic proxy) and read here by TMA (async proxy):
// the writers fence.proxy.async.global before the release, the TMA thread after its acquire.
//
// Built for another target than sm_90a, the kernel records kStatusWrongTarget and computes nothing.
#include <moe/fused_profile.cuh>
#include <moe/fused_spans.cuh>
#include <moe/fused_wgmma.cuh>
#include <moe/fused_wgmma128.cuh>

namespace symmring_moe {
namespace fused {
namespace wg {
namespace tma {

constexpr int kQueue = 4;              // item entries the producer may run ahead of the math warpgroups
constexpr int kArrivalsPerL1Item = 2;  // each math warpgroup releases its own columns of an L1 item
constexpr int kBlockThreads = 128 * (1 + kMathWarpgroups);  // the producer warpgroup, then the math ones
constexpr int kMathWarps = 4 * kMathWarpgroups;              // the empty barriers' arrivals per phase
constexpr int kProducerRegisters = 48, kMathRegisters = 224;
constexpr int kLaunchRegisters = 168;  // 64K / 384 threads, rounded down to 8: what the block holds at launch
// setmaxnreg moves registers within the block's launch allocation (not the SM's 64K): asking for more, the math
// warpgroups' setmaxnreg.inc would wait forever (232 with a producer of 48 did: 1024 registers more than the
// producer gave back).
static_assert(kProducerRegisters * 128 + kMathRegisters * 128 * kMathWarpgroups <= kLaunchRegisters * kBlockThreads,
              "the warpgroups' registers after setmaxnreg must fit the block's allocation at launch");
constexpr int kABoxRows = 64;  // rows of one TMA box of A (the host's pool and intermediate maps)
constexpr int kTableBlocks = 2048;  // 64-row blocks whose first row's expert id the block keeps in shared memory
constexpr int kBlocksPerGroup = kAlign / kABoxRows;
constexpr int kTableGroups = kTableBlocks / kBlocksPerGroup;  // the 128-row groups they cover (their spans)

// The geometry of the two kernels. wg64t: 64-row items, B boxes of 128 rows (L1: gate, up; L2: one). wg128t:
// 128-row items (a whole group), B boxes of 64 rows (L1: gate, up of a pass's 64 columns; L2: the two halves of
// the output block), its first L1 pass's values kept in shared memory (wg128::Keep, a base of Shared).
template <int kRows>
struct Tile {
    static constexpr int kBlockM = kRows;
    static constexpr int kStages = 5;
    static constexpr uint32_t kATileBytes = kRows * kBlockK;
    static constexpr int kABoxes = kRows / kABoxRows;
    static constexpr int kBBoxRows = kRows == 64 ? kTileN : wg128::kBoxRows;
    static constexpr uint32_t kBBoxBytes = kBBoxRows * kBlockK;
    static constexpr uint32_t kScaleBytes = kRows * 4;  // the stage's K block: each A row's activation scale
};
using Tile64 = Tile<wg::kBlockM>;
using Tile128 = Tile<wg128::kBlockM>;

template <class T>
struct Keep {};  // wg64t keeps nothing (an empty base: no bytes)
template <>
struct Keep<Tile128> : wg128::Keep {};

template <class T>
struct Shared : Keep<T> {
    uint8_t a[T::kStages][T::kATileBytes];
    uint8_t b[T::kStages][2 * T::kBBoxBytes];  // two boxes of B rows
    float sa[T::kStages][T::kBlockM];           // each A row's activation scale (0 past the pass's rows)
    float sb[T::kStages][2];                    // each B box's weight block scale (cp.async: scale_copies)
    uint64_t full[T::kStages];
    uint64_t empty[T::kStages];
    uint64_t queue_full[kQueue];   // the producer pushed the entry
    uint64_t queue_empty[kQueue];  // every math warp read it
    uint64_t amax_ready[2];        // both math warpgroups wrote their row maxima of an L1 item (two in flight)
    uint64_t stored[kMathWarpgroups];  // a math warpgroup's four warps stored their part of an L1 item
    float amax[2][kMathWarpgroups][kBlockM];  // wg64t's row maxima (wg128t's rows stay in one warpgroup)
    int block_expert[kTableBlocks];  // m_indices at rows 0, 64, 128, ... (the producer's decoding, no global read)
    int16_t span_first[kTableGroups];   // each group's span (span_of): its first group
    int16_t span_groups[kTableGroups];  //   and its groups
    int queue_ticket[kQueue];
    int queue_expert[kQueue];        // the item's local expert, m block, n block and first row (the producer's
    int queue_m_block[kQueue];       //   decoding: the math warps decode nothing)
    int queue_n_block[kQueue];
    int queue_row0[kQueue];
    int queue_expired[kQueue];
    int closed;     // after a stall: the producer pushes and fills no more (close_queue), then:
    int queue_end;  //   the entries it pushed
    int ring_end;   //   the ring positions it filled
    int dispatch_blocks;  // beside the fused dispatch (dispatch_plan): its grid, or kPlanAbandoned; else 0 (wait_plan)
};
static_assert(Tile64::kBBoxBytes % kSwizzleAtom == 0 && Tile128::kBBoxBytes % kSwizzleAtom == 0 &&
                  (kABoxRows * kBlockK) % kSwizzleAtom == 0 && sizeof(wg128::Keep) % kSwizzleAtom == 0,
              "tiles must keep the 1024-byte alignment of the swizzle atom");

// sa follows Keep and the tiles, all multiples of the 1024-byte swizzle atom (asserted above): every 64-row box of
// scales lands 128-byte aligned, as a TMA destination must.
static_assert((kABoxRows * 4) % 128 == 0 && Tile64::kScaleBytes == Tile64::kABoxes * kABoxRows * 4 &&
                  Tile128::kScaleBytes == Tile128::kABoxes * kABoxRows * 4,
              "one 128-byte aligned box of scales per 64 A rows");

// The launch's dynamic shared memory: the layout plus the slack to align its base up to 1024 bytes.
template <class T>
constexpr uint32_t kDynamicSharedBytes = sizeof(Shared<T>) + kSwizzleAtom;
static_assert(kDynamicSharedBytes<Tile64> <= 227 * 1024 && kDynamicSharedBytes<Tile128> <= 227 * 1024,
              "more shared memory than an sm_90 block may have");

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

// tma_load_2d with an L2 eviction priority (`policy`, from l2_policy).
__device__ __forceinline__ void tma_load_2d(uint8_t* dst, const TensorMap* map, uint64_t* bar, int c0, int c1,
                                            uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "l"(policy)
        : "memory");
}

// The L2 policy of the weight copies: evict first (FusedExpertsArgs::weights_evict_first: each tile is read once)
// or normal.
__device__ __forceinline__ uint64_t l2_policy(bool evict_first) {
    uint64_t policy;
    if (evict_first) {
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    } else {
        asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(policy));
    }
    return policy;
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A 4-byte copy global -> shared by the cp.async unit: the issuing thread neither waits for it nor holds a register.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// An arrival on `bar` once every cp.async this thread issued so far has landed (.noinc: the barrier's count
// includes it).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
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

// --- bounded waits ------------------------------------------------------------------------------------------

// Nothing in this kernel waits for another block but the producer's wait for L1 arrivals (fused_common.cuh,
// bounded by the engine's timeout T). Every mbarrier wait needs only this block's progress, so it expires only on
// a fault of the kernel itself:
//   * The producer's waits (a free ring stage, a free queue entry) are bounded by T + kWaitFloorNs. The first to
//     expire records kStatusPipelineStalled and closes the queue: it publishes how many entries it pushed and
//     how many ring positions it filled, pushes nothing more, and writes NaN for every ticket it still draws (an
//     L2 tile; an L1 item's intermediate, its arrivals then released so that no L2 wait sits out the timeout).
//   * A math warp's waits end when their phase completes or when the closed queue says it never will (an entry
//     or ring position past what was published): a decision every warp of a warpgroup takes alike, so the
//     warpgroup's wgmma and barriers stay aligned; a tile that misses data is NaN, and the warps leave at the end
//     of the pushed entries. Only if the producer itself stopped for 2 (T + kWaitFloorNs) does a math wait give
//     up on its own (recording the same status): the last resort of a kernel already faulted, where the warps of
//     a warpgroup may no longer decide alike and a tile may read a stage it was not meant to.
// kWaitFloorNs: a ring wait takes microseconds, and a short protocol timeout (a test of the L2 arrival expiry)
// must not pass for a stall.
constexpr uint64_t kWaitFloorNs = 1000ull * 1000ull * 1000ull;

struct Clock {
    int* status;
    uint64_t producer_ns;  // T + kWaitFloorNs
    uint64_t math_ns;      // 2 (T + kWaitFloorNs), beside the fused dispatch plus 2 dispatch_bound: the last resort
};

__device__ __forceinline__ void record_stall(const Clock& clock) { atomicCAS(clock.status, 0, kStatusPipelineStalled); }

// Wait until the barrier's phase of parity `parity` completed; false when give_up() says it never will (checked
// every 64 polls) or `bound_ns` passed (recorded as a stall).
template <class GiveUp>
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, uint32_t parity, uint64_t bound_ns, const Clock& clock,
                                          GiveUp give_up) {
    const uint32_t addr = smem_addr(bar);
    if (mbar_try_wait(addr, parity)) return true;
    const uint64_t deadline = now_ns() + bound_ns;
    for (uint32_t polls = 0;; ++polls) {
        if (mbar_try_wait(addr, parity)) return true;
        if (polls % 64 == 63) {
            if (give_up()) return false;
            if (now_ns() > deadline) {
                record_stall(clock);
                return false;
            }
        }
    }
}

// Whether the producer closed the queue (close_queue: queue_end and ring_end are then final).
template <class T>
__device__ __forceinline__ bool closed(const Shared<T>& sm) {
    const bool is_closed = *reinterpret_cast<const volatile int*>(&sm.closed) != 0;
    __threadfence_block();  // the ends after the flag
    return is_closed;
}

// --- the ring: one position per K block, stage and phase running on across items ---------------------------

template <class T>
struct Ring {
    uint32_t kb = 0;  // K blocks through the ring so far (this thread's count; every role counts the same)
    uint64_t b_policy = 0;  // the producer's L2 policy of its weight copies (l2_policy)
    __device__ __forceinline__ int stage() const { return static_cast<int>(kb % T::kStages); }
    __device__ __forceinline__ uint32_t phase() const { return (kb / T::kStages) & 1u; }
};

// --- the item queue: the producer's tickets to the math warpgroups ----------------------------------------

// Entry `pos` of the queue: a ticket (an index of the whole work list; kEndOfWork ends the math loop), the item it
// decodes to (the producer's decoding) and whether the producer's wait for its L1 items expired (an L2 item: its
// loads came all the same, its tile is NaN).
constexpr int kEndOfWork = -1;

// The producer's push of entry `pos`; false when the wait for a free entry expired (a stall).
template <class T>
__device__ __forceinline__ bool push(Shared<T>& sm, uint32_t pos, int ticket, const Item& it, int expired,
                                     const Clock& clock) {
    const int q = static_cast<int>(pos % kQueue);
    // A fresh barrier's "previous" phase counts as done: the first round needs no math warp's arrival.
    FUSED_PROFILE_STAMP(waited);
    if (!mbar_wait(&sm.queue_empty[q], ((pos / kQueue) & 1u) ^ 1u, clock.producer_ns, clock, [] { return false; }))
        return false;
    FUSED_PROFILE_ADD(kQueueWait, waited);
    sm.queue_ticket[q] = ticket;
    sm.queue_expert[q] = it.expert;
    sm.queue_m_block[q] = it.m_block;
    sm.queue_n_block[q] = it.n_block;
    sm.queue_row0[q] = it.row0;
    sm.queue_expired[q] = expired;
    mbar_arrive(&sm.queue_full[q]);  // release (CTA scope): the entry before the math warps' acquiring wait
    return true;
}

// A math thread's pop of entry `pos`; false when the producer closed the queue before it (or the last resort).
template <class T>
__device__ __forceinline__ bool pop(Shared<T>& sm, uint32_t pos, int& ticket, Item& it, int& expired,
                                    const Clock& clock) {
    const int q = static_cast<int>(pos % kQueue);
    const auto never = [&] { return closed(sm) && pos >= static_cast<uint32_t>(sm.queue_end); };
    FUSED_PROFILE_STAMP(waited);
    if (!mbar_wait(&sm.queue_full[q], (pos / kQueue) & 1u, clock.math_ns, clock, never)) return false;
    FUSED_PROFILE_ADD(kPopWait, waited);
    ticket = sm.queue_ticket[q];
    it.expert = sm.queue_expert[q];
    it.m_block = sm.queue_m_block[q];
    it.n_block = sm.queue_n_block[q];
    it.row0 = sm.queue_row0[q];
    expired = sm.queue_expired[q];
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(&sm.queue_empty[q]);  // this warp read the entry
    return true;
}

// --- the producer: thread 0 of warpgroup 0 ------------------------------------------------------------------

// The copies of A (T::kBlockM rows from a_row, in boxes of 64) and of their activation scales (sf_map: rows
// innermost) for K block kb into stage s.
template <class T>
__device__ __forceinline__ void copy_a(Shared<T>& sm, int s, const TensorMap* a_map, const TensorMap* sf_map,
                                       int a_row, int kb) {
#pragma unroll
    for (int i = 0; i < T::kABoxes; ++i) {
        tma_load_2d(sm.a[s] + i * kABoxRows * kBlockK, a_map, &sm.full[s], kb * kBlockK, a_row + i * kABoxRows);
        tma_load_2d(reinterpret_cast<uint8_t*>(sm.sa[s] + i * kABoxRows), sf_map, &sm.full[s], a_row + i * kABoxRows,
                    kb);
    }
}

// Claim the next ring position: wait for its stage to be free and expect A's and num_boxes B boxes' bytes, then
// issue the B copies of K block kb (T::kBBoxRows rows from b_row[h]) and the copies of their two weight block scales
// (b_sf[h] + kb; a single box: both name its block), whose landing is the full barrier's second arrival. The math
// warps then read no global memory in the main loop: a scale load of theirs, an L2 round trip under the weights'
// stream, would pace them when they catch up on a full ring after an epilogue. False when the wait expired (a stall).
template <class T>
__device__ __forceinline__ bool claim_with_b(Shared<T>& sm, const Ring<T>& ring, const Clock& clock,
                                             const TensorMap* b_map, const int (&b_row)[2],
                                             const float* const (&b_sf)[2], int num_boxes, int kb) {
    const int s = ring.stage();
    // A fresh barrier's "previous" phase counts as done: the first round needs no math warp's arrival.
    FUSED_PROFILE_STAMP(waited);
    if (!mbar_wait(&sm.empty[s], ring.phase() ^ 1u, clock.producer_ns, clock, [] { return false; })) return false;
    FUSED_PROFILE_ADD(kEmptyWait, waited);
    mbar_arrive_expect_tx(&sm.full[s], T::kATileBytes + T::kScaleBytes + num_boxes * T::kBBoxBytes);
    for (int h = 0; h < num_boxes; ++h)
        tma_load_2d(sm.b[s] + h * T::kBBoxBytes, b_map, &sm.full[s], kb * kBlockK, b_row[h], ring.b_policy);
    for (int h = 0; h < 2; ++h) cp_async_4(&sm.sb[s][h], b_sf[h] + kb);
    cp_async_mbar_arrive(&sm.full[s]);
    return true;
}

// K blocks [kb0, num_kb) of one item (or wg128t L1 pass): claim each position with its B copies, then A's. False
// when a wait expired (a stall); ring.kb then counts the positions whose copies were issued.
template <class T>
__device__ __forceinline__ bool produce(Shared<T>& sm, Ring<T>& ring, const Clock& clock, const TensorMap* a_map,
                                        const TensorMap* sf_map, const TensorMap* b_map, int a_row,
                                        const int (&b_row)[2], const float* const (&b_sf)[2], int num_boxes, int kb0,
                                        int num_kb) {
    for (int kb = kb0; kb < num_kb; ++kb, ++ring.kb) {
        if (!claim_with_b(sm, ring, clock, b_map, b_row, b_sf, num_boxes, kb)) return false;
        copy_a(sm, ring.stage(), a_map, sf_map, a_row, kb);
    }
    return true;
}

// An item's B boxes: wg64t's gate and up boxes (L1), its two output blocks' boxes (an L2 pair: with_l2_pairs) or
// its one box; wg128t's L2 the two 64-row halves of the output block (its L1 runs in passes: produce_item).
template <class T>
__device__ __forceinline__ int item_boxes(const Work& w, bool l1, const int (&row)[2], int (&box_row)[2]) {
    box_row[0] = row[0];
    box_row[1] = T::kBlockM == wg128::kBlockM && !l1 ? row[0] + wg128::kBoxRows : row[1];
    return T::kBlockM == wg128::kBlockM || l1 || w.n2_per_item == 2 ? 2 : 1;
}

// An item's loads from K block kb0 (the K blocks before it were claimed with their B copies by claim_l2_weights
// and got their A copies from copy_claimed_a). wg128t's L1 runs in two passes of gate and up 64-row boxes.
template <class T>
__device__ __forceinline__ bool produce_item(Shared<T>& sm, Ring<T>& ring, const Clock& clock,
                                             const FusedExpertsTmaArgs& args, const Work& w, bool l1, int a_row,
                                             const int (&row)[2], const float* const (&b_sf)[2], int kb0,
                                             int num_kb) {
    const TensorMap* a_map = l1 ? &args.pool_x_map : &args.act_map;
    const TensorMap* sf_map = l1 ? &args.pool_sf_map : &args.act_sf_map;
    const TensorMap* b_map = l1 ? &args.w13_map : &args.w_down_map;
    if constexpr (T::kBlockM == wg128::kBlockM) {
        if (l1) {
            for (int pass = 0; pass < wg128::kL1Passes; ++pass) {
                const int c = pass * wg128::kBoxRows;
                if (!produce(sm, ring, clock, a_map, sf_map, b_map, a_row, {row[0] + c, row[1] + c}, b_sf, 2, 0,
                             num_kb))
                    return false;
            }
            return true;
        }
    }
    int box_row[2];
    const int boxes = item_boxes<T>(w, l1, row, box_row);
    return produce(sm, ring, clock, a_map, sf_map, b_map, a_row, box_row, b_sf, boxes, kb0, num_kb);
}

// An item's first ring positions, claimed one at a time with their weight copies while the count `word` its A
// operand waits for is read (the weights do not depend on it): the first read is in flight during the first claim,
// and the claims stop once the count reached `expected` or at a ring's worth, where the bounded wait takes over
// (`arrived`: false when it ran out). An item not yet queued thus holds at most kStages positions, each of which
// needed only this block's math to free it. Returns the K blocks claimed (at least 1), or -1 when a claim's wait
// expired (a stall; ring.kb is back at the item's first position).
template <class T>
__device__ __forceinline__ int claim_weights_while(Shared<T>& sm, Ring<T>& ring, const Clock& clock,
                                                   const TensorMap* b_map, const int (&box_row)[2],
                                                   const float* const (&b_sf)[2], int boxes, int num_kb,
                                                   const int* word, int expected, uint64_t bound_ns, bool& arrived) {
    const int n = min(num_kb, T::kStages);
    int seen = load_acquire_gpu(word);
    for (int kb = 0;;) {
        if (!claim_with_b(sm, ring, clock, b_map, box_row, b_sf, boxes, kb)) {
            ring.kb -= kb;  // no position of this item is complete
            return -1;
        }
        ++ring.kb;
        ++kb;
        if (seen >= expected) {
            arrived = true;
            return kb;
        }
        if (kb == n) {
            arrived = wait_count(word, expected, bound_ns);
            return kb;
        }
        seen = load_acquire_gpu(word);  // in flight during the next claim
    }
}

// An L2 item's first ring positions (claim_weights_while) while its m block's L1 arrivals are read (usually seen at
// the first claim: they are long complete); `expired`: the wait ran out, counted in the status.
template <class T>
__device__ __forceinline__ int claim_l2_weights(Shared<T>& sm, Ring<T>& ring, const Clock& clock,
                                                const FusedExpertsTmaArgs& args, const Work& w, int m_block,
                                                const int (&row)[2], const float* const (&b_sf)[2], int num_kb,
                                                int& expired) {
    const FusedExpertsArgs& p = args.experts;
    int box_row[2];
    const int boxes = item_boxes<T>(w, false, row, box_row);
    bool arrived = true;
    const int claimed = claim_weights_while(sm, ring, clock, &args.w_down_map, box_row, b_sf, boxes, num_kb,
                                            p.counters + 1 + m_block, kArrivalsPerL1Item * w.n1_blocks,
                                            p.timeout_ns, arrived);
    expired = claimed >= 0 && !arrived;
    if (expired) count_expired_wait(p, m_block, w.n2_per_item);  // an L2 pair: two tiles
    return claimed;
}

// Beside the fused dispatch: the bound of the waits for its plan and rows, past the dispatch's own bounded waits
// (twice the ring's bound for its own producer's words; the engine's timeout is the ring's).
__device__ __forceinline__ uint64_t dispatch_bound(const FusedExpertsArgs& p) { return 3 * p.timeout_ns + kWaitFloorNs; }

// Thread 0 of warpgroup 0 beside the fused dispatch: its plan (its grid, or kPlanAbandoned), acquired. A wait past
// the bound records kStatusDispatchLate and abandons (nothing is computed).
__device__ __forceinline__ int wait_plan(const FusedExpertsArgs& p) {
    const uint64_t deadline = now_ns() + dispatch_bound(p);
    for (uint32_t polls = 0;; ++polls) {
        const int plan = load_acquire_gpu(p.dispatch_plan);
        if (plan != 0) return plan;
        if (polls % 64 == 63 && now_ns() > deadline) {
            atomicCAS(p.status, 0, kStatusDispatchLate);
            return kPlanAbandoned;
        }
    }
}

// The block's first L1 item beside the fused dispatch: its first ring positions claimed with their weight copies
// (claim_weights_while) while the dispatch's blocks finish writing the pool's rows; `arrived`: every block did
// within the bound; `lost`: some block returned without its rows (kPlanRowsLost: the ring holds the error). wg128t's
// L1 runs in passes from K block 0 (produce_item): it only waits.
template <class T>
__device__ __forceinline__ int claim_pool_weights(Shared<T>& sm, Ring<T>& ring, const Clock& clock,
                                                  const FusedExpertsTmaArgs& args, const Work& w, const int (&row)[2],
                                                  const float* const (&b_sf)[2], int num_kb, int dispatch_blocks,
                                                  bool& arrived, bool& lost) {
    const FusedExpertsArgs& p = args.experts;
    const int* word = p.dispatch_plan + 1;
    int claimed = 0;
    if constexpr (T::kBlockM == wg128::kBlockM) {
        arrived = wait_count(word, dispatch_blocks, dispatch_bound(p));
    } else {
        int box_row[2];
        const int boxes = item_boxes<T>(w, true, row, box_row);
        claimed = claim_weights_while(sm, ring, clock, &args.w13_map, box_row, b_sf, boxes, num_kb, word,
                                      dispatch_blocks, dispatch_bound(p), arrived);
    }
    lost = arrived && load_acquire_gpu(word) >= kPlanRowsLost;
    return claimed;
}

// The A copies of the n K blocks an item claimed (the ring positions just before ring.kb): L1's from the pool,
// L2's from the intermediate.
template <class T>
__device__ __forceinline__ void copy_claimed_a(Shared<T>& sm, const Ring<T>& ring, const FusedExpertsTmaArgs& args,
                                               bool l1, int a_row, int n) {
    for (int kb = 0; kb < n; ++kb) {
        Ring<T> at;
        at.kb = ring.kb - n + kb;
        copy_a(sm, at.stage(), l1 ? &args.pool_x_map : &args.act_map, l1 ? &args.pool_sf_map : &args.act_sf_map,
               a_row, kb);
    }
}

// B rows of an item in the 2D view of its weights: expert e's rows start at e * rows_per_expert.
__device__ __forceinline__ void b_rows(const Operands& op, int e, int rows_per_expert, int (&row)[2]) {
    row[0] = e * rows_per_expert + op.b_row0[0];
    row[1] = e * rows_per_expert + op.b_row0[1];
}

// An L2 tile written NaN by one thread: what the producer does for the L2 items it draws after a stall.
template <class T>
__device__ __forceinline__ void nan_tile(const FusedExpertsArgs& p, const Work& w, const Item& it) {
    const uint4 nan8 = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);  // 8 bf16 NaN
    for (int r = 0; r < T::kBlockM && it.row0 + r < p.num_rows; ++r) {
        __nv_bfloat16* dst = out_row(p, it.row0 + r);
        if (dst == nullptr) continue;
        uint4* row = reinterpret_cast<uint4*>(dst + it.n_block * w.n2_per_item * kTileN);
        for (int c = 0; c < w.n2_per_item * kTileN / 8; ++c) row[c] = nan8;
    }
}

// An L1 item the producer draws after a stall: its intermediate written NaN (e4m3 0x7f, scale 1) by one thread and
// both arrivals released, so the m block's L2 items, here or in other blocks, compute NaN at once instead of each
// waiting out the engine's timeout for arrivals that would never come.
__device__ __forceinline__ void nan_intermediate(const FusedExpertsArgs& p, const Work& w, const Item& it,
                                                 int rows) {
    const uint4 nan16 = make_uint4(0x7f7f7f7fu, 0x7f7f7f7fu, 0x7f7f7f7fu, 0x7f7f7f7fu);  // 16 e4m3 NaN
    for (int r = 0; r < rows && it.row0 + r < p.num_rows; ++r) {
        const long long row = it.row0 + r;
        uint4* act = reinterpret_cast<uint4*>(p.act + row * p.inter + it.n_block * kTileN);
        for (int c = 0; c < kTileN / 16; ++c) act[c] = nan16;
        *act_scale(p, row, it.n_block) = 1.0f;
    }
    fence_proxy_async_global();  // the stores before other blocks' TMA reads of them (after the release)
    __threadfence();             // release: pairs with the acquire of the m block's L2 items
    atomicAdd(p.counters + 1 + it.m_block, kArrivalsPerL1Item);
}

// After a stall: the entries pushed and the ring positions filled, then the flag (the math warps read them after
// it). Nothing is pushed or filled after this.
template <class T>
__device__ __forceinline__ void close_queue(Shared<T>& sm, uint32_t pos, const Ring<T>& ring) {
    sm.queue_end = static_cast<int>(pos);
    sm.ring_end = static_cast<int>(ring.kb);
    __threadfence_block();
    *reinterpret_cast<volatile int*>(&sm.closed) = 1;
}

// Whether every 128-row group of the pass fits the span table: the work list's order is then the span order
// (fused_spans.cuh), else group order (item_coords).
__device__ __forceinline__ bool span_order(const Work& w) { return w.num_m_blocks / w.per_group <= kTableGroups; }

// The producer's decoding of item i of a phase: its coordinates (in span_order's order), and its m block's local
// expert from the table in shared memory (an m block past the table: from m_indices).
template <class T>
__device__ __forceinline__ Item producer_item(const Shared<T>& sm, const FusedExpertsArgs& p, const Work& w, int i,
                                              bool l1) {
    Item it;
    if (span_order(w)) {
        span_coords(sm.span_first, sm.span_groups, w.per_group, T::kBlockM, i, l1 ? w.n1_blocks : w.n2_items,
                    it.m_block, it.row0, it.n_block);
    } else {
        item_coords<T::kBlockM>(w, i, l1 ? w.n1_blocks : w.n2_items, it.m_block, it.row0, it.n_block);
    }
    const int b = it.row0 / kABoxRows;
    it.expert = it.row0 >= p.num_rows ? -1
                                      : checked_expert(p, b < kTableBlocks ? sm.block_expert[b] : p.m_indices[it.row0],
                                                       l1 && it.n_block == 0);
    return it;
}

// Whether the item is its weight tiles' only reader (fused_spans.cuh sole_reader over the block table), which the
// host's `weights_evict_first` says for a whole pass only where its bound on the rows per expert proves it (given
// routing's bound is the call's entries: DeepSeek-V3-like 512 rows at 64 tokens).
template <class T>
__device__ __forceinline__ bool weights_read_once(const Shared<T>& sm, const FusedExpertsArgs& p, const Item& it) {
    const int blocks = (p.num_rows + kABoxRows - 1) / kABoxRows;
    const auto expert = [&](int b) { return sm.block_expert[b]; };
    return sole_reader(expert, it.row0 / kABoxRows, T::kBlockM / kABoxRows, blocks, min(blocks, kTableBlocks),
                       it.expert);
}

// The producer's loop: take a ticket; skip padding (no entry: no barrier, no wait of any math warp); for an L2 item
// claim its first ring positions with their weight copies, then wait for its m block's L1 arrivals; push the entry;
// issue the rest of the item's loads. Nothing on this path reads global memory but the ticket's atomic, drawn one
// item ahead so that its round trip overlaps the item before it, and an L2 item's arrival counter, read while the
// ring streams its weights. The progress argument of docs/FUSED.md holds: a ticket drawn during an L2 item is an
// L2 ticket (every L1 ticket precedes every L2 ticket), so a held L1 ticket waits only until the current L1 item's
// loads are issued, which needs nothing but this block's own math; a claim waits only for this block's math to
// free a stage; and every item in the queue has its loads issued before the producer moves on, so it completes
// without the producer.
template <class T>
__device__ __forceinline__ void producer(Shared<T>& sm, const FusedExpertsTmaArgs& args, const Work& w,
                                         const Clock& clock) {
    const FusedExpertsArgs& p = args.experts;
    Ring<T> ring;
    const uint64_t evict_first = l2_policy(true), evict_normal = l2_policy(false);
    uint32_t pos = 0;
    bool stalled = false;
    // Beside the fused dispatch (fill_tables waited for its plan): an abandoned plan leaves nothing to compute, and
    // the block's first L1 item waits for the pool's rows; else they were complete at the launch.
    const int dispatch_blocks = sm.dispatch_blocks;
    bool rows_in = dispatch_blocks == 0;
    for (int ticket = dispatch_blocks < 0 ? w.total_items : atomicAdd(p.counters, 1), next; ticket < w.total_items;
         ticket = next) {
        next = atomicAdd(p.counters, 1);  // read at the next ticket's turn: its latency hides behind this one's
        const bool l1 = ticket < w.l1_items;
        const Item it = producer_item<T>(sm, p, w, l1 ? ticket : ticket - w.l1_items, l1);
        if (it.expert < 0) continue;
        if (!stalled) {
            // Evict first where this item is its weight tiles' only reader: by the pass's bound, or its expert's rows.
            ring.b_policy = (p.weights_evict_first != 0 || weights_read_once(sm, p, it)) ? evict_first : evict_normal;
            const Operands op = l1 ? l1_operands(p, w, it.expert, it.n_block, it.row0)
                                   : l2_operands(p, w, it.expert, it.n_block, it.row0);
            int row[2];
            b_rows(op, it.expert, l1 ? 2 * p.inter : p.hidden, row);
            int claimed = 0, expired = 0;
            bool rows_arrived = true, rows_lost = false;
            if (!l1) {
                FUSED_PROFILE_STAMP(claiming);
                claimed = claim_l2_weights(sm, ring, clock, args, w, it.m_block, row, op.b_sf, op.num_kb, expired);
                FUSED_PROFILE_ADD(kArrivalWait, claiming);
                FUSED_PROFILE_COUNT(kLateArrivals, claimed > 1);
                if (claimed >= 0) fence_proxy_async_global();  // the acquire of the intermediate, then its TMA reads
            } else if (!rows_in) {
                claimed = claim_pool_weights(sm, ring, clock, args, w, row, op.b_sf, op.num_kb, dispatch_blocks,
                                             rows_arrived, rows_lost);
                rows_in = true;
                if (!rows_arrived) {
                    atomicCAS(p.status, 0, kStatusDispatchLate);
                } else if (claimed >= 0) {
                    fence_proxy_async_global();  // the acquire of the pool's rows, then their TMA reads
                }
            }
            // Rows that never came, or that a dispatch block gave up on: this item and every later one NaN (their
            // L1 arrivals released at once, so no L2 wait sits out the bound), as after a stall.
            if (claimed >= 0 && rows_arrived && !rows_lost && push(sm, pos, ticket, it, expired, clock)) {
                ++pos;
                FUSED_PROFILE_COUNT(kProducerItems, 1);
                // An expired wait's tile takes its loads all the same (the math then writes it NaN): the claimed
                // positions complete, and the ring stays aligned.
                copy_claimed_a(sm, ring, args, l1, it.row0, claimed);
                if (produce_item(sm, ring, clock, args, w, l1, it.row0, row, op.b_sf, claimed, op.num_kb)) continue;
                close_queue(sm, pos, ring);  // this item is queued: its tile misses data past ring_end (NaN)
                stalled = true;
                continue;
            }
            if (claimed > 0) ring.kb -= claimed;  // claimed positions of an item not queued never complete
            close_queue(sm, pos, ring);  // this item is not queued: its tile is NaN below
            stalled = true;
        }
        if (l1) {
            nan_intermediate(p, w, it, T::kBlockM);
        } else {
            nan_tile<T>(p, w, it);
        }
    }
    if (stalled || push(sm, pos, kEndOfWork, Item{-1, -1, -1, -1}, 0, clock)) return;
    close_queue(sm, pos, ring);
}

// --- the math warpgroups ------------------------------------------------------------------------------------

// A math wait on an mbarrier completed by the other math warps (no closed queue can end it): the last resort only.
__device__ __forceinline__ bool math_wait(uint64_t* bar, uint32_t parity, const Clock& clock) {
    return mbar_wait(bar, parity, clock.math_ns, clock, [] { return false; });
}

// The wait for ring position ring.kb to be full; false when the closed queue says it never will be.
template <class T>
__device__ __forceinline__ bool wait_full(Shared<T>& sm, const Ring<T>& ring, const Clock& clock) {
    const uint32_t position = ring.kb;
    const auto never = [&] { return closed(sm) && position >= static_cast<uint32_t>(sm.ring_end); };
    return mbar_wait(&sm.full[ring.stage()], ring.phase(), clock.math_ns, clock, never);
}

// wg64t: acc[half][32] += A[64 rows, K] * B[this warpgroup's 64 columns of the half, K]^T. Two K blocks in flight:
// block kb + 1's wgmma runs on the tensor cores while block kb is promoted (two sets of partial sums), so the
// promotion and the ring's waits no longer sit between one block's wgmma and the next.
template <class T, int kHalves>
__device__ __forceinline__ void tile_gemm(Shared<T>& sm, Ring<T>& ring, const Clock& clock, const Operands& op,
                                          float (&acc)[kHalves][kFrag], int wg, int t) {
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int i = 0; i < kFrag; ++i) acc[h][i] = 0.0f;
    float part[2][kHalves][kFrag];
    float sa[2][2], sb[2][kHalves];
    // Wait for ring position ring.kb and issue its wgmma into part[b] with its scales; false: never filled.
    const auto issue = [&](auto b) -> bool {
        FUSED_PROFILE_STAMP(waited);
        if (!wait_full(sm, ring, clock)) return false;
        FUSED_PROFILE_ADD(kFullWait, waited);
        const int s = ring.stage();
        sa[b][0] = sm.sa[s][acc_row(t, 0)];  // the stage's scales: read before the release
        sa[b][1] = sm.sa[s][acc_row(t, 2)];
#pragma unroll
        for (int h = 0; h < kHalves; ++h) sb[b][h] = sm.sb[s][h];
        wgmma_k_block<kHalves>(part[b], sm.a[s], sm.b[s], wg);
        return true;
    };
    // The block in part[b] (ring position ring.kb - 1; the next, if any, in flight): complete, released, promoted.
    const auto finish = [&](auto b, bool newest_in_flight) {
        if (newest_in_flight) {
            wgmma_wait_all_but_newest();
        } else {
            wgmma_wait_all();
        }
#pragma unroll
        for (int h = 0; h < kHalves; ++h) fence_operands(part[b][h]);
        const int s = static_cast<int>((ring.kb - 1) % T::kStages);  // ring.kb: the position after it
        if (threadIdx.x % 32 == 0) mbar_arrive(&sm.empty[s]);  // this warp's wgmma no longer reads the stage
        FUSED_PROFILE_STAMP(promoting);
        accumulate<kHalves>(acc, part[b], sa[b], sb[b]);
        FUSED_PROFILE_ADD(kPromote, promoting);
        FUSED_PROFILE_COUNT(kKBlocks, 1);
    };
    const auto never_filled = [&] {
        wgmma_wait_all();
#pragma unroll
        for (int h = 0; h < kHalves; ++h) fill_nan(acc[h]);
    };  // at ring_end, as every later wait of every math warp: the ring stays aligned
    using Zero = std::integral_constant<int, 0>;
    using One = std::integral_constant<int, 1>;
    if (!issue(Zero{})) return never_filled();
    for (int kb = 0;; kb += 2) {  // two blocks per turn: part[] indexed by constants stays in registers
        ++ring.kb;
        if (kb + 1 == op.num_kb) return finish(Zero{}, false);
        if (!issue(One{})) return never_filled();
        finish(Zero{}, true);
        ++ring.kb;
        if (kb + 2 == op.num_kb) return finish(One{}, false);
        if (!issue(Zero{})) return never_filled();
        finish(One{}, true);
    }
}

// wg128t: acc[h][32] += A[this warpgroup's 64 rows, K] * B[box h's 64 rows, K]^T (wg64's streams and promotion,
// on the warpgroup's rows instead of its columns).
template <class T>
__device__ __forceinline__ void tile_gemm_rows(Shared<T>& sm, Ring<T>& ring, const Clock& clock, const Operands& op,
                                               float (&acc)[2][kFrag], int wg, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < kFrag; ++i) acc[h][i] = 0.0f;
    float part[2][kFrag];
    for (int kb = 0; kb < op.num_kb; ++kb, ++ring.kb) {
        if (!wait_full(sm, ring, clock)) {  // never filled: no tile
#pragma unroll
            for (int h = 0; h < 2; ++h) fill_nan(acc[h]);
            return;  // at ring_end, as every later wait of every math warp: the ring stays aligned
        }
        const int s = ring.stage();
        const int r = wg * wg128::kWgRows;  // this warpgroup's rows; the stage's scales read before the release
        const float sa[2] = {sm.sa[s][r + acc_row(t, 0)], sm.sa[s][r + acc_row(t, 2)]};
        const float sb[2] = {sm.sb[s][0], sm.sb[s][1]};
        wg128::wgmma_k_block(part, sm.a[s], sm.b[s], wg);
        wgmma_wait_all();
#pragma unroll
        for (int h = 0; h < 2; ++h) fence_operands(part[h]);
        if (threadIdx.x % 32 == 0) mbar_arrive(&sm.empty[s]);  // this warp's wgmma no longer reads the stage
        accumulate<2>(acc, part, sa, sb);
    }
}

// After an L1 item's stores: once this warpgroup's four warps stored (stored[wg], phase n), its thread 0
// releases one arrival of the m block (kArrivalsPerL1Item per L1 item); `complete`: nothing went missing.
__device__ __forceinline__ void release_warpgroup(uint64_t* stored, const FusedExpertsArgs& p, int m_block,
                                                  uint32_t n, int t, bool complete, const Clock& clock) {
    fence_proxy_async_global();  // the stores before other blocks' TMA reads of them (after the release)
    __syncwarp();
    if (t % 32 == 0) mbar_arrive(stored);  // release: this warp's stores
    if (t == 0 && complete && math_wait(stored, n & 1u, clock)) {
        __threadfence();  // release: pairs with the acquire of the m block's L2 items (wait_arrivals)
        atomicAdd(p.counters + 1 + m_block, 1);
    }
}

// wg128t's L1 item `n` of this block (counted by every math thread alike): a row is in one warpgroup, which stores
// its part and releases its arrival. No barrier spans the warpgroups or waits for the producer.
template <class T>
__device__ __forceinline__ void l1_math_rows(Shared<T>& sm, Ring<T>& ring, const Clock& clock,
                                             const FusedExpertsArgs& p, const Work& w, const Item& it, uint32_t n,
                                             int wg, int t) {
    const Operands op = l1_operands(p, w, it.expert, it.n_block, it.row0);
    float acc[2][kFrag];  // [0]: gate, [1]: up, a pass's 64 columns of n1 for this warpgroup's rows
    float row_amax[2] = {0.0f, 0.0f};
    tile_gemm_rows(sm, ring, clock, op, acc, wg, t);  // columns [0, 64)
    wg128::swiglu_pass(acc, row_amax);
    wg128::keep_pass(sm, acc[0], wg, t);
    tile_gemm_rows(sm, ring, clock, op, acc, wg, t);  // columns [64, 128): the same scales
    wg128::swiglu_pass(acc, row_amax);
    wg128::l1_store(p, w, sm, acc[0], row_amax, wg, t, it.row0, it.n_block);
    release_warpgroup(&sm.stored[wg], p, it.m_block, n, t, true, clock);
}

// wg64t's L1 epilogue of its item `n` (acc: [0] gate, [1] up, this warpgroup's 64 columns of n1 in both): the two
// warpgroups exchange their halves of the row maxima through amax[n % 2] and the mbarrier amax_ready[n % 2], then
// each stores its part and releases its arrival.
template <class T>
__device__ __forceinline__ void l1_epilogue(Shared<T>& sm, const Clock& clock, const FusedExpertsArgs& p,
                                            const Work& w, const Item& it, float (&acc)[2][kFrag],
                                            const bool (&live)[2], uint32_t n, int wg, int t) {
    const int buf = static_cast<int>(n & 1u);
    l1_swiglu_amax(acc, sm.amax[buf], wg, t);
    __syncwarp();
    if (t % 32 == 0) mbar_arrive(&sm.amax_ready[buf]);  // release: this warp's row maxima
    FUSED_PROFILE_STAMP(waited);
    const bool both = math_wait(&sm.amax_ready[buf], (n >> 1) & 1u, clock);
    FUSED_PROFILE_ADD(kAmaxWait, waited);
    if (!both) fill_nan(acc[0]);
    l1_quantize_store(p, w, acc, sm.amax[buf], live, wg, t, it.row0, it.n_block);
    FUSED_PROFILE_STAMP(releasing);
    release_warpgroup(&sm.stored[wg], p, it.m_block, n, t, both, clock);
    FUSED_PROFILE_ADD(kRelease, releasing);
}

template <class T>
__device__ __forceinline__ void l2_math(Shared<T>& sm, Ring<T>& ring, const Clock& clock, const FusedExpertsArgs& p,
                                        const Work& w, const Item& it, bool expired, int wg, int t) {
    const Operands op = l2_operands(p, w, it.expert, it.n_block, it.row0);
    if constexpr (T::kBlockM == wg128::kBlockM) {
        float acc[2][kFrag];  // the two 64-column halves of n2 for this warpgroup's rows
        tile_gemm_rows(sm, ring, clock, op, acc, wg, t);  // an expired wait's loads came all the same
        if (expired) {
            fill_nan(acc[0]);
            fill_nan(acc[1]);
        }
        wg128::l2_store(p, acc, wg, t, it.row0, it.n_block);
    } else {  // wg64t's L2 item of one output block (hidden / 128 odd; pairs run in math)
        bool live[2];
        live_rows(p, it.row0, t, live);
        float acc[1][kFrag];
        tile_gemm<T, 1>(sm, ring, clock, op, acc, wg, t);  // an expired wait's loads came all the same
        if (expired) fill_nan(acc[0]);
        l2_store(p, acc[0], live, wg, t, it.row0, it.n_block);
    }
}

// The math loop: pop entries until the end of the work (or the end of a closed queue).
template <class T>
__device__ __forceinline__ void math(Shared<T>& sm, const FusedExpertsArgs& p, const Work& w, const Clock& clock) {
    const int wg = threadIdx.x / 128 - 1, t = threadIdx.x % 128;
    Ring<T> ring;
    uint32_t n_l1 = 0;
    for (uint32_t pos = 0;; ++pos) {
        int ticket, expired;
        Item it;  // the producer's decoding (no global read)
        if (!pop(sm, pos, ticket, it, expired, clock) || ticket == kEndOfWork) return;
        const bool l1 = ticket < w.l1_items;
        if constexpr (T::kBlockM == wg::kBlockM) {
            if (l1 || w.n2_per_item == 2) {  // both run wg64t's two-stream main loop: one copy of it serves both
                const Operands op = l1 ? l1_operands(p, w, it.expert, it.n_block, it.row0)
                                       : l2_operands(p, w, it.expert, it.n_block, it.row0);
                bool live[2];
                live_rows(p, it.row0, t, live);
                float acc[2][kFrag];  // L1: gate, up; an L2 pair: its two output blocks (this warpgroup's columns)
                tile_gemm<T, 2>(sm, ring, clock, op, acc, wg, t);  // an expired wait's loads came all the same
                FUSED_PROFILE_COUNT(kMathItems, 1);
                FUSED_PROFILE_STAMP(finishing);
                if (l1) {
                    l1_epilogue(sm, clock, p, w, it, acc, live, n_l1++, wg, t);
                    FUSED_PROFILE_ADD(kL1Epilogue, finishing);
                    continue;
                }
#pragma unroll  // acc[h] indexed at run time would live in local memory
                for (int h = 0; h < 2; ++h) {
                    if (expired) fill_nan(acc[h]);
                    l2_store(p, acc[h], live, wg, t, it.row0, 2 * it.n_block + h);
                }
                FUSED_PROFILE_ADD(kL2Epilogue, finishing);
                continue;
            }
        } else if (l1) {
            l1_math_rows(sm, ring, clock, p, w, it, n_l1++, wg, t);
            continue;
        }
        l2_math(sm, ring, clock, p, w, it, expired, wg, t);
    }
}

// --- the persistent kernels --------------------------------------------------------------------------------

// Warpgroup 0 copies the expert id of every 64-row block's first row (up to kTableBlocks of them) into shared
// memory, then (where every group of the pass fits the table) each group's span (fused_spans.cuh), for the
// producer's decoding; named barriers of the warpgroup (not the block's) end each step. A span of L groups costs
// each of its groups L reads of the table: at most kTableGroups^2 / 128 reads a thread (one expert holding every
// row).
// Beside the fused dispatch, thread 0 first waits for its plan (the first rows' ids written), the warpgroup's barrier
// ordering the table's reads after its acquire.
template <class T>
__device__ __forceinline__ void fill_tables(Shared<T>& sm, const FusedExpertsArgs& p, const Work& w) {
    if (p.dispatch_plan != nullptr) {
        if (threadIdx.x == 0) sm.dispatch_blocks = wait_plan(p);
        asm volatile("bar.sync 1, 128;\n" ::: "memory");
    }
    const int blocks = min((p.num_rows + kABoxRows - 1) / kABoxRows, kTableBlocks);
    for (int b = threadIdx.x; b < blocks; b += 128) sm.block_expert[b] = p.m_indices[b * kABoxRows];
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
    if (!span_order(w)) return;
    const int groups = w.num_m_blocks / w.per_group;
    const auto expert = [&](int g) { return sm.block_expert[g * kBlocksPerGroup]; };
    for (int g = threadIdx.x; g < groups; g += 128) {
        int first, count;
        span_of(expert, g, groups, first, count);
        sm.span_first[g] = static_cast<int16_t>(first);
        sm.span_groups[g] = static_cast<int16_t>(count);
    }
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
}

template <class T>
__device__ __forceinline__ void run(const FusedExpertsTmaArgs& args) {
    extern __shared__ __align__(16) uint8_t tma_smem_raw[];
    const FusedExpertsArgs& p = args.experts;
    if (!shared_memory_fits(p, kDynamicSharedBytes<T>)) return;  // a launch the host sized wrong
    const uint32_t base = smem_addr(tma_smem_raw);
    Shared<T>& sm = *reinterpret_cast<Shared<T>*>(tma_smem_raw + ((0u - base) % kSwizzleAtom));  // 1024-aligned
    if (threadIdx.x == 0) {
        sm.closed = sm.queue_end = sm.ring_end = sm.dispatch_blocks = 0;
        for (int s = 0; s < T::kStages; ++s) {
            mbar_init(&sm.full[s], 2);  // the producer's arrive.expect_tx (the TMA copies complete its bytes) and
                                        // the landing of its scale copies (cp_async_mbar_arrive)
            mbar_init(&sm.empty[s], kMathWarps);
        }
        for (int q = 0; q < kQueue; ++q) {
            mbar_init(&sm.queue_full[q], 1);           // the producer's push
            mbar_init(&sm.queue_empty[q], kMathWarps);  // every math warp read the entry
        }
        for (int b = 0; b < 2; ++b) mbar_init(&sm.amax_ready[b], kMathWarps);
        for (int g = 0; g < kMathWarpgroups; ++g) mbar_init(&sm.stored[g], 4);
        fence_barrier_init();
        prefetch_tensor_map(&args.pool_x_map);
        prefetch_tensor_map(&args.act_map);
        prefetch_tensor_map(&args.w13_map);
        prefetch_tensor_map(&args.w_down_map);
        prefetch_tensor_map(&args.pool_sf_map);
        prefetch_tensor_map(&args.act_sf_map);
    }
    FUSED_PROFILE_START(started_ns);
    __syncthreads();  // the only block-wide barrier: from here the roles meet at mbarriers alone
    // wg64t's L2 items take two output blocks where they can (an L2 stage then streams two weight boxes, as L1's);
    // wg128t's L2 stage has two boxes already.
    const Work w = T::kBlockM == wg128::kBlockM ? work_of<T::kBlockM>(p) : with_l2_pairs(work_of<T::kBlockM>(p));
    const uint64_t bound = p.timeout_ns + kWaitFloorNs;
    // A math warp's first pop waits for the producer's first push, which beside the fused dispatch follows the waits
    // for its plan and rows (each up to dispatch_bound): a bound past them, so that the producer's own record names
    // a late dispatch.
    const uint64_t beside = p.dispatch_plan != nullptr ? 2 * dispatch_bound(p) : 0;
    const Clock clock{p.status, bound, 2 * bound + beside};
    if (threadIdx.x < 128) {
        setmaxnreg_dec<kProducerRegisters>();
        fill_tables(sm, p, w);
        if (threadIdx.x == 0) {
            FUSED_PROFILE_STAMP(producing);
            producer(sm, args, w, clock);
            FUSED_PROFILE_ADD(kProducerCycles, producing);
        }
    } else {
        setmaxnreg_inc<kMathRegisters>();
        FUSED_PROFILE_STAMP(computing);
        math(sm, p, w, clock);
        FUSED_PROFILE_ADD(kMathCycles, computing);
    }
    FUSED_PROFILE_FLUSH(started_ns);
}

}  // namespace tma
}  // namespace wg
}  // namespace fused
}  // namespace symmring_moe
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

using symmring_moe::FusedExpertsTmaArgs;
using Tile64 = symmring_moe::fused::wg::tma::Tile64;
using Tile128 = symmring_moe::fused::wg::tma::Tile128;

// A kernel's body: built for sm_90a, run it; for another target, record kStatusWrongTarget and compute nothing.
template <class T>
__device__ __forceinline__ void run_tma_kernel(const FusedExpertsTmaArgs& args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    symmring_moe::fused::wg::tma::run<T>(args);
    // Launched beside the fused dispatch (PDL, dispatch_plan): this grid's end follows the dispatch's, as stream order
    // would have it for the kernels after it. A no-op for a plain launch.
    asm volatile("griddepcontrol.wait;" ::: "memory");
#else
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicCAS(args.experts.status, 0, symmring_moe::fused::kStatusWrongTarget);
#endif
}

// Grid: the SM budget; block: 384 threads (a producer warpgroup, two math warpgroups); dynamic shared memory:
// fused::wg::tma::kDynamicSharedBytes<Tile64> / <Tile128>.
// 64 rows per item: wg64's tiles (the two math warpgroups split a 64-row item's columns).
extern "C" __global__ void __launch_bounds__(symmring_moe::fused::wg::tma::kBlockThreads, 1)
    moe_fused_experts_wg64t(const __grid_constant__ FusedExpertsTmaArgs args) {
    run_tma_kernel<Tile64>(args);
}

// 128 rows per item: a whole group, the two math warpgroups splitting its rows (fused_wgmma128.cuh).
extern "C" __global__ void __launch_bounds__(symmring_moe::fused::wg::tma::kBlockThreads, 1)
    moe_fused_experts_wg128t(const __grid_constant__ FusedExpertsTmaArgs args) {
    run_tma_kernel<Tile128>(args);
}
