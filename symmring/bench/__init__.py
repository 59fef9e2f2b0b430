"""Benchmarks (``python -m symmring bench <name>``): `protocol` (publish->observe latency and slot-pull
bandwidth of the device protocol), `moe` (the GPU MoE layer against plain torch) and `stream` (streamed
against batch-ready)."""

from __future__ import annotations

from typing import Optional


def missing_cuda_torch() -> Optional[str]:
    """Why a torch benchmark cannot run here (``None`` when torch sees a CUDA GPU)."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA (not installed)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None
