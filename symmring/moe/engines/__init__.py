"""The experts step of the GPU MoE layer behind one seam (`symmring.moe.engines.seam`: pool rows in, output
rows out), and the engines that implement it:

* ``"torch"``: `symmring.moe.engines.torch_bf16` (bf16 experts on ``torch._grouped_mm``);
* ``"builtin"`` and ``"deepgemm"``: `symmring.moe.engines.fp8` (block-scaled fp8 GEMMs: the project's Triton
  kernels, `triton_large` for large groups and `triton_small` for tiny ones, sharing `triton_common`, their
  configurations chosen by `triton_heuristics`; or DeepGEMM's, `symmring.moe.engines.deepgemm`);
* ``"fused"``: `symmring.moe.engines.fused` (fp8: L1, SwiGLU + quantisation and L2 in one persistent kernel of
  the project's own device code, on an SM budget; docs/FUSED.md);
* ``"auto"``: ``"torch"`` for bf16 experts; for fp8, DeepGEMM where it loads, else the built-in kernels.

`make_engine` picks one (the layer's ``engine=`` argument); `capture_scope` wraps the capture of a CUDA graph
that runs one.
"""

from __future__ import annotations

import logging

from ...errors import ConfigError
from ..weights import ExpertWeights
from .seam import CombineRows, ExpertEngine, Pool, Scratch

logger = logging.getLogger(__name__)

__all__ = ["ENGINES", "CombineRows", "ExpertEngine", "Pool", "Scratch", "capture_scope", "make_engine"]

#: Values of the layer's ``engine`` argument.
ENGINES = ("auto", "deepgemm", "builtin", "torch", "fused")


def capture_scope():
    """A context manager around the capture of a CUDA graph whose work includes an engine's: it yields what the
    engines' captured launches hold for the graph's life (`triton_small.capture_counters`: the split-K
    counters' slices), which is given back when that object is dropped. Keep it exactly as long as the graph.

    Example:
        >>> with capture_scope() as held, torch.cuda.graph(graph):  # doctest: +SKIP
        ...     y = engine.forward(pool, rows)
    """
    from . import triton_small  # no Triton import: the kernels load on first launch
    return triton_small.capture_counters()


def make_engine(engine: str, weights: ExpertWeights) -> ExpertEngine:
    """The `ExpertEngine` named by ``engine`` (one of `ENGINES`) for these weights.

    Raises:
        ConfigError: an unknown name, or one that does not fit the weights (``"torch"`` needs bf16 experts,
            ``"builtin"``/``"deepgemm"``/``"fused"`` fp8 ones; ``"fused"`` also hidden and inter multiples of
            128 and contiguous weights).
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
        from .torch_bf16 import TorchBf16Experts
        return TorchBf16Experts(weights)
    if engine == "fused":
        from .fused import FusedExperts
        return FusedExperts(weights)
    from .fp8 import Fp8Experts
    return Fp8Experts(weights, engine)
