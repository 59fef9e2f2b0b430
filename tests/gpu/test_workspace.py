"""The GPU layers of a model on one `symmring.Workspace` (symmring.moe.gpu.memory): passes through a pool far
below the worst routing, layers of different shapes, memory that does not grow with the layers, the live
regions equal to the planner's, and one CUDA graph over several layers bitwise equal to eager.

Several PEs: ``python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_workspace.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402
from gpu_helpers import ranks  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason
pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")

from moe_helpers import cuda_device as device_of, make_tokens, make_weights, to_torch, verdict  # noqa: E402

from symmring.moe import fp8_reference  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.reference import reference_moe  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402
from symmring.moe.workspace_plan import REGIONS, plan  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261201))
NUM_EXPERTS = 12  # splits evenly over 1, 2, 3 and 4 PEs: every PE count the GPU jobs run
REL_TOL = 1e-2
#: (hidden, inter, top-k, engine) of the layer shapes the tests mix.
SHAPES = ((256, 256, 2, "builtin"), (384, 128, 4, "torch"))


@pytest.fixture(scope="module")
def ctx(nvshmem_ctx):
    if NUM_EXPERTS % nvshmem_ctx.world_size:
        pytest.skip(f"these layers split {NUM_EXPERTS} experts evenly: not over {nvshmem_ctx.world_size} PEs")
    return nvshmem_ctx


def build(ctx, workspace, shape, seed, max_tokens, **schedule):
    """A layer of ``shape`` with this rank's experts of seeded global weights; returns it and the float32
    weights its reference uses (dequantised fp8 blocks for the fp8 engine)."""
    hidden, inter, topk, engine = shape
    w_gate, w_up, w_down, _ = make_weights(seed, NUM_EXPERTS, hidden, inter)
    e = NUM_EXPERTS // ctx.world_size
    lo, hi = ctx.rank * e, (ctx.rank + 1) * e
    dev = device_of()
    if engine == "torch":
        moe = MoE(ctx, Experts(*(to_torch(w[lo:hi], torch.bfloat16, dev) for w in (w_gate, w_up, w_down))),
                  RoutingConfig(NUM_EXPERTS, topk), max_tokens=max_tokens, schedule=ScheduleConfig(**schedule),
                  engine="torch", workspace=workspace)
        return moe, (w_gate, w_up, w_down), None
    q = [fp8_reference.quantize_weight_blocks(w) for w in (w_gate, w_up, w_down)]
    deq = tuple(fp8_reference.dequantize_weight_blocks(*b) for b in q)

    def fp8(a):
        return torch.from_numpy(np.ascontiguousarray(a[lo:hi]).view(np.uint8)).to(dev).view(torch.float8_e4m3fn)

    scales = (to_torch(b[1][lo:hi], torch.float32, dev) for b in q)
    experts = Experts(*(fp8(b[0]) for b in q), *scales)
    moe = MoE(ctx, experts, RoutingConfig(NUM_EXPERTS, topk), max_tokens=max_tokens,
              schedule=ScheduleConfig(**schedule), engine="builtin", workspace=workspace)
    return moe, deq, "fp8"


def routing(seed, num_tokens, topk, worst):
    """int32 / float32 routing: ``worst`` sends every (token, k) to experts 0..topk-1 (all on rank 0)."""
    rng = np.random.default_rng(seed)
    if worst:
        idx = np.tile(np.arange(topk, dtype=np.int32), (num_tokens, 1))
    else:
        idx = np.stack([rng.permutation(NUM_EXPERTS)[:topk] for _ in range(num_tokens)]).astype(np.int32)
    return idx.reshape(num_tokens, topk), rng.random((num_tokens, topk), dtype=np.float32)


def check_layer(ctx, moe, weights, expert_format, hidden, topk, seed, num_tokens, worst, **forward):
    """One call vs the float64 reference; returns (squared error, squared reference, finite)."""
    dev = device_of()
    x = make_tokens(seed + ctx.rank, num_tokens, hidden)
    idx, w = routing(seed + 100 + ctx.rank, num_tokens, topk, worst)
    y = moe.forward(to_torch(x, torch.bfloat16, dev), topk_idx=to_torch(idx, torch.int32, dev),
                    topk_weights=to_torch(w, torch.float32, dev), **forward)
    moe.check_errors()
    y = y.float().cpu().numpy()
    kwargs = dict(expert_format="fp8") if expert_format else {}
    ref = reference_moe(x, w_gate=weights[0], w_up=weights[1], w_down=weights[2], num_topk=topk, topk_idx=idx,
                        topk_weights=w, **kwargs)
    return (float(np.sum((y.astype(np.float64) - ref.y) ** 2)), float(np.sum(ref.y.astype(np.float64) ** 2)),
            bool(np.all(np.isfinite(y))))


def agreed_error(ctx, parts):
    err_sq = sum(p[0] for p in parts)
    ref_sq = sum(p[1] for p in parts)
    finite = all(p[2] for p in parts)
    if ctx.world_size > 1:
        err_sq, ref_sq = ranks(ctx).allreduce(err_sq), ranks(ctx).allreduce(ref_sq)
        finite = bool(ranks(ctx).allreduce(int(finite)) == ctx.world_size)
    return (err_sq / max(ref_sq, 1e-30)) ** 0.5, finite


@pytest.mark.parametrize("streaming", [False, True])
def test_worst_routing_through_a_small_pool(ctx, streaming):
    """Two layers of different shapes (fp8 built-in and bf16 torch engines) on one workspace whose pool is one
    aligned group (128 rows): every token of every rank goes to rank 0's experts, so rank 0's windows run
    several passes; both outputs match the reference."""
    workspace = Workspace(ctx, pool_rows=128)
    layers = [build(ctx, workspace, shape, SEED + i, 96, num_slots=2, tokens_per_slot=48)
              for i, shape in enumerate(SHAPES)]
    parts, passes = [], []
    try:
        for i, ((moe, weights, fmt), shape) in enumerate(zip(layers, SHAPES)):
            parts.append(check_layer(ctx, moe, weights, fmt, shape[0], shape[2], SEED + 10 * i, 96, True,
                                     streaming=streaming))
            passes.append(max(len(w.passes) for w in moe.last_plan.windows.values()))
    finally:
        workspace.close()
    err, finite = agreed_error(ctx, parts)
    message = (f"worst routing, pool 128 rows, streaming={streaming}: passes per window {passes}, relative error "
               f"{err:.3e} (<= {REL_TOL})")
    print(f"[figure] workspace: {message}")
    verdict(ctx, finite and err <= REL_TOL and min(passes) > 1, message)


def test_memory_does_not_grow_with_layers_and_matches_the_plan(ctx):
    """2 and 8 layers (the two shapes alternating) on a workspace each: the same workspace bytes and the same
    device memory after a call of every layer (torch's allocations + the symmetric heap regions), each layer
    matching the reference; the live regions equal the planner's."""
    figures, parts = {}, []
    for num_layers in (2, 8):
        torch.cuda.synchronize()
        workspace = Workspace(ctx, max_tokens=64)
        layers = [build(ctx, workspace, SHAPES[i % 2], SEED + i % 2, 64) for i in range(num_layers)]
        before_calls = torch.cuda.memory_allocated()
        for i, (moe, weights, fmt) in enumerate(layers):
            shape = SHAPES[i % 2]
            parts.append(check_layer(ctx, moe, weights, fmt, shape[0], shape[2], SEED + 7 * i, 64, False))
        torch.cuda.synchronize()
        memory = workspace.memory()
        expected = plan([m.layer_shape for m, _, _ in layers[:2]], world_size=ctx.world_size, max_tokens=64)
        figures[num_layers] = (memory, torch.cuda.memory_allocated() - before_calls, expected.regions)
        workspace.close()
    err, finite = agreed_error(ctx, parts)
    (m2, grown2, plan2), (m8, grown8, _) = figures[2], figures[8]
    same_plan = all(m2[name] == plan2[name] for name in REGIONS)
    message = (f"workspace bytes 2 layers {m2['total']}, 8 layers {m8['total']}; torch memory grown by the calls "
               f"{grown2} vs {grown8} bytes; regions == plan: {same_plan} ({ {k: m2[k] for k in REGIONS} } vs "
               f"{plan2}); relative error {err:.3e}")
    print(f"[figure] workspace: {message}")
    verdict(ctx, finite and err <= REL_TOL and m2 == m8 and same_plan, message)


def test_one_graph_over_four_layers_equals_eager(ctx):
    """A forward of four layers (two shapes) captured in ONE CUDA graph, as a server captures a decode step:
    each replay with new inputs equals the eager calls bitwise (generations grow across the layers)."""
    workspace = Workspace(ctx, max_tokens=32)
    layers = [build(ctx, workspace, SHAPES[i % 2], SEED + i, 32) for i in range(4)]
    dev = device_of()
    n = 8 + 4 * ctx.rank  # uneven counts across the ranks

    def inputs(seed):
        out = []
        for i, (moe, _, _) in enumerate(layers):
            hidden, _, topk, _ = SHAPES[i % 2]
            idx, w = routing(seed + i, n, topk, False)
            out.append((to_torch(make_tokens(seed + i, n, hidden), torch.bfloat16, dev),
                        to_torch(idx, torch.int32, dev), to_torch(w, torch.float32, dev)))
        return out

    static = inputs(SEED)
    ok, worst = True, ""
    try:
        def step(tensors):
            return [moe.forward(x, topk_idx=i, topk_weights=w, graph_cache=False)
                    for (moe, _, _), (x, i, w) in zip(layers, tensors)]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(static)  # warm-up: compiles and loads every kernel before the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = step(static)
        for replay in range(5):
            fresh = inputs(SEED + 1000 * (replay + 1))
            for dst, src in zip(static, fresh):
                for d, s in zip(dst, src):
                    d.copy_(s)
            graph.replay()
            replayed = [y.clone() for y in ys]
            eager = step(fresh)
            for layer_idx, (a, b) in enumerate(zip(replayed, eager)):
                if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    ok, worst = False, f"replay {replay} layer {layer_idx} differs from eager"
        for moe, _, _ in layers:
            moe.check_errors()
    finally:
        torch.cuda.synchronize()
        workspace.close()
    message = f"one graph over 4 layers, 5 replays with new inputs == eager bitwise: {ok} {worst}"
    print(f"[figure] workspace: {message}")
    verdict(ctx, ok, message)


def test_fp8_shapes_interleaved_on_one_pool(ctx):
    """Two fp8 shapes share the pool's bytes: a call of the wider one writes rows over where the other's rows
    were. Calls alternating A, B, A, B each match the reference (the group ids that must stay -1 between calls
    live apart from the shared bytes)."""
    workspace = Workspace(ctx, max_tokens=96)
    shapes = ((256, 256, 2, "builtin"), (1024, 256, 4, "builtin"))
    layers = [build(ctx, workspace, shape, SEED + 50 + i, 96) for i, shape in enumerate(shapes)]
    parts = []
    try:
        for call in range(4):
            (moe, weights, fmt), shape = layers[call % 2], shapes[call % 2]
            parts.append(check_layer(ctx, moe, weights, fmt, shape[0], shape[2], SEED + 60 + call, 96, False))
    finally:
        workspace.close()
    err, finite = agreed_error(ctx, parts)
    message = f"two fp8 shapes alternating on one pool, 4 calls: relative error {err:.3e} (<= {REL_TOL})"
    print(f"[figure] workspace: {message}")
    verdict(ctx, finite and err <= REL_TOL, message)
