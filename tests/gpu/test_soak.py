"""Integrity soak through a 2-slot ring with kernels that use only <symmring/protocol.cuh> (a "user"
producer and consumer, tests/gpu/user_kernels.cu): at least 100,000 slot uses over all PEs, every word
checked in place against a hash of (rank, chunk, generation), random producer and consumer delays,
zero-token chunks, route and layout published in alternating order. Mismatches must be 0."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy (and a GPU, nvshmem4py); skipped here")

from gpu_helpers import collective, errors_of, small_spec, total, user_num_valid  # noqa: E402
from symmring.kernels import DeviceRing  # noqa: E402

#: Slot uses (publications) over all PEs per soak.
SLOT_USES = 100_000


@pytest.mark.parametrize("max_delay_ns", [0, 2000])
@collective
def test_soak_user_kernels_two_slot_ring(backend, user_module, seed, max_delay_ns):
    R = backend.world_size
    spec = small_spec("fp8_e4m3", num_slots=2, tokens_per_slot=8)
    num_chunks = math.ceil(SLOT_USES / R)
    ring = DeviceRing(backend, spec, timeout_s=30.0)
    # Defaults so that a rank whose soak raised still joins the collectives below with the others.
    error, mismatches, reads, checked_bytes, produced, zero_chunks, gen_ok, elapsed = None, 0, 0, 0, 0, 0, False, 0.0
    try:
        k = ring.kernels
        base = k.gen_base()
        stats = cupy.zeros(4, dtype=cupy.uint64)
        backend.barrier()
        start = time.monotonic()
        # Block 0 produces, block 1 consumes: both resident, so the ring's back-pressure is exercised.
        user_module.function("user_soak")((2,), (256,), (k.desc, np.int32(num_chunks), np.uint32(max_delay_ns),
                                                         np.uint64(seed), stats))
        k.end_call(num_chunks)
        cupy.cuda.runtime.deviceSynchronize()
        elapsed = time.monotonic() - start
        error = errors_of(k)
        mismatches, reads, checked_bytes, produced = (int(v) for v in stats.get())
        zero_chunks = sum(user_num_valid(backend.rank, c, spec.tokens_per_slot) == 0 for c in range(num_chunks))
        gen_ok = k.gen_base() == base + num_chunks
    except Exception as exc:  # reported by the asserts below, after the collectives
        error = f"{type(exc).__name__}: {exc}"
    finally:
        ring.close()
    # Every rank makes the same collectives, in the same order (a rank-0-only allreduce hangs the others).
    uses, all_reads, all_mismatches = total(produced), total(reads), total(mismatches)
    all_bytes, all_zero_chunks = total(checked_bytes), total(zero_chunks)
    if backend.rank == 0:
        print(f"\nsoak (max delay {max_delay_ns} ns, {R} PE(s)): {uses} slot uses, {all_reads} slot reads, "
              f"{all_bytes} bytes checked, {all_zero_chunks} zero-token chunks, "
              f"{all_mismatches} mismatches, {elapsed:.2f} s ({elapsed * 1e6 / num_chunks:.2f} us per chunk)")
    assert error is None, error
    assert mismatches == 0 and produced == num_chunks and reads == num_chunks * R, (mismatches, produced, reads)
    assert zero_chunks > 0 and gen_ok and uses >= SLOT_USES, (zero_chunks, gen_ok, uses)
