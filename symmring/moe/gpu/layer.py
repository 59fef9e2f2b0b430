"""The expert-parallel MoE layer on GPUs: one layer, batch-ready by default, streamed through the ring on request.

Every rank (PE) owns ``num_experts / world_size`` consecutive experts and its own tokens. One
`MoE.forward` is one call of the ring protocol (`symmring.protocol`), enqueued on the current torch
stream with no host synchronisation. Its chunks move through a ring of ``num_slots`` slots of
``tokens_per_slot`` tokens (by default one slot of ``max_tokens``):

* ``streaming=False`` (the default and the fallback): the batch-ready path. Every chunk of the call is
  produced (router, TopK, route and layout published), then one expert window over the whole call is
  consumed; with the default ring that is one chunk holding the batch.
* ``streaming=True``: the chunked schedule. The producer of chunk ``c + 1`` overlaps the consumer of
  chunk ``c`` (a producer and a consumer stream), the consumer takes expert windows of ``expert_window``
  chunks (1 = chunk-local pools; W > 1 reserves pool rows across the window's chunks, counted from route
  readiness alone, and runs one grouped GEMM per window).
* small batches (decode): a batch call of one chunk with at most ``small_batch_tokens`` tokens on every
  rank (fp8 dispatch and fp8 experts) runs the small-batch schedule: the same stages in three fused
  kernels around the experts (`symmring.moe.gpu.stages.small_batch_call`), bitwise the same output;
  ``forward(small_batch=True/False)`` forces either.
* token counts on the device: every rank plans a call for the same token **bucket**
  (`symmring.moe.gpu.plan.token_bucket` of the largest count: powers of two up to 256, then multiples of 256),
  and its exact count goes into a device word the producers and the reduce read (and the slots' metadata
  carry to the consumers). The bucket comes from one bounded host exchange per call, or per model step
  inside `symmring.Workspace.step` (one exchange for every layer of the step, as vLLM exchanges its
  data-parallel counts once per step); a graph captured over a step serves any counts up to its bucket
  (`symmring.Workspace.set_call_tokens` before each replay).
* eager calls of a bucket seen before replay a CUDA graph of that call (`symmring.moe.gpu.graph_cache`: at
  most ``graph_cache`` graphs per layer, one per bucket, calls of at most 256 tokens per rank), so an eager
  decode call costs about what a replay costs; bitwise the same output.
* ``streaming="auto"``: what the measured policy (`symmring.moe.gpu.policy.StreamPolicy`) says for this
  layer's shape, ring and the largest token count of any rank (exchanged, or declared to the step, so
  every rank runs the same schedule); batch where it has no measurement that beat batch.

Stages of a call (`symmring.moe.gpu.stages`, kernels in ``device/moe/``): **produce** (router GEMM and TopK in
torch, `symmring.moe.routing`; ``moe_produce_route`` acquires the slot and publishes route readiness;
``moe_produce_layout_fp8`` quantises ``x`` to fp8 e4m3 with per-128-channel scales, bitwise
`symmring.moe.quant`, or ``_bf16`` copies it, and publishes layout readiness); **dispatch** (wait for both
generations of every source, count and scan the local experts' rows, pull every routed row over NVLink
into the expert pool: dequantised to bf16 for bf16 experts, as fp8 rows with their scales for fp8
experts); **experts** (the `symmring.moe.engines.ExpertEngine` seam: L1,
SwiGLU, L2); **combine** (rows back to their owners at the logical token row, a signal per owner, then a
fixed-order weighted reduce into ``y``). The plan of each distinct call (`symmring.moe.gpu.plan`) is built
once and reused.

Memory: the layer borrows a `symmring.Workspace` (``ctx.workspace()`` unless ``workspace=``): rings, combine
rows, expert pool, output rows, shared by every layer of the process. The pool holds one window under
uniform routing (and any routing of a 128-token call); a window with more rows runs in passes over it
(docs/PROTOCOL.md 9.1c), so no routing can overflow it; ``max_tokens`` (tokens per rank per call) is fixed at
construction and a larger batch is a ConfigError before anything is enqueued.

Errors: a device wait that times out (``SYMMRING_TIMEOUT_S``) writes the ring's error record and every
later kernel returns at once; `MoE.check_errors` (which synchronises) raises the `ProtocolTimeout`. Without
a synchronisation (docs/PROTOCOL.md 10.2): the call's output is NaN, `MoE.async_error` returns the error
latched in host memory, and the next `forward` outside a step, or the next `symmring.Workspace.step`, raises it
on every rank before enqueuing anything; `CapturedCall.replay` raises this rank's. Every call carries its
identity (call number and layer id, docs/PROTOCOL.md 3.2): in its exchange outside a step, in every meta row
inside one, so ranks whose call sequences diverged raise `CallMismatch` instead of pairing calls; a call refused
on one rank inside a step records ``peer_refused`` on its ring (`_refuse`). With ``SYMMRING_DEBUG=1`` every
forward checks. After any device error, `MoE.reset` (collective: `symmring.Workspace.reset`) makes every layer
of the workspace usable again.

Example:
    >>> ctx = symmring.init("nvshmem")  # doctest: +SKIP
    >>> moe = MoE(ctx, Experts(wg, wu, wd), RoutingConfig(num_experts=8, topk=2), max_tokens=4096,  # doctest: +SKIP
    ...           schedule=ScheduleConfig(num_slots=4, tokens_per_slot=1024))  # wg: [4, 512, 1024] per rank of 2
    >>> y = moe.forward(x, router_weight=router)                  # batch-ready (x: [n, 1024] bf16)  # doctest: +SKIP
    >>> y = moe.forward(x, router_weight=router, streaming=True)  # the same call, 1024-token chunks  # doctest: +SKIP
    >>> moe.check_errors(); moe.close()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import numpy as np

from ... import agreement, env, protocol
from ... import transport as transport_mod
from ...backends.base import DeviceBackend
from ...closing import Closing
from ...errors import BackendError, BrokenStateError, ConfigError, RingClosedError
from .. import routing as routing_mod
from ..config import Experts, RoutingConfig, ScheduleConfig, check_int, misplaced
from ..workspace_plan import spanned_rows
from . import graph_cache as graph_cache_mod
from . import plan as plans
from . import stages, timeline
from .memory import view

logger = logging.getLogger(__name__)

#: fp8 scale group the fused layout kernel implements.
FP8_GROUP_SIZE = 128
#: Stage names of `MoE.forward(stage_events=...)`, in order (batch path).
STAGES = ("route", "layout", "dispatch", "experts", "combine")
#: Values of ``forward(streaming=...)``.
STREAMING_MODES = (False, True, "auto")
#: Plans kept per layer (one per distinct (token counts, schedule); a serving loop sees few).
MAX_CACHED_PLANS = 64


def _torch():
    try:
        import torch
    except ImportError:  # one line naming the extra, not a traceback into the layer
        from ... import deps
        raise BackendError(f"symmring.moe.gpu.MoE needs torch: {deps.hint('torch')}") from None
    return torch


def _cupy():
    import cupy
    return cupy


def _rows_like(t, rows: int):
    """An uninitialised tensor like ``t`` with ``rows`` rows (a cached graph's static input for its bucket)."""
    return _torch().empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)


def _check_values(experts, routing, schedule):
    """``(experts, routing, schedule)`` checked to be the config values (`symmring.moe.config`; each validated
    itself when made); ``schedule=None`` is ``ScheduleConfig()``."""
    schedule = ScheduleConfig() if schedule is None else schedule
    for name, value, cls in (("experts", experts, Experts), ("routing", routing, RoutingConfig),
                             ("schedule", schedule, ScheduleConfig)):
        if not isinstance(value, cls):
            raise ConfigError(f"{name}={value!r}: expected a symmring.moe.config.{cls.__name__}")
    return experts, routing, schedule


def _skipped_groups(state, rank: int, num_local_experts: int) -> Optional[BackendError]:
    """The error of what the fp8 GEMMs reported in ``state.bad_groups`` (tiles skipped for a group id outside
    ``[-1, E)``), the report then cleared; None when nothing was skipped (after a synchronisation)."""
    if state.bad_groups is None:
        return None
    tiles, value = (int(v) for v in state.bad_groups.tolist())
    if not tiles:
        return None
    state.bad_groups.zero_()
    return BackendError(f"rank {rank}: the expert GEMMs skipped {tiles} tile(s) of pool rows naming group {value}, "
                        f"outside [-1, {num_local_experts}) (stale or corrupt group ids); those rows were not "
                        "computed and the call's output is not valid")


def _check_delays(name: str, delays) -> Dict[int, int]:
    if delays is None:
        return {}
    if not isinstance(delays, dict):
        raise ConfigError(f"{name}={delays!r}: expected a dict chunk_idx -> nanoseconds")
    for chunk, ns in delays.items():
        check_int(f"{name} chunk", chunk, 0)
        check_int(f"{name}[{chunk}]", ns, 0)
    return {int(c): int(ns) for c, ns in delays.items()}


class MoE(Closing):
    """Expert-parallel MoE layer on GPU PEs (see the module docstring).

    Args:
        ctx: a `symmring.context.Context` on a device backend (``nvshmem``).
        experts: this rank's experts, a `symmring.moe.config.Experts`: ``w_gate``, ``w_up`` CUDA tensors
            ``[num_experts / world_size, inter, hidden]`` (``nn.Linear`` layout, Mixtral's ``w1``/``w3``),
            ``w_down`` ``[num_experts / world_size, hidden, inter]`` (``w2``): bf16, or fp8 e4m3 with block
            scales (``w_gate_scale``, ``w_up_scale``, ``w_down_scale``: float32 ``[E, ceil(inter / 128),
            ceil(hidden / 128)]``, down ``[E, ceil(hidden / 128), ceil(inter / 128)]``, the dequantisation
            multipliers, ``weight_scale_inv`` in DeepSeek-V3 / Qwen3-FP8; `symmring.moe.weights`). ``hidden``
            and ``inter`` are ``w_gate``'s shape (multiples of 128 for fp8 dispatch, of 8 for bf16; ``inter`` a
            multiple of 8). ``experts.expert_dtype``: ``"bf16"`` or ``"fp8"`` experts (None: what ``engine``
            needs, else the weights' own format); bf16 weights are quantised to 128x128-block fp8 once, fp8
            ones dequantised for bf16. Copied once into the fused ``[E, 2 * inter, hidden]`` L1 weight.
        routing: a `symmring.moe.config.RoutingConfig`: ``num_experts`` (a multiple of ``ctx.world_size``),
            ``topk`` (at most ``min(32, num_experts)``), ``scoring`` (``"softmax"``, Mixtral;
            ``"sigmoid_bias"``, DeepSeek-V3), ``bias`` (a float tensor on this device), ``routed_scaling_factor``,
            ``n_group``, ``topk_group``, ``norm_topk_prob`` (as in `symmring.moe.routing.route`).
        max_tokens: most tokens per rank per call.
        schedule: a `symmring.moe.config.ScheduleConfig` (default ``ScheduleConfig()``):

            * ``num_slots``: slots of the ring (>= 1); the streamed producer runs up to ``num_slots - 1``
              chunks ahead. ``tokens_per_slot``: tokens per chunk, the slot's capacity (at most
              ``max_tokens``). A batch call fits the ring when it has at most ``num_slots * tokens_per_slot``
              tokens per rank. Neither given: the workspace's chunk (``max_tokens`` without a budget) and
              enough slots for ``max_tokens``; only ``tokens_per_slot`` given: one slot.
            * ``ack_policy``: `AckPolicy.CONSERVATIVE` (acknowledge a chunk after its window's combine
              signal, the default) or ``EARLY`` (right after its pull), or their names (`AckPolicy.parse`).
            * ``expert_window``: chunks per expert window of the streamed schedule (``1 <= W <= num_slots``).
            * ``x_format``: dispatch format, ``"fp8_e4m3"`` (per-token, per-128-channel scales; the default
              here) or ``"bf16"``.
            * ``single_stream``: run the streamed schedule's producer and consumer on the caller's stream, in
              the enqueue order (the serial schedule of PROTOCOL.md 9.1; for tests and as a fallback).
            * ``timeout_s``: bound of every device wait (default: the context's).
            * ``policy``: a `symmring.moe.gpu.policy.StreamPolicy` for ``streaming="auto"`` (default: the one
              measured on an H200, `StreamPolicy.default`).
            * ``small_batch_tokens``: batch calls of one chunk with at most this many tokens on every rank
              run the small-batch schedule (fp8 dispatch and experts only; 0: never unless forced).
            * ``transport``: how this PE reaches each peer (`symmring.transport`): ``"auto"`` (p2p where
              ``nvshmem_ptr`` maps, rdma otherwise), ``"p2p"``, ``"rdma"`` (every peer: NVSHMEM gets into a
              staging ring, puts of combine rows, remote atomics), ``"rdma:1,3"`` (those peers); None:
              ``SYMMRING_TRANSPORT``, else ``"auto"``. The result per rank is ``layer.transports``.
            * ``graph_cache``: CUDA graphs of calls kept for eager calls to replay
              (`symmring.moe.gpu.graph_cache`; default 12, 0 disables; ``SYMMRING_GRAPH_CACHE`` overrides it).
        engine: the experts' GEMMs (`symmring.moe.engines.ENGINES`): ``"torch"`` (bf16), ``"builtin"``
            (Triton fp8), ``"deepgemm"`` (fp8, optional), ``"auto"`` (DeepGEMM where it loads for fp8).
        workspace: the `symmring.Workspace` whose ring, combine buffer, pool and output rows the layer borrows
            for each call (default: the context's own, ``ctx.workspace()``, shared by every layer). Its pool
            holds one window under uniform routing; a window with more rows runs in passes (PROTOCOL.md 9.1c).

    Attribute ``routing`` is the routing the layer runs with (``routing.bias``: the layer's float32 copy of the
    bias); ``schedule`` is the value given, whose ``None`` fields the layer resolved (``layer.x_format``,
    ``layer.num_slots``, ``layer.tokens_per_slot``, ``layer.policy`` hold what it runs with).

    Raises:
        ConfigError: any bad argument, named, before any collective work.
        BackendError: the context is not on a device backend, or torch is missing, or
            ``transport="p2p"`` with a peer that has no P2P mapping (named).

    Example:
        >>> moe = MoE(ctx, Experts(wg, wu, wd), RoutingConfig(num_experts=8, topk=2), max_tokens=1024)  # doctest: +SKIP
        >>> y = moe.forward(x, logits=logits)  # doctest: +SKIP
    """

    def __init__(self, ctx, experts: Experts, routing: RoutingConfig, *, max_tokens: int,
                 schedule: Optional[ScheduleConfig] = None, engine: str = "auto", workspace=None, **unexpected):
        if unexpected:  # e.g. a flat x_format=: name the value it belongs to
            raise misplaced(unexpected, "MoE")
        torch = _torch()
        backend = getattr(ctx, "backend", None)
        if not isinstance(backend, DeviceBackend):
            raise BackendError(f"ctx: expected a context on a device backend ('nvshmem'), got "
                               f"{getattr(backend, 'name', ctx)!r}")
        ctx.check_open()
        self.ctx, self.backend = ctx, backend
        self.rank, self.world_size = ctx.rank, ctx.world_size
        # --- every argument checked before any collective work (the values validated themselves) ----------
        experts, routing, schedule = _check_values(experts, routing, schedule)
        self.routing, self.schedule = routing, schedule
        num_experts, topk, x_format = routing.num_experts, routing.topk, schedule.x_format or "fp8_e4m3"
        self.num_experts, self.topk = num_experts, topk
        self.hidden = check_int("hidden (w_gate.shape[2])", experts.hidden)
        self.inter = check_int("inter (w_gate.shape[1])", experts.inter)
        hidden, inter = self.hidden, self.inter
        self.max_tokens = check_int("max_tokens", max_tokens)
        self.num_slots, self.tokens_per_slot = schedule.num_slots, schedule.tokens_per_slot
        tokens_per_slot = self.tokens_per_slot
        if self.tokens_per_slot is not None and self.tokens_per_slot > self.max_tokens:
            raise ConfigError(f"schedule.tokens_per_slot={tokens_per_slot}: expected at most max_tokens={max_tokens}")
        self.ack_policy = schedule.ack_policy
        expert_window = self.expert_window = schedule.expert_window
        if self.num_experts % self.world_size:
            raise ConfigError(f"num_experts={num_experts}: expected a multiple of world_size={self.world_size} "
                              "(experts are split evenly)")
        if self.topk > min(stages.MAX_TOPK, self.num_experts):
            raise ConfigError(f"topk={topk}: expected at most min({stages.MAX_TOPK}, num_experts={num_experts})")
        multiple = FP8_GROUP_SIZE if x_format == "fp8_e4m3" else 8
        if self.hidden % multiple:
            raise ConfigError(f"hidden={hidden} (w_gate.shape[2]): expected a multiple of {multiple} for "
                              f"x_format={x_format!r}")
        if self.inter % 8:
            raise ConfigError(f"inter={inter} (w_gate.shape[1]): expected a multiple of 8 (16-byte rows for the "
                              "grouped GEMM)")
        self.n_group, self.topk_group, self.norm_topk_prob = routing.n_group, routing.topk_group, routing.norm_topk_prob
        scoring, bias, timeout_s = routing.scoring, routing.bias, schedule.timeout_s
        single_stream, policy, transport = schedule.single_stream, schedule.policy, schedule.transport
        expert_dtype = experts.expert_dtype
        self.small_batch_tokens = schedule.small_batch_tokens
        transport_mod.request(transport, self.world_size)  # a ConfigError before any collective work
        self._graphs = graph_cache_mod.GraphCache(graph_cache_mod.capacity(schedule.graph_cache))
        self.num_local_experts = self.num_experts // self.world_size
        self.expert_begin = self.rank * self.num_local_experts
        self.x_format = x_format
        self.scoring = scoring
        self.routed_scaling_factor = float(routing.routed_scaling_factor)
        self.single_stream = single_stream
        self.timeout_s = float(ctx.timeout_s if timeout_s is None else timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device())
        E, K, H = self.num_local_experts, self.topk, self.hidden
        from ..engines import ENGINES, make_engine
        from ..weights import expert_weights
        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r}: expected one of {list(ENGINES)}")
        wanted = {"torch": "bf16", "builtin": "fp8", "deepgemm": "fp8"}.get(engine)
        if expert_dtype is not None and wanted is not None and expert_dtype != wanted:
            raise ConfigError(f"expert_dtype={expert_dtype!r} with engine={engine!r}: that engine runs {wanted} experts")
        weights = expert_weights(experts.w_gate, experts.w_up, experts.w_down, num_local_experts=E, hidden=H,
                                 inter=self.inter, device=self.device, expert_dtype=expert_dtype or wanted,
                                 w_gate_scale=experts.w_gate_scale, w_up_scale=experts.w_up_scale,
                                 w_down_scale=experts.w_down_scale)
        if weights.dtype == "fp8" and x_format != "fp8_e4m3":
            raise ConfigError(f"x_format={x_format!r}: fp8 experts read the fp8 dispatch rows as they are; "
                              "expected x_format='fp8_e4m3' (or expert_dtype='bf16')")
        self.bias = None
        if bias is not None:
            self._check_tensor("routing.bias", bias, None, (self.num_experts,))
            self.bias = bias.float().contiguous()
        # The routing runs on the device (routing.device_router) within its limits, in every schedule, so
        # they all route alike; torch's `routing.route` past them.
        self._device_routing = routing_mod.device_routing_applies(self.num_experts, self.topk, self.n_group)
        self._router_args = routing_mod.device_router(
            self.num_experts, self.scoring, bias=self.bias, routed_scaling_factor=self.routed_scaling_factor,
            n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob)
        self.policy = policy
        self.engine = make_engine(engine, weights)
        self.expert_dtype = weights.dtype
        #: The routing this layer runs: ``routing`` with its bias as the layer's float32 copy (a state-dict
        #: load into `bias` in place is what the next call routes with).
        self.routing = routing if bias is None else routing.with_bias(self.bias)

        # --- memory: borrowed from the workspace (collective: attach and bind allocate on first use) ------
        from ..workspace import Workspace
        from ..workspace_plan import LayerShape
        if workspace is not None and (not isinstance(workspace, Workspace) or workspace.ctx is not ctx):
            raise ConfigError(f"workspace={workspace!r}: expected a symmring.Workspace of this context")
        self._transport_request = transport_mod.request(transport, self.world_size)
        self.workspace = workspace if workspace is not None else ctx.workspace(collective=True)
        #: This layer's id on its workspace (construction order): the layer part of its calls' identities.
        self.layer_id = self.workspace.new_layer_id()
        # Once, before any allocation: a rank built with other sizes or schedule options (or another layer id: a
        # rank that built another number of layers before) is a ConfigError naming it and the field, on every
        # rank (the ring's spec is checked again by DeviceRing).
        agreement.exchange_and_check(ctx.collectives, self._agreed_fields(), what="MoE")
        self.layer_shape = LayerShape(H, self.inter, self.num_experts, K, x_format=x_format,
                                      expert_format=self.engine.pool_format)
        self.workspace.attach(self.layer_shape, self.max_tokens)
        ws_plan = self.workspace.plan
        if self.num_slots is None and self.tokens_per_slot is None:
            # The workspace's chunk (its windows are whole chunks), and a ring a batch call of max_tokens fits.
            self.tokens_per_slot = min(ws_plan.tokens_per_slot, self.max_tokens)
            self.num_slots = protocol.num_chunks_for(self.max_tokens, self.tokens_per_slot)
        self.num_slots = 1 if self.num_slots is None else self.num_slots
        self.tokens_per_slot = self.max_tokens if self.tokens_per_slot is None else self.tokens_per_slot
        protocol.check_expert_window(expert_window, self.num_slots)
        #: Chunks of an expert window of the batch schedule (the workspace's window; the whole call without
        #: a budget).
        self.batch_window = max(1, ws_plan.window_tokens // self.tokens_per_slot)
        align = self.engine.align_m
        # The layer's view of the workspace, looked up per use: a workspace that grows (a larger layer built
        # before the first call) makes new memory and new views for every layer attached.
        self._bound = (-1, None)  # (workspace epoch, binding): `_binding`
        self._bind_key = self.workspace.gpu.bind(self.layer_shape, num_slots=self.num_slots,
                                                 tokens_per_slot=self.tokens_per_slot, transport=transport,
                                                 timeout_s=self.timeout_s, align=align)
        # Once bound: a later growth of the workspace's memory (`Workspace.release_memory`) reaches this layer.
        self.workspace.register(self)
        self.spec = self.ring.spec
        #: How this PE reaches each rank ("self", "p2p", "rdma"; `symmring.transport`).
        self.transports = self.ring.transports
        self.max_chunks = protocol.num_chunks_for(self.max_tokens, self.tokens_per_slot)
        self._plans: "OrderedDict[Tuple, plans.Plan]" = OrderedDict()
        self._streams: Dict[int, object] = {}  # torch stream handle -> CuPy view of it
        self._timeline = (0, {})  # (chunks, windows) of the last forward(timeline=True)
        self.last_plan: Optional[plans.Plan] = None  # of the last forward (benchmarks and tests read it)
        self.closed = False
        backend.barrier()
        logger.info("MoE on rank %d/%d: experts [%d, %d) of %d, hidden %d, inter %d, top-%d, %s dispatch, %s experts "
                    "(engine %s), max_tokens %d, ring %d x %d tokens, %s ack, window %d, pool %d rows (%d bytes)",
                    self.rank, self.world_size, self.expert_begin, self.expert_begin + E, self.num_experts, H,
                    self.inter, K, x_format, self.expert_dtype, self.engine.name, self.max_tokens, self.num_slots,
                    self.tokens_per_slot, self.ack_policy.name.lower(), self.expert_window, self.capacity,
                    self.memory()["pool_bytes"])

    def _agreed_fields(self) -> Dict[str, object]:
        """What every rank's layer must share: the sizes of its symmetric memory and the schedule options
        every rank's plan reads (`symmring.agreement`)."""
        return dict(num_experts=self.num_experts, hidden=self.hidden, inter=self.inter, topk=self.topk,
                    max_tokens=self.max_tokens, num_slots=self.num_slots, tokens_per_slot=self.tokens_per_slot,
                    x_format=self.x_format, expert_dtype=self.expert_dtype, ack_policy=self.ack_policy.name,
                    expert_window=self.expert_window, small_batch_tokens=self.small_batch_tokens,
                    small_batch_capable=self._small_batch_capable(), timeout_s=self.timeout_s,
                    # Whether a ring of the workspace is shared depends on these too (memory.DeviceMemory keys).
                    transport=str(self._transport_request), layer_id=self.layer_id)

    # --- what the layer borrows from its workspace (the same objects for every layer of a shape) ------------

    def forget_workspace_memory(self) -> None:
        """The workspace is making its memory anew (it grew for a larger layer): drop the cached graphs and
        plans, which address or were sized for the old memory."""
        self.clear_graph_cache()
        self._plans.clear()

    @property
    def _binding(self):
        # Looked up once per workspace memory (its epoch), not per use: a forward reads it dozens of times.
        epoch, binding = self._bound
        if epoch != self.workspace.epoch:
            binding = self.workspace.gpu.bindings[self._bind_key]
            self._bound = (self.workspace.epoch, binding)
        return binding

    # The layer's views of its workspace (looked up per use: a workspace that grows makes new memory).
    _latch = view("_binding.latch", "The async-error latch of this layer's ring (`symmring.kernels.AsyncErrorLatch`).")
    _kernels = view("workspace.gpu.kernels")
    capacity = view("_binding.capacity",
                    "Rows of the expert pool (a window under uniform routing; more rows run in passes, PROTOCOL.md "
                    "9.1c).")
    ring = view("_binding.ring", "The `DeviceRing` of this layer's ring spec in the workspace (shared by the layers "
                                 "of that spec).")
    _state = view("_binding.state")
    combine_alloc = view("workspace.gpu.combine_alloc")
    stage_alloc = view("_binding.stage_alloc")
    _topk_idx = view("_binding.topk_idx")
    _topk_weights = view("_binding.topk_weights")
    _producer_stream = view("workspace.gpu.producer_stream")
    _consumer_stream = view("workspace.gpu.consumer_stream")

    _graph_pool = view("workspace.gpu.graph_pool", writable=True)

    def memory(self) -> Dict[str, int]:
        """Device bytes this layer's calls use on this PE, all of them the workspace's (shared with every layer
        on it; `symmring.Workspace.memory` has the regions): ``pool_bytes`` (this shape's view of the expert
        pool: its rows, their scales, sources, routing weights and group ids), ``heap_bytes`` (symmetric: the
        ring, the combine buffer, the staging ring and the experts' region) and ``weight_bytes`` (the layer's
        own experts and their scales)."""
        s = self._state
        pool = sum(t.numel() * t.element_size() for t in (s.pool_x, s.pool_sf, s.m_indices, s.row_src, s.row_weight)
                   if t is not None)
        gpu = self.workspace.gpu
        stage = 0 if self.stage_alloc is None else self.stage_alloc.nbytes
        return {"pool_bytes": pool, "heap_bytes": self.ring.alloc.nbytes + gpu.combine_alloc.nbytes + stage
                + gpu.experts_alloc.nbytes, "weight_bytes": self.engine.weights.nbytes}

    # --- validation -----------------------------------------------------------------------------------

    def _check_tensor(self, name: str, t, dtype, shape) -> None:
        torch = _torch()
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{name}: expected a torch tensor, got {type(t).__name__}")
        if not t.is_cuda or t.device != self.device:
            raise ConfigError(f"{name}: expected a tensor on {self.device}, got one on {t.device}")
        if dtype is not None and t.dtype != dtype:
            raise ConfigError(f"{name}.dtype={t.dtype}: expected {dtype}")
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"{name}.shape={tuple(t.shape)}: expected {tuple(shape)}")

    def _check_input(self, x):
        """``x`` validated (bf16 ``[n <= max_tokens, hidden]`` on this GPU), with 16-byte aligned rows."""
        torch = _torch()
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ConfigError(f"x: expected a 2-D torch tensor [n, hidden={self.hidden}], got "
                              f"{getattr(x, 'shape', type(x).__name__)}")
        n = int(x.shape[0])
        if n > self.max_tokens:
            raise ConfigError(f"x.shape[0]={n}: expected at most max_tokens={self.max_tokens}")
        self._check_tensor("x", x, torch.bfloat16, (n, self.hidden))
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()  # the kernels read 16-byte vectors of rows
        return x

    def _check_open(self) -> None:
        self._check_closed()
        self.workspace.check_open()  # its memory: a closed workspace is a RingClosedError (the context's too)

    def _check_closed(self) -> None:
        """RingClosedError when this layer, its workspace or its context is closed (not the workspace's failure:
        `forward` sends that to the other ranks as a refusal)."""
        if self.closed:
            raise RingClosedError("this MoE layer was closed")
        self.workspace.ctx.check_open()
        if self.workspace.closed:
            raise RingClosedError("this workspace was closed (its layers can no longer run)")

    def _routing_source(self, x, router_weight, logits, topk_idx, topk_weights) -> Tuple:
        """Validate the routing source (nothing enqueued): ``("given", (topk_idx, topk_weights))``,
        ``("router", router_weight)`` or ``("logits", logits)``."""
        torch = _torch()
        n = x.shape[0]
        sources = [s for s, v in (("router_weight", router_weight), ("logits", logits), ("topk_idx", topk_idx))
                   if v is not None]
        if len(sources) != 1:
            raise ConfigError(f"routing: got {sources or 'none'}; expected exactly one of router_weight, "
                              "logits, or topk_idx with topk_weights")
        if topk_idx is not None:
            self._check_tensor("topk_idx", topk_idx, torch.int32, (n, self.topk))
            self._check_tensor("topk_weights", topk_weights, torch.float32, (n, self.topk))
            return "given", (topk_idx.contiguous(), topk_weights.contiguous())
        if topk_weights is not None:
            raise ConfigError("topk_weights: given without topk_idx")
        if router_weight is not None:
            self._check_tensor("router_weight", router_weight, torch.bfloat16, (self.num_experts, self.hidden))
            return "router", router_weight
        self._check_logits(logits, n)
        return "logits", logits

    def _check_logits(self, logits, n: int) -> None:
        self._check_tensor("logits", logits, None, (n, self.num_experts))
        if not logits.is_floating_point():
            raise ConfigError(f"logits.dtype={logits.dtype}: expected a floating-point dtype")

    def _logits(self, x, kind: str, source, rows: slice = slice(None)):
        """The router logits of ``x[rows]`` from a validated router or logits source (enqueued)."""
        return x[rows] @ source.t() if kind == "router" else source[rows]

    def _route(self, x, kind: str, source, rows: slice = slice(None), out: Optional[Tuple] = None) -> Tuple:
        """``(topk_idx, topk_weights)`` of ``x[rows]`` from a validated router or logits source (enqueued), into
        ``out`` (contiguous int32 / float32 ``[rows, topk]``) when given."""
        torch = _torch()
        logits = self._logits(x, kind, source, rows)
        if self._device_routing:
            n = int(logits.shape[0])
            idx, weights = out if out is not None else (
                torch.empty((n, self.topk), dtype=torch.int32, device=self.device),
                torch.empty((n, self.topk), dtype=torch.float32, device=self.device))
            stages.route_topk(self._kernels, self._stream(torch.cuda.current_stream().cuda_stream),
                              logits=routing_mod.logits_operand(logits), router=self._router_args, topk=self.topk,
                              topk_idx=idx, topk_weights=weights)
            return idx, weights
        idx, weights = routing_mod.route(logits, self.topk, self.scoring, bias=self.bias,
                                         routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
                                         topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob)
        if out is not None:
            out[0].copy_(idx)
            out[1].copy_(weights)
            return out
        return idx.contiguous(), weights.contiguous()

    def route(self, logits) -> Tuple:
        """The layer's routing of router ``logits`` ``[n, num_experts]`` (any float dtype, on the layer's device):
        ``(topk_idx int32, topk_weights float32)`` ``[n, topk]``, enqueued on the current stream, as every
        `forward` given ``logits`` or ``router_weight`` routes (the small-batch producer, the other schedules'
        routing kernel: the same device routing, `symmring.moe.routing` module notes; torch's
        `routing.route` past its limits). Not collective; touches no ring state.

        Raises:
            ConfigError: ``logits`` not a 2-D ``[n, num_experts]`` tensor on the layer's device.
        """
        self._check_open()
        if not isinstance(logits, _torch().Tensor) or logits.dim() != 2:
            raise ConfigError(f"logits: expected a 2-D tensor [n, num_experts={self.num_experts}], got "
                              f"{getattr(logits, 'shape', type(logits).__name__)}")
        self._check_logits(logits, int(logits.shape[0]))
        return self._route(None, "logits", logits)

    def streams(self, streaming, num_tokens: int) -> bool:
        """Whether a call of ``num_tokens`` tokens per rank with this ``streaming`` argument runs the streamed
        schedule: ``streaming`` itself, or the policy's answer for ``"auto"``.

        Raises ConfigError for any other value."""
        if isinstance(streaming, bool):
            return streaming
        if streaming != "auto":
            raise ConfigError(f"streaming={streaming!r}: expected one of {list(STREAMING_MODES)}")
        if self.policy is None:
            from .policy import StreamPolicy
            self.policy = StreamPolicy.default()
        return self.policy.streams(self, num_tokens)

    # --- the layer ------------------------------------------------------------------------------------

    def forward(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None, streaming=False,
                small_batch: Optional[bool] = None, stage_events: Optional[List] = None, timeline: bool = False,
                producer_delay_ns=None, consumer_delay_ns=None, graph_cache: bool = True):
        """Run the layer on this rank's tokens (collective: every rank calls forward once per call, with
        the same ``streaming``). Outside a `symmring.Workspace.step` it exchanges every rank's token count
        with the other ranks (one bounded host exchange); inside one it exchanges nothing.

        Args:
            x: bf16 ``[n, hidden]`` on this rank's GPU, ``0 <= n <= max_tokens``, rows contiguous.
            router_weight: bf16 ``[num_experts, hidden]`` (logits = ``x @ router_weight.T``), or
            logits: ``[n, num_experts]`` (any float dtype), or
            topk_idx / topk_weights: int32 / float32 ``[n, topk]`` routing (``-1`` = masked).
            streaming: False (batch-ready), True (chunked through the ring) or ``"auto"`` (the policy).
            small_batch: None (the small-batch schedule where it applies: `small_batch_applies`), True
                (force it: a ConfigError where it cannot run) or False (the general kernels).
            stage_events: batch path only: a list that receives ``(stage name, torch.cuda.Event)`` pairs
                after each stage of `STAGES` (with a leading ``("start", event)``) for per-stage timing.
            timeline: streamed only: stamp every stage of every chunk with the device clock
                (`timeline_records`).
            producer_delay_ns / consumer_delay_ns: streamed only, ``{chunk_idx: ns}``: spin the producer
                before producing the chunk, or the consumer before consuming the window that starts at it
                (tests: a deliberately slow producer or consumer).
            graph_cache: False: this call neither replays nor captures a cached graph (launches its kernels;
                `symmring.moe.gpu.graph_cache` says when True replays).

        Returns:
            bf16 ``[n, hidden]`` tensor ``y`` (enqueued on the current torch stream; no host sync), a new
            tensor on every call (a replayed call returns a clone of its graph's output); all NaN when a
            device error was pending at the call's end.

        Raises:
            ConfigError: bad shapes, dtypes, devices, routing sources or options, or a batch call larger
                than the ring (nothing is enqueued): outside a step on every rank (the call's exchange carries
                every rank's verdict); inside a step on this rank, also for more tokens than the step declared
                or given routing in a step declared ``own_router=True``, and the call is refused (`_refuse`:
                counted, ``peer_refused`` recorded on its ring, the step failed on every rank).
            CallMismatch: outside a step, the ranks are at different calls or layers (on every rank, nothing
                enqueued; until `reset`).
            PeerTimeout: the ranks' token counts did not arrive within the host bound (a `ProtocolTimeout`).
            BrokenStateError: an earlier host exchange of the context failed (re-initialise), or (on every rank,
                outside a step) a step failed (`reset`).
            ProtocolTimeout, ProtocolViolation: a device error of an earlier call, latched on any rank
                (`async_error`; its subclass `ProtocolAborted` on the ranks where another rank latched it), on
                every rank and before anything is enqueued, until `reset`; with ``SYMMRING_DEBUG=1`` also a
                device error of this call.
        """
        torch = _torch()
        self._check_closed()
        step = self.workspace.active_step
        kind, refusal = None, None
        try:
            self.workspace.check_open()  # a failed step or call: refused like a bad argument (every rank hears)
            x, kind, source, delays, consumer_delays = self._check_call(
                x, router_weight, logits, topk_idx, topk_weights, streaming, small_batch, stage_events, timeline,
                producer_delay_ns, consumer_delay_ns, graph_cache)
        except (ConfigError, BrokenStateError) as exc:
            refusal = exc
        n = 0 if refusal is not None else int(x.shape[0])
        if step is None:
            counts, distinct, latched = self._all_token_counts(n, own_router=kind != "given", refusal=refusal)
        else:  # the step exchanged the counts once for every layer: nothing to exchange here
            counts, distinct, latched = self._step_counts(step, n, kind, refusal)
        self._raise_async_error(latched)  # every rank got the same list: every rank raises, nothing enqueued
        # Every rank plans for the same token bucket; this rank's exact count goes to the device (_begin_call).
        bucket = [self._bucket(max(counts))] * self.world_size
        stream_it, small = self._schedule(streaming, counts, small_batch, bucket)
        plan = self._plan(bucket, stream_it, small, distinct)
        self.last_plan = plan
        if plan.num_chunks == 0:  # every rank has zero tokens: no chunk, generation base unchanged
            return torch.empty((n, self.hidden), dtype=torch.bfloat16, device=self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        y = None
        if graph_cache and not capturing and stage_events is None and not timeline and not delays \
                and not consumer_delays:
            y = self._cached_call(plan, distinct, x, kind, source)
        if y is None:
            y = torch.empty((n, self.hidden), dtype=torch.bfloat16, device=self.device)
            if not capturing:
                self._begin_call(n)
            else:
                self.workspace.note_capture()  # Workspace.replay refuses a graph of old memory
                if step is None:  # a graph captured outside a step replays this count (it fixed the bucket too)
                    self.workspace.gpu.record_call_tokens(n)
                # else: a step's graph reads the count set before each replay (Workspace.set_call_tokens)
            self._enqueue(plan, x, kind, source, y, stage_events, timeline, delays, consumer_delays)
            if not capturing:
                self._end_of_call()
        if env.debug():
            self.check_errors()
        return y

    __call__ = forward

    def _check_call(self, x, router_weight, logits, topk_idx, topk_weights, streaming, small_batch, stage_events,
                    timeline, producer_delay_ns, consumer_delay_ns, graph_cache) -> Tuple:
        """`forward`'s arguments checked on this rank (nothing enqueued, nothing exchanged):
        ``(x, kind, source, delays, consumer_delays)``, ``x`` with 16-byte aligned rows.

        Raises:
            ConfigError: the first bad argument, named."""
        x = self._check_input(x)
        if not isinstance(streaming, bool) and streaming != "auto":
            raise ConfigError(f"streaming={streaming!r}: expected one of {list(STREAMING_MODES)}")
        if not isinstance(timeline, bool):
            raise ConfigError(f"timeline={timeline!r}: expected a bool")
        delays = _check_delays("producer_delay_ns", producer_delay_ns)
        consumer_delays = _check_delays("consumer_delay_ns", consumer_delay_ns)
        if streaming is not True and (timeline or delays or consumer_delays):
            raise ConfigError("timeline/producer_delay_ns/consumer_delay_ns: only for the streamed schedule "
                              "(streaming=True)")
        if streaming is not False and stage_events is not None:
            raise ConfigError("stage_events: only for the batch path (streaming=False); the streamed schedule "
                              "records a timeline (timeline=True)")
        if small_batch not in (None, True, False):
            raise ConfigError(f"small_batch={small_batch!r}: expected None, True or False")
        if not isinstance(graph_cache, bool):
            raise ConfigError(f"graph_cache={graph_cache!r}: expected a bool")
        if small_batch and not self._small_batch_capable():
            raise ConfigError("small_batch=True: the small-batch schedule needs fp8 dispatch and fp8 experts and at "
                              f"most {stages.THREADS_PER_BLOCK} ranks (this layer: x_format={self.x_format!r}, engine "
                              f"{self.engine.name!r}, {self.world_size} ranks)")
        kind, source = self._routing_source(x, router_weight, logits, topk_idx, topk_weights)
        return x, kind, source, delays, consumer_delays

    def _enqueue(self, plan: plans.Plan, x, kind: str, source, y, stage_events: Optional[List] = None,
                 stamps: bool = False, delays: Optional[Dict[int, int]] = None,
                 consumer_delays: Optional[Dict[int, int]] = None) -> None:
        """The call's kernels on the current stream (eagerly, or into the graph being captured)."""
        plan = plans.own_rows(plan, int(x.shape[0]))  # never past x's or y's rows, whatever the count word says
        if plan.streaming:
            self._run_streamed(plan, x, kind, source, y, stamps, delays or {}, consumer_delays or {})
        else:
            self._run_batch(plan, x, kind, source, y, stage_events)
        # Last on the caller's stream: after an error, y is NaN and the error latched for the next forward.
        self._latch.enqueue(_torch().cuda.current_stream().cuda_stream, y)

    # --- the cache of captured calls (symmring.moe.gpu.graph_cache) ---------------------------------------

    def _graph_key(self, plan: plans.Plan, distinct: bool, x, kind: str, source) -> Optional[Tuple]:
        """``(key, the call's tensors for the graph's static inputs)`` of a call the cache may serve, or None."""
        if max(plan.counts) > graph_cache_mod.MAX_TOKENS or not x.is_contiguous():
            return None
        base = (plan.counts, plan.streaming, plan.small_batch, distinct, kind)
        if kind == "given":
            return base, (x,) + tuple(source)  # made contiguous by _routing_source
        if kind == "logits":
            if not source.is_contiguous():
                return None
            return base + (source.dtype,), (x, source)
        # The router weight is read in place: its address and strides are part of what the graph captured.
        return base + (source.data_ptr(), tuple(source.stride())), (x,)

    def _cached_call(self, plan: plans.Plan, distinct: bool, x, kind: str, source):
        """``y`` of this call from its cached graph (captured first if this is the key's second call), or None
        when the call runs eagerly (nothing enqueued then)."""
        found = self._graph_key(plan, distinct, x, kind, source)
        if found is None:
            return None
        key, values = found
        action, entry = self._graphs.decide(key)
        if action == "eager":
            return None
        if action == "capture":
            torch = _torch()
            torch.cuda.synchronize()  # the graphs evicted below have no replay in flight
            self._graphs.make_room()
            try:
                entry = self._capture_call(plan, x, kind, source)
            except Exception as exc:  # the call runs eagerly; its key stays eager
                self._graphs.fail(key)
                logger.warning("MoE rank %d: capturing a call of counts %s for the graph cache failed (%s: %s); "
                               "calls of this shape run eagerly", self.rank, plan.counts, type(exc).__name__, exc)
                return None
            self._graphs.insert(key, entry)
        self._begin_call(x.shape[0])  # before the copies: the previous replay may still read the static inputs
        y = entry.replay(values)
        self._end_of_call()  # after the clone: the next call (any graph of the shared pool) comes after it
        return y

    def _capture_call(self, plan: plans.Plan, x, kind: str, source) -> graph_cache_mod.CachedGraph:
        """Capture this call's kernels on static inputs (a side stream, the cache's memory pool; nothing runs)."""
        torch = _torch()
        rows = plan.counts[self.rank]  # the bucket: the graph serves any count up to it (the device reads it)
        with torch.inference_mode(False):  # normal tensors: later calls may copy into them outside inference mode
            inputs = [_rows_like(x, rows)]
            if kind == "given":
                inputs += [_rows_like(t, rows) for t in source]
            elif kind == "logits":
                inputs.append(_rows_like(source, rows))
        static_source = {"given": tuple(inputs[1:]), "logits": inputs[-1]}.get(kind, source)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        from ..engines import capture_scope
        try:
            with capture_scope() as held, torch.cuda.graph(graph, pool=self._graph_pool):
                y = torch.empty((rows, self.hidden), dtype=torch.bfloat16, device=self.device)
                self._enqueue(plan, inputs[0], kind, static_source, y)
        finally:
            torch.cuda.set_stream(caller)  # a failed capture_end would leave the capture stream current
        return graph_cache_mod.CachedGraph(graph, inputs, y, held)

    def graph_cache_info(self) -> Dict[str, int]:
        """The cache of captured calls: ``entries``, ``capacity``, ``hits`` (eager calls that replayed),
        ``captures``, ``evictions``, ``failures`` (`symmring.moe.gpu.graph_cache.GraphCache.info`)."""
        return self._graphs.info()

    def refresh_weights(self) -> None:
        """After overwriting the expert weights in place (the tensors of ``layer.engine.weights``): let the
        engine re-derive what it keeps beside them (`ExpertEngine.refresh_weights`: views, DeepGEMM's
        prepared layouts, which may be new tensors) and drop the cached graphs, which address the former
        ones. `symmring.moe.integrations.module.MoEModule.load_state_dict` calls it."""
        self.engine.refresh_weights()
        self.clear_graph_cache()

    def clear_graph_cache(self) -> None:
        """Drop every cached graph (synchronises first, so no replay of theirs is in flight); later calls
        capture again. `refresh_weights` calls it after the engine's weight tensors are replaced."""
        if len(self._graphs):
            _torch().cuda.synchronize()
        self._graphs.clear()
        # torch releases a graph memory pool with its last graph; a capture into the released handle fails
        # (CUDACachingAllocator's use_count assertion), so the next capture makes a new pool.
        self._graph_pool = None

    def _bucket(self, most: int) -> int:
        """The token bucket of a call whose largest rank has ``most`` tokens (`plans.token_bucket`): at most
        ``max_tokens``, at most the ring when ``most`` fits it (a batch call must fit the ring), and never more
        chunks than ``most`` needs."""
        ring = self.num_slots * self.tokens_per_slot
        cap = min(self.max_tokens, ring) if most <= ring else self.max_tokens
        chunks = -(-most // self.tokens_per_slot) * self.tokens_per_slot  # never more chunks than the count's
        return plans.token_bucket(most, min(cap, chunks))

    def _step_counts(self, step, n: int, kind: Optional[str], refusal: Optional[BaseException]
                     ) -> Tuple[List[int], bool, List]:
        """``(counts, distinct, latched)`` of a call inside `Workspace.step` (no exchange): the step's (its
        latched errors were raised at its entry). The call is then counted.

        Raises:
            ConfigError: on every rank, a declared count over ``max_tokens``; on this rank only ``refusal`` (its
                arguments), more tokens than this rank declared, or ``topk_idx`` in a step declared
                ``own_router=True``: the call is refused (`_refuse`), so no rank pairs it with another."""
        if max(step.counts) > self.max_tokens:  # every rank sees the same counts: every rank refuses
            raise ConfigError(f"Workspace.step: ranks declared {list(step.counts)} tokens, over this layer's "
                              f"max_tokens={self.max_tokens}")
        if refusal is None and n > step.counts[self.rank]:
            refusal = ConfigError(f"x.shape[0]={n}: more tokens than this step declared ({step.counts[self.rank]}; "
                                  "Workspace.step(num_tokens))")
        if refusal is None and kind == "given" and step.distinct:
            refusal = ConfigError("topk_idx/topk_weights: this step was declared with own_router=True (every call "
                                  "routes with the layer's router); open it with own_router=False")
        if refusal is not None:
            self._refuse(refusal)
        self.workspace.begin_call()
        return list(step.counts), step.distinct and kind != "given", [None] * self.world_size

    def _refuse(self, error: BaseException) -> None:
        """Raise ``error``, this rank's refusal of a call inside a step, after telling every rank: the call is
        counted (`Workspace.refuse_call`: the step is failed and raised everywhere at the next entry) and, unless
        a graph is being captured, ``moe_refuse_call`` records the refusal on the layer's ring after the last
        call (every other PE's wait of this call ends at once, aborted; their outputs are NaN) and the latch
        follows it, as after any call."""
        self.workspace.refuse_call(self.layer_id, error)
        torch = _torch()
        if not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream()
            self.workspace.gpu.after_last_call()
            stages.refuse_call(self._kernels, self._state, self._stream(stream.cuda_stream), layer=self.layer_id)
            self._latch.enqueue(stream.cuda_stream)
            self._end_of_call()
        raise error

    def _begin_call(self, num_tokens: int) -> None:
        """Order this call after the previous one (of any layer), then set this rank's token count on the device
        (`DeviceMemory.begin_call`: the workspace's word every layer's kernels read)."""
        self.workspace.gpu.begin_call(num_tokens)

    def _end_of_call(self) -> None:
        self.workspace.gpu.end_of_call()

    def _schedule(self, streaming, counts: List[int], small_batch: Optional[bool],
                  bucket: Optional[List[int]] = None) -> Tuple[bool, bool]:
        """``(streamed, small_batch)`` of a call: decided from the exchanged (or step-declared) token ``counts``
        (the same list on every rank), never from this rank's own count, so every rank runs the same schedule
        (PROTOCOL 9.1a): ``"auto"`` asks the policy about ``max(counts)``; the small-batch schedule needs the
        call's largest count within ``small_batch_tokens`` and its ``bucket`` (the counts every rank plans
        for) within one chunk and one pass. A forced ``small_batch`` on a call it cannot run (streamed,
        several chunks) is left to `plans.make_plan` to name."""
        stream_it = self.streams(streaming, max(counts))
        small = self.small_batch_applies(counts, stream_it, bucket) if small_batch is None else small_batch
        return stream_it, small

    def _small_batch_capable(self) -> bool:
        # The fused dispatch waits for source r on thread r of every block.
        return (self.x_format == "fp8_e4m3" and self.engine.pool_format == "fp8"
                and self.world_size <= stages.THREADS_PER_BLOCK)

    def small_batch_applies(self, counts: List[int], streaming: bool, bucket: Optional[List[int]] = None) -> bool:
        """Whether a call with every rank's token ``counts`` runs the small-batch schedule by default: fp8
        dispatch and experts, batch, at most ``small_batch_tokens`` tokens on every rank, and the call as
        planned (``bucket``: every rank's planned tokens; default ``counts``) one chunk whose rows fit the pool
        in one pass."""
        planned = counts if bucket is None else bucket
        most = max(counts)
        # The small-batch schedule runs one pass: its rows must fit the pool.
        rows = spanned_rows(sum(planned) * self.topk, self.num_local_experts, self.engine.align_m)
        return (self._small_batch_capable() and not streaming and 0 < most <= self.small_batch_tokens
                and max(planned) <= self.tokens_per_slot and rows <= self.capacity)

    def _plan(self, counts: List[int], streaming: bool, small_batch: bool = False,
              distinct_experts: bool = False) -> plans.Plan:
        key = (tuple(counts), streaming, small_batch, distinct_experts)
        plan = self._plans.get(key)
        if plan is None:
            plan = plans.make_plan(counts, self.rank, tokens_per_slot=self.tokens_per_slot, num_slots=self.num_slots,
                                   expert_window=self.expert_window, streaming=streaming,
                                   two_streams=not self.single_stream, topk=self.topk, capacity=self.capacity,
                                   align=self._state.align, num_groups=self.num_local_experts,
                                   small_batch=small_batch, distinct_experts=distinct_experts,
                                   batch_window=self.batch_window)
            self._plans[key] = plan
            if len(self._plans) > MAX_CACHED_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def _run_batch(self, plan: plans.Plan, x, kind: str, source, y, events: Optional[List]) -> None:
        """The batch schedule on the caller's stream: every route, every layout, one window, the end."""
        torch = _torch()
        k, s = self._kernels, self._state
        stream = self._stream(torch.cuda.current_stream().cuda_stream)

        def mark(name: str) -> None:
            if events is not None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                events.append((name, ev))

        mark("start")
        if plan.small_batch:
            # The producer routes the logits itself (the same device routing as _route).
            logits = None
            if kind == "given":
                idx, weights = source
            elif self._device_routing:
                logits = routing_mod.logits_operand(self._logits(x, kind, source))
                idx, weights = self._topk_idx[:x.shape[0]], self._topk_weights[:x.shape[0]]
            else:
                idx, weights = self._route(x, kind, source)
            mark("route")
            stages.small_batch_call(k, s, stream, chunk=plan.chunks[0], window=plan.windows[0], engine=self.engine,
                                    ack_policy=self.ack_policy, x=x, topk_idx=idx, topk_weights=weights, y=y,
                                    num_chunks=plan.num_chunks, mark=mark if events is not None else None,
                                    logits=logits, router=self._router_args, layer=self.layer_id)
            return
        idx, weights = source if kind == "given" else self._route(x, kind, source)
        row_bytes = self.topk * 4
        for chunk in plan.chunks:
            stages.produce_route(k, s, stream, chunk=chunk, topk_idx_ptr=idx.data_ptr() + chunk.token_base * row_bytes,
                                 topk_weights_ptr=weights.data_ptr() + chunk.token_base * row_bytes,
                                 layer=self.layer_id)
        mark("route")
        for chunk in plan.chunks:
            stages.produce_layout(k, s, stream, chunk=chunk, x=x)
        mark("layout")
        # One window over the call's chunks, or (a budgeted workspace) windows of its window's chunks in turn.
        for first, window in plan.windows.items():
            last = first == plan.last_window
            stages.consume_window(k, s, stream, window=window, engine=self.engine, ack_policy=self.ack_policy,
                                  split_waits=False, topk_idx=idx, topk_weights=weights, y=y, layer=self.layer_id,
                                  end_call_chunks=plan.num_chunks if last else 0,
                                  mark=mark if events is not None and last else None)

    def _run_streamed(self, plan: plans.Plan, x, kind: str, source, y, stamps: bool, delays: Dict[int, int],
                      consumer_delays: Dict[int, int]) -> None:
        """The streamed schedule: the plan's enqueue order on the producer and consumer streams (or the
        caller's stream alone), joined on the caller's stream, which then ends the call."""
        torch = _torch()
        k, s = self._kernels, self._state
        caller = torch.cuda.current_stream()
        if plan.two_streams:
            producer, consumer = self._producer_stream, self._consumer_stream
            # Fork: both streams start after the caller's earlier work (the previous call's end included).
            producer.wait_stream(caller)
            consumer.wait_stream(caller)
        else:
            producer = consumer = caller
        if kind == "given":
            idx, weights = source
            route = None
        else:
            idx, weights = self._topk_idx, self._topk_weights

            def route(rows: slice) -> None:
                rows = slice(rows.start, min(rows.stop, x.shape[0]))  # the bucket's chunk may pass x's end
                if rows.start < rows.stop:
                    self._route(x, kind, source, rows, out=(idx[rows], weights[rows]))
        self._timeline = (plan.num_chunks, {w.first: w.last for w in plan.windows.values()}) if stamps else (0, {})
        last_window = plan.last_window
        p_stream, c_stream = self._stream(producer.cuda_stream), self._stream(consumer.cuda_stream)
        # The local edges between the streams (plan.waits): a captured graph keeps them, so no executor can
        # run a window before this rank's own chunks of it, or a chunk before the acknowledgement of its slot.
        # EARLY acknowledges each chunk right after its pull, inside its window: the producer of the slot's
        # next use waits for that acknowledgement, not for the whole window.
        early = self.ack_policy == protocol.AckPolicy.EARLY
        done = {b: torch.cuda.Event() for b in plan.signals}
        acked: Dict[int, object] = {}

        def record_ack(chunk: int) -> None:
            acked[chunk] = torch.cuda.Event()
            acked[chunk].record(consumer)

        for entry in plan.order:
            item, first, _ = entry
            for before in plan.waits.get(entry, ()):
                if early and item == "produce" and before[0] == "consume":
                    producer.wait_event(acked[first - self.num_slots])
                else:
                    (producer if item == "produce" else consumer).wait_event(done[before])
            if item == "produce":
                with torch.cuda.stream(producer):
                    stages.produce_chunk(k, s, p_stream, chunk=plan.chunks[first], x=x, route=route, topk_idx=idx,
                                         topk_weights=weights, layer=self.layer_id, delay_ns=delays.get(first, 0),
                                         stamps=stamps)
            else:
                end_here = not plan.two_streams and first == last_window
                with torch.cuda.stream(consumer):
                    stages.consume_window(k, s, c_stream, window=plan.windows[first], engine=self.engine,
                                          ack_policy=self.ack_policy, split_waits=True, topk_idx=idx,
                                          topk_weights=weights, y=y, layer=self.layer_id,
                                          end_call_chunks=plan.num_chunks if end_here else 0,
                                          delay_ns=consumer_delays.get(first, 0), stamps=stamps,
                                          acked=record_ack if early and plan.two_streams else None)
            if entry in done:
                done[entry].record(producer if item == "produce" else consumer)
        if plan.two_streams:
            caller.wait_stream(producer)  # join: every kernel that reads the generation base is done
            caller.wait_stream(consumer)
            # End of the call: generation base + num_chunks (device-resident: graph replays stay fresh).
            stages.end_call(k, s, self._stream(caller.cuda_stream), num_chunks=plan.num_chunks)

    def capture(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None, streaming=False,
                small_batch: Optional[bool] = None, warmup: int = 1):
        """Capture one `forward` on these (static) tensors into a CUDA graph (collective).

        Runs ``warmup`` eager calls first (real calls: every rank must make the same ones), then
        captures. Each ``graph.replay()`` is one more call on every rank: the generations come from the
        device-resident generation base, so replays never reuse a stale one. Refill ``x`` (and the
        routing tensors) in place between replays. The schedule is the capture's token bucket: the other
        ranks' counts may change up to it from replay to replay; this rank's is ``x``'s rows.

        Returns:
            ``(call, y)``: a `CapturedCall` (``call.replay()``; ``call.graph`` is the ``torch.cuda.CUDAGraph``)
            and its static output tensor. ``call.replay()`` on any stream runs after the layer's previous
            call, eager or replayed, as `forward` does, and raises a latched device error; a bare
            ``call.graph.replay()`` does neither (it leaves the order to the caller, and the next eager call on
            another stream may overlap it): replay through ``call.replay()`` or `symmring.Workspace.replay`.

        Raises:
            ConfigError: as `forward`.

        Example:
            >>> call, y = moe.capture(x, router_weight=router, streaming=True)  # doctest: +SKIP
            >>> x.copy_(next_batch); call.replay(); use(y)  # doctest: +SKIP
        """
        torch = _torch()
        kwargs = dict(router_weight=router_weight, logits=logits, topk_idx=topk_idx, topk_weights=topk_weights,
                      streaming=streaming, small_batch=small_batch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(check_int("warmup", warmup, 0)):
                self.forward(x, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        from ..engines import capture_scope
        # registered: a replay after the workspace grew is refused; the engines' captured launches hold
        # their counters while the graph lives
        with capture_scope() as held, self.workspace.capture(graph):
            y = self.forward(x, **kwargs)
        return CapturedCall(self, graph, int(x.shape[0]), held), y

    def _all_token_counts(self, n: int, own_router: bool, refusal: Optional[BaseException] = None
                          ) -> Tuple[List[int], bool, List]:
        """Every rank's token count of this call, whether every rank routes with the layer's own router
        (distinct experts per token, so no expert gets more rows than there are tokens), and every rank's
        latched device error (`AsyncErrorLatch.latched`: None where none), from ONE bounded exchange of the
        context (`PeerTimeout` naming the late ranks; the context then refuses further calls until it is
        re-initialised) that also carries every rank's argument verdict and call identity, so every rank raises,
        or none does, before anything is enqueued: a refusal (``refusal``: this rank's own error; a `ConfigError`
        naming the refusing ranks elsewhere, `symmring.agreement.rejection`), then ranks whose call sequences
        diverged (`CallMismatch`, `symmring.agreement.call_mismatch`). The call is then counted."""
        ws = self.workspace
        mine = (n, own_router, ws.gpu.latched(), ws.call_identity(self.layer_id),
                None if refusal is None else str(refusal))
        entries = self._exchange_counts(mine)
        rejected = agreement.rejection([e[4] for e in entries], self.rank, "MoE.forward")
        if rejected is not None:
            raise refusal if refusal is not None else rejected
        mismatch = agreement.call_mismatch([e[3] for e in entries], self.rank, "MoE.forward")
        if mismatch is not None:
            raise mismatch
        latched = [e[2] for e in entries]
        if all(words is None for words in latched):
            ws.begin_call()
        return [int(e[0]) for e in entries], all(bool(e[1]) for e in entries), latched

    def _exchange_counts(self, mine: Tuple) -> List[Tuple]:
        """Every rank's ``mine`` (`_all_token_counts`), in rank order: the context's bounded exchange, under its
        own (host) bound."""
        if self.world_size == 1:
            return [mine]
        return self.ctx.collectives.allgather(mine, what="MoE.forward: token counts")

    def _raise_async_error(self, latched: List) -> None:
        """Raise the device error latched by an earlier call of this rank (its own record, named, decoded from the
        words it sent), or else by another rank (`ProtocolAborted` naming it): ``latched`` is the exchanged list,
        the same on every rank, so every rank raises in the same call (`symmring.kernels.exchanged_error`). The
        latch stays set until `reset`."""
        from ...kernels import exchanged_error
        error = exchanged_error(self.rank, latched, self.workspace.gpu.decode_latched)
        if error is None:
            return
        collectives = getattr(self.backend, "collectives", None)
        if collectives is not None:
            collectives.record_fault(error)  # as check_errors: exiting now aborts the job instead of hanging
        raise error

    def async_error(self):
        """This rank's device error latched by an earlier call of any layer on the workspace
        (`symmring.kernels.AsyncErrorLatch`), as the named exception (returned, not raised), or None: a poll of
        host memory, no synchronisation and no collective (NCCL's ``ncclCommGetAsyncError``). A call still
        running on the device may latch one later."""
        self._check_open()
        return self.workspace.gpu.latched_error()

    def _stream(self, handle: int):
        """CuPy's view of a torch stream (cached: one object per stream handle)."""
        stream = self._streams.get(handle)
        if stream is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; kernels.as_stream uses it too
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._streams[handle] = _cupy().cuda.ExternalStream(handle)
        return stream

    # --- state, errors, teardown ----------------------------------------------------------------------

    def timeline_records(self, relative: bool = True) -> List[Dict]:
        """Device timestamps of the last ``forward(streaming=True, timeline=True)`` (synchronises): see
        `symmring.moe.gpu.timeline.records` (``relative=False``: the device clock's values)."""
        self._check_open()
        num_chunks, windows = self._timeline
        if not num_chunks:
            return []
        stamps = self._state.stamps[: timeline.num_stamps(num_chunks)].cpu().numpy().astype(np.int64)
        return timeline.records(stamps, num_chunks, windows, relative)

    def slot_view(self, name: str, num_tokens: int, slot: int = 0):
        """Zero-copy CuPy view of this rank's ring slot ``slot``'s payload ``name`` (``x``, ``x_sf``,
        ``topk_idx``, ``topk_weights``), its first ``num_tokens`` rows (for tests: what the producer
        kernels wrote)."""
        self._check_open()
        if name not in ("x", "x_sf", "topk_idx", "topk_weights"):
            raise ConfigError(f"name={name!r}: expected one of 'x', 'x_sf', 'topk_idx', 'topk_weights'")
        slot = check_int("slot", slot, 0)
        if slot >= self.num_slots:
            raise ConfigError(f"slot={slot}: expected < num_slots={self.num_slots}")
        num_tokens = check_int("num_tokens", num_tokens, 0)
        if num_tokens > self.tokens_per_slot:
            raise ConfigError(f"num_tokens={num_tokens}: expected at most tokens_per_slot={self.tokens_per_slot}")
        region = self.ring.layout[name]
        return self.backend.view(self.ring.alloc, self.rank, region.slot_offset(slot), region.dtype,
                                 (num_tokens,) + tuple(region.slot_shape[1:]))

    def check_errors(self) -> None:
        """Synchronise the device; raise `ProtocolTimeout` if a wait of this rank timed out, `PoolOverflow` (a
        `ProtocolViolation`) if the device counted more rows than the call's plan bounded, `ConfigError`
        if a routed expert id was outside ``[-1, num_experts)`` (the entry was skipped; the record is cleared,
        so the next valid call works), or `BackendError` if a peer's slot could not be read (no mapping and no
        staging ring: an internal inconsistency of the transports) or the expert GEMMs skipped pool rows that
        named no local expert (stale group ids; cleared like the expert id's record)."""
        self._check_open()
        self.ring.kernels.check_errors(synchronize=True)
        status = int(self._state.status.item())
        if status & stages.STATUS_BAD_EXPERT_ID:
            value, src, token, k = (int(v) for v in self._state.bad_id.tolist())
            self._state.status.fill_(status & ~stages.STATUS_BAD_EXPERT_ID)
            self._state.bad_id.zero_()
            torch = _torch()
            torch.cuda.synchronize()
            raise ConfigError(f"topk_idx: expert id {value} of token {token} (k={k}) on rank {src} is outside "
                              f"[-1, num_experts={self.num_experts}); that entry contributed nothing")
        skipped = _skipped_groups(self._state, self.rank, self.num_local_experts)
        if skipped is not None:
            raise skipped
        if status & stages.STATUS_NO_PEER_MAPPING:
            raise BackendError(f"rank {self.rank}: a peer's ring slot was readable neither through a P2P mapping "
                               f"nor from the staging ring (transports {self.transports}): an rdma peer without "
                               "a staging ring")

    def reset(self) -> None:
        """Collective: `symmring.Workspace.reset` (its rings, combine buffer, error state, failed steps and call
        count back to their first state, after any device error, failed step or diverged call: every layer on the
        workspace is usable again), and drop this layer's cached graphs (the other layers' graphs stay valid:
        the reset restores the state they were captured against)."""
        self._check_closed()
        self.clear_graph_cache()
        self.workspace.reset()

    def close(self) -> None:
        """Idempotent: drop the cached graphs; the layer refuses further calls. Its memory is the workspace's
        (`symmring.Workspace.close`, collective, or the context's close)."""
        if self.closed:
            return
        self.closed = True
        self.clear_graph_cache()


class CapturedCall:
    """One `MoE.forward` captured into a CUDA graph (`MoE.capture`): each `replay` is one more call of the
    layer, ordered after its previous call whatever stream either runs on.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph``.
    """

    def __init__(self, layer: MoE, graph, num_tokens: int, held=None):
        self.layer, self.graph, self.num_tokens = layer, graph, num_tokens
        self.held = held  # what the engines' captured launches hold while the graph lives (`capture_scope`)

    def replay(self) -> None:
        """Replay on the current stream, after the last call of any layer, and mark its end so the next call
        (eager or replayed, any stream) comes after it (`symmring.Workspace.replay`). No host synchronisation
        and no exchange: a device error already latched on this rank is raised (a poll of host memory) before
        anything is enqueued; a replay that meets one on the device returns NaN rows, and the next
        `symmring.Workspace.step` (or `forward` outside one) raises it on every rank.

        Raises:
            ConfigError: the workspace made its memory anew since the capture (a larger layer was built).
            ProtocolTimeout, ProtocolViolation (subclasses): this rank's latched device error (until `reset`)."""
        self.layer._check_closed()
        self.layer.workspace.replay(self.graph, num_tokens=self.num_tokens)
