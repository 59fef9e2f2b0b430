"""mpi4py's ``MPI``, or a world of one process when mpi4py or an MPI library cannot be loaded.

Jobs started by ``mpirun``/``mpiexec`` join their ranks with mpi4py (the ``mpi`` extra: ``pip install
"symmring[mpi]"`` brings mpi4py and the ``mpich`` wheel; a system MPICH / Open MPI works too); jobs started by
``torchrun`` use torch.distributed instead (`symmring.world`) and need no MPI. mpi4py's wheels carry no MPI
library: they load ``libmpi.so`` at ``from mpi4py import MPI``. Without mpi4py or a library, that import
raises. A single process needs no MPI at all, so `load` then returns `STANDIN`: the part of mpi4py's API that
symmring uses (``COMM_WORLD`` with
``Get_rank``/``Get_size``/``allgather``/``allreduce``/``bcast``/``Barrier``/``Split_type``/``Iallgather``,
shared-memory windows with ``Allocate_shared``/``Shared_query``/``Accumulate``/``Sync``/``Flush``, and the
constants), for a world of exactly one rank. `symmring.backends.host.HostBackend` runs on it unchanged:
its window is plain process memory, its accumulates are plain loads and stores (one process, one
thread of protocol calls: nothing to order against).

The fallback is refused when this process was started as one of several ranks by an MPI launcher
(``PMI_SIZE`` or ``OMPI_COMM_WORLD_SIZE`` above 1): each rank would otherwise believe it is alone.
`load` then raises `BackendError` naming ``pip install "symmring[mpi]"``.

Example:
    >>> MPI = load()
    >>> MPI.COMM_WORLD.Get_size() >= 1
    True
    >>> STANDIN.COMM_WORLD.allreduce(3, op=STANDIN.SUM), STANDIN.COMM_WORLD.allgather("a")
    (3, ['a'])
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional, Tuple

import numpy as np

from .errors import BackendError

log = logging.getLogger(__name__)

#: How to get a real MPI library (named in every message about a missing one).
INSTALL_HINT = 'pip install "symmring[mpi]" (the mpich wheel: libmpi and mpiexec)'
#: Variables an MPI launcher sets to the number of ranks it started (Hydra/PMI, Open MPI).
LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")

_lock = threading.Lock()
_loaded = None
_why_not: Optional[str] = None


# --- the stand-in ---------------------------------------------------------------------------------

class _Op:
    """A reduction/accumulate operation; ``apply(old, new)`` on uint64 NumPy arrays."""

    def __init__(self, name: str, apply):
        self.name = name
        self.apply = apply

    def __repr__(self) -> str:
        return f"<symmring.mpi stand-in op {self.name}>"


class _Request:
    """A completed non-blocking operation."""

    def Test(self) -> bool:  # noqa: N802 - mpi4py's names
        return True

    def Wait(self) -> None:  # noqa: N802
        return None


class _Comm:
    """A communicator of one rank: every collective returns this rank's own contribution."""

    def Get_rank(self) -> int:  # noqa: N802
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def allgather(self, obj):
        return [obj]

    def gather(self, obj, root: int = 0):
        return [obj]

    def allreduce(self, obj, op=None):
        return obj

    def bcast(self, obj, root: int = 0):
        return obj

    def Barrier(self) -> None:  # noqa: N802
        return None

    barrier = Barrier

    def Iallgather(self, sendbuf, recvbuf) -> _Request:  # noqa: N802
        np.copyto(np.asarray(recvbuf), np.asarray(sendbuf))
        return _Request()

    def Split_type(self, split_type, key: int = 0, info=None) -> "_Comm":  # noqa: N802
        return _Comm()

    def Dup(self) -> "_Comm":  # noqa: N802
        return _Comm()

    def Free(self) -> None:  # noqa: N802
        return None

    def __repr__(self) -> str:
        return "<symmring.mpi stand-in communicator: a world of one rank>"


class _Info:
    @classmethod
    def Create(cls) -> "_Info":  # noqa: N802
        return cls()

    def Set(self, key: str, value: str) -> None:  # noqa: N802
        return None

    def Free(self) -> None:  # noqa: N802
        return None


class _Win:
    """A "shared-memory window" of one rank: a zero-filled, 64-byte aligned NumPy buffer."""

    def __init__(self, nbytes: int):
        raw = np.zeros(nbytes + 64, np.uint8)
        start = -raw.ctypes.data % 64
        self._memory = raw[start:start + nbytes]
        self._freed = False

    @classmethod
    def Allocate_shared(cls, size: int, disp_unit: int = 1, info=None, comm=None) -> "_Win":  # noqa: N802
        return cls(int(size))

    def Shared_query(self, rank: int) -> Tuple[memoryview, int]:  # noqa: N802
        if rank != 0:
            raise BackendError(f"Shared_query({rank}): the single-process stand-in has only rank 0")
        return memoryview(self._memory), 1

    def Get_attr(self, keyval):  # noqa: N802
        return STANDIN.WIN_UNIFIED if keyval == STANDIN.WIN_MODEL else None

    def Accumulate(self, origin, target_rank: int, target=None, op=None) -> None:  # noqa: N802
        buf, count, datatype = origin
        disp, target_count, target_type = target
        if datatype is not STANDIN.UINT64_T or target_type is not STANDIN.UINT64_T or count != target_count:
            raise BackendError("Accumulate: the single-process stand-in supports UINT64_T words only")
        words = self._memory[disp:disp + 8 * count].view(np.uint64)
        words[:] = op.apply(words, np.asarray(buf, np.uint64)[:count])

    def Lock_all(self, assertion: int = 0) -> None:  # noqa: N802
        return None

    def Unlock_all(self) -> None:  # noqa: N802
        return None

    def Sync(self) -> None:  # noqa: N802 - one process: program order is the only order
        return None

    def Flush(self, rank: int) -> None:  # noqa: N802
        return None

    def Free(self) -> None:  # noqa: N802
        self._freed = True
        self._memory = None


class _StandIn:
    """The single-process stand-in for ``mpi4py.MPI`` (see the module docstring)."""

    standin = True
    COMM_WORLD = _Comm()
    COMM_SELF = COMM_WORLD
    Win = _Win
    Info = _Info
    INFO_NULL = None
    COMM_TYPE_SHARED = 1
    MODE_NOCHECK = 1024
    WIN_MODEL = "WIN_MODEL"
    WIN_UNIFIED = "WIN_UNIFIED"
    UINT64_T = "UINT64_T"
    MIN = _Op("MIN", np.minimum)
    MAX = _Op("MAX", np.maximum)
    SUM = _Op("SUM", lambda old, new: old + new)  # uint64 arrays wrap modulo 2**64
    BOR = _Op("BOR", np.bitwise_or)
    REPLACE = _Op("REPLACE", lambda old, new: new)

    @staticmethod
    def Get_library_version() -> str:  # noqa: N802
        return f"none (symmring's single-process stand-in: {_why_not or 'selected'})"

    @staticmethod
    def Get_version() -> Tuple[int, int]:  # noqa: N802
        return (0, 0)

    def __repr__(self) -> str:
        return "<symmring.mpi stand-in for mpi4py.MPI: one process, no MPI library>"


#: The stand-in namespace (a world of one rank).
STANDIN = _StandIn()


# --- loading --------------------------------------------------------------------------------------

def _launched_size() -> Tuple[Optional[str], int]:
    """``(variable, ranks)`` when an MPI launcher started this process as one of several ranks."""
    for name in LAUNCHER_SIZE_VARS:
        raw = os.environ.get(name, "")
        if raw.isdigit() and int(raw) > 1:
            return name, int(raw)
    return None, 1


def launcher_rank() -> int:
    """This process's rank as its MPI launcher numbered it (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``);
    0 outside a launcher. For messages printed once when MPI itself is not usable."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        raw = os.environ.get(name, "")
        if raw.isdigit():
            return int(raw)
    return 0


def load():
    """``mpi4py.MPI``, or `STANDIN` when mpi4py cannot load an MPI library in a lone process.

    Logs one warning (naming the extra that brings MPI) the first time it falls back.

    Raises:
        BackendError: no MPI library, but an MPI launcher started this process as one of several ranks
            (or mpi4py itself is not installed there).
    """
    global _loaded, _why_not
    with _lock:
        if _loaded is not None:
            return _loaded
        try:
            from mpi4py import MPI
        except Exception as exc:  # noqa: BLE001 - mpi4py raises RuntimeError when libmpi is missing
            _why_not = _first_line(exc)
        else:
            _loaded = MPI
            return MPI
        variable, size = _launched_size()
        if variable is not None:
            raise BackendError(f"this process is one of {size} ranks ({variable}={size}) but MPI cannot be loaded "
                               f"({_why_not}): {INSTALL_HINT}, or put your MPI's libmpi on LD_LIBRARY_PATH")
        log.warning("no MPI library (%s): symmring runs as one process; for several ranks: %s",
                    _why_not, INSTALL_HINT)
        _loaded = STANDIN
        return STANDIN


def is_standin(mpi_or_comm) -> bool:
    """Whether ``mpi_or_comm`` is the stand-in namespace or one of its communicators."""
    return mpi_or_comm is STANDIN or isinstance(mpi_or_comm, _Comm)


def namespace_of(comm):
    """The ``MPI`` namespace that goes with ``comm`` (`STANDIN` for its communicators, else `load`)."""
    return STANDIN if isinstance(comm, _Comm) else load()


def unavailable_reason() -> Optional[str]:
    """Why the real MPI could not be loaded (after `load` fell back), else None."""
    return _why_not


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


__all__ = ["load", "launcher_rank", "is_standin", "namespace_of", "unavailable_reason", "STANDIN", "INSTALL_HINT"]
