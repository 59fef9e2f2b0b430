"""Shared pieces of the GPU MoE tests and benchmark: seeded weights and inputs, the relative-error
figure, the verdict every rank agrees on, and the `transformers` Mixtral block loaded with our weights.

Weights are generated for ALL experts from one seed on every rank (each rank keeps its slice for the
layer and the whole set for the independent checks); tokens get a seed per rank.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import pytest


def gpu_layer_torch():
    """torch, where the GPU MoE layer can run (a CUDA GPU, CuPy, nvshmem4py, nvidia-nvshmem); otherwise a
    module-level skip saying what is missing. Call it at the top of a GPU layer test module."""
    torch = pytest.importorskip("torch", reason="the GPU MoE layer needs torch (not installed here)")
    if not torch.cuda.is_available():
        pytest.skip("the GPU MoE layer needs a CUDA GPU (torch sees none)", allow_module_level=True)
    from symmring.backends.nvshmem import gpu_available

    if not gpu_available():
        pytest.skip("the GPU MoE layer needs CuPy, nvshmem4py and nvidia-nvshmem", allow_module_level=True)
    return torch


def make_weights(seed: int, num_experts: int, hidden: int, inter: int):
    """float32 NumPy ``(w_gate, w_up, w_down, router_weight)``, bf16-representable (so the layer's bf16
    copies and the NumPy reference see the same values)."""
    import ml_dtypes
    rng = np.random.default_rng(seed)

    def bf16_exact(a):
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)

    w_gate = bf16_exact(rng.standard_normal((num_experts, inter, hidden)) / math.sqrt(hidden))
    w_up = bf16_exact(rng.standard_normal((num_experts, inter, hidden)) / math.sqrt(hidden))
    w_down = bf16_exact(rng.standard_normal((num_experts, hidden, inter)) / math.sqrt(inter))
    router = bf16_exact(rng.standard_normal((num_experts, hidden)) / math.sqrt(hidden))
    return w_gate, w_up, w_down, router


def make_tokens(seed: int, num_tokens: int, hidden: int) -> np.ndarray:
    """float32 bf16-representable activations with per-token magnitudes spread over 2^-3..2^3 (so the
    per-token fp8 scales differ) and a few zero groups."""
    import ml_dtypes
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, hidden)) * np.exp2(rng.uniform(-3, 3, (num_tokens, 1)))
    if num_tokens and hidden >= 256:
        x[rng.integers(0, num_tokens), :128] = 0.0  # a zero fp8 group: scale 1, exact zeros
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def skewed_logits(seed: int, num_tokens: int, num_experts: int, hot_experts: int = 2) -> np.ndarray:
    """Logits that send most tokens to the first ``hot_experts`` experts (all on rank 0 with several
    ranks), float32."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    logits[:, :hot_experts] += 4.0
    return logits


def rel_error(y, y_ref) -> float:
    """``||y - y_ref|| / ||y_ref||`` in float64 (0 when both are empty or zero)."""
    y = np.asarray(y, np.float64)
    y_ref = np.asarray(y_ref, np.float64)
    denom = np.linalg.norm(y_ref)
    num = np.linalg.norm(y - y_ref)
    return float(num / denom) if denom > 0 else float(num)


def agree(comm, ok: bool, message: str) -> Tuple[bool, str]:
    """Every rank's verdict over ``comm`` (`gpu_helpers.ranks`): all passed, and the messages of the ranks that
    did not (rank-tagged)."""
    if comm is None or comm.Get_size() == 1:
        return ok, message
    from rankworld import MIN
    all_ok = bool(comm.allreduce(1 if ok else 0, op=MIN))
    messages = comm.allgather(None if ok else f"rank {comm.Get_rank()}: {message}")
    return all_ok, "; ".join(m for m in messages if m)


def verdict(ctx, ok: bool, message: str) -> None:
    """Assert on every rank that every rank passed (`agree`), naming the ranks that did not."""
    from gpu_helpers import ranks
    all_ok, messages = agree(ranks(ctx), ok, message)
    assert all_ok, messages


def cuda_device():
    """This process's current CUDA device (torch)."""
    import torch
    return torch.device("cuda", torch.cuda.current_device())


def deepgemm_reason() -> Optional[str]:
    """Why the DeepGEMM engine cannot run here, or None when it loads."""
    from symmring.moe.engines import deepgemm
    ok, reason = deepgemm.deepgemm_status()
    return None if ok else reason


def fp8_engines() -> list:
    """pytest parameters of the fp8 engines: "builtin", and "deepgemm" skipped with the reason where it
    does not load."""
    import pytest
    reason = deepgemm_reason()
    return ["builtin", pytest.param("deepgemm", marks=pytest.mark.skipif(reason is not None, reason=f"{reason}"))]


def to_torch(a: np.ndarray, dtype, device):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def mixtral_block(w_gate, w_up, w_down, router, topk: int, device) -> Optional[object]:
    """A `transformers` MixtralSparseMoeBlock holding these weights (bf16), or None when transformers is
    missing or its Mixtral experts have a layout this helper does not know (fused 3-D ``gate_up_proj``
    [E, 2I, H] + ``down_proj`` [E, H, I], or a ModuleList of ``w1``/``w3``/``w2``)."""
    import torch
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except Exception:
        return None
    num_experts, inter, hidden = w_gate.shape
    config = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
                           num_experts_per_tok=topk, router_jitter_noise=0.0)
    block = MixtralSparseMoeBlock(config).to(device=device, dtype=torch.bfloat16).eval()
    bf16 = lambda a: to_torch(a, torch.bfloat16, device)  # noqa: E731
    with torch.no_grad():
        experts = block.experts
        if hasattr(experts, "gate_up_proj") and tuple(experts.gate_up_proj.shape) == (num_experts, 2 * inter, hidden):
            experts.gate_up_proj.copy_(bf16(np.concatenate([w_gate, w_up], axis=1)))
            if tuple(experts.down_proj.shape) != (num_experts, hidden, inter):
                return None
            experts.down_proj.copy_(bf16(w_down))
        elif isinstance(experts, torch.nn.ModuleList) and hasattr(experts[0], "w1"):
            for e in range(num_experts):
                experts[e].w1.weight.copy_(bf16(w_gate[e]))
                experts[e].w3.weight.copy_(bf16(w_up[e]))
                experts[e].w2.weight.copy_(bf16(w_down[e]))
        else:
            return None
        gate_weight = getattr(block.gate, "weight", None)
        if gate_weight is None or tuple(gate_weight.shape) != (num_experts, hidden):
            return None
        gate_weight.copy_(bf16(router))
    return block


def mixtral_forward(block, x):
    """``(y, topk_idx int32, topk_weights float32)`` of the transformers block on ``x`` [n, H] bf16; the
    routing is the block's own (``block.gate``), or None when its router does not return it."""
    import torch
    with torch.no_grad():
        out = block(x[None])
        y = (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
        routed = block.gate(x)
    if isinstance(routed, tuple) and len(routed) == 3:
        _, weights, idx = routed
        return y, idx.to(torch.int32).contiguous(), weights.float().contiguous()
    return y, None, None
