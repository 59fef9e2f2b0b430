"""Issue 24 ([serving-safety]) on the GPU layer: a serving loop never gets garbage silently.

* schedules agreed by construction: ``streaming="auto"`` decided from the exchanged counts, so ranks with very
  uneven counts (one above the policy's threshold, the others far below) all stream (or all run batch);
* asynchronous errors: after an injected double acknowledgement or abort, the next call's output is NaN on every
  PE (never stale, never uninitialised), `MoE.async_error()` names the error without a synchronisation, and the
  call after that raises on every PE before enqueuing anything; reset makes the layer bitwise as before;
* a stale payload injected on the MoE path (a ready word raised over an old meta row) is detected by the
  dispatch wait's check_payload on every other PE, and the output is poisoned;
* one deadline per wait: moe_dispatch_wait of both parts, where the route arrives late (at 0.9x the bound) and
  the layout never, gives up within 1.2x the bound (it took up to 2x with a deadline per part).

Each prints one figure line per rank (the case, the error text or schedule, the seconds). Run on 1, 2 and 4 PEs:
``python -m symmring.launch -n 4 --mps -- python -m mpi4py -m pytest tests/gpu/test_serving_safety.py -q -s``.
How each fails on the code before issue 24: the auto case raises or times out (rank 0 streams, the others run
batch); the async case gets torch.empty's uninitialised rows in the call after the fault and no raise in the
next one; the stale case passes there (the detector existed) but fails with the dispatch wait's check_payload
call removed (a mutant); the deadline case takes about 1.9x the bound.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402
from gpu_helpers import ranks  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

import cupy  # noqa: E402

from moe_helpers import cuda_device as dev, make_tokens, make_weights, to_torch, verdict  # noqa: E402

from symmring import layout, protocol  # noqa: E402
from symmring.errors import ProtocolAborted, ProtocolTimeout, ProtocolViolation, StalePayload  # noqa: E402
from symmring.moe.gpu import stages  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.gpu.policy import StreamPolicy  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261224))
HIDDEN, INTER, NUM_EXPERTS, TOPK = 256, 256, 24, 2  # 24 experts split evenly over 1, 2, 3, 4 or 8 PEs


class ThresholdPolicy(StreamPolicy):
    """Streams every call of at least ``threshold`` tokens per rank (the layer asks about max(counts))."""

    def __init__(self, threshold: int):
        self.threshold = threshold

    def streams(self, layer, num_tokens: int) -> bool:
        return num_tokens >= self.threshold


def layer(ctx, max_tokens, **schedule):
    """A bf16-expert layer (torch engine) with this rank's slice of seeded weights."""
    w_gate, w_up, w_down, _ = make_weights(SEED, NUM_EXPERTS, HIDDEN, INTER)
    e = NUM_EXPERTS // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    return MoE(ctx, Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down))),
               RoutingConfig(NUM_EXPERTS, TOPK), max_tokens=max_tokens, schedule=ScheduleConfig(**schedule),
               engine="torch")


def tokens(seed, n):
    x = to_torch(make_tokens(seed, n, HIDDEN), torch.bfloat16, dev())
    logits = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((n, NUM_EXPERTS)).astype(np.float32))
    return x, logits.to(dev())


def bits(y):
    return y.view(torch.int16).cpu().numpy()


# --- 1. streaming="auto" from the exchanged counts ------------------------------------------------------------

@pytest.mark.parametrize("big_rank", ["first", "last"])
def test_auto_schedule_agrees_with_uneven_counts(ctx, big_rank):
    R, me = ctx.world_size, ctx.rank
    big = 0 if big_rank == "first" else R - 1
    moe = layer(ctx, 2048, num_slots=4, tokens_per_slot=512, expert_window=1, timeout_s=5.0,
                policy=ThresholdPolicy(1000))
    problems, lines = [], []
    try:
        for case, (large, small) in enumerate(((1500, 50), (900, 50), (1500, 0))):
            n = large if me == big else small
            x, logits = tokens(SEED + 10 * case + me, n)
            start = time.monotonic()
            y_auto = moe.forward(x, logits=logits, streaming="auto")
            moe.check_errors()
            seconds = time.monotonic() - start
            streamed = moe.last_plan.streaming
            want = max(large, small) >= 1000
            y_same = moe.forward(x, logits=logits, streaming=want)
            moe.check_errors()
            lines.append(f"counts {large}/{small}: {'streamed' if streamed else 'batch'} in {seconds:.2f} s")
            if streamed is not want:
                problems.append(f"counts {large}/{small}: streamed={streamed}, expected {want}")
            if not np.array_equal(bits(y_auto), bits(y_same)):
                problems.append(f"counts {large}/{small}: auto != streaming={want} bitwise")
    except (ProtocolTimeout, ProtocolViolation) as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        moe.close()
    print(f"\nrank {me} (big rank {big}): " + "; ".join(lines))
    verdict(ctx, not problems, "; ".join(problems))


# --- 2. asynchronous errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["double_ack", "abort"])
def test_async_error_poisons_then_raises_on_every_pe(ctx, fault):
    R, me = ctx.world_size, ctx.rank
    n = 48 + 8 * me  # uneven counts: every rank's fits max_tokens on any number of PEs
    moe = layer(ctx, 48 + 8 * R, timeout_s=5.0)
    problems, line = [], ""
    try:
        x, logits = tokens(SEED + 100 + me, n)
        y0 = moe.forward(x, logits=logits).clone()
        moe.check_errors()
        ranks(ctx).Barrier()
        # The fault, between two calls.
        if fault == "double_ack" and me == R - 1:
            moe.ring.kernels.ack(0, 0)  # rank 0's slot 0 mask already holds this rank's bit: DoubleAck
        elif fault == "abort":
            word = layout.pack_abort((me + 1) % R, layout.ERROR_KIND_COMBINE, me, 5)
            moe.backend.signal_set(moe.ring.alloc, moe.ring.layout["abort"].offset, word, me)
        torch.cuda.synchronize()
        ranks(ctx).Barrier()  # every PE's error pending (the double ack aborted the others)
        start = time.monotonic()
        y_a = moe.forward(x, logits=logits)  # enqueued after the fault: NaN, not garbage
        torch.cuda.synchronize()
        if not bool(torch.isnan(y_a.float()).all()):
            problems.append(f"the call after the fault returned {int((~torch.isnan(y_a.float())).any(1).sum())} "
                            f"unpoisoned rows of {n}")
        polled = moe.async_error()
        if polled is None:
            problems.append("async_error() is None after a poisoned call")
        ranks(ctx).Barrier()
        try:
            moe.forward(x, logits=logits)
            problems.append("the next forward did not raise")
        except (ProtocolTimeout, ProtocolViolation) as exc:
            line = f"{fault}: {time.monotonic() - start:.2f} s to the raise: {type(exc).__name__}: {exc}"
            if fault == "double_ack" and me != R - 1 and not (isinstance(exc, ProtocolAborted) and exc.origin == R - 1):
                problems.append(f"expected ProtocolAborted naming rank {R - 1}: {exc!r}")
            if fault == "abort" and not (isinstance(exc, ProtocolAborted) and exc.origin == (me + 1) % R):
                problems.append(f"expected ProtocolAborted naming rank {(me + 1) % R}: {exc!r}")
        ranks(ctx).Barrier()
        moe.reset()
        if moe.async_error() is not None:
            problems.append("async_error() still set after reset")
        y_c = moe.forward(x, logits=logits)
        moe.check_errors()
        if not np.array_equal(bits(y_c), bits(y0)):
            problems.append("after reset: not bitwise the call before the fault")
    finally:
        moe.close()
    print(f"\nrank {me}: {line}")
    verdict(ctx, not problems, "; ".join(problems))


# --- 3. stale payload on the MoE path -----------------------------------------------------------------------------

def test_stale_payload_on_the_moe_path_is_detected(ctx):
    R, me = ctx.world_size, ctx.rank
    if R < 2:
        pytest.skip("a consumer of another PE's stale slot needs 2 or more PEs (one PE orders its consumer after "
                    "its own producer)")
    culprit, n = R - 1, 64
    moe = layer(ctx, n, num_slots=2, tokens_per_slot=32, timeout_s=5.0)
    problems, line = [], ""
    try:
        x, logits = tokens(SEED + 200 + me, n)
        moe.forward(x, logits=logits, streaming=True)
        moe.check_errors()
        if me == culprit:
            # The fault: chunk 0's ready words of the NEXT call raised over the previous call's meta row, while
            # the real producer is held back 2 s.
            gen = moe.ring.kernels.gen_base() + 1
            for name in ("route_ready", "layout_ready"):
                moe.backend.signal_set(moe.ring.alloc, moe.ring.layout[name].slot_offset(0), gen, me)
            torch.cuda.synchronize()
        ranks(ctx).Barrier()
        start = time.monotonic()
        delay = {0: 2_000_000_000} if me == culprit else None
        y = moe.debug.forward(x, logits=logits, streaming=True, producer_delay_ns=delay)  # None: no hook
        torch.cuda.synchronize()
        seconds = time.monotonic() - start
        if not bool(torch.isnan(y.float()).all()):
            problems.append("the call with the stale slot returned unpoisoned rows")
        try:
            moe.check_errors()
            problems.append("no error")
        except StalePayload as exc:
            line = f"{seconds:.2f} s: {exc}"
            if exc.peer != culprit:
                problems.append(f"StalePayload names peer {exc.peer}, expected {culprit}")
        except ProtocolAborted as exc:
            line = f"{seconds:.2f} s: {exc}"
            if exc.origin_kind != "stale_payload" or exc.origin_peer != culprit:
                problems.append(f"expected an abort for a stale payload of rank {culprit}: {exc}")
        except ProtocolTimeout as exc:
            line = f"{seconds:.2f} s: {exc}"
            if me != culprit:  # the culprit itself may time out on the others' combine signals
                problems.append(f"{type(exc).__name__}: {exc}")
        ranks(ctx).Barrier()
        moe.reset()
    finally:
        moe.close()
    print(f"\nrank {me}: {line}")
    verdict(ctx, not problems, "; ".join(problems))


# --- 4. one deadline per wait -------------------------------------------------------------------------------------

def test_dispatch_wait_gives_both_parts_one_deadline(ctx):
    if ctx.world_size != 1:
        pytest.skip("one PE: the wait's sources are this PE's own words, written from the host")
    if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        pytest.skip("the host writes the route word while the wait runs: not with CUDA_LAUNCH_BLOCKING=1")
    bound_s = 4.0
    moe = layer(ctx, 16, timeout_s=bound_s)
    try:
        ring, k, s = moe.ring, moe.executor.kernels, moe.executor.state
        route_offset = ring.layout["route_ready"].slot_offset(0)
        # Load the writer's kernel now: a lazily loaded module can wait for the device's running kernels.
        moe.backend.signal_set(ring.alloc, route_offset, 0, 0)
        gen = ring.kernels.gen_base() + 1  # chunk 0 of the next call (gen_base synchronises)
        meta = ring.region("meta")
        meta[0, layout.META_PAYLOAD_GEN] = gen  # so check_payload accepts the route when it comes
        meta[0, layout.META_CHUNK_IDX] = 0
        number = int(moe.workspace.gpu.call_number.item())  # this PE's next call (the device's call counter)
        meta[0, layout.META_CALL_ID] = protocol.call_identity(number, moe.layer_id)
        cupy.cuda.runtime.deviceSynchronize()
        waiter, writer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        start = time.monotonic()
        stages.wait(k, s, waiter, chunk=0, parts=stages.WAIT_ROUTE | stages.WAIT_LAYOUT, window_row=0,
                    clear_counts=True, layer=moe.layer_id)
        time.sleep(0.9 * bound_s)
        with writer:  # the route, late but within the bound; the layout never
            moe.backend.signal_set(ring.alloc, route_offset, gen, 0)
        cupy.cuda.runtime.deviceSynchronize()
        elapsed = time.monotonic() - start
        try:
            moe.check_errors()
            error = None
        except ProtocolTimeout as exc:
            error = exc
        moe.reset()
    finally:
        moe.close()
    print(f"\nboth parts, route at {0.9 * bound_s:.1f} s, layout never: gave up after {elapsed:.2f} s "
          f"(bound {bound_s} s): {error}")
    assert error is not None and error.kind == "layout_ready", repr(error)
    assert elapsed < 1.2 * bound_s, f"the wait took {elapsed:.2f} s > 1.2 x {bound_s} s: a deadline per part"
