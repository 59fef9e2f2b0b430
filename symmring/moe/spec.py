"""What a layer runs with: its arguments checked and resolved once, at construction, into a frozen `LayerSpec`
that every rank agrees on.

Both layers (`symmring.moe.gpu.GpuMoE`, `symmring.moe.cpu.layer.ExpertParallelMoE`) take the same values
(`symmring.moe.config`: `Experts`, `RoutingConfig`, `ScheduleConfig`) and build their spec the same way:

1. `check_values` and `check_sizes` (the checks both layers share, so they raise the same `ConfigError` for the
   same mistake), then each layer's own (the GPU layer's kernels' limits, the CPU layer's refusal of GPU-only
   options);
2. the defaults filled in (the ring's shape, the timeout): a `LayerSpec`, frozen;
3. `agree`: ONE bounded exchange of every rank's spec, or of its error where its arguments failed, so every
   rank raises the same `ConfigError` (naming the rank and the field) before any symmetric memory is allocated.

What follows reads the spec, never the layer: the planner (`symmring.moe.gpu.plan.Planner`), the streaming
policy (`symmring.moe.gpu.policy.StreamPolicy.streams`), the executor (`symmring.moe.gpu.executor`).

Example:
    >>> from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig
    >>> import numpy as np
    >>> w = np.zeros((2, 32, 128), np.float32)
    >>> check_sizes(Experts(w, w, np.zeros((2, 128, 32), np.float32)), RoutingConfig(8, 2), ScheduleConfig(),
    ...             max_tokens=64, world_size=4)
    64
    >>> check_sizes(Experts(w, w, np.zeros((2, 128, 32), np.float32)), RoutingConfig(6, 2), ScheduleConfig(),
    ...             max_tokens=64, world_size=4)
    Traceback (most recent call last):
    ...
    symmring.errors.ConfigError: num_experts=6: expected a multiple of world_size=4 (experts are split evenly)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from .. import agreement
from ..errors import ConfigError
from ..protocol import AckPolicy
from .config import Experts, RoutingConfig, ScheduleConfig, check_int


def check_values(experts, routing, schedule):
    """``(experts, routing, schedule)`` checked to be the config values (each validated itself when made);
    ``schedule=None`` is ``ScheduleConfig()``.

    Raises:
        ConfigError: naming the argument that is not its value class.
    """
    schedule = ScheduleConfig() if schedule is None else schedule
    for name, value, cls in (("experts", experts, Experts), ("routing", routing, RoutingConfig),
                             ("schedule", schedule, ScheduleConfig)):
        if not isinstance(value, cls):
            raise ConfigError(f"{name}={value!r}: expected a symmring.moe.config.{cls.__name__}")
    return experts, routing, schedule


def check_sizes(experts: Experts, routing: RoutingConfig, schedule: ScheduleConfig, *, max_tokens,
                world_size: int) -> int:
    """The checks of sizes both layers make (the same messages on both): ``max_tokens``, ``hidden`` and
    ``inter`` (``w_gate``'s shape) ints >= 1, ``num_experts`` a multiple of the ranks, ``w_gate``'s experts
    this rank's share, ``schedule.tokens_per_slot`` at most ``max_tokens``. Returns ``max_tokens``.

    Raises:
        ConfigError: the first that fails, named.
    """
    max_tokens = check_int("max_tokens", max_tokens)
    check_int("hidden (w_gate.shape[2])", experts.hidden)
    check_int("inter (w_gate.shape[1])", experts.inter)
    if routing.num_experts % world_size:
        raise ConfigError(f"num_experts={routing.num_experts}: expected a multiple of world_size={world_size} "
                          "(experts are split evenly)")
    local = routing.num_experts // world_size
    if experts.num_local_experts != local:
        raise ConfigError(f"w_gate.shape[0]={experts.num_local_experts}: expected {local} local experts "
                          f"(num_experts={routing.num_experts} over {world_size} ranks)")
    if schedule.tokens_per_slot is not None and schedule.tokens_per_slot > max_tokens:
        raise ConfigError(f"schedule.tokens_per_slot={schedule.tokens_per_slot}: expected at most "
                          f"max_tokens={max_tokens}")
    return max_tokens


def timeout_of(schedule: ScheduleConfig, ctx) -> float:
    """The bound of every wait of the layer: ``schedule.timeout_s``, else the context's."""
    return float(ctx.timeout_s if schedule.timeout_s is None else schedule.timeout_s)


#: Field metadata of a `LayerSpec` field every rank need not share (its rank, what it keeps for itself).
LOCAL = {"agreed": False}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """A layer's resolved configuration: every size and option it runs with, defaults filled in, the same on
    every rank but ``rank`` (`agree` checks it).

    Attributes:
        rank, world_size: this rank and the ranks.
        num_experts, topk, hidden, inter: the layer's sizes (``hidden``, ``inter``: ``w_gate``'s shape).
        max_tokens: most tokens per rank per call.
        num_slots, tokens_per_slot: the ring of streamed calls.
        ack_policy: when consumers acknowledge a chunk (`symmring.AckPolicy`).
        x_format: what the ring carries (``"fp8_e4m3"`` or ``"bf16"``).
        timeout_s: the bound of every wait.
        routing: the routing options as plain values (`RoutingConfig.key`).
        layer_id: the layer's id on its workspace (its calls' identities; construction order).
    """

    rank: int = dataclasses.field(metadata=LOCAL)
    world_size: int
    num_experts: int
    topk: int
    hidden: int
    inter: int
    max_tokens: int
    num_slots: int
    tokens_per_slot: int
    ack_policy: AckPolicy
    x_format: str
    timeout_s: float
    routing: tuple
    layer_id: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def expert_begin(self) -> int:
        """This rank's first expert (rank ``r`` owns ``[r E/R, (r+1) E/R)``)."""
        return self.rank * self.num_local_experts

    def agreed(self) -> Dict[str, Any]:
        """The fields every rank must share, by name (enums by name, so they compare across processes)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("agreed", True):
                value = getattr(self, f.name)
                out[f.name] = value.name if isinstance(value, AckPolicy) else value
        return out


def agree(collectives, rank: int, spec: Optional[LayerSpec], error: Optional[BaseException], *, what: str) -> None:
    """Collective, ONE bounded exchange (under the context's host bound, not the device waits'): every rank's spec (its `LayerSpec.agreed` fields), or the message of the
    error its arguments raised. Every rank gets the same list, so every rank raises, or none does: this rank's
    own error where it had one, a `ConfigError` naming the ranks that refused elsewhere
    (`symmring.agreement.rejection`), else one naming the first rank and field that differ from rank 0's
    (`symmring.agreement.check_same`).

    Raises:
        ConfigError: as above (``error`` itself on this rank when given).
        PeerTimeout: a rank did not reach the exchange within the bound.
    """
    mine = (None if error is None else str(error), None if spec is None else spec.agreed())
    entries = collectives.allgather(mine, what=f"{what}: agreement")
    rejected = agreement.rejection([e[0] for e in entries], rank, what)
    if rejected is not None:
        raise error if error is not None else rejected
    agreement.check_same([e[1] for e in entries], what=what)


__all__ = ["LayerSpec", "LOCAL", "agree", "check_sizes", "check_values", "timeout_of"]
