"""The GPU layer's resolved configuration: `GpuSpec`, made once by `resolve` and agreed by every rank
(`symmring.moe.spec.agree`), before any symmetric memory is allocated.

What the GPU layer adds to `symmring.moe.spec.LayerSpec`: the schedule's options (expert window, the batch
schedule's window, the small-batch threshold, one stream or two), what its engine runs (the experts' dtype, the
pool's format and row alignment) and the transport request. The ring's shape defaults from the workspace's
plan for this layer (`symmring.Workspace.preview`: what attaching it would make), so a spec is whole before
the layer attaches.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ... import protocol
from ... import transport as transport_mod
from ...errors import ConfigError
from ..config import Experts, RoutingConfig, ScheduleConfig
from ..spec import LOCAL, LayerSpec, timeout_of
from .stages import MAX_TOPK, THREADS_PER_BLOCK

#: fp8 scale group the fused layout kernel implements.
FP8_GROUP_SIZE = 128


@dataclasses.dataclass(frozen=True)
class GpuSpec(LayerSpec):
    """`LayerSpec` and the GPU layer's own fields (module docstring).

    Attributes:
        expert_window: chunks per expert window of the streamed schedule (``1 <= W <= num_slots``).
        batch_window: chunks per expert window of the batch schedule (the workspace's window).
        small_batch_tokens: batch calls of one chunk with at most this many tokens per rank run the small-batch
            schedule (where `small_batch_capable`).
        small_batch_capable: fp8 dispatch, fp8 experts and few enough ranks for the small-batch schedule.
        expert_dtype, pool_format: what the experts run (``"bf16"``/``"fp8"``) and the rows dispatch writes.
        transport_request: the transport request and where it came from (`symmring.transport.request`, as a
            string): whether a ring of the workspace is shared depends on it too (`DeviceMemory` keys).
        transport: ``schedule.transport`` as given (what the workspace's rings are bound with; None: the
            ``SYMMRING_TRANSPORT`` variable, else ``"auto"``).
        align: every expert group starts at a multiple of this many pool rows (the engine's).
        engine: the engine's name.
        single_stream: the streamed schedule on the caller's stream.
        graph_cache: graphs kept for eager calls (``SYMMRING_GRAPH_CACHE`` applied).

    The last five are this rank's own (a rank may replay, or run another engine of the same format; the transport
    is agreed through ``transport_request``).
    """

    expert_window: int
    batch_window: int
    small_batch_tokens: int
    small_batch_capable: bool
    expert_dtype: str
    pool_format: str
    transport_request: str
    transport: Optional[str] = dataclasses.field(metadata=LOCAL)
    align: int = dataclasses.field(metadata=LOCAL)
    engine: str = dataclasses.field(metadata=LOCAL)
    single_stream: bool = dataclasses.field(metadata=LOCAL)
    graph_cache: int = dataclasses.field(metadata=LOCAL)

    @property
    def max_chunks(self) -> int:
        """Chunks of the largest call (``max_tokens`` through the ring's slots)."""
        return protocol.num_chunks_for(self.max_tokens, self.tokens_per_slot)


def check_gpu_sizes(experts: Experts, routing: RoutingConfig, schedule: ScheduleConfig, world_size: int) -> str:
    """The GPU kernels' limits on the layer's sizes (before any weight is copied): ``topk`` at most
    `MAX_TOPK`, ``hidden`` a multiple of 128 for fp8 dispatch (8 for bf16), ``inter`` a multiple of 8, the
    transport request. Returns the dispatch format (``schedule.x_format``, default ``"fp8_e4m3"``).

    Raises:
        ConfigError: the first that fails, named.
    """
    x_format = schedule.x_format or "fp8_e4m3"
    num_experts, topk = routing.num_experts, routing.topk
    if topk > min(MAX_TOPK, num_experts):
        raise ConfigError(f"topk={topk}: expected at most min({MAX_TOPK}, num_experts={num_experts})")
    multiple = FP8_GROUP_SIZE if x_format == "fp8_e4m3" else 8
    if experts.hidden % multiple:
        raise ConfigError(f"hidden={experts.hidden} (w_gate.shape[2]): expected a multiple of {multiple} for "
                          f"x_format={x_format!r}")
    if experts.inter % 8:
        raise ConfigError(f"inter={experts.inter} (w_gate.shape[1]): expected a multiple of 8 (16-byte rows for the "
                          "grouped GEMM)")
    transport_mod.request(schedule.transport, world_size)
    return x_format


def resolve(ctx, experts: Experts, routing: RoutingConfig, schedule: ScheduleConfig, *, max_tokens: int, engine,
            workspace_plan, layer_id: int, graph_cache: int) -> GpuSpec:
    """The spec of a layer with these (checked) values, its built ``engine`` (an `ExpertEngine`) and the plan
    its workspace would have with it attached (``workspace_plan``: the chunk and window of its budget).

    The ring: neither ``num_slots`` nor ``tokens_per_slot`` given, the workspace's chunk (at most
    ``max_tokens``) and enough slots for a batch call of ``max_tokens``; only ``tokens_per_slot``, one slot;
    only ``num_slots``, slots of ``max_tokens``.

    Raises:
        ConfigError: fp8 experts with bf16 dispatch, an ``expert_window`` past the ring's slots.
    """
    x_format = schedule.x_format or "fp8_e4m3"
    weights = engine.weights
    if weights.dtype == "fp8" and x_format != "fp8_e4m3":
        raise ConfigError(f"x_format={x_format!r}: fp8 experts read the fp8 dispatch rows as they are; "
                          "expected x_format='fp8_e4m3' (or expert_dtype='bf16')")
    num_slots, tokens_per_slot = schedule.num_slots, schedule.tokens_per_slot
    if num_slots is None and tokens_per_slot is None:
        # The workspace's chunk (its windows are whole chunks), and a ring a batch call of max_tokens fits.
        tokens_per_slot = min(workspace_plan.tokens_per_slot, max_tokens)
        num_slots = protocol.num_chunks_for(max_tokens, tokens_per_slot)
    num_slots = 1 if num_slots is None else num_slots
    tokens_per_slot = max_tokens if tokens_per_slot is None else tokens_per_slot
    protocol.check_expert_window(schedule.expert_window, num_slots)
    world = ctx.world_size
    return GpuSpec(
        rank=ctx.rank, world_size=world, num_experts=routing.num_experts, topk=routing.topk, hidden=experts.hidden,
        inter=experts.inter, max_tokens=max_tokens, num_slots=num_slots, tokens_per_slot=tokens_per_slot,
        ack_policy=schedule.ack_policy, x_format=x_format, timeout_s=timeout_of(schedule, ctx),
        routing=routing.key(), layer_id=layer_id, expert_window=schedule.expert_window,
        batch_window=max(1, workspace_plan.window_tokens // tokens_per_slot),
        small_batch_tokens=schedule.small_batch_tokens,
        # The small-batch schedule's fused dispatch waits for source r on thread r of every block.
        small_batch_capable=x_format == "fp8_e4m3" and engine.pool_format == "fp8" and world <= THREADS_PER_BLOCK,
        expert_dtype=weights.dtype, pool_format=engine.pool_format,
        transport_request=str(transport_mod.request(schedule.transport, world)), transport=schedule.transport,
        align=engine.align_m, engine=engine.name, single_stream=schedule.single_stream, graph_cache=graph_cache)


__all__ = ["GpuSpec", "check_gpu_sizes", "resolve", "FP8_GROUP_SIZE"]
