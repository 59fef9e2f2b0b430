"""Small random transformers MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3), built locally from a config: no
download. What ``python -m symmring demo --model NAME`` and the module tests run.

The models satisfy the fp8 layer's constraints (hidden and moe inter multiples of 128). Expert and router
weights are re-drawn at unit-preserving scales (N(0, 1/fan_in)) so that the MoE blocks carry a real share of
the residual stream; with transformers' 0.02 init their output would be too small for the logits to show
an error in them. Every rank building a model with the same seed gets the same weights.

Example:
    >>> canonical_family("deepseek-v3"), canonical_family("qwen3_moe"), canonical_family("qwen3-30b-a3b")
    ('deepseek_v3', 'qwen3_moe', 'qwen3_moe')
"""

from __future__ import annotations

import math

from ...errors import ConfigError

#: Scale of the experts' down projection (x 1/sqrt(inter)): their output is then about a quarter of the
#: residual stream, enough to show in the logits without the MoE dominating every later router input.
DOWN_SCALE = 0.25
#: The families (`symmring.moe.integrations.hf.BLOCK_CLASSES`' values); the demo's ``--model`` takes them with ``-``.
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
#: The demo's names of the families: the model presets' (`symmring.moe.workspace_plan.PRESETS`, ``plan --preset``)
#: and their former names (`symmring.moe.workspace_plan.PRESET_ALIASES`).
MODEL_NAMES = {"mixtral": "mixtral", "qwen3-30b-a3b": "qwen3_moe", "qwen3-moe": "qwen3_moe",
               "deepseek-v3": "deepseek_v3"}


def canonical_family(name: str) -> str:
    """``"mixtral"``, ``"qwen3_moe"`` or ``"deepseek_v3"`` from either spelling (``-`` or ``_``).

    Raises:
        ConfigError: another name (naming the ones accepted).
    """
    family = MODEL_NAMES.get(name, name)
    if family not in FAMILIES:
        raise ConfigError(f"model={name!r}: expected one of {list(MODEL_NAMES)}")
    return family


def tiny_config(family: str, *, hidden: int = 256, inter: int = 256, num_experts: int = 16, topk: int = 4,
                num_layers: int = 2, vocab: int = 512, norm_topk_prob: bool = True, n_group: int = 4,
                topk_group: int = 2, **overrides):
    """A transformers config of ``family`` with these sizes (DeepSeek-V3: one dense layer first, then
    ``num_layers`` MoE layers with one shared expert, group-limited routing); ``overrides``: any other
    argument of the family's config class, over the ones chosen here (vLLM's CPU MLA, say, needs
    ``kv_lora_rank=512, qk_rope_head_dim=64``)."""
    family = canonical_family(family)
    common = dict(hidden_size=hidden, vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, num_experts_per_tok=topk, tie_word_embeddings=False)
    if family == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(**{**dict(intermediate_size=inter, num_local_experts=num_experts,
                                       num_hidden_layers=num_layers, router_jitter_noise=0.0, **common), **overrides})
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**{**dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                        num_experts=num_experts, num_hidden_layers=num_layers, head_dim=64,
                                        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=norm_topk_prob,
                                        **common), **overrides})
    from transformers import DeepseekV3Config
    common["num_key_value_heads"] = 4
    return DeepseekV3Config(**{**dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                      n_routed_experts=num_experts, n_shared_experts=1,
                                      num_hidden_layers=num_layers + 1, first_k_dense_replace=1, n_group=n_group,
                                      topk_group=topk_group, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5,
                                      q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                      v_head_dim=32, **common), **overrides})


def tiny_model(family: str, seed: int, device="cpu", **config_kwargs):
    """``(model, config)``: a bf16 causal LM of ``family`` in eval mode on ``device``, seeded weights."""
    import torch
    from transformers import AutoModelForCausalLM
    from .hf import block_family
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
    from .hf import block_family
    return [(n, m) for n, m in model.named_modules() if n and block_family(m) is not None]


def input_ids(seed: int, batch: int, seq: int, vocab: int = 512):
    """Seeded random token ids ``[batch, seq]`` (int64, CPU)."""
    import torch
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


__all__ = ["DOWN_SCALE", "FAMILIES", "MODEL_NAMES", "canonical_family", "tiny_config", "tiny_model", "moe_blocks",
           "input_ids"]
