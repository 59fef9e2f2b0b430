"""The per-call plan of the GPU MoE layer: which chunks and expert windows a call runs, in which order.

A plan depends only on every rank's token count, the ring's shape and the schedule (batch or streamed),
so the layer's `Planner` builds it once per distinct call and reuses it: an eager call then only binds its
tensors and launches (no argument re-derivation, no host work that depends on the routing). The planner reads
the layer's spec (`symmring.moe.gpu.spec.GpuSpec`) and the pool's rows, nothing of the layer: from every
rank's token counts (the same list on every rank) and the routing source it picks the token bucket, the
schedule (streamed or batch, small-batch or not) and the plan.

Two schedules, one protocol (every call is a call of the ring protocol, `symmring.protocol`):

* **batch** (``streaming=False``, the default and the fallback): every chunk of the call is produced
  first (all routes, then all layouts), then ONE expert window over all chunks is consumed. With the
  default ring (one slot of ``max_tokens``) that is one chunk: the classic batch-ready handoff. A call
  whose chunks do not all fit the ring at once (more than ``num_slots`` chunks) cannot run batch.
* **streamed** (``streaming=True``): `protocol.windowed_enqueue_order` -- the producer runs ahead by up to
  ``num_slots`` chunks, the consumer takes expert windows of ``expert_window`` chunks -- on a producer and
  a consumer stream (or one stream, ``single_stream``). Executed serially it completes (PROTOCOL.md 9.1a).

Example:
    >>> plan = make_plan((300, 0), rank=0, tokens_per_slot=128, num_slots=3, expert_window=3,
    ...                  streaming=False, two_streams=False, topk=2, capacity=1536)
    >>> plan.num_chunks, [w.first for w in plan.windows.values()], plan.windows[0].rows_bound
    (3, [0], 600)
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from ... import protocol
from ...errors import ConfigError
from ..workspace_plan import spanned_rows

#: Plans a `Planner` keeps (one per distinct (token bucket, schedule); a serving loop sees few).
MAX_CACHED_PLANS = 64
#: Values of ``forward(streaming=...)``.
STREAMING_MODES = (False, True, "auto")


#: Token buckets: powers of two up to this many tokens per rank, then multiples of it.
BUCKET_STEP = 256


def token_bucket(tokens: int, cap: int) -> int:
    """The token bucket of a call whose largest rank has ``tokens`` tokens: 0 for 0, the next power of two up
    to `BUCKET_STEP`, then the next multiple of it; at most ``cap`` (the layer's ``max_tokens``).

    Every rank computes it from the same exchanged (or step-declared) value, so every rank plans the same
    call; a plan and a graph made for a bucket serve ANY counts up to it on every rank, zero included: each
    rank's exact count lives on the device (`symmring.moe.gpu.stages.State.call_tokens`) and travels in the
    slots' metadata.

    Example:
        >>> [token_bucket(n, 4096) for n in (0, 1, 3, 64, 65, 256, 257, 4000, 4096)]
        [0, 1, 4, 64, 128, 256, 512, 4096, 4096]
    """
    if tokens <= 0:
        return 0
    if tokens <= BUCKET_STEP:
        bucket = 1 << (int(tokens) - 1).bit_length()
    else:
        bucket = -(-int(tokens) // BUCKET_STEP) * BUCKET_STEP
    return max(int(tokens), min(bucket, int(cap)))


def num_buckets(cap: int) -> int:
    """How many buckets calls of 1 to ``cap`` tokens per rank fall in (the most graphs a layer's cache holds
    for one schedule and routing source)."""
    return len({token_bucket(n, cap) for n in range(1, cap + 1)})


@dataclass(frozen=True)
class ChunkStep:
    """This rank's part of one chunk: logical token base and valid tokens (0 for a zero-token chunk)."""

    chunk: int
    token_base: int
    num_valid: int


@dataclass(frozen=True)
class WindowStep:
    """One expert window ``[first, last]`` of chunks consumed together (one grouped GEMM).

    Attributes:
        rows_bound: pool rows the experts run over: every (token, k) of every rank's chunks of the window
            plus the alignment padding of every expert group (a host bound from the token counts; the
            exact count stays on the device), at least 1.
        token_begin, num_valid: this rank's logical tokens of the window (the rows of ``y`` it reduces).
        source_tokens: the window's tokens of all ranks.
        rows_per_expert: a host bound of the rows any one local expert holds in the window (the engine's
            small-group kernels cover that many rows of each group): ``source_tokens`` when every rank's
            routing has distinct experts per token (the layer's own router), else ``source_tokens * topk``
            (given routing may name an expert twice); at most ``rows_bound``.
        passes: ``(first window row, rows)`` of each pass through the pool (PROTOCOL.md 9.1c): one pass of
            ``rows_bound`` rows when the window's bound fits the pool, else as many pool-sized passes as the
            bound needs (the routing decides on the device which of them hold rows).
    """

    first: int
    last: int
    rows_bound: int
    token_begin: int
    num_valid: int
    source_tokens: int = 0
    rows_per_expert: int = 0
    passes: Tuple[Tuple[int, int], ...] = ()

    @property
    def chunks(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def rows_spanned(self) -> int:
        """The window rows its passes cover (where the last one ends): the device's count of the window's
        rows may not exceed it (device/moe/bounds.cuh)."""
        if not self.passes:
            return self.rows_bound
        first, rows = self.passes[-1]
        return first + rows

    @property
    def expert_rows_bound(self) -> int:
        """The most rows one local expert may hold in the window by this plan (the device checks it; the
        engines' small-group kernels trust it): ``rows_per_expert`` where it is below ``rows_bound`` (the
        window's tokens or entries), else `rows_spanned` (``rows_per_expert`` was cut to the pool there)."""
        return self.rows_per_expert if self.rows_per_expert < self.rows_bound else self.rows_spanned


@dataclass(frozen=True)
class Plan:
    """What one call runs (see the module docstring).

    Attributes:
        streaming: the schedule; counts: every rank's tokens of the call; num_chunks: the call's chunks.
        small_batch: a one-chunk batch call run by the small-batch schedule's fused kernels
            (`symmring.moe.gpu.stages.small_batch_call`).
        waits: two streams only: for an item of ``order``, the items of the other stream it must follow
            (`protocol.call_dependency_graph`'s "own chunks" and "own acknowledgement" edges), so every
            topological order of the captured call is a valid serial schedule; ``signals``: the items
            whose end an item of the other stream waits for.
        two_streams: producer and consumer on their own streams (streamed, not ``single_stream``).
        order: the enqueue order, ``("produce", c, c)`` and ``("consume", first, last)`` items.
        chunks: this rank's `ChunkStep` per chunk; windows: `WindowStep` by first chunk, in order.
    """

    streaming: bool
    counts: Tuple[int, ...]
    num_chunks: int
    two_streams: bool
    order: Tuple[Tuple[str, int, int], ...]
    chunks: Tuple[ChunkStep, ...]
    windows: Dict[int, WindowStep]
    small_batch: bool = False
    waits: Dict[Tuple[str, int, int], Tuple[Tuple[str, int, int], ...]] = field(default_factory=dict)
    signals: FrozenSet[Tuple[str, int, int]] = frozenset()

    @property
    def last_window(self) -> int:
        """First chunk of the call's last window."""
        return next(reversed(self.windows))


def own_rows(plan: "Plan", rows: int) -> "Plan":
    """``plan`` with this rank's token bounds (each chunk's ``num_valid``, each window's) clamped to ``rows``,
    the rows of the call's ``x`` and ``y``: the device count further clamps them (`State.call_tokens`), and
    this keeps every launch inside the call's tensors whatever that word holds. The plan itself when no
    bound passes ``rows``."""
    if all(c.token_base + c.num_valid <= rows for c in plan.chunks) and \
            all(w.token_begin + w.num_valid <= rows for w in plan.windows.values()):
        return plan
    chunks = tuple(dataclasses.replace(c, num_valid=max(0, min(c.num_valid, rows - c.token_base)))
                   for c in plan.chunks)
    windows = {first: dataclasses.replace(w, num_valid=max(0, min(w.num_valid, rows - w.token_begin)))
               for first, w in plan.windows.items()}
    return dataclasses.replace(plan, chunks=chunks, windows=windows)


def make_plan(counts: Sequence[int], rank: int, *, tokens_per_slot: int, num_slots: int, expert_window: int,
              streaming: bool, two_streams: bool, topk: int, capacity: int, align: int = 1,
              num_groups: int = 1, small_batch: bool = False, distinct_experts: bool = False,
              batch_window: Optional[int] = None) -> Plan:
    """The plan of a call with every rank's token ``counts`` on rank ``rank``.

    Args:
        counts: tokens of every rank in this call (the same list on every rank).
        tokens_per_slot, num_slots: the ring's shape; expert_window: chunks per window when streamed.
        streaming: the schedule; two_streams: streamed on a producer and a consumer stream.
        topk: experts per token; capacity: rows of the expert pool, a multiple of ``align`` (bounds
            ``rows_bound``; a window whose bound exceeds it runs in passes of at most ``capacity`` rows).
        align, num_groups: every one of the ``num_groups`` expert groups starts at a multiple of ``align``
            rows, so a window of ``m`` entries spans at most ``m + min(num_groups, m) * (align - 1)`` rows.
        small_batch: run the call with the small-batch schedule (a batch call of one chunk).
        distinct_experts: every rank's routing names each expert at most once per token (tightens
            ``rows_per_expert``).
        batch_window: chunks per expert window of the batch schedule (the workspace's window; None: all of
            the call's chunks in one window).

    Raises:
        ConfigError: a batch call with more chunks than ``num_slots`` (it cannot be in the ring at once),
            a bad window, or ``small_batch`` for a call that is not a one-chunk batch call.
    """
    counts = tuple(int(c) for c in counts)
    T, S = tokens_per_slot, num_slots
    num_chunks = protocol.call_num_chunks(counts, T)
    if streaming:
        window = expert_window
    else:
        if num_chunks > S:
            raise ConfigError(f"batch call of {max(counts)} tokens on a rank: {num_chunks} chunks of "
                              f"tokens_per_slot={T} do not fit the ring of num_slots={S} at once (at most "
                              f"{S * T} tokens per rank); use streaming=True, or a ring with "
                              "num_slots * tokens_per_slot >= max_tokens")
        window, two_streams = max(1, min(num_chunks, batch_window or num_chunks)), False
    protocol.check_expert_window(window, S)
    if small_batch and (streaming or num_chunks != 1):
        raise ConfigError(f"small_batch: the small-batch schedule runs one-chunk batch calls; this call is "
                          f"{'streamed' if streaming else f'{num_chunks} chunks'} (at most tokens_per_slot={T} "
                          "tokens per rank, streaming=False)")
    if capacity < 1 or (align > 1 and capacity % align):
        raise ConfigError(f"capacity={capacity}: expected a positive multiple of align={align} (pool rows)")
    own = counts[rank]
    chunks = tuple(ChunkStep(c, protocol.chunk_token_base(c, T), protocol.chunk_valid_tokens(own, c, T))
                   for c in range(num_chunks))
    windows: Dict[int, WindowStep] = {}
    for first, last in protocol.expert_windows(num_chunks, window):
        tokens = sum(protocol.chunk_valid_tokens(n, c, T) for n in counts for c in range(first, last + 1))
        entries = topk * tokens
        spanned = spanned_rows(entries, num_groups, align)
        rows_bound = max(1, min(capacity, spanned))
        passes = tuple((begin, min(capacity, spanned - begin)) for begin in range(0, spanned, capacity)) \
            if spanned > capacity else ((0, rows_bound),)
        windows[first] = WindowStep(first, last, rows_bound=rows_bound,
                                    token_begin=protocol.chunk_token_base(first, T),
                                    num_valid=sum(chunks[c].num_valid for c in range(first, last + 1)),
                                    source_tokens=tokens,
                                    rows_per_expert=max(1, min(rows_bound, tokens if distinct_experts else entries)),
                                    passes=passes)
    if small_batch and any(len(w.passes) > 1 for w in windows.values()):
        raise ConfigError(f"small_batch: the small-batch schedule runs one pass; this call's rows (a bound of "
                          f"{sum(rows for _, rows in windows[0].passes)}) exceed the pool of {capacity} rows")
    order = tuple(protocol.windowed_enqueue_order(num_chunks, S, window))
    waits: Dict[Tuple[str, int, int], Tuple[Tuple[str, int, int], ...]] = {}
    if two_streams:
        _, edges = protocol.call_dependency_graph(order, S, two_streams=True)
        for e in edges:
            if e.why in ("own chunks", "own acknowledgement"):
                waits[e.after] = waits.get(e.after, ()) + (e.before,)
    return Plan(streaming=bool(streaming), counts=counts, num_chunks=num_chunks, two_streams=bool(two_streams),
                order=order, chunks=chunks, windows=windows, small_batch=bool(small_batch), waits=waits,
                signals=frozenset(b for befores in waits.values() for b in befores))


class Planner:
    """The plans of one layer's calls, from its spec and the rows of its pool (see the module docstring).

    Args:
        spec: the layer's `symmring.moe.gpu.spec.GpuSpec`.
        policy: the `symmring.moe.gpu.policy.StreamPolicy` of ``streaming="auto"`` (None: the measured default,
            loaded on the first such call).

    `follow` gives it the pool's rows of the workspace memory the calls run on (and drops the plans made for
    another); the layer calls it whenever that memory was made anew.
    """

    def __init__(self, spec, policy=None):
        self.spec, self.policy = spec, policy
        self.capacity = 0  # pool rows (`follow`)
        self._plans: "OrderedDict[Tuple, Plan]" = OrderedDict()

    def follow(self, capacity: int) -> None:
        """The calls now run on a pool of ``capacity`` rows: the plans made so far go."""
        self.capacity = capacity
        self._plans.clear()

    def plan(self, counts: List[int], streaming, small_batch: Optional[bool], distinct: bool) -> Plan:
        """The plan of a call with every rank's token ``counts`` (exchanged or declared to the step: the same list
        on every rank, so every rank plans the same call): for the token bucket of the largest count, streamed
        as ``streaming`` says (``"auto"``: the policy), small-batch where it applies (``small_batch`` None) or as
        forced, ``distinct``: every rank routes with the layer's router.

        Raises:
            ConfigError: a forced ``small_batch`` the call cannot run, a batch call past the ring (`make_plan`).
        """
        most = max(counts)
        bucket = [self.bucket(most)] * self.spec.world_size
        stream_it = self.streams(streaming, most)
        small = self.small_batch_applies(counts, stream_it, bucket) if small_batch is None else small_batch
        key = (tuple(bucket), stream_it, small, distinct)
        plan = self._plans.get(key)
        if plan is None:
            spec = self.spec
            plan = make_plan(bucket, spec.rank, tokens_per_slot=spec.tokens_per_slot, num_slots=spec.num_slots,
                             expert_window=spec.expert_window, streaming=stream_it, two_streams=not spec.single_stream,
                             topk=spec.topk, capacity=self.capacity, align=spec.align,
                             num_groups=spec.num_local_experts, small_batch=small, distinct_experts=distinct,
                             batch_window=spec.batch_window)
            self._plans[key] = plan
            if len(self._plans) > MAX_CACHED_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def bucket(self, most: int) -> int:
        """The token bucket of a call whose largest rank has ``most`` tokens (`token_bucket`): at most
        ``max_tokens``, at most the ring when ``most`` fits it (a batch call must fit the ring), and never more
        chunks than ``most`` needs."""
        spec = self.spec
        ring = spec.num_slots * spec.tokens_per_slot
        cap = min(spec.max_tokens, ring) if most <= ring else spec.max_tokens
        chunks = -(-most // spec.tokens_per_slot) * spec.tokens_per_slot  # never more chunks than the count's
        return token_bucket(most, min(cap, chunks))

    def streams(self, streaming, num_tokens: int) -> bool:
        """Whether a call whose largest rank has ``num_tokens`` tokens runs the streamed schedule: ``streaming``
        itself, or the policy's answer for ``"auto"`` (about the exchanged counts, never one rank's own).

        Raises:
            ConfigError: ``streaming`` not one of `STREAMING_MODES`.
        """
        if isinstance(streaming, bool):
            return streaming
        if streaming != "auto":
            raise ConfigError(f"streaming={streaming!r}: expected one of {list(STREAMING_MODES)}")
        if self.policy is None:
            from .policy import StreamPolicy
            self.policy = StreamPolicy.default()
        return self.policy.streams(self.spec, num_tokens)

    def small_batch_applies(self, counts: List[int], streaming: bool, bucket: Optional[List[int]] = None) -> bool:
        """Whether a call with every rank's token ``counts`` runs the small-batch schedule by default: fp8
        dispatch and experts, batch, at most ``small_batch_tokens`` tokens on every rank, and the call as
        planned (``bucket``: every rank's planned tokens; default ``counts``) one chunk whose rows fit the pool
        in one pass."""
        spec = self.spec
        planned = counts if bucket is None else bucket
        most = max(counts)
        # The small-batch schedule runs one pass: its rows must fit the pool.
        rows = spanned_rows(sum(planned) * spec.topk, spec.num_local_experts, spec.align)
        return (spec.small_batch_capable and not streaming and 0 < most <= spec.small_batch_tokens
                and max(planned) <= spec.tokens_per_slot and rows <= self.capacity)
