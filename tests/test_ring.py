"""The ring protocol in one process (a world of 1 on the CPU backend): data, generations, errors.

Multi-rank behaviour is in tests/mpi (run by tests/test_under_mpi.py with 2, 3 and 4 ranks).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import symmring
from symmring import BackendError, ConfigError, ProtocolTimeout, RingClosedError, RingSpec, protocol
from symmring.backends.host import HostBackend
from symmring.context import init
from symmring.ring import ChunkView, Ring

sys.path.insert(0, str(Path(__file__).with_name("mpi")))
from ringdriver import Stats, bad_inputs, check_chunk, expected_route, expected_sf, expected_x, own_bytes  # noqa: E402

SEED = 20261129
SPECS = {
    "fp8": RingSpec(num_slots=3, tokens_per_slot=8, hidden=64, num_topk=4, num_experts=16, sf_group_size=32),
    "bf16": RingSpec(num_slots=2, tokens_per_slot=8, hidden=64, num_topk=1, num_experts=4, x_format="bf16"),
}


@pytest.fixture(scope="module")
def ctx():
    context = init("host", timeout_s=30.0)
    yield context
    context.close()


@pytest.fixture(params=sorted(SPECS))
def ring(request, ctx):
    with Ring(ctx, SPECS[request.param]) as r:
        yield r


def random_chunk(rng, spec, num_valid, typed=False):
    """Seeded random payload of ``num_valid`` tokens; ``typed`` gives x as ml_dtypes fp8/bf16 arrays."""
    if spec.x_elem_bytes == 1:
        x = rng.integers(0, 256, (num_valid, spec.hidden), dtype=np.uint8)
        typed_x = x.view(ml_dtypes.float8_e4m3fn)
    else:
        x = rng.integers(0, 1 << 16, (num_valid, spec.hidden), dtype=np.uint16)
        typed_x = x.view(ml_dtypes.bfloat16)
    x_sf = rng.uniform(2.0**-10, 4.0, (num_valid, spec.num_sf)).astype(np.float32)  # scales: finite, > 0
    idx = rng.integers(-1, spec.num_experts, (num_valid, spec.num_topk)).astype(np.int32)
    weights = rng.random((num_valid, spec.num_topk), dtype=np.float32)
    return dict(x=x, x_in=typed_x if typed else x, x_sf=x_sf, idx=idx, weights=weights)


def produce(ring, call, chunk, data, token_base, route_first=True):
    num_valid = data["idx"].shape[0]
    ring.acquire_slot(call, chunk)
    steps = [lambda: (ring.write_route(call, chunk, data["idx"], data["weights"], token_base, num_valid),
                      ring.publish_route(call, chunk)),
             lambda: (ring.write_layout(call, chunk, data["x_in"], data["x_sf"] if ring.spec.num_sf else None),
                      ring.publish_layout(call, chunk))]
    for step in (steps if route_first else steps[::-1]):
        step()


def consume(ring, call, chunk):
    ring.wait_ready(call, chunk, 0)
    view = ring.read(call, chunk, 0)
    ring.ack(call, chunk, 0)
    return view


def assert_bitwise(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    diff = np.argwhere(got.view(np.uint8) != want.view(np.uint8))
    assert diff.size == 0, f"{what}: first differing byte at {tuple(diff[0])}"


def assert_chunk(view, data, token_base, spec):
    assert (view.num_valid, view.token_base) == (data["idx"].shape[0], token_base)
    assert_bitwise(view.x, data["x"], "x")
    assert_bitwise(view.x_sf, data["x_sf"] if spec.num_sf else np.zeros((view.num_valid, 0), np.float32), "x_sf")
    assert_bitwise(view.topk_idx, data["idx"], "topk_idx")
    assert_bitwise(view.topk_weights, data["weights"], "topk_weights")


@pytest.mark.parametrize("typed", [False, True], ids=["bits", "ml_dtypes"])
def test_round_trip_bitwise(ring, typed):
    """Every chunk comes back bit for bit (fp8/bf16 given as bits or as ml_dtypes arrays), and the
    zero-copy slot views hold the same bytes."""
    rng = np.random.default_rng(SEED)
    spec = ring.spec
    num_tokens = 5 * spec.tokens_per_slot - 3  # partial last chunk
    num_chunks = protocol.num_chunks_for(num_tokens, spec.tokens_per_slot)
    call = ring.begin_call(num_chunks)
    for chunk in range(num_chunks):
        num_valid = protocol.chunk_valid_tokens(num_tokens, chunk, spec.tokens_per_slot)
        token_base = protocol.chunk_token_base(chunk, spec.tokens_per_slot)
        data = random_chunk(rng, spec, num_valid, typed)
        produce(ring, call, chunk, data, token_base, route_first=bool(chunk % 2))
        slot = call.slot(chunk)
        assert_bitwise(ring.x(slot)[:num_valid], data["x"], "ring.x view")
        assert_bitwise(ring.topk_idx(slot, 0)[:num_valid], data["idx"], "ring.topk_idx view")
        assert list(ring.meta(slot)) == [token_base, num_valid, chunk, call.generation(chunk), call.call_id]
        assert_chunk(consume(ring, call, chunk), data, token_base, spec)
    ring.end_call(call)


def test_generations_across_wrap_and_calls(ring, ctx):
    """Generations follow protocol.generation from the gen_base word across ring wraps and calls of
    different chunk counts (including 0), and payloads stay bitwise."""
    rng = np.random.default_rng(SEED + 1)
    spec = ring.spec
    base = 0
    gen_base = ring.layout["gen_base"].offset
    for num_chunks in (7, 1, 0, 2 * spec.num_slots + 1, 3):
        call = ring.begin_call(num_chunks)
        assert call.base == base == ctx.backend.read_word(ring.allocation, gen_base, 0)
        for chunk in range(num_chunks):
            assert call.generation(chunk) == protocol.generation(base, chunk)
            assert call.slot(chunk) == protocol.slot_of(chunk, spec.num_slots)
            data = random_chunk(rng, spec, int(rng.integers(0, spec.tokens_per_slot + 1)))
            produce(ring, call, chunk, data, 0)
            for kind in ("route_ready", "layout_ready"):
                word = ctx.backend.read_word(ring.allocation, ring.layout[kind].slot_offset(call.slot(chunk)), 0)
                assert word == call.generation(chunk)
            assert_chunk(consume(ring, call, chunk), data, 0, spec)
        ring.end_call(call)
        base = protocol.next_base(base, num_chunks)
        assert ctx.backend.read_word(ring.allocation, gen_base, 0) == base


def test_zero_token_chunks(ring):
    """Chunks with no valid token are published and read as empty arrays of the right width."""
    spec = ring.spec
    call = ring.begin_call(2 * spec.num_slots)
    empty = random_chunk(np.random.default_rng(SEED), spec, 0)
    for chunk in range(call.num_chunks):
        produce(ring, call, chunk, empty, 17)
        view = consume(ring, call, chunk)
        assert view.num_valid == 0 and view.token_base == 17
        assert view.x.shape == (0, spec.hidden) and view.topk_idx.shape == (0, spec.num_topk)
        assert view.x_sf.shape == (0, spec.num_sf) and view.topk_weights.shape == (0, spec.num_topk)
    ring.end_call(call)


def test_bad_inputs_change_nothing_and_ring_stays_usable(ring, ctx):
    """Each bad input raises ConfigError naming the problem, the ring's bytes are unchanged, and the same
    call then completes bitwise."""
    spec = ring.spec
    rng = np.random.default_rng(SEED + 2)
    with Ring(ctx, RingSpec(num_slots=4, tokens_per_slot=4, hidden=16, num_topk=1, num_experts=2,
                            sf_group_size=16)) as other:
        other_call = other.begin_call(1)
        call = ring.begin_call(3)
        ring.acquire_slot(call, 0)
        before = own_bytes(ring)
        cases = bad_inputs(ring, call, 0, other_call)
        for what, thunk in cases:
            with pytest.raises(ConfigError) as info:
                thunk()
            assert str(info.value), what
        assert np.array_equal(before, own_bytes(ring))
    assert len(cases) >= 30
    with pytest.raises(ConfigError, match="num_chunks=-1"):
        Ring.begin_call(ring, -1)  # checked before the open-call rule too
    data = random_chunk(rng, spec, spec.tokens_per_slot)
    ring.write_route(call, 0, data["idx"], data["weights"], 0, spec.tokens_per_slot)
    ring.write_layout(call, 0, data["x"], data["x_sf"] if spec.num_sf else None)
    ring.publish_route(call, 0)
    ring.publish_layout(call, 0)
    assert_chunk(consume(ring, call, 0), data, 0, spec)
    for chunk in (1, 2):
        data = random_chunk(rng, spec, 3)
        produce(ring, call, chunk, data, 5)
        assert_chunk(consume(ring, call, chunk), data, 5, spec)
    with pytest.raises(ConfigError, match="already acknowledged"):
        ring.wait_ready(call, 2, 0)
    ring.end_call(call)
    with pytest.raises(ConfigError, match="already ended"):
        ring.acquire_slot(call, 0)


def test_use_after_close(ctx):
    """A closed ring raises RingClosedError for every operation; close is idempotent."""
    ring = Ring(ctx, SPECS["fp8"])
    call = ring.begin_call(1)
    ring.close()
    ring.close()
    assert ring.closed
    calls = [lambda: ring.begin_call(1), lambda: ring.acquire_slot(call, 0), lambda: ring.x(0),
             lambda: ring.meta(0, 0), lambda: ring.publish_layout(call, 0), lambda: ring.wait_ready(call, 0, 0),
             lambda: ring.read(call, 0, 0), lambda: ring.ack(call, 0, 0), lambda: ring.end_call(call),
             lambda: ring.allocation]
    for fn in calls:
        with pytest.raises(RingClosedError):
            fn()


def test_wait_on_unpublished_chunk_times_out(ctx):
    """wait_ready on a chunk never published raises ProtocolTimeout within the bound, naming rank, peer,
    slot, chunk and the generations; the ring keeps working afterwards."""
    timeout_s = 0.5
    with Ring(ctx, SPECS["fp8"], timeout_s=timeout_s) as ring:
        call = ring.begin_call(2)
        start = time.monotonic()
        with pytest.raises(ProtocolTimeout) as info:
            ring.wait_ready(call, 1, 0)
        elapsed_s = time.monotonic() - start
        assert timeout_s <= elapsed_s < timeout_s + 1.0
        exc = info.value
        assert (exc.kind, exc.rank, exc.peer, exc.slot, exc.chunk) == ("route_ready", 0, 0, 1, 1)
        assert (exc.expected, exc.observed, exc.timeout_s) == (call.generation(1), protocol.GEN_NONE, timeout_s)
        for text in ("rank 0", "slot 1", "chunk 1", f"expected {call.generation(1)}", "observed 0"):
            assert text in str(exc)
        data = random_chunk(np.random.default_rng(SEED), ring.spec, 2)
        for chunk in range(2):
            produce(ring, call, chunk, data, 0)
            assert_chunk(consume(ring, call, chunk), data, 0, ring.spec)


def test_reuse_without_ack_times_out_naming_missing_rank(ctx):
    """A slot whose previous use was never acknowledged cannot be reacquired: 'reuse' ProtocolTimeout
    naming the missing rank."""
    with Ring(ctx, SPECS["bf16"], timeout_s=0.3) as ring:
        call = ring.begin_call(3)
        data = random_chunk(np.random.default_rng(SEED), ring.spec, 1)
        produce(ring, call, 0, data, 0)
        ring.wait_ready(call, 0, 0)
        ring.read(call, 0, 0)  # read but never acknowledged
        with pytest.raises(ProtocolTimeout) as info:
            ring.acquire_slot(call, ring.spec.num_slots)  # the same slot, next lap
        exc = info.value
        assert exc.kind == "reuse" and exc.missing_ranks == (0,) and "missing acknowledgements from ranks [0]" \
            in str(exc)
        ring.ack(call, 0, 0)
        ring.acquire_slot(call, ring.spec.num_slots)  # now free


def test_stale_generation_from_previous_call_is_not_accepted(ctx):
    """A ready word left by an earlier call (same slot, older generation) never satisfies a wait."""
    with Ring(ctx, SPECS["fp8"], timeout_s=0.3) as ring:
        call = ring.begin_call(1)
        data = random_chunk(np.random.default_rng(SEED), ring.spec, 4)
        produce(ring, call, 0, data, 0)
        consume(ring, call, 0)
        ring.end_call(call)
        call = ring.begin_call(1)
        with pytest.raises(ProtocolTimeout) as info:
            ring.wait_ready(call, 0, 0)
        assert (info.value.expected, info.value.observed) == (2, 1)


def test_context_and_backend_selection(monkeypatch):
    """init() picks the host backend here (no GPU), validates its arguments, and finalize closes it."""
    monkeypatch.delenv("SYMMRING_BACKEND", raising=False)
    monkeypatch.setenv("SYMMRING_TIMEOUT_S", "7.5")
    with pytest.raises(ConfigError, match="backend='tpu'"):
        init("tpu")
    with pytest.raises(ConfigError, match="timeout_s=0"):
        init("host", timeout_s=0)
    from symmring.backends.nvshmem import gpu_available
    ctx = init("auto")
    assert ctx.backend.name == ("nvshmem" if gpu_available() else "host")
    assert (ctx.rank, ctx.world_size, ctx.timeout_s) == (0, 1, 7.5) and "open" in repr(ctx)
    symmring.context.finalize()
    assert ctx.closed
    symmring.context.finalize()  # nothing left: a no-op
    with pytest.raises(RingClosedError):
        Ring(ctx, SPECS["fp8"])
    if not gpu_available():
        with pytest.raises(BackendError):
            init("nvshmem")


def test_host_backend_primitives():
    """Signals: set/add/or/read on 64-bit words (values above 2**63 too), bounded waits with every
    comparison, and checked views."""
    backend = HostBackend()
    alloc = backend.alloc(256)
    big = (1 << 63) + 5
    backend.signal_set(alloc, 8, big, 0)
    backend.signal_add(alloc, 8, 2, 0)
    backend.atomic_or(alloc, 16, 0b1010, 0)
    backend.atomic_or(alloc, 16, 0b0110, 0)
    assert backend.read_word(alloc, 8, 0) == big + 2 and backend.read_word(alloc, 16, 0) == 0b1110
    assert backend.view(alloc, 0, 8, np.uint64, (2,)).tolist() == [big + 2, 0b1110]
    for cmp, value, want in (("eq", 14, True), ("ne", 14, False), ("ge", 14, True), ("gt", 14, False),
                             ("le", 13, False), ("lt", 15, True)):
        satisfied, observed = backend.wait_until(alloc, 16, 0, cmp, value, 0.05)
        assert (satisfied, observed) == (want, 14), cmp
    for bad in (lambda: backend.view(alloc, 0, 250, np.uint64, (1,)), lambda: backend.view(alloc, 1, 0, np.uint8, (1,)),
                lambda: backend.read_word(alloc, 4, 0), lambda: backend.wait_until(alloc, 0, 0, "approx", 1, 1.0),
                lambda: backend.alloc(0)):
        with pytest.raises(ConfigError):
            bad()
    backend.finalize()
    backend.finalize()
    with pytest.raises(RingClosedError):
        backend.read_word(alloc, 8, 0)


@pytest.mark.parametrize("field", ["x", "x_sf", "topk_idx", "topk_weights", "num_valid"])
def test_stress_checker_catches_one_wrong_element(field):
    """The stress tests' checker reports a single flipped element (or a wrong count) at its coordinate."""
    spec = SPECS["fp8"]
    src, gen, chunk, num_tokens = 2, 41, 1, 2 * spec.tokens_per_slot - 3
    num_valid = protocol.chunk_valid_tokens(num_tokens, chunk, spec.tokens_per_slot)
    idx, weights = expected_route(spec, src, gen, num_valid, "uniform")
    arrays = dict(x=expected_x(spec, src, gen, num_valid), x_sf=expected_sf(spec, src, gen, num_valid),
                  topk_idx=idx, topk_weights=weights)
    clean = Stats()
    check_chunk(clean, spec, ChunkView(**arrays, token_base=spec.tokens_per_slot, num_valid=num_valid), src, gen,
                chunk, num_tokens, "uniform", 0)
    assert (clean.mismatches, clean.slot_uses_checked) == (0, 1) and clean.bytes_checked > 0
    count = num_valid
    if field == "num_valid":
        count -= 1
    else:
        flat = arrays[field].reshape(-1).view(np.uint8)
        flat[3] ^= 0x10
    stats = Stats()
    check_chunk(stats, spec, ChunkView(**arrays, token_base=spec.tokens_per_slot, num_valid=count), src, gen,
                chunk, num_tokens, "uniform", 0)
    assert stats.mismatches == 1 and field in stats.first_mismatch
