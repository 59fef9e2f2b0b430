"""The fp8 engines, ``"builtin"`` and ``"deepgemm"``: block-scaled fp8 grouped GEMMs over the contiguous
layout (the Triton kernels of `symmring.moe.engines.triton_large`, or DeepGEMM's), SwiGLU fused with the
fp8 quantisation of its output, and `symmring.moe.engines.triton_small`'s swap-AB kernels for tiny groups."""

from __future__ import annotations

from typing import Optional

from ...errors import BackendError, ConfigError
from ..weights import ExpertWeights
from .seam import ExpertEngine, Pool, Scratch

#: Row alignment of every expert group in an fp8 pool (DeepGEMM's and the Triton kernel's M block).
FP8_ALIGN_M = 128
#: `Fp8Experts`' default threshold: at most this many rows per expert take the small-group kernels (their
#: largest row tile; above it a 64-row tile of the large-group GEMM wastes little).
SMALL_ROWS = 64


class Fp8Experts(ExpertEngine):
    """fp8 experts: block-scaled fp8 grouped GEMMs over the contiguous layout, SwiGLU fused with the fp8
    quantisation of its output (see the module docstring).

    Small groups (decode): when the host bound ``rows_per_expert`` of `forward` is at most ``small_rows``,
    both GEMMs run as `symmring.moe.engines.triton_small`'s swap-AB kernels (the weights on the MMA's M side, the few
    rows on its N side, L1 fused with SwiGLU and the quantisation), whatever ``gemm`` is: DeepGEMM's
    small-batch kernel wants the masked layout (rows of each expert in a ``[G, max_rows, K]`` block), not
    the contiguous pool the layer's dispatch writes, and its contiguous kernel computes 128-row blocks.

    Args:
        weights: fp8 `ExpertWeights` (128x128 block scales).
        gemm: ``"builtin"`` (Triton, `symmring.moe.engines.triton_large`) or ``"deepgemm"``: the GEMM of larger groups.
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
        from . import triton_large
        self.name = gemm
        self.small_rows = small_rows
        self.weights = weights
        self._swiglu_quant = triton_large.swiglu_quant_fp8  # L2's scales MN-major: DeepGEMM reads them as they are
        if gemm == "deepgemm":
            from . import deepgemm
            ok, reason = deepgemm.deepgemm_status()
            if not ok:
                raise BackendError(f"engine='deepgemm': {reason}")
            self._gemm = deepgemm.grouped_gemm_fp8
        elif gemm == "builtin":
            self._gemm = triton_large.grouped_gemm_fp8
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
        # The Triton GEMMs skip tiles naming no local expert and report them in pool.bad_groups; DeepGEMM's
        # cannot (the layer's dispatch leaves no such id in the rows it hands over).
        check = dict(bad_groups=pool.bad_groups)
        if rows_per_expert is not None and rows_per_expert <= self.small_rows:
            from . import triton_small
            bound = min(rows_per_expert, num_rows)
            # Its activations come from torch, not `scratch`: the fused L1 writes them while other programs
            # still read the pool, which the workspace's activations may share bytes with (expert_arena).
            act, act_sf = triton_small.grouped_gemm_swiglu_quant_fp8_small(
                pool.x[:num_rows], pool.x_sf[:num_rows], self._w13, self._w13_scale, m_indices, rows_per_group=bound,
                **check)
            return triton_small.grouped_gemm_fp8_small(act, act_sf, self._w_down, self._w_down_scale, m_indices, out,
                                                    rows_per_group=bound, **check)
        if self.name == "deepgemm":
            check = {}
        h = self._gemm(pool.x[:num_rows], pool.x_sf[:num_rows], self._w13, self._w13_scale, m_indices,
                       None if scratch is None else scratch.h[:num_rows], **check)
        act, act_sf = self._swiglu_quant(h, m_indices, sf_mn_major=True,
                                         q_out=None if scratch is None else scratch.act[:num_rows])
        return self._gemm(act, act_sf, self._w_down, self._w_down_scale, m_indices, out, **check)
