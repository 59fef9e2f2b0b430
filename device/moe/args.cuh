// The MoE kernels' arguments: one struct per kernel (a family shares one where its kernels take the same
// values), passed BY VALUE as the kernel's only parameter. Mirrored field by field by
// symmring/moe/gpu/kernel_args.py, where each struct is a NumPy dtype that the launchers of
// symmring.moe.gpu.stages fill by name. Two checks hold the sides together:
//   * CI (tests/test_kernel_args.py) compiles this header with the host compiler and compares every struct's
//     size and every field's name, order, offset, size and kind with its dtype, both ways;
//   * at load time (stages.Kernels), kernel_args.check_device_layout compiles static_asserts of the host
//     dtypes' sizes and offsets against this header with nvcc and the library's options: a mismatch is a
//     named error (KernelArgsMismatch) before any kernel runs.
// Plain C layout (no padding the host does not reproduce), includable from host C++: a pointer field needs
// only a declaration of its type.
//
// Field order is each kernel's former parameter order, so a field sits at the offset its parameter had.
// Pointers are device addresses; `desc` is the ring's device descriptor (symmring/descriptor.cuh).
#pragma once
#include <stdint.h>

#include <symmring/descriptor.cuh>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <vector_types.h>
#else
struct __nv_bfloat16;  // host-only compiles (the layout check) need the pointer types declared, not defined
struct int4;
#endif

namespace symmring_moe {

using symmring::RingDescriptor;

// The layer's routing options (moe/router.cuh; symmring.moe.routing.device_router fills them).
struct RouterOptions {
    const float* bias;  // float32 [num_experts] or null (sigmoid_bias only)
    float routed_scaling_factor;
    int scoring;        // RouterScoring
    int num_experts;
    int topk;
    int n_group;
    int topk_group;
    int norm_topk_prob;
};

// The rows of one pass of a window (moe/dispatch.cu): entry_rows, this chunk's [num_ranks][tokens_per_slot]
// [num_topk] window rows, or null (one pass); the pass holds window rows [pass_begin, pass_begin + pass_rows).
struct PassRows {
    int* entry_rows;
    int pass_begin;
    int pass_rows;
};

// --- producer.cu ---------------------------------------------------------------------------------------

// moe_wait_slot, moe_dispatch_ack: one chunk of the ring.
struct ChunkArgs {
    const RingDescriptor* desc;
    int chunk_idx;
};

// moe_produce_route.
struct ProduceRouteArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    const int32_t* topk_idx;
    const float* topk_weights;
    int num_valid;
    const int* call_tokens;
    unsigned int* counter;
    int layer;
};

// moe_produce_layout_fp8, moe_produce_layout_bf16.
struct ProduceLayoutArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    const __nv_bfloat16* x;
    long long x_row_stride;
    int num_valid;
    const int* call_tokens;
    unsigned int* counter;
};

// moe_produce_chunk_fp8. router.topk is not read: the ring's num_topk is the chunk's.
struct ProduceChunkArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    int32_t* topk_idx;
    float* topk_weights;
    const __nv_bfloat16* x;
    long long x_row_stride;
    int num_valid;
    const int* call_tokens;
    unsigned int* counter;
    int layer;
    const void* logits;
    int logits_dtype;
    long long logits_stride;
    RouterOptions router;
};

// moe_route_topk.
struct RouteTopkArgs {
    const void* logits;
    int logits_dtype;
    long long logits_stride;
    int num_tokens;
    int32_t* topk_idx;
    float* topk_weights;
    RouterOptions router;
};

// --- dispatch.cu ---------------------------------------------------------------------------------------

// moe_dispatch_wait.
struct DispatchWaitArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    int parts;
    int* counts;
    int num_local_experts;
    long long* token_base;
    int clear_counts;
    int layer;
};

// moe_dispatch_stage.
struct DispatchStageArgs {
    const RingDescriptor* desc;
    const RingDescriptor* stage;
    int chunk_idx;
    int parts;
    int wait;
};

// moe_dispatch_count.
struct DispatchCountArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    int* counts;
    int expert_begin;
    int num_local_experts;
    int* status;
    int* bad_id;
    const RingDescriptor* stage;
};

// moe_dispatch_scan.
struct DispatchScanArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    const int* counts;
    int* begin;
    int* group_end;
    int* cursor;
    int* total;
    int num_local_experts;
    int align;
    int expert_begin;
    int window_rows;
    int rows_per_expert;
};

// moe_dispatch_pull (the bf16 pool).
struct DispatchPullArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    int* cursor;
    __nv_bfloat16* pool_x;
    int4* row_src;
    float* row_weight;
    int expert_begin;
    int num_local_experts;
    int* status;
    const RingDescriptor* stage;
    PassRows pass;
};

// moe_dispatch_pull_fp8 (the fp8 pool).
struct DispatchPullFp8Args {
    const RingDescriptor* desc;
    int chunk_idx;
    int* cursor;
    uint8_t* pool_x;
    float* pool_sf;
    long long sf_row_stride;
    long long sf_col_stride;
    int* m_indices;
    int4* row_src;
    float* row_weight;
    int expert_begin;
    int num_local_experts;
    int* status;
    const RingDescriptor* stage;
    PassRows pass;
};

// moe_dispatch_fused_fp8.
struct DispatchFusedArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    long long* token_base;
    int* expert_counts;
    int* begin;
    int* group_end;
    int* total;
    uint8_t* pool_x;
    float* pool_sf;
    long long sf_row_stride;
    long long sf_col_stride;
    int* m_indices;
    int4* row_src;
    float* row_weight;
    int expert_begin;
    int num_local_experts;
    int align;
    int* status;
    int* bad_id;
    int ack_now;
    unsigned int* counter;
    const RingDescriptor* stage;
    int pool_rows;
    int rows_per_expert;
    int layer;
    // Null, or the plan words of an experts kernel launched beside this dispatch (FusedExpertsArgs::dispatch_plan),
    // zeroed before the call: [0] kPlanAbandoned, or this grid's blocks once every live 64-row block's first row of
    // m_indices is written; [1] the blocks whose rows are all written (fence.proxy.async first: TMA reads them), or
    // past kPlanRowsLost once a block returned without them.
    int* plan;
};

// The plan word of a dispatch that placed no row (an error pending or recorded, counts past the plan's bounds).
constexpr int kPlanAbandoned = -1;
// What a dispatch block that returned without its rows adds to the rows word ([1]) instead of 1: any count at or
// past it means rows are missing (the experts kernel then computes NaN, not stale rows).
constexpr int kPlanRowsLost = 1 << 20;
// The rows of m_indices the plan writes ahead of the pull: every kPlanRows-th row of each expert's rows (the first
// row of each of the experts kernel's 64-row blocks; the pool's groups start at multiples of it).
constexpr int kPlanRows = 64;

// --- combine.cu ----------------------------------------------------------------------------------------

// moe_combine_scatter.
struct CombineScatterArgs {
    const RingDescriptor* desc;
    const __nv_bfloat16* pool_out;
    const int4* row_src;
    const int* total;
    const long long* token_base;
    int window_begin;
    int* m_indices;
    __nv_bfloat16* combine_rows;
    int pass_begin;
    int pass_rows;
    int combine_tokens;
    int rows_sent;  // the engine sent the rows itself (FusedExpertsArgs::send_peers): check and free them only
};

// moe_combine_signal.
struct CombineSignalArgs {
    const RingDescriptor* desc;
    int chunk_begin;
    int chunk_end;
    uint64_t* combine_ready;
    int ack_now;
};

// moe_combine_wait.
struct CombineWaitArgs {
    const RingDescriptor* desc;
    int chunk_idx;
    const uint64_t* combine_ready;
};

// moe_combine_reduce.
struct CombineReduceArgs {
    const RingDescriptor* desc;
    const __nv_bfloat16* combine_rows;
    const int32_t* topk_idx;
    const float* topk_weights;
    __nv_bfloat16* y;
    long long y_row_stride;
    int token_begin;
    int num_valid;
    const int* call_tokens;
    int end_call_chunks;
};

// moe_combine_fused.
struct CombineFusedArgs {
    const RingDescriptor* desc;
    const __nv_bfloat16* pool_out;
    const int4* row_src;
    const int* expert_counts;
    const int* begin;
    int num_local_experts;
    const long long* token_base;
    int* m_indices;
    __nv_bfloat16* combine_rows;
    int chunk_idx;
    uint64_t* combine_ready;
    int ack_now;
    const int32_t* topk_idx;
    const float* topk_weights;
    __nv_bfloat16* y;
    long long y_row_stride;
    int token_begin;
    int num_valid;
    const int* call_tokens;
    int end_call_chunks;
    unsigned int* counters;
    int pool_rows;
    int combine_tokens;
    // The engine stored every live row into its owner's combine rows itself (FusedExpertsArgs::send_peers): the
    // scatter only checks each row's token and frees the row (pool_out unused).
    int rows_sent;
};

// --- fused_experts.cu -----------------------------------------------------------------------------------

// moe_fused_experts_m16, _m32, _wg64: the experts of one pass (L1, SwiGLU + fp8 quantisation, L2) in one
// persistent kernel over the pool the fp8 dispatch wrote (symmring.moe.engines.fused fills it).
struct FusedExpertsArgs {
    const uint8_t* pool_x;       // fp8 e4m3 [>= num_rows, hidden]
    const float* pool_sf;        // row r, K block kb at pool_sf[r * sf_row_stride + kb * sf_col_stride]
    long long sf_row_stride;
    long long sf_col_stride;
    const int* m_indices;        // [>= num_rows]: each row's local expert, -1 for padding
    const uint8_t* w13;          // fp8 [E, 2 inter, hidden]: gate rows then up rows
    const float* w13_sf;         // [E, 2 inter / 128, hidden / 128]
    const uint8_t* w_down;       // fp8 [E, hidden, inter]
    const float* w_down_sf;      // [E, hidden / 128, inter / 128]
    uint8_t* act;                // fp8 [num_rows, inter]: SwiGLU's output, quantised (L2's input)
    float* act_sf;               // MN-major: [inter / 128][num_rows rounded up to 4] (fused_common.cuh act_scale)
    __nv_bfloat16* out;          // [num_rows, hidden] (unless the rows are sent: send_peers)
    int* counters;               // zeroed before the launch: [0] the work ticket, [1 + m block] L1 arrivals
    int* bad_groups;             // [2]: tiles skipped for an expert id outside [-1, E), the first id; or null
    int* status;                 // [2]: L2 tiles whose arrival wait expired (written NaN), the first m block;
                                 //      or [0] = -1: too little shared memory, -2: wgmma kernel not built for sm_90a
    unsigned long long timeout_ns;
    int num_rows;
    int hidden;
    int inter;
    int num_local_experts;
    int m_blocks_per_group;      // m blocks listed per 128-row group: ceil(the host's rows-per-expert bound / rows)
    // The layer's combine send (or send_peers null: the rows go to `out`): each live row straight to its owner's
    // combine rows at (logical token, k), where moe_combine_scatter would have put it (fused_common.cuh out_row).
    const int4* row_src;         // [num_rows]: each pool row's (owner, chunk-local token, k, chunk), from the pull
    const long long* token_base;  // [chunks][num_ranks]: the owners' snapshot token bases of the window's chunks
    const unsigned long long* send_peers;  // [num_ranks]: each owner's combine rows, mapped into this process
    long long combine_tokens;    // the tokens every owner's combine rows hold
    int window_begin;            // the window's first chunk (token_base's row 0)
    int num_ranks;
    int num_topk;
    // 1: no expert holds more than one m block (the host's rows-per-expert bound), so each weight tile is read once:
    // the TMA kernels copy the weights with an L2 evict-first hint, and the stream of them no longer evicts what the
    // kernels around this one read (the ring's slots, the pool, their code). 0: the default policy (tiles reused).
    int weights_evict_first;
    // Null, or the plan words of the fused dispatch launched just before this kernel (DispatchFusedArgs::plan): the
    // TMA kernels then start with PDL before the dispatch ends, read m_indices once the plan is published and the
    // pool's rows once every dispatch block wrote its own (fused_experts_tma.cu), and wait for the dispatch's end
    // at their own end.
    const int* dispatch_plan;
};

// A CUDA tensor map (the driver's CUtensorMap: 128 opaque bytes, 64-byte aligned), encoded on the host by
// cuTensorMapEncodeTiled (symmring.moe.gpu.tensor_map) and read by TMA copies from the kernel's parameter.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// moe_fused_experts_wg64t (fused_experts_tma.cu): the wgmma kernel whose producer warpgroup loads the A and B tiles
// by TMA. The parameter is __grid_constant__, so the maps' addresses are the parameter's own.
struct FusedExpertsTmaArgs {
    FusedExpertsArgs experts;
    TensorMap pool_x_map;        // pool rows [num_rows, hidden] fp8; box 128 x 64 rows, 128B swizzle
    TensorMap act_map;           // intermediate [num_rows, inter] fp8; box 128 x 64 rows
    TensorMap w13_map;           // w13 as [E * 2 inter, hidden] fp8; box 128 x 128 rows
    TensorMap w_down_map;        // w_down as [E * hidden, inter] fp8; box 128 x 128 rows
    TensorMap pool_sf_map;       // the pool rows' scales, MN-major f32 [hidden / 128][rows]; box 64 rows x 1 K block
    TensorMap act_sf_map;        // the intermediate's scales, MN-major f32 [inter / 128][rows]; box 64 rows x 1
};

// moe_fused_div_probe (fused_experts_wgmma.cu): q[i] = a[i] / b[i] by the wgmma kernel's call-free division,
// for the GPU test to compare with torch's.
struct FusedDivProbeArgs {
    const float* a;
    const float* b;
    float* q;
    int n;
};

// --- schedule.cu ---------------------------------------------------------------------------------------

// moe_end_call.
struct EndCallArgs {
    const RingDescriptor* desc;
    int num_chunks;
};

// moe_refuse_call.
struct RefuseCallArgs {
    const RingDescriptor* desc;
    int layer;
};

// moe_stamp.
struct StampArgs {
    unsigned long long* stamps;
    int idx;
};

// moe_sleep.
struct SleepArgs {
    unsigned long long duration_ns;
};

// moe_spin_probe.
struct SpinProbeArgs {
    const unsigned long long* word;
    unsigned long long until;
    unsigned long long duration_ns;
};

}  // namespace symmring_moe
