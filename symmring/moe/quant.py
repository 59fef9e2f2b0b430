"""Activation formats of the ring: fp8 e4m3 with per-token, per-group float32 scales, and bf16.

fp8 (``x_format="fp8_e4m3"``)
    Each token's ``hidden`` channels are split into groups of ``group_size`` (128 by default, DeepSeek-V3's
    and DeepGEMM's choice). A group's scale is ``amax / 448`` (448 is e4m3's largest finite value), so
    the group's largest magnitude maps to 448 and no value overflows. The quantised value is
    ``round_to_nearest_even(x / scale)`` as ``ml_dtypes.float8_e4m3fn``; the ring carries its raw bytes
    (``uint8``). Dequantisation is ``float32(q) * scale``.

    Zero groups: a group whose ``amax / 448`` is 0 in float32 (all zeros, or an amax below 448 times the
    smallest float32 subnormal) gets scale **1.0**, so it quantises to zeros and dequantises to exact
    zeros; no division by zero ever happens.

    Error bound: an element whose scaled value ``|x / scale|`` is at least 2^-6 (e4m3's smallest normal)
    is within a relative ``2^-4`` (half of e4m3's 2^-3 machine epsilon) of ``x``; a smaller element is
    within ``2^-10 * scale`` (half the subnormal spacing). Values of the form ``q * 2^k`` with ``q``
    representable in e4m3 and a group amax of exactly ``448 * 2^k`` round-trip exactly.

bf16 (``x_format="bf16"``)
    Round to nearest even (``ml_dtypes.bfloat16``); the ring carries the raw 16 bits (``uint16``), and
    there are no scales.

Every function works row by row with elementwise operations only, so a token's result never depends on
which other tokens are quantised with it (the expert-parallel layer relies on that for bitwise equality
of its batch and streamed paths).
"""

from __future__ import annotations

from typing import Tuple

import ml_dtypes
import numpy as np

from ..errors import ConfigError

#: Largest finite e4m3 value: a group's amax is scaled onto it.
FP8_E4M3_MAX = 448.0
#: Channels per scale factor unless told otherwise.
DEFAULT_GROUP_SIZE = 128
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
BF16_DTYPE = np.dtype(ml_dtypes.bfloat16)


def _check_x(x, name: str = "x") -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ConfigError(f"{name}: expected a 2-D NumPy array [num_tokens, hidden], got "
                          f"{type(x).__name__} with shape {getattr(x, 'shape', None)}")
    if x.dtype != np.float32:
        raise ConfigError(f"{name}.dtype={x.dtype}: expected float32")
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"{name}: expected finite values (found NaN or inf)")
    return x


def _check_group_size(hidden: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise ConfigError(f"group_size={group_size!r}: expected a positive integer")
    if hidden % group_size:
        raise ConfigError(f"hidden={hidden}: expected a multiple of group_size={group_size}")


def quantize_fp8(x: np.ndarray, group_size: int = DEFAULT_GROUP_SIZE) -> Tuple[np.ndarray, np.ndarray]:
    """Quantise ``x`` to fp8 e4m3 with one float32 scale per token and per ``group_size`` channels.

    Args:
        x: float32 ``[num_tokens, hidden]``, finite.
        group_size: channels per scale; ``hidden`` must be a multiple of it.

    Returns:
        ``(x_q, x_sf)``: ``x_q`` float8_e4m3fn ``[num_tokens, hidden]`` (``x_q.view(np.uint8)`` gives the
        ring's bytes) and ``x_sf`` float32 ``[num_tokens, hidden // group_size]``.

    Raises:
        ConfigError: ``x`` is not a finite 2-D float32 array, or ``hidden`` is not a multiple of
            ``group_size``.

    Example:
        >>> x_q, x_sf = quantize_fp8(np.ones((2, 128), np.float32))
        >>> float(x_q.astype(np.float32)[0, 0]), x_sf.shape
        (448.0, (2, 1))
    """
    x = _check_x(x)
    num_tokens, hidden = x.shape
    _check_group_size(hidden, group_size)
    groups = x.reshape(num_tokens, hidden // group_size, group_size)
    amax = np.abs(groups).max(axis=2, initial=np.float32(0))
    x_sf = (amax / np.float32(FP8_E4M3_MAX)).astype(np.float32)
    x_sf[x_sf == 0] = np.float32(1.0)  # zero groups: scale 1, no division by zero
    scaled = groups / x_sf[:, :, None]
    # amax / (amax / 448) can round just above 448; e4m3fn has no inf, so clip rather than make NaN.
    np.clip(scaled, -FP8_E4M3_MAX, FP8_E4M3_MAX, out=scaled)
    x_q = scaled.astype(FP8_DTYPE).reshape(num_tokens, hidden)
    return x_q, x_sf


def dequantize_fp8(x_q: np.ndarray, x_sf: np.ndarray) -> np.ndarray:
    """Float32 values of fp8 data: ``float32(x_q) * scale`` of each element's group.

    Args:
        x_q: ``[num_tokens, hidden]`` float8_e4m3fn, or its raw bytes as uint8 (the ring's storage).
        x_sf: float32 ``[num_tokens, hidden // group_size]``.

    Returns:
        float32 ``[num_tokens, hidden]`` (a new array).

    Raises:
        ConfigError: shapes or dtypes that do not fit together.

    Example:
        >>> x = np.linspace(-1, 1, 256, dtype=np.float32).reshape(1, 256)
        >>> bool(np.allclose(dequantize_fp8(*quantize_fp8(x)), x, rtol=2 ** -4, atol=2 ** -10 / 448))
        True
    """
    if not isinstance(x_q, np.ndarray) or x_q.ndim != 2:
        raise ConfigError(f"x_q: expected a 2-D array [num_tokens, hidden], got shape {getattr(x_q, 'shape', None)}")
    if x_q.dtype == np.uint8:
        x_q = x_q.view(FP8_DTYPE)
    elif x_q.dtype != FP8_DTYPE:
        raise ConfigError(f"x_q.dtype={x_q.dtype}: expected float8_e4m3fn or uint8")
    if not isinstance(x_sf, np.ndarray) or x_sf.dtype != np.float32 or x_sf.ndim != 2:
        raise ConfigError(f"x_sf: expected a 2-D float32 array, got {getattr(x_sf, 'dtype', None)} "
                          f"{getattr(x_sf, 'shape', None)}")
    num_tokens, hidden = x_q.shape
    if x_sf.shape[0] != num_tokens or x_sf.shape[1] == 0 or hidden % x_sf.shape[1]:
        raise ConfigError(f"x_sf.shape={x_sf.shape}: expected [{num_tokens}, a divisor of hidden={hidden}]")
    group_size = hidden // x_sf.shape[1]
    values = x_q.astype(np.float32).reshape(num_tokens, x_sf.shape[1], group_size)
    return (values * x_sf[:, :, None]).reshape(num_tokens, hidden)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 ``x`` to bf16 (nearest even); ``.view(np.uint16)`` gives the ring's bits.

    Raises:
        ConfigError: ``x`` is not a finite 2-D float32 array.

    Example:
        >>> to_bf16(np.full((1, 8), 1 + 2 ** -9, np.float32)).astype(np.float32)[0, 0]
        np.float32(1.0)
    """
    return _check_x(x).astype(BF16_DTYPE)


def from_bf16(x_bf16: np.ndarray) -> np.ndarray:
    """Float32 values (exact) of bf16 data given as ``ml_dtypes.bfloat16`` or raw ``uint16`` bits.

    Raises:
        ConfigError: another dtype.
    """
    if not isinstance(x_bf16, np.ndarray):
        raise ConfigError(f"x_bf16: expected a NumPy array, got {type(x_bf16).__name__}")
    if x_bf16.dtype == np.uint16:
        x_bf16 = x_bf16.view(BF16_DTYPE)
    elif x_bf16.dtype != BF16_DTYPE:
        raise ConfigError(f"x_bf16.dtype={x_bf16.dtype}: expected bfloat16 or uint16")
    return x_bf16.astype(np.float32)


def encode(x: np.ndarray, x_format: str, group_size: int = DEFAULT_GROUP_SIZE):
    """The ring's representation of float32 ``x``: ``(x_bits, x_sf)``.

    ``x_bits`` is uint8 (fp8 e4m3 bytes) or uint16 (bf16 bits); ``x_sf`` is float32 scales for fp8 and
    ``None`` for bf16.

    Raises:
        ConfigError: an unknown ``x_format`` or bad ``x``.

    Example:
        >>> bits, sf = encode(np.zeros((3, 128), np.float32), "fp8_e4m3")
        >>> bits.dtype, sf.shape
        (dtype('uint8'), (3, 1))
    """
    if x_format == "fp8_e4m3":
        x_q, x_sf = quantize_fp8(x, group_size)
        return x_q.view(np.uint8), x_sf
    if x_format == "bf16":
        return to_bf16(x).view(np.uint16), None
    raise ConfigError(f"x_format={x_format!r}: expected 'fp8_e4m3' or 'bf16'")


def decode(x_bits: np.ndarray, x_sf, x_format: str) -> np.ndarray:
    """Float32 values of the ring's representation (the inverse of `encode`, up to its rounding).

    Raises:
        ConfigError: an unknown ``x_format`` or inconsistent arrays.
    """
    if x_format == "fp8_e4m3":
        if x_sf is None:
            raise ConfigError("x_sf=None: fp8_e4m3 data needs its scales")
        return dequantize_fp8(x_bits, x_sf)
    if x_format == "bf16":
        return from_bf16(x_bits)
    raise ConfigError(f"x_format={x_format!r}: expected 'fp8_e4m3' or 'bf16'")
