"""Small random transformers MoE models (`symmring.moe.integrations.tiny`, re-exported here) and a CPU stand-in
of the GPU layer, shared by tests/test_moe_module.py (CPU), tests/mpi/test_moe_module_mpi.py and tests/gpu/test_moe_module.py.
"""

from __future__ import annotations

from types import SimpleNamespace

from symmring.moe.integrations.tiny import (DOWN_SCALE, FAMILIES, input_ids, moe_blocks, tiny_config,  # noqa: F401
                                            tiny_model)


class StandInLayer:
    """The GPU layer's constructor and forward on any device in plain torch (`symmring.moe.torch_ref`):
    what `MoEModule` needs of `symmring.moe.gpu.MoE`, for tests without a GPU. ``ctx`` needs ``rank`` and
    ``world_size``; with several ranks only this rank's experts contribute (no exchange)."""

    def __init__(self, ctx, experts, routing, *, max_tokens, **others):
        from symmring.moe.weights import expert_weights
        num_experts, topk, hidden, inter = routing.num_experts, routing.topk, experts.hidden, experts.inter
        w_gate, w_up, w_down = experts.w_gate, experts.w_up, experts.w_down
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
        self.bias = None if routing.bias is None else routing.bias.float()
        self.routing = routing if self.bias is None else routing.with_bias(self.bias)
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
        idx, weights = routing.route(logits, self.topk, **self.routing.route_kwargs())
        w = self.engine.weights
        y = torch_ref.experts_forward(x, idx, weights, w.w13, w.w_down, expert_offset=self.expert_begin)
        return y.to(x.dtype)

    def close(self):
        self.closed = True
