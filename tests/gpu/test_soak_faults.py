"""Issue 33's soak on the GPU layer: steps of three layers (two of one shape, sharing a ring, and one of another),
random per-rank counts (zero included), faults injected in turn -- a call refused on one PE inside a step, a
stalled PE (its consumer spins twice the device bound, ``consumer_delay_ns``), a late host (1.5 times the device
bound before the step, within the host bound) -- and every output row checked against the NumPy reference.
It prints one line of counts and requires: no wrong row returned without an error (none finite from a call that
did not raise), every refused call and stall raised on every PE within two steps, every late host absorbed (no
error, right rows), every step after a reset right, no error without a fault.

Needs 2 or more PEs (a PE alone cannot stall itself past a bound). ``test_soak_short`` (300 steps) runs with the
other GPU tests; ``test_soak_long`` is marked slow (CI's ``-m "not slow"`` skips it): 5,000 steps by default,
``SYMMRING_SOAK_STEPS`` to change it. On 3 PEs under MPS::

    python -m symmring.launch --mps -n 3 -- python -m mpi4py -m pytest tests/gpu/test_soak_faults.py -q -s -m slow
"""

from __future__ import annotations

import os
import time

import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import verdict  # noqa: E402
from layer_sets import MAX_TOKENS, SEED, GpuLayers, silent_rows  # noqa: E402

pytestmark = pytest.mark.gpu

#: Every token bucket twice (the graph cache captures on a bucket's second call), then a step of zeros: the
#: captures happen before the first fault.
WARMUP = [b for b in (1, 2, 4, 8, 16, 32, MAX_TOKENS) for _ in range(2)] + [0]


def run_soak(ctx, steps: int, fault_every: int):
    if ctx.world_size < 2:
        pytest.skip("the soak needs 2 or more PEs (a PE alone cannot stall past its own bound)")
    layers = GpuLayers(ctx, SEED)
    start = time.monotonic()
    try:
        result = silent_rows.soak(layers, seed=SEED, steps=steps, fault_every=fault_every, warmup_counts=WARMUP,
                                  allgather=ctx.comm.allgather)
    finally:
        layers.close()
    if ctx.rank == 0:
        print("\n" + result.line(f"soak [GPU, {ctx.world_size} PEs, {time.monotonic() - start:.0f} s]"))
        for problem in result.problems[:20]:
            print(f"  {problem}")
    ok = (result.silent_wrong_rows == result.finite_wrong_rows == 0 and not result.problems
          and result.raised_everywhere["refused"] == result.faults["refused"]
          and result.raised_everywhere["stall"] == result.faults["stall"]
          and result.late_absorbed == result.faults["late_host"] and result.right_after_reset == result.resets
          and all(result.faults.values()))
    verdict(ctx, ok, result.line("soak") + "; " + "; ".join(result.problems[:5]))


def test_soak_short(ctx):
    run_soak(ctx, steps=300, fault_every=20)


@pytest.mark.slow
def test_soak_long(ctx):
    run_soak(ctx, steps=int(os.environ.get("SYMMRING_SOAK_STEPS", 5000)), fault_every=50)
