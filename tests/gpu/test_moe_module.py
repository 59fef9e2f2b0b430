"""MoEModule, from_hf / replace_moe_blocks and torch.compile on the GPU layer (issue #14 items 2-4).

Small random transformers models of each family (tests/hf_models.py: hidden 256, moe inter 256, 16 experts,
top-4, two MoE layers; DeepSeek-V3 with a dense first layer, one shared expert and n_group=4 / topk_group=2),
with every MoE block replaced by the layer, for the bf16 engine (``engine="torch"``, bf16 dispatch) and the
built-in fp8 engine (``engine="builtin"``, fp8 dispatch). With several PEs each rank owns 16 / R experts and
runs its own batch. Run with ``-s`` to see the measured errors (lines starting ``hf-moe``).

Bounds (relative error ``||a - b|| / ||b||``):

* **each block on the block's own input** (the transformers block's input in the reference forward): bf16
  <= 1e-2 (bf16 rounding in another order; Qwen3's router also rounds its weights to bf16, ~3e-3), fp8
  <= 8e-2 (e4m3 on x and the weights costs 6.3-6.4e-2 on this data: a float model of the fp8 recipe on the
  CPU measured that; tests/gpu/test_moe_fp8.py has the same bound against the Mixtral block);
* **the model's logits**: bf16 <= 6e-2, fp8 <= 3.5e-1. In these random models the MoE output carries most
  of the residual stream, so a block's error reaches the logits almost whole, and it moves the second MoE
  layer's router input, which flips near-tie routing choices: the CPU float model of the fp8 recipe gives
  0.11-0.23 on the logits for 6.4e-2 per block. The per-block bound is the one that checks the layer;
* **the routing**: the module's experts for each block input == the transformers router's (as sets) on
  every token whose top-k boundary is not a tie (at least 90 % of them); exact equality on all tokens is
  asserted on the CPU (tests/test_moe_module.py);
* **torch.compile(fullgraph=True)** of a module (inductor) == eager **bitwise** (the router GEMM and the
  layer's kernels are the same; DeepSeek-V3's shared experts are left out there, as inductor fuses their
  SwiGLU in float32: that module is checked within 1e-2), and a CUDA graph of the compiled module, replayed
  on new inputs copied in, == eager bitwise; the whole compiled model's logits within 1.5e-1 of eager.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason
pytest.importorskip("transformers", reason="needs transformers 5.x (pip install 'transformers>=5,<6')")
pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: hf_models
import hf_models  # noqa: E402
from moe_helpers import cuda_device as device_of, verdict  # noqa: E402

from symmring.moe.integrations.hf import from_hf, replace_moe_blocks  # noqa: E402
from symmring.moe.config import ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261214))
ENGINES = {"torch": dict(engine="torch", schedule=ScheduleConfig(x_format="bf16")), "builtin": dict(engine="builtin")}
BLOCK_TOL = {"torch": 1e-2, "builtin": 8e-2}
# Measured on the H200 (2026-12-01): bf16 logits up to 3.7e-2 (Qwen3-MoE; its blocks 3.2e-3), so 6e-2.
LOGITS_TOL = {"torch": 6e-2, "builtin": 3.5e-1}
# The compiled whole model vs eager: 9.1e-2 measured (DeepSeek-V3: inductor's bf16 fusions of the non-MoE
# parts flip near-tie routing choices downstream); the compiled module alone is bitwise (test above).
COMPILED_MODEL_TOL = 1.5e-1
MAX_TOKENS = 256
BATCH, SEQ = 2, 64


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def untied(block, x):
    """Mask of the tokens whose top-k boundary is no tie in the transformers router's own selection key."""
    from symmring.moe.integrations.hf import block_family
    logits, _, _ = block.gate(x)
    key = logits.float()
    if block_family(block) == "deepseek_v3":
        key = key.sigmoid() + block.gate.e_score_correction_bias.float()
    top = torch.topk(key, block.gate.top_k + 1, dim=-1)[0]
    return top[:, -2] != top[:, -1]


def batch_of(ctx, seed):
    return hf_models.input_ids(seed + 1000 * ctx.rank, BATCH, SEQ).to(device_of())


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_replaced_model_matches_transformers(ctx, family, engine):
    dev = device_of()
    reference, _ = hf_models.tiny_model(family, SEED, device=dev)
    model, _ = hf_models.tiny_model(family, SEED, device=dev)
    ids = batch_of(ctx, SEED)
    inputs = {}
    hooks = [b.register_forward_pre_hook(lambda m, a, name=n: inputs.__setitem__(name, a[0]))
             for n, b in hf_models.moe_blocks(reference)]
    with torch.no_grad():
        want = reference(ids).logits.float()
    for h in hooks:
        h.remove()
    replaced = replace_moe_blocks(model, ctx, max_tokens=MAX_TOKENS, **ENGINES[engine])
    problems, report = [], []
    try:
        with torch.no_grad():
            got = model(ids).logits.float()
            blocks = dict(hf_models.moe_blocks(reference))
            for name, module in replaced.items():  # the same order on every rank: each call is collective
                x = inputs[name]
                err = rel(module(x).float(), blocks[name](x).float())
                report.append(f"{name} {err:.3e}")
                if not err <= BLOCK_TOL[engine]:
                    problems.append(f"{name}: block error {err:.3e} > {BLOCK_TOL[engine]}")
                flat = x.reshape(-1, x.shape[-1])
                _, idx, _ = module.route(flat)
                _, _, hf_idx = blocks[name].gate(flat)
                same = (idx.sort(-1)[0] == hf_idx.to(torch.int32).sort(-1)[0]).all(-1)
                free = untied(blocks[name], flat)
                if free.float().mean() < 0.9 or not bool(same[free].all()):
                    problems.append(f"{name}: routing differs on {int((~same[free]).sum())} untied tokens "
                                    f"({int(free.sum())} untied of {flat.shape[0]})")
        logits_err = rel(got, want)
        max_err = float((got - want).abs().max() / want.abs().max())
        if not logits_err <= LOGITS_TOL[engine]:
            problems.append(f"logits error {logits_err:.3e} > {LOGITS_TOL[engine]}")
        print(f"hf-moe {family} engine={engine} rank={ctx.rank}/{ctx.world_size}: logits rel error (norm) "
              f"{logits_err:.3e}, max |diff| / max |ref| {max_err:.3e}; blocks: {', '.join(report)}", flush=True)
    finally:
        for module in replaced.values():
            module.close()
    verdict(ctx, not problems, "; ".join(problems))


def _first_module(ctx, family, engine, seed=SEED, **kwargs):
    model, _ = hf_models.tiny_model(family, seed, device=device_of())
    name, block = hf_models.moe_blocks(model)[0]
    return from_hf(block, ctx, max_tokens=MAX_TOKENS, **ENGINES[engine], **kwargs), block


def _tokens(seed, n=BATCH * SEQ):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(BATCH, n // BATCH, 256, generator=g).to(device=device_of(), dtype=torch.bfloat16)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_compile_and_cuda_graph_bitwise(ctx, family, engine):
    module, block = _first_module(ctx, family, engine)
    problems = []
    try:
        shared = module.shared_experts
        with torch.no_grad():
            if shared is not None:  # the full DeepSeek-V3 module: inductor fuses the shared SwiGLU in float32
                x = _tokens(SEED + ctx.rank)
                full = torch.compile(module, fullgraph=True)
                err = rel(full(x).float(), module(x).float())
                print(f"hf-moe compile {family} engine={engine}: with shared experts, compiled vs eager {err:.3e}")
                if not err <= 1e-2:
                    problems.append(f"compiled module with shared experts: {err:.3e} > 1e-2")
                torch._dynamo.reset()
                module.shared_experts = None
            compiled = torch.compile(module, fullgraph=True)
            for seed in (1, 2):
                x = _tokens(SEED + 10 * seed + ctx.rank)
                if not torch.equal(compiled(x), module(x)):
                    problems.append(f"compiled != eager (seed {seed})")
            # CUDA graph of the compiled module: warm up on a side stream, capture, replay on new inputs.
            x_static = _tokens(SEED + 100 + ctx.rank)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    compiled(x_static)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_static = compiled(x_static)
            for seed in range(3):
                x_new = _tokens(SEED + 200 + 10 * seed + ctx.rank)
                x_static.copy_(x_new)
                graph.replay()
                y_eager = module(x_new)
                torch.cuda.synchronize()
                if not torch.equal(y_static, y_eager):
                    diff = (y_static.float() - y_eager.float()).abs().max().item()
                    problems.append(f"graph replay {seed} != eager (max |diff| {diff:.3e})")
            module.layer.check_errors()
            module.shared_experts = shared
    finally:
        torch._dynamo.reset()
        module.close()
    verdict(ctx, not problems, "; ".join(problems))


@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_compiled_model_fullgraph(ctx, family):
    """The whole replaced transformers model under torch.compile(fullgraph=True): no graph break, and its
    logits within COMPILED_MODEL_TOL of eager (inductor fuses RMSNorm, attention and the shared experts differently)."""
    dev = device_of()
    model, _ = hf_models.tiny_model(family, SEED, device=dev)
    replaced = replace_moe_blocks(model, ctx, max_tokens=MAX_TOKENS, **ENGINES["torch"])
    problems = []
    try:
        ids = batch_of(ctx, SEED + 5)
        with torch.no_grad():
            eager = model(ids).logits.float()
            compiled = torch.compile(model, fullgraph=True)(ids).logits.float()
        err = rel(compiled, eager)
        print(f"hf-moe compiled model {family}: logits compiled vs eager {err:.3e}", flush=True)
        if not err <= COMPILED_MODEL_TOL:
            problems.append(f"compiled model logits {err:.3e} > {COMPILED_MODEL_TOL}")
    finally:
        torch._dynamo.reset()
        for module in replaced.values():
            module.close()
    verdict(ctx, not problems, "; ".join(problems))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_state_dict_round_trip_and_no_second_copy(ctx, engine):
    a, _ = _first_module(ctx, "mixtral", engine, seed=SEED)
    b, _ = _first_module(ctx, "mixtral", engine, seed=SEED + 1)
    problems = []
    try:
        w = b.layer.engine.weights
        for name in ("w13", "w_down", "w13_scale", "w_down_scale"):
            if getattr(w, name) is not None and getattr(b, name).data_ptr() != getattr(w, name).data_ptr():
                problems.append(f"buffer {name} is not the layer's tensor")
        ptr = w.w13.data_ptr()
        x = _tokens(SEED + 7 + ctx.rank)
        with torch.no_grad():
            y_a, y_b = a(x), b(x)
            b.load_state_dict(a.state_dict())
            y_loaded = b(x)
        if torch.equal(y_a, y_b):
            problems.append("two seeds gave the same output")
        if not torch.equal(y_loaded, y_a):
            problems.append("after load_state_dict the module's output is not the source module's")
        if b.layer.engine.weights.w13.data_ptr() != ptr:
            problems.append("load_state_dict replaced the layer's tensor")
    finally:
        a.close()
        b.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_streaming_option_passes_through(ctx):
    """streaming=True with one expert window over the call is bitwise the batch module (MOE_STREAMED.md)."""
    batch, _ = _first_module(ctx, "qwen3_moe", "builtin")
    streamed, _ = _first_module(ctx, "qwen3_moe", "builtin", streaming=True, schedule=ScheduleConfig(
        num_slots=2, tokens_per_slot=MAX_TOKENS // 2, expert_window=2))
    problems = []
    try:
        x = _tokens(SEED + 9 + ctx.rank, n=MAX_TOKENS)
        with torch.inference_mode():
            y_batch, y_streamed = batch(x), streamed(x)
        if not streamed.layer.last_plan.streaming or batch.layer.last_plan.streaming:
            problems.append("the schedules were not the ones asked for")
        if not torch.equal(y_batch, y_streamed):
            problems.append("streamed != batch")
    finally:
        batch.close()
        streamed.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_grad_enabled_input_rejected(ctx):
    from symmring.errors import ConfigError
    module, _ = _first_module(ctx, "mixtral", "torch")
    try:
        x = _tokens(SEED).requires_grad_(True)
        with pytest.raises(ConfigError, match="inference-only"):
            module(x)
        with pytest.raises(ConfigError, match="expected torch.bfloat16"):
            module(x.detach().float())
    finally:
        module.close()
