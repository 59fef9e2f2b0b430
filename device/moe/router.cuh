// Top-k routing of one token by one warp: router logits to (topk_idx, topk_weights), the definitions of
// symmring/moe/routing.py and of the NumPy reference (symmring.moe.reference.select_topk). Included as
// <moe/router.cuh> by device/moe/producer.cu (moe_route_topk, and the small-batch producer, which routes
// its chunk itself), so both write the same bits.
//
//   softmax       the topk largest logits; weights: a softmax over the chosen logits (norm_topk_prob), or the
//                 probabilities of a softmax over all experts at the chosen ones.
//   sigmoid_bias  s = sigmoid(logit); the topk largest s + bias (optionally only inside the topk_group
//                 groups whose two largest s + bias sum highest); weights s, renormalised (norm_topk_prob),
//                 times routed_scaling_factor.
//
// Selection: a total order on float32 keys (NaN above +inf, as torch.topk; -0 equal to +0), ties to the
// lower expert id (group ties to the lower group id), entries in decreasing key: what the NumPy reference
// writes. The chosen set is torch.topk's wherever torch's own ties break to the lower id (its single-block
// top-k gathers tied values in index order). Float32 arithmetic throughout, CUDA's accurate expf, IEEE
// divisions (no fast math), so weights agree with torch's to float32 rounding (the sums' order differs).
//
// Expert e lives in lane e % 32, register slot e / 32: each lane keeps its own best candidate and only the
// winner of a pick rescans, so a pick is two warp reductions (max key, then min id among that key).
#pragma once

#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <moe/args.cuh>  // RouterOptions

namespace symmring_moe {

// routing.SCORINGS, in order (symmring.moe.router.SCORING_CODES).
enum RouterScoring : int { kScoringSoftmax = 0, kScoringSigmoidBias = 1 };
// Logits element types the kernels read (symmring.moe.router.LOGITS_DTYPES).
enum LogitsDtype : int { kLogitsFloat32 = 0, kLogitsBfloat16 = 1, kLogitsFloat16 = 2 };
// Limits of the warp routing (symmring.moe.router.MAX_EXPERTS / MAX_GROUPS; topk <= 32: a lane per entry).
constexpr int kRouterMaxExperts = 512;
constexpr int kRouterSlots = kRouterMaxExperts / 32;
constexpr int kRouterMaxGroups = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
// A key no expert has: a chosen expert, an expert outside the kept groups, a slot past num_experts.
constexpr uint32_t kNoKey = 0;
constexpr uint32_t kNoExpert = 0xffffffffu;

// Order-preserving map of float32 to uint32: larger float, larger key; NaN largest; every real value > kNoKey.
__device__ __forceinline__ uint32_t order_key(float v) {
    if (v != v) return 0xffffffffu;
    const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);  // -0 as +0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(uint32_t key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

__device__ __forceinline__ float load_logit(const void* row, int dtype, int e) {
    if (dtype == kLogitsBfloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(row)[e]);
    if (dtype == kLogitsFloat16) return __half2float(static_cast<const __half*>(row)[e]);
    return static_cast<const float*>(row)[e];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullWarp, v, offset);
    return v;
}

// All 32 lanes: the warp's best (key, expert) of the lanes' candidates: the largest key, then the lowest id.
__device__ __forceinline__ void warp_best(uint32_t key, uint32_t expert, uint32_t& best_key, uint32_t& best_expert) {
    best_key = __reduce_max_sync(kFullWarp, key);
    best_expert = __reduce_min_sync(kFullWarp, key == best_key ? expert : kNoExpert);
}

// The lane's best selectable slot (largest key, then the lower slot = the lower id), restricted to the
// experts of `group` when group >= 0 (per_group experts each).
__device__ __forceinline__ void lane_best(const uint32_t (&key)[kRouterSlots], int lane, int group, int per_group,
                                          uint32_t& best_key, uint32_t& best_expert) {
    best_key = kNoKey;
    best_expert = kNoExpert;
#pragma unroll
    for (int j = 0; j < kRouterSlots; ++j) {
        const int e = j * 32 + lane;
        if (key[j] > best_key && (group < 0 || e / per_group == group)) {
            best_key = key[j];
            best_expert = static_cast<uint32_t>(e);
        }
    }
}

__device__ __forceinline__ void clear_slot(uint32_t (&key)[kRouterSlots], int slot) {
#pragma unroll
    for (int j = 0; j < kRouterSlots; ++j)
        if (j == slot) key[j] = kNoKey;
}

__device__ __forceinline__ float slot_value(const float (&v)[kRouterSlots], int slot) {
    float out = 0.0f;
#pragma unroll
    for (int j = 0; j < kRouterSlots; ++j)
        if (j == slot) out = v[j];
    return out;
}

// Group-limited routing: keep only the experts of the topk_group groups with the largest scores (a group's
// score: the sum of its two largest keys' values, the larger first), ties to the lower group.
__device__ __forceinline__ void limit_to_groups(const RouterOptions& o, uint32_t (&key)[kRouterSlots], int lane) {
    const int per_group = o.num_experts / o.n_group;
    float group_score = 0.0f;  // lane g: group g's score
    for (int g = 0; g < o.n_group; ++g) {
        uint32_t lk, le, k1, e1, k2, e2;
        lane_best(key, lane, g, per_group, lk, le);
        warp_best(lk, le, k1, e1);
        // The second: the winner lane offers its next best of the group (the others their best).
        if (le == e1) {
            uint32_t saved[kRouterSlots];
#pragma unroll
            for (int j = 0; j < kRouterSlots; ++j) saved[j] = key[j];
            clear_slot(saved, static_cast<int>(e1) / 32);
            lane_best(saved, lane, g, per_group, lk, le);
        }
        warp_best(lk, le, k2, e2);
        if (lane == g) group_score = key_value(k1) + key_value(k2);
    }
    uint32_t gkey = lane < o.n_group ? order_key(group_score) : kNoKey;
    unsigned kept = 0;  // bit g: group g kept
    for (int pick = 0; pick < o.topk_group; ++pick) {
        uint32_t bk, bg;
        warp_best(gkey, static_cast<uint32_t>(lane), bk, bg);
        if (bk == kNoKey) break;
        kept |= 1u << bg;
        if (static_cast<uint32_t>(lane) == bg) gkey = kNoKey;
    }
#pragma unroll
    for (int j = 0; j < kRouterSlots; ++j) {
        const int e = j * 32 + lane;
        if (e < o.num_experts && !((kept >> (e / per_group)) & 1u)) key[j] = kNoKey;
    }
}

// One lane's entry of a token's route: entry k is lane k's (lanes >= topk: expert -1, weight 0).
struct RouteEntry {
    int32_t expert;
    float weight;
};

// Lanes k < topk store their entry at idx[k] / weights[k].
__device__ __forceinline__ void store_route(const RouterOptions& o, RouteEntry entry, int32_t* idx, float* weights,
                                            int lane) {
    if (lane < o.topk) {
        idx[lane] = entry.expert;
        weights[lane] = entry.weight;
    }
}

// One warp (all 32 lanes): route the token whose logits row is `row` (num_experts entries of `dtype`);
// lane k returns entry k (decreasing key).
__device__ __forceinline__ RouteEntry route_token(const RouterOptions& o, const void* row, int dtype, int lane) {
    const bool sigmoid = o.scoring == kScoringSigmoidBias;
    float value[kRouterSlots];  // softmax: the logit; sigmoid_bias: s (the weight before normalisation)
    uint32_t key[kRouterSlots];
#pragma unroll
    for (int j = 0; j < kRouterSlots; ++j) {
        const int e = j * 32 + lane;
        value[j] = 0.0f;
        key[j] = kNoKey;
        if (e < o.num_experts) {
            const float logit = load_logit(row, dtype, e);
            float choice = logit;
            if (sigmoid) {
                value[j] = 1.0f / (1.0f + expf(-logit));
                choice = o.bias != nullptr ? value[j] + o.bias[e] : value[j];
            } else {
                value[j] = logit;
            }
            key[j] = order_key(choice);
        }
    }
    if (sigmoid && o.n_group > 1) limit_to_groups(o, key, lane);

    uint32_t lk, le;
    lane_best(key, lane, -1, 1, lk, le);
    float lvalue = le != kNoExpert ? slot_value(value, static_cast<int>(le) / 32) : 0.0f;
    int32_t my_expert = -1;  // lane k: entry k
    float my_value = 0.0f;
    for (int k = 0; k < o.topk; ++k) {
        uint32_t bk, be;
        warp_best(lk, le, bk, be);
        if (bk == kNoKey) break;  // fewer selectable experts than topk (not with checked options): -1 entries
        const float v = __shfl_sync(kFullWarp, lvalue, static_cast<int>(be % 32));
        if (lane == k) {
            my_expert = static_cast<int32_t>(be);
            my_value = v;
        }
        if (le == be) {  // the winner rescans its slots
            clear_slot(key, static_cast<int>(be) / 32);
            lane_best(key, lane, -1, 1, lk, le);
            lvalue = le != kNoExpert ? slot_value(value, static_cast<int>(le) / 32) : 0.0f;
        }
    }

    const bool mine = lane < o.topk && my_expert >= 0;
    float weight;
    if (sigmoid) {
        weight = my_value;
        // sum + 1e-20 (routing.RENORM_EPS): transformers' DeepSeek-V3 router; 0, not 0/0, when every s underflows.
        if (o.norm_topk_prob) weight = weight / (warp_sum(mine ? weight : 0.0f) + 1e-20f);
        weight = weight * o.routed_scaling_factor;
    } else {
        const float top = __shfl_sync(kFullWarp, my_value, 0);  // entry 0: the largest logit, of all experts too
        if (o.norm_topk_prob) {
            const float e = mine ? expf(my_value - top) : 0.0f;
            weight = e / warp_sum(e);
        } else {
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < kRouterSlots; ++j)
                if (j * 32 + lane < o.num_experts) part += expf(value[j] - top);
            weight = expf(my_value - top) / warp_sum(part);
        }
    }
    return {mine ? my_expert : -1, mine ? weight : 0.0f};
}

}  // namespace symmring_moe
