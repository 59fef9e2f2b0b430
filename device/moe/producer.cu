// MoE producer kernels (symmring.moe.gpu.stages, produce_*): write one chunk of this PE's tokens into its own
// ring slot and publish it. Route (topk_idx, topk_weights, meta) and layout (x, x_sf) are separate launches
// with separate publications, so either may finish first (the RFC's independent readiness generations).
//
//   moe_wait_slot          one block: wait until the chunk's slot is reusable (every consumer acknowledged
//                          chunk - num_slots), no reset. The streamed schedule runs it first on the producer
//                          stream so ONE block spins instead of the route kernel's grid, and its timeline
//                          shows the wait apart from the work.
//   moe_produce_route      acquire (every block sees the mask complete; a no-op wait after moe_wait_slot),
//                          copy topk + meta; the last block resets the mask and publishes route readiness.
//   moe_produce_layout_*   quantise (fp8) or copy (bf16) x into the slot; the last block publishes layout.
//   moe_produce_chunk_fp8  the small-batch schedule's producer: route and fp8 layout in one grid (acquire,
//                          copy topk + meta, quantise x with one warp per 256 channels of a token, several
//                          loads in flight), the last block resets the mask and publishes both (route
//                          first), so a decode call pays one launch instead of two. Given the router's
//                          logits instead of topk it routes the chunk itself (moe/router.cuh, one warp per
//                          token), into the slot and the caller's topk buffers: no routing kernels before it.
//   moe_route_topk         the layer's routing of any number of tokens (one warp each, moe/router.cuh) for the
//                          schedules whose producer takes topk: the same bits as the producer's own routing.
//
// Every kernel here is one grid; its last block to arrive publishes (grid_publish), after every block's
// stores. The layer enqueues the route kernel first (it acquires the slot), the layout kernel after it.
//
// fp8 layout, bitwise the same as symmring/moe/quant.py: per token and per 128 channels,
// scale = amax / 448 (1.0 when that is 0), q = e4m3(clip(x / scale, +-448)), round to nearest even.
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <moe/args.cuh>
#include <moe/call_tokens.cuh>
#include <moe/router.cuh>
#include <symmring/protocol.cuh>

using namespace symmring;
using symmring_moe::ChunkArgs;
using symmring_moe::ProduceChunkArgs;
using symmring_moe::ProduceLayoutArgs;
using symmring_moe::ProduceRouteArgs;
using symmring_moe::RouteTopkArgs;
using symmring_moe::RouterOptions;
using symmring_moe::RouteEntry;
using symmring_moe::route_token;
using symmring_moe::store_route;

namespace {

constexpr float kFp8E4M3Max = 448.0f;
// Channels per scale handled by the fused layout kernel (layout.RingSpec.sf_group_size).
constexpr int kGroupSize = 128;
// Channels one lane converts per step: 8 bf16 = one 16-byte load.
constexpr int kChannelsPerLane = 8;
// Lanes that share one group: 128 / 8 = 16, so a warp converts two groups per step.
constexpr int kLanesPerGroup = kGroupSize / kChannelsPerLane;
// Channels of one warp step: 32 lanes x 8 = two groups.
constexpr int kSliceChannels = 32 * kChannelsPerLane;
// Warp steps the small-batch producer loads before it converts them (memory latency, not bandwidth,
// bounds a decode-sized layout: one warp walking a 7168-channel token step by step took ~20 us).
constexpr int kStepsInFlight = 4;

__device__ __forceinline__ uint32_t pack_fp8x4(float a, float b, float c, float d) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Grid-stride: copy the chunk's topk_idx / topk_weights ([num_valid, K], contiguous) into its slot; block 0
// writes the metadata row (with the call's identity `call_id`). Part of the route payload (published by the
// caller's grid_publish).
__device__ __forceinline__ void write_route(const RingDescriptor& d, int chunk_idx, const int32_t* topk_idx,
                                            const float* topk_weights, int num_valid, uint64_t gen,
                                            uint64_t call_id) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    int32_t* dst_idx = topk_idx_of(d, slot);
    float* dst_weights = topk_weights_of(d, slot);
    const int64_t num_entries = int64_t(num_valid) * d.num_topk;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_entries;
         i += int64_t(gridDim.x) * blockDim.x) {
        dst_idx[i] = topk_idx[i];
        dst_weights[i] = topk_weights[i];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        write_meta(d, chunk_idx, chunk_token_base(chunk_idx, d.tokens_per_slot), num_valid, gen, call_id);
}

// One warp step of the fp8 quantisation (all 32 lanes call it, the shuffles need them): the channels
// [col0, col0 + 256) of a token, two groups of 128, lanes 0-15 the first and 16-31 the second, 8 channels
// per lane. `raw`: the lane's 16-byte load of bf16 channels col0 + lane * 8 (load_step_fp8; ignored where
// that column is past the row, `active` false). Writes the lane's 8 fp8 bytes into dst + col and, from the
// first lane of each group, the group's float32 scale into dst_sf[col / 128]. The one implementation of the
// quantisation: the warp-per-token layout and the small-batch producer's warp-per-slice layout both call it,
// so they write the same bits.
__device__ __forceinline__ void quantize_step_fp8(int4 raw, bool active, int col, uint8_t* dst, float* dst_sf,
                                                  int lane) {
    float v[kChannelsPerLane];
    float amax = 0.0f;
    if (active) {
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < kChannelsPerLane / 2; ++i) {
            const float2 f = __bfloat1622float2(pairs[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
    }
    // amax over the 16 lanes of this group (xor offsets stay inside a half-warp).
#pragma unroll
    for (int offset = kLanesPerGroup / 2; offset > 0; offset /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (!active) return;
    float scale = amax / kFp8E4M3Max;  // IEEE division, as NumPy's float32 amax / 448
    if (scale == 0.0f) scale = 1.0f;   // zero group: quantise to zeros, no division by zero
    float q[kChannelsPerLane];
#pragma unroll
    for (int i = 0; i < kChannelsPerLane; ++i) q[i] = fminf(fmaxf(v[i] / scale, -kFp8E4M3Max), kFp8E4M3Max);
    uint2 packed;
    packed.x = pack_fp8x4(q[0], q[1], q[2], q[3]);
    packed.y = pack_fp8x4(q[4], q[5], q[6], q[7]);
    *reinterpret_cast<uint2*>(dst + col) = packed;
    if (lane % kLanesPerGroup == 0) dst_sf[col / kGroupSize] = scale;
}

// The small-batch producer's routing from the logits rows of the chunk (row stride logits_stride elements of
// logits_dtype): one warp per token counted from the grid's LAST warp (the sliced layout starts at the first,
// so a decode chunk routes and quantises on different warps). A warp's first token is routed BEFORE the slot
// wait (route_first: only the caller's topk buffers are written, which no earlier kernel on the stream still
// reads); the slot is written after it (route_rest: that token's entries, then every later token of the warp
// routed into both). Block 0 writes the metadata row. Part of the route payload, as write_route.
struct ProducerRoute {
    RouterOptions options;
    const char* logits;
    int dtype;
    long long row_bytes;
    int32_t* topk_idx;  // the caller's [num_valid, K]
    float* topk_weights;
    int num_valid;
    int64_t first_token;  // this warp's first token
    int64_t token_step;   // warps of the grid
};

__device__ __forceinline__ ProducerRoute producer_route(const RouterOptions& o, const void* logits, int dtype,
                                                        long long logits_stride, int32_t* topk_idx,
                                                        float* topk_weights, int num_valid) {
    const int warps_per_block = blockDim.x / 32;
    const int64_t num_warps = int64_t(gridDim.x) * warps_per_block;
    const int elem_bytes = dtype == symmring_moe::kLogitsFloat32 ? 4 : 2;
    return {o, static_cast<const char*>(logits), dtype, logits_stride * elem_bytes, topk_idx, topk_weights,
            num_valid, num_warps - 1 - (int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32), num_warps};
}

__device__ __forceinline__ RouteEntry route_first(const ProducerRoute& r) {
    if (r.first_token >= r.num_valid) return {-1, 0.0f};
    const int lane = threadIdx.x % 32;
    const RouteEntry entry = route_token(r.options, r.logits + r.first_token * r.row_bytes, r.dtype, lane);
    const int64_t at = r.first_token * r.options.topk;
    store_route(r.options, entry, r.topk_idx + at, r.topk_weights + at, lane);
    return entry;
}

__device__ __forceinline__ void route_rest(const RingDescriptor& d, int chunk_idx, const ProducerRoute& r,
                                           RouteEntry first, uint64_t gen, uint64_t call_id) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    const int lane = threadIdx.x % 32;
    int32_t* slot_idx = topk_idx_of(d, slot);
    float* slot_weights = topk_weights_of(d, slot);
    for (int64_t token = r.first_token; token < r.num_valid; token += r.token_step) {
        const int64_t at = token * d.num_topk;
        RouteEntry entry = first;
        if (token != r.first_token) {
            entry = route_token(r.options, r.logits + token * r.row_bytes, r.dtype, lane);
            store_route(r.options, entry, r.topk_idx + at, r.topk_weights + at, lane);
        }
        store_route(r.options, entry, slot_idx + at, slot_weights + at, lane);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        write_meta(d, chunk_idx, chunk_token_base(chunk_idx, d.tokens_per_slot), r.num_valid, gen, call_id);
}

// The lane's 16-byte load for quantize_step_fp8 (zeros past the row).
__device__ __forceinline__ int4 load_step_fp8(const __nv_bfloat16* src, bool active, int col) {
    return active ? *reinterpret_cast<const int4*>(src + col) : make_int4(0, 0, 0, 0);
}

// One warp (all 32 lanes): quantise one token's bf16 row `src` [hidden] into fp8 e4m3 `dst` and its float32
// scales `dst_sf` [hidden / 128], one quantize_step_fp8 per 256 channels. Needs hidden % 128 == 0 (checked
// by the layer).
__device__ __forceinline__ void quantize_token_fp8(const __nv_bfloat16* src, uint8_t* dst, float* dst_sf, int hidden,
                                                   int lane) {
    // Every lane runs the same number of steps (hidden is a multiple of 2 groups or the second
    // half-warp idles), so the shuffles always have all 32 lanes.
    for (int col0 = 0; col0 < hidden; col0 += kSliceChannels) {
        const int col = col0 + lane * kChannelsPerLane;
        const bool active = col < hidden;
        quantize_step_fp8(load_step_fp8(src, active, col), active, col, dst, dst_sf, lane);
    }
}

// Grid-stride over tokens, one warp each: the chunk's fp8 layout (x and x_sf) into its slot.
__device__ __forceinline__ void write_layout_fp8(const RingDescriptor& d, int chunk_idx, const __nv_bfloat16* x,
                                                 long long x_row_stride, int num_valid) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    const int warps_per_block = blockDim.x / 32;
    uint8_t* slot_x = x_of(d, slot);
    float* slot_sf = x_sf_of(d, slot);
    for (int64_t token = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32; token < num_valid;
         token += int64_t(gridDim.x) * warps_per_block)
        quantize_token_fp8(x + token * x_row_stride, slot_x + token * d.hidden, slot_sf + token * d.num_sf, d.hidden,
                           threadIdx.x % 32);
}

// Grid-stride over 16-byte vectors, one thread each: the chunk's bf16 layout (x as it is, no quantisation) into
// its slot.
__device__ __forceinline__ void write_layout_bf16(const RingDescriptor& d, int chunk_idx, const __nv_bfloat16* x,
                                                  long long x_row_stride, int num_valid) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    const int vecs_per_row = d.hidden / 8;  // 8 bf16 per 16-byte vector (hidden % 8 == 0: RingSpec)
    int4* dst = reinterpret_cast<int4*>(x_of(d, slot));
    const int64_t num_vecs = int64_t(num_valid) * vecs_per_row;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vecs;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t token = i / vecs_per_row;
        const int64_t vec = i % vecs_per_row;
        dst[i] = *reinterpret_cast<const int4*>(x + token * x_row_stride + vec * 8);
    }
}

// The small-batch producer's layout: grid-stride over warp steps (token, 256-channel slice), so even one
// token spreads over hidden / 256 warps; each warp loads kStepsInFlight steps before it converts them.
// The same quantize_step_fp8 as the warp-per-token layout, so the same bits. x is the caller's input (no
// slot memory): the producer issues a warp's first loads (load_steps_fp8 at the warp's first step) before
// its slot wait and passes them in as `first_raw`.
__device__ __forceinline__ int64_t first_layout_step() {
    return int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
}

__device__ __forceinline__ void load_steps_fp8(const RingDescriptor& d, const __nv_bfloat16* x,
                                               long long x_row_stride, int num_valid, int64_t first,
                                               int4 (&raw)[kStepsInFlight]) {
    const int lane = threadIdx.x % 32;
    const int64_t num_warps = int64_t(gridDim.x) * (blockDim.x / 32);
    const int slices = (d.hidden + kSliceChannels - 1) / kSliceChannels;
    const int64_t num_steps = int64_t(num_valid) * slices;
#pragma unroll
    for (int u = 0; u < kStepsInFlight; ++u) {
        const int64_t step = first + u * num_warps;
        const int64_t token = step / slices;
        const int col = static_cast<int>(step % slices) * kSliceChannels + lane * kChannelsPerLane;
        raw[u] = load_step_fp8(x + token * x_row_stride, step < num_steps && col < d.hidden, col);
    }
}

__device__ __forceinline__ void write_layout_fp8_sliced(const RingDescriptor& d, int chunk_idx,
                                                        const __nv_bfloat16* x, long long x_row_stride,
                                                        int num_valid, const int4 (&first_raw)[kStepsInFlight]) {
    const int slot = slot_of(chunk_idx, d.num_slots);
    const int lane = threadIdx.x % 32;
    const int64_t num_warps = int64_t(gridDim.x) * (blockDim.x / 32);
    const int slices = (d.hidden + kSliceChannels - 1) / kSliceChannels;
    const int64_t num_steps = int64_t(num_valid) * slices;
    uint8_t* slot_x = x_of(d, slot);
    float* slot_sf = x_sf_of(d, slot);
    // Warp-uniform bounds: every lane of a warp takes the same steps (quantize_step_fp8 shuffles).
    for (int64_t first = first_layout_step(); first < num_steps; first += kStepsInFlight * num_warps) {
        int4 raw[kStepsInFlight];
        if (first == first_layout_step()) {
#pragma unroll
            for (int u = 0; u < kStepsInFlight; ++u) raw[u] = first_raw[u];
        } else {
            load_steps_fp8(d, x, x_row_stride, num_valid, first, raw);
        }
#pragma unroll
        for (int u = 0; u < kStepsInFlight; ++u) {
            const int64_t step = first + u * num_warps;
            if (step >= num_steps) break;  // warp-uniform
            const int64_t token = step / slices;
            const int col = static_cast<int>(step % slices) * kSliceChannels + lane * kChannelsPerLane;
            quantize_step_fp8(raw[u], col < d.hidden, col, slot_x + token * d.hidden, slot_sf + token * d.num_sf,
                              lane);
        }
    }
}

// The body of moe_produce_layout_fp8 (kFp8) and moe_produce_layout_bf16: unless an error is pending, the
// chunk's layout (write_layout_fp8 or write_layout_bf16) of its num_valid tokens (capped by call_tokens),
// then layout readiness, published by the last block (grid_publish).
template <bool kFp8>
__device__ __forceinline__ void produce_layout(const RingDescriptor* desc_ptr, int chunk_idx, const __nv_bfloat16* x,
                                               long long x_row_stride, int num_valid, const int* call_tokens,
                                               unsigned int* counter) {
    const RingDescriptor& d = *desc_ptr;
    if (error_pending(d)) return;
    num_valid = symmring_moe::call_valid_tokens(call_tokens, chunk_token_base(chunk_idx, d.tokens_per_slot), num_valid);
    if (kFp8)
        write_layout_fp8(d, chunk_idx, x, x_row_stride, num_valid);
    else
        write_layout_bf16(d, chunk_idx, x, x_row_stride, num_valid);
    grid_publish(d, chunk_idx, expected_generation(d, chunk_idx), counter, /*reset_mask=*/false, /*route=*/false,
                 /*layout=*/true);
}

}  // namespace

// One block: wait until every consumer acknowledged the slot's previous use (chunk - num_slots), acquire;
// no reset (moe_produce_route, next on the stream, resets the mask before it publishes).
extern "C" __global__ void moe_wait_slot(const ChunkArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    wait_reusable(d, args.chunk_idx, /*reset=*/false);  // acquire: pairs with the release fence in ack()
}

// Route of chunk `chunk_idx`: acquire the slot (all blocks wait for the previous use's
// acknowledgements; the last block resets the mask), copy topk_idx/topk_weights ([num_valid, K],
// contiguous) and the metadata row (this PE's call of layer `layer`: expected_call), then the last block
// publishes route readiness.
// counter: a zeroed device word private to this kernel (reset by the last block).
extern "C" __global__ void moe_produce_route(const ProduceRouteArgs args) {
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    const int num_valid = symmring_moe::call_valid_tokens(args.call_tokens,
                                                          chunk_token_base(args.chunk_idx, d.tokens_per_slot),
                                                          args.num_valid);
    if (!wait_reusable(d, args.chunk_idx, /*reset=*/false)) return;
    const uint64_t gen = expected_generation(d, args.chunk_idx);
    write_route(d, args.chunk_idx, args.topk_idx, args.topk_weights, num_valid, gen, expected_call(d, args.layer));
    // Every block saw the mask complete before arriving: the last one resets it, then publishes.
    grid_publish(d, args.chunk_idx, gen, args.counter, /*reset_mask=*/true, /*route=*/true, /*layout=*/false);
}

// Layout of chunk `chunk_idx`, fp8: read bf16 x [num_valid, hidden] (row stride x_row_stride elements),
// write fp8 e4m3 x and float32 x_sf (one scale per token and 128 channels) straight into the slot, and
// publish layout readiness from the last block. One warp per token; each lane converts 8 channels per
// step with one 16-byte load, 16 lanes share a group's amax. Needs hidden % 128 == 0 (checked by the
// layer). Must run after moe_produce_route of the same chunk (which acquires the slot).
extern "C" __global__ void moe_produce_layout_fp8(const ProduceLayoutArgs args) {
    produce_layout</*kFp8=*/true>(args.desc, args.chunk_idx, args.x, args.x_row_stride, args.num_valid,
                                  args.call_tokens, args.counter);
}

// Layout of chunk `chunk_idx`, bf16 dispatch format (no quantisation): copy x rows into the slot with
// 16-byte loads and publish layout readiness from the last block.
extern "C" __global__ void moe_produce_layout_bf16(const ProduceLayoutArgs args) {
    produce_layout</*kFp8=*/false>(args.desc, args.chunk_idx, args.x, args.x_row_stride, args.num_valid,
                                   args.call_tokens, args.counter);
}

// The small-batch schedule's producer, fp8 layout: moe_produce_route and moe_produce_layout_fp8 in one grid.
// Every block waits for the slot's previous acknowledgements, then writes its share of topk, meta and the
// quantised rows (one warp per 256-channel slice of a token, write_layout_fp8_sliced); the last block to
// arrive resets the mask and publishes route readiness, then layout readiness (the consumer sees both parts,
// in the protocol's order). counter: as for moe_produce_route. Every block spins in wait_reusable, so the
// grid is at most stages.Kernels.spin_blocks (docs/PROTOCOL.md 9.2).
// logits null: topk_idx / topk_weights hold the chunk's routing, copied. logits not null: the router's
// logits of the chunk's tokens (logits_dtype: moe/router.cuh LogitsDtype), routed here with `router` into the
// slot AND into topk_idx / topk_weights, which the combine reads.
// layer: the call identity's layer (as moe_produce_route).
extern "C" __global__ void moe_produce_chunk_fp8(const ProduceChunkArgs args) {
    grid_dependency_wait();  // launched with PDL (stages.Kernels.launch): stream order from here
    CHAIN_STAMP(0);
    grid_dependents_launch();
    const RingDescriptor& d = *args.desc;
    if (error_pending(d)) return;
    const int num_valid = symmring_moe::call_valid_tokens(args.call_tokens,
                                                          chunk_token_base(args.chunk_idx, d.tokens_per_slot),
                                                          args.num_valid);
    const RouterOptions& r = args.router;  // its topk is not read: the ring's K is the chunk's
    const RouterOptions o{r.bias, r.routed_scaling_factor, r.scoring, r.num_experts, d.num_topk, r.n_group,
                          r.topk_group, r.norm_topk_prob};
    const ProducerRoute route = producer_route(o, args.logits, args.logits_dtype, args.logits_stride, args.topk_idx,
                                               args.topk_weights, num_valid);
    // Neither x nor the logits are slot memory: a warp's first loads and its first route overlap the wait.
    int4 first_raw[kStepsInFlight];
    load_steps_fp8(d, args.x, args.x_row_stride, num_valid, first_layout_step(), first_raw);
    const RouteEntry first = args.logits != nullptr ? route_first(route) : RouteEntry{-1, 0.0f};
    if (!wait_reusable(d, args.chunk_idx, /*reset=*/false)) return;
    CHAIN_STAMP(1);
    const uint64_t gen = expected_generation(d, args.chunk_idx);
    const uint64_t call_id = expected_call(d, args.layer);
    if (args.logits != nullptr)
        route_rest(d, args.chunk_idx, route, first, gen, call_id);
    else
        write_route(d, args.chunk_idx, args.topk_idx, args.topk_weights, num_valid, gen, call_id);
    CHAIN_STAMP(2);
    write_layout_fp8_sliced(d, args.chunk_idx, args.x, args.x_row_stride, num_valid, first_raw);
    CHAIN_STAMP(3);
    grid_publish(d, args.chunk_idx, gen, args.counter, /*reset_mask=*/true, /*route=*/true, /*layout=*/true);
}

// The layer's routing of num_tokens tokens (grid-stride, one warp each): logits rows (row stride
// logits_stride elements of logits_dtype) to topk_idx int32 / topk_weights float32 [num_tokens, topk]. No
// ring state: the schedules whose producers copy topk run it where the torch router ran.
extern "C" __global__ void moe_route_topk(const RouteTopkArgs args) {
    const RouterOptions o = args.router;
    const int warps_per_block = blockDim.x / 32;
    const int64_t num_warps = int64_t(gridDim.x) * warps_per_block;
    const char* rows = static_cast<const char*>(args.logits);
    const int elem_bytes = args.logits_dtype == symmring_moe::kLogitsFloat32 ? 4 : 2;
    for (int64_t token = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32; token < args.num_tokens;
         token += num_warps)
        store_route(o, route_token(o, rows + token * args.logits_stride * elem_bytes, args.logits_dtype,
                                   threadIdx.x % 32),
                    args.topk_idx + token * o.topk, args.topk_weights + token * o.topk, threadIdx.x % 32);
}
