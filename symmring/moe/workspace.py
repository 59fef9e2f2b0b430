"""One workspace per process: the memory every MoE layer of a model borrows for the length of a call.

A `Workspace` holds the symmetric and scratch memory of MoE calls: the rings, the combine buffer (and
its generation base), the expert pool, the dispatch words and, on GPUs, the experts' output rows. Layers
keep only their weights, routing options and plans; every layer of a model (``from_hf``,
``replace_moe_blocks``) borrows the same workspace, so memory does not grow with the number of layers.
Its size comes from a budget (`symmring.moe.workspace_plan`): the pool holds one window of tokens under
uniform routing, and a window whose arrivals exceed it runs as more passes over the same pool.

Created once per context (``ctx.workspace()``, which every layer uses by default) or explicitly
(``Workspace(ctx, ...)``, passed as ``workspace=``). Layers attach at construction (collective, as the
layers' constructors are): the workspace grows to serve the largest shape and ``max_tokens`` attached.
On GPUs growing makes the memory anew (after a device synchronisation) and moves `Workspace.epoch` on: the
layers attached before take views of the new memory and drop their cached graphs and plans at their next
call (the epoch is the one signal, read before every call), and a graph of `symmring.moe.gpu.MoE.capture`
refuses to replay with a `ConfigError`; any other CUDA graph captured over a layer's forward before (a
`torch.cuda.graph`, a compiled model's) addresses freed memory and must be captured again: build every
layer first, then capture, as a server does. On CPUs the rings and the combine buffer also grow on demand
within a call (collectively). Layers of different shapes share the pool and combine bytes; each distinct
shape has its ring (layers of one shape share it, and its generations keep growing across their calls).

Calls are agreed, not assumed: every call of a layer carries an identity every rank must share
(`symmring.protocol.call_identity`: the workspace's call number and the layer's id, given in construction order
and agreed when the layer is built). Outside a `step` the call's exchange carries it (a `CallMismatch` on every
rank before anything is enqueued); inside one every slot's meta row carries it and the consumer checks it (a
named device error, every output NaN, raised on every rank at the next step's entry). A call refused on one
rank inside a step (its arguments failed a check only it could see) still counts as a call there and stops
the others' (`symmring.errors.CallRefused`), and a step that a refusal or an exception left is raised on every
rank at the next step's entry (`symmring.errors.StepFailed`): no rank returns rows paired with another
call's. `reset` (collective) is the way back from any of these.

Serving (GPU): ``with ws.step(n):`` raises, on every rank, any device error latched on any rank and any step
that failed; inside it ``ws.set_call_tokens(n)`` then ``ws.replay(graph)`` replays a graph captured over a
step (`capture`), ordered after the last call and checked against the latch without a synchronisation.

Given counts (a serving engine that exchanged every rank's token count already, as vLLM does once per step):
``ws.step(n, counts=counts)`` exchanges nothing (`given_entries`). Its entry raises what this rank knows from
its own host memory: its latched device error, its failed step (a refused call, an exception that left a step,
a call that failed part-way), bad counts. What only another rank knows is not raised at entry; it reaches this
rank through the ring in the step's first call with that rank: another call's identity in a slot's meta row
(`CallMismatch` on the CPU layer; ``call_mismatch`` on GPUs), a rank that raised at its entry and publishes
nothing (the bounded wait of every ring: `ProtocolTimeout`), a device error elsewhere (the ring abort, GPUs).
The CPU layer raises these in the call; the GPU layer returns that call's rows as NaN and raises at this rank's
next entry (its latch): every rank raises within two steps, none keeps wrong rows. Not checked at all: that the
ranks were given the same counts and ``own_router`` (vLLM's counts come from one all-reduce), and diverged call
counts are seen only by the identity check (docs/MOE_GPU.md, "Given counts").

Thread safety: none. A workspace, its layers and its context belong to one thread (the one that makes the
calls; every call is collective in call order, which two threads would interleave differently on each rank).

Example:
    >>> import symmring
    >>> ctx = symmring.init("host")
    >>> ws = ctx.workspace()
    >>> ws is ctx.workspace()
    True
    >>> ctx.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import weakref
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..closing import Closing
from ..errors import BrokenStateError, ConfigError, RingClosedError, StepFailed
from ..layout import ALIGN, RingSpec, align_up
from ..protocol import AckPolicy, call_identity
from .workspace_plan import REGIONS, LayerShape, WorkspacePlan, plan

log = logging.getLogger(__name__)

#: Rings a host workspace keeps (per ring spec and acknowledgement policy; least recently used dropped).
MAX_HOST_RINGS = 8
_WORD_BYTES = 8


def _torch():
    import torch
    return torch


def _token_count(value) -> int:
    """``value`` as a token count (an int >= 0), else a ConfigError naming ``num_tokens``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"num_tokens={value!r}: expected an int >= 0")
    return int(value)


#: What a rank is told to do after a failed step or a diverged call (every error of `Workspace.step` names it).
RESET_ADVICE = "call reset() on every rank (collective: Workspace.reset, or a layer's reset) before the next step"


@dataclasses.dataclass(frozen=True)
class Step:
    """What a `Workspace.step` exchanged (or was given): every rank's ``counts`` and whether every rank routes with
    its layers' own routers (``distinct``). (Every rank's latched device errors were exchanged too, and raised at
    entry; with given counts this rank's own.)"""

    counts: Tuple[int, ...]
    distinct: bool

    def bucket(self, cap: int) -> int:
        """The token bucket of the step's largest count, at most ``cap`` (`symmring.moe.gpu.plan.token_bucket`); a GPU
        layer also keeps it within its ring's whole chunks (`symmring.moe.gpu.MoE._bucket`)."""
        from .gpu.plan import token_bucket
        return token_bucket(max(self.counts), cap)


def step_error(rank: int, entries, decode) -> Optional[BaseException]:
    """The error every rank raises at a step's entry from the step's exchanged ``entries`` (each rank's count,
    routing, latched device error words, calls made and failure text; the same list on every rank), or None:
    a latched device error first (this rank's own, decoded from its words by ``decode``; else a
    `ProtocolAborted` naming the first rank that latched one), then a `StepFailed` naming every rank that
    reported a failed step, or that entered after another number of calls than this rank.

    Example:
        >>> entries = [(4, True, None, 7, None), (4, True, None, 7, "ConfigError left the step: x.shape")]
        >>> print(step_error(0, entries, decode=None))  # doctest: +ELLIPSIS
        rank 0: a model step failed on rank(s) [1] (rank 1: ConfigError left the step: x.shape); call reset()...
        >>> step_error(1, [(4, True, None, 7, None)] * 2, decode=None) is None
        True
    """
    from ..kernels import exchanged_error
    latched = [e[2] for e in entries]
    if any(words is not None for words in latched):
        return exchanged_error(rank, latched, decode)
    calls = entries[rank][3]
    failures = {r: e[4] for r, e in enumerate(entries) if e[4]}
    failures.update({r: f"entered the step after {e[3]} calls, rank {rank} after {calls}"
                     for r, e in enumerate(entries) if e[3] != calls and r not in failures})
    return StepFailed(rank, failures, RESET_ADVICE) if failures else None


def given_entries(mine: tuple, counts, rank: int, world_size: int) -> list:
    """A step's entries for `step_error` from every rank's token ``counts`` given by the caller, without an
    exchange: this rank's own entry ``mine`` (its count must be ``counts[rank]``), and for every other rank its
    count with nothing to report (no latched error, this rank's call count, no failure): at the entry of a step of
    given counts a rank raises only what it knows itself (module docstring, "Given counts").

    Raises:
        ConfigError: ``counts`` (ints, or an int array or tensor) not one int >= 0 per rank, or ``counts[rank]``
            not this rank's ``num_tokens``.

    Example:
        >>> given_entries((3, False, None, 5, None), (3, 0), rank=0, world_size=2)
        [(3, False, None, 5, None), (0, False, None, 5, None)]
    """
    counts = counts.tolist() if hasattr(counts, "tolist") else counts  # vLLM's are a CPU tensor
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__") or len(counts) != world_size:
        raise ConfigError(f"counts={counts!r}: expected one token count per rank ({world_size})")
    counts = [_token_count(c) for c in counts]
    if counts[rank] != mine[0]:
        raise ConfigError(f"counts={counts}: rank {rank}'s count {counts[rank]} is not num_tokens={mine[0]}")
    return [mine if r == rank else (c,) + mine[1:2] + (None, mine[3], None) for r, c in enumerate(counts)]


def step_entries(ws, mine: tuple, counts) -> list:
    """Every rank's entry of a step of ``ws``: from the caller's ``counts`` without an exchange (`given_entries`),
    else from ONE bounded allgather (none on one rank)."""
    if counts is not None:
        return given_entries(mine, counts, ws.rank, ws.world_size)
    return [mine] if ws.world_size == 1 else ws.ctx.collectives.allgather(mine, what="Workspace.step")


class Workspace(Closing):
    """The process's memory for MoE calls (see the module docstring). Nothing is allocated until a layer
    attaches (collectively).

    Args:
        ctx: the `symmring.Context`.
        max_tokens: most tokens per rank per call (None: the largest of the attached layers').
        budget: bytes per PE (None: a pool for a window of the whole call under uniform routing;
            `symmring.moe.workspace_plan.plan`).
        tokens_per_slot: the GPU ring's chunk (None: the plan's choice).
        pool_rows: rows of the expert pool, overriding the budget's (tests: a tiny pool forces passes).

    Raises:
        ConfigError: a bad argument (before any collective work).
    """

    def __init__(self, ctx, *, max_tokens: Optional[int] = None, budget: Optional[int] = None,
                 tokens_per_slot: Optional[int] = None, pool_rows: Optional[int] = None):
        ctx.check_open()
        for name, value in (("max_tokens", max_tokens), ("budget", budget), ("tokens_per_slot", tokens_per_slot),
                            ("pool_rows", pool_rows)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or value < 1):
                raise ConfigError(f"{name}={value!r}: expected an int >= 1, or None")
        self.ctx = ctx
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.max_tokens = None if max_tokens is None else int(max_tokens)
        self.budget = None if budget is None else int(budget)
        self.tokens_per_slot = None if tokens_per_slot is None else int(tokens_per_slot)
        self.pool_rows_override = None if pool_rows is None else int(pool_rows)
        self.shapes: Tuple[LayerShape, ...] = ()
        self.plan: Optional[WorkspacePlan] = None
        # Calls of its layers (refused ones too), the same on every rank: the number of every call's identity
        # (`call_identity`); `reset` zeroes it.
        self.calls = 0
        self._layer_ids = 0  # layers built on it (their ids, in construction order)
        self._step_failure: Optional[str] = None  # this rank: what failed in a step (exchanged at the next entry)
        self.epoch = 0  # GPU: bumped each time the memory is made anew (a graph captured before cannot replay)
        self._graphs = _GraphEpochs()  # GPU: the memory each captured graph addresses (`capture`, `replay`)
        self.closed = False
        self.failure: Optional[BaseException] = None  # a call stopped part-way: the shared state is unknown
        self._device = None  # symmring.moe.gpu.memory.DeviceMemory on a device backend
        from ..backends.base import DeviceBackend
        self._host = None if isinstance(ctx.backend, DeviceBackend) else _HostMemory(ctx)
        self.active_step: Optional["Step"] = None  # the open `step`, or None

    # --- attaching layers ---------------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return "cpu" if self._host is not None else "gpu"

    def attach(self, shape: LayerShape, max_tokens: Optional[int]) -> None:
        """Make room for a layer of ``shape`` with calls of up to ``max_tokens`` tokens per rank (collective:
        a layer's constructor calls it on every rank with the same arguments).

        Raises:
            ConfigError: no plan holds the layers attached so far and this one (a budget too small; the
                workspace is left as it was).
        """
        self.check_open()
        shapes, tokens = self._with(shape, max_tokens)
        if shapes == self.shapes and tokens == self.max_tokens:
            return
        if self._host is not None:
            # Without a token bound the CPU workspace grows with the calls (one pass per chunk); with one,
            # the pool is the plan's, allocated now.
            self.plan = None if tokens is None else self._plan_of(shapes, tokens)
            self.shapes, self.max_tokens = shapes, tokens  # only once the plan holds them
            hidden = max(s.hidden for s in shapes)
            rows = max((self.pool_rows(s) for s in shapes), default=0) if self._bounded else 0
            self._host.pool_view(rows, hidden)
            return
        self.plan = self._plan_of(shapes, tokens)
        self.shapes, self.max_tokens = shapes, tokens  # only once the plan holds them
        from .gpu.memory import DeviceMemory
        if self._device is not None and self._device.fits(self.plan):
            self._device.plan = self.plan  # the memory holds the new plan too: nothing moves
            return
        requests = []
        if self._device is not None:
            # The layers attached so far get views of the new memory at their next call (`epoch`); graphs
            # captured by hand refuse to replay.
            self.release_memory()
            requests = self._device.requests
            self._device.close()
        self._device = DeviceMemory(self, self.plan)
        self.epoch += 1
        self._device.rebind(requests)

    def preview(self, shape: LayerShape, max_tokens: Optional[int]) -> Optional[WorkspacePlan]:
        """The plan this workspace would have with a layer of ``shape`` and ``max_tokens`` attached (its chunk,
        window and pool rows), without attaching it or allocating anything: what a layer resolves its defaults
        from before the ranks agree on them. None for a CPU workspace without a token bound.

        Raises:
            ConfigError: no plan holds the layers attached so far and this one (`attach` would raise the same).
        """
        shapes, tokens = self._with(shape, max_tokens)
        if shapes == self.shapes and tokens == self.max_tokens:
            return self.plan
        return None if tokens is None and self._host is not None else self._plan_of(shapes, tokens)

    def _with(self, shape: LayerShape, max_tokens: Optional[int]) -> Tuple[Tuple[LayerShape, ...], Optional[int]]:
        """The shapes and token bound of this workspace with a layer of ``shape`` and ``max_tokens`` attached."""
        shapes = tuple(dict.fromkeys(self.shapes + (shape,)))
        bounds = [t for t in (self.max_tokens, max_tokens) if t is not None]
        return shapes, (max(bounds) if bounds else None)

    def _plan_of(self, shapes: Tuple[LayerShape, ...], tokens: Optional[int]) -> WorkspacePlan:
        if self._host is not None:
            return plan(shapes, world_size=self.world_size, max_tokens=tokens, budget=self.budget, device="cpu",
                        tokens_per_slot=min(tokens, self.tokens_per_slot or tokens), pool_rows=self.pool_rows_override)
        if tokens is None:
            raise ConfigError("workspace: a GPU layer needs max_tokens (the workspace's or the layer's)")
        return plan(shapes, world_size=self.world_size, max_tokens=tokens, budget=self.budget,
                    tokens_per_slot=None if self.tokens_per_slot is None else min(tokens, self.tokens_per_slot),
                    device="gpu", pool_rows=self.pool_rows_override)

    def release_memory(self) -> None:
        """Before GPU memory of this workspace is freed or moves (`attach` makes it anew; `DeviceMemory` grows a
        part of it): synchronise the device, so no queued call or graph replay still uses it. The caller then
        bumps `epoch`: the one signal of the move. Each layer's executor compares it before every call and then
        takes views of the new memory and drops what addressed the old (its cached graphs and plans); a graph of
        `symmring.moe.gpu.GpuMoE.capture` (or `capture`) refuses to replay."""
        import torch
        torch.cuda.synchronize()

    @property
    def _bounded(self) -> bool:
        return self.pool_rows_override is not None or self.plan is not None

    def pool_rows(self, shape: LayerShape) -> int:
        """Rows of the pool for a layer of ``shape``: ``pool_rows=``, else the plan's (on CPUs without any
        ``max_tokens``: unbounded, the pool grows to each chunk's arrivals)."""
        if self.plan is not None:
            return self.plan.pool_rows[shape]
        if self.pool_rows_override is not None:
            return self.pool_rows_override
        return sys.maxsize  # CPU without a token bound: the pool grows to each chunk's arrivals

    @property
    def failed(self) -> bool:
        """Whether a call or a step failed on this rank since the last `reset` (`failure`, or a step that a refused
        call or an exception left, not yet raised at a step's entry)."""
        return self.failure is not None or self._step_failure is not None

    @property
    def next_layer_id(self) -> int:
        """The id the next layer built on this workspace gets (`new_layer_id`): what its spec carries into the
        construction agreement, before the id is taken."""
        return self._layer_ids

    def new_layer_id(self) -> int:
        """The id of a layer being built on this workspace: its place in construction order (every rank builds
        its layers in the same order; the layer's construction agreement checks it). The layer part of its calls'
        identities (`call_identity`). Taken once the layer's construction was agreed, so a refused layer takes
        none."""
        layer_id, self._layer_ids = self._layer_ids, self._layer_ids + 1
        return layer_id

    def call_identity(self, layer_id: int) -> int:
        """The identity of the next call, a call of layer ``layer_id`` (`call_identity` of `calls`)."""
        return call_identity(self.calls, layer_id)

    def begin_call(self) -> None:
        """A layer starts a call on this workspace (counted in `calls`)."""
        self.check_open()
        self.calls += 1

    def refuse_call(self, layer_id: int, error: BaseException) -> None:
        """This rank refused a call of layer ``layer_id`` inside a step (its arguments failed a check no other rank
        could see): it still counts as a call here, so this rank's later calls keep their numbers, and the step is
        marked failed (raised on every rank at the next step's entry, `step`)."""
        if self._step_failure is None:
            self._step_failure = f"refused call #{self.calls} of layer {layer_id}: {error}"
        self.calls += 1

    # --- model steps ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, num_tokens: int, *, own_router: bool = True, counts: Optional[Sequence[int]] = None):
        """One model step (a forward of every layer) with ONE bounded host exchange for all its MoE calls (none
        with given ``counts``): every rank's token count, whether every rank routes with the layers' own routers,
        every rank's latched device error, call count and step failure (as vLLM exchanges its data-parallel token
        counts once per step). Collective: every rank enters the step. Inside it the GPU layers' `forward`
        exchanges nothing: every rank plans its calls for the same token bucket (`symmring.moe.gpu.plan.token_bucket`
        of the largest count), and each rank's exact count goes to the device; each call's identity travels in the
        ring's meta rows instead (module docstring).

        At entry every rank raises the same kind of error when any rank has one to report, so a serving loop
        learns of it on every rank in the same step: a device error latched on any rank (this rank's own, named;
        `ProtocolAborted` naming the first rank that latched one elsewhere), or a failed step (`StepFailed`: an
        exception left an earlier step on some rank, a call inside it was refused there, or the ranks entered
        after different numbers of calls). Both stay until `reset`. An exception that leaves the step marks it
        failed on this rank.

        Args:
            num_tokens: this rank's tokens in every MoE call of the step (a call may have fewer; more is a
                `ConfigError`, and refuses that call, `refuse_call`).
            own_router: every call of the step routes with the layer's router (``router_weight`` or
                ``logits``: distinct experts per token, a tighter bound for the engines); False when some
                call passes ``topk_idx``.
            counts: every rank's token count, given by the caller (``counts[rank] == num_tokens``): the step
                exchanges NOTHING, and its entry raises only this rank's own errors; another rank's reach
                this rank in the step's calls (module docstring, "Given counts").

        Yields:
            the `Step` (its ``counts``, ``bucket`` and ``distinct``).

        Raises:
            ConfigError: a bad argument, or a step inside a step (before any exchange).
            ProtocolTimeout, ProtocolViolation (their subclasses): a device error latched on any rank.
            StepFailed: an earlier step failed on some rank.
            PeerTimeout, BrokenStateError: as the context's exchanges.

        Example:
            >>> with workspace.step(x.shape[0]):            # doctest: +SKIP
            ...     logits = model(x)                        # every MoE layer: no host exchange
        """
        num_tokens = _token_count(num_tokens)
        if not isinstance(own_router, bool):
            raise ConfigError(f"own_router={own_router!r}: expected a bool")
        if self.active_step is not None:
            raise ConfigError("Workspace.step: a step is already open (steps do not nest)")
        self.ctx.check_open()
        if self.closed:
            raise RingClosedError("this workspace was closed (its layers can no longer run)")
        latched = None if self._device is None else self._device.latched()
        mine = (num_tokens, own_router, latched, self.calls, self._failure_text())
        entries = step_entries(self, mine, counts)
        error = step_error(self.rank, entries, None if self._device is None else self._device.decode_latched)
        if isinstance(error, StepFailed):
            self.failure = error  # every rank: until reset
        elif error is not None:
            self.ctx.collectives.record_fault(error)  # a device error: exiting now aborts rather than hangs
        if error is not None:
            raise error
        self.active_step = Step(counts=tuple(int(e[0]) for e in entries), distinct=all(bool(e[1]) for e in entries))
        try:
            yield self.active_step
        except BaseException as exc:
            if self._step_failure is None:
                self._step_failure = f"{type(exc).__name__} left the step: {exc}"
            raise
        finally:
            self.active_step = None

    def _failure_text(self) -> Optional[str]:
        """What this rank reports at a step's entry: a failed step, or the workspace's failure, or None."""
        if self._step_failure is not None:
            return self._step_failure
        if isinstance(self.failure, StepFailed):  # already reported on every rank: not its whole text again
            return "a step failed earlier (no reset since)"
        return None if self.failure is None else f"{type(self.failure).__name__}: {self.failure}"

    def set_call_tokens(self, num_tokens: int) -> None:
        """GPU: this rank's token count for the next call or replay, enqueued on the current torch stream (a
        graph captured over a step reads it on the device: set it before each ``graph.replay()`` with that
        replay's count, at most the rows the graph was captured with; every launch is also clamped to those
        rows). `forward` sets it itself. Ordered after the last call of any layer on this workspace (as a
        call is): replay the step on the same stream. While the current stream captures a CUDA graph the count
        is written INTO the graph instead (each replay sets it: a graph that its caller replays itself, as vLLM
        does, or a `replay` without ``num_tokens``)."""
        num_tokens = _token_count(num_tokens)
        if self._device is None:
            raise ConfigError("Workspace.set_call_tokens: a GPU workspace with a layer attached")
        self._device.set_call_tokens(num_tokens)

    # --- captured steps (GPU) -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self, graph, **graph_kwargs):
        """Capture the layers' calls made inside the block into ``graph`` (a ``torch.cuda.CUDAGraph``;
        ``graph_kwargs``: ``torch.cuda.graph``'s ``pool``, ``stream``, ...; ``capture_error_mode`` defaults to
        ``"thread_local"``, `symmring.moe.gpu.graph_cache.CAPTURE_ERROR_MODE`), registered with the workspace memory
        it addresses, so `replay` refuses it once the workspace grew. Every rank captures the same calls.

        Example:
            >>> graph = torch.cuda.CUDAGraph()                                     # doctest: +SKIP
            >>> with ws.step(n, own_router=True), ws.capture(graph):               # doctest: +SKIP
            ...     y = model(x)
        """
        from .gpu.graph_cache import CAPTURE_ERROR_MODE
        graph_kwargs.setdefault("capture_error_mode", CAPTURE_ERROR_MODE)
        with self._graphs.capturing(graph, self.epoch):
            with _torch().cuda.graph(graph, **graph_kwargs):
                yield graph

    def note_capture(self) -> None:
        """A layer's call is being captured into a CUDA graph: outside `capture`, remember the memory's epoch (a
        graph `replay` cannot match to its capture is refused once the workspace grew after such a capture)."""
        self._graphs.note_layer_call(self.epoch)

    def replay(self, graph, num_tokens: Optional[int] = None) -> None:
        """Replay a CUDA graph of layer calls (`capture`; `symmring.moe.gpu.CapturedCall.replay` uses it) on the
        current torch stream, as a call: after the last call of any layer (and with this rank's ``num_tokens``
        set on the device first, `set_call_tokens`, when given), then marking its end, so the next eager call on
        any stream comes after it. No synchronisation and no exchange: a device error already latched on this
        rank is raised (a poll of host memory, as `symmring.moe.gpu.MoE.async_error`), before anything is
        enqueued; a replay that meets a new one returns NaN rows, and the next `step` raises it on every rank.

        Raises:
            ConfigError: the workspace made its memory anew since the capture (a larger layer was built; capture
                again), or a graph of unknown capture after such a growth (capture it through `capture`), or a
                bad ``num_tokens``.
            ProtocolTimeout, ProtocolViolation (subclasses): this rank's latched device error (until `reset`).
            BrokenStateError: a failed step (until `reset`), or the context is broken.
        """
        self.check_open()
        if self._device is None:
            raise ConfigError("Workspace.replay: a GPU workspace with a layer attached")
        self._graphs.check(graph, self.epoch)
        error = self._device.latched_error()
        if error is not None:
            raise error
        if num_tokens is None:
            self._device.after_last_call()
        else:
            self._device.begin_call(_token_count(num_tokens))
        graph.replay()
        self._device.end_of_call()

    # --- recovery -------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Collective: put every ring, the combine buffer, the error state and the call count back to their first
        state, on every rank (after any device error, a failed step or diverged calls; every layer on the
        workspace is usable again, and GPU graphs captured before stay valid). Works inside a step too (its later
        calls count from 0, as on every rank).

        Raises:
            PeerTimeout: a rank did not reach the reset within the bound.
            RingClosedError: the workspace or its context is closed.
        """
        self.ctx.check_open()
        if self.closed:
            raise RingClosedError("this workspace was closed (its layers can no longer run)")
        if self._device is not None:
            self._device.reset()
        else:
            self._host.reset()
        self.failure = None
        self._step_failure = None
        self.calls = 0

    # --- host (CPU) memory ------------------------------------------------------------------------------

    @property
    def host(self) -> "_HostMemory":
        return self._host

    @property
    def gpu(self):
        """The device memory (`symmring.moe.gpu.memory.DeviceMemory`) on a device backend."""
        return self._device

    # --- accounting, teardown -------------------------------------------------------------------------------

    def memory(self) -> Dict[str, int]:
        """Bytes per PE this workspace holds now, by region (`symmring.moe.workspace_plan.REGIONS`); ``total`` too.

        On GPUs ``scratch`` is the engines' transient tensors (the fp8 activations' scales; the torch engine's
        L1 output and activations), which come from torch's allocator during a call (the plan's figure; freed
        between calls)."""
        regions = dict.fromkeys(REGIONS, 0)
        if self._host is not None:
            regions.update(self._host.memory())
        elif self._device is not None:
            regions.update(self._device.memory())
        regions["total"] = sum(regions[name] for name in REGIONS)
        return regions

    def check_open(self) -> None:
        """Raise what the context raises when it is closed or broken, else `RingClosedError` when this workspace
        was closed, `BrokenStateError` when a call left it in an unknown state."""
        self.ctx.check_open()
        if self.closed:
            raise RingClosedError("this workspace was closed (its layers can no longer run)")
        if self.failure is not None:
            raise BrokenStateError(f"rank {self.rank}: the workspace is in an unknown state after a call failed "
                                   f"part-way ({type(self.failure).__name__}: {self.failure}); close its layers and "
                                   "the workspace (collective) and build new ones", self.failure)

    def close(self) -> None:
        """Collective, idempotent: free every region (the layers that borrowed it can no longer run)."""
        if self.closed:
            return
        self.closed = True
        if self._host is not None:
            self._host.close()
        if self._device is not None:
            self._device.close()

    def __repr__(self) -> str:
        return (f"Workspace({self.device}, rank {self.rank}/{self.world_size}, max_tokens={self.max_tokens}, "
                f"budget={self.budget}, shapes={len(self.shapes)}, calls={self.calls}"
                f"{', closed' if self.closed else ''})")


class _GraphEpochs:
    """Which memory of a GPU workspace (its `Workspace.epoch`) each captured graph addresses: graphs of
    `Workspace.capture` are registered when captured; a graph captured otherwise is registered at its first
    `Workspace.replay`, unless the workspace grew since a layer call was captured outside `Workspace.capture`
    (that graph may be one of them: refused)."""

    def __init__(self):
        self.epochs = weakref.WeakKeyDictionary()  # graph -> the epoch it addresses
        self.raw_epochs: set = set()  # epochs at which a layer call was captured outside `capturing`
        self.depth = 0  # inside `capturing`

    @contextlib.contextmanager
    def capturing(self, graph, epoch: int):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        self.epochs[graph] = epoch  # only a capture that completed

    def note_layer_call(self, epoch: int) -> None:
        if not self.depth:
            self.raw_epochs.add(epoch)

    def check(self, graph, epoch: int) -> None:
        """Raise ConfigError unless ``graph`` addresses the memory of ``epoch`` (the workspace's current one)."""
        captured = self.epochs.get(graph)
        if captured is None:
            if any(e != epoch for e in self.raw_epochs):
                raise ConfigError("Workspace.replay: this graph was not captured through Workspace.capture, and the "
                                  "workspace grew (made its memory anew) after a layer call was captured outside "
                                  "it: the graph may address freed memory; capture it again inside "
                                  "Workspace.capture(graph)")
            self.epochs[graph] = captured = epoch
        if captured != epoch:
            raise ConfigError("this graph was captured before its workspace grew for a larger layer (its memory is "
                              "new); capture it again, or build every layer before capturing")


class _HostMemory:
    """The CPU layer's share of a workspace: rings per (spec, ack policy), one combine buffer (float32
    ``[rows][K][H]`` per layer shape, its ready words first) with its generation base, and the pool."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.rings: Dict[Tuple, object] = {}
        self.combine = None
        self.combine_base = 0  # generation base of the combine signals (grows over every call of every layer)
        self.out_offset = align_up(ctx.world_size * _WORD_BYTES, ALIGN)
        self.pool = np.empty(0, np.float32)

    def ring(self, spec: RingSpec, ack_policy: AckPolicy, timeout_s: float, exact: bool):
        """A ring of ``spec``, shared by every layer of that shape (``exact=False``: any one of that shape with
        at least its tokens per slot; a smaller one is replaced). Collective (every rank asks for the same)."""
        from ..ring import Ring
        # The timeout is the ring's (its waits' bound): layers with another one get a ring of their own.
        key = (dataclasses.replace(spec, tokens_per_slot=1), ack_policy, float(timeout_s),
               spec.tokens_per_slot if exact else None)
        ring = self.rings.pop(key, None)
        if ring is not None and ring.spec.tokens_per_slot < spec.tokens_per_slot:
            ring.close()
            ring = None
        if ring is None:
            while len(self.rings) >= MAX_HOST_RINGS:
                self.rings.pop(next(iter(self.rings))).close()
            ring = Ring(self.ctx, spec, ack_policy=ack_policy, timeout_s=timeout_s)
        self.rings[key] = ring  # re-inserted last: most recently used
        return ring

    def ensure_combine(self, nbytes_rows: int) -> None:
        """Make the combine buffer hold ``nbytes_rows`` bytes of rows (collective; all ranks pass the same)."""
        if self.combine is not None and self.combine.nbytes - self.out_offset >= nbytes_rows:
            return
        backend = self.ctx.backend
        if self.combine is not None:
            backend.free(self.combine)  # bounded: nobody still reads or writes the old buffer
            self.combine = None
        self.combine = backend.alloc(self.out_offset + nbytes_rows)
        # The fresh buffer's ready words are 0: generations restart, which is sound since every consumer
        # signals a generation above 0 only after this (collective) allocation.
        self.combine_base = 0

    def combine_rows(self, rank: int, topk: int, hidden: int) -> np.ndarray:
        """Zero-copy ``[rows, K, H]`` float32 view of ``rank``'s combine rows for a layer of that shape."""
        rows = (self.combine.nbytes - self.out_offset) // (topk * hidden * 4)
        return self.ctx.backend.view(self.combine, rank, self.out_offset, np.float32, (rows, topk, hidden))

    def pool_view(self, rows: int, hidden: int) -> np.ndarray:
        """The pool as ``[rows, hidden]`` float32 (grown to that many elements, never shrunk; a bounded
        workspace allocates its whole pool when a layer attaches, so a call never grows it)."""
        if self.pool.size < rows * hidden:
            self.pool = np.empty(rows * hidden, np.float32)
        return self.pool[: rows * hidden].reshape(rows, hidden)

    def reset(self) -> None:
        """Collective: every ring and the combine ready words back to their first state (`symmring.ring.Ring.clear`,
        local stores only, between two bounded barriers: no rank is inside a call while another clears)."""
        backend = self.ctx.backend
        backend.barrier(what="Workspace.reset: every rank out of its calls")
        for ring in self.rings.values():
            ring.clear()
        if self.combine is not None:
            backend.view(self.combine, self.ctx.rank, 0, np.uint64, (self.ctx.world_size,))[:] = 0
        self.combine_base = 0
        backend.barrier(what="Workspace.reset: rings cleared")  # its fences order the stores before any use

    def memory(self) -> Dict[str, int]:
        return {"ring": sum(ring.allocation.nbytes for ring in self.rings.values()),
                "combine": 0 if self.combine is None else self.combine.nbytes, "experts": self.pool.nbytes}

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        if self.combine is not None and not self.ctx.closed:
            self.ctx.backend.free(self.combine)
        self.combine = None


__all__ = ["Workspace", "LayerShape", "given_entries"]
