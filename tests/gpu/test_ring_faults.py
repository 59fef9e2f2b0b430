"""Device faults of the ready-made ring kernels (device/ring.cu via symmring.kernels) on 1..N PEs, each
injected on purpose, named by check_errors(), and followed by reset() and a bitwise-correct call:

* a stale payload (a slot's meta row names another generation or chunk than its readiness) -> StalePayload
  (or, on a PE that another PE's abort reached first, ProtocolAborted naming that PE and stale_payload);
* a second acknowledgement of the same chunk -> DoubleAck (or ProtocolAborted naming double_ack);
* an abort word raised while a wait runs ends that wait at once -> ProtocolAborted (any number of PEs: each
  PE raises its own word from the host);
* abort propagation (2+ PEs): one PE's DoubleAck ends the other PEs' 30 s waits (wait_ready or
  wait_reusable) within seconds, each naming the origin;
* the split producer: produce(c, parts="route") and produce(c, parts="layout"), both acquiring, in either
  order, on one stream or two, moves every chunk bitwise (it timed out before: the second part waited for a
  full mask the first part had reset).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy (and a GPU, nvshmem4py); skipped here")

from gpu_helpers import chunk_data, collective, device_error, small_spec, total, user_num_valid  # noqa: E402
from symmring import layout, protocol  # noqa: E402
from symmring.errors import DoubleAck, ProtocolAborted, StalePayload  # noqa: E402
from symmring.kernels import DeviceRing  # noqa: E402


def _inputs(spec, seed, rank, chunk, num_valid):
    """Device copies of chunk_data (ready on return)."""
    arrays = [cupy.asarray(a) for a in chunk_data(spec, seed, rank, chunk, num_valid)]
    cupy.cuda.runtime.deviceSynchronize()
    return arrays


def _produce(k, spec, chunk, arrays, *, parts="both", stream=None):
    x, x_sf, idx, w = arrays
    k.produce(chunk, x=x, x_sf=x_sf if spec.num_sf else None, topk_idx=idx, topk_weights=w,
              token_base=chunk * spec.tokens_per_slot, num_valid=x.shape[0], parts=parts, stream=stream)


def _run_call(ring, seed, num_chunks, *, split=None, two_streams=False):
    """One call of ``num_chunks`` chunks in protocol.enqueue_order, every PE's chunks consumed from every PE
    and compared bitwise. ``split``: None (produce both parts in one launch), ``"route_first"`` or
    ``"layout_first"`` (two launches per chunk, both acquiring). ``two_streams``: route parts, layout parts
    and consumers on three streams (else all on one). Returns (device error or None, problems, gen_ok)."""
    torch = pytest.importorskip("torch")
    k, spec = ring.kernels, ring.spec
    R, me, T = ring.backend.world_size, ring.backend.rank, spec.tokens_per_slot
    base, call = k.gen_base(), protocol.call_identity(k.call_number(), 0)
    inputs = {c: _inputs(spec, seed, me, c, user_num_valid(me, c, T)) for c in range(num_chunks)}
    outputs = {(c, src): k.new_outputs() for c in range(num_chunks) for src in range(R)}  # ready now
    if two_streams:
        route_stream, layout_stream, consumer = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    else:
        route_stream = layout_stream = consumer = torch.cuda.Stream()
    for op, chunk in protocol.enqueue_order(num_chunks, spec.num_slots):
        if op == "produce":
            if split is None:
                _produce(k, spec, chunk, inputs[chunk], stream=route_stream)
                continue
            parts = [("route", route_stream), ("layout", layout_stream)]
            for part, stream in parts if split == "route_first" else parts[::-1]:
                _produce(k, spec, chunk, inputs[chunk], parts=part, stream=stream)
        else:
            for src in range(R):
                k.consume(chunk, src, outputs[(chunk, src)], stream=consumer)
    torch.cuda.synchronize()
    k.end_call(num_chunks)
    error = device_error(k)
    problems = []
    for (chunk, src), out in outputs.items():
        nv = user_num_valid(src, chunk, T)
        x, x_sf, idx, w = chunk_data(spec, seed, src, chunk, nv)
        want_meta = np.array([chunk * T, nv, chunk, protocol.generation(base, chunk), call], dtype=np.int64)
        pairs = [("x", out["x"].get()[:nv], x), ("topk_idx", out["topk_idx"].get()[:nv], idx),
                 ("topk_weights", out["topk_weights"].get()[:nv].view(np.uint32), w.view(np.uint32)),
                 ("meta", out["meta"].get(), want_meta)]
        if spec.num_sf:
            pairs.append(("x_sf", out["x_sf"].get()[:nv].view(np.uint32), x_sf.view(np.uint32)))
        for name, got, want in pairs:
            if got.shape != want.shape or not np.array_equal(got, want):
                problems.append(f"chunk {chunk} of rank {src}: {name} differs")
    gen_ok = k.gen_base() == protocol.next_base(base, num_chunks)
    return error, problems, gen_ok


def _recovered(ring, seed):
    """After reset: a normal 3-chunk call (slots wrap) is bitwise correct with no device error."""
    error, problems, gen_ok = _run_call(ring, seed + 1, 3)
    return error is None and not problems and gen_ok, (str(error) if error else None, problems[:3], gen_ok)


# --- detectors ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("column", ["generation", "chunk_idx"])
@collective
def test_stale_payload_is_named_and_ring_recovers(backend, seed, column):
    R, me = backend.world_size, backend.rank
    spec = small_spec("bf16", tokens_per_slot=8)
    ring = DeviceRing(backend, spec, timeout_s=5.0)
    try:
        k = ring.kernels
        gen = protocol.generation(k.gen_base(), 0)
        _produce(k, spec, 0, _inputs(spec, seed, me, 0, spec.tokens_per_slot))
        outs = {src: k.new_outputs() for src in range(R)}  # synchronises: chunk 0 is published
        # The fault: this PE's slot 0 meta row now names a later lap (generation + S) or chunk S (same slot).
        meta = ring.region("meta")
        if column == "generation":
            meta[0, layout.META_PAYLOAD_GEN] = gen + spec.num_slots
        else:
            meta[0, layout.META_CHUNK_IDX] = spec.num_slots
        cupy.cuda.runtime.deviceSynchronize()
        backend.barrier(what="test: every PE's meta corrupted")
        for src in range(R):
            k.consume(0, src, outs[src])
        cupy.cuda.runtime.deviceSynchronize()
        error = device_error(k)
        untouched = all(not outs[src]["meta"].get().any() for src in range(R))  # the payload was not used
        direct = isinstance(error, StalePayload)
        ring.reset()
        ok, detail = _recovered(ring, seed)
    finally:
        ring.close()
    num_direct = total(direct)
    if direct:
        want = (gen, gen + spec.num_slots, 0) if column == "generation" else (gen, gen, spec.num_slots)
        assert (error.rank, error.slot, error.chunk) == (me, 0, 0) and error.peer in range(R), str(error)
        assert (error.expected, error.observed, error.observed_chunk) == want, str(error)
        assert "call reset()" in str(error) and f"rank {me}:" in str(error), str(error)
    else:
        assert isinstance(error, ProtocolAborted) and error.origin != me and \
            error.origin_kind == "stale_payload", repr(error)
    assert num_direct >= 1, "no PE recorded the stale payload itself"
    assert untouched, "a consumer used a stale payload"
    assert ok, detail


@collective
def test_double_ack_is_named_and_ring_recovers(backend, seed):
    R, me = backend.world_size, backend.rank
    spec = small_spec("fp8_e4m3", tokens_per_slot=8)
    ring = DeviceRing(backend, spec, timeout_s=5.0)
    try:
        k = ring.kernels
        _produce(k, spec, 0, _inputs(spec, seed, me, 0, spec.tokens_per_slot))
        outs = {src: k.new_outputs() for src in range(R)}
        for src in range(R):
            k.consume(0, src, outs[src], ack=False)
        for src in range(R):
            k.ack(0, src)
        for src in range(R):
            k.ack(0, src)  # the fault: the same generation acknowledged a second time
        cupy.cuda.runtime.deviceSynchronize()
        error = device_error(k)
        direct = isinstance(error, DoubleAck)
        ring.reset()
        ok, detail = _recovered(ring, seed)
    finally:
        ring.close()
    num_direct = total(direct)
    bit = 1 << (me % 64)
    if direct:
        assert (error.rank, error.slot, error.chunk, error.expected) == (me, 0, 0, bit), str(error)
        assert error.observed & bit and error.peer in range(R), str(error)
        assert "twice" in str(error) and "call reset()" in str(error), str(error)
    else:
        assert isinstance(error, ProtocolAborted) and error.origin != me and error.origin_kind == "double_ack", \
            repr(error)
    assert num_direct >= 1, "no PE recorded the double acknowledgement itself"
    assert ok, detail


# --- abort ----------------------------------------------------------------------------------------------

@collective
def test_abort_word_ends_a_running_wait_at_once(backend, user_module, seed):
    # Every PE waits for its own chunk 0, which it never produces (8 s bound), and its own abort word is raised
    # 0.2 s later, as another PE's record_error would: the wait ends at its next check and records
    # kErrorAborted naming the (pretended) origin and its error.
    #
    # The store is a one-thread kernel of the test's user module (user_store_after: it spins 0.2 s on the device,
    # then stores), launched BEFORE the wait. The version before issue 33 launched the store from the host 0.2 s
    # AFTER the wait started (the backend's signal_set, on a second stream), which needs the GPU to start a new
    # kernel while the wait spins, and CUDA promises no such concurrency: two streams of one process may share a
    # hardware queue (CUDA_DEVICE_MAX_CONNECTIONS, the MPS server's channels), and a function used for the first
    # time may wait for the running kernels before it loads (lazy loading, as CuPy's fill kernel of an earlier
    # version did). Either holds the store behind the wait until its bound: the wait then times out instead of
    # aborting (1 run in 4 on an H100). Launched first, the store runs whatever the GPU does: beside the wait
    # (which it ends at once, `error.waited` set), or before it (the wait's kernel returns at entry on the raised
    # word, `error.waited` None); never after the bound.
    R, me = backend.world_size, backend.rank
    spec = small_spec("bf16", tokens_per_slot=8)
    timeout_s = 8.0
    ring = DeviceRing(backend, spec, timeout_s=timeout_s)
    origin = (me + 1) % R
    try:
        k = ring.kernels
        gen = protocol.generation(k.gen_base(), 0)
        out = k.new_outputs()
        word = layout.pack_abort(origin, layout.ERROR_KIND_COMBINE, me, 5)
        waiter, writer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        store = user_module.function("user_store_after")
        cupy.cuda.runtime.deviceSynchronize()
        start = time.monotonic()
        store((1,), (32,), (np.uint64(ring.alloc.ptr + ring.layout["abort"].offset), np.uint64(word),
                            np.uint64(200_000_000)), stream=writer)
        k.consume(0, me, out, stream=waiter)
        cupy.cuda.runtime.deviceSynchronize()
        elapsed = time.monotonic() - start
        error = device_error(k)
        ring.reset()
        ok, detail = _recovered(ring, seed)
    finally:
        ring.close()
    assert isinstance(error, ProtocolAborted), repr(error)
    assert (error.rank, error.origin, error.origin_kind, error.origin_peer, error.origin_chunk) == \
        (me, origin, "combine", me, 5), str(error)
    assert error.waited in (None, "route_ready"), str(error)
    if error.waited is not None:  # the wait itself gave up (not a kernel returning at entry)
        assert (error.slot, error.chunk, error.expected) == (0, 0, gen), str(error)
    assert f"rank {origin}" in str(error) and "call reset()" in str(error), str(error)
    assert elapsed < 4.0, f"the wait took {elapsed:.1f} s after the abort was stored (bound {timeout_s} s)"
    assert ok, detail


@pytest.mark.parametrize("wait", ["wait_ready", "wait_reusable"])
@collective
def test_one_pe_error_aborts_every_other_pe_at_once(backend, seed, wait):
    R, me = backend.world_size, backend.rank
    if R < 2:
        pytest.skip("abort propagation needs 2 or more PEs")
    origin = R - 1
    spec = small_spec("bf16", tokens_per_slot=8)
    timeout_s = 30.0
    ring = DeviceRing(backend, spec, timeout_s=timeout_s)
    try:
        k = ring.kernels
        inputs = {c: _inputs(spec, seed, me, c, spec.tokens_per_slot) for c in range(spec.num_slots)}
        out = k.new_outputs()
        backend.barrier(what="test: start together")
        start = time.monotonic()
        if me == origin:
            # The fault: a double acknowledgement of its own chunk 0.
            _produce(k, spec, 0, inputs[0])
            k.consume(0, me, out, ack=False)
            k.ack(0, me)
            k.ack(0, me)
        elif wait == "wait_ready":
            k.consume(0, me, out)  # its own chunk 0, never produced: waits until the abort
        else:
            for c in range(spec.num_slots):
                _produce(k, spec, c, inputs[c])  # every slot published, nobody acknowledges
            k.acquire(spec.num_slots)  # waits for chunk 0's acknowledgements until the abort
        cupy.cuda.runtime.deviceSynchronize()
        elapsed = time.monotonic() - start
        error = device_error(k)
        ring.reset()
        ok, detail = _recovered(ring, seed)
    finally:
        ring.close()
    if me == origin:
        assert isinstance(error, DoubleAck) and (error.peer, error.chunk) == (origin, 0), repr(error)
    else:
        assert isinstance(error, ProtocolAborted), repr(error)
        assert (error.origin, error.origin_kind, error.origin_peer, error.origin_chunk) == \
            (origin, "double_ack", origin, 0), str(error)
        assert error.waited in (None, "route_ready" if wait == "wait_ready" else "reuse"), str(error)
        assert f"rank {origin}" in str(error), str(error)
        assert elapsed < 10.0, f"rank {me} waited {elapsed:.1f} s after rank {origin}'s error (bound {timeout_s} s)"
    assert ok, detail


@collective
def test_reuse_timeout_names_the_consumer_that_never_acknowledged(backend, seed):
    """Issue 24, item 3 (3 PEs and more; 2 work too): every PE reads every PE's chunk 0, and the last PE never
    acknowledges. Rank 0 then produces chunk 1 into the same slot: its reuse wait times out (3 s) with the
    last PE's bit missing, and the abort word it raises must name that PE (``origin_peer``), which the other
    PEs -- waiting (20 s bound) for rank 0's chunk 1 -- report. The old code put the waiting owner (rank 0)
    in the record's peer and so in every survivor's error (mutant check: ``peer = d.rank`` in
    protocol.cuh wait_slot_free fails the ``origin_peer`` assertion)."""
    R, me = backend.world_size, backend.rank
    if R < 2:
        pytest.skip("a missing consumer of another PE's slot needs 2 or more PEs")
    culprit, owner_bound_s = R - 1, 3.0
    spec = small_spec("bf16", num_slots=1, tokens_per_slot=8)
    ring = DeviceRing(backend, spec, timeout_s=owner_bound_s if me == 0 else 20.0)
    try:
        k = ring.kernels
        inputs = {c: _inputs(spec, seed, me, c, spec.tokens_per_slot) for c in range(2)}
        outs = {src: k.new_outputs() for src in range(R)}
        _produce(k, spec, 0, inputs[0])
        for src in range(R):
            k.consume(0, src, outs[src], ack=me != culprit)  # the fault: the culprit reads but never acks
        cupy.cuda.runtime.deviceSynchronize()
        backend.barrier(what="test: chunk 0 read everywhere")
        start = time.monotonic()
        if me == 0:
            _produce(k, spec, 1, inputs[1])  # waits for the culprit's acknowledgement of chunk 0
        else:
            k.consume(1, 0, k.new_outputs())  # waits for rank 0's chunk 1 until rank 0's abort
        cupy.cuda.runtime.deviceSynchronize()
        elapsed = time.monotonic() - start
        error = device_error(k)
        ring.reset()
        ok, detail = _recovered(ring, seed)
    finally:
        ring.close()
    print(f"\nrank {me}: {elapsed:.2f} s: {type(error).__name__}: {error}")
    if me == 0:
        from symmring.errors import ProtocolTimeout
        assert type(error) is ProtocolTimeout and error.kind == "reuse", repr(error)
        assert list(error.missing_ranks) == [culprit], str(error)
        assert elapsed < owner_bound_s * 1.2 + 1.0, f"rank 0's reuse wait took {elapsed:.1f} s"
    else:
        assert isinstance(error, ProtocolAborted), repr(error)
        assert (error.origin, error.origin_kind, error.origin_peer) == (0, "reuse", culprit), str(error)
        assert f"about rank {culprit}" in str(error), str(error)
        assert elapsed < owner_bound_s * 1.2 + 2.0, f"rank {me} waited {elapsed:.1f} s after rank 0's error"
    assert ok, detail


# --- the split producer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("two_streams", [False, True], ids=["one_stream", "two_streams"])
@pytest.mark.parametrize("order", ["route_first", "layout_first"])
@collective
def test_split_produce_route_and_layout_both_acquiring(backend, seed, order, two_streams):
    spec = small_spec("fp8_e4m3", num_slots=2, tokens_per_slot=16)
    ring = DeviceRing(backend, spec, timeout_s=10.0)
    try:
        error, problems, gen_ok = _run_call(ring, seed, 7, split=order, two_streams=two_streams)
        # A second call: the slots' previous uses are now in an earlier call.
        error2, problems2, gen_ok2 = _run_call(ring, seed + 5, 5, split=order, two_streams=two_streams)
    finally:
        ring.close()
    assert error is None and error2 is None, (str(error), str(error2))
    assert not problems and not problems2, (problems + problems2)[:5]
    assert gen_ok and gen_ok2
