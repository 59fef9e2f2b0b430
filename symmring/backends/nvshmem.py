"""The ``nvshmem`` backend: NVSHMEM initialisation, symmetric allocations and device modules on GPU PEs.

`NvshmemBackend` implements `symmring.backends.base.DeviceBackend` through nvshmem4py:

* the CUDA runtime is initialised on the PE's device first, then NVSHMEM from a unique id
  (``initializer_method="uid"``): rank 0 makes it and sends it to every rank in a bounded exchange of the
  context's collectives, over MPI (mpirun) or a torch.distributed group (torchrun, a subgroup: one NVSHMEM
  job per group), as DeepEP does over its group; NVSHMEM's own MPI bootstrap is never used (the wheel's
  plugin is built for Open MPI only);
* one GPU per local rank, or several PEs on one GPU when a node has more ranks than GPUs (logged;
  kernels of different PEs then run concurrently only under CUDA MPS -- see `symmring.launch`);
* the GPU environment policy of `symmring.env.GPU_ENV` (``NVSHMEM_DISABLE_NVLS=1``,
  ``CUDA_MODULE_LOADING=EAGER``, ...) is applied unless the user set the variables, before the first
  CUDA call; ``NVSHMEM_REMOTE_TRANSPORT=none`` only once the job's nodes are counted (every rank's host
  name, before NVSHMEM init) and there is one: across nodes NVSHMEM picks its remote
  transport, and the backend logs which (`node_env`);
* nvshmem4py's own prints are kept out of the user's output;
* allocations come from the symmetric heap (``nvshmem_malloc``); `view` gives zero-copy CuPy arrays of
  this PE's or a peer's copy (peers through ``nvshmem_ptr``), `torch_view` the same as torch tensors;
* device modules: `NvshmemBackend.load_module` compiles through `symmring.jit` (once per node, cached),
  loads the cubin into CuPy and registers it with NVSHMEM (``cumodule_init``; unregistered at `finalize`);
  `library_module` does that once per backend for symmring's own modules;
* the host primitives (signal_set/add, atomic_or, read_word, wait_until, fence) are one-thread kernels of
  ``device/ring.cu`` launched on the current CuPy stream, so they are ordered with the copies a caller
  made through views on that stream. `wait_until` is bounded on the device (``%globaltimer``).

Nothing here runs at import time; importing this module does not import CuPy or nvshmem4py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import deps, env
from ..collective import Collectives
from ..errors import BackendError, BrokenStateError, ConfigError, PeerTimeout, RingClosedError
from ..launch import node_local_rank
from ..world import local_rank
from .base import CMP, DeviceBackend, LoadedModule, SymmetricAllocation

logger = logging.getLogger(__name__)

#: Modules the backend needs (`gpu_available` checks them without importing them).
GPU_MODULES = ("cupy", "nvshmem", "nvidia.nvshmem")

_WORD_OPS = {"set": 0, "add": 1, "or": 2}  # device/ring.cu WordOp
_CMP_CODES = {name: code for code, name in enumerate(CMP)}  # device/ring.cu WordCmp (order of base.CMP)
_quiet_lock = threading.Lock()


def gpu_available() -> bool:
    """Whether the nvshmem backend can run here: CuPy with a visible CUDA device, nvshmem4py and the
    nvidia-nvshmem wheel are installed. Never raises; imports nothing that prints or initialises NVSHMEM.
    Applies the GPU environment policy (`symmring.env.apply_gpu_env`: ``CUDA_MODULE_LOADING=EAGER``,
    NVLink multicast off, ...) first, since its device query may be the first CUDA call of the process;
    the settings for one node only wait for the backend, which counts the job's nodes (`node_env`).
    Logs why not at INFO (the reason behind ``init("auto")`` choosing the host backend).
    """
    try:
        env.apply_gpu_env(num_nodes=None)  # before CUDA initialises here; the user's values are kept
        missing = [deps.OPTIONAL[m][0] for m in GPU_MODULES if not deps.installed(m)]
        if missing:
            logger.info("no GPU backend: %s not installed (pip install \"symmring[gpu]\")", ", ".join(missing))
            return False
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if count == 0:
            logger.info("no GPU backend: CuPy sees no CUDA device")
        return count > 0
    except Exception as exc:  # any failure (no driver, broken install) means "not available"
        logger.info("no GPU backend: %s: %s", type(exc).__name__, exc)
        return False


def count_nodes(local_rank: int, collectives: Collectives) -> int:
    """The job's number of nodes: the ranks whose node-local rank (`symmring.world.local_rank`) is 0.
    Collective over ``collectives`` (bounded)."""
    return sum(1 for leader in collectives.allgather(local_rank == 0, what="nvshmem backend: node count")
               if leader)


def count_pes_per_gpu(device_id: int, collectives: Collectives, runtime) -> int:
    """The job's PEs on this PE's physical GPU (same host and PCI address): what the small-batch kernels'
    grid cap divides by. Ranks given one GPU each through CUDA_VISIBLE_DEVICES see one device apiece, so
    the node's rank and device counts cannot tell. Collective over ``collectives`` (bounded).

    Example (one rank, a stand-in runtime):
        >>> class Runtime:
        ...     def getDeviceProperties(self, device):
        ...         return {"pciDomainID": 0, "pciBusID": 0x1B, "pciDeviceID": 0}
        >>> from symmring.collective import Collectives
        >>> count_pes_per_gpu(0, Collectives(None, 5.0), Runtime())
        1
    """
    import socket

    props = runtime.getDeviceProperties(device_id)  # cupy.cuda.runtime
    mine = (socket.gethostname(), int(props["pciDomainID"]), int(props["pciBusID"]), int(props["pciDeviceID"]))
    return sum(1 for gpu in collectives.allgather(mine, what="nvshmem backend: PEs per GPU") if tuple(gpu) == mine)


def node_env(num_nodes: int, environ=None, *, rank: int = 0) -> Dict[str, str]:
    """Apply the GPU environment policy for a job on ``num_nodes`` nodes (`symmring.env.apply_gpu_env`):
    ``NVSHMEM_REMOTE_TRANSPORT=none`` on one node, left to NVSHMEM across nodes (``ibrc`` unless built for
    UCX; IBGDA with ``NVSHMEM_IB_ENABLE_IBGDA=1``). Logs the choice at INFO on rank 0, and warns on every
    rank when the user's ``NVSHMEM_REMOTE_TRANSPORT=none`` meets a job on several nodes. Returns what was set.

    Example:
        >>> "NVSHMEM_REMOTE_TRANSPORT" in node_env(1, {}), "NVSHMEM_REMOTE_TRANSPORT" in node_env(2, {})
        (True, False)
    """
    environ = os.environ if environ is None else environ
    applied = env.apply_gpu_env(environ, num_nodes=num_nodes)
    note = env.remote_transport_note(num_nodes, environ)
    if num_nodes > 1 and environ.get("NVSHMEM_REMOTE_TRANSPORT") == "none":
        logger.warning("nvshmem backend: %s", note)
    elif rank == 0:
        logger.info("nvshmem backend: %s", note)
    return applied


@contextlib.contextmanager
def quiet_nvshmem():
    """Swallow what nvshmem4py prints (``Importing MPI``, ``MPI4Py enabled``, ``CUmodule init status``)
    during import, init and module registration; it is logged at DEBUG level instead."""
    with _quiet_lock:
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
        text = sink.getvalue().strip()
        if text:
            logger.debug("nvshmem4py: %s", text)


def _cuda_core_device(device_id: int):
    try:
        from cuda.core import Device
    except ImportError:  # cuda-core < 1.0
        from cuda.core.experimental import Device
    return Device(device_id)


class NvshmemAllocation(SymmetricAllocation):
    """A block of NVSHMEM symmetric memory: ``ptr`` is this PE's address, ``nbytes`` its size."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.freed = False

    def __repr__(self) -> str:
        return f"NvshmemAllocation(ptr={self.ptr:#x}, nbytes={self.nbytes}, freed={self.freed})"


class NvshmemModule(LoadedModule):
    """A cubin loaded into CuPy and registered with NVSHMEM by `NvshmemBackend.load_module`.

    Attributes:
        name: the module's name; path: the cubin; module: the ``cupy.cuda.function.Module``; ptr: its CUmodule.
    """

    def __init__(self, name: str, path, module):
        self.name = name
        self.path = path
        self.module = module
        self.ptr = int(module.ptr)
        self._functions: Dict[str, object] = {}

    def function(self, kernel_name: str):
        """The ``cupy.cuda.function.Function`` of ``extern "C"`` kernel ``kernel_name``; call it as
        ``fn(grid, block, args, shared_mem=0, stream=None)``."""
        fn = self._functions.get(kernel_name)
        if fn is None:
            fn = self._functions[kernel_name] = self.module.get_function(kernel_name)
        return fn


class NvshmemBackend(DeviceBackend):
    """Symmetric memory and 64-bit signals over GPU PEs (NVSHMEM through nvshmem4py).

    Args:
        world: mpi4py communicator or torch.distributed ProcessGroup of the PEs (default: the launcher's,
            `symmring.world.resolve`).
        device_id: CUDA device of this PE (default: the launcher's node-local rank -- torchrun's
            ``LOCAL_RANK``, MPI's -- else the rank's place among the PEs of its host, modulo the visible GPUs).
        collectives: the bounded host collectives over ``world`` (the context's); None makes the backend
            its own, bounded by ``SYMMRING_HOST_TIMEOUT_S``.

    Raises:
        BackendError: CuPy, nvshmem4py, the nvidia-nvshmem wheel or a GPU is missing, or NVSHMEM failed
            to initialise.
        PeerTimeout: a PE did not arrive within the bound.

    Example (a GPU with NVSHMEM; skipped by the CPU doctest run):
        >>> backend = NvshmemBackend()                # python script.py, or under mpirun  # doctest: +SKIP
        >>> alloc = backend.alloc(4096)                                                  # doctest: +SKIP
        >>> words = backend.view(alloc, backend.rank, 0, np.uint64, (8,))   # a CuPy array # doctest: +SKIP
        >>> backend.free(alloc); backend.finalize()                                      # doctest: +SKIP
    """

    name = "nvshmem"

    def __init__(self, world=None, *, device_id: Optional[int] = None, collectives: Optional[Collectives] = None):
        if not gpu_available():
            raise BackendError("the nvshmem backend needs a CUDA GPU, CuPy (cupy-cuda13x), nvshmem4py-cu13 and "
                               "nvidia-nvshmem-cu13; use backend='host' on machines without them")
        import cupy
        self._cupy = cupy
        self.comm = world if world is not None else self._default_comm()
        self._owns_collectives = collectives is None
        self.collectives = Collectives(self.comm, env.host_timeout_s(), what="NvshmemBackend") if collectives is None \
            else collectives
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        # NVSHMEM's init blocks until every PE calls it: start it only once all are here.
        self.collectives.barrier(what="nvshmem backend: init")
        # The node's own ranks (every rank's host name), never the world rank; the launcher's node-local rank
        # (LOCAL_RANK, MPI's) picks the GPU, so PEs of several groups of one job spread like the job's ranks.
        hosts = self.collectives.allgather(socket.gethostname(), what="nvshmem backend: hosts")
        self.local_rank = local_rank(hosts, self.rank)
        local_size = hosts.count(hosts[self.rank])
        self.num_nodes = len(set(hosts))
        num_gpus = cupy.cuda.runtime.getDeviceCount()
        if device_id is None:
            launcher = node_local_rank()
            device_id = (launcher[0] if launcher is not None else self.local_rank) % num_gpus
        if not isinstance(device_id, int) or not 0 <= device_id < num_gpus:
            raise ConfigError(f"device_id={device_id!r}: expected an int in [0, {num_gpus}) (visible GPUs)")
        self.device_id = device_id
        self.pes_per_gpu = (count_pes_per_gpu(device_id, self.collectives, cupy.cuda.runtime)
                            if self.world_size > 1 else 1)
        if self.pes_per_gpu > 1:
            logger.warning("%d ranks on this node (%d visible GPU(s) each): %d PEs share this PE's GPU. Their "
                           "kernels run concurrently only under CUDA MPS (CUDA_MPS_PIPE_DIRECTORY=%s); start the "
                           "job with `python -m symmring.launch --mps` or `symmring-mpirun --mps`.", local_size,
                           num_gpus, self.pes_per_gpu, os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "<unset>"))
        node_env(self.num_nodes, rank=self.rank)  # before NVSHMEM init, which reads the transport variables

        # CUDA runtime first, on the PE's device (NVSHMEM init on an uninitialised context can fail).
        cupy.cuda.Device(device_id).use()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))
        if "torch" in __import__("sys").modules:
            import torch
            if torch.cuda.is_available():
                torch.cuda.set_device(device_id)
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        self.compute_capability = int(props["major"]) * 10 + int(props["minor"])
        gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.device = f"cuda:{device_id} ({gpu_name})"
        self.num_sms = int(props["multiProcessorCount"])

        try:
            with quiet_nvshmem():
                import nvshmem.bindings as nvshmem_bindings
                import nvshmem.core as nvshmem_core
                logging.getLogger("nvshmem").setLevel(logging.WARNING)
                dev = _cuda_core_device(device_id)
                dev.set_current()
            uid = self._unique_id(nvshmem_core)
            with quiet_nvshmem():
                nvshmem_core.init(device=dev, uid=uid, rank=self.rank, nranks=self.world_size,
                                  initializer_method="uid")
        except (PeerTimeout, BrokenStateError):
            raise
        except Exception as exc:
            raise BackendError(f"NVSHMEM initialisation failed on rank {self.rank} ({self.device}): {exc}") from exc
        self._nvshmem = nvshmem_bindings
        self._nvshmem_core = nvshmem_core
        if nvshmem_bindings.my_pe() != self.rank or nvshmem_bindings.n_pes() != self.world_size:
            raise BackendError(f"NVSHMEM PE {nvshmem_bindings.my_pe()}/{nvshmem_bindings.n_pes()} does not match "
                               f"rank {self.rank}/{self.world_size}")
        self._modules: List[NvshmemModule] = []
        self._library: Dict[str, NvshmemModule] = {}
        self._allocs: Dict[int, NvshmemAllocation] = {}
        self._finalized = False
        self._result = cupy.zeros(2, dtype=cupy.uint64)  # word_read / word_wait results
        logger.info("nvshmem backend: PE %d/%d on %s (sm_%d, %d PEs per GPU)", self.rank, self.world_size,
                    self.device, self.compute_capability, self.pes_per_gpu)

    @staticmethod
    def _default_comm():
        from .. import world
        return world.resolve(timeout_s=env.host_timeout_s())  # the launcher's ranks (symmring.world)

    def _unique_id(self, nvshmem_core):
        """NVSHMEM's unique id of this job: made on rank 0, sent to every rank in a bounded exchange of its
        bytes (over MPI or the torch group alike: one NVSHMEM job per communicator or group). Once the
        exchange completed every rank is there, so NVSHMEM's own (blocking) bootstrap starts with all."""
        import numpy as np
        uid = nvshmem_core.get_unique_id(empty=self.rank != 0)
        raw = uid._data.view(np.uint8)
        root = self.collectives.allgather(raw.tobytes() if self.rank == 0 else None,
                                          what="nvshmem backend: unique id")[0]
        if self.rank != 0:
            raw[:] = np.frombuffer(root, dtype=np.uint8)
        return uid

    # --- device code ----------------------------------------------------------------------------------

    def load_module(self, source: str, *, name: str, extra_options=()) -> "NvshmemModule":
        """Compile (once per node, cached: `symmring.jit.compile_on_node`) and load ``source``, registered
        with NVSHMEM so its kernels may call NVSHMEM device functions; unregistered at `finalize`.

        Raises CompileError with the compiler log.
        """
        self._check_open()
        from .. import jit
        os.environ.setdefault("CUPY_CACHE_DIR", str(env.cache_dir() / "cupy"))
        path = jit.compile_on_node(source, name=name, cc=self.compute_capability, local_rank=self.local_rank,
                                   extra_options=extra_options, collectives=self.collectives)
        # cupy.cuda.function.Module: the CUmodule itself (ptr), loaded eagerly, so cumodule_init can see it.
        module = self._cupy.cuda.function.Module()
        module.load_file(str(path))
        loaded = NvshmemModule(name, path, module)
        with quiet_nvshmem():
            self._nvshmem.cumodule_init(loaded.ptr)
        # Every kernel resolved now, while nothing of ours spins: with lazy loading (CUDA_MODULE_LOADING=LAZY,
        # CUDA's default, in effect when CUDA started before the GPU environment policy applied) a function
        # loads at its first cuModuleGetFunction, which may wait for the running kernels (a spinning wait).
        for kernel in jit.kernel_names(source):
            loaded.function(kernel)
        self._modules.append(loaded)
        return loaded

    def library_module(self, name: str) -> "NvshmemModule":
        """One of symmring's own modules (`symmring.jit.LIBRARY_MODULES`, e.g. ``"ring"``, ``"moe_dispatch"``),
        loaded once per backend."""
        module = self._library.get(name)
        if module is None:
            from .. import jit
            if name not in jit.LIBRARY_MODULES:
                raise ConfigError(f"name={name!r}: expected one of {sorted(jit.LIBRARY_MODULES)}")
            module = self._library[name] = self.load_module(jit.read_source(jit.LIBRARY_MODULES[name]), name=name)
        return module

    def _launch(self, kernel: str, args: Tuple, stream=None) -> None:
        fn = self.library_module("ring").function(kernel)
        fn((1,), (1,), args, stream=stream if stream is not None else self._cupy.cuda.get_current_stream())

    # --- memory ---------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._finalized:
            raise RingClosedError("the nvshmem backend was finalized")

    def alloc(self, nbytes: int) -> NvshmemAllocation:
        """Collective: ``nbytes`` zero-filled bytes of symmetric memory (same size on every PE).

        Raises ConfigError for a non-positive size.
        """
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes <= 0:
            raise ConfigError(f"nbytes={nbytes!r}: expected a positive int")
        # nvshmem_malloc is collective (it synchronises every PE): start it only once all are here.
        self.collectives.barrier(what=f"nvshmem backend: alloc of {nbytes} bytes")
        ptr = int(self._nvshmem.malloc(int(nbytes)))
        if ptr == 0:
            raise BackendError(f"nvshmem_malloc({nbytes}) failed on rank {self.rank}: symmetric heap exhausted? "
                               "(NVSHMEM_SYMMETRIC_SIZE sizes it, default 1 GiB)")
        alloc = NvshmemAllocation(ptr, int(nbytes))
        self._cupy.cuda.runtime.memset(ptr, 0, int(nbytes))
        self._allocs[ptr] = alloc
        self.barrier(what="nvshmem backend: alloc (zero fill)")  # every PE's zero fill is done first
        return alloc

    def free(self, alloc: NvshmemAllocation) -> None:
        """Collective: release ``alloc`` (idempotent per allocation)."""
        if alloc.freed or self._finalized:
            return
        if self.collectives.broken:  # nvshmem_free is collective: drop it (the heap goes with the process)
            alloc.freed = True
            self._allocs.pop(alloc.ptr, None)
            logger.warning("rank %d: %d bytes of symmetric memory dropped without nvshmem_free (collective) after "
                           "broken collectives: %s", self.rank, alloc.nbytes, self.collectives.failure)
            return
        self.barrier(what=f"nvshmem backend: free of {alloc.nbytes} bytes")  # no PE still uses any copy
        self._nvshmem.free(alloc.ptr)
        alloc.freed = True
        self._allocs.pop(alloc.ptr, None)

    def address(self, alloc: NvshmemAllocation, rank: int, offset: int = 0) -> int:
        """Address, in this process, of ``rank``'s copy of ``alloc`` plus ``offset`` (nvshmem_ptr).

        Raises BackendError when that PE's memory is not load/store reachable from here.
        """
        self._check_alloc(alloc, rank, offset, 0)
        if rank == self.rank:
            return alloc.ptr + offset
        peer = int(self._nvshmem.ptr(alloc.ptr, rank))
        if peer == 0:
            raise BackendError(f"rank {rank}'s symmetric memory is not load/store reachable from rank "
                               f"{self.rank} (no NVLink/P2P mapping)")
        return peer + offset

    def peer_mapped(self, alloc: NvshmemAllocation, rank: int) -> bool:
        """Whether ``rank``'s copy of ``alloc`` is load/store reachable from here (nvshmem_ptr is not null;
        always true for this PE). `symmring.transport` picks p2p or rdma per peer from it."""
        self._check_alloc(alloc, rank, 0, 0)
        return rank == self.rank or int(self._nvshmem.ptr(alloc.ptr, rank)) != 0

    def _check_alloc(self, alloc, rank: int, offset: int, nbytes: int) -> None:
        self._check_open()
        if not isinstance(alloc, NvshmemAllocation) or alloc.freed:
            raise ConfigError(f"alloc={alloc!r}: expected a live allocation of this backend")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank={rank!r}: expected 0 <= rank < world_size={self.world_size}")
        if offset < 0 or offset + nbytes > alloc.nbytes:
            raise ConfigError(f"offset={offset}, nbytes={nbytes}: outside the {alloc.nbytes}-byte allocation")

    def view(self, alloc: NvshmemAllocation, rank: int, offset: int, dtype, shape: Tuple[int, ...]):
        """Zero-copy CuPy array over ``rank``'s copy of ``alloc`` at ``offset`` bytes."""
        cupy = self._cupy
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._check_alloc(alloc, rank, offset, nbytes)
        if offset % dtype.itemsize:
            raise ConfigError(f"offset={offset}: expected a multiple of {dtype} size {dtype.itemsize}")
        address = self.address(alloc, rank, offset)
        memory = cupy.cuda.UnownedMemory(address, max(nbytes, 1), alloc, device_id=self.device_id)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))

    def torch_view(self, alloc: NvshmemAllocation, rank: int, offset: int, dtype, shape: Tuple[int, ...]):
        """Zero-copy torch tensor over the same bytes as `view` (through DLPack)."""
        import torch
        return torch.from_dlpack(self.view(alloc, rank, offset, dtype, shape))

    # --- 64-bit words ---------------------------------------------------------------------------------

    def _word(self, alloc: NvshmemAllocation, offset: int, rank: int) -> np.uint64:
        self._check_alloc(alloc, rank, offset, 8)
        if offset % 8:
            raise ConfigError(f"offset={offset}: a 64-bit word must be 8-byte aligned")
        return np.uint64(alloc.ptr + offset)  # the LOCAL address: device code maps it to `rank`

    def _word_op(self, op: str, alloc, offset: int, value: int, rank: int) -> None:
        word = self._word(alloc, offset, rank)
        self._launch("symmring_word_op", (word, np.uint64(value), np.int32(rank), np.int32(_WORD_OPS[op])))

    def signal_set(self, alloc, offset: int, value: int, rank: int) -> None:
        """Relaxed SET of ``rank``'s word (nvshmemx_signal_op), enqueued on the current CuPy stream."""
        self._word_op("set", alloc, offset, value, rank)

    def signal_add(self, alloc, offset: int, value: int, rank: int) -> None:
        """Relaxed ADD to ``rank``'s word (nvshmemx_signal_op), enqueued on the current CuPy stream."""
        self._word_op("add", alloc, offset, value, rank)

    def atomic_or(self, alloc, offset: int, value: int, rank: int) -> None:
        """Relaxed atomic OR into ``rank``'s word (nvshmem_uint64_atomic_or), on the current stream."""
        self._word_op("or", alloc, offset, value, rank)

    def read_word(self, alloc, offset: int, rank: int) -> int:
        """Relaxed load of ``rank``'s word, after everything enqueued on the current stream."""
        word = self._word(alloc, offset, rank)
        stream = self._cupy.cuda.get_current_stream()
        self._launch("symmring_word_read", (word, np.int32(rank), self._result), stream)
        stream.synchronize()
        return int(self._result[0].get())

    def wait_until(self, alloc, offset: int, rank: int, cmp: str, value: int,
                   timeout_s: float) -> Tuple[bool, int]:
        """Bounded poll (on the device) of ``rank``'s word until ``CMP[cmp](word, value)``; acquire on
        success. Returns ``(satisfied, observed)``.

        Raises ConfigError for an unknown ``cmp`` or a non-positive ``timeout_s``.
        """
        if cmp not in _CMP_CODES:
            raise ConfigError(f"cmp={cmp!r}: expected one of {sorted(_CMP_CODES)}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        word = self._word(alloc, offset, rank)
        stream = self._cupy.cuda.get_current_stream()
        self._launch("symmring_word_wait", (word, np.int32(rank), np.int32(_CMP_CODES[cmp]), np.uint64(value),
                                            np.uint64(int(timeout_s * 1e9)), self._result), stream)
        stream.synchronize()
        satisfied, observed = (int(v) for v in self._result.get())
        return bool(satisfied), observed

    def fence(self) -> None:
        """Release fence (nvshmem_fence) after everything enqueued on the current stream."""
        self._check_open()
        self._launch("symmring_fence", ())

    def barrier(self, *, what: str = "nvshmem backend: barrier") -> None:
        """Collective: the device is idle and every PE arrived (device sync, then a bounded barrier).

        Raises:
            PeerTimeout: a PE did not arrive within the bound.
        """
        self._check_open()
        self._cupy.cuda.runtime.deviceSynchronize()
        self.collectives.barrier(what=what)

    def finalize(self) -> None:
        """Collective, idempotent: free what is left, unregister modules, finalize NVSHMEM. With broken
        collectives nothing collective runs (``nvshmem_free`` and ``nvshmem_finalize`` are collective):
        the allocations are dropped and NVSHMEM is left to the process exit (a warning says so). A PE that
        does not reach one of the bounded barriers before them breaks the collectives the same way: the
        rest is dropped and the `PeerTimeout` raised."""
        if self._finalized:
            return
        if self.collectives.broken:
            self._drop()
            return
        self._cupy.cuda.runtime.deviceSynchronize()
        try:
            for alloc in list(self._allocs.values()):
                self.free(alloc)  # each after a bounded barrier
            self.collectives.barrier(what="nvshmem backend: finalize")
        except (PeerTimeout, BrokenStateError):  # a PE did not come: the collectives are broken now
            self._drop()
            raise
        with quiet_nvshmem():
            for module in self._modules:
                # bindings.cumodule_finalize: core.module_finalize is broken in nvshmem4py 0.4.1.
                self._nvshmem.cumodule_finalize(module.ptr)
        self._finalized = True
        with quiet_nvshmem():
            self._nvshmem_core.finalize()
        if self._owns_collectives:
            self.collectives.close()

    def _drop(self) -> None:
        """Finalize without any collective call (after broken collectives): the allocations are dropped,
        nvshmem_free and nvshmem_finalize never run (each waits for every PE), NVSHMEM goes with the process
        (which ends the job at exit: `symmring.collective`)."""
        self._finalized = True
        for alloc in self._allocs.values():
            alloc.freed = True
        self._allocs.clear()
        logger.warning("rank %d: nvshmem backend dropped without the collective teardown (nvshmem_free, "
                       "nvshmem_finalize) after broken collectives: %s", self.rank, self.collectives.failure)

    @property
    def finalized(self) -> bool:
        return self._finalized

