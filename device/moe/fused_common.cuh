// What every fused experts kernel shares, whatever its main loop (mma.sync: fused_experts.cu; wgmma:
// fused_experts_wgmma.cu): the work list and its tickets, the arrival protocol between L1 and L2 items, the
// epilogues' arithmetic (so that the kernel families round alike), and the PTX wrappers they both use.
// docs/FUSED.md describes the design.
#pragma once

#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <moe/args.cuh>

namespace symmring_moe {
namespace fused {

constexpr int kThreads = 256;
constexpr int kBlockK = 128;               // K per stage and per scale block
constexpr int kTileN = 128;                // output columns per item (one scale block of the weights)
constexpr int kAlign = 128;                // expert groups start at multiples of this many pool rows
constexpr float kFp8Max = 448.0f;

// What thread 0 records in status[0] besides a count of expired waits (the engine's check_status names them).
constexpr int kStatusSharedTooSmall = -1;  // launched with less dynamic shared memory than the layout
constexpr int kStatusWrongTarget = -2;     // a wgmma kernel run from a cubin not built for sm_90a
constexpr int kStatusPipelineStalled = -3; // wg64t, wg128t: a wait of the TMA pipeline expired (outputs NaN)
constexpr int kStatusDispatchLate = -4;    // wg64t, wg128t beside the fused dispatch: its plan or its rows never
                                           // came within the bound (dispatch_plan; the outputs are NaN or absent)

// --- PTX wrappers ----------------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    const int src_bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

__device__ __forceinline__ int load_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t n;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// --- the epilogues' arithmetic (every kernel family rounds exactly so) -----------------------------------

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// The rule's division: IEEE float32, round to nearest even. The mma.sync kernels take the hardware's
// (__fdiv_rn); the wgmma kernel the same bits without a call (fused_div.cuh), so ptxas keeps its wgmma pipelined.
struct HardwareDivision {
    __device__ __forceinline__ float operator()(float a, float b) const { return __fdiv_rn(a, b); }
};

// SwiGLU in float32 of the bf16-rounded L1 outputs (the unfused engines round L1 to bf16 in memory),
// silu(g) = g / (1 + expf(-g)) with CUDA's accurate expf and IEEE division, as their kernels.
// Its terms: the rounded gate and up, and the divisor 1 + expf(-gate) (the wgmma epilogue divides them itself).
struct SwigluTerms {
    float gate, up, den;
};

__device__ __forceinline__ SwigluTerms swiglu_terms(float gate_acc, float up_acc) {
    const float gate = bf16_round(gate_acc), up = bf16_round(up_acc);
    return {gate, up, 1.0f + expf(-gate)};
}

template <class Divide>
__device__ __forceinline__ float swiglu(float gate_acc, float up_acc, Divide divide) {
    const SwigluTerms s = swiglu_terms(gate_acc, up_acc);
    return divide(s.gate, s.den) * s.up;
}

// The 1x128 group's scale from its amax: quant.quantize_fp8's rule (amax / 448, 1 for an all-zero group).
template <class Divide>
__device__ __forceinline__ float fp8_scale(float amax, Divide divide) {
    return amax == 0.0f ? 1.0f : divide(amax, kFp8Max);
}

// Two quotients to e4m3 (a in the low byte): satfinite clips to +-448 as the rule's clip; round to nearest even.
__device__ __forceinline__ __nv_fp8x2_storage_t fp8_pair(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// Two values divided by their group's scale, to e4m3.
template <class Divide>
__device__ __forceinline__ __nv_fp8x2_storage_t quantize_pair(float a, float b, float scale, Divide divide) {
    return fp8_pair(divide(a, scale), divide(b, scale));
}

// --- the work list ---------------------------------------------------------------------------------------

struct Work {
    int per_group;     // m blocks listed per aligned 128-row group (the rest of a group is padding: no ticket)
    int num_m_blocks;  // per_group m blocks of kBlockM rows over ceil(num_rows / 128) groups
    int n1_blocks;     // inter / 128
    int n2_blocks;     // hidden / 128
    int n2_per_item;   // output blocks per L2 item: 1, or 2 (wg64t where n2_blocks is even: with_l2_pairs)
    int n2_items;      // L2 items per m block: n2_blocks / n2_per_item
    int l1_items;
    int total_items;
};

template <int kBlockM>
__device__ __forceinline__ Work work_of(const FusedExpertsArgs& p) {
    Work w;
    const int groups = (p.num_rows + kAlign - 1) / kAlign;
    w.per_group = min(max(p.m_blocks_per_group, 1), kAlign / kBlockM);
    w.num_m_blocks = groups * w.per_group;
    w.n1_blocks = p.inter / kTileN;
    w.n2_blocks = p.hidden / kTileN;
    w.n2_per_item = 1;
    w.n2_items = w.n2_blocks;
    w.l1_items = w.num_m_blocks * w.n1_blocks;
    w.total_items = w.l1_items + w.num_m_blocks * w.n2_items;
    return w;
}

// The work list with L2 items of two output blocks where hidden / 128 is even (wg64t: an L2 stage then carries two
// 128-row weight boxes, as an L1 stage does, and an m block has half the L2 items).
__device__ __forceinline__ Work with_l2_pairs(Work w) {
    if (w.n2_blocks % 2 == 0) {
        w.n2_per_item = 2;
        w.n2_items = w.n2_blocks / 2;
        w.total_items = w.l1_items + w.num_m_blocks * w.n2_items;
    }
    return w;
}

// Item i of a phase with n_blocks column blocks: its m block (the arrival counter's index) and first pool row,
// and its n block; the m blocks of one group adjacent for each n block, so the items running at once share a
// weight tile (read from HBM once, then L2).
template <int kBlockM>
__device__ __forceinline__ void item_coords(const Work& w, int i, int n_blocks, int& m_block, int& row0,
                                            int& n_block) {
    const int group = i / (n_blocks * w.per_group), rest = i % (n_blocks * w.per_group);
    n_block = rest / w.per_group;
    m_block = group * w.per_group + rest % w.per_group;
    row0 = group * kAlign + (rest % w.per_group) * kBlockM;
}

// An m block's local expert from its first row's id `e`: -1 (skip) for padding or an id outside [-1, E) (reported
// once per m block, by thread 0 of its first L1 item).
__device__ __forceinline__ int checked_expert(const FusedExpertsArgs& p, int e, bool report) {
    if (e >= -1 && e < p.num_local_experts) return e;
    if (report && threadIdx.x == 0 && p.bad_groups != nullptr) {
        atomicAdd(p.bad_groups, 1);
        atomicCAS(p.bad_groups + 1, 0, e);
    }
    return -1;
}

// The local expert of m block rows starting at row0 (checked_expert); -1 for rows past the pass. Every thread
// reads the same id, so the whole block takes the same branch.
__device__ __forceinline__ int block_expert(const FusedExpertsArgs& p, int row0, bool report) {
    return row0 >= p.num_rows ? -1 : checked_expert(p, p.m_indices[row0], report);
}

// One item: its m block, its 128-column block (n1 for L1, n2 for L2), its first row and the local expert of its
// rows (-1: nothing to compute).
struct Item {
    int m_block, n_block, row0, expert;
};

// Item i of the L1 phase (l1: an m block's bad expert id is reported by its first L1 item) or of the L2 phase.
template <int kBlockM>
__device__ __forceinline__ Item item_of(const FusedExpertsArgs& p, const Work& w, int i, bool l1) {
    Item it;
    item_coords<kBlockM>(w, i, l1 ? w.n1_blocks : w.n2_items, it.m_block, it.row0, it.n_block);
    it.expert = block_expert(p, it.row0, l1 && it.n_block == 0);
    return it;
}

// Where pool row `row`'s L2 output goes: `out`, or (the layer's combine send: send_peers) its owner's combine row at
// (logical token, k), as moe_combine_scatter computes it. Null where nothing may be written: a padding row (its
// source is stale), or a token past the owner's combine rows, which the layer's clearing scatter (rows_sent)
// records as pool_overflow.
__device__ __forceinline__ __nv_bfloat16* out_row(const FusedExpertsArgs& p, long long row) {
    if (p.send_peers == nullptr) return p.out + row * p.hidden;
    if (p.m_indices[row] < 0) return nullptr;
    const int4 src = p.row_src[row];
    const long long token =
        p.token_base[static_cast<long long>(src.w - p.window_begin) * p.num_ranks + src.x] + src.y;
    if (token < 0 || token >= p.combine_tokens) return nullptr;
    return reinterpret_cast<__nv_bfloat16*>(p.send_peers[src.x]) + (token * p.num_topk + src.z) * p.hidden;
}

// The intermediate's scales are MN-major, as the layer's pool's: column n1 holds every row's scale of K block n1,
// its length padded to a multiple of 4 rows (16-byte aligned columns), so an item's scales of one K block are one
// contiguous run (the TMA kernels copy them with the stage: act_sf_map).
__device__ __forceinline__ long long act_sf_column(const FusedExpertsArgs& p) { return (p.num_rows + 3) / 4 * 4; }

__device__ __forceinline__ float* act_scale(const FusedExpertsArgs& p, long long row, int n1) {
    return p.act_sf + n1 * act_sf_column(p) + row;
}

// --- an item's operands ---------------------------------------------------------------------------------

// The operands of one item. B's shared rows [128 h, 128 h + 128) come from global rows b_row0[h] + [0, 128);
// a_sf / b_sf give the scales of K block kb (b_sf[h]: the weight block of half h, one float per K block).
struct Operands {
    const uint8_t* a;
    long long a_stride;
    const float* a_sf;
    long long a_sf_row, a_sf_col;
    const uint8_t* b;
    long long b_stride;
    int b_row0[2];
    const float* b_sf[2];
    int row0, rows_valid;  // A rows [row0, row0 + kBlockM); rows past rows_valid are zero-filled
    int num_kb;
};

// L1 of expert e, intermediate block n1: A = the pool rows, B = the 128 gate rows then the 128 up rows of n1.
__device__ __forceinline__ Operands l1_operands(const FusedExpertsArgs& p, const Work& w, int e, int n1, int row0) {
    const int kb_count = p.hidden / kBlockK;
    const int n_scale_rows = 2 * p.inter / kTileN;  // w13_sf rows per expert
    Operands op;
    op.a = p.pool_x;
    op.a_stride = p.hidden;
    op.a_sf = p.pool_sf;
    op.a_sf_row = p.sf_row_stride;
    op.a_sf_col = p.sf_col_stride;
    op.b = p.w13 + static_cast<long long>(e) * 2 * p.inter * p.hidden;
    op.b_stride = p.hidden;
    op.b_row0[0] = n1 * kTileN;
    op.b_row0[1] = p.inter + n1 * kTileN;
    op.b_sf[0] = p.w13_sf + (static_cast<long long>(e) * n_scale_rows + n1) * kb_count;
    op.b_sf[1] = p.w13_sf + (static_cast<long long>(e) * n_scale_rows + w.n1_blocks + n1) * kb_count;
    op.row0 = row0;
    op.rows_valid = p.num_rows;
    op.num_kb = kb_count;
    return op;
}

// L2 of expert e, L2 item n (output block n * w.n2_per_item, and the next one for a pair): A = the fp8
// intermediate rows, B = the 128 w_down rows of each output block (one half each; a single block: both halves
// name it).
__device__ __forceinline__ Operands l2_operands(const FusedExpertsArgs& p, const Work& w, int e, int n, int row0) {
    const int n2 = n * w.n2_per_item, n2_last = n2 + w.n2_per_item - 1;
    const int kb_count = p.inter / kBlockK;
    Operands op;
    op.a = p.act;
    op.a_stride = p.inter;
    op.a_sf = p.act_sf;
    op.a_sf_row = 1;
    op.a_sf_col = act_sf_column(p);
    op.b = p.w_down + static_cast<long long>(e) * p.hidden * p.inter;
    op.b_stride = p.inter;
    op.b_row0[0] = n2 * kTileN;
    op.b_row0[1] = n2_last * kTileN;
    op.b_sf[0] = p.w_down_sf + (static_cast<long long>(e) * w.n2_blocks + n2) * kb_count;
    op.b_sf[1] = p.w_down_sf + (static_cast<long long>(e) * w.n2_blocks + n2_last) * kb_count;
    op.row0 = row0;
    op.rows_valid = p.num_rows;
    op.num_kb = kb_count;
    return op;
}

// --- the arrival protocol ---------------------------------------------------------------------------------

// After an L1 item's stores (the caller's __syncthreads orders every thread's stores before it): thread 0
// releases the m block's arrival counter.
__device__ __forceinline__ void release_arrival(const FusedExpertsArgs& p, int m_block) {
    if (threadIdx.x == 0) {
        __threadfence();  // release: pairs with the acquire of the m block's L2 items (wait_arrivals)
        atomicAdd(p.counters + 1 + m_block, 1);
    }
}

// Wait (one thread, bounded by bound_ns, acquire at gpu scope) until the count `word` reaches `expected`; false when
// the bound expired.
__device__ __forceinline__ bool wait_count(const int* word, int expected, uint64_t bound_ns) {
    if (load_acquire_gpu(word) >= expected) return true;
    const uint64_t deadline = now_ns() + bound_ns;
    for (uint32_t polls = 0;; ++polls) {
        if (load_acquire_gpu(word) >= expected) return true;
        if (polls % 64 == 63 && now_ns() > deadline) return false;
    }
}

// Wait (thread 0, bounded) until the m block's L1 items all arrived; false when the bound expired.
__device__ __forceinline__ bool wait_arrivals(const FusedExpertsArgs& p, int m_block, int expected) {
    return wait_count(p.counters + 1 + m_block, expected, p.timeout_ns);
}

// One expired L2 wait counted in status[0] as the `tiles` output tiles it leaves NaN (status[1]: the m block of
// the first), unless status[0] holds one of the negative codes above: a code says more than a count, and a count
// past it would turn it into another code (or into 0: no error at all).
__device__ __forceinline__ void count_expired_wait(const FusedExpertsArgs& p, int m_block, int tiles = 1) {
    int old = *reinterpret_cast<volatile int*>(p.status);
    while (old >= 0) {
        const int seen = atomicCAS(p.status, old, old + tiles);
        if (seen == old) {
            if (old == 0) p.status[1] = m_block;
            return;
        }
        old = seen;
    }
}

// The start of an L2 item, for the whole block: thread 0 waits for the m block's L1 items (an expired wait is
// counted in the status, the first m block named); true when the wait expired. `flag` is a shared int.
__device__ __forceinline__ bool l2_arrivals_expired(const FusedExpertsArgs& p, const Work& w, int m_block,
                                                    int& flag) {
    if (threadIdx.x == 0) {
        flag = !wait_arrivals(p, m_block, w.n1_blocks);
        if (flag) count_expired_wait(p, m_block);
    }
    __syncthreads();  // the acquire of thread 0, then the block's reads of the intermediate
    const bool expired = flag;
    __syncthreads();  // every thread read the flag before a later item's thread 0 rewrites it
    return expired;
}

// --- the persistent loop ----------------------------------------------------------------------------------

// Draw tickets until the work list is done: l1(item) for L1 items, l2(item - l1_items) for L2 items. `slot` is
// a shared int (thread 0 draws, every thread reads).
template <class L1, class L2>
__device__ __forceinline__ void run_items(const FusedExpertsArgs& p, const Work& w, int& slot, L1 l1, L2 l2) {
    for (;;) {
        if (threadIdx.x == 0) slot = atomicAdd(p.counters, 1);
        __syncthreads();
        const int item = slot;
        __syncthreads();  // every thread read it before thread 0 draws the next
        if (item >= w.total_items) return;
        if (item < w.l1_items) {
            l1(item);
        } else {
            l2(item - w.l1_items);
        }
    }
}

// A launch with less dynamic shared memory than `bytes` records kStatusSharedTooSmall and computes nothing.
__device__ __forceinline__ bool shared_memory_fits(const FusedExpertsArgs& p, uint32_t bytes) {
    if (dynamic_smem_bytes() >= bytes) return true;
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicCAS(p.status, 0, kStatusSharedTooSmall);
    return false;
}

}  // namespace fused
}  // namespace symmring_moe
