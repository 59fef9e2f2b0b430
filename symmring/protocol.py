"""The arithmetic of the chunk-ready ring protocol: the single source of truth.

Everything here is pure Python on integers. The device headers (``device/symmring/protocol.cuh``), the
CPU backend (``symmring.ring``) and the model checker (``symmring.modelcheck``) all compute generations,
slots, valid counts and acknowledgement masks with exactly these rules; ``docs/PROTOCOL.md`` is the prose
version.

Vocabulary
----------
* A *call* is one MoE invocation. It moves ``num_chunks`` chunks of ``tokens_per_slot`` tokens through a
  ring of ``num_slots`` slots that every rank owns in its symmetric heap.
* Every rank is a *producer* (it writes its own tokens into its own slots) and a *consumer* (it pulls the
  tokens routed to its experts from every rank's slots).
* For owner rank ``r`` and slot ``s`` the owner's heap holds three signal words::

      route_ready_gen[s]   generation whose topk_idx/topk_weights are published
      layout_ready_gen[s]  generation whose x/x_sf are published
      ack_mask[s][w]       bitmask of consumer ranks that finished with the current generation

Generations (and why no stale value can satisfy a wait)
-------------------------------------------------------
Chunk ``c`` of a call whose *generation base* is ``base`` has generation ``base + c + 1`` and lives in
slot ``c % num_slots``. After the call every rank advances its base by the call's ``num_chunks``. The base
lives in device memory and is advanced by a kernel, so a CUDA Graph that is replayed advances it too: no
generation is ever baked into a launch.

Hence generations form one global sequence ``1, 2, 3, ...`` that only grows, across ring laps, across
calls with different chunk counts and across graph replays. A slot's successive uses carry strictly
growing generations, and ready signals start at ``GEN_NONE = 0``, which no chunk ever carries. A ready
word therefore only ever holds (a) a generation older than the one awaited, which the equality test
rejects, (b) the awaited one, or (c) a newer one. (c) cannot happen while a consumer still waits: the
owner overwrites the slot only after every consumer acknowledged the awaited generation. 64-bit words
cannot wrap in practice (a billion chunks per second for 584 years), so there is no ABA.

Acknowledgements and the mask reset
-----------------------------------
Every consumer rank reads every producer's slot (at least its ``topk_idx`` to learn which tokens are
routed to it), so the *required* set of a slot is all consumer ranks. Consumer ``q`` acknowledges
generation ``g`` of owner ``r``'s slot ``s`` exactly once, by atomically OR-ing bit ``q % 64`` into word
``q // 64`` of ``ack_mask[s]`` on rank ``r``. The mask starts *full* (a fresh slot is free).

Before writing generation ``g`` into slot ``s``, the owner *acquires* the slot: it waits until the mask
equals the required mask (all acknowledgements of the previous use have arrived, acquire), resets the mask
to zero, and only then writes the payload and publishes (release). The reset cannot race with a late
acknowledgement: every required consumer has already sent its single acknowledgement of the previous
generation, and none can acknowledge ``g`` before observing ``g``'s publication, which the owner issues
after the reset (the release fence orders the reset before the publication).

Two acknowledgement policies (`AckPolicy`) choose *when* a consumer acknowledges:

* ``CONSERVATIVE``: after the chunk's combine completed (the RFC's first implementation);
* ``EARLY``: right after its last read of slot memory (payload and metadata), so the owner can refill
  the slot while experts still compute.

Call identities (which call a slot's payload belongs to)
--------------------------------------------------------
A generation says which use of a slot is awaited, not which call: two ranks whose call sequences diverged
(one rank refused a call the others ran, and went on with the next layer's) publish the same generations
on a shared ring. So every published chunk also carries its call's *identity* in the slot's meta row:
``call_identity(number, layer)``, the rank's call number (a counter every rank advances once per call:
the device-resident ``call`` word, advanced at the end of a call with the generation base, or the host's
count) and the layer (an id every rank agreed on when the layer was built). A consumer compares it with
its own call's identity after acquiring readiness; a mismatch is a named error (``call_mismatch``), never
data.

Progress: the enqueue order rule
--------------------------------
Producers wait for acknowledgements; consumers wait for publications. Every serial execution of the host
enqueue order completes if a rank never enqueues the producer of chunk ``c`` before its consumer of
chunk ``c - num_slots`` -- i.e. the producer runs at most ``lookahead <= num_slots - 1`` chunks ahead of
the consumer (`enqueue_order`). By induction on ``c``: every producer and consumer of chunks ``< c`` can
complete, the consumer of ``c`` needs only producers of ``c``, and the producer of ``c`` needs only
consumers of ``c - num_slots``, all enqueued before it on every rank. With ``lookahead >= num_slots`` a
rank's single stream holds the producer of chunk ``num_slots`` ahead of the consumer of chunk 0 it waits
for: a deadlock (the model checker shows the trace).

Example
-------
A call of three chunks from generation base 10 through a 2-slot ring, three ranks::

    >>> [(slot_of(c, 2), generation(10, c)) for c in range(3)]      # slot and generation of each chunk
    [(0, 11), (1, 12), (0, 13)]
    >>> next_base(10, 3), call_num_chunks([5, 0, 9], tokens_per_slot=4), chunk_valid_tokens(9, 2, 4)
    (13, 3, 1)
    >>> missing_ranks((0b101,), full_mask(3))                          # rank 1 has not acknowledged
    [1]
    >>> enqueue_order(3, num_slots=2)                                  # the producer runs 1 chunk ahead
    [('produce', 0), ('produce', 1), ('consume', 0), ('produce', 2), ('consume', 1), ('consume', 2)]
"""

from __future__ import annotations

import enum
from typing import Iterable, List, NamedTuple, Sequence, Tuple

from .errors import ConfigError
from .identity import CALL_LAYER_BITS, CALL_NUMBER_BITS, split_call_identity  # noqa: F401 (the identity's layout)

#: Value of every ready signal before its first publication; no chunk carries it.
GEN_NONE = 0
#: Ranks per acknowledgement-mask word.
RANKS_PER_MASK_WORD = 64
#: Largest generation a 64-bit signal word holds.
GEN_MAX = (1 << 64) - 1


class AckPolicy(enum.IntEnum):
    """When a consumer acknowledges a slot. A host-side choice of each layer (its consume stage issues the
    acknowledgement at the chosen point); the device kernels only ever see *that* they acknowledge."""

    CONSERVATIVE = 0  #: after the chunk's combine completed
    EARLY = 1  #: right after the last read of slot memory

    @classmethod
    def parse(cls, value) -> "AckPolicy":
        """The policy named by ``value``: an `AckPolicy`, its int value, its name in any case
        (``"early"``), or None for the default (`DEFAULT_ACK_POLICY`).

        Raises:
            ConfigError: anything else, naming the accepted values.
        """
        if value is None:
            return DEFAULT_ACK_POLICY
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in {int(p) for p in cls}:
            return cls(value)
        raise ConfigError(f"ack_policy={value!r}: expected an AckPolicy or one of "
                          f"{[p.name.lower() for p in cls]}")


#: The acknowledgement policy when none is given: the RFC's first implementation (after the combine).
DEFAULT_ACK_POLICY = AckPolicy.CONSERVATIVE


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_nonneg(name: str, value: int) -> None:
    if not _is_int(value) or value < 0:
        raise ConfigError(f"{name}={value!r}: expected a non-negative int")


def _check_pos(name: str, value: int) -> None:
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive int")


# --- chunks and slots ---------------------------------------------------------------------------------

def num_chunks_for(num_tokens: int, tokens_per_slot: int) -> int:
    """Chunks needed for ``num_tokens`` tokens: ``ceil(num_tokens / tokens_per_slot)`` (0 for 0 tokens)."""
    _check_nonneg("num_tokens", num_tokens)
    _check_pos("tokens_per_slot", tokens_per_slot)
    return -(-num_tokens // tokens_per_slot)


def call_num_chunks(tokens_per_rank: Sequence[int], tokens_per_slot: int) -> int:
    """Chunks of a call: the most any rank needs. Ranks with fewer tokens publish zero-token chunks, so
    every rank runs the same chunk sequence (and no consumer waits for a chunk that never comes)."""
    return max((num_chunks_for(n, tokens_per_slot) for n in tokens_per_rank), default=0)


def slot_of(chunk_idx: int, num_slots: int) -> int:
    """Ring slot of chunk ``chunk_idx`` (chunks restart at 0 in every call)."""
    _check_nonneg("chunk_idx", chunk_idx)
    _check_pos("num_slots", num_slots)
    return chunk_idx % num_slots


def chunk_token_base(chunk_idx: int, tokens_per_slot: int) -> int:
    """Logical index, within the owner's tokens of this call, of the chunk's first token."""
    _check_nonneg("chunk_idx", chunk_idx)
    _check_pos("tokens_per_slot", tokens_per_slot)
    return chunk_idx * tokens_per_slot


def chunk_valid_tokens(num_tokens: int, chunk_idx: int, tokens_per_slot: int) -> int:
    """Valid tokens of chunk ``chunk_idx`` for a rank holding ``num_tokens`` tokens.

    ``tokens_per_slot`` for full chunks, the remainder for the final partial chunk and 0 for chunks past
    the rank's last token (a zero-token chunk: still written, published and acknowledged).
    """
    _check_nonneg("num_tokens", num_tokens)
    base = chunk_token_base(chunk_idx, tokens_per_slot)
    return max(0, min(tokens_per_slot, num_tokens - base))


# --- generations --------------------------------------------------------------------------------------

def generation(base: int, chunk_idx: int) -> int:
    """Generation of chunk ``chunk_idx`` in a call whose generation base is ``base``: ``base + chunk + 1``."""
    _check_nonneg("base", base)
    _check_nonneg("chunk_idx", chunk_idx)
    return _fit_word(base + chunk_idx + 1)


def next_base(base: int, num_chunks: int) -> int:
    """Generation base of the next call, after a call of ``num_chunks`` chunks (done on the device)."""
    _check_nonneg("base", base)
    _check_nonneg("num_chunks", num_chunks)
    return _fit_word(base + num_chunks)


def _fit_word(gen: int) -> int:
    if gen > GEN_MAX:
        raise OverflowError(f"generation {gen} does not fit a 64-bit signal word")
    return gen


def call_identity(number: int, layer: int) -> int:
    """The identity a call writes into every meta row it publishes and its consumers expect: the call
    ``number`` (modulo ``2**CALL_NUMBER_BITS``) above the ``layer`` id (modulo ``2**CALL_LAYER_BITS``).

    Example:
        >>> call_identity(3, 2), split_call_identity(call_identity(3, 2))
        (196610, (3, 2))
    """
    _check_nonneg("number", number)
    _check_nonneg("layer", layer)
    number %= 1 << CALL_NUMBER_BITS
    return number << CALL_LAYER_BITS | layer % (1 << CALL_LAYER_BITS)


def is_ready(route_gen: int, layout_gen: int, expected: int) -> bool:
    """A consumer may read a slot only when both ready generations equal the expected generation."""
    return route_gen == expected and layout_gen == expected


# --- acknowledgement masks ----------------------------------------------------------------------------

def mask_words(num_ranks: int) -> int:
    """64-bit words of an acknowledgement mask for ``num_ranks`` consumer ranks."""
    _check_pos("num_ranks", num_ranks)
    return -(-num_ranks // RANKS_PER_MASK_WORD)


def ack_bit(rank: int) -> Tuple[int, int]:
    """``(word, bit value)`` that consumer ``rank`` ORs into a slot's mask to acknowledge it."""
    _check_nonneg("rank", rank)
    return rank // RANKS_PER_MASK_WORD, 1 << (rank % RANKS_PER_MASK_WORD)


def required_mask(consumer_ranks: Iterable[int], num_words: int) -> Tuple[int, ...]:
    """Mask words with one bit per consumer rank that must acknowledge (all consumers, in symmring)."""
    words = [0] * num_words
    for rank in consumer_ranks:
        word, bit = ack_bit(rank)
        if word >= num_words:
            raise ConfigError(f"rank {rank} does not fit a mask of {num_words} words")
        words[word] |= bit
    return tuple(words)


def full_mask(num_ranks: int) -> Tuple[int, ...]:
    """Required mask when all ``num_ranks`` ranks consume: also the initial (free) value of a slot."""
    return required_mask(range(num_ranks), mask_words(num_ranks))


def _check_same_words(mask: Sequence[int], required: Sequence[int]) -> None:
    if len(mask) != len(required):
        raise ConfigError(f"mask of {len(mask)} words: expected {len(required)} words like the required mask")


def mask_complete(mask: Sequence[int], required: Sequence[int]) -> bool:
    """Whether every required acknowledgement is present (the owner may then reuse the slot)."""
    _check_same_words(mask, required)
    return all((m & r) == r for m, r in zip(mask, required))


def missing_ranks(mask: Sequence[int], required: Sequence[int]) -> List[int]:
    """Ranks whose required acknowledgement bit is absent from ``mask`` (named in a ``ProtocolTimeout``)."""
    _check_same_words(mask, required)
    missing = []
    for word, (m, r) in enumerate(zip(mask, required)):
        absent = r & ~m
        bit = 0
        while absent:
            if absent & 1:
                missing.append(word * RANKS_PER_MASK_WORD + bit)
            absent >>= 1
            bit += 1
    return missing


# --- host enqueue order -------------------------------------------------------------------------------

def check_lookahead(lookahead: int, num_slots: int) -> None:
    """Raise ``ConfigError`` unless ``0 <= lookahead < num_slots`` (the deadlock-freedom condition)."""
    _check_pos("num_slots", num_slots)
    if not _is_int(lookahead) or lookahead < 0 or lookahead >= num_slots:
        raise ConfigError(f"lookahead={lookahead!r}: expected 0 <= lookahead < num_slots={num_slots} "
                         "(a producer more than num_slots-1 chunks ahead waits on a consumer enqueued "
                         "after it)")


def default_lookahead(num_slots: int) -> int:
    """The deepest lookahead that keeps every serial schedule live: ``num_slots - 1``."""
    _check_pos("num_slots", num_slots)
    return num_slots - 1


def enqueue_order(num_chunks: int, num_slots: int, lookahead: int | None = None,
                  *, check: bool = True) -> List[Tuple[str, int]]:
    """One rank's host enqueue order: ``[("produce", c) | ("consume", c), ...]``.

    The producer runs ``lookahead`` chunks ahead of the consumer: produce 0..lookahead, then alternately
    consume ``c`` and produce ``c + lookahead + 1``. Executed serially (one stream, or
    ``CUDA_LAUNCH_BLOCKING=1``) on every rank, this order completes for any ``lookahead < num_slots``.
    ``check=False`` builds the order for a forbidden lookahead (the model checker's deadlock mutant).
    """
    _check_nonneg("num_chunks", num_chunks)
    if lookahead is None:
        lookahead = default_lookahead(num_slots)
    if check:
        check_lookahead(lookahead, num_slots)
    order: List[Tuple[str, int]] = []
    produced = 0
    for consumed in range(num_chunks):
        while produced < num_chunks and produced <= consumed + lookahead:
            order.append(("produce", produced))
            produced += 1
        order.append(("consume", consumed))
    return order


def check_expert_window(expert_window: int, num_slots: int) -> None:
    """Raise ``ConfigError`` unless ``1 <= expert_window <= num_slots``.

    A consumer of a window waits for the route of every chunk of the window before it acknowledges any of
    them; the producer of the window's last chunk ``c0 + W - 1`` needs the acknowledgements of chunk
    ``c0 + W - 1 - num_slots``, which must lie before the window: ``W <= num_slots``.
    """
    _check_pos("num_slots", num_slots)
    if not _is_int(expert_window) or expert_window < 1 or expert_window > num_slots:
        raise ConfigError(f"expert_window={expert_window!r}: expected 1 <= expert_window <= num_slots={num_slots} "
                          "(a window's consumer waits for all of its chunks before acknowledging any)")


def expert_windows(num_chunks: int, expert_window: int) -> List[Tuple[int, int]]:
    """The call's expert windows: consecutive ``(first, last)`` chunk pairs of ``expert_window`` chunks
    (the last window may be shorter)."""
    _check_nonneg("num_chunks", num_chunks)
    _check_pos("expert_window", expert_window)
    return [(c, min(num_chunks, c + expert_window) - 1) for c in range(0, num_chunks, expert_window)]


def windowed_enqueue_order(num_chunks: int, num_slots: int, expert_window: int = 1,
                           *, check: bool = True) -> List[Tuple[str, int, int]]:
    """One rank's host enqueue order with expert windows: ``("produce", c, c)`` and ``("consume", first,
    last)`` items.

    Before consuming the window ``[c0, c1]`` every chunk ``c < c0 + num_slots`` is produced (its slot's
    previous chunk ``c - num_slots < c0`` was consumed, hence acknowledged, earlier in the order), which
    includes the whole window since ``c1 < c0 + expert_window <= c0 + num_slots``. Executed serially on every
    rank, it completes. ``expert_window = 1`` is `enqueue_order` with the default lookahead.
    ``check=False`` builds the order for a forbidden window (the model checker's deadlock mutant).
    """
    if check:
        check_expert_window(expert_window, num_slots)
    else:
        _check_pos("num_slots", num_slots)
    order: List[Tuple[str, int, int]] = []
    produced = 0
    for first, last in expert_windows(num_chunks, expert_window):
        while produced < num_chunks and produced < first + num_slots:
            order.append(("produce", produced, produced))
            produced += 1
        order.append(("consume", first, last))
    # Only a forbidden window (check=False) leaves chunks unproduced before the last window.
    order += [("produce", c, c) for c in range(produced, num_chunks)]
    return order


# --- the captured dependency graph of one rank's call -----------------------------------------------------

#: An item of a (windowed) enqueue order -- ``("produce", c, c)`` or ``("consume", first, last)`` -- or the
#: end of the call, ``("end_call", num_chunks, num_chunks)``.
Item = Tuple[str, int, int]


class DependencyEdge(NamedTuple):
    """``after`` may start only once ``before`` finished on this rank; ``why`` names the rule."""

    before: Item
    after: Item
    why: str  #: ``"stream"``, ``"own chunks"``, ``"own acknowledgement"`` or ``"end"``


def call_dependency_graph(order: Sequence[Item], num_slots: int, *,
                          two_streams: bool) -> Tuple[Tuple[Item, ...], Tuple[DependencyEdge, ...]]:
    """The dependency graph of one rank's call as captured (a CUDA graph of the layer's enqueue order), with
    the local edges that make every topological order of it a valid serial schedule.

    A captured graph keeps only the edges it is given: stream order within each stream, and the fork and
    join of the streams. With producer and consumer on two streams that lets an executor run a window's
    consumer before this rank's own producer of its chunks, or a producer before this rank's own
    acknowledgement of the slot's previous use, and spin there forever. So the layer adds, between the
    streams (one stream already orders both, as `windowed_enqueue_order` does):

    * ``"own chunks"``: consume ``[c0, c1]`` after this rank's produce of ``c1`` (hence of every chunk of the
      window: the producer stream runs them in order), whose route and layout the window waits for;
    * ``"own acknowledgement"``: produce ``c`` after this rank's consume of the window holding
      ``c - num_slots``, the previous use of ``c``'s slot (EARLY acknowledges inside that window,
      CONSERVATIVE at its end: after the window holds for both).

    Plus ``"stream"`` edges (each item after the previous item of its stream) and ``"end"`` edges (the end of
    the call, which advances the generation base, after the last item of each stream). The waits on other
    ranks stay waits: the model checker explores every rank running any topological order of its graph
    (``symmring.modelcheck``, ``ModelConfig(graph=True)``).

    Args:
        order: the call's items, ``("produce", c, c)`` and ``("consume", first, last)``, as
            `windowed_enqueue_order` returns them (any order that produces every chunk once, in order, and
            consumes consecutive windows).
        num_slots: ring slots.
        two_streams: producer and consumer items on two streams (else one stream runs ``order``).

    Returns:
        ``(items, edges)``: the items of ``order`` followed by ``("end_call", n, n)``, and the edges.

    Raises:
        ConfigError: ``order`` is not such an order.

    Example:
        >>> items, edges = call_dependency_graph(windowed_enqueue_order(3, 2, 1), 2, two_streams=True)
        >>> [(e.before, e.after) for e in edges if e.why == "own acknowledgement"]
        [(('consume', 0, 0), ('produce', 2, 2))]
    """
    _check_pos("num_slots", num_slots)
    items = [tuple(item) for item in order]
    produced = [c for kind, c, _ in items if kind == "produce"]
    windows = [(first, last) for kind, first, last in items if kind == "consume"]
    num_chunks = len(produced)
    if (produced != list(range(num_chunks)) or len(produced) + len(windows) != len(items)
            or any(kind == "produce" and a != b for kind, a, b in items)
            or [c for first, last in windows for c in range(first, last + 1)] != list(range(num_chunks))):
        raise ConfigError(f"order={list(order)!r}: expected ('produce', c, c) for every chunk in order and "
                          "('consume', first, last) windows covering the chunks consecutively")
    end: Item = ("end_call", num_chunks, num_chunks)
    position = {item: i for i, item in enumerate(items)}
    edges: List[DependencyEdge] = []
    streams = ([[it for it in items if it[0] == "produce"], [it for it in items if it[0] == "consume"]]
               if two_streams else [items])
    for stream in streams:
        edges += [DependencyEdge(a, b, "stream") for a, b in zip(stream, stream[1:])]
        if stream:
            edges.append(DependencyEdge(stream[-1], end, "end"))
    if two_streams:
        window_of = {c: (first, last) for first, last in windows for c in range(first, last + 1)}
        for first, last in windows:
            edges.append(DependencyEdge(("produce", last, last), ("consume", first, last), "own chunks"))
        for c in range(num_slots, num_chunks):
            first, last = window_of[c - num_slots]
            edges.append(DependencyEdge(("consume", first, last), ("produce", c, c), "own acknowledgement"))
    for before, after, why in edges:
        if why != "end" and position[before] > position[after]:
            raise ConfigError(f"order={list(order)!r}: {after} comes before {before} ({why}): not a valid "
                              "enqueue order")
    return tuple(items) + (end,), tuple(edges)
