"""`symmring.moe.integrations.module.MoEModule`, its custom op and `symmring.moe.integrations.hf` on the CPU.

The GPU layer needs a GPU, so here the module runs a stand-in layer with the same constructor and forward
(`hf_models.StandInLayer`: the layer's routing, `torch_ref`'s experts): what is checked is the module's own
part (router logits as the transformers block computes them, the routing options taken from the block,
this rank's experts, shapes, state_dict, the custom op under FakeTensorMode and torch.compile) and the
routing itself against transformers' routers on real activations, exactly. tests/gpu/test_moe_module.py
runs the real layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from symmring.errors import ConfigError

torch = pytest.importorskip("torch", reason="MoEModule needs torch")

import hf_models  # noqa: E402  (tests/ is on sys.path: pytest's rootdir insertion)

from symmring.moe.integrations.module import MoEModule, STREAMING_CODES, layer_of, moe_op  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

SEED = 20261214
HIDDEN, INTER, E = 256, 256, 16


def ctx_of(rank=0, world_size=1):
    return SimpleNamespace(rank=rank, world_size=world_size)


def make_module(seed=SEED, world_size=1, rank=0, shared=False, routing=None, **kwargs):
    g = torch.Generator().manual_seed(seed)
    local = E // world_size
    w_gate, w_up = (torch.randn(local, INTER, HIDDEN, generator=g).bfloat16() / 16 for _ in range(2))
    w_down = (torch.randn(local, HIDDEN, INTER, generator=g) / 16).bfloat16()
    router = (torch.randn(E, HIDDEN, generator=g) / 8).bfloat16()
    shared_experts = torch.nn.Linear(HIDDEN, HIDDEN, bias=False).bfloat16().requires_grad_(False) if shared else None
    kwargs.setdefault("max_tokens", 64)
    return MoEModule(ctx_of(rank, world_size), Experts(w_gate, w_up, w_down), routing or RoutingConfig(E, 4),
                     router_weight=router, shared_experts=shared_experts, layer_factory=hf_models.StandInLayer,
                     **kwargs)


def tokens(seed, *shape):
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()


# --- the module -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7,), (2, 5), (2, 3, 4), (1, 64), (0,)])
def test_any_leading_shape_is_one_layer_call(shape):
    module = make_module(streaming="auto")
    x = tokens(SEED, *shape)
    with torch.inference_mode():
        y = module(x)
        flat = module(x.reshape(-1, HIDDEN))
    n = int(np.prod(shape))
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert module.layer.calls == [(n, "auto"), (n, "auto")]
    assert int(module.call_token) == 2 and "call_token" not in module.state_dict()  # the op's token counts calls
    assert torch.equal(y.reshape(-1, HIDDEN), flat)
    if n:  # the module's output is the layer's on the module's routing: recompute it here
        logits = torch.nn.functional.linear(x.reshape(-1, HIDDEN), module.router_weight)
        y_ref = module.layer.forward(x.reshape(-1, HIDDEN), logits=logits)
        assert torch.equal(flat, y_ref) and flat.abs().max() > 0


def test_shared_experts_are_added():
    module = make_module(shared=True)
    x = tokens(SEED + 1, 9)
    with torch.no_grad():
        y = module(x)
        routed = module.layer.forward(x, logits=torch.nn.functional.linear(x, module.router_weight))
        assert torch.equal(y, routed + module.shared_experts(x))


def test_router_dtype():
    module = make_module(router_dtype=torch.float32)
    x = tokens(SEED + 2, 5)
    logits, idx, weights = module.route(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(x.float(), module.router_weight.float()))
    assert idx.shape == (5, 4) and weights.dtype == torch.float32


@pytest.mark.parametrize("make_bad,match", [
    (lambda x: x.float(), "hidden_states.dtype=torch.float32: expected torch.bfloat16"),
    (lambda x: x[..., :128], r"expected a tensor \[\.\.\., hidden=256\]"),
    (lambda x: torch.zeros(65, HIDDEN, dtype=torch.bfloat16), "65 tokens, expected at most max_tokens=64"),
    (lambda x: x.clone().requires_grad_(True), "inference-only"),
    (lambda x: x.tolist(), "expected a tensor"),
])
def test_bad_input_rejected(make_bad, match):
    module = make_module()
    x = tokens(SEED, 3, 4)
    with pytest.raises(ConfigError, match=match):
        module(make_bad(x))
    assert module.layer.calls == []
    with torch.no_grad():  # grad off: an input that requires grad is fine
        assert module(x.clone().requires_grad_(True)).shape == x.shape


@pytest.mark.parametrize("kwargs,match", [
    (dict(streaming="yes"), "streaming='yes'"),
    (dict(streaming=1), "streaming=1"),
    (dict(router_dtype="float32"), "router_dtype='float32'"),
    (dict(shared_experts=lambda x: x), "shared_experts: expected a torch.nn.Module"),
    (dict(router_weight=torch.zeros(E, HIDDEN + 1)), "router_weight: expected a float tensor"),
    (dict(routing=dict(num_experts=E, topk=4)), "routing=.*expected a symmring.moe.config.RoutingConfig"),
])
def test_bad_module_arguments_rejected(kwargs, match):
    args = dict(router_weight=torch.zeros(E, HIDDEN), max_tokens=8, layer_factory=hf_models.StandInLayer)
    routing = kwargs.pop("routing", RoutingConfig(E, 4))
    args.update(kwargs)
    w = torch.zeros(E, INTER, HIDDEN)
    with pytest.raises(ConfigError, match=match):  # before the layer is built (its weights are zeros here)
        MoEModule(ctx_of(), Experts(w, w, w.transpose(1, 2)), routing, **args)


def test_layer_kwargs_pass_through():
    schedule = ScheduleConfig(num_slots=2, tokens_per_slot=32)
    routing = RoutingConfig(E, 4, "sigmoid_bias", bias=torch.zeros(E), n_group=4, topk_group=2,
                            routed_scaling_factor=2.5)
    module = make_module(engine="builtin", schedule=schedule, routing=routing)
    assert module.layer.others == dict(engine="builtin", schedule=schedule)
    assert module.routing.n_group == 4 and module.routing.routed_scaling_factor == 2.5


def test_buffers_are_the_layers_tensors_and_state_dict_round_trips():
    a, b = make_module(SEED, router_dtype=None), make_module(SEED + 7)
    w = b.layer.engine.weights
    assert b.w13 is w.w13 and b.w_down is w.w_down  # no second copy of the experts
    keys = set(a.state_dict())
    assert keys == {"router_weight", "w13", "w_down"}
    x = tokens(SEED + 3, 11)
    with torch.no_grad():
        y_a, y_b = a(x), b(x)
    assert not torch.equal(y_a, y_b)
    ptr = w.w13.data_ptr()
    b.load_state_dict(a.state_dict())
    assert b.layer.engine.weights.w13.data_ptr() == ptr and b.layer.refreshed == 1  # in place, then re-derived
    assert b.layer.graphs_cleared == 1  # graphs of the old weights' derived tensors dropped
    with torch.no_grad():
        assert torch.equal(b(x), y_a)
    # The layer's tensors stay where and what they are under .to(); the router follows.
    b.to(torch.float32)
    assert b.w13.dtype == torch.bfloat16 and b.w13.data_ptr() == ptr and b.router_weight.dtype == torch.float32


def test_state_dict_mismatch_rejected():
    a = make_module()
    state = a.state_dict()
    state["w13"] = state["w13"].float()
    with pytest.raises(ConfigError, match=r"state_dict\['w13'\]: torch.float32"):
        a.load_state_dict(state)
    state = a.state_dict()
    state["w_down"] = state["w_down"][:, :, :128]
    with pytest.raises(ConfigError, match=r"state_dict\['w_down'\]"):
        a.load_state_dict(state)
    with pytest.raises(ConfigError, match="assign=True"):
        a.load_state_dict(a.state_dict(), assign=True)


# --- the custom op --------------------------------------------------------------------------------------

def test_op_registered_with_fake_impl():
    op = moe_op()
    assert op is torch.ops.symmring.moe_forward.default
    module = make_module()
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(37, HIDDEN, dtype=torch.bfloat16)
        y = op(x, torch.empty(37, E), torch.zeros(1, dtype=torch.int64), module._handle, STREAMING_CODES[True])
        assert y.shape == (37, HIDDEN) and y.dtype == torch.bfloat16
    assert module.layer.calls == []  # the fake ran, not the layer
    torch.library.opcheck(op, (tokens(SEED, 5), torch.randn(5, E), torch.zeros(1, dtype=torch.int64),
                               module._handle, 0), test_utils=("test_schema", "test_faketensor"))


def test_unknown_handle_and_closed_module():
    module = make_module()
    handle = module._handle
    assert layer_of(handle) is module.layer
    module.close()
    assert module.layer.closed
    with pytest.raises(ConfigError, match=f"handle={handle}"):
        layer_of(handle)
    with pytest.raises(ConfigError, match=f"handle={handle}"):
        moe_op()(tokens(SEED, 2), torch.zeros(2, E), torch.zeros(1, dtype=torch.int64), handle, 0)


@pytest.mark.parametrize("shared", [False, True])
def test_compile_fullgraph_matches_eager(shared):
    module = make_module(shared=shared, router_dtype=torch.float32)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        for seed, shape in ((1, (3, 5)), (2, (4, 7)), (3, (3, 5))):
            x = tokens(SEED + seed, *shape)
            assert torch.equal(compiled(x), module(x))


# --- transformers ---------------------------------------------------------------------------------------

def _needs_transformers():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'transformers>=5,<6')")


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False),
                                         ("deepseek_v3", True), ("deepseek_v3", False)])
def test_replaced_model_routes_as_transformers(family, norm):
    """Every MoE block's input in a real forward: the module's routing == the block's router's, exactly
    (as sets: DeepSeek-V3 takes its top-k unsorted), and the model's logits agree."""
    _needs_transformers()
    reference, _ = hf_models.tiny_model(family, SEED, norm_topk_prob=norm)
    model, _ = hf_models.tiny_model(family, SEED, norm_topk_prob=norm)
    ids = hf_models.input_ids(SEED, 2, 24)
    inputs = {}
    hooks = [block.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0]))
             for name, block in hf_models.moe_blocks(reference)]
    with torch.no_grad():
        want = reference(ids).logits.float()
    for h in hooks:
        h.remove()
    from symmring.moe.integrations.hf import replace_moe_blocks
    replaced = replace_moe_blocks(model, ctx_of(), max_tokens=64, device="cpu", layer_factory=hf_models.StandInLayer)
    assert list(replaced) == [name for name, _ in hf_models.moe_blocks(reference)] and len(replaced) == 2
    blocks = dict(hf_models.moe_blocks(reference))
    with torch.no_grad():
        for name, module in replaced.items():
            x = inputs[name].reshape(-1, inputs[name].shape[-1])
            hf_logits, hf_weights, hf_idx = blocks[name].gate(x)
            logits, idx, weights = module.route(x)
            assert logits.dtype == hf_logits.dtype and torch.equal(logits, hf_logits)
            np.testing.assert_array_equal(np.sort(idx.numpy(), 1), np.sort(hf_idx.numpy(), 1))
            order, hf_order = np.argsort(idx.numpy(), 1), np.argsort(hf_idx.numpy(), 1)
            np.testing.assert_allclose(np.take_along_axis(weights.numpy(), order, 1),
                                       np.take_along_axis(hf_weights.float().numpy(), hf_order, 1),
                                       rtol=4e-3 if family == "qwen3_moe" else 1e-6)
        got = model(ids).logits.float()
    calls = [m.layer.calls for m in replaced.values()]
    assert calls == [[(48, False)]] * 2
    # The stand-in's experts compute as transformers' grouped_mm ones (bitwise on most rows); Qwen3's router
    # also rounds its weights to bf16, which the layer does not.
    err = float((got - want).norm() / want.norm())
    assert err <= (3e-2 if family == "qwen3_moe" else 1e-3), err


def test_from_hf_takes_this_ranks_experts():
    _needs_transformers()
    from symmring.moe.integrations.hf import from_hf
    model, _ = hf_models.tiny_model("deepseek_v3", SEED)
    block = model.model.layers[1].mlp
    module = from_hf(block, ctx_of(rank=1, world_size=2), max_tokens=16, device="cpu",
                     layer_factory=hf_models.StandInLayer, streaming=True)
    assert torch.equal(module.w13, block.experts.gate_up_proj[8:16])
    assert torch.equal(module.w_down, block.experts.down_proj[8:16])
    assert module.router_weight is block.gate.weight or torch.equal(module.router_weight, block.gate.weight)
    assert torch.equal(module.bias, block.gate.e_score_correction_bias.float())
    assert module.shared_experts is block.shared_experts and module.streaming is True
    assert module.layer.expert_begin == 8 and module.router_dtype == torch.float32
    r = module.routing
    assert (r.scoring, r.n_group, r.topk_group, r.routed_scaling_factor) == ("sigmoid_bias", 4, 2, 2.5)


def test_from_hf_rejects_what_it_cannot_run():
    _needs_transformers()
    from symmring.moe.integrations.hf import from_hf, replace_moe_blocks
    model, _ = hf_models.tiny_model("qwen3_moe", SEED)
    block = model.model.layers[0].mlp
    kw = dict(max_tokens=16, device="cpu", layer_factory=hf_models.StandInLayer)
    with pytest.raises(ConfigError, match="Linear is not a supported transformers MoE block"):
        from_hf(torch.nn.Linear(4, 4), ctx_of(), **kw)
    with pytest.raises(ConfigError, match="16 experts, expected a multiple of world_size=3"):
        from_hf(block, ctx_of(world_size=3), **kw)
    with pytest.raises(ConfigError, match="routing: set by the transformers block"):
        from_hf(block, ctx_of(), routing=RoutingConfig(16, 2), **kw)
    with pytest.raises(ConfigError, match="no supported MoE block"):
        replace_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)), ctx_of(), **kw)
    with pytest.raises(ConfigError, match="streaming='sometimes'"):
        from_hf(block, ctx_of(), streaming="sometimes", **kw)
    # A bad second block: nothing is replaced.
    second = model.model.layers[1].mlp
    second.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp: block.experts.act_fn=GELU.*expected SiLU"):
        replace_moe_blocks(model, ctx_of(), **kw)
    assert [n for n, _ in hf_models.moe_blocks(model)] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    with torch.no_grad():
        block.experts.down_proj.data = block.experts.down_proj.data.float()
    with pytest.raises(ConfigError, match=r"block.experts.down_proj.dtype=torch.float32: expected torch.bfloat16"):
        from_hf(block, ctx_of(), **kw)
    with torch.device("meta"):
        meta_model, _ = hf_models.tiny_config("mixtral"), None
        from transformers import AutoModelForCausalLM
        meta = AutoModelForCausalLM.from_config(meta_model)
    with pytest.raises(ConfigError, match="meta device"):
        from_hf(meta.model.layers[0].mlp, ctx_of(), **kw)


def test_compile_fullgraph_through_a_replaced_model():
    """torch.compile(fullgraph=True) traces a whole transformers model through the custom op (no graph
    break) and runs what eager runs."""
    _needs_transformers()
    from symmring.moe.integrations.hf import replace_moe_blocks
    model, _ = hf_models.tiny_model("deepseek_v3", SEED)
    replace_moe_blocks(model, ctx_of(), max_tokens=64, device="cpu", layer_factory=hf_models.StandInLayer)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = hf_models.input_ids(SEED + 1, 2, 16)
    with torch.inference_mode():
        assert torch.equal(compiled(ids).logits, model(ids).logits)


def test_deepseek_renormalisation_matches_transformers_where_scores_underflow():
    """transformers divides DeepSeek-V3's chosen scores by ``sum + 1e-20``: symmring's torch routing and the
    NumPy reference do too (`routing.RENORM_EPS`). Tokens whose chosen sigmoid scores are ~1e-26 (logit -60)
    get weights ~1e-6 there, not 1/topk, and tokens whose scores underflow to 0 (logit -200) get 0, not NaN."""
    _needs_transformers()
    from symmring.moe import routing
    from symmring.moe.reference import select_topk
    model, _ = hf_models.tiny_model("deepseek_v3", SEED)
    gate = model.model.layers[1].mlp.gate.float()
    hidden = gate.weight.shape[1]
    g = torch.Generator().manual_seed(SEED)
    logits = torch.cat([torch.randn(4, E, generator=g) * 2,           # ordinary tokens
                        -60 - torch.rand(4, E, generator=g),           # s ~ 1e-26: the 1e-20 decides the weights
                        torch.full((2, E), -200.0)])                   # s == 0 in float32
    x = torch.zeros(1, hidden)
    x[0, 0] = 1.0
    hf = []
    with torch.no_grad():
        gate.weight.zero_()
        for row in logits:  # logits = x @ W^T = W[:, 0] for this one-hot x: one router call per token
            gate.weight[:, 0] = row
            hf.append(gate(x))
    hf_idx = torch.cat([h[2] for h in hf]).long()
    hf_w = torch.cat([h[1] for h in hf]).float()
    assert torch.isfinite(hf_w).all() and hf_w[4:8].max() < 1e-4 and (hf_w[8:] == 0).all()
    options = dict(bias=gate.e_score_correction_bias.float(), routed_scaling_factor=2.5, n_group=4, topk_group=2)
    idx, w = routing.route(logits, 4, "sigmoid_bias", **options)
    order, hf_order = idx.long().argsort(1), hf_idx.argsort(1)
    assert torch.equal(idx.long().gather(1, order), hf_idx.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), rtol=1e-6, atol=0)
    ref_idx, ref_w = select_topk(logits.numpy(), 4, "sigmoid_bias", bias=options["bias"].numpy(),
                                 routed_scaling_factor=2.5, n_group=4, topk_group=2)
    np.testing.assert_array_equal(np.sort(ref_idx, 1), np.sort(hf_idx.numpy(), 1))
    ref_order = np.argsort(ref_idx, 1)
    np.testing.assert_allclose(np.take_along_axis(ref_w, ref_order, 1), hf_w.gather(1, hf_order).numpy(),
                               rtol=1e-5, atol=0)
    # Without the 1e-20 the underflowing tokens would be 0/0 and the tiny ones 1/topk each (x 2.5).
    assert np.isfinite(ref_w).all() and ref_w[4:8].max() < 1e-4


def test_old_transformers_refused_in_one_line():
    from symmring.errors import BackendError
    from symmring.moe.integrations.hf import TRANSFORMERS_RANGE, check_transformers
    assert check_transformers("5.13.0") == "5.13.0" and check_transformers("5.17.0+local") == "5.17.0+local"
    for old in ("5.12.1", "5.0.0", "4.57.6", "5.12.0.dev0"):
        with pytest.raises(BackendError, match=rf"transformers {old} is installed; symmring.moe.integrations.hf needs "
                                               rf"transformers{TRANSFORMERS_RANGE} \(pip install \"symmring\[hf\]\"\)"):
            check_transformers(old)


# --- the module on the CPU layer (host backend) ------------------------------------------------------------

@pytest.fixture(scope="module")
def host_ctx():
    from symmring.context import init
    context = init("host", timeout_s=30.0)
    yield context
    context.close()


def _host_weights(seed=SEED, local=E):
    g = torch.Generator().manual_seed(seed)
    w_gate, w_up = (torch.randn(local, INTER, HIDDEN, generator=g).bfloat16() / 16 for _ in range(2))
    w_down = (torch.randn(local, HIDDEN, INTER, generator=g) / 16).bfloat16()
    return w_gate, w_up, w_down, (torch.randn(E, HIDDEN, generator=g) / 8).bfloat16()


def test_host_context_builds_the_cpu_layer_and_streams_bitwise(host_ctx):
    """The context picks the layer: HostLayer on the host backend; its streamed calls (chunks of 8 through a
    2-slot ring) equal its batch calls bitwise (the CPU layer is row-independent), and `workspace` is only
    forwarded when given."""
    from symmring.moe.cpu.host_layer import HostLayer
    from symmring.moe.integrations.module import default_layer_factory
    assert default_layer_factory(host_ctx) is HostLayer
    w_gate, w_up, w_down, router = _host_weights()
    batch = MoEModule(host_ctx, Experts(w_gate, w_up, w_down), RoutingConfig(E, 4), router_weight=router,
                      max_tokens=64, workspace=None)
    streamed = MoEModule(host_ctx, Experts(w_gate, w_up, w_down), RoutingConfig(E, 4), router_weight=router,
                         max_tokens=64, schedule=ScheduleConfig(tokens_per_slot=8), streaming=True)
    assert isinstance(batch.layer, HostLayer) and batch.device == torch.device("cpu")
    x = tokens(SEED + 5, 3, 9)
    with torch.inference_mode():
        y, y_streamed = batch(x), streamed(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.abs().max() > 0
    assert torch.equal(y, y_streamed)
    assert streamed.layer.last_stats.num_chunks == 4 and batch.layer.last_stats.num_chunks == 1
    assert batch.layer.layer is batch.layer  # HostLayer's inner layer: the layer itself now
    batch.close(), streamed.close()


@pytest.mark.parametrize("kwargs,match", [
    (dict(engine="builtin"), "engine: options of the GPU layer"),
    (dict(expert_dtype="fp8", schedule=dict(graph_cache=0)),
     "experts.expert_dtype, schedule.graph_cache: options of the GPU layer"),
    (dict(no_such_option=1), r"no_such_option \(not an argument of MoE\)"),
    (dict(x_format="bf16"), r"x_format \(a field of ScheduleConfig: pass ScheduleConfig\(x_format=...\)\)"),
    (dict(max_tokens_per_rank=8), r"max_tokens_per_rank \(not an argument of MoE\)"),
    (dict(schedule=dict(x_format="fp16")), "x_format='fp16'"),
    (dict(schedule=dict(tokens_per_slot=0)), "tokens_per_slot=0"),
    (dict(w_gate="int"), r"w_gate: expected a float CPU tensor or a float32 NumPy array, got torch.int32 on cpu"),
])
def test_host_layer_bad_arguments(host_ctx, kwargs, match):
    """Issue 34: the CPU layer takes the GPU layer's values and reports the same errors; a flat keyword names the
    value it belongs to (the code before said "unexpected argument" and no more)."""
    from symmring.moe.cpu.host_layer import HostLayer
    w_gate, w_up, w_down, _ = _host_weights()
    if kwargs.get("w_gate") == "int":
        kwargs = dict(w_gate=w_gate.int())
    args = dict(w_gate=w_gate, w_up=w_up, w_down=w_down)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args or k == "expert_dtype"})
    with pytest.raises(ConfigError, match=match):  # a bad config value is refused when it is made
        if "schedule" in kwargs:
            kwargs["schedule"] = ScheduleConfig(**kwargs["schedule"])
        HostLayer(host_ctx, Experts(**args), RoutingConfig(E, 4), max_tokens=8, **kwargs)


def test_host_layer_reloads_weights(host_ctx):
    """load_state_dict copies into the layer's bf16 tensors in place and the CPU layer re-derives its float
    operands: a module loaded with another module's state computes what that module computes, bitwise."""
    a_w, b_w = _host_weights(SEED), _host_weights(SEED + 1)
    a = MoEModule(host_ctx, Experts(*a_w[:3]), RoutingConfig(E, 4), router_weight=a_w[3], max_tokens=16)
    b = MoEModule(host_ctx, Experts(*b_w[:3]), RoutingConfig(E, 4), router_weight=b_w[3], max_tokens=16)
    x = tokens(SEED + 6, 10)
    with torch.inference_mode():
        y_a, y_b = a(x), b(x)
    assert not torch.equal(y_a, y_b)
    b.load_state_dict(a.state_dict())
    with torch.inference_mode():
        assert torch.equal(b(x), y_a)
    a.close(), b.close()


def test_gpu_layer_and_bench_without_torch_name_the_extra(tmp_path):
    """Without torch, `symmring.moe.gpu.MoE`, `MoEModule` and ``bench moe`` fail in one line naming the extra."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\n"
            "from symmring.moe.gpu import MoE\n"
            "from symmring.moe import MoEModule\n"
            "for build in (lambda: MoE(None, None, None, max_tokens=8),\n"
            "              lambda: MoEModule(None, None, None, router_weight=None, max_tokens=8)):\n"
            "    try:\n"
            "        build()\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__, exc)\n"
            "from symmring.__main__ import main\n"
            "print('status', main(['bench', 'moe']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[2] == "status 2", run.stdout + run.stderr
    for line in lines[:2]:
        assert line.startswith("BackendError symmring.moe.") and 'pip install "symmring[gpu]"' in line \
            and '"symmring[cpu]"' in line, line
    assert 'bench moe: needs torch with CUDA: torch is not installed (pip install "symmring[gpu]")' in run.stderr


def test_module_built_under_inference_mode_runs_under_no_grad():
    """The call token is a normal tensor even when the module is built under inference_mode, so a later call
    under no_grad may write it (an inference tensor refuses in-place writes outside inference mode)."""
    with torch.inference_mode():
        module = make_module()
    x = tokens(SEED + 8, 4)
    with torch.no_grad():
        module(x)
    with torch.inference_mode():
        module(x)
    assert int(module.call_token) == 2 and not module.call_token.is_inference()


class _Fp8StandIn(hf_models.StandInLayer):
    """The stand-in with fp8 experts, as the GPU layer's fp8 engines keep them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        w = self.engine.weights
        w.w13, w.w_down = w.w13.to(torch.float8_e4m3fn), w.w_down.to(torch.float8_e4m3fn)


def test_transformers_names_refuse_bf16_experts_into_fp8_and_bad_names():
    """A module with the transformers block's names takes the block's bf16 experts only into bf16 experts:
    into an fp8 engine's it is a ConfigError naming the engine (nothing is loaded); an unknown
    checkpoint_names is a ConfigError before the layer is built."""
    _needs_transformers()
    from symmring.moe.integrations.hf import from_hf
    model, _ = hf_models.tiny_model("mixtral", SEED)
    block = model.model.layers[0].mlp
    module = from_hf(block, ctx_of(), max_tokens=16, device="cpu", layer_factory=_Fp8StandIn)
    before = module.w13.clone()
    with pytest.raises(ConfigError, match=r"state_dict\['experts.gate_up_proj'\]: bf16 transformers experts, but "
                                          r"the layer keeps torch.float8_e4m3fn experts \(engine=stand-in\)"):
        module.load_state_dict(block.state_dict())
    assert torch.equal(module.w13.view(torch.uint8), before.view(torch.uint8))
    with pytest.raises(ConfigError, match="checkpoint_names='transformers': expected one of"):
        make_module(checkpoint_names="transformers")
