"""The ``"fused"`` engine (device/moe/fused_experts.cu, docs/FUSED.md) on the GPU.

* At the seam, for each kernel (``m16``, ``m32``: mma.sync; ``wg64``: wgmma, cc 9.0 only; ``wg64t``: wg64 with
  TMA loads by a producer warpgroup, and ``wg128t``, the same with 128-row items, cc 9.0 only; forced with
  ``kernel=``, and ``auto``: wg64t on cc 9.0), on pools laid out
  as the fp8 dispatch writes them (groups at multiples of 128 rows, MN-major scales, ``m_indices``), DeepSeek-V3-like (hidden 7168, inter 2048, 256 experts, top-8; 1 to 2048
  tokens: up to 64 rows per expert), Qwen3-30B-A3B-like (2048, 768, 128, top-8; 1 to 4096 tokens: up to 256)
  and a tiny shape (256, 256, 16, top-2), all experts on this PE: the fused output vs the float64 model of the
  same quantised values (L1 rounded to bf16, SwiGLU quantised 1x128 to fp8) and vs the ``"builtin"`` engine on
  the same pool, relative error <= 1e-2 (as tests/gpu/test_moe_fp8.py); run to run bitwise; without a
  rows-per-expert bound (every m block of each 128-row group listed, not only those the bound can fill) within
  the same error, and the same bits where the same kernel runs; the same bits with
  an SM budget of 1 and 3 blocks (a block never needs another resident) on the pass's first 128-row group
  (the whole pass on one SM would read every expert's weights through one SM: minutes at DeepSeek-V3 sizes; an
  item computes the same bits whatever the pass's length); nothing recorded in the engine's status.
* ``wg64t`` and ``wg128t`` against ``wg64`` and ``"builtin"`` on every seam case: the same bits (the same wgmma
  streams, promotion and epilogues per element; only the loads and the items' rows differ); wg128t with a pass
  ending 64 rows into its last group.
* The wgmma kernel's call-free division (device/moe/fused_div.cuh) against torch's float32 division, bit for bit.
* A pool row group naming an expert outside ``[-1, E)`` is skipped and reported in ``bad_groups`` (``m32``,
  ``wg64t``, ``wg128t``).
* In the layer (every PE of the session): ``MoE(engine="fused")`` vs ``engine="builtin"`` and the NumPy float64
  reference on the tiny and the Qwen3-like shapes, and a CUDA graph replay bitwise equal to the eager call
  (``SYMMRING_FUSED_KERNEL`` ``m32``, ``wg64t``, ``wg128t``); the layer's ``check_errors`` raises what the
  kernel recorded.

Run: ``python -m pytest tests/gpu/test_fused_engine.py -q`` (1 PE; ``-k wg64`` for the wgmma kernels alone,
``-k wg64t`` for the TMA one), and
with 2 PEs
``python -m symmring.launch --mps -n 2 -- python -m mpi4py -m pytest tests/gpu/test_fused_engine.py -q``.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason
pytest.importorskip("triton", reason="the builtin engine it is compared with needs Triton")

from moe_helpers import cuda_device, make_tokens, to_torch, verdict  # noqa: E402

from symmring.errors import BackendError  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig  # noqa: E402
from symmring.moe.engines import Pool  # noqa: E402
from symmring.moe.engines.fp8 import Fp8Experts  # noqa: E402
from symmring.moe.engines.fused import FusedExperts, blocks_per_group, select_kernel  # noqa: E402
from symmring.moe.engines.fused import KERNELS as ROWS_PER_ITEM  # noqa: E402
from symmring.moe.gpu import MoE, kernel_args, stages  # noqa: E402
from symmring.moe.reference import reference_moe  # noqa: E402
from symmring.moe.weights import ExpertWeights, dequantize_blocks, quantize_blocks  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261208))
REL_TOL = 1e-2
#: hidden, inter, experts, top-k.
SHAPES = {"deepseek-v3": (7168, 2048, 256, 8), "qwen3-30b-a3b": (2048, 768, 128, 8), "tiny": (256, 256, 16, 2)}
TOKENS = (1, 8, 64, 512)
#: Token counts of the seam test per shape: into the rows per expert where the mma.sync kernels need two m blocks.
SEAM_TOKENS = {"deepseek-v3": TOKENS + (2048,), "qwen3-30b-a3b": TOKENS + (4096,), "tiny": TOKENS}
#: The kernels the seam test forces (``"auto"``: the engine's pick).
KERNELS = ("m16", "m32", "wg64", "wg64t", "wg128t", "auto")
#: The kernels built for sm_90a: cc 9.0 only.
WGMMA_KERNELS = ("wg64", "wg64t", "wg128t")
ALIGN = 128
#: Pool rows of the SM budget runs: the first 128-row group (one expert: its L2 items still wait for its L1 items,
#: and one SM reads that expert's weights once per m block, seconds at DeepSeek-V3 sizes for 16-row items).
BUDGET_ROWS = ALIGN


def fp8_weights(hidden, inter, num_experts, seed) -> ExpertWeights:
    """Random experts quantised to 128x128-block fp8 on the GPU, one expert at a time (bounded memory)."""
    dev = cuda_device()
    gen = torch.Generator(device=dev).manual_seed(seed)
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn, device=dev)
    w_down = torch.empty(num_experts, hidden, inter, dtype=torch.float8_e4m3fn, device=dev)
    s13 = torch.empty(num_experts, 2 * inter // 128, hidden // 128, device=dev)
    s_down = torch.empty(num_experts, hidden // 128, inter // 128, device=dev)
    for e in range(num_experts):
        w13[e], s13[e] = (t[0] for t in quantize_blocks(
            torch.randn(1, 2 * inter, hidden, device=dev, generator=gen) / hidden ** 0.5))
        w_down[e], s_down[e] = (t[0] for t in quantize_blocks(
            torch.randn(1, hidden, inter, device=dev, generator=gen) / inter ** 0.5))
    return ExpertWeights("fp8", w13, w_down, s13, s_down)


def quantize_rows(x):
    """1x128 fp8 of float rows ``x [M, K]`` by the layer's rule: ``(q, scale [M, K / 128])``."""
    g = x.float().view(x.shape[0], -1, 128)
    amax = g.abs().amax(dim=2)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    q = (g / scale[:, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(x.shape), scale


def make_pool(hidden, num_experts, topk, num_tokens, seed):
    """A pool as the fp8 dispatch leaves it for ``num_tokens`` tokens routed to ``topk`` distinct random experts:
    ``(pool, num_rows, rows_per_expert, live [rows] bool, group of each live row)``."""
    rng = np.random.default_rng(seed)
    picks = np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(num_tokens)]).reshape(-1)
    counts = np.bincount(picks, minlength=num_experts)
    spans = -(-counts // ALIGN) * ALIGN
    begins = np.concatenate([[0], np.cumsum(spans)[:-1]])
    num_rows = int(spans.sum()) + ALIGN  # a host bound past the groups, as the plan's rows_bound
    m = np.full(num_rows, -1, np.int32)
    for e in range(num_experts):
        m[begins[e]: begins[e] + counts[e]] = e
    dev = cuda_device()
    x = to_torch(make_tokens(seed, num_rows, hidden), torch.float32, dev)
    q, scale = quantize_rows(x)
    column = -(-num_rows // 4) * 4
    sf_store = torch.zeros(hidden // 128 * column, device=dev)
    x_sf = sf_store.view(hidden // 128, column).t()[:num_rows]
    x_sf.copy_(scale)
    live = torch.from_numpy(m >= 0).to(dev)
    pool = Pool(x=q, group_end=torch.from_numpy(np.cumsum(spans).astype(np.int32)).to(dev), x_sf=x_sf,
                m_indices=torch.from_numpy(m).to(dev), bad_groups=torch.zeros(2, dtype=torch.int32, device=dev))
    return pool, num_rows, int(counts.max()), live


def reference_rows(pool, weights: ExpertWeights, live):
    """float64 expert output of the live rows: the same quantised values, L1 rounded to bf16, SwiGLU quantised."""
    inter = weights.inter
    x = pool.x.double() * pool.x_sf.double().repeat_interleave(128, dim=1)
    out = torch.zeros(x.shape[0], weights.hidden, dtype=torch.float64, device=x.device)
    for e in torch.unique(pool.m_indices[live]).tolist():
        rows = (pool.m_indices == e).nonzero().squeeze(1)
        w13 = dequantize_blocks(weights.w13[e:e + 1], weights.w13_scale[e:e + 1], torch.float64)[0]
        w_down = dequantize_blocks(weights.w_down[e:e + 1], weights.w_down_scale[e:e + 1], torch.float64)[0]
        h = (x[rows] @ w13.T).to(torch.bfloat16).double()
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        q, scale = quantize_rows(act)
        out[rows] = (q.double() * scale.double().repeat_interleave(128, dim=1)) @ w_down.T
    return out


@functools.lru_cache(maxsize=1)  # one shape's experts at a time (DeepSeek-V3-like: 11 GB)
def shape_weights(shape):
    hidden, inter, num_experts, topk = SHAPES[shape]
    return fp8_weights(hidden, inter, num_experts, SEED), topk


@functools.lru_cache(maxsize=1)  # the kernels of one case run one after the other
def seam_case(shape, num_tokens):
    """``(pool, num_rows, rows per expert, live rows, float64 reference of the live rows, builtin's live rows)``."""
    weights, topk = shape_weights(shape)
    pool, num_rows, per_expert, live = make_pool(weights.hidden, weights.num_local_experts, topk, num_tokens,
                                                 SEED + num_tokens)
    ref = reference_rows(pool, weights, live)[live]
    builtin = Fp8Experts(weights, "builtin").forward(pool, num_rows, per_expert)[live]
    return pool, num_rows, per_expert, live, ref, builtin


def rel_error_on_device(y, y_ref) -> float:
    """``||y - y_ref|| / ||y_ref||`` in float64, on the device (no host copy of large outputs)."""
    y, y_ref = y.double(), y_ref.double()
    return float(torch.linalg.vector_norm(y - y_ref) / torch.linalg.vector_norm(y_ref))


def device_cc() -> int:
    major, minor = torch.cuda.get_device_capability(cuda_device())
    return major * 10 + minor


def skip_off_sm90(kernel):
    if kernel in WGMMA_KERNELS and device_cc() != 90:
        pytest.skip(f"the wgmma kernels need compute capability 9.0 (sm_90a); this device is {device_cc()}")


SEAM_CASES = [(shape, n) for shape in sorted(SHAPES) for n in SEAM_TOKENS[shape]]


# The kernels of one case are adjacent (the first parametrize is the outer loop): the cached case serves them all.
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape, num_tokens", SEAM_CASES)
def test_fused_vs_reference_and_builtin_on_the_dispatch_pool(shape, num_tokens, kernel):
    skip_off_sm90(kernel)
    weights, _ = shape_weights(shape)
    pool, num_rows, per_expert, live, ref, builtin = seam_case(shape, num_tokens)
    fused = FusedExperts(weights, kernel=kernel)
    picked = select_kernel(per_expert, device_cc(), kernel)
    y = fused.forward(pool, num_rows, per_expert)
    again = fused.forward(pool, num_rows, per_expert)
    few = min(num_rows, BUDGET_ROWS)
    budgets = [FusedExperts(weights, sm_budget=b, kernel=kernel).forward(pool, few, per_expert) for b in (1, 3)]
    unbounded = fused.forward(pool, num_rows, None)  # no bound: every m block of each group listed
    fused.check_status()
    got = y[live]
    err_ref, err_builtin = rel_error_on_device(got, ref), rel_error_on_device(got, builtin)
    print(f"[figure] fused {kernel} ({picked}) {shape} n={num_tokens} ({int(live.sum())} rows, <= {per_expert} per "
          f"expert): vs float64 {err_ref:.3e}, vs builtin {err_builtin:.3e}")
    assert torch.isfinite(got.float()).all(), "non-finite fused output on live rows"
    assert err_ref <= REL_TOL and err_builtin <= REL_TOL, (err_ref, err_builtin)
    assert torch.equal(got, again[live]), "fused output differs run to run"
    err_unbounded = rel_error_on_device(unbounded[live], ref)
    assert err_unbounded <= REL_TOL, f"without a rows-per-expert bound: vs float64 {err_unbounded:.3e}"
    if select_kernel(None, device_cc(), kernel) == picked:  # the same kernel: the same items, so the same bits
        assert torch.equal(got, unbounded[live]), "listing every m block of a group changed the output"
    for b, other in zip((1, 3), budgets):
        assert torch.equal(y[:few][live[:few]], other[live[:few]]), f"sm_budget={b} changed the output"
    assert not pool.bad_groups.any()


@pytest.mark.parametrize("kernel", ["wg64t", "wg128t"])
@pytest.mark.parametrize("shape, num_tokens", SEAM_CASES)
def test_the_tma_kernels_give_wg64s_and_builtins_bits(shape, num_tokens, kernel):
    # wg64t computes wg64's output elements with wg64's wgmma streams, promotion and epilogues (its L2 items take two
    # output blocks where wg64's take one); only the loads (TMA by a producer warpgroup, zeros past the pass's rows
    # as cp.async's zero-fill) differ. wg128t runs the same
    # m64n64k32 streams and promotion per output element on 128-row items (the warpgroups split rows, an L1 item
    # in two 64-column passes) and takes each row's amax over the same 128 values. So the same bits; wg64 gave
    # builtin's bits on every seam case on an H100 (docs/FUSED.md), so these must too.
    skip_off_sm90(kernel)
    weights, _ = shape_weights(shape)
    pool, num_rows, per_expert, live, ref, builtin = seam_case(shape, num_tokens)
    tma, plain = FusedExperts(weights, kernel=kernel), FusedExperts(weights, kernel="wg64")
    y, y_plain = tma.forward(pool, num_rows, per_expert), plain.forward(pool, num_rows, per_expert)
    tma.check_status()
    plain.check_status()
    got = y[live]
    print(f"[figure] fused {kernel} {shape} n={num_tokens}: vs wg64 {rel_error_on_device(got, y_plain[live]):.3e}, "
          f"vs builtin {rel_error_on_device(got, builtin):.3e}")
    assert torch.equal(got, y_plain[live]), f"{kernel} differs from wg64"
    assert torch.equal(got, builtin), f"{kernel} differs from builtin"


@pytest.mark.parametrize("hidden", [384, 640])
def test_wg64t_with_an_odd_number_of_output_blocks(hidden):
    # hidden / 128 odd: wg64t's L2 items keep one output block each (no pairs) and must still give wg64's and
    # builtin's bits.
    skip_off_sm90("wg64t")
    weights = fp8_weights(hidden, 256, 8, SEED + 13)
    pool, num_rows, per_expert, live = make_pool(hidden, 8, 2, 96, SEED + 14)
    y = FusedExperts(weights, kernel="wg64t").forward(pool, num_rows, per_expert)[live]
    y_plain = FusedExperts(weights, kernel="wg64").forward(pool, num_rows, per_expert)[live]
    builtin = Fp8Experts(weights, "builtin").forward(pool, num_rows, per_expert)[live]
    ref = reference_rows(pool, weights, live)[live]
    print(f"[figure] fused wg64t hidden={hidden}: vs wg64 {rel_error_on_device(y, y_plain):.3e}, vs builtin "
          f"{rel_error_on_device(y, builtin):.3e}, vs float64 {rel_error_on_device(y, ref):.3e}")
    assert torch.equal(y, y_plain) and torch.equal(y, builtin)
    assert rel_error_on_device(y, ref) <= REL_TOL


@pytest.mark.parametrize("kernel, hidden", [("wg64", 256), ("wg64t", 256), ("wg64t", 384)])
def test_padding_rows_are_never_written_and_their_garbage_reaches_no_token(kernel, hidden, monkeypatch):
    # wg64 and wg64t store only the rows that hold tokens (fused_wgmma.cuh: live_rows). The buffers start as NaN bytes
    # here: the padding rows of the output, of the intermediate and of its scales must keep them (never written), and
    # the L2 items, which read all 64 rows of an m block's intermediate and scales, must carry that garbage into no
    # live row: those are builtin's bits. hidden 384: wg64t's single-block L2 items (no pairs). Then a pass cut
    # inside the live rows of its last group: the live rows before the cut are the same bits.
    skip_off_sm90(kernel)
    weights = fp8_weights(hidden, 256, 8, SEED + 17)
    pool, num_rows, per_expert, live = make_pool(hidden, 8, 2, 96, SEED + 18)
    assert 0 < per_expert < 64, "the m blocks must mix live and padding rows"
    builtin = Fp8Experts(weights, "builtin").forward(pool, num_rows, per_expert)
    engine = FusedExperts(weights, kernel=kernel)
    prepare, launches = engine.prepare, []

    def poisoned(*args, **kwargs):
        launch = prepare(*args, **kwargs)
        launch.out.fill_(float("nan"))
        launch.act.fill_(0xFF)  # e4m3 NaN
        launch.act_sf.fill_(float("nan"))
        launches.append(launch)
        return launch

    monkeypatch.setattr(engine, "prepare", poisoned)
    y = engine.forward(pool, num_rows, per_expert)
    engine.check_status()
    launch, dead = launches[-1], ~live[:num_rows]
    assert torch.isnan(y[dead].float()).all(), "a padding row of the output was written"
    assert bool((launch.act[dead] == 0xFF).all()), "a padding row of the intermediate was written"
    assert torch.isnan(launch.act_sf[dead]).all(), "a padding row of the intermediate's scales was written"
    assert torch.isfinite(y[live].float()).all() and torch.equal(y[live], builtin[live]), \
        f"live rows: vs builtin {rel_error_on_device(y[live], builtin[live]):.3e}"
    last = int(live.nonzero().max()) // ALIGN * ALIGN  # the last group holding rows: cut after half of its rows
    cut = last + max(1, int(live[last:last + ALIGN].sum()) // 2)
    y_cut = engine.forward(pool, cut, per_expert)
    engine.check_status()
    kept = live[:cut]
    assert torch.isnan(y_cut[~kept].float()).all() and torch.equal(y_cut[kept], builtin[:cut][kept])


@pytest.mark.parametrize("kernel", ["m32", "wg64", "wg64t", "wg128t"])
def test_l2_waits_that_expire_give_nan_tiles_counted_and_the_engine_runs_on(kernel, monkeypatch):
    # L1 arrivals that can never come (the counters start far below zero): every L2 item's bounded wait expires,
    # its tiles are NaN (no finite garbage), each is counted in the status (check_status names the count), nothing
    # stalls (the TMA kernels still issue an expired item's loads, so their ring stays aligned: no status -3), and
    # the next call gives the bits of a call before it (m32 is not bitwise builtin's: its own bits are the check).
    skip_off_sm90(kernel)
    weights = fp8_weights(256, 256, 16, SEED + 15)
    pool, num_rows, per_expert, live = make_pool(256, 16, 2, 64, SEED + 16)
    engine = FusedExperts(weights, kernel=kernel, timeout_s=0.05)
    before = engine.forward(pool, num_rows, per_expert)[live].clone()
    engine.check_status()
    assert torch.isfinite(before).all()
    prepare = engine.prepare

    def starved(*args, **kwargs):
        launch = prepare(*args, **kwargs)
        launch.counters[1:].fill_(-(1 << 20))
        return launch

    monkeypatch.setattr(engine, "prepare", starved)
    y = engine.forward(pool, num_rows, per_expert)
    torch.cuda.synchronize()
    rows = ROWS_PER_ITEM[kernel]
    per_group = blocks_per_group(per_expert, rows)
    m = pool.m_indices.cpu()
    blocks = sum(1 for g in range(-(-num_rows // 128)) for j in range(per_group)
                 if g * 128 + j * rows < num_rows and m[g * 128 + j * rows] >= 0)
    tiles = blocks * (256 // 128)
    assert torch.isnan(y[live]).all()
    with pytest.raises(BackendError, match=rf"^engine 'fused': {tiles} L2 tile\(s\) waited past 0.05 s"):
        engine.check_status()
    monkeypatch.undo()
    again = engine.forward(pool, num_rows, per_expert)[live]
    engine.check_status()
    assert torch.equal(again, before)


def test_wg128t_with_a_pass_that_ends_inside_its_last_group():
    # The pass's rows end 64 rows into the last live group: wg128t's second A box of that group lies wholly past the
    # pool map's rows (TMA fills it with zeros and must still count its bytes, or the ring stalls: status -3).
    skip_off_sm90("wg128t")
    weights = fp8_weights(256, 256, 16, SEED + 11)
    pool, num_rows, per_expert, live = make_pool(256, 16, 2, 64, SEED + 12)
    assert per_expert <= 64
    last = int(pool.m_indices[:num_rows].ge(0).nonzero().max()) // ALIGN  # the last group holding rows
    cut = last * ALIGN + 64
    y = FusedExperts(weights, kernel="wg128t")
    got = y.forward(pool, cut, per_expert)
    want = FusedExperts(weights, kernel="wg64").forward(pool, num_rows, per_expert)
    y.check_status()
    assert torch.equal(got[:cut][live[:cut]], want[:cut][live[:cut]])


def test_the_call_free_division_is_torchs_division_bit_for_bit():
    # The wgmma kernel's epilogue divides with device/moe/fused_div.cuh (no call, so ptxas keeps wgmma pipelined);
    # it must give __fdiv_rn's bits: here against torch's float32 division (IEEE, nearest even) on this GPU.
    import cupy
    from symmring.moe.engines import fused as fused_engine
    dev = cuda_device()
    gen = torch.Generator(device=dev).manual_seed(SEED)
    n = 1 << 22
    raw = torch.randint(-2 ** 31, 2 ** 31, (2, n), dtype=torch.int64, device=dev, generator=gen).to(torch.int32)
    a, b = raw.view(torch.float32)  # every class of float: NaN, infinities, denormals, zeros
    gate = (torch.randn(n, device=dev, generator=gen) * 4).to(torch.bfloat16).float()
    amax = gate.abs() * (1 + torch.rand(n, device=dev, generator=gen) * 8)
    tiny = torch.randint(0, 1 << 24, (n,), dtype=torch.int32, device=dev, generator=gen).view(torch.float32)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448)
    # any pairs; SwiGLU's gate / (1 + exp(-gate)); values / their scale; denormal numerators
    a, b = (torch.cat([a, gate, gate * torch.rand(n, device=dev, generator=gen), tiny]),
            torch.cat([b, 1 + torch.exp(-gate), scale, 1 + b.abs() % 8]))
    q = torch.empty_like(a)
    module, _ = fused_engine._module(dev.index, device_cc(), fused_engine.WGMMA_MODULE)
    probe = module.get_function("moe_fused_div_probe")
    with cupy.cuda.Device(dev.index):
        args = kernel_args.pack(kernel_args.STRUCTS["FusedDivProbeArgs"], a=a.data_ptr(), b=b.data_ptr(),
                                q=q.data_ptr(), n=a.numel())
        probe(((a.numel() + 255) // 256,), (256,), args)
        cupy.cuda.runtime.deviceSynchronize()
    want = a / b
    same = (q.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(q) & torch.isnan(want))
    first = (~same).nonzero()[:5].squeeze(1).tolist()
    assert bool(same.all()), [(a[i].item(), b[i].item(), q[i].item(), want[i].item()) for i in first]


@pytest.mark.parametrize("kernel", ["m32", "wg64t", "wg128t"])
def test_a_group_naming_no_local_expert_is_skipped_and_reported(kernel):
    skip_off_sm90(kernel)
    weights = fp8_weights(256, 256, 4, SEED + 1)
    pool, num_rows, per_expert, live = make_pool(256, 4, 2, 64, SEED + 2)
    pool.m_indices[ALIGN:2 * ALIGN] = torch.where(pool.m_indices[ALIGN:2 * ALIGN] >= 0, 9, -1)  # group 1: id 9
    engine = FusedExperts(weights, kernel=kernel)
    y = engine.forward(pool, num_rows, per_expert)
    torch.cuda.synchronize()
    engine.check_status()
    assert pool.bad_groups[0].item() >= 1 and pool.bad_groups[1].item() == 9
    assert torch.isfinite(y[:ALIGN][live[:ALIGN]].float()).all()


def _layer(ctx, engine, hidden, inter, num_experts, topk, max_tokens, seed):
    dev = cuda_device()
    rng = np.random.default_rng(seed)
    e_local = num_experts // ctx.world_size
    w = [torch.from_numpy(rng.standard_normal(s).astype(np.float32) / s[-1] ** 0.5).to(dev, torch.bfloat16)
         for s in ((num_experts, inter, hidden), (num_experts, inter, hidden), (num_experts, hidden, inter))]
    local = [t[ctx.rank * e_local:(ctx.rank + 1) * e_local] for t in w]
    moe = MoE(ctx, Experts(*local, expert_dtype="fp8"), RoutingConfig(num_experts, topk), max_tokens=max_tokens,
              engine=engine)
    return moe, [t.float().cpu().numpy() for t in w]


@pytest.mark.parametrize("shape", ["tiny", "qwen3-30b-a3b"])
@pytest.mark.parametrize("kernel", ["m32", "wg64t", "wg128t"])
def test_fused_layer_vs_builtin_and_reference(ctx, shape, kernel, monkeypatch):
    # Errors are summed over the token counts and ranks (one token's norm ratio alone varies too much for a 1e-2
    # bound, as in tests/gpu/test_moe_fp8.py); bitwise stability is checked per count.
    skip_off_sm90(kernel)
    monkeypatch.setenv("SYMMRING_FUSED_KERNEL", kernel)  # the layer's engine takes the variable
    # Every call sends its rows from the fused kernel's L2 epilogue (stages.send_rows; the small-batch schedule's
    # too): the wgmma kernels' rows are builtin's bits, so they must land bitwise where builtin's were scattered.
    sent, small_sent = [], []
    send_rows = stages.send_rows
    monkeypatch.setattr(stages, "send_rows", lambda *a: sent.append(send_rows(*a)) or sent[-1])
    hidden, inter, num_experts, topk = SHAPES[shape]
    fused, w = _layer(ctx, "fused", hidden, inter, num_experts, topk, max(TOKENS), SEED + 3)
    builtin, _ = _layer(ctx, "builtin", hidden, inter, num_experts, topk, max(TOKENS), SEED + 3)
    q = [dequantize_blocks(*quantize_blocks(torch.from_numpy(a)), torch.float32).numpy() for a in w]
    problems, sums = [], np.zeros(4)  # err^2 vs reference, reference^2, err^2 vs builtin, builtin^2
    dev = cuda_device()
    try:
        for n in TOKENS:
            x = make_tokens(SEED + n + ctx.rank, n, hidden)
            logits = np.random.default_rng(SEED + n + ctx.rank).standard_normal((n, num_experts)).astype(np.float32)
            xt, lt = to_torch(x, torch.bfloat16, dev), to_torch(logits, torch.float32, dev)
            before = len(sent)
            y, y2 = fused.forward(xt, logits=lt), fused.forward(xt, logits=lt)
            if fused.last_plan.small_batch:  # its first call runs the schedule (the graph cache captures later)
                small_sent.append(any(to is not None for to in sent[before:]))
            y_builtin = builtin.forward(xt, logits=lt)
            graph, y_static = fused.capture(xt, logits=lt)
            graph.replay()
            fused.check_errors()
            builtin.check_errors()
            fused.engine.check_status()
            if not torch.equal(y, y2) or not torch.equal(y, y_static):
                problems.append(f"n={n}: not bitwise stable (eager twice, graph replay)")
            if kernel != "m32" and not torch.equal(y, y_builtin):
                problems.append(f"n={n}: not builtin's bits")
            ref = reference_moe(x, w_gate=q[0], w_up=q[1], w_down=q[2], num_topk=topk, logits=logits,
                                expert_format="fp8").y.astype(np.float64)
            got, base = y.double().cpu().numpy(), y_builtin.double().cpu().numpy()
            sums += [np.sum((got - ref) ** 2), np.sum(ref ** 2), np.sum((got - base) ** 2), np.sum(base ** 2)]
    finally:
        fused.close()
        builtin.close()
    if ctx.world_size > 1:
        from gpu_helpers import ranks
        sums = np.array([ranks(ctx).allreduce(float(v)) for v in sums])
    err_ref, err_builtin = (sums[0] / sums[1]) ** 0.5, (sums[2] / sums[3]) ** 0.5
    print(f"[figure] fused layer {kernel} {shape}, {ctx.world_size} PE(s), tokens {TOKENS}: vs float64 {err_ref:.3e}, "
          f"vs builtin {err_builtin:.3e}")
    if not (err_ref <= REL_TOL and err_builtin <= REL_TOL):
        problems.append(f"vs float64 {err_ref:.3e}, vs builtin {err_builtin:.3e} (bound {REL_TOL})")
    if not any(to is not None for to in sent):
        problems.append(f"no call sent its rows from the kernel ({len(sent)} windows)")
    if not small_sent or not all(small_sent):
        problems.append(f"small-batch calls that sent their rows from the kernel: {small_sent}")
    verdict(ctx, not problems, f"fused {kernel} {shape}: " + "; ".join(problems))


@pytest.mark.parametrize("kernel", ["wg64t", "wg128t"])
def test_the_kernel_beside_the_dispatch_gives_the_bits_of_the_kernel_after_it(ctx, kernel, monkeypatch):
    """Small-batch calls with one PE per GPU (PDL): the TMA kernel starts beside the fused dispatch (waits for its
    plan, streams its first weights while the rows arrive) and gives bitwise the output it gives launched after
    the dispatch, eagerly and replayed from a graph. With several PEs on a GPU (no PDL) none starts beside it."""
    skip_off_sm90(kernel)
    monkeypatch.setenv("SYMMRING_FUSED_KERNEL", kernel)
    hidden, inter, num_experts, topk = SHAPES["tiny"]
    moe, _ = _layer(ctx, "fused", hidden, inter, num_experts, topk, 64, SEED + 5)
    engine, pdl = moe.engine, moe.executor.kernels.launch.enabled
    began = []
    begin = engine.begin_beside_dispatch
    monkeypatch.setattr(engine, "begin_beside_dispatch", lambda *a, **kw: began.append(begin(*a, **kw)) or began[-1])
    counts, outputs, problems = (1, 8, 64), {}, []
    dev = cuda_device()
    try:
        for beside in (True, False):
            engine.beside_dispatch = beside
            for n in counts:
                x = to_torch(make_tokens(SEED + 7 * n + ctx.rank, n, hidden), torch.bfloat16, dev)
                logits = np.random.default_rng(SEED + n + ctx.rank).standard_normal((n, num_experts)).astype(np.float32)
                lt = to_torch(logits, torch.float32, dev)
                y = moe.forward(x, logits=lt, small_batch=True, graph_cache=False)
                graph, y_static = moe.capture(x, logits=lt, small_batch=True)
                graph.replay()
                moe.check_errors()
                engine.check_status()
                outputs[beside, n] = (y.float().cpu().numpy(), y_static.float().cpu().numpy())
                del graph
            started = sum(b is not None for b in began)
            if beside and pdl and started < 2 * len(counts):  # each eager call and each capture
                problems.append(f"{started} calls started beside the dispatch, expected {2 * len(counts)}")
            if (not beside or not pdl) and started:
                problems.append(f"{started} calls started beside the dispatch with beside_dispatch={beside}, "
                                f"PDL {'on' if pdl else 'off'}")
            began.clear()
        for n in counts:
            for what, a, b in zip(("eager", "graph"), outputs[True, n], outputs[False, n]):
                if not np.array_equal(a, b, equal_nan=False) or not np.isfinite(a).all():
                    problems.append(f"n={n} {what}: beside the dispatch differs from after it")
    finally:
        engine.beside_dispatch = True
        moe.close()
    print(f"[figure] fused {kernel} beside the dispatch, {ctx.world_size} PE(s), PDL {'on' if pdl else 'off'}: "
          f"tokens {counts} bitwise {'yes' if not problems else 'no'}")
    verdict(ctx, not problems, f"{kernel}: " + "; ".join(problems))


def test_the_layers_check_errors_raises_what_the_fused_kernel_recorded(ctx):
    # An L2 tile whose wait for its L1 items expired is NaN and counted in the engine's status word: the layer's
    # check_errors (every call under SYMMRING_DEBUG) names it, clears it, and the layer runs on.
    hidden, inter, num_experts, topk = SHAPES["tiny"]
    moe, _ = _layer(ctx, "fused", hidden, inter, num_experts, topk, 64, SEED + 5)
    dev = cuda_device()
    x = to_torch(make_tokens(SEED + 6 + ctx.rank, 8, hidden), torch.bfloat16, dev)
    logits = to_torch(np.random.default_rng(SEED + 7).standard_normal((8, num_experts)).astype(np.float32),
                      torch.float32, dev)
    try:
        y = moe.forward(x, logits=logits)
        moe.check_errors()  # nothing recorded
        moe.engine.status.copy_(torch.tensor([2, 5], dtype=torch.int32, device=dev))  # as the kernel records it
        with pytest.raises(BackendError, match=r"2 L2 tile\(s\) waited .*\(first m block 5\)"):
            moe.check_errors()
        moe.check_errors()  # cleared
        assert torch.equal(moe.forward(x, logits=logits), y)
    finally:
        moe.close()
