"""Helpers shared by the GPU tests (imported after the module-level importorskip of CuPy)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from symmring import protocol
from symmring.kernels import DeviceRing
from symmring.layout import RingSpec


def all_ok(flag: bool) -> bool:
    """The same verdict on every rank: True only if ``flag`` holds on all of them."""
    return bool(MPI.COMM_WORLD.allreduce(1 if flag else 0, op=MPI.MIN))


def total(value: int) -> int:
    """Sum of ``value`` over the ranks."""
    return int(MPI.COMM_WORLD.allreduce(int(value), op=MPI.SUM))


def user_num_valid(rank: int, chunk: int, tokens_per_slot: int) -> int:
    """Mirror of user_num_valid() in user_kernels.cu: every count 0..T occurs, zero included."""
    return (rank * 7 + chunk * 5 + 3) % (tokens_per_slot + 1)


def small_spec(x_format: str = "bf16", num_slots: int = 2, tokens_per_slot: int = 16) -> RingSpec:
    hidden = 256 if x_format == "bf16" else 512
    return RingSpec(num_slots=num_slots, tokens_per_slot=tokens_per_slot, hidden=hidden, num_topk=4,
                    num_experts=16, x_format=x_format)


def chunk_data(spec: RingSpec, seed: int, src_rank: int, chunk: int, num_valid: int):
    """Host arrays of (src_rank, chunk): any rank regenerates any source's chunk bitwise."""
    rng = np.random.default_rng([seed, src_rank, chunk])
    x_dtype = np.uint8 if spec.x_elem_bytes == 1 else np.uint16
    x = rng.integers(0, np.iinfo(x_dtype).max, size=(num_valid, spec.hidden), dtype=x_dtype, endpoint=True)
    x_sf = rng.random((num_valid, spec.num_sf), dtype=np.float32)
    topk_idx = rng.integers(-1, spec.num_experts, size=(num_valid, spec.num_topk), dtype=np.int32)
    topk_weights = rng.random((num_valid, spec.num_topk), dtype=np.float32)
    return x, x_sf, topk_idx, topk_weights


def user_buffers(spec: RingSpec):
    """Source tensors for user_fill (uint32 words) of one chunk, all T rows."""
    import cupy
    T = spec.tokens_per_slot
    return {"x": cupy.zeros((T, spec.hidden * spec.x_elem_bytes // 4), dtype=cupy.uint32),
            "x_sf": cupy.zeros((T, max(spec.num_sf, 1)), dtype=cupy.uint32),
            "topk_idx": cupy.zeros((T, spec.num_topk), dtype=cupy.uint32),
            "topk_weights": cupy.zeros((T, spec.num_topk), dtype=cupy.uint32)}


def enqueue_step(ring: DeviceRing, user_module, num_chunks: int, srcs, inputs, outputs, stats, stream, *,
                 generation_override_base: int = 0, skip_produce: bool = False) -> None:
    """Enqueue one call on one stream in protocol.enqueue_order: fill + produce each chunk of this PE
    (ready-made producer), consume + check each chunk of every source (ready-made consumer, user check),
    then end_call. ``generation_override_base``: bake generations (the graph control)."""
    import cupy
    k = ring.kernels
    spec = ring.spec
    rank = ring.backend.rank
    fill = user_module.function("user_fill")
    check = user_module.function("user_check")
    for op, chunk in protocol.enqueue_order(num_chunks, spec.num_slots):
        if op == "produce":
            if skip_produce:
                continue
            buf = inputs[chunk % len(inputs)]
            nv = user_num_valid(rank, chunk, spec.tokens_per_slot)
            fill((4,), (256,), (k.desc, np.int32(chunk), buf["x"], buf["x_sf"], buf["topk_idx"],
                                buf["topk_weights"]), stream=stream)
            gen = generation_override_base + chunk + 1 if generation_override_base else 0
            k.produce(chunk, x=buf["x"][:nv].view(cupy.uint16 if spec.x_elem_bytes == 2 else cupy.uint8)
                      .reshape(nv, spec.hidden),
                      x_sf=buf["x_sf"][:nv].view(cupy.float32) if spec.num_sf else None,
                      topk_idx=buf["topk_idx"][:nv].view(cupy.int32),
                      topk_weights=buf["topk_weights"][:nv].view(cupy.float32),
                      token_base=chunk * spec.tokens_per_slot, num_valid=nv, stream=stream,
                      generation_override=gen)
        else:
            for src in srcs:
                out = outputs[(chunk, src)]
                k.consume(chunk, src, out, stream=stream)
                check((1,), (256,), (k.desc, np.int32(chunk), np.int32(src), out["x"], out["x_sf"],
                                     out["topk_idx"], out["topk_weights"], out["meta"], stats), stream=stream)
    k.end_call(num_chunks, stream=stream)
