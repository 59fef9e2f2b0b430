"""The model checker of the ring protocol (symmring.modelcheck): the quick configuration finds no violation
of the real protocol -- per-chunk consumers in every lookahead (and mixes of them over the ranks), and the
GPU layer's windowed consumer (`protocol.windowed_enqueue_order`) in every window -- kills every mutant
with the expected invariant (a window of num_slots + 1 chunks deadlocks), and its search really explores.

Runs in-process in well under a minute; the full run is ``python -m symmring.modelcheck``
(docs/MODELCHECK.md).
"""

import dataclasses
import io
import json

import pytest

from symmring import protocol
from symmring.errors import ConfigError
from symmring.modelcheck import (INV_COMBINE_ONCE, INV_EXACT_READ, INV_LIVENESS, INV_NO_STALE_WAIT,
                                 INV_REUSE, MUTANT_NAMES, MUTANTS, QUICK_CROSS_CHECKS, QUICK_SHAPES,
                                 QUICK_WINDOW_CROSS_CHECKS, QUICK_WINDOW_SHAPES, ModelConfig, RingModel, check,
                                 explore, main)
from symmring.protocol import AckPolicy


@pytest.fixture(scope="module")
def quick_report():
    return check(QUICK_SHAPES, QUICK_CROSS_CHECKS, window_shapes=QUICK_WINDOW_SHAPES,
                 window_cross_checks=QUICK_WINDOW_CROSS_CHECKS)


def test_quick_protocol_has_no_violation(quick_report):
    runs = quick_report.protocol_runs
    assert quick_report.violations == 0, [(r.config.label(), r.violation) for r in runs if r.violation]
    # Every configuration actually explored something and ended in exactly one (complete) terminal state.
    assert all(run.states > 1 and run.terminal_states == 1 for run in runs)
    assert {run.config.shape() for run in runs} >= set(QUICK_SHAPES)
    assert any(run.config.serial for run in runs) and any(not run.config.serial for run in runs)
    # Ranks with different lookaheads are among them (the rule is per rank), and calls of different chunk
    # counts (a slot's previous use then lies one or more calls back).
    assert any(run.config.serial and len(set(run.config.lookaheads())) > 1 for run in runs)
    assert any(len(set(run.config.chunks_per_call())) > 1 for run in runs)


def test_quick_checks_the_windowed_order_in_every_window(quick_report):
    # The GPU layer's order: for every window shape, every window 1..S, both policies, two streams, serial
    # (windowed_enqueue_order) and the captured graph (every topological order, one item at a time, and
    # concurrently), every invariant held and the one terminal state is the complete one.
    windowed = {(run.config.shape(), run.config.expert_window, run.config.ack_policy, run.config.serial,
                 run.config.graph): run
                for run in quick_report.protocol_runs if run.config.expert_window is not None and run.config.reduced()}
    for shape in QUICK_WINDOW_SHAPES:
        for width in range(1, shape[2] + 1):
            for policy in AckPolicy:
                for serial in (False, True):
                    for graph in (False, True):
                        run = windowed[(shape, width, policy, serial, graph)]
                        assert run.violation is None and run.terminal_states == 1 and run.states > 1, \
                            run.config.label()
    # The serial walk follows windowed_enqueue_order item by item.
    model = RingModel(ModelConfig(2, 2, 3, 4, 1, serial=True, expert_window=2))
    assert [item[::2] for item in model.stream_items[0][:-1]] == [
        (kind, first) for kind, first, _ in protocol.windowed_enqueue_order(4, 3, 2)]


def test_windowed_reduction_agrees_with_full_search():
    for shape, width in QUICK_WINDOW_CROSS_CHECKS:
        for policy in AckPolicy:
            reduced = explore(ModelConfig(*shape, ack_policy=policy, expert_window=width))
            full = explore(ModelConfig(*shape, ack_policy=policy, expert_window=width, reduce=False))
            for run in (reduced, full):
                assert run.violation is None and run.terminal_states == 1
            assert reduced.states < full.states


def test_quick_kills_every_mutant_with_expected_invariant(quick_report):
    assert quick_report.mutants_killed == len(MUTANTS) == len(quick_report.mutants)
    for result in quick_report.mutants:
        assert result.invariant == result.spec.expected, (result.spec.name, result.invariant)
        # The counterexample is a real step-by-step trace, and the reduction used for the protocol
        # does not hide the bug.
        assert len(result.killing_run.violation.trace) >= 1
        assert result.reduced_run is not None and result.reduced_run.violation is not None


@pytest.mark.parametrize("mutant, invariant", [
    ("fence_removed", INV_EXACT_READ),
    ("no_acquire", INV_EXACT_READ),
    ("ack_before_last_read", INV_EXACT_READ),
    ("reset_forgotten", INV_REUSE),
    ("reset_after_publish", INV_LIVENESS),
    ("ready_ignores_generation", INV_NO_STALE_WAIT),
    ("wait_route_only", INV_NO_STALE_WAIT),
    ("generation_baked", INV_NO_STALE_WAIT),
    ("reuse_on_any_ack", INV_REUSE),
    ("lookahead_eq_slots", INV_LIVENESS),
    ("window_exceeds_slots", INV_LIVENESS),
    ("windows_differ_per_rank", INV_LIVENESS),
    ("graph_without_own_chunk_edges", INV_LIVENESS),
    ("graph_without_own_ack_edges", INV_LIVENESS),
    ("split_acquire_full_mask_only", INV_LIVENESS),
])
def test_named_mutant_killed_by_expected_invariant(quick_report, mutant, invariant):
    result = next(r for r in quick_report.mutants if r.spec.name == mutant)
    assert result.killed and result.invariant == invariant


def test_fence_removed_trace_shows_buffered_store_then_stale_read(quick_report):
    result = next(r for r in quick_report.mutants if r.spec.name == "fence_removed")
    trace = result.killing_run.violation.trace
    assert any("store buffer" in line for line in trace)
    assert "WRONG" in trace[-1] and INV_EXACT_READ in trace[-1]


def test_window_of_more_chunks_than_slots_deadlocks_with_two_streams(quick_report):
    # W = S + 1: the window's consumer counts the route of chunk S, whose slot still holds chunk 0 of the
    # same window, unacknowledged: a deadlock even with producer and consumer on their own streams.
    result = next(r for r in quick_report.mutants if r.spec.name == "window_exceeds_slots")
    run = result.killing_run
    assert not run.config.serial and run.config.window_widths() == (run.config.num_slots + 1,) * run.config.num_consumers
    message = run.violation.message
    assert "waits for the route of chunk" in message and "waits to acquire slot" in message
    # Serial too, and on two ranks.
    for cfg in (ModelConfig(1, 1, 2, 3, 1, serial=True, expert_window=3, mutant="window_exceeds_slots"),
                ModelConfig(2, 2, 2, 3, 1, ack_policy=AckPolicy.EARLY, expert_window=3, mutant="window_exceeds_slots")):
        assert explore(cfg).violation.invariant == INV_LIVENESS


def test_captured_graph_needs_both_local_edges(quick_report):
    # Without "consume after own produce" an executor that starts the consumer first spins at once; without
    # "produce after own acknowledgement" one that runs the producer ahead waits for a slot forever.
    chunk = next(r for r in quick_report.mutants if r.spec.name == "graph_without_own_chunk_edges")
    assert chunk.killing_run.violation.trace == ["  1. rank 0: the executor starts call 0's consume the window from chunk 0"]
    ack = next(r for r in quick_report.mutants if r.spec.name == "graph_without_own_ack_edges")
    assert "waits to acquire slot" in ack.killing_run.violation.message
    # With both edges, every topological order of every rank completes, also on three ranks and windows of 2.
    for cfg in (ModelConfig(3, 3, 2, 4, 1, serial=True, expert_window=1, graph=True),
                ModelConfig(2, 2, 3, 5, 2, serial=True, expert_window=2, graph=True, ack_policy=AckPolicy.EARLY)):
        run = explore(cfg)
        assert run.violation is None and run.terminal_states == 1


def test_one_rank_with_a_forbidden_lookahead_deadlocks_everyone():
    # The rule is per rank: the last rank with lookahead S, the others within the rule.
    for shape in ((2, 2, 2, 4, 1), (3, 3, 1, 2, 1)):
        cfg = ModelConfig(*shape, serial=True, mutant="lookahead_eq_slots")
        assert cfg.lookaheads()[:-1] == (shape[2] - 1,) * (shape[0] - 1) and cfg.lookaheads()[-1] == shape[2]
        assert explore(cfg).violation.invariant == INV_LIVENESS


def test_ready_ge_variant_is_equivalent(quick_report):
    runs = quick_report.equivalents["ready_ge"]
    assert runs and all(run.violation is None for run in runs)


@pytest.mark.parametrize("shape", [(2, 1, 2, 3, 1), (1, 2, 2, 3, 2)])
def test_reduction_agrees_with_full_search(shape):
    # The same configuration with partial-order reduction, without it, and with fine steps: all end in
    # the one complete terminal state with no violation, and each reduction explores strictly fewer states.
    reduced = explore(ModelConfig(*shape))
    coarse = explore(ModelConfig(*shape, reduce=False))
    fine = explore(ModelConfig(*shape, reduce=False, fine=True))
    for run in (reduced, coarse, fine):
        assert run.violation is None and run.terminal_states == 1
    assert reduced.states < coarse.states < fine.states


def test_successor_steps_use_protocol_arithmetic():
    # Chunk c of call k lives in slot_of(c) with generation(base, c); after the call the base advances
    # by next_base. Walk one serial run and check every publish against the protocol functions.
    cfg = ModelConfig(1, 1, 2, 3, 2, serial=True)
    model = RingModel(cfg)
    state = model.initial()
    published = []
    while True:
        succs = model.successors(state)
        if not succs:
            break
        label, state, violation = succs[0]
        assert violation is None
        for part in (label if isinstance(label[0], tuple) else (label,)):
            if part[0] == "publish":
                _, _, k, c, s, _, gen = part
                published.append((k, c, s, gen))
            if part[0] == "advance":
                assert part[4] == protocol.next_base(part[3], cfg.num_chunks)
    assert model.is_final(state)
    base = 0
    for k in range(cfg.num_calls):
        for c in range(cfg.num_chunks):
            expect = (k, c, protocol.slot_of(c, cfg.num_slots), protocol.generation(base, c))
            assert published.count(expect) == 2  # route and layout
        base = protocol.next_base(base, cfg.num_chunks)
    assert len(published) == 2 * cfg.num_calls * cfg.num_chunks


def test_double_combine_is_caught():
    # Corrupt a state so that a result is already marked written: the next combine must report inv4.
    model = RingModel(ModelConfig(1, 1, 1, 1, 1))
    state = bytearray(model.initial())
    state[model.o_written] = 1
    state = bytes(state)
    while True:
        succs = model.successors(state)
        bad = [v for _, _, v in succs if v is not None]
        if bad:
            assert bad[0][0] == INV_COMBINE_ONCE
            break
        assert succs, "ran out of steps before the combine"
        state = succs[0][1]


def test_cli_one_config_one_mutant_and_json(tmp_path):
    out = io.StringIO()
    path = tmp_path / "report.json"
    status = main(["--config", "1,1,2,3,2", "--json", str(path)], out=out)
    lines = out.getvalue().splitlines()
    data = json.loads(path.read_text())
    assert status == (0 if data["mutants_killed"] == data["mutants_total"] else 1)
    assert lines[-1] == (f"modelcheck: states={data['states']} violations=0 "
                         f"mutants_killed={data['mutants_killed']}/{len(MUTANT_NAMES)}")
    # reuse_on_any_ack needs two consumers and windows_differ_per_rank two ranks and three slots: one
    # shape with Q=1, S=2 cannot kill them, and the exit status says so (the graph mutants are killed).
    assert status == 1 and data["mutants_killed"] == len(MUTANT_NAMES) - 2

    out = io.StringIO()
    assert main(["--config", "1,2,2,3,2", "--mutant", "reuse_on_any_ack"], out=out) == 0
    assert out.getvalue().splitlines()[-1] == "modelcheck: states=0 violations=0 mutants_killed=1/1"


@pytest.mark.parametrize("kwargs, word", [
    (dict(num_slots=0), "num_slots"),
    (dict(num_consumers=9), "num_consumers"),
    (dict(mutant="nope"), "mutant"),
    (dict(serial=True, lookahead=2), "lookahead"),
    (dict(serial=True, lookahead=(0, 1)), "lookahead"),
    (dict(expert_window=3), "expert_window"),
    (dict(expert_window=0), "expert_window"),
    (dict(num_producers=2, expert_window=1), "P == Q"),
    (dict(expert_window=1, mutant="fence_removed"), "mutant"),
    (dict(mutant="window_exceeds_slots"), "expert_window"),
    (dict(graph=True), "expert_window"),
    (dict(expert_window=1, mutant="graph_without_own_ack_edges"), "graph=True"),
])
def test_bad_config_raises_config_error(kwargs, word):
    base = dict(num_producers=1, num_consumers=1, num_slots=2, num_chunks=3, num_calls=1)
    base.update(kwargs)
    with pytest.raises(ConfigError, match=word):
        RingModel(ModelConfig(**base))


def test_config_label_names_mode():
    cfg = ModelConfig(2, 2, 2, 4, 2, serial=True)
    assert "serial(lookahead=1)" in cfg.label()
    assert "unreduced" in dataclasses.replace(cfg, mutant="fence_removed").label()


def test_split_producer_whose_parts_both_acquire_completes_and_the_old_rule_deadlocks(quick_report):
    # RingKernels.produce(c, parts="route") and produce(c, parts="layout"), both acquiring: each part
    # acquires when the mask is complete or the other part is published, and resets in its publication.
    split_runs = [run for run in quick_report.protocol_runs if run.config.split_acquire]
    assert split_runs and all(run.violation is None for run in split_runs)
    assert {run.config.serial for run in split_runs} == {False, True}
    for cfg in (ModelConfig(2, 2, 2, 4, 2, split_acquire=True, reduce=False),
                ModelConfig(1, 2, 1, 3, 1, ack_policy=AckPolicy.EARLY, split_acquire=True, fine=True)):
        assert explore(cfg).violation is None, cfg.label()
    # The rule before the fix (the second part waits for a complete mask only): the first part's reset
    # leaves it waiting for acknowledgements that need its own publication.
    result = next(r for r in quick_report.mutants if r.spec.name == "split_acquire_full_mask_only")
    assert "waits to acquire slot" in result.killing_run.violation.message
    assert any("part acquires slot" in line for line in result.killing_run.violation.trace)


def test_cli_is_a_short_table_unless_verbose():
    """Without -v: a table row per check and per mutant, then the time and the summary line; -v adds every
    configuration's line and each mutant's counterexample trace."""
    args = ["--config", "1,1,2,3,2", "--mutant", "reset_forgotten", "--mutant", "fence_removed"]
    out = io.StringIO()
    assert main(args, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["check", "configs", "states", "result"]
    assert [line.split()[:2] for line in lines[1:3]] == [["mutant", "reset_forgotten"], ["mutant", "fence_removed"]]
    assert "killed by inv2-reuse-after-all-acks" in lines[1] and lines[3].startswith("total time")
    assert len(lines) == 5 and lines[-1] == "modelcheck: states=0 violations=0 mutants_killed=2/2"
    verbose = io.StringIO()
    assert main(args + ["-v"], out=verbose) == 0
    text = verbose.getvalue()
    assert "== mutants ==" in text and "shortest counterexample" in text and "check  " not in text
    assert text.splitlines()[-1] == lines[-1]
