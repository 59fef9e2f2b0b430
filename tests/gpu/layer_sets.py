"""The GPU layer set of issue 33's tests (tests/gpu/test_no_silent_rows.py, test_soak_faults.py): the layers of
`SHAPES` on one workspace as a `silent_rows.Adapter`. Imported after `moe_helpers.gpu_layer_torch` (a GPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

from moe_helpers import cuda_device as dev, to_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: silent_rows
import silent_rows  # noqa: E402

from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261233))
NUM_EXPERTS = 24  # an even split over 1, 2, 3, 4 or 8 PEs
#: Layers (hidden, inter, top-k): A and B share a ring, C has its own.
SHAPES = ((256, 256, 2), (256, 256, 2), (512, 256, 2))
MAX_TOKENS = 64
#: The layers' device wait bound; the host exchanges keep the context's (SYMMRING_TIMEOUT_S).
DEVICE_BOUND_S = 1.0


class GpuLayers(silent_rows.Adapter):
    """The layers of `SHAPES` (bf16 dispatch, torch engine, a 2 x 32-token ring) on a fresh workspace."""

    x_format, rtol, bf16, device_bound_s, stall_layer_streams = "bf16", 0.05, True, DEVICE_BOUND_S, True

    def __init__(self, ctx, seed: int, shapes=SHAPES, workspace=None):
        self.rank, self.world, self.max_tokens = ctx.rank, ctx.world_size, MAX_TOKENS
        self.ws = workspace if workspace is not None else Workspace(ctx, max_tokens=MAX_TOKENS)
        self.defs = silent_rows.make_layer_defs(seed, shapes, NUM_EXPERTS, bf16=True)
        e = NUM_EXPERTS // self.world
        mine = slice(self.rank * e, (self.rank + 1) * e)
        self.layers = [MoE(ctx, Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (d.w_gate, d.w_up, d.w_down))),
                           RoutingConfig(NUM_EXPERTS, d.topk), max_tokens=MAX_TOKENS, engine="torch",
                           schedule=ScheduleConfig(num_slots=2, tokens_per_slot=MAX_TOKENS // 2, x_format="bf16",
                                                   timeout_s=DEVICE_BOUND_S), workspace=self.ws)
                       for d in self.defs]

    def inputs(self, x, idx, weights):
        return (to_torch(x, torch.bfloat16, dev()), to_torch(idx, torch.int32, dev()),
                to_torch(weights, torch.float32, dev()))

    def call(self, layer, x, idx, weights, **kwargs):
        """The layer's output tensor (enqueued; not synchronised); with a test hook (``consumer_delay_ns``) through
        ``layer.debug.forward``."""
        x, idx, weights = self.inputs(x, idx, weights)
        moe = self.layers[layer]
        forward = moe.debug.forward if "consumer_delay_ns" in kwargs else moe.forward
        return forward(x, topk_idx=idx, topk_weights=weights, **kwargs)

    def forward(self, layer, x, idx, weights, *, streaming=False, stall_s=0.0):
        # This PE's consumer stalls past the bound (a test hook), or the call runs as any other.
        stall = dict(consumer_delay_ns={0: int(stall_s * 1e9)}) if stall_s else {}
        y = self.call(layer, x, idx, weights, streaming=streaming, **stall)
        return y.float().cpu().numpy()

    def reference(self, layer, x, idx, weights):
        """`silent_rows.reference_rows` in float64 torch on this GPU (plain torch ops, independent of the layer;
        the NumPy one costs tens of ms per call, too slow for a soak of thousands of steps)."""
        if not hasattr(self, "_w64"):
            self._w64 = [tuple(torch.from_numpy(w).to(dev(), torch.float64) for w in (d.w_gate, d.w_up, d.w_down))
                         for d in self.defs]
        w_gate, w_up, w_down = self._w64[layer]
        if x.shape[0] == 0:
            return np.zeros((0, self.defs[layer].hidden))
        x64 = torch.from_numpy(np.asarray(x, np.float64)).to(dev())
        idx_t = torch.from_numpy(idx).to(dev(), torch.int64)
        live = idx_t >= 0
        e = idx_t.clamp(min=0)  # [n, K]
        h = torch.einsum("nkih,nh->nki", w_gate[e], x64)
        act = h / (1.0 + torch.exp(-h)) * torch.einsum("nkih,nh->nki", w_up[e], x64)
        out = torch.einsum("nkhi,nki->nkh", w_down[e], act)
        weights_t = torch.from_numpy(weights).to(dev(), torch.float64) * live
        return (weights_t[:, :, None] * out).sum(1).cpu().numpy()

    def close(self):
        for layer in self.layers:
            layer.close()
        self.ws.close()
