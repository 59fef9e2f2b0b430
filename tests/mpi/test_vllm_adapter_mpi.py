"""The symmring side of the vLLM integration over several ranks (host backend), without vLLM: every rank runs
`symmring.integrations.vllm.adapter.GivenRoutingLayer` on its own tokens with routing and every rank's counts
given, as vLLM's experts class does, and checks its rows against the definition (tests/vllm_problem.py).

* its rows (bf16; fp8 blocks dequantised; a rank with no tokens) against the definition;
* a vLLM step (every MoE layer's call, counts given: ``Workspace.step(counts=...)``) makes zero host exchanges;
* a fault on one rank in a step of given counts -- a call refused there (x of another width), a call
  skipped there (its call sequence diverges), a stalled host (past the rings' bound) -- raises a named error on
  every rank within that step or the next one, and no rank keeps wrong rows without one; after
  `Workspace.reset` a step is right again. Nothing was exchanged at the steps' entries: the other ranks learn
  of the fault through the ring (the call identity in the meta rows, the rings' bounded waits).

    mpiexec -n 2 python -m mpi4py -m pytest tests/mpi/test_vllm_adapter_mpi.py -q -p no:cacheprovider

(tests/test_under_mpi.py runs it with 2, 3 and 4 ranks, tests/test_under_torchrun.py with 2 and 3 under torchrun.)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: vllm_problem

from symmring.errors import ConfigError  # noqa: E402
from symmring.integrations.vllm import adapter  # noqa: E402
from symmring.moe.config import ScheduleConfig  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402
import vllm_problem  # noqa: E402
from vllm_problem import FAULTS, ExchangeCounter, fault_step, fault_verdict, make_problem, reference  # noqa: E402

NUM_EXPERTS, HIDDEN, INTER, TOPK = 12, 128, 128, 3
#: The rings' wait bound in the fault tests (the CPU layer's "device" bound); the host exchanges keep the
#: context's.
RING_TIMEOUT_S = 2.0


def build(ctx, problem, fp8=False, max_tokens=48, **kwargs):
    w13, w2, s13, s2 = problem.local(ctx.rank, ctx.world_size)
    experts = adapter.experts_from_vllm(w13, w2, w13_scale=s13, w2_scale=s2, dequantize=fp8)
    return adapter.GivenRoutingLayer(ctx, experts, num_experts=NUM_EXPERTS, topk=TOPK, max_tokens=max_tokens,
                                     **kwargs)


def counts_for(world, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 40, (world,), generator=g).tolist()
    if world > 1:
        counts[seed % world] = 0  # one rank with no tokens still takes part in every call
    return counts


def steps_problem(seed: int, counts):
    return vllm_problem.steps_problem(seed, counts, num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, topk=TOPK)


def close_enough(y, want) -> bool:
    if y is None or tuple(y.shape) != tuple(want.shape):
        return False
    if not want.numel():
        return True
    return (y.float() - want).abs().max().item() <= 2e-2 + 2e-2 * want.abs().max().item()


@pytest.mark.mpi
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_given_routing_and_counts_match_the_definition(ctx, comm, seed, fp8, outcome, check):
    counts = counts_for(ctx.world_size, seed)
    problem = make_problem(seed, counts, num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, topk=TOPK, fp8=fp8)
    rank = ctx.rank
    layer = build(ctx, problem, fp8)
    try:
        y = outcome.run(layer, problem.x[rank], problem.topk_ids[rank], problem.topk_weights[rank], counts)
    finally:
        layer.close()
    ok = close_enough(y, reference(problem, rank))
    check(comm, ok, outcome.error or f"rows differ from the definition (counts {counts})")


@pytest.mark.mpi
def test_a_vllm_step_makes_no_host_exchange(ctx, comm, seed, outcome, check, figure):
    """Two MoE layers called as vLLM calls them in three model steps of different counts (every rank's given):
    zero host exchanges, right rows."""
    counts = [counts_for(ctx.world_size, seed + s) for s in range(3)]
    problems = [steps_problem(seed + li, counts) for li in range(2)]
    ws = Workspace(ctx, max_tokens=48)
    layers = [build(ctx, p, workspace=ws) for p in problems]
    rank, wrong = ctx.rank, []

    def steps():
        for s, step_counts in enumerate(counts):
            for li, layer in enumerate(layers):
                p, i = problems[li], s * ctx.world_size + rank
                y = layer(p.x[i], p.topk_ids[i], p.topk_weights[i], step_counts)
                if not close_enough(y, reference(p, i)):
                    wrong.append((s, li))

    try:
        with ExchangeCounter(ctx) as counter:
            outcome.run(steps)
    finally:
        for layer in layers:
            layer.close()
        ws.close()
    figure(f"vllm_adapter[host exchanges of 3 model steps x 2 MoE layers, counts given]: ranks={ctx.world_size}: "
           f"{counter.count}")
    check(comm, not outcome.error and counter.count == 0 and not wrong,
          outcome.error or f"{counter.count} host exchanges ({counter.what}); wrong rows in (step, layer) {wrong}")


@pytest.mark.mpi
def test_counts_that_do_not_hold_this_ranks_tokens_are_refused_before_any_exchange(ctx, comm, seed, outcome, check):
    problem = make_problem(seed, [4] * ctx.world_size, num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER,
                           topk=TOPK)
    layer = build(ctx, problem)
    rank = ctx.rank
    try:
        with ExchangeCounter(ctx) as counter:
            outcome.run(layer, problem.x[rank], problem.topk_ids[rank], problem.topk_weights[rank],
                        [3] * ctx.world_size)
    finally:
        layer.close()
    ok = isinstance(outcome.exception, ConfigError) and "more than this rank's count 3" in str(outcome.exception)
    check(comm, ok and counter.count == 0, outcome.error or "no ConfigError")


# --- a fault on one rank, counts given ---------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_on_one_rank_in_a_given_counts_step_raises_on_every_rank(ctx, comm, seed, outcome, check, figure,
                                                                           fault):
    """Steps 0 (clean), 1 (the fault on the last rank's call of layer A, `vllm_problem.fault_step`) and 2 (clean),
    counts given: every rank raises in step 1 or 2, no rank keeps wrong rows from a call that did not raise,
    nothing is exchanged; then every rank resets the workspace and step 3 is right everywhere."""
    if ctx.world_size < 2:
        pytest.skip("needs 2 or more ranks (mpiexec -n 2)")
    world, rank, culprit = ctx.world_size, ctx.rank, ctx.world_size - 1
    counts = [[4 + (s + r) % 3 for r in range(world)] for s in range(4)]
    problems = [steps_problem(seed + li, counts) for li in range(2)]
    ws = Workspace(ctx, max_tokens=8)
    schedule = ScheduleConfig(timeout_s=RING_TIMEOUT_S)
    layers = [build(ctx, p, max_tokens=8, workspace=ws, schedule=schedule) for p in problems]
    start = time.monotonic()

    def step(s, fault_here=None):
        return fault_step(layers, problems, s, counts[s], rank=rank, world=world, fault=fault_here, culprit=culprit,
                          stall_s=2 * RING_TIMEOUT_S)

    def body():
        with ExchangeCounter(ctx) as counter:
            records = [step(s, fault if s == 1 else None) for s in range(3)]
        ws.reset()  # collective: every rank, once it is out of its calls
        return records, step(3), counter.count

    try:
        result = outcome.run(body)
    finally:
        for layer in layers:
            layer.close()
        ws.close()
    found = []
    if result is not None:
        records, after, exchanges = result
        found = fault_verdict(records, after) + ([f"{exchanges} host exchanges in the three steps"] if exchanges
                                                  else [])
        figure(f"vllm_adapter[fault {fault} on rank {culprit}, counts given]: ranks={world}: rank {rank} raised "
               f"{len(records[1]['errors'])} in the step, {len(records[2]['errors'])} in the next "
               f"({(records[1]['errors'] + records[2]['errors'])[:1]}), finite wrong rows "
               f"{sum(r['finite_wrong'] for r in records)}, {time.monotonic() - start:.1f} s")
    check(comm, not outcome.error and not found,
          outcome.error + "; ".join(found) + (f" (records {result[0]})" if result else ""))
