// Warp-level helpers of the MoE kernels (device/moe/*.cu; included as <moe/warp.cuh>).
#pragma once

namespace symmring_moe {

// All 32 lanes: the sum of `value` over lanes 0..lane (a shuffle scan).
__device__ __forceinline__ int warp_inclusive_sum(int value, int lane) {
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
        const int add = __shfl_up_sync(0xffffffffu, value, offset);
        if (lane >= offset) value += add;
    }
    return value;
}

// The lanes of the warp below the calling lane.
__device__ __forceinline__ unsigned lanes_below() {
    unsigned mask;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

}  // namespace symmring_moe
