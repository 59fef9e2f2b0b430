"""The small interface every backend implements, so the protocol code never branches on the backend.

Two implementations:

* ``host`` (`symmring.backends.host`): CPU ranks on one node; the "symmetric heap" is an MPI-3
  shared-memory window (``MPI.Win.Allocate_shared``) and peers are reached by plain loads and stores.
* ``nvshmem`` (`symmring.backends.nvshmem`): GPU PEs; the symmetric heap is NVSHMEM's (nvshmem4py), peers
  are reached over NVLink. Host-side primitives here are for control and tests; the fast path runs the same
  protocol inside kernels (``device/symmring/protocol.cuh``). It is a `DeviceBackend`: what the GPU
  layers (`symmring.kernels`, `symmring.moe.gpu`) need beyond `Backend`, declared once below, so they
  check the backend by type and never by a name string.

Semantics every implementation provides (the protocol's correctness argument uses exactly these):

* ``alloc`` is collective and returns a zero-filled allocation of identical size on every rank;
  ``free`` is collective.
* ``view(alloc, rank, offset, dtype, shape)`` is a zero-copy array over ``rank``'s copy of the bytes
  (a NumPy array on ``host``, a CuPy array on ``nvshmem``).
* ``signal_set``/``signal_add``/``atomic_or`` update one 64-bit word on a peer. They are *relaxed*: they
  do not order earlier stores. A publisher calls ``fence()`` first (release).
* ``wait_until`` polls one 64-bit word until ``cmp(word, value)`` holds or ``timeout_s`` passes, and ends
  with an acquire: loads issued after it see everything released before the signal it observed.
  It returns ``(satisfied, observed)``; raising ``ProtocolTimeout`` is the caller's job, since only the
  caller knows which rank, slot and generation the word stands for.
* ``fence()`` is a release fence over all earlier stores to any rank (system scope).
* ``alloc``, ``free``, ``barrier`` and ``finalize`` wait for the other ranks only through the backend's
  bounded collectives (``collectives``, a `symmring.collective.Collectives`): a late or vanished rank is a
  `symmring.errors.PeerTimeout` naming it, never a hang. Once they are broken, ``free`` and ``finalize``
  drop their memory without any collective step.
"""

from __future__ import annotations

import abc
import operator
from typing import TYPE_CHECKING, Callable, Dict, Tuple

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ..collective import Collectives

#: Comparisons accepted by ``wait_until`` (NVSHMEM's NVSHMEM_CMP_* names).
CMP: Dict[str, Callable[[int, int], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "ge": operator.ge,
    "gt": operator.gt,
    "le": operator.le,
    "lt": operator.lt,
}


class SymmetricAllocation(abc.ABC):
    """A block of bytes at the same offset in every rank's symmetric memory."""

    nbytes: int


class Backend(abc.ABC):
    """Symmetric memory and 64-bit signals over ranks. See the module docstring for the semantics."""

    #: ``"host"`` or ``"nvshmem"``.
    name: str
    #: This process's rank, the number of ranks, and its rank within its node.
    rank: int
    world_size: int
    local_rank: int
    #: Human-readable device, e.g. ``"cpu"`` or ``"cuda:0 (NVIDIA H200)"``.
    device: str
    #: The bounded host collectives over the backend's ranks (`symmring.collective.Collectives`).
    collectives: "Collectives"

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> SymmetricAllocation:
        """Collective: a zero-filled symmetric allocation of ``nbytes`` bytes."""

    @abc.abstractmethod
    def free(self, alloc: SymmetricAllocation) -> None:
        """Collective: release ``alloc``."""

    @abc.abstractmethod
    def view(self, alloc: SymmetricAllocation, rank: int, offset: int, dtype, shape: Tuple[int, ...]):
        """Zero-copy array of ``shape``/``dtype`` over ``rank``'s copy, starting ``offset`` bytes in."""

    @abc.abstractmethod
    def signal_set(self, alloc: SymmetricAllocation, offset: int, value: int, rank: int) -> None:
        """Relaxed 64-bit store of ``value`` to ``rank``'s word at ``offset``."""

    @abc.abstractmethod
    def signal_add(self, alloc: SymmetricAllocation, offset: int, value: int, rank: int) -> None:
        """Relaxed atomic 64-bit add to ``rank``'s word at ``offset``."""

    @abc.abstractmethod
    def atomic_or(self, alloc: SymmetricAllocation, offset: int, value: int, rank: int) -> None:
        """Relaxed atomic 64-bit OR into ``rank``'s word at ``offset``."""

    @abc.abstractmethod
    def read_word(self, alloc: SymmetricAllocation, offset: int, rank: int) -> int:
        """Relaxed 64-bit load of ``rank``'s word at ``offset``."""

    @abc.abstractmethod
    def wait_until(self, alloc: SymmetricAllocation, offset: int, rank: int, cmp: str, value: int,
                   timeout_s: float) -> Tuple[bool, int]:
        """Poll ``rank``'s word until ``CMP[cmp](word, value)``; acquire on success.

        Returns ``(satisfied, observed)``; ``satisfied`` is False when ``timeout_s`` expired first.
        """

    @abc.abstractmethod
    def fence(self) -> None:
        """Release fence: earlier stores (to any rank) are visible before later signal operations."""

    @abc.abstractmethod
    def barrier(self, *, what: str = "barrier") -> None:
        """Collective barrier over all ranks, with full memory ordering, bounded by ``collectives``
        (``what`` is named in its `symmring.errors.PeerTimeout`)."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Release the backend (collective). Idempotent."""

    # Shared helper: NumPy dtype of a 64-bit signal word.
    WORD = np.dtype(np.uint64)


class LoadedModule(abc.ABC):
    """Device code loaded by a `DeviceBackend`: its kernels by name."""

    name: str

    @abc.abstractmethod
    def function(self, kernel_name: str):
        """The launchable kernel ``kernel_name``: ``fn(grid, block, args, shared_mem=0, stream=None)``."""


class DeviceBackend(Backend):
    """A backend whose ranks are GPU processing elements: what the GPU layers call beyond `Backend`.

    Attributes:
        device_id: this PE's CUDA device; num_sms: its multiprocessors; compute_capability: e.g. 90.
    """

    device_id: int
    num_sms: int
    compute_capability: int

    @abc.abstractmethod
    def address(self, alloc: SymmetricAllocation, rank: int, offset: int = 0) -> int:
        """Device address, in this process, of ``rank``'s copy of ``alloc`` plus ``offset``."""

    @abc.abstractmethod
    def torch_view(self, alloc: SymmetricAllocation, rank: int, offset: int, dtype, shape: Tuple[int, ...]):
        """Zero-copy torch tensor over the same bytes as `view`."""

    @abc.abstractmethod
    def load_module(self, source: str, *, name: str, extra_options=()) -> LoadedModule:
        """Compile (cached) and load device ``source``, ready for kernels that use the symmetric heap."""

    @abc.abstractmethod
    def library_module(self, name: str) -> LoadedModule:
        """One of symmring's own device modules (`symmring.jit.LIBRARY_MODULES`), loaded once per backend."""
