"""The MoE block written plainly in torch: the GPU layer's baseline and its independent check.

Router GEMM, TopK, sort the (token, k) pairs by expert, one grouped GEMM for gate/up, SwiGLU, one grouped
GEMM for down, then a weighted scatter-add back to the tokens. No symmetric memory, no custom kernels:
this is what `symmring.moe.gpu.MoE` must beat (``python -m symmring bench moe`` times both in one run) and
what it is compared against in bf16 dispatch mode (tests/gpu/test_moe_batch.py).

Weights use the ``nn.Linear`` convention of Mixtral and Qwen-MoE (``w1``/``w3``/``w2``): ``w_gate`` and
``w_up`` are ``[num_experts, inter, hidden]``, ``w_down`` is ``[num_experts, hidden, inter]``.

Routing (the same definitions as `symmring.moe.reference`):

* ``"softmax"`` (Mixtral, Qwen-MoE): the ``topk`` largest logits (softmax is monotonic), weights = their
  softmax probabilities renormalised to sum to 1, i.e. a softmax over the chosen logits (float32).
* ``"sigmoid_bias"`` (DeepSeek-V3): ``s = sigmoid(logits)`` in float32; experts chosen by the ``topk``
  largest ``s + bias``; weights ``s`` of the chosen experts (no bias) renormalised to sum to 1, times
  ``routed_scaling_factor``.

Nothing here imports torch at module import time beyond the first call (no import-time side effects).
"""

from __future__ import annotations

from typing import Tuple

from ..errors import ConfigError

#: Routing functions accepted by `route`.
SCORINGS = ("softmax", "sigmoid_bias")


def _torch():
    import torch  # lazy: symmring imports without torch
    return torch


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
        >>> idx, w = route(torch.randn(4, 8), topk=2)
        >>> idx.shape, float(w.sum(-1)[0])
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


def grouped_mm(a, b_t, offs):
    """``a [M, K] @ b_t[g] [K, N]`` for the row group ``g`` given by cumulative ends ``offs`` (int32).

    ``torch._grouped_mm`` where it exists (CUTLASS grouped GEMM on sm_90; a CPU kernel in recent torch),
    else one matmul per group (needs the offsets on the host). Rows past ``offs[-1]`` are left undefined.
    """
    torch = _torch()
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b_t, offs=offs)
    out = a.new_empty((a.shape[0], b_t.shape[2]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b_t[g]
        start = end
    return out


def swiglu(h, inter: int):
    """``silu(gate) * up`` of ``h = [gate | up]`` (``[M, 2 * inter]`` -> ``[M, inter]``, dtype of ``h``)."""
    torch = _torch()
    return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]


def fuse_gate_up(w_gate, w_up):
    """``[E, 2 * inter, hidden]`` of gate rows then up rows, so L1 is one grouped GEMM."""
    torch = _torch()
    return torch.cat([w_gate, w_up], dim=1).contiguous()


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
        >>> moe = TorchMoE(w_gate, w_up, w_down, topk=2)
        >>> y = moe.forward(x, logits=x.float() @ router.T)
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

