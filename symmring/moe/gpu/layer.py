"""The expert-parallel MoE layer on GPUs (`GpuMoE`, `symmring.MoE` on the nvshmem backend): batch-ready by default,
streamed through the ring on request.

Every rank (PE) owns ``num_experts / world_size`` consecutive experts and its own tokens. One
`GpuMoE.forward` is one call of the ring protocol (`symmring.protocol`), enqueued on the current torch
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

The layer's parts, each reading the one below and never calling back up: the layer itself checks the call's
arguments and agrees the call with the other ranks (its token counts, its identity, every rank's verdict); the
spec (`symmring.moe.gpu.spec.GpuSpec`) is what it was built with, resolved and agreed once; the planner
(`symmring.moe.gpu.plan.Planner`) turns every rank's counts into a plan; the executor
(`symmring.moe.gpu.executor.Executor`) owns the memory views, kernels, streams, router and graph cache and runs
the plan (`symmring.moe.gpu.stages`).

Memory: the layer borrows a `symmring.Workspace` (``ctx.workspace()`` unless ``workspace=``): rings, combine
rows, expert pool, output rows, shared by every layer of the process. The pool holds one window under
uniform routing (and any routing of a 128-token call); a window with more rows runs in passes over it
(docs/PROTOCOL.md 9.1c), so no routing can overflow it; ``max_tokens`` (tokens per rank per call) is fixed at
construction and a larger batch is a ConfigError before anything is enqueued.

Errors: a device wait that times out (``SYMMRING_TIMEOUT_S``) writes the ring's error record and every
later kernel returns at once; `GpuMoE.check_errors` (which synchronises) raises the `ProtocolTimeout`. Without
a synchronisation (docs/PROTOCOL.md 10.2): the call's output is NaN, `GpuMoE.async_error` returns the error
latched in host memory, and the next `forward` outside a step, or the next `symmring.Workspace.step`, raises it
on every rank before enqueuing anything; `CapturedCall.replay` raises this rank's. Every call carries its
identity (call number and layer id, docs/PROTOCOL.md 3.2): in its exchange outside a step, in every meta row
inside one, so ranks whose call sequences diverged raise `CallMismatch` instead of pairing calls; a call refused
on one rank inside a step records ``peer_refused`` on its ring (`GpuMoE._refuse`). With ``SYMMRING_DEBUG=1``
every forward checks. After any device error, `GpuMoE.reset` (collective: `symmring.Workspace.reset`) makes every
layer of the workspace usable again.

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
from typing import Dict, List, Optional, Tuple

from ... import env
from ...backends.base import DeviceBackend
from ...errors import BackendError, BrokenStateError, ConfigError, RingClosedError
from .. import calls
from ..config import check_int, misplaced
from ..debug import Debug
from ..layer_base import LayerBase, borrow_workspace, spec_views
from ..spec import agree, check_sizes, check_values
from ..workspace_plan import LayerShape
from . import graph_cache as graph_cache_mod
from . import plan as plans
from .executor import Executor
from ..weights import check_tensor
from .inputs import check_logits, check_x, routing_source, this_device, torch_module
from .plan import STREAMING_MODES, Planner
from .router import Router
from .spec import check_gpu_sizes, resolve
from .stages import THREADS_PER_BLOCK

logger = logging.getLogger(__name__)

#: Stage names of ``layer.debug.forward(stage_events=...)``, in order (batch path).
STAGES = ("route", "layout", "dispatch", "experts", "combine")


class GpuMoE(LayerBase):
    """Expert-parallel MoE layer on GPU PEs (see the module docstring; the arguments: `symmring.MoE`).

    Args:
        ctx: a `symmring.context.Context` on a device backend (``nvshmem``).
        experts: ``w_gate``, ``w_up`` CUDA tensors ``[E/R, inter, hidden]``, ``w_down`` ``[E/R, hidden, inter]``:
            bf16, or fp8 e4m3 with block scales (``w_gate_scale``, ``w_up_scale``, ``w_down_scale``: float32
            ``[E/R, ceil(inter / 128), ceil(hidden / 128)]``, down ``[E/R, ceil(hidden / 128), ceil(inter / 128)]``,
            the checkpoints' ``weight_scale_inv``; `symmring.moe.weights`); ``hidden`` a multiple of 128 for
            fp8 dispatch (8 for bf16), ``inter`` of 8; ``expert_dtype``: ``"bf16"`` or ``"fp8"`` experts (None:
            what ``engine`` needs, else the weights' own format). Copied once into the fused L1 weight.
        routing: ``topk`` at most ``min(32, num_experts)``; ``bias`` a float tensor on this device.
        max_tokens: most tokens per rank per call.
        schedule: `symmring.moe.config.ScheduleConfig`: the ring (``num_slots`` x ``tokens_per_slot``; neither
            given: the workspace's chunk and enough slots for ``max_tokens``; only ``tokens_per_slot``: one slot),
            ``ack_policy``, ``expert_window``, ``x_format`` (default ``"fp8_e4m3"``), ``single_stream``,
            ``timeout_s``, ``policy`` (`symmring.moe.gpu.policy.StreamPolicy`), ``small_batch_tokens``,
            ``transport`` (`symmring.transport`; the result per rank: ``layer.transports``), ``graph_cache``.
        engine: the experts' GEMMs (`symmring.moe.engines.ENGINES`): ``"torch"`` (bf16), ``"builtin"``
            (Triton fp8), ``"deepgemm"`` (fp8, optional), ``"fused"`` (fp8, one persistent kernel: docs/FUSED.md),
            ``"auto"`` (DeepGEMM where it loads for fp8).
        workspace: the `symmring.Workspace` whose memory the layer borrows for each call (default:
            ``ctx.workspace()``, shared by every layer).

    Attributes:
        spec: the `symmring.moe.gpu.spec.GpuSpec` it runs with (its fields also read as the layer's:
            ``layer.hidden`` is ``layer.spec.hidden``); routing: the routing it runs (``routing.bias``: its
            float32 copy); engine, planner, executor, debug (`symmring.moe.debug.Debug`), last_plan.

    Raises:
        ConfigError: any bad argument, named, on every rank, before any symmetric memory is allocated.
        BackendError: the context is not on a device backend, torch is missing, or ``transport="p2p"`` with a
            peer that has no P2P mapping (named).
    """

    def __init__(self, ctx, experts, routing, *, max_tokens: int, schedule=None, engine: str = "auto",
                 workspace=None, **unexpected):
        if unexpected:  # e.g. a flat x_format=: name the value it belongs to
            raise misplaced(unexpected, "MoE")
        torch_module()  # a BackendError naming the extra, before anything else
        backend = getattr(ctx, "backend", None)
        if not isinstance(backend, DeviceBackend):
            raise BackendError(f"ctx: expected a context on a device backend ('nvshmem'), got "
                               f"{getattr(backend, 'name', ctx)!r}")
        ctx.check_open()
        self.ctx, self.backend, self.closed = ctx, backend, False
        self.device = this_device()
        self.workspace = borrow_workspace(ctx, workspace)
        spec, error = None, None
        try:
            spec, self.engine, routing, policy = self._resolve(experts, routing, schedule, max_tokens, engine)
        except (ConfigError, BackendError) as exc:
            error = exc
        # Once, before any allocation: a rank built with other sizes or options (or another layer id: a rank that
        # built another number of layers before) is a ConfigError naming it and the field, on every rank.
        agree(ctx.collectives, ctx.rank, spec, error, what="MoE")
        self.spec = spec
        self.workspace.new_layer_id()  # spec.layer_id, agreed
        self.layer_shape = LayerShape(spec.hidden, spec.inter, spec.num_experts, spec.topk, x_format=spec.x_format,
                                      expert_format=spec.pool_format)
        self.workspace.attach(self.layer_shape, spec.max_tokens)  # collective: allocates on first use
        bind_key = self.workspace.gpu.bind(self.layer_shape, num_slots=spec.num_slots,
                                           tokens_per_slot=spec.tokens_per_slot, transport=spec.transport,
                                           timeout_s=spec.timeout_s, align=spec.align)
        self.router = Router(routing)
        self.planner = Planner(spec, policy)
        self.executor = Executor(spec, self.workspace, bind_key, self.engine, self.router, self.device)
        self.debug = Debug(self.forward, self.executor)
        self.last_plan: Optional[plans.Plan] = None  # of the last forward (benchmarks and tests read it)
        self._follow_memory()
        backend.barrier()
        logger.info("MoE on rank %d/%d: experts [%d, %d) of %d, hidden %d, inter %d, top-%d, %s dispatch, %s experts "
                    "(engine %s), max_tokens %d, ring %d x %d tokens, %s ack, window %d, pool %d rows (%d bytes)",
                    spec.rank, spec.world_size, spec.expert_begin, spec.expert_begin + spec.num_local_experts,
                    spec.num_experts, spec.hidden, spec.inter, spec.topk, spec.x_format, spec.expert_dtype,
                    spec.engine, spec.max_tokens, spec.num_slots, spec.tokens_per_slot, spec.ack_policy.name.lower(),
                    spec.expert_window, self.executor.capacity, self.memory()["pool_bytes"])

    def _resolve(self, experts, routing, schedule, max_tokens, engine) -> Tuple:
        """``(spec, engine, routing, policy)`` of these arguments, every check made (nothing collective)."""
        from ..engines import ENGINES, make_engine
        from ..weights import expert_weights
        ctx = self.ctx
        experts, routing, schedule = check_values(experts, routing, schedule)
        max_tokens = check_sizes(experts, routing, schedule, max_tokens=max_tokens, world_size=ctx.world_size)
        check_gpu_sizes(experts, routing, schedule, ctx.world_size)
        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r}: expected one of {list(ENGINES)}")
        wanted = {"torch": "bf16", "builtin": "fp8", "deepgemm": "fp8", "fused": "fp8"}.get(engine)
        if experts.expert_dtype is not None and wanted is not None and experts.expert_dtype != wanted:
            raise ConfigError(f"expert_dtype={experts.expert_dtype!r} with engine={engine!r}: that engine runs "
                              f"{wanted} experts")
        if routing.bias is not None:  # the layer's float32 copy: what its calls route with
            check_tensor("routing.bias", routing.bias, None, (routing.num_experts,), self.device)
            routing = routing.with_bias(routing.bias.float().contiguous())
        weights = expert_weights(experts.w_gate, experts.w_up, experts.w_down,
                                 num_local_experts=experts.num_local_experts, hidden=experts.hidden,
                                 inter=experts.inter, device=self.device, expert_dtype=experts.expert_dtype or wanted,
                                 w_gate_scale=experts.w_gate_scale, w_up_scale=experts.w_up_scale,
                                 w_down_scale=experts.w_down_scale)
        built = make_engine(engine, weights)
        shape = LayerShape(experts.hidden, experts.inter, routing.num_experts, routing.topk,
                           x_format=schedule.x_format or "fp8_e4m3", expert_format=built.pool_format)
        spec = resolve(ctx, experts, routing, schedule, max_tokens=max_tokens, engine=built,
                       workspace_plan=self.workspace.preview(shape, max_tokens),
                       layer_id=self.workspace.next_layer_id,
                       graph_cache=graph_cache_mod.capacity(schedule.graph_cache))
        return spec, built, routing, schedule.policy

    def _follow_memory(self) -> Executor:
        """The executor, on the workspace's current memory (its views, and the planner's pool rows, follow
        the memory when the workspace made it anew: `Executor.follow_memory`)."""
        executor = self.executor
        if executor.follow_memory():
            self.planner.follow(executor.capacity)
        return executor

    # --- a call ---------------------------------------------------------------------------------------

    def forward(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None, streaming=False,
                small_batch: Optional[bool] = None, graph_cache: bool = True, **unexpected):
        """Run the layer on this rank's tokens (collective: every rank calls forward once per call, with
        the same ``streaming``). Outside a `symmring.Workspace.step` it exchanges every rank's token count
        with the other ranks (one bounded host exchange); inside one it exchanges nothing.

        Args:
            x: bf16 ``[n, hidden]`` on this rank's GPU, ``0 <= n <= max_tokens``.
            router_weight: bf16 ``[num_experts, hidden]`` (logits = ``x @ router_weight.T``), or
            logits: ``[n, num_experts]`` (any float dtype), or
            topk_idx / topk_weights: int32 / float32 ``[n, topk]`` routing (``-1`` = masked).
            streaming: False (batch-ready), True (chunked through the ring) or ``"auto"`` (the policy).
            small_batch: None (where it applies: `small_batch_applies`), True (force it: a ConfigError where it
                cannot run) or False (the general kernels).
            graph_cache: False: neither replay nor capture a cached graph (`symmring.moe.gpu.graph_cache`).

        Returns:
            bf16 ``[n, hidden]`` ``y``, a new tensor, enqueued on the current torch stream (no host sync); all NaN
            when a device error was pending at the call's end.

        Raises:
            ConfigError: bad tensors, routing sources or options (nothing enqueued): outside a step on every rank
                (the call's exchange carries every rank's verdict); inside a step on this rank, also for more
                tokens than the step declared or given routing in a step declared ``own_router=True``, and the
                call is refused (`_refuse`).
            CallMismatch: outside a step, the ranks are at different calls or layers (every rank; until `reset`).
            PeerTimeout: the ranks' token counts did not arrive within the host bound.
            BrokenStateError: an earlier host exchange failed (re-initialise), or a step failed (`reset`).
            ProtocolTimeout, ProtocolViolation: a device error of an earlier call latched on any rank
                (`async_error`; `ProtocolAborted` where another rank latched it), on every rank, before anything is
                enqueued, until `reset`; with ``SYMMRING_DEBUG=1`` also one of this call.
        """
        self._check_closed()
        executor, spec, workspace = self._follow_memory(), self.spec, self.workspace
        step = workspace.active_step
        kind, refusal = None, None
        try:
            workspace.check_open()  # a failed step or call: refused like a bad argument (every rank hears)
            x, kind, source = self._check_call(x, router_weight, logits, topk_idx, topk_weights, streaming,
                                               small_batch, graph_cache, unexpected)
        except (ConfigError, BrokenStateError) as exc:
            refusal = exc
        n = 0 if refusal is not None else int(x.shape[0])
        counts, distinct, latched = self._agree_call(step, n, kind, streaming, small_batch, refusal)
        # Every rank got the same list: every rank raises, nothing enqueued.
        calls.raise_latched(spec.rank, latched, workspace.gpu.decode_latched, self.backend)
        # Every rank plans for the same token bucket; this rank's exact count goes to the device.
        plan = self.last_plan = self.planner.plan(counts, streaming, small_batch, distinct)
        if plan.num_chunks == 0:  # every rank has zero tokens: no chunk, generation base unchanged
            torch = torch_module()
            return torch.empty((n, spec.hidden), dtype=torch.bfloat16, device=self.device)
        y = executor.execute(plan, x, kind, source, distinct=distinct, graph_cache=graph_cache,
                             in_step=step is not None)
        if env.debug():
            self.check_errors()
        return y

    __call__ = forward

    def _check_call(self, x, router_weight, logits, topk_idx, topk_weights, streaming, small_batch, graph_cache,
                    unexpected) -> Tuple:
        """`forward`'s arguments (and the call's hooks, `symmring.moe.debug`) checked on this rank (nothing
        enqueued, nothing exchanged): ``(x, kind, source)``, ``x`` with 16-byte aligned rows.

        Raises:
            ConfigError: the first bad argument, named."""
        if unexpected:
            raise misplaced(unexpected, "MoE.forward")
        spec = self.spec
        x = check_x(x, spec, self.device)
        if not isinstance(streaming, bool) and streaming != "auto":
            raise ConfigError(f"streaming={streaming!r}: expected one of {list(STREAMING_MODES)}")
        if small_batch not in (None, True, False):
            raise ConfigError(f"small_batch={small_batch!r}: expected None, True or False")
        if not isinstance(graph_cache, bool):
            raise ConfigError(f"graph_cache={graph_cache!r}: expected a bool")
        if small_batch and not spec.small_batch_capable:
            raise ConfigError("small_batch=True: the small-batch schedule needs fp8 dispatch and fp8 experts and at "
                              f"most {THREADS_PER_BLOCK} ranks (this layer: x_format={spec.x_format!r}, engine "
                              f"{spec.engine!r}, {spec.world_size} ranks)")
        hooks = self.executor.hooks
        if hooks is not None:
            self.executor.hooks = hooks.checked(streaming, "gpu")
        kind, source = routing_source(x, spec, self.device, router_weight, logits, topk_idx, topk_weights)
        return x, kind, source

    def _agree_call(self, step, n: int, kind: Optional[str], streaming, small_batch,
                    refusal: Optional[BaseException]) -> Tuple[List[int], bool, List]:
        """``(counts, distinct, latched)`` of this call, agreed with every rank (`symmring.moe.calls`): from ONE
        bounded exchange outside a step (every rank's count, router, latched device error, identity, verdict and
        ``streaming``/``small_batch``), from the step inside one (this rank's refusal then refuses the call,
        `_refuse`, so no rank pairs it with another). The call is then counted."""
        spec, workspace = self.spec, self.workspace
        if step is None:
            return calls.outside_step(workspace, rank=spec.rank, world_size=spec.world_size, layer_id=spec.layer_id,
                                      num_tokens=n, own_router=kind != "given", latched=workspace.gpu.latched(),
                                      options=(streaming, small_batch), refusal=refusal, what="MoE.forward")
        refusal = calls.inside_step(step, rank=spec.rank, num_tokens=n, given=kind == "given",
                                    max_tokens=spec.max_tokens, refusal=refusal)
        if refusal is not None:
            self._refuse(refusal)
        workspace.begin_call()
        return list(step.counts), step.distinct and kind != "given", [None] * spec.world_size

    def _refuse(self, error: BaseException) -> None:
        """Raise ``error``, this rank's refusal of a call inside a step, after telling every rank: the call is
        counted (`Workspace.refuse_call`: the step is failed and raised everywhere at the next entry) and its
        refusal recorded on the layer's ring (`Executor.refuse`)."""
        self.workspace.refuse_call(self.spec.layer_id, error)
        self.executor.refuse(self.spec.layer_id)
        raise error

    def capture(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None, streaming=False,
                small_batch: Optional[bool] = None, warmup: int = 1):
        """Capture one `forward` on these (static) tensors into a CUDA graph (collective): ``warmup`` eager calls
        first (real calls: every rank makes the same ones), then the capture. Each replay is one more call on
        every rank (generations from the device-resident base); refill ``x`` (and the routing tensors) in place
        between replays. The schedule is the capture's token bucket: the other ranks' counts may change up to
        it from replay to replay; this rank's is ``x``'s rows.

        Returns:
            ``(call, y)``: a `CapturedCall` (``call.replay()`` orders the replay after the layer's previous call,
            eager or replayed, and raises a latched device error; a bare ``call.graph.replay()`` does neither)
            and its static output tensor.

        Raises:
            ConfigError: as `forward`.

        Example:
            >>> call, y = moe.capture(x, router_weight=router, streaming=True)  # doctest: +SKIP
            >>> x.copy_(next_batch); call.replay(); use(y)  # doctest: +SKIP
        """
        torch = torch_module()
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
        # Outside a step the graph writes its own token count (`DeviceMemory.record_call_tokens`); a step's graph reads
        # the count each replay sets first.
        own_count = self.workspace.active_step is None
        with capture_scope() as held, self.workspace.capture(graph):
            y = self.forward(x, **kwargs)
        return CapturedCall(self, graph, int(x.shape[0]), held, own_count=own_count), y

    # --- what the layer answers without a call ------------------------------------------------------------

    def route(self, logits) -> Tuple:
        """The layer's routing of router ``logits`` ``[n, num_experts]`` (any float dtype, on the layer's device):
        ``(topk_idx int32, topk_weights float32)`` ``[n, topk]``, enqueued on the current stream, as every
        `forward` given ``logits`` or ``router_weight`` routes. Not collective; touches no ring state.

        Raises:
            ConfigError: ``logits`` not a 2-D ``[n, num_experts]`` tensor on the layer's device.
        """
        self._check_open()
        if not isinstance(logits, torch_module().Tensor) or logits.dim() != 2:
            raise ConfigError(f"logits: expected a 2-D tensor [n, num_experts={self.spec.num_experts}], got "
                              f"{getattr(logits, 'shape', type(logits).__name__)}")
        check_logits(logits, int(logits.shape[0]), self.spec, self.device)
        executor = self._follow_memory()
        stream = executor.stream(torch_module().cuda.current_stream().cuda_stream)
        return self.router.route(executor.kernels, stream, None, "logits", logits)

    def streams(self, streaming, num_tokens: int) -> bool:
        """Whether a call whose largest rank has ``num_tokens`` tokens runs the streamed schedule (`Planner.streams`).

        Raises ConfigError for a ``streaming`` that is not one of `STREAMING_MODES`."""
        return self.planner.streams(streaming, num_tokens)

    def small_batch_applies(self, counts: List[int], streaming: bool, bucket: Optional[List[int]] = None) -> bool:
        """Whether a call with every rank's token ``counts`` runs the small-batch schedule by default
        (`Planner.small_batch_applies`)."""
        self._follow_memory()
        return self.planner.small_batch_applies(counts, streaming, bucket)

    def memory(self) -> Dict[str, int]:
        """Device bytes this layer's calls use on this PE, all of them the workspace's (shared with every layer
        on it; `symmring.Workspace.memory` has the regions): ``pool_bytes`` (this shape's view of the expert
        pool: its rows, their scales, sources, routing weights and group ids), ``heap_bytes`` (symmetric: the
        ring, the combine buffer, the staging ring and the experts' region) and ``weight_bytes`` (the layer's
        own experts and their scales)."""
        return self._follow_memory().memory_bytes()

    def graph_cache_info(self) -> Dict[str, int]:
        """The cache of captured calls: ``entries``, ``capacity``, ``hits`` (eager calls that replayed),
        ``captures``, ``evictions``, ``failures``, ``retries`` (`symmring.moe.gpu.graph_cache.GraphCache.info`)."""
        return self.executor.graphs.info()

    def refresh_weights(self) -> None:
        """After overwriting the expert weights in place (the tensors of ``layer.engine.weights``): let the
        engine re-derive what it keeps beside them (`ExpertEngine.refresh_weights`) and drop the cached graphs,
        which address the former ones. `symmring.moe.integrations.module.MoEModule.load_state_dict` calls it."""
        self.engine.refresh_weights()
        self.clear_graph_cache()

    def clear_graph_cache(self) -> None:
        """Drop every cached graph (synchronises first, so no replay of theirs is in flight); later calls
        capture again."""
        self.executor.clear_graphs()

    def async_error(self):
        """This rank's device error latched by an earlier call of any layer on the workspace
        (`symmring.kernels.AsyncErrorLatch`), as the named exception (returned, not raised), or None: a poll of
        host memory, no synchronisation and no collective (NCCL's ``ncclCommGetAsyncError``)."""
        self._check_open()
        return self.workspace.gpu.latched_error()

    def slot_view(self, name: str, num_tokens: int, slot: int = 0):
        """Zero-copy CuPy view of this rank's ring slot ``slot``'s payload ``name`` (``x``, ``x_sf``,
        ``topk_idx``, ``topk_weights``), its first ``num_tokens`` rows (for tests: what the producers wrote)."""
        self._check_open()
        return self._follow_memory().slot_view(name, num_tokens, slot)

    # --- errors, teardown -----------------------------------------------------------------------------

    def check_errors(self) -> None:
        """Synchronise the device; raise `ProtocolTimeout` if a wait of this rank timed out, `PoolOverflow` (a
        `ProtocolViolation`) if the device counted more rows than the call's plan bounded, `ConfigError`
        if a routed expert id was outside ``[-1, num_experts)`` (the entry was skipped; the record is cleared,
        so the next valid call works), or `BackendError` if a peer's slot could not be read (no mapping and no
        staging ring), the expert GEMMs skipped pool rows that named no local expert (cleared likewise) or the
        expert engine's kernels recorded an error (`ExpertEngine.check_status`: the fused kernel's L2 tiles whose
        wait for their L1 items expired, written NaN; cleared likewise)."""
        self._check_open()
        self._follow_memory().check_errors()

    def reset(self) -> None:
        """Collective: `symmring.Workspace.reset` (every layer on the workspace usable again after any device
        error, failed step or diverged call), and drop this layer's cached graphs."""
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

    # What the executor and planner hold, read as the layer's (tests, benchmarks, the torch module).
    routing = property(lambda self: self.router.routing, doc="The routing the layer runs (its float32 bias).")
    bias = property(lambda self: self.router.routing.bias, doc="The layer's float32 copy of the routing bias.")
    policy = property(lambda self: self.planner.policy, doc="The `StreamPolicy` of ``streaming='auto'``.")
    capacity = property(lambda self: self._follow_memory().capacity, doc="Rows of the expert pool.")
    ring = property(lambda self: self._follow_memory().ring, doc="The `DeviceRing` of this layer's ring spec.")
    transports = property(lambda self: self._follow_memory().ring.transports,
                          doc="How this PE reaches each rank ('self', 'p2p', 'rdma'; `symmring.transport`).")


class CapturedCall:
    """One `GpuMoE.forward` captured into a CUDA graph (`GpuMoE.capture`): each `replay` is one more call of the
    layer, ordered after its previous call whatever stream either runs on.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph``.
    """

    def __init__(self, layer: GpuMoE, graph, num_tokens: int, held=None, own_count: bool = False):
        self.layer, self.graph, self.num_tokens = layer, graph, num_tokens
        self.held = held  # what the engines' captured launches hold while the graph lives (`capture_scope`)
        # The graph writes its token count itself (captured outside a step): a replay sets none first, which would be
        # one more kernel, and a host launch, before the graph's (the decode call's fixed cost).
        self.own_count = own_count

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
        self.layer.workspace.replay(self.graph, num_tokens=None if self.own_count else self.num_tokens)


spec_views(GpuMoE, ("expert_window", "batch_window", "small_batch_tokens", "small_batch_capable", "expert_dtype",
                    "single_stream", "max_chunks"))

#: The name this layer had before `symmring.MoE` chose it by backend (kept: ``symmring.moe.gpu.MoE``).
MoE = GpuMoE

__all__ = ["GpuMoE", "MoE", "CapturedCall", "STAGES", "STREAMING_MODES"]
