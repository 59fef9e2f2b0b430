"""The wgmma kernel's shared memory layout and accumulator indexing (device/moe/wgmma_layout.cuh) on the CPU: the
header built with g++ (tests/wgmma_layout_check.cpp) against the PTX ISA's definitions, restated there: the
matrix descriptor's fields, how wgmma reads a K-major 128B-swizzled e4m3 operand through it at each k32 step (the
byte the cp.async of the kernel's load_stage wrote there, for every row, K byte and 1024-byte aligned tile), and
the m64nNk32 float32 accumulator fragment (CUTLASS's CLayout_64xN) with what the epilogues rely on. A wrong swizzle,
descriptor field, k advance or fragment index fails here instead of on the GPU (as wrong numbers)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) to build the layout check")


def test_the_kernels_layouts_are_the_ptx_isas(tmp_path):
    exe = tmp_path / "wgmma_layout_check"
    subprocess.run([CXX, "-O2", "-std=c++17", f"-I{ROOT / 'device'}", "-o", str(exe),
                    str(ROOT / "tests" / "wgmma_layout_check.cpp")], check=True, capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    found = re.search(r"checks (\d+) failures (\d+)", run.stdout)
    assert run.returncode == 0 and found, run.stdout + run.stderr
    checks, failures = (int(g) for g in found.groups())
    assert failures == 0 and checks > 1_000_000, run.stdout
