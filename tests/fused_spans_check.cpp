// device/moe/fused_spans.cuh on the CPU (tests/test_fused_spans.py builds this with g++): over seeded random pools
// (every expert's rows in consecutive 128-row groups, then padding groups), for both kernels' m blocks (64 rows, two
// per group; 128 rows, one) and several n blocks per m block:
//   * span_of gives every group the first group and the count of the run of groups naming its expert (a padding
//     group: itself alone), restated here by a forward scan;
//   * span_coords is a permutation of the phase's items: every (m block, n block) exactly once, with the first row
//     item_coords (group order, fused_common.cuh) gives that m block;
//   * a span's items run n block by n block, its m blocks adjacent at each: item i + 1 is the next m block of the
//     same n block or the span's first m block of the next one;
//   * sole_reader, over pools laid out row by row (each expert's rows from its first group's start, the rest of its
//     groups -1): an item of 64 or 128 rows is its tiles' only reader exactly where its expert holds at most the
//     item's rows, and "not known" (false) where a neighbouring block lies past a shorter table.
// Usage: fused_spans_check; prints the count of checks and of failures, exits 1 on any.
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include <moe/fused_spans.cuh>

using namespace symmring_moe::fused;

static long checks = 0, failures = 0;

static void expect(bool ok, const char* what, long a = 0, long b = 0, long c = 0) {
    ++checks;
    if (ok) return;
    if (failures++ < 20) std::printf("FAIL %s (%ld, %ld, %ld)\n", what, a, b, c);
}

// One pool's groups: each expert's ceil(rows / 128) groups in expert order (experts of no rows have none), then
// `padding` groups of -1.
static std::vector<int> pool_groups(std::mt19937& rng, int experts, int max_rows, int padding) {
    std::vector<int> groups;
    std::uniform_int_distribution<int> rows(0, max_rows);
    for (int e = 0; e < experts; ++e)
        for (int g = 0, n = (rows(rng) + 127) / 128; g < n; ++g) groups.push_back(e);
    groups.insert(groups.end(), padding, -1);
    return groups;
}

static void check_pool(const std::vector<int>& expert_of) {
    const int groups = static_cast<int>(expert_of.size());
    std::vector<int16_t> first(groups), count(groups);
    const auto expert = [&](int g) { return expert_of[g]; };
    for (int g = 0; g < groups; ++g) {
        int f, c;
        span_of(expert, g, groups, f, c);
        first[g] = static_cast<int16_t>(f);
        count[g] = static_cast<int16_t>(c);
        int want_first = g, want_end = g + 1;  // restated: the run of groups of g's expert
        if (expert_of[g] >= 0) {
            want_first = 0;
            for (int h = 0; h <= g; ++h)
                if (expert_of[h] != expert_of[g]) want_first = h + 1;
            while (want_end < groups && expert_of[want_end] == expert_of[g]) ++want_end;
        }
        expect(f == want_first && c == want_end - want_first, "span_of", g, f, c);
    }
    for (int per_group : {1, 2}) {
        const int block_m = 128 / per_group;
        for (int n_blocks : {1, 3, 16}) {
            const int items = groups * per_group * n_blocks;
            std::set<std::pair<int, int>> seen;
            int prev_m = -1, prev_n = -1;
            for (int i = 0; i < items; ++i) {
                int m_block, row0, n_block;
                span_coords(first.data(), count.data(), per_group, block_m, i, n_blocks, m_block, row0, n_block);
                const int g = m_block / per_group;
                expect(m_block >= 0 && m_block < groups * per_group && n_block >= 0 && n_block < n_blocks,
                       "in range", i, m_block, n_block);
                if (failures) return;
                expect(row0 == g * 128 + (m_block % per_group) * block_m, "row0 as item_coords", i, m_block, row0);
                expect(seen.insert({m_block, n_block}).second, "each item once", i, m_block, n_block);
                // Within the ticket's span: the next m block at the same n block, or the span's first at the next.
                const int span_begin = first[g] * per_group, span_end = span_begin + count[g] * per_group;
                if (prev_m >= 0 && prev_m >= span_begin && prev_m < span_end) {
                    const bool next_m = n_block == prev_n && m_block == prev_m + 1;
                    const bool next_n = prev_m == span_end - 1 && n_block == prev_n + 1 && m_block == span_begin;
                    const bool next_span = prev_m == span_end - 1 && prev_n == n_blocks - 1 && m_block == span_end;
                    expect(next_m || next_n || next_span || m_block < span_begin, "adjacent", i, prev_m, m_block);
                }
                expect(m_block >= span_begin && m_block < span_end, "item in its group's span", i, m_block, g);
                prev_m = m_block;
                prev_n = n_block;
            }
            expect(static_cast<int>(seen.size()) == items, "every item", items, static_cast<long>(seen.size()));
        }
    }
}

// Rows per expert -> each row's expert (every expert's rows from its first group's start, -1 to its groups' end),
// then `padding` groups of -1.
static std::vector<int> pool_rows(const std::vector<int>& rows_of, int padding) {
    std::vector<int> rows;
    for (int e = 0; e < static_cast<int>(rows_of.size()); ++e) {
        const int groups = (rows_of[e] + 127) / 128;
        for (int r = 0; r < groups * 128; ++r) rows.push_back(r < rows_of[e] ? e : -1);
    }
    rows.insert(rows.end(), padding * 128, -1);
    return rows;
}

static long sole_checks = 0;  // sole_reader's own checks (printed apart: the test asserts them)

static void check_sole_reader(const std::vector<int>& rows_of, int padding, int known_cut) {
    const std::vector<int> rows = pool_rows(rows_of, padding);
    const int blocks = static_cast<int>(rows.size()) / 64;
    const int known = known_cut > 0 && known_cut < blocks ? known_cut : blocks;
    const long before = checks;
    const auto expert = [&](int b) {
        expect(b >= 0 && b < known, "read inside the table", b, known);
        return rows[b * 64];
    };
    for (int item_blocks : {1, 2}) {
        for (int b = 0; b + item_blocks <= blocks; b += item_blocks) {
            const int e = rows[b * 64];
            if (e < 0) continue;  // padding: the producer skips it before asking
            const bool got = sole_reader(expert, b, item_blocks, blocks, known, e);
            const int end = b + item_blocks;
            const bool readable = b <= known && (end >= blocks || end < known);
            const bool want = readable && rows_of[e] <= 64 * item_blocks;
            expect(got == want, "sole_reader", b, item_blocks, rows_of[e]);
        }
    }
    sole_checks += checks - before;
}

int main() {
    std::mt19937 rng(1234);
    check_pool({0});
    check_pool({-1});
    check_pool(std::vector<int>(300, 7));  // one expert holds every group
    check_pool({0, 0, 1, -1, -1});
    for (int trial = 0; trial < 200; ++trial) {
        std::uniform_int_distribution<int> experts(1, 64), max_rows(0, 600), padding(0, 8);
        check_pool(pool_groups(rng, experts(rng), max_rows(rng), padding(rng)));
    }
    check_sole_reader({64, 65, 0, 1, 128, 129, 300}, 1, 0);  // at and past one and two 64-row blocks
    // Every table length of one pool, with and without padding after its last expert: items that start at the
    // table's end (the pass's last item included), end at it, or straddle it.
    const std::vector<int> edges = {40, 64, 100, 1, 200, 128, 65, 20};
    for (int padding : {0, 1})
        for (int known = 1; known <= static_cast<int>(pool_rows(edges, padding).size()) / 64; ++known)
            check_sole_reader(edges, padding, known);
    for (int trial = 0; trial < 300; ++trial) {
        std::uniform_int_distribution<int> experts(1, 48), max_rows(0, 300), padding(0, 3), cut(0, 40);
        std::vector<int> rows_of(experts(rng));
        std::uniform_int_distribution<int> rows(0, max_rows(rng));
        for (int& r : rows_of) r = rows(rng);
        check_sole_reader(rows_of, padding(rng), trial % 2 ? cut(rng) : 0);
    }
    std::printf("sole_reader %ld\nchecks %ld failures %ld\n", sole_checks, checks, failures);
    return failures ? 1 : 0;
}
