"""Helpers shared by the GPU tests (imported after the module-level importorskip of CuPy)."""

from __future__ import annotations

import functools
import sys
import weakref
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: rankworld
from rankworld import MIN, SUM, RankWorld  # noqa: E402

from symmring import protocol  # noqa: E402
from symmring.kernels import DeviceRing  # noqa: E402
from symmring.layout import RingSpec  # noqa: E402

_worlds: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ranks(ctx=None) -> RankWorld:
    """The verdict collectives over the ranks of ``ctx`` (the current context when None; a process alone
    without one), whichever launcher started them: made on first use, which every rank reaches at the same
    point of the same test (they run the same tests in the same order)."""
    from symmring.context import current
    ctx = current() if ctx is None else ctx
    if ctx is None:
        return RankWorld(None, 60.0)
    if ctx not in _worlds:
        _worlds[ctx] = RankWorld.of(ctx)
    return _worlds[ctx]


def collective(test):
    """Decorator: run the test body, then agree on one verdict over all ranks (one allgather).

    The body asserts locally and must not call a collective after anything that can raise, except in
    ``finally`` blocks that every rank runs (closing a ring); so a failure on one rank fails the test on
    every rank, with each failing rank's message, instead of leaving the others in a collective.
    """
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        error = None
        try:
            test(*args, **kwargs)
        except Exception as exc:  # pytest's skip/fail outcomes are BaseException and pass through
            error = exc
        reports = ranks().allgather(None if error is None else f"{type(error).__name__}: {error}")
        failed = {rank: report for rank, report in enumerate(reports) if report is not None}
        if failed:
            raise AssertionError(f"failed on ranks {sorted(failed)}: " +
                                 "; ".join(f"rank {r}: {m}" for r, m in failed.items())) from error
    return wrapper


def device_error(kernels):
    """The error a ring's device error record (or abort word) holds: a `ProtocolTimeout` (its subclass
    `ProtocolAborted` included) or a `ProtocolViolation`, or None when clean; never raises it, so every
    rank goes on to the same collectives."""
    from symmring.errors import ProtocolTimeout, ProtocolViolation
    try:
        kernels.check_errors()
    except (ProtocolTimeout, ProtocolViolation) as exc:
        return exc
    return None


def errors_of(kernels) -> Optional[str]:
    """`device_error` as text (None when clean)."""
    error = device_error(kernels)
    return None if error is None else str(error)


def all_ok(flag: bool) -> bool:
    """The same verdict on every rank: True only if ``flag`` holds on all of them."""
    return bool(ranks().allreduce(1 if flag else 0, op=MIN))


def total(value: int) -> int:
    """Sum of ``value`` over the ranks."""
    return int(ranks().allreduce(int(value), op=SUM))


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
    x_sf = rng.random((num_valid, spec.num_sf), dtype=np.float32) + np.float32(2.0**-10)  # scales: > 0
    topk_idx = rng.integers(-1, spec.num_experts, size=(num_valid, spec.num_topk), dtype=np.int32)
    topk_weights = rng.random((num_valid, spec.num_topk), dtype=np.float32)
    return x, x_sf, topk_idx, topk_weights


def user_buffers(spec: RingSpec):
    """Source tensors for user_fill (uint32 words) of one chunk, all T rows (ready on return)."""
    import cupy
    T = spec.tokens_per_slot
    buffers = {"x": cupy.zeros((T, spec.hidden * spec.x_elem_bytes // 4), dtype=cupy.uint32),
            "x_sf": cupy.zeros((T, max(spec.num_sf, 1)), dtype=cupy.uint32),
            "topk_idx": cupy.zeros((T, spec.num_topk), dtype=cupy.uint32),
            "topk_weights": cupy.zeros((T, spec.num_topk), dtype=cupy.uint32)}
    cupy.cuda.runtime.deviceSynchronize()  # zero fills ran on CuPy's stream; the tests use torch streams
    return buffers


def enqueue_step(ring: DeviceRing, user_module, num_chunks: int, srcs, inputs, outputs, stats, stream, *,
                 generation_override_base: Optional[int] = None, skip_produce: bool = False) -> None:
    """Enqueue one call on one stream in protocol.enqueue_order: fill + produce each chunk of this PE
    (ready-made producer), consume + check each chunk of every source (ready-made consumer, user check),
    then end_call. ``generation_override_base`` (not None): bake generations base + chunk + 1 into the
    producer launches (the graph control)."""
    import cupy
    from symmring.kernels import as_stream
    k = ring.kernels
    launch_stream = as_stream(stream)
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
                                buf["topk_weights"]), stream=launch_stream)
            gen = 0 if generation_override_base is None else protocol.generation(generation_override_base, chunk)
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
                                     out["topk_idx"], out["topk_weights"], out["meta"], stats), stream=launch_stream)
    k.end_call(num_chunks, stream=stream)
