"""Issue 33 on the GPU layer: every row a PE gets back is right, or every PE raises.

* the measured defect (`test_refused_call_in_a_step_raises_on_every_pe`): inside a `Workspace.step` PE 0's call of
  layer A is refused (one token more than the step declared), PE 0 catches the ConfigError and calls layer B, the
  others call A then B. Every PE raises a named error in that step or at the next step's entry, no call returns
  finite wrong rows, no PE keeps wrong rows without an error, and after `Workspace.reset` a step is right; A and
  B of one shape (one ring) and of two shapes (two rings);
* a device error latched on one PE is raised by `Workspace.step` at entry on every PE, at every entry until reset;
  `CapturedCall.replay` (and `Workspace.replay`) raise it without a synchronisation; a reset inside a step leaves
  no stale latch words behind;
* `Workspace.replay` orders the next eager call on another stream after the replay (the end-of-call event), and
  refuses a graph captured (raw ``torch.cuda.graph``) before the workspace grew;
* outside a step, a PE whose arguments fail joins the exchange (every PE raises the same ConfigError, nothing is
  enqueued) and PEs that call different layers raise `CallMismatch` on every PE.

Run at 1, 2 and 3 PEs: ``python -m symmring.launch --mps -n 3 -- python -m mpi4py -m pytest
tests/gpu/test_no_silent_rows.py -q -s`` (the soak: tests/gpu/test_soak_faults.py). Each test prints one line per
PE. On the code before issue 33 the reproduction returns finite wrong rows on every PE (relative errors 0.6 to
1.2: PE 0's B paired with the others' A on the shared ring, the same generations), `Workspace.step` raises
nothing, and `Workspace.replay`, `Workspace.reset` and `CallMismatch` do not exist.
"""

from __future__ import annotations

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import cuda_device as dev, verdict  # noqa: E402
from layer_sets import MAX_TOKENS, SEED, SHAPES, GpuLayers, silent_rows  # noqa: E402

from symmring import layout  # noqa: E402
from symmring.errors import CallMismatch, ConfigError, StepFailed, SymmringError  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402

pytestmark = pytest.mark.gpu


def rows_ok(a: GpuLayers, layer: int, step: int, n: int, y) -> bool:
    x, idx, w = silent_rows.step_inputs(SEED, step, layer, a.rank, n, a.defs[layer], True)
    ref = silent_rows.reference_rows(a.defs[layer], x, idx, w, "bf16")
    return silent_rows.wrong_rows(np.asarray(y.float().cpu()), ref, a.rtol) == 0


def raise_own_abort(a: GpuLayers, layer: int) -> None:
    """The fault of the latch tests: this PE's abort word raised from the host, as another PE's error would."""
    moe = a.layers[layer]
    word = layout.pack_abort((a.rank + 1) % a.world, layout.ERROR_KIND_COMBINE, a.rank, 5)
    moe.backend.signal_set(moe.ring.alloc, moe.ring.layout["abort"].offset, word, a.rank)
    torch.cuda.synchronize()


@pytest.mark.parametrize("given", [False, True], ids=["exchanged", "counts_given"])
@pytest.mark.parametrize("second", [1, 2], ids=["same_ring", "other_ring"])
def test_refused_call_in_a_step_raises_on_every_pe(ctx, second, given):
    """``counts_given``: every step takes its counts as given (``Workspace.step(counts=...)``, as vLLM's): no
    exchange at any entry, yet every PE raises in the step or at the next entry (its own latch or failure)."""
    a = GpuLayers(ctx, SEED)
    try:
        problems = silent_rows.refused_then_next(a, seed=SEED, culprit=0, first=0, second=second, n=5,
                                                 allgather=ctx.comm.allgather, given=given)
    finally:
        a.close()
    print(f"\nrank {ctx.rank}: refused A, then {'B (same ring)' if second == 1 else 'C (other ring)'}"
          f"{', counts given' if given else ''}: problems {problems}")
    verdict(ctx, not problems, "; ".join(problems))


def test_step_raises_a_latched_error_at_entry_on_every_pe(ctx):
    a = GpuLayers(ctx, SEED, shapes=SHAPES[:1])
    n, problems, raised = 4, [], []
    try:
        with a.ws.step(n, own_router=False):
            if not rows_ok(a, 0, 0, n, a.call(0, *silent_rows.step_inputs(SEED, 0, 0, a.rank, n, a.defs[0], True))):
                problems.append("the first call was wrong")
        if a.rank == a.world - 1:
            raise_own_abort(a, 0)
        ctx.comm.Barrier()
        with a.ws.step(n, own_router=False):  # the fault is on the device only: this step's call is NaN
            y = a.call(0, *silent_rows.step_inputs(SEED, 1, 0, a.rank, n, a.defs[0], True))
            if not bool(torch.isnan(y.float()).all()):
                problems.append("the call after the fault returned unpoisoned rows")
        for attempt in range(2):  # every entry until reset, on every PE
            try:
                with a.ws.step(n, own_router=False):
                    problems.append(f"entry {attempt} did not raise")
            except SymmringError as exc:
                raised.append(f"{type(exc).__name__}")
        a.ws.reset()
        with a.ws.step(n, own_router=False):
            if not rows_ok(a, 0, 2, n, a.call(0, *silent_rows.step_inputs(SEED, 2, 0, a.rank, n, a.defs[0], True))):
                problems.append("the step after reset was wrong")
    finally:
        a.close()
    print(f"\nrank {ctx.rank}: step entries raised {raised}")
    verdict(ctx, not problems, "; ".join(problems))


def test_replay_raises_the_latched_error_without_a_synchronisation(ctx):
    a = GpuLayers(ctx, SEED, shapes=SHAPES[:1])
    n, problems, line = 8, [], ""
    try:
        x, idx, w = a.inputs(*silent_rows.step_inputs(SEED, 0, 0, a.rank, n, a.defs[0], True))
        call, y = a.layers[0].capture(x, topk_idx=idx, topk_weights=w)
        call.replay()
        if not rows_ok(a, 0, 0, n, y):
            problems.append("the first replay was wrong")
        if a.rank == a.world - 1:
            raise_own_abort(a, 0)
        ctx.comm.Barrier()
        call.replay()  # meets the error on the device: NaN rows, the latch set
        torch.cuda.synchronize()
        if not bool(torch.isnan(y.float()).all()):
            problems.append("the replay after the fault returned unpoisoned rows")
        try:
            call.replay()
            problems.append("the replay after a latched error did not raise")
        except SymmringError as exc:
            line = f"{type(exc).__name__}: {exc}"
        ctx.comm.Barrier()
        a.layers[0].reset()
        call.replay()
        if not rows_ok(a, 0, 0, n, y):
            problems.append("the replay after reset was wrong")
    finally:
        a.close()
    print(f"\nrank {ctx.rank}: {line}")
    verdict(ctx, not problems, "; ".join(problems))


def test_replay_orders_the_next_call_after_it(ctx):
    """`Workspace.replay` records the end-of-call event after the graph: an eager call's stream waits for it."""
    a = GpuLayers(ctx, SEED, shapes=SHAPES[:1])
    problems = []
    try:
        marker = torch.zeros(1, device=dev())
        graph = torch.cuda.CUDAGraph()
        with a.ws.capture(graph):  # a long graph: ~0.3 s of spinning, then the marker
            torch.cuda._sleep(int(3e8))
            marker.fill_(1.0)
        marker.zero_()
        torch.cuda.synchronize()
        a.ws.replay(graph)
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            a.ws.gpu.after_last_call()  # what every call does first (Workspace.set_call_tokens, forward)
            seen = marker.clone()
        torch.cuda.synchronize()
        if float(seen.item()) != 1.0:
            problems.append("the next call on another stream ran before the replay ended")
    finally:
        a.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_replay_refuses_a_raw_graph_captured_before_the_workspace_grew(ctx):
    ws = Workspace(ctx, max_tokens=MAX_TOKENS)
    small = GpuLayers(ctx, SEED, shapes=SHAPES[:1], workspace=ws)
    problems, big = [], None
    try:
        n = 4
        x, idx, w = small.inputs(*silent_rows.step_inputs(SEED, 0, 0, small.rank, n, small.defs[0], True))
        small.layers[0].forward(x, topk_idx=idx, topk_weights=w, graph_cache=False)  # warm-up, eager
        torch.cuda.synchronize()
        graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
        for graph in graphs:
            with ws.step(n, own_router=False):
                # A raw capture, not Workspace.capture; thread_local as symmring's own captures (graph_cache.
                # CAPTURE_ERROR_MODE: in global mode another thread's CUDA call invalidated it on some PEs).
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    small.layers[0].forward(x, topk_idx=idx, topk_weights=w)
        ws.set_call_tokens(n)
        ws.replay(graphs[0])  # the memory it addresses is current; graphs[1] is never replayed before the growth
        torch.cuda.synchronize()
        epoch = ws.epoch
        big = GpuLayers(ctx, SEED + 1, shapes=((2048, 1024, 4),), workspace=ws)  # makes the memory anew
        if ws.epoch == epoch:
            problems.append("the larger layer did not grow the workspace (the test needs a growth)")
        for which, graph in enumerate(graphs):
            try:
                ws.replay(graph)
                problems.append(f"graph {which}: a graph of freed memory replayed")
            except ConfigError as exc:
                if "grew" not in str(exc):
                    problems.append(f"graph {which}: named {exc}")
    finally:
        for layers in (big, small):
            if layers is not None:
                for layer in layers.layers:
                    layer.close()
        ws.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_reset_inside_a_step_leaves_no_stale_latch(ctx):
    a = GpuLayers(ctx, SEED, shapes=SHAPES[:1])
    n, problems = 4, []
    try:
        with a.ws.step(n, own_router=False):
            if a.rank == a.world - 1:
                raise_own_abort(a, 0)
            ctx.comm.Barrier()
            a.call(0, *silent_rows.step_inputs(SEED, 0, 0, a.rank, n, a.defs[0], True))
            torch.cuda.synchronize()
            if a.layers[0].async_error() is None and a.world == 1:
                problems.append("no latched error after the fault")
            a.ws.reset()  # inside the step, on every PE
            y = a.call(0, *silent_rows.step_inputs(SEED, 1, 0, a.rank, n, a.defs[0], True))
            if not rows_ok(a, 0, 1, n, y):
                problems.append("the call after the in-step reset was wrong")
        with a.ws.step(n, own_router=False):  # nothing latched, nothing failed: the next step opens
            y = a.call(0, *silent_rows.step_inputs(SEED, 2, 0, a.rank, n, a.defs[0], True))
            if not rows_ok(a, 0, 2, n, y):
                problems.append("the next step was wrong")
    except SymmringError as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        a.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_outside_a_step_refusals_and_mismatches_raise_on_every_pe(ctx):
    a = GpuLayers(ctx, SEED)
    n, problems, last = 4, [], ctx.world_size - 1
    try:
        x, idx, w = silent_rows.step_inputs(SEED, 0, 0, a.rank, n, a.defs[0], True)
        # The last PE passes a bad argument: every PE raises in the same exchange, nothing is enqueued.
        try:
            if a.rank == last:
                a.call(0, x, idx, w, streaming="always")
            else:
                a.call(0, x, idx, w)
            problems.append("a call ran while a PE refused it")
        except ConfigError as exc:
            if "streaming='always'" not in str(exc):
                problems.append(f"named {exc}")
        if not rows_ok(a, 0, 0, n, a.call(0, x, idx, w)):
            problems.append("the call after the refusal was wrong")
        if ctx.world_size > 1:  # PE 0 calls B, the others A: a CallMismatch everywhere, before anything runs
            layer = 1 if a.rank == 0 else 0
            try:
                a.call(layer, *silent_rows.step_inputs(SEED, 1, layer, a.rank, n, a.defs[layer], True))
                problems.append("calls of different layers paired")
            except CallMismatch as exc:
                if {exc.expected_layer, exc.observed_layer} != {a.layers[0].layer_id, a.layers[1].layer_id}:
                    problems.append(f"named {exc}")
        if not rows_ok(a, 1, 2, n, a.call(1, *silent_rows.step_inputs(SEED, 2, 1, a.rank, n, a.defs[1], True))):
            problems.append("the call after the mismatch was wrong")
    except (SymmringError, StepFailed) as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        a.close()
    verdict(ctx, not problems, "; ".join(problems))
