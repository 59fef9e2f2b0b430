"""The symmring side of the vLLM integration on the GPU layer, without vLLM (not installed on the GPU machine):
`symmring.integrations.vllm.adapter.GivenRoutingLayer` with weights in vLLM's layouts (bf16, fp8 with 128x128
``weight_scale_inv`` blocks), vLLM's routing and every rank's counts given (``Workspace.step(counts=...)``),
against the definition (tests/vllm_problem.py):

* its rows, and ZERO host exchanges per call (vLLM exchanged the counts already);
* a call captured into a CUDA graph (as vLLM captures its model) replays its own count;
* a fault on one PE in a call of given counts (a refused call, a skipped call, a stalled host; several PEs)
  raises a named error on every PE within that model step or the next, and no PE keeps finite wrong rows.

    python -m pytest tests/gpu/test_vllm_adapter_gpu.py -q
    python -m symmring.launch -n 2 --mps --torchrun -- python -m pytest tests/gpu/test_vllm_adapter_gpu.py -q
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
from symmring.moe.config import ScheduleConfig  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402
from vllm_problem import (FAULTS, ExchangeCounter, fault_step, fault_verdict, make_problem, reference,  # noqa: E402
                          steps_problem)

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
    assert counter.count == 0, counter.what  # the counts are given: no host exchange per call
    print(f"\nrank {rank}: {dtype}: 3 calls, host exchanges {counter.count}")


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


#: The device wait bound of the fault test's layers.
DEVICE_TIMEOUT_S = 2.0


@pytest.mark.parametrize("fault", FAULTS)
@collective
def test_a_fault_on_one_pe_in_a_given_counts_call_raises_on_every_pe(ctx, fault):
    """Model steps 0 (clean), 1 (the fault on the last PE's call of layer A, `vllm_problem.fault_step`) and 2
    (clean) of two layers, counts given: every PE raises in step 1 or 2 (the refusal's ring abort, the call
    identity in the meta rows or a device wait's bound, latched and raised at the PE's next call's entry), no PE
    keeps finite wrong rows, nothing is exchanged; after `Workspace.reset` step 3 is right on every PE."""
    if ctx.world_size < 2:
        pytest.skip("needs 2 or more PEs (python -m symmring.launch -n 2 --mps --torchrun -- ...)")
    world, rank, culprit = ctx.world_size, ctx.rank, ctx.world_size - 1
    counts = [[4 + (s + r) % 3 for r in range(world)] for s in range(4)]
    shape = dict(num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, topk=TOPK)
    problems = [steps_problem(20261210 + li, counts, **shape) for li in range(2)]
    device = cuda_device()
    ws = Workspace(ctx, max_tokens=8)
    schedule = ScheduleConfig(x_format="bf16", timeout_s=DEVICE_TIMEOUT_S)
    layers = []
    for p in problems:
        w13, w2, _, _ = p.local(rank, world, device)
        layers.append(adapter.GivenRoutingLayer(ctx, adapter.experts_from_vllm(w13, w2), num_experts=NUM_EXPERTS,
                                                topk=TOPK, max_tokens=8, workspace=ws, schedule=schedule))

    def step(s, fault_here=None):
        return fault_step(layers, problems, s, counts[s], rank=rank, world=world, fault=fault_here, culprit=culprit,
                          stall_s=2 * DEVICE_TIMEOUT_S, device=device)

    try:
        with ExchangeCounter(ctx) as counter:
            records = [step(s, fault if s == 1 else None) for s in range(3)]
        torch.cuda.synchronize()
        ws.reset()  # collective: every PE, once it is out of its calls
        after = step(3)
    finally:
        for layer in layers:
            layer.close()
        ws.close()
    found = fault_verdict(records, after) + ([f"{counter.count} host exchanges"] if counter.count else [])
    print(f"\nrank {rank}: fault {fault} on PE {culprit}: raised {len(records[1]['errors'])} in the step, "
          f"{len(records[2]['errors'])} in the next ({(records[1]['errors'] + records[2]['errors'])[:1]}), "
          f"wrong rows {sum(r['wrong'] for r in records)} (finite {sum(r['finite_wrong'] for r in records)}), "
          f"host exchanges {counter.count}")
    assert not found, f"{found} (records {records})"
