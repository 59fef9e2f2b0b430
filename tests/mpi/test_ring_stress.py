"""Stress the ring protocol across ranks: every byte of every slot use is checked against its source.

Run (every rank runs every test; the figure lines are printed by rank 0)::

    mpiexec -n 4 python -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider
    SYMMRING_STRESS_WRAPS=100000 mpiexec -n 2 python -m mpi4py -m pytest tests/mpi -m slow -q -s

Payload values are a hash of (source rank, generation, row, column), so a row from an earlier lap, call
or rank is caught; random seeded delays before publish, read, ack and reuse shuffle the interleavings.
"""

from __future__ import annotations

import os
import time

import pytest
from rankworld import MAX
from ringdriver import Stats, Workload, figure_line, run_workload, tokens_for

from symmring import RingSpec
from symmring.protocol import AckPolicy
from symmring.ring import Ring

#: Wraps of every slot in the CI soak (each slot is used this many times + 1).
CI_WRAPS = 1000


def _run(ctx, comm, spec, workload, seed, outcome, check, figure, name, **extra):
    """Run ``workload`` on a fresh ring on every rank, print the figure line, and assert collectively."""
    ring = Ring(ctx, spec, ack_policy=workload.ack_policy)
    comm.Barrier()
    start_s = time.monotonic()
    stats = outcome.run(run_workload, ring, workload, seed) or Stats()
    elapsed_s = comm.allreduce(time.monotonic() - start_s, op=MAX)
    ring.close()
    total = stats.reduce(comm)
    figure(figure_line(name, comm.Get_size(), total, elapsed_s, **extra))
    ok = not outcome.error and stats.mismatches == 0
    check(comm, ok, outcome.error or f"{stats.mismatches} mismatches; first: {stats.first_mismatch}")
    return total



def _soak_chunks(num_slots: int, wraps: int):
    """Chunk counts of the soak's calls: varying counts (generations carry across calls) totalling
    ``num_slots * (wraps + 1)`` uses, so every slot wraps at least ``wraps`` times."""
    uses = [0] * num_slots
    counts, pattern = [], [1, 7, 2, 13, 3, 64, 5]
    while min(uses) < wraps + 1:
        n = pattern[len(counts) % len(pattern)]
        counts.append(n)
        for chunk in range(n):  # chunks restart at slot 0 in every call
            uses[chunk % num_slots] += 1
    return counts


@pytest.mark.mpi
@pytest.mark.parametrize("ack_policy", list(AckPolicy), ids=lambda p: p.name.lower())
def test_soak_two_slots_wrap(ctx, comm, seed, outcome, check, figure, ack_policy):
    """A 2-slot ring; every slot wraps >= CI_WRAPS times across calls of varying chunk counts, with
    random delays; all payloads bitwise equal."""
    spec = RingSpec(num_slots=2, tokens_per_slot=4, hidden=32, num_topk=8, num_experts=16, sf_group_size=16)
    chunks = _soak_chunks(spec.num_slots, CI_WRAPS)
    workload = Workload(tokens_per_rank=[1] * comm.Get_size(), ack_policy=ack_policy, calls_chunks=chunks,
                        delay_probability=0.02, delay_max_s=0.002)
    total = _run(ctx, comm, spec, workload, seed, outcome, check, figure, f"soak[{ack_policy.name}]",
                 calls=len(chunks))
    check(comm, total.min_uses_per_slot >= CI_WRAPS + 1,
          f"each slot used only {total.min_uses_per_slot} times; expected >= {CI_WRAPS + 1}")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(0)  # minutes to hours by design: bounded by the protocol timeouts, not pytest-timeout
def test_soak_long(ctx, comm, seed, outcome, check, figure):
    """The long soak: ``SYMMRING_STRESS_WRAPS`` (default 100,000) wraps of each slot of a 2-slot ring."""
    wraps = int(os.environ.get("SYMMRING_STRESS_WRAPS", "100000"))
    spec = RingSpec(num_slots=2, tokens_per_slot=2, hidden=16, num_topk=2, num_experts=4, sf_group_size=16)
    workload = Workload(tokens_per_rank=[1] * comm.Get_size(), calls_chunks=_soak_chunks(2, wraps),
                        delay_probability=0.001, delay_max_s=0.001)
    total = _run(ctx, comm, spec, workload, seed, outcome, check, figure, "soak_long")
    check(comm, total.min_uses_per_slot >= wraps + 1, f"slots used {total.min_uses_per_slot} times")


# name: (tokens kind, routing, num_topk, x_format, num_slots, extra zero-valid chunks)
CASES = {
    "topk1_uniform": ("even", "uniform", 1, "fp8_e4m3", 3, 0),
    "topk8_uniform": ("even", "uniform", 8, "fp8_e4m3", 2, 0),
    "skewed_one_expert": ("uneven", "skewed", 8, "fp8_e4m3", 3, 0),
    "masked_experts": ("partial_last", "masked", 4, "bf16", 2, 0),
    "partial_last_chunk": ("partial_last", "uniform", 2, "fp8_e4m3", 4, 0),
    "uneven_tokens": ("uneven", "uniform", 2, "bf16", 3, 0),
    "zero_token_rank": ("zero_rank", "uniform", 2, "fp8_e4m3", 2, 2),
    "zero_tokens_everywhere": ("zero_all", "uniform", 2, "fp8_e4m3", 2, 3),
}


@pytest.mark.mpi
@pytest.mark.parametrize("ack_policy", list(AckPolicy), ids=lambda p: p.name.lower())
@pytest.mark.parametrize("case", sorted(CASES))
def test_token_distributions(ctx, comm, seed, outcome, check, figure, case, ack_policy):
    """Zero-token ranks, zero-valid chunks, uneven counts, partial last chunks, top-k 1 and 8, skewed and
    masked routing, fp8 and bf16: every chunk from every rank arrives bitwise, over three calls."""
    kind, routing, num_topk, x_format, num_slots, extra_chunks = CASES[case]
    spec = RingSpec(num_slots=num_slots, tokens_per_slot=8, hidden=64, num_topk=num_topk, num_experts=16,
                    x_format=x_format, sf_group_size=32)
    tokens = tokens_for(kind, comm.Get_size(), spec.tokens_per_slot)
    num_chunks = -(-max(tokens) // spec.tokens_per_slot) + extra_chunks
    workload = Workload(tokens_per_rank=tokens, routing=routing, ack_policy=ack_policy,
                        calls_chunks=[num_chunks] * 3, delay_probability=0.1, delay_max_s=0.002)
    total = _run(ctx, comm, spec, workload, seed, outcome, check, figure, f"{case}[{ack_policy.name}]",
                 tokens=tokens)
    expected_uses = 3 * num_chunks * comm.Get_size() ** 2
    check(comm, total.slot_uses_checked == expected_uses,
          f"checked {total.slot_uses_checked} slot uses; expected {expected_uses}")
