"""The symmring side of the vLLM integration on the GPU layer, without vLLM (not installed on the GPU machine):
`symmring.integrations.vllm.adapter.GivenRoutingLayer` with weights in vLLM's layouts (bf16, fp8 with 128x128
``weight_scale_inv`` blocks), vLLM's routing and every rank's counts given, against the definition
(tests/vllm_problem.py), and the host exchanges each call makes.

    python -m pytest tests/gpu/test_vllm_adapter_gpu.py -q
    python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_vllm_adapter_gpu.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpu_helpers import collective  # noqa: E402
from moe_helpers import cuda_device, gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: vllm_problem

from symmring.integrations.vllm import adapter  # noqa: E402
from vllm_problem import ExchangeCounter, make_problem, reference  # noqa: E402

pytestmark = pytest.mark.gpu

NUM_EXPERTS, HIDDEN, INTER, TOPK = 16, 256, 256, 4
#: Largest error relative to the output's largest value: bf16 dispatch and experts; fp8 dispatch (1x128 scales)
#: and fp8 experts (tests/gpu/test_moe_fp8.py: e4m3 costs a few per cent).
REL_TOL = {"bf16": 1e-2, "fp8": 8e-2}


@pytest.fixture(scope="module")
def ctx(nvshmem_ctx):
    if NUM_EXPERTS % nvshmem_ctx.world_size:
        pytest.skip(f"{NUM_EXPERTS} experts do not split evenly over {nvshmem_ctx.world_size} PEs")
    return nvshmem_ctx


def counts_of(world: int):
    counts = [37, 0, 5, 64, 1, 20, 9, 2][:world]
    return counts if world > 1 else [37]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@collective
def test_given_routing_layer_matches_the_definition(ctx, dtype):
    counts = counts_of(ctx.world_size)
    problem = make_problem(20261206, counts, num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, topk=TOPK,
                           fp8=dtype == "fp8")
    device = cuda_device()
    w13, w2, s13, s2 = problem.local(ctx.rank, ctx.world_size, device)
    experts = adapter.experts_from_vllm(w13, w2, w13_scale=s13, w2_scale=s2)
    layer = adapter.GivenRoutingLayer(ctx, experts, num_experts=NUM_EXPERTS, topk=TOPK, max_tokens=64)
    rank = ctx.rank
    x, ids, w = (t.to(device) for t in (problem.x[rank], problem.topk_ids[rank], problem.topk_weights[rank]))
    try:
        with ExchangeCounter(ctx) as counter:
            outputs = [layer(x, ids, w, counts) for _ in range(3)]  # the later calls replay cached graphs
        torch.cuda.synchronize()
        layer.layer.check_errors()
    finally:
        layer.close()
    want = reference(problem, rank)
    scale = max(want.abs().max().item(), 1e-6) if want.numel() else 1.0
    for y in outputs:
        assert y.dtype == torch.bfloat16 and tuple(y.shape) == tuple(want.shape)
        err = (y.float().cpu() - want).abs().max().item() if want.numel() else 0.0
        assert err <= REL_TOL[dtype] * scale, f"max error {err} (scale {scale}, counts {counts})"
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    # No host exchange per call where the workspace takes the counts; until then one per call (several PEs).
    expected = 0 if ctx.world_size == 1 or adapter.accepts_given_counts(layer.workspace) else 3
    assert counter.count == expected, counter.what


@collective
def test_a_call_captured_in_a_graph_replays_its_own_count(ctx):
    """As vLLM captures its model: a call captured into a CUDA graph, replayed after an eager call of other
    counts left another count on the device, gives the eager output of its own counts (bitwise)."""
    counts = counts_of(ctx.world_size)
    others = [max(1, c // 2) for c in counts]
    problem = make_problem(20261207, counts, num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, topk=TOPK)
    device = cuda_device()
    w13, w2, _, _ = problem.local(ctx.rank, ctx.world_size, device)
    layer = adapter.GivenRoutingLayer(ctx, adapter.experts_from_vllm(w13, w2), num_experts=NUM_EXPERTS, topk=TOPK,
                                      max_tokens=64)
    rank = ctx.rank
    x, ids, w = (t.to(device) for t in (problem.x[rank], problem.topk_ids[rank], problem.topk_weights[rank]))
    mine = others[rank]
    try:
        eager = layer(x, ids, w, counts)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(x, ids, w, counts)
        layer(x[:mine], ids[:mine], w[:mine], others)  # the device's count is now this call's
        graph.replay()
        torch.cuda.synchronize()
        layer.layer.check_errors()
    finally:
        layer.close()
    assert torch.equal(captured, eager)
