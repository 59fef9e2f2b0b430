"""The wgmma kernel's shared memory layout and accumulator indexing (device/moe/wgmma_layout.cuh) on the CPU: the
header built with g++ (tests/wgmma_layout_check.cpp) against the PTX ISA's definitions, restated there: the
matrix descriptor's fields, how wgmma reads a K-major 128B-swizzled e4m3 operand through it at each k32 step (the
byte the cp.async of the kernel's load_stage wrote there, for every row, K byte and 1024-byte aligned tile), and
the m64nNk32 float32 accumulator fragment (CUTLASS's CLayout_64xN) with what the epilogues rely on. A wrong swizzle,
descriptor field, k advance or fragment index fails here instead of on the GPU (as wrong numbers)."""

from __future__ import annotations

from host_checks import build_check, needs_cxx, run_checks

pytestmark = needs_cxx


def test_the_kernels_layouts_are_the_ptx_isas(tmp_path):
    checks, failures = run_checks(build_check("wgmma_layout_check", tmp_path))
    assert failures == 0 and checks > 1_000_000
