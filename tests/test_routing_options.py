"""The routing options of issue #14 (Qwen3-MoE's ``norm_topk_prob=False``, DeepSeek-V3's group-limited top-k)
in the torch routing (`symmring.moe.routing.route`, what the GPU layer runs) and the NumPy reference
(`symmring.moe.reference.select_topk`), each against a plain per-token formulation written here, and against
the transformers routers (Mixtral, Qwen3-MoE, DeepSeek-V3) where transformers is importable.

Seeded float32 logits with distinct values: no ties, so every formulation must choose the same experts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from symmring.errors import ConfigError
from symmring.moe import reference, routing

torch = pytest.importorskip("torch", reason="the torch routing needs torch")

SEED = 20261214
# (scoring, n_group, topk_group, norm_topk_prob, routed_scaling_factor, num_experts, topk)
CASES = [
    ("softmax", 1, 1, True, 1.0, 16, 2),
    ("softmax", 1, 1, False, 1.0, 16, 4),
    ("softmax", 1, 1, False, 1.0, 8, 1),
    ("sigmoid_bias", 1, 1, True, 2.5, 16, 4),
    ("sigmoid_bias", 1, 1, False, 2.5, 16, 4),
    ("sigmoid_bias", 4, 2, True, 2.5, 16, 4),
    ("sigmoid_bias", 4, 2, False, 1.5, 16, 6),
    ("sigmoid_bias", 8, 4, True, 2.5, 64, 8),
    ("sigmoid_bias", 8, 1, True, 1.0, 64, 8),  # one group: the top-k lives inside it
]


def plain_route(logits, topk, scoring, bias, rsf, n_group, topk_group, norm):
    """One token at a time in float64 Python: the definitions of routing.py's docstring, spelled out."""
    num_tokens, num_experts = logits.shape
    ids = np.zeros((num_tokens, topk), np.int64)
    weights = np.zeros((num_tokens, topk), np.float64)
    for t in range(num_tokens):
        row = [float(v) for v in logits[t]]
        if scoring == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            probs = [e / sum(exps) for e in exps]
            key = row
        else:
            probs = [1.0 / (1.0 + math.exp(-v)) for v in row]
            key = [p + float(b) for p, b in zip(probs, bias)]
        allowed = set(range(num_experts))
        if n_group > 1:
            size = num_experts // n_group
            scores = []
            for g in range(n_group):
                members = sorted(key[g * size:(g + 1) * size], reverse=True)
                scores.append((members[0] + members[1], g))
            best = sorted(scores, key=lambda s: (-s[0], s[1]))[:topk_group]
            allowed = {g * size + j for _, g in best for j in range(size)}
        chosen = sorted(allowed, key=lambda e: (-key[e], e))[:topk]
        w = [probs[e] for e in chosen]
        if norm:
            w = [v / sum(w) for v in w]
        if scoring == "sigmoid_bias":
            w = [v * rsf for v in w]
        ids[t], weights[t] = chosen, w
    return ids, weights


def sorted_rows(ids, weights):
    order = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, order, 1), np.take_along_axis(weights, order, 1)


def make_case(num_tokens, num_experts, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((num_tokens, num_experts)) * 2).astype(np.float32)
    bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32)
    return logits, bias


@pytest.mark.parametrize("scoring,n_group,topk_group,norm,rsf,num_experts,topk", CASES)
def test_route_and_reference_vs_plain(scoring, n_group, topk_group, norm, rsf, num_experts, topk):
    logits, bias = make_case(97, num_experts, SEED + num_experts + topk)
    bias_or_none = bias if scoring == "sigmoid_bias" else None
    want_ids, want_w = plain_route(logits, topk, scoring, bias, rsf, n_group, topk_group, norm)
    options = dict(routed_scaling_factor=rsf, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    ids, w = routing.route(torch.from_numpy(logits), topk, scoring,
                           bias=None if bias_or_none is None else torch.from_numpy(bias), **options)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    ref_ids, ref_w = reference.select_topk(logits, topk, scoring, bias=bias_or_none, **options)
    # The reference lists experts by decreasing key, like the plain one: equal in order.
    np.testing.assert_array_equal(ref_ids, want_ids)
    np.testing.assert_allclose(ref_w, want_w, rtol=1e-6, atol=0)
    # torch.topk on CPU also returns decreasing values, but compare as sets to not depend on it.
    got_ids, got_w = sorted_rows(ids.numpy().astype(np.int64), w.numpy().astype(np.float64))
    exp_ids, exp_w = sorted_rows(want_ids, want_w)
    np.testing.assert_array_equal(got_ids, exp_ids)
    np.testing.assert_allclose(got_w, exp_w, rtol=2e-6, atol=0)
    if not norm:  # no renormalisation really happened: the row sums are not all 1 (or rsf)
        assert np.abs(want_w.sum(1) - (rsf if scoring == "sigmoid_bias" else 1.0)).max() > 1e-2


def test_group_limit_changes_the_choice():
    """The group-limited top-k is not the plain one on this data (else the test above could not fail)."""
    logits, bias = make_case(97, 64, SEED)
    plain, _ = routing.route(torch.from_numpy(logits), 8, "sigmoid_bias", bias=torch.from_numpy(bias))
    grouped, _ = routing.route(torch.from_numpy(logits), 8, "sigmoid_bias", bias=torch.from_numpy(bias),
                               n_group=8, topk_group=2)
    differs = (np.sort(plain.numpy(), 1) != np.sort(grouped.numpy(), 1)).any(1)
    assert differs.mean() > 0.5
    # Every chosen expert lies in at most topk_group = 2 groups of 8.
    assert max(len(set((grouped.numpy()[t] // 8).tolist())) for t in range(97)) <= 2


def test_default_options_keep_the_previous_numbers():
    """n_group=1, norm_topk_prob=True: bitwise the formulas the layer ran before the options existed."""
    logits, bias = make_case(64, 16, SEED + 1)
    lt, bt = torch.from_numpy(logits), torch.from_numpy(bias)
    idx, w = routing.route(lt, 2, "softmax")
    chosen, want_idx = torch.topk(lt, 2, dim=-1)
    assert torch.equal(idx, want_idx.int()) and torch.equal(w, torch.softmax(chosen, -1))
    idx, w = routing.route(lt, 4, "sigmoid_bias", bias=bt, routed_scaling_factor=2.5)
    probs = torch.sigmoid(lt)
    want_idx = torch.topk(probs + bt, 4, dim=-1)[1]
    g = probs.gather(1, want_idx)
    assert torch.equal(idx, want_idx.int()) and torch.equal(w, g / g.sum(-1, keepdim=True) * 2.5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scoring="softmax", n_group=2, topk_group=1), "n_group=2: group-limited routing"),
    (dict(scoring="sigmoid_bias", n_group=3, topk_group=1), "n_group=3: expected a positive divisor"),
    (dict(scoring="sigmoid_bias", n_group=0, topk_group=1), "n_group=0"),
    (dict(scoring="sigmoid_bias", n_group=4, topk_group=5), r"topk_group=5: expected an int in \[1, n_group=4\]"),
    (dict(scoring="sigmoid_bias", n_group=16, topk_group=2), "groups of 1 expert"),
    (dict(scoring="sigmoid_bias", n_group=4, topk_group=1, topk=5), "topk=5: expected at most topk_group"),
    (dict(scoring="softmax", norm_topk_prob=1), "norm_topk_prob=1: expected a bool"),
    (dict(scoring="softmax", topk=17), r"topk=17: expected an int in \[1, num_experts=16\]"),
    (dict(scoring="sparsemax"), "scoring='sparsemax'"),
])
def test_bad_options_rejected(kwargs, match):
    kwargs = dict(kwargs)
    topk = kwargs.pop("topk", 4)
    scoring = kwargs.pop("scoring")
    with pytest.raises(ConfigError, match=match):
        routing.check_options(16, topk, scoring, **kwargs)
    with pytest.raises(ConfigError, match=match):
        routing.route(torch.zeros(3, 16), topk, scoring, **kwargs)
    if scoring in reference.TOPK_METHODS:
        with pytest.raises(ConfigError, match=match):
            reference.select_topk(np.zeros((3, 16), np.float32), topk, scoring, **kwargs)


# --- against the transformers routers ------------------------------------------------------------------

def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install 'transformers>=5,<6')")


def _hidden_and_router(seed, num_tokens, hidden, num_experts, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(num_experts, hidden, generator=g) / math.sqrt(hidden)).to(dtype)
    return x, w


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_softmax_routers_match_transformers(family, norm):
    _transformers()
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router
        config = MixtralConfig(hidden_size=128, num_local_experts=16, num_experts_per_tok=2)
        topk = 2
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
        config = Qwen3MoeConfig(hidden_size=128, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
        topk = 4
    router = Router(config).to(torch.bfloat16)
    x, w = _hidden_and_router(SEED, 512, 128, 16, torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(w)
        hf_logits, hf_weights, hf_idx = router(x)
    logits = torch.nn.functional.linear(x, w)  # what the module computes: the block's own dtype (bf16)
    assert torch.equal(logits, hf_logits)
    idx, weights = routing.route(logits, topk, "softmax", norm_topk_prob=norm)
    # bf16 logits tie now and then: both sides order the same values, so they choose the same experts.
    np.testing.assert_array_equal(np.sort(idx.numpy(), 1), np.sort(hf_idx.numpy(), 1))
    got = np.take_along_axis(weights.numpy(), np.argsort(idx.numpy(), 1), 1)
    want = np.take_along_axis(hf_weights.float().numpy(), np.argsort(hf_idx.numpy(), 1), 1)
    # Qwen3's router rounds its weights to the logits' dtype (bf16: 2^-9 relative); Mixtral's stay float32.
    np.testing.assert_allclose(got, want, rtol=4e-3 if family == "qwen3_moe" else 1e-6, atol=0)


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (4, 2, False), (1, 1, True), (8, 3, True)])
def test_deepseek_router_matches_transformers(n_group, topk_group, norm):
    _transformers()
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = DeepseekV3Config(hidden_size=128, n_routed_experts=32, num_experts_per_tok=6, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config).to(torch.bfloat16)
    x, w = _hidden_and_router(SEED + n_group, 512, 128, 32, torch.bfloat16)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(SEED)) * 0.05
    with torch.no_grad():
        router.weight.copy_(w)
        router.e_score_correction_bias.copy_(bias)
        hf_logits, hf_weights, hf_idx = router(x)
    logits = torch.nn.functional.linear(x.float(), w.float())  # DeepSeek-V3's router runs in float32
    assert torch.equal(logits, hf_logits)
    idx, weights = routing.route(logits, 6, "sigmoid_bias", bias=router.e_score_correction_bias,
                                 routed_scaling_factor=2.5, n_group=n_group, topk_group=topk_group,
                                 norm_topk_prob=norm)
    # transformers takes the top-k unsorted: compare each token's experts as a set.
    np.testing.assert_array_equal(np.sort(idx.numpy(), 1), np.sort(hf_idx.numpy(), 1))
    got = np.take_along_axis(weights.numpy(), np.argsort(idx.numpy(), 1), 1)
    want = np.take_along_axis(hf_weights.float().numpy(), np.argsort(hf_idx.numpy(), 1), 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    # The router's bias is what .to(bfloat16) left of it: the reference gets those values too.
    ref_bias = router.e_score_correction_bias.float().numpy()
    ref_ids, _ = reference.select_topk(logits.numpy(), 6, "sigmoid_bias", bias=ref_bias, n_group=n_group,
                                       topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    np.testing.assert_array_equal(np.sort(ref_ids, 1), np.sort(hf_idx.numpy(), 1))


# --- the NumPy routing (the CPU layer's) against the torch routing (the GPU layer's) ------------------------

def spread_case(num_tokens, num_experts, seed):
    """Logits whose values in each row are a permutation of an evenly spaced grid (no two closer than
    6 / (num_experts - 1)), and a small random bias."""
    rng = np.random.default_rng(seed)
    grid = np.linspace(-3.0, 3.0, num_experts)
    logits = np.stack([rng.permutation(grid) for _ in range(num_tokens)]).astype(np.float32)
    bias = (rng.standard_normal(num_experts) * 0.1).astype(np.float32)
    return logits, bias


def boundary_gap(values, k):
    """The smallest gap over the rows between the k-th and the (k+1)-th largest of ``values`` (float64)."""
    if k >= values.shape[1]:
        return np.inf
    ordered = -np.sort(-values, axis=1)
    with np.errstate(invalid="ignore"):  # -inf - -inf where a row has fewer than k + 1 finite values
        return float(np.nan_to_num(ordered[:, k - 1] - ordered[:, k], nan=np.inf, posinf=np.inf).min())


def selection_gaps(logits, bias, scoring, topk, n_group, topk_group):
    """How far each selection of the routing is from a tie, in float64: the top-k keys and, with groups,
    the group scores at the topk_group boundary. float32 rounding moves a key by about 1e-7."""
    logits64 = logits.astype(np.float64)
    if scoring == "softmax":
        return [boundary_gap(logits64, topk)]
    key = 1.0 / (1.0 + np.exp(-logits64)) + bias.astype(np.float64)
    gaps = []
    if n_group > 1:
        grouped = -np.sort(-key.reshape(len(key), n_group, -1), axis=2)
        gaps.append(boundary_gap(grouped[:, :, 0] + grouped[:, :, 1], topk_group))
        key = reference._limit_to_groups(key, n_group, topk_group)
    gaps.append(boundary_gap(key, topk))
    return gaps


@pytest.mark.parametrize("scoring,n_group,topk_group,norm,rsf,num_experts,topk", CASES)
def test_numpy_routing_equals_torch_routing(scoring, n_group, topk_group, norm, rsf, num_experts, topk):
    """`reference.select_topk` (NumPy, float64) and `routing.route` (torch, float32) choose the same experts
    for every token and give the same weights to float32 rounding, for every option combination."""
    logits, bias = spread_case(64, num_experts, SEED + 7 * num_experts + topk)
    assert min(selection_gaps(logits, bias, scoring, topk, n_group, topk_group)) > 1e-5, \
        "the data has a near-tie: the two routings could then differ by rounding alone"
    options = dict(routed_scaling_factor=rsf, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    sig = scoring == "sigmoid_bias"
    ids, w = routing.route(torch.from_numpy(logits), topk, scoring, bias=torch.from_numpy(bias) if sig else None,
                           **options)
    ref_ids, ref_w = reference.select_topk(logits, topk, scoring, bias=bias if sig else None, **options)
    got_ids, got_w = sorted_rows(ids.numpy().astype(np.int64), w.numpy())
    want_ids, want_w = sorted_rows(ref_ids.astype(np.int64), ref_w)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6, atol=0)
