"""What ``bench gemm`` (`symmring.bench.gemm`) and its decode part (`symmring.bench.gemm_decode`) both use:
the progress line on stderr and the ring's fp8 row quantisation rule in torch."""

from __future__ import annotations

import sys
import time


def progress(msg: str) -> None:
    print(f"[bench gemm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def quant_rows(x):
    """Per row and 128 columns, the ring's rule in torch: (q fp8, sf float32 [M, K / 128])."""
    import torch
    M, K = x.shape
    groups = x.float().view(M, K // 128, 128)
    amax = groups.abs().amax(dim=2)
    # A tensor divisor: torch turns division by a Python scalar into a multiply by its reciprocal, which
    # is not the IEEE quotient the rule (and producer.cu, and the Triton kernel) uses.
    sf = amax / torch.full_like(amax, 448.0)
    sf = torch.where(sf == 0, torch.ones_like(sf), sf)
    q = (groups / sf[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(M, K)
    return q, sf
