"""Which ranks a context joins: an mpi4py communicator, a torch.distributed ProcessGroup, torchrun's workers, or a
process alone.

`symmring.init` takes ``comm=`` (mpi4py) or ``group=`` (torch.distributed); given neither, `resolve` picks
the world the process was started in, in this order:

1. ``torch.distributed`` is initialised in this process: its default group (the program chose it);
2. an MPI launcher started it (``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``): MPI's ``COMM_WORLD``;
3. ``torchrun`` started it (``TORCHELASTIC_RUN_ID``, or ``WORLD_SIZE`` with ``MASTER_ADDR``): its workers as
   `StoreRanks` -- the store of torchrun's rendezvous (``torch.distributed.rendezvous("env://")``: torchrun's
   ``TCPStore``, in its agent), this worker's ``RANK`` and the ``WORLD_SIZE``; no ProcessGroup is made (no
   gloo connections between the workers: symmring's collectives need only the store, `symmring.wire`);
4. neither: a process alone (MPI's ``COMM_WORLD`` of one, or `symmring.mpi`'s stand-in without an MPI
   library).

A process that a launcher started as one of several ranks never runs as a world of one: a
``COMM_WORLD`` of one rank under an MPI launcher of several (an mpi4py built for another MPI) is a
`BackendError`, as is a ProcessGroup this process is not a member of.

torch is imported only when a ProcessGroup is involved (given, initialised, or torchrun's variables set).

Example:
    >>> launcher_world({"WORLD_SIZE": "3", "RANK": "1", "MASTER_ADDR": "localhost"})
    ('torchrun', 3)
    >>> launcher_world({"PMI_SIZE": "4", "PMI_RANK": "0"})
    ('mpi', 4)
    >>> launcher_world({})
    (None, 1)
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import BackendError, ConfigError, PeerTimeout

log = logging.getLogger(__name__)

#: Variables torchrun (torch.distributed.run) sets for every worker.
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR")


def launcher_world(environ: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], int]:
    """``(launcher, ranks)`` of the launcher that started this process: ``"mpi"`` (``PMI_SIZE``,
    ``OMPI_COMM_WORLD_SIZE``), ``"torchrun"`` (``WORLD_SIZE`` with ``TORCHELASTIC_RUN_ID`` or
    ``MASTER_ADDR``), or ``(None, 1)``."""
    from .mpi import LAUNCHER_SIZE_VARS
    environ = os.environ if environ is None else environ
    for name in LAUNCHER_SIZE_VARS:
        raw = environ.get(name, "")
        if raw.isdigit():
            return "mpi", int(raw)
    raw = environ.get("WORLD_SIZE", "")
    if raw.isdigit() and any(environ.get(v) for v in TORCHRUN_VARS):
        return "torchrun", int(raw)
    return None, 1


def launcher_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank as its launcher numbered it (MPI's variables, torchrun's ``RANK``); 0 outside a
    launcher. For lines printed once before any context exists."""
    environ = os.environ if environ is None else environ
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"):
        raw = environ.get(name, "")
        if raw.isdigit():
            return int(raw)
    return 0


# --- torch.distributed ------------------------------------------------------------------------------------

def _dist():
    import torch.distributed as dist
    return dist


def torch_initialized() -> bool:
    """Whether this process initialised torch.distributed (without importing torch when it did not)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def is_process_group(obj) -> bool:
    """Whether ``obj`` is a torch.distributed ProcessGroup (False without importing torch when it is not
    loaded)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(obj, dist.ProcessGroup)


def group_rank(group) -> int:
    return int(_dist().get_rank(group))


def group_size(group) -> int:
    return int(_dist().get_world_size(group))


def group_name(group) -> str:
    """The group's name: the same on every member (``"0"`` for the default group; ``new_group`` numbers the
    others in creation order)."""
    return str(group.group_name)


def group_store(group):
    """The c10d store every member of ``group`` reaches (torch's store of the group, else the default
    group's)."""
    from torch.distributed import distributed_c10d as c10d
    if hasattr(c10d, "_get_process_group_store"):
        return c10d._get_process_group_store(group)
    return c10d._get_default_store()  # pragma: no cover - torch < 2.4


@dataclasses.dataclass(frozen=True, eq=False)
class StoreRanks:
    """Ranks that share a c10d store but no ProcessGroup: torchrun's workers when the program did not initialise
    torch.distributed. What symmring's collectives need of a group (`symmring.wire.StoreWire`): the store,
    this rank, the number of ranks, and a name every rank gives it."""

    store: Any
    rank: int
    world_size: int
    name: str = "torchrun"


_torchrun: Optional[StoreRanks] = None


def torchrun_ranks(timeout_s: float) -> StoreRanks:
    """torchrun's workers as `StoreRanks`, from its ``env://`` variables (one rendezvous per process: later
    calls return the same), bounded by ``timeout_s``.

    Raises:
        PeerTimeout: not every worker reached the store within the bound (which ones is unknown here).
        BackendError: torch.distributed is not available, or the rendezvous failed otherwise.
    """
    global _torchrun
    if _torchrun is not None:
        return _torchrun
    try:
        dist = _dist()
    except ImportError as exc:
        raise BackendError(f"this process was started by torchrun but torch cannot be imported: {exc}") from exc
    if not dist.is_available():
        raise BackendError("this process was started by torchrun but this torch has no torch.distributed")
    _, size = launcher_world()
    try:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    except Exception as exc:  # noqa: BLE001 - DistStoreError / RuntimeError of a rendezvous that timed out
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            raise PeerTimeout("symmring.init: torchrun's rendezvous", rank=launcher_rank(), world_size=size,
                              missing_ranks=(), timeout_s=timeout_s) from exc
        raise BackendError(f"torchrun's rendezvous (env://) failed: {type(exc).__name__}: {exc}") from exc
    _torchrun = StoreRanks(store, int(rank), int(world_size))
    log.info("symmring: rank %d of torchrun's %d workers (its store; no ProcessGroup)", rank, world_size)
    return _torchrun


def is_torch_ranks(obj) -> bool:
    """Whether ``obj`` is ranks of torch.distributed: a ProcessGroup, or `StoreRanks`."""
    return isinstance(obj, StoreRanks) or is_process_group(obj)


def store_of(ranks) -> Tuple[Any, int, int, str]:
    """``(store, rank, world_size, name)`` of a ProcessGroup or `StoreRanks`."""
    if isinstance(ranks, StoreRanks):
        return ranks.store, ranks.rank, ranks.world_size, ranks.name
    return group_store(ranks), group_rank(ranks), group_size(ranks), group_name(ranks)


def init_kwargs(ranks) -> Dict[str, Any]:
    """The arguments that make `symmring.init` join ``ranks`` again (``comm=``, ``group=``, or none for
    torchrun's `StoreRanks`, which `resolve` finds again)."""
    if isinstance(ranks, StoreRanks):
        return {}
    return {"group": ranks} if is_process_group(ranks) else {"comm": ranks}


# --- the world of a context -------------------------------------------------------------------------------

def resolve(comm=None, group=None, *, timeout_s: float):
    """The world ``symmring.init`` joins: ``comm`` (mpi4py) or ``group`` (ProcessGroup) as given, else the
    launcher's (the module docstring): torchrun's workers as `StoreRanks`.

    Raises:
        ConfigError: both ``comm`` and ``group``; ``group`` not a ProcessGroup, or this process not in it.
        BackendError: a world of one under a launcher of several ranks; no MPI library under an MPI launcher.
        PeerTimeout: torchrun's workers did not all reach its store within ``timeout_s``.
    """
    if comm is not None and group is not None:
        raise ConfigError("comm= and group=: give one of them (an mpi4py communicator or a torch.distributed "
                          "ProcessGroup)")
    if group is None and comm is None:
        launcher, size = launcher_world()
        if torch_initialized():
            group = _dist().group.WORLD
        elif launcher == "torchrun" and size > 1:
            return torchrun_ranks(timeout_s)
    if group is not None:
        if not is_process_group(group):
            raise ConfigError(f"group={group!r}: expected a torch.distributed ProcessGroup")
        if group_rank(group) < 0:
            raise ConfigError(f"group={group!r}: this process (global rank {_dist().get_rank()}) is not a member "
                              "of it; every member calls symmring.init(group=...), the others do not")
        return group
    if comm is None:
        from . import mpi
        comm = mpi.load().COMM_WORLD  # a world of one without an MPI library (symmring.mpi)
        launcher, size = launcher_world()
        if size > 1 and comm.Get_size() != size:
            raise BackendError(f"this process is one of {size} ranks of its launcher ({launcher}) but MPI's "
                               f"COMM_WORLD has {comm.Get_size()}: mpi4py was built for another MPI than the "
                               "launcher's (use the mpiexec of the MPI mpi4py loads, e.g. the mpich wheel's)")
    return comm


def local_rank(hosts, rank: int) -> int:
    """This rank's place among the ranks on its host, from every rank's host name (``hosts``, rank order)."""
    return sum(1 for r in range(rank) if hosts[r] == hosts[rank])


__all__ = ["launcher_world", "launcher_rank", "resolve", "StoreRanks", "torchrun_ranks", "torch_initialized",
           "is_process_group", "is_torch_ranks", "store_of", "init_kwargs", "group_rank", "group_size", "group_name",
           "group_store", "local_rank"]
