"""The fused TMA kernels' span order (device/moe/fused_spans.cuh) on the CPU: the header built with g++
(tests/fused_spans_check.cpp) over seeded random pools: each group's span, and the span order as a permutation of
the phase's items (the first rows group order gives them) in which every span's m blocks are adjacent tickets at
each n block. A wrong decode fails here instead of on the GPU (as rows computed twice or never)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) to build the span check")


def test_the_span_order_is_a_permutation_with_each_spans_m_blocks_adjacent(tmp_path):
    exe = tmp_path / "fused_spans_check"
    subprocess.run([CXX, "-O2", "-std=c++17", f"-I{ROOT / 'device'}", "-o", str(exe),
                    str(ROOT / "tests" / "fused_spans_check.cpp")], check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    found = re.search(r"checks (\d+) failures (\d+)", run.stdout)
    assert run.returncode == 0 and found, run.stdout + run.stderr
    checks, failures = (int(g) for g in found.groups())
    assert failures == 0 and checks > 100_000, run.stdout
