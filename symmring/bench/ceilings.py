"""The ceilings a benchmark measures in its own run and the fp8 roofline of an MoE call built from them
(`symmring.bench.moe` and `symmring.bench.moe_anchor` print latency over it)."""

from __future__ import annotations

import statistics
from typing import Dict

from . import timed_ms


def measure_ceilings(device) -> Dict[str, float]:
    """bf16 dense matmul rate and fp8 dense GEMM rate (TFLOP/s, 8192^3, ``torch._scaled_mm`` with per-row
    scales) and device copy bandwidth (GB/s, bytes read + written)."""
    import torch
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = statistics.median(timed_ms(lambda: a @ b, 10, 3))
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as cuBLASLt wants
    sa = torch.ones(8192, 1, device=device, dtype=torch.float32)
    sb = torch.ones(1, 8192, device=device, dtype=torch.float32)
    fp8_ms = statistics.median(timed_ms(lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb,
                                                               out_dtype=torch.bfloat16), 10, 3))
    src = torch.empty(2 ** 30 // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(timed_ms(lambda: dst.copy_(src), 10, 3))
    del a, b, a8, b8, src, dst
    return {"matmul_tflops": 2 * 8192 ** 3 / (mm_ms * 1e-3) / 1e12,
            "fp8_matmul_tflops": 2 * 8192 ** 3 / (fp8_ms * 1e-3) / 1e12,
            "copy_gbps": 2 * 2 ** 30 / (copy_ms * 1e-3) / 1e9}


def fp8_roofline_ms(touched_experts: int, rows: int, hidden: int, inter: int, ceilings: Dict[str, float]) -> float:
    """``max(fp8 weight bytes touched / copy rate, FLOPs / dense fp8 rate)`` in ms: the experts' weights
    (gate, up, down: ``3 * hidden * inter`` bytes each, plus their 128x128 block scales) read once, the
    expert GEMMs at the dense fp8 rate (the copy rate counts bytes read + written, so reads alone move at
    about half of it: the bound uses the measured rate as is, a lower bound)."""
    weight_bytes = touched_experts * (3 * hidden * inter + 3 * (hidden // 128) * (inter // 128) * 4)
    flops = 2.0 * rows * 3 * hidden * inter
    return max(weight_bytes / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["fp8_matmul_tflops"] * 1e12)) * 1e3
