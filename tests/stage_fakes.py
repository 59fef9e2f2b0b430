"""Stand-ins for what `symmring.moe.gpu.stages`' launchers take: a layer state holding a distinct address per
buffer, tensors that are only an address, a shape and strides, and kernels that record or do nothing. No GPU.
tests/test_stage_args.py reads back the arguments the launchers pack; tools/launch_cost.py times the launchers.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class FakeTensor:
    def __init__(self, ptr, shape=(1, 1), strides=None, element_size=4):
        self.ptr, self.shape, self._strides, self._size = ptr, shape, strides or (shape[-1], 1), element_size

    def data_ptr(self):
        return self.ptr

    def stride(self, dim):
        return self._strides[dim]

    def element_size(self):
        return self._size

    def __getitem__(self, index):  # a row's bytes (entry_rows[0].nbytes)
        return SimpleNamespace(nbytes=int(np.prod(self.shape[1:])) * self._size)


#: The fake state's buffers: name -> address (each distinct, so a field holding another buffer's shows).
BUFFERS = {name: 0x10000 * (i + 1) for i, name in enumerate(
    ("desc", "counts", "begin", "group_end", "cursor", "total", "status", "counters", "pool_x", "pool_sf", "m_indices",
     "bad_id", "row_src", "row_weight", "token_base", "stage", "entry_rows", "stamps", "call_tokens"))}
COMBINE_READY, COMBINE_ROWS = 0xCE0000, 0xCC0000


def fake_state(*, entry_rows=(2, 3, 64, 8), scale_columns=16, **changes):
    """A layer state (3 ranks, 4 local experts, 64-token slots by default): every buffer a `FakeTensor` at its
    `BUFFERS` address, ``entry_rows`` of that shape, fp8 pool scales of ``scale_columns`` columns; ``changes``
    replace fields."""
    s = SimpleNamespace(num_ranks=3, expert_begin=8, num_local_experts=4, tokens_per_slot=64, topk=8, hidden=2048,
                        fp8_layout=True, capacity=256, align=128, combine_ready=np.uint64(COMBINE_READY),
                        combine_rows=np.uint64(COMBINE_ROWS), combine_tokens=640, args=None)
    for name, ptr in BUFFERS.items():
        setattr(s, name, FakeTensor(ptr, entry_rows if name == "entry_rows" else (8, 4)))
    s.desc = np.uint64(BUFFERS["desc"])  # the launchers take any address-like value
    s.pool_scales = lambda rows: FakeTensor(BUFFERS["pool_sf"], (rows, scale_columns), strides=(1, 4 * -(-rows // 4)))
    for name, value in changes.items():
        setattr(s, name, value)
    return s


#: stages.Kernels attribute -> kernel name.
KERNEL_OF = {"wait_slot": "moe_wait_slot", "produce_route": "moe_produce_route",
             "produce_layout_fp8": "moe_produce_layout_fp8", "produce_layout_bf16": "moe_produce_layout_bf16",
             "wait": "moe_dispatch_wait", "count": "moe_dispatch_count", "stage": "moe_dispatch_stage",
             "scan": "moe_dispatch_scan", "pull": "moe_dispatch_pull", "pull_fp8": "moe_dispatch_pull_fp8",
             "ack": "moe_dispatch_ack", "combine_scatter": "moe_combine_scatter",
             "combine_signal": "moe_combine_signal",
             "combine_wait": "moe_combine_wait", "combine_reduce": "moe_combine_reduce", "end_call": "moe_end_call",
             "refuse_call": "moe_refuse_call", "stamp": "moe_stamp", "sleep": "moe_sleep",
             "produce_chunk_fp8": "moe_produce_chunk_fp8", "dispatch_fused_fp8": "moe_dispatch_fused_fp8",
             "dispatch_fused_fp8_small": "moe_dispatch_fused_fp8_small",
             "combine_fused": "moe_combine_fused", "route_topk": "moe_route_topk"}


def fake_kernels(kernel_for) -> SimpleNamespace:
    """`stages.Kernels`' stand-in: attribute ``a`` is ``kernel_for(a)`` for every attribute of `KERNEL_OF`, and
    ``launch`` (PDL) calls the kernel as a plain launch does."""
    k = SimpleNamespace(spin_blocks=66)
    for attr in KERNEL_OF:
        setattr(k, attr, kernel_for(attr))
    k.launch = lambda fn, grid, block, args, *, stream, shared_mem=0: fn(grid, block, args, stream=stream,
                                                                         shared_mem=shared_mem)
    return k


class FakeKernels(SimpleNamespace):
    """Every kernel a recorder of ``(kernel, grid, args)`` into ``calls``; ``launch`` (PDL) records the same way."""

    def __init__(self):
        calls = []
        super().__init__(**vars(fake_kernels(
            lambda attr: lambda grid, block, args, stream=None, shared_mem=0: calls.append((attr, grid, args)))))
        self.calls = calls
