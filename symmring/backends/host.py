"""The CPU backend: symmetric memory shared by the ranks of one node, and 64-bit signal words on it.

Every rank maps every other rank's segment of each allocation, so a peer's ring is reached with plain NumPy
loads and stores, exactly like a GPU reaches a peer's NVSHMEM heap over NVLink with ``nvshmem_ptr``. The
protocol code above (`symmring.ring.Ring`) is the same for every backend; `HostBackend` is the same for
both launchers, and only the shared memory beneath it differs:

* over an mpi4py communicator (mpirun): an MPI-3 shared-memory window per allocation (`MpiWindows`, below);
* over a torch.distributed ProcessGroup (torchrun; no MPI library needed): ``/dev/shm`` files mapped by every
  rank, with libatomic's C11 atomics and fences (`symmring.backends.shm.SharedFiles`).

MPI windows, and why they are correctly ordered (MPI's *unified* memory model, checked at allocation):

* The whole lifetime of a window is one passive-target ``Lock_all(MODE_NOCHECK)`` epoch, so
  ``Win.Sync()`` (``MPI_Win_sync``) is legal at any time. In the unified model the public and private
  copies of the window are the same memory, and ``MPI_Win_sync`` is a full memory barrier: loads and
  stores before it complete before loads and stores after it (MPICH: a full processor fence).
* ``fence()`` (release) = ``Win.Sync()`` on every live window: the payload stores issued before it
  are globally visible before the signal store issued after it.
* ``wait_until`` (acquire) polls the word with plain loads and, once satisfied, calls ``Win.Sync()``:
  the payload loads issued after it cannot be satisfied before the signal load that observed the
  publication (pairs with the release in ``fence`` on the writer).
* ``signal_set`` / ``signal_add`` / ``atomic_or`` are MPI accumulate operations (``MPI.REPLACE``,
  ``MPI.SUM``, ``MPI.BOR`` on ``MPI.UINT64_T``) followed by ``Win.Flush(rank)``. MPI makes accumulates
  on the same location with the same basic datatype atomic with respect to each other, so two
  consumers OR-ing their acknowledgement bits into one mask word never lose a bit. They are *relaxed*
  (base-interface semantics): the caller fences first.
* 64-bit signal words are read with one aligned 8-byte NumPy load (``int(view[0])`` of a ``uint64``
  view). Every region of a ring starts on a 128-byte boundary and every segment base is checked to be
  8-byte aligned, and x86-64 and AArch64 both guarantee single-copy atomicity for naturally aligned
  8-byte accesses, so a poll sees either the old or the new value, never a torn mix. (MPICH writes the
  word with one 8-byte store, whether its accumulate runs lock-free or under its window mutex.)

Waits back off: a few ``sched_yield`` polls, then sleeps that double from 20 us up to 1 ms, so four
ranks on two cores still make progress (a spinning rank would starve the very producer it waits for).

Every wait for other ranks is bounded: ``barrier`` and the verdicts of ``alloc`` are
`symmring.collective.Collectives` exchanges, and the blocking MPI calls that have no bounded form
(``Split_type``, ``Win.Allocate_shared``, ``Win.Free``) each run right after a bounded barrier, so they
start only when every rank is there. A late or vanished rank is a `PeerTimeout` naming it.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import env
from ..collective import Collectives
from ..errors import BackendError, ConfigError, RingClosedError
from .base import CMP, Backend, SymmetricAllocation

log = logging.getLogger(__name__)

#: Polls that only yield the CPU before the backoff starts sleeping.
_YIELD_POLLS = 8
#: First and largest sleep between polls, in seconds.
_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3


class HostAllocation(SymmetricAllocation):
    """One allocation: the shared memory's handle (an MPI window, or the file mappings) and a NumPy byte view
    of every rank's segment."""

    def __init__(self, handle, segments: List[np.ndarray], nbytes: int):
        self.handle = handle
        self.segments = segments
        self.nbytes = nbytes
        self.freed = False

    def __repr__(self) -> str:
        return f"HostAllocation(nbytes={self.nbytes}, ranks={len(self.segments)}, freed={self.freed})"


class MpiWindows:
    """The segments of every rank in MPI-3 shared-memory windows (see the module docstring).

    Raises:
        BackendError: the ranks span several nodes (a collective verdict: every rank raises).
    """

    name = "MPI shared memory"

    def __init__(self, comm, chan: Collectives):
        from .. import mpi
        self._MPI = MPI = mpi.namespace_of(comm)  # mpi4py's MPI, or the one-process stand-in
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        # key=rank keeps the world order, so node rank == world rank whenever the node is the world.
        self.node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        num_node_ranks = self.node_comm.Get_size()
        # Collective verdict: every rank raises, or none does (no rank left waiting in a later collective).
        if not chan.agree(num_node_ranks == self.world_size, what="host backend: all ranks on one node"):
            self.node_comm.Free()
            raise BackendError(f"the host backend needs all {self.world_size} ranks on one node (shared "
                               f"memory), but rank {self.rank}'s node holds {num_node_ranks} of them; use "
                               "the nvshmem backend or run every rank on one host")
        if self.node_comm.Get_rank() != self.rank:  # pragma: no cover - guaranteed by key=rank
            raise BackendError(f"node rank {self.node_comm.Get_rank()} differs from rank {self.rank}")
        self._ops = {"set": MPI.REPLACE, "add": MPI.SUM, "or": MPI.BOR}

    def allocate(self, nbytes: int, chan: Collectives):
        """Collective (after the caller's bounded barrier): a window of ``nbytes`` per rank; ``(win,
        segments)``, inside its lifelong ``Lock_all`` epoch."""
        MPI = self._MPI
        info = MPI.Info.Create()
        # Non-contiguous segments: each rank's segment starts on its own page (no false sharing of the
        # signal words of neighbouring ranks).
        info.Set("alloc_shared_noncontig", "true")
        win = MPI.Win.Allocate_shared(nbytes, 1, info, comm=self.node_comm)
        info.Free()
        model = win.Get_attr(MPI.WIN_MODEL)
        if not chan.agree(model == MPI.WIN_UNIFIED, what="host backend: alloc (window model)"):
            win.Free()
            raise BackendError(f"MPI window memory model is {model}, expected MPI.WIN_UNIFIED "
                               f"({MPI.WIN_UNIFIED}): plain loads/stores on shared memory would not be "
                               "coherent with MPI's atomics")
        segments = [np.frombuffer(win.Shared_query(peer)[0], dtype=np.uint8, count=nbytes)
                    for peer in range(self.world_size)]
        # One passive-target epoch for the window's whole life: Win.Sync and Flush are legal from now on.
        win.Lock_all(MPI.MODE_NOCHECK)
        return win, segments

    def release(self, win, segments: List[np.ndarray]) -> None:
        """Free the window (collective: the caller passed a bounded barrier first)."""
        segments.clear()
        win.Sync()
        win.Unlock_all()
        win.Free()

    def fence(self, windows) -> None:
        """Release: ``Win.Sync`` (a full memory barrier in the unified model) on every live window."""
        for win in windows:
            win.Sync()

    def acquire(self, win) -> None:
        """After a satisfied wait: ``Win.Sync`` (pairs with the writer's `fence`)."""
        win.Sync()

    def update(self, win, rank: int, offset: int, word: np.ndarray, value: int, op: str) -> None:
        """Relaxed atomic ``op`` on ``rank``'s word at ``offset``: an accumulate, completed at the target."""
        MPI = self._MPI
        origin = np.array([value], dtype=np.uint64)
        win.Accumulate([origin, 1, MPI.UINT64_T], rank, target=(offset, 1, MPI.UINT64_T), op=self._ops[op])
        win.Flush(rank)  # completes the operation at the target before returning (passive target)

    def load(self, word: np.ndarray) -> int:
        """Relaxed load: one aligned 8-byte NumPy load (single-copy atomic, see the module docstring)."""
        return int(word[0])

    def close(self, healthy: bool) -> None:
        if healthy:
            self.node_comm.Free()


class HostBackend(Backend):
    """Symmetric memory and 64-bit signals for CPU ranks of one node.

    Args:
        world: an mpi4py intracommunicator (MPI windows), torch.distributed ranks -- a ProcessGroup or
            torchrun's `symmring.world.StoreRanks` -- (``/dev/shm`` files and libatomic:
            `symmring.backends.shm`), or None: the launcher's (`symmring.world.resolve`; a world
            of one outside a launcher). All its ranks must share one node.
        collectives: the bounded collectives over ``world`` (the context's); None makes the backend its
            own, bounded by ``SYMMRING_HOST_TIMEOUT_S``.

    Attributes:
        memory: how the segments are shared (`MpiWindows` or `symmring.backends.shm.SharedFiles`; its
            ``name`` says which).

    Raises:
        BackendError: no MPI library under a multi-rank MPI launch (`symmring.mpi.load`), the ranks span
            several nodes, MPI's window memory model is not unified, no ``/dev/shm`` or libatomic.
        PeerTimeout: a rank did not arrive within the bound.

    Example:
        >>> backend = HostBackend()          # a world of 1 outside a launcher
        >>> alloc = backend.alloc(1024)
        >>> backend.view(alloc, 0, 0, np.uint64, (4,))[:] = 7
        >>> backend.free(alloc); backend.finalize()
    """

    name = "host"

    def __init__(self, world=None, *, collectives: Optional[Collectives] = None):
        from ..world import is_torch_ranks, resolve
        self.comm = resolve(timeout_s=env.host_timeout_s()) if world is None else world
        self._owns_collectives = collectives is None
        self.collectives = Collectives(self.comm, env.host_timeout_s(), what="HostBackend") if collectives is None \
            else collectives
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        self.collectives.barrier(what="host backend: init")
        if is_torch_ranks(self.comm):
            self.memory = self._shared_files()
        else:
            self.memory = MpiWindows(self.comm, self.collectives)
        self.local_rank = self.rank
        self.device = "cpu"
        self._live: Dict[int, HostAllocation] = {}
        self._finalized = False
        log.debug("host backend: rank %d of %d on one node (%s)", self.rank, self.world_size, self.memory.name)

    def _shared_files(self):
        """`symmring.backends.shm.SharedFiles`, once every rank found itself on one node with it (a collective
        verdict: every rank raises, or none does)."""
        from .shm import SharedFiles
        try:
            memory, problem = SharedFiles(rank=self.rank, world_size=self.world_size), None
        except BackendError as exc:
            memory, problem = None, str(exc)
        hosts = self.collectives.allgather((socket.gethostname(), _boot_id(), problem),
                                           what="host backend: all ranks on one node")
        problems = [p for _, _, p in hosts if p]
        if problems:
            raise BackendError(problems[0])
        on_mine = sum(1 for host, boot, _ in hosts if (host, boot) == hosts[self.rank][:2])
        if on_mine != self.world_size:
            raise BackendError(f"the host backend needs all {self.world_size} ranks on one node (shared "
                               f"memory), but rank {self.rank}'s node holds {on_mine} of them; use the nvshmem "
                               "backend or run every rank on one host")
        return memory

    # --- allocation -----------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> HostAllocation:
        """Collective: a zero-filled shared allocation of ``nbytes`` bytes per rank.

        Raises:
            ConfigError: ``nbytes`` is not a positive int.
            BackendError: the memory cannot be shared (the window model is not unified, a segment cannot be
                mapped), or a segment is not 8-byte aligned.
            PeerTimeout: a rank did not arrive within the bound.
        """
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise ConfigError(f"nbytes={nbytes!r}: expected a positive int")
        nbytes = int(nbytes)
        chan = self.collectives
        # The allocation blocks (MPI) or maps the others' files: start it only once all are here.
        chan.barrier(what=f"host backend: alloc of {nbytes} bytes")
        handle, segments = self.memory.allocate(nbytes, chan)
        aligned = chan.agree(all(s.ctypes.data % 8 == 0 for s in segments), what="host backend: alloc (alignment)")
        if not aligned:
            self.memory.release(handle, segments)
            raise BackendError("a shared-memory segment is not 8-byte aligned: 64-bit signal words "
                               "would not be single-copy atomic")
        segments[self.rank][:] = 0
        # Zeroes visible to all before anyone uses the memory: fence (barrier) fence, the unified-model idiom.
        self.memory.fence([handle])
        chan.barrier(what="host backend: alloc (zero fill)")
        self.memory.fence([handle])
        alloc = HostAllocation(handle, segments, nbytes)
        self._live[id(alloc)] = alloc
        return alloc

    def free(self, alloc: HostAllocation) -> None:
        """Collective: unmap and free ``alloc`` (after a bounded barrier: no rank still uses it).
        Freeing twice is a no-op. With broken collectives the memory is only dropped (an MPI window's
        collective release could wait forever).

        Raises:
            PeerTimeout: a rank did not arrive within the bound (the memory is then dropped).
        """
        if alloc.freed:
            return
        if not self.collectives.broken:
            try:
                self.collectives.barrier(what=f"host backend: free of {alloc.nbytes} bytes")
            except Exception:
                self._drop(alloc)
                raise
            self.memory.release(alloc.handle, alloc.segments)
        self._drop(alloc)

    def _drop(self, alloc: HostAllocation) -> None:
        alloc.freed = True
        self._live.pop(id(alloc), None)
        alloc.segments = []

    # --- access ---------------------------------------------------------------------------------------

    def view(self, alloc: HostAllocation, rank: int, offset: int, dtype, shape: Tuple[int, ...]) -> np.ndarray:
        """Zero-copy NumPy array of ``shape``/``dtype`` over ``rank``'s segment at byte ``offset``."""
        self._check_alloc(alloc)
        self._check_rank(rank)
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        end = offset + count * dtype.itemsize
        if offset < 0 or end > alloc.nbytes:
            raise ConfigError(f"view [{offset}, {end}) of {count} x {dtype}: expected within the "
                              f"allocation's {alloc.nbytes} bytes")
        if offset % dtype.alignment:
            raise ConfigError(f"offset={offset}: expected a multiple of {dtype}'s alignment {dtype.alignment}")
        return alloc.segments[rank][offset:end].view(dtype).reshape(shape)

    def _word(self, alloc: HostAllocation, offset: int, rank: int) -> np.ndarray:
        """``rank``'s 64-bit word at ``offset`` as a 1-element uint64 view (validated; the hot path)."""
        self._check_alloc(alloc)
        self._check_rank(rank)
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset % 8 \
                or not 0 <= offset <= alloc.nbytes - 8:
            raise ConfigError(f"offset={offset!r}: expected an 8-byte aligned word offset within the "
                              f"allocation's {alloc.nbytes} bytes")
        return alloc.segments[rank][offset:offset + 8].view(np.uint64)

    def _update(self, alloc: HostAllocation, offset: int, value: int, rank: int, op: str) -> None:
        word = self._word(alloc, offset, rank)  # validates rank, offset and bounds
        self.memory.update(alloc.handle, rank, offset, word, value, op)

    def signal_set(self, alloc: HostAllocation, offset: int, value: int, rank: int) -> None:
        """Relaxed atomic 64-bit store (``MPI.REPLACE`` accumulate, or libatomic's store); fence first to
        release."""
        self._update(alloc, offset, value, rank, "set")

    def signal_add(self, alloc: HostAllocation, offset: int, value: int, rank: int) -> None:
        """Relaxed atomic 64-bit add (wraps modulo 2**64)."""
        self._update(alloc, offset, value, rank, "add")

    def atomic_or(self, alloc: HostAllocation, offset: int, value: int, rank: int) -> None:
        """Relaxed atomic 64-bit OR: concurrent ORs never lose a bit."""
        self._update(alloc, offset, value, rank, "or")

    def read_word(self, alloc: HostAllocation, offset: int, rank: int) -> int:
        """Relaxed 64-bit load (single-copy atomic, see the module docstring)."""
        return self.memory.load(self._word(alloc, offset, rank))

    def wait_until(self, alloc: HostAllocation, offset: int, rank: int, cmp: str, value: int,
                   timeout_s: float) -> Tuple[bool, int]:
        """Poll ``rank``'s word until ``CMP[cmp](word, value)`` with backoff; acquire on success.

        Returns:
            ``(satisfied, observed)``; ``satisfied`` is False when ``timeout_s`` passed first.

        Raises:
            ConfigError: unknown ``cmp`` or a non-positive ``timeout_s``.
        """
        if cmp not in CMP:
            raise ConfigError(f"cmp={cmp!r}: expected one of {sorted(CMP)}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        compare = CMP[cmp]
        word = self._word(alloc, offset, rank)
        deadline = time.monotonic() + timeout_s
        num_polls = 0
        sleep_s = _SLEEP_MIN_S
        load = self.memory.load
        while True:
            observed = load(word)
            if compare(observed, value):
                # Acquire: pairs with the writer's fence() before its signal; later loads see the payload.
                self.memory.acquire(alloc.handle)
                return True, observed
            if time.monotonic() >= deadline:
                return False, observed
            num_polls += 1
            if num_polls <= _YIELD_POLLS:
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, _SLEEP_MAX_S)

    # --- ordering and collectives ---------------------------------------------------------------------

    def fence(self) -> None:
        """Release: a full memory barrier (``Win.Sync`` on every live window, or one
        ``atomic_thread_fence``)."""
        self._check_open()
        self.memory.fence([alloc.handle for alloc in self._live.values()])

    def barrier(self, *, what: str = "host backend: barrier") -> None:
        """Collective barrier with full ordering: Sync, bounded barrier, Sync on every live window.

        Raises:
            PeerTimeout: a rank did not arrive within the bound.
        """
        self._check_open()
        self.fence()
        self.collectives.barrier(what=what)
        self.fence()

    def finalize(self) -> None:
        """Collective: free every allocation still live (and MPI's node communicator). Idempotent. With broken
        collectives nothing collective runs: the memory is dropped."""
        if self._finalized:
            return
        self._finalized = True
        try:
            for alloc in list(self._live.values()):
                self.free(alloc)
            self.memory.close(not self.collectives.broken)
        finally:
            for alloc in list(self._live.values()):
                self._drop(alloc)
            if self._owns_collectives:
                self.collectives.close()
        log.debug("host backend finalized on rank %d", self.rank)

    # --- checks ---------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._finalized:
            raise RingClosedError("the host backend was finalized")

    def _check_alloc(self, alloc) -> None:
        if not isinstance(alloc, HostAllocation):
            raise ConfigError(f"alloc={alloc!r}: expected a HostAllocation of this backend")
        if alloc.freed:
            raise RingClosedError(f"{alloc!r} was freed")

    def _check_rank(self, rank) -> None:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank={rank!r}: expected 0 <= rank < world_size={self.world_size}")


def _boot_id() -> str:
    """This machine's boot id: two machines may share a host name (cloned images), not a boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
