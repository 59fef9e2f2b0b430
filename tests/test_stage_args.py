"""`symmring.moe.gpu.stages`' launchers on the CPU: each passes its kernel ONE argument, the kernel's struct of
device/moe/args.cuh by value (`symmring.moe.gpu.kernel_args`), and every field holds what the launcher means.

Fake kernels record each launch; a fake state holds a distinct address per buffer. Each launch's argument is
read back through the struct's dtype and checked field by field, by name: the fields the state fixes (its
buffers, the expert range, the grid-handshake words) and the call's own. The kernels' signatures in device/moe/
are read from the sources: each takes exactly the struct `kernel_args.KERNELS` names (tests/test_kernel_args.py
holds the structs to the header). On a GPU, tests/gpu runs every launcher for real.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from symmring import jit
from symmring.moe import routing
from symmring.moe.gpu import kernel_args, stages
from symmring.moe.gpu.plan import ChunkStep, WindowStep

from stage_fakes import BUFFERS, COMBINE_READY, COMBINE_ROWS, KERNEL_OF, FakeKernels, FakeTensor, fake_state

SOURCES = ("moe/producer.cu", "moe/dispatch.cu", "moe/combine.cu", "moe/schedule.cu", "moe/fused_experts.cu",
           "moe/fused_experts_wgmma.cu", "moe/fused_experts_tma.cu")


#: An ``extern "C"`` kernel's name and parameter list, with or without ``__launch_bounds__``.
KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\(([^)]*)\)')


def kernel_signatures():
    """``{kernel: its parameter list}`` of every ``extern "C"`` kernel of device/moe/."""
    found = {}
    for source in SOURCES:
        for name, params in KERNEL.findall(jit.read_source(source)):
            found[name] = " ".join(params.split())
    return found


def holds_tensor_maps(struct: str) -> bool:
    dtype = kernel_args.STRUCTS[struct]
    return any(dtype.fields[name][0] == kernel_args.STRUCTS["TensorMap"] for name in dtype.names)


def test_every_kernel_takes_its_struct_by_value():
    # A struct with tensor maps is taken __grid_constant__: TMA reads a map at its address in the parameter.
    signatures = kernel_signatures()
    assert set(signatures) == set(kernel_args.KERNELS)
    for kernel, params in signatures.items():
        struct = kernel_args.KERNELS[kernel]
        qualifier = "__grid_constant__ " if holds_tensor_maps(struct) else ""
        assert params == f"const {qualifier}{struct} args", (kernel, params)
    assert holds_tensor_maps("FusedExpertsTmaArgs") and not holds_tensor_maps("FusedExpertsArgs")


def launched(k, index=-1):
    """``(kernel name, record)`` of a recorded launch: its one argument read as the kernel's struct."""
    attr, _, args = k.calls[index]
    kernel = KERNEL_OF[attr]
    dtype = kernel_args.STRUCTS[kernel_args.KERNELS[kernel]]
    assert len(args) == 1, f"{kernel}: {len(args)} arguments, expected its struct alone"
    (param,) = args
    assert isinstance(param, np.ndarray) and param.shape == (1,) and param.dtype.itemsize == dtype.itemsize, kernel
    return kernel, param.copy().view(dtype)[0]


#: Fields a state fixes, by name: the address or value each must hold in every struct that has it.
def fixed_fields(s):
    return {"desc": BUFFERS["desc"], "counts": BUFFERS["counts"], "expert_counts": BUFFERS["counts"],
            "begin": BUFFERS["begin"], "group_end": BUFFERS["group_end"], "cursor": BUFFERS["cursor"],
            "total": BUFFERS["total"], "status": BUFFERS["status"], "bad_id": BUFFERS["bad_id"],
            "pool_x": BUFFERS["pool_x"], "pool_sf": BUFFERS["pool_sf"], "m_indices": BUFFERS["m_indices"],
            "row_src": BUFFERS["row_src"], "row_weight": BUFFERS["row_weight"], "stage": BUFFERS["stage"],
            "call_tokens": BUFFERS["call_tokens"], "stamps": BUFFERS["stamps"], "combine_ready": COMBINE_READY,
            "combine_rows": COMBINE_ROWS, "combine_tokens": s.combine_tokens, "expert_begin": s.expert_begin,
            "num_local_experts": s.num_local_experts, "align": s.align}


def check(k, s, want):
    """The last launch's fields: every state-fixed field of its struct, and ``want`` (the call's own)."""
    kernel, record = launched(k)
    fixed = {name: value for name, value in fixed_fields(s).items() if name in record.dtype.names}
    got = {name: _value(record, name) for name in [*fixed, *want]}
    assert got == {**fixed, **want}, kernel
    return kernel, record


def _value(record, name):
    outer, _, inner = name.partition("__")
    value = record[outer][inner] if inner else record[outer]
    return value.item() if isinstance(value, np.generic) else value


WINDOW = WindowStep(5, 6, rows_bound=256, token_begin=64, num_valid=40, source_tokens=100, rows_per_expert=96,
                    passes=((0, 256), (256, 256), (512, 12)))
ONE_PASS = WindowStep(3, 3, rows_bound=640, token_begin=0, num_valid=4, source_tokens=9, rows_per_expert=8,
                      passes=((0, 640),))


def test_producer_launchers():
    k, s = FakeKernels(), fake_state()
    chunk = ChunkStep(chunk=7, token_base=128, num_valid=50)
    stages.wait_slot(k, s, None, chunk=7)
    check(k, s, {"chunk_idx": 7})
    stages.produce_route(k, s, None, chunk=chunk, topk_idx_ptr=0xA1000, topk_weights_ptr=0xA2000, layer=9)
    check(k, s, {"chunk_idx": 7, "topk_idx": 0xA1000, "topk_weights": 0xA2000, "num_valid": 50, "layer": 9,
                 "counter": BUFFERS["counters"] + 4 * stages.COUNTER_ROUTE})
    x = FakeTensor(0xB0000, (400, 2048), strides=(2560, 1), element_size=2)
    for fp8, kernel in ((True, "moe_produce_layout_fp8"), (False, "moe_produce_layout_bf16")):
        s.fp8_layout = fp8
        stages.produce_layout(k, s, None, chunk=chunk, x=x)
        assert check(k, s, {"chunk_idx": 7, "x": 0xB0000 + 128 * 2560 * 2, "x_row_stride": 2560, "num_valid": 50,
                            "counter": BUFFERS["counters"] + 4 * stages.COUNTER_LAYOUT})[0] == kernel


def test_fused_producer_with_and_without_logits():
    k, s = FakeKernels(), fake_state()
    router = routing.device_router(128, "sigmoid_bias", routed_scaling_factor=2.5, n_group=8, topk_group=4)
    chunk = ChunkStep(chunk=3, token_base=2, num_valid=2)
    idx, w = FakeTensor(0x100, (4, 8)), FakeTensor(0x200, (4, 8))
    x = FakeTensor(0x300, (4, 2048), element_size=2)
    logits = FakeTensor(0x400, (4, 128), strides=(160, 1), element_size=2)
    common = {"chunk_idx": 3, "topk_idx": 0x100 + 2 * 32, "topk_weights": 0x200 + 2 * 32, "x": 0x300 + 2 * 2048 * 2,
              "x_row_stride": 2048, "num_valid": 2, "layer": 7,
              "counter": BUFFERS["counters"] + 4 * stages.COUNTER_ROUTE}
    stages.produce_fused(k, s, None, chunk=chunk, topk_idx=idx, topk_weights=w, x=x, router=router, layer=7)
    _, plain = check(k, s, {**common, "logits": 0, "logits_dtype": 0, "logits_stride": 0})
    stages.produce_fused(k, s, None, chunk=chunk, topk_idx=idx, topk_weights=w, x=x, router=router, layer=7,
                         logits=(logits, routing.LOGITS_DTYPE_CODES["bfloat16"]))
    _, routed = check(k, s, {**common, "logits": 0x400 + 2 * 160 * 2, "logits_dtype": 1, "logits_stride": 160})
    assert plain["router"].tobytes() == routed["router"].tobytes() == router.tobytes()  # the options as given
    assert (routed["router"]["num_experts"], routed["router"]["n_group"], routed["router"]["topk_group"]) == (128, 8, 4)
    assert routed["router"]["routed_scaling_factor"] == np.float32(2.5) and routed["router"]["scoring"] == 1


def test_routing_kernel_arguments():
    k = FakeKernels()
    router = routing.device_router(256, "softmax", norm_topk_prob=False)
    stages.route_topk(k, None, logits=(FakeTensor(0x500, (3, 256), strides=(300, 1)), 0), router=router, topk=8,
                      topk_idx=FakeTensor(0x600, (3, 8)), topk_weights=FakeTensor(0x700, (3, 8)))
    kernel, record = launched(k)
    assert kernel == "moe_route_topk"
    assert [record[n].item() for n in ("logits", "logits_dtype", "logits_stride", "num_tokens", "topk_idx",
                                       "topk_weights")] == [0x500, 0, 300, 3, 0x600, 0x700]
    options = record["router"]
    assert (options["topk"], options["num_experts"], options["norm_topk_prob"], options["scoring"]) == (8, 256, 0, 0)
    assert router["topk"] == 0  # the layer's options are not changed by a launch


def test_dispatch_launchers():
    k, s = FakeKernels(), fake_state()
    stages.wait(k, s, None, chunk=6, parts=stages.WAIT_ROUTE, window_row=1, clear_counts=True, layer=5)
    check(k, s, {"chunk_idx": 6, "parts": 1, "token_base": BUFFERS["token_base"] + 1 * 3 * 8, "clear_counts": 1,
                 "layer": 5})
    stages.stage(k, s, None, chunk=6, parts=stages.WAIT_LAYOUT, wait=True)
    check(k, s, {"chunk_idx": 6, "parts": 2, "wait": 1})
    stages.count(k, s, None, chunk=6)
    check(k, s, {"chunk_idx": 6})
    stages.scan(k, s, None, window=WINDOW)
    check(k, s, {"chunk_idx": 5, "window_rows": 524, "rows_per_expert": WINDOW.expert_rows_bound})
    stages.ack(k, s, None, chunk=6)
    check(k, s, {"chunk_idx": 6})


def test_pull_carries_the_pass_and_the_entry_map():
    """pull and pull_fp8 carry the pass (device/moe/args.cuh PassRows): the window's later chunk's block of the
    entry map, the pass's rows; one pass: no map."""
    k = FakeKernels()
    block = 3 * 64 * 8 * 4  # one chunk's [ranks][tokens][k] int32
    bf16 = fake_state(pool_sf=None, m_indices=None)
    stages.pull(k, bf16, None, chunk=6, window=WINDOW, pass_idx=2)
    assert check(k, bf16, {"chunk_idx": 6, "pass__entry_rows": BUFFERS["entry_rows"] + block,
                           "pass__pass_begin": 512, "pass__pass_rows": 12})[0] == "moe_dispatch_pull"
    fp8 = fake_state()
    stages.pull(k, fp8, None, chunk=5, window=WINDOW, pass_idx=0)
    kernel, _ = check(k, fp8, {"chunk_idx": 5, "pass__entry_rows": BUFFERS["entry_rows"], "pass__pass_begin": 0,
                               "pass__pass_rows": 256, "sf_row_stride": 1, "sf_col_stride": 256})
    assert kernel == "moe_dispatch_pull_fp8"
    stages.pull(k, fp8, None, chunk=3, window=ONE_PASS)
    check(k, fp8, {"chunk_idx": 3, "pass__entry_rows": 0, "pass__pass_begin": 0, "pass__pass_rows": 640,
                   "sf_row_stride": 1, "sf_col_stride": 640})


def test_combine_launchers():
    k, s = FakeKernels(), fake_state()
    stages.combine_scatter(k, s, None, out=FakeTensor(0x5000), window_begin=5, pass_begin=512, pass_rows=12)
    check(k, s, {"pool_out": 0x5000, "window_begin": 5, "pass_begin": 512, "pass_rows": 12,
                 "token_base": BUFFERS["token_base"]})
    stages.combine_scatter(k, s, None, out=FakeTensor(0x5000), window_begin=5)
    check(k, s, {"pool_out": 0x5000, "window_begin": 5, "pass_begin": 0, "pass_rows": s.capacity,
                 "token_base": BUFFERS["token_base"]})
    stages.combine_signal(k, s, None, first=5, last=6, ack_chunks=True)
    check(k, s, {"chunk_begin": 5, "chunk_end": 6, "ack_now": 1})
    stages.combine_wait(k, s, None, chunk=6)
    check(k, s, {"chunk_idx": 6})
    y = FakeTensor(0x9000, (100, 2048), strides=(4096, 1), element_size=2)
    stages.combine_reduce(k, s, None, window=WINDOW, topk_idx=FakeTensor(0x6000), topk_weights=FakeTensor(0x7000),
                          y=y, end_call_chunks=2)
    check(k, s, {"topk_idx": 0x6000, "topk_weights": 0x7000, "y": 0x9000, "y_row_stride": 4096, "token_begin": 64,
                 "num_valid": 40, "end_call_chunks": 2})


def test_fused_dispatch_and_combine_carry_the_plans_bounds():
    """The fused dispatch and combine (PDL launches) get the window's bounds the device checks
    (device/moe/bounds.cuh), and their grid-handshake words: the fused combine's ``counters`` is COUNTER_SEND
    with COUNTER_TICKET the word after it (device/moe/combine.cu reads counters[0] and counters[1])."""
    k, s = FakeKernels(), fake_state()
    stages.dispatch_fused(k, s, None, window=ONE_PASS, ack_now=True, layer=5)
    check(k, s, {"chunk_idx": 3, "sf_row_stride": 1, "sf_col_stride": 640, "ack_now": 1, "pool_rows": 640,
                 "rows_per_expert": 8, "layer": 5, "token_base": BUFFERS["token_base"],
                 "counter": BUFFERS["counters"] + 4 * stages.COUNTER_DISPATCH, "plan": 0})
    stages.dispatch_fused(k, s, None, window=ONE_PASS, ack_now=False, layer=5, plan=0xBE5100)
    check(k, s, {"chunk_idx": 3, "sf_row_stride": 1, "sf_col_stride": 640, "ack_now": 0, "pool_rows": 640,
                 "rows_per_expert": 8, "layer": 5, "plan": 0xBE5100})
    y = FakeTensor(0x9000, (5, 2048), element_size=2)
    stages.combine_fused(k, s, None, out=FakeTensor(0x5000, (256, 2048)), window=ONE_PASS, ack_now=False,
                         topk_idx=FakeTensor(0x6000), topk_weights=FakeTensor(0x7000), y=y, end_call_chunks=1)
    check(k, s, {"pool_out": 0x5000, "chunk_idx": 3, "ack_now": 0, "topk_idx": 0x6000, "topk_weights": 0x7000,
                 "y": 0x9000, "y_row_stride": 2048, "token_begin": 0, "num_valid": 4, "end_call_chunks": 1,
                 "pool_rows": 640, "token_base": BUFFERS["token_base"], "rows_sent": 0,
                 "counters": BUFFERS["counters"] + 4 * stages.COUNTER_SEND})
    assert stages.COUNTER_TICKET == stages.COUNTER_SEND + 1 < stages.NUM_COUNTERS
    scattering = k.calls[-1][1]
    stages.combine_fused(k, s, None, out=FakeTensor(0x5000, (0, 2048)), window=ONE_PASS, ack_now=False,
                         topk_idx=FakeTensor(0x6000), topk_weights=FakeTensor(0x7000), y=y, end_call_chunks=1,
                         rows_sent=True)
    check(k, s, {"pool_out": 0x5000, "chunk_idx": 3, "ack_now": 0, "topk_idx": 0x6000, "topk_weights": 0x7000,
                 "y": 0x9000, "y_row_stride": 2048, "token_begin": 0, "num_valid": 4, "end_call_chunks": 1,
                 "pool_rows": 640, "token_base": BUFFERS["token_base"], "rows_sent": 1,
                 "counters": BUFFERS["counters"] + 4 * stages.COUNTER_SEND})
    # Its scatter frees rows only: a block per 256 live rows, or the reduce's blocks.
    freeing = stages.blocks(s.topk * ONE_PASS.source_tokens, stages.THREADS_PER_BLOCK, k.spin_blocks)
    reducing = stages.blocks(ONE_PASS.num_valid * stages.reduce_slices(s.hidden), stages.WARPS_PER_BLOCK, k.spin_blocks)
    assert k.calls[-1][1] == (max(freeing, reducing),) and k.calls[-1][1] < scattering


def test_the_fused_dispatch_takes_its_small_build_where_a_block_pulls_one_token():
    """One load in flight per thread (``moe_dispatch_fused_fp8_small``) where every block of the grid pulls at most
    one token and the count takes at most two rounds of a block; eight (``moe_dispatch_fused_fp8``) past either
    bound: both kernels take the same record."""
    k, s = FakeKernels(), fake_state()
    bound = stages.SMALL_DISPATCH_ENTRIES // s.topk
    for source_tokens, small in ((1, True), (9, True), (bound, True), (bound + 1, False), (k.spin_blocks + 1, False)):
        window = dataclasses.replace(ONE_PASS, source_tokens=source_tokens)
        stages.dispatch_fused(k, s, None, window=window, ack_now=False, layer=5)
        attr, grid, _ = k.calls[-1]
        assert grid == (min(source_tokens, k.spin_blocks),)
        assert attr == ("dispatch_fused_fp8_small" if small else "dispatch_fused_fp8"), source_tokens
        check(k, s, {"chunk_idx": 3, "pool_rows": 640, "rows_per_expert": 8, "layer": 5})
    assert stages.small_dispatch(bound, s.topk, bound) and not stages.small_dispatch(bound, s.topk, bound - 1)


def test_schedule_launchers():
    k, s = FakeKernels(), fake_state()
    stages.end_call(k, s, None, num_chunks=4)
    check(k, s, {"num_chunks": 4})
    stages.refuse_call(k, s, None, layer=11)
    check(k, s, {"layer": 11})
    stages.stamp(k, s, None, chunk=2, stage=("consumer", "wait"), end=True)
    check(k, s, {"idx": stages.timeline.stamp_index(2, ("consumer", "wait"), True)})
    stages.sleep(k, s, None, ns=12345)
    check(k, s, {"duration_ns": 12345})


def test_null_buffers_are_null_pointers():
    """A state without rdma peers, the call's token word or an fp8 pool passes nulls where those go."""
    k, s = FakeKernels(), fake_state(stage=None, call_tokens=None, m_indices=None, pool_sf=None)
    stages.count(k, s, None, chunk=1)
    assert launched(k)[1]["stage"] == 0
    stages.produce_route(k, s, None, chunk=ChunkStep(1, 0, 3), topk_idx_ptr=1, topk_weights_ptr=2, layer=0)
    assert launched(k)[1]["call_tokens"] == 0
    stages.combine_scatter(k, s, None, out=FakeTensor(0x5000), window_begin=1)
    assert launched(k)[1]["m_indices"] == 0


def test_a_call_sets_its_own_fields_again_every_time():
    """The record a state keeps is rewritten by every call: a later launch's values, never an earlier one's."""
    k, s = FakeKernels(), fake_state()
    stages.wait(k, s, None, chunk=1, parts=3, window_row=0, clear_counts=True, layer=2)
    first = k.calls[-1][2][0].copy()
    stages.wait(k, s, None, chunk=9, parts=1, window_row=2, clear_counts=False, layer=4)
    assert first.view(kernel_args.STRUCTS["DispatchWaitArgs"])[0]["chunk_idx"] == 1  # launched with its own copy
    check(k, s, {"chunk_idx": 9, "parts": 1, "token_base": BUFFERS["token_base"] + 2 * 3 * 8, "clear_counts": 0,
                 "layer": 4})


def test_values_that_do_not_fit_their_field_are_refused():
    k, s = FakeKernels(), fake_state()
    with pytest.raises((OverflowError, ValueError)):
        stages.wait_slot(k, s, None, chunk=2**31)
    with pytest.raises((OverflowError, ValueError)):
        stages.sleep(k, s, None, ns=-1)


class _Beside:
    """An engine call beside the dispatch (`ExpertEngine.begin_beside_dispatch`'s object): records its launch."""

    def __init__(self, events):
        self.plan, self.events = 0xBE5100, events

    def launch(self, launcher, stream):
        self.events.append(("launch beside", launcher, stream))
        return "beside rows"


class _Engine:
    """An engine that starts beside the dispatch when ``beside`` (else `begin_beside_dispatch` says None) and sends
    its rows when ``sends_rows``; its calls record whether they were given ``send``."""

    def __init__(self, events, beside, sends_rows=False):
        self.events, self.beside, self.sends_rows = events, beside, sends_rows

    def begin_beside_dispatch(self, pool, num_rows, rows_per_expert=None):
        self.events.append(("begin beside", pool, num_rows, rows_per_expert))
        return _Beside(self.events) if self.beside else None

    def forward(self, pool, num_rows, rows_per_expert=None, out=None, scratch=None, **send):
        self.events.append(("forward", pool, num_rows, rows_per_expert, "send" in send))
        return "forward rows"


@pytest.mark.parametrize("pdl, beside, sends, mapped", [
    (True, True, False, True), (True, False, False, True), (False, True, False, True),
    (True, True, True, True), (True, False, True, True), (False, True, True, True), (False, True, True, False)])
def test_small_batch_call_starts_an_engine_beside_the_dispatch_before_the_producer(monkeypatch, pdl, beside, sends,
                                                                                   mapped):
    """With PDL an engine that can start beside the fused dispatch is set up before the producer (its zeroed counters
    precede the chain of dependent launches), hands its plan words to the dispatch and is launched by the PDL
    launcher right after it; otherwise (no PDL, or the engine declines) `forward` runs after the dispatch. An engine
    after the dispatch that sends its rows, where every owner is mapped (the state's ``send_peers``; not with rdma
    peers), is given ``send`` and the combine only checks and frees the rows (``rows_sent``); beside the dispatch
    its rows go through its output as before."""
    events = []
    monkeypatch.setattr(stages, "produce_fused", lambda *a, **kw: events.append("produce"))
    monkeypatch.setattr(stages, "stage", lambda *a, **kw: events.append("stage"))
    monkeypatch.setattr(stages, "dispatch_fused", lambda *a, plan=0, **kw: events.append(("dispatch", plan)))
    monkeypatch.setattr(stages, "combine_fused",
                        lambda *a, out, rows_sent=False, **kw: events.append(("combine", out, rows_sent)))
    monkeypatch.setattr(stages, "_out_rows", lambda s, rows: None)
    launcher = type("Launcher", (), {"enabled": pdl})()
    k = type("K", (), {"launch": launcher})()
    s = type("S", (), {"pool": staticmethod(lambda rows: ("pool", rows)), "outbound": None, "scratch": None,
                       "send_peers": 0x5E0 if mapped else None, "row_src": 0x100, "token_base": 0x200, "num_ranks": 1,
                       "topk": 8, "combine_tokens": 64})()
    stages.small_batch_call(k, s, "stream", chunk=None, window=ONE_PASS, engine=_Engine(events, beside, sends),
                            ack_policy=stages.protocol.AckPolicy.EARLY, x=None, topk_idx=None, topk_weights=None,
                            y=None, num_chunks=1, router=(), layer=0)
    pool = ("pool", ONE_PASS.rows_bound)
    sent = sends and mapped
    if pdl and beside:
        assert events == [("begin beside", pool, 640, 8), "produce", "stage", ("dispatch", 0xBE5100),
                          ("launch beside", launcher, "stream"), ("combine", "beside rows", False)]
    elif pdl:
        assert events == [("begin beside", pool, 640, 8), "produce", "stage", ("dispatch", 0),
                          ("forward", pool, 640, 8, sent), ("combine", "forward rows", sent)]
    else:
        assert events == ["produce", "stage", ("dispatch", 0), ("forward", pool, 640, 8, sent),
                          ("combine", "forward rows", sent)]
