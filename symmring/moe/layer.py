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

import operator
from typing import Iterable

from ..closing import Closing
from ..errors import BackendError, ConfigError
from .config import Experts, RoutingConfig, ScheduleConfig  # noqa: F401  (the values the layer takes)


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


def borrow_workspace(ctx, workspace):
    """The `symmring.Workspace` a layer borrows: ``workspace`` (one of ``ctx``), else the context's own
    (``ctx.workspace(collective=True)``: collective, as the layers' constructors are).

    Raises:
        ConfigError: ``workspace`` is not a `symmring.Workspace` of ``ctx``.
    """
    from .workspace import Workspace
    if workspace is not None and (not isinstance(workspace, Workspace) or workspace.ctx is not ctx):
        raise ConfigError(f"workspace={workspace!r}: expected a symmring.Workspace of this context")
    return workspace if workspace is not None else ctx.workspace(collective=True)


def spec_views(cls, names: Iterable[str]):
    """Read the spec's fields ``names`` as attributes of the layer class ``cls`` (``layer.hidden`` is
    ``layer.spec.hidden``: read-only, as the spec is frozen). Returns ``cls``."""
    for name in names:
        setattr(cls, name, property(operator.attrgetter(f"spec.{name}"), doc=f"``spec.{name}``"))
    return cls


#: The `symmring.moe.spec.LayerSpec` fields every layer reads as its own (not ``routing``: the layer's
#: ``routing`` is the `RoutingConfig` it runs).
COMMON_VIEWS = ("rank", "world_size", "num_experts", "topk", "hidden", "inter", "max_tokens", "num_slots",
                "tokens_per_slot", "ack_policy", "x_format", "timeout_s", "layer_id", "num_local_experts",
                "expert_begin")


class MoE(Closing):
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

    def __new__(cls, ctx=None, *args, **kwargs):
        if len(args) > 2:  # ctx, experts, routing; everything else by keyword
            raise ConfigError(f"{cls.__name__}: {len(args) + 1} positional arguments: expected (ctx, experts, routing, "
                              "*, max_tokens, schedule=None, engine='auto', workspace=None), the values of "
                              "symmring.moe.config (the former ExpertParallelMoE(ctx, MoEShapes(...), w_gate, w_up, "
                              "w_down, ...) is MoE(ctx, Experts(w_gate, w_up, w_down), RoutingConfig(num_experts, "
                              "topk), max_tokens=..., schedule=ScheduleConfig(x_format=...)))")
        if cls is MoE:
            cls = implementation(ctx)
        return super().__new__(cls)


spec_views(MoE, COMMON_VIEWS)

__all__ = ["MoE", "implementation", "borrow_workspace", "spec_views"]
