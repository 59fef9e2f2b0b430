"""The small-batch fp8 kernels (symmring.moe.engines.triton_small) against the float64 reference and against themselves.

Runs where tests/gpu/test_fp8_kernels.py runs (a CUDA GPU of compute capability >= 8.9, or the CPU under
``TRITON_INTERPRET=1`` with smaller shapes and fewer configurations; the same exact-cast fixture)::

    TRITON_INTERPRET=1 python -m pytest tests/gpu/test_fp8_small.py -q

* the swap-AB grouped GEMM, several configurations, vs the float64 reference over real rows (<= 1e-2, like
  the large-group GEMM) on layouts with groups of 1 .. BLOCK_T + 1 rows (a group over several row tiles),
  empty groups, empty 128-row blocks and trailing padding; padding rows (garbage, NaN scales) never
  written; the ``rows_per_group`` bound visits only the first row tiles of each block;
* the fused L1 + SwiGLU + quantise: q and q_sf bitwise the small GEMM's bf16 output through
  `triton_large.swiglu_quant_fp8` on every real row, and near the float64 model of the same recipe;
* position independence: the same rows placed at other pool positions (another group slot, another row
  of the tile, other rows beside them) give bitwise the same output rows, for both kernels;
* split-K (``split_k > 1``, in the configurations above too): within the same tolerance of the float64
  reference as unsplit, for 2 .. 8 splits and uneven K ranges; two launches reusing the counters give the
  same bits and leave every counter at zero; on the GPU also CUDA graph replays (the capture arena, and a
  capture with no arena) and overlapping launches on two streams;
* bad arguments -> ConfigError; `Fp8Experts` picks the small path by ``rows_per_expert`` and its
  ``small_rows`` threshold, and both paths agree with the reference.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from test_fp8_kernels import (E4M3, INTERPRET, SENTINEL, _skip_reason, check_gemm, device,  # noqa: F401
                              exact_interpreter_casts, first_difference, make_gemm_problem, to_numpy, to_torch)

import torch  # noqa: E402  (test_fp8_kernels skipped the module already where torch is missing)

from symmring.errors import ConfigError  # noqa: E402
from symmring.moe.engines import triton_heuristics, triton_large  # noqa: E402
from symmring.moe.engines import triton_small  # noqa: E402
from symmring.moe.fp8_reference import grouped_gemm_fp8_reference, swiglu_quant_reference  # noqa: E402
from symmring.moe.quant import BF16_DTYPE  # noqa: E402

pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

SmallConfig = triton_heuristics.SmallConfig
INTERPRETER_CONFIGS = [SmallConfig(128, 16, 4, 2), SmallConfig(64, 32, 4, 3, tma=False), SmallConfig(64, 64, 4, 2),
                       SmallConfig(128, 16, 4, 2, split_k=2), SmallConfig(64, 32, 4, 2, tma=False, split_k=3)]
GPU_CONFIGS = [SmallConfig(n, t, w, s) for n in (64, 128) for t in (16, 32, 64) for w in (4, 8) for s in (3, 6)]
GPU_SPLIT_CONFIGS = [SmallConfig(n, t, 4, s, split_k=k) for n in (64, 128) for t in (16, 64)
                     for s, k in ((4, 2), (3, 3), (4, 4))] + [SmallConfig(128, 32, 4, 4, tma=False, split_k=2)]
CONFIGS = INTERPRETER_CONFIGS if INTERPRET else (GPU_CONFIGS + [SmallConfig(128, 32, 4, 4, tma=False)]
                                                 + GPU_SPLIT_CONFIGS)
# (rows per group, N, K, total rows): 1 .. 65 rows per group (17 and 33 and 65 span two row tiles of a
# 16-, 32- or 64-row tile), empty groups, empty trailing blocks.
SHAPES_SMALL = [
    ([1, 0, 17, 3, 64], 256, 256, 1024),
    ([33, 2, 0, 65], 128, 384, 640),
]
SHAPES_GPU = SHAPES_SMALL + [
    ([1, 5, 0, 16, 31, 32, 48, 64, 1, 0, 2, 7], 2048, 2048, 2048),
    ([1, 1], 4096, 7168, 256),
]
SHAPES = SHAPES_SMALL if INTERPRET else SHAPES_GPU


def _args(problem, dev):
    return [to_torch(v, dev) for v in problem]


def _skip_split_over(config, K):
    """More splits than K blocks is a ConfigError (test_small_errors): such a pair has nothing to run."""
    if config.split_k > K // 128:
        pytest.skip(f"{config.name}: split_k {config.split_k} > {K // 128} K blocks")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"G{len(s[0])}-N{s[1]}-K{s[2]}")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_small_gemm_matches_reference(config, shape, device):
    rows, N, K, total = shape
    _skip_split_over(config, K)
    problem = make_gemm_problem(rows, N, K, total)
    m_indices = problem[4]
    out = torch.full((len(m_indices), N), SENTINEL, dtype=torch.bfloat16, device=device)
    triton_small.grouped_gemm_fp8_small(*_args(problem, device), out=out, rows_per_group=max(rows), config=config)
    err = check_gemm(out, problem, f"{config.name} {shape}")
    got = to_numpy(out).astype(np.float32)
    assert np.all(got[m_indices < 0] == SENTINEL), f"{config.name}: a padding row was written"
    print(f"{config.name} {shape}: relative error {err:.2e}")


def test_small_gemm_bound_and_default_config(device):
    rows = [20, 0, 1, 9]
    problem = make_gemm_problem(rows, 256, 256, 768)
    args = _args(problem, device)
    full = triton_small.grouped_gemm_fp8_small(*args)  # every tile, default config (row tile 64)
    check_gemm(full, problem, "no bound")
    real = torch.from_numpy(problem[4] >= 0).to(device)
    cfg = SmallConfig(128, 16, 4, 2)
    # A bound that holds: the same rows (the same configuration computes them the same way).
    a = triton_small.grouped_gemm_fp8_small(*args, rows_per_group=20, config=cfg)
    b = triton_small.grouped_gemm_fp8_small(*args, rows_per_group=128, config=cfg)
    c = triton_small.grouped_gemm_fp8_small(*args, config=cfg)
    assert torch.equal(a[real], b[real]) and torch.equal(a[real], c[real])
    # A bound that does not hold leaves the rows past it unwritten (the contract: the bound must hold).
    out = torch.full_like(a, SENTINEL)
    triton_small.grouped_gemm_fp8_small(*args, out=out, rows_per_group=16, config=cfg)
    assert torch.equal(out[:16], a[:16]) and bool((out[16:20].float() == SENTINEL).all())


def _tiles_with(mask, block_t, tiles_per_block, n_tiles, split_k):
    """Programs of a small kernel whose tile's first row lies in ``mask`` (each reads the group there)."""
    firsts = [blk * 128 + sub * block_t for blk in range(-(-len(mask) // 128)) for sub in range(tiles_per_block)]
    return sum(bool(mask[r]) for r in firsts if r < len(mask)) * n_tiles * split_k


@pytest.mark.parametrize("bad", [-5, 9], ids=["below-padding", "past-G"])
@pytest.mark.parametrize("config", [INTERPRETER_CONFIGS[0], INTERPRETER_CONFIGS[3]], ids=lambda c: c.name)
def test_small_kernels_skip_and_report_bad_group_ids(bad, config, device):
    """Both small kernels skip the tiles whose first row names a group outside [-1, G) (G = 5 here): no weight
    read past ``b``, the rows keep what they held, every other row is bitwise the clean layout's, and
    ``bad_groups`` counts every skipped program (each split of a tile reads the group) and keeps the id."""
    rows, N, K, total = [1, 0, 17, 3, 64], 256, 256, 1024
    problem = make_gemm_problem(rows, N, K, total)
    a, a_sf, b, b_sf, m_indices = _args(problem, device)
    corrupt = problem[4].copy()
    hit = corrupt == 2
    corrupt[hit] = bad
    bad_m = to_torch(corrupt, device)
    keep = torch.from_numpy(~hit & (problem[4] >= 0)).to(device)
    per_block = 128 // config.block_t
    clean = triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_indices, config=config)
    report = torch.zeros(2, dtype=torch.int32, device=device)
    out = torch.full_like(clean, SENTINEL)
    triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, bad_m, out=out, config=config, bad_groups=report)
    assert np.all(to_numpy(out).astype(np.float32)[hit] == SENTINEL), f"{config.name}: a row of group {bad} written"
    assert torch.equal(out[keep], clean[keep]), f"{config.name}: a good row changed"
    want = _tiles_with(hit, config.block_t, per_block, -(-N // config.block_n), config.split_k)
    assert want > 0 and report.tolist() == [want, bad], (report.tolist(), want)
    inter = N // 2
    q_clean, sf_clean = triton_small.grouped_gemm_swiglu_quant_fp8_small(a, a_sf, b, b_sf, m_indices,
                                                                         config=dataclasses.replace(config, block_n=128))
    report.zero_()
    q, sf = triton_small.grouped_gemm_swiglu_quant_fp8_small(a, a_sf, b, b_sf, bad_m, bad_groups=report,
                                                             config=dataclasses.replace(config, block_n=128))
    assert torch.equal(q[keep].view(torch.uint8), q_clean[keep].view(torch.uint8)) and torch.equal(sf[keep],
                                                                                                     sf_clean[keep])
    want = _tiles_with(hit, config.block_t, per_block, -(-inter // 128), config.split_k)
    assert report.tolist() == [want, bad], (report.tolist(), want)
    _sync(device)
    _counters_zero("after skipped split tiles")


def _fused_problem(rows, inter, K, total, seed=7):
    a_q, a_sf, b_q, b_sf, m_indices = make_gemm_problem(rows, 2 * inter, K, total, seed=seed)
    return a_q, a_sf, b_q, b_sf, m_indices


# The fused kernel stages two weight tiles (gate and up) per step: only the configurations whose pipeline
# fits the SM's shared memory (triton_heuristics.small_configs applies the same rule).
FUSED_CONFIGS = [c for c in CONFIGS if c.block_n == 128 and c.smem_bytes(True) <= 200 * 1024]
FUSED_SHAPES = [([1, 0, 17, 3, 64], 128, 256, 1024), ([33, 2, 0, 65], 256, 128, 640)]
if not INTERPRET:  # K blocks for every split configuration
    FUSED_SHAPES.append(([1, 5, 0, 2], 256, 2048, 512))


@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: f"G{len(s[0])}-I{s[1]}-K{s[2]}")
@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=lambda c: c.name)
def test_fused_l1_bitwise_small_gemm_then_swiglu_quant(config, shape, device):
    rows, inter, K, total = shape
    _skip_split_over(config, K)
    problem = _fused_problem(rows, inter, K, total)
    a, a_sf, b, b_sf, m_idx = _args(problem, device)
    real = problem[4] >= 0
    q, q_sf = triton_small.grouped_gemm_swiglu_quant_fp8_small(a, a_sf, b, b_sf, m_idx, rows_per_group=max(rows),
                                                            config=config)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (total, inter)
    assert tuple(q_sf.shape) == (total, inter // 128) and q_sf.stride(0) == 1  # MN-major, as L2 reads it
    h = triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_idx, rows_per_group=max(rows), config=config)
    q_ref, sf_ref = triton_large.swiglu_quant_fp8(h, m_idx, sf_mn_major=True)
    for name, got, want in (("q", q, q_ref), ("q_sf", q_sf, sf_ref)):
        diff = first_difference(name, to_numpy(got)[real], to_numpy(want)[real])
        assert diff is None, f"{config.name}: fused != small GEMM + swiglu_quant_fp8: {diff}"
    # And the recipe against float64: L1 rounded to bf16, SwiGLU + quantise, dequantised.
    h_ref = grouped_gemm_fp8_reference(*problem).astype(np.float32).astype(BF16_DTYPE)
    q64, sf64 = swiglu_quant_reference(h_ref[real])
    deq = lambda qq, ss: qq.astype(np.float64) * np.repeat(ss.astype(np.float64), 128, axis=1)  # noqa: E731
    got = deq(to_numpy(q)[real], to_numpy(q_sf)[real])
    want = deq(q64, sf64)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert err <= 2e-2, f"{config.name}: fused L1 vs the float64 recipe: {err:.3e}"


def _relocated(problem, slot_rows, seed):
    """The first group's rows of ``problem`` (in its group 0) placed, with other random rows beside them, at
    another pool position: group slot 2 (its weights copied there), after ``slot_rows`` other rows of that
    group. Returns the new problem and the new rows' indices."""
    a_q, a_sf, b_q, b_sf, m_indices = problem
    n0 = int((m_indices == 0).sum())
    other = make_gemm_problem([slot_rows + n0 + 3, 4, 1], b_q.shape[1], a_q.shape[1], 768, seed=seed)
    a2, sf2, b2, bsf2, m2 = (x.copy() for x in other)
    # group 1 of the new problem at rows 128.., group 2 at 256..: put the rows into group 0's block
    start = slot_rows
    a2.view(np.uint8)[start:start + n0] = a_q.view(np.uint8)[:n0]
    sf2[start:start + n0] = a_sf[:n0]
    b2.view(np.uint8)[0] = b_q.view(np.uint8)[0]
    bsf2[0] = b_sf[0]
    return (a2, sf2, b2, bsf2, m2), np.arange(start, start + n0)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.block_n == 128 and c.split_k == 1][:2]
                         + [c for c in CONFIGS if c.block_n == 128 and c.split_k > 1][:1], ids=lambda c: c.name)
def test_row_results_independent_of_position(config, device):
    inter, K = 128, 256
    base = make_gemm_problem([5, 2], 2 * inter, K, 256, seed=11)
    args = _args(base, device)
    out0 = triton_small.grouped_gemm_fp8_small(*args, config=config)[:5]
    q0, sf0 = triton_small.grouped_gemm_swiglu_quant_fp8_small(*args, config=config)
    for slot_rows, seed in ((9, 1), (config.block_t - 2, 2), (40, 3)):
        moved, rows = _relocated(base, slot_rows, seed)
        margs = _args(moved, device)
        out1 = triton_small.grouped_gemm_fp8_small(*margs, config=config)[rows]
        assert torch.equal(out0, out1), f"{config.name}: GEMM rows changed when placed at row {slot_rows}"
        q1, sf1 = triton_small.grouped_gemm_swiglu_quant_fp8_small(*margs, config=config)
        assert torch.equal(q0[:5].view(torch.uint8), q1[rows].view(torch.uint8)), \
            f"{config.name}: fused q rows changed when placed at row {slot_rows}"
        assert torch.equal(sf0[:5], sf1[rows]), f"{config.name}: fused q_sf rows changed at row {slot_rows}"


def test_small_errors(device):
    problem = make_gemm_problem([3, 1], 256, 256, 256)
    a, a_sf, b, b_sf, m_idx = _args(problem, device)
    with pytest.raises(ConfigError, match="a:"):
        triton_small.grouped_gemm_fp8_small(a.float(), a_sf, b, b_sf, m_idx)
    with pytest.raises(ConfigError, match="b_sf"):
        triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf[:, :1], m_idx)
    with pytest.raises(ConfigError, match="m_indices"):
        triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_idx.long())
    with pytest.raises(ConfigError, match="out"):
        triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_idx, out=torch.empty(3, 3, device=device))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="rows_per_group"):
            triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_idx, rows_per_group=bad)
    with pytest.raises(ConfigError, match="config"):
        triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_idx, config=triton_heuristics.GemmConfig())
    with pytest.raises(ConfigError, match="block_n"):
        triton_small.grouped_gemm_swiglu_quant_fp8_small(a, a_sf, b, b_sf, m_idx, config=SmallConfig(64, 16))
    with pytest.raises(ConfigError, match="2 \\* I"):
        triton_small.grouped_gemm_swiglu_quant_fp8_small(a, a_sf, b[:, :128], b_sf[:, :1], m_idx)
    for kwargs in ({"block_n": 32}, {"block_t": 8}, {"num_warps": 2}, {"num_stages": 0}):
        with pytest.raises(ConfigError):
            SmallConfig(**kwargs)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ConfigError, match="split_k"):
            SmallConfig(split_k=bad)
    # K = 256 is 2 K blocks: 3 splits is an error, not clamped (the configuration names what runs).
    with pytest.raises(ConfigError, match="split_k=3: more splits than K blocks"):
        triton_small.grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_idx, config=SmallConfig(128, 16, split_k=3))
    with pytest.raises(ConfigError, match="split_k=3"):
        triton_small.grouped_gemm_swiglu_quant_fp8_small(a, a_sf, b, b_sf, m_idx,
                                                         config=SmallConfig(128, 16, split_k=3))
    assert SmallConfig(128, 16, 4, 4).name == "n128t16w4s4" and SmallConfig(64, 16, split_k=2).name == "n64t16w4s4k2"
    empty = triton_small.grouped_gemm_fp8_small(a[:0], a_sf[:0], b, b_sf, m_idx[:0])
    assert tuple(empty.shape) == (0, 256)


def test_fp8_experts_small_path(device):
    """Fp8Experts: rows_per_expert <= small_rows takes the small kernels, else the large-group path; both
    agree with the float64 model of the same recipe, and small_rows=0 disables the small path."""
    from symmring.moe.engines.fp8 import Fp8Experts
    from symmring.moe.engines import Pool
    from symmring.moe.weights import ExpertWeights
    inter, hidden, rows = 128, 256, [3, 0, 1, 5]
    a_q, a_sf, w13, w13_sf, m_indices = make_gemm_problem(rows, 2 * inter, hidden, 640, seed=3)
    _, _, w_down, w_down_sf, _ = make_gemm_problem(rows, hidden, inter, 640, seed=4)
    weights = ExpertWeights(dtype="fp8", w13=to_torch(w13, device), w_down=to_torch(w_down, device),
                            w13_scale=to_torch(w13_sf, device), w_down_scale=to_torch(w_down_sf, device))
    pool = Pool(x=to_torch(a_q, device), x_sf=to_torch(a_sf, device), group_end=None,
                m_indices=to_torch(m_indices, device))
    real = m_indices >= 0
    calls = []
    small = Fp8Experts(weights, "builtin", small_rows=8)
    large = Fp8Experts(weights, "builtin", small_rows=0)
    original = triton_small.grouped_gemm_swiglu_quant_fp8_small
    try:
        triton_small.grouped_gemm_swiglu_quant_fp8_small = lambda *a, **k: calls.append(k) or original(*a, **k)
        y_small = small.forward(pool, 640, rows_per_expert=5)
        assert len(calls) == 1 and calls[0]["rows_per_group"] == 5
        y_large = large.forward(pool, 640, rows_per_expert=5)
        y_none = small.forward(pool, 640)
        y_over = small.forward(pool, 640, rows_per_expert=9)
        assert len(calls) == 1, "the small path ran where it should not"
    finally:
        triton_small.grouped_gemm_swiglu_quant_fp8_small = original
    assert torch.equal(y_large[torch.from_numpy(real)], y_none[torch.from_numpy(real)])
    assert torch.equal(y_large[torch.from_numpy(real)], y_over[torch.from_numpy(real)])
    # The float64 model of the recipe: L1 (bf16), SwiGLU + 1x128 quantisation, L2.
    h = grouped_gemm_fp8_reference(a_q, a_sf, w13, w13_sf, m_indices).astype(np.float32).astype(BF16_DTYPE)
    q, q_sf = swiglu_quant_reference(h, m_indices)
    want = grouped_gemm_fp8_reference(q, q_sf, w_down, w_down_sf, m_indices)[real]
    for name, y in (("small", y_small), ("large", y_large)):
        got = to_numpy(y).astype(np.float64)[real]
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert err <= 1e-2, f"{name} path vs the float64 model: {err:.3e}"
    with pytest.raises(ConfigError, match="small_rows"):
        Fp8Experts(weights, "builtin", small_rows=-1)


def test_rows_across_tile_shapes(device):
    """The same rows under other row/weight tile shapes (what another window's rows_per_expert bound picks):
    bitwise equal under the interpreter (NumPy dots); on the GPU the fp8 MMA's in-block accumulation could
    depend on the instruction's shape, so a difference there warns with its size instead of failing (the
    layer promises bitwise equality only between schedules that see the same bound)."""
    import warnings
    problem = make_gemm_problem([5, 0, 12], 256, 384, 512, seed=5)
    args = _args(problem, device)
    real = torch.from_numpy(problem[4] >= 0).to(device)
    outs = {c.name: triton_small.grouped_gemm_fp8_small(*args, config=c)[real]
            for c in (SmallConfig(128, 16, 4, 2), SmallConfig(128, 64, 4, 3), SmallConfig(64, 32, 4, 2))}
    first, *others = outs.items()
    for name, out in others:
        if torch.equal(out, first[1]):
            continue
        diff = float((out.float() - first[1].float()).norm() / first[1].float().norm())
        assert not INTERPRET and diff <= 1e-2, f"{name} vs {first[0]}: {diff:.2e}"
        warnings.warn(f"triton_small: {name} and {first[0]} differ (relative {diff:.2e}): tile shape changes the "
                      f"MMA's rounding on this GPU")


# --- split-K ---------------------------------------------------------------------------------------------

SPLIT_BASE = SmallConfig(128, 16, 4, 2) if INTERPRET else SmallConfig(128, 16, 4, 4)
# K = 384 (3 blocks) under the interpreter: 2 splits of 2 + 1 blocks, 3 of one each; on the GPU K = 2048
# (16 blocks): 3 and 5 splits are uneven.
SPLIT_K_VALUES = (2, 3) if INTERPRET else (2, 3, 5, 8)
SPLIT_K_BLOCKS = 384 if INTERPRET else 2048


@pytest.mark.parametrize("split_k", SPLIT_K_VALUES)
def test_split_k_within_the_reference_tolerance(split_k, device):
    """split_k = S: the same 1e-2 bound against float64 as unsplit, close to the unsplit result (a different
    summation order, so not bitwise), padding rows never written."""
    rows, N, K = [1, 17, 0, 5], 256, SPLIT_K_BLOCKS
    problem = make_gemm_problem(rows, N, K, 512, seed=19)
    args = _args(problem, device)
    real = problem[4] >= 0
    cfg = dataclasses.replace(SPLIT_BASE, split_k=split_k)
    out = torch.full((len(real), N), SENTINEL, dtype=torch.bfloat16, device=device)
    triton_small.grouped_gemm_fp8_small(*args, out=out, rows_per_group=max(rows), config=cfg)
    err = check_gemm(out, problem, cfg.name)
    got = to_numpy(out).astype(np.float64)
    assert np.all(got[~real] == SENTINEL), f"{cfg.name}: a padding row was written"
    unsplit = to_numpy(triton_small.grouped_gemm_fp8_small(*args, rows_per_group=max(rows), config=SPLIT_BASE))
    unsplit = unsplit.astype(np.float64)[real]
    diff = float(np.linalg.norm(got[real] - unsplit) / np.linalg.norm(unsplit))
    assert diff <= 1e-2, f"{cfg.name} vs {SPLIT_BASE.name}: {diff:.2e}"
    print(f"{cfg.name}: relative error {err:.2e}, vs unsplit {diff:.2e}")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _counters_zero(what):
    for buf in triton_small.split_counter_buffers():
        assert not bool(buf.any()), f"{what}: a split-K counter left non-zero ({int(buf.count_nonzero())} of them)"


def test_split_k_repeat_launches_bitwise_and_counters_zero(device):
    """Consecutive launches on one stream reuse the counters (no new buffer), give the same bits, and leave
    every counter at 0 (the last arrival resets its tile's), for both kernels."""
    problem = make_gemm_problem([3, 0, 9], 256, 384, 512, seed=13)
    args = _args(problem, device)
    real = torch.from_numpy(problem[4] >= 0).to(device)
    for split_k in (2, 3):
        cfg = dataclasses.replace(SPLIT_BASE, split_k=split_k)
        out1 = triton_small.grouped_gemm_fp8_small(*args, config=cfg)
        q1, sf1 = triton_small.grouped_gemm_swiglu_quant_fp8_small(*args, config=cfg)
        _sync(device)
        _counters_zero(f"{cfg.name} first launches")
        buffers = [b.data_ptr() for b in triton_small.split_counter_buffers()]
        out2 = triton_small.grouped_gemm_fp8_small(*args, config=cfg)
        q2, sf2 = triton_small.grouped_gemm_swiglu_quant_fp8_small(*args, config=cfg)
        _sync(device)
        _counters_zero(f"{cfg.name} second launches")
        assert [b.data_ptr() for b in triton_small.split_counter_buffers()] == buffers, "the counters were not reused"
        assert torch.equal(out1[real], out2[real]), f"{cfg.name}: GEMM differs between launches"
        assert torch.equal(q1[real].view(torch.uint8), q2[real].view(torch.uint8)), f"{cfg.name}: fused q differs"
        assert torch.equal(sf1[real], sf2[real]), f"{cfg.name}: fused q_sf differs"


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and streams: GPU only")
def test_split_k_graph_replays_and_streams(device, monkeypatch):
    """Split launches captured into CUDA graphs (counters from the capture arena; then, with no arena, the
    capture's own zeroed counters) replay bitwise the eager result and leave the counters zero; eager
    launches overlapping on two streams (a buffer each) give the same bits."""
    problem = make_gemm_problem([3, 0, 9, 64], 256, 2048, 640, seed=17)
    args = _args(problem, device)
    real = torch.from_numpy(problem[4] >= 0).to(device)
    cfg = dataclasses.replace(SPLIT_BASE, split_k=4)
    want = triton_small.grouped_gemm_fp8_small(*args, config=cfg)[real]
    q_want, sf_want = (t[real] for t in triton_small.grouped_gemm_swiglu_quant_fp8_small(*args, config=cfg))
    torch.cuda.synchronize()
    for fresh in (False, True):
        if fresh:  # no eager split launch since: no arena, the capture zeroes its own (a memset node)
            monkeypatch.setattr(triton_small, "_split_counters", triton_small._SplitCounters())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = triton_small.grouped_gemm_fp8_small(*args, config=cfg)
            q, sf = triton_small.grouped_gemm_swiglu_quant_fp8_small(*args, config=cfg)
        for replay in range(3):
            out.fill_(SENTINEL)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out[real], want), f"fresh={fresh} replay {replay}: GEMM != eager"
            assert torch.equal(q[real].view(torch.uint8), q_want.view(torch.uint8)), f"replay {replay}: q != eager"
            assert torch.equal(sf[real], sf_want), f"fresh={fresh} replay {replay}: q_sf != eager"
            if not fresh:  # fresh: the capture's own counters, zeroed by its memset node at every replay
                _counters_zero(f"replay {replay}")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(4):
        for s in streams:
            with torch.cuda.stream(s):
                outs.append(triton_small.grouped_gemm_fp8_small(*args, config=cfg))
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        assert torch.equal(o[real], want), f"launch {i} on stream {i % 2} != the one-stream result"
    _counters_zero("two streams")


def _integer_problem(rows, N, K, total, seed):
    """Weights and activations of small integers (-2..2: every 128-long dot product is an exact float32
    integer, whatever the order of its sum) with random float32 scales: the kernel's result is then fixed
    by the documented promotion and split reduction alone, which `_split_model` evaluates.

    Every K block repeats block 0's values; block ``K / 256`` has them negated, and it and block 0 carry the
    same scales times 2**24: two partials cancel exactly in split order, and any other grouping or order of
    the sum (where they fall into different splits) loses the small blocks to rounding, visibly in bf16."""
    from symmring.moe.fp8_reference import make_contiguous_layout
    rng = np.random.default_rng(seed)
    m_indices, _ = make_contiguous_layout(rows, total_rows=total)
    M, G, k_blocks = len(m_indices), len(rows), K // 128
    neg = k_blocks // 2
    a_q = np.tile(rng.integers(-2, 3, (M, 128)).astype(np.float32), (1, k_blocks)).astype(E4M3)
    b_q = np.tile(rng.integers(-2, 3, (G, N, 128)).astype(np.float32), (1, 1, k_blocks))
    b_q[..., neg * 128:(neg + 1) * 128] *= -1
    b_q = b_q.astype(E4M3)
    a_sf = rng.uniform(0.01, 2.0, (M, k_blocks)).astype(np.float32)
    b_sf = rng.uniform(0.01, 2.0, (G, -(-N // 128), k_blocks)).astype(np.float32)
    a_sf[:, 0] *= np.float32(2.0 ** 24)
    a_sf[:, neg] = a_sf[:, 0]
    b_sf[..., neg] = b_sf[..., 0]
    return a_q, a_sf, b_q, b_sf, m_indices


def _fma32(x, y, z):
    """float32 ``fma(x, y, z)`` (one rounding) of float32 arrays whose product ``x * y`` is exact in float64;
    fails if the float64 sum's rounding could make a float32 tie (the model would then be ambiguous)."""
    p = x.astype(np.float64) * y.astype(np.float64)
    z64 = z.astype(np.float64)
    t = p + z64
    b = t - p
    err = (p - (t - b)) + (z64 - b)  # TwoSum: t + err == p + z exactly
    r = t.astype(np.float32)
    other = np.nextafter(r, np.where(t > r, np.float32(np.inf), np.float32(-np.inf))).astype(np.float32)
    tie = (err != 0) & (t == (r.astype(np.float64) + other.astype(np.float64)) / 2)
    assert not tie.any(), "the float64 model of fma is ambiguous here: change the test data"
    return r


def _split_model(problem, split_k, fused_fma):
    """The module notes' arithmetic in NumPy: per split, ``acc = fma(block, a_sf * b_sf, acc)`` from 0 over its
    K blocks (split s: q + (s < r) blocks from s * q + min(s, r)); then ((p0 + p1) + p2) ... in float32,
    rounded to bf16. ``fused_fma``: a true fma (the GPU's fma.rn.f32); else the interpreter's, which rounds
    the product first. Returns bf16 [M, N] (padding rows 0)."""
    a_q, a_sf, b_q, b_sf, m_indices = problem
    M, K = a_q.shape
    N = b_q.shape[1]
    k_blocks = K // 128
    q, r = divmod(k_blocks, split_k)
    bounds = [(s * q + min(s, r), s * q + min(s, r) + q + (s < r)) for s in range(split_k)]
    assert bounds[-1][1] == k_blocks
    out = np.zeros((M, N), np.float32)
    a64 = a_q.astype(np.float64).reshape(M, k_blocks, 128)
    b64 = b_q.astype(np.float64).reshape(b_q.shape[0], N, k_blocks, 128)
    for g in range(b_q.shape[0]):
        rows = np.flatnonzero(m_indices == g)
        if not rows.size:
            continue
        dots = np.einsum("rkc,nkc->rnk", a64[rows], b64[g]).astype(np.float32)  # exact integers
        scale = a_sf[rows][:, None, :] * np.repeat(b_sf[g], 128, axis=0)[:N][None, :, :]  # float32 products
        total = None
        for begin, end in bounds:
            acc = np.zeros((len(rows), N), np.float32)
            for kb in range(begin, end):
                if fused_fma:
                    acc = _fma32(dots[..., kb], scale[..., kb], acc)
                else:
                    acc = dots[..., kb] * scale[..., kb] + acc
            total = acc if total is None else total + acc
        out[rows] = total
    return out.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("split_k", (1, 2, 3) if INTERPRET else (1, 2, 3, 4, 5))
def test_split_k_arithmetic_is_the_documented_sum(split_k, device):
    """With exact block sums the GEMM is bitwise the documented arithmetic: the promotion's fma per K block,
    the split ranges fixed by (K, split_k), the partials added in split order."""
    rows, N = [3, 0, 20], 256
    K = 384 if INTERPRET else 768  # 3 or 6 K blocks: uneven splits among them
    problem = _integer_problem(rows, N, K, 512, seed=23)
    cfg = dataclasses.replace(SPLIT_BASE, split_k=split_k)
    out = triton_small.grouped_gemm_fp8_small(*_args(problem, device), config=cfg)
    real = problem[4] >= 0
    want = _split_model(problem, split_k, fused_fma=not INTERPRET)
    diff = first_difference(cfg.name, to_numpy(out)[real], want[real])
    assert diff is None, f"{cfg.name} != the documented split-K arithmetic: {diff}"
