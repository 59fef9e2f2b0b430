"""Without an MPI library, one process still runs (symmring.mpi's world of one); several ranks are refused
in one line.

The in-process tests drive the stand-in communicator directly (this process has a real MPI); the
subprocess tests hide the MPI library from mpi4py (``MPI4PY_LIBMPI`` pointing at no file), which is what
``pip install symmring`` without the ``mpi`` extra looks like on a machine without a system MPI.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from symmring import ConfigError, Experts, MoE, RingSpec, RoutingConfig, ScheduleConfig, init
from symmring.backends.host import HostBackend
from symmring.mpi import STANDIN, is_standin, namespace_of
from symmring.ring import Ring

NO_LIBMPI = {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                                                            "OMPI_COMM_WORLD_RANK", "PYTEST_ADDOPTS")}
    env.update(extra)
    return env


def test_standin_primitives_match_the_host_backend_contract():
    """Set/add (wrapping at 2**64)/or/read on words of the stand-in window, bounded waits, one rank."""
    backend = HostBackend(STANDIN.COMM_WORLD)
    assert (backend.rank, backend.world_size, backend.memory._MPI) == (0, 1, STANDIN)
    alloc = backend.alloc(256)
    assert backend.view(alloc, 0, 0, np.uint8, (256,)).ctypes.data % 64 == 0
    backend.signal_set(alloc, 8, 2**64 - 1, 0)
    backend.signal_add(alloc, 8, 3, 0)
    backend.atomic_or(alloc, 16, 0b1010, 0)
    backend.atomic_or(alloc, 16, 0b0110, 0)
    assert (backend.read_word(alloc, 8, 0), backend.read_word(alloc, 16, 0)) == (2, 0b1110)
    assert backend.wait_until(alloc, 16, 0, "eq", 0b1110, 0.05) == (True, 0b1110)
    assert backend.wait_until(alloc, 16, 0, "gt", 0b1110, 0.05) == (False, 0b1110)
    with pytest.raises(ConfigError):
        backend.view(alloc, 1, 0, np.uint8, (1,))  # there is no rank 1
    backend.finalize()


def test_standin_runs_the_ring_and_the_layer_bitwise_like_real_mpi():
    """The same ring round trip and MoE layer on the stand-in and on MPI.COMM_WORLD (one rank) agree bit
    for bit."""
    rng = np.random.default_rng(7)
    wg, wu = (rng.standard_normal((4, 32, 128), dtype=np.float32) / 11 for _ in range(2))
    wd = rng.standard_normal((4, 128, 32), dtype=np.float32) / 6
    x = rng.standard_normal((37, 128), dtype=np.float32)
    router = rng.standard_normal((4, 128), dtype=np.float32)
    outputs = {}
    for label, comm in (("standin", STANDIN.COMM_WORLD), ("mpi", None)):
        with init("host", comm=comm, timeout_s=10.0) as ctx:
            assert is_standin(ctx.comm) == (label == "standin")
            assert (namespace_of(ctx.comm) is STANDIN) == (label == "standin")
            with Ring(ctx, RingSpec(num_slots=2, tokens_per_slot=4, hidden=128, num_topk=2, num_experts=8,
                                    x_format="bf16")) as ring:
                bits = rng.integers(0, 2**16, (4, 128), dtype=np.uint16)
                call = ring.begin_call(1)
                ring.acquire_slot(call, 0)
                ring.write_route(call, 0, np.zeros((4, 2), np.int32), np.ones((4, 2), np.float32), 0, 4)
                ring.write_layout(call, 0, bits)
                ring.publish_route(call, 0)
                ring.publish_layout(call, 0)
                ring.wait_ready(call, 0, 0)
                assert np.array_equal(ring.read(call, 0, 0).x, bits)
                ring.ack(call, 0, 0)
                ring.end_call(call)
            with MoE(ctx, Experts(wg, wu, wd), RoutingConfig(4, 2), max_tokens=37,
                     schedule=ScheduleConfig(tokens_per_slot=5, x_format="fp8_e4m3")) as layer:
                outputs[label] = (layer.forward(x, router_weight=router), layer.forward(x, router_weight=router,
                                                                                        streaming=True))
    for a, b in zip(outputs["standin"], outputs["mpi"]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_demo_and_info_without_an_mpi_library(tmp_path):
    """One process: demo passes, info says there is no MPI library and which extra brings one."""
    env = _clean_env(**NO_LIBMPI)
    demo = subprocess.run([sys.executable, "-m", "symmring", "demo", "--tokens", "24", "--repeats", "0"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    lines = demo.stdout.strip().splitlines()
    assert demo.returncode == 0 and lines[-1].startswith("demo: PASS backend=host ranks=1"), demo.stdout + demo.stderr
    assert "process memory, no MPI library" in demo.stdout
    assert "Traceback" not in demo.stderr and 'pip install "symmring[mpi]"' in demo.stderr, demo.stderr
    info = subprocess.run([sys.executable, "-m", "symmring", "info"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert info.returncode == 0, info.stdout + info.stderr
    mpi_line = next(line for line in info.stdout.splitlines() if line.startswith("mpi4py:"))
    assert "MPI library: none" in mpi_line and 'pip install "symmring[mpi]"' in mpi_line, mpi_line


def test_several_ranks_without_an_mpi_library_fail_in_one_line(tmp_path):
    """Started as one of several ranks (PMI_SIZE=3) without an MPI library: no fallback, one line, no
    traceback; rank 0 says it, the other ranks stay silent."""
    for rank, expect_line in ((0, True), (2, False)):
        env = _clean_env(PMI_SIZE="3", PMI_RANK=str(rank), **NO_LIBMPI)
        run = subprocess.run([sys.executable, "-m", "symmring", "demo", "--tokens", "8"], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path, env=env)
        assert run.returncode == 1, run.stdout + run.stderr
        assert "Traceback" not in run.stdout + run.stderr
        lines = run.stdout.strip().splitlines()
        if expect_line:
            assert len(lines) == 1 and lines[0].startswith("demo: FAIL this process is one of 3 ranks"), lines
            assert 'pip install "symmring[mpi]"' in lines[0]
        else:
            assert lines == []
