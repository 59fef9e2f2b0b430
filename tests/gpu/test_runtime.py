"""NvshmemBackend: symmetric allocations, zero-copy CuPy/torch views of own and peer copies, and the host
primitives (signal_set/add, atomic_or, read_word, bounded wait_until, fence) over 1..N PEs."""

from __future__ import annotations

import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="GPU tests need CuPy (and a GPU, nvshmem4py); skipped here")

from gpu_helpers import collective  # noqa: E402
from symmring.errors import ConfigError  # noqa: E402


@collective
def test_alloc_is_zero_and_peer_views_see_each_rank_bitwise(backend, seed):
    R, me = backend.world_size, backend.rank
    nbytes = 1 << 16
    alloc = backend.alloc(nbytes)
    try:
        mine = backend.view(alloc, me, 0, np.uint8, (nbytes,))
        zero_ok = int(cupy.count_nonzero(mine)) == 0
        data = np.random.default_rng([seed, me]).integers(0, 256, nbytes, dtype=np.uint8)
        mine.set(data)
        backend.barrier()
        peers_ok = all(
            np.array_equal(backend.view(alloc, r, 0, np.uint8, (nbytes,)).get(),
                           np.random.default_rng([seed, r]).integers(0, 256, nbytes, dtype=np.uint8))
            for r in range(R))
        backend.barrier()
    finally:
        backend.free(alloc)
    assert zero_ok and peers_ok, (zero_ok, peers_ok)


@collective
def test_torch_view_shares_memory_with_cupy_view(backend, seed):
    torch = pytest.importorskip("torch")
    alloc = backend.alloc(4096)
    try:
        words = backend.view(alloc, backend.rank, 128, np.int32, (64,))
        tensor = backend.torch_view(alloc, backend.rank, 128, np.int32, (64,))
        values = np.random.default_rng(seed).integers(-2**31, 2**31 - 1, 64, dtype=np.int32)
        tensor.copy_(torch.from_numpy(values).cuda())
        torch.cuda.synchronize()
        ok = tensor.data_ptr() == words.data.ptr and np.array_equal(words.get(), values)
        backend.barrier()
    finally:
        backend.free(alloc)
    assert ok


@collective
def test_word_primitives_across_ranks(backend, seed):
    R, me = backend.world_size, backend.rank
    alloc = backend.alloc(8 * (2 * R + 2))
    try:
        value = int(np.random.default_rng([seed, me]).integers(1, 2**62))
        right = (me + 1) % R
        backend.signal_set(alloc, 8 * me, value, right)            # word `me` on my right neighbour
        backend.atomic_or(alloc, 8 * (2 * R), 1 << me, 0)          # every rank's bit on rank 0
        backend.signal_add(alloc, 8 * (2 * R + 1), me + 1, 0)      # 1 + 2 + ... + R on rank 0
        backend.fence()
        backend.barrier()
        left = (me - 1) % R
        expected_left = int(np.random.default_rng([seed, left]).integers(1, 2**62))
        ok = backend.read_word(alloc, 8 * left, me) == expected_left
        ok &= backend.read_word(alloc, 8 * (2 * R), 0) == (1 << R) - 1
        ok &= backend.read_word(alloc, 8 * (2 * R + 1), 0) == R * (R + 1) // 2
        satisfied, observed = backend.wait_until(alloc, 8 * left, me, "eq", expected_left, 5.0)
        ok &= satisfied and observed == expected_left
        backend.barrier()
    finally:
        backend.free(alloc)
    assert ok


@collective
def test_wait_until_is_bounded_and_reports_what_it_saw(backend):
    alloc = backend.alloc(64)
    try:
        backend.signal_set(alloc, 0, 7, backend.rank)
        start = time.monotonic()
        satisfied, observed = backend.wait_until(alloc, 0, backend.rank, "ge", 8, 0.2)
        elapsed = time.monotonic() - start
        ok = (not satisfied) and observed == 7 and 0.2 <= elapsed < 5.0
        ok &= backend.wait_until(alloc, 0, backend.rank, "lt", 8, 0.2) == (True, 7)
        backend.barrier()
    finally:
        backend.free(alloc)
    assert ok, (satisfied, observed, elapsed)


@collective
def test_bad_arguments_raise_config_error_before_any_work(backend):
    alloc = backend.alloc(64)
    try:
        cases = [lambda: backend.alloc(0),
                 lambda: backend.view(alloc, backend.rank, 32, np.uint64, (8,)),
                 lambda: backend.view(alloc, backend.world_size, 0, np.uint8, (8,)),
                 lambda: backend.signal_set(alloc, 4, 1, backend.rank),
                 lambda: backend.wait_until(alloc, 0, backend.rank, "approx", 1, 1.0),
                 lambda: backend.wait_until(alloc, 0, backend.rank, "eq", 1, 0.0)]
        raised = []
        for case in cases:
            try:
                case()
                raised.append(False)
            except ConfigError:
                raised.append(True)
        ok = all(raised) and backend.read_word(alloc, 0, backend.rank) == 0
        backend.barrier()
    finally:
        backend.free(alloc)
    assert ok, raised
