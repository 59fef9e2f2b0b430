"""Programmatic dependent launch (PDL) of the library's CuPy kernels: ``cuLaunchKernelEx`` with the
programmatic-stream-serialization attribute, so a kernel's launch (block scheduling, prologue) overlaps the
end of the kernel before it on the stream instead of following it.

Hopper's rule, which every kernel launched here keeps: its threads run ``griddepcontrol.wait`` (device/
symmring/protocol.cuh ``grid_dependency_wait``) before they touch memory, so the kernel still sees
everything the previous kernel wrote and writes nothing that kernel still reads: stream order, less the
launch gap. The previous kernel lets it start with ``griddepcontrol.launch_dependents`` (or by ending).
One kernel waits later: the fused dispatch reads of the fused producer before it only the slot, behind the
ring's own acquire, so it polls while the producer writes and runs its wait at its end (device/moe/
dispatch.cu ``moe_dispatch_fused_fp8``); the producer is then wholly resident (a dependent launches only
once every block of the kernel before it triggered), so the dispatch's spin cannot keep it off an SM. The
fused engine's TMA experts kernel, launched here after that dispatch, waits likewise for the dispatch's own
words and not for its end (`symmring.moe.engines.fused.FusedExperts.begin_beside_dispatch`).

Where it is used (`PdlLauncher.enabled`): compute capability >= 9, ``SYMMRING_PDL`` not ``0``, and ONE PE
on the GPU. A dependent kernel's blocks hold their SMs while they wait; with several PEs on one GPU (MPS)
those SMs could be the ones another PE's kernel needs to finish the spin wait the first PE is in (the
budget of `symmring.moe.gpu.stages.spin_blocks`), so that configuration keeps plain launches.

A stream capture records the launches as programmatic graph edges (CUDA >= 12.3), so graph replays keep
the overlap. Driver entry point through ctypes (libcuda); no launch attribute is reachable from CuPy.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Sequence

import numpy as np

from .errors import BackendError

#: CUlaunchAttributeID: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (here its first int, the
    # programmaticStreamSerializationAllowed flag, then the rest of the union).
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_ubyte * 60)]


class _LaunchConfig(ctypes.Structure):
    # CUlaunchConfig.
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


#: The oldest driver whose stream capture records programmatic edges (CUDA 12.3).
MIN_DRIVER_VERSION = 12030


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    """libcuda's cuLaunchKernelEx, or None where the driver lacks it or predates `MIN_DRIVER_VERSION`."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < MIN_DRIVER_VERSION:
            return None
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


def requested() -> bool:
    """``SYMMRING_PDL`` (``1`` default; ``0`` keeps every launch plain)."""
    return os.environ.get("SYMMRING_PDL", "1").strip() != "0"


def _arg_bytes(arg) -> bytes:
    """A kernel argument's bytes: numpy scalars and one-element numpy arrays (a struct passed by value,
    `symmring.moe.gpu.kernel_args`) as they are, device arrays (CuPy) as their address."""
    if isinstance(arg, np.generic) or (isinstance(arg, np.ndarray) and arg.size == 1):
        return arg.tobytes()
    data = getattr(arg, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return np.uint64(data.ptr).tobytes()
    raise BackendError(f"PDL launch: unsupported kernel argument {type(arg).__name__} (expected a numpy scalar, a "
                       "one-element numpy array or a CuPy array)")


def _dim3(dims: Sequence[int]):
    dims = tuple(int(d) for d in dims) + (1, 1, 1)
    return dims[:3]


class PdlLauncher:
    """Launches CuPy ``Function`` objects with PDL where `enabled`, else as ``fn(grid, block, args, ...)``.

    Args:
        compute_capability: the major compute capability of this PE's GPU.
        pes_per_gpu: PEs that share this PE's GPU.

    Attributes:
        enabled: whether launches use PDL (settable, e.g. to compare against plain launches).
        launches: PDL launches made so far (tests check that the path ran).
    """

    def __init__(self, compute_capability: int, pes_per_gpu: int):
        self.enabled = (compute_capability >= 9 and pes_per_gpu == 1 and requested()
                        and _launch_kernel_ex() is not None)
        self.launches = 0
        self._attr = _LaunchAttribute()
        self._attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value = 1

    def __call__(self, fn, grid, block, args, *, stream, shared_mem: int = 0) -> None:
        """Launch ``fn`` (a CuPy ``Function``) on ``stream`` (a CuPy stream) with ``args`` (numpy scalars,
        one-element numpy arrays passed by value, and CuPy arrays, as CuPy takes them)."""
        if not self.enabled:
            fn(grid, block, args, stream=stream, shared_mem=shared_mem)
            return
        buffers = [ctypes.create_string_buffer(_arg_bytes(a)) for a in args]
        params = (ctypes.c_void_p * max(1, len(buffers)))(*[ctypes.cast(b, ctypes.c_void_p) for b in buffers])
        gx, gy, gz = _dim3(grid)
        bx, by, bz = _dim3(block)
        config = _LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), ctypes.c_void_p(int(stream.ptr)),
                               ctypes.pointer(self._attr), 1)
        status = _launch_kernel_ex()(ctypes.byref(config), ctypes.c_void_p(int(fn.ptr)), params, None)
        if status != 0:
            raise BackendError(f"cuLaunchKernelEx (PDL) of a symmring kernel failed with CUresult {status}; "
                               "SYMMRING_PDL=0 launches without it")
        self.launches += 1
