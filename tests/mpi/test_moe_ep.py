"""The expert-parallel MoE on the ring: streamed == batch bitwise, both ~ the reference, on every rank.

Run (every rank runs every test; rank 0 prints one figure line per case)::

    mpiexec -n 4 python -m mpi4py -m pytest tests/mpi/test_moe_ep.py -q -p no:cacheprovider
    python -m pytest tests/mpi/test_moe_ep.py -q          # a world of 1

Every rank builds the same global problem from a shared seed (tokens of all ranks, all experts, the
router), runs its slice through the CPU layer (`symmring.MoE` on the host backend, `ExpertParallelMoE`; 12
experts: an even split over 1, 2, 3 or 4 ranks), and checks its output rows against `reference_moe` of the
global problem. Verdicts are collective.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, List

import numpy as np
import pytest
from rankworld import MAX, MIN, SUM

from symmring import MoE, shard_experts
from symmring.errors import ConfigError
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig
from symmring.moe.reference import reference_moe
from symmring.protocol import AckPolicy

HIDDEN, INTER, NUM_EXPERTS = 256, 32, 12
#: Most tokens a rank holds in these cases (counts below 45, and a few more in the bad-input test).
MAX_TOKENS = 64


def counts_uneven(world: int, rng, low: int = 5, zero_rank: bool = False) -> List[int]:
    """Uneven random counts in [low, 45) (mostly not multiples of the chunk size); with ``zero_rank`` one
    random rank holds no tokens (when world > 1)."""
    counts = [int(n) for n in rng.integers(low, 45, world)]
    if zero_rank and world > 1:
        counts[int(rng.integers(world))] = 0
    return counts


def counts_with_zero(world: int, rng) -> List[int]:
    return counts_uneven(world, rng, zero_rank=True)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    num_topk: int
    routing: str  # "router", "logits", "skewed" (every token to one expert), "masked" (given, -1 entries)
    method: str = "softmax"
    x_format: str = "fp8_e4m3"
    tokens_per_slot: int = 8
    num_slots: int = 2
    ack_policy: AckPolicy = AckPolicy.CONSERVATIVE
    counts: Callable = counts_uneven


CASES = [
    Case("softmax_k2_fp8_zero_rank", 2, "router", counts=counts_with_zero),
    Case("softmax_k1_skewed_early", 1, "skewed", tokens_per_slot=7, num_slots=3, ack_policy=AckPolicy.EARLY),
    Case("sigmoid_k8_bf16_wrap", 8, "router", method="sigmoid_bias", x_format="bf16", tokens_per_slot=3,
         ack_policy=AckPolicy.EARLY, counts=lambda world, rng: counts_uneven(world, rng, low=24)),
    Case("masked_k4_zero_rank", 4, "masked", tokens_per_slot=8, num_slots=4, counts=counts_with_zero),
    Case("sigmoid_k2_skewed_bf16_multiple", 2, "skewed", method="sigmoid_bias", x_format="bf16",
         tokens_per_slot=6, counts=lambda world, rng: [12] * world),
    Case("all_ranks_zero_tokens", 2, "router", counts=lambda world, rng: [0] * world),
    Case("one_chunk_logits_early", 3, "logits", tokens_per_slot=64, ack_policy=AckPolicy.EARLY),
]


def make_problem(case: Case, world: int, seed: int):
    """The global problem, identical on every rank: counts, x, weights, routing, layer options."""
    rng = np.random.default_rng(seed)
    counts = case.counts(world, rng)
    total = sum(counts)
    x = rng.standard_normal((total, HIDDEN), dtype=np.float32)
    w_gate = (rng.standard_normal((NUM_EXPERTS, INTER, HIDDEN)) / math.sqrt(HIDDEN)).astype(np.float32)
    w_up = (rng.standard_normal((NUM_EXPERTS, INTER, HIDDEN)) / math.sqrt(HIDDEN)).astype(np.float32)
    w_down = (rng.standard_normal((NUM_EXPERTS, HIDDEN, INTER)) / math.sqrt(INTER)).astype(np.float32)
    options = dict(scoring=case.method)
    if case.method == "sigmoid_bias":
        options.update(bias=(rng.standard_normal(NUM_EXPERTS) * 0.1).astype(np.float32), routed_scaling_factor=2.5)
    target = int(rng.integers(NUM_EXPERTS))
    if case.routing == "router":
        routing = dict(router_weight=(rng.standard_normal((NUM_EXPERTS, HIDDEN)) / 16).astype(np.float32))
    elif case.routing in ("logits", "skewed"):
        logits = rng.standard_normal((total, NUM_EXPERTS), dtype=np.float32)
        if case.routing == "skewed":
            logits[:, target] += 30  # every token picks `target` first
            if "bias" in options:
                options["bias"][target] = 2  # sigmoid saturates at 1: the bias must favour `target` too
        routing = dict(logits=logits)
    else:
        idx = np.stack([rng.permutation(NUM_EXPERTS)[:case.num_topk] for _ in range(total)]).astype(np.int32)
        idx = idx.reshape(total, case.num_topk)
        idx[rng.random(idx.shape) < 0.3] = -1
        if total:
            idx[0] = -1  # a token with every entry masked
        routing = dict(topk_idx=idx, topk_weights=rng.random((total, case.num_topk), dtype=np.float32))
    return counts, x, (w_gate, w_up, w_down), routing, options, target


def local_routing(routing: dict, lo: int, hi: int) -> dict:
    """This rank's rows of per-token routing inputs (the router weight is shared)."""
    return {k: (v if k == "router_weight" else v[lo:hi]) for k, v in routing.items()}


def max_abs(a) -> float:
    return float(np.max(np.abs(a))) if np.size(a) else 0.0


def check_close(y, y_ref, what: str) -> str:
    """'' when ``y`` matches ``y_ref`` within float32 tolerance (rtol 1e-5, atol 1e-5 of the largest)."""
    try:
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * max(max_abs(y_ref), 1e-30))
    except AssertionError as exc:
        return f"{what}: {exc}"
    return ""


def first_bit_difference(a, b) -> str:
    """'' when ``a`` and ``b`` are bitwise equal, else the first differing coordinate."""
    if a.shape != b.shape:
        return f"shapes {a.shape} != {b.shape}"
    diff = np.argwhere(a.view(np.uint32) != b.view(np.uint32))
    if diff.size == 0:
        return ""
    t, h = diff[0]
    return f"{len(diff)} elements differ; first at [{t}, {h}]: {a[t, h]!r} != {b[t, h]!r}"


def run_case(ctx, comm, case: Case, seed: int):
    world, rank = comm.Get_size(), comm.Get_rank()
    counts, x, weights, routing, options, target = make_problem(case, world, seed)
    lo = sum(counts[:rank])
    hi = lo + counts[rank]
    ref = reference_moe(x, num_topk=case.num_topk, x_format=case.x_format, w_gate=weights[0],
                        w_up=weights[1], w_down=weights[2], **routing, **options)
    errors = []
    schedule = ScheduleConfig(x_format=case.x_format, tokens_per_slot=min(case.tokens_per_slot, MAX_TOKENS),
                              num_slots=case.num_slots, ack_policy=case.ack_policy)
    with MoE(ctx, Experts(*shard_experts(*weights, rank, world)), RoutingConfig(NUM_EXPERTS, case.num_topk, **options),
             max_tokens=MAX_TOKENS, schedule=schedule) as layer:
        mine = local_routing(routing, lo, hi)
        y_batch = layer.forward(x[lo:hi], **mine)
        pairs = [layer.last_stats.pairs_computed]
        y_stream = layer.forward(x[lo:hi], streaming=True, **mine)
        pairs.append(layer.last_stats.pairs_computed)
        num_chunks = layer.last_stats.num_chunks
    bitwise = first_bit_difference(y_stream, y_batch)
    errors.append(bitwise and "streamed != batch: " + bitwise)
    errors.append(check_close(y_batch, ref.y[lo:hi], "batch vs reference"))
    errors.append(check_close(y_stream, ref.y[lo:hi], "streamed vs reference"))
    # Invariant 4: each live (token, k) of every rank is computed exactly once, on some rank.
    live = int(np.count_nonzero(ref.topk_idx != -1))
    for path, n in zip(("batch", "streamed"), pairs):
        total = comm.allreduce(n, op=SUM)
        if total != live:
            errors.append(f"{path}: {total} (token, k) pairs computed over all ranks, expected {live}")
    if case.routing == "skewed" and counts[rank]:
        if not np.all(ref.topk_idx[lo:hi, 0] == target):
            errors.append(f"skewed routing did not send every token to expert {target}")
    if case.routing == "masked" and rank == 0 and counts[0] and np.any(y_batch[0] != 0):
        errors.append("a token whose entries are all masked has a non-zero output")
    return dict(errors=[e for e in errors if e], bitwise=not bitwise, counts=counts, num_chunks=num_chunks,
                diff=max_abs(y_batch - ref.y[lo:hi]), scale=max_abs(ref.y))


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_streamed_equals_batch_and_reference(ctx, comm, seed, outcome, check, figure, case):
    start_s = time.monotonic()
    result = outcome.run(run_case, ctx, comm, case, seed) or {}
    elapsed_s = comm.allreduce(time.monotonic() - start_s, op=MAX)
    errors = ([outcome.error] if outcome.error else []) + result.get("errors", [])
    diff = comm.allreduce(result.get("diff", math.inf), op=MAX)
    bitwise = comm.allreduce(int(result.get("bitwise", False)), op=MIN)
    figure(f"moe_ep[{case.name}]: ranks={comm.Get_size()} tokens={result.get('counts')} "
           f"chunks={result.get('num_chunks')} K={case.num_topk} {case.x_format} {case.method} "
           f"slots={case.num_slots}x{case.tokens_per_slot} {case.ack_policy.name}: streamed==batch bitwise "
           f"{'yes' if bitwise else 'NO'}, max|y-ref|={diff:.3g} (|ref|<={result.get('scale', 0):.3g}), "
           f"{elapsed_s:.2f} s")
    check(comm, not errors, "\n".join(errors))


@pytest.mark.mpi
def test_repeated_calls_reuse_rings(ctx, comm, seed, outcome, check, figure):
    """One layer, many calls mixing paths, chunk sizes, batch sizes and ack policies: generations and
    combine signals carry over calls, rings are cached and regrown, results stay bitwise identical."""
    world, rank = comm.Get_size(), comm.Get_rank()
    case = Case("repeat", 2, "router")
    counts, x, weights, routing, options, _ = make_problem(case, world, seed)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    ref = reference_moe(x, num_topk=2, w_gate=weights[0], w_up=weights[1], w_down=weights[2], **routing)
    half = (hi - lo) // 2
    full = slice(lo, hi)
    # Layers of several schedules on one workspace (the rings of a spec shared and regrown, generations and
    # combine signals carried over every call of every layer): (layer, rows, forward options, hooks); every call
    # after the first takes all rows and must equal call 1 bitwise.
    fp8 = dict(x_format="fp8_e4m3")  # the reference's
    schedules = [ScheduleConfig(tokens_per_slot=5, num_slots=2, **fp8),
                 ScheduleConfig(tokens_per_slot=5, num_slots=2, ack_policy=AckPolicy.EARLY, **fp8),
                 ScheduleConfig(tokens_per_slot=4, num_slots=3, **fp8),
                 ScheduleConfig(tokens_per_slot=1, num_slots=2, **fp8)]
    runs = [
        (0, slice(lo, lo + half), {}, {}),  # a small batch first: the batch ring is regrown by the next call
        (0, full, {}, {}),
        (0, full, dict(streaming=True), {}),
        (1, full, dict(streaming=True), {}),
        (2, full, dict(streaming=True), dict(lookahead=0)),
        (0, full, dict(streaming=True), {}),  # cached ring, later generations
        (3, full, dict(streaming=True), {}),
        (1, full, {}, {}),
    ]

    def body():
        errors = []
        y_full = None
        layers = [MoE(ctx, Experts(*shard_experts(*weights, rank, world)), RoutingConfig(NUM_EXPERTS, 2),
                      max_tokens=MAX_TOKENS, schedule=schedule) for schedule in schedules]
        try:
            for i, (which, rows, options, hooks) in enumerate(runs):
                forward = layers[which].debug.forward if hooks else layers[which].forward
                y = forward(x[rows], **local_routing(routing, rows.start, rows.stop), **options, **hooks)
                close = check_close(y, ref.y[rows], f"call {i}")
                if close:
                    errors.append(close)
                if i == 1:
                    y_full = y
                elif i > 1 and first_bit_difference(y, y_full):
                    errors.append(f"call {i} ({options}): {first_bit_difference(y, y_full)}")
        finally:
            for layer in layers:
                layer.close()
        return errors

    errors = outcome.run(body) or []
    figure(f"moe_ep[repeat]: ranks={world} calls={len(runs)} tokens={counts}: all identical "
           f"{'yes' if not errors and not outcome.error else 'NO'}")
    check(comm, not errors and not outcome.error, outcome.error + "\n".join(errors))


def expect_config_error(ctx, comm, outcome, check, fn, match: str) -> None:
    """``fn()`` must raise ConfigError on every rank, with ``match`` in the message on some rank."""
    outcome.run(fn)
    exc = outcome.exception
    outcome.exception, outcome.error = None, ""
    ok = isinstance(exc, ConfigError)
    found = comm.allreduce(int(ok and match in str(exc)), op=MAX)
    check(comm, ok and found, f"expected ConfigError mentioning {match!r} on every rank, got {exc!r}")


@pytest.mark.mpi
def test_bad_input_rejected_on_every_rank_and_layer_stays_usable(ctx, comm, seed, outcome, check):
    world, rank = comm.Get_size(), comm.Get_rank()
    case = Case("bad", 2, "router")
    counts, x, weights, routing, options, _ = make_problem(case, world, seed)
    counts = [max(n, 3) for n in counts]  # every rank holds tokens here
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((sum(counts), HIDDEN), dtype=np.float32)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    ref = reference_moe(x, num_topk=2, w_gate=weights[0], w_up=weights[1], w_down=weights[2], **routing)
    last = world - 1
    layer = MoE(ctx, Experts(*shard_experts(*weights, rank, world)), RoutingConfig(NUM_EXPERTS, 2), max_tokens=64,
                schedule=ScheduleConfig(tokens_per_slot=4, num_slots=2, x_format="fp8_e4m3"))
    mine = x[lo:hi]
    router = routing["router_weight"]
    try:
        # Only the last rank passes a bad argument; every rank must raise (no one left waiting).
        bad_x = mine.astype(np.float64) if rank == last else mine
        expect_config_error(ctx, comm, outcome, check, lambda: layer.forward(bad_x, router_weight=router), "x.dtype")
        idx = np.zeros((hi - lo, 2), np.int32)
        if rank == last:
            idx[0, 1] = NUM_EXPERTS  # out of range
        expect_config_error(ctx, comm, outcome, check, lambda: layer.forward(
            mine, topk_idx=idx, topk_weights=np.ones((hi - lo, 2), np.float32)), "topk_idx")
        big = np.zeros((65 if rank == last else 3, HIDDEN), np.float32)
        expect_config_error(ctx, comm, outcome, check, lambda: layer.forward(big, router_weight=router),
                            "expected at most max_tokens=64")
        if world > 1:  # the ranks disagree on streaming, or on the chunk size (a layer of another schedule)
            expect_config_error(ctx, comm, outcome, check, lambda: layer.forward(
                mine, router_weight=router, streaming=rank == last), "expected the same options on every rank")
            expect_config_error(ctx, comm, outcome, check, lambda: MoE(
                ctx, Experts(*shard_experts(*weights, rank, world)), RoutingConfig(NUM_EXPERTS, 2), max_tokens=64,
                schedule=ScheduleConfig(tokens_per_slot=4 + (rank == last))), "tokens_per_slot")
        expect_config_error(ctx, comm, outcome, check, lambda: layer.debug.forward(
            mine, router_weight=router, streaming=True, lookahead=2), "lookahead")
        expect_config_error(ctx, comm, outcome, check, lambda: layer.forward(
            mine, router_weight=router, streaming=True, tokens_per_slot=4),
            "tokens_per_slot (a field of ScheduleConfig")
        expect_config_error(ctx, comm, outcome, check, lambda: layer.forward(
            mine, router_weight=router, logits=np.zeros((hi - lo, NUM_EXPERTS), np.float32)), "exactly one")
        # The layer and its rings are still usable, and still right.
        y = outcome.run(layer.forward, mine, router_weight=router, streaming=True)
        message = outcome.error or (check_close(y, ref.y[lo:hi], "after rejected calls") if y is not None else "")
        check(comm, not message, message)
    finally:
        layer.close()


@pytest.mark.mpi
def test_constructor_rejects_on_every_rank(ctx, comm, seed, outcome, check):
    world, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((1, INTER, HIDDEN), dtype=np.float32)
    wd = rng.standard_normal((1, HIDDEN, INTER), dtype=np.float32)
    if world > 1:
        # 4 * world + 1 experts cannot be split evenly over the ranks.
        expect_config_error(ctx, comm, outcome, check, lambda: MoE(
            ctx, Experts(w, w, wd), RoutingConfig(4 * world + 1, 2), max_tokens=8), "multiple of world_size")
    # Weights for one local expert while the routing says two per rank.
    expect_config_error(ctx, comm, outcome, check, lambda: MoE(
        ctx, Experts(w, w, wd), RoutingConfig(2 * world, 2), max_tokens=8), "local experts")
    # Only the last rank's w_down has the wrong shape.
    bad_down = wd[:, :, :INTER - 1] if rank == world - 1 else wd
    expect_config_error(ctx, comm, outcome, check, lambda: MoE(
        ctx, Experts(w, w, bad_down), RoutingConfig(world, 1), max_tokens=8), "w_down")
    if world > 1:  # only the last rank builds with another routing: named by the construction's agreement
        top = 2 if rank == world - 1 else 1
        expect_config_error(ctx, comm, outcome, check, lambda: MoE(
            ctx, Experts(w, w, wd), RoutingConfig(world, top), max_tokens=8), "has topk=")
    expect_config_error(ctx, comm, outcome, check, lambda: RoutingConfig(4, 5), "topk")


@pytest.mark.mpi
def test_missing_combine_signal_times_out_naming_the_rank(ctx, comm, seed, outcome, check, figure):
    """A consumer that never signals its combine (a broken rank) makes every owner's bounded combine wait
    expire with a ProtocolTimeout that names it, instead of hanging; the layer then refuses further calls
    (BrokenStateError) and still closes."""
    from symmring.errors import BrokenStateError, ProtocolTimeout
    world, rank = comm.Get_size(), comm.Get_rank()
    case = Case("stall", 2, "router")
    counts, x, weights, routing, options, _ = make_problem(case, world, seed)
    counts = [max(n, 1) for n in counts]
    x = np.random.default_rng(seed + 2).standard_normal((sum(counts), HIDDEN), dtype=np.float32)
    lo, hi = sum(counts[:rank]), sum(counts[:rank + 1])
    broken = world - 1
    timeout_s = 3.0  # short, yet long enough that the ready waits before the combine never expire
    layer = MoE(ctx, Experts(*shard_experts(*weights, rank, world)), RoutingConfig(NUM_EXPERTS, 2),
                max_tokens=MAX_TOKENS, schedule=ScheduleConfig(timeout_s=timeout_s))
    if rank == broken:
        layer.executor._signal_combine = lambda combine_gen: None  # the mutant: combine stores never signalled
    comm.Barrier()
    start_s = time.monotonic()
    refused = None
    try:
        outcome.run(layer.forward, x[lo:hi], router_weight=routing["router_weight"])
        elapsed_s = time.monotonic() - start_s
        try:  # the call stopped part-way: the layer must refuse the next one (no mismatched steps)
            layer.forward(x[lo:hi], router_weight=routing["router_weight"])
        except BrokenStateError as exc:
            refused = exc
    finally:
        layer.close()  # still collective and bounded: every rank is alive
    exc = outcome.exception
    ok = (isinstance(exc, ProtocolTimeout) and exc.kind == "combine" and broken in exc.missing_ranks
          and exc.rank == rank and elapsed_s < 10 * timeout_s and refused is not None and refused.cause is exc)
    figure(f"moe_ep[stalled combine]: ranks={world} broken rank {broken}: rank 0 got "
           f"{type(exc).__name__}: {exc} after {elapsed_s:.2f} s")
    check(comm, ok, f"expected ProtocolTimeout('combine') naming rank {broken} within {10 * timeout_s} s, then "
          f"BrokenStateError; got {exc!r} after {elapsed_s:.2f} s, then {refused!r}")


@pytest.mark.mpi
def test_demo_and_info_commands(ctx, comm, check, capsys):
    """``python -m symmring demo`` ends with ``demo: PASS`` and exit 0 on every rank (small sizes), bad
    arguments end with ``demo: FAIL`` and exit 2; ``info`` names the backend auto would pick."""
    from symmring import demo, info
    rank = comm.Get_rank()
    small = ["--tokens", "9", "--hidden", "128", "--experts", "12", "--topk", "2", "--inter", "16",
             "--tokens-per-slot", "4", "--repeats", "1", "--backend", "host"]
    rc_pass = demo.main(small)
    out_pass = capsys.readouterr().out.strip().splitlines()
    rc_fail = demo.main(small + ["--topk", "0"])
    out_fail = capsys.readouterr().out.strip().splitlines()
    rc_info = info.main([])
    out_info = capsys.readouterr().out
    errors = []
    if rc_pass != 0 or rc_fail != 2 or rc_info != 0:
        errors.append(f"exit statuses demo={rc_pass} (0), bad demo={rc_fail} (2), info={rc_info} (0)")
    if rank == 0:
        if not out_pass or not out_pass[-1].startswith("demo: PASS"):
            errors.append(f"demo's last line: {out_pass[-1:]}")
        if not out_fail or not out_fail[-1].startswith("demo: FAIL --topk=0"):
            errors.append(f"bad demo's last line: {out_fail[-1:]}")
        if "backend (auto): " not in out_info or "numpy: " not in out_info:
            errors.append(f"info output: {out_info!r}")
    elif out_pass or out_fail or out_info:
        errors.append("ranks other than 0 must print nothing")
    check(comm, not errors, "; ".join(errors))
