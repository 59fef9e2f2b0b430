"""Bounded writes of the GPU MoE layer (issue 33, items 3-5): every device write stays inside its buffer, an
overflow is a named error on every rank, and memory stays where the plan put it.

* A plan that bounds fewer rows than the call brings (a rank whose call sequence shifted plans another token
  bucket; forced here on the last rank by wrapping its layer's plans) ends in `PoolOverflow` on that rank and
  `ProtocolAborted` naming it (``pool_overflow``) on every other, the call's output NaN on every rank; no row
  past the window's pool rows is written (canary rows after them, checked bitwise) in the small-batch schedule,
  the general fp8 and the general bf16 one; after `MoE.reset` the layer is bitwise right again.
* A pool row whose group id names no local expert (a stale id) is skipped by the expert GEMMs, reported by
  `MoE.check_errors` (`BackendError`) on every rank, and changes no output row.
* The window's entry map growing for a later layer's larger ring (an own schedule) while a call is queued
  and graphs are cached or captured: the queued call is bitwise right, the old map is never written again
  (canary), the cached graphs are captured anew (bitwise right) and a `CapturedCall` of before refuses to
  replay (the workspace's epoch moved).
* 10,000 cached calls with random counts over several buckets and a 2-graph cache (captures and evictions
  all along; split-K GEMMs): ``torch.cuda.memory_allocated()``, the split-K counters and the workspace's bytes
  are the same after 1,000 and after 10,000 calls (printed as ``[figure]`` lines).

Several PEs: ``python -m symmring.launch -n 3 --mps -- python -m mpi4py -m pytest tests/gpu/test_moe_bounds.py``.
"""

from __future__ import annotations

import dataclasses
import gc
import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import cuda_device as dev, make_tokens, make_weights, to_torch, verdict  # noqa: E402

from symmring import Workspace  # noqa: E402
from symmring.errors import BackendError, ConfigError, PoolOverflow, ProtocolAborted  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261233))
HIDDEN, INTER, NUM_EXPERTS, TOPK = 256, 256, 24, 4  # 24 experts: an even split over 1, 2 or 3 ranks
#: Canary patterns of the rows past the window's pool (int32 words; m_indices: an id no dispatch writes).
CANARY, CANARY_GROUP = 0x5A5A5A5A, -77


def layer(ctx, workspace, engine, max_tokens=64, hidden=HIDDEN, inter=INTER, num_experts=NUM_EXPERTS, **schedule):
    if engine != "torch":
        pytest.importorskip("triton", reason="the fp8 engines need Triton")
    w_gate, w_up, w_down, _ = make_weights(SEED, num_experts, hidden, inter)
    e = num_experts // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    experts = Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down)),
                      expert_dtype="bf16" if engine == "torch" else "fp8")
    return MoE(ctx, experts, RoutingConfig(num_experts, TOPK), max_tokens=max_tokens,
               schedule=ScheduleConfig(**schedule), engine=engine, workspace=workspace)


def router_of(hidden=HIDDEN, num_experts=NUM_EXPERTS):
    return to_torch(make_weights(SEED, num_experts, hidden, INTER)[3], torch.bfloat16, dev())


def tokens(ctx, n, seed, hidden=HIDDEN):
    return to_torch(make_tokens(seed + 31 * ctx.rank, n, hidden), torch.bfloat16, dev())


def shrink_plans(moe, monkeypatch, rows: int, rows_per_expert: int) -> None:
    """This rank's layer plans every window with ``rows`` pool rows in one pass and ``rows_per_expert`` rows
    per expert: a plan made for fewer tokens than the call brings (a test hook; no public API)."""
    real = moe.planner.plan

    def plan(*args, **kwargs):
        p = real(*args, **kwargs)
        windows = {first: dataclasses.replace(w, rows_bound=rows, rows_per_expert=rows_per_expert,
                                              passes=((0, rows),)) for first, w in p.windows.items()}
        return dataclasses.replace(p, windows=windows)
    monkeypatch.setattr(moe.planner, "plan", plan)


def _canary_views(state, first: int):
    """The rows ``[first, capacity)`` of every buffer a dispatch writes by pool row, as int32 words."""
    return [state.pool_x[first:].view(torch.uint8).view(torch.int32), state.row_src[first:],
            state.row_weight[first:].view(torch.int32)] + \
        ([state.m_indices[first:state.capacity]] if state.m_indices is not None else [])


def _fill_canaries(state, first: int) -> None:
    views = _canary_views(state, first)
    for v in views[:3]:
        v.fill_(CANARY)
    if len(views) > 3:
        views[3].fill_(CANARY_GROUP)


def _broken_canaries(state, first: int) -> list:
    names = ("pool_x", "row_src", "row_weight", "m_indices")
    out = []
    for name, v in zip(names, _canary_views(state, first)):
        want = CANARY_GROUP if name == "m_indices" else CANARY
        bad = int((v != want).sum())
        if bad:
            out.append(f"{name}: {bad} words past row {first} written")
    return out


PATHS = {  # engine, forward kwargs, forced (rows, rows_per_expert): the bound each trips
    "small-batch fp8": ("builtin", dict(small_batch=True), (128, 1)),     # an expert's rows
    # the fused engine's TMA kernel beside the dispatch (one PE per GPU on sm_90): the abandoned plan
    "small-batch fused": ("fused", dict(small_batch=True), (128, 1)),
    "general fp8": ("builtin", dict(small_batch=False), (128, 128)),     # the window's rows
    "general bf16": ("torch", dict(), (4, 4)),                           # the window's rows (align 1)
}


@pytest.mark.parametrize("path", list(PATHS))
def test_overflowing_dispatch_is_a_named_error_on_every_rank(ctx, monkeypatch, path):
    engine, kwargs, (rows, per_expert) = PATHS[path]
    if engine == "fused":
        monkeypatch.setenv("SYMMRING_FUSED_BESIDE", "1")  # read when the layer makes its engine
    workspace = Workspace(ctx, max_tokens=64)
    moe = layer(ctx, workspace, engine)
    router = router_of()
    faulty = ctx.world_size - 1
    n = 16
    x = tokens(ctx, n, SEED)
    problems = []
    try:
        y0 = moe.forward(x, router_weight=router, graph_cache=False, **kwargs)
        moe.check_errors()
        state = moe.executor.state
        if ctx.rank == faulty:
            shrink_plans(moe, monkeypatch, rows, per_expert)
            _fill_canaries(state, rows)
        y = moe.forward(x, router_weight=router, graph_cache=False, **kwargs)
        raised = None
        try:
            moe.check_errors()
        except (PoolOverflow, ProtocolAborted) as exc:
            raised = exc
        if ctx.rank == faulty:
            if not isinstance(raised, PoolOverflow):
                problems.append(f"the overflowing rank raised {raised!r}, expected PoolOverflow")
            problems += _broken_canaries(state, rows)
            print(f"[figure] bounds {path}: rank {ctx.rank}: {raised}")
        elif not (isinstance(raised, ProtocolAborted) and raised.origin == faulty
                  and raised.origin_kind == "pool_overflow"):
            problems.append(f"raised {raised!r}, expected ProtocolAborted naming rank {faulty}'s pool_overflow")
        if not bool(torch.isnan(y.float()).all()):
            problems.append("the failed call returned rows that are not NaN")
        monkeypatch.undo()
        moe.reset()
        again = moe.forward(x, router_weight=router, graph_cache=False, **kwargs)
        moe.check_errors()
        if not torch.equal(again, y0):
            problems.append(f"after reset: {int((again != y0).any(dim=1).sum())} of {n} rows differ from before")
    finally:
        workspace.close()
    verdict(ctx, not problems, f"{path}: " + "; ".join(problems))


@pytest.mark.parametrize("small, n", [(True, 8), (False, 64)], ids=["small-batch", "general"])
def test_stale_group_id_is_skipped_and_reported(ctx, small, n):
    """A group id past the local experts in a pool row the dispatch leaves as padding (the first row after the
    window's live groups, where a tile starts): the expert GEMMs (the small-group kernels; at 64 tokens on 2+
    ranks the large-group one) skip that tile and report it, the output is bitwise the clean call's, and the
    report is a `BackendError` naming the id on every rank."""
    workspace = Workspace(ctx, max_tokens=64)
    moe = layer(ctx, workspace, "builtin")
    router = router_of()
    x = tokens(ctx, n, SEED + 1)
    problems = []
    try:
        clean = moe.forward(x, router_weight=router, graph_cache=False, small_batch=small)
        moe.check_errors()
        state, window = moe.executor.state, moe.last_plan.windows[0]
        live, bad = int(state.total.item()), moe.num_local_experts + 3
        if live >= window.rows_bound:
            problems.append(f"the window's rows fill its pool ({live}): no padding tile to corrupt")
        else:
            state.m_indices[live] = bad
            y = moe.forward(x, router_weight=router, graph_cache=False, small_batch=small)
            try:
                moe.check_errors()
                problems.append(f"no error for group {bad} at row {live}")
            except BackendError as exc:
                if f"naming group {bad}" not in str(exc):
                    problems.append(str(exc))
            if not torch.equal(y, clean):
                problems.append(f"{int((y != clean).any(dim=1).sum())} rows differ from the clean call")
            moe.check_errors()  # the report was cleared
            state.m_indices[live] = -1
    finally:
        workspace.close()
    verdict(ctx, not problems, f"small_batch={small}: " + "; ".join(problems))


def test_entry_map_growth_keeps_queued_and_cached_calls_right(ctx):
    """A layer whose windows run in passes (a 32-row pool: the entry map is used), with a call queued, a graph
    cached and one captured, then a second layer with a larger ring (its own schedule) grows the map."""
    workspace = Workspace(ctx, max_tokens=64, pool_rows=32)
    first = layer(ctx, workspace, "torch")
    router = router_of()
    x = tokens(ctx, 16, SEED + 2)
    problems = []
    try:
        reference = first.forward(x, router_weight=router, graph_cache=False)
        if max(len(w.passes) for w in first.last_plan.windows.values()) < 2:
            problems.append("the call ran in one pass: the entry map is not used")
        for _ in range(2):  # seen, then captured: the cache holds its graph
            first.forward(x, router_weight=router)
        captured, y_captured = first.capture(x, router_weight=router)
        captured.replay()
        torch.cuda.synchronize()
        first.check_errors()
        if not torch.equal(y_captured, reference):
            problems.append("the captured call differs from the eager one before the growth")
        old_map = workspace.gpu.entry_rows  # kept alive here: a stale user writes into it, visibly
        queued = first.forward(x, router_weight=router)  # a replay of the cached graph, in flight
        second = layer(ctx, workspace, "torch", num_slots=4, tokens_per_slot=64)
        if workspace.gpu.entry_rows.data_ptr() == old_map.data_ptr():
            problems.append("the second layer's ring did not grow the entry map")
        torch.cuda.synchronize()
        if not torch.equal(queued, reference):
            problems.append("the call queued across the growth differs")
        old_map.fill_(CANARY)
        for call in range(3):  # eager (seen again), captured anew, replayed
            y = first.forward(x, router_weight=router)
            if not torch.equal(y, reference):
                problems.append(f"call {call} after the growth differs")
        torch.cuda.synchronize()
        first.check_errors()
        if not bool((old_map == CANARY).all()):
            problems.append(f"{int((old_map != CANARY).sum())} words of the old entry map written after the growth")
        try:
            captured.replay()
            problems.append("a graph captured before the growth replayed")
        except ConfigError:
            pass
        y2 = second.forward(x, router_weight=router, graph_cache=False)
        second.check_errors()
        if not bool(torch.isfinite(y2.float()).all()):
            problems.append("the second layer's output is not finite")
    finally:
        workspace.close()
    verdict(ctx, not problems, "; ".join(problems))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ten_thousand_cached_calls_keep_memory_flat(ctx, monkeypatch):
    """Random per-rank counts (0-8 tokens: buckets 1, 2, 4, 8) through a cache of 2 graphs, so captures and
    evictions churn; the fp8 small-batch path at 1024 channels, whose GEMMs split K (their counters come from
    the capture arenas). After the same settling calls (buckets 8 then 1, each to a replay, outputs bitwise
    the uncached calls') at call 1,000 and at call 10,000: the same allocated bytes, counters and workspace
    bytes."""
    from symmring.moe.engines import triton_small
    monkeypatch.delenv("SYMMRING_GRAPH_CACHE", raising=False)
    hidden = inter = 1024
    workspace = Workspace(ctx, max_tokens=16)
    moe = layer(ctx, workspace, "builtin", max_tokens=16, hidden=hidden, inter=inter, num_experts=12, graph_cache=2)
    router = router_of(hidden, 12)
    rng = np.random.default_rng(SEED + ctx.rank)
    xs = {n: tokens(ctx, n, SEED + 3 + n, hidden) for n in range(9)}
    problems, figures = [], {}

    def settle():
        for n in (8, 8, 8, 1, 1, 1):  # the cache then holds buckets 8 and 1 on every rank
            y = moe.forward(xs[n], router_weight=router)
            ref = moe.forward(xs[n], router_weight=router, graph_cache=False)
            if not torch.equal(y, ref):
                problems.append(f"a cached call of {n} tokens differs from the uncached one")
        torch.cuda.synchronize()
        gc.collect()
        counters = sum(b.numel() for b in triton_small.split_counter_buffers())
        return torch.cuda.memory_allocated(), counters, workspace.memory()["total"]

    try:
        for call in range(1, 10_001):
            moe.forward(xs[int(rng.integers(0, 9))], router_weight=router)
            if call in (1_000, 10_000):
                figures[call] = settle()
        moe.check_errors()
        info = moe.graph_cache_info()
        (m1, c1, w1), (m2, c2, w2) = figures[1_000], figures[10_000]
        message = (f"rank {ctx.rank}: allocated bytes after 1,000 calls {m1}, after 10,000 {m2}; split-K counters "
                   f"{c1} -> {c2}; workspace bytes {w1} -> {w2}; cache {info}")
        print(f"[figure] bounds memory: {message}")
        if (m1, c1, w1) != (m2, c2, w2):
            problems.append(message)
        if info["evictions"] < 100 or info["captures"] < 100:
            problems.append(f"too little churn to show a leak: {info}")
    finally:
        workspace.close()
    verdict(ctx, not problems, "; ".join(problems))
