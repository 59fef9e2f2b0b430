"""Routing of the GPU MoE layer: router logits to ``(topk_idx, topk_weights)``, in torch.

The same definitions as the NumPy reference (`symmring.moe.reference.select_topk`):

* ``"softmax"`` (Mixtral, Qwen-MoE): the ``topk`` largest logits (softmax is monotonic), weights = their
  softmax probabilities renormalised to sum to 1, i.e. a softmax over the chosen logits (float32).
* ``"sigmoid_bias"`` (DeepSeek-V3): ``s = sigmoid(logits)`` in float32; experts chosen by the ``topk``
  largest ``s + bias``; weights ``s`` of the chosen experts (no bias) renormalised to sum to 1, times
  ``routed_scaling_factor``.

torch is imported on the first call, not at module import.
"""

from __future__ import annotations

from ..errors import ConfigError


def _torch():
    import torch  # lazy: symmring imports without torch
    return torch


#: Routing functions accepted by `route`.
SCORINGS = ("softmax", "sigmoid_bias")


def route(logits, topk: int, scoring: str = "softmax", *, bias=None, routed_scaling_factor: float = 1.0):
    """TopK routing of router ``logits``.

    Args:
        logits: ``[num_tokens, num_experts]`` tensor (any float dtype; computed in float32).
        topk: experts per token, ``1 <= topk <= num_experts``.
        scoring: ``"softmax"`` (Mixtral) or ``"sigmoid_bias"`` (DeepSeek-V3, with ``bias``).
        bias: float ``[num_experts]`` selection bias (sigmoid_bias only; None means zeros).
        routed_scaling_factor: factor applied to the renormalised sigmoid weights.

    Returns:
        ``(topk_idx int32 [num_tokens, topk], topk_weights float32 [num_tokens, topk])``, on the
        device of ``logits``.

    Raises:
        ConfigError: bad ``scoring``, ``topk`` or shapes.

    Example:
        >>> import torch
        >>> idx, w = route(torch.randn(4, 8), topk=2)
        >>> idx.shape, round(float(w.sum(-1)[0]), 6)     # the chosen weights sum to 1 (to float32 rounding)
        (torch.Size([4, 2]), 1.0)
    """
    torch = _torch()
    if scoring not in SCORINGS:
        raise ConfigError(f"scoring={scoring!r}: expected one of {list(SCORINGS)}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ConfigError(f"logits: expected a 2-D tensor [num_tokens, num_experts], got "
                          f"{getattr(logits, 'shape', type(logits).__name__)}")
    num_experts = logits.shape[1]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ConfigError(f"topk={topk!r}: expected an int in [1, num_experts={num_experts}]")
    scores = logits.float()
    if scoring == "softmax":
        chosen, idx = torch.topk(scores, topk, dim=-1)
        weights = torch.softmax(chosen, dim=-1)
    else:
        probs = torch.sigmoid(scores)
        choice = probs if bias is None else probs + bias.float().to(probs.device)[None, :]
        _, idx = torch.topk(choice, topk, dim=-1)
        weights = probs.gather(1, idx)
        weights = weights / weights.sum(dim=-1, keepdim=True) * float(routed_scaling_factor)
    return idx.to(torch.int32), weights.float()
