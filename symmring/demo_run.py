"""The run both demos share (``python -m symmring demo`` and ``demo --model``, `symmring.demo` and
`symmring.demo_model`): the MPI world's `Reporter`, the backend's start and the ``demo: FAIL`` ending."""

from __future__ import annotations

import logging
from typing import Optional, Tuple

from .errors import ConfigError, SymmringError

log = logging.getLogger(__name__)


class Reporter:
    """Rank 0 prints; every rank logs."""

    def __init__(self, comm):
        from . import mpi
        self.comm = comm
        self.rank = comm.Get_rank()
        self._MPI = mpi.namespace_of(comm)

    def say(self, line: str) -> None:
        log.debug(line)
        if self.rank == 0:
            print(line, flush=True)

    def all_ok(self, ok: bool) -> bool:
        return bool(self.comm.allreduce(int(bool(ok)), op=self._MPI.MIN))

    def max(self, value: float) -> float:
        return float(self.comm.allreduce(float(value), op=self._MPI.MAX))

    def sum(self, value: int) -> int:
        return int(self.comm.allreduce(int(value), op=self._MPI.SUM))

    def fsum(self, value: float) -> float:
        return float(self.comm.allreduce(float(value), op=self._MPI.SUM))


def _backend_reason(requested: str) -> str:
    from .info import auto_backend
    if requested != "auto":
        return f"--backend {requested}"
    return auto_backend()[1]


def world_reporter() -> Optional[Reporter]:
    """The demo's first step (``demo`` and ``demo --model``): a `Reporter` on MPI's world communicator, or None
    after rank 0 of the launch printed ``demo: FAIL`` (no MPI library under a multi-rank launch; exit 1)."""
    from . import mpi
    try:
        return Reporter(mpi.load().COMM_WORLD)
    except SymmringError as exc:  # no MPI library under a multi-rank launch
        if mpi.launcher_rank() == 0:
            print(f"demo: FAIL {exc}", flush=True)
        return None


def start(backend: str, report: Reporter) -> Optional[Tuple[object, Reporter, str]]:
    """Initialise the ``--backend`` (``demo`` and ``demo --model``): (the context, a `Reporter` on its
    communicator, why that backend), or None after ``demo: FAIL`` on ``report`` (exit 1)."""
    from .context import init
    reason = _backend_reason(backend)
    try:
        ctx = init(backend)
    except SymmringError as exc:
        report.say(f"demo: FAIL could not initialise the {backend} backend: {exc}")
        return None
    return ctx, Reporter(ctx.comm), reason


def fail(ctx, report, exc) -> int:
    """The demo's end after a symmring error in its run (``demo`` and ``demo --model``): the ``demo: FAIL`` line,
    the context closed, and the exit status (2 for a bad configuration, which every rank raises; else 1)."""
    if isinstance(exc, ConfigError):
        report.say(f"demo: FAIL bad configuration: {exc}")
        status = 2
    else:
        log.error("rank %d: %s", ctx.rank, exc)
        report.say(f"demo: FAIL {type(exc).__name__}: {exc}")
        status = 1
    ctx.close()
    return status
