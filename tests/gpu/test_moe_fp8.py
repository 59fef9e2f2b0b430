"""The fp8 experts of the GPU MoE layer (symmring.moe.gpu.MoE with expert_dtype="fp8"), every fp8 engine.

* vs a float64 reference built from the same quantised values (symmring.moe.reference.reference_moe with
  the dequantised 128x128-block fp8 weights, fp8 dispatch and ``expert_format="fp8"``: L1 rounded to bf16,
  the SwiGLU output quantised to 1x128 fp8): relative error <= 1e-2 (the issue's bound);
* checkpoint-layout weights (fp8 e4m3 + scales, quantised on the CPU by symmring.moe.fp8_reference) and
  bf16 weights quantised by the layer itself: the same weight bytes and BITWISE the same outputs;
* streamed with one expert window over the call == batch BITWISE; a CUDA graph replay == eager BITWISE;
* vs transformers' Mixtral block with the bf16 weights: relative error <= 8e-2, and within 5e-3 of what the
  float64 model of the same fp8 recipe gives against the bf16 model on the same data (6.35e-2 here: e4m3's
  3 mantissa bits cost ~3.7 % RMS on x alone and ~4.6 % on the weights alone, so the issue's 6e-2 is
  below what the format allows on this data; the second bound is the one that checks the implementation);
* shape classes: hidden and inter multiples of 128 (an odd number of 128-channel groups too), 1..8 experts
  per rank, top-1..8, zero-token ranks; bad weights, scales and options rejected with ConfigError;
* an expert id outside [-1, num_experts) is named by check_errors() as a ConfigError, and the next call
  works; the fp8 pool's rows take half the bytes of the bf16 pool's.

Engines: "builtin" (Triton) always, "deepgemm" where it imports (else skipped with the reason). Several
PEs: ``python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_moe_fp8.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402
from gpu_helpers import ranks  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason
pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")

from moe_helpers import (cuda_device as device_of, fp8_engines, make_tokens, make_weights, mixtral_block,  # noqa: E402
                         mixtral_forward, rel_error, to_torch, verdict)

from symmring.errors import ConfigError  # noqa: E402
from symmring.moe import fp8_reference  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.reference import reference_moe  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261201))
HIDDEN, INTER, NUM_EXPERTS = 256, 256, 16
REL_TOL = 1e-2
MIXTRAL_TOL = 8e-2
#: The layer's error vs the Mixtral block may exceed the fp8 model's error vs the bf16 model by this much.
MIXTRAL_VS_MODEL_TOL = 5e-3
ENGINES = fp8_engines()




def checkpoint(seed, num_experts=NUM_EXPERTS, hidden=HIDDEN, inter=INTER):
    """Global fp8 checkpoint: ``{name: (q fp8 [E, N, K], scale [E, N/128, K/128])}``, the dequantised float32
    weights, the bf16-exact originals and a router, all NumPy."""
    w_gate, w_up, w_down, router = make_weights(seed, num_experts, hidden, inter)
    q = {name: fp8_reference.quantize_weight_blocks(w) for name, w in (("gate", w_gate), ("up", w_up),
                                                                      ("down", w_down))}
    deq = {name: fp8_reference.dequantize_weight_blocks(*q[name]) for name in q}
    return q, deq, (w_gate, w_up, w_down), router


def local(ctx, a, num_experts=NUM_EXPERTS):
    e = num_experts // ctx.world_size
    return a[ctx.rank * e:(ctx.rank + 1) * e]


def fp8_layer(ctx, q, engine, max_tokens, *, num_experts=NUM_EXPERTS, topk=2, **schedule):
    """The fp8 checkpoint ``q`` as this rank's experts (hidden and inter: the weights' shape); ``schedule``:
    `ScheduleConfig`'s fields."""
    dev = device_of()

    def fp8(a):
        return torch.from_numpy(np.ascontiguousarray(local(ctx, a, num_experts)).view(np.uint8)).to(dev).view(
            torch.float8_e4m3fn)

    def f32(a):
        return to_torch(local(ctx, a, num_experts), torch.float32, dev)

    experts = Experts(fp8(q["gate"][0]), fp8(q["up"][0]), fp8(q["down"][0]), w_gate_scale=f32(q["gate"][1]),
                      w_up_scale=f32(q["up"][1]), w_down_scale=f32(q["down"][1]))
    return MoE(ctx, experts, RoutingConfig(num_experts, topk), max_tokens=max(1, max_tokens),
               schedule=ScheduleConfig(**schedule), engine=engine)


def run(moe, x, logits, **kwargs):
    dev = device_of()
    y = moe.forward(to_torch(x, torch.bfloat16, dev), logits=to_torch(logits, torch.float32, dev), **kwargs)
    moe.check_errors()
    return y.float().cpu().numpy()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("num_tokens,topk", [(1, 2), (7, 1), (128, 8), (1000, 2), (3000, 4)])
def test_fp8_experts_vs_reference(ctx, engine, num_tokens, topk):
    # The error is summed over every rank's rows and, for small batches, over 64 // n calls with new tokens
    # (one token's output alone varies too much for a 1e-2 bound on a norm ratio).
    q, deq, _, _ = checkpoint(SEED + topk)
    moe = fp8_layer(ctx, q, engine, num_tokens, topk=topk)
    err_sq = ref_sq = 0.0
    finite = True
    try:
        for call in range(max(1, 64 // num_tokens)):
            tseed = SEED + 10 * num_tokens + 1000 * call + ctx.rank
            x = make_tokens(tseed, num_tokens, HIDDEN)
            logits = np.random.default_rng(tseed).standard_normal((num_tokens, NUM_EXPERTS)).astype(np.float32)
            y = run(moe, x, logits)
            ref = reference_moe(x, w_gate=deq["gate"], w_up=deq["up"], w_down=deq["down"], num_topk=topk,
                                logits=logits, expert_format="fp8")
            finite = finite and bool(np.all(np.isfinite(y)))
            err_sq += float(np.sum((y.astype(np.float64) - ref.y) ** 2))
            ref_sq += float(np.sum(ref.y.astype(np.float64) ** 2))
    finally:
        moe.close()
    if ctx.world_size > 1:
        err_sq, ref_sq = ranks(ctx).allreduce(err_sq), ranks(ctx).allreduce(ref_sq)
        finite = bool(ranks(ctx).allreduce(int(finite)) == ctx.world_size)
    err = (err_sq / ref_sq) ** 0.5
    message = f"{engine} n={num_tokens} top-{topk}: relative error {err:.3e} (<= {REL_TOL})"
    print(f"[figure] fp8 vs float64 reference: {message}")
    verdict(ctx, finite and err <= REL_TOL, message)


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpoint_weights_equal_bf16_weights_quantised_by_the_layer(ctx, engine):
    q, _, (w_gate, w_up, w_down), _ = checkpoint(SEED + 1)
    dev = device_of()
    n = 300
    from_ckpt = fp8_layer(ctx, q, engine, n)
    from_bf16 = MoE(ctx, Experts(*(to_torch(local(ctx, w), torch.bfloat16, dev) for w in (w_gate, w_up, w_down)),
                                 expert_dtype="fp8"), RoutingConfig(NUM_EXPERTS, 2), max_tokens=n, engine=engine)
    problems = []
    try:
        a, b = from_ckpt.engine.weights, from_bf16.engine.weights
        for name in ("w13", "w_down", "w13_scale", "w_down_scale"):
            ta, tb = getattr(a, name), getattr(b, name)
            if not torch.equal(ta.view(torch.uint8) if ta.dtype == torch.float8_e4m3fn else ta,
                               tb.view(torch.uint8) if tb.dtype == torch.float8_e4m3fn else tb):
                problems.append(f"{name} differs")
        x = make_tokens(SEED + 2 + ctx.rank, n, HIDDEN)
        logits = np.random.default_rng(SEED + 3 + ctx.rank).standard_normal((n, NUM_EXPERTS)).astype(np.float32)
        if not np.array_equal(run(from_ckpt, x, logits), run(from_bf16, x, logits)):
            problems.append("outputs differ")
    finally:
        from_ckpt.close()
        from_bf16.close()
    verdict(ctx, not problems, f"{engine}: " + "; ".join(problems))


@pytest.mark.parametrize("engine", ENGINES)
def test_streamed_whole_window_and_graph_bitwise(ctx, engine):
    q, _, _, _ = checkpoint(SEED + 4)
    n = 700
    moe = fp8_layer(ctx, q, engine, n, tokens_per_slot=64, num_slots=11, expert_window=11, ack_policy="early")
    problems = []
    try:
        x = make_tokens(SEED + 5 + ctx.rank, n, HIDDEN)
        logits = np.random.default_rng(SEED + 6 + ctx.rank).standard_normal((n, NUM_EXPERTS)).astype(np.float32)
        y_batch = run(moe, x, logits)
        y_streamed = run(moe, x, logits, streaming=True)
        if not np.array_equal(y_batch, y_streamed):
            problems.append(f"streamed != batch ({int(np.sum(np.any(y_batch != y_streamed, axis=1)))} rows differ)")
        dev = device_of()
        x_static = to_torch(x, torch.bfloat16, dev)
        logits_static = to_torch(logits, torch.float32, dev)
        for streaming in (False, True):
            graph, y_static = moe.capture(x_static, logits=logits_static, streaming=streaming)
            x2 = make_tokens(SEED + 7 + ctx.rank, n, HIDDEN)
            x_static.copy_(to_torch(x2, torch.bfloat16, dev))
            graph.replay()
            moe.check_errors()
            if not np.array_equal(y_static.float().cpu().numpy(), run(moe, x2, logits, streaming=streaming)):
                problems.append(f"graph replay (streaming={streaming}) != eager")
            del graph
    finally:
        moe.close()
    verdict(ctx, not problems, f"{engine}: " + "; ".join(problems))


@pytest.mark.parametrize("engine", ENGINES)
def test_vs_transformers_mixtral(ctx, engine):
    # Mixtral-like routing (softmax top-2, the block's own router) on bf16 weights; the layer quantises them.
    if ctx.world_size > 1 and NUM_EXPERTS % ctx.world_size:
        pytest.skip("experts do not split evenly")
    w_gate, w_up, w_down, router = make_weights(SEED + 8, NUM_EXPERTS, HIDDEN, INTER)
    dev = device_of()
    block = mixtral_block(w_gate, w_up, w_down, router, 2, dev)
    if block is None:
        pytest.skip("transformers' MixtralSparseMoeBlock is not importable here or has an unknown layout")
    n = 256
    moe = MoE(ctx, Experts(*(to_torch(local(ctx, w), torch.bfloat16, dev) for w in (w_gate, w_up, w_down)),
                           expert_dtype="fp8"), RoutingConfig(NUM_EXPERTS, 2), max_tokens=n, engine=engine)
    try:
        x = to_torch(make_tokens(SEED + 9 + ctx.rank, n, HIDDEN), torch.bfloat16, dev)
        y_ref, idx, weights = mixtral_forward(block, x)
        if idx is None:
            y = moe.forward(x, router_weight=to_torch(router, torch.bfloat16, dev))
        else:
            y = moe.forward(x, topk_idx=idx, topk_weights=weights)
        moe.check_errors()
        err = rel_error(y.float().cpu().numpy(), y_ref.float().cpu().numpy())
        # What the fp8 recipe itself costs on these data: the float64 fp8 model against the bf16 model.
        x_np = x.float().cpu().numpy()
        routing = (dict(topk_idx=idx.cpu().numpy(), topk_weights=weights.cpu().numpy()) if idx is not None else
                   dict(router_weight=router))
        deq = [fp8_reference.dequantize_weight_blocks(*fp8_reference.quantize_weight_blocks(w))
               for w in (w_gate, w_up, w_down)]
        model = reference_moe(x_np, w_gate=deq[0], w_up=deq[1], w_down=deq[2], num_topk=2, expert_format="fp8",
                              **routing)
        exact = reference_moe(x_np, w_gate=w_gate, w_up=w_up, w_down=w_down, num_topk=2, x_format="bf16", **routing)
        model_err = rel_error(model.y, exact.y)
        ok = err <= MIXTRAL_TOL and err <= model_err + MIXTRAL_VS_MODEL_TOL
        message = (f"{engine}: relative error vs MixtralSparseMoeBlock {err:.3e} (<= {MIXTRAL_TOL}); the fp8 "
                   f"recipe's float64 model vs the bf16 model: {model_err:.3e} (the layer within "
                   f"{MIXTRAL_VS_MODEL_TOL} of it)")
        print(f"[figure] fp8 layer vs transformers Mixtral (bf16): {message}")
    finally:
        moe.close()
    verdict(ctx, ok, message)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hidden,inter,num_experts,topk", [(128, 128, 2, 1), (384, 256, 8, 8), (512, 640, 4, 3)])
def test_shape_classes(ctx, engine, hidden, inter, num_experts, topk):
    if num_experts % ctx.world_size:
        pytest.skip(f"{num_experts} experts do not split over {ctx.world_size} ranks")
    q, deq, _, _ = checkpoint(SEED + hidden + inter, num_experts, hidden, inter)
    n = 0 if ctx.rank == 1 else 77 + 31 * ctx.rank  # rank 1 (if any) has no tokens
    moe = fp8_layer(ctx, q, engine, 200, num_experts=num_experts, topk=topk)
    try:
        x = make_tokens(SEED + 11 + ctx.rank, n, hidden)
        logits = np.random.default_rng(SEED + 12 + ctx.rank).standard_normal((n, num_experts)).astype(np.float32)
        y = run(moe, x, logits)
        ref = reference_moe(x, w_gate=deq["gate"], w_up=deq["up"], w_down=deq["down"], num_topk=topk, logits=logits,
                            expert_format="fp8")
        err = rel_error(y, ref.y) if n else 0.0
        ok = y.shape == (n, hidden) and bool(np.all(np.isfinite(y))) and err <= REL_TOL
    finally:
        moe.close()
    verdict(ctx, ok, f"{engine} {hidden}x{inter}, {num_experts} experts, top-{topk}, n={n}: error {err:.3e}")


def test_bad_weights_and_options_are_rejected(ctx):
    q, _, (w_gate, w_up, w_down), _ = checkpoint(SEED + 13)
    dev = device_of()
    e = NUM_EXPERTS // ctx.world_size
    fp8 = {n: torch.from_numpy(np.ascontiguousarray(local(ctx, q[n][0])).view(np.uint8)).to(dev).view(
        torch.float8_e4m3fn) for n in q}
    scale = {n: to_torch(local(ctx, q[n][1]), torch.float32, dev) for n in q}
    bf16 = [to_torch(local(ctx, w), torch.bfloat16, dev) for w in (w_gate, w_up, w_down)]
    # (weights, Experts' other fields, the layer's other arguments with the schedule's fields)
    base = dict(w_gate_scale=scale["gate"], w_up_scale=scale["up"], w_down_scale=scale["down"])
    cases = {
        "missing scale": (list(fp8.values()), dict(base, w_down_scale=None)),
        "scale shape": (list(fp8.values()), dict(base, w_gate_scale=scale["gate"][:, :1])),
        "scale dtype": (list(fp8.values()), dict(base, w_up_scale=scale["up"].double())),
        "scale on the CPU": (list(fp8.values()), dict(base, w_down_scale=scale["down"].cpu())),
        "scales with bf16 weights": (bf16, base),
        "mixed weight dtypes": ([fp8["gate"], bf16[1], fp8["down"]], base),
        "weight shape": ([fp8["gate"][:, :128], fp8["up"], fp8["down"]], base),
        "unknown engine": (bf16, {}, dict(engine="cutlass")),
        "engine vs expert_dtype": (bf16, dict(expert_dtype="fp8"), dict(engine="torch")),
        "unknown expert_dtype": (bf16, dict(expert_dtype="int4")),
        "fp8 experts with bf16 dispatch": (bf16, dict(expert_dtype="fp8"), dict(x_format="bf16")),
    }
    problems = []
    for name, (weights, fields, *layer) in cases.items():
        layer = dict(layer[0]) if layer else {}
        engine = layer.pop("engine", "auto")
        try:
            MoE(ctx, Experts(*weights, **fields), RoutingConfig(NUM_EXPERTS, 2), max_tokens=16,
                schedule=ScheduleConfig(**layer), engine=engine).close()
            problems.append(f"{name}: no ConfigError")
        except ConfigError:
            pass
    try:  # inter not a multiple of 128 with fp8 experts
        w = make_weights(SEED, NUM_EXPERTS, HIDDEN, 136)[:3]
        MoE(ctx, Experts(*(to_torch(local(ctx, a), torch.bfloat16, dev) for a in w), expert_dtype="fp8"),
            RoutingConfig(NUM_EXPERTS, 2), max_tokens=16).close()
        problems.append("inter=136: no ConfigError")
    except ConfigError:
        pass
    assert e >= 1
    verdict(ctx, not problems, "; ".join(problems))


@pytest.mark.parametrize("engine", ["torch"] + ENGINES)
def test_out_of_range_expert_id_is_named_and_the_next_call_works(ctx, engine):
    q, deq, (w_gate, w_up, w_down), _ = checkpoint(SEED + 14)
    dev = device_of()
    n = 64
    if engine == "torch":
        moe = MoE(ctx, Experts(*(to_torch(local(ctx, w), torch.bfloat16, dev) for w in (w_gate, w_up, w_down))),
                  RoutingConfig(NUM_EXPERTS, 2), max_tokens=n)
    else:
        moe = fp8_layer(ctx, q, engine, n)
    problems = []
    try:
        x = to_torch(make_tokens(SEED + 15 + ctx.rank, n, HIDDEN), torch.bfloat16, dev)
        idx = torch.randint(0, NUM_EXPERTS, (n, 2), dtype=torch.int32, device=dev)
        w = torch.rand(n, 2, device=dev)
        # The reference of the call after the bad one: the same valid call before it (issue 24, item 6: the
        # next call must equal it bitwise, not merely be finite).
        y_before = moe.forward(x, topk_idx=idx, topk_weights=w).clone()
        moe.check_errors()
        bad = idx.clone()
        bad[17, 1] = 10 ** 6
        moe.forward(x, topk_idx=bad, topk_weights=w)
        try:
            moe.check_errors()
            problems.append("no ConfigError for expert id 10**6")
        except ConfigError as exc:
            if "1000000" not in str(exc) or "token 17" not in str(exc):
                problems.append(f"message does not name the id and token: {exc}")
        ranks(ctx).Barrier()
        y = moe.forward(x, topk_idx=idx, topk_weights=w)
        moe.check_errors()  # the record was cleared: the valid call raises nothing
        if not torch.equal(y.view(torch.int16), y_before.view(torch.int16)):
            rows = int((y.view(torch.int16) != y_before.view(torch.int16)).any(dim=1).sum())
            problems.append(f"the next call's output differs from the same call before the bad one ({rows} rows)")
    finally:
        moe.close()
    verdict(ctx, not problems, f"{engine}: " + "; ".join(problems))


@pytest.mark.parametrize("engine", ENGINES)
def test_fp8_pool_rows_take_half_the_bytes(ctx, engine):
    q, _, (w_gate, w_up, w_down), _ = checkpoint(SEED + 16)
    dev = device_of()
    n = 512
    fp8_moe = fp8_layer(ctx, q, engine, n)
    bf16_moe = MoE(ctx, Experts(*(to_torch(local(ctx, w), torch.bfloat16, dev) for w in (w_gate, w_up, w_down))),
                   RoutingConfig(NUM_EXPERTS, 2), max_tokens=n)
    try:
        pool8, pool16 = fp8_moe.executor.state.pool_x, bf16_moe.executor.state.pool_x
        rows8 = pool8.numel() * pool8.element_size() / fp8_moe.capacity
        rows16 = pool16.numel() * pool16.element_size() / bf16_moe.capacity
        m8, m16 = fp8_moe.memory(), bf16_moe.memory()
        message = (f"{engine}: pool row bytes {rows8:.0f} vs {rows16:.0f}; pool {m8['pool_bytes']} vs "
                   f"{m16['pool_bytes']} bytes; weights {m8['weight_bytes']} vs {m16['weight_bytes']} bytes")
        print(f"[figure] {message}")
        ok = rows8 * 2 == rows16 and m8["weight_bytes"] < 0.6 * m16["weight_bytes"]
    finally:
        fp8_moe.close()
        bf16_moe.close()
    verdict(ctx, ok, message)
