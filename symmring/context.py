"""Process-wide setup: pick a backend, join the ranks, and hand out a `Context`.

The ranks are an mpi4py communicator (``mpirun``) or a torch.distributed ProcessGroup (``torchrun``, or any
torch job): `symmring.world` says which when neither is given. Nothing happens at import: `init()` does the
work (it imports mpi4py or torch.distributed, and symmring.backends.nvshmem for the GPU backend, only then).

Example:
    >>> import symmring
    >>> with symmring.init(backend="host") as ctx:
    ...     print(ctx.rank, ctx.world_size, ctx.backend.name)
    0 1 host
"""

from __future__ import annotations

import logging
from typing import Optional

from . import env
from .backends.base import Backend
from .closing import Closing
from .collective import Collectives
from .errors import BackendError, ConfigError, RingClosedError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "host", "nvshmem")

#: The context made by the last `init()`, closed by `finalize()`.
_current: Optional["Context"] = None


class Context(Closing):
    """This process's place in the ring world: its backend, rank and bounds.

    Attributes:
        backend: the `symmring.backends.Backend` (host or nvshmem).
        rank, world_size, local_rank: this process's rank, the number of ranks, its rank on its node.
        device: human-readable device (``"cpu"`` or the GPU).
        ranks: what `init` joined (`symmring.world`): an mpi4py communicator, a torch.distributed
            ProcessGroup, or torchrun's workers (`symmring.world.StoreRanks`, when the program made no group).
        comm: the mpi4py communicator of the ranks (MPI's, or `symmring.mpi`'s stand-in for a process alone),
            or None under torch.distributed.
        group: the torch.distributed ProcessGroup of the ranks, or None (MPI, or torchrun without a group).
        collectives: the bounded host collectives over them (`symmring.collective.Collectives`): every
            barrier and exchange of the rings and layers goes through them, whichever the launcher.
        timeout_s: bound of every protocol wait (host-driven and on the device), in seconds.
        host_timeout_s: bound of every host collective (`collectives`), in seconds.
        closed: whether `close()` ran.
    """

    def __init__(self, backend: Backend, comm, timeout_s: float, collectives: Optional[Collectives] = None, *,
                 group=None):
        self.backend = backend
        self.comm = comm
        self.group = group
        self.collectives = collectives if collectives is not None else backend.collectives
        self.timeout_s = timeout_s
        self.host_timeout_s = self.collectives.timeout_s
        self.ranks = self.collectives.parent
        self.rank = backend.rank
        self.world_size = backend.world_size
        self.local_rank = backend.local_rank
        self.device = backend.device
        self.closed = False
        self._workspace = None  # ctx.workspace(): made on first use

    def check_open(self) -> None:
        """Raise `RingClosedError` if the context was closed, `BrokenStateError` if a host collective
        failed on its communicator (the ranks are then in an unknown state)."""
        if self.closed:
            raise RingClosedError(f"{self!r} was closed (finalize); call symmring.init() again")
        self.collectives.check()

    def workspace(self, *, collective: bool = False, **kwargs):
        """The context's own `symmring.Workspace`, which every MoE layer borrows unless given ``workspace=``.

        Made on the first call (collective then: every rank makes it), with ``kwargs`` (`Workspace`'s
        ``max_tokens``, ``budget``, ``tokens_per_slot``, ``pool_rows``); later calls return it, and giving
        arguments again once it exists is a `ConfigError`. Closed with the context. With ``collective=True``
        (the layers' constructors, which every rank calls) the ranks agree in a bounded exchange whether a
        failed call or step left the workspace in an unknown state on any rank (`Workspace.failed`); if so every
        rank closes it and makes a fresh one (the layers that borrowed it keep refusing calls)."""
        current = self._workspace
        if collective and current is not None and not current.closed:
            failed = self.collectives.allgather(current.failed, what="ctx.workspace: failed calls")
            if any(failed):
                current.close()  # on every rank alike: the next layer gets a fresh workspace
        if self._workspace is None or self._workspace.closed:
            from .moe.workspace import Workspace
            self._workspace = Workspace(self, **kwargs)
        elif kwargs:
            raise ConfigError(f"ctx.workspace({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}): this context's "
                              "workspace exists already; pass its arguments on the first call, before any layer "
                              "is built, or build a Workspace and pass it as workspace=")
        return self._workspace

    @property
    def broken(self) -> bool:
        """Whether a host collective failed (`symmring.errors.PeerTimeout`): only `close` still works."""
        return self.collectives.broken

    def close(self) -> None:
        """Collective: finalize the backend. Idempotent (the same as `symmring.finalize` for this context).

        On a broken context (`broken`) nothing collective runs: the backend drops its memory without
        the collective release, and the process ends the job at exit (after the other ranks report)
        instead of entering ``MPI_Finalize`` (`symmring.collective`), unless a new ``symmring.init()``
        succeeds first.
        """
        global _current
        if self.closed:
            return
        try:
            if self._workspace is not None and not self.broken:
                self._workspace.close()  # collective, while the context still is open
        finally:
            self._workspace = None
        self.closed = True
        try:
            self.backend.finalize()
        finally:
            self.collectives.close()
        if _current is self:
            _current = None
        log.debug("symmring context closed on rank %d", self.rank)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if self.broken else "open")
        return (f"Context(backend={self.backend.name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device!r}, {self.collectives.kind}, timeout_s={self.timeout_s:g}, "
                f"host_timeout_s={self.host_timeout_s:g}, {state})")


def _gpu_available() -> bool:
    try:
        from .backends import nvshmem
    except ImportError as exc:
        log.debug("symmring.backends.nvshmem not importable (%s): no GPU backend", exc)
        return False
    return bool(nvshmem.gpu_available())


def _choose_backend(backend: str) -> str:
    if not isinstance(backend, str) or backend.strip().lower() not in BACKENDS:
        raise ConfigError(f"backend={backend!r}: expected one of {list(BACKENDS)}")
    name = backend.strip().lower()
    if name == "auto":
        name = env.backend_name()
        if name not in BACKENDS:
            raise ConfigError(f"SYMMRING_BACKEND={name!r}: expected one of {list(BACKENDS)}")
    if name == "auto":
        name = "nvshmem" if _gpu_available() else "host"
    return name


def _seconds(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r}: expected a positive number of seconds")
    return float(value)


def init(backend: str = "auto", *, comm=None, group=None, timeout_s: Optional[float] = None,
         host_timeout_s: Optional[float] = None) -> Context:
    """Join the ranks and create the backend (collective over the ranks).

    Args:
        backend: ``"auto"`` (``SYMMRING_BACKEND``, else ``"nvshmem"`` when `symmring.backends.nvshmem.gpu_available`
            says a GPU, CuPy and nvshmem4py are usable, else ``"host"``), ``"host"`` or ``"nvshmem"``.
        comm: mpi4py communicator of the ranks.
        group: torch.distributed ProcessGroup of the ranks (every member calls ``init``; a subgroup works:
            each group its own context, memory and layers).
        With neither, the launcher's world (`symmring.world.resolve`): torch.distributed's default group when
        it is initialised, ``MPI.COMM_WORLD`` under mpirun, torchrun's workers over its store under torchrun
        (no ProcessGroup needed), else a world of one.
        timeout_s: bound of every protocol wait; ``SYMMRING_TIMEOUT_S`` (default 60 s) when None.
        host_timeout_s: bound of every host collective between ranks (setup, allocation, the layers'
            per-call exchanges, teardown): how late a rank may come to one; ``SYMMRING_HOST_TIMEOUT_S``
            (default 1800 s) when None.

    Returns:
        The `Context`; `finalize()` (or ``ctx.close()``) releases it.

    Raises:
        ConfigError: unknown backend name, a non-positive timeout, a bad ``SYMMRING_LOG_LEVEL``, both
            ``comm`` and ``group``, a group this process is not in.
        BackendError: the backend cannot run here (no GPU, ranks on several nodes, no MPI library for
            several MPI ranks, a world of one under a launcher of several, ...).
        PeerTimeout: not every rank called ``init`` within the host bound.

    Example:
        >>> import symmring
        >>> ctx = symmring.init("host", timeout_s=5.0)
        >>> ctx.world_size, ctx.host_timeout_s > 0
        (1, True)
        >>> symmring.finalize()
    """
    global _current
    env.configure_logging()  # SYMMRING_LOG_LEVEL / SYMMRING_DEBUG: symmring's log lines on stderr
    name = _choose_backend(backend)
    timeout_s = env.timeout_s() if timeout_s is None else _seconds("timeout_s", timeout_s)
    host_timeout_s = env.host_timeout_s() if host_timeout_s is None else _seconds("host_timeout_s", host_timeout_s)
    from . import world
    ranks = world.resolve(comm, group, timeout_s=host_timeout_s)
    group = ranks if world.is_process_group(ranks) else None
    comm = None if world.is_torch_ranks(ranks) else ranks
    # First: every rank is here (bounded), so the backend's blocking setup cannot wait for a late one.
    collectives = Collectives(ranks, host_timeout_s, what="symmring.init")
    if name == "host":
        from .backends.host import HostBackend
        impl: Backend = HostBackend(ranks, collectives=collectives)
    else:
        try:
            from .backends.nvshmem import NvshmemBackend
        except ImportError as exc:
            raise BackendError(f"backend='nvshmem' needs symmring.backends.nvshmem (CuPy, nvshmem4py): {exc}") from exc
        impl = NvshmemBackend(ranks, collectives=collectives)
    ctx = Context(impl, comm, timeout_s, collectives, group=group)
    _current = ctx
    log.info("symmring: rank %d of %d uses the %s backend on %s over %s (timeout %g s, host timeout %g s)",
             ctx.rank, ctx.world_size, impl.name, ctx.device, collectives.kind, ctx.timeout_s, ctx.host_timeout_s)
    return ctx


def current() -> Optional[Context]:
    """The context of the last `init()` that is still open, or None."""
    return _current


def finalize() -> None:
    """Close the context made by the last `init()` (collective). A no-op when there is none."""
    if _current is not None:
        _current.close()
