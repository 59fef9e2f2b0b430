"""The CPU layer (ExpertParallelMoE, `symmring.MoE` on the host backend) in one process: messages name the
caller's shapes, torch CPU tensors in and out (bf16 and float32), the SYMMRING_DEBUG checks after each call (they
pass on a correct call and catch a lost acknowledgement or a non-finite output that a plain call lets through),
and the GPU layer's routing options (``scoring``, ``n_group``/``topk_group``, ``norm_topk_prob``): rejected before
any collective when bad, and a group-limited forward equal to the reference."""

from __future__ import annotations

import numpy as np
import pytest

from symmring import ConfigError, ExpertParallelMoE, MoE, ProtocolTimeout, SymmringError, init
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig
from symmring.moe.cpu.executor import HostEngine, HostExecutor
from symmring.moe.reference import reference_moe
from symmring.ring import Ring


def build(ctx, p, routing=None, max_tokens=16, **schedule):
    """A CPU layer of ``p``'s experts (4 of them, top-2 unless ``routing``), ``schedule``: `ScheduleConfig` fields."""
    return MoE(ctx, Experts(p["wg"], p["wu"], p["wd"]), routing or RoutingConfig(4, 2), max_tokens=max_tokens,
               schedule=ScheduleConfig(**schedule))


@pytest.fixture(scope="module")
def ctx():
    context = init("host", timeout_s=30.0)
    yield context
    context.close()


def make_problem(seed, num_experts, num_tokens, router_div=1):
    """Seeded experts (inter 32, hidden 128), ``x`` and a router weight; ``rng`` for more draws."""
    rng = np.random.default_rng(seed)
    wg, wu = (rng.standard_normal((num_experts, 32, 128), dtype=np.float32) / 11 for _ in range(2))
    wd = rng.standard_normal((num_experts, 128, 32), dtype=np.float32) / 6
    x = rng.standard_normal((num_tokens, 128), dtype=np.float32)
    router = rng.standard_normal((num_experts, 128), dtype=np.float32) / router_div
    return dict(wg=wg, wu=wu, wd=wd, x=x, router=router, rng=rng)


@pytest.fixture(scope="module")
def problem():
    p = make_problem(20261201, 4, 10)
    del p["rng"]
    return p


@pytest.fixture
def layer(ctx, problem):
    with build(ctx, problem, timeout_s=0.5) as moe:
        assert isinstance(moe, ExpertParallelMoE)
        yield moe


def _bitwise(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(topk_idx=np.zeros((10, 3), np.int32), topk_weights=np.ones((10, 3), np.float32)),
     "topk_idx.shape=(10, 3): expected [num_tokens, num_topk] = (10, 2)"),
    (dict(topk_idx=np.zeros((10, 2), np.int32), topk_weights=np.ones((10, 3), np.float32)),
     "topk_weights.shape=(10, 3): expected"),
    (dict(topk_idx=np.zeros((10, 2), np.int64), topk_weights=np.ones((10, 2), np.float32)),
     "int64 with shape (10, 2)"),
    (dict(logits=np.zeros((10, 5), np.float32)), "logits.shape=(10, 5): expected [num_tokens, num_experts] = (10, 4)"),
    (dict(logits=np.zeros((7, 4), np.float32)), "logits.shape=(7, 4)"),
    (dict(router_weight=np.zeros((4, 64), np.float32)), "router_weight.shape=(4, 64)"),
])
def test_errors_name_the_shape_the_caller_passed(layer, problem, kwargs, message):
    with pytest.raises(ConfigError) as info:
        layer.forward(problem["x"], **kwargs)
    assert message in str(info.value)
    assert "(0, " not in str(info.value), "the message names the zero-row validation slice"
    # The rejected call left the layer usable.
    assert layer.forward(problem["x"], router_weight=problem["router"]).shape == (10, 128)


def test_torch_cpu_tensors_in_and_out(ctx, problem):
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch): the torch-input "
                                                "path of the CPU layer is not exercised")
    want = None
    with build(ctx, problem, tokens_per_slot=3) as moe:
        want = moe.forward(problem["x"], router_weight=problem["router"])
        assert isinstance(want, np.ndarray)
    tensors = {k: torch.from_numpy(v) for k, v in problem.items()}
    with build(ctx, tensors, tokens_per_slot=3) as moe:
        x = tensors["x"]
        got = moe.forward(x, router_weight=tensors["router"])
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.device.type == "cpu"
        assert _bitwise(got.numpy(), want)
        # NumPy x with a torch router: NumPy out (the type follows x).
        assert isinstance(moe.forward(problem["x"], router_weight=tensors["router"]), np.ndarray)
        # A tensor that requires grad and a non-contiguous view are accepted as they are.
        x_grad = x.clone().requires_grad_(True)
        assert _bitwise(moe.forward(x_grad, router_weight=tensors["router"]).numpy(), want)
        x_wide = torch.cat([x, x], dim=1)[:, ::2]
        assert not x_wide.is_contiguous()
        ref_wide = moe.forward(np.ascontiguousarray(x_wide.numpy()), router_weight=problem["router"])
        assert _bitwise(moe.forward(x_wide, router_weight=tensors["router"]).numpy(), ref_wide)
        # topk from torch.topk is int64: named, not silently cast.
        with pytest.raises(ConfigError, match="topk_idx: expected a 2-D int32 array, got 2-D int64 with shape \\(10, 2\\)"):
            moe.forward(x, topk_idx=torch.zeros((10, 2), dtype=torch.int64), topk_weights=torch.ones(10, 2))
        streamed = moe.forward(x, topk_idx=torch.zeros((10, 2), dtype=torch.int32), topk_weights=torch.ones(10, 2),
                               streaming=True)
        assert isinstance(streamed, torch.Tensor) and streamed.shape == (10, 128)
        # bf16 activations (the GPU layer's): exact as float32, the output rounded once to bf16.
        x16 = x.bfloat16()
        y16 = moe.forward(x16, router_weight=tensors["router"].bfloat16())
        ref16 = moe.forward(x16.float(), router_weight=tensors["router"].bfloat16().float())
        assert y16.dtype == torch.bfloat16 and torch.equal(y16, ref16.bfloat16())
        with pytest.raises(ConfigError, match="x.dtype"):
            moe.forward(x.double(), router_weight=tensors["router"])
        if torch.cuda.is_available():
            with pytest.raises(ConfigError, match="expected a CPU tensor"):
                moe.forward(x.cuda(), router_weight=tensors["router"])


def test_debug_checks_pass_on_a_correct_call(layer, problem, monkeypatch):
    calls = []
    original = HostExecutor._debug_check
    monkeypatch.setattr(HostExecutor, "_debug_check", lambda self, *a: (calls.append(a[1].num_chunks),
                                                                       original(self, *a)))
    y = layer.forward(problem["x"], router_weight=problem["router"])
    assert calls == []  # off by default
    monkeypatch.setenv("SYMMRING_DEBUG", "1")
    assert _bitwise(layer.forward(problem["x"], router_weight=problem["router"]), y)
    with build(layer.ctx, problem, tokens_per_slot=3, num_slots=2) as streamed:
        assert _bitwise(streamed.forward(problem["x"], router_weight=problem["router"], streaming=True), y)
    assert calls == [1, 4]


def test_debug_catches_a_lost_acknowledgement(layer, problem, monkeypatch):
    """A consumer that forgets its last ack: a plain call returns (the next call's producer would time
    out); with SYMMRING_DEBUG=1 the call itself raises, naming the rank that did not acknowledge."""
    real_ack = Ring.ack

    def forgetful_ack(ring, call, chunk, src_rank):
        if chunk == call.num_chunks - 1:
            return  # the bug: no acknowledgement of the last chunk
        real_ack(ring, call, chunk, src_rank)

    monkeypatch.setattr(Ring, "ack", forgetful_ack)
    kwargs = dict(router_weight=problem["router"], streaming=True)
    with build(layer.ctx, problem, tokens_per_slot=4, num_slots=2, timeout_s=0.5) as first:
        first.forward(problem["x"], **kwargs)  # no check: returns normally
    with build(layer.ctx, problem, tokens_per_slot=4, num_slots=2, timeout_s=0.3) as fresh:
        monkeypatch.setenv("SYMMRING_DEBUG", "1")
        with pytest.raises(ProtocolTimeout) as info:
            fresh.forward(problem["x"], **kwargs)
        assert info.value.kind == "reuse" and tuple(info.value.missing_ranks) == (0,)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_debug_catches_a_non_finite_output(layer, problem, monkeypatch):
    real_expert = HostEngine.forward
    monkeypatch.setattr(HostEngine, "forward", lambda self, i, h: real_expert(self, i, h) * np.float32(np.inf))
    kwargs = dict(router_weight=problem["router"])
    assert not np.isfinite(layer.forward(problem["x"], **kwargs)).all()  # no check: inf goes through
    monkeypatch.setenv("SYMMRING_DEBUG", "1")
    with pytest.raises(SymmringError, match="are not finite"):
        layer.forward(problem["x"], **kwargs)


# --- routing options (the GPU layer's: scoring, n_group, topk_group, norm_topk_prob) ------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(scoring="softmax", n_group=2), "n_group=2: group-limited routing is defined for scoring='sigmoid_bias'"),
    (dict(scoring="sigmoid_bias", n_group=3), "n_group=3: expected a positive divisor of num_experts=4"),
    (dict(scoring="sigmoid_bias", n_group=2, topk_group=3), "topk_group=3: expected an int in [1, n_group=2]"),
    (dict(scoring="sigmoid_bias", n_group=4, topk_group=2), "n_group=4: groups of 1 expert(s)"),
    (dict(scoring="sigmoid_bias", n_group=2, num_topk=3), "topk=3: expected at most topk_group * num_experts"),
    (dict(norm_topk_prob=0), "norm_topk_prob=0: expected a bool"),
    (dict(scoring="sparsemax"), "scoring='sparsemax': expected one of"),
])
def test_bad_routing_options_rejected_when_the_config_is_made(kwargs, message):
    """The routing options are checked once, by `RoutingConfig` (the GPU layer's rule), before any layer."""
    kwargs = dict(kwargs)
    with pytest.raises(ConfigError) as info:
        RoutingConfig(4, kwargs.pop("num_topk", 2), **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("routing, message", [
    (lambda: RoutingConfig(4, 2, "sigmoid_bias", routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
    (lambda: RoutingConfig(8, 2), "w_gate.shape[0]=4: expected 8 local experts (num_experts=8 over 1 ranks)"),
    (lambda: dict(scoring="softmax"), "expected a symmring.moe.config.RoutingConfig"),
])
def test_bad_routing_rejected_before_any_collective(ctx, problem, monkeypatch, routing, message):
    routing = routing()
    exchanged = []
    real_allgather = ctx.collectives.allgather

    def recording_allgather(value, **kw):
        exchanged.append((kw["what"], value))
        return real_allgather(value, **kw)

    ctx.workspace()  # made before: its agreement is not this layer's
    monkeypatch.setattr(ctx.collectives, "allgather", recording_allgather)
    with pytest.raises(ConfigError) as info:
        MoE(ctx, Experts(problem["wg"], problem["wu"], problem["wd"]), routing, max_tokens=16)
    assert message in str(info.value)
    # The check ran before the first collective of the layer: its one agreement carried the verdict (no spec).
    assert exchanged[-1] == ("MoE: agreement", (str(info.value), None))


@pytest.fixture(scope="module")
def grouped_problem():
    """16 experts in 4 groups of 4, top-4 from the 2 best groups (DeepSeek-V3's routing, scaled down)."""
    p = make_problem(20261215, 16, 24, router_div=11)  # logits of order 1: sigmoid does not saturate
    p["bias"] = (p.pop("rng").standard_normal(16) * 0.1).astype(np.float32)
    return p


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_group_limited_forward_matches_reference(ctx, grouped_problem, norm_topk_prob):
    p = grouped_problem
    options = dict(bias=p["bias"], routed_scaling_factor=2.5, n_group=4, topk_group=2, norm_topk_prob=norm_topk_prob)
    weights = dict(w_gate=p["wg"], w_up=p["wu"], w_down=p["wd"])
    ref = reference_moe(p["x"], num_topk=4, router_weight=p["router"], scoring="sigmoid_bias", x_format="bf16",
                        **weights, **options)
    plain = reference_moe(p["x"], num_topk=4, router_weight=p["router"], scoring="sigmoid_bias", x_format="bf16",
                          **weights, **dict(options, n_group=1, topk_group=1))
    # The group limit decides here: most tokens get other experts than the plain top-4, from <= 2 groups.
    assert (np.sort(ref.topk_idx, 1) != np.sort(plain.topk_idx, 1)).any(1).mean() > 0.3
    assert max(len(set((row // 4).tolist())) for row in ref.topk_idx) <= 2
    routing = RoutingConfig(16, 4, "sigmoid_bias", **options)
    with MoE(ctx, Experts(p["wg"], p["wu"], p["wd"]), routing, max_tokens=24,
             schedule=ScheduleConfig(tokens_per_slot=5)) as layer:
        r = layer.routing
        assert (r.scoring, r.n_group, r.topk_group, r.norm_topk_prob) == ("sigmoid_bias", 4, 2, norm_topk_prob)
        assert r.key() == routing.key()
        y = layer.forward(p["x"], router_weight=p["router"])
        np.testing.assert_allclose(y, ref.y, rtol=1e-5, atol=1e-5 * float(np.abs(ref.y).max()))
        assert _bitwise(layer.forward(p["x"], router_weight=p["router"], streaming=True), y)
    # The routing options are the RoutingConfig only: a flat keyword names the value it belongs to.
    for old in (dict(topk_method="sigmoid_bias"), dict(scoring="sigmoid_bias")):
        with pytest.raises(ConfigError, match="unexpected keyword"):
            MoE(ctx, Experts(p["wg"], p["wu"], p["wd"]), routing, max_tokens=24, **old)
