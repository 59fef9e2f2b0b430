"""Failures across ranks: a stalled rank is named within the timeout and nobody hangs; bad input is
rejected before shared memory changes and the ring stays usable.

Run: ``mpiexec -n 3 python -m mpi4py -m pytest tests/mpi/test_ring_errors.py -q -p no:cacheprovider``
(also passes as a world of 1 under plain pytest).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from rankworld import MAX, SUM
from ringdriver import Stats, Workload, bad_inputs, consume, own_bytes, produce, run_workload

from symmring import ConfigError, ProtocolTimeout, RingSpec
from symmring import protocol
from symmring.protocol import AckPolicy
from symmring.ring import Ring

#: The stall test's bound of every wait: small, so the test is quick.
STALL_TIMEOUT_S = 1.0
#: How much later than the bound the error may arrive (2 cores, up to 4 ranks, other jobs).
STALL_SLACK_S = 3.0


class _TimedRing:
    """A ring that remembers when its last wait started, and drops one rank's acknowledgements."""

    def __init__(self, ring, drop_acks_from_chunk=None):
        self._ring = ring
        self._drop_from = drop_acks_from_chunk
        self.wait_started_s = 0.0

    def __getattr__(self, name):
        return getattr(self._ring, name)

    def acquire_slot(self, call, chunk):
        self.wait_started_s = time.monotonic()
        self._ring.acquire_slot(call, chunk)

    def wait_ready(self, call, chunk, src_rank):
        self.wait_started_s = time.monotonic()
        self._ring.wait_ready(call, chunk, src_rank)

    def ack(self, call, chunk, src_rank):
        if self._drop_from is not None and chunk >= self._drop_from:
            return  # stalled: never acknowledges again
        self._ring.ack(call, chunk, src_rank)


def _clean_run(ctx, comm, seed, outcome, check):
    """A fresh ring runs two full calls with every payload checked: the world still works."""
    spec = RingSpec(num_slots=2, tokens_per_slot=4, hidden=32, num_topk=2, num_experts=8, sf_group_size=16)
    workload = Workload(tokens_per_rank=[4 * r + 9 for r in range(comm.Get_size())], calls_chunks=[4, 5])
    with Ring(ctx, spec) as ring:
        stats = outcome.run(run_workload, ring, workload, seed) or Stats()
    total = stats.reduce(comm)
    check(comm, not outcome.error and stats.mismatches == 0 and stats.slot_uses_checked == 9 * comm.Get_size(),
          outcome.error or f"after the failure: {stats.mismatches} mismatches, {stats.slot_uses_checked} checked")
    return total


@pytest.mark.mpi
def test_stalled_rank_is_named_within_timeout(ctx, comm, seed, outcome, check, figure):
    """The last rank stops publishing and acknowledging at chunk 3: every rank gets a ProtocolTimeout
    naming it within the bound (none hangs), and afterwards all ranks run a clean ring."""
    world_size, rank = comm.Get_size(), comm.Get_rank()
    stalled, stall_chunk, num_chunks = world_size - 1, 3, 8
    spec = RingSpec(num_slots=2, tokens_per_slot=4, hidden=32, num_topk=2, num_experts=8, sf_group_size=16)
    workload = Workload(tokens_per_rank=[num_chunks * spec.tokens_per_slot] * world_size)
    ring = Ring(ctx, spec, timeout_s=STALL_TIMEOUT_S)
    timed = _TimedRing(ring, stall_chunk if rank == stalled else None)
    stats = Stats()
    rng = np.random.default_rng([seed, rank])

    def drive():
        call = timed.begin_call(num_chunks)
        for op, chunk in protocol.enqueue_order(num_chunks, spec.num_slots):
            if op == "produce":
                if rank == stalled and chunk >= stall_chunk:
                    continue  # stalled: never publishes again
                produce(timed, call, chunk, workload.tokens_per_rank[rank], workload.routing, lambda: None, rng)
            else:
                consume(timed, call, chunk, workload, stats, lambda: None, rng)

    comm.Barrier()
    outcome.run(drive)
    time_to_error_s = time.monotonic() - timed.wait_started_s
    ring.close()
    exc = outcome.exception
    named = isinstance(exc, ProtocolTimeout) and (exc.peer == stalled or stalled in exc.missing_ranks)
    in_time = isinstance(exc, ProtocolTimeout) and STALL_TIMEOUT_S <= time_to_error_s <= STALL_TIMEOUT_S + STALL_SLACK_S
    max_time_s = comm.allreduce(time_to_error_s, op=MAX)
    num_named = comm.allreduce(int(named), op=SUM)
    figure(f"[figure] stall: ranks={world_size} stalled_rank={stalled} stall_chunk={stall_chunk} "
           f"timeout_s={STALL_TIMEOUT_S} errors_naming_it={num_named}/{world_size} "
           f"max_time_to_error_s={max_time_s:.2f} mismatches_before={comm.allreduce(stats.mismatches)}")
    if rank == 0 and isinstance(exc, ProtocolTimeout):
        figure(f"[figure] stall: rank 0's error: {exc}")
    check(comm, named and in_time and stats.mismatches == 0,
          f"expected a ProtocolTimeout naming rank {stalled} within {STALL_TIMEOUT_S}+{STALL_SLACK_S} s; "
          f"got {outcome.error or 'no error'} after {time_to_error_s:.2f} s, {stats.mismatches} mismatches")
    _clean_run(ctx, comm, seed, type(outcome)(), check)


@pytest.mark.mpi
@pytest.mark.parametrize("x_format", ["fp8_e4m3", "bf16"])
def test_bad_inputs_rejected_and_ring_usable(ctx, comm, seed, outcome, check, figure, x_format):
    """Every kind of bad input raises ConfigError on every rank, leaves the rank's ring bytes unchanged,
    and the same ring then completes its call and more calls with every payload bitwise."""
    spec = RingSpec(num_slots=2, tokens_per_slot=8, hidden=64, num_topk=4, num_experts=8, x_format=x_format,
                    sf_group_size=32)
    other_spec = RingSpec(num_slots=3, tokens_per_slot=8, hidden=64, num_topk=4, num_experts=8,
                          x_format=x_format, sf_group_size=32)
    workload = Workload(tokens_per_rank=[13 + 3 * r for r in range(comm.Get_size())],
                        ack_policy=AckPolicy.CONSERVATIVE)
    rng = np.random.default_rng([seed, comm.Get_rank()])
    stats = Stats()
    not_rejected = []
    with Ring(ctx, spec) as ring, Ring(ctx, other_spec) as other:
        other_call = other.begin_call(2)
        num_chunks = protocol.call_num_chunks(workload.tokens_per_rank, spec.tokens_per_slot)
        call = ring.begin_call(num_chunks)
        ring.acquire_slot(call, 0)
        before = own_bytes(ring)
        cases = bad_inputs(ring, call, 0, other_call)
        for what, thunk in cases:
            try:
                thunk()
                not_rejected.append(what)
            except ConfigError as exc:
                if not str(exc):
                    not_rejected.append(f"{what} (empty message)")
        unchanged = bool(np.array_equal(before, own_bytes(ring)))

        def finish():
            for op, chunk in protocol.enqueue_order(num_chunks, spec.num_slots):
                if op == "produce":
                    produce(ring, call, chunk, workload.tokens_per_rank[ring.rank], workload.routing, lambda: None,
                            rng, acquire=chunk != 0)
                else:
                    consume(ring, call, chunk, workload, stats, lambda: None, rng)
            ring.end_call(call)
            workload.calls_chunks = [num_chunks, 1, num_chunks + 2]
            run_workload(ring, workload, seed, stats)

        outcome.run(finish)
        other.end_call(other_call)
    figure(f"[figure] bad_inputs[{x_format}]: ranks={comm.Get_size()} kinds={len(cases)} "
           f"rejected={len(cases) - len(not_rejected)} ring_bytes_unchanged={unchanged} "
           f"slot_uses_checked_after={comm.allreduce(stats.slot_uses_checked)} "
           f"mismatches={comm.allreduce(stats.mismatches)}")
    check(comm, not not_rejected and unchanged and not outcome.error and stats.mismatches == 0,
          f"not rejected: {not_rejected}; bytes unchanged: {unchanged}; error: {outcome.error}; "
          f"mismatches: {stats.mismatches} ({stats.first_mismatch})")


@pytest.mark.mpi
def test_ranks_with_different_specs_rejected(ctx, comm, check):
    """A RingSpec that differs on one rank is a ConfigError on every rank (with one rank: accepted)."""
    world_size = comm.Get_size()
    hidden = 64 if comm.Get_rank() == world_size - 1 and world_size > 1 else 32
    spec = RingSpec(num_slots=2, tokens_per_slot=4, hidden=hidden, num_topk=2, num_experts=8, sf_group_size=16)
    error = ""
    try:
        Ring(ctx, spec).close()
    except ConfigError as exc:
        error = str(exc)
    expect_error = world_size > 1
    ok = bool(error) == expect_error and (not expect_error or f"ranks [{world_size - 1}]" in error)
    check(comm, ok, f"expected {'a ConfigError naming the odd rank' if expect_error else 'no error'}; "
                    f"got {error!r}")
