// device/moe/fused_div.cuh on the CPU (tests/test_fused_div.py builds and runs this with g++): its division
// against the C library's float division (IEEE, round to nearest even), bit for bit (any NaN for a NaN).
// The hardware reciprocals are modelled by their error: rcp.approx.f32 as the correctly rounded 1 / b moved by
// up to `max_ulps` ulps, rcp.approx.f64 as 1 / b within a relative 2^-19. Usage: fused_div_check ROUNDS MAX_ULPS;
// prints the count of checks and of wrong quotients, exits 1 on any.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

static uint64_t state = 88172645463325252ull;
static uint64_t next_random() {  // xorshift64
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}
static int max_ulps = 2;

namespace symmring_moe {
namespace fused {
namespace div {
float symmring_div_rcp32(float b) {
    float y = 1.0f / b;
    if (std::isfinite(y) && y != 0.0f) {
        uint32_t u;
        std::memcpy(&u, &y, 4);
        u += static_cast<int>(next_random() % (2 * max_ulps + 1)) - max_ulps;
        std::memcpy(&y, &u, 4);
    }
    return y;
}
double symmring_div_rcp64(double b) {
    const double rel = (static_cast<double>(next_random() % 2000001) - 1000000.0) / 1000000.0 * 0x1p-19;
    return 1.0 / b * (1.0 + rel);
}
}  // namespace div
}  // namespace fused
}  // namespace symmring_moe

#include <moe/fused_div.cuh>

using namespace symmring_moe::fused::div;

static long checks = 0, fast = 0, wrong = 0;

static bool same(float want, float got) { return (std::isnan(want) && std::isnan(got)) || bits(want) == bits(got); }

// divide, and the epilogues' two passes: fast_divide where it says it applies, slow_quotient where it does not.
static void check(float a, float b) {
    const float want = a / b, got = divide(a, b);
    float q;
    const bool applies = fast_divide(a, b, divisor_of(b), q);
    const float split = applies ? q : slow_quotient(a, b);
    ++checks;
    if (fast_operands(bits(a) & 0x7fffffffu, bits(b) & 0x7fffffffu)) ++fast;
    if (same(want, got) && same(want, split)) return;
    if (wrong++ < 20)
        std::printf("wrong: %a / %a = %a, got %a (divide), %a (%s)\n", a, b, want, got, split,
                    applies ? "fast_divide" : "slow_quotient");
}

static float any_float() { return from_bits(static_cast<uint32_t>(next_random())); }

// x with a mantissa of few or many trailing ones, or near a half: where rounding is hardest.
static float edge_mantissa(float x) {
    uint32_t m;
    switch (next_random() % 4) {
        case 0: m = next_random() & 15; break;
        case 1: m = 0x7fffffu - (next_random() & 15); break;
        case 2: m = 0x400000u ^ (next_random() & 15); break;
        default: m = next_random() & 0x7fffffu;
    }
    return from_bits((bits(x) & 0xff800000u) | m);
}

static float with_exponent(uint32_t field) {
    return from_bits((static_cast<uint32_t>(next_random()) & 0x807fffffu) | ((field & 0xffu) << 23));
}

int main(int argc, char** argv) {
    const long rounds = argc > 1 ? std::atol(argv[1]) : 1000000;
    if (argc > 2) max_ulps = std::atoi(argv[2]);
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 0x1p-149f, -0x1p-149f, 0x1.8p-148f,
                              0x1p-126f, 0x1.fffffep127f, -0x1.fffffep127f, 1.0f, -2.0f, 0x1.fffffep-1f, 448.0f};
    for (long i = 0; i < rounds; ++i) {
        // any bit patterns (NaN, infinities, denormals included), half of them with hard mantissas
        float a = any_float(), b = any_float();
        if (i & 1) a = edge_mantissa(a);
        if (i & 2) b = edge_mantissa(b);
        check(a, b);
        // the fast path's domain and its borders
        const float a2 = with_exponent(20 + next_random() % 240), b2 = with_exponent(next_random() % 256);
        check(edge_mantissa(a2), b2);
        check(a2, edge_mantissa(b2));
        // the epilogues' divisions: bf16 gate / (1 + expf(-gate)); value / (amax / 448)
        const float unit = static_cast<float>(static_cast<int64_t>(next_random() % 2000001) - 1000000) / 1e6f;
        const float gate = from_bits(bits(std::ldexp(unit, static_cast<int>(next_random() % 40) - 30)) & 0xffff0000u);
        check(gate, 1.0f + std::exp(-gate));
        const float amax = std::fabs(gate) * (1.0f + static_cast<float>(next_random() % 1000) / 100.0f);
        check(gate * static_cast<float>(static_cast<int64_t>(next_random() % 2001) - 1000) / 1000.0f,
              amax == 0.0f ? 1.0f : amax / 448.0f);
        // denormal and tiny quotients
        const uint32_t tiny_bits = static_cast<uint32_t>(next_random() % 0x01000000u) | (next_random() & 0x80000000u);
        const float tiny = from_bits(tiny_bits);
        const float near_one = with_exponent(127 + next_random() % 8);
        check(tiny, near_one);
        check(tiny, from_bits(bits(near_one) + static_cast<uint32_t>((next_random() % 60) << 23)));
        // exact midpoints between denormals: a = b m 2^-150 with m odd, b a small odd integer times 2^k
        const int odd = 3 + 2 * static_cast<int>(next_random() % 48), k = 1 + static_cast<int>(next_random() % 20);
        const int64_t m = 1 + 2 * static_cast<int64_t>(next_random() % ((1u << 20) / odd / 2));
        const float mb = std::ldexp(static_cast<float>(odd), k), ma = std::ldexp(static_cast<float>(odd * m), k - 150);
        check((i & 4) ? -ma : ma, mb);
        check(ma, -mb);
        // quotients near overflow
        const float big = with_exponent(230 + next_random() % 25), small = with_exponent(100 + next_random() % 30);
        check(std::fabs(big), std::fabs(small));
        check(edge_mantissa(big), edge_mantissa(small));
        if (i % 1024 == 0)
            for (float x : specials) {
                for (float y : specials) check(x, y);
                check(x, b);
                check(a, x);
            }
    }
    std::printf("checks %ld (fast path %ld) wrong %ld\n", checks, fast, wrong);
    return wrong != 0;
}
