"""The experts step of the GPU MoE layer: one seam, pool rows in, output rows out.

Dispatch (`symmring.moe.stages`) gathers every (token, k) entry routed to this rank's experts into an
expert-contiguous `Pool`; an `ExpertEngine` turns the pool's first ``num_rows`` rows into output rows
(L1 = gate and up as one grouped GEMM, SwiGLU, L2 = down), which the combine sends back to the tokens'
owners. The engine says which pool it wants: its row format (``"bf16"``: dispatch dequantises fp8 on the
way) and the row alignment of every expert's group (1: packed). Nothing else in the layer knows how the
experts compute.

Engines (`make_engine`, the layer's ``engine=`` argument):

* ``"torch"``: `TorchBf16Experts`, bf16 experts on ``torch._grouped_mm`` (float32 accumulation, bf16
  SwiGLU); dispatch dequantises the fp8 rows into a bf16 pool.
* ``"builtin"``: `Fp8Experts` on the project's Triton kernels (`symmring.moe.fp8_kernels`): fp8 pool (rows
  and their 1x128 scales as the producer wrote them), L1 block-scaled fp8 grouped GEMM, SwiGLU fused with
  the 1x128 fp8 quantisation of its output, L2 fp8 grouped GEMM to bf16.
* ``"deepgemm"``: `Fp8Experts` with DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` for both GEMMs
  (`symmring.moe.deepgemm`; optional, imported lazily) and the same SwiGLU kernel.
* ``"auto"``: ``"torch"`` for bf16 experts; for fp8, DeepGEMM where it loads, else the built-in kernels.

For tiny groups (decode: ``forward``'s ``rows_per_expert`` bound at most ``small_rows``) both fp8 engines run
`symmring.moe.fp8_small`'s swap-AB kernels instead (L1 fused with SwiGLU and the quantisation).

The fp8 engines want the contiguous layout: every expert's group starts at a multiple of 128 pool rows
and ``m_indices`` names each row's expert (-1 for padding). Weights: `symmring.moe.weights`.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Optional

from ..errors import BackendError, ConfigError
from .weights import ExpertWeights

logger = logging.getLogger(__name__)

#: Values of the layer's ``engine`` argument.
ENGINES = ("auto", "deepgemm", "builtin", "torch")
#: Row alignment of every expert group in an fp8 pool (DeepGEMM's and the Triton kernel's M block).
FP8_ALIGN_M = 128
#: `Fp8Experts`' default threshold: at most this many rows per expert take the small-group kernels (their
#: largest row tile; above it a 64-row tile of the large-group GEMM wastes little).
SMALL_ROWS = 64


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


@dataclass
class Scratch:
    """Where an fp8 engine puts a pass's intermediates on its general path, L1 then SwiGLU then L2 (the
    workspace's experts' region: rows past the pass's are another pass's or shape's;
    `symmring.workspace_plan.expert_arena`). ``act`` may share bytes with the pool (dead after L1) and ``h``
    with the output rows (written by L2): an engine must not read the pool after writing ``act``, nor write
    the output before it is done with ``h``; a bf16 pool shares its bytes with the output rows.

    Attributes:
        h: bf16 ``[capacity, 2 * inter]``: L1's output (gate then up).
        act: float8_e4m3fn ``[capacity, inter]``: SwiGLU's output quantised for L2.
    """

    h: object
    act: object


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
    def forward(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int] = None, out=None,
                scratch: Optional[Scratch] = None):
        """bf16 ``[num_rows, hidden]``: the expert output of pool rows ``[0, num_rows)`` (a host-side bound;
        rows past the groups' end are undefined and never read). Enqueued on the current torch stream.

        ``rows_per_expert``: a host bound on the rows any one local expert holds in this window (None:
        unknown); an engine may pick its kernels by it, and must then trust it. ``out``: bf16 ``[num_rows,
        hidden]`` to write the output into (the workspace's rows the combine sends); the engine returns it
        (an engine that cannot write into it returns its own tensor, which the layer then copies).
        ``scratch``: where to put the intermediates (`Scratch`; None: the engine allocates them); an engine
        that keeps its own ignores it."""

    def refresh_weights(self) -> None:
        """Re-derive whatever the engine keeps beside `weights` (views, prepared layouts) after the
        weights' tensors were overwritten in place (`symmring.moe.module.MoEModule.load_state_dict`)."""


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


class Fp8Experts(ExpertEngine):
    """fp8 experts: block-scaled fp8 grouped GEMMs over the contiguous layout, SwiGLU fused with the fp8
    quantisation of its output (see the module docstring).

    Small groups (decode): when the host bound ``rows_per_expert`` of `forward` is at most ``small_rows``,
    both GEMMs run as `symmring.moe.fp8_small`'s swap-AB kernels (the weights on the MMA's M side, the few
    rows on its N side, L1 fused with SwiGLU and the quantisation), whatever ``gemm`` is: DeepGEMM's
    small-batch kernel wants the masked layout (rows of each expert in a ``[G, max_rows, K]`` block), not
    the contiguous pool the layer's dispatch writes, and its contiguous kernel computes 128-row blocks.

    Args:
        weights: fp8 `ExpertWeights` (128x128 block scales).
        gemm: ``"builtin"`` (Triton, `symmring.moe.fp8_kernels`) or ``"deepgemm"``: the GEMM of larger groups.
        small_rows: the largest ``rows_per_expert`` that takes the small kernels (default `SMALL_ROWS`;
            0 disables them, a large value forces them where the bound is given; at most 128).

    Raises:
        ConfigError: bad weights, ``gemm`` or ``small_rows``.
        BackendError: the chosen GEMM cannot run here (no Triton, DeepGEMM absent or incompatible).
    """

    pool_format = "fp8"
    align_m = FP8_ALIGN_M

    def __init__(self, weights: ExpertWeights, gemm: str, small_rows: Optional[int] = None):
        if weights.dtype != "fp8":
            raise ConfigError(f"engine {gemm!r}: expected fp8 expert weights, got {weights.dtype}")
        small_rows = SMALL_ROWS if small_rows is None else small_rows
        if isinstance(small_rows, bool) or not isinstance(small_rows, int) or not 0 <= small_rows <= FP8_ALIGN_M:
            raise ConfigError(f"small_rows={small_rows!r}: expected an int in [0, {FP8_ALIGN_M}] (0: never the "
                              f"small-group kernels)")
        from . import fp8_kernels
        self.name = gemm
        self.small_rows = small_rows
        self.weights = weights
        self._swiglu_quant = fp8_kernels.swiglu_quant_fp8  # L2's scales MN-major: DeepGEMM reads them as they are
        if gemm == "deepgemm":
            from . import deepgemm
            ok, reason = deepgemm.deepgemm_status()
            if not ok:
                raise BackendError(f"engine='deepgemm': {reason}")
            self._gemm = deepgemm.grouped_gemm_fp8
        elif gemm == "builtin":
            self._gemm = fp8_kernels.grouped_gemm_fp8
        else:
            raise ConfigError(f"gemm={gemm!r}: expected 'builtin' or 'deepgemm'")
        self.refresh_weights()

    def refresh_weights(self) -> None:
        w = self.weights
        if self.name == "deepgemm":  # contiguous float32 scales: the same tensors unless a copy was needed
            from . import deepgemm
            self._w13, self._w13_scale = deepgemm.prepare_weights(w.w13, w.w13_scale)
            self._w_down, self._w_down_scale = deepgemm.prepare_weights(w.w_down, w.w_down_scale)
        else:
            self._w13, self._w13_scale = w.w13, w.w13_scale
            self._w_down, self._w_down_scale = w.w_down, w.w_down_scale

    def forward(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int] = None, out=None,
                scratch: Optional[Scratch] = None):
        m_indices = pool.m_indices[:num_rows]
        if rows_per_expert is not None and rows_per_expert <= self.small_rows:
            from . import fp8_small
            bound = min(rows_per_expert, num_rows)
            # Its activations come from torch, not `scratch`: the fused L1 writes them while other programs
            # still read the pool, which the workspace's activations may share bytes with (expert_arena).
            act, act_sf = fp8_small.grouped_gemm_swiglu_quant_fp8_small(
                pool.x[:num_rows], pool.x_sf[:num_rows], self._w13, self._w13_scale, m_indices, rows_per_group=bound)
            return fp8_small.grouped_gemm_fp8_small(act, act_sf, self._w_down, self._w_down_scale, m_indices, out,
                                                    rows_per_group=bound)
        h = self._gemm(pool.x[:num_rows], pool.x_sf[:num_rows], self._w13, self._w13_scale, m_indices,
                       None if scratch is None else scratch.h[:num_rows])
        act, act_sf = self._swiglu_quant(h, m_indices, sf_mn_major=True,
                                         q_out=None if scratch is None else scratch.act[:num_rows])
        return self._gemm(act, act_sf, self._w_down, self._w_down_scale, m_indices, out)


def make_engine(engine: str, weights: ExpertWeights) -> ExpertEngine:
    """The `ExpertEngine` named by ``engine`` (one of `ENGINES`) for these weights.

    Raises:
        ConfigError: an unknown name, or one that does not fit the weights (``"torch"`` needs bf16 experts,
            ``"builtin"``/``"deepgemm"`` fp8 ones).
        BackendError: the engine cannot run here (the message says what is missing).
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r}: expected one of {list(ENGINES)}")
    if engine == "auto":
        if weights.dtype == "bf16":
            engine = "torch"
        else:
            from . import deepgemm
            ok, reason = deepgemm.deepgemm_status()
            engine = "deepgemm" if ok else "builtin"
            if not ok:
                logger.info("engine='auto': DeepGEMM not usable (%s); using the built-in fp8 kernels", reason)
    if engine == "torch":
        return TorchBf16Experts(weights)
    return Fp8Experts(weights, engine)
