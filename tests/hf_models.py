"""Small random transformers MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3) and a CPU stand-in of the GPU layer,
shared by tests/test_moe_module.py (CPU) and tests/gpu/test_moe_module.py.

The models satisfy the fp8 layer's constraints (hidden and moe inter multiples of 128). Expert and router
weights are re-drawn at unit-preserving scales (N(0, 1/fan_in)) so that the MoE blocks carry a real share of
the residual stream; with transformers' 0.02 init their output would be too small for the logits to show
an error in them. Every rank building a model with the same seed gets the same weights.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

#: Scale of the experts' down projection (x 1/sqrt(inter)): their output is then about a quarter of the
#: residual stream, enough to show in the logits without the MoE dominating every later router input.
DOWN_SCALE = 0.25
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


def tiny_config(family: str, *, hidden: int = 256, inter: int = 256, num_experts: int = 16, topk: int = 4,
                num_layers: int = 2, vocab: int = 512, norm_topk_prob: bool = True, n_group: int = 4,
                topk_group: int = 2):
    """A transformers config of ``family`` with these sizes (DeepSeek-V3: one dense layer first, then
    ``num_layers`` MoE layers with one shared expert, group-limited routing)."""
    common = dict(hidden_size=hidden, vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, num_experts_per_tok=topk, tie_word_embeddings=False)
    if family == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(intermediate_size=inter, num_local_experts=num_experts, num_hidden_layers=num_layers,
                             router_jitter_noise=0.0, **common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter, num_experts=num_experts,
                              num_hidden_layers=num_layers, head_dim=64, decoder_sparse_step=1, mlp_only_layers=[],
                              norm_topk_prob=norm_topk_prob, **common)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        common["num_key_value_heads"] = 4
        return DeepseekV3Config(intermediate_size=2 * inter, moe_intermediate_size=inter, n_routed_experts=num_experts,
                                n_shared_experts=1, num_hidden_layers=num_layers + 1, first_k_dense_replace=1,
                                n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                routed_scaling_factor=2.5, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                                qk_rope_head_dim=16, v_head_dim=32, **common)
    raise ValueError(f"family={family!r}: expected one of {FAMILIES}")


def tiny_model(family: str, seed: int, device="cpu", **config_kwargs):
    """``(model, config)``: a bf16 causal LM of ``family`` in eval mode on ``device``, seeded weights."""
    import torch
    from transformers import AutoModelForCausalLM
    from symmring.moe.hf import block_family
    config = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if block_family(module) is None:
                continue
            experts = module.experts
            E, I2, H = experts.gate_up_proj.shape
            experts.gate_up_proj.copy_(torch.randn(E, I2, H, generator=g) / math.sqrt(H))
            experts.down_proj.copy_(torch.randn(E, H, I2 // 2, generator=g) * (DOWN_SCALE / math.sqrt(I2 // 2)))
            module.gate.weight.copy_(torch.randn(E, H, generator=g) * (2.0 / math.sqrt(H)))
            if hasattr(module.gate, "e_score_correction_bias"):
                module.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.05)
    return model.to(device=device, dtype=torch.bfloat16).eval(), config


def moe_blocks(model):
    """``[(name, block)]`` of the supported MoE blocks of ``model``."""
    from symmring.moe.hf import block_family
    return [(n, m) for n, m in model.named_modules() if n and block_family(m) is not None]


def input_ids(seed: int, batch: int, seq: int, vocab: int = 512):
    import torch
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


class StandInLayer:
    """The GPU layer's constructor and forward on any device in plain torch (`symmring.moe.torch_ref`):
    what `MoEModule` needs of `symmring.moe.gpu.MoE`, for tests without a GPU. ``ctx`` needs ``rank`` and
    ``world_size``; with several ranks only this rank's experts contribute (no exchange)."""

    def __init__(self, ctx, num_experts, hidden, inter, topk, w_gate, w_up, w_down, *, max_tokens, scoring="softmax",
                 bias=None, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True, **others):
        from symmring.moe import routing
        from symmring.moe.weights import expert_weights
        routing.check_options(num_experts, topk, scoring, n_group=n_group, topk_group=topk_group,
                              norm_topk_prob=norm_topk_prob)
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.num_experts, self.hidden, self.inter, self.topk, self.max_tokens = num_experts, hidden, inter, topk, max_tokens
        self.num_local_experts = num_experts // self.world_size
        self.expert_begin = self.rank * self.num_local_experts
        self.device = w_gate.device
        weights = expert_weights(w_gate, w_up, w_down, num_local_experts=self.num_local_experts, hidden=hidden,
                                 inter=inter, device=self.device, expert_dtype="bf16")
        self.refreshed = 0
        self.graphs_cleared = 0
        self.engine = SimpleNamespace(name="stand-in", weights=weights, refresh_weights=self._refresh)
        self.scoring, self.routed_scaling_factor = scoring, float(routed_scaling_factor)
        self.bias = None if bias is None else bias.float()
        self.n_group, self.topk_group, self.norm_topk_prob = n_group, topk_group, norm_topk_prob
        self.others = others
        self.calls = []  # (num_tokens, streaming) of every forward
        self.closed = False

    def _refresh(self):
        self.refreshed += 1

    def clear_graph_cache(self):
        self.graphs_cleared += 1

    def refresh_weights(self):  # MoE.refresh_weights' contract: the engine's derived tensors, then the graphs
        self.engine.refresh_weights()
        self.clear_graph_cache()

    def forward(self, x, logits=None, *, streaming=False):
        from symmring.moe import routing, torch_ref
        self.calls.append((int(x.shape[0]), streaming))
        idx, weights = routing.route(logits, self.topk, self.scoring, bias=self.bias,
                                     routed_scaling_factor=self.routed_scaling_factor, n_group=self.n_group,
                                     topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob)
        w = self.engine.weights
        y = torch_ref.experts_forward(x, idx, weights, w.w13, w.w_down, expert_offset=self.expert_begin)
        return y.to(x.dtype)

    def close(self):
        self.closed = True
