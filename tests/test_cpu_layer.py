"""The CPU layer (ExpertParallelMoE) in one process: messages name the caller's shapes, torch CPU tensors in
and out, and the SYMMRING_DEBUG checks after each call (they pass on a correct call and catch a lost
acknowledgement or a non-finite output that a plain call lets through)."""

from __future__ import annotations

import numpy as np
import pytest

from symmring import ConfigError, ExpertParallelMoE, MoEShapes, ProtocolTimeout, SymmringError, init
from symmring.ring import Ring

SHAPES = MoEShapes(hidden=128, num_experts=4, num_topk=2)


@pytest.fixture(scope="module")
def ctx():
    context = init("host", timeout_s=30.0)
    yield context
    context.close()


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(20261201)
    wg, wu = (rng.standard_normal((4, 32, 128), dtype=np.float32) / 11 for _ in range(2))
    wd = rng.standard_normal((4, 128, 32), dtype=np.float32) / 6
    x = rng.standard_normal((10, 128), dtype=np.float32)
    router = rng.standard_normal((4, 128), dtype=np.float32)
    return dict(wg=wg, wu=wu, wd=wd, x=x, router=router)


@pytest.fixture
def layer(ctx, problem):
    with ExpertParallelMoE(ctx, SHAPES, problem["wg"], problem["wu"], problem["wd"], timeout_s=0.5) as moe:
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
    with ExpertParallelMoE(ctx, SHAPES, problem["wg"], problem["wu"], problem["wd"]) as moe:
        want = moe.forward(problem["x"], router_weight=problem["router"])
        assert isinstance(want, np.ndarray)
    tensors = {k: torch.from_numpy(v) for k, v in problem.items()}
    with ExpertParallelMoE(ctx, SHAPES, tensors["wg"], tensors["wu"], tensors["wd"]) as moe:
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
                               streaming=True, tokens_per_slot=3)
        assert isinstance(streamed, torch.Tensor) and streamed.shape == (10, 128)
        with pytest.raises(ConfigError, match="x.dtype=torch.bfloat16"):
            moe.forward(x.bfloat16(), router_weight=tensors["router"])
        with pytest.raises(ConfigError, match="x.dtype"):
            moe.forward(x.double(), router_weight=tensors["router"])
        if torch.cuda.is_available():
            with pytest.raises(ConfigError, match="expected a CPU tensor"):
                moe.forward(x.cuda(), router_weight=tensors["router"])


def test_debug_checks_pass_on_a_correct_call(layer, problem, monkeypatch):
    calls = []
    original = ExpertParallelMoE._debug_check
    monkeypatch.setattr(ExpertParallelMoE, "_debug_check", lambda self, *a: (calls.append(a[1].num_chunks),
                                                                            original(self, *a)))
    y = layer.forward(problem["x"], router_weight=problem["router"])
    assert calls == []  # off by default
    monkeypatch.setenv("SYMMRING_DEBUG", "1")
    assert _bitwise(layer.forward(problem["x"], router_weight=problem["router"]), y)
    assert _bitwise(layer.forward(problem["x"], router_weight=problem["router"], streaming=True,
                                  tokens_per_slot=3, num_slots=2), y)
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
    kwargs = dict(router_weight=problem["router"], streaming=True, tokens_per_slot=4, num_slots=2)
    layer.forward(problem["x"], **kwargs)  # no check: returns normally
    layer.close()
    with ExpertParallelMoE(layer.ctx, SHAPES, problem["wg"], problem["wu"], problem["wd"], timeout_s=0.3) as fresh:
        monkeypatch.setenv("SYMMRING_DEBUG", "1")
        with pytest.raises(ProtocolTimeout) as info:
            fresh.forward(problem["x"], **kwargs)
        assert info.value.kind == "reuse" and tuple(info.value.missing_ranks) == (0,)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_debug_catches_a_non_finite_output(layer, problem, monkeypatch):
    real_expert = ExpertParallelMoE._expert
    monkeypatch.setattr(ExpertParallelMoE, "_expert",
                        lambda self, i, h: real_expert(self, i, h) * np.float32(np.inf))
    kwargs = dict(router_weight=problem["router"])
    assert not np.isfinite(layer.forward(problem["x"], **kwargs)).all()  # no check: inf goes through
    monkeypatch.setenv("SYMMRING_DEBUG", "1")
    with pytest.raises(SymmringError, match="are not finite"):
        layer.forward(problem["x"], **kwargs)
