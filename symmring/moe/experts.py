"""The experts step of the GPU MoE layer: one seam, pool rows in, output rows out.

Dispatch (`symmring.moe.stages`) gathers every (token, k) entry routed to this rank's experts into an
expert-contiguous `Pool`; an `ExpertEngine` turns the pool's first ``num_rows`` rows into output rows
(L1 = gate and up as one grouped GEMM, SwiGLU, L2 = down), which the combine sends back to the tokens'
owners. The engine says which pool it wants: its row format (``"bf16"``: dispatch dequantises fp8 on the
way) and the row alignment of every expert's group (1: packed). Nothing else in the layer knows how the
experts compute.

Engines here: `TorchBf16Experts` (``torch._grouped_mm`` over bf16 rows, float32 accumulation).

Weights use the ``nn.Linear`` convention of Mixtral and Qwen-MoE: gate and up ``[E, inter, hidden]``,
down ``[E, hidden, inter]``; L1 runs on the fused ``[E, 2 * inter, hidden]`` (`fuse_gate_up`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional


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


@dataclass
class Pool:
    """The expert pool of one window, as dispatch left it (device tensors, fixed size: graph-capturable).

    Attributes:
        x: ``[capacity, hidden]`` rows, in the engine's `ExpertEngine.pool_format`.
        x_sf: ``[capacity, hidden / 128]`` float32 scales of fp8 rows, or None.
        group_end: int32 ``[E]``: cumulative row end of each local expert's group (``torch._grouped_mm``'s
            ``offs``); with an alignment > 1, the end of its aligned block.
        m_indices: int32 ``[capacity]``: the local expert of each row, -1 for padding (aligned pools), or None.
    """

    x: object
    group_end: object
    x_sf: Optional[object] = None
    m_indices: Optional[object] = None


class ExpertEngine(abc.ABC):
    """How this rank's experts compute (see the module docstring).

    Attributes:
        name: the engine's name (``"torch"``, ...).
        pool_format: ``"bf16"`` or ``"fp8"``: the rows dispatch writes into the pool.
        align_m: every expert group starts at a multiple of this many pool rows (1: packed).
        num_local_experts, hidden, inter: the shapes it was built for.
    """

    name: str
    pool_format: str
    align_m: int = 1

    @abc.abstractmethod
    def forward(self, pool: Pool, num_rows: int):
        """bf16 ``[num_rows, hidden]``: the expert output of pool rows ``[0, num_rows)`` (a host-side bound;
        rows past the groups' end are undefined and never read). Enqueued on the current torch stream."""


class TorchBf16Experts(ExpertEngine):
    """bf16 experts on ``torch._grouped_mm`` (CUTLASS on sm_90), float32 accumulation, bf16 SwiGLU.

    Args:
        w_gate, w_up: bf16 ``[E, inter, hidden]``; w_down: bf16 ``[E, hidden, inter]`` (this rank's experts).

    Example:
        >>> engine = TorchBf16Experts(w_gate, w_up, w_down)
        >>> out = engine.forward(Pool(x=pool_x, group_end=group_end), num_rows)
    """

    name = "torch"
    pool_format = "bf16"
    align_m = 1

    def __init__(self, w_gate, w_up, w_down):
        self.num_local_experts, self.inter, self.hidden = (int(s) for s in w_gate.shape)
        self.w13 = fuse_gate_up(w_gate, w_up)
        self.w_down = w_down.contiguous()
        self._w13_t, self._w_down_t = self.w13.transpose(1, 2), self.w_down.transpose(1, 2)  # [E, K, N] views

    def forward(self, pool: Pool, num_rows: int):
        h = grouped_mm(pool.x[:num_rows], self._w13_t, pool.group_end)
        act = swiglu(h, self.inter)
        return grouped_mm(act, self._w_down_t, pool.group_end)
