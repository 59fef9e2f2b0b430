"""Issue 33 on the CPU layer: every row a rank gets back is right, or every rank raises.

* the measured defect, inside a `symmring.Workspace.step`: rank 0's call of layer A is refused (one token more
  than the step declared), rank 0 catches it and calls layer B; the others call A then B. Every rank raises a
  named error in that step or at the next step's entry, no rank keeps wrong rows without one, and after
  `Workspace.reset` a step is right (A and B of one shape, sharing a ring; and of two shapes);
* outside a step a rank that skipped a call makes every rank raise a `CallMismatch` in the call's exchange,
  before any ring work; ranks whose counts of calls differ keep raising until `reset`;
* an exception that leaves a step on one rank fails the next step's entry on every rank (`StepFailed`);
* the soak (3 ranks; ``SYMMRING_SOAK_STEPS``, default 200): random per-rank counts, zero included, with a refused
  call, a stalled rank and a late host injected; it prints the counts and requires zero silent wrong rows.

Run: ``mpiexec -n 3 python -m mpi4py -m pytest tests/mpi/test_no_silent_rows.py -q -p no:cacheprovider -s``.
On the code before issue 33 the reproduction returns wrong rows without an error on every rank (the refused
rank's B paired with the others' A on the shared ring: the same generations, no identity to tell them apart).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: silent_rows
import silent_rows  # noqa: E402
from exchanges import ExchangeCounter  # noqa: E402

from symmring.errors import CallMismatch, StepFailed, SymmringError  # noqa: E402
from symmring import Experts, MoE, RoutingConfig, ScheduleConfig, shard_experts  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402

NUM_EXPERTS = 12  # an even split over 1, 2, 3 or 4 ranks
#: Layers (hidden, inter, top-k): A and B share a ring, C has its own.
SHAPES = ((128, 32, 2), (128, 32, 2), (256, 32, 3))
MAX_TOKENS = 16
#: The rings' wait bound (the CPU layer's "device" bound); the host exchanges keep the context's (60 s in CI).
RING_TIMEOUT_S = 2.0


class CpuLayers(silent_rows.Adapter):
    """The layers of `SHAPES` on a fresh workspace, this rank's experts of seeded weights."""

    x_format, rtol, bf16, device_bound_s = "fp8_e4m3", 1e-4, False, RING_TIMEOUT_S

    def __init__(self, ctx, seed: int):
        self.rank, self.world, self.max_tokens = ctx.rank, ctx.world_size, MAX_TOKENS
        self.ws = Workspace(ctx, max_tokens=MAX_TOKENS)
        self.defs = silent_rows.make_layer_defs(seed, SHAPES, NUM_EXPERTS, bf16=False)
        schedule = ScheduleConfig(x_format=self.x_format, timeout_s=RING_TIMEOUT_S)
        self.layers = [MoE(ctx, Experts(*shard_experts(d.w_gate, d.w_up, d.w_down, self.rank, self.world)),
                           RoutingConfig(NUM_EXPERTS, d.topk), max_tokens=MAX_TOKENS, schedule=schedule,
                           workspace=self.ws)
                       for d in self.defs]

    def forward(self, layer, x, idx, weights, *, streaming=False, stall_s=0.0):
        if stall_s:
            time.sleep(stall_s)  # this rank's host stalls: the others' ring waits pass their bound
        return self.layers[layer].forward(x, topk_idx=idx, topk_weights=weights)

    def close(self):
        for layer in self.layers:
            layer.close()
        self.ws.close()


def need_ranks(comm, n: int = 2) -> None:
    if comm.Get_size() < n:
        pytest.skip(f"needs {n} or more ranks (mpiexec -n 3)")


def on_layers(ctx, comm, seed, outcome, check, body) -> None:
    """Run ``body(layers, problems)`` on a fresh `CpuLayers` (closed after), then the collective verdict."""
    layers, problems = CpuLayers(ctx, seed), []
    try:
        outcome.run(body, layers, problems)
    finally:
        layers.close()
    check(comm, not outcome.error and not problems, outcome.error + "; ".join(problems))


@pytest.mark.mpi
@pytest.mark.parametrize("second", [1, 2], ids=["same_ring", "other_ring"])
def test_refused_call_in_a_step_raises_on_every_rank(ctx, comm, seed, outcome, check, figure, second):
    need_ranks(comm)
    layers = CpuLayers(ctx, seed)
    start = time.monotonic()
    try:
        problems = outcome.run(silent_rows.refused_then_next, layers, seed=seed, culprit=0, first=0, second=second,
                               n=5, allgather=comm.allgather)
    finally:
        layers.close()
    figure(f"no_silent_rows[cpu refused, {'same' if second == 1 else 'other'} ring]: ranks={comm.Get_size()}: "
           f"problems {len(problems or [])}, {time.monotonic() - start:.1f} s")
    check(comm, not outcome.error and not problems, outcome.error + "\n".join(problems or []))


@pytest.mark.mpi
@pytest.mark.parametrize("second", [1, 2], ids=["same_ring", "other_ring"])
def test_refused_call_in_a_step_of_given_counts_raises_on_every_rank(ctx, comm, seed, outcome, check, figure, second):
    """The measured defect in steps whose counts the caller gives (``Workspace.step(counts=...)``, as vLLM's): no
    exchange at any entry, yet every rank raises in the step (the call identity in the meta rows, the rings'
    bounded waits) or at the next entry (its own failure), and none keeps wrong rows."""
    need_ranks(comm)
    layers = CpuLayers(ctx, seed)
    start = time.monotonic()
    try:
        # The CPU layer makes a shape's ring and its combine rows at its first call (collective allocations):
        # one step of every layer first, as a server warms up.
        silent_rows.run_step(layers, seed, 0, [MAX_TOKENS] * comm.Get_size(), None, given=True)
        with ExchangeCounter(ctx) as counter:
            problems = outcome.run(silent_rows.refused_then_next, layers, seed=seed, culprit=0, first=0,
                                   second=second, n=5, allgather=comm.allgather, given=True)
    finally:
        layers.close()
    exchanges = [what for what in counter.what if not what.startswith("Workspace.reset")]  # the reset's barriers
    figure(f"no_silent_rows[cpu refused, counts given, {'same' if second == 1 else 'other'} ring]: "
           f"ranks={comm.Get_size()}: problems {len(problems or [])}, host exchanges besides the reset "
           f"{len(exchanges)}, {time.monotonic() - start:.1f} s")
    check(comm, not outcome.error and not problems and not exchanges,
          outcome.error + "\n".join(problems or []) + f" exchanges {exchanges}")


@pytest.mark.mpi
def test_call_skipped_outside_a_step_raises_on_every_rank(ctx, comm, seed, outcome, check):
    need_ranks(comm)
    rank = comm.Get_rank()

    def call(layers, li, step):
        x, idx, w = silent_rows.step_inputs(seed, step, li, rank, 4, layers.defs[li], False)
        y = layers.forward(li, x, idx, w)
        return silent_rows.wrong_rows(y, layers.reference(li, x, idx, w), layers.rtol)

    def body(layers, problems):
        call(layers, 0, 0)  # every rank: layer A, agreed
        # Rank 0 skips B and calls C; the others call B: the exchange names the layers, every rank raises.
        try:
            call(layers, 2 if rank == 0 else 1, 1)
            problems.append("a call of another layer than the other ranks' ran")
        except CallMismatch as exc:
            mine, theirs = (layers.layers[2], layers.layers[1]) if rank == 0 else (layers.layers[1], layers.layers[2])
            if (exc.expected_layer, exc.observed_layer, exc.peer == 0 or rank == 0) != \
                    (mine.layer_id, theirs.layer_id, True):
                problems.append(f"named {exc}")
        # Every rank calls C now: the same call number (a mismatched call counts nowhere), right rows.
        if call(layers, 2, 2):
            problems.append("wrong rows after the mismatch")
        # Rank 0 makes one call more (alone it cannot: any call is collective): emulate a rank whose count ran
        # ahead (a call the others never saw) -- every later call is refused on every rank until reset.
        if rank == 0:
            layers.ws.calls += 1
        for attempt in range(2):
            try:
                call(layers, 0, 3 + attempt)
                problems.append(f"attempt {attempt}: a call at diverged counts ran")
            except CallMismatch:
                pass
        layers.ws.reset()
        if call(layers, 0, 5) or call(layers, 1, 6):
            problems.append("wrong rows after reset")

    on_layers(ctx, comm, seed, outcome, check, body)


@pytest.mark.mpi
def test_exception_leaving_a_step_fails_the_next_on_every_rank(ctx, comm, seed, outcome, check):
    need_ranks(comm)
    rank = comm.Get_rank()

    def body(layers, problems):
        try:
            with layers.ws.step(4, own_router=False):
                x, idx, w = silent_rows.step_inputs(seed, 0, 0, rank, 4, layers.defs[0], False)
                layers.forward(0, x, idx, w)
                if rank == comm.Get_size() - 1:
                    raise RuntimeError("the model failed after layer A")
        except RuntimeError:
            pass
        for _ in range(2):  # raised at every entry until reset, on every rank
            try:
                with layers.ws.step(4, own_router=False):
                    problems.append("the next step opened")
            except StepFailed as exc:
                if "the model failed after layer A" not in str(exc) and "failed earlier" not in str(exc):
                    problems.append(f"named {exc}")
        try:  # outside a step the workspace refuses too, on every rank in the same exchange
            x, idx, w = silent_rows.step_inputs(seed, 1, 1, rank, 4, layers.defs[1], False)
            layers.forward(1, x, idx, w)
            problems.append("a call ran on a failed workspace")
        except SymmringError as exc:  # the failing rank's own BrokenStateError; a ConfigError naming it elsewhere
            if "step failed" not in str(exc):
                problems.append(f"refused with {type(exc).__name__}: {exc}")
        layers.ws.reset()
        right = silent_rows.run_step(layers, seed, 2, [4] * comm.Get_size(), None)
        if right.entry_raised or right.body_raised or right.wrong:
            problems.append(f"after reset: {right.errors[:2]}, {right.wrong} wrong rows")

    on_layers(ctx, comm, seed, outcome, check, body)


@pytest.mark.mpi
def test_soak_with_faults_returns_no_silent_wrong_row(ctx, comm, seed, outcome, check, figure):
    if comm.Get_size() != 3:
        pytest.skip("the CPU soak runs at 3 ranks (mpiexec -n 3)")
    steps = int(os.environ.get("SYMMRING_SOAK_STEPS", 200))
    layers = CpuLayers(ctx, seed)
    start = time.monotonic()
    try:
        result = outcome.run(silent_rows.soak, layers, seed=seed, steps=steps, fault_every=20,
                             warmup_counts=[MAX_TOKENS, 1, 0], allgather=comm.allgather)
    finally:
        layers.close()
    if result is not None:
        figure(result.line(f"no_silent_rows[cpu soak, {comm.Get_size()} ranks, {time.monotonic() - start:.0f} s]"))
    ok = result is not None and result.silent_wrong_rows == result.finite_wrong_rows == 0 and not result.problems and \
        result.raised_everywhere["refused"] == result.faults["refused"] and \
        result.raised_everywhere["stall"] == result.faults["stall"] and \
        result.late_absorbed == result.faults["late_host"] and result.right_after_reset == result.resets and \
        all(result.faults.values())
    check(comm, ok, outcome.error + (result.line("soak") + "\n" + "\n".join(result.problems[:10]) if result else ""))
