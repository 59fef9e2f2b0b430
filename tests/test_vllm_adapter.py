"""The symmring side of the vLLM integration (`symmring.integrations.vllm.adapter`), without vLLM: weights from
vLLM's layouts, token counts from its data-parallel metadata, capture sizes to token buckets, and the layer on
given routing and counts (one rank, host backend) against the definition (tests/vllm_problem.py).

Its multi-rank half is tests/mpi/test_vllm_adapter_mpi.py, its GPU half tests/gpu/test_vllm_adapter_gpu.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from symmring.errors import ConfigError  # noqa: E402
from symmring.integrations.vllm import adapter  # noqa: E402
from symmring.moe.gpu.plan import token_bucket  # noqa: E402
from symmring.moe.weights import dequantize_blocks, quantize_blocks  # noqa: E402
from vllm_problem import ExchangeCounter, make_problem, reference  # noqa: E402

#: vLLM 0.32's default ``cudagraph_capture_sizes`` for ``max_cudagraph_capture_size=512``: 1, 2, 4, then steps of
#: 8 to 256, then of 16 to 512 (vllm/config/vllm.py, ``_set_cudagraph_sizes``).
VLLM_DEFAULT_CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def test_bf16_weights_split_at_inter_gate_first():
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(3, 2 * 40, 24, generator=g).bfloat16()
    w2 = torch.randn(3, 24, 40, generator=g).bfloat16()
    experts = adapter.experts_from_vllm(w13, w2)
    assert torch.equal(experts.w_gate, w13[:, :40]) and torch.equal(experts.w_up, w13[:, 40:])
    assert experts.w_down is w2 and experts.w_gate_scale is None
    assert (experts.num_local_experts, experts.inter, experts.hidden) == (3, 40, 24)


def test_fp8_weights_keep_or_dequantise_their_block_scales():
    g = torch.Generator().manual_seed(2)
    (q13, s13), (q2, s2) = quantize_blocks(torch.randn(2, 512, 256, generator=g)), \
        quantize_blocks(torch.randn(2, 256, 256, generator=g))
    native = adapter.experts_from_vllm(q13, q2, w13_scale=s13, w2_scale=s2)
    assert torch.equal(native.w_gate.view(torch.uint8), q13[:, :256].view(torch.uint8))
    assert torch.equal(native.w_up_scale, s13[:, 2:]) and torch.equal(native.w_gate_scale, s13[:, :2])
    assert native.w_down_scale is s2
    dense = adapter.experts_from_vllm(q13, q2, w13_scale=s13, w2_scale=s2, dequantize=True)
    assert dense.w_gate_scale is None and dense.w_gate.dtype == torch.bfloat16
    assert torch.equal(dense.w_up, dequantize_blocks(q13[:, 256:], s13[:, 2:]))
    assert torch.equal(dense.w_down, dequantize_blocks(q2, s2))


@pytest.mark.parametrize("case, match", [
    (lambda w13, w2: (w13[0], w2), "3-D"),
    (lambda w13, w2: (w13, w2[:, :, :3]), "expected w13"),
    (lambda w13, w2: (w13.float(), w2.float()), "expected bf16"),
])
def test_bad_weights_are_named(case, match):
    w13, w2 = torch.zeros(2, 16, 8, dtype=torch.bfloat16), torch.zeros(2, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=match):
        adapter.experts_from_vllm(*case(w13, w2))


def test_fp8_without_matching_scales_is_refused():
    q13, s13 = quantize_blocks(torch.randn(1, 256, 128))
    q2, s2 = quantize_blocks(torch.randn(1, 128, 128))
    with pytest.raises(ConfigError, match="w2_scale"):
        adapter.experts_from_vllm(q13, q2, w13_scale=s13, w2_scale=None)
    with pytest.raises(ConfigError, match="w13_scale"):
        adapter.experts_from_vllm(q13, q2, w13_scale=s13[:, :1], w2_scale=s2)
    with pytest.raises(ConfigError, match="belong to fp8"):
        adapter.experts_from_vllm(torch.zeros(1, 256, 128, dtype=torch.bfloat16),
                                  torch.zeros(1, 128, 128, dtype=torch.bfloat16), w13_scale=s13, w2_scale=s2)


def test_counts_come_from_vllm_dp_metadata():
    assert adapter.step_counts(7, ep_rank=0, ep_size=1) == (7,)
    assert adapter.step_counts(0, ep_rank=2, ep_size=3, num_tokens_across_dp=torch.tensor([4, 9, 0])) == (4, 9, 0)
    assert adapter.step_counts(3, ep_rank=1, ep_size=2, num_tokens_across_dp=[5, 3]) == (5, 3)
    with pytest.raises(ConfigError, match="data-parallel token counts"):
        adapter.step_counts(3, ep_rank=0, ep_size=2)
    with pytest.raises(ConfigError, match="one per EP rank"):
        adapter.step_counts(3, ep_rank=0, ep_size=2, num_tokens_across_dp=[3, 3, 3])
    with pytest.raises(ConfigError, match="more than EP rank 1"):
        adapter.step_counts(6, ep_rank=1, ep_size=2, num_tokens_across_dp=[9, 5])


def test_capture_sizes_map_onto_token_buckets():
    table = adapter.capture_buckets(VLLM_DEFAULT_CAPTURE_SIZES, max_tokens=512)
    assert list(table) == VLLM_DEFAULT_CAPTURE_SIZES
    for size, bucket in table.items():
        assert size <= bucket <= 512 and bucket == token_bucket(size, 512)
    # 51 capture sizes, 10 buckets (1, 2, 4, ..., 256, then 512): one symmring plan per bucket.
    assert sorted(set(table.values())) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert [table[s] for s in (24, 40, 136, 272, 512)] == [32, 64, 256, 512, 512]
    # A bound below 512 caps the last buckets at it.
    assert adapter.capture_buckets([200, 256], max_tokens=300) == {200: 256, 256: 256}
    with pytest.raises(ConfigError, match="over max_tokens=256"):
        adapter.capture_buckets(VLLM_DEFAULT_CAPTURE_SIZES, max_tokens=256)
    with pytest.raises(ConfigError, match="capture size"):
        adapter.capture_buckets([0], max_tokens=256)


@pytest.fixture(scope="module")
def host_ctx():
    import symmring
    ctx = symmring.init("host")
    yield ctx
    ctx.close()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_given_routing_layer_matches_the_definition(host_ctx, fp8):
    problem = make_problem(11, [13], num_experts=8, hidden=256, inter=128, topk=3, fp8=fp8)
    w13, w2, s13, s2 = problem.local(0, 1)
    experts = adapter.experts_from_vllm(w13, w2, w13_scale=s13, w2_scale=s2, dequantize=fp8)
    layer = adapter.GivenRoutingLayer(host_ctx, experts, num_experts=8, topk=3, max_tokens=32)
    try:
        with ExchangeCounter(host_ctx) as counter:
            y = layer(problem.x[0], problem.topk_ids[0], problem.topk_weights[0], counts=[13])
            empty = layer(problem.x[0][:0], problem.topk_ids[0][:0], problem.topk_weights[0][:0], counts=[0])
        assert counter.count == 0, counter.what  # one rank: nothing to exchange
    finally:
        layer.close()
    want = reference(problem, 0)
    assert y.dtype == torch.bfloat16 and y.shape == want.shape and empty.shape == (0, 256)
    # The CPU layer computes in float32 and rounds once; fp8 weights are dequantised to bf16 first.
    torch.testing.assert_close(y.float(), want, atol=2e-2 if fp8 else 1e-2, rtol=2e-2)


def test_given_routing_layer_names_bad_calls(host_ctx):
    problem = make_problem(12, [4], num_experts=4, hidden=128, inter=128, topk=2)
    w13, w2, _, _ = problem.local(0, 1)
    layer = adapter.GivenRoutingLayer(host_ctx, adapter.experts_from_vllm(w13, w2), num_experts=4, topk=2,
                                      max_tokens=8)
    x, ids, w = problem.x[0], problem.topk_ids[0], problem.topk_weights[0]
    try:
        with pytest.raises(ConfigError, match="hidden_states"):
            layer(x.float(), ids, w, counts=[4])
        with pytest.raises(ConfigError, match="topk_ids"):
            layer(x, ids[:, :1], w, counts=[4])
        with pytest.raises(ConfigError, match="more than this rank.s count 3"):
            layer(x, ids, w, counts=[3])
        with pytest.raises(ConfigError, match="one token count per rank"):
            layer(x, ids, w, counts=[4, 4])
    finally:
        layer.close()


def test_a_step_takes_vllms_counts_as_they_come(host_ctx):
    """`Workspace.step(counts=...)` takes vLLM's ``num_tokens_across_dp_cpu`` (an int tensor) as it is, and names
    counts that do not fit (one rank here)."""
    from symmring.moe.workspace import Workspace
    ws = Workspace(host_ctx)
    try:
        with ws.step(5, own_router=False, counts=torch.tensor([5], dtype=torch.int32)) as step:
            assert step.counts == (5,) and not step.distinct
        with pytest.raises(ConfigError, match="not num_tokens=4"):
            with ws.step(4, counts=[5]):
                pass
        with pytest.raises(ConfigError, match="one token count per rank"):
            with ws.step(5, counts=[5, 5]):
                pass
        with pytest.raises(ConfigError, match="expected an int"):
            with ws.step(5, counts=torch.tensor([5.0])):
                pass
    finally:
        ws.close()
