"""Optional DeepGEMM engine for the fp8 expert GEMMs: the same contract as
`symmring.moe.engines.triton_large.grouped_gemm_fp8`.

DeepGEMM (``deep_gemm``) is not a dependency: `deepgemm_status` says whether it can be used here and why
not, and the layer falls back to the Triton engine. The build known to load next to torch 2.11 on the
H200 is ``tokenspeed-deepgemm==2.5.0.post20260424`` (cp312); its wheel links libtorch, so it must match
the installed torch (a build for another torch fails to load or misreads tensors).

What the 2.5.0.post20260424 wheel provides (read from its ``_C.pyi``, its ``__init__.py`` and the strings
of its ``_C`` module, and from deepseek-ai/DeepGEMM's ``csrc/apis/{gemm,layout}.hpp``, ``csrc/utils/
layout.hpp``, ``csrc/jit_kernels/heuristics/{sm90,runtime}.hpp`` and the SM90 kernel and scheduler it
ships as headers, ``include/deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh`` and ``common/scheduler.cuh``):

* Call: ``m_grouped_fp8_gemm_nt_contiguous(a=(x_fp8, x_sf), b=(w_fp8, w_sf), d, grouped_layout,
  recipe=None, recipe_a=None, recipe_b=None, compiled_dims="nk", disable_ue8m0_cast=False,
  use_psum_layout=False, expected_m_for_psum_layout=None) -> None`` (an alias of
  ``m_grouped_fp8_fp4_gemm_nt_contiguous``). ``x_fp8`` float8_e4m3fn ``[M, K]`` K-major, ``w_fp8``
  ``[G, N, K]`` K-major (SM90 requires K-major B), ``d`` bf16 ``[M, N]`` row-major, ``grouped_layout``
  contiguous int32 ``[M]`` (the group of each row, -1 for padding). ``M == 0`` returns at once. The
  kernel also asserts ``N % 8 == 0`` on the device and needs ``K % 128 == 0``.
* Recipe: with float32 scales on SM90 the default recipe is ``(1, 128, 128)``: one activation scale per
  row and 128 K, one weight scale per 128 x 128 block, used as float32 multipliers (no rounding to powers
  of two; SM100 would turn them into packed UE8M0, which changes the numbers: this adapter is SM90 only).
* Alignment: ``get_mk_alignment_for_contiguous_layout()`` (alias ``get_m_alignment_for_contiguous_layout``)
  is 128 on SM90; the SM90 heuristic uses exactly that as BLOCK_M, so every group must start at a
  multiple of 128 rows, which is symmring's `ALIGN_M`. (``set_mk_alignment_for_contiguous_layout``
  changes it process-wide; `deepgemm_status` refuses any value but 128.)
* Scale layouts and their cost per call: the activation scales are transformed on EVERY call by
  ``get_mn_major_tma_aligned_tensor``: unless ``x_sf`` is already MN-major and TMA-aligned (strides
  ``(1, align(M, 4))``), it allocates ``[M, K / 128]`` with those strides and launches a transpose kernel
  (a JIT ``transpose_fp32`` kernel, or a torch copy when ``x_sf`` is not contiguous). Hand it
  `prepare_activation_scales`' output (the Triton engine takes that layout too) to skip that. The
  weight scales are NOT transformed on SM90: a float32 ``[G, ceil(N / 128), K / 128]`` tensor must be
  contiguous (or contiguous with its last two dims transposed) and is read as is, so `prepare_weights`
  only makes weights and scales contiguous; there is no ``transform_sf_into_required_layout`` step to
  pay at load time on the H200.
* Padding rows: the SM90 kernel is persistent and visits every 128-row block. A math warpgroup (64 rows)
  whose first row has ``grouped_layout < 0`` skips its MMAs, but the TMA warp still loads that block's A
  and B tiles (B of group ``max(0, -1) = 0``) and the block's output is still stored (zeros, from the
  zero-initialised accumulator). So trailing padding costs DeepGEMM its full memory traffic, where the
  Triton engine exits such blocks after one 4-byte load; padding rows inside a group's last block are
  computed from whatever the pool holds, as in the Triton engine.
* JIT: kernels are compiled with nvcc (or NVRTC with ``DG_JIT_USE_NVRTC=1``) on first use of a shape and
  cached under ``DG_JIT_CACHE_DIR`` (default ``~/.deep_gemm``); ``import deep_gemm`` asserts that a CUDA
  home is found (``CUDA_HOME``/``CUDA_PATH``, ``nvcc`` on the path, or ``/usr/local/cuda``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from typing import Any, Optional, Tuple

from ...errors import BackendError, ConfigError
from .triton_large import ALIGN_M, check_gemm_args

logger = logging.getLogger(__name__)

#: Builds of DeepGEMM that link libtorch -> the torch release (major, minor) each was built against. The
#: ``deepgemm`` extra pins the build and that torch together; `torch_mismatch` refuses any other pairing
#: before ``import deep_gemm`` (a libtorch ABI mismatch may crash the process rather than raise).
BUILT_FOR_TORCH = {("tokenspeed-deepgemm", "2.5.0.post20260424"): (2, 11)}


def torch_mismatch(distribution: str, version: Optional[str], torch_version: str) -> Optional[str]:
    """Why DeepGEMM build ``distribution==version`` cannot load beside ``torch_version`` (None: it may).

    Example:
        >>> torch_mismatch("tokenspeed-deepgemm", "2.5.0.post20260424", "2.11.0+cu130") is None
        True
        >>> torch_mismatch("tokenspeed-deepgemm", "2.5.0.post20260424", "2.13.0+cpu")
        'tokenspeed-deepgemm 2.5.0.post20260424 is built against torch 2.11 but torch 2.13.0+cpu is installed (pip install "symmring[gpu,deepgemm]" installs the pair)'
    """
    want = BUILT_FOR_TORCH.get((distribution, version))
    if want is None:
        return None
    have = tuple(int(p) for p in torch_version.split("+")[0].split(".")[:2] if p.isdigit())
    if have == want:
        return None
    return (f"{distribution} {version} is built against torch {want[0]}.{want[1]} but torch {torch_version} is "
            f'installed (pip install "symmring[gpu,deepgemm]" installs the pair)')


def _installed_build() -> Tuple[str, Optional[str]]:
    import importlib.metadata
    for distribution, _ in BUILT_FOR_TORCH:
        try:
            return distribution, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "", None


@functools.lru_cache(maxsize=None)
def _load() -> Tuple[Optional[Any], str]:
    """``(deep_gemm module or None, reason)``; never raises."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    mismatch = torch_mismatch(*_installed_build(), torch.__version__)
    if mismatch:
        return None, mismatch
    try:
        if not torch.cuda.is_available():
            return None, "no CUDA device is visible"
        major, minor = torch.cuda.get_device_capability()
    except Exception as exc:  # a broken CUDA runtime reads as "not usable", never as a crash
        return None, f"CUDA is not usable: {type(exc).__name__}: {exc}"
    if major != 9:
        return None, (f"compute capability {major}.{minor}: the adapter passes float32 block scales, which only "
                      f"DeepGEMM's SM90 kernel takes unchanged")
    try:
        # deep_gemm prints (not logs) when its optional A100 Triton kernels fail to load: keep it out of stdout.
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            import deep_gemm
        if captured.getvalue().strip():
            logger.info("deep_gemm import: %s", captured.getvalue().strip())
    except BaseException as exc:  # ImportError, a libtorch ABI mismatch, its CUDA-home assert, ...
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return None, f"deep_gemm does not import: {type(exc).__name__}: {exc}"
    if not hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous"):
        return None, (f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has no m_grouped_fp8_gemm_nt_contiguous "
                      f"(built without its CUDA 12.1+ kernels?)")
    getter = getattr(deep_gemm, "get_mk_alignment_for_contiguous_layout",
                     getattr(deep_gemm, "get_m_alignment_for_contiguous_layout", None))
    try:
        align = int(getter()) if getter is not None else ALIGN_M
    except Exception as exc:
        return None, f"deep_gemm's contiguous-layout alignment is unreadable: {type(exc).__name__}: {exc}"
    if align != ALIGN_M:
        return None, f"deep_gemm wants groups aligned to {align} rows; symmring's pool aligns them to {ALIGN_M}"
    return deep_gemm, f"deep_gemm {getattr(deep_gemm, '__version__', '?')} (groups aligned to {align} rows)"


def _probe(deep_gemm) -> Optional[str]:
    """Run one tiny grouped GEMM and compare it with torch; the reason it is wrong, or None."""
    import torch
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(7)
    M, N, K, G = 256, 128, 256, 2
    a = torch.randn(M, K, device=device, generator=gen).to(torch.float8_e4m3fn)
    a_sf = torch.rand(M, K // 128, device=device, generator=gen) + 0.5
    b = torch.randn(G, N, K, device=device, generator=gen).to(torch.float8_e4m3fn)
    b_sf = torch.rand(G, N // 128, K // 128, device=device, generator=gen) + 0.5
    m_indices = torch.arange(M, device=device, dtype=torch.int32) // 128
    out = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_sf), (b, b_sf), out, m_indices)
    a_deq = a.float() * a_sf.repeat_interleave(128, dim=1)
    b_deq = b.float() * b_sf.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    want = torch.cat([a_deq[g * 128:(g + 1) * 128] @ b_deq[g].T for g in range(G)])
    err = float((out.float() - want).norm() / want.norm())
    return None if err < 2e-2 else f"probe GEMM relative error {err:.3g} (expected < 2e-2): an ABI mismatch?"


def deepgemm_status(probe: bool = False) -> Tuple[bool, str]:
    """Whether the DeepGEMM engine can be used here, and why (not).

    Never raises. Checks: torch with a visible Hopper (sm_90) GPU, ``import deep_gemm`` (lazily, once per
    process), the contiguous grouped entry point, and a 128-row alignment. With ``probe=True`` it also
    runs one tiny GEMM against torch (one JIT compile, seconds), which catches builds that import but
    misread tensors (a libtorch ABI mismatch).

    Args:
        probe: also run and check a tiny GEMM.

    Returns:
        ``(ok, reason)``: the deep_gemm version when ok, else what is missing or broken.

    Example:
        >>> ok, reason = deepgemm_status()
        >>> isinstance(ok, bool) and bool(reason)
        True
    """
    module, reason = _load()
    if module is None or not probe:
        return module is not None, reason
    try:
        wrong = _probe(module)
    except Exception as exc:
        return False, f"{reason}, but the probe GEMM failed: {type(exc).__name__}: {exc}"
    return (False, f"{reason}, but {wrong}") if wrong else (True, reason + ", probe GEMM correct")


def _module():
    module, reason = _load()
    if module is None:
        raise BackendError(f"DeepGEMM engine unavailable: {reason}")
    return module


def prepare_weights(b, b_sf):
    """Weights and block scales in the layout DeepGEMM's SM90 kernel reads (call once, at load time).

    On SM90 the float32 128x128 block scales are used as they are, so this only makes both contiguous
    (and the scales float32); no scale transform is needed.

    Args:
        b: float8_e4m3fn ``[G, N, K]``.
        b_sf: ``[G, ceil(N / 128), ceil(K / 128)]`` (float32, or a dtype that converts to it).

    Returns:
        ``(b, b_sf)`` contiguous, ``b_sf`` float32 (the inputs themselves when already so).

    Raises:
        ConfigError: wrong ranks, dtypes or shapes.

    Example:
        >>> w, w_sf = prepare_weights(w, w_sf)  # doctest: +SKIP
    """
    import torch
    if not isinstance(b, torch.Tensor) or b.dim() != 3 or b.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"b: expected float8_e4m3fn [G, N, K], got {getattr(b, 'dtype', type(b).__name__)} "
                          f"{tuple(getattr(b, 'shape', ()))}")
    G, N, K = b.shape
    want = (G, -(-N // 128), -(-K // 128))
    if not isinstance(b_sf, torch.Tensor) or tuple(b_sf.shape) != want or not b_sf.is_floating_point():
        raise ConfigError(f"b_sf: expected a float tensor {list(want)}, got {getattr(b_sf, 'dtype', None)} "
                          f"{tuple(getattr(b_sf, 'shape', ()))}")
    return b.contiguous(), b_sf.to(torch.float32).contiguous()


def prepare_activation_scales(a_sf):
    """``a_sf [M, K / 128]`` in the MN-major, TMA-aligned layout (strides ``(1, align(M, 4))``) that DeepGEMM
    would otherwise build on every call; the Triton engine reads it too.

    Args:
        a_sf: float32 ``[M, K / 128]``.

    Returns:
        A float32 tensor of the same shape and values with strides ``(1, align(M, 4))``.

    Raises:
        ConfigError: not a 2-D float32 tensor.

    Example:
        >>> a_sf_mn = prepare_activation_scales(a_sf)  # doctest: +SKIP
    """
    import torch
    if not isinstance(a_sf, torch.Tensor) or a_sf.dim() != 2 or a_sf.dtype != torch.float32:
        raise ConfigError(f"a_sf: expected a float32 [M, K / 128] tensor, got {getattr(a_sf, 'dtype', None)} "
                          f"{tuple(getattr(a_sf, 'shape', ()))}")
    M, kb = a_sf.shape
    aligned = -(-M // 4) * 4  # 16-byte TMA alignment of 4-byte scales
    if a_sf.stride() == (1, aligned) or (kb == 1 and a_sf.stride(0) == 1):
        return a_sf
    out = torch.empty_strided((M, kb), (1, aligned), dtype=torch.float32, device=a_sf.device)
    out.copy_(a_sf)
    return out


def grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices, out=None):
    """Block-scaled fp8 grouped GEMM of the contiguous layout through DeepGEMM (SM90).

    The contract of `symmring.moe.engines.triton_large.grouped_gemm_fp8`:
    ``out[r, n] = sum_kb (a[r, kb] . b[g, n, kb]) * a_sf[r, kb] * b_sf[g, n // 128, kb]`` in bf16 for rows
    with ``g = m_indices[r] >= 0``. Padding blocks' rows come back as zeros (module notes).

    Args:
        a: float8_e4m3fn ``[M, K]`` (contiguous), ``K % 128 == 0``.
        a_sf: float32 ``[M, K // 128]`` (any layout; `prepare_activation_scales`' saves a transpose per call).
        b: float8_e4m3fn ``[G, N, K]`` contiguous, ``N % 8 == 0``.
        b_sf: float32 ``[G, ceil(N / 128), K // 128]``, contiguous (`prepare_weights`).
        m_indices: contiguous int32 ``[M]``, groups starting at multiples of 128.
        out: optional bf16 ``[M, N]``, contiguous; allocated when None.

    Returns:
        ``out``.

    Raises:
        BackendError: DeepGEMM is not usable here (`deepgemm_status` says why).
        ConfigError: bad shapes, dtypes, strides or devices (before any launch).

    Example:
        >>> out = grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices)  # doctest: +SKIP
    """
    deep_gemm = _module()
    import torch
    M, N, K, G = check_gemm_args(a, a_sf, b, b_sf, m_indices, out)
    if N % 8:
        raise ConfigError(f"b.shape={tuple(b.shape)}: DeepGEMM needs N % 8 == 0, got N={N}")
    if not a.is_contiguous():
        raise ConfigError(f"a.stride()={a.stride()}: DeepGEMM needs a contiguous [M, K] activation tensor")
    if not b.is_contiguous():
        raise ConfigError(f"b.stride()={b.stride()}: DeepGEMM needs contiguous weights (prepare_weights)")
    sfb_ok = b_sf.is_contiguous() or b_sf.transpose(1, 2).is_contiguous()
    if not sfb_ok:
        raise ConfigError(f"b_sf.stride()={b_sf.stride()}: DeepGEMM needs contiguous block scales (prepare_weights)")
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    elif not out.is_contiguous():
        raise ConfigError(f"out.stride()={out.stride()}: DeepGEMM needs a contiguous [M, N] output")
    if M == 0:
        return out
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_sf), (b, b_sf), out, m_indices)
    return out
