"""The wgmma kernel's call-free IEEE division (device/moe/fused_div.cuh) on the CPU: the header built with g++
(tests/fused_div_check.cpp) against the C library's float division, bit for bit, over random and hard operands
(every class of float, hard mantissas, the epilogues' own divisions, denormal quotients and exact midpoints
between them, quotients near overflow), with the hardware reciprocals modelled as off by up to 2 and 4 ulps.
On the GPU, tests/gpu/test_fused_engine.py compares the same code with torch's division."""

from __future__ import annotations

import re
import subprocess

import pytest
from host_checks import build_check, needs_cxx

pytestmark = needs_cxx


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    # -ffp-contract=off: the header's roundings are the explicit ones; no fused multiply-add of the compiler's.
    return build_check("fused_div_check", tmp_path_factory.mktemp("fused_div"),
                       ("-ffp-contract=off", "-Wno-unknown-pragmas"))


@pytest.mark.parametrize("max_ulps", [0, 2, 4])
def test_the_division_is_ieee_bit_for_bit(checker, max_ulps):
    run = subprocess.run([str(checker), "400000", str(max_ulps)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    found = re.search(r"checks (\d+) \(fast path (\d+)\) wrong (\d+)", run.stdout)
    assert found, run.stdout
    checks, fast, wrong = (int(g) for g in found.groups())
    assert wrong == 0 and checks > 4_000_000 and fast > checks // 4, run.stdout
