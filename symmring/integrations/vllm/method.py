"""How a vLLM 0.32 MoE layer runs symmring: its quantisation method (`SymmringMoEMethod`) and the
``RoutedExperts`` class that makes it (`SymmringRoutedExperts`).

vLLM picks a MoE layer's experts class inside each quantisation method (its unquantized and fp8 "oracles"),
from lists no plugin can extend, and pairs it with the prepare/finalize of the configured all2all backend; the
``passthrough`` backend is reserved for vLLM's own megakernels. What vLLM does offer out of tree is the
replacement of a pluggable layer class (``PluggableLayer.register_oot``; ``RoutedExperts`` is one) and, as
its LoRA and elastic-EP paths do, a modular quantisation method that runs a kernel of its choice. So:

* `SymmringRoutedExperts` is ``RoutedExperts`` whose quantisation method is vLLM's own (unquantized, or fp8
  with 128x128 blocks) wrapped in `SymmringMoEMethod`; `symmring.integrations.vllm.plugin` registers it.
* `SymmringMoEMethod` checks the layer when the model is built (vLLM's capability checks of
  `SymmringExperts` and symmring's own, refusing with the reason), lets the wrapped method create and load the
  weights in the checkpoint layout, then, in place of that method's conversion into a vLLM backend's layout,
  builds the modular kernel of ``PassThroughPrepareAndFinalize`` and `SymmringExperts` from those weights.
"""

from __future__ import annotations

from typing import Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig, fp8_w8a8_moe_quant_config
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym

from ...errors import ConfigError
from .experts import SymmringExperts, make_kernel

#: fp8 weight blocks the experts take (DeepSeek-V3's and Qwen3-FP8's ``weight_block_size``).
FP8_BLOCK = [128, 128]


def quant_keys(method: FusedMoEMethodBase, prefix: str):
    """``(weight key, activation key)`` of the vLLM method symmring can stand in for, else a ConfigError."""
    if isinstance(method, UnquantizedFusedMoEMethod):
        return None, None
    if isinstance(method, Fp8MoEMethod):
        config = method.quant_config
        if list(method.weight_block_size or []) != FP8_BLOCK or not config.is_checkpoint_fp8_serialized:
            raise ConfigError(f"symmring cannot run MoE layer {prefix!r}: fp8 weights with weight_block_size="
                              f"{method.weight_block_size} (serialized: {config.is_checkpoint_fp8_serialized}); "
                              f"expected an fp8 checkpoint with {FP8_BLOCK} blocks")
        return kFp8Static128BlockSym, kFp8Dynamic128Sym
    raise ConfigError(f"symmring cannot run MoE layer {prefix!r}: quantisation method {type(method).__name__}; "
                      "expected bf16 weights (UnquantizedFusedMoEMethod) or fp8 with 128x128 blocks (Fp8MoEMethod)")


class SymmringMoEMethod(FusedMoEMethodBase):
    """A MoE layer's quantisation method that runs symmring (module docstring).

    Args:
        wrapped: vLLM's method of the layer (it creates and loads the weights).
        layer: the `RoutedExperts` being built.

    Raises:
        ConfigError: a layer symmring cannot run, with the reason (vLLM's capability checks' and symmring's).
    """

    #: What vLLM's weight loader reads of a method; answered by the wrapped one.
    LOADING_ATTRS = ("weight_scale_refine", "use_global_sf", "weight_block_size", "block_quant", "quant_config")

    def __init__(self, wrapped: FusedMoEMethodBase, layer: RoutedExperts):
        super().__init__(wrapped.moe)
        self.old_quant_method = wrapped
        prefix = getattr(layer, "layer_name", "?")
        self.weight_key, self.activation_key = quant_keys(wrapped, prefix)
        ok, reason = SymmringExperts.is_supported_config(SymmringExperts, self.moe, self.weight_key,
                                                         self.activation_key, mk.FusedMoEActivationFormat.Standard)
        if ok and layer.apply_router_weight_on_input:
            ok, reason = False, "router weights applied on the input"
        placement = getattr(layer, "expert_placement_strategy", "linear")
        if ok and self.moe.moe_parallel_config.ep_size > 1 and placement != "linear":
            ok, reason = False, (f"expert_placement_strategy={placement!r} (symmring's rank r owns the r-th "
                                 "consecutive range of experts: 'linear')")
        if not ok:
            raise ConfigError(f"symmring cannot run MoE layer {prefix!r}: {reason}")

    def __getattr__(self, name: str):
        if name in SymmringMoEMethod.LOADING_ATTRS:
            return getattr(self.__dict__["old_quant_method"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        self.old_quant_method.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                                             params_dtype, **extra_weight_attrs)

    def uses_weight_scale_2_pattern(self) -> bool:
        return self.old_quant_method.uses_weight_scale_2_pattern()

    def get_fused_moe_quant_config(self, layer) -> Optional[FusedMoEQuantConfig]:
        if self.weight_key is None:
            return FusedMoEQuantConfig.make()
        return fp8_w8a8_moe_quant_config(w1_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
                                         block_shape=FP8_BLOCK)

    def process_weights_after_loading(self, layer) -> None:
        """symmring's kernel from the loaded weights in the checkpoint layout (none of the wrapped method's
        conversions into a vLLM backend's layout); collective over the EP group."""
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        kernel = make_kernel(self.moe, self.moe_quant_config)
        kernel.fused_experts.process_weights_after_loading(layer)
        self.moe_kernel = kernel

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        if self.moe_kernel is None:
            raise ConfigError("SymmringMoEMethod: the layer's weights were not processed")
        if x.shape[0] == 0:
            # vLLM's modular kernel skips experts that get no rows; symmring's call is collective, so this
            # rank still takes part in it.
            self.moe_kernel.fused_experts.run(x, topk_ids, topk_weights)
            return torch.empty_like(x)
        return self.moe_kernel.apply(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                     activation=layer.activation, global_num_experts=layer.global_num_experts,
                                     expert_map=layer.expert_map,
                                     apply_router_weight_on_input=layer.apply_router_weight_on_input,
                                     shared_experts=shared_experts, shared_experts_input=shared_experts_input)


class SymmringRoutedExperts(RoutedExperts):
    """vLLM's ``RoutedExperts`` whose quantisation method runs symmring (`SymmringMoEMethod`)."""

    def _get_quant_method(self, prefix, quant_config, moe_config) -> FusedMoEMethodBase:
        return SymmringMoEMethod(super()._get_quant_method(prefix, quant_config, moe_config), self)


__all__ = ["SymmringMoEMethod", "SymmringRoutedExperts", "quant_keys", "FP8_BLOCK"]
