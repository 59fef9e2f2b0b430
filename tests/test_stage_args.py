"""`symmring.moe.gpu.stages`' launchers of the routing kernels, on the CPU: the argument tuple each builds has one
value per parameter of its kernel in device/moe/producer.cu, of the parameter's size, in order (a fake launcher
records the call; fake tensors stand in for torch's). On a GPU, tests/gpu/test_moe_routing.py runs them."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from symmring import jit
from symmring.moe import routing
from symmring.moe.gpu import stages

#: Bytes of each C parameter type the kernels take.
C_SIZES = {"int": 4, "float": 4, "long long": 8, "uint64_t": 8}


def kernel_params(name, source_file="moe/producer.cu"):
    """The parameter sizes of ``extern "C"`` kernel ``name`` in ``source_file`` (pointers: 8)."""
    source = jit.read_source(source_file)
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
    s = SimpleNamespace(topk=8, hidden=2048, desc=np.uint64(0xD0), counters=FakeTensor(0xC0, (5, 1)),
                        call_tokens=FakeTensor(0xE0, (1, 1)))
    chunk = SimpleNamespace(chunk=3, token_base=0, num_valid=2)
    return k, s, chunk


def test_producer_arguments_match_its_kernel_with_and_without_logits():
    k, s, chunk = fake_layer()
    router = routing.device_router(128, "sigmoid_bias", routed_scaling_factor=2.5, n_group=8, topk_group=4)
    idx, w = FakeTensor(0x100, (2, 8)), FakeTensor(0x200, (2, 8))
    x = FakeTensor(0x300, (2, 2048), element_size=2)
    logits = FakeTensor(0x400, (2, 128), strides=(160, 1), element_size=2)
    want = kernel_params("moe_produce_chunk_fp8")
    stages.produce_fused(k, s, None, chunk=chunk, topk_idx=idx, topk_weights=w, x=x, router=router, layer=7)
    stages.produce_fused(k, s, None, chunk=chunk, topk_idx=idx, topk_weights=w, x=x, router=router, layer=7,
                         logits=(logits, routing.LOGITS_DTYPE_CODES["bfloat16"]))
    (_, plain), (_, routed) = k.launch.calls
    assert sizes_of(plain) == want and sizes_of(routed) == want
    assert int(plain[7]) == 0xE0 and int(routed[7]) == 0xE0  # the device word of the call's token count
    assert int(plain[9]) == 7 and int(routed[9]) == 7  # the layer of the call identity in the meta row
    assert int(plain[10]) == 0 and int(routed[10]) == 0x400  # logits: null (copy topk) vs the call's logits
    assert (int(routed[11]), int(routed[12])) == (1, 160)   # bf16, row stride in elements
    assert routed[13:] == router and plain[13:] == router   # the options in RouterOptions' order


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


class FakeRows(FakeTensor):
    """A tensor of which the launchers read addresses, a row's bytes (``t[0].nbytes``) and slices."""

    def __init__(self, ptr, shape, element_size=4):
        super().__init__(ptr, shape, element_size=element_size)

    def __getitem__(self, index):
        return SimpleNamespace(nbytes=int(np.prod(self.shape[1:])) * self._size)


def test_pass_launchers_match_their_kernels():
    """pull, pull_fp8 and combine_scatter carry the pass arguments (device/moe/dispatch.cu PassRows): one value
    per kernel parameter, of its size, and the entry map of a window's later chunk at its block's offset."""
    from symmring.moe.gpu.plan import WindowStep
    calls = []

    def recorder(name):
        return lambda grid, block, args, stream, **kw: calls.append((name, args))

    k = SimpleNamespace(pull=recorder("moe_dispatch_pull"), pull_fp8=recorder("moe_dispatch_pull_fp8"),
                        combine_scatter=recorder("moe_combine_scatter"))
    entry_rows = FakeRows(0x10000, (2, 3, 64, 2))  # [window chunks][ranks][tokens][k]
    base = dict(desc=np.uint64(0xD0), num_ranks=3, tokens_per_slot=64, cursor=FakeTensor(0xA0, (4, 1)),
                pool_x=FakeTensor(0xB0, (8, 1)), row_src=FakeTensor(0xB8, (8, 4)), row_weight=FakeTensor(0xBC, (8, 1)),
                expert_begin=0, num_local_experts=4, status=FakeTensor(0xE0, (1, 1)), stage=None, entry_rows=entry_rows,
                m_indices=FakeTensor(0xF0, (8, 1)), total=FakeTensor(0xF8, (1, 1)), token_base=FakeTensor(0xFC, (2, 3)),
                combine_rows=np.uint64(0xCC), capacity=256, combine_tokens=640)
    window = WindowStep(5, 6, rows_bound=256, token_begin=0, num_valid=64, passes=((0, 256), (256, 256), (512, 12)))
    bf16 = SimpleNamespace(pool_sf=None, **base)
    stages.pull(k, bf16, None, chunk=6, window=window, pass_idx=2)
    fp8 = SimpleNamespace(pool_sf=FakeTensor(0xD8, (64, 1)), **base)
    fp8.pool_scales = lambda rows: FakeTensor(0xD8, (rows, 2), strides=(1, 4 * -(-rows // 4)))
    stages.pull(k, fp8, None, chunk=5, window=window, pass_idx=0)
    stages.combine_scatter(k, fp8, None, out=FakeTensor(0x500, (8, 1)), window_begin=5, pass_begin=512, pass_rows=12)
    files = {"moe_dispatch_pull": "moe/dispatch.cu", "moe_dispatch_pull_fp8": "moe/dispatch.cu",
             "moe_combine_scatter": "moe/combine.cu"}
    for name, args in calls:
        assert sizes_of(args) == kernel_params(name, files[name]), name
    (_, pull_bf16), (_, pull_fp8), (_, scatter) = calls
    block = 3 * 64 * 2 * 4  # one chunk's [ranks][tokens][k] int32
    assert [int(a) for a in pull_bf16[-3:]] == [0x10000 + block, 512, 12]  # the window's 2nd chunk, the last pass
    assert [int(a) for a in pull_fp8[-3:]] == [0x10000, 0, 256]
    assert [int(a) for a in scatter[-3:]] == [512, 12, 640]  # the pass, then the combine rows' tokens
    one_pass = WindowStep(5, 5, rows_bound=100, token_begin=0, num_valid=64, passes=((0, 100),))
    calls.clear()
    stages.pull(k, bf16, None, chunk=5, window=one_pass)
    assert [int(a) for a in calls[0][1][-3:]] == [0, 0, 100]  # one pass: no entry map


def test_fused_combine_arguments_match_its_kernel():
    """The fused combine goes through the layer's one launcher (PDL where allowed; no cooperative launch: it needs
    no residency), one value per kernel parameter, and its ``counters`` is the address of COUNTER_SEND with
    COUNTER_TICKET the word after it (device/moe/combine.cu reads counters[0] and counters[1])."""
    from symmring.moe.gpu.plan import WindowStep
    k, _, _ = fake_layer()
    k.combine_fused = "combine"
    s = SimpleNamespace(desc=np.uint64(0xD0), topk=8, hidden=2048, num_ranks=2, num_local_experts=4,
                        row_src=FakeTensor(0xB8, (8, 4)), counts=FakeTensor(0xA0, (4, 1)),
                        begin=FakeTensor(0xA8, (4, 1)), token_base=FakeTensor(0xFC, (1, 2)),
                        m_indices=FakeTensor(0xF0, (8, 1)), combine_rows=np.uint64(0xCC),
                        combine_ready=np.uint64(0xCE), counters=FakeTensor(0xC0, (5, 1)),
                        call_tokens=FakeTensor(0xE0, (1, 1)), combine_tokens=96)
    window = WindowStep(3, 3, rows_bound=256, token_begin=0, num_valid=5, source_tokens=9, passes=((0, 256),))
    y = FakeTensor(0x900, (5, 2048), element_size=2)
    stages.combine_fused(k, s, None, out=FakeTensor(0x500, (256, 2048)), window=window, ack_now=True,
                         topk_idx=FakeTensor(0x600, (5, 8)), topk_weights=FakeTensor(0x700, (5, 8)), y=y,
                         end_call_chunks=1)
    (fn, args), = k.launch.calls
    assert fn == "combine"
    assert sizes_of(args) == kernel_params("moe_combine_fused", "moe/combine.cu")
    assert stages.COUNTER_TICKET == stages.COUNTER_SEND + 1 < stages.NUM_COUNTERS
    assert int(args[-3]) == 0xC0 + 4 * stages.COUNTER_SEND
    assert [int(a) for a in args[-2:]] == [256, 96]  # the window's pool rows, the combine rows' tokens


def _bounds_state():
    return SimpleNamespace(desc=np.uint64(0xD0), num_ranks=2, num_local_experts=4, expert_begin=4, align=128,
                           counts=FakeTensor(0xA0, (4, 1)), begin=FakeTensor(0xA8, (4, 1)),
                           group_end=FakeTensor(0xAC, (4, 1)), cursor=FakeTensor(0xB0, (4, 1)),
                           total=FakeTensor(0xB4, (1, 1)), token_base=FakeTensor(0xFC, (1, 2)),
                           pool_x=FakeTensor(0xB8, (8, 1)), pool_sf=FakeTensor(0xBC, (8, 1)),
                           m_indices=FakeTensor(0xF0, (8, 1)), row_src=FakeTensor(0xC4, (8, 4)),
                           row_weight=FakeTensor(0xC8, (8, 1)), status=FakeTensor(0xE0, (1, 1)),
                           bad_id=FakeTensor(0xE4, (4, 1)), counters=FakeTensor(0xC0, (5, 1)), stage=None,
                           pool_scales=lambda rows: FakeTensor(0xBC, (rows, 2), strides=(1, 4 * -(-rows // 4))))


def test_scan_and_fused_dispatch_carry_the_plans_bounds():
    """The scan and the fused dispatch get the window's bounds the device checks (device/moe/bounds.cuh): the
    rows its passes cover and the rows one expert may hold (`WindowStep.expert_rows_bound`: ``rows_per_expert``
    where it is below the pool rows, else the rows spanned), one value per kernel parameter."""
    from symmring.moe.gpu.plan import WindowStep
    calls = []
    k, _, _ = fake_layer()
    k.dispatch_fused_fp8 = "dispatch"
    k.scan = lambda grid, block, args, stream, **kw: calls.append(("moe_dispatch_scan", args))
    s = _bounds_state()
    passes = WindowStep(2, 3, rows_bound=512, token_begin=0, num_valid=64, source_tokens=600, rows_per_expert=512,
                        passes=((0, 512), (512, 512), (1024, 100)))
    small = WindowStep(3, 3, rows_bound=640, token_begin=0, num_valid=4, source_tokens=8, rows_per_expert=8,
                       passes=((0, 640),))
    assert (passes.rows_spanned, passes.expert_rows_bound) == (1124, 1124)
    assert (small.rows_spanned, small.expert_rows_bound) == (640, 8)
    stages.scan(k, s, None, window=passes)
    stages.scan(k, s, None, window=small)
    stages.dispatch_fused(k, s, None, window=small, ack_now=True, layer=5)
    (_, scan_passes), (_, scan_small) = calls
    want = kernel_params("moe_dispatch_scan", "moe/dispatch.cu")
    assert sizes_of(scan_passes) == want and sizes_of(scan_small) == want
    assert [int(a) for a in scan_passes[:2]] == [0xD0, 2] and [int(a) for a in scan_passes[-3:]] == [4, 1124, 1124]
    assert [int(a) for a in scan_small[-3:]] == [4, 640, 8]
    (fn, fused), = k.launch.calls
    assert fn == "dispatch" and sizes_of(fused) == kernel_params("moe_dispatch_fused_fp8", "moe/dispatch.cu")
    assert [int(a) for a in fused[-3:]] == [640, 8, 5]
