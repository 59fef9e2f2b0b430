"""The one MoE layer: ``symmring.MoE(ctx, experts, routing, *, max_tokens, schedule=None, engine="auto",
workspace=None)``, on any backend.

The context's backend picks the implementation, a subclass of `MoE`: `symmring.moe.gpu.GpuMoE` on the nvshmem
backend (torch tensors on this rank's GPU), `symmring.moe.cpu.layer.ExpertParallelMoE` on the host backend
(torch CPU tensors or NumPy arrays; MPI shared memory). Both take the same values (`symmring.moe.config`:
`Experts`, `RoutingConfig`, `ScheduleConfig`), make and agree their spec the same way (`symmring.moe.spec`), so
the same mistake is the same `ConfigError` on both (a flat keyword such as ``x_format=`` names the value it
belongs to: `symmring.moe.config.misplaced`), and run the same call::

    y = layer.forward(x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None, streaming=False)

collective, with exactly one routing source; ``streaming``: False (batch-ready), True (chunks through the
ring) or ``"auto"``. Options one implementation has and the other has not are named where refused (the CPU
layer refuses the GPU-only fields of `ScheduleConfig` and `Experts`). Test hooks live apart, on
``layer.debug`` (`symmring.moe.debug`).

Example:
    >>> import numpy as np, symmring
    >>> ctx = symmring.init("host")
    >>> rng = np.random.default_rng(0)
    >>> wg, wu = (rng.standard_normal((4, 32, 128), dtype=np.float32) / 11 for _ in range(2))
    >>> wd = rng.standard_normal((4, 128, 32), dtype=np.float32) / 6
    >>> layer = MoE(ctx, Experts(wg, wu, wd), RoutingConfig(num_experts=4, topk=2), max_tokens=16)
    >>> type(layer).__name__, isinstance(layer, MoE)
    ('ExpertParallelMoE', True)
    >>> y = layer.forward(rng.standard_normal((10, 128), dtype=np.float32),
    ...                   router_weight=rng.standard_normal((4, 128), dtype=np.float32))
    >>> y.shape
    (10, 128)
    >>> MoE(ctx, Experts(wg, wu, wd), RoutingConfig(4, 2), max_tokens=16, x_format="bf16")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    symmring.errors.ConfigError: MoE: unexpected keyword argument(s): x_format (a field of ScheduleConfig: ...)
    >>> layer.close(); ctx.close()
"""

from __future__ import annotations

from ..errors import BackendError
from .config import Experts, RoutingConfig, ScheduleConfig  # noqa: F401  (the values the layer takes)
from .layer_base import LayerBase


def implementation(ctx) -> type:
    """The `MoE` subclass of ``ctx``'s backend: `symmring.moe.cpu.layer.ExpertParallelMoE` on ``host``,
    `symmring.moe.gpu.GpuMoE` on a device backend.

    Raises:
        BackendError: ``ctx`` is not a context, or its backend has no MoE layer.
    """
    backend = getattr(ctx, "backend", None)
    if getattr(backend, "name", None) == "host":
        from .cpu.layer import ExpertParallelMoE
        return ExpertParallelMoE
    from ..backends.base import DeviceBackend
    if isinstance(backend, DeviceBackend):
        from .gpu.layer import GpuMoE
        return GpuMoE
    raise BackendError(f"ctx: expected a symmring context (symmring.init()) on the host or a device backend, got "
                       f"{getattr(backend, 'name', ctx)!r}")


class _PickedByBackend(type):
    """``MoE(ctx, ...)`` builds the implementation of ``ctx``'s backend (`implementation`), and every instance of
    either implementation is an instance of `MoE` (both derive from `symmring.moe.layer_base.LayerBase`)."""

    def __call__(cls, ctx=None, *args, **kwargs):
        return implementation(ctx)(ctx, *args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, LayerBase)

    def __subclasscheck__(cls, sub) -> bool:
        return isinstance(sub, type) and issubclass(sub, LayerBase)


class MoE(metaclass=_PickedByBackend):
    """The expert-parallel MoE layer of ``ctx``'s backend (see the module docstring): ``MoE(ctx, ...)`` builds
    that implementation (an instance of this class).

    Args:
        ctx: a `symmring.Context` (collective constructor: every rank builds its layer, in the same order).
        experts: this rank's experts, a `symmring.moe.config.Experts` (rank ``r`` owns experts
            ``[r E/R, (r+1) E/R)``).
        routing: a `symmring.moe.config.RoutingConfig` (``num_experts`` a multiple of the ranks).
        max_tokens: most tokens per rank per call.
        schedule: a `symmring.moe.config.ScheduleConfig` (default ``ScheduleConfig()``).
        engine: the GPU layer's expert engine (``"auto"`` on the CPU layer, which has one).
        workspace: the `symmring.Workspace` the layer borrows (default: the context's own, ``ctx.workspace()``).

    Raises:
        ConfigError: a bad argument (named) on every rank, before any symmetric memory is allocated.
        BackendError: the context's backend has no layer, or the implementation's dependency is missing.
    """


__all__ = ["MoE", "implementation"]
