"""symmring as vLLM's expert-parallel MoE path (the ``vllm`` extra; README, "Serving with vLLM").

vLLM's fused MoE is a modular kernel (``vllm/model_executor/layers/fused_moe/modular_kernel.py``): a
prepare/finalize stage (the all-to-all) around an experts class. symmring enters as an *experts class that does
its own all-to-all*, paired with vLLM's pass-through prepare/finalize, as the FlashInfer MoE-EP megakernels do
in vLLM 0.32: the experts receive each rank's own tokens with vLLM's routing and return the combined rows.

Modules, from the one that never imports vLLM to the ones that do:

* `adapter`: the symmring side (weights from vLLM's ``w13``/``w2`` layouts, token counts from vLLM's
  data-parallel metadata, capture sizes to token buckets, `adapter.GivenRoutingLayer`); torch and symmring
  only, so it runs on the GPU machine, where vLLM is not installed.
* `experts`: `experts.SymmringExperts`, the ``FusedMoEExpertsModular`` with vLLM's capability checks
  (activation format, quantisation schemes, parallel configuration), and the EP context and workspace each
  vLLM process makes once.
* `method`: how a vLLM MoE layer gets it: `method.SymmringMoEMethod` (the layer's quantisation method, a
  ``FusedMoEModularMethod``, wrapping vLLM's own unquantized or fp8 method for weight creation and loading)
  and `method.SymmringRoutedExperts` (vLLM's ``RoutedExperts`` with that method, registered out of tree).
* `plugin`: the ``vllm.general_plugins`` entry point, a no-op unless ``SYMMRING_VLLM=1``.

Importing this package imports nothing of vLLM.
"""
