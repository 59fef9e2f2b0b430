"""A GPU layer call's tensors checked before anything is enqueued: ``x`` and the routing source.

The routing source of a call is one of three (a ``(kind, value)`` pair the router and the graph cache read):
``("router", router_weight)`` (the router GEMM runs in the call), ``("logits", logits)`` or
``("given", (topk_idx, topk_weights))``.
"""

from __future__ import annotations

from typing import Tuple

from ...errors import BackendError, ConfigError
from ..weights import check_tensor


def torch_module():
    """torch, or a `BackendError` naming the extra that brings it (the GPU layer needs it)."""
    try:
        import torch
    except ImportError:  # one line naming the extra, not a traceback into the layer
        from ... import deps
        raise BackendError(f"symmring.moe.gpu.MoE needs torch: {deps.hint('torch')}") from None
    return torch


def this_device():
    """The torch device of this PE's GPU (the current CUDA device: the backend made it current)."""
    torch = torch_module()
    return torch.device("cuda", torch.cuda.current_device())


def check_x(x, spec, device):
    """``x`` validated (bf16 ``[n <= max_tokens, hidden]`` on ``device``), with 16-byte aligned rows."""
    torch = torch_module()
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ConfigError(f"x: expected a 2-D torch tensor [n, hidden={spec.hidden}], got "
                          f"{getattr(x, 'shape', type(x).__name__)}")
    n = int(x.shape[0])
    if n > spec.max_tokens:
        raise ConfigError(f"x.shape[0]={n}: expected at most max_tokens={spec.max_tokens}")
    check_tensor("x", x, torch.bfloat16, (n, spec.hidden), device)
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()  # the kernels read 16-byte vectors of rows
    return x


def check_logits(logits, n: int, spec, device) -> None:
    """Raise ConfigError unless ``logits`` are a floating-point ``[n, num_experts]`` tensor on ``device``."""
    check_tensor("logits", logits, None, (n, spec.num_experts), device)
    if not logits.is_floating_point():
        raise ConfigError(f"logits.dtype={logits.dtype}: expected a floating-point dtype")


def routing_source(x, spec, device, router_weight, logits, topk_idx, topk_weights) -> Tuple:
    """The call's routing source, validated (nothing enqueued): ``("given", (topk_idx, topk_weights))`` (made
    contiguous), ``("router", router_weight)`` or ``("logits", logits)``.

    Raises:
        ConfigError: not exactly one source, or a tensor of the wrong dtype, shape or device, named.
    """
    torch = torch_module()
    n = x.shape[0]
    sources = [s for s, v in (("router_weight", router_weight), ("logits", logits), ("topk_idx", topk_idx))
               if v is not None]
    if len(sources) != 1:
        raise ConfigError(f"routing: got {sources or 'none'}; expected exactly one of router_weight, "
                          "logits, or topk_idx with topk_weights")
    if topk_idx is not None:
        check_tensor("topk_idx", topk_idx, torch.int32, (n, spec.topk), device)
        check_tensor("topk_weights", topk_weights, torch.float32, (n, spec.topk), device)
        return "given", (topk_idx.contiguous(), topk_weights.contiguous())
    if topk_weights is not None:
        raise ConfigError("topk_weights: given without topk_idx")
    if router_weight is not None:
        check_tensor("router_weight", router_weight, torch.bfloat16, (spec.num_experts, spec.hidden), device)
        return "router", router_weight
    check_logits(logits, n, spec, device)
    return "logits", logits


__all__ = ["check_tensor", "check_x", "check_logits", "routing_source", "this_device", "torch_module"]
