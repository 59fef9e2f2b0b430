"""The MoE layers' configuration values (`symmring.moe.config`): each validated once, when it is made (a
`ConfigError` naming the field), frozen, and the same value for every consumer: a `RoutingConfig` builds the
CPU layer, and is what `block_spec` / `from_hf` produce for a transformers block."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from symmring import ConfigError, ExpertParallelMoE, init
from symmring.moe import routing as routing_mod
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig
from symmring.protocol import AckPolicy

SEED = 20261202


@pytest.fixture(scope="module")
def ctx():
    context = init("host", timeout_s=30.0)
    yield context
    context.close()


# --- RoutingConfig -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=0, topk=1), "num_experts=0: expected an int >= 1"),
    (dict(num_experts=8.0, topk=1), "num_experts=8.0"),
    (dict(num_experts=8, topk=0), "topk=0: expected an int >= 1"),
    (dict(num_experts=8, topk=9), "topk=9: expected an int in [1, num_experts=8]"),
    (dict(num_experts=8, topk=True), "topk=True"),
    (dict(num_experts=8, topk=2, scoring="sparsemax"), "scoring='sparsemax': expected one of"),
    (dict(num_experts=8, topk=2, n_group=3, scoring="sigmoid_bias"), "n_group=3: expected a positive divisor"),
    (dict(num_experts=8, topk=2, n_group=2), "n_group=2: group-limited routing is defined for scoring='sigmoid_bias'"),
    (dict(num_experts=8, topk=2, n_group=2, topk_group=3, scoring="sigmoid_bias"), "topk_group=3"),
    (dict(num_experts=8, topk=2, norm_topk_prob=1), "norm_topk_prob=1: expected a bool"),
    (dict(num_experts=8, topk=2, routed_scaling_factor="2.5"), "routed_scaling_factor='2.5': expected a number"),
    (dict(num_experts=8, topk=2, scoring="sigmoid_bias", bias=np.zeros(7, np.float32)),
     "bias: expected a float tensor [num_experts=8], got (7,)"),
    (dict(num_experts=8, topk=2, scoring="sigmoid_bias", bias=1.0), "bias: expected a float tensor"),
])
def test_routing_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ConfigError) as info:
        RoutingConfig(**kwargs)
    assert message in str(info.value)


def test_routing_config_is_frozen_and_keeps_the_bias_as_given():
    bias = np.linspace(-1, 1, 8).astype(np.float32)
    r = RoutingConfig(8, 2, "sigmoid_bias", bias=bias, routed_scaling_factor=2.5, n_group=2, topk_group=1)
    assert r.bias is bias and (r.n_group, r.topk_group, r.norm_topk_prob) == (2, 1, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.topk = 4
    # Equality is identity (the bias may be a tensor); key() compares the values.
    twin = RoutingConfig(8, 2, "sigmoid_bias", bias=bias.copy(), routed_scaling_factor=2.5, n_group=2, topk_group=1)
    assert r != twin and r == r and r.key() == twin.key()
    assert r.route_kwargs() == dict(scoring="sigmoid_bias", bias=bias, routed_scaling_factor=2.5, n_group=2,
                                    topk_group=1, norm_topk_prob=True)
    # with_bias validates again.
    with pytest.raises(ConfigError, match="bias"):
        r.with_bias(np.zeros(3, np.float32))


def test_routing_is_checked_once(ctx, monkeypatch):
    """`routing.check_options` runs when the RoutingConfig is made, not again when a layer takes it."""
    calls = []
    real = routing_mod.check_options
    monkeypatch.setattr(routing_mod, "check_options", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    r = RoutingConfig(4, 2, "sigmoid_bias", bias=np.zeros(4, np.float32), n_group=2, topk_group=1)
    assert len(calls) == 1
    rng = np.random.default_rng(SEED)
    wg, wu = (rng.standard_normal((4, 32, 128), dtype=np.float32) / 11 for _ in range(2))
    wd = rng.standard_normal((4, 128, 32), dtype=np.float32) / 6
    with ExpertParallelMoE(ctx, Experts(wg, wu, wd), r, max_tokens=8) as layer:
        assert len(calls) == 1
        assert layer.routing.key() == r.key() and layer.routing.scoring == "sigmoid_bias" and layer.routing.n_group == 2


# --- ScheduleConfig ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_slots=0), "num_slots=0: expected an int >= 1"),
    (dict(tokens_per_slot=-1), "tokens_per_slot=-1"),
    (dict(ack_policy="sometimes"), "ack_policy='sometimes'"),
    (dict(num_slots=2, expert_window=3), "expert_window=3: expected 1 <= expert_window <= num_slots=2"),
    (dict(expert_window=0), "expert_window=0"),
    (dict(expert_window="2"), "expert_window='2'"),
    (dict(x_format="fp16"), "x_format='fp16'"),
    (dict(single_stream=1), "single_stream=1: expected a bool"),
    (dict(timeout_s=0), "timeout_s=0: expected a positive number of seconds"),
    (dict(timeout_s=True), "timeout_s=True"),
    (dict(policy="fast"), "policy='fast': expected a StreamPolicy or None"),
    (dict(small_batch_tokens=-1), "small_batch_tokens=-1: expected an int >= 0"),
    (dict(transport="nvlink"), "transport='nvlink'"),
    (dict(graph_cache=-1), "graph_cache=-1"),
])
def test_schedule_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ConfigError) as info:
        ScheduleConfig(**kwargs)
    assert message in str(info.value)


def test_schedule_config_defaults_and_frozen():
    s = ScheduleConfig()
    assert (s.num_slots, s.tokens_per_slot, s.ack_policy, s.expert_window, s.x_format) == \
        (None, None, AckPolicy.CONSERVATIVE, 1, None)
    assert s.gpu_only_set() == []
    from symmring.moe.config import GRAPH_CACHE_ENTRIES
    assert s.graph_cache == GRAPH_CACHE_ENTRIES
    t = ScheduleConfig(num_slots=np.int64(3), ack_policy="early", expert_window=3, graph_cache=0, transport="rdma:1")
    assert type(t.num_slots) is int and t.ack_policy is AckPolicy.EARLY
    assert t.gpu_only_set() == ["expert_window", "transport", "graph_cache"]
    assert t == ScheduleConfig(num_slots=3, ack_policy=AckPolicy.EARLY, expert_window=3, graph_cache=0,
                               transport="rdma:1")  # plain values compare by value
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.num_slots = 4


# --- Experts -----------------------------------------------------------------------------------------------

def test_experts_give_hidden_and_inter():
    wg = np.zeros((2, 32, 128), np.float32)
    e = Experts(wg, wg, np.zeros((2, 128, 32), np.float32))
    assert (e.num_local_experts, e.inter, e.hidden) == (2, 32, 128) and e.w_gate is wg
    assert Experts(wg, wg, wg, expert_dtype="fp8").gpu_only_set() == ["expert_dtype"]
    with pytest.raises(ConfigError, match=r"w_gate: expected a 3-D tensor .*got \(32, 128\)"):
        Experts(wg[0], wg, wg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.w_up = wg


# --- one RoutingConfig for the CPU layer, from_hf and block_spec -------------------------------------------

def test_block_spec_and_from_hf_give_the_routing_config_a_cpu_layer_takes(ctx):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'transformers>=5,<6')")
    import hf_models  # tests/ is on sys.path (pytest's rootdir insertion)
    from symmring.moe.integrations.hf import block_spec, from_hf
    model, _ = hf_models.tiny_model("deepseek_v3", SEED)
    name, block = next((n, m) for n, m in hf_models.moe_blocks(model))
    spec = block_spec(block, 1)
    r = spec["routing"]
    gate = block.gate
    assert isinstance(r, RoutingConfig)
    assert (r.num_experts, r.topk, r.scoring, r.n_group, r.topk_group, r.norm_topk_prob) == \
        (spec["gate_up_proj"].shape[0], gate.top_k, "sigmoid_bias", gate.num_group, gate.topk_group,
         bool(gate.norm_topk_prob))
    assert r.bias is gate.e_score_correction_bias and r.routed_scaling_factor == float(gate.routed_scaling_factor)
    # from_hf hands the layer this routing (the bias moved to the layer's device).
    seen = {}

    def factory(ctx, experts, routing, **kwargs):
        seen.update(experts=experts, routing=routing, kwargs=kwargs)
        return hf_models.StandInLayer(ctx, experts, routing, **kwargs)

    schedule = ScheduleConfig(num_slots=2)
    module = from_hf(block, SimpleNamespace(rank=0, world_size=1), max_tokens=16, device="cpu",
                     layer_factory=factory, expert_dtype="fp8", schedule=schedule)
    assert isinstance(module.routing, RoutingConfig) and module.routing.key() == r.key()
    assert seen["routing"].key() == r.key() and seen["kwargs"] == dict(max_tokens=16, schedule=schedule)
    assert seen["experts"].expert_dtype == "fp8" and seen["experts"].hidden == spec["hidden"]
    # The same value builds the CPU layer (its float32 experts from the block's).
    I = spec["inter"]
    w13 = spec["gate_up_proj"].detach().float().numpy()
    cpu_routing = r.with_bias(r.bias.detach().float())
    experts = Experts(np.ascontiguousarray(w13[:, :I]), np.ascontiguousarray(w13[:, I:]),
                      spec["down_proj"].detach().float().numpy())
    with ExpertParallelMoE(ctx, experts, cpu_routing, max_tokens=8) as layer:
        assert layer.routing.key() == r.key()
        x = torch.randn(5, spec["hidden"], generator=torch.Generator().manual_seed(SEED)).bfloat16()
        logits = module.router_logits(x).float()
        idx, _ = routing_mod.route(logits, r.topk, **r.route_kwargs())
        y = layer.forward(x.float().numpy(), logits=logits.numpy())
        assert y.shape == (5, spec["hidden"]) and np.isfinite(y).all()
        # The CPU layer routes as torch's reference does with the same RoutingConfig.
        from symmring.moe.reference import select_topk
        ref_idx, _ = select_topk(logits.numpy(), r.topk, r.scoring, bias=cpu_routing.bias.numpy(),
                                 routed_scaling_factor=r.routed_scaling_factor, n_group=r.n_group,
                                 topk_group=r.topk_group, norm_topk_prob=r.norm_topk_prob)
        assert (np.sort(ref_idx, 1) == np.sort(idx.numpy(), 1)).mean() > 0.9


def test_the_gpu_layer_names_where_a_flat_keyword_belongs():
    # Before any device work (no context needed): the old flat keywords are a ConfigError naming their value.
    from symmring.moe.gpu import MoE
    with pytest.raises(ConfigError, match=r"scoring \(a field of RoutingConfig.*x_format \(a field of ScheduleConfig"):
        MoE(None, None, None, max_tokens=8, x_format="bf16", scoring="softmax")
    with pytest.raises(ConfigError, match=r"bogus \(not an argument of MoE\)"):
        MoE(None, None, None, max_tokens=8, bogus=1)


def test_the_test_hooks_misplaced_names_are_the_debug_hooks():
    """`config.misplaced` names a test hook without importing `symmring.moe.debug` (above it): its list is
    the hooks' fields."""
    import dataclasses

    from symmring.moe.config import TEST_HOOKS
    from symmring.moe.debug import Hooks
    assert set(TEST_HOOKS) == {f.name for f in dataclasses.fields(Hooks)}
