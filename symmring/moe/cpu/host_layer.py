"""`HostLayer`: the former name of the CPU layer with the GPU layer's constructor, kept for code written against it.

The CPU layer, `symmring.moe.cpu.layer.ExpertParallelMoE`, now takes the GPU layer's arguments itself (the values
of `symmring.moe.config`), bf16 torch tensors in and out as well as float32 tensors and NumPy arrays, so
`HostLayer` is that class (``HostLayer(...).layer`` is the layer itself, as the wrapped layer was).
`symmring.MoE` picks it on the host backend; `symmring.moe.integrations.module.MoEModule` builds it there.

Example:
    >>> import torch, symmring
    >>> ctx = symmring.init("host")
    >>> g = torch.Generator().manual_seed(0)
    >>> wg, wu = (torch.randn(4, 32, 128, generator=g).bfloat16() / 11 for _ in range(2))
    >>> wd = (torch.randn(4, 128, 32, generator=g) / 6).bfloat16()
    >>> from symmring.moe.config import Experts, RoutingConfig
    >>> layer = HostLayer(ctx, Experts(wg, wu, wd), RoutingConfig(num_experts=4, topk=2), max_tokens=16)
    >>> x = torch.randn(5, 128, generator=g).bfloat16()
    >>> y = layer.forward(x, logits=torch.randn(5, 4, generator=g))
    >>> y.shape, y.dtype
    (torch.Size([5, 128]), torch.bfloat16)
    >>> layer.close(); ctx.close()
"""

from __future__ import annotations

from ..config import ScheduleConfig
from .layer import ExpertParallelMoE

#: The CPU layer (an alias: the layer takes the GPU layer's constructor and forward itself).
HostLayer = ExpertParallelMoE
#: ``x_format`` values of the CPU layer's ring.
X_FORMATS = ("bf16", "fp8_e4m3")
#: The GPU layer's options that have no meaning on the CPU layer (refused, naming them, unless at their
#: defaults): ``engine`` and the fields of `Experts` and `ScheduleConfig` listed here.
GPU_ONLY = ("engine",) + tuple(f"experts.{name}" for name in ("expert_dtype", "w_gate_scale", "w_up_scale",
                                                              "w_down_scale")) \
    + tuple(f"schedule.{name}" for name in ScheduleConfig.GPU_ONLY)

__all__ = ["HostLayer", "GPU_ONLY", "X_FORMATS"]
