"""Call ordering of the GPU MoE layer: each call runs after the previous call's end, whatever stream or
graph replay either is (the generation base it advances is what the next call's generations derive from).

Calls alternate between two streams and CUDA graph replays with no host synchronisation between them;
every output must equal the single-stream result BITWISE and no wait may time out. Without the ordering
two calls would run concurrently and publish the same generations (stale payloads, double
acknowledgements, timeouts). Batch, small-batch (fp8) and streamed (two streams, so the local edges of
the plan are exercised inside the captured graph too). The eager steps replay the layer's own cached
graph once warm (`symmring.moe.gpu.graph_cache`); the reference launches every kernel.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import cuda_device as dev, make_tokens, make_weights, to_torch, verdict  # noqa: E402

from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261203))
HIDDEN, INTER, NUM_EXPERTS, TOPK = 256, 256, 8, 2


CASES = {
    "batch bf16": dict(engine="torch", kwargs={}),
    "small-batch fp8": dict(engine="builtin", kwargs={"small_batch": True}),
    "streamed": dict(engine="torch", kwargs={"streaming": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_calls_on_alternating_streams_and_graph_replays_stay_ordered(ctx, case):
    if CASES[case]["engine"] == "builtin":
        pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")
    w_gate, w_up, w_down, _ = make_weights(SEED, NUM_EXPERTS, HIDDEN, INTER)
    e = NUM_EXPERTS // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    n = 48
    engine = CASES[case]["engine"]
    experts = Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down)),
                      expert_dtype="fp8" if engine == "builtin" else "bf16")
    moe = MoE(ctx, experts, RoutingConfig(NUM_EXPERTS, TOPK), max_tokens=n,
              schedule=ScheduleConfig(num_slots=3, tokens_per_slot=16), engine=engine)
    kwargs = CASES[case]["kwargs"]
    if kwargs.get("small_batch"):
        n = 16  # one chunk
    problems = []
    try:
        rng = np.random.default_rng(SEED + ctx.rank)
        inputs = []
        for i in range(2):
            x = to_torch(make_tokens(SEED + 10 * i + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
            logits = to_torch(rng.standard_normal((n, NUM_EXPERTS)).astype(np.float32), torch.float32, dev())
            inputs.append((x, logits))
        # The single-stream reference launches every kernel; the eager steps below replay the layer's cached
        # graph of the call once warm (symmring.moe.gpu.graph_cache), so its ordering is exercised too.
        want = [moe.forward(x, logits=lg, graph_cache=False, **kwargs).clone() for x, lg in inputs]
        moe.check_errors()
        x_graph, logits_graph = (t.clone() for t in inputs[1])
        call, y_graph = moe.capture(x_graph, logits=logits_graph, **kwargs)
        torch.cuda.synchronize()
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        outs = []
        for step in range(8):  # eager on stream 0, replay on stream 1, eager on stream 1, replay on stream 0, ...
            with torch.cuda.stream(streams[(step // 2 + step) % 2]):
                if step % 2:
                    call.replay()
                    outs.append(("replay", y_graph.clone()))
                else:
                    outs.append(("eager", moe.forward(*inputs[0][:1], logits=inputs[0][1], **kwargs)))
        torch.cuda.synchronize()
        moe.check_errors()
        for step, (kind, y) in enumerate(outs):
            ref = want[1] if kind == "replay" else want[0]
            if not torch.equal(y, ref):
                problems.append(f"step {step} ({kind}): {int((y != ref).any(dim=1).sum())} rows differ")
        del call
    finally:
        moe.close()
    verdict(ctx, not problems, f"{case}: " + "; ".join(problems))
