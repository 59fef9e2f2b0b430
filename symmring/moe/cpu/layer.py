"""The expert-parallel MoE layer on the host backend (`ExpertParallelMoE`, `symmring.MoE` on ``host``): a
batch-ready path and a streamed path through the chunk ring, in MPI shared memory.

It takes what the GPU layer takes (`symmring.MoE`: ``ctx``, `Experts`, `RoutingConfig`, ``max_tokens``, a
`ScheduleConfig`, ``workspace``), makes and agrees its spec the same way (`symmring.moe.spec`) and agrees each
call the same way (`symmring.moe.calls`); the GPU-only options (`ScheduleConfig.GPU_ONLY`, the fp8 scales,
``expert_dtype``, ``engine``) are refused, named. `symmring.moe.cpu.executor` runs each call.

Experts are split evenly over the ranks: rank ``q`` owns experts ``[q*E/R, (q+1)*E/R)``. Every rank is a
*producer* of its own tokens and a *consumer* of every rank's tokens routed to its experts.

Data flow of one chunk ``c`` (generation ``g`` of the ring, combine generation ``cg``)::

    producer r   route + quantise rows [c*T, c*T + n) of its x
                 acquire_slot -> write_route -> publish_route -> write_layout -> publish_layout
    consumer q   wait_ready(c, r) for every r; read each r's topk_idx, pull the rows routed to q's experts
                 (x, x_sf): chunk-local expert pools
                 [EARLY: ack(c, r) for every r]
                 L1 (gate, up) -> SwiGLU -> L2 for every pulled (token, k), per local expert
                 write each output into r's combine buffer at [token_base + row, k]   (a remote store)
                 fence; combine_gen[q] on r := cg                                     (release)
                 [CONSERVATIVE: ack(c, r) for every r]
    owner r      wait combine_gen[q] >= cg for every q (acquire); y[rows] = sum_k w * out, k in order

The **batch-ready** path (the default, and ``streaming="auto"``: the CPU layer has no measured policy) is one
chunk holding the whole batch in a 1-slot ring sized to the largest token count over the ranks (agreed in the
call's exchange). The **streamed** path moves ``tokens_per_slot``-token chunks through a ``num_slots`` ring
(the schedule's; defaults 64, at most ``max_tokens``, and 2) in `protocol.enqueue_order` (the producer runs
``num_slots - 1`` chunks ahead; ``layer.debug.forward(..., lookahead=...)`` fewer); every rank runs the same
chunk count, so ranks with fewer (or zero) tokens still publish zero-token chunks and every consumer still
acknowledges them.

The combine buffer is a separate symmetric allocation: ``combine_gen`` (one 64-bit word per consumer
rank) then ``out`` float32 ``[capacity, K, H]`` indexed by the owner's logical token row. Its generations
come from the layer's own counter (they only grow, over chunks, calls, and both paths), so an owner waits
with ``>=``: a consumer that already signalled a later chunk has finished the earlier ones (it handles
chunks in order and releases after its writes). A row is overwritten only in a later call, after the
consumer pulled the owner's new chunk, which the owner published after finishing the previous call's
reduce: no combine row is rewritten while its owner still reads it.

Why the two paths agree bitwise: each token's routing, quantisation, expert arithmetic and combine are
evaluated with row-independent operations (`reference.row_matmul`, `swiglu`, `select_topk`,
`combine_rows`, `quant`; see `symmring.moe.reference`), in the fixed order ``k = 0..K-1``; so the result
of a token does not depend on which chunk, pool or batch it was computed in.

Every argument is validated on every rank and the verdicts are exchanged (`ConfigError` on all ranks,
naming the rank and the argument) before any shared memory is touched, so a rejected call leaves the
rings usable and no rank waits for a rank that gave up. Every call carries its identity
(`symmring.protocol.call_identity`: the workspace's call number and the layer's id, agreed at construction):
exchanged with the token counts outside a model step (ranks whose call sequences diverged get a
`CallMismatch` on every rank before any ring work), and inside one written into every meta row and checked
by every consumer (`Ring.check_meta`), so no rank ever reads another call's rows. A call refused inside a
step (its arguments failed on this rank alone) counts as a call there (`symmring.Workspace.refuse_call`):
the other ranks' calls then fail by the identity check or a bounded timeout, and every rank raises at the
next step's entry. Every exchange is a bounded collective of the
context (`symmring.collective`): a late or vanished rank is a `PeerTimeout` naming it within
``timeout_s``; a wait that expires inside a call leaves the layer refusing further calls
(`BrokenStateError`) until it is closed and rebuilt.

Arrays may be NumPy arrays or torch CPU tensors (converted at the boundary without a copy, `as_numpy`; bf16
and float16 tensors as float32, exactly); the layer computes in float32 (float64 accumulation) and
`ExpertParallelMoE.forward` returns what ``x`` was: a bf16 tensor for bf16 ``x`` (rounded once), a float32
tensor for a float32 one, a float32 NumPy array for an array.

``SYMMRING_DEBUG=1`` adds checks after every call (`ExpertParallelMoE.forward`), as the GPU layer checks
its device error records: this rank's ring words (``gen_base``, the ready generations and metadata of
every slot the call used) hold what the call published, every consumer's acknowledgement of this
rank's slots arrives within ``timeout_s`` (so the next call's producer will not time out), every
consumer's combine signal is at the call's last generation, and the output is finite. A failed check
raises `SymmringError` (`ProtocolTimeout` for a missing acknowledgement).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from typing import Tuple

import numpy as np

from ... import env, protocol
from ...errors import BackendError, BrokenStateError, ConfigError, RingClosedError, SymmringError
from ...layout import RingSpec
from .. import calls, quant
from ..config import RoutingConfig, misplaced
from ..debug import Debug
from ..layer_base import LayerBase, borrow_workspace
from ..reference import check_routing, route
from ..spec import LayerSpec, agree, check_sizes, check_values, timeout_of
from ..workspace_plan import LayerShape
from .executor import ForwardStats, HostEngine, HostExecutor

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MoEShapes:
    """Global shapes of an MoE layer.

    Args:
        hidden: channels of ``x``.
        num_experts: experts over all ranks.
        num_topk: experts per token.
        x_format: ``"fp8_e4m3"`` or ``"bf16"``: what the ring carries.
        sf_group_size: channels per fp8 scale.

    Raises:
        ConfigError: a bad field (checked by building the equivalent `RingSpec`).
    """

    hidden: int
    num_experts: int
    num_topk: int
    x_format: str = "fp8_e4m3"
    sf_group_size: int = quant.DEFAULT_GROUP_SIZE

    def __post_init__(self):
        self.ring_spec(1, 1)  # validates every field with RingSpec's rules

    def ring_spec(self, num_slots: int, tokens_per_slot: int) -> RingSpec:
        """The `RingSpec` of a ring of these shapes."""
        return RingSpec(num_slots=num_slots, tokens_per_slot=tokens_per_slot, hidden=self.hidden,
                        num_topk=self.num_topk, num_experts=self.num_experts, x_format=self.x_format,
                        sf_group_size=self.sf_group_size)

    @classmethod
    def of(cls, spec_or_shapes) -> "MoEShapes":
        """`MoEShapes` from a `MoEShapes`, a `RingSpec` or a dict of the fields."""
        if isinstance(spec_or_shapes, MoEShapes):
            return spec_or_shapes
        if isinstance(spec_or_shapes, RingSpec):
            s = spec_or_shapes
            return cls(s.hidden, s.num_experts, s.num_topk, s.x_format, s.sf_group_size)
        if isinstance(spec_or_shapes, dict):
            try:
                return cls(**spec_or_shapes)
            except TypeError as exc:
                raise ConfigError(f"spec_or_shapes={spec_or_shapes!r}: {exc}") from None
        raise ConfigError(f"spec_or_shapes={spec_or_shapes!r}: expected a MoEShapes, a RingSpec or a dict")


def local_experts(rank: int, world_size: int, num_experts: int) -> range:
    """Experts owned by ``rank``: ``[rank*E/R, (rank+1)*E/R)``.

    Raises:
        ConfigError: ``num_experts`` is not a multiple of ``world_size``.

    Example:
        >>> local_experts(1, 4, 16)
        range(4, 8)
    """
    if num_experts % world_size:
        raise ConfigError(f"num_experts={num_experts}: expected a multiple of the number of ranks "
                          f"{world_size} (experts are split evenly)")
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def as_numpy(name: str, value):
    """``value`` as a NumPy array if it is a torch CPU tensor (zero-copy: the array shares its memory);
    anything else unchanged. Returns ``(value, was_torch)``.

    Raises:
        ConfigError: a torch tensor on another device, or of a dtype NumPy has no equivalent of (bf16).

    Example:
        >>> as_numpy("x", np.zeros(2, np.float32))[1]
        False
    """
    torch = sys.modules.get("torch")  # a torch tensor exists only if torch was imported
    if torch is None or not isinstance(value, torch.Tensor):
        return value, False
    if value.device.type != "cpu":
        raise ConfigError(f"{name}: a torch tensor on {value.device}; expected a CPU tensor or a NumPy array "
                          "(symmring.moe.gpu.MoE is the layer for GPU tensors)")
    try:
        return value.detach().numpy(), True
    except (TypeError, RuntimeError) as exc:
        raise ConfigError(f"{name}.dtype={value.dtype}: expected a dtype NumPy has (the CPU layer computes in "
                          f"float32; convert with .float()): {exc}") from None


class ExpertParallelMoE(LayerBase):
    """The expert-parallel MoE layer on the host backend (see the module docstring; the arguments: `symmring.MoE`).

    Args:
        ctx: a `symmring.Context` on the host backend (collective constructor).
        experts: `symmring.moe.config.Experts` of this rank's experts: ``w_gate``, ``w_up`` ``[E/R, inter,
            hidden]`` and ``w_down`` ``[E/R, hidden, inter]``, float32 NumPy arrays or float torch CPU tensors
            (bf16 for `symmring.moe.integrations.module.MoEModule`, which registers the layer's copies).
        routing: a `symmring.moe.config.RoutingConfig` (``bias``: a float tensor, array or sequence).
        max_tokens: most tokens per rank per call.
        schedule: a `symmring.moe.config.ScheduleConfig`: ``num_slots`` (default 2), ``tokens_per_slot`` (64, at
            most ``max_tokens``) and ``ack_policy`` of streamed calls, ``x_format`` (what the ring carries:
            ``"bf16"``, the default here, or ``"fp8_e4m3"``), ``timeout_s``; its GPU-only fields at their defaults.
        engine: ``"auto"`` (the CPU layer has one).
        workspace: the `symmring.Workspace` whose rings, combine buffer and pool it borrows (default: the
            context's own). Its pool holds ``workspace.pool_rows(...)`` rows: a chunk whose arrivals exceed them
            runs in more passes.

    Attributes:
        spec: the `symmring.moe.spec.LayerSpec` it runs with (its fields also read as the layer's); routing: the
        routing it runs (``routing.bias``: its float32 copy, read in place); engine (`HostEngine`: the
        weights); executor (`HostExecutor`); last_stats (`ForwardStats` of the last call); debug
        (`symmring.moe.debug.Debug`: ``lookahead``).

    Raises:
        ConfigError: on every rank, any rank's bad argument (named), or one of the GPU layer's options.
        BackendError: the context is not on the host backend.

    Example:
        >>> import numpy as np, symmring
        >>> from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig
        >>> ctx = symmring.init("host")
        >>> rng = np.random.default_rng(0)
        >>> wg, wu = (rng.standard_normal((4, 32, 128), dtype=np.float32) / 11 for _ in range(2))
        >>> wd = rng.standard_normal((4, 128, 32), dtype=np.float32) / 6
        >>> layer = ExpertParallelMoE(ctx, Experts(wg, wu, wd), RoutingConfig(4, 2), max_tokens=16,
        ...                           schedule=ScheduleConfig(tokens_per_slot=3))
        >>> x = rng.standard_normal((10, 128), dtype=np.float32)
        >>> router = rng.standard_normal((4, 128), dtype=np.float32)
        >>> y = layer.forward(x, router_weight=router)
        >>> bool(np.array_equal(y, layer.forward(x, router_weight=router, streaming=True)))
        True
        >>> layer.close(); ctx.close()
    """

    def __init__(self, ctx, experts, routing, *, max_tokens: int, schedule=None, engine: str = "auto",
                 workspace=None, **unexpected):
        if unexpected:  # e.g. a flat x_format= or max_tokens_per_rank=: name the value it belongs to
            raise misplaced(unexpected, "MoE")
        if getattr(getattr(ctx, "backend", None), "name", None) != "host":
            raise BackendError(f"ctx: expected a context on the host backend, got "
                               f"{getattr(getattr(ctx, 'backend', None), 'name', ctx)!r} (symmring.MoE picks the "
                               "layer of the context's backend)")
        ctx.check_open()
        self.ctx, self.closed, self.hooks = ctx, False, None
        self.num_calls = 0  #: forward calls that ran on this rank (each one collective)
        self.workspace = borrow_workspace(ctx, workspace)
        spec, error = None, None
        try:
            spec, self.engine, routing = self._resolve(experts, routing, schedule, max_tokens, engine)
        except ConfigError as exc:
            error = exc
        agree(ctx.collectives, ctx.rank, spec, error, what="MoE")
        self.spec = spec
        self.workspace.new_layer_id()  # spec.layer_id, agreed
        #: The routing this layer runs (``routing.bias``: its float32 copy, the module's buffer; read in place).
        self.routing = routing
        self.layer_shape = LayerShape(spec.hidden, spec.inter, spec.num_experts, spec.topk, x_format=spec.x_format,
                                      expert_format="bf16")
        self.workspace.attach(self.layer_shape, spec.max_tokens)
        self.executor = HostExecutor(ctx, spec, self.workspace, self.layer_shape, self.engine)
        self.debug = Debug(self.forward, self)
        log.info("ExpertParallelMoE on rank %d/%d: experts [%d, %d) of %d, hidden %d, inter %d, top-%d %s, x as %s, "
                 "ring %d x %d tokens, timeout %g s%s", spec.rank, spec.world_size, spec.expert_begin,
                 spec.expert_begin + spec.num_local_experts, spec.num_experts, spec.hidden, spec.inter, spec.topk,
                 routing.scoring, spec.x_format, spec.num_slots, spec.tokens_per_slot, spec.timeout_s,
                 "; SYMMRING_DEBUG checks after every call" if env.debug() else "")

    def _resolve(self, experts, routing, schedule, max_tokens, engine) -> Tuple:
        """``(spec, engine, routing)`` of these arguments, every check made (nothing collective)."""
        ctx = self.ctx
        experts, routing, schedule = check_values(experts, routing, schedule)
        max_tokens = check_sizes(experts, routing, schedule, max_tokens=max_tokens, world_size=ctx.world_size)
        gpu_only = (["engine"] if engine != "auto" else []) + [f"experts.{n}" for n in experts.gpu_only_set()] \
            + [f"schedule.{n}" for n in schedule.gpu_only_set()]
        if gpu_only:
            raise ConfigError(f"{', '.join(gpu_only)}: options of the GPU layer (symmring.moe.gpu.GpuMoE); the CPU "
                              "layer (host backend) computes in float32 and takes schedule.x_format, num_slots, "
                              "tokens_per_slot, ack_policy, timeout_s and the routing")
        engine = HostEngine(experts.w_gate, experts.w_up, experts.w_down, hidden=experts.hidden)
        routing = self._own_bias(routing)
        x_format = schedule.x_format or "bf16"
        # Route zero tokens once: checks bias and routed_scaling_factor with select_topk's own rules.
        route(np.zeros((0, experts.hidden), np.float32), routing.topk, routing.num_experts,
              logits=np.zeros((0, routing.num_experts), np.float32), **_route_options(routing))
        spec = LayerSpec(rank=ctx.rank, world_size=ctx.world_size, num_experts=routing.num_experts, topk=routing.topk,
                         hidden=experts.hidden, inter=experts.inter, max_tokens=max_tokens,
                         num_slots=2 if schedule.num_slots is None else schedule.num_slots,
                         tokens_per_slot=min(64, max_tokens) if schedule.tokens_per_slot is None
                         else schedule.tokens_per_slot, ack_policy=schedule.ack_policy, x_format=x_format,
                         timeout_s=timeout_of(schedule, ctx), routing=routing.key(),
                         layer_id=self.workspace.next_layer_id)
        MoEShapes(spec.hidden, spec.num_experts, spec.topk, x_format)  # RingSpec's checks of the ring's shapes
        return spec, engine, routing

    @staticmethod
    def _own_bias(routing: RoutingConfig) -> RoutingConfig:
        """``routing`` with its bias as the layer's own contiguous float32 copy (a torch tensor for a tensor: the
        module's buffer, which a load updates in place; a NumPy array otherwise), or as it is without one."""
        bias = routing.bias
        if bias is None:
            return routing
        if hasattr(bias, "detach"):
            if not bias.is_floating_point():
                raise ConfigError(f"routing.bias.dtype={bias.dtype}: expected a float tensor [num_experts]")
            import torch
            return routing.with_bias(bias.detach().to("cpu", torch.float32).contiguous().clone())
        return routing.with_bias(np.array(bias, dtype=np.float32))

    # --- a call ---------------------------------------------------------------------------------------

    def forward(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None, streaming=False,
                **unexpected):
        """The layer on this rank's tokens (collective: every rank calls it once per call, with its own tokens).

        Args:
            x: ``[num_tokens, hidden]``: a float32 NumPy array, or a float32 or bf16 torch CPU tensor
                (``num_tokens`` may differ between ranks and may be 0, at most ``max_tokens``).
            router_weight / logits / (topk_idx, topk_weights): exactly one routing source: ``[E, hidden]``;
                ``[num_tokens, E]``; int32 / float32 ``[num_tokens, K]`` (-1 masked).
            streaming: False (batch-ready) or ``"auto"`` (the same), True (the schedule's chunks through its ring).

        Returns:
            ``[num_tokens, hidden]``: this rank's output rows in its input order, as ``x`` was (module docstring).

        Raises:
            ConfigError: on every rank, before any shared-memory work, when any rank's arguments are bad (named),
                or the ranks call with another ``streaming``. Inside a `symmring.Workspace.step` the call exchanges
                nothing: its arguments are checked on this rank only, more tokens than the step declared or given
                routing in an ``own_router=True`` step is a ConfigError, and the call, refused so, still counts as
                a call and fails the step (`symmring.Workspace.refuse_call`).
            CallMismatch: the ranks' call sequences diverged (outside a step, on every rank before any ring work;
                inside one, from a slot's meta row: no row of the other call is used).
            ProtocolTimeout: a wait exceeded ``timeout_s``; the workspace then refuses further calls
                (`BrokenStateError`) until `symmring.Workspace.reset` (collective).
            PeerTimeout: a rank did not reach the call's exchange within the context's bound (named).
            BrokenStateError: an earlier call failed part-way on some rank, or the context is broken.
            RingClosedError: the layer or its context is closed.
        """
        self._check_closed()
        start_s = time.perf_counter()
        spec, ws = self.spec, self.workspace
        kind, out, route_rows, options, refusal = None, None, None, None, None
        try:
            ws.check_open()  # a workspace left unknown by a failed call or step: refused like a bad argument
            x, out, kind, route_rows, options = self._check_call(x, router_weight, logits, topk_idx, topk_weights,
                                                                 streaming, unexpected)
        except (ConfigError, BrokenStateError) as exc:
            refusal = exc
        num_tokens = 0 if refusal is not None else x.shape[0]
        call_id = ws.call_identity(spec.layer_id)
        if ws.active_step is None:
            counts, _, _ = calls.outside_step(ws, rank=spec.rank, world_size=spec.world_size, layer_id=spec.layer_id,
                                              num_tokens=num_tokens, own_router=kind != "given", latched=None,
                                              options=options, refusal=refusal, what="MoE.forward")
        else:
            refusal = calls.inside_step(ws.active_step, rank=spec.rank, num_tokens=num_tokens, given=kind == "given",
                                        max_tokens=spec.max_tokens, refusal=refusal)
            if refusal is not None:
                ws.refuse_call(spec.layer_id, refusal)
                raise refusal
            ws.begin_call()
            counts = list(ws.active_step.counts)  # a rank may bring fewer: its last chunks are zero-token chunks
        y = self._run(x, counts, route_rows, options, call_id)
        self.num_calls += 1
        self.executor.stats.elapsed_s = time.perf_counter() - start_s
        return out(y)

    __call__ = forward

    def _check_call(self, x, router_weight, logits, topk_idx, topk_weights, streaming, unexpected) -> Tuple:
        """`forward`'s arguments (and the call's hooks) checked on this rank, before any shared-memory work:
        ``(x, out, kind, route_rows, options)``: ``x`` as float32 NumPy, ``out`` turning the float32 result into
        what ``x`` was, the routing source's kind, ``route_rows(rows)`` giving the routing of those rows, and the
        call's options every rank must share (``(streamed, lookahead)``).

        Raises:
            ConfigError: the first bad argument, named (the caller's shapes, not a validation slice)."""
        if unexpected:
            raise misplaced(unexpected, "MoE.forward")
        spec = self.spec
        x, out = _input_x(x)
        router_weight, logits = (_as_float32_tensor(v) for v in (router_weight, logits))
        (router_weight, _), (logits, _), (topk_idx, _), (topk_weights, _) = (
            as_numpy(n, v) for n, v in (("router_weight", router_weight), ("logits", logits), ("topk_idx", topk_idx),
                                        ("topk_weights", topk_weights)))
        quant._check_x(x)
        if x.shape[1] != spec.hidden:
            raise ConfigError(f"x.shape={x.shape}: expected [num_tokens, hidden={spec.hidden}]")
        if x.shape[0] > spec.max_tokens:
            raise ConfigError(f"x.shape[0]={x.shape[0]}: expected at most max_tokens={spec.max_tokens}")
        sources = dict(router_weight=router_weight, logits=logits, topk_idx=topk_idx, topk_weights=topk_weights)
        # The whole source as the caller passed it (messages name its shape): types, shapes, expert ids, values.
        check_routing(x.shape[0], spec.hidden, spec.topk, spec.num_experts, **sources)
        if not (streaming is True or streaming is False or (isinstance(streaming, str) and streaming == "auto")):
            raise ConfigError(f"streaming={streaming!r}: expected one of [False, True, 'auto']")
        streamed = streaming is True
        lookahead = protocol.default_lookahead(spec.num_slots) if streamed else 0
        if self.hooks is not None:
            hooks = self.hooks.checked(streaming, "cpu")
            if hooks.lookahead is not None:
                try:
                    protocol.check_lookahead(hooks.lookahead, spec.num_slots)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
                lookahead = hooks.lookahead
        per_token = ("logits", "topk_idx", "topk_weights")
        options = _route_options(self.routing)

        def route_rows(rows: slice):
            # Per-token sources are cut to ``rows`` (checked whole above: chunks route their own rows).
            cut = {k: (v[rows] if k in per_token and v is not None else v) for k, v in sources.items()}
            return route(x[rows], spec.topk, spec.num_experts, **options, **cut)[:2]

        kind = "given" if topk_idx is not None else "router"
        return x, out, kind, route_rows, (streamed, lookahead)

    def _run(self, x, counts, route_rows, options, call_id: int):
        """The agreed call on the workspace's ring of its shape (batch: one slot holding the whole batch)."""
        spec, ws = self.spec, self.workspace
        streamed, lookahead = options
        most = max(counts)
        if streamed:
            num_slots, tokens_per_slot = spec.num_slots, spec.tokens_per_slot
            num_chunks = protocol.call_num_chunks(counts, tokens_per_slot)
        else:
            # Batch-ready: one slot whose single chunk is the whole batch (at least one row, even when every rank
            # has zero tokens: the chunk is still published and acknowledged).
            num_slots, tokens_per_slot, num_chunks, lookahead = 1, max(1, most), 1, 0
        ring_spec = RingSpec(num_slots=num_slots, tokens_per_slot=tokens_per_slot, hidden=spec.hidden,
                             num_topk=spec.topk, num_experts=spec.num_experts, x_format=spec.x_format)
        ring = ws.host.ring(ring_spec, spec.ack_policy, spec.timeout_s, exact=streamed)
        ws.host.ensure_combine(max(most, spec.max_tokens, 1) * spec.topk * spec.hidden * 4)
        self.executor.stats = ForwardStats(streaming=streamed, num_chunks=num_chunks, num_slots=num_slots,
                                           tokens_per_slot=ring.spec.tokens_per_slot, num_tokens=x.shape[0])
        try:
            return self.executor.run(ring, num_chunks, x, route_rows, spec.ack_policy, lookahead, call_id)
        except SymmringError as exc:
            # The call stopped part-way (a wait expired, another call's payload): the ranks' rings and combine
            # counters now disagree, so no later call may run on them (nor on any layer of this workspace)
            # until the workspace's reset (collective).
            ws.failure = exc
            raise

    # --- the module's side (symmring.moe.integrations.module) ------------------------------------------------

    def refresh_weights(self) -> None:
        """Re-derive the float64 operands from ``engine.weights`` (after an in-place load of its tensors)."""
        self.engine.refresh_weights()

    def clear_graph_cache(self) -> None:
        """Nothing to drop: the CPU layer captures no graphs (the GPU layer's method, for the module)."""

    last_stats = property(lambda self: self.executor.stats, doc="`ForwardStats` of the last call on this rank.")
    bias = property(lambda self: self.routing.bias, doc="The layer's float32 copy of the routing bias, or None.")
    #: `HostLayer` wrapped this layer as ``.layer``; the layer is that now (kept for code written against it).
    layer = property(lambda self: self)

    @property
    def device(self):
        """``torch.device("cpu")`` (where the module's tensors live)."""
        import torch
        return torch.device("cpu")

    def close(self) -> None:
        """Idempotent: the layer refuses further calls. Its memory is the workspace's (`Workspace.close`)."""
        self.closed = True

    def _check_closed(self) -> None:
        if self.closed:
            raise RingClosedError(f"{self!r} was closed")
        self.ctx.check_open()

    def __repr__(self) -> str:
        spec = getattr(self, "spec", None)
        if spec is None:
            return "ExpertParallelMoE(not built)"
        return (f"ExpertParallelMoE(experts [{spec.expert_begin}, {spec.expert_begin + spec.num_local_experts}) of "
                f"{spec.num_experts}, hidden={spec.hidden}, inter={spec.inter}, top-{spec.topk}, rank "
                f"{spec.rank}/{spec.world_size}, closed={self.closed})")


def _route_options(routing: RoutingConfig) -> dict:
    """The routing options `reference.route` takes (its bias as a NumPy view: a torch bias read in place)."""
    bias = routing.bias
    if bias is not None:
        bias = as_numpy("routing.bias", bias)[0]
    return dict(scoring=routing.scoring, bias=bias, routed_scaling_factor=routing.routed_scaling_factor,
                n_group=routing.n_group, topk_group=routing.topk_group, norm_topk_prob=routing.norm_topk_prob)


def _as_float32_tensor(value):
    """A torch tensor of a float dtype NumPy lacks (bf16, float16) as float32 (exact); anything else as it is."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    return value


def _input_x(x):
    """``(x as float32 NumPy, what turns the float32 result into what x was)``: bf16 tensors in, bf16 tensors out."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        dtype = x.dtype
        if dtype == torch.bfloat16:
            return as_numpy("x", x.float())[0], lambda y: torch.from_numpy(y).to(torch.bfloat16)
        return as_numpy("x", x)[0], torch.from_numpy
    return x, lambda y: y


def shard_experts(w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, rank: int, world_size: int):
    """This rank's slices of global expert weights (experts `local_experts`).

    Example:
        >>> w = np.zeros((8, 4, 16), np.float32)
        >>> [a.shape[0] for a in shard_experts(w, w, np.zeros((8, 16, 4), np.float32), 1, 4)]
        [2, 2, 2]
    """
    experts = local_experts(rank, world_size, w_gate.shape[0])
    sl = slice(experts.start, experts.stop)
    return w_gate[sl], w_up[sl], w_down[sl]


__all__ = ["ExpertParallelMoE", "MoEShapes", "ForwardStats", "HostEngine", "as_numpy", "local_experts",
           "shard_experts"]
