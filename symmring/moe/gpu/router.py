"""The GPU layer's routing: the top-k of router logits, enqueued, the same in every schedule.

Within the device routing's limits (`symmring.moe.routing.device_routing_applies`) a kernel computes it
(``moe_route_topk``; the small-batch producer routes in its own kernel with the same options), past them
torch's `symmring.moe.routing.route`. The batch schedule routes the whole call at once; the streamed producer
routes each chunk's rows on its own stream (`symmring.moe.gpu.stages.produce_chunk` is handed the router and
the call's routing source: data down, no call back into the layer).
"""

from __future__ import annotations

from typing import Optional, Tuple

from .. import routing as routing_mod
from ..config import RoutingConfig
from . import stages


class Router:
    """Routes a call's tokens with the layer's `RoutingConfig` (its bias: the layer's float32 copy on the
    device, read in place, so a state-dict load into it is what the next call routes with).

    Attributes:
        routing: the routing the layer runs.
        on_device: whether the device routing applies (else torch's).
        args: the options as the kernels' trailing arguments (`symmring.moe.routing.device_router`).
    """

    def __init__(self, routing: RoutingConfig):
        self.routing, self.topk = routing, routing.topk
        self.on_device = routing_mod.device_routing_applies(routing.num_experts, routing.topk, routing.n_group)
        self.args = routing_mod.device_router(
            routing.num_experts, routing.scoring, bias=routing.bias,
            routed_scaling_factor=routing.routed_scaling_factor, n_group=routing.n_group,
            topk_group=routing.topk_group, norm_topk_prob=routing.norm_topk_prob)
        self._torch_options = routing.route_kwargs()

    @staticmethod
    def logits(x, kind: str, source, rows: slice = slice(None)):
        """The router logits of ``x[rows]`` from a ``"router"`` or ``"logits"`` source (enqueued)."""
        return x[rows] @ source.t() if kind == "router" else source[rows]

    def route(self, k, stream, x, kind: str, source, rows: slice = slice(None), out: Optional[Tuple] = None) -> Tuple:
        """``(topk_idx, topk_weights)`` of ``x[rows]`` from a ``"router"`` or ``"logits"`` source, enqueued on the
        current torch stream (``stream``: its CuPy view, ``k``: the layer's kernels), into ``out`` (contiguous
        int32 / float32 ``[rows, topk]``) when given."""
        logits = self.logits(x, kind, source, rows)
        if self.on_device:
            n = int(logits.shape[0])
            if out is None:
                import torch
                out = (torch.empty((n, self.topk), dtype=torch.int32, device=logits.device),
                       torch.empty((n, self.topk), dtype=torch.float32, device=logits.device))
            stages.route_topk(k, stream, logits=routing_mod.logits_operand(logits), router=self.args, topk=self.topk,
                              topk_idx=out[0], topk_weights=out[1])
            return out
        idx, weights = routing_mod.route(logits, self.topk, **self._torch_options)
        if out is not None:
            out[0].copy_(idx)
            out[1].copy_(weights)
            return out
        return idx.contiguous(), weights.contiguous()

    def route_rows(self, k, stream, x, kind: str, source, rows: slice, out: Tuple) -> None:
        """Route ``x[rows]`` into ``out``'s same rows (the streamed producer's chunk; the bucket's chunk may pass
        ``x``'s end, so the rows are clamped to it)."""
        rows = slice(rows.start, min(rows.stop, x.shape[0]))
        if rows.start < rows.stop:
            self.route(k, stream, x, kind, source, rows, out=(out[0][rows], out[1][rows]))


__all__ = ["Router"]
