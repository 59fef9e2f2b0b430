"""Unit tests of symmring/protocol.py: the arithmetic of generations, slots, masks and enqueue order.

Every function of the module is exercised on seeded random inputs and checked against a property or an
independent derivation (not against hard-coded answers). The enqueue orders are checked for their shape
here; their deadlock freedom (and the converses) by the model checker (tests/test_modelcheck.py), which
explores every interleaving of them on the protocol model.
"""

from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

import pytest

from symmring import protocol
from symmring.errors import ConfigError
from symmring.protocol import AckPolicy

SEED = 20261129
WORD_MASK = (1 << 64) - 1


# --- constants and enums ------------------------------------------------------------------------------

def test_constants():
    assert protocol.GEN_NONE == 0
    assert protocol.RANKS_PER_MASK_WORD == 64
    assert protocol.GEN_MAX == 2**64 - 1
    # The first generation of any call is above GEN_NONE, so an unpublished word never satisfies a wait.
    assert protocol.generation(0, 0) > protocol.GEN_NONE


def test_ack_policy_values_are_distinct_ints():
    values = [int(policy) for policy in AckPolicy]
    assert sorted(values) == list(range(len(values)))
    assert {policy.name for policy in AckPolicy} == {"CONSERVATIVE", "EARLY"}


# --- chunks and slots ---------------------------------------------------------------------------------

def test_valid_tokens_partition_each_rank_tokens():
    rng = random.Random(SEED)
    for _ in range(500):
        tokens_per_slot = rng.randint(1, 64)
        num_tokens = rng.choice([0, rng.randint(0, 4 * tokens_per_slot), rng.randint(0, 10_000)])
        num_chunks = protocol.num_chunks_for(num_tokens, tokens_per_slot)
        # The fewest chunks that hold every token.
        assert num_chunks * tokens_per_slot >= num_tokens
        assert (num_chunks - 1) * tokens_per_slot < num_tokens or num_chunks == 0
        valid = [protocol.chunk_valid_tokens(num_tokens, c, tokens_per_slot) for c in range(num_chunks)]
        assert sum(valid) == num_tokens
        # Full chunks, then at most one partial chunk at the end.
        assert all(v == tokens_per_slot for v in valid[:-1])
        assert all(0 < v <= tokens_per_slot for v in valid)
        # Token bases tile [0, num_tokens) without gaps or overlaps.
        next_token = 0
        for c, v in enumerate(valid):
            assert protocol.chunk_token_base(c, tokens_per_slot) == next_token
            next_token += v
        assert next_token == num_tokens
        # Chunks past the last token are zero-token chunks.
        for c in range(num_chunks, num_chunks + 3):
            assert protocol.chunk_valid_tokens(num_tokens, c, tokens_per_slot) == 0


def test_call_num_chunks_with_zero_token_and_uneven_ranks():
    rng = random.Random(SEED + 1)
    for _ in range(300):
        tokens_per_slot = rng.randint(1, 32)
        num_ranks = rng.randint(1, 9)
        tokens_per_rank = [rng.choice([0, rng.randint(0, 200)]) for _ in range(num_ranks)]
        num_chunks = protocol.call_num_chunks(tokens_per_rank, tokens_per_slot)
        assert num_chunks == max(protocol.num_chunks_for(n, tokens_per_slot) for n in tokens_per_rank)
        for num_tokens in tokens_per_rank:
            # Every rank runs the call's chunk sequence; its own tokens fill a prefix of it exactly once.
            valid = [protocol.chunk_valid_tokens(num_tokens, c, tokens_per_slot) for c in range(num_chunks)]
            assert sum(valid) == num_tokens
            if num_tokens == 0:
                assert valid == [0] * num_chunks
    assert protocol.call_num_chunks([], 8) == 0
    assert protocol.call_num_chunks([0, 0, 0], 8) == 0
    # One rank with tokens makes every rank publish that many (mostly zero-token) chunks.
    assert protocol.call_num_chunks([0, 17, 0], 8) == protocol.num_chunks_for(17, 8)


def test_slot_of_cycles_through_the_ring():
    rng = random.Random(SEED + 2)
    for _ in range(100):
        num_slots = rng.randint(1, 17)
        slots = [protocol.slot_of(c, num_slots) for c in range(5 * num_slots)]
        assert all(0 <= s < num_slots for s in slots)
        # Consecutive chunks use consecutive slots and the pattern repeats every num_slots chunks.
        for c in range(1, len(slots)):
            assert slots[c] == (slots[c - 1] + 1) % num_slots
        assert slots[0] == 0


@pytest.mark.parametrize("call, bad", [
    (lambda v: protocol.num_chunks_for(v, 4), -1),
    (lambda v: protocol.num_chunks_for(4, v), 0),
    (lambda v: protocol.num_chunks_for(4, v), 2.0),
    (lambda v: protocol.num_chunks_for(v, 4), True),
    (lambda v: protocol.slot_of(v, 4), -1),
    (lambda v: protocol.slot_of(1, v), 0),
    (lambda v: protocol.chunk_token_base(v, 4), -3),
    (lambda v: protocol.chunk_valid_tokens(v, 0, 4), -1),
    (lambda v: protocol.chunk_valid_tokens(4, 0, v), 0),
    (lambda v: protocol.generation(v, 0), -1),
    (lambda v: protocol.generation(0, v), -1),
    (lambda v: protocol.next_base(v, 1), -1),
    (lambda v: protocol.next_base(0, v), -1),
    (lambda v: protocol.mask_words(v), 0),
    (lambda v: protocol.ack_bit(v), -1),
    (lambda v: protocol.default_lookahead(v), 0),
])
def test_bad_arguments_raise_value_error(call, bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        call(bad)


# --- generations --------------------------------------------------------------------------------------

def _run_calls(chunk_counts: Sequence[int], num_slots: int, advance_base: bool = True
               ) -> Dict[int, List[int]]:
    """Generations each slot carries over a sequence of calls (``advance_base=False``: a base baked in)."""
    history: Dict[int, List[int]] = {s: [] for s in range(num_slots)}
    base = 0
    for num_chunks in chunk_counts:
        for c in range(num_chunks):
            history[protocol.slot_of(c, num_slots)].append(protocol.generation(base, c))
        if advance_base:
            base = protocol.next_base(base, num_chunks)
    return history


def _stale_value_satisfies_a_wait(history: Dict[int, List[int]]) -> bool:
    """Whether any value a slot held earlier (or its initial GEN_NONE) passes ``is_ready`` for a later use."""
    for gens in history.values():
        for i, awaited in enumerate(gens):
            for stale in [protocol.GEN_NONE] + gens[:i]:
                if protocol.is_ready(stale, stale, awaited) or protocol.is_ready(stale, awaited, awaited) \
                        or protocol.is_ready(awaited, stale, awaited):
                    return True
    return False


def test_generations_strictly_grow_per_slot_across_laps_and_calls():
    rng = random.Random(SEED + 3)
    for _ in range(40):
        num_slots = rng.randint(1, 8)
        # Many calls with random chunk counts, including empty calls and calls of many ring laps.
        chunk_counts = [rng.choice([0, 1, rng.randint(0, 3 * num_slots), rng.randint(0, 40)])
                        for _ in range(rng.randint(1, 60))]
        history = _run_calls(chunk_counts, num_slots)
        for gens in history.values():
            assert all(a < b for a, b in zip(gens, gens[1:])), gens
            assert protocol.GEN_NONE not in gens
        # All slots together carry the global sequence 1, 2, 3, ... exactly once each.
        all_gens = sorted(g for gens in history.values() for g in gens)
        assert all_gens == list(range(1, sum(chunk_counts) + 1))
        assert not _stale_value_satisfies_a_wait(history)


def test_graph_replay_control_with_a_baked_base_repeats_generations():
    # The same call replayed: a base advanced on the device keeps generations growing; a base baked into
    # the launch (DeepGEMM PR 451) repeats them, so a stale publication would satisfy a later wait.
    num_slots, replays = 3, 5
    live = _run_calls([4] * replays, num_slots, advance_base=True)
    baked = _run_calls([4] * replays, num_slots, advance_base=False)
    assert not _stale_value_satisfies_a_wait(live)
    assert _stale_value_satisfies_a_wait(baked)


def test_generation_and_next_base():
    rng = random.Random(SEED + 4)
    for _ in range(200):
        base, num_chunks = rng.randint(0, 2**40), rng.randint(0, 100)
        gens = [protocol.generation(base, c) for c in range(num_chunks)]
        assert gens == list(range(base + 1, base + num_chunks + 1))
        nxt = protocol.next_base(base, num_chunks)
        # The next call's first generation follows this call's last one directly.
        assert protocol.generation(nxt, 0) == (gens[-1] if gens else base) + 1
    assert protocol.generation(protocol.GEN_MAX - 1, 0) == protocol.GEN_MAX
    with pytest.raises(OverflowError):
        protocol.generation(protocol.GEN_MAX, 0)


def test_masks_of_different_widths_are_rejected():
    # A short mask must not pass as complete: zip() alone would stop at the shorter one.
    with pytest.raises(ConfigError, match="expected 1 words"):
        protocol.mask_complete((), (1,))
    with pytest.raises(ConfigError, match="expected 2 words"):
        protocol.missing_ranks((3,), (3, 1))


def test_bool_is_not_a_lookahead():
    with pytest.raises(ConfigError, match="lookahead=True"):
        protocol.check_lookahead(True, 2)


def test_is_ready_needs_both_generations():
    rng = random.Random(SEED + 6)
    for _ in range(500):
        expected = rng.randint(1, 2**63)
        route, layout = (rng.choice([expected, expected - 1, expected + 1, protocol.GEN_NONE])
                         for _ in range(2))
        assert protocol.is_ready(route, layout, expected) == (route == expected and layout == expected)


# --- acknowledgement masks ----------------------------------------------------------------------------

def _expected_words(ranks: Sequence[int], num_words: int) -> Tuple[int, ...]:
    """Mask words derived from one big integer with a bit per rank (independent of ack_bit)."""
    big = sum(1 << r for r in set(ranks))
    return tuple((big >> (64 * w)) & WORD_MASK for w in range(num_words))


@pytest.mark.parametrize("num_ranks", [1, 2, 63, 64, 65, 127, 128, 130])
def test_masks_split_into_64_bit_words(num_ranks):
    num_words = protocol.mask_words(num_ranks)
    assert num_words == (num_ranks + 63) // 64
    full = protocol.full_mask(num_ranks)
    assert full == _expected_words(range(num_ranks), num_words)
    assert all(0 <= w <= WORD_MASK for w in full)  # fits a uint64 signal word
    assert sum(bin(w).count("1") for w in full) == num_ranks
    bits = [protocol.ack_bit(r) for r in range(num_ranks)]
    assert len(set(bits)) == num_ranks  # one distinct bit per rank
    acc = [0] * num_words
    for word, bit in bits:
        assert 0 <= word < num_words and bin(bit).count("1") == 1 and bit <= WORD_MASK
        acc[word] |= bit
    assert tuple(acc) == full
    assert protocol.required_mask(range(num_ranks), num_words) == full
    with pytest.raises(ValueError, match=str(64 * num_words)):
        protocol.required_mask([64 * num_words], num_words)


@pytest.mark.parametrize("num_ranks", [1, 63, 64, 65, 130])
def test_missing_ranks_and_mask_complete(num_ranks):
    rng = random.Random(SEED + num_ranks)
    num_words = protocol.mask_words(num_ranks)
    for _ in range(100):
        required_ranks = sorted(rng.sample(range(num_ranks), rng.randint(0, num_ranks)))
        acked = [r for r in range(num_ranks) if rng.random() < 0.8]
        required = protocol.required_mask(required_ranks, num_words)
        mask = _expected_words(acked, num_words)
        missing = protocol.missing_ranks(mask, required)
        assert missing == sorted(set(required_ranks) - set(acked))
        assert protocol.mask_complete(mask, required) == (not missing)
    full = protocol.full_mask(num_ranks)
    assert protocol.mask_complete(full, full) and protocol.missing_ranks(full, full) == []
    empty = (0,) * num_words
    assert protocol.missing_ranks(empty, full) == list(range(num_ranks))
    assert not protocol.mask_complete(empty, full)


def test_reuse_handshake_over_many_generations():
    # Owner: wait for a complete mask, reset, publish; consumers ack once each per generation. The mask
    # is complete exactly when the last consumer acked, never before.
    rng = random.Random(SEED + 7)
    for num_ranks in (1, 3, 64, 66):
        required = protocol.full_mask(num_ranks)
        mask = list(required)  # a fresh slot starts free
        for _ in range(20):
            assert protocol.mask_complete(mask, required)
            mask = [0] * len(mask)  # the owner's reset, before it publishes the next generation
            order = list(range(num_ranks))
            rng.shuffle(order)
            for i, rank in enumerate(order):
                assert protocol.missing_ranks(mask, required) == sorted(order[i:])
                word, bit = protocol.ack_bit(rank)
                mask[word] |= bit
            assert protocol.mask_complete(mask, required)


# --- host enqueue order -------------------------------------------------------------------------------

def test_lookahead_bounds():
    for num_slots in range(1, 9):
        assert protocol.default_lookahead(num_slots) == num_slots - 1
        for lookahead in range(num_slots):
            protocol.check_lookahead(lookahead, num_slots)
        for bad in (num_slots, num_slots + 1, -1):
            with pytest.raises(ValueError, match=f"lookahead={bad}"):
                protocol.check_lookahead(bad, num_slots)
            with pytest.raises(ValueError, match="lookahead"):
                protocol.enqueue_order(5, num_slots, bad)
    with pytest.raises(ValueError, match="num_slots"):
        protocol.check_lookahead(0, 0)


@pytest.mark.parametrize("num_slots", [1, 2, 3, 5])
def test_enqueue_order_shape(num_slots):
    rng = random.Random(SEED + 10 * num_slots)
    for num_chunks in list(range(0, 12)) + [rng.randint(12, 60) for _ in range(5)]:
        for lookahead in [None] + list(range(num_slots)):
            order = protocol.enqueue_order(num_chunks, num_slots, lookahead)
            effective = num_slots - 1 if lookahead is None else lookahead
            # Every chunk produced once and consumed once, each in increasing chunk order.
            assert [c for op, c in order if op == "produce"] == list(range(num_chunks))
            assert [c for op, c in order if op == "consume"] == list(range(num_chunks))
            position = {item: i for i, item in enumerate(order)}
            for c in range(num_chunks):
                # Consume c after produce c; produce c after consume c - num_slots (the progress rule).
                assert position[("produce", c)] < position[("consume", c)]
                if c >= num_slots:
                    assert position[("consume", c - num_slots)] < position[("produce", c)]
                # The producer runs exactly `effective` chunks ahead where it can.
                produced_before = sum(1 for op, _ in order[:position[("consume", c)]] if op == "produce")
                assert produced_before == min(num_chunks, c + effective + 1)


def test_windowed_enqueue_order_shape():
    for num_slots in (1, 2, 3, 5):
        for window in range(1, num_slots + 1):
            for num_chunks in range(0, 14):
                order = protocol.windowed_enqueue_order(num_chunks, num_slots, window)
                assert [c for op, c, _ in order if op == "produce"] == list(range(num_chunks))
                consumed = [(a, b) for op, a, b in order if op == "consume"]
                assert consumed == protocol.expert_windows(num_chunks, window)
                assert all(b - a + 1 <= window for a, b in consumed)
                if window == 1:  # the plain order with the default lookahead
                    assert [(op, a) for op, a, _ in order] == protocol.enqueue_order(num_chunks, num_slots)
    for bad in (0, 4, "2", None):
        with pytest.raises(ValueError, match="expert_window"):
            protocol.windowed_enqueue_order(5, 3, bad)
    # check=False builds the forbidden window (the model checker's window_exceeds_slots mutant): the window
    # [0, S] is consumed after producing only chunks 0..S-1.
    order = protocol.windowed_enqueue_order(4, 3, 4, check=False)
    assert order == [("produce", 0, 0), ("produce", 1, 1), ("produce", 2, 2), ("consume", 0, 3), ("produce", 3, 3)]


# Deadlock freedom of both orders (every interleaving, every lookahead and window, mixes over the ranks)
# and their converses (lookahead == num_slots, window == num_slots + 1) are checked by the model checker
# on the full protocol model: tests/test_modelcheck.py, docs/MODELCHECK.md.


# --- the captured dependency graph of one rank's call ----------------------------------------------------

def _topological_orders(items, edges):
    """Every topological order of the graph (small graphs only)."""
    preds = {item: {e.before for e in edges if e.after == item} for item in items}

    def extend(done, order):
        ready = [it for it in items if it not in done and preds[it] <= done]
        if not ready:
            yield list(order)
        for it in ready:
            yield from extend(done | {it}, order + [it])
    yield from extend(frozenset(), [])


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_dependency_graph_of_one_stream_is_the_order(num_slots):
    for window in range(1, num_slots + 1):
        for num_chunks in range(0, 6):
            order = protocol.windowed_enqueue_order(num_chunks, num_slots, window)
            items, edges = protocol.call_dependency_graph(order, num_slots, two_streams=False)
            assert items == tuple(order) + (("end_call", num_chunks, num_chunks),)
            assert list(_topological_orders(items, edges)) == [list(items)]


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_dependency_graph_of_two_streams_has_the_local_edges(num_slots):
    for window in range(1, num_slots + 1):
        for num_chunks in range(0, 7):
            order = protocol.windowed_enqueue_order(num_chunks, num_slots, window)
            items, edges = protocol.call_dependency_graph(order, num_slots, two_streams=True)
            orders = list(_topological_orders(items, edges))
            assert list(items) in orders  # the enqueue order itself is one of them
            windows = protocol.expert_windows(num_chunks, window)
            for topo in orders:
                at = {item: i for i, item in enumerate(topo)}
                assert topo[-1][0] == "end_call"
                for first, last in windows:
                    # every chunk of the window produced before it (this rank's own route and layout)
                    assert all(at[("produce", c, c)] < at[("consume", first, last)] for c in range(first, last + 1))
                for c in range(num_slots, num_chunks):
                    # the slot's previous use consumed (acknowledged) before its reuse
                    holder = next(w for w in windows if w[0] <= c - num_slots <= w[1])
                    assert at[("consume", *holder)] < at[("produce", c, c)]
                produced = [it[1] for it in topo if it[0] == "produce"]
                consumed = [it[1] for it in topo if it[0] == "consume"]
                assert produced == sorted(produced) and consumed == sorted(consumed)  # each stream in order
            # A window smaller than the ring leaves the executor a choice (the streams can overlap).
            if window < num_slots and num_chunks > window:
                assert len(orders) > 1, (num_slots, window, num_chunks)


def test_dependency_graph_rejects_orders_that_are_not_enqueue_orders():
    for bad in ([("consume", 0, 0), ("produce", 0, 0)],  # a window before its own chunk
                [("produce", 1, 1), ("produce", 0, 0), ("consume", 0, 1)],
                [("produce", 0, 0), ("consume", 0, 1)],
                [("produce", 0, 0), ("produce", 1, 1), ("produce", 2, 2), ("consume", 0, 0), ("consume", 1, 2)]):
        with pytest.raises(ConfigError, match="order"):
            protocol.call_dependency_graph(bad, 2, two_streams=True)

