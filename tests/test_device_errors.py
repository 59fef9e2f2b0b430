"""The host side of the device error record and abort word, without a GPU: the abort word's packing
(layout.pack_abort / unpack_abort, the device's pack_abort) and how RingKernels turns a record into a
named error whose text says what happened, where, expected vs found, and that reset is the way back."""

from __future__ import annotations

import types

import pytest

from symmring import layout
from symmring.errors import DoubleAck, ProtocolAborted, ProtocolTimeout, ProtocolViolation, StalePayload
from symmring.kernels import RingKernels
from symmring.layout import (ERROR_KIND_ABORTED, ERROR_KIND_COMBINE, ERROR_KIND_DOUBLE_ACK, ERROR_KIND_ROUTE,
                             ERROR_KIND_STALE_PAYLOAD, RingLayout, RingSpec, pack_abort, unpack_abort)


def _kernels(rank=1, world_size=4):
    """A RingKernels shell with just what decoding needs (no GPU, no allocation)."""
    k = object.__new__(RingKernels)
    k.backend = types.SimpleNamespace(rank=rank, world_size=world_size)
    k.layout = RingLayout(RingSpec(num_slots=2, tokens_per_slot=8, hidden=256, num_topk=2, num_experts=4,
                                   x_format="bf16"), world_size)
    k.timeout_s = 2.0
    return k


@pytest.mark.parametrize("origin, kind, peer, chunk", [(0, 1, 3, 0), (65535, 7, 65535, layout.ABORT_CHUNK_MAX - 1),
                                                       (5, 4, 0, 12345)])
def test_abort_word_round_trips_and_is_never_zero(origin, kind, peer, chunk):
    word = pack_abort(origin, kind, peer, chunk)
    assert word >> layout.ABORT_FLAG_SHIFT == 1 and 0 < word < 1 << 64
    assert unpack_abort(word) == {"origin": origin, "kind": kind, "peer": peer, "chunk": chunk}


def test_abort_word_saturates_a_chunk_that_does_not_fit():
    for chunk in (-1, layout.ABORT_CHUNK_MAX, 1 << 30):
        assert unpack_abort(pack_abort(2, ERROR_KIND_ROUTE, 1, chunk))["chunk"] == layout.ABORT_CHUNK_MAX


def test_clean_record_and_word_is_no_error():
    assert _kernels()._device_error([0] * layout.ERROR_WORDS, 0) is None


def test_aborted_wait_names_the_origin_its_error_and_reset():
    word = pack_abort(3, ERROR_KIND_STALE_PAYLOAD, 2, 6)
    record = [ERROR_KIND_ABORTED, 1, 3, 0, 6, 17, word - (1 << 64), ERROR_KIND_ROUTE]  # int64 words as stored
    error = _kernels()._device_error(record, word - (1 << 64))
    assert isinstance(error, ProtocolAborted) and isinstance(error, ProtocolTimeout)
    assert (error.rank, error.origin, error.origin_kind, error.origin_peer, error.origin_chunk) == \
        (1, 3, "stale_payload", 2, 6)
    assert (error.waited, error.slot, error.chunk, error.expected, error.peer) == ("route_ready", 0, 6, 17, 3)
    text = str(error)
    for part in ("rank 1:", "route_ready", "slot 0", "chunk 6", "expected 17", "rank 3", "stale_payload",
                 "call reset()"):
        assert part in text, (part, text)


def test_kernel_that_returned_at_entry_is_named_from_the_abort_word_alone():
    error = _kernels(rank=2)._device_error([0] * layout.ERROR_WORDS, pack_abort(0, ERROR_KIND_COMBINE, 1, 4))
    assert isinstance(error, ProtocolAborted) and error.waited is None and error.slot is None
    assert (error.rank, error.origin, error.origin_kind, error.origin_peer, error.origin_chunk) == \
        (2, 0, "combine", 1, 4)
    assert "rank 2:" in str(error) and "rank 0" in str(error) and "call reset()" in str(error)


def test_stale_payload_says_expected_and_found():
    record = [ERROR_KIND_STALE_PAYLOAD, 1, 0, 1, 3, 9, 11, 5]
    error = _kernels()._device_error(record, 0)
    assert isinstance(error, StalePayload) and isinstance(error, ProtocolViolation)
    assert (error.rank, error.peer, error.slot, error.chunk, error.expected, error.observed,
            error.observed_chunk) == (1, 0, 1, 3, 9, 11, 5)
    text = str(error)
    for part in ("rank 1:", "rank 0's slot 1", "chunk 3, generation 9", "chunk 5, generation 11", "call reset()"):
        assert part in text, (part, text)


def test_double_ack_says_which_bit_and_mask():
    record = [ERROR_KIND_DOUBLE_ACK, 1, 2, 0, 4, 0b10, 0b1110, 0]
    error = _kernels()._device_error(record, 0)
    assert isinstance(error, DoubleAck) and (error.peer, error.chunk, error.expected, error.observed) == (2, 4, 2, 14)
    text = str(error)
    for part in ("rank 1:", "chunk 4 (slot 0) of rank 2 twice", "0x2", "0xe", "call reset()"):
        assert part in text, (part, text)


def test_timeout_keeps_its_fields_and_says_reset():
    record = [ERROR_KIND_ROUTE, 1, 3, 1, 5, 12, 10, 0]
    error = _kernels()._device_error(record, 0)
    assert type(error) is ProtocolTimeout and (error.kind, error.peer, error.slot, error.chunk) == \
        ("route_ready", 3, 1, 5)
    assert "timed out after 2 s" in str(error) and "call reset()" in str(error)


@pytest.mark.parametrize("what, bound, expert, parts", [
    (layout.OVERFLOW_WINDOW_ROWS, "window_rows", None, ("the window at chunk 4 holds 900 pool rows", "than the 768")),
    (layout.OVERFLOW_EXPERT_ROWS | 37 << 8, "expert_rows", 37, ("expert 37 holds 900 rows", "than the 768")),
    (layout.OVERFLOW_COMBINE_TOKEN, "combine_token", None, ("names token 900 of rank 2", "the 768 tokens")),
])
def test_pool_overflow_names_the_bound_found_and_reset(what, bound, expert, parts):
    """A pool_overflow record (device/moe/bounds.cuh: expected = the plan's bound, observed = what the device
    counted, missing = which bound, the expert id above its low byte) is a PoolOverflow naming both."""
    from symmring.errors import PoolOverflow
    record = [layout.ERROR_KIND_POOL_OVERFLOW, 1, 2, 0, 4, 768, 900, what]
    error = _kernels()._device_error(record, 0)
    assert isinstance(error, PoolOverflow) and isinstance(error, ProtocolViolation)
    assert (error.kind, error.rank, error.chunk, error.expected, error.observed, error.bound, error.expert) == \
        ("pool_overflow", 1, 4, 768, 900, bound, expert)
    text = str(error)
    for part in ("rank 1:", "pool overflow", *parts, "no row was written past its buffer", "call reset()"):
        assert part in text, (part, text)


def test_pool_overflow_of_a_token_below_zero_keeps_its_sign():
    from symmring.errors import PoolOverflow
    record = [layout.ERROR_KIND_POOL_OVERFLOW, 0, 1, 0, 2, 512, -3, layout.OVERFLOW_COMBINE_TOKEN]
    error = _kernels()._device_error(record, 0)
    assert isinstance(error, PoolOverflow) and error.observed == -3 and "names token -3 of rank 1" in str(error)


def test_ranks_aborted_by_a_pool_overflow_name_it():
    """The other ranks' waits give up on the abort word: their ProtocolAborted names the overflowing rank and
    pool_overflow (what every rank then raises; the origin's own error is the PoolOverflow)."""
    word = pack_abort(2, layout.ERROR_KIND_POOL_OVERFLOW, 2, 4)
    error = _kernels(rank=0)._device_error([0] * layout.ERROR_WORDS, word)
    assert isinstance(error, ProtocolAborted)
    assert (error.origin, error.origin_kind, error.origin_chunk) == (2, "pool_overflow", 4)


def test_skipped_group_report_names_the_id_and_clears():
    """The expert GEMMs' report of tiles skipped for a group id outside [-1, E) (`State.bad_groups`) becomes
    a BackendError naming the id, and is cleared so the next check passes; nothing reported, no error."""
    torch = pytest.importorskip("torch")
    from symmring.errors import BackendError
    from symmring.moe.gpu.executor import _skipped_groups
    state = types.SimpleNamespace(bad_groups=torch.tensor([3, 11], dtype=torch.int32))
    error = _skipped_groups(state, 2, 8)
    assert isinstance(error, BackendError)
    assert "rank 2:" in str(error) and "3 tile(s)" in str(error) and "naming group 11, outside [-1, 8)" in str(error)
    assert state.bad_groups.tolist() == [0, 0] and _skipped_groups(state, 2, 8) is None
    assert _skipped_groups(types.SimpleNamespace(bad_groups=None), 0, 8) is None  # a bf16 pool: no report
