// The span order of the fused TMA kernels' work list (fused_experts_tma.cu): which item a ticket decodes to.
//
// The pool's rows come in 128-row groups, every expert's rows in consecutive groups from a group's start (the
// contiguous layout). A span is an expert's groups: consecutive groups whose first rows name the same expert; a
// padding group (its first row -1) is a span of its own. Group order (fused_common.cuh item_coords) lists a group's
// items n block by n block, group after group: an expert's second group then reads every weight tile again a
// group's items after its first did, by then out of L2 (DeepSeek-V3-like at 4096 tokens per rank: half the experts
// hold two groups). Span order lists a span's items n block by n block, all of the span's m blocks at each: the
// m blocks that read a tile are adjacent tickets, so the tile comes from HBM once and from L2 for the others.
// Every group has n_blocks * per_group items in either order, so a span's items start at its first group's share of
// the list (no prefix sums), and the two orders are permutations of each other: the same m blocks, first rows and
// n blocks. `sole_reader` tells the producer which items may stream their weights evict-first. Host and device alike:
// tests/test_fused_spans.py builds this header with g++ (tests/fused_spans_check.cpp).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define SYMMRING_SPAN_FN __host__ __device__ __forceinline__
#else
#define SYMMRING_SPAN_FN inline
#endif

namespace symmring_moe {
namespace fused {

// Group g's span among `groups` groups, from `expert(g)`, the local expert of each group's first row (-1:
// padding): its first group and its groups. A span of L groups takes L reads of `expert` for each of its groups.
template <class Expert>
SYMMRING_SPAN_FN void span_of(const Expert& expert, int g, int groups, int& first, int& count) {
    const int e = expert(g);
    int begin = g, end = g + 1;
    if (e >= 0) {
        while (begin > 0 && expert(begin - 1) == e) --begin;
        while (end < groups && expert(end) == e) ++end;
    }
    first = begin;
    count = end - begin;
}

// Item i of a phase of n_blocks items per m block, per_group m blocks of block_m rows per 128-row group: its m
// block, first row and n block, given each group's span (span_first, span_groups: span_of).
SYMMRING_SPAN_FN void span_coords(const int16_t* span_first, const int16_t* span_groups, int per_group, int block_m,
                                  int i, int n_blocks, int& m_block, int& row0, int& n_block) {
    const int group_items = n_blocks * per_group;
    const int g = i / group_items;
    const int first = span_first[g], span_m = span_groups[g] * per_group;
    const int r = i - first * group_items;
    const int m = r % span_m;
    n_block = r / span_m;
    m_block = first * per_group + m;
    row0 = (first + m / per_group) * 128 + (m % per_group) * block_m;
}

// Whether an item of `item_blocks` 64-row blocks from block `first` is the only reader of its weight tiles: its
// expert `e` holds no rows outside it (the blocks either side name another expert or padding; `expert(b)`: the local
// expert of block b's first row, -1 padding), among the pass's `blocks` of which the first `known` can be read (a
// table's length). Where a neighbour is past them: not known, false. An expert's rows start its group and come in
// one run, so this is "the expert holds at most the item's rows" without a count.
template <class Expert>
SYMMRING_SPAN_FN bool sole_reader(const Expert& expert, int first, int item_blocks, int blocks, int known, int e) {
    const int end = first + item_blocks;
    if (first > known || (end < blocks && end >= known)) return false;
    return (first == 0 || expert(first - 1) != e) && (end >= blocks || expert(end) != e);
}

}  // namespace fused
}  // namespace symmring_moe
