"""The run both demos share (``python -m symmring demo`` and ``demo --model``, `symmring.demo` and
`symmring.demo_model`): the ranks' `Reporter` (whichever launcher started them), the backend's start and the
``demo: FAIL`` ending."""

from __future__ import annotations

import logging
import math
from typing import Optional, Tuple

from .errors import ConfigError, SymmringError

log = logging.getLogger(__name__)


class Reporter:
    """Rank 0 prints; every rank logs. Its reductions are bounded exchanges (`symmring.collective.Collectives`)
    over the demo's ranks, on a channel of its own: whichever launcher started them (mpirun, torchrun)."""

    def __init__(self, ranks, chan):
        self.ranks = ranks  # what symmring.init joins (`symmring.world.resolve`)
        self.chan = chan
        self.rank, self.size = chan.rank, chan.world_size

    def say(self, line: str) -> None:
        log.debug(line)
        if self.rank == 0:
            print(line, flush=True)

    def allgather(self, value):
        return self.chan.allgather(value, what="demo: report")

    def all_ok(self, ok: bool) -> bool:
        return all(self.allgather(bool(ok)))

    def max(self, value: float) -> float:
        return max(float(v) for v in self.allgather(float(value)))

    def sum(self, value: int) -> int:
        return sum(int(v) for v in self.allgather(int(value)))

    def fsum(self, value: float) -> float:
        return math.fsum(float(v) for v in self.allgather(float(value)))

    def barrier(self) -> None:
        self.chan.barrier(what="demo: barrier")

    def close(self) -> None:
        self.chan.close()


def _backend_reason(requested: str) -> str:
    from .info import auto_backend
    if requested != "auto":
        return f"--backend {requested}"
    return auto_backend()[1]


def world_reporter() -> Optional[Reporter]:
    """The demo's first step (``demo`` and ``demo --model``): its ranks (`symmring.world.resolve`: MPI's world
    under mpirun, torchrun's workers under torchrun, else one process) and a `Reporter` on
    them, or None after the launcher's rank 0 printed ``demo: FAIL`` (e.g. no MPI library under a multi-rank
    MPI launch; exit 1)."""
    from . import env, world
    from .collective import Collectives
    try:
        ranks = world.resolve(timeout_s=env.host_timeout_s())
        return Reporter(ranks, Collectives(ranks, env.host_timeout_s(), what="demo: start"))
    except SymmringError as exc:
        if world.launcher_rank() == 0:
            print(f"demo: FAIL {exc}", flush=True)
        return None


def start(backend: str, report: Reporter) -> Optional[Tuple[object, Reporter, str]]:
    """Initialise the ``--backend`` on the report's ranks (``demo`` and ``demo --model``): (the context, the
    `Reporter`, why that backend), or None after ``demo: FAIL`` on ``report`` (exit 1)."""
    from . import world
    from .context import init
    reason = _backend_reason(backend)
    try:
        ctx = init(backend, **world.init_kwargs(report.ranks))
    except SymmringError as exc:
        report.say(f"demo: FAIL could not initialise the {backend} backend: {exc}")
        return None
    return ctx, report, reason


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
