"""Token counts on the device (symmring.moe.gpu, `Workspace.step`): every rank plans a call for the same token
bucket and its exact count lives in a device word, so one captured graph serves any per-rank counts up to the
bucket (uneven and zero included), a model step exchanges with the other ranks once, and the graph cache holds
at most one graph per bucket.

Several PEs: ``python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_device_counts.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason
pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")

from moe_helpers import cuda_device as device_of, make_tokens, to_torch, verdict  # noqa: E402
from test_workspace import NUM_EXPERTS, SHAPES, build  # noqa: E402  (the layers of the workspace tests)
from test_workspace import routing as routing_rows  # noqa: E402

from symmring.moe.gpu.plan import num_buckets  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261202))
BUCKET = 32
REPLAYS = 200
CACHED_CALLS = 1000  # the count of eager calls through the graph cache


@pytest.fixture(scope="module")
def ctx(nvshmem_ctx):
    if NUM_EXPERTS % nvshmem_ctx.world_size:
        pytest.skip(f"these layers split {NUM_EXPERTS} experts evenly: not over {nvshmem_ctx.world_size} PEs")
    return nvshmem_ctx


def routing(seed, rows, topk, worst):
    """`test_workspace.routing`, and empty arrays for a zero-token call."""
    if rows == 0:
        return np.zeros((0, topk), np.int32), np.zeros((0, topk), np.float32)
    return routing_rows(seed, rows, topk, worst)


def layer_inputs(layers, seed, rows):
    """Per layer: seeded x, topk ids and weights of ``rows`` tokens (on the device)."""
    dev = device_of()
    out = []
    for i, _ in enumerate(layers):
        hidden, _, topk, _ = SHAPES[i % 2]
        idx, w = routing(seed + i, rows, topk, False)
        out.append((to_torch(make_tokens(seed + i, rows, hidden), torch.bfloat16, dev),
                    to_torch(idx, torch.int32, dev), to_torch(w, torch.float32, dev)))
    return out


def random_count(ctx, replay: int) -> int:
    """This rank's tokens of a replay: seeded per (replay, rank); every rank takes a zero-token turn."""
    if replay % (ctx.world_size + 2) == ctx.rank:
        return 0
    return int(np.random.default_rng(SEED + 7919 * replay + ctx.rank).integers(0, BUCKET + 1))


def test_one_step_graph_serves_random_counts_and_exchanges_once(ctx):
    """Four layers (two shapes) of a model step captured in ONE graph for a bucket of 32 tokens, replayed 200
    times with random per-rank counts (zero on each rank in turn; `Workspace.set_call_tokens`), each replay
    bitwise equal to the eager step with those counts; an eager step of the four layers makes one exchange."""
    workspace = Workspace(ctx, max_tokens=BUCKET)
    layers = [build(ctx, workspace, SHAPES[i % 2], SEED + i, BUCKET)[0] for i in range(4)]
    collectives = ctx.collectives
    problems, exchanges = [], []

    def step(tensors):
        return [moe.forward(x, topk_idx=i, topk_weights=w, graph_cache=False)
                for moe, (x, i, w) in zip(layers, tensors)]

    try:
        static = layer_inputs(layers, SEED, BUCKET)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), workspace.step(BUCKET, own_router=False):
            step(static)  # warm-up: compiles and loads every kernel before the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with workspace.step(BUCKET, own_router=False), torch.cuda.graph(graph):
            ys = step(static)
        zero_turns = 0
        for replay in range(REPLAYS):
            n = random_count(ctx, replay)
            zero_turns += n == 0
            fresh = layer_inputs(layers, SEED + 1000 * (replay + 1), n)
            for dst, src in zip(static, fresh):
                for d, s in zip(dst, src):
                    d[:n].copy_(s)
            workspace.set_call_tokens(n)
            graph.replay()
            replayed = [y[:n].clone() for y in ys]
            before = collectives._sequence
            with workspace.step(BUCKET, own_router=False):  # the graph's bucket: the same plan eagerly
                eager = step(fresh)
            exchanges.append(collectives._sequence - before)
            for i, (a, b) in enumerate(zip(replayed, eager)):
                if a.shape != b.shape or not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                    problems.append(f"replay {replay} ({n} tokens) layer {i} differs from eager")
            if len(problems) > 4:
                break
        for moe in layers:
            moe.check_errors()
    finally:
        torch.cuda.synchronize()
        workspace.close()
    most = max(exchanges, default=0)
    if ctx.world_size > 1 and most != 1:
        problems.append(f"an eager step of 4 layers made {most} exchanges (expected 1)")
    message = (f"one graph of 4 layers, {REPLAYS} replays with random counts (this rank: {zero_turns} with zero "
               f"tokens) == eager bitwise: {not problems}; exchanges per step of 4 layers: {most}; "
               + "; ".join(problems[:5]))
    print(f"[figure] device counts: {message}")
    verdict(ctx, not problems, message)


def test_graph_cache_holds_one_graph_per_bucket(ctx):
    """1000 eager calls with random per-rank counts (uneven, zero included) through the graph cache: at most one
    capture per token bucket, every cached call bitwise equal to the same call launched kernel by kernel."""
    workspace = Workspace(ctx, max_tokens=64)
    moe = build(ctx, workspace, SHAPES[0], SEED, 64)[0]
    dev = device_of()
    hidden, _, topk, _ = SHAPES[0]
    problems = []
    try:
        for call in range(CACHED_CALLS):
            n = int(np.random.default_rng(SEED + 31 * call + ctx.rank).integers(0, 65))
            x = to_torch(make_tokens(SEED + call + 3 * ctx.rank, n, hidden), torch.bfloat16, dev)
            idx, w = routing(SEED + 5 * call + ctx.rank, n, topk, False)
            idx, w = to_torch(idx, torch.int32, dev), to_torch(w, torch.float32, dev)
            y = moe.forward(x, topk_idx=idx, topk_weights=w)
            if call % 10 == 9:
                ref = moe.forward(x, topk_idx=idx, topk_weights=w, graph_cache=False)
                if not torch.equal(y.view(torch.int16), ref.view(torch.int16)):
                    problems.append(f"call {call} ({n} tokens): cached != uncached")
        moe.check_errors()
        info = moe.graph_cache_info()
    finally:
        torch.cuda.synchronize()
        workspace.close()
    if info["captures"] > num_buckets(64):
        problems.append(f"{info['captures']} captures > {num_buckets(64)} buckets")
    message = (f"{CACHED_CALLS} calls with random counts: captures {info['captures']} (buckets {num_buckets(64)}), "
               f"hits {info['hits']}, failures {info['failures']}, retries {info['retries']}; "
               + "; ".join(problems[:5]))
    print(f"[figure] device counts: {message}")
    verdict(ctx, not problems and info["failures"] == 0, message)


def test_a_replaced_model_step_captured_once_serves_random_counts(ctx):
    """A transformers model whose MoE blocks were replaced (`replace_moe_blocks`, built-in fp8 engine) captured
    in ONE CUDA graph for a bucket of 32 tokens inside `Workspace.step`, replayed with random per-rank counts
    (`Workspace.set_call_tokens`): the logits of each rank's first n positions equal, bitwise, the eager forward
    of the same padded batch, whose MoE layers compute all 32 rows (causal attention: positions past n never
    reach the first n, and every MoE row is computed alike; the first replay writes every row, so later rows
    past n hold finite values)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: hf_models
    import hf_models
    from symmring.moe.integrations.hf import replace_moe_blocks
    dev = device_of()
    model, _ = hf_models.tiny_model("mixtral", SEED, device=dev, num_experts=NUM_EXPERTS)  # splits over 3 PEs
    replaced = replace_moe_blocks(model, ctx, max_tokens=BUCKET, engine="builtin")
    workspace = next(iter(replaced.values())).layer.workspace
    static_ids = hf_models.input_ids(SEED + ctx.rank, 1, BUCKET).to(dev)
    problems, counts = [], []
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), workspace.step(BUCKET):
                model(static_ids)  # warm-up: every kernel compiled and loaded before the capture
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with workspace.step(BUCKET), torch.cuda.graph(graph):
                logits = model(static_ids).logits
            workspace.set_call_tokens(BUCKET)
            graph.replay()  # every row of every layer written once
            for replay in range(20):
                n = max(1, random_count(ctx, replay))
                counts.append(n)
                fresh = hf_models.input_ids(SEED + 100 * (replay + 1) + ctx.rank, 1, BUCKET).to(dev)
                static_ids.copy_(fresh)
                workspace.set_call_tokens(n)
                graph.replay()
                got = logits[:, :n].clone()
                with workspace.step(BUCKET):
                    want = model(fresh).logits[:, :n]
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    diff = (got.float() - want.float()).abs().max().item()
                    problems.append(f"replay {replay} ({n} tokens): logits differ from eager (max |diff| {diff:.3e})")
            for module in replaced.values():
                module.layer.check_errors()
    finally:
        torch.cuda.synchronize()
        for module in replaced.values():
            module.close()
    message = (f"a replaced Mixtral-like model captured once, 20 replays with counts {counts[:6]}...: first n "
               f"positions == eager bitwise: {not problems}; " + "; ".join(problems[:3]))
    print(f"[figure] device counts: {message}")
    verdict(ctx, not problems, message)


def test_a_graph_captured_outside_a_step_keeps_the_count_word_honest(ctx):
    """A call skips the count fill when the word already holds its count, unless a graph captured outside a step
    writes the word: here a raw ``torch.cuda.graph`` around a 3-token forward, replayed between two 5-token
    eager calls. Without that rule the second eager call would read 3 and leave its last 2 rows unwritten."""
    workspace = Workspace(ctx, max_tokens=64)
    moe = build(ctx, workspace, SHAPES[0], SEED, 64)[0]
    hidden, _, topk, _ = SHAPES[0]
    dev = device_of()

    def call_inputs(seed, n):
        idx, w = routing(seed + 1, n, topk, False)
        return (to_torch(make_tokens(seed, n, hidden), torch.bfloat16, dev), to_torch(idx, torch.int32, dev),
                to_torch(w, torch.float32, dev))

    small, large = call_inputs(SEED + 11, 3), call_inputs(SEED + 13, 5)
    try:
        ref = moe.forward(*large[:1], topk_idx=large[1], topk_weights=large[2], graph_cache=False)
        moe.forward(*small[:1], topk_idx=small[1], topk_weights=small[2], graph_cache=False)  # warm the 3-token plan
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe.forward(*small[:1], topk_idx=small[1], topk_weights=small[2])
        first = moe.forward(*large[:1], topk_idx=large[1], topk_weights=large[2], graph_cache=False)
        graph.replay()  # every rank replays: one more call of the layer, count 3 written by the graph
        second = moe.forward(*large[:1], topk_idx=large[1], topk_weights=large[2], graph_cache=False)
        moe.check_errors()
        same = [torch.equal(y.view(torch.int16), ref.view(torch.int16)) for y in (first, second)]
    finally:
        torch.cuda.synchronize()
        workspace.close()
    message = f"5-token calls around a raw replay of a 3-token capture == the first 5-token call bitwise: {same}"
    print(f"[figure] device counts: {message}")
    verdict(ctx, all(same), message)
