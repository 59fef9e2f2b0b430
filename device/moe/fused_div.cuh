// IEEE float32 division rounded to nearest even (the result of __fdiv_rn, bit for bit, for every input) without
// a call. ptxas expands div.rn.f32 into a fast path plus a call to a slow-path subroutine, and any call in a
// kernel makes it serialise every wgmma (C7509); the wgmma kernel's epilogue divides with this instead.
//
//   * Fast path, for operands whose exponents keep every intermediate normal (`fast_operands`): a reciprocal
//     from rcp.approx (within an ulp or two), one Newton step, q = a * y and one correction: q is within an ulp
//     of a / b. Then the exact check: r = a - b q is exact (a float, from one fma), and q is the nearest
//     float iff |r| <= |b| * (half the gap to q's neighbour on r's side); else the neighbour is. (Equality,
//     a tie, cannot happen in that range: see fast_divide.) The products by powers of two are exact in that
//     range, so the check is too.
//   * Every other input (zeros, infinities, NaN, denormals, extreme exponents): the quotient in float64 from a
//     Newton-refined reciprocal (within ~2^-51 of a / b), rounded to float, then the same decision against
//     the midpoint between that float and its neighbour, exactly in float64 (b times a midpoint has at most
//     49 significant bits; a - b m is exact in an fma), which also settles denormal and overflowing results.
// tests/test_fused_div.py runs this header on the CPU (g++) against the C library's division with the
// hardware reciprocals modelled as off by up to two ulps; tests/gpu/test_fused_engine.py compares it with
// torch's division on the GPU bit for bit.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define SYMMRING_DIV_FN __device__ __forceinline__
#else
#include <cmath>
#include <cstring>
#define SYMMRING_DIV_FN inline
#endif

namespace symmring_moe {
namespace fused {
namespace div {

#if defined(__CUDACC__)
__device__ __forceinline__ uint32_t bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float from_bits(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ float fma32(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ float mul32(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double fma64(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ double mul64(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add64(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float to_float(double x) { return __double2float_rn(x); }
__device__ __forceinline__ float rcp_approx32(float b) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
    return y;
}
__device__ __forceinline__ double rcp_approx64(double b) {
    double y;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(y) : "d"(b));
    return y;
}
#else
// The host build (the CPU test): the same arithmetic, with the hardware reciprocals supplied by the test
// (symmring_div_rcp32 / 64 model rcp.approx's error).
float symmring_div_rcp32(float b);
double symmring_div_rcp64(double b);
inline uint32_t bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float from_bits(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float fma32(float a, float b, float c) { return std::fma(a, b, c); }
inline float mul32(float a, float b) { return a * b; }
inline double fma64(double a, double b, double c) { return std::fma(a, b, c); }
inline double mul64(double a, double b) { return a * b; }
inline double add64(double a, double b) { return a + b; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float rcp_approx32(float b) { return symmring_div_rcp32(b); }
inline double rcp_approx64(double b) { return symmring_div_rcp64(b); }
#endif

constexpr uint32_t kSign = 0x80000000u, kExp = 0x7f800000u, kMant = 0x007fffffu, kInf = 0x7f800000u;

SYMMRING_DIV_FN int exponent_field(uint32_t magnitude) { return static_cast<int>(magnitude >> 23); }

// Magnitudes a, b (no sign bit) for which the fast path is exact: a's exponent field in [30, 250] (its residual
// and the check's products stay normal), b's in [4, 250] (1 / b normal), their difference in [-100, 100]
// (the quotient normal, far from overflow).
SYMMRING_DIV_FN bool fast_operands(uint32_t a, uint32_t b) {
    const int ea = exponent_field(a), eb = exponent_field(b);
    return (ea >= 30) & (ea <= 250) & (eb >= 4) & (eb <= 250) & (ea - eb >= -100) & (ea - eb <= 100);
}

// The divisor of the fast path: |b| and its refined reciprocal (one per divisor: the quantisation divides a
// row's 64 values by one scale).
struct Divisor {
    float b;  // |b|
    float y;  // ~ 1 / |b|, within an ulp
};

SYMMRING_DIV_FN Divisor divisor_of(float b) {
    Divisor d;
    d.b = from_bits(bits(b) & ~kSign);
    const float y = rcp_approx32(d.b);
    d.y = fma32(y, fma32(-d.b, y, 1.0f), y);  // one Newton step
    return d;
}

// Every case the fast path leaves: exact, in float64 (see the top of the file). Magnitudes in, sign applied.
SYMMRING_DIV_FN float slow_quotient(float a, float b) {
    const uint32_t ua = bits(a), ub = bits(b), sign = (ua ^ ub) & kSign;
    const uint32_t ma = ua & ~kSign, mb = ub & ~kSign;
    if (ma > kInf || mb > kInf) return from_bits(0x7fffffffu);  // a NaN in: the canonical NaN out, as the GPU's
    if (mb == 0) return from_bits(ma == 0 ? 0x7fffffffu : (kInf | sign));  // 0 / 0: NaN; x / 0: inf
    if (mb == kInf) return from_bits(ma == kInf ? 0x7fffffffu : sign);    // inf / inf: NaN; x / inf: 0
    if (ma == kInf || ma == 0) return from_bits(ma | sign);    // inf / x: inf; 0 / x: 0
    const double A = static_cast<double>(from_bits(ma)), B = static_cast<double>(from_bits(mb));
    double r = rcp_approx64(B);  // B is a normal double (every float is)
#pragma unroll
    for (int i = 0; i < 4; ++i) r = fma64(r, fma64(-B, r, 1.0), r);
    const double q = mul64(A, r);  // within ~2^-51 of A / B: f below is the right float or its neighbour
    uint32_t f = bits(to_float(q));
    const double F = f == kInf ? 0x1p128 : static_cast<double>(from_bits(f));
    if (q > F) {  // the quotient may lie past the midpoint above f
        const uint32_t up = f + 1;
        const double U = up == kInf ? 0x1p128 : static_cast<double>(from_bits(up));
        const double d = fma64(-B, mul64(add64(F, U), 0.5), A);  // sign of A - B m, exactly
        if (d > 0.0 || (d == 0.0 && (f & 1u))) f = up;
    } else if (q < F) {  // ... or below the midpoint under f (f > 0 here)
        const uint32_t down = f - 1;
        const double D = static_cast<double>(from_bits(down));
        const double d = fma64(-B, mul64(add64(F, D), 0.5), A);
        if (d < 0.0 || (d == 0.0 && (f & 1u))) f = down;
    }
    return from_bits(f | sign);
}

// The fast path alone: true with q = a / b rounded to nearest even where it applies (fast_operands, or a zero a
// over a divisor of the fast range: a signed zero), false where slow_quotient must give the quotient. The wgmma
// epilogues run it over all their values first and take the slow path for the rare values it leaves in a separate
// pass, skipped when none does: inlined after every value, the slow path made wg64t's L1 epilogue ~9000
// instructions, fetched again at every item (docs/FUSED.md "Measured: the profile").
SYMMRING_DIV_FN bool fast_divide(float a, float b, const Divisor& d, float& q) {
    const uint32_t ua = bits(a), sign = (ua ^ bits(b)) & kSign, ma = ua & ~kSign, mb = bits(d.b);
    const int eb = exponent_field(mb);
    const bool zero = ma == 0;
    // fast_operands, or 0 / b for a normal, finite b (in bit operations: a branch costs more than the tests)
    const bool fast = (zero & (eb >= 4) & (eb <= 250)) | fast_operands(ma, mb);
    // Without a branch: the epilogues run this for 64 values in a row, and selects keep the code short and the
    // warp converged. Outside the fast range the arithmetic below is meaningless, and its result unused.
    const float x = from_bits(ma);
    float qx = mul32(x, d.y);
    qx = fma32(fma32(-d.b, qx, x), d.y, qx);  // within an ulp of x / |b|
    const float r = fma32(-d.b, qx, x);        // exact: x - |b| q
    const uint32_t uq = bits(qx);
    const float ulp = from_bits((uq & kExp) - (23u << 23));  // q's exponent field is >= 24 here
    const bool below = r < 0.0f;
    // |b| times half the gap to q's neighbour on r's side (exact): below a power of two the gap is half an ulp.
    const float t = mul32(d.b, mul32(ulp, below && (uq & kMant) == 0 ? 0.25f : 0.5f));
    const float off = fabsf(r);
    // No tie: a quotient of two floats of the fast range is never halfway between two floats (its odd part would
    // need 25 bits and a's has at most 24).
    const bool step = off > t;  // r = 0 never steps: t > 0
    const uint32_t rounded = step ? (below ? uq - 1u : uq + 1u) : uq;
    q = from_bits((zero ? 0u : rounded) | sign);
    return fast;
}

// a / b rounded to nearest even, for a divisor prepared by divisor_of(b).
SYMMRING_DIV_FN float divide(float a, float b, const Divisor& d) {
    // Its own range test first (zeros go to slow_quotient too): fast_divide's answer is then dead and dropped by the
    // compiler. Branching on that answer instead spilled 1600 bytes in wg128t when it was tried (session 17).
    if (!fast_operands(bits(a) & ~kSign, bits(d.b))) return slow_quotient(a, b);
    float q;
    fast_divide(a, b, d, q);
    return q;
}

SYMMRING_DIV_FN float divide(float a, float b) { return divide(a, b, divisor_of(b)); }

// The division functors of the epilogues (fused_common.cuh): any divisor, or one prepared divisor.
struct CallFreeDivision {
    SYMMRING_DIV_FN float operator()(float a, float b) const { return divide(a, b); }
};

struct ByDivisor {
    Divisor d;
    SYMMRING_DIV_FN explicit ByDivisor(float b) : d(divisor_of(b)) {}
    SYMMRING_DIV_FN float operator()(float a, float b) const { return divide(a, b, d); }
};

}  // namespace div
}  // namespace fused
}  // namespace symmring_moe
