"""The expert-parallel MoE layer on the chunk ring: a batch-ready path and a streamed path.

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

The **batch-ready** path (the default) is one chunk holding the whole batch in a 1-slot ring sized to the
largest token count over the ranks (agreed with an allreduce). The **streamed** path moves
``tokens_per_slot``-token chunks through a ``num_slots`` ring in `protocol.enqueue_order` (the producer
runs ``num_slots - 1`` chunks ahead); every rank runs the same chunk count, so ranks with fewer (or zero)
tokens still publish zero-token chunks and every consumer still acknowledges them.

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

Arrays may be NumPy arrays or torch CPU tensors (converted at the boundary without a copy, `as_numpy`);
`ExpertParallelMoE.forward` returns a torch tensor when ``x`` was one, a NumPy array otherwise.

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
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ... import env, protocol
from ...closing import Closing
from ...context import Context
from ... import agreement
from ...errors import BrokenStateError, ConfigError, ProtocolTimeout, RingClosedError, SymmringError
from ...layout import META_CHUNK_IDX, META_PAYLOAD_GEN, RingSpec
from ...protocol import AckPolicy
from ...ring import Call, Ring
from .. import quant
from ..reference import check_expert_weights, check_routing, combine_rows, route, row_matmul, swiglu, transposed_f64
from ..config import RoutingConfig
from ..workspace_plan import LayerShape

log = logging.getLogger(__name__)

_WORD_BYTES = 8


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


def _agree(ctx: Context, error: Optional[str], what: str) -> None:
    """Collective verdict on local validation (a bounded exchange, under the host bound): raise `ConfigError` on
    every rank if any rank failed (`symmring.agreement.rejection`)."""
    errors = ctx.collectives.allgather(error, what=f"{what}: argument check")
    rejected = agreement.rejection(errors, ctx.rank, what)
    if rejected is not None:
        raise rejected


def _config_error(fn: Callable[[], object]) -> Tuple[object, Optional[str]]:
    """Run ``fn``; return ``(result, None)`` or ``(None, message of its ConfigError)``."""
    try:
        return fn(), None
    except ConfigError as exc:
        return None, str(exc)


@dataclasses.dataclass
class ForwardStats:
    """What the last `ExpertParallelMoE.forward` did on this rank."""

    streaming: bool = False
    num_chunks: int = 0
    num_slots: int = 0
    tokens_per_slot: int = 0
    num_tokens: int = 0
    rows_pulled: int = 0  #: token rows pulled from all ranks (x and x_sf) for local experts
    pairs_computed: int = 0  #: (token, k) pairs computed by local experts
    passes: int = 0  #: passes through the workspace's pool (more than one per chunk when arrivals exceed it)
    elapsed_s: float = 0.0


class ExpertParallelMoE(Closing):
    """An expert-parallel MoE layer whose inputs move through a `Ring` (collective constructor).

    Args:
        ctx: the `Context` (``symmring.init()``); every rank builds its layer with the same shapes.
        spec_or_shapes: `MoEShapes` (or a `RingSpec`, or a dict of MoEShapes' fields): hidden,
            num_experts, num_topk, x_format, sf_group_size.
        w_gate, w_up: float32 ``[E/R, inter, hidden]``: this rank's experts (`local_experts`).
        w_down: float32 ``[E/R, hidden, inter]``.
        routing: a `symmring.moe.config.RoutingConfig` (the GPU layer's value; its ``num_experts`` and
            ``topk`` must be the shapes' ``num_experts`` and ``num_topk``): ``scoring`` ``"softmax"``
            (Mixtral, Qwen-MoE) or ``"sigmoid_bias"`` (DeepSeek-V3; see `reference.select_topk`), ``bias``
            (float32 ``[num_experts]``, ``sigmoid_bias`` only), ``routed_scaling_factor``, DeepSeek-V3's
            group-limited top-k (``n_group``, ``topk_group``) and ``norm_topk_prob``. None (the default):
            ``RoutingConfig(num_experts, num_topk)``, softmax.
        max_tokens_per_rank: capacity; a call with more tokens on any rank is a `ConfigError`. None
            grows the combine buffer on demand.
        timeout_s: bound of every wait; ``ctx.timeout_s`` when None.
        workspace: the `symmring.Workspace` whose rings, combine buffer and pool the layer borrows for each
            call (default: the context's own, ``ctx.workspace()``, which every layer shares). Its pool
            holds ``workspace.pool_rows(...)`` rows: a chunk whose arrivals exceed them runs in more passes.

    Raises:
        ConfigError: on every rank, if any rank's arguments are bad (``num_experts`` not a multiple of
            the number of ranks, weight shapes, ...).

    Example:
        >>> import numpy as np, symmring
        >>> ctx = symmring.init("host")
        >>> shapes = MoEShapes(hidden=128, num_experts=4, num_topk=2)
        >>> rng = np.random.default_rng(0)
        >>> wg, wu = (rng.standard_normal((4, 32, 128), dtype=np.float32) / 11 for _ in range(2))
        >>> wd = rng.standard_normal((4, 128, 32), dtype=np.float32) / 6
        >>> layer = ExpertParallelMoE(ctx, shapes, wg, wu, wd)
        >>> x = rng.standard_normal((10, 128), dtype=np.float32)
        >>> router = rng.standard_normal((4, 128), dtype=np.float32)
        >>> y = layer.forward(x, router_weight=router)
        >>> bool(np.array_equal(y, layer.forward(x, router_weight=router, streaming=True, tokens_per_slot=3)))
        True
        >>> layer.close(); ctx.close()
    """

    def __init__(self, ctx: Context, spec_or_shapes, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
                 *, routing: Optional[RoutingConfig] = None, max_tokens_per_rank: Optional[int] = None,
                 timeout_s: Optional[float] = None, workspace=None):
        if not isinstance(ctx, Context):
            raise ConfigError(f"ctx={ctx!r}: expected a symmring Context (symmring.init())")
        ctx.check_open()
        from ..workspace import Workspace
        if workspace is not None and (not isinstance(workspace, Workspace) or workspace.ctx is not ctx):
            raise ConfigError(f"workspace={workspace!r}: expected a symmring.Workspace of this context")
        self.ctx = ctx
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        (w_gate, _), (w_up, _), (w_down, _) = (as_numpy(n, v) for n, v in (
            ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)))
        setup, error = _config_error(lambda: self._validate_setup(
            spec_or_shapes, w_gate, w_up, w_down, routing, max_tokens_per_rank, timeout_s))
        _agree(ctx, error, "ExpertParallelMoE")
        self.shapes, self.experts, self.inter, self.timeout_s, routing, bias = setup
        self.workspace = workspace if workspace is not None else ctx.workspace(collective=True)
        #: This layer's id on its workspace (construction order): the layer part of its calls' identities.
        self.layer_id = self.workspace.new_layer_id()
        # Every rank must agree on the shapes and the routing parameters, or the rings would differ, and on the
        # layer's id, or no call of it would pair.
        params = (self.shapes, routing.scoring, None if bias is None else bias.tobytes(),
                  routing.routed_scaling_factor, routing.n_group, routing.topk_group, routing.norm_topk_prob,
                  max_tokens_per_rank, self.inter, self.layer_id)
        others = ctx.collectives.allgather(params, what="ExpertParallelMoE: parameter exchange")
        mismatch = [r for r, p in enumerate(others) if p != params]
        _agree(ctx, f"rank {self.rank}: shapes/routing parameters or layer id differ from rank(s) {mismatch}"
               if mismatch else None, "ExpertParallelMoE")
        #: The routing this layer runs (``routing.bias``: the NumPy view of the bias it was given).
        self.routing = routing if bias is None else routing.with_bias(bias)
        self.scoring, self.bias, self.routed_scaling_factor = routing.scoring, bias, routing.routed_scaling_factor
        self.n_group, self.topk_group, self.norm_topk_prob = routing.n_group, routing.topk_group, routing.norm_topk_prob
        self.max_tokens_per_rank = max_tokens_per_rank
        # Row-independent operands: [hidden, 2*inter] (gate | up) and [inter, hidden], float64.
        self.set_expert_weights(w_gate, w_up, w_down)
        # Rings, combine buffer (and its generation base) and pool: borrowed from the workspace per call.
        self.layer_shape = LayerShape(self.shapes.hidden, self.inter, self.shapes.num_experts, self.shapes.num_topk,
                                      x_format=self.shapes.x_format, expert_format="bf16")
        self.workspace.attach(self.layer_shape, max_tokens_per_rank)
        self.closed = False
        self.last_stats = ForwardStats()
        log.info("ExpertParallelMoE on rank %d/%d: experts [%d, %d) of %d, hidden %d, inter %d, top-%d %s%s%s, "
                 "x as %s, timeout %g s%s", self.rank, self.world_size, self.experts.start, self.experts.stop,
                 self.shapes.num_experts, self.shapes.hidden, self.inter, self.shapes.num_topk, self.scoring,
                 f", n_group={self.n_group}, topk_group={self.topk_group}" if self.n_group > 1 else "",
                 "" if self.norm_topk_prob else ", norm_topk_prob=False", self.shapes.x_format, self.timeout_s,
                 "; SYMMRING_DEBUG checks after every call" if env.debug() else "")

    def set_expert_weights(self, w_gate, w_up, w_down) -> None:
        """Replace this rank's expert weights (local, not collective: each rank its own experts), e.g. after
        `symmring.moe.integrations.module.MoEModule` loaded a state dict. Shapes as at construction.

        Raises:
            ConfigError: a weight of another shape, dtype or with a non-finite value (the layer is unchanged).
        """
        (w_gate, _), (w_up, _), (w_down, _) = (as_numpy(n, v) for n, v in (
            ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)))
        num_local, inter, _ = check_expert_weights(w_gate, w_up, w_down, hidden=self.shapes.hidden)
        if (num_local, inter) != (len(self.experts), self.inter):
            raise ConfigError(f"w_gate.shape={w_gate.shape}: expected [{len(self.experts)}, {self.inter}, "
                              f"{self.shapes.hidden}] (this layer's experts)")
        self._w_gate_up_t = [transposed_f64(np.concatenate([w_gate[i], w_up[i]], axis=0))
                             for i in range(len(self.experts))]
        self._w_down_t = [transposed_f64(w_down[i]) for i in range(len(self.experts))]

    def _routing_options(self) -> dict:
        """The routing options `reference.route` takes, as this layer was built with them."""
        return dict(topk_method=self.scoring, bias=self.bias, routed_scaling_factor=self.routed_scaling_factor,
                    n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob)

    def _validate_setup(self, spec_or_shapes, w_gate, w_up, w_down, routing, max_tokens_per_rank, timeout_s):
        shapes = MoEShapes.of(spec_or_shapes)
        experts = local_experts(self.rank, self.world_size, shapes.num_experts)
        num_local, inter, _ = check_expert_weights(w_gate, w_up, w_down, hidden=shapes.hidden)
        if num_local != len(experts):
            raise ConfigError(f"w_gate.shape={w_gate.shape}: expected {len(experts)} local experts "
                              f"(num_experts={shapes.num_experts} over {self.world_size} ranks) in dimension 0")
        if routing is None:
            routing = RoutingConfig(shapes.num_experts, shapes.num_topk)
        elif not isinstance(routing, RoutingConfig):
            raise ConfigError(f"routing={routing!r}: expected a symmring.moe.config.RoutingConfig or None")
        elif (routing.num_experts, routing.topk) != (shapes.num_experts, shapes.num_topk):
            raise ConfigError(f"routing: num_experts={routing.num_experts}, topk={routing.topk}; expected the "
                              f"shapes' num_experts={shapes.num_experts}, num_topk={shapes.num_topk}")
        bias, _ = as_numpy("routing.bias", routing.bias)
        # Route zero tokens once: checks bias and routed_scaling_factor with select_topk's own rules.
        route(np.zeros((0, shapes.hidden), np.float32), shapes.num_topk, shapes.num_experts,
              logits=np.zeros((0, shapes.num_experts), np.float32), topk_method=routing.scoring, bias=bias,
              routed_scaling_factor=routing.routed_scaling_factor, n_group=routing.n_group,
              topk_group=routing.topk_group, norm_topk_prob=routing.norm_topk_prob)
        if max_tokens_per_rank is not None and (isinstance(max_tokens_per_rank, bool) or not isinstance(
                max_tokens_per_rank, (int, np.integer)) or max_tokens_per_rank <= 0):
            raise ConfigError(f"max_tokens_per_rank={max_tokens_per_rank!r}: expected a positive int or None")
        if timeout_s is None:
            timeout_s = self.ctx.timeout_s
        elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        return shapes, experts, inter, float(timeout_s), routing, bias

    # --- public -------------------------------------------------------------------------------------

    def forward(self, x: np.ndarray, *, router_weight: Optional[np.ndarray] = None,
                logits: Optional[np.ndarray] = None, topk_idx: Optional[np.ndarray] = None,
                topk_weights: Optional[np.ndarray] = None, streaming: bool = False,
                tokens_per_slot: Optional[int] = None, num_slots: int = 2,
                ack_policy: AckPolicy = AckPolicy.CONSERVATIVE, lookahead: Optional[int] = None) -> np.ndarray:
        """The layer on this rank's tokens (collective: every rank calls it, with its own tokens).

        Args:
            x: float32 ``[num_tokens, hidden]`` (NumPy, or a torch CPU tensor); ``num_tokens`` may differ
                between ranks and may be 0.
            router_weight / logits / (topk_idx, topk_weights): exactly one routing source: float32
                ``[E, hidden]``; float32 ``[num_tokens, E]``; int32/float32 ``[num_tokens, K]`` (-1 masked).
            streaming: False: the batch-ready path (one chunk of the whole batch). True: chunks of
                ``tokens_per_slot`` through a ``num_slots`` ring.
            tokens_per_slot: tokens per chunk (streamed; default: 64).
            num_slots: ring slots (streamed).
            ack_policy: `AckPolicy.CONSERVATIVE` (acknowledge after the combine signal) or ``EARLY``
                (right after the pulls).
            lookahead: chunks the producer runs ahead (streamed), ``0 <= lookahead < num_slots``;
                default ``num_slots - 1``.

        Returns:
            float32 ``[num_tokens, hidden]``: this rank's output rows, in its input order; a torch tensor
            (sharing the array's memory) when ``x`` was one, else a NumPy array.

        Raises:
            ConfigError: on every rank, before any shared-memory work, if any rank's arguments are bad
                (named), or the ranks disagree on ``streaming``/``tokens_per_slot``/``num_slots``/
                ``ack_policy``/``lookahead``.
                Inside a `symmring.Workspace.step` the call exchanges nothing (the step exchanged every
                rank's count once): its arguments are checked on this rank only, more tokens than the
                step declared is a ConfigError, and the ranks' call options are not cross-checked; a call
                refused so still counts as a call and fails the step (`symmring.Workspace.refuse_call`).
            CallMismatch: the ranks' call sequences diverged (outside a step, on every rank before any ring
                work; inside one, from a slot's meta row: no row of the other call is used).
            ProtocolTimeout: a wait exceeded ``timeout_s`` (names rank, slot, generation, missing ranks);
                the workspace then refuses further calls (`BrokenStateError`) until `symmring.Workspace.reset`
                (collective).
            PeerTimeout: a rank did not reach the call's exchange within the context's bound (named); the
                context is then broken.
            BrokenStateError: an earlier call failed part-way on some rank (on every rank, outside a step), or
                the context is broken.
            RingClosedError: the layer or its context is closed.
        """
        self._check_closed()
        start_s = time.perf_counter()
        ws = self.workspace
        x, torch_in, route_rows, call_params, refusal = x, False, None, None, None
        try:
            ws.check_open()  # a workspace left unknown by a failed call or step: refused like a bad argument
            (x, torch_in), (router_weight, _), (logits, _), (topk_idx, _), (topk_weights, _) = (
                as_numpy(n, v) for n, v in (("x", x), ("router_weight", router_weight), ("logits", logits),
                                            ("topk_idx", topk_idx), ("topk_weights", topk_weights)))
            route_rows, call_params = self._validate_call(x, router_weight, logits, topk_idx, topk_weights, streaming,
                                                          tokens_per_slot, num_slots, ack_policy, lookahead)
        except (ConfigError, BrokenStateError) as exc:
            refusal = exc
        num_tokens = 0 if refusal is not None else x.shape[0]
        if ws.active_step is None:
            counts = self._agreed_counts(refusal, num_tokens, call_params)
        else:
            counts = self._step_counts(ws.active_step, refusal, num_tokens)
        over = [r for r, n in enumerate(counts) if self.max_tokens_per_rank is not None
                and n > self.max_tokens_per_rank]
        if over:
            raise ConfigError(f"x.shape[0]: ranks {over} have {[counts[r] for r in over]} tokens, over "
                              f"max_tokens_per_rank={self.max_tokens_per_rank}")
        streaming, tokens_per_slot, num_slots, ack_policy, lookahead = call_params
        max_tokens = max(counts)
        if streaming:
            num_chunks = protocol.call_num_chunks(counts, tokens_per_slot)
        else:
            # Batch-ready: one slot whose single chunk is the whole batch (at least one row, even when
            # every rank has zero tokens: the chunk is still published and acknowledged).
            num_slots, tokens_per_slot, num_chunks, lookahead = 1, max(1, max_tokens), 1, 0
        call_id = ws.call_identity(self.layer_id)
        ws.begin_call()
        ring = ws.host.ring(self.shapes.ring_spec(num_slots, tokens_per_slot), ack_policy, self.timeout_s,
                            exact=streaming)
        ws.host.ensure_combine(max(max_tokens, self.max_tokens_per_rank or 0, 1) * self.shapes.num_topk
                               * self.shapes.hidden * 4)
        self.last_stats = ForwardStats(streaming=streaming, num_chunks=num_chunks, num_slots=num_slots,
                                       tokens_per_slot=ring.spec.tokens_per_slot, num_tokens=x.shape[0])
        try:
            y = self._run(ring, num_chunks, x, route_rows, ack_policy, lookahead, call_id)
        except SymmringError as exc:
            # The call stopped part-way (a wait expired, another call's payload): the ranks' rings and combine
            # counters now disagree, so no later call may run on them (nor on any layer of this workspace)
            # until the workspace's reset (collective).
            ws.failure = exc
            raise
        self.last_stats.elapsed_s = time.perf_counter() - start_s
        if torch_in:
            import torch
            return torch.from_numpy(y)
        return y

    __call__ = forward

    def _agreed_counts(self, refusal: Optional[BaseException], num_tokens: int, call_params) -> list:
        """Every rank's token count of a call outside a model step, from ONE bounded exchange that also carries
        every rank's argument verdict (a refusal: this rank's own error where it refused, a `ConfigError` naming
        the refusing ranks elsewhere), its call parameters (which must agree) and its call identity (a
        `CallMismatch` on every rank where they differ): every rank raises or none does, before any ring work."""
        ws = self.workspace
        mine = (None if refusal is None else str(refusal), num_tokens, call_params, ws.call_identity(self.layer_id))
        gathered = self.ctx.collectives.allgather(mine, what="forward: token counts")
        rejected = agreement.rejection([g[0] for g in gathered], self.rank, "forward")
        if rejected is not None:
            raise refusal if refusal is not None else rejected
        mismatch = agreement.call_mismatch([g[3] for g in gathered], self.rank, "ExpertParallelMoE.forward")
        if mismatch is not None:
            raise mismatch
        differ = [r for r, g in enumerate(gathered) if g[2] != call_params]
        if differ:
            raise ConfigError(f"forward: rank {self.rank} has (streaming, tokens_per_slot, num_slots, ack_policy, "
                              f"lookahead)={call_params}, ranks {differ} differ; expected the same on all ranks")
        return [g[1] for g in gathered]

    def _step_counts(self, step, refusal: Optional[BaseException], num_tokens: int) -> list:
        """Every rank's token count of a call inside a model step: the step's (no exchange). The arguments were
        checked on this rank alone: a refused call (or more tokens than this rank declared) still counts as a
        call here and fails the step (`symmring.Workspace.refuse_call`), and the other ranks' calls fail by
        the identity check or a bounded timeout. The ranks must pass the same call options (not
        cross-checked)."""
        if refusal is None and num_tokens > step.counts[self.rank]:
            refusal = ConfigError(f"x.shape[0]={num_tokens}: more tokens than this step declared "
                                  f"({step.counts[self.rank]}; Workspace.step(num_tokens))")
        if refusal is not None:
            self.workspace.refuse_call(self.layer_id, refusal)
            raise refusal
        return list(step.counts)  # a rank may bring fewer: its last chunks are zero-token chunks

    def close(self) -> None:
        """Idempotent: the layer refuses further calls. Its memory is the workspace's (`Workspace.close`)."""
        self.closed = True

    def __repr__(self) -> str:
        return (f"ExpertParallelMoE({self.shapes}, rank={self.rank}/{self.world_size}, experts="
                f"[{self.experts.start}, {self.experts.stop}), inter={self.inter}, closed={self.closed})")

    # --- validation -----------------------------------------------------------------------------------

    def _validate_call(self, x, router_weight, logits, topk_idx, topk_weights, streaming, tokens_per_slot,
                       num_slots, ack_policy, lookahead):
        shapes = self.shapes
        quant._check_x(x)
        if x.shape[1] != shapes.hidden:
            raise ConfigError(f"x.shape={x.shape}: expected [num_tokens, hidden={shapes.hidden}]")
        per_token = ("logits", "topk_idx", "topk_weights")
        sources = dict(router_weight=router_weight, logits=logits, topk_idx=topk_idx, topk_weights=topk_weights)

        def route_rows(rows: slice):
            # Per-token sources are cut to ``rows`` (checked whole below: chunks route their own rows).
            cut = {k: (v[rows] if k in per_token and v is not None else v) for k, v in sources.items()}
            return route(x[rows], shapes.num_topk, shapes.num_experts, **self._routing_options(), **cut)[:2]

        # The whole source as the caller passed it (messages name its shape), before any shared-memory
        # work: types, shapes, expert ids, finite values. The routing options were checked at construction.
        check_routing(x.shape[0], shapes.hidden, shapes.num_topk, shapes.num_experts, **sources)
        if not isinstance(streaming, (bool, np.bool_)):
            raise ConfigError(f"streaming={streaming!r}: expected True or False")
        ack_policy = AckPolicy.parse(ack_policy)
        if streaming:
            tokens_per_slot = 64 if tokens_per_slot is None else tokens_per_slot
            for name, value in (("tokens_per_slot", tokens_per_slot), ("num_slots", num_slots)):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                    raise ConfigError(f"{name}={value!r}: expected a positive int")
            tokens_per_slot, num_slots = int(tokens_per_slot), int(num_slots)
            lookahead = protocol.default_lookahead(num_slots) if lookahead is None else lookahead
            try:
                protocol.check_lookahead(lookahead, num_slots)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            params = (True, tokens_per_slot, num_slots, ack_policy, int(lookahead))
        else:
            if tokens_per_slot is not None or lookahead is not None:
                raise ConfigError("tokens_per_slot/lookahead: only for streaming=True (the batch-ready path "
                                  "uses one slot holding the whole batch)")
            params = (False, None, None, ack_policy, None)

        return route_rows, params

    # --- symmetric memory -----------------------------------------------------------------------------

    def _combine_out(self, rank: int) -> np.ndarray:
        """Zero-copy ``[capacity, K, H]`` float32 view of ``rank``'s combine rows (the workspace's buffer)."""
        return self.workspace.host.combine_rows(rank, self.shapes.num_topk, self.shapes.hidden)

    # --- the protocol ---------------------------------------------------------------------------------

    def _run(self, ring: Ring, num_chunks: int, x: np.ndarray, route_rows, ack_policy: AckPolicy,
             lookahead: int, call_id: int) -> np.ndarray:
        """Every chunk of one call (identity ``call_id``), in the host enqueue order (producer ``lookahead``
        chunks ahead)."""
        y = np.zeros((x.shape[0], self.shapes.hidden), np.float32)
        own_routes: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
        call = ring.begin_call(num_chunks, call_id=call_id)
        host = self.workspace.host
        combine_base = host.combine_base
        for step, chunk in protocol.enqueue_order(num_chunks, ring.spec.num_slots, lookahead):
            combine_gen = protocol.generation(combine_base, chunk)
            if step == "produce":
                own_routes[chunk] = self._produce(ring, call, chunk, x, route_rows)
            else:
                self._consume(ring, call, chunk, ack_policy, combine_gen)
                self._reduce(ring, call, chunk, own_routes.pop(chunk), combine_gen, y)
        ring.end_call(call)
        host.combine_base = protocol.next_base(combine_base, num_chunks)
        if env.debug():
            self._debug_check(ring, call, combine_base, y)
        return y

    def _debug_check(self, ring: Ring, call: Call, combine_base: int, y: np.ndarray) -> None:
        """``SYMMRING_DEBUG=1``: the shared state a finished call must leave behind (module docstring)."""
        backend, alloc, lay = self.ctx.backend, ring.allocation, ring.layout
        num_chunks, num_slots = call.num_chunks, ring.spec.num_slots
        base = backend.read_word(alloc, lay["gen_base"].offset, self.rank)
        if base != protocol.next_base(call.base, num_chunks):
            raise SymmringError(f"SYMMRING_DEBUG: rank {self.rank}: gen_base is {base} after a call of {num_chunks} "
                                f"chunks from base {call.base}, expected {protocol.next_base(call.base, num_chunks)}")
        for chunk in range(max(0, num_chunks - num_slots), num_chunks):  # the last use of each slot
            slot, gen = protocol.slot_of(chunk, num_slots), protocol.generation(call.base, chunk)
            words = {kind: backend.read_word(alloc, lay[kind].slot_offset(slot), self.rank)
                     for kind in ("route_ready", "layout_ready")}
            meta = ring.meta(slot)
            if words != {"route_ready": gen, "layout_ready": gen} or int(meta[META_PAYLOAD_GEN]) != gen \
                    or int(meta[META_CHUNK_IDX]) != chunk:
                raise SymmringError(f"SYMMRING_DEBUG: rank {self.rank}: slot {slot} holds ready words {words} and "
                                    f"metadata {meta.tolist()}, expected generation {gen} of chunk {chunk}")
        required = protocol.full_mask(self.world_size)
        deadline = time.monotonic() + self.timeout_s
        for slot in range(num_slots):
            for word_idx, want in enumerate(required):
                offset = lay["ack_mask"].slot_offset(slot) + word_idx * _WORD_BYTES
                # Acquire (pairs with each consumer's fence before its atomic_or in Ring.ack): every consumer
                # acknowledges this call's chunks without waiting for this rank, so they must all arrive.
                ok, observed = backend.wait_until(alloc, offset, self.rank, "eq", want,
                                                  max(deadline - time.monotonic(), 1e-6))
                if not ok:
                    mask = [backend.read_word(alloc, lay["ack_mask"].slot_offset(slot) + w * _WORD_BYTES, self.rank)
                            for w in range(len(required))]
                    raise ProtocolTimeout("reuse", rank=self.rank, peer=self.rank, slot=slot, chunk=num_chunks - 1,
                                          expected=want, observed=observed,
                                          missing_ranks=protocol.missing_ranks(mask, required), timeout_s=self.timeout_s)
        if num_chunks:
            last = protocol.generation(combine_base, num_chunks - 1)
            behind = [q for q in range(self.world_size)
                      if backend.read_word(self.workspace.host.combine, q * _WORD_BYTES, self.rank) < last]
            if behind:
                raise SymmringError(f"SYMMRING_DEBUG: rank {self.rank}: combine signals of consumer(s) {behind} are "
                                    f"below the call's last generation {last}")
        bad = np.nonzero(~np.isfinite(y).all(axis=1))[0]
        if bad.size:
            raise SymmringError(f"SYMMRING_DEBUG: rank {self.rank}: output rows {bad[:8].tolist()} (of {bad.size}) "
                                "are not finite")

    def _chunk_rows(self, ring: Ring, chunk: int, num_tokens: int) -> slice:
        tokens_per_slot = ring.spec.tokens_per_slot
        token_base = protocol.chunk_token_base(chunk, tokens_per_slot)
        return slice(token_base, token_base + protocol.chunk_valid_tokens(num_tokens, chunk, tokens_per_slot))

    def _produce(self, ring: Ring, call: Call, chunk: int, x: np.ndarray, route_rows):
        """Route and quantise this rank's rows of ``chunk``, then write and publish them (route first)."""
        rows = self._chunk_rows(ring, chunk, x.shape[0])
        topk_idx, topk_weights = route_rows(rows)
        x_bits, x_sf = quant.encode(x[rows], self.shapes.x_format, self.shapes.sf_group_size)
        ring.acquire_slot(call, chunk)
        ring.write_route(call, chunk, topk_idx, topk_weights, rows.start, rows.stop - rows.start)
        # Route before layout: a consumer could start counting its experts' tokens before x arrives.
        ring.publish_route(call, chunk)
        ring.write_layout(call, chunk, x_bits, x_sf)
        ring.publish_layout(call, chunk)
        return topk_idx, topk_weights

    def _entries(self, ring: Ring, call: Call, chunk: int, src_rank: int):
        """The (row, k) entries of ``src_rank``'s ``chunk`` routed to local experts (after `wait_ready`).

        Returns ``(token_base, rows, ks, experts)``: for every local (row, k) pair its row in the chunk, its k
        and its expert (row-major order).
        """
        slot = call.slot(chunk)
        token_base, num_valid = ring.check_meta(call, chunk, src_rank)  # this chunk, generation and call
        topk_idx = np.array(ring.topk_idx(slot, src_rank)[:num_valid])
        local = (topk_idx >= self.experts.start) & (topk_idx < self.experts.stop)
        rows, ks = np.nonzero(local)
        return token_base, rows, ks, topk_idx[rows, ks]

    def _pull(self, ring: Ring, call: Call, chunk: int, src_rank: int, rows: np.ndarray, pool: np.ndarray,
              pool_rows: np.ndarray) -> None:
        """Dequantise the x rows ``rows`` of ``src_rank``'s ``chunk`` into rows ``pool_rows`` of ``pool``: one read
        of each distinct row of the slot."""
        slot = call.slot(chunk)
        pulled_rows, inverse = np.unique(rows, return_inverse=True)
        x_bits = ring.x(slot, src_rank)[pulled_rows]  # fancy indexing: a copy of the rows only
        x_sf = ring.x_sf(slot, src_rank)[pulled_rows] if ring.spec.num_sf else None
        pool[pool_rows] = quant.decode(x_bits, x_sf, self.shapes.x_format)[inverse]
        self.last_stats.rows_pulled += len(pulled_rows)

    def _consume(self, ring: Ring, call: Call, chunk: int, ack_policy: AckPolicy, combine_gen: int) -> None:
        """Dispatch, compute and combine-write ``chunk`` of every rank; signal every owner.

        The chunk's arrivals go through the workspace's pool in passes of at most ``pool_rows`` (token, k)
        entries, grouped by expert: a routing that sends more rows here than the pool holds runs more
        passes, never truncated. Every pass reads the slots, so EARLY acknowledges after the last one."""
        entries = []
        for src_rank in range(self.world_size):
            ring.wait_ready(call, chunk, src_rank)
            entries.append(self._entries(ring, call, chunk, src_rank))
        sources = np.concatenate([np.full(len(e[1]), r, np.int64) for r, e in enumerate(entries)])
        rows = np.concatenate([e[1] for e in entries])
        ks = np.concatenate([e[2] for e in entries])
        experts = np.concatenate([e[3] for e in entries]).astype(np.int64)
        order = np.argsort(experts, kind="stable")  # expert-contiguous, as the GPU pool
        pool_rows = self.workspace.pool_rows(self.layer_shape)
        acked = False
        for begin in range(0, len(order), pool_rows):
            part = order[begin:begin + pool_rows]
            pool = self.workspace.host.pool_view(len(part), self.shapes.hidden)
            for src_rank in range(self.world_size):
                sel = np.nonzero(sources[part] == src_rank)[0]
                if sel.size:
                    self._pull(ring, call, chunk, src_rank, rows[part[sel]], pool, sel)
            if begin + pool_rows >= len(order):
                acked = self._early_ack(ring, call, chunk, ack_policy)  # the last read of every slot is done
            out = np.empty((len(part), self.shapes.hidden), np.float32)
            for local_idx, expert in enumerate(self.experts):
                sel = np.nonzero(experts[part] == expert)[0]
                if sel.size:
                    out[sel] = self._expert(local_idx, pool[sel])
            self.last_stats.pairs_computed += len(part)
            self.last_stats.passes += 1
            for src_rank in range(self.world_size):
                sel = np.nonzero(sources[part] == src_rank)[0]
                if sel.size:
                    # A remote store into the owner's combine buffer at the token's logical row.
                    token_base = entries[src_rank][0]
                    self._combine_out(src_rank)[token_base + rows[part[sel]], ks[part[sel]]] = out[sel]
        if not acked:  # no entry here: the slots were read for their routing only
            self._early_ack(ring, call, chunk, ack_policy)
        self._signal_combine(combine_gen)
        if ack_policy == AckPolicy.CONSERVATIVE:
            for src_rank in range(self.world_size):
                ring.ack(call, chunk, src_rank)  # release: after this chunk's combine was signalled

    def _early_ack(self, ring: Ring, call: Call, chunk: int, ack_policy: AckPolicy) -> bool:
        if ack_policy == AckPolicy.EARLY:
            for src_rank in range(self.world_size):
                ring.ack(call, chunk, src_rank)  # release: after the last read of the slot (fence inside)
        return True

    def _signal_combine(self, combine_gen: int) -> None:
        """Tell every owner that this rank's combine stores of the current chunk are complete."""
        backend = self.ctx.backend
        # Release: the combine stores are visible before the signals; pairs with the acquire in _reduce.
        backend.fence()
        for owner in range(self.world_size):
            backend.signal_set(self.workspace.host.combine, self.rank * _WORD_BYTES, combine_gen, owner)

    def _expert(self, local_idx: int, h: np.ndarray) -> np.ndarray:
        """L1 (gate | up) -> SwiGLU -> L2 for rows ``h`` of one local expert (row-independent)."""
        gate_up = row_matmul(h, self._w_gate_up_t[local_idx])
        act = swiglu(gate_up[:, :self.inter], gate_up[:, self.inter:])
        return row_matmul(act, self._w_down_t[local_idx])

    def _reduce(self, ring: Ring, call: Call, chunk: int, own_route, combine_gen: int, y: np.ndarray) -> None:
        """Wait for every consumer's combine of this rank's ``chunk``, then reduce over k into ``y``."""
        backend = self.ctx.backend
        deadline = time.monotonic() + self.timeout_s
        for consumer in range(self.world_size):
            # Acquire: pairs with the fence before the consumer's signal_set in _consume.
            ok, observed = backend.wait_until(self.workspace.host.combine, consumer * _WORD_BYTES, self.rank, "ge", combine_gen,
                                              max(deadline - time.monotonic(), 1e-6))
            if not ok:
                missing = [q for q in range(self.world_size)
                           if backend.read_word(self.workspace.host.combine, q * _WORD_BYTES, self.rank) < combine_gen]
                error = ProtocolTimeout("combine", rank=self.rank, peer=consumer, slot=call.slot(chunk), chunk=chunk,
                                        expected=combine_gen, observed=observed, missing_ranks=missing,
                                        timeout_s=self.timeout_s)
                self.ctx.collectives.record_fault(error)  # a peer may be stalled or gone (see Ring)
                raise error
        topk_idx, topk_weights = own_route
        rows = self._chunk_rows(ring, chunk, y.shape[0])
        if rows.stop > rows.start:
            y[rows] = combine_rows(self._combine_out(self.rank)[rows], topk_idx, topk_weights)

    def _check_closed(self) -> None:
        if self.closed:
            raise RingClosedError(f"{self!r} was closed")
        self.ctx.check_open()


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


__all__ = ["ExpertParallelMoE", "MoEShapes", "ForwardStats", "as_numpy", "local_experts", "shard_experts"]
