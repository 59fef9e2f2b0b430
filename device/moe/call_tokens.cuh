// symmring MoE: this call's token count on the device (symmring.moe.gpu, issue device-counts).
//
// The host sizes a call's launches for a token BUCKET (every rank's plan is the same: symmring.moe.buckets),
// and the exact count of this rank's tokens lives in one device word the layer fills before the call (or a
// server before replaying a captured step). So one captured graph serves any count up to its bucket on
// every rank: the producer writes the count into the slot's metadata, consumers read it there.
#pragma once

#include <stdint.h>

namespace symmring_moe {

// Tokens of [token_base, token_base + bound) this call holds: the device count's share, at most the host's
// bound (a chunk's or a window's tokens in the plan); the bound itself when call_tokens is null.
__device__ __forceinline__ int call_valid_tokens(const int* call_tokens, int64_t token_base, int bound) {
    if (call_tokens == nullptr) return bound;
    const int64_t n = int64_t(*call_tokens) - token_base;
    return n < 0 ? 0 : (n < bound ? static_cast<int>(n) : bound);
}

}  // namespace symmring_moe
