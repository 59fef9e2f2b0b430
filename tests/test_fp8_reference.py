"""The CPU references of the fp8 expert engines (symmring.moe.fp8_reference), against independent code.

Weight block quantisation is checked bitwise against a per-block loop over ml_dtypes written here; the
grouped GEMM reference against dequantise-then-matmul in float64 (the same sum in another order, so a
float64 tolerance); SwiGLU + quantise bitwise against quant.quantize_fp8 of the float32 activation, the
activation itself against float64 math.exp within float32 rounding. Also: the contiguous-layout helpers,
the engine configurations, and that the GPU modules import and fail cleanly without torch/triton.
"""

from __future__ import annotations

import math
import sys

import ml_dtypes
import numpy as np
import pytest

from symmring.errors import BackendError, ConfigError
from symmring.moe import quant
from symmring.moe.engines import triton_common, triton_heuristics, triton_large
from symmring.moe.fp8_reference import (ALIGN_M, dequantize_weight_blocks, grouped_gemm_fp8_reference,
                                        make_contiguous_layout, quantize_weight_blocks, silu_mul_f32,
                                        swiglu_quant_reference)

SEED = 20261201
E4M3 = ml_dtypes.float8_e4m3fn


def first_difference(name, got, want):
    """None when bitwise equal, else the first differing coordinate and both values (as bits too)."""
    got_bits = np.ascontiguousarray(got).view(np.uint8 if got.dtype.itemsize == 1 else np.uint32)
    want_bits = np.ascontiguousarray(want).view(np.uint8 if want.dtype.itemsize == 1 else np.uint32)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != {want.shape}"
    bad = np.argwhere(got_bits != want_bits)
    if bad.size == 0:
        return None
    at = tuple(bad[0])
    return (f"{name}: {len(bad)} differences, first at {at}: {got[at]!r} (0x{int(got_bits[at]):x}) != "
            f"{want[at]!r} (0x{int(want_bits[at]):x})")


def naive_block_quant(w):
    """Independent 128x128 block quantisation: one block at a time, Python max, ml_dtypes cast."""
    G, N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    q = np.empty(w.shape, E4M3)
    sf = np.empty((G, nb, kb), np.float32)
    for g in range(G):
        for i in range(nb):
            for j in range(kb):
                block = w[g, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                amax = np.float32(max(abs(float(v)) for v in block.ravel()))
                scale = np.float32(amax / np.float32(448.0))
                if scale == 0:
                    scale = np.float32(1.0)
                sf[g, i, j] = scale
                q[g, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = np.clip(
                    block / scale, np.float32(-448), np.float32(448)).astype(E4M3)
    return q, sf


# --- weight block quantisation ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 256, 384), (1, 200, 300), (3, 128, 130), (1, 1, 128), (2, 130, 1)])
def test_weight_blocks_bitwise_against_independent(shape):
    rng = np.random.default_rng([SEED, *shape])
    w = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0], size=shape)).astype(np.float32)
    # A zero block and a block far below float32's normal range (scale 1 and subnormal scales).
    if shape[1] > 128 and shape[2] > 128:
        w[0, :128, :128] = 0.0
        w[-1, 128:, 128:] = np.float32(1e-40) * rng.standard_normal(w[-1, 128:, 128:].shape).astype(np.float32)
    q, sf = quantize_weight_blocks(w)
    q_ref, sf_ref = naive_block_quant(w)
    assert q.dtype == E4M3 and q.shape == shape
    assert sf.dtype == np.float32 and sf.shape == (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    assert first_difference("sf", sf, sf_ref) is None, first_difference("sf", sf, sf_ref)
    assert first_difference("q", q, q_ref) is None, first_difference("q", q, q_ref)
    if shape[1] > 128 and shape[2] > 128:
        assert sf[0, 0, 0] == 1.0 and not np.any(q[0, :128, :128].astype(np.float32))


def test_weight_blocks_round_trip():
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((2, 200, 300)).astype(np.float32)
    q, sf = quantize_weight_blocks(w)
    back = dequantize_weight_blocks(q, sf)
    # Each element is within half an e4m3 ulp of the scaled value: relative 2^-4 for normals, 2^-10
    # times the block scale below e4m3's smallest normal.
    scale_of = np.repeat(np.repeat(sf, 128, axis=1), 128, axis=2)[:, :200, :300]
    assert np.all(np.abs(back - w) <= np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 * scale_of) * (1 + 1e-6))
    # Every block's largest magnitude maps onto 448 exactly (up to the float32 rounding of the scale).
    assert np.all(np.abs(q.astype(np.float32)).reshape(2, -1).max(axis=1) == 448.0)
    # Values q * 2^k with q representable and a block amax of exactly 448 * 2^k round-trip exactly.
    exact = (rng.integers(-16, 17, (1, 256, 256)).astype(np.float32) * np.float32(2.0 ** -5))
    exact[:, ::128, ::128] = np.float32(448 * 2.0 ** -5)
    np.testing.assert_array_equal(dequantize_weight_blocks(*quantize_weight_blocks(exact)), exact)


def test_weight_blocks_two_dimensional_and_errors():
    w = np.linspace(-3, 3, 130 * 256, dtype=np.float32).reshape(130, 256)
    q2, sf2 = quantize_weight_blocks(w)
    q3, sf3 = quantize_weight_blocks(w[None])
    assert q2.shape == (130, 256) and sf2.shape == (2, 2)
    np.testing.assert_array_equal(q2.view(np.uint8), q3[0].view(np.uint8))
    np.testing.assert_array_equal(sf2, sf3[0])
    with pytest.raises(ConfigError, match="float32"):
        quantize_weight_blocks(w.astype(np.float64))
    with pytest.raises(ConfigError, match="finite"):
        quantize_weight_blocks(np.full((1, 128, 128), np.inf, np.float32))
    with pytest.raises(ConfigError, match="sf"):
        dequantize_weight_blocks(q3, sf3[:, :1])


# --- grouped GEMM reference -------------------------------------------------------------------------------

def make_problem(rng, rows_per_group, N, K, total_rows=None):
    m_indices, starts = make_contiguous_layout(rows_per_group, total_rows=total_rows)
    M = len(m_indices)
    x = (rng.standard_normal((M, K)) * rng.choice([0.01, 1.0, 30.0], size=(M, 1))).astype(np.float32)
    a_q, a_sf = quant.quantize_fp8(x)
    w = (rng.standard_normal((len(rows_per_group), N, K)) / math.sqrt(K)).astype(np.float32)
    b_q, b_sf = quantize_weight_blocks(w)
    return a_q, a_sf, b_q, b_sf, m_indices


@pytest.mark.parametrize("rows_per_group,N,K,total", [
    ([130, 0, 64, 256], 256, 384, None),        # an empty group, blocks not filled, a full group
    ([1, 300], 200, 128, 1024),                  # N not a multiple of 128, trailing padding
    ([128], 128, 256, None),
])
def test_grouped_gemm_reference_matches_dequantised_matmul(rows_per_group, N, K, total):
    rng = np.random.default_rng([SEED, N, K])
    a_q, a_sf, b_q, b_sf, m_indices = make_problem(rng, rows_per_group, N, K, total)
    out = grouped_gemm_fp8_reference(a_q, a_sf, b_q, b_sf, m_indices)
    a_deq = quant.dequantize_fp8(a_q, a_sf).astype(np.float64)
    b_deq = dequantize_weight_blocks(b_q, b_sf).astype(np.float64)
    assert out.dtype == np.float64 and out.shape == (len(m_indices), N)
    for g in range(len(rows_per_group)):
        rows = m_indices == g
        assert rows.sum() == rows_per_group[g]
        expect = a_deq[rows] @ b_deq[g].T
        # float32 dequantisation products are exact in float64 except for the scale products' rounding.
        np.testing.assert_allclose(out[rows], expect, rtol=1e-6, atol=1e-6 * max(1.0, np.abs(expect).max(initial=0)),
                                   err_msg=f"group {g}")
    assert np.all(out[m_indices < 0] == 0)


def test_grouped_gemm_reference_rows_are_independent():
    rng = np.random.default_rng(SEED + 1)
    a_q, a_sf, b_q, b_sf, m_indices = make_problem(rng, [200, 100], 128, 256)
    full = grouped_gemm_fp8_reference(a_q, a_sf, b_q, b_sf, m_indices)
    # Garbage (NaN bytes) in padding rows changes nothing elsewhere.
    a_dirty = a_q.copy()
    a_dirty.view(np.uint8)[m_indices < 0] = 0x7F
    dirty = grouped_gemm_fp8_reference(a_dirty, a_sf, b_q, b_sf, m_indices)
    np.testing.assert_array_equal(dirty[m_indices >= 0], full[m_indices >= 0])


def test_grouped_gemm_reference_errors():
    rng = np.random.default_rng(SEED + 2)
    a_q, a_sf, b_q, b_sf, m_indices = make_problem(rng, [128], 128, 256)
    with pytest.raises(ConfigError, match="m_indices"):
        grouped_gemm_fp8_reference(a_q, a_sf, b_q, b_sf, np.full_like(m_indices, 3))
    with pytest.raises(ConfigError, match="a_sf"):
        grouped_gemm_fp8_reference(a_q, a_sf[:, :1], b_q, b_sf, m_indices)
    with pytest.raises(ConfigError, match="b_sf"):
        grouped_gemm_fp8_reference(a_q, a_sf, b_q, b_sf[:, :, :1], m_indices)
    with pytest.raises(ConfigError, match="b_q"):
        grouped_gemm_fp8_reference(a_q, a_sf, b_q[:, :, :128], b_sf, m_indices)


# --- SwiGLU + quantise reference --------------------------------------------------------------------------

def random_h(rng, M, inter):
    h = (rng.standard_normal((M, 2 * inter)) * rng.choice([0.1, 1.0, 12.0], size=(M, 1))).astype(np.float32)
    h[0, :inter] = -100.0      # exp(-g) overflows: silu = -0.0
    h[1, inter:] = 0.0         # a zero row: scale 1, q = 0
    return h.astype(ml_dtypes.bfloat16)


def test_silu_mul_against_float64():
    rng = np.random.default_rng(SEED + 3)
    h = random_h(rng, 64, 256)
    act = silu_mul_f32(h)
    g = h[:, :256].astype(np.float64)
    u = h[:, 256:].astype(np.float64)
    with np.errstate(over="ignore"):
        expect = g / (1 + np.exp(-g)) * u
    # Four float32 roundings (exp, add, divide, multiply): a few float32 ulps of the result.
    np.testing.assert_allclose(act, expect, rtol=4 * 2.0 ** -23, atol=1e-37)
    assert act.dtype == np.float32 and np.all(act[0] == 0) and np.all(act[1] == 0)
    # bf16, its bits and float32 values of it give the same activation.
    np.testing.assert_array_equal(silu_mul_f32(h.view(np.uint16)), act)
    np.testing.assert_array_equal(silu_mul_f32(h.astype(np.float32)), act)


def test_swiglu_quant_reference_is_quantize_fp8_of_the_activation():
    rng = np.random.default_rng(SEED + 4)
    h = random_h(rng, 96, 384)
    q, q_sf = swiglu_quant_reference(h)
    q_ref, sf_ref = quant.quantize_fp8(silu_mul_f32(h))
    assert q.shape == (96, 384) and q_sf.shape == (96, 3)
    assert first_difference("q", q, q_ref) is None, first_difference("q", q, q_ref)
    assert first_difference("q_sf", q_sf, sf_ref) is None
    assert np.all(q_sf[1] == 1.0) and not np.any(q[1].astype(np.float32))
    # The same per-group rule written out once more, from the float32 activation.
    act = silu_mul_f32(h)
    groups = act.reshape(96, 3, 128)
    scale = (np.abs(groups).max(axis=2) / np.float32(448)).astype(np.float32)
    scale[scale == 0] = 1
    np.testing.assert_array_equal(q_sf, scale)
    qv = np.clip(groups / scale[:, :, None], -448, 448).astype(E4M3).reshape(96, 384)
    assert first_difference("q (written out)", q, qv) is None


def test_swiglu_quant_reference_masks_padding_rows_and_rejects_bad_input():
    rng = np.random.default_rng(SEED + 5)
    h = random_h(rng, 8, 128)
    m_indices = np.array([0, 0, 1, -1, -1, 2, -1, 2], np.int32)
    q, q_sf = swiglu_quant_reference(h, m_indices)
    full_q, full_sf = swiglu_quant_reference(h)
    real = m_indices >= 0
    np.testing.assert_array_equal(q.view(np.uint8)[real], full_q.view(np.uint8)[real])
    np.testing.assert_array_equal(q_sf[real], full_sf[real])
    assert not np.any(q.view(np.uint8)[~real]) and np.all(q_sf[~real] == 1)
    with pytest.raises(ConfigError, match="multiple of 128"):
        swiglu_quant_reference(np.zeros((2, 128), np.float32))
    with pytest.raises(ConfigError, match="dtype"):
        swiglu_quant_reference(np.zeros((2, 256), np.float64))
    with pytest.raises(ConfigError, match="m_indices"):
        swiglu_quant_reference(h, m_indices[:3])


# --- layout helpers, configurations, optional engines -----------------------------------------------------

def test_contiguous_layout_helpers():
    m_indices, starts = make_contiguous_layout([130, 0, 5, 128], total_rows=700)
    assert starts.tolist() == [0, 256, 256, 384] and len(m_indices) == 700
    assert (m_indices == 0).sum() == 130 and (m_indices == 1).sum() == 0 and (m_indices == 3).sum() == 128
    assert np.all(m_indices[130:256] == -1) and np.all(m_indices[512:] == -1)
    triton_large.check_contiguous_layout(m_indices, 4)
    bad = m_indices.copy()
    bad[512] = 0                                   # group 0 again, after other groups
    with pytest.raises(ConfigError, match="not contiguous"):
        triton_large.check_contiguous_layout(bad, 4)
    shifted = np.roll(m_indices, 1)                # group 0 now starts at row 1
    with pytest.raises(ConfigError, match="multiple of 128"):
        triton_large.check_contiguous_layout(shifted, 4)
    with pytest.raises(ConfigError, match=r"\[-1, 2\)"):
        triton_large.check_contiguous_layout(m_indices, 2)
    with pytest.raises(ConfigError, match="total_rows"):
        make_contiguous_layout([200], total_rows=200)
    assert ALIGN_M == triton_large.ALIGN_M == 128


def test_gemm_configs():
    names = [c.name for c in triton_heuristics.gemm_configs()]
    assert len(names) == len(set(names)) >= 8
    for c in triton_heuristics.gemm_configs():
        assert triton_large.ALIGN_M % c.block_m == 0 and c.smem_bytes <= 227 * 1024
    for problem in [(32 * 256, 4096, 7168, 32), (32 * 128, 4096, 7168, 32), (8 * 2048, 28672, 4096, 8),
                    (128 * 256, 1536, 2048, 128), (128, 128, 128, 1), (4096, 7168, 2048, 256)]:
        assert isinstance(triton_heuristics.default_config(*problem), triton_heuristics.GemmConfig)
    with pytest.raises(ConfigError, match="block_m"):
        triton_heuristics.GemmConfig(block_m=256)
    with pytest.raises(ConfigError, match="num_warps"):
        triton_heuristics.GemmConfig(num_warps=2)


def test_engines_fail_cleanly_without_triton(monkeypatch):
    # A missing triton (or torch) surfaces as BackendError at the first call, never at import.
    monkeypatch.setitem(sys.modules, "triton", None)
    triton_large._triton.cache_clear()
    triton_common.load.cache_clear()
    try:
        with pytest.raises(BackendError, match="triton"):
            triton_large.swiglu_quant_fp8(None)
    finally:
        triton_large._triton.cache_clear()
        triton_common.load.cache_clear()


def test_deepgemm_status_never_raises():
    from symmring.moe.engines import deepgemm
    ok, reason = deepgemm.deepgemm_status()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    if not ok:
        with pytest.raises(BackendError, match="DeepGEMM"):
            deepgemm.grouped_gemm_fp8(None, None, None, None, None, None)
