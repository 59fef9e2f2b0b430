"""What both MoE layers share (`symmring.moe.layer.MoE` builds one of them): their base class `LayerBase`, the
workspace a layer borrows, and the spec fields a layer reads as its own. Below both implementations
(`symmring.moe.cpu.layer`, `symmring.moe.gpu.layer`), so that `symmring.moe.layer`, which picks one, sits above
them: no import cycle."""

from __future__ import annotations

import operator
from typing import Iterable

from ..closing import Closing
from ..errors import ConfigError


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


class LayerBase(Closing):
    """The base class of both implementations of `symmring.moe.layer.MoE` (``isinstance(layer, symmring.MoE)``
    holds for both): it refuses the former positional form (``ExpertParallelMoE(ctx, MoEShapes(...), w_gate,
    ...)``) with the new one named."""

    def __new__(cls, ctx=None, *args, **kwargs):
        if len(args) > 2:  # ctx, experts, routing; everything else by keyword
            raise ConfigError(f"{cls.__name__}: {len(args) + 1} positional arguments: expected (ctx, experts, routing, "
                              "*, max_tokens, schedule=None, engine='auto', workspace=None), the values of "
                              "symmring.moe.config (the former ExpertParallelMoE(ctx, MoEShapes(...), w_gate, w_up, "
                              "w_down, ...) is MoE(ctx, Experts(w_gate, w_up, w_down), RoutingConfig(num_experts, "
                              "topk), max_tokens=..., schedule=ScheduleConfig(x_format=...)))")
        return super().__new__(cls)


spec_views(LayerBase, COMMON_VIEWS)

__all__ = ["LayerBase", "borrow_workspace", "spec_views", "COMMON_VIEWS"]
