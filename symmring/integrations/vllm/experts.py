"""`SymmringExperts`: symmring's expert-parallel layer as a vLLM 0.32 modular-kernel experts class.

An experts class that does its own all-to-all (as vLLM's ``FlashInferMoeEpExperts`` does), paired with vLLM's
``PassThroughPrepareAndFinalize`` (`make_kernel`): ``apply`` gets this rank's tokens with the router's
``topk_ids`` (global expert ids) and ``topk_weights``, and writes the combined rows into ``output``; the
pass-through finalize leaves them as they are (``output_is_reduced``).

What it answers vLLM's capability checks with (`FusedMoEExperts.is_supported_config` and the extra checks of
`refusals`): the standard activation format; SiLU gated experts without bias, clamp or LoRA; bf16 activations;
bf16 weights, or fp8 e4m3 weights with 128x128 block scales (``kFp8Static128BlockSym`` weights,
``kFp8Dynamic128Sym`` activations: symmring quantises its dispatch itself, so it takes the activations
unquantised); expert parallelism whose EP group is the data-parallel group (tensor parallel, context parallel
and sequence parallel MoE size 1), without EPLB, on a CPU (the host backend) or a CUDA device (nvshmem).

Each vLLM process makes one symmring context over its EP group and one `symmring.Workspace` sized from vLLM's
``max_num_batched_tokens`` (`process_workspace`), when the first MoE layer's weights are processed: at model
load, before vLLM profiles or captures graphs: ``symmring.init(backend, group=get_ep_group().cpu_group)``.
Each call takes vLLM's data-parallel token counts of the step (``dp_metadata.num_tokens_across_dp_cpu``) as
given (`symmring.Workspace.step` with ``counts=``): a vLLM step adds no host exchange.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                         FusedMoEQuantConfig)
from vllm.model_executor.layers.fused_moe.prepare_finalize.passthrough import PassThroughPrepareAndFinalize
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization.utils.quant_utils import (QuantKey, kFp8Dynamic128Sym,
                                                                       kFp8Static128BlockSym)
from vllm.platforms import current_platform

from ...errors import ConfigError
from .adapter import GivenRoutingLayer, experts_from_vllm, step_counts

log = logging.getLogger(__name__)

#: The (weight, activation) quantisation schemes the experts take, and their names.
SCHEMES = {(None, None): "bf16", (kFp8Static128BlockSym, kFp8Dynamic128Sym): "fp8 e4m3, 128x128 weight blocks"}


def parallel_refusals(parallel: FusedMoEParallelConfig) -> List[str]:
    """Why symmring cannot run a MoE layer of this parallel configuration (empty: it can)."""
    reasons = []
    if parallel.tp_size != 1:
        reasons.append(f"MoE tensor parallelism (tp_size={parallel.tp_size}): symmring splits experts across "
                       "ranks, not their weights; enable expert parallelism")
    if parallel.pcp_size != 1:
        reasons.append(f"prefill context parallelism (pcp_size={parallel.pcp_size})")
    if parallel.is_sequence_parallel:
        reasons.append(f"sequence-parallel MoE (sp_size={parallel.sp_size})")
    if parallel.enable_eplb:
        reasons.append("EPLB (redundant experts move between ranks; symmring's ranks own fixed expert ranges)")
    if parallel.use_batched_activation_format:
        reasons.append(f"the batched activation format of all2all_backend={parallel.all2all_backend!r}")
    if parallel.ep_size > 1 and parallel.dp_size != parallel.ep_size:
        reasons.append(f"an EP group of {parallel.ep_size} ranks over {parallel.dp_size} data-parallel ranks: "
                       "symmring takes vLLM's per-DP-rank token counts; expected ep_size == dp_size")
    return reasons


def refusals(moe: FusedMoEConfig) -> List[str]:
    """Why symmring cannot run this MoE layer, beyond vLLM's generic checks (empty: it can)."""
    reasons = parallel_refusals(moe.moe_parallel_config)
    if moe.in_dtype != torch.bfloat16:
        reasons.append(f"activations of dtype {moe.in_dtype} (expected torch.bfloat16)")
    if moe.has_bias:
        reasons.append("expert biases")
    if moe.swiglu_limit is not None or moe.swiglu_alpha is not None or moe.swiglu_beta is not None:
        reasons.append("a clamped or scaled SwiGLU (swiglu_limit/alpha/beta)")
    if moe.num_experts != moe.num_logical_experts:
        reasons.append(f"{moe.num_experts - moe.num_logical_experts} redundant or fused shared experts")
    ep_size = moe.moe_parallel_config.ep_size
    if moe.num_experts % ep_size:
        reasons.append(f"num_experts={moe.num_experts} over {ep_size} EP ranks (expected a multiple)")
    return reasons


def _backend_name() -> str:
    return "host" if current_platform.is_cpu() else "nvshmem"


#: This process's symmring context and workspace (one EP group per vLLM process): `process_workspace`.
_PROCESS: dict = {}


def _ep_cpu_group():
    """vLLM's EP group as a torch.distributed group of CPU tensors (gloo), or None where vLLM built no groups
    (an experts class made outside vLLM's engine, as the kernel tests do)."""
    from vllm.distributed import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_ep_group().cpu_group


def process_workspace(parallel: FusedMoEParallelConfig, max_tokens: int, group=None):
    """This process's symmring workspace on vLLM's EP group, made by the first MoE layer (collective over
    the group, as vLLM builds every layer on every rank), sized for ``max_tokens`` tokens per rank per call.
    The context is ``symmring.init(backend, group=...)`` over ``group`` (default: vLLM's EP group,
    ``get_ep_group().cpu_group``; its c10d store carries symmring's few host collectives: setup, allocation,
    teardown; none per step). One EP rank outside vLLM's engine (no groups) runs in a world of its own.

    Raises:
        ConfigError: several EP ranks and no group (vLLM's groups not initialised), or a context whose rank or
            size is not this process's EP rank and size.
    """
    import symmring
    from ...moe.workspace import Workspace
    ctx = _PROCESS.get("ctx")
    if ctx is None or ctx.closed:
        group = _ep_cpu_group() if group is None else group
        if group is not None:
            ctx = symmring.init(_backend_name(), group=group)
        elif parallel.ep_size == 1:
            from ... import mpi
            ctx = symmring.init(_backend_name(), comm=mpi.load().COMM_SELF)  # a world of its own
        else:
            raise ConfigError(f"vLLM EP group of {parallel.ep_size} ranks: vLLM's process groups are not "
                              "initialised; pass group= (the torch.distributed group of the EP ranks)")
        if ctx.rank != parallel.ep_rank or ctx.world_size != parallel.ep_size:
            raise ConfigError(f"symmring rank {ctx.rank} of {ctx.world_size} on vLLM EP rank {parallel.ep_rank} of "
                              f"{parallel.ep_size}: expected the same ranks")
        _PROCESS.clear()
        _PROCESS.update(ctx=ctx, workspace=Workspace(ctx, max_tokens=max_tokens))
    return _PROCESS["workspace"]


def made_workspace():
    """This process's symmring workspace once its first MoE layer made it (`process_workspace`), else None: to
    read its calls (``.calls``), count its context's host exchanges, or `symmring.Workspace.reset` it."""
    ctx = _PROCESS.get("ctx")
    return None if ctx is None or ctx.closed else _PROCESS["workspace"]


class SymmringExperts(mk.FusedMoEExpertsModular):
    """symmring's layer behind vLLM's modular kernel (module docstring); pair it with
    ``PassThroughPrepareAndFinalize`` (`make_kernel`)."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        super().__init__(moe_config, quant_config)
        self.layer: Optional[GivenRoutingLayer] = None

    # --- what vLLM asks of an experts class ------------------------------------------------------------

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu() or current_platform.is_cuda()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: Optional[QuantKey], activation_key: Optional[QuantKey]) -> bool:
        return (weight_key, activation_key) in SCHEMES

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return not parallel_refusals(moe_parallel_config)

    @staticmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        supported, reason = mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                                   activation_format)
        if not supported:
            extra = parallel_refusals(moe_config.moe_parallel_config)
            return False, reason + (f" ({'; '.join(extra)})" if extra else "")
        extra = refusals(moe_config)
        return (False, f"symmring does not support {'; '.join(extra)}") if extra else (True, None)

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True  # symmring quantises its own dispatch rows (fp8 e4m3, 1x128 scales) on the GPU

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # the combined rows are the output: nothing left to reduce

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        return (0,), (0,), (M, K)  # symmring's memory is its workspace's

    # --- weights and calls --------------------------------------------------------------------------------

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Build symmring's layer from the layer's loaded weights, in vLLM's checkpoint layout (collective over
        the EP group). fp8 weights keep their block scales on the GPU; the CPU layer gets them dequantised."""
        moe = self.moe_config
        parallel = moe.moe_parallel_config
        scales = {}
        if getattr(layer, "w13_weight_scale_inv", None) is not None:
            scales = dict(w13_scale=layer.w13_weight_scale_inv.data, w2_scale=layer.w2_weight_scale_inv.data)
        experts = experts_from_vllm(layer.w13_weight.data, layer.w2_weight.data, dequantize=current_platform.is_cpu(),
                                    **scales)
        workspace = process_workspace(parallel, moe.max_num_tokens)
        self.layer = GivenRoutingLayer(workspace.ctx, experts, num_experts=moe.num_experts,
                                       topk=moe.experts_per_token, max_tokens=moe.max_num_tokens,
                                       workspace=workspace)
        log.info("symmring: %s on EP rank %d of %d (experts %d, top-%d, max %d tokens per rank)",
                 getattr(layer, "layer_name", "MoE layer"), parallel.ep_rank, parallel.ep_size, moe.num_experts,
                 moe.experts_per_token, moe.max_num_tokens)

    def counts(self, num_tokens: int):
        """Every EP rank's token count of the current call: vLLM's data-parallel counts of this step."""
        from vllm.forward_context import get_forward_context, is_forward_context_available
        dp = get_forward_context().dp_metadata if is_forward_context_available() else None
        parallel = self.moe_config.moe_parallel_config
        return step_counts(num_tokens, ep_rank=parallel.ep_rank, ep_size=parallel.ep_size,
                           num_tokens_across_dp=None if dp is None else dp.num_tokens_across_dp_cpu)

    def run(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """symmring's layer on this rank's tokens (collective over the EP group, zero tokens included)."""
        if self.layer is None:
            raise ConfigError("SymmringExperts: the layer's weights were not processed "
                              "(process_weights_after_loading builds symmring's layer)")
        return self.layer(hidden_states, topk_ids, topk_weights, self.counts(int(hidden_states.shape[0])))

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        if apply_router_weight_on_input:
            raise ConfigError("apply_router_weight_on_input=True: symmring applies the router weights at the "
                              "combine")
        output.copy_(self.run(hidden_states, topk_ids, topk_weights))


def make_kernel(moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig) -> mk.FusedMoEKernel:
    """vLLM's modular kernel of symmring's experts and the pass-through prepare/finalize."""
    return mk.FusedMoEKernel(PassThroughPrepareAndFinalize(), SymmringExperts(moe_config, quant_config))


__all__ = ["SymmringExperts", "SCHEMES", "make_kernel", "parallel_refusals", "refusals", "process_workspace",
           "made_workspace"]
