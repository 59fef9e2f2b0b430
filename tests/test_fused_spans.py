"""The fused TMA kernels' span order (device/moe/fused_spans.cuh) on the CPU: the header built with g++
(tests/fused_spans_check.cpp) over seeded random pools: each group's span, and the span order as a permutation of
the phase's items (the first rows group order gives them) in which every span's m blocks are adjacent tickets at
each n block; and `sole_reader` (the producer's evict-first rule per item) true exactly where the item's expert holds
at most the item's rows. A wrong decode fails here instead of on the GPU (as rows computed twice or never, or a
weight stream at the wrong L2 priority)."""

from __future__ import annotations

import re
import subprocess

from host_checks import build_check, needs_cxx

pytestmark = needs_cxx


def test_span_order_is_a_permutation_of_adjacent_m_blocks_and_sole_readers_hold_their_experts(tmp_path):
    run = subprocess.run([str(build_check("fused_spans_check", tmp_path))], capture_output=True, text=True,
                         timeout=120)
    found = re.search(r"sole_reader (\d+)\nchecks (\d+) failures (\d+)", run.stdout)
    assert found and run.returncode == 0, run.stdout + run.stderr
    sole, checks, failures = (int(g) for g in found.groups())
    assert failures == 0 and checks > 100_000 and sole > 10_000
