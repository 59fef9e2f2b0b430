"""One rank of the two-rank test of symmring's experts class on vLLM's modular kernel (test_vllm_ep2.py here),
started by ``torchrun --nproc-per-node 2``: the EP group is the torch.distributed world (gloo), as vLLM's is
over its data-parallel ranks (``symmring.init(group=...)``: the CPU backend's memory in /dev/shm, its few host
collectives over the group's c10d store).

Each rank runs its own tokens through `SymmringExperts` (its half of the experts, vLLM's data-parallel token
counts in the forward context) and compares its rows with vLLM's own unquantized CPU path at one rank with
every expert; bf16 and fp8 blocks (against the dequantised weights). It counts the host exchanges of the
calls and prints ``EP2 RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (FusedMoEParallelConfig, FusedMoEQuantConfig,  # noqa: E402
                                                         fp8_w8a8_moe_quant_config)

from symmring.integrations.vllm import experts as sx  # noqa: E402
from symmring.moe.weights import dequantize_blocks  # noqa: E402
from test_vllm_kernel import layer_of, moe_config, run, symmring_kernel, vllm_unquantized  # noqa: E402
from vllm_problem import ExchangeCounter, make_problem  # noqa: E402

NUM_EXPERTS, HIDDEN, INTER, TOPK = 8, 256, 256, 2
COUNTS_2 = [19, 6]


def case(rank: int, world: int, fp8: bool) -> dict:
    counts = COUNTS_2[:world]  # one rank: a check of the worker itself
    problem = make_problem(2026 + fp8, counts, num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER, topk=TOPK, fp8=fp8)
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0,
                                      dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                      all2all_backend="allgather_reducescatter", enable_eplb=False)
    local = NUM_EXPERTS // world
    moe = moe_config(NUM_EXPERTS, HIDDEN, INTER, TOPK, parallel=parallel, num_local_experts=local)
    w13, w2, s13, s2 = problem.local(rank, world)
    layer = layer_of(w13, w2, s13, s2)
    quant = FusedMoEQuantConfig.make() if not fp8 else fp8_w8a8_moe_quant_config(
        w1_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv, block_shape=[128, 128])
    kernel = symmring_kernel(moe, quant, layer)
    args = (problem.x[rank], problem.topk_ids[rank], problem.topk_weights[rank], NUM_EXPERTS)
    forward = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                             dp_metadata=DPMetadata(torch.tensor(counts)))
    with override_forward_context(forward), ExchangeCounter(kernel.fused_experts.layer.ctx) as counter:
        got = [run(kernel, layer, *args) for _ in range(3)]
    full13, full2 = (problem.w13, problem.w2) if not fp8 else (dequantize_blocks(problem.w13, problem.w13_scale),
                                                                dequantize_blocks(problem.w2, problem.w2_scale))
    ref_kernel, ref_layer = vllm_unquantized(moe_config(NUM_EXPERTS, HIDDEN, INTER, TOPK), full13, full2)
    want = run(ref_kernel, ref_layer, *args).float()
    err = max((g.float() - want).abs().max().item() for g in got)
    return dict(fp8=fp8, max_error=err, scale=want.abs().max().item(), exchanges=counter.count, calls=len(got),
                counts=counts)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sx.process_workspace(FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0,
                                                pcp_rank=0, dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                                all2all_backend="allgather_reducescatter", enable_eplb=False),
                         max_tokens=64, group=dist.group.WORLD)
    results = [case(rank, world, fp8) for fp8 in (False, True)]
    # One write, newline included: the two ranks share the job's stdout, and print() writes the text and its
    # newline apart (another rank's output landed between them on CI).
    sys.stdout.write("EP2 RESULT " + json.dumps(dict(rank=rank, results=results)) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
