"""Fixtures of the multi-process ring tests.

These tests are ordinary pytest files: under ``mpiexec -n N python -m mpi4py -m pytest tests/mpi`` or
``torchrun --standalone --nproc-per-node N -m pytest tests/mpi`` every rank runs every test (``-m mpi4py``
aborts all ranks if one dies, and so does torchrun's agent, instead of leaving them hanging), and a plain
``pytest`` run collects them too and runs them as a world of 1 (choice documented in docs/CPU_BACKEND.md: the
one-rank run keeps them importable and correct everywhere; tests/test_under_mpi.py runs them with 2, 3 and 4
ranks under mpiexec, tests/test_under_torchrun.py with 2 and 3 under torchrun). The tests never name the launcher: ``comm`` is a
`rankworld.RankWorld` (tests/rankworld.py) over whichever ranks `symmring.init` joined. Every test reaches one
verdict on all ranks (`verdict`).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: figures
import figures  # noqa: E402
from rankworld import MIN, RankWorld  # noqa: E402

from symmring.context import init  # noqa: E402

#: Base seed; ``SYMMRING_TEST_SEED`` changes it (every test derives its own streams from it).
DEFAULT_SEED = 20261129


@pytest.fixture(scope="session")
def ctx():
    """One host-backend context for the whole session (collective)."""
    context = init("host")
    yield context
    context.close()


@pytest.fixture(scope="session")
def comm(ctx):
    """The ranks' verdict collectives (`rankworld.RankWorld` (tests/rankworld.py); a world of 1 under plain pytest)."""
    world = RankWorld.of(ctx)
    yield world
    world.close()


@pytest.fixture
def seed(request):
    """A per-test seed, the same on every rank."""
    base = int(os.environ.get("SYMMRING_TEST_SEED", DEFAULT_SEED))
    return base + sum(map(ord, request.node.name))


@pytest.fixture
def figure(comm, request):
    """``figure(line)`` records a figure line once (rank 0): to the figure log, and on the terminal with -s or
    -v (tests/figures.py)."""
    def emit(line: str) -> None:
        if comm.Get_rank() == 0:
            figures.emit(request.config, line)
    return emit


class Outcome:
    """Runs a rank's part of a test, catching its exception so every rank reaches the collective verdict."""

    def __init__(self):
        self.error = ""
        self.exception = None

    def run(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported collectively by verdict()
            self.exception = exc
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            return None


@pytest.fixture
def outcome():
    return Outcome()


def verdict(comm, ok: bool, message: str = "") -> None:
    """Collective assert: fails on every rank if it failed on any, showing each failing rank's message."""
    all_ok = comm.allreduce(int(bool(ok)), op=MIN)
    messages = comm.allgather("" if ok else (message or "failed"))
    if not all_ok:
        detail = "\n".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m)
        pytest.fail(f"failed on ranks {[r for r, m in enumerate(messages) if m]}:\n{detail}", pytrace=False)


@pytest.fixture
def check():
    """``check(comm, ok, message)``: the collective assert (`verdict`)."""
    return verdict

