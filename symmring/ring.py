"""`Ring`: the chunk-ready protocol of `symmring.protocol`, driven from the host over any backend.

The ring is one symmetric allocation laid out by `RingLayout`. Every rank owns its slots (it is the
producer of its own tokens) and pulls every rank's slots (it is a consumer of all of them). This class
uses only the `symmring.backends.Backend` interface, so the same code runs on the CPU backend (MPI
shared memory) and on NVSHMEM; it never branches on the backend.

One call moves chunks ``0 .. num_chunks-1``::

    call = ring.begin_call(num_chunks)          # generation base read from the ring's gen_base word
                                                # (call_id=: the call's identity, protocol.call_identity)
    # producer of chunk c (this rank owns the slot)
    ring.acquire_slot(call, c)                  # wait: every rank acknowledged the slot's previous use
    ring.write_route(call, c, topk_idx, topk_weights, token_base, num_valid)
    ring.write_layout(call, c, x, x_sf)
    ring.publish_route(call, c); ring.publish_layout(call, c)
    # consumer of chunk c, for every source rank
    ring.wait_ready(call, c, src)               # both ready generations == call.generation(c)
    view = ring.read(call, c, src)              # copies of the valid rows
    ring.ack(call, c, src)                      # after the last read of src's slot
    ring.end_call(call)                         # gen_base += num_chunks, the ring's call count += 1

Every meta row carries its call's identity (`symmring.protocol.call_identity`), and `read` (and the CPU layer)
refuses a slot whose identity is not the reader's own call's (`CallMismatch`): ranks whose call sequences
diverged get a named error, never another call's rows.

A rank that runs its producer at most ``num_slots - 1`` chunks ahead of its consumer never deadlocks
(`protocol.enqueue_order`). Every wait is bounded by the ring's ``timeout_s`` and raises
`ProtocolTimeout` naming the waiting rank, the peer, the slot, the chunk, the expected and observed values
and the ranks that did not answer; the collective steps (construction, `Ring.close`) go through the
context's bounded collectives and raise `PeerTimeout` naming a rank that did not come. Every argument is
checked before shared memory is touched (`ConfigError`), so a rejected call leaves the ring as it was.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, NamedTuple, Optional, Set, Tuple

import numpy as np

from . import layout as _layout
from . import protocol
from . import transport as transport_mod
from .backends.base import Backend
from .closing import Closing
from .errors import CallMismatch, ConfigError, ProtocolTimeout, RingClosedError, StalePayload, SymmringError
from .layout import RingLayout, RingSpec
from .protocol import AckPolicy

if TYPE_CHECKING:  # the context makes the workspace, whose CPU share makes rings: no import back
    from .context import Context

log = logging.getLogger(__name__)

#: Bytes of one 64-bit signal or mask word.
_WORD_BYTES = 8

#: Accepted dtype names of ``x`` per ring format: the stored bit pattern and the typed alias viewed as it.
_X_DTYPES = {"fp8_e4m3": (np.dtype(np.uint8), "float8_e4m3fn"), "bf16": (np.dtype(np.uint16), "bfloat16")}


class ChunkView(NamedTuple):
    """Copies of the valid rows of one source rank's chunk (``num_valid`` rows each)."""

    x: Any  #: [num_valid, H] uint8 (fp8 e4m3 bits) or uint16 (bf16 bits)
    x_sf: Any  #: [num_valid, num_sf] float32
    topk_idx: Any  #: [num_valid, K] int32, -1 = masked
    topk_weights: Any  #: [num_valid, K] float32
    token_base: int  #: logical index of the first row among the source rank's tokens of this call
    num_valid: int


class Call:
    """One MoE invocation on a ring: chunks ``0 .. num_chunks-1`` with generations ``base + c + 1``, and the
    identity ``call_id`` (`symmring.protocol.call_identity`) its meta rows carry.

    Made by `Ring.begin_call`; tracks which protocol steps this rank took, so an out-of-order step (a
    write before `Ring.acquire_slot`, a read before `Ring.wait_ready`, a read after `Ring.ack`) is a
    `ConfigError` instead of a silent data race.
    """

    def __init__(self, ring: "Ring", base: int, num_chunks: int, call_id: int = 0):
        self.ring = ring
        self.base = base
        self.num_chunks = num_chunks
        self.call_id = call_id
        self.ended = False
        self._acquired: Set[int] = set()
        self._route_written: Set[int] = set()
        self._route_published: Set[int] = set()
        self._layout_published: Set[int] = set()
        self._ready: Set[Tuple[int, int]] = set()  # (chunk, src_rank) awaited and not yet acknowledged
        self._acked: Set[Tuple[int, int]] = set()

    def generation(self, chunk: int) -> int:
        """Generation of ``chunk`` (`protocol.generation`)."""
        self._check_chunk(chunk)
        return protocol.generation(self.base, chunk)

    def slot(self, chunk: int) -> int:
        """Ring slot of ``chunk`` (`protocol.slot_of`)."""
        self._check_chunk(chunk)
        return protocol.slot_of(chunk, self.ring.spec.num_slots)

    def _check_chunk(self, chunk) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or not 0 <= chunk < self.num_chunks:
            raise ConfigError(f"chunk={chunk!r}: expected an int with 0 <= chunk < num_chunks={self.num_chunks}")

    def __repr__(self) -> str:
        return f"Call(base={self.base}, num_chunks={self.num_chunks}, ended={self.ended})"


def _int_arg(name: str, value, low: int, high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high]`` (inclusive), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name}={value!r}: expected an int")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"{low} <= {name}" + (f" <= {high}" if high is not None else "")
        raise ConfigError(f"{name}={value}: expected {bound}")
    return value


def _check_array(name: str, arr, shape: Tuple[int, ...], kinds: str, dtypes=()) -> np.dtype:
    """Check ``arr``'s shape and dtype (NumPy or CuPy); returns its dtype."""
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
        raise ConfigError(f"{name}: expected an array of shape {shape}, got {type(arr).__name__}")
    dtype = np.dtype(arr.dtype)
    if tuple(arr.shape) != tuple(shape):
        raise ConfigError(f"{name}.shape={tuple(arr.shape)}: expected {tuple(shape)}")
    if dtype.kind not in kinds and dtype.name not in dtypes:
        allowed = sorted(set(dtypes)) or [f"kind {kinds!r}"]
        raise ConfigError(f"{name}.dtype={dtype.name}: expected {' or '.join(allowed)}")
    return dtype


class Ring(Closing):
    """A ring of ``spec.num_slots`` token-chunk slots on every rank (collective constructor).

    Args:
        ctx: the `symmring.context.Context` (every rank passes its own, all with the same world).
        spec: the `RingSpec`; identical on every rank.
        ack_policy: when consumers acknowledge (`AckPolicy`, or its name; None: the default), recorded as
            ``ring.ack_policy`` for the layer that consumes the ring; the protocol is the same for both.
        timeout_s: bound of every wait of this ring; ``ctx.timeout_s`` when None.
        transport: how the ring's device kernels reach each peer (`symmring.transport`; None:
            ``SYMMRING_TRANSPORT``, else ``"auto"``), recorded as ``ring.transport`` and applied by
            `symmring.kernels.RingKernels.for_ring`. This class's own host-side views read peers through
            their mapping (one node).

    Raises:
        ConfigError: a bad argument, or ranks passing different specs.
        RingClosedError: ``ctx`` is closed.
        BrokenStateError: an earlier host collective of ``ctx`` failed.
        PeerTimeout: a rank did not construct its ring within the bound (named).

    Example:
        >>> import symmring
        >>> ctx = symmring.init("host")
        >>> ring = Ring(ctx, RingSpec(num_slots=2, tokens_per_slot=4, hidden=128, num_topk=2, num_experts=8))
        >>> call = ring.begin_call(1)
        >>> ring.acquire_slot(call, 0)
        >>> ring.write_route(call, 0, np.zeros((4, 2), np.int32), np.ones((4, 2), np.float32), 0, 4)
        >>> ring.write_layout(call, 0, np.zeros((4, 128), np.uint8), np.ones((4, 1), np.float32))
        >>> ring.publish_route(call, 0); ring.publish_layout(call, 0)
        >>> ring.wait_ready(call, 0, 0); view = ring.read(call, 0, 0); ring.ack(call, 0, 0)
        >>> view.num_valid, float(view.topk_weights.sum())
        (4, 8.0)
        >>> ring.end_call(call); ring.close(); ctx.close()
    """

    def __init__(self, ctx: Context, spec: RingSpec, *, ack_policy=None, timeout_s: Optional[float] = None,
                 transport=None):
        if not isinstance(getattr(ctx, "backend", None), Backend) or not hasattr(ctx, "collectives"):
            raise ConfigError(f"ctx={ctx!r}: expected a symmring Context (symmring.init())")
        ctx.check_open()
        if not isinstance(spec, RingSpec):
            raise ConfigError(f"spec={spec!r}: expected a RingSpec")
        ack_policy = AckPolicy.parse(ack_policy)
        transport_mod.request(transport, ctx.world_size)  # validated here; resolved by the device kernels
        if timeout_s is None:
            timeout_s = ctx.timeout_s
        elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        # Every rank must lay the ring out identically, or offsets disagree between ranks.
        specs = ctx.collectives.allgather(spec, what="Ring: spec exchange")
        odd_ranks = [r for r, other in enumerate(specs) if other != specs[0]]
        if odd_ranks:
            raise ConfigError(f"spec={spec} on rank {ctx.rank}: ranks {odd_ranks} passed a RingSpec different "
                              f"from rank 0's {specs[0]}; expected the same spec on every rank")
        self.ctx = ctx
        self.spec = spec
        self.ack_policy = ack_policy
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.layout = RingLayout(spec, ctx.world_size)
        self.closed = False
        self._backend = ctx.backend
        self._required_mask = protocol.full_mask(self.world_size)
        self._open_call: Optional[Call] = None
        self._views: Dict[Tuple[str, int, int], Any] = {}
        self._alloc = self._backend.alloc(self.layout.nbytes)
        # The mask starts full: a fresh slot counts as acknowledged by everyone (free). The barrier orders
        # these stores before any rank's first acquire_slot or ack.
        masks = self._backend.view(self._alloc, self.rank, self.layout["ack_mask"].offset, np.uint64,
                                   (spec.num_slots, self.layout.mask_words))
        for word_idx, required in enumerate(self._required_mask):
            masks[:, word_idx] = required
        self._backend.barrier(what="Ring: masks initialised")
        log.debug("rank %d: ring %s, %d bytes per rank", self.rank, spec, self.layout.nbytes)

    @property
    def allocation(self):
        """The backend's symmetric allocation holding the ring (offsets from `layout`; for descriptors)."""
        self._check_open()
        return self._alloc

    # --- views ----------------------------------------------------------------------------------------

    def _view(self, name: str, slot, rank):
        self._check_open()
        slot = _int_arg("slot", slot, 0, self.spec.num_slots - 1)
        rank = self.rank if rank is None else _int_arg("rank", rank, 0, self.world_size - 1)
        key = (name, slot, rank)
        view = self._views.get(key)
        if view is None:  # views stay valid until close(): make each once
            region = self.layout[name]
            view = self._backend.view(self._alloc, rank, region.slot_offset(slot), region.dtype,
                                      region.slot_shape)
            self._views[key] = view
        return view

    def x(self, slot: int, rank: Optional[int] = None):
        """Zero-copy ``[T, H]`` view of ``x`` in ``rank``'s (default: this rank's) ``slot``."""
        return self._view("x", slot, rank)

    def x_sf(self, slot: int, rank: Optional[int] = None):
        """Zero-copy ``[T, num_sf]`` float32 view of the fp8 scales."""
        return self._view("x_sf", slot, rank)

    def topk_idx(self, slot: int, rank: Optional[int] = None):
        """Zero-copy ``[T, K]`` int32 view of the expert ids (-1 = masked)."""
        return self._view("topk_idx", slot, rank)

    def topk_weights(self, slot: int, rank: Optional[int] = None):
        """Zero-copy ``[T, K]`` float32 view of the combine weights."""
        return self._view("topk_weights", slot, rank)

    def meta(self, slot: int, rank: Optional[int] = None):
        """Zero-copy ``[META_COLUMNS]`` int64 view: token_base, num_valid, chunk_idx, payload generation, call
        identity."""
        return self._view("meta", slot, rank)

    # --- word offsets ---------------------------------------------------------------------------------

    def _ready_offset(self, kind: str, slot: int) -> int:
        return self.layout[kind].slot_offset(slot)

    def _ack_offset(self, slot: int, word_idx: int) -> int:
        return self.layout["ack_mask"].slot_offset(slot) + word_idx * _WORD_BYTES

    def _read_mask(self, slot: int, rank: int) -> Tuple[int, ...]:
        return tuple(self._backend.read_word(self._alloc, self._ack_offset(slot, w), rank)
                     for w in range(self.layout.mask_words))

    # --- calls ----------------------------------------------------------------------------------------

    def begin_call(self, num_chunks: int, *, call_id: Optional[int] = None) -> Call:
        """Start a call of ``num_chunks`` chunks (the same count on every rank).

        Reads the generation base from this rank's gen_base word. One call at a time per ring.

        Args:
            call_id: the call's identity (`symmring.protocol.call_identity`: the caller's call number and layer,
                the same on every rank), written into every meta row it publishes and expected in every one it
                reads; None: the ring's own call count (its ``call`` word) with layer 0.

        Raises:
            ConfigError: bad ``num_chunks`` or ``call_id``, or a call of this ring is still open.
            RingClosedError: the ring is closed.
        """
        self._check_open()
        num_chunks = _int_arg("num_chunks", num_chunks, 0)
        if call_id is None:
            call_id = protocol.call_identity(self._backend.read_word(self._alloc, self.layout["call"].offset,
                                                                     self.rank), 0)
        call_id = _int_arg("call_id", call_id, 0, (1 << 63) - 1)
        if self._open_call is not None:
            raise ConfigError(f"begin_call: {self._open_call!r} is still open; call end_call() first")
        base = self._backend.read_word(self._alloc, self.layout["gen_base"].offset, self.rank)
        if num_chunks:
            try:
                protocol.generation(base, num_chunks - 1)
            except OverflowError as exc:
                raise ConfigError(f"num_chunks={num_chunks}: {exc}") from None
        call = Call(self, base, num_chunks, call_id)
        self._open_call = call
        return call

    def end_call(self, call: Call) -> None:
        """Finish ``call``: advance the gen_base word by its chunk count (`protocol.next_base`)."""
        self._check_call(call)
        unpublished = [c for c in range(call.num_chunks)
                       if c not in call._route_published or c not in call._layout_published]
        if unpublished:
            # Allowed (a call abandoned after a ProtocolTimeout), but peers never get these chunks.
            log.warning("rank %d: end_call with chunks %s not fully published", self.rank, unpublished[:8])
        new_base = protocol.next_base(call.base, call.num_chunks)
        # Only this rank reads its gen_base and call words, so relaxed stores suffice (no pairing).
        self._backend.signal_set(self._alloc, self.layout["gen_base"].offset, new_base, self.rank)
        self._backend.signal_add(self._alloc, self.layout["call"].offset, 1, self.rank)
        call.ended = True
        self._open_call = None

    # --- producer -------------------------------------------------------------------------------------

    def acquire_slot(self, call: Call, chunk: int) -> None:
        """Wait until every rank acknowledged the previous use of ``chunk``'s slot, then reset its mask.

        Raises:
            ConfigError: bad call/chunk, or the chunk was already acquired in this call.
            ProtocolTimeout: ``kind="reuse"``, naming the ranks whose acknowledgement never arrived.
        """
        self._check_call(call)
        call._check_chunk(chunk)
        if chunk in call._acquired:
            raise ConfigError(f"acquire_slot: chunk {chunk} was already acquired in {call!r}")
        slot = call.slot(chunk)
        deadline = time.monotonic() + self.timeout_s
        for word_idx, required in enumerate(self._required_mask):
            # Acquire: pairs with the fence before each consumer's atomic_or in ack(); the slot's old
            # payload is no longer read by anyone once this returns.
            ok, _ = self._backend.wait_until(self._alloc, self._ack_offset(slot, word_idx), self.rank, "eq",
                                             required, max(deadline - time.monotonic(), 1e-6))
            if not ok:
                mask = self._read_mask(slot, self.rank)
                raise self._timed_out(ProtocolTimeout(
                    "reuse", rank=self.rank, peer=self.rank, slot=slot, chunk=chunk,
                    expected=_join_words(self._required_mask), observed=_join_words(mask),
                    missing_ranks=protocol.missing_ranks(mask, self._required_mask), timeout_s=self.timeout_s))
        for word_idx in range(self.layout.mask_words):
            # Relaxed: ordered before this use's acknowledgements by the release in publish_*.
            self._backend.signal_set(self._alloc, self._ack_offset(slot, word_idx), 0, self.rank)
        call._acquired.add(chunk)

    def _check_producer_step(self, call: Call, chunk: int, step: str) -> int:
        self._check_call(call)
        call._check_chunk(chunk)
        if chunk not in call._acquired:
            raise ConfigError(f"{step}: chunk {chunk} was not acquired; call acquire_slot(call, {chunk}) first")
        return call.slot(chunk)

    def write_route(self, call: Call, chunk: int, topk_idx, topk_weights, token_base: int, num_valid: int) -> None:
        """Copy routing and metadata of ``num_valid`` tokens into this rank's slot of ``chunk``.

        Args:
            topk_idx: ``[num_valid, K]`` integer expert ids in ``[-1, num_experts)`` (-1 = masked).
            topk_weights: ``[num_valid, K]`` float32 combine weights.
            token_base: logical index of the chunk's first token among this rank's tokens (>= 0).
            num_valid: valid tokens, ``0 <= num_valid <= tokens_per_slot``.

        Raises:
            ConfigError: bad shapes, dtypes, expert ids, counts, or the slot was not acquired or its
                route is already published.
        """
        slot = self._check_producer_step(call, chunk, "write_route")
        if chunk in call._route_published:
            raise ConfigError(f"write_route: chunk {chunk}'s route is already published in {call!r}")
        spec = self.spec
        num_valid = _int_arg("num_valid", num_valid, 0, spec.tokens_per_slot)
        token_base = _int_arg("token_base", token_base, 0)
        _check_array("topk_idx", topk_idx, (num_valid, spec.num_topk), "iu")
        _check_array("topk_weights", topk_weights, (num_valid, spec.num_topk), "", ("float32",))
        if num_valid:
            low, high = int(topk_idx.min()), int(topk_idx.max())
            if low < -1 or high >= spec.num_experts:
                raise ConfigError(f"topk_idx: values in [{low}, {high}]; expected expert ids in "
                                  f"[-1, num_experts={spec.num_experts}) (-1 = masked)")
        self.topk_idx(slot)[:num_valid] = topk_idx
        self.topk_weights(slot)[:num_valid] = topk_weights
        meta = self.meta(slot)
        meta[_layout.META_TOKEN_BASE] = token_base
        meta[_layout.META_NUM_VALID] = num_valid
        meta[_layout.META_CHUNK_IDX] = chunk
        meta[_layout.META_PAYLOAD_GEN] = call.generation(chunk)
        meta[_layout.META_CALL_ID] = call.call_id
        call._route_written.add(chunk)

    def write_layout(self, call: Call, chunk: int, x, x_sf=None) -> None:
        """Copy activations (and fp8 scales) of ``n <= tokens_per_slot`` tokens into rows ``[0, n)``.

        Consumers read rows ``[0, num_valid)`` (``num_valid`` from `write_route`), so write at least that
        many rows.

        Args:
            x: ``[n, H]``: uint8 or ``ml_dtypes.float8_e4m3fn`` for fp8 rings, uint16 or
                ``ml_dtypes.bfloat16`` for bf16 rings (stored as bits).
            x_sf: ``[n, num_sf]`` float32 scales, finite and > 0; required for fp8, None for bf16.

        Raises:
            ConfigError: bad shapes or dtypes, missing/extra scales, or the slot was not acquired or its
                layout is already published.
        """
        slot = self._check_producer_step(call, chunk, "write_layout")
        if chunk in call._layout_published:
            raise ConfigError(f"write_layout: chunk {chunk}'s layout is already published in {call!r}")
        spec = self.spec
        bits_dtype, alias = _X_DTYPES[spec.x_format]
        num_rows = x.shape[0] if hasattr(x, "shape") and len(x.shape) == 2 else -1
        if not 0 <= num_rows <= spec.tokens_per_slot:
            shape = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
            raise ConfigError(f"x.shape={shape}: expected (n, hidden={spec.hidden}) with "
                              f"0 <= n <= tokens_per_slot={spec.tokens_per_slot}")
        dtype = _check_array("x", x, (num_rows, spec.hidden), "", (bits_dtype.name, alias))
        if spec.num_sf:
            if x_sf is None:
                raise ConfigError(f"x_sf=None: expected [{num_rows}, {spec.num_sf}] float32 scales for "
                                  f"x_format={spec.x_format!r}")
            _check_array("x_sf", x_sf, (num_rows, spec.num_sf), "", ("float32",))
            _check_scales(x_sf)
        elif x_sf is not None and tuple(getattr(x_sf, "shape", (None,))) != (num_rows, 0):
            raise ConfigError(f"x_sf: expected None for x_format={spec.x_format!r} (no scales)")
        self.x(slot)[:num_rows] = x if dtype == bits_dtype else x.view(bits_dtype)
        if spec.num_sf:
            self.x_sf(slot)[:num_rows] = x_sf

    def _publish(self, call: Call, chunk: int, kind: str, published: Set[int]) -> None:
        slot = self._check_producer_step(call, chunk, f"publish_{kind.split('_')[0]}")
        if chunk in published:
            raise ConfigError(f"publish: chunk {chunk}'s {kind} is already published in {call!r}")
        # Release: pairs with the acquire in wait_ready; the slot's payload and metadata are visible first.
        self._backend.fence()
        self._backend.signal_set(self._alloc, self._ready_offset(kind, slot), call.generation(chunk), self.rank)
        published.add(chunk)

    def publish_route(self, call: Call, chunk: int) -> None:
        """Publish ``chunk``'s topk_idx/topk_weights/metadata: fence, then route_ready = generation.

        Raises:
            ConfigError: bad call/chunk, `write_route` not called, or already published.
        """
        self._check_producer_step(call, chunk, "publish_route")
        if chunk not in call._route_written:
            raise ConfigError(f"publish_route: chunk {chunk} has no route; call write_route first")
        self._publish(call, chunk, "route_ready", call._route_published)

    def publish_layout(self, call: Call, chunk: int) -> None:
        """Publish ``chunk``'s x/x_sf: fence, then layout_ready = generation.

        Raises:
            ConfigError: bad call/chunk, the slot not acquired, or already published.
        """
        self._publish(call, chunk, "layout_ready", call._layout_published)

    # --- consumer -------------------------------------------------------------------------------------

    def _check_src(self, call: Call, chunk: int, src_rank) -> Tuple[int, int]:
        self._check_call(call)
        call._check_chunk(chunk)
        return call.slot(chunk), _int_arg("src_rank", src_rank, 0, self.world_size - 1)

    def wait_ready(self, call: Call, chunk: int, src_rank: int) -> None:
        """Wait until ``src_rank`` published both route and layout of ``chunk`` (generation equality).

        Raises:
            ConfigError: bad call, chunk or rank, or this chunk of ``src_rank`` was already acknowledged.
            ProtocolTimeout: ``kind="route_ready"`` or ``"layout_ready"`` naming ``src_rank``.
        """
        slot, src_rank = self._check_src(call, chunk, src_rank)
        if (chunk, src_rank) in call._acked:
            raise ConfigError(f"wait_ready: chunk {chunk} of rank {src_rank} was already acknowledged")
        expected = call.generation(chunk)
        deadline = time.monotonic() + self.timeout_s
        for kind in ("route_ready", "layout_ready"):
            # Acquire: pairs with the release (fence) in src_rank's publish_*; the payload reads follow.
            ok, observed = self._backend.wait_until(self._alloc, self._ready_offset(kind, slot), src_rank, "eq",
                                                    expected, max(deadline - time.monotonic(), 1e-6))
            if not ok:
                raise self._timed_out(ProtocolTimeout(kind, rank=self.rank, peer=src_rank, slot=slot, chunk=chunk,
                                                      expected=expected, observed=observed,
                                                      timeout_s=self.timeout_s))
        call._ready.add((chunk, src_rank))

    def read(self, call: Call, chunk: int, src_rank: int) -> ChunkView:
        """Pull copies of the valid rows of ``src_rank``'s ``chunk`` (after `wait_ready`, before `ack`).

        Raises:
            ConfigError: bad arguments, or `wait_ready` has not returned for this chunk and rank (or it
                was acknowledged already).
            StalePayload, CallMismatch, SymmringError: the slot's metadata is not the awaited chunk's
                (`check_meta`).
        """
        slot, src_rank = self._check_src(call, chunk, src_rank)
        if (chunk, src_rank) not in call._ready:
            raise ConfigError(f"read: chunk {chunk} of rank {src_rank} is not ready; call wait_ready first "
                              "(and read before ack)")
        token_base, num_valid = self.check_meta(call, chunk, src_rank)
        return ChunkView(x=self.x(slot, src_rank)[:num_valid].copy(),
                         x_sf=self.x_sf(slot, src_rank)[:num_valid].copy(),
                         topk_idx=self.topk_idx(slot, src_rank)[:num_valid].copy(),
                         topk_weights=self.topk_weights(slot, src_rank)[:num_valid].copy(),
                         token_base=token_base, num_valid=num_valid)

    def check_meta(self, call: Call, chunk: int, src_rank: int) -> Tuple[int, int]:
        """``(token_base, num_valid)`` of ``src_rank``'s slot of ``chunk``, after `wait_ready` returned for it,
        once its meta row was checked to name this chunk, its generation and this call's identity.

        Raises:
            StalePayload: another chunk or generation (the slot was overwritten while in use).
            CallMismatch: another call's identity (the ranks' call sequences diverged: a rank refused or skipped
                a call, or called another layer); nothing of the slot may be used.
            SymmringError: a row count outside ``[0, tokens_per_slot]``.
        """
        slot = call.slot(chunk)
        meta = self.meta(slot, src_rank)
        token_base, num_valid, meta_chunk, meta_gen, meta_call = (int(meta[i]) for i in range(_layout.META_COLUMNS))
        expected = call.generation(chunk)
        if meta_gen != expected or meta_chunk != chunk:
            raise StalePayload(rank=self.rank, peer=src_rank, slot=slot, chunk=chunk, expected=expected,
                               observed=meta_gen, observed_chunk=meta_chunk)
        if meta_call != call.call_id:
            raise CallMismatch(rank=self.rank, peer=src_rank, slot=slot, chunk=chunk, expected=call.call_id,
                               observed=meta_call)
        if not 0 <= num_valid <= self.spec.tokens_per_slot:
            raise SymmringError(f"rank {self.rank}: slot {slot} of rank {src_rank} holds num_valid {num_valid}, "
                                f"outside [0, tokens_per_slot={self.spec.tokens_per_slot}]")
        return token_base, num_valid

    def ack(self, call: Call, chunk: int, src_rank: int) -> None:
        """Acknowledge ``src_rank``'s ``chunk``: fence after the last read, then OR this rank's bit there.

        Raises:
            ConfigError: bad arguments, or `wait_ready` has not returned for it (or it was acknowledged).
        """
        slot, src_rank = self._check_src(call, chunk, src_rank)
        if (chunk, src_rank) not in call._ready:
            raise ConfigError(f"ack: chunk {chunk} of rank {src_rank} is not ready or already acknowledged; "
                              "call wait_ready first")
        word_idx, bit = protocol.ack_bit(self.rank)
        # Release: every read of src_rank's slot completes first; pairs with the acquire in acquire_slot.
        self._backend.fence()
        self._backend.atomic_or(self._alloc, self._ack_offset(slot, word_idx), bit, src_rank)
        call._ready.discard((chunk, src_rank))
        call._acked.add((chunk, src_rank))

    # --- lifetime -------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Put this rank's copy of the ring back to its first state: every word, meta row and payload zeroed (the
        generation base and call count too), the masks full (every slot free), no call open. Local stores only:
        the caller makes it collective (`symmring.Workspace.reset`: a barrier before, so no rank still uses the
        ring, and one after, so none uses it before every rank cleared it)."""
        self._check_open()
        self._backend.view(self._alloc, self.rank, 0, np.uint8, (self.layout.nbytes,))[:] = 0
        masks = self._backend.view(self._alloc, self.rank, self.layout["ack_mask"].offset, np.uint64,
                                   (self.spec.num_slots, self.layout.mask_words))
        for word_idx, required in enumerate(self._required_mask):
            masks[:, word_idx] = required
        self._open_call = None

    def close(self) -> None:
        """Collective: free the ring's symmetric memory (the backend's free waits, bounded, until no rank
        uses it). Idempotent; later use raises RingClosedError. On a broken context the memory is only
        dropped (nothing collective runs).

        Raises:
            PeerTimeout: a rank did not close its ring within the bound.
        """
        if self.closed:
            return
        self.closed = True
        self._open_call = None
        self._views.clear()
        if not self.ctx.closed:
            self._backend.free(self._alloc)

    def __repr__(self) -> str:
        return (f"Ring({self.spec}, rank={self.rank}, world_size={self.world_size}, "
                f"ack_policy={self.ack_policy.name}, closed={self.closed})")

    # --- checks ---------------------------------------------------------------------------------------

    def _timed_out(self, error: ProtocolTimeout) -> ProtocolTimeout:
        """``error``, recorded with the context's collectives (until every rank meets again in a collective,
        a peer may be stalled or gone: the process then aborts the job at exit instead of hanging)."""
        self.ctx.collectives.record_fault(error)
        return error

    def _check_open(self) -> None:
        if self.closed:
            raise RingClosedError(f"{self!r} was closed")
        self.ctx.check_open()

    def _check_call(self, call) -> None:
        self._check_open()
        if not isinstance(call, Call) or call.ring is not self:
            raise ConfigError(f"call={call!r}: expected a Call made by this ring's begin_call()")
        if call.ended:
            raise ConfigError(f"call={call!r}: already ended (end_call)")


def _check_scales(x_sf) -> None:
    """fp8 scales are dequantisation multipliers: finite and > 0 (`symmring.moe.quant` never makes another),
    else a ConfigError naming the first bad one (a NaN or negative scale would turn every row it scales into
    wrong values on every consumer)."""
    values = np.asarray(x_sf.get() if hasattr(x_sf, "get") else x_sf)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ConfigError(f"x_sf[{row}, {col}]={values[row, col]!r}: expected finite scales > 0 "
                          f"({int(bad.sum())} of {values.size} are not)")


def _join_words(words) -> int:
    """Mask words as one integer (word ``w`` at bits ``64*w``), for error messages."""
    return sum(int(w) << (protocol.RANKS_PER_MASK_WORD * i) for i, w in enumerate(words))
