"""The CPU backend's shared memory without MPI: POSIX shared-memory files, C11 atomics from libatomic.

`symmring.backends.host.HostBackend` runs over it when the ranks are a torch.distributed ProcessGroup (torchrun,
no MPI library needed); over an mpi4py communicator it uses MPI-3 windows instead
(`symmring.backends.host.MpiWindows`). Both give the same protocol the same primitives; docs/CPU_BACKEND.md
argues the ordering of each.

* **Memory.** Each rank creates one file per allocation in ``/dev/shm`` (``symmring-<pid>-<n>-<random>``,
  mode 0600, ``ftruncate``: zero-filled pages), the ranks exchange the names in a bounded collective, every
  rank maps every segment (``mmap``, ``MAP_SHARED``), and once every rank has mapped them (a bounded verdict)
  each rank unlinks its own file: from then on nothing is left in ``/dev/shm`` whatever happens to the
  processes, and the memory goes with the last mapping. Only a process killed between creating its file
  and that verdict (milliseconds) leaves a file behind: ``rm /dev/shm/symmring-*`` removes it.
* **Signal words and atomics** are libatomic's C11 functions, called through ctypes on the word's address:
  ``__atomic_store_8`` / ``__atomic_fetch_add_8`` / ``__atomic_fetch_or_8`` (relaxed) and
  ``__atomic_load_8`` (relaxed) for the words, ``atomic_thread_fence(memory_order_seq_cst)`` for `fence`
  and after a satisfied wait. Every word is naturally aligned and the 8-byte atomics must be lock-free
  (checked at allocation: libatomic's fallback for wider types is a lock table private to each process,
  which would not be atomic across processes). On x86-64 (this project's CI) these are ``mov``,
  ``lock xadd``/``lock cmpxchg`` and ``mfence``; on AArch64 ``ldr``/``str``, LSE or LL/SC atomics and
  ``dmb ish``.
* **Where it cannot run.** No ``/dev/shm`` (not Linux) or no ``libatomic.so.1`` (a system without GCC's
  runtime: Debian/Ubuntu ``libatomic1``, Fedora ``libatomic``): `SharedFiles` raises `BackendError` naming
  what is missing and the MPI route (``pip install "symmring[mpi]"``, then ``mpiexec``).

Example (one process: a world of one needs no collective):
    >>> from symmring.collective import Collectives
    >>> mem = SharedFiles(rank=0, world_size=1)
    >>> handle, segments = mem.allocate(4096, Collectives(None, 5.0))
    >>> word = segments[0][0:8].view("uint64")
    >>> for value, op in ((5, "set"), (2, "add"), (8, "or")):
    ...     mem.update(handle, 0, 0, word, value, op)
    >>> mem.load(word)
    15
    >>> mem.release(handle, segments)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import mmap
import os
import secrets
import types
from pathlib import Path
from typing import List, Tuple

import numpy as np

from ..errors import BackendError

log = logging.getLogger(__name__)

#: Where the segments' files live (tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
#: C11 memory orders (``__ATOMIC_RELAXED``, ``__ATOMIC_SEQ_CST``).
_RELAXED, _SEQ_CST = 0, 5
_serial = itertools.count(1)
_atomic = None


def libatomic():
    """libatomic's functions symmring calls, loaded through ctypes once per process (``load``, ``store``,
    ``fetch_add``, ``fetch_or``, ``is_lock_free``, ``thread_fence``).

    Raises:
        BackendError: no ``libatomic.so.1`` here.
    """
    global _atomic
    if _atomic is not None:
        return _atomic
    lib, tried = None, []
    for name in ("libatomic.so.1", ctypes.util.find_library("atomic")):
        if not name:
            continue
        tried.append(name)
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise BackendError(f"the host backend without MPI needs libatomic (tried {', '.join(tried)}): install "
                           "GCC's runtime (Debian/Ubuntu: libatomic1; Fedora: libatomic), or run under MPI: "
                           'pip install "symmring[mpi]" and start the ranks with mpiexec')
    word, u64, order = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
    functions = {}
    for short, fn, args, result in (
            ("load", "__atomic_load_8", (word, order), u64), ("store", "__atomic_store_8", (word, u64, order), None),
            ("fetch_add", "__atomic_fetch_add_8", (word, u64, order), u64),
            ("fetch_or", "__atomic_fetch_or_8", (word, u64, order), u64),
            ("is_lock_free", "__atomic_is_lock_free", (ctypes.c_size_t, word), ctypes.c_bool),
            ("thread_fence", "atomic_thread_fence", (order,), None)):
        function = getattr(lib, fn)
        function.argtypes, function.restype = args, result
        functions[short] = function
    _atomic = types.SimpleNamespace(**functions)
    return _atomic


class SharedFiles:
    """The segments of every rank in ``/dev/shm`` files, and libatomic's atomics on their words.

    Args:
        rank, world_size: this process's place among the ranks (the collectives' ranks).

    Raises:
        BackendError: no ``/dev/shm`` directory, or no libatomic.
    """

    name = "POSIX shared memory (/dev/shm) + libatomic"

    def __init__(self, *, rank: int, world_size: int):
        if not SHM_DIR.is_dir():
            raise BackendError(f"the host backend without MPI needs POSIX shared memory in {SHM_DIR} (Linux); "
                               'elsewhere run under MPI: pip install "symmring[mpi]" and start the ranks with mpiexec')
        self._atomic = libatomic()
        self.rank, self.world_size = rank, world_size

    def allocate(self, nbytes: int, chan) -> Tuple[List[mmap.mmap], List[np.ndarray]]:
        """Collective: every rank's zero-filled segment of ``nbytes`` bytes, mapped here.

        Returns ``(mappings, segments)``: the ``mmap`` objects and one uint8 array per rank (rank order).

        Raises:
            BackendError: a rank could not create or map a segment (named), or the atomics are not lock-free.
            PeerTimeout: a rank did not arrive within the bound.
        """
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        path = SHM_DIR / f"symmring-{os.getpid()}-{next(_serial)}-{secrets.token_hex(4)}"
        mappings: List[mmap.mmap] = []
        try:
            own, error = None, None
            try:
                own = _map(path, size, create=True)
            except OSError as exc:
                error = f"rank {self.rank} could not create {path} ({size} bytes): {exc.strerror or exc}"
            names = chan.allgather((str(path), error), what="host backend: alloc (segment names)")
            errors = [e for _, e in names if e]
            for rank, (name, _) in enumerate(names if not errors else ()):
                try:
                    mappings.append(own if rank == self.rank else _map(Path(name), size, create=False))
                except OSError as exc:
                    errors.append(f"rank {self.rank} could not map rank {rank}'s {name}: {exc.strerror or exc} "
                                  "(the host backend needs every rank on one node)")
                    break
            # Every rank mapped every segment (or the same error everywhere): the files may go.
            errors = [e for found in chan.allgather(errors, what="host backend: alloc (segments mapped)")
                      for e in found]
        finally:
            _unlink(path)
        if errors:
            _close(mappings)
            raise BackendError(f"host backend: shared memory of {nbytes} bytes: {errors[0]}")
        segments = [np.frombuffer(m, dtype=np.uint8, count=nbytes) for m in mappings]
        if not all(self._atomic.is_lock_free(8, s.ctypes.data) for s in segments):
            raise BackendError("libatomic's 8-byte atomics are not lock-free here: they would not be atomic "
                               "between processes")
        return mappings, segments

    def close(self, healthy: bool) -> None:
        """Nothing process-wide to release."""

    def release(self, mappings: List[mmap.mmap], segments: List[np.ndarray]) -> None:
        """Unmap (the caller made sure no rank still uses them). A mapping that a live view still references
        is left to go with its last view."""
        segments.clear()
        _close(mappings)

    def fence(self, handles) -> None:
        """Full memory barrier (``atomic_thread_fence(seq_cst)``; one for the whole process): the release
        before a signal."""
        self._atomic.thread_fence(_SEQ_CST)

    def acquire(self, handle) -> None:
        """After a satisfied wait: the same full barrier (pairs with the writer's `fence`)."""
        self._atomic.thread_fence(_SEQ_CST)

    def update(self, handle, rank: int, offset: int, word: np.ndarray, value: int, op: str) -> None:
        """Relaxed atomic ``op`` (``"set"``, ``"add"``, ``"or"``) of ``value`` on the uint64 ``word`` (rank
        ``rank``'s word at ``offset``)."""
        address, value = word.ctypes.data, ctypes.c_uint64(value & 0xFFFF_FFFF_FFFF_FFFF)
        if op == "set":
            self._atomic.store(address, value, _RELAXED)
        elif op == "add":
            self._atomic.fetch_add(address, value, _RELAXED)
        else:
            self._atomic.fetch_or(address, value, _RELAXED)

    def load(self, word: np.ndarray) -> int:
        """Relaxed atomic load of the uint64 ``word``."""
        return int(self._atomic.load(word.ctypes.data, _RELAXED))


def _map(path: Path, size: int, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _close(mappings: List[mmap.mmap]) -> None:
    for m in mappings:
        try:
            m.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the last one
            pass
    mappings.clear()
