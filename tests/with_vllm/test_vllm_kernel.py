"""symmring's experts class on vLLM's modular kernel (one rank, CPU) against vLLM's own unquantized MoE path on
the same inputs, in vLLM's weight layouts; vLLM's capability checks; the plugin's registration.

The reference is what vLLM itself runs on a CPU for an unquantized layer: the oracle's choice of experts
(``select_unquantized_moe_backend``), its kernel with vLLM's prepare/finalize (``make_unquantized_moe_kernel``)
and its weight processing (``process_weights_after_loading``: the CPU prepack).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,  # noqa: E402
                                                         FusedMoEQuantConfig, RoutingMethodType,
                                                         fp8_w8a8_moe_quant_config)
from vllm.model_executor.layers.fused_moe.oracle.unquantized import (make_unquantized_moe_kernel,  # noqa: E402
                                                                     select_unquantized_moe_backend)
from vllm.model_executor.layers.fused_moe.prepare_finalize.passthrough import (  # noqa: E402
    PassThroughPrepareAndFinalize)
from vllm.model_executor.layers.quantization.utils.quant_utils import (kFp8Dynamic128Sym,  # noqa: E402
                                                                       kFp8Static128BlockSym,
                                                                       kFp8StaticTensorSym)

from symmring.errors import ConfigError  # noqa: E402
from symmring.integrations.vllm import experts as sx  # noqa: E402
from symmring.integrations.vllm import method as sm  # noqa: E402
from symmring.integrations.vllm import plugin  # noqa: E402
from symmring.moe.weights import dequantize_blocks  # noqa: E402
from vllm_problem import ExchangeCounter, make_problem, reference  # noqa: E402

STANDARD = mk.FusedMoEActivationFormat.Standard


def moe_config(num_experts, hidden, inter, topk, *, parallel=None, max_tokens=64, **overrides) -> FusedMoEConfig:
    return FusedMoEConfig(**{**dict(
        num_experts=num_experts, experts_per_token=topk, hidden_dim=hidden, intermediate_size=inter,
        num_local_experts=num_experts, num_logical_experts=num_experts, activation=MoEActivation.SILU, device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel or FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
        max_num_tokens=max_tokens), **overrides})


def layer_of(w13, w2, w13_scale=None, w2_scale=None) -> torch.nn.Module:
    """What a vLLM MoE layer holds after loading: its parameters in the checkpoint layout."""
    layer = torch.nn.Module()
    for name, t in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale_inv", w13_scale),
                    ("w2_weight_scale_inv", w2_scale)):
        if t is not None:
            layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    return layer


def run(kernel, layer, x, ids, weights, num_experts):
    return kernel.apply(x, layer.w13_weight, layer.w2_weight, weights, ids.to(torch.int32),
                        activation=MoEActivation.SILU, global_num_experts=num_experts, expert_map=None,
                        apply_router_weight_on_input=False)


def vllm_unquantized(moe, w13, w2):
    """vLLM's own CPU path for an unquantized layer: ``(kernel, layer)``."""
    backend, experts_cls = select_unquantized_moe_backend(moe)
    kernel = make_unquantized_moe_kernel(FusedMoEQuantConfig.make(), moe, backend, experts_cls)
    layer = layer_of(w13, w2)
    kernel.fused_experts.process_weights_after_loading(layer)
    return kernel, layer


def symmring_kernel(moe, quant_config, layer):
    kernel = sx.make_kernel(moe, quant_config)
    assert isinstance(kernel.prepare_finalize, PassThroughPrepareAndFinalize)
    kernel.fused_experts.process_weights_after_loading(layer)
    return kernel


def test_vllm_w13_is_gate_then_up():
    """vLLM's own CPU path applies SiLU to the first half of w13 (the gate): the split symmring's adapter makes."""
    problem = make_problem(3, [9], num_experts=4, hidden=128, inter=64, topk=2)
    kernel, layer = vllm_unquantized(moe_config(4, 128, 64, 2), problem.w13, problem.w2)
    y = run(kernel, layer, problem.x[0], problem.topk_ids[0], problem.topk_weights[0], 4).float()
    want = reference(problem, 0)
    torch.testing.assert_close(y, want, atol=2e-2, rtol=2e-2)
    swapped = make_problem(3, [9], num_experts=4, hidden=128, inter=64, topk=2)
    swapped.w13 = torch.cat([problem.w13[:, 64:], problem.w13[:, :64]], dim=1)
    assert (y - reference(swapped, 0)).abs().max() > 0.2  # up-then-gate would be far off


@pytest.mark.parametrize("num_experts, hidden, inter, topk, tokens", [(8, 256, 128, 2, 17), (16, 128, 256, 4, 40)])
def test_symmring_experts_equal_vllm_unquantized(num_experts, hidden, inter, topk, tokens):
    problem = make_problem(tokens, [tokens], num_experts=num_experts, hidden=hidden, inter=inter, topk=topk)
    moe = moe_config(num_experts, hidden, inter, topk)
    ref_kernel, ref_layer = vllm_unquantized(moe, problem.w13, problem.w2)
    layer = layer_of(problem.w13, problem.w2)
    kernel = symmring_kernel(moe, FusedMoEQuantConfig.make(), layer)
    args = (problem.x[0], problem.topk_ids[0], problem.topk_weights[0], num_experts)
    want = run(ref_kernel, ref_layer, *args)
    got = run(kernel, layer, *args)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # vLLM's CPU kernel rounds its intermediates to bf16, symmring's CPU layer accumulates in float32.
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), reference(problem, 0), atol=1e-2, rtol=2e-2)
    experts = kernel.fused_experts
    with ExchangeCounter(experts.layer.ctx) as counter:
        run(kernel, layer, *args)
    assert counter.count == 0, counter.what


def test_fp8_block_weights_against_dequantised_reference():
    problem = make_problem(5, [23], num_experts=8, hidden=256, inter=256, topk=3, fp8=True)
    moe = moe_config(8, 256, 256, 3)
    layer = layer_of(problem.w13, problem.w2, problem.w13_scale, problem.w2_scale)
    quant = fp8_w8a8_moe_quant_config(w1_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
                                      block_shape=[128, 128])
    ok, reason = sx.SymmringExperts.is_supported_config(sx.SymmringExperts, moe, kFp8Static128BlockSym,
                                                        kFp8Dynamic128Sym, STANDARD)
    assert ok, reason
    kernel = symmring_kernel(moe, quant, layer)
    # vLLM's unquantized path on the weights dequantised block by block (float32(q) * scale, then bf16).
    ref_kernel, ref_layer = vllm_unquantized(moe, dequantize_blocks(problem.w13, problem.w13_scale),
                                             dequantize_blocks(problem.w2, problem.w2_scale))
    args = (problem.x[0], problem.topk_ids[0], problem.topk_weights[0], 8)
    got, want = run(kernel, layer, *args).float(), run(ref_kernel, ref_layer, *args).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, reference(problem, 0), atol=2e-2, rtol=3e-2)


def parallel(**fields) -> FusedMoEParallelConfig:
    base = dict(tp_size=1, pcp_size=1, dp_size=1, ep_size=1, tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=0, sp_size=1,
                use_ep=False, all2all_backend="allgather_reducescatter", enable_eplb=False)
    return FusedMoEParallelConfig(**{**base, **fields})


def test_capability_checks_accept_bf16_fp8_blocks_and_dp_ep():
    supported = sx.SymmringExperts.is_supported_config
    cls = sx.SymmringExperts
    assert supported(cls, moe_config(8, 128, 128, 2), None, None, STANDARD) == (True, None)
    dp_ep = parallel(dp_size=2, ep_size=2, ep_rank=1, dp_rank=1, use_ep=True)
    assert supported(cls, moe_config(8, 128, 128, 2, parallel=dp_ep, num_local_experts=4), None, None,
                     STANDARD) == (True, None)


@pytest.mark.parametrize("moe_kwargs, keys, reason", [
    (dict(parallel=parallel(tp_size=2, use_ep=False)), (None, None), "tensor parallelism"),
    (dict(parallel=parallel(dp_size=2, ep_size=2, use_ep=True, enable_eplb=True)), (None, None), "EPLB"),
    (dict(parallel=parallel(dp_size=2, ep_size=4, tp_size=1, use_ep=True)), (None, None), "ep_size == dp_size"),
    (dict(activation=MoEActivation.GELU), (None, None), "activation"),
    (dict(has_bias=True), (None, None), "expert biases"),
    (dict(in_dtype=torch.float16), (None, None), "float16"),
    (dict(), (kFp8StaticTensorSym, kFp8StaticTensorSym), "quantization scheme"),
])
def test_capability_checks_refuse_with_the_reason(moe_kwargs, keys, reason):
    parallel_config = moe_kwargs.pop("parallel", None)
    moe = moe_config(8, 128, 128, 2, parallel=parallel_config, **moe_kwargs)
    ok, why = sx.SymmringExperts.is_supported_config(sx.SymmringExperts, moe, *keys, STANDARD)
    assert not ok and reason in why, why


def test_batched_activation_format_is_refused():
    ok, why = sx.SymmringExperts.is_supported_config(sx.SymmringExperts, moe_config(8, 128, 128, 2), None, None,
                                                     mk.FusedMoEActivationFormat.BatchedExperts)
    assert not ok and "activation format" in why


def test_other_quantisation_methods_are_refused_by_name():
    class SomeInt4Method:
        pass

    with pytest.raises(ConfigError, match="SomeInt4Method"):
        sm.quant_keys(SomeInt4Method(), "model.layers.0.mlp.experts")


@pytest.fixture
def oot_registry():
    from vllm.model_executor.custom_op import op_registry_oot
    saved = dict(op_registry_oot)
    yield op_registry_oot
    op_registry_oot.clear()
    op_registry_oot.update(saved)


def test_plugin_registers_only_when_enabled(monkeypatch, oot_registry):
    monkeypatch.delenv("SYMMRING_VLLM", raising=False)
    plugin.register()
    assert "RoutedExperts" not in oot_registry
    monkeypatch.setenv("SYMMRING_VLLM", "1")
    plugin.register()
    plugin.register()  # vLLM may load plugins again: idempotent
    assert oot_registry["RoutedExperts"] is sm.SymmringRoutedExperts


def test_plugin_refuses_another_replacement_and_other_vllm_releases(monkeypatch, oot_registry):
    import vllm
    monkeypatch.setenv("SYMMRING_VLLM", "1")
    oot_registry["RoutedExperts"] = type("TheirRoutedExperts", (), {})
    with pytest.raises(ConfigError, match="TheirRoutedExperts"):
        plugin.register()
    oot_registry.pop("RoutedExperts")
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(ConfigError, match="vLLM 0.99.0"):
        plugin.register()
