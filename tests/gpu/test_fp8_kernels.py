"""The fp8 expert engines (symmring.moe.engines.triton_large, symmring.moe.engines.deepgemm) against the CPU references.

Needs torch with a CUDA GPU of compute capability >= 8.9 and triton (no NVSHMEM); skipped with the reason
elsewhere. With ``TRITON_INTERPRET=1`` the Triton kernels run on the CPU through Triton's interpreter
(smaller shapes, fewer configurations); the interpreter's float32 -> bf16/e4m3 casts truncate or round
half up, so a fixture here replaces them with ml_dtypes' round-to-nearest-even, what the GPU does::

    TRITON_INTERPRET=1 python -m pytest tests/gpu/test_fp8_kernels.py -q

* grouped GEMM, every configuration, vs the float64 reference on shapes with empty groups, groups not
  filling their last block, trailing padding, N not a multiple of the tile: ``||out - ref|| / ||ref||``
  over real rows <= 1e-2 (float32 accumulation then one bf16 rounding gives ~1.5e-3; the message prints
  the figure); tiles that start with a padding row are not written; garbage in padding rows of ``a``
  changes no real row;
* SwiGLU + quantise: q and q_sf bitwise equal to quant.quantize_fp8 of the kernel's own float32
  activation, and that activation bitwise equal to the same formula evaluated by torch (on the GPU, both
  CUDA's expf) or NumPy (interpreter); if the activation differs by an ulp somewhere (a different expf),
  q must be within one e4m3 ulp and the test warns with the count;
* DeepGEMM vs the reference and vs Triton when deep_gemm is usable (else skipped with
  deepgemm_status()'s reason).
"""

from __future__ import annotations

import functools
import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from moe_helpers import deepgemm_reason
from symmring.errors import ConfigError
from symmring.moe import quant
from symmring.moe.engines import triton_heuristics, triton_large
from symmring.moe.engines.triton_heuristics import GemmConfig
from symmring.moe.fp8_reference import (grouped_gemm_fp8_reference, make_contiguous_layout,
                                        quantize_weight_blocks, silu_mul_f32)

torch = pytest.importorskip("torch", reason="the fp8 engine tests need torch (and triton, and a CUDA GPU)")
pytest.importorskip("triton", reason="the fp8 engine tests need triton (it ships with torch's CUDA wheels)")

INTERPRET = triton_large.interpreting()
SEED = 20261201
E4M3 = ml_dtypes.float8_e4m3fn


def _skip_reason():
    if INTERPRET:
        if tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4):
            return ("the Triton 3.x interpreter converts 1-element arrays with int(), which NumPy >= 2.4 rejects: "
                    "run it with numpy < 2.4")
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (or TRITON_INTERPRET=1 to run the Triton kernels on the CPU interpreter)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"needs fp8 tensor cores (compute capability >= 8.9), found {major}.{minor}"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@pytest.fixture(scope="module")
def device():
    return torch.device("cpu") if INTERPRET else torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module", autouse=True)
def exact_interpreter_casts():
    """Under the interpreter: float32 -> bf16 / e4m3 with round-to-nearest-even (ml_dtypes), as the GPU's
    cvt.rn.bf16.f32 and cvt.rn.satfinite.e4m3x2.f32; the interpreter's own cast truncates (bf16) or rounds
    half up without carrying into the exponent (e4m3)."""
    if not INTERPRET:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter
    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        rtz = rounding_mode is not None and rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ
        if input_dtype == tl.float32 and not rtz and output_dtype in (tl.bfloat16, tl.float8e4nv):
            values = np.asarray(input).view(np.float32)
            if output_dtype == tl.bfloat16:
                return values.astype(ml_dtypes.bfloat16).view(np.uint16)
            return np.clip(values, -448, 448).astype(E4M3).view(np.uint8)  # satfinite
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original


def to_torch(array, device):
    """A torch tensor of a NumPy array's values (e4m3 and bf16 via their bits)."""
    if array.dtype == E4M3:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(torch.float8_e4m3fn).to(device)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def to_numpy(tensor):
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.cpu().view(torch.uint8).numpy().view(E4M3)
    if tensor.dtype == torch.bfloat16:
        return tensor.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.cpu().numpy()


def first_difference(name, got, want):
    got_b = np.ascontiguousarray(got).view(np.uint8 if got.dtype.itemsize == 1 else np.uint32)
    want_b = np.ascontiguousarray(want).view(np.uint8 if want.dtype.itemsize == 1 else np.uint32)
    bad = np.argwhere(got_b != want_b)
    if bad.size == 0:
        return None
    at = tuple(bad[0])
    return f"{name}: {len(bad)} of {got.size} differ, first at {at}: {got[at]!r} != {want[at]!r}"


def make_gemm_problem(rows_per_group, N, K, total_rows=None, seed=SEED):
    rng = np.random.default_rng([seed, N, K, len(rows_per_group)])
    m_indices, _ = make_contiguous_layout(rows_per_group, total_rows=total_rows)
    M = len(m_indices)
    # Rows of very different magnitudes, so per-row scales matter.
    x = (rng.standard_normal((M, K)) * rng.choice([0.02, 1.0, 40.0], size=(M, 1))).astype(np.float32)
    a_q, a_sf = quant.quantize_fp8(x)
    # Padding rows hold garbage, NaN bytes included: they must not leak into real rows.
    a_q.view(np.uint8)[m_indices < 0] = rng.integers(0, 256, ((m_indices < 0).sum(), K), dtype=np.uint8)
    a_sf[m_indices < 0] = np.float32(np.nan)
    w = (rng.standard_normal((len(rows_per_group), N, K)) / math.sqrt(K)).astype(np.float32)
    w *= rng.choice([0.1, 1.0, 8.0], size=(len(rows_per_group), 1, 1)).astype(np.float32)
    b_q, b_sf = quantize_weight_blocks(w)
    return a_q, a_sf, b_q, b_sf, m_indices


# (rows per group, N, K, total rows): an empty group, groups not filling their last block, a full group,
# trailing padding, an odd number of 128-column blocks (a 256-wide tile's second half past N), N not a
# multiple of 128, M not a multiple of 128.
GEMM_SHAPES_SMALL = [
    ([130, 0, 64, 256], 256, 384, 1024),
    ([1, 300, 128], 384, 256, None),
    ([70, 129], 320, 128, 600),
]
GEMM_SHAPES_GPU = GEMM_SHAPES_SMALL + [
    ([500, 0, 37, 1024, 255, 128, 0, 3], 1024, 1024, 4096),
    ([256] * 4, 2048, 2048, None),
]
INTERPRETER_CONFIGS = [GemmConfig(128, 128, 8, 8, 3), GemmConfig(64, 128, 8, 4, 3, tma=False),
                       GemmConfig(128, 256, 8, 8, 3)]
GEMM_CONFIGS = INTERPRETER_CONFIGS if INTERPRET else triton_heuristics.gemm_configs()
GEMM_SHAPES = GEMM_SHAPES_SMALL if INTERPRET else GEMM_SHAPES_GPU
SENTINEL = 7.0  # bf16-exact: rows the kernel must not write keep it


_REFERENCES = {}


def reference_of(problem):
    """The float64 reference of a problem, computed once per problem (the larger ones take seconds)."""
    key = id(problem)
    if key not in _REFERENCES:
        _REFERENCES[key] = (problem, grouped_gemm_fp8_reference(*problem))
    return _REFERENCES[key][1]


@functools.lru_cache(maxsize=None)
def cached_problem(rows, N, K, total):
    return make_gemm_problem(list(rows), N, K, total)


def check_gemm(out, problem, what):
    """Relative error over real rows; asserts <= 1e-2 and returns the figure."""
    m_indices = problem[4]
    want = reference_of(problem)
    got = to_numpy(out).astype(np.float64)
    real = m_indices >= 0
    err = float(np.linalg.norm(got[real] - want[real]) / np.linalg.norm(want[real]))
    assert np.all(np.isfinite(got[real])), f"{what}: non-finite values in real rows"
    assert err <= 1e-2, f"{what}: ||out - ref|| / ||ref|| = {err:.3e} over real rows (limit 1e-2)"
    return err


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"G{len(s[0])}-N{s[1]}-K{s[2]}")
@pytest.mark.parametrize("config", GEMM_CONFIGS, ids=lambda c: c.name)
def test_grouped_gemm_matches_reference(config, shape, device):
    rows, N, K, total = shape
    problem = cached_problem(tuple(rows), N, K, total)
    m_indices = problem[4]
    args = [to_torch(v, device) for v in problem]
    out = torch.full((len(m_indices), N), SENTINEL, dtype=torch.bfloat16, device=device)
    triton_large.grouped_gemm_fp8(*args, out=out, config=config)
    err = check_gemm(out, problem, f"{config.name} {shape}")
    # Tiles that start with a padding row exit before writing anything.
    starts = np.arange(0, len(m_indices), config.block_m)
    skipped = np.concatenate([np.arange(s, min(s + config.block_m, len(m_indices)))
                              for s in starts if m_indices[s] < 0] or [np.zeros(0, np.int64)])
    assert np.all(to_numpy(out).astype(np.float32)[skipped] == SENTINEL), f"{config.name}: a padding tile was written"
    print(f"{config.name} {shape}: relative error {err:.2e}")


def test_grouped_gemm_default_config_strided_scales_and_errors(device):
    problem = make_gemm_problem([200, 64], 256, 256, 512)
    a, a_sf, b, b_sf, m_indices = [to_torch(v, device) for v in problem]
    out = triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices)  # default config, allocated output
    check_gemm(out, problem, "default config")
    # MN-major activation scales (DeepGEMM's layout) and transposed weight scales give the same result.
    a_sf_mn = torch.empty_strided(a_sf.shape, (1, a_sf.shape[0]), dtype=torch.float32, device=device).copy_(a_sf)
    b_sf_t = b_sf.transpose(1, 2).contiguous().transpose(1, 2)
    out2 = triton_large.grouped_gemm_fp8(a, a_sf_mn, b, b_sf_t, m_indices)
    real = torch.from_numpy(problem[4] >= 0).to(device)
    assert torch.equal(out[real], out2[real])
    with pytest.raises(ConfigError, match="a:"):
        triton_large.grouped_gemm_fp8(a.float(), a_sf, b, b_sf, m_indices)
    with pytest.raises(ConfigError, match="multiple of 128"):
        triton_large.grouped_gemm_fp8(a[:, :100], a_sf, b, b_sf, m_indices)
    with pytest.raises(ConfigError, match="b_sf"):
        triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf[:, :1], m_indices)
    with pytest.raises(ConfigError, match="m_indices"):
        triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices.long())
    with pytest.raises(ConfigError, match="out"):
        triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices, out=torch.empty(3, 3, device=device))
    if device.type == "cuda":
        with pytest.raises(ConfigError, match="device"):
            triton_large.grouped_gemm_fp8(a, a_sf.cpu(), b, b_sf, m_indices)
    empty = triton_large.grouped_gemm_fp8(a[:0], a_sf[:0], b, b_sf, m_indices[:0])
    assert tuple(empty.shape) == (0, 256)


@pytest.mark.parametrize("bad", [-5, 7], ids=["below-padding", "past-G"])
@pytest.mark.parametrize("config", INTERPRETER_CONFIGS[:2], ids=lambda c: c.name)
def test_grouped_gemm_skips_and_reports_bad_group_ids(bad, config, device):
    """Rows whose group id lies outside [-1, G) (stale or corrupt ids; G = 4 here) are skipped: their tiles
    read no weights and write nothing (the rows keep the sentinel), every other row is bitwise what the clean
    layout gives, and ``bad_groups`` counts the skipped tiles and keeps the first id; without ``bad_groups``
    they are skipped all the same."""
    problem = make_gemm_problem([130, 0, 64, 256], 256, 384, 1024)
    a, a_sf, b, b_sf, m_indices = [to_torch(v, device) for v in problem]
    clean = triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices, config=config)
    corrupt = problem[4].copy()
    hit = corrupt == 2
    corrupt[hit] = bad
    report = torch.zeros(2, dtype=torch.int32, device=device)
    for given in (report, None):
        out = torch.full_like(clean, SENTINEL)
        triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf, to_torch(corrupt, device), out=out, config=config,
                                      bad_groups=given)
        got = to_numpy(out).astype(np.float32)
        assert np.all(got[hit] == SENTINEL), f"{config.name}: a row of group {bad} was written"
        keep = torch.from_numpy(~hit & (problem[4] >= 0)).to(device)
        assert torch.equal(out[keep], clean[keep]), f"{config.name}: a good row changed"
    starts = np.arange(0, len(corrupt), config.block_m)
    tiles = int(hit[starts].sum()) * -(-256 // config.block_n)
    assert tiles > 0 and report.tolist() == [tiles, bad], (report.tolist(), tiles)
    with pytest.raises(ConfigError, match="bad_groups"):
        triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices, bad_groups=torch.zeros(1, dtype=torch.int32,
                                                                                           device=device))


def _reference_activation(h):
    """The activation formula evaluated outside the kernel: torch float32 ops on the GPU (CUDA's expf,
    each step one rounding), NumPy's float32 under the interpreter (whose tl.exp is NumPy's)."""
    if h.device.type == "cpu":
        return silu_mul_f32(to_numpy(h))
    inter = h.shape[1] // 2
    g, u = h[:, :inter].float(), h[:, inter:].float()
    return to_numpy(g / (1.0 + torch.exp(-g)) * u)


def _e4m3_ulps(a, b):
    """Distance in representable e4m3 steps (same-sign, finite values)."""
    def ordinal(x):
        bits = x.view(np.uint8).astype(np.int32)
        return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)
    return np.abs(ordinal(a) - ordinal(b))


@pytest.mark.parametrize("M,inter,with_indices", [(200, 256, False), (200, 384, True), (64, 128, True)])
def test_swiglu_quant_bitwise(M, inter, with_indices, device):
    rng = np.random.default_rng([SEED, M, inter])
    h_f32 = (rng.standard_normal((M, 2 * inter)) * rng.choice([0.05, 1.0, 9.0], size=(M, 1))).astype(np.float32)
    h_f32[0, :inter] = -100.0       # exp(-g) overflows: silu = -0.0
    h_f32[1] = 0.0                  # zero groups: scale 1
    h_f32[2, inter:] = 1e-30        # tiny products
    h = to_torch(h_f32.astype(ml_dtypes.bfloat16), device)
    m_np = None
    if with_indices:
        m_np = np.where(rng.random(M) < 0.25, -1, 0).astype(np.int32)
        m_np[:3] = 0
    act_out = torch.empty(M, inter, dtype=torch.float32, device=device)
    q, q_sf = triton_large.swiglu_quant_fp8(h, None if m_np is None else to_torch(m_np, device), act_out=act_out)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (M, inter)
    assert q_sf.dtype == torch.float32 and tuple(q_sf.shape) == (M, inter // 128)
    real = np.ones(M, bool) if m_np is None else m_np >= 0
    q_np, sf_np, act = to_numpy(q)[real], to_numpy(q_sf)[real], to_numpy(act_out)[real]

    # 1. The quantiser, exactly: bitwise quant.quantize_fp8 of the kernel's own float32 activation.
    q_own, sf_own = quant.quantize_fp8(np.ascontiguousarray(act))
    assert first_difference("q_sf vs quantize_fp8(kernel act)", sf_np, sf_own) is None, \
        first_difference("q_sf vs quantize_fp8(kernel act)", sf_np, sf_own)
    assert first_difference("q vs quantize_fp8(kernel act)", q_np, q_own) is None, \
        first_difference("q vs quantize_fp8(kernel act)", q_np, q_own)

    # 2. The activation against the formula evaluated outside, then the whole thing against the reference.
    ref_act = _reference_activation(h)[real]
    q_ref, sf_ref = quant.quantize_fp8(np.ascontiguousarray(ref_act))
    act_diff = first_difference("act", act, ref_act)
    if act_diff is None:
        assert first_difference("q", q_np, q_ref) is None and first_difference("q_sf", sf_np, sf_ref) is None
        return
    # Only a different expf can get here (CUDA's vs the reference's): then within rounding, and say so.
    ulp = np.abs(act.view(np.int32).astype(np.int64) - ref_act.view(np.int32).astype(np.int64))
    assert ulp.max() <= 2, f"activation more than 2 float32 ulps from the formula: {act_diff}"
    assert _e4m3_ulps(q_np, q_ref).max() <= 1, "q more than one e4m3 ulp from the reference"
    np.testing.assert_allclose(sf_np, sf_ref, rtol=2 * 2.0 ** -23)
    warnings.warn(f"swiglu_quant_fp8: activation not bitwise equal to the reference formula ({act_diff}); "
                  f"q within one e4m3 ulp ({int((q_np.view(np.uint8) != q_ref.view(np.uint8)).sum())} differ)")


def test_swiglu_quant_errors(device):
    h = torch.zeros(4, 256, dtype=torch.bfloat16, device=device)
    with pytest.raises(ConfigError, match="bfloat16"):
        triton_large.swiglu_quant_fp8(h.float())
    with pytest.raises(ConfigError, match="multiple of 128"):
        triton_large.swiglu_quant_fp8(h[:, :192])
    with pytest.raises(ConfigError, match="m_indices"):
        triton_large.swiglu_quant_fp8(h, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ConfigError, match="act_out"):
        triton_large.swiglu_quant_fp8(h, act_out=torch.empty(4, 256, device=device))
    q, q_sf = triton_large.swiglu_quant_fp8(h[:0])
    assert tuple(q.shape) == (0, 128) and tuple(q_sf.shape) == (0, 1)


# --- DeepGEMM ---------------------------------------------------------------------------------------------

def _deepgemm_reason():
    if INTERPRET:
        return "DeepGEMM needs a GPU (running under the Triton interpreter)"
    return deepgemm_reason()


@pytest.mark.skipif(_deepgemm_reason() is not None, reason=f"DeepGEMM engine: {_deepgemm_reason()}")
@pytest.mark.parametrize("shape", [s for s in GEMM_SHAPES if s[1] % 8 == 0],
                         ids=lambda s: f"G{len(s[0])}-N{s[1]}-K{s[2]}")
def test_deepgemm_matches_reference_and_triton(shape, device):
    from symmring.moe.engines import deepgemm
    rows, N, K, total = shape
    problem = cached_problem(tuple(rows), N, K, total)
    a, a_sf, b, b_sf, m_indices = [to_torch(v, device) for v in problem]
    b, b_sf = deepgemm.prepare_weights(b, b_sf)
    out_dg = deepgemm.grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices)
    err_dg = check_gemm(out_dg, problem, f"DeepGEMM {shape}")
    out_dg2 = deepgemm.grouped_gemm_fp8(a, deepgemm.prepare_activation_scales(a_sf), b, b_sf, m_indices)
    real = torch.from_numpy(problem[4] >= 0).to(device)
    assert torch.equal(out_dg[real], out_dg2[real]), "MN-major activation scales changed DeepGEMM's result"
    out_tr = triton_large.grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices)
    err_tr = check_gemm(out_tr, problem, f"Triton {shape}")
    diff = float((out_dg[real].float() - out_tr[real].float()).norm() / out_dg[real].float().norm())
    assert diff <= 1e-2, f"DeepGEMM vs Triton: relative difference {diff:.3e}"
    print(f"{shape}: DeepGEMM {err_dg:.2e}, Triton {err_tr:.2e}, DeepGEMM vs Triton {diff:.2e}")


def test_deepgemm_status_reports(device):
    from symmring.moe.engines.deepgemm import deepgemm_status
    ok, reason = deepgemm_status(probe=not INTERPRET)
    assert isinstance(ok, bool) and reason
    print(f"deepgemm_status: ok={ok}: {reason}")
