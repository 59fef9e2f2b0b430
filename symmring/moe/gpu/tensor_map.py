"""CUDA tensor maps for the TMA loads of the fused engine's ``wg64t`` and ``wg128t`` kernels
(``device/moe/fused_experts_tma.cu``).

A tensor map (the driver's ``CUtensorMap``: 128 opaque bytes) tells the TMA unit where a 2D tensor lies in global
memory and which box of it one copy brings into shared memory, and how it is swizzled there. The kernel copies
tiles of 128-byte rows (one 128-wide K block of e4m3) with the 128-byte swizzle, which is exactly the layout its
wgmma descriptors expect (``device/moe/wgmma_layout.cuh``).

Two parts:

* `tile_spec` (pure, testable on the CPU): the arguments of ``cuTensorMapEncodeTiled`` for a K-major fp8 tensor
  ``[rows, K]`` (row stride in bytes, K contiguous) and a box of ``box_rows`` rows x 128 bytes, after checking
  what TMA requires of the tensor: 1-byte elements, contiguous rows, a 16-byte aligned base, a row stride that
  is a multiple of 16 bytes, K a multiple of 128;
* `Encoder` (``cuTensorMapEncodeTiled`` of ``libcuda.so.1`` through ctypes, resolved when made): a spec's 128 bytes
  as a record of ``kernel_args.STRUCTS["TensorMap"]``, the type of the kernel's map fields.

Rows past the tensor's ``rows`` arrive in shared memory as zeros (out-of-bounds fill), so a map over exactly the
pass's rows zero-fills an item's rows past them, as the cp.async kernels do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ...errors import BackendError, ConfigError
from . import kernel_args

#: ``CUtensorMapDataType``, ``CUtensorMapInterleave``, ``CUtensorMapSwizzle``, ``CUtensorMapL2promotion``,
#: ``CUtensorMapFloatOOBfill`` values (cuda.h) the maps use.
DATA_TYPE_UINT8, INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_NONE = 0, 0, 3, 3, 0
DATA_TYPE_FLOAT32, SWIZZLE_NONE = 7, 0
#: Bytes of a box row: one 128-wide K block of e4m3, the 128-byte swizzle's span.
BOX_ROW_BYTES = 128
#: What TMA asks of the global tensor: base and row stride alignment, dims below 2^32, strides below 2^40.
GLOBAL_ALIGN, MAX_DIM, MAX_STRIDE = 16, 1 << 32, 1 << 40
#: Size of a ``CUtensorMap`` and the alignment the driver writes it at.
MAP_BYTES, MAP_ALIGN = 128, 64


@dataclass(frozen=True)
class TileSpec:
    """The arguments of ``cuTensorMapEncodeTiled`` for one rank-2 map (dimensions innermost first, as the driver
    takes them)."""

    address: int
    dims: Tuple[int, int]          # (K elements, rows)
    strides: Tuple[int]            # the row stride in bytes (the innermost dimension's is implied)
    box: Tuple[int, int]           # (K elements, rows) per copy
    element_strides: Tuple[int, int] = (1, 1)
    data_type: int = DATA_TYPE_UINT8
    interleave: int = INTERLEAVE_NONE
    swizzle: int = SWIZZLE_128B
    l2_promotion: int = L2_PROMOTION_256B
    oob_fill: int = OOB_FILL_NONE


def tile_spec(name: str, tensor, box_rows: int, rows: int = None) -> TileSpec:
    """The map of a K-major fp8 ``tensor`` [rows, K] (its first ``rows`` rows when given, all by default) whose
    copies bring ``box_rows`` rows x 128 bytes.

    Raises:
        ConfigError: naming ``name``: not 2D, elements not 1 byte, K not contiguous, the base not 16-byte aligned,
            the row stride not a multiple of 16 bytes (or below K), K not a positive multiple of 128, no rows, a
            box of more than 256 rows.

    Example:
        >>> import torch
        >>> x = torch.zeros(300, 256, dtype=torch.uint8)
        >>> s = tile_spec("pool.x", x, 64)
        >>> s.dims, s.strides, s.box, s.swizzle
        ((256, 300), (256,), (128, 64), 3)
    """
    shape = tuple(tensor.shape)
    if len(shape) != 2 or tensor.element_size() != 1:
        raise ConfigError(f"{name}: expected a 2D tensor of 1-byte elements (fp8) for a TMA map, got "
                          f"{tensor.dtype} {list(shape)}")
    rows = shape[0] if rows is None else rows
    k = shape[1]
    row_stride, k_stride = tensor.stride()
    address = int(tensor.data_ptr())
    if k_stride != 1 and k > 1:
        raise ConfigError(f"{name}: expected contiguous rows (K stride 1) for a TMA map, got strides {tensor.stride()}")
    if k <= 0 or k % BOX_ROW_BYTES:
        raise ConfigError(f"{name}: K={k}: expected a positive multiple of {BOX_ROW_BYTES} (one 128-byte box row "
                          f"per K block)")
    if not 0 < rows <= shape[0] or rows >= MAX_DIM:
        raise ConfigError(f"{name}: rows={rows}: expected 1 to {shape[0]} rows for a TMA map")
    if address % GLOBAL_ALIGN:
        raise ConfigError(f"{name}: base address {address:#x} is not {GLOBAL_ALIGN}-byte aligned (TMA requires it)")
    if row_stride % GLOBAL_ALIGN or row_stride < k or row_stride >= MAX_STRIDE:
        raise ConfigError(f"{name}: row stride {row_stride} bytes: expected a multiple of {GLOBAL_ALIGN} of at least "
                          f"K={k} (TMA requires it)")
    if not 0 < box_rows <= 256:
        raise ConfigError(f"{name}: box_rows={box_rows}: expected 1 to 256 (a TMA box dimension)")
    return TileSpec(address=address, dims=(k, rows), strides=(row_stride,), box=(BOX_ROW_BYTES, box_rows))


def is_mn_major(scales) -> bool:
    """Whether float32 scales ``[rows, K blocks]`` are MN-major as `scale_spec` maps them: rows contiguous, each K
    block's column 16-byte aligned (the layer's pool and the fused engine's intermediate are)."""
    return (scales.dim() == 2 and scales.element_size() == 4 and (scales.stride(0) == 1 or scales.shape[0] <= 1)
            and (scales.stride(1) * 4) % GLOBAL_ALIGN == 0 and int(scales.data_ptr()) % GLOBAL_ALIGN == 0)


def scale_spec(name: str, scales, box_rows: int, rows: int = None) -> TileSpec:
    """The map of MN-major float32 activation scales ``scales`` [rows, K blocks] (`is_mn_major`; its first ``rows``
    rows when given) whose copies bring ``box_rows`` rows' scales of one K block, rows innermost, unswizzled.

    Raises:
        ConfigError: naming ``name``: not MN-major float32 with 16-byte aligned columns, no rows, a box of more than
            256 rows.

    Example:
        >>> import torch
        >>> sf = torch.zeros(56, 304).t()[:300]
        >>> s = scale_spec("pool.x_sf", sf, 64)
        >>> s.dims, s.strides, s.box, s.data_type, s.swizzle
        ((300, 56), (1216,), (64, 1), 7, 0)
    """
    if not is_mn_major(scales):
        raise ConfigError(f"{name}: expected MN-major float32 scales [rows, K blocks] with strides (1, a multiple of 4) "
                          f"and a 16-byte aligned base for a TMA map, got {scales.dtype} {list(scales.shape)} strides "
                          f"{scales.stride()}")
    rows = scales.shape[0] if rows is None else rows
    if not 0 < rows <= scales.shape[0] or rows >= MAX_DIM:
        raise ConfigError(f"{name}: rows={rows}: expected 1 to {scales.shape[0]} rows for a TMA map")
    if not 0 < box_rows <= 256:
        raise ConfigError(f"{name}: box_rows={box_rows}: expected 1 to 256 (a TMA box dimension)")
    return TileSpec(address=int(scales.data_ptr()), dims=(rows, scales.shape[1]), strides=(scales.stride(1) * 4,),
                    box=(box_rows, 1), data_type=DATA_TYPE_FLOAT32, swizzle=SWIZZLE_NONE)


def weight_view(tensor):
    """An expert weight tensor [E, N, K] as the 2D view [E * N, K] its map covers (expert e's rows start at e * N).

    Raises:
        ConfigError: not 3D or not contiguous.
    """
    if tensor.dim() != 3 or not tensor.is_contiguous():
        raise ConfigError(f"expert weights: expected a contiguous [E, N, K] tensor for a TMA map, got "
                          f"{list(tensor.shape)} strides {tensor.stride()}")
    return tensor.reshape(tensor.shape[0] * tensor.shape[1], tensor.shape[2])


def map_record(raw: bytes) -> np.ndarray:
    """A map's 128 bytes as a record of ``kernel_args.STRUCTS["TensorMap"]`` (what a `KernelArgs` map field takes).

    Raises:
        ValueError: not 128 bytes.
    """
    if len(raw) != MAP_BYTES:
        raise ValueError(f"a CUtensorMap is {MAP_BYTES} bytes, got {len(raw)}")
    return np.frombuffer(bytes(raw), dtype=kernel_args.STRUCTS["TensorMap"])[0].copy()


@functools.lru_cache(maxsize=1)
def _load_driver():
    """``libcuda.so.1``'s ``cuTensorMapEncodeTiled`` with its argument types, or None when there is none; looked up
    once per process (``find_library`` runs ``ldconfig``: only when ``libcuda.so.1`` itself does not load)."""
    for find in (lambda: "libcuda.so.1", lambda: ctypes.util.find_library("cuda")):
        name = find()
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).cuTensorMapEncodeTiled
        except (OSError, AttributeError):
            continue
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


class Encoder:
    """``cuTensorMapEncodeTiled`` of the CUDA driver, resolved when made (the engine makes one at construction for a
    forced TMA kernel; under auto, at the first call with rows that takes wg64t). ``load``: what resolves it (None:
    the driver's, `_load_driver`).

    Raises:
        BackendError: no ``libcuda.so.1`` with ``cuTensorMapEncodeTiled`` (a driver older than CUDA 12, or none).
    """

    def __init__(self, load=None):
        self._fn = (load or _load_driver)()
        if self._fn is None:
            raise BackendError("engine 'fused': kernels 'wg64t' and 'wg128t' need the CUDA driver's "
                               "cuTensorMapEncodeTiled (libcuda.so.1 of CUDA 12 or newer) to encode their TMA maps; "
                               "use kernel 'wg64'")
        # The driver writes the map at a 64-byte aligned address: one buffer, reused (the bytes are copied out).
        self._buffer = ctypes.create_string_buffer(MAP_BYTES + MAP_ALIGN)
        self._at = -ctypes.addressof(self._buffer) % MAP_ALIGN

    def __call__(self, spec: TileSpec) -> np.ndarray:
        """The map of ``spec`` as a ``TensorMap`` record.

        Raises:
            BackendError: the driver refused it (its CUresult named).
        """
        u32, u64 = ctypes.c_uint32, ctypes.c_uint64
        out = ctypes.addressof(self._buffer) + self._at
        result = self._fn(out, spec.data_type, 2, ctypes.c_void_p(spec.address), (u64 * 2)(*spec.dims),
                          (u64 * 1)(*spec.strides), (u32 * 2)(*spec.box), (u32 * 2)(*spec.element_strides),
                          spec.interleave, spec.swizzle, spec.l2_promotion, spec.oob_fill)
        if result != 0:
            raise BackendError(f"cuTensorMapEncodeTiled refused {spec} (CUresult {result})")
        return map_record(ctypes.string_at(out, MAP_BYTES))
