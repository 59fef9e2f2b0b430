"""The fused TMA kernels' span order (device/moe/fused_spans.cuh) on the CPU: the header built with g++
(tests/fused_spans_check.cpp) over seeded random pools: each group's span, and the span order as a permutation of
the phase's items (the first rows group order gives them) in which every span's m blocks are adjacent tickets at
each n block. A wrong decode fails here instead of on the GPU (as rows computed twice or never)."""

from __future__ import annotations

from host_checks import build_check, needs_cxx, run_checks

pytestmark = needs_cxx


def test_the_span_order_is_a_permutation_with_each_spans_m_blocks_adjacent(tmp_path):
    checks, failures = run_checks(build_check("fused_spans_check", tmp_path))
    assert failures == 0 and checks > 100_000
