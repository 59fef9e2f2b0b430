"""`symmring.moe.stages`' launchers of the routing kernels, on the CPU: the argument tuple each builds has one
value per parameter of its kernel in device/moe/producer.cu, of the parameter's size, in order (a fake launcher
records the call; fake tensors stand in for torch's). On a GPU, tests/gpu/test_moe_routing.py runs them."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from symmring import jit
from symmring.moe import routing, stages

#: Bytes of each C parameter type the kernels take.
C_SIZES = {"int": 4, "float": 4, "long long": 8, "uint64_t": 8}


def kernel_params(name):
    """The parameter sizes of ``extern "C"`` kernel ``name`` in device/moe/producer.cu (pointers: 8)."""
    source = jit.read_source("moe/producer.cu")
    params = re.search(r"__global__ void " + name + r"\(([^)]*)\)", source).group(1)
    sizes = []
    for p in (" ".join(p.split()) for p in params.split(",")):
        kind = p.rsplit(" ", 1)[0].replace("const ", "")
        sizes.append(8 if "*" in p else C_SIZES[kind])
    return sizes


class FakeTensor:
    def __init__(self, ptr, shape, strides=None, element_size=4):
        self.ptr, self.shape, self._strides, self._size = ptr, shape, strides or (shape[1], 1), element_size

    def data_ptr(self):
        return self.ptr

    def stride(self, dim):
        return self._strides[dim]

    def element_size(self):
        return self._size


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, fn, grid, block, args, *, stream, shared_mem=0):
        self.calls.append((fn, args))


def sizes_of(args):
    return [a.dtype.itemsize if isinstance(a, np.generic) else 8 for a in args]


def fake_layer():
    launch = Recorder()
    k = SimpleNamespace(launch=launch, produce_chunk_fp8="produce", spin_blocks=66,
                        route_topk=lambda grid, block, args, stream: launch.calls.append(("route", args)))
    s = SimpleNamespace(topk=8, hidden=2048, desc=np.uint64(0xD0), counters=FakeTensor(0xC0, (5, 1)))
    chunk = SimpleNamespace(chunk=3, token_base=0, num_valid=2)
    return k, s, chunk


def test_producer_arguments_match_its_kernel_with_and_without_logits():
    k, s, chunk = fake_layer()
    router = routing.device_router(128, "sigmoid_bias", routed_scaling_factor=2.5, n_group=8, topk_group=4)
    idx, w = FakeTensor(0x100, (2, 8)), FakeTensor(0x200, (2, 8))
    x = FakeTensor(0x300, (2, 2048), element_size=2)
    logits = FakeTensor(0x400, (2, 128), strides=(160, 1), element_size=2)
    want = kernel_params("moe_produce_chunk_fp8")
    stages.produce_fused(k, s, None, chunk=chunk, topk_idx=idx, topk_weights=w, x=x, router=router)
    stages.produce_fused(k, s, None, chunk=chunk, topk_idx=idx, topk_weights=w, x=x, router=router,
                         logits=(logits, routing.LOGITS_DTYPE_CODES["bfloat16"]))
    (_, plain), (_, routed) = k.launch.calls
    assert sizes_of(plain) == want and sizes_of(routed) == want
    assert int(plain[8]) == 0 and int(routed[8]) == 0x400  # logits: null (copy topk) vs the call's logits
    assert (int(routed[9]), int(routed[10])) == (1, 160)   # bf16, row stride in elements
    assert routed[11:] == router and plain[11:] == router   # the options in RouterOptions' order


def test_routing_kernel_arguments_match_its_kernel():
    k, _, _ = fake_layer()
    router = routing.device_router(256, "softmax", norm_topk_prob=False)
    logits = FakeTensor(0x500, (3, 256))
    stages.route_topk(k, None, logits=(logits, 0), router=router, topk=8, topk_idx=FakeTensor(0x600, (3, 8)),
                      topk_weights=FakeTensor(0x700, (3, 8)))
    (_, args), = k.launch.calls
    assert sizes_of(args) == kernel_params("moe_route_topk")
    assert [int(a) for a in args[3:6]] == [3, 0x600, 0x700] and int(args[10]) == 8  # tokens, outputs, topk
    assert [int(a) for a in args[6:10]] == [int(v) for v in router[:4]]
