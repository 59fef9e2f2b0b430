"""Ready-made kernels (device/ring.cu via symmring.kernels) on 1..N PEs: bitwise data movement through a
2-slot ring with producers and consumers on separate streams, random delays and zero-token chunks; the
CONSERVATIVE (separate ack) policy; CUDA Graph replays checked against the eager reference, and the
control that bakes the generation into the graph failing; a stalled PE named by ProtocolTimeout with the
process still usable; bad input rejected before any work."""

from __future__ import annotations

import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy (and a GPU, nvshmem4py); skipped here")

from gpu_helpers import (chunk_data, collective, enqueue_step, errors_of, small_spec, total,  # noqa: E402
                         user_buffers, user_num_valid)
from symmring import protocol  # noqa: E402
from symmring.errors import ConfigError, ProtocolAborted, ProtocolTimeout  # noqa: E402
from symmring.kernels import DeviceRing  # noqa: E402


def _first_difference(name, got, want):
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != {want.shape}"
    bad = np.argwhere(got != want)
    return None if bad.size == 0 else f"{name}: first difference at {tuple(bad[0])}: {got[tuple(bad[0])]} != {want[tuple(bad[0])]}"


def _to_torch(array):
    """A CUDA tensor of ``array``'s bits (uint16 travels as int16: torch's uint16 support is partial)."""
    import torch
    return torch.from_numpy(array.view(np.int16) if array.dtype == np.uint16 else array).cuda()


def _run_two_streams(backend, spec, seed, *, num_chunks, delays, conservative, transport=None):
    torch = pytest.importorskip("torch")
    R, me = backend.world_size, backend.rank
    ring = DeviceRing(backend, spec, timeout_s=20.0, transport=transport)
    try:
        k = ring.kernels
        base, call = k.gen_base(), protocol.call_identity(k.call_number(), 0)
        producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
        rng = np.random.default_rng([seed, me, 99])
        inputs = {}
        for chunk in range(num_chunks):
            nv = user_num_valid(me, chunk, spec.tokens_per_slot)
            inputs[chunk] = [_to_torch(a) for a in chunk_data(spec, seed, me, chunk, nv)]
        outputs = {(c, src): k.new_outputs() for c in range(num_chunks) for src in range(R)}  # ready now
        torch.cuda.synchronize()
        for op, chunk in protocol.enqueue_order(num_chunks, spec.num_slots):
            if op == "produce":
                x, x_sf, idx, w = inputs[chunk]
                with torch.cuda.stream(producer):
                    if delays:
                        torch.cuda._sleep(int(rng.integers(0, 200_000)))
                k.produce(chunk, x=x, x_sf=x_sf if spec.num_sf else None, topk_idx=idx, topk_weights=w,
                          token_base=chunk * spec.tokens_per_slot, num_valid=x.shape[0], stream=producer)
            else:
                for src in range(R):
                    out = outputs[(chunk, src)]
                    with torch.cuda.stream(consumer):
                        if delays:
                            torch.cuda._sleep(int(rng.integers(0, 200_000)))
                    k.consume(chunk, src, out, ack=not conservative, stream=consumer)
                    if conservative:  # "combine" first, then acknowledge
                        with torch.cuda.stream(consumer):
                            torch.cuda._sleep(10_000)
                        k.ack(chunk, src, stream=consumer)
        torch.cuda.synchronize()
        k.end_call(num_chunks)
        error = errors_of(k)
        problems = [error] if error else []
        for (chunk, src), out in outputs.items():
            nv = user_num_valid(src, chunk, spec.tokens_per_slot)
            x, x_sf, idx, w = chunk_data(spec, seed, src, chunk, nv)
            meta = out["meta"].get()
            want_meta = np.array([chunk * spec.tokens_per_slot, nv, chunk, protocol.generation(base, chunk),
                                  call], dtype=np.int64)
            for name, got, want in (("x", out["x"].get()[:nv], x), ("topk_idx", out["topk_idx"].get()[:nv], idx),
                                    ("topk_weights", out["topk_weights"].get()[:nv].view(np.uint32),
                                     w.view(np.uint32)), ("meta", meta, want_meta)) + (
                    (("x_sf", out["x_sf"].get()[:nv].view(np.uint32), x_sf.view(np.uint32)),) if spec.num_sf else ()):
                diff = _first_difference(f"chunk {chunk} of rank {src} {name}", got, want)
                if diff:
                    problems.append(diff)
        gen_ok = k.gen_base() == protocol.next_base(base, num_chunks)
    finally:
        ring.close()
    assert not problems and gen_ok, problems[:5]


@pytest.mark.parametrize("x_format", ["bf16", "fp8_e4m3"])
@collective
def test_producer_and_consumer_on_two_streams_bitwise(backend, seed, x_format):
    _run_two_streams(backend, small_spec(x_format), seed, num_chunks=7, delays=False, conservative=False)


def _mixed(world_size: int) -> str:
    """The mixed transport of the tests: rdma to the odd ranks, p2p to the others."""
    return "rdma:" + ",".join(str(q) for q in range(1, world_size, 2))


@pytest.mark.parametrize("x_format, delays", [("bf16", False), ("fp8_e4m3", False), ("fp8_e4m3", True)])
@pytest.mark.parametrize("kind", ["rdma", "mixed"])
@collective
def test_two_streams_over_the_rdma_transport_bitwise(backend, seed, x_format, delays, kind):
    # The same movement with NVSHMEM gets / remote atomics instead of loads through the mapping (forced on
    # one node), for every peer or the odd ones; random delays and the separate ack too.
    if backend.world_size == 1:
        pytest.skip("one PE: no peer to reach over rdma")
    transport = "rdma" if kind == "rdma" else _mixed(backend.world_size)
    probe = DeviceRing(backend, small_spec(x_format), timeout_s=20.0, transport=transport)
    try:
        want = ["self" if q == backend.rank else
                "rdma" if kind == "rdma" or q % 2 == 1 else "p2p" for q in range(backend.world_size)]
        got = probe.transports
    finally:
        probe.close()
    # delays: random sleeps on both streams and the separate (CONSERVATIVE) acknowledgement.
    _run_two_streams(backend, small_spec(x_format), seed, num_chunks=7, delays=delays, conservative=delays,
                     transport=transport)
    assert got == want, f"transports {got}, expected {want}"  # after the collective runs: every rank ran them


@pytest.mark.parametrize("delay_seed", [1, 2, 3, 4])
@collective
def test_random_delays_and_conservative_acks(backend, seed, delay_seed):
    _run_two_streams(backend, small_spec("bf16"), seed + delay_seed, num_chunks=9, delays=True,
                     conservative=delay_seed % 2 == 0)


def _step_buffers(ring, num_chunks):
    inputs = [user_buffers(ring.spec)]
    outputs = {(c, s): ring.kernels.new_outputs() for c in range(num_chunks) for s in range(ring.backend.world_size)}
    return inputs, outputs


@collective
def test_cuda_graph_replays_match_eager_and_advance_generations(backend, user_module):
    torch = pytest.importorskip("torch")
    R = backend.world_size
    spec = small_spec("fp8_e4m3", tokens_per_slot=8)
    num_chunks, num_eager, num_replays = 5, 3, 1000
    ring = DeviceRing(backend, spec, timeout_s=20.0)
    errors = []
    try:
        k = ring.kernels
        base = k.gen_base()
        inputs, outputs = _step_buffers(ring, num_chunks)
        stats = cupy.zeros(2, dtype=cupy.uint64)
        cupy.cuda.runtime.deviceSynchronize()
        stream = torch.cuda.Stream()
        for _ in range(num_eager):
            enqueue_step(ring, user_module, num_chunks, range(R), inputs, outputs, stats, stream)
        torch.cuda.synchronize()
        errors.append(errors_of(k))
        eager = [int(v) for v in stats.get()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            enqueue_step(ring, user_module, num_chunks, range(R), inputs, outputs, stats, stream)
        start = time.monotonic()
        for _ in range(num_replays):
            graph.replay()
        torch.cuda.synchronize()
        replay_s = time.monotonic() - start
        errors.append(errors_of(k))
        final = [int(v) for v in stats.get()]
        gen_ok = k.gen_base() == base + (num_eager + num_replays) * num_chunks
        # One more eager step after the replays: the eager path continues from the graph's generations.
        enqueue_step(ring, user_module, num_chunks, range(R), inputs, outputs, stats, stream)
        torch.cuda.synchronize()
        errors.append(errors_of(k))
        after = [int(v) for v in stats.get()]
        del graph
    finally:
        ring.close()
    checks_per_step = num_chunks * R
    pulls, mismatches = total(final[1] - eager[1]), total(final[0])
    if backend.rank == 0:
        print(f"\ngraph replay: {num_replays} replays x {checks_per_step} chunk pulls on {R} PE(s), "
              f"{pulls} pulls checked, {mismatches} mismatches, {replay_s * 1e6 / num_replays:.1f} us per replay")
    assert not any(errors), errors
    assert eager == [0, num_eager * checks_per_step], eager
    assert final == [0, (num_eager + num_replays) * checks_per_step], final
    assert after == [0, (num_eager + num_replays + 1) * checks_per_step], after
    assert gen_ok


@collective
def test_graph_with_baked_generation_goes_stale_and_times_out(backend, user_module):
    torch = pytest.importorskip("torch")
    R = backend.world_size
    spec = small_spec("bf16", tokens_per_slot=8)
    num_chunks, timeout_s = 3, 0.5
    ring = DeviceRing(backend, spec, timeout_s=timeout_s)
    try:
        k = ring.kernels
        inputs, outputs = _step_buffers(ring, num_chunks)
        stats = cupy.zeros(2, dtype=cupy.uint64)
        cupy.cuda.runtime.deviceSynchronize()
        stream = torch.cuda.Stream()
        baked_base = k.gen_base()  # what a launch argument would freeze at capture time
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            enqueue_step(ring, user_module, num_chunks, range(R), inputs, outputs, stats, stream,
                         generation_override_base=baked_base)
        start = time.monotonic()
        graph.replay()   # first replay: the baked generations happen to be the right ones
        torch.cuda.synchronize()
        first_error = errors_of(k)
        first_checks = [int(v) for v in stats.get()]
        graph.replay()   # second replay: producers publish the stale generations again
        torch.cuda.synchronize()
        second_error = errors_of(k)
        elapsed = time.monotonic() - start
        del graph
        ring.reset()   # collective: the ring is usable again
        stats.fill(0)
        cupy.cuda.runtime.deviceSynchronize()
        enqueue_step(ring, user_module, num_chunks, range(R), inputs, outputs, stats, stream)
        torch.cuda.synchronize()
        after_reset_error = errors_of(k)
        usable = [int(v) for v in stats.get()]
    finally:
        ring.close()
    assert first_error is None and first_checks == [0, num_chunks * R], (first_error, first_checks)
    assert second_error is not None and ("route_ready" in second_error or "layout_ready" in second_error), \
        second_error
    assert elapsed < timeout_s * 4 + 10, elapsed
    assert after_reset_error is None and usable == [0, num_chunks * R], (after_reset_error, usable)


@collective
def test_stalled_pe_is_named_by_protocol_timeout_and_ring_recovers(backend, user_module):
    torch = pytest.importorskip("torch")
    R, me = backend.world_size, backend.rank
    stalled = R - 1
    spec = small_spec("bf16", tokens_per_slot=8)
    timeout_s = 1.0
    ring = DeviceRing(backend, spec, timeout_s=timeout_s)
    try:
        k = ring.kernels
        inputs, outputs = _step_buffers(ring, 1)
        stats = cupy.zeros(2, dtype=cupy.uint64)
        cupy.cuda.runtime.deviceSynchronize()
        stream = torch.cuda.Stream()
        start = time.monotonic()
        enqueue_step(ring, user_module, 1, range(R), inputs, outputs, stats, stream, skip_produce=me == stalled)
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
        error = None
        try:
            k.check_errors()
        except ProtocolTimeout as exc:
            error = exc
        ring.reset()   # collective
        stats.fill(0)
        more_outputs = _step_buffers(ring, 2)[1]
        cupy.cuda.runtime.deviceSynchronize()
        enqueue_step(ring, user_module, 2, range(R), inputs, more_outputs, stats, stream)
        torch.cuda.synchronize()
        after_reset_error = errors_of(k)
        usable = [int(v) for v in stats.get()]
    finally:
        ring.close()
    assert error is not None, "no ProtocolTimeout"
    # Either this PE's own wait expired first, or another PE's did and aborted the ring here: its error
    # then names the same stalled peer (every PE's first timeout is a wait for the stalled PE's route).
    if isinstance(error, ProtocolAborted):
        assert error.rank == me and error.origin_kind == "route_ready" and error.origin_peer == stalled, str(error)
    else:
        assert error.peer == stalled and error.rank == me and error.kind == "route_ready", str(error)
    assert f"rank {stalled}" in str(error) and f"rank {me}:" in str(error), str(error)
    assert timeout_s <= elapsed < timeout_s + 10, elapsed
    assert after_reset_error is None and usable == [0, 2 * R], (after_reset_error, usable)


@collective
def test_bad_input_is_rejected_before_any_work_and_ring_stays_usable(backend, seed):
    torch = pytest.importorskip("torch")
    R, me = backend.world_size, backend.rank
    spec = small_spec("fp8_e4m3", tokens_per_slot=8)
    ring = DeviceRing(backend, spec, timeout_s=20.0)
    try:
        k = ring.kernels
        nv = spec.tokens_per_slot
        x, x_sf, idx, w = (_to_torch(a) for a in chunk_data(spec, seed, me, 0, nv))
        good = dict(x=x, x_sf=x_sf, topk_idx=idx, topk_weights=w, token_base=0, num_valid=nv)
        bad_calls = [
            lambda: k.produce(0, **{**good, "x": x[:, :-16]}),                       # wrong hidden
            lambda: k.produce(0, **{**good, "topk_idx": idx.to(torch.int64)}),       # wrong dtype
            lambda: k.produce(0, **{**good, "num_valid": nv + 1}),                   # over capacity
            lambda: k.produce(0, **{**good, "x": x.cpu().numpy()}),                  # host memory
            lambda: k.produce(0, **{**good, "x": x.t()}),                            # not contiguous
            lambda: k.produce(0, **{**good, "x_sf": None}),                          # fp8 needs scales
            lambda: k.produce(0, **good, parts="everything"),
            lambda: k.produce(-1, **good),
            lambda: k.consume(0, R, k.new_outputs()),                                # no such rank
            lambda: k.consume(0, 0, {**k.new_outputs(), "meta": cupy.zeros(3, cupy.int64)}),
            lambda: k.end_call(-2),
            lambda: DeviceRing(backend, spec, timeout_s=0),
        ]
        rejected = []
        for call in bad_calls:
            try:
                call()
                rejected.append(False)
            except ConfigError:
                rejected.append(True)
        torch.cuda.synchronize()
        k.produce(0, **good)
        outs = {src: k.new_outputs() for src in range(R)}
        for src in range(R):
            k.consume(0, src, outs[src])
        k.end_call(1)
        error = errors_of(k)
        moved = [np.array_equal(outs[src]["x"].get(), chunk_data(spec, seed, src, 0, nv)[0]) for src in range(R)]
    finally:
        ring.close()
    assert all(rejected), rejected
    assert error is None and all(moved), (error, moved)
