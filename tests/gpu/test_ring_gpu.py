"""The host-driven `symmring.ring.Ring` (written against the Backend interface only) on the nvshmem
backend: CuPy views of GPU symmetric memory, publications and acknowledgements through the backend's
device primitives, bitwise round trips through a 2-slot ring over two calls (ring wrap), 1..N PEs."""

from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy (and a GPU, nvshmem4py); skipped here")

from gpu_helpers import chunk_data, collective, small_spec, user_num_valid  # noqa: E402
from symmring import protocol  # noqa: E402


@pytest.fixture(scope="module")
def gpu_ctx(backend):
    ring_module = pytest.importorskip("symmring.ring")
    from symmring.context import Context
    return Context(backend, backend.comm, 20.0), ring_module.Ring


@pytest.mark.parametrize("x_format", ["bf16", "fp8_e4m3"])
@collective
def test_ring_round_trip_on_gpu_bitwise(gpu_ctx, seed, x_format):
    ctx, Ring = gpu_ctx
    R, me = ctx.world_size, ctx.rank
    spec = small_spec(x_format, tokens_per_slot=8)
    ring = Ring(ctx, spec)
    problems = []
    try:
        for call_idx, num_chunks in enumerate((3, 4)):
            call = ring.begin_call(num_chunks)
            for op, chunk in protocol.enqueue_order(num_chunks, spec.num_slots):
                if op == "produce":
                    nv = user_num_valid(me, chunk + call_idx, spec.tokens_per_slot)
                    x, x_sf, idx, w = (cupy.asarray(a) for a in chunk_data(spec, seed + call_idx, me, chunk, nv))
                    ring.acquire_slot(call, chunk)
                    ring.write_route(call, chunk, idx, w, chunk * spec.tokens_per_slot, nv)
                    ring.write_layout(call, chunk, x, x_sf if spec.num_sf else None)
                    ring.publish_layout(call, chunk)
                    ring.publish_route(call, chunk)
                    continue
                for src in range(R):
                    nv = user_num_valid(src, chunk + call_idx, spec.tokens_per_slot)
                    want = chunk_data(spec, seed + call_idx, src, chunk, nv)
                    ring.wait_ready(call, chunk, src)
                    view = ring.read(call, chunk, src)
                    ring.ack(call, chunk, src)
                    got = (view.x, view.x_sf, view.topk_idx, view.topk_weights)
                    for name, g, w in zip(("x", "x_sf", "topk_idx", "topk_weights"), got, want):
                        g = cupy.asnumpy(g)
                        if name == "x_sf" and not spec.num_sf:
                            continue
                        if g.shape != w.shape or g.tobytes() != w.tobytes():
                            problems.append(f"call {call_idx} chunk {chunk} rank {src} {name}")
                    if (view.token_base, view.num_valid) != (chunk * spec.tokens_per_slot, nv):
                        problems.append(f"call {call_idx} chunk {chunk} rank {src} meta")
            ring.end_call(call)
    finally:
        ring.close()
    assert not problems, problems[:5]
