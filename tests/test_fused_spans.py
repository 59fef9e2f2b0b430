"""The fused TMA kernels' span order (device/moe/fused_spans.cuh) on the CPU: the header built with g++
(tests/fused_spans_check.cpp) over seeded random pools: each group's span, and the span order as a permutation of
the phase's items (the first rows group order gives them) in which every span's m blocks are adjacent tickets at
each n block; and `sole_reader` (the producer's evict-first rule per item) true exactly where the item's expert holds
at most the item's rows. A wrong decode fails here instead of on the GPU (as rows computed twice or never, or a
weight stream at the wrong L2 priority)."""

from __future__ import annotations

import re

from host_checks import build_check, needs_cxx, run_check

pytestmark = needs_cxx


def test_span_order_is_a_permutation_of_adjacent_m_blocks_and_sole_readers_hold_their_experts(tmp_path):
    checks, failures, out = run_check(build_check("fused_spans_check", tmp_path))
    sole = re.search(r"sole_reader (\d+)", out)
    assert failures == 0 and checks > 100_000 and sole and int(sole[1]) > 10_000, out
