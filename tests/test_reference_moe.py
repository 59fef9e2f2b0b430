"""The reference MoE, its TopK variants and the fp8/bf16 formats, against independent implementations.

The independent MoE below is written differently on purpose: one token at a time, Python sorting for
TopK, ``math.exp``, float64 throughout without the float32 roundings of the contract. So agreement is
checked with a float32 tolerance; quantisation and row independence are checked bitwise.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from symmring.errors import ConfigError
from symmring.moe import quant
from symmring.moe.reference import (combine_rows, reference_moe, route, row_matmul, router_logits,
                                    select_topk, swiglu, transposed_f64)

SEED = 20261129


def make_weights(rng, num_experts, inter, hidden):
    scale = 1 / math.sqrt(hidden)
    w_gate = (rng.standard_normal((num_experts, inter, hidden)) * scale).astype(np.float32)
    w_up = (rng.standard_normal((num_experts, inter, hidden)) * scale).astype(np.float32)
    w_down = (rng.standard_normal((num_experts, hidden, inter)) / math.sqrt(inter)).astype(np.float32)
    return w_gate, w_up, w_down


def naive_topk(logit_row, num_topk, method, bias, scaling):
    """One token's TopK with Python sorting and math.exp (ties: lower expert id first)."""
    num_experts = len(logit_row)
    if method == "softmax":
        top = max(logit_row)
        exps = [math.exp(float(v) - top) for v in logit_row]
        probs = [e / sum(exps) for e in exps]
        keys = [float(v) for v in logit_row]
    else:
        probs = [1 / (1 + math.exp(-float(v))) for v in logit_row]
        keys = [p + float(b) for p, b in zip(probs, bias)]
    chosen = sorted(range(num_experts), key=lambda e: (-keys[e], e))[:num_topk]
    total = sum(probs[e] for e in chosen)
    weights = [probs[e] / total * (scaling if method == "sigmoid_bias" else 1.0) for e in chosen]
    return chosen, weights


def naive_moe(x_deq, idx, weights, w_gate, w_up, w_down):
    """y in float64, one token and one k at a time; masked (-1) entries skipped."""
    num_tokens, hidden = x_deq.shape
    y = np.zeros((num_tokens, hidden))
    for t in range(num_tokens):
        h = x_deq[t].astype(np.float64)
        for k in range(idx.shape[1]):
            expert = int(idx[t, k])
            if expert < 0:
                continue
            inter = w_gate.shape[1]
            act = np.empty(inter)
            for i in range(inter):
                g = float(np.dot(w_gate[expert, i].astype(np.float64), h))
                u = float(np.dot(w_up[expert, i].astype(np.float64), h))
                act[i] = g / (1 + math.exp(-g)) * u
            out = np.array([np.dot(w_down[expert, j].astype(np.float64), act) for j in range(hidden)])
            y[t] += float(weights[t, k]) * out
    return y


def assert_close_f32(actual, expected, what):
    """float32 tolerance: rtol 1e-5, atol 1e-5 of the largest magnitude (cancellation near 0)."""
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


# --- the reference layer against the independent one --------------------------------------------------

@pytest.mark.parametrize("method", ["softmax", "sigmoid_bias"])
@pytest.mark.parametrize("x_format", ["fp8_e4m3", "bf16"])
@pytest.mark.parametrize("num_topk", [1, 3])
def test_reference_matches_independent(method, x_format, num_topk):
    rng = np.random.default_rng([SEED, num_topk, len(method), len(x_format)])
    num_tokens, hidden, num_experts, inter = 12, 256, 6, 24
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    router_weight = (rng.standard_normal((num_experts, hidden)) / 8).astype(np.float32)
    bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32) if method == "sigmoid_bias" else None
    scaling = 2.5 if method == "sigmoid_bias" else 1.0
    w_gate, w_up, w_down = make_weights(rng, num_experts, inter, hidden)
    res = reference_moe(x, w_gate=w_gate, w_up=w_up, w_down=w_down, num_topk=num_topk,
                        router_weight=router_weight, scoring=method, bias=bias,
                        routed_scaling_factor=scaling, x_format=x_format)
    logits64 = x.astype(np.float64) @ router_weight.astype(np.float64).T
    assert_close_f32(res.logits, logits64, "router logits")
    for t in range(num_tokens):
        chosen, weights = naive_topk(res.logits[t], num_topk, method,
                                     bias if bias is not None else np.zeros(num_experts), scaling)
        assert res.topk_idx[t].tolist() == chosen, f"token {t}"
        np.testing.assert_allclose(res.topk_weights[t], weights, rtol=1e-6, err_msg=f"token {t}")
    y = naive_moe(res.x_deq, res.topk_idx, res.topk_weights, w_gate, w_up, w_down)
    assert_close_f32(res.y, y, "y")
    assert res.y.dtype == np.float32 and res.y.shape == (num_tokens, hidden)


def test_masked_entries_contribute_nothing():
    rng = np.random.default_rng([SEED, 1])
    num_tokens, hidden, num_experts, inter, num_topk = 10, 128, 5, 16, 3
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    w_gate, w_up, w_down = make_weights(rng, num_experts, inter, hidden)
    idx = rng.integers(0, num_experts, (num_tokens, num_topk)).astype(np.int32)
    weights = rng.random((num_tokens, num_topk), dtype=np.float32)
    masked = rng.random((num_tokens, num_topk)) < 0.4
    masked[3] = True  # one token with every entry masked
    idx_masked = np.where(masked, -1, idx).astype(np.int32)
    kw = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, num_topk=num_topk)
    res = reference_moe(x, topk_idx=idx_masked, topk_weights=weights, **kw)
    # A masked entry is the same as any expert with weight 0 (0 * out adds exactly +0).
    zeroed = reference_moe(x, topk_idx=idx, topk_weights=np.where(masked, 0, weights).astype(np.float32), **kw)
    np.testing.assert_array_equal(res.y, zeroed.y)
    assert np.all(res.y[3] == 0)
    assert np.all(res.expert_out[masked] == 0)
    assert_close_f32(res.y, naive_moe(res.x_deq, idx_masked, weights, w_gate, w_up, w_down), "masked y")


# --- TopK properties ----------------------------------------------------------------------------------

def test_softmax_topk_properties():
    rng = np.random.default_rng([SEED, 2])
    logits = rng.standard_normal((200, 16), dtype=np.float32)
    logits[:20, 5] = logits[:20, 9] = 3.0  # exact ties: expert 5 must come before 9
    idx, weights = select_topk(logits, 4, "softmax")
    assert idx.dtype == np.int32 and weights.dtype == np.float32
    for t in range(logits.shape[0]):
        chosen = logits[t, idx[t]]
        rest = np.delete(logits[t], idx[t])
        assert chosen.min() >= rest.max()
        assert np.all(np.diff(chosen) <= 0), "experts listed in decreasing logit"
        assert len(set(idx[t].tolist())) == 4
    assert idx[:20, 0].tolist() == [5] * 20 and idx[:20, 1].tolist() == [9] * 20
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    # Renormalised softmax over the chosen experts = softmax of their logits.
    chosen = np.take_along_axis(logits, idx, axis=1).astype(np.float64)
    expect = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    np.testing.assert_allclose(weights, expect / expect.sum(axis=1, keepdims=True), rtol=1e-6)


def test_sigmoid_bias_topk_properties():
    rng = np.random.default_rng([SEED, 3])
    logits = rng.standard_normal((200, 16), dtype=np.float32)
    bias = (rng.standard_normal(16) * 0.5).astype(np.float32)
    idx, weights = select_topk(logits, 4, "sigmoid_bias", bias=bias, routed_scaling_factor=2.5)
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    key = scores + bias
    for t in range(logits.shape[0]):
        assert key[t, idx[t]].min() >= np.delete(key[t], idx[t]).max()
    np.testing.assert_allclose(weights.sum(axis=1), 2.5, rtol=1e-6)
    # Weights come from the unbiased scores of the chosen experts.
    chosen = np.take_along_axis(scores, idx, axis=1)
    np.testing.assert_allclose(weights, 2.5 * chosen / chosen.sum(axis=1, keepdims=True), rtol=1e-6)
    # The bias changes the selection: a huge bias on expert 7 puts it first everywhere.
    bias2 = np.zeros(16, np.float32)
    bias2[7] = 10
    idx2, _ = select_topk(logits, 4, "sigmoid_bias", bias=bias2)
    assert np.all(idx2[:, 0] == 7)
    # Ties in score + bias: lower expert id first.
    flat = np.zeros((3, 8), np.float32)
    assert select_topk(flat, 3, "sigmoid_bias")[0].tolist() == [[0, 1, 2]] * 3


@pytest.mark.parametrize("bad, match", [
    (dict(num_topk=0), "num_topk"), (dict(num_topk=9), "num_topk"), (dict(scoring="relu"), "scoring='relu'"),
    (dict(bias=np.zeros(3, np.float32), scoring="sigmoid_bias"), "bias.shape"),
    (dict(bias=np.zeros(8, np.float32)), "bias"), (dict(routed_scaling_factor=-1.0, scoring="sigmoid_bias"),
                                                   "routed_scaling_factor"),
])
def test_select_topk_rejects(bad, match):
    args = dict(num_topk=2, scoring="softmax")
    args.update(bad)
    with pytest.raises(ConfigError, match=match):
        select_topk(np.zeros((2, 8), np.float32), args.pop("num_topk"), **args)


def test_reference_takes_the_routing_configs_names():
    """Issue 34: ``reference_moe`` takes ``scoring=`` as `RoutingConfig` does; ``topk_method=``, its former name,
    still works (a DeprecationWarning) and is refused beside a different ``scoring``."""
    rng = np.random.default_rng([SEED, 9])
    w_gate, w_up, w_down = make_weights(rng, 4, 8, 128)
    x = rng.standard_normal((3, 128), dtype=np.float32)
    weights = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, num_topk=2, logits=x[:, :4].copy(),
                   bias=np.zeros(4, np.float32))
    y = reference_moe(x, scoring="sigmoid_bias", **weights).y
    with pytest.warns(DeprecationWarning, match="topk_method= is the former name of scoring="):
        assert np.array_equal(reference_moe(x, topk_method="sigmoid_bias", **weights).y, y)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="the same option twice"):
        reference_moe(x, scoring="sigmoid_bias", topk_method="softmax", **weights)


def test_bad_inputs_are_named():
    rng = np.random.default_rng([SEED, 4])
    w_gate, w_up, w_down = make_weights(rng, 4, 8, 128)
    x = rng.standard_normal((3, 128), dtype=np.float32)
    kw = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, num_topk=2)
    with pytest.raises(ConfigError, match="logits"):
        select_topk(np.full((1, 4), np.nan, np.float32), 1)
    with pytest.raises(ConfigError, match="routing"):
        reference_moe(x, **kw)
    with pytest.raises(ConfigError, match="topk_idx"):
        reference_moe(x, topk_idx=np.full((3, 2), 4, np.int32), topk_weights=np.ones((3, 2), np.float32), **kw)
    with pytest.raises(ConfigError, match="topk_idx"):
        reference_moe(x, topk_idx=np.zeros((3, 2), np.int64), topk_weights=np.ones((3, 2), np.float32), **kw)
    with pytest.raises(ConfigError, match="w_down"):
        reference_moe(x, logits=np.zeros((3, 4), np.float32), **dict(kw, w_down=w_down[:, :, :4]))
    with pytest.raises(ConfigError, match="x.shape"):
        reference_moe(x[:, :64], logits=np.zeros((3, 4), np.float32), **kw)
    with pytest.raises(ConfigError, match="x.dtype"):
        reference_moe(x.astype(np.float64), logits=np.zeros((3, 4), np.float32), **kw)
    with pytest.raises(ConfigError, match="x_format"):
        reference_moe(x, logits=np.zeros((3, 4), np.float32), x_format="fp4", **kw)


# --- fp8 and bf16 formats -----------------------------------------------------------------------------

def test_fp8_error_bound():
    rng = np.random.default_rng([SEED, 5])
    # Magnitudes over ~12 binades, so groups hold normal and subnormal scaled values.
    x = (rng.choice([-1, 1], (64, 512)) * np.exp2(rng.uniform(-12, 3, (64, 512)))).astype(np.float32)
    x[7] = 0  # a zero token
    x[9, :128] = 0  # a zero group
    x_q, x_sf = quant.quantize_fp8(x)
    assert x_q.dtype == quant.FP8_DTYPE and x_sf.shape == (64, 4) and x_sf.dtype == np.float32
    deq = quant.dequantize_fp8(x_q, x_sf)
    np.testing.assert_array_equal(quant.dequantize_fp8(x_q.view(np.uint8), x_sf), deq)
    scale = np.repeat(x_sf, 128, axis=1)
    scaled = np.abs(x / scale)
    err = np.abs(deq.astype(np.float64) - x)
    normal = scaled >= 2.0 ** -6
    assert normal.any() and (~normal & (x != 0)).any(), "the data must exercise both ranges"
    # Half of e4m3's epsilon 2^-3 (tighter than 2^-3), and half the subnormal spacing 2^-9 below 2^-6.
    assert np.all(err[normal] <= 2.0 ** -4 * np.abs(x[normal]) * (1 + 1e-6))
    assert np.all(err[~normal] <= 2.0 ** -10 * scale[~normal] * (1 + 1e-6))
    # Each group's amax maps onto +-448.
    groups = np.abs(x_q.astype(np.float32).reshape(64, 4, 128)).max(axis=2)
    assert np.all(groups[x_sf != 1] == 448)
    assert np.all(x_sf[7] == 1) and x_sf[9, 0] == 1 and np.all(deq[7] == 0) and np.all(deq[9, :128] == 0)


def test_fp8_exact_round_trip_of_representable_values():
    rng = np.random.default_rng([SEED, 6])
    finite = np.arange(256, dtype=np.uint8).view(quant.FP8_DTYPE)
    finite = finite[np.isfinite(finite.astype(np.float32))]
    q = rng.choice(finite, (16, 256)).astype(np.float32)
    q[:, ::128] = rng.choice([-448.0, 448.0], (16, 2))  # every group's amax is exactly 448
    power = np.exp2(rng.integers(-20, 20, (16, 2))).astype(np.float32)
    x = q * np.repeat(power, 128, axis=1)
    x_q, x_sf = quant.quantize_fp8(x)
    np.testing.assert_array_equal(x_sf, power)
    np.testing.assert_array_equal(x_q.astype(np.float32), q)
    np.testing.assert_array_equal(quant.dequantize_fp8(x_q, x_sf), x)


def test_bf16_round_trip():
    rng = np.random.default_rng([SEED, 7])
    x = rng.standard_normal((8, 64), dtype=np.float32)
    bits, sf = quant.encode(x, "bf16")
    assert bits.dtype == np.uint16 and sf is None
    deq = quant.decode(bits, None, "bf16")
    np.testing.assert_array_less(np.abs(deq - x), 2.0 ** -8 * np.abs(x) + 1e-38)
    np.testing.assert_array_equal(quant.decode(quant.encode(deq, "bf16")[0], None, "bf16"), deq)
    np.testing.assert_array_equal(deq, x.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("call, match", [
    (lambda: quant.quantize_fp8(np.zeros((2, 100), np.float32)), "hidden"),
    (lambda: quant.quantize_fp8(np.zeros((2, 128), np.float64)), "x.dtype"),
    (lambda: quant.quantize_fp8(np.full((1, 128), np.inf, np.float32)), "finite"),
    (lambda: quant.quantize_fp8(np.zeros(128, np.float32)), "2-D"),
    (lambda: quant.dequantize_fp8(np.zeros((2, 128), np.uint8), np.ones((3, 1), np.float32)), "x_sf.shape"),
    (lambda: quant.encode(np.zeros((1, 128), np.float32), "int8"), "x_format"),
    (lambda: quant.decode(np.zeros((1, 128), np.uint8), None, "fp8_e4m3"), "x_sf"),
])
def test_quant_rejects(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


# --- row independence (what makes streamed == batch bitwise) ------------------------------------------

@pytest.mark.parametrize("method", ["softmax", "sigmoid_bias"])
def test_row_independence(method):
    """Each row's result is bitwise the same computed alone, in any sub-batch, or in the whole batch."""
    rng = np.random.default_rng([SEED, 8, len(method)])
    num_tokens, hidden, num_experts = 37, 256, 16
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    router_weight = rng.standard_normal((num_experts, hidden), dtype=np.float32)
    w_t = transposed_f64(rng.standard_normal((48, hidden), dtype=np.float32))
    whole = dict(logits=router_logits(x, router_weight), mm=row_matmul(x, w_t),
                 q=quant.encode(x, "fp8_e4m3"))
    whole["topk"] = select_topk(whole["logits"], 4, method)
    whole["act"] = swiglu(whole["mm"][:, :24], whole["mm"][:, 24:])
    for sizes in ([1] * num_tokens, [5, 17, 3, 12], [num_tokens - 1, 1]):
        start = 0
        for size in sizes:
            rows = slice(start, start + size)
            logits = router_logits(x[rows], router_weight)
            np.testing.assert_array_equal(logits, whole["logits"][rows])
            for got, want in zip(select_topk(logits, 4, method), whole["topk"]):
                np.testing.assert_array_equal(got, want[rows])
            mm = row_matmul(x[rows], w_t)
            np.testing.assert_array_equal(mm, whole["mm"][rows])
            np.testing.assert_array_equal(swiglu(mm[:, :24], mm[:, 24:]), whole["act"][rows])
            for got, want in zip(quant.encode(x[rows], "fp8_e4m3"), whole["q"]):
                np.testing.assert_array_equal(got, want[rows])
            start += size


def test_combine_order_and_row_matmul_values():
    rng = np.random.default_rng([SEED, 9])
    a = rng.standard_normal((9, 70), dtype=np.float32)
    w = rng.standard_normal((70, 11))
    np.testing.assert_allclose(row_matmul(a, w), (a.astype(np.float64) @ w).astype(np.float32), rtol=1e-6,
                               atol=1e-6)
    out = rng.standard_normal((9, 3, 5), dtype=np.float32)
    idx = rng.integers(-1, 4, (9, 3)).astype(np.int32)
    weights = rng.random((9, 3), dtype=np.float32)
    expect = np.zeros((9, 5))
    for k in range(3):
        expect += np.where(idx[:, k, None] >= 0, weights[:, k, None].astype(np.float64) * out[:, k], 0)
    np.testing.assert_array_equal(combine_rows(out, idx, weights), expect.astype(np.float32))


def test_route_sources():
    x = np.zeros((2, 128), np.float32)
    with pytest.raises(ConfigError, match="exactly one"):
        route(x, 1, 4, logits=np.zeros((2, 4), np.float32), router_weight=np.zeros((4, 128), np.float32))
    with pytest.raises(ConfigError, match="router_weight"):
        route(x, 1, 4, router_weight=np.zeros((5, 128), np.float32))
    with pytest.raises(ConfigError, match="topk_weights"):
        route(x, 1, 4, topk_idx=np.zeros((2, 1), np.int32))
