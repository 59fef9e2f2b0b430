"""The MoE block written plainly in torch: the GPU layer's baseline and its independent check.

Router GEMM, TopK, sort the (token, k) pairs by expert, one grouped GEMM for gate/up, SwiGLU, one grouped
GEMM for down, then a weighted scatter-add back to the tokens. No symmetric memory, no custom kernels:
this is what `symmring.moe.gpu.MoE` must beat (``python -m symmring bench moe`` times both in one run) and
what it is compared against in bf16 dispatch mode (tests/gpu/test_moe_batch.py).

Weights use the ``nn.Linear`` convention of Mixtral and Qwen-MoE (``w1``/``w3``/``w2``): ``w_gate`` and
``w_up`` are ``[num_experts, inter, hidden]``, ``w_down`` is ``[num_experts, hidden, inter]``.

Routing and the grouped-GEMM primitives are the definitions the layer uses (`symmring.moe.routing`,
`symmring.moe.engines`); what is plain here is the data movement: sort by expert, gather, scatter-add.

Nothing here imports torch at module import time beyond the first call (no import-time side effects).
"""

from __future__ import annotations

from typing import Tuple

from ..errors import ConfigError
from .engines.torch_bf16 import fuse_gate_up, grouped_mm, swiglu
from .routing import route


def _torch():
    import torch  # lazy: symmring imports without torch
    return torch


def experts_forward(x, topk_idx, topk_weights, w13, w_down, *, expert_offset: int = 0):
    """The experts of one rank applied to ``x``: sort by expert, grouped GEMMs, weighted scatter-add.

    Args:
        x: bf16 ``[num_tokens, hidden]``.
        topk_idx: int ``[num_tokens, topk]``, global expert ids; ``-1`` (or any id outside this rank's
            ``[expert_offset, expert_offset + E)``) contributes nothing.
        topk_weights: float ``[num_tokens, topk]``.
        w13: ``[E, 2 * inter, hidden]`` (`fuse_gate_up`); w_down: ``[E, hidden, inter]``.
        expert_offset: global id of this rank's first expert.

    Returns:
        float32 ``[num_tokens, hidden]``: the weighted sum over this rank's experts (not yet rounded).
    """
    torch = _torch()
    num_tokens, topk = topk_idx.shape
    num_local, inter2, _ = w13.shape
    local = topk_idx.long().flatten() - expert_offset
    valid = (local >= 0) & (local < num_local)
    # Stable sort: rows of one expert keep token order (no effect on the result, easier to inspect).
    keys = torch.where(valid, local, torch.full_like(local, num_local))
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=num_local + 1)[:num_local]
    num_rows = int(counts.sum())  # the plain version syncs here; the symmring layer does not
    order = order[:num_rows]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    token_of = order // topk
    xs = x[token_of]
    h = grouped_mm(xs, w13.transpose(1, 2), offs)
    act = swiglu(h, inter2 // 2)
    out = grouped_mm(act, w_down.transpose(1, 2), offs)
    weight = topk_weights.float().flatten()[order]
    y = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    y.index_add_(0, token_of, out.float() * weight[:, None])
    return y


class TorchMoE:
    """The whole MoE block on one device in plain torch (all experts local).

    Args:
        w_gate, w_up: ``[num_experts, inter, hidden]`` bf16; w_down: ``[num_experts, hidden, inter]`` bf16.
        topk: experts per token; scoring, bias, routed_scaling_factor: as in `route`.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> w_gate, w_up = (torch.randn(4, 32, 128, generator=g).bfloat16() / 11 for _ in range(2))
        >>> w_down = (torch.randn(4, 128, 32, generator=g) / 6).bfloat16()
        >>> x, router = torch.randn(6, 128, generator=g).bfloat16(), torch.randn(4, 128, generator=g)
        >>> moe = TorchMoE(w_gate, w_up, w_down, topk=2)
        >>> y = moe.forward(x, logits=x.float() @ router.T)
        >>> y.shape, y.dtype
        (torch.Size([6, 128]), torch.bfloat16)
    """

    def __init__(self, w_gate, w_up, w_down, topk: int, scoring: str = "softmax", *, bias=None,
                 routed_scaling_factor: float = 1.0):
        self.w13 = fuse_gate_up(w_gate, w_up)
        self.w_down = w_down.contiguous()
        self.num_experts = w_gate.shape[0]
        self.topk = topk
        self.scoring = scoring
        self.bias = bias
        self.routed_scaling_factor = routed_scaling_factor

    def route(self, x, router_weight=None, logits=None) -> Tuple:
        """``(topk_idx, topk_weights)`` from ``logits`` or from ``x @ router_weight.T`` (bf16 GEMM)."""
        if logits is None:
            if router_weight is None:
                raise ConfigError("router_weight=None and logits=None: expected one of them")
            logits = x @ router_weight.t()
        return route(logits, self.topk, self.scoring, bias=self.bias, routed_scaling_factor=self.routed_scaling_factor)

    def forward(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None):
        """``y`` bf16 ``[num_tokens, hidden]``; routing from ``topk_idx``/``topk_weights`` when given."""
        if topk_idx is None:
            topk_idx, topk_weights = self.route(x, router_weight, logits)
        y = experts_forward(x, topk_idx, topk_weights, self.w13, self.w_down)
        return y.to(x.dtype)

