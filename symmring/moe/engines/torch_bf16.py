"""The ``"torch"`` engine: bf16 experts on ``torch._grouped_mm`` (float32 accumulation, bf16 SwiGLU); dispatch
dequantises the fp8 rows into a bf16 pool. Also the grouped-GEMM and SwiGLU helpers the torch baseline
(`symmring.moe.torch_ref`) shares."""

from __future__ import annotations

from typing import Optional

from ...errors import ConfigError
from ..weights import ExpertWeights
from .seam import ExpertEngine, Pool, Scratch


def _torch():
    import torch  # lazy: symmring imports without torch
    return torch


def grouped_mm(a, b_t, offs):
    """``a [M, K] @ b_t[g] [K, N]`` for the row group ``g`` given by cumulative ends ``offs`` (int32).

    ``torch._grouped_mm`` where it exists (CUTLASS grouped GEMM on sm_90; a CPU kernel in recent torch),
    else one matmul per group (needs the offsets on the host). Rows past ``offs[-1]`` are left undefined.
    """
    torch = _torch()
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b_t, offs=offs)
    out = a.new_empty((a.shape[0], b_t.shape[2]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b_t[g]
        start = end
    return out


def swiglu(h, inter: int):
    """``silu(gate) * up`` of ``h = [gate | up]`` (``[M, 2 * inter]`` -> ``[M, inter]``, dtype of ``h``)."""
    torch = _torch()
    return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]


def fuse_gate_up(w_gate, w_up):
    """``[E, 2 * inter, hidden]`` of gate rows then up rows, so L1 is one grouped GEMM."""
    torch = _torch()
    return torch.cat([w_gate, w_up], dim=1).contiguous()


class TorchBf16Experts(ExpertEngine):
    """bf16 experts on ``torch._grouped_mm`` (CUTLASS on sm_90), float32 accumulation, bf16 SwiGLU.

    Args:
        weights: bf16 `ExpertWeights` of this rank's experts.

    Example:
        >>> engine = TorchBf16Experts(expert_weights(w_gate, w_up, w_down, ...))  # doctest: +SKIP
        >>> out = engine.forward(Pool(x=pool_x, group_end=group_end), num_rows)  # doctest: +SKIP
    """

    name = "torch"
    pool_format = "bf16"
    align_m = 1

    def __init__(self, weights: ExpertWeights):
        if weights.dtype != "bf16":
            raise ConfigError(f"engine 'torch': expected bf16 expert weights, got {weights.dtype}")
        self.weights = weights
        self.inter = weights.inter
        self.refresh_weights()

    def refresh_weights(self) -> None:
        w = self.weights
        self._w13_t, self._w_down_t = w.w13.transpose(1, 2), w.w_down.transpose(1, 2)  # [E, K, N] views

    def forward(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int] = None, out=None,
                scratch: Optional[Scratch] = None):
        # torch._grouped_mm has no out=: its own tensor comes back (stages.outbound copies it where needed).
        h = grouped_mm(pool.x[:num_rows], self._w13_t, pool.group_end)
        act = swiglu(h, self.inter)
        return grouped_mm(act, self._w_down_t, pool.group_end)
