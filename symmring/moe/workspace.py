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
On GPUs growing makes the memory anew (after a device synchronisation): the layers attached before get
views of the new memory and drop their cached graphs and plans, and a graph of `symmring.moe.gpu.MoE.capture`
refuses to replay with a `ConfigError`; any other CUDA graph captured over a layer's forward before (a
`torch.cuda.graph`, a compiled model's) addresses freed memory and must be captured again: build every
layer first, then capture, as a server does. On CPUs the rings and the combine buffer also grow on demand
within a call (collectively). Layers of different shapes share the pool and combine bytes; each distinct
shape has its ring (layers of one shape share it, and its generations keep growing across their calls).

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
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..closing import Closing
from ..errors import BrokenStateError, ConfigError, RingClosedError
from ..layout import ALIGN, RingSpec, align_up
from ..protocol import AckPolicy
from .workspace_plan import REGIONS, LayerShape, WorkspacePlan, plan

log = logging.getLogger(__name__)

#: Rings a host workspace keeps (per ring spec and acknowledgement policy; least recently used dropped).
MAX_HOST_RINGS = 8
_WORD_BYTES = 8


def _token_count(value) -> int:
    """``value`` as a token count (an int >= 0), else a ConfigError naming ``num_tokens``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"num_tokens={value!r}: expected an int >= 0")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Step:
    """What a `Workspace.step` exchanged: every rank's ``counts``, whether every rank routes with its layers'
    own routers (``distinct``), and every rank's latched device error words (None where none)."""

    counts: Tuple[int, ...]
    distinct: bool
    latched: Tuple

    def bucket(self, cap: int) -> int:
        """The token bucket of the step's largest count, at most ``cap`` (`symmring.moe.gpu.plan.token_bucket`); a GPU
        layer also keeps it within its ring's whole chunks (`symmring.moe.gpu.MoE._bucket`)."""
        from .gpu.plan import token_bucket
        return token_bucket(max(self.counts), cap)


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
        self.calls = 0  # calls made on it
        self.epoch = 0  # GPU: bumped each time the memory is made anew (a graph captured before cannot replay)
        self._layers: List["weakref.ref"] = []  # GPU layers attached (their views and graphs follow the memory)
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
        shapes = tuple(dict.fromkeys(self.shapes + (shape,)))
        bounds = [t for t in (self.max_tokens, max_tokens) if t is not None]
        tokens = max(bounds) if bounds else None
        if shapes == self.shapes and tokens == self.max_tokens:
            return
        if self._host is not None:
            # Without a token bound the CPU workspace grows with the calls (one pass per chunk); with one,
            # the pool is the plan's, allocated now.
            self.plan = None if tokens is None else plan(
                shapes, world_size=self.world_size, max_tokens=tokens, budget=self.budget, device="cpu",
                tokens_per_slot=min(tokens, self.tokens_per_slot or tokens), pool_rows=self.pool_rows_override)
            self.shapes, self.max_tokens = shapes, tokens  # only once the plan holds them
            hidden = max(s.hidden for s in shapes)
            rows = max((self.pool_rows(s) for s in shapes), default=0) if self._bounded else 0
            self._host.pool_view(rows, hidden)
            return
        if tokens is None:
            raise ConfigError("workspace: a GPU layer needs max_tokens (the workspace's or the layer's)")
        self.plan = plan(shapes, world_size=self.world_size, max_tokens=tokens, budget=self.budget,
                         tokens_per_slot=None if self.tokens_per_slot is None else min(tokens, self.tokens_per_slot),
                         device="gpu", pool_rows=self.pool_rows_override)
        self.shapes, self.max_tokens = shapes, tokens  # only once the plan holds them
        from .gpu.memory import DeviceMemory
        if self._device is not None and self._device.fits(self.plan):
            self._device.plan = self.plan  # the memory holds the new plan too: nothing moves
            return
        requests = []
        if self._device is not None:
            # The layers attached so far get their views of the new memory; what addressed the old memory
            # goes: their cached graphs and plans now, graphs captured by hand at their replay (`epoch`).
            for layer in self.layers():
                layer.forget_workspace_memory()
            import torch
            torch.cuda.synchronize()  # no kernel of an earlier call still uses the memory freed below
            requests = self._device.requests
            self._device.close()
        self._device = DeviceMemory(self, self.plan)
        self.epoch += 1
        self._device.rebind(requests)

    @property
    def _bounded(self) -> bool:
        return self.pool_rows_override is not None or self.plan is not None

    def register(self, layer) -> None:
        """Remember a GPU layer (weakly) so a later growth can drop what it keeps of the old memory."""
        self._layers.append(weakref.ref(layer))

    def layers(self) -> List:
        """The live GPU layers attached to this workspace."""
        alive = [ref() for ref in self._layers]
        self._layers = [ref for ref, layer in zip(self._layers, alive) if layer is not None]
        return [layer for layer in alive if layer is not None and not layer.closed]

    def pool_rows(self, shape: LayerShape) -> int:
        """Rows of the pool for a layer of ``shape``: ``pool_rows=``, else the plan's (on CPUs without any
        ``max_tokens``: unbounded, the pool grows to each chunk's arrivals)."""
        if self.plan is not None:
            return self.plan.pool_rows[shape]
        if self.pool_rows_override is not None:
            return self.pool_rows_override
        return sys.maxsize  # CPU without a token bound: the pool grows to each chunk's arrivals

    def begin_call(self) -> None:
        """A layer starts a call on this workspace (counted in `calls`)."""
        self.check_open()
        self.calls += 1

    # --- model steps ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, num_tokens: int, *, own_router: bool = True):
        """One model step (a forward of every layer) with ONE bounded host exchange for all its MoE calls:
        every rank's token count, whether every rank routes with the layers' own routers, and every rank's
        latched device error (as vLLM exchanges its data-parallel token counts once per step). Collective:
        every rank enters the step. Inside it the GPU layers' `forward` exchanges nothing: every rank plans
        its calls for the same token bucket (`symmring.moe.gpu.plan.token_bucket` of the largest count), and
        each rank's exact count goes to the device.

        Args:
            num_tokens: this rank's tokens in every MoE call of the step (a call may have fewer; more is a
                `ConfigError`).
            own_router: every call of the step routes with the layer's router (``router_weight`` or
                ``logits``: distinct experts per token, a tighter bound for the engines); False when some
                call passes ``topk_idx``.

        Yields:
            the `Step` (its ``counts``, ``bucket`` and ``distinct``).

        Raises:
            ConfigError: a bad argument, or a step inside a step (before any exchange).
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
        self.check_open()
        latched = None if self._device is None else self._device.latched()
        triples = [(num_tokens, own_router, latched)] if self.world_size == 1 else \
            self.ctx.collectives.allgather((num_tokens, own_router, latched), what="Workspace.step")
        counts = tuple(int(c) for c, _, _ in triples)
        self.active_step = Step(counts=counts, distinct=all(bool(r) for _, r, _ in triples),
                                latched=tuple(e for _, _, e in triples))
        try:
            yield self.active_step
        finally:
            self.active_step = None

    def set_call_tokens(self, num_tokens: int) -> None:
        """GPU: this rank's token count for the next call or replay, enqueued on the current torch stream (a
        graph captured over a step reads it on the device: set it before each ``graph.replay()`` with that
        replay's count, at most the rows the graph was captured with; every launch is also clamped to those
        rows). `forward` sets it itself. Ordered after the last call of any layer on this workspace (as a
        call is): replay the step on the same stream."""
        num_tokens = _token_count(num_tokens)
        if self._device is None:
            raise ConfigError("Workspace.set_call_tokens: a GPU workspace with a layer attached")
        self._device.begin_call(num_tokens)

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


__all__ = ["Workspace", "LayerShape"]
