"""What the built-in Triton kernels share (`triton_large`: the grouped GEMM and SwiGLU for large groups;
`triton_small`: the swap-AB kernels for tiny ones): the layout's constants, loading Triton on first use
(`bind`: the kernels are plain functions whose module globals ``tl`` and the jitted helpers are set then,
so symmring imports without Triton), the device helpers both kernels inline (the SwiGLU + quantisation of a
tile, the GEMMs' program id and argument assumptions, a tile's group with its bound) and the host checks of
devices, TMA views and the bad-group report.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Any

from ...errors import BackendError, ConfigError

#: Rows per alignment unit of the contiguous layout; every group starts at a multiple of it.
ALIGN_M = 128
#: K per MMA step and per scale block.
BLOCK_K = 128

# Set by `load` (the helpers below resolve them from this module's globals).
tl: Any = None
libdevice: Any = None

#: What `load` returns: the modules and the jitted helpers.
Triton = collections.namedtuple("Triton", "torch triton tl TensorDescriptor swiglu_quant_rows gemm_program tile_group")
#: Words of a grouped GEMM's ``bad_groups`` report (int32, zero when nothing was skipped): the tiles skipped
#: because their first row named a group outside ``[-1, G)``, and the first such id.
BAD_GROUP_TILES, BAD_GROUP_ID = 0, 1
BAD_GROUP_WORDS = 2


def interpreting() -> bool:
    """True under the Triton interpreter (``TRITON_INTERPRET=1``): kernels run with NumPy on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def ceil_div(x: int, y: int) -> int:
    """``x / y`` rounded up (positive ``y``).

    Example:
        >>> ceil_div(7, 4), ceil_div(8, 4)
        (2, 2)
    """
    return -(-x // y)


# --- device helpers (plain functions; `load` wraps them in triton.jit) -------------------------------------

def _swiglu_quant_rows(gate, up, ACCURATE_EXP: tl.constexpr):
    """``silu(gate) * up`` and its fp8 quantisation, one scale per row of the ``[rows, 128]`` tiles
    (float32 values of bf16 numbers): ``(act, q e4m3, scale)``. The one definition both SwiGLU kernels
    (`swiglu_quant_fp8` and `triton_small`'s fused L1) run, so they agree bitwise."""
    if ACCURATE_EXP:
        e = libdevice.exp(-gate)  # CUDA's expf, as torch's float32 exp (tl.exp would be ex2.approx)
    else:
        e = tl.exp(-gate)  # the Triton interpreter: NumPy's float32 exp (it has no libdevice)
    act = tl.math.div_rn(gate, 1.0 + e) * up
    amax = tl.max(tl.abs(act), axis=1)
    scale = tl.math.div_rn(amax, 448.0)  # IEEE division, as quant.quantize_fp8 and producer.cu
    scale = tl.where(scale == 0.0, 1.0, scale)  # zero group: scale 1, quantises to zeros
    scaled = tl.math.div_rn(act, scale[:, None])
    # amax / (amax / 448) can round just above 448; clip so the conversion never saturates differently.
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    return act, scaled.to(tl.float8e4nv), scale


def _gemm_program(M, N, K, stride_am, stride_asm, stride_ask, stride_bg, stride_bn, stride_bsg, stride_bsn,
                  stride_bsk, stride_om):
    """The program id of a grouped GEMM, after telling the compiler what both GEMMs know of their arguments
    (positive sizes and row strides, non-negative scale strides), so it can drop the checks those make dead."""
    tl.assume(M > 0)
    tl.assume(N > 0)
    tl.assume(K > 0)
    tl.assume(stride_am > 0)
    tl.assume(stride_asm >= 0)
    tl.assume(stride_ask >= 0)
    tl.assume(stride_bg > 0)
    tl.assume(stride_bn > 0)
    tl.assume(stride_bsg >= 0)
    tl.assume(stride_bsn >= 0)
    tl.assume(stride_bsk >= 0)
    tl.assume(stride_om > 0)
    pid = tl.program_id(0)
    tl.assume(pid >= 0)
    return pid


def _tile_group(m_indices_ptr, row, G, bad_groups_ptr, REPORT: tl.constexpr):
    """The group of a GEMM tile whose first row is ``row`` (groups start at multiples of `ALIGN_M`, so that
    row names the tile's group), or -1 when the tile computes nothing: padding, or an id outside ``[-1, G)``,
    which would index weights past ``b`` (stale or corrupt ids). Such a tile is skipped and, with REPORT,
    counted in ``bad_groups`` (`BAD_GROUP_TILES` += 1; `BAD_GROUP_ID`: the first id, never 0 for a bad one)."""
    group = tl.load(m_indices_ptr + row)
    if (group < -1) | (group >= G):
        if REPORT:  # words BAD_GROUP_TILES (0) and BAD_GROUP_ID (1): no module globals in a Triton function
            tl.atomic_add(bad_groups_ptr, 1)
            tl.atomic_cas(bad_groups_ptr + 1, 0, group)
        group = -1
    return group


# --- loading -----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def load() -> Triton:
    """torch, triton and the jitted helpers; BackendError when torch or triton is missing."""
    global tl, libdevice
    try:
        import torch
        import triton
        import triton.language as _tl
        from triton.language.extra import libdevice as _libdevice
    except ImportError as exc:
        raise BackendError(f"the built-in fp8 kernels need torch and triton (Triton ships with torch's Linux "
                           f"CUDA wheels): {exc}") from exc
    tl, libdevice = _tl, _libdevice
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton < 3.4: pointer loads only
        TensorDescriptor = None
    return Triton(torch, triton, _tl, TensorDescriptor, triton.jit(_swiglu_quant_rows), triton.jit(_gemm_program),
                  triton.jit(_tile_group))


def bind(namespace: dict) -> Triton:
    """`load`, and set ``tl`` and the jitted helpers in a kernel module's ``namespace`` (its ``globals()``),
    where its kernels look them up when Triton compiles them."""
    t = load()
    namespace.update(tl=t.tl, swiglu_quant_rows=t.swiglu_quant_rows, gemm_program=t.gemm_program,
                     tile_group=t.tile_group)
    return t


# --- host checks ---------------------------------------------------------------------------------------------

def check_device(tensors, names) -> None:
    """One device for every tensor, CUDA of compute capability >= 8.9 (CPU only under the interpreter)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ConfigError("tensors on different devices: " +
                          ", ".join(f"{n}={t.device}" for n, t in zip(names, tensors)))
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise ConfigError(f"device={device}: expected CUDA tensors (CPU tensors only under TRITON_INTERPRET=1)")
    if device.type == "cuda" and not interpreting():
        import torch
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise BackendError(f"device {device} has compute capability {major}.{minor}: fp8 tensor-core "
                               f"dots need 8.9 or newer (9.0, Hopper, is the target)")


def check_bad_groups(bad_groups, device) -> None:
    """``bad_groups`` of a grouped GEMM: None, or a contiguous int32 tensor of at least `BAD_GROUP_WORDS` on
    ``device`` (the kernel adds to it: zero it to start counting)."""
    if bad_groups is None:
        return
    import torch
    if (not isinstance(bad_groups, torch.Tensor) or bad_groups.dtype != torch.int32 or bad_groups.dim() != 1
            or bad_groups.numel() < BAD_GROUP_WORDS or bad_groups.stride(0) != 1 or bad_groups.device != device):
        raise ConfigError(f"bad_groups: expected None or a contiguous int32 tensor of >= {BAD_GROUP_WORDS} words on "
                          f"{device}, got {getattr(bad_groups, 'dtype', type(bad_groups).__name__)} "
                          f"{tuple(getattr(bad_groups, 'shape', ()))}")


def tma_ok(t, block_inner_bytes_multiple: int = 16) -> bool:
    """TMA's requirements on a 2-D view: 16-byte aligned base and row pitch, unit inner stride."""
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and
            (t.stride(-2) * t.element_size()) % block_inner_bytes_multiple == 0)
