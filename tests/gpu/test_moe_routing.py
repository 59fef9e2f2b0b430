"""The GPU layer's device routing (device/moe/router.cuh; `symmring.moe.routing` module notes).

One warp per token turns router logits into ``(topk_idx, topk_weights)``, as the standalone kernel
(`stages.route_topk`, every schedule but the small-batch one) and inside the small-batch producer. Checked
on seeded logits of several expert counts, top-k and element types:

* against the NumPy reference (`reference.select_topk`, float64): the ordered expert ids BITWISE (decreasing
  key, ties to the lower id) wherever the selection key is exact in float32 (softmax: the logits themselves;
  sigmoid without bias, renormalised or not: monotonic in the logits), on logits rounded coarsely so that ties are frequent;
  weights to float32 rounding;
* against torch's `routing.route` (the same float32 formulas) where the keys carry a float32 bias, with and
  without DeepSeek-V3's group-limited top-k: the ordered ids bitwise on continuous logits, weights close;
* NaN logits are chosen first (torch.topk's order), a logits row stride is honoured;
* `MoE.route` and the small-batch producer write the same bits as the kernel (the slot's routing and the
  layer output of both schedules, a graph replay included).

Several PEs: ``python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_moe_routing.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import cuda_device as dev, make_tokens, make_weights, to_torch, verdict  # noqa: E402

from symmring.moe import routing  # noqa: E402
from symmring.moe.gpu import stages
from symmring.moe.reference import select_topk  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261203))
#: (experts, top-k): Mixtral, Qwen2-MoE-like 60 (not a multiple of 32), Qwen3, 160 at the largest top-k,
#: DeepSeek-V3, the kernel's largest expert count.
SIZES = [(8, 2), (60, 4), (128, 8), (160, 32), (256, 8), (512, 16)]
TOKENS = 300
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def kernels(ctx):
    return stages.Kernels(ctx.backend)


def device_route(kernels, logits, topk, scoring="softmax", bias=None, **options):
    """The routing kernel on ``logits`` (a torch tensor): int32 / float32 numpy ``[n, topk]``."""
    import cupy
    n = logits.shape[0]
    idx = torch.full((n, topk), -7, dtype=torch.int32, device=dev())
    weights = torch.full((n, topk), float("nan"), dtype=torch.float32, device=dev())
    bias_t = None if bias is None else to_torch(bias, torch.float32, dev())
    router = routing.device_router(logits.shape[1], scoring, bias=bias_t, **options)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    stages.route_topk(kernels, stream, logits=routing.logits_operand(logits), router=router, topk=topk,
                      topk_idx=idx, topk_weights=weights)
    torch.cuda.synchronize()
    return idx.cpu().numpy(), weights.cpu().numpy()


def coarse_logits(rng, n, num_experts, step=0.25):
    """Logits on a grid of ``step`` in [-4, 4]: many exact ties, every value exact in bf16/fp16/fp32."""
    return (np.round(rng.uniform(-4, 4, (n, num_experts)) / step) * step).astype(np.float32)


def compare(got, want, what, problems, ids_exact=True):
    (gi, gw), (wi, ww) = got, want
    if ids_exact and not np.array_equal(gi, wi):
        rows = np.flatnonzero(np.any(gi != wi, axis=1))
        r = int(rows[0])
        problems.append(f"{what}: ids differ on {len(rows)} rows (row {r}: {gi[r].tolist()} vs {wi[r].tolist()})")
        return
    if not np.allclose(gw, ww, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL):
        err = float(np.max(np.abs(gw - ww) / (np.abs(ww) + WEIGHT_ATOL)))
        problems.append(f"{what}: weights differ (largest relative {err:.2e})")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("case", ["softmax", "softmax-all", "sigmoid", "sigmoid-norm"])
def test_exact_keys_match_the_reference_bitwise(ctx, kernels, dtype, case):
    """Keys exact in float32: the ordered ids are the reference's, ties (frequent here) to the lower id."""
    rng = np.random.default_rng([SEED, ["bfloat16", "float16", "float32"].index(dtype),
                                 ["softmax", "softmax-all", "sigmoid", "sigmoid-norm"].index(case)])
    scoring = "sigmoid_bias" if case.startswith("sigmoid") else "softmax"
    norm = case in ("softmax", "sigmoid-norm")
    problems, ties = [], 0
    for num_experts, topk in SIZES:
        logits = coarse_logits(rng, TOKENS, num_experts)
        kth = -np.sort(-logits, axis=1)
        ties += int(np.sum(kth[:, topk - 1] == kth[:, topk]))
        got = device_route(kernels, to_torch(logits, getattr(torch, dtype), dev()), topk, scoring,
                           norm_topk_prob=norm)
        want = select_topk(logits, topk, scoring, norm_topk_prob=norm)
        compare(got, want, f"E={num_experts} top-{topk}", problems)
    if ties < 50:
        problems.append(f"only {ties} rows tie at the k-th expert: the tie rule went untested")
    verdict(ctx, not problems, f"{case}/{dtype}: " + "; ".join(problems))


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "groups"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_biased_sigmoid_matches_torch(ctx, kernels, dtype, grouped):
    """DeepSeek-V3's routing (bias, scaling factor; 8 groups, 4 kept; and 32 groups of 2, 8 kept): the ids
    torch chooses, in its order, weights close to torch's and to the float64 reference's."""
    rng = np.random.default_rng(SEED + 7 + grouped)
    problems = []
    sizes = [(256, 8, 8, 4), (512, 16, 8, 4), (64, 8, 32, 8)] if grouped else [(e, k, 1, 1) for e, k in SIZES]
    for num_experts, topk, n_group, topk_group in sizes:
        options = dict(routed_scaling_factor=2.5, n_group=n_group, topk_group=topk_group)
        logits = rng.standard_normal((TOKENS, num_experts)).astype(np.float32)
        bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32)
        lt = to_torch(logits, getattr(torch, dtype), dev())
        got = device_route(kernels, lt, topk, "sigmoid_bias", bias=bias, **options)
        t_idx, t_w = routing.route(lt, topk, "sigmoid_bias", bias=to_torch(bias, torch.float32, dev()), **options)
        compare(got, (t_idx.cpu().numpy(), t_w.cpu().numpy()), f"E={num_experts} vs torch", problems)
        ref = select_topk(lt.float().cpu().numpy(), topk, "sigmoid_bias", bias=bias, **options)
        same_set = np.all(np.sort(got[0], 1) == np.sort(ref[0], 1), axis=1)
        if same_set.mean() < 0.99:
            problems.append(f"E={num_experts}: the float64 reference chooses other experts on "
                            f"{int((~same_set).sum())} of {TOKENS} rows")
        order = np.argsort(got[0], 1)
        ref_order = np.argsort(ref[0], 1)
        gw = np.take_along_axis(got[1], order, 1)[same_set]
        rw = np.take_along_axis(ref[1], ref_order, 1)[same_set]
        if not np.allclose(gw, rw, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL):
            problems.append(f"E={num_experts}: weights differ from the float64 reference")
    verdict(ctx, not problems, f"{dtype}/{'groups' if grouped else 'plain'}: " + "; ".join(problems))


def test_nan_first_and_row_stride(ctx, kernels):
    rng = np.random.default_rng(SEED + 11)
    problems = []
    logits = rng.standard_normal((64, 256)).astype(np.float32)
    wide = to_torch(np.concatenate([logits, np.zeros((64, 128), np.float32)], axis=1), torch.float32, dev())
    got = device_route(kernels, wide[:, :256], 8)  # row stride 384
    compare(got, select_topk(logits, 8), "row stride 384", problems)
    logits[5, 200] = np.nan
    idx, _ = device_route(kernels, to_torch(logits, torch.float32, dev()), 8)
    if idx[5, 0] != 200:
        problems.append(f"a NaN logit is not chosen first (row 5: {idx[5].tolist()})")
    t_idx, _ = routing.route(to_torch(logits, torch.float32, dev()), 8)
    if set(idx[5].tolist()) != set(t_idx[5].cpu().tolist()):
        problems.append("with a NaN logit the experts differ from torch.topk's")
    verdict(ctx, not problems, "; ".join(problems))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid_bias"])
def test_layer_routes_as_the_kernel(ctx, kernels, scoring):
    """`MoE.route`, the small-batch producer (its slot's routing) and the general schedule route alike: the
    layer's outputs of both schedules are bitwise equal from router weights, logits and a graph replay."""
    import cupy
    from symmring.moe.gpu import MoE
    pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")
    num_experts, topk, hidden = 64, 6, 256
    w_gate, w_up, w_down, router = make_weights(SEED + 13, num_experts, hidden, 256)
    e = num_experts // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    options, bias = dict(scoring=scoring), None
    if scoring == "sigmoid_bias":
        bias = (np.random.default_rng(SEED + 14).standard_normal(num_experts) * 0.1).astype(np.float32)
        options.update(bias=to_torch(bias, torch.float32, dev()), routed_scaling_factor=2.5, n_group=8,
                       topk_group=4)
    moe = MoE(ctx, Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down)),
                           expert_dtype="fp8"), RoutingConfig(num_experts, topk, **options), max_tokens=32,
              engine="builtin")
    router = to_torch(router, torch.bfloat16, dev())
    problems = []
    try:
        n = 5 + ctx.rank
        x = to_torch(make_tokens(SEED + 15 + ctx.rank, n, hidden), torch.bfloat16, dev())
        logits = x @ router.t()
        idx, weights = moe.route(logits)
        want = device_route(kernels, logits, topk, scoring, bias=bias,
                            **{k: v for k, v in options.items() if k not in ("scoring", "bias")})
        compare((idx.cpu().numpy(), weights.cpu().numpy()), want, "MoE.route vs kernel", problems)
        y_small = moe.forward(x, router_weight=router, small_batch=True)
        moe.check_errors()
        if not moe.last_plan.small_batch:
            problems.append("not the small-batch schedule")
        slot = tuple(cupy.asnumpy(moe.slot_view(name, n)).reshape(n, topk) for name in ("topk_idx", "topk_weights"))
        compare(slot, want, "the producer's slot routing vs kernel", problems)
        y_general = moe.forward(x, router_weight=router, small_batch=False)
        y_logits = moe.forward(x, logits=logits, small_batch=True)
        graph, y_static = moe.capture(x, logits=logits.clone(), small_batch=True)
        graph.replay()
        moe.check_errors()
        for name, y in (("general", y_general), ("logits", y_logits), ("graph replay", y_static)):
            if not torch.equal(y, y_small):
                problems.append(f"small-batch output != {name}")
        del graph
    finally:
        moe.close()
    verdict(ctx, not problems, f"{scoring}: " + "; ".join(problems))
