"""CPU references of the fp8 expert engines (NumPy and ml_dtypes only): what the GPU kernels are checked against.

Formats (DeepSeek-V3 / DeepGEMM):

* activations: float8_e4m3fn rows ``a [M, K]`` with float32 scales ``a_sf [M, K // 128]``, one per token and
  per 128 channels, produced by `symmring.moe.quant.quantize_fp8` (the rule is restated there);
* weights: float8_e4m3fn ``b [G, N, K]`` (nn.Linear layout: out features N, in features K) with float32
  block scales ``b_sf [G, ceil(N / 128), ceil(K / 128)]``, one dequantisation multiplier per 128 x 128
  block (``weight_scale_inv`` of DeepSeek-V3 / Qwen3-FP8 checkpoints). `quantize_weight_blocks` applies the
  activation rule per block: ``scale = amax / 448`` in float32 (1.0 when that is 0),
  ``q = e4m3fn(clip(w / scale, -448, 448))`` rounded to nearest even. Edge blocks (N or K not a multiple
  of 128) take the amax of the elements they have;
* pool ("contiguous layout", DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous``): the rows of one group are
  contiguous and every group starts at a multiple of `ALIGN_M` rows; ``m_indices int32 [M]`` holds each
  row's group, ``-1`` for padding rows.

The grouped GEMM is defined per row ``r`` with ``g = m_indices[r] >= 0`` as
``out[r, n] = sum_kb (a[r, kb] . b[g, n, kb]) * a_sf[r, kb] * b_sf[g, n // 128, kb]``; the reference
evaluates it in float64 (exact products of e4m3 values, one float64 rounding per addition), so it is the
yardstick the GPU's float32 accumulation is measured against.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..errors import ConfigError
from .quant import BF16_DTYPE, FP8_DTYPE, FP8_E4M3_MAX, quantize_fp8

#: Rows per alignment unit of the contiguous layout: every group starts at a multiple of it.
ALIGN_M = 128
#: Side of a weight scale block, and channels per activation scale.
BLOCK = 128


def _ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def _as_fp8(x, name: str, ndim: int) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != ndim:
        raise ConfigError(f"{name}: expected a {ndim}-D NumPy array, got {type(x).__name__} with shape "
                          f"{getattr(x, 'shape', None)}")
    if x.dtype == np.uint8:
        return x.view(FP8_DTYPE)
    if x.dtype != FP8_DTYPE:
        raise ConfigError(f"{name}.dtype={x.dtype}: expected float8_e4m3fn (or its bytes as uint8)")
    return x


def _as_f32(x, name: str, shape: Tuple[int, ...]) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != shape:
        raise ConfigError(f"{name}: expected a float32 array of shape {shape}, got {getattr(x, 'dtype', None)} "
                          f"{getattr(x, 'shape', None)}")
    return x


def quantize_weight_blocks(w: np.ndarray, block: int = BLOCK) -> Tuple[np.ndarray, np.ndarray]:
    """Quantise expert weights to e4m3 with one float32 scale per ``block x block`` block.

    Args:
        w: float32 ``[G, N, K]`` (or ``[N, K]``, treated as one group), finite.
        block: block side (128: the checkpoints' and DeepGEMM's choice).

    Returns:
        ``(q, sf)``: ``q`` float8_e4m3fn of ``w``'s shape, ``sf`` float32 ``[G, ceil(N / block),
        ceil(K / block)]`` (``[ceil(N / block), ceil(K / block)]`` for 2-D input), the dequantisation
        multipliers (``w ~ float32(q) * sf[block of the element]``).

    Raises:
        ConfigError: ``w`` is not a finite 2-D or 3-D float32 array, or ``block`` is not a positive int.

    Example:
        >>> q, sf = quantize_weight_blocks(np.full((1, 130, 128), 2.0, np.float32))
        >>> sf.shape, bool(sf[0, 0, 0] == np.float32(2) / np.float32(448)), float(q.astype(np.float32)[0, 129, 0])
        ((1, 2, 1), True, 448.0)
    """
    if not isinstance(w, np.ndarray) or w.ndim not in (2, 3) or w.dtype != np.float32:
        raise ConfigError(f"w: expected a float32 array [G, N, K] or [N, K], got {getattr(w, 'dtype', None)} "
                          f"{getattr(w, 'shape', type(w).__name__)}")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block <= 0:
        raise ConfigError(f"block={block!r}: expected a positive integer")
    if not np.all(np.isfinite(w)):
        raise ConfigError("w: expected finite values (found NaN or inf)")
    squeeze = w.ndim == 2
    w3 = w[None] if squeeze else w
    G, N, K = w3.shape
    nb, kb = _ceil_div(N, block), _ceil_div(K, block)
    # Zero padding up to whole blocks leaves every block's amax unchanged (|0| never raises a maximum).
    padded = np.zeros((G, nb * block, kb * block), np.float32)
    padded[:, :N, :K] = w3
    blocks = padded.reshape(G, nb, block, kb, block)
    amax = np.abs(blocks).max(axis=(2, 4))
    sf = (amax / np.float32(FP8_E4M3_MAX)).astype(np.float32)
    sf[sf == 0] = np.float32(1.0)  # zero blocks: scale 1, no division by zero (as quant.quantize_fp8)
    scaled = blocks / sf[:, :, None, :, None]
    # amax / (amax / 448) can round just above 448; e4m3fn has no inf, so clip rather than make NaN.
    np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX, out=scaled)
    q = scaled.astype(FP8_DTYPE).reshape(G, nb * block, kb * block)[:, :N, :K]
    q = np.ascontiguousarray(q)
    return (q[0], sf[0]) if squeeze else (q, sf)


def dequantize_weight_blocks(q: np.ndarray, sf: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """Float32 values of block-quantised weights: ``float32(q) * sf[block of the element]``.

    Args:
        q: float8_e4m3fn (or uint8 bytes) ``[G, N, K]``.
        sf: float32 ``[G, ceil(N / block), ceil(K / block)]``.
        block: block side.

    Returns:
        float32 ``[G, N, K]`` (a new array).

    Raises:
        ConfigError: shapes or dtypes that do not fit together.

    Example:
        >>> w = np.linspace(-1, 1, 2 * 128 * 256, dtype=np.float32).reshape(2, 128, 256)
        >>> bool(np.allclose(dequantize_weight_blocks(*quantize_weight_blocks(w)), w, rtol=2 ** -4, atol=1e-5))
        True
    """
    q = _as_fp8(q, "q", 3)
    G, N, K = q.shape
    sf = _as_f32(sf, "sf", (G, _ceil_div(N, block), _ceil_div(K, block)))
    full = np.repeat(np.repeat(sf, block, axis=1), block, axis=2)[:, :N, :K]
    return q.astype(np.float32) * full


def _check_layout(m_indices, M: int, G: int) -> np.ndarray:
    if not isinstance(m_indices, np.ndarray) or m_indices.shape != (M,) or m_indices.dtype.kind not in "iu":
        raise ConfigError(f"m_indices: expected an integer array of shape ({M},), got "
                          f"{getattr(m_indices, 'dtype', None)} {getattr(m_indices, 'shape', None)}")
    m_indices = m_indices.astype(np.int64)
    if M and (m_indices.min() < -1 or m_indices.max() >= G):
        raise ConfigError(f"m_indices: expected values in [-1, {G}) (-1: padding row), got "
                          f"[{m_indices.min()}, {m_indices.max()}]")
    return m_indices


def grouped_gemm_fp8_reference(a_q: np.ndarray, a_sf: np.ndarray, b_q: np.ndarray, b_sf: np.ndarray,
                               m_indices: np.ndarray) -> np.ndarray:
    """The block-scaled grouped GEMM of the contiguous layout, in float64.

    ``out[r, n] = sum_kb (a[r, kb] . b[g, n, kb]) * a_sf[r, kb] * b_sf[g, n // 128, kb]`` for every row
    ``r`` whose group ``g = m_indices[r]`` is ``>= 0``; the dot products of 128 e4m3 values are exact in
    float64, each term is scaled, then the terms are added in k-block order.

    Args:
        a_q: float8_e4m3fn (or uint8) ``[M, K]``, ``K % 128 == 0``.
        a_sf: float32 ``[M, K // 128]``.
        b_q: float8_e4m3fn (or uint8) ``[G, N, K]``.
        b_sf: float32 ``[G, ceil(N / 128), K // 128]``.
        m_indices: int ``[M]``, values in ``[-1, G)``.

    Returns:
        float64 ``[M, N]``; padding rows (``m_indices == -1``) are 0 (the GPU engines leave them undefined).

    Raises:
        ConfigError: shapes, dtypes or group ids that do not fit together.

    Example:
        >>> a_q, a_sf = quantize_fp8(np.full((2, 128), 448.0, np.float32))       # scale 1
        >>> b_q, b_sf = quantize_weight_blocks(np.full((1, 8, 128), 0.5 * 448, np.float32))  # scale 0.5
        >>> grouped_gemm_fp8_reference(a_q, a_sf, b_q, b_sf, np.array([0, -1], np.int32))[:, 0].tolist()
        [12845056.0, 0.0]
    """
    a_q = _as_fp8(a_q, "a_q", 2)
    b_q = _as_fp8(b_q, "b_q", 3)
    M, K = a_q.shape
    G, N, K_b = b_q.shape
    if K_b != K or K % BLOCK:
        raise ConfigError(f"b_q.shape={b_q.shape}: expected [G, N, K={K}] with K a multiple of {BLOCK}")
    kb = K // BLOCK
    a_sf = _as_f32(a_sf, "a_sf", (M, kb))
    b_sf = _as_f32(b_sf, "b_sf", (G, _ceil_div(N, BLOCK), kb))
    groups = _check_layout(m_indices, M, G)
    out = np.zeros((M, N), np.float64)
    a64 = a_q.astype(np.float64)
    for g in range(G):
        rows = np.flatnonzero(groups == g)
        if rows.size == 0:
            continue
        a_g = a64[rows]
        b_g = b_q[g].astype(np.float64)
        # b_sf of every output column: the 128-row block of the weight it belongs to.
        col_sf = np.repeat(b_sf[g].astype(np.float64), BLOCK, axis=0)[:N]
        acc = np.zeros((rows.size, N))
        for k in range(kb):
            part = a_g[:, k * BLOCK:(k + 1) * BLOCK] @ b_g[:, k * BLOCK:(k + 1) * BLOCK].T
            acc += part * a_sf[rows, k].astype(np.float64)[:, None] * col_sf[None, :, k]
        out[rows] = acc
    return out


def silu_mul_f32(h: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` in float32 of ``h = [gate | up]``: ``g / (1 + exp(-g)) * u``, every step rounded
    to float32 in that order (NumPy's float32 ``exp``).

    Args:
        h: ``[M, 2 * I]`` bfloat16 (ml_dtypes), its bits as uint16, or float32 values.

    Returns:
        float32 ``[M, I]``.

    Raises:
        ConfigError: not a 2-D array of one of those dtypes with an even number of columns.

    Example:
        >>> silu_mul_f32(np.array([[0.0, 2.0]], np.float32)).tolist()
        [[0.0]]
    """
    if not isinstance(h, np.ndarray) or h.ndim != 2 or h.shape[1] % 2:
        raise ConfigError(f"h: expected a 2-D array [M, 2 * I], got shape {getattr(h, 'shape', None)}")
    if h.dtype == np.uint16:
        h = h.view(BF16_DTYPE)
    if h.dtype not in (BF16_DTYPE, np.float32):
        raise ConfigError(f"h.dtype={h.dtype}: expected bfloat16, its bits as uint16, or float32")
    inter = h.shape[1] // 2
    g = h[:, :inter].astype(np.float32)
    u = h[:, inter:].astype(np.float32)
    with np.errstate(over="ignore"):  # exp(-g) = inf for g < -88: silu -> -0.0, as on the GPU
        silu = g / (np.float32(1.0) + np.exp(-g))
    return (silu * u).astype(np.float32)


def swiglu_quant_reference(h: np.ndarray, m_indices: Optional[np.ndarray] = None
                           ) -> Tuple[np.ndarray, np.ndarray]:
    """SwiGLU then fp8 quantisation, as the fused GPU kernel defines it.

    ``act = silu(gate) * up`` in float32 (`silu_mul_f32`), then `symmring.moe.quant.quantize_fp8` per row
    and 128 columns.

    Args:
        h: ``[M, 2 * I]`` (bfloat16, uint16 bits or float32), ``I % 128 == 0``.
        m_indices: optional int ``[M]``; rows with ``-1`` come back as zeros with scale 1 (the GPU kernel
            may skip them, leaving them undefined).

    Returns:
        ``(q, q_sf)``: float8_e4m3fn ``[M, I]`` and float32 ``[M, I // 128]``.

    Raises:
        ConfigError: bad shapes or dtypes, ``I`` not a multiple of 128, or a non-finite activation.

    Example:
        >>> q, q_sf = swiglu_quant_reference(np.ones((1, 256), np.float32))
        >>> q.shape, q_sf.shape
        ((1, 128), (1, 1))
    """
    act = silu_mul_f32(h)
    if act.shape[1] % BLOCK:
        raise ConfigError(f"h.shape={h.shape}: expected 2 * I columns with I a multiple of {BLOCK}")
    if m_indices is not None:
        if not isinstance(m_indices, np.ndarray) or m_indices.shape != (act.shape[0],):
            raise ConfigError(f"m_indices: expected shape ({act.shape[0]},), got {getattr(m_indices, 'shape', None)}")
        act = np.where((m_indices >= 0)[:, None], act, np.float32(0))
    return quantize_fp8(act, BLOCK)


def make_contiguous_layout(rows_per_group, align: int = ALIGN_M, total_rows: Optional[int] = None
                           ) -> Tuple[np.ndarray, np.ndarray]:
    """``m_indices`` of a contiguous-layout pool with the given rows per group.

    Group ``g`` occupies ``rows_per_group[g]`` rows starting at a multiple of ``align``; the rest of its
    last block, and everything after the last group, is padding (-1).

    Args:
        rows_per_group: non-negative ints, one per group (0 allowed: the group gets no rows).
        align: alignment of every group's first row.
        total_rows: ``M``, at least the aligned total (the host's upper bound); default the aligned total.

    Returns:
        ``(m_indices, starts)``: int32 ``[M]`` and int64 ``[G]`` (each group's first row).

    Raises:
        ConfigError: negative counts, a bad ``align`` or a ``total_rows`` below the aligned total.

    Example:
        >>> m, starts = make_contiguous_layout([2, 0, 1], align=4)
        >>> m.tolist(), starts.tolist()
        ([0, 0, -1, -1, 2, -1, -1, -1], [0, 4, 4])
    """
    counts = [int(c) for c in rows_per_group]
    if any(c < 0 for c in counts):
        raise ConfigError(f"rows_per_group={counts}: expected non-negative counts")
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
        raise ConfigError(f"align={align!r}: expected a positive int")
    starts, row = [], 0
    for c in counts:
        starts.append(row)
        row += _ceil_div(c, align) * align
    M = row if total_rows is None else int(total_rows)
    if M < row:
        raise ConfigError(f"total_rows={total_rows}: expected at least the aligned total {row}")
    m_indices = np.full(M, -1, np.int32)
    for g, (start, c) in enumerate(zip(starts, counts)):
        m_indices[start:start + c] = g
    return m_indices, np.array(starts, np.int64)

