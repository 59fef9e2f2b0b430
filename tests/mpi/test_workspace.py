"""Layers of a model on one `symmring.Workspace` (CPU backend): shapes mixed, a pool far below the worst
routing, and memory that does not grow with the number of layers.

Run under ``mpiexec -n 3 python -m mpi4py -m pytest tests/mpi/test_workspace.py -q -p no:cacheprovider``
(``tests/test_under_mpi.py`` runs every file of ``tests/mpi`` with 2, 3 and 4 ranks; a plain pytest run is a
world of 1). Every rank builds the same global problem from the shared seed and checks its rows against
`reference_moe`; verdicts are collective.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from symmring import Experts, MoE, RoutingConfig, ScheduleConfig, shard_experts
from symmring.moe.reference import reference_moe
from symmring.moe.workspace import Workspace
from symmring.moe.workspace_plan import REGIONS

NUM_EXPERTS = 12  # an even split over 1, 2, 3 or 4 ranks
#: Two layer shapes: (hidden, inter, top-k).
SHAPES = ((256, 32, 2), (128, 64, 3))
#: The references' dispatch format (reference_moe's default).
FP8 = ScheduleConfig(x_format="fp8_e4m3")


def layer_problem(rng, world: int, hidden: int, inter: int, topk: int, counts, worst: bool):
    """Weights, tokens and routing of one layer, identical on every rank. ``worst``: every (token, k) of every
    rank goes to experts of rank 0 (the first ``topk`` experts), the most rows any pool can receive."""
    total = sum(counts)
    x = rng.standard_normal((total, hidden), dtype=np.float32)
    w = [(rng.standard_normal(s) / math.sqrt(s[-1])).astype(np.float32)
         for s in ((NUM_EXPERTS, inter, hidden), (NUM_EXPERTS, inter, hidden), (NUM_EXPERTS, hidden, inter))]
    if worst:
        idx = np.tile(np.arange(topk, dtype=np.int32), (total, 1))  # experts 0..topk-1: all on rank 0
    else:
        idx = np.stack([rng.permutation(NUM_EXPERTS)[:topk] for _ in range(total)]).astype(np.int32)
        idx = idx.reshape(total, topk)
    weights = rng.random((total, topk), dtype=np.float32)
    return x, w, idx, weights


def run_layers(ctx, comm, seed: int, num_layers: int, workspace: Workspace, worst: bool):
    """Build ``num_layers`` layers (the two shapes alternating) on ``workspace``, run each once; return the
    errors against the reference and the pool passes this rank ran."""
    world, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(5, 20, world)]
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    layers, problems, errors, passes = [], [], [], 0
    for i in range(num_layers):
        hidden, inter, topk = SHAPES[i % len(SHAPES)]
        x, w, idx, weights = layer_problem(rng, world, hidden, inter, topk, counts, worst)
        layers.append(MoE(ctx, Experts(*shard_experts(*w, rank, world)), RoutingConfig(NUM_EXPERTS, topk),
                          max_tokens=32, schedule=FP8, workspace=workspace))
        problems.append((x, w, idx, weights, topk))
    for i, (layer, (x, w, idx, weights, topk)) in enumerate(zip(layers, problems)):
        y = layer.forward(x[lo:hi], topk_idx=idx[lo:hi], topk_weights=weights[lo:hi])
        passes += layer.last_stats.passes
        ref = reference_moe(x, num_topk=topk, w_gate=w[0], w_up=w[1], w_down=w[2], topk_idx=idx, topk_weights=weights)
        try:
            np.testing.assert_allclose(y, ref.y[lo:hi], rtol=1e-5, atol=1e-5 * float(np.abs(ref.y).max()))
        except AssertionError as exc:
            errors.append(f"layer {i}: {exc}")
    return layers, errors, passes, counts


@pytest.mark.mpi
def test_two_shapes_worst_routing_small_pool(ctx, comm, seed, outcome, check, figure):
    """Two layers of different shapes on one workspace whose pool (8 rows) is far below the worst routing
    (every token of every rank on rank 0's experts): every output matches the reference, rank 0 ran many
    passes, and the other ranks' pools stayed empty."""
    workspace = Workspace(ctx, pool_rows=8)

    def body():
        layers, errors, passes, counts = run_layers(ctx, comm, seed, 2, workspace, worst=True)
        entries = sum(counts) * sum(topk for _, _, topk in SHAPES)
        if comm.Get_rank() == 0 and passes < entries // 8:
            errors.append(f"rank 0 ran {passes} passes for {entries} rows through an 8-row pool")
        if comm.Get_rank() != 0 and passes != 0:
            errors.append(f"rank {comm.Get_rank()} owns no routed expert but ran {passes} passes")
        return errors, passes, counts

    errors, passes, counts = outcome.run(body) or ([], 0, None)
    errors = ([outcome.error] if outcome.error else []) + errors
    figure(f"workspace[worst routing]: ranks={comm.Get_size()} tokens={counts} pool 8 rows: rank 0 passes "
           f"{comm.bcast(passes, root=0)}, outputs vs reference {'ok' if not errors else 'FAIL'}")
    workspace.close()
    check(comm, not errors, "\n".join(errors))


@pytest.mark.mpi
def test_workspace_bytes_do_not_grow_with_layers(ctx, comm, seed, outcome, check, figure):
    """2 and 8 layers (the same two shapes) on a budgeted workspace: the same bytes in every region, and
    every output matches the reference (uniform routing)."""
    figures = {}
    errors = []
    for num_layers in (2, 8):
        workspace = Workspace(ctx, max_tokens=32, budget=1 << 20)

        def body(ws=workspace, n=num_layers):
            _, errs, _, _ = run_layers(ctx, comm, seed, n, ws, worst=False)
            return errs, ws.memory()

        errs, memory = outcome.run(body) or ([], {})
        errors += ([outcome.error] if outcome.error else []) + errs
        figures[num_layers] = memory
        workspace.close()
    if figures.get(2) != figures.get(8):
        errors.append(f"workspace bytes differ: 2 layers {figures.get(2)}, 8 layers {figures.get(8)}")
    if figures.get(2) and set(figures[2]) != set(REGIONS) | {"total"}:
        errors.append(f"memory() regions {sorted(figures[2])}, expected {sorted(REGIONS)} + total")
    figure(f"workspace[layers]: ranks={comm.Get_size()} 2 layers {figures.get(2, {}).get('total')} bytes, "
           f"8 layers {figures.get(8, {}).get('total')} bytes")
    check(comm, not errors, "\n".join(errors))


@pytest.mark.mpi
def test_layers_default_to_the_context_workspace(ctx, comm, seed, outcome, check):
    """Layers built without ``workspace=`` share ``ctx.workspace()``; its combine generations keep growing
    across the layers' calls."""
    def body():
        world, rank = comm.Get_size(), comm.Get_rank()
        rng = np.random.default_rng(seed)
        w = [(rng.standard_normal(s) / 8).astype(np.float32) for s in ((NUM_EXPERTS, 16, 128),) * 2
             + ((NUM_EXPERTS, 128, 16),)]
        a, b = (MoE(ctx, Experts(*shard_experts(*w, rank, world)), RoutingConfig(NUM_EXPERTS, 2), max_tokens=8)
                for _ in range(2))
        errs = [] if a.workspace is b.workspace is ctx.workspace() else ["layers do not share ctx.workspace()"]
        x = rng.standard_normal((4, 128), dtype=np.float32)
        router = rng.standard_normal((NUM_EXPERTS, 128), dtype=np.float32)
        base = ctx.workspace().host.combine_base
        ya, yb = a.forward(x, router_weight=router), b.forward(x, router_weight=router)
        if not np.array_equal(ya, yb):
            errs.append("two layers of the same weights disagree")
        if ctx.workspace().host.combine_base != base + 2:
            errs.append(f"combine base {base} -> {ctx.workspace().host.combine_base}, expected +2 over two calls")
        return errs

    errors = outcome.run(body) or []
    check(comm, not outcome.error and not errors, outcome.error + "\n".join(errors))


def test_pool_passes_reduce_to_one_with_a_large_pool(ctx, comm, seed):
    """Not collective-sensitive: a world of one with a pool larger than the call's rows runs one pass per
    chunk (the common case pays nothing for the budget)."""
    if comm.Get_size() != 1:
        pytest.skip("a world of one (the passes of one rank are the call's rows)")
    workspace = Workspace(ctx, pool_rows=10_000)
    _, errors, passes, _ = run_layers(ctx, comm, seed, 2, workspace, worst=False)
    workspace.close()
    assert not errors and passes == 2


@pytest.mark.mpi
def test_a_step_exchanges_once_for_every_layer(ctx, comm, check):
    """`Workspace.step`: one exchange of every rank's count (uneven), the bucket every rank plans for, the
    routing declaration; a nested step and bad arguments are refused before any exchange."""
    from symmring.errors import ConfigError
    from symmring.moe.gpu.plan import token_bucket
    world, rank = comm.Get_size(), comm.Get_rank()
    workspace = Workspace(ctx)
    errors = []
    before = ctx.collectives._sequence
    with workspace.step(3 + 5 * rank) as step:
        if step.counts != tuple(3 + 5 * r for r in range(world)):
            errors.append(f"counts {step.counts}")
        if step.bucket(4096) != token_bucket(3 + 5 * (world - 1), 4096) or not step.distinct:
            errors.append(f"bucket {step.bucket(4096)}, distinct {step.distinct}")
        if workspace.active_step is not step or ctx.collectives._sequence - before != (world > 1):
            errors.append(f"{ctx.collectives._sequence - before} exchanges for one step")
        with pytest.raises(ConfigError, match="already open"):
            with workspace.step(1):
                pass
    if workspace.active_step is not None:
        errors.append("the step stayed open")
    with workspace.step(0, own_router=rank != 0) as step:
        if step.distinct or step.bucket(64) != 0:
            errors.append(f"declared routing {step.distinct}, bucket {step.bucket(64)}")
    for bad, what in (({"num_tokens": -1}, "num_tokens"), ({"num_tokens": 1, "own_router": 1}, "own_router")):
        with pytest.raises(ConfigError, match=what):
            with workspace.step(**bad):
                pass
    workspace.close()
    check(comm, not errors, "; ".join(errors))


@pytest.mark.mpi
def test_a_step_of_given_counts_exchanges_nothing_and_raises_only_its_own_failure(ctx, comm, check):
    """`Workspace.step(counts=...)`: the given counts, no exchange (bad counts refused before anything); at its
    entry a rank raises its own failed step and nothing of another rank's (that reaches it through the ring, in
    its calls: tests/mpi/test_no_silent_rows.py, tests/mpi/test_vllm_adapter_mpi.py); until `reset`."""
    from symmring.errors import ConfigError, StepFailed
    world, rank = comm.Get_size(), comm.Get_rank()
    counts = [2 + 3 * r for r in range(world)]
    workspace = Workspace(ctx)
    errors = []
    before = ctx.collectives._sequence
    with workspace.step(counts[rank], own_router=rank != 0, counts=counts) as step:
        if step.counts != tuple(counts) or step.distinct != (rank != 0):
            errors.append(f"counts {step.counts}, distinct {step.distinct}")
    for bad, what in (([1] * (world + 1), "one token count per rank"), ([-1] * world, "num_tokens=-1"),
                      ([c + 1 for c in counts], f"rank {rank}'s count {counts[rank] + 1}")):
        with pytest.raises(ConfigError, match=what):
            with workspace.step(counts[rank], counts=bad):
                pass
    culprit = world - 1
    try:
        with workspace.step(counts[rank], counts=counts):
            if rank == culprit:
                raise RuntimeError("the model failed here")
    except RuntimeError:
        pass
    for _ in range(2):  # the culprit at every entry until reset; nobody else (nothing was exchanged)
        try:
            with workspace.step(counts[rank], counts=counts):
                if rank == culprit:
                    errors.append("the culprit's next step opened")
        except StepFailed as exc:
            if rank != culprit or exc.failures.keys() != {culprit} or "the model failed here" not in str(exc):
                errors.append(f"rank {rank} raised {exc}")
    if ctx.collectives._sequence != before:
        errors.append(f"{ctx.collectives._sequence - before} exchanges in steps of given counts")
    workspace.reset()
    with workspace.step(counts[rank], counts=counts):
        pass
    workspace.close()
    check(comm, not errors, "; ".join(errors))
