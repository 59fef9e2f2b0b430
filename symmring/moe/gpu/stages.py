"""The GPU MoE layer's stages: one named launcher per kernel, and the two sequences a call is made of.

Launchers (each enqueues one kernel of ``device/moe/`` on a CuPy stream; a kernel takes one struct of
``device/moe/args.cuh`` by value, which the launcher fills by name: `LaunchArgs` holds each kernel's record with the
fields a `State` fixes, the launcher sets the call's own; `symmring.moe.gpu.kernel_args` mirrors the header):

* producer (``producer.cu``): `wait_slot`, `produce_route`, `produce_layout`;
* dispatch (``dispatch.cu``): `wait`, `stage` (rdma sources only), `count`, `scan`, `pull`, `ack`;
* combine (``combine.cu``): `combine_scatter`, `combine_signal`, `combine_wait`, `combine_reduce`;
* schedule (``schedule.cu``): `end_call`, `refuse_call`, `stamp`, `sleep`;
* the small-batch schedule's fused kernels: `produce_fused` (``producer.cu``), `dispatch_fused`
  (``dispatch.cu``) and `combine_fused` (``combine.cu``).

Sequences (what `symmring.moe.gpu.executor.Executor` enqueues for each item of a `symmring.moe.gpu.plan.Plan`;
they get the call's tensors, the router and the hooks as data, and call nothing of the layer):

* `produce_chunk`: acquire the chunk's slot, write route and layout, publish both;
* `consume_window`: wait, count and scan the window's chunks, pull them into the pool, run the experts
  (the `symmring.moe.engines.ExpertEngine` seam), send the rows home and reduce;
* `small_batch_call`: a whole one-chunk batch call (fp8 pools) in three fused kernels around the experts:
  produce (route, from the router's logits too, + layout), dispatch (wait + count + scan + pull) and combine
  (scatter + signal + wait +
  reduce + end of call). The same protocol, generations and acknowledgements; the pool rows and the expert
  engine are the general schedule's, so the output is bitwise the same.

The acknowledgement policy is applied in these sequences and nowhere else: EARLY acknowledges each chunk
right after its pull (its last read of slot memory), CONSERVATIVE with the window's combine signal.

The kernels' launch geometry (grid sizes from the ring's shape and a chunk's valid tokens) is computed
here too, so the layer holds no kernel arguments of its own. ``layer`` (the producers' and the waiting
consumers' argument) is the layer id of the call identity every meta row carries and every consumer checks
(`symmring.protocol.call_identity`; the number is the device's call counter): constant for a layer, so a
captured graph keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import numpy as np

from ... import protocol
from ...pdl import PdlLauncher
from ..engines import CombineRows, ExpertEngine, Pool
from . import kernel_args, timeline
from .plan import ChunkStep, WindowStep

#: Threads per block of the MoE kernels (8 warps).
THREADS_PER_BLOCK = 256
WARPS_PER_BLOCK = THREADS_PER_BLOCK // 32
#: Grid caps: enough blocks to fill an H200 (132 SMs) several times over, few enough to stay cheap.
MAX_BLOCKS = 1056
#: Blocks of the route kernel, whose blocks all poll the acknowledgement mask while they wait.
MAX_ROUTE_BLOCKS = 16
#: Most PEs that share one GPU (under CUDA MPS) `spin_blocks` assumes when the backend does not say.
MAX_PES_PER_GPU = 4
#: Blocks of the count kernel per source rank.
MAX_COUNT_BLOCKS = 64
#: Largest top-k the dispatch kernel handles (one lane per k).
MAX_TOPK = 32
#: Parts of a chunk `wait` waits for (device/moe/dispatch.cu WaitParts).
WAIT_ROUTE, WAIT_LAYOUT = 1, 2
#: Bits of the device status word (device/moe/dispatch.cu MoeStatus).
STATUS_NO_PEER_MAPPING, STATUS_BAD_EXPERT_ID = 1, 2
#: Words of the bad-expert-id record (device/moe/dispatch.cu BadIdWord): value, source rank, token, k.
BAD_ID_WORDS = 4
#: Words of `State.counters`, zeroed, each reset by the kernel that uses it: one grid-handshake word per
#: last-block step of a kernel, and the fused combine's two (COUNTER_SEND: its finished scatter items, then
#: COUNTER_TICKET: the work tickets its blocks draw; device/moe/combine.cu).
COUNTER_ROUTE, COUNTER_LAYOUT, COUNTER_DISPATCH, COUNTER_SEND, COUNTER_TICKET = range(5)
NUM_COUNTERS = 5


def blocks(num_items: int, per_block: int, cap: int = MAX_BLOCKS) -> int:
    """Blocks for ``num_items`` items at ``per_block`` per block, between 1 and ``cap``."""
    return max(1, min(cap, -(-num_items // per_block)))


def spin_blocks(num_sms: int, pes_per_gpu: int) -> int:
    """Most blocks of a small-batch kernel whose blocks spin (the fused producer, dispatch and combine).

    The rule: the PEs sharing one GPU run one such kernel each at a time (one stream), and together they
    hold at most HALF its SMs (one 256-thread block per SM at most, where the hardware spreads them), so
    the kernels they wait for (the other PEs' producers and combine, the expert GEMMs) always find whole
    SMs free. No grid needs all its blocks resident at once: no block of these kernels waits for another
    block of its own grid (the fused combine's blocks take their scatter work from a ticket counter before
    any of them waits; device/moe/combine.cu). ``num_sms // (2 * pes_per_gpu)``, at least 1: 66 blocks on an
    H200 (132 SMs) for one PE, 16 for four under MPS. With programmatic dependent launch (`Kernels.launch`, one
    PE per GPU only) the next fused grid may sit resident beside the spinning one: sound because a lone PE's
    fused kernels spin only on remote peers, or (the fused dispatch) on its own producer, wholly resident once
    its dependent launches (docs/PROTOCOL.md 9.2).
    """
    return max(1, num_sms // (2 * max(1, pes_per_gpu)))


def reduce_slices(hidden: int) -> int:
    """Warps of the combine reduce per token: one per 256 channels (device/moe/combine.cu kReduceSliceVecs)."""
    return -(-hidden // 256)


def pool_scale_words(capacity: int, hidden: int) -> int:
    """float32 words of an fp8 pool's scales: every window's ``[hidden / 128][align4(rows)]`` block fits."""
    return (hidden // 128) * (-(-capacity // 4) * 4)


def _counter(s: "State", word: int) -> int:
    """The address of grid-handshake word ``word`` (`COUNTER_ROUTE`, ...) of `State.counters`."""
    return s.counters.data_ptr() + 4 * word


class Kernels:
    """The layer's kernels, looked up once from the backend's library modules (loaded once per backend), after
    `kernel_args.check_device_layout` found their argument structs laid out as the host's (else
    `symmring.errors.KernelArgsMismatch`)."""

    def __init__(self, backend):
        # The argument structs as the device compiler lays them out, before any kernel runs (KernelArgsMismatch).
        kernel_args.check_device_layout(backend.compute_capability)
        producer, dispatch = backend.library_module("moe_producer"), backend.library_module("moe_dispatch")
        combine, schedule = backend.library_module("moe_combine"), backend.library_module("moe_schedule")
        self.wait_slot = producer.function("moe_wait_slot")
        self.produce_route = producer.function("moe_produce_route")
        self.produce_layout_fp8 = producer.function("moe_produce_layout_fp8")
        self.produce_layout_bf16 = producer.function("moe_produce_layout_bf16")
        self.wait = dispatch.function("moe_dispatch_wait")
        self.count = dispatch.function("moe_dispatch_count")
        self.stage = dispatch.function("moe_dispatch_stage")
        self.scan = dispatch.function("moe_dispatch_scan")
        self.pull = dispatch.function("moe_dispatch_pull")
        self.pull_fp8 = dispatch.function("moe_dispatch_pull_fp8")
        self.ack = dispatch.function("moe_dispatch_ack")
        self.combine_scatter = combine.function("moe_combine_scatter")
        self.combine_signal = combine.function("moe_combine_signal")
        self.combine_wait = combine.function("moe_combine_wait")
        self.combine_reduce = combine.function("moe_combine_reduce")
        self.end_call = schedule.function("moe_end_call")
        self.refuse_call = schedule.function("moe_refuse_call")
        self.stamp = schedule.function("moe_stamp")
        self.sleep = schedule.function("moe_sleep")
        self.produce_chunk_fp8 = producer.function("moe_produce_chunk_fp8")
        self.dispatch_fused_fp8 = dispatch.function("moe_dispatch_fused_fp8")
        self.dispatch_fused_fp8_small = dispatch.function("moe_dispatch_fused_fp8_small")
        self.combine_fused = combine.function("moe_combine_fused")
        self.route_topk = producer.function("moe_route_topk")
        pes_per_gpu = getattr(backend, "pes_per_gpu", MAX_PES_PER_GPU)
        #: Grid cap of the small-batch kernels (`spin_blocks`) on this PE's GPU.
        self.spin_blocks = spin_blocks(backend.num_sms, pes_per_gpu)
        #: Launcher of the small-batch kernels: programmatic dependent launch where `symmring.pdl` allows it.
        self.launch = PdlLauncher(getattr(backend, "compute_capability", 0) // 10, pes_per_gpu)


@dataclass
class State:
    """The device state the stages read and write: the ring descriptor, the dispatch buffers, the pool,
    the combine buffer's local addresses, the owner's routing buffers and the timeline stamps.

    Shapes (R ranks, E local experts, W = window chunks, capacity pool rows): counts/begin/group_end/cursor
    int32 [E]; total/status int32 [1]; bad_id int32 [4]; counters uint32 [`NUM_COUNTERS`] (grid handshakes); pool_x [capacity, hidden] (bf16, or fp8 bytes for fp8 pools); pool_sf float32
    [capacity * hidden / 128] (fp8 pools, laid out per window: `pool_scales`) or None; m_indices int32
    [capacity] (aligned pools: -1 except while a window's rows are in the pool) or None; row_src int32
    [capacity, 4]; row_weight float32 [capacity]; token_base int64 [W, R]. align: the row alignment of every
    expert group (the engine's). stage: the device descriptor of the staging ring (one slot per source rank)
    the rdma sources' slots are got into, or None when this PE has no rdma peer (`symmring.transport`).
    outbound: bf16 [capacity, hidden] in symmetric memory, the local buffer of the combine's puts to rdma
    owners (`outbound`), or None when this PE has no rdma peer.
    entry_rows: int32 [num_slots, R, tokens_per_slot, K]: every entry's window row (by the chunk's place in its
    window), written by a window's
    first pass and read by its later ones (device/moe/dispatch.cu PassRows), or None (never more than one
    pass). out_rows: bf16 [capacity, hidden], the rows the engine writes its L2 output into and the combine
    sends (symmetric memory, so rdma puts read them as they are), or None (the engine allocates them).
    pass_group_end: int32 [E], the torch engine's group ends within a pass (``group_end`` moved to the pass).
    scratch: the fp8 engines' L1 output and activations of a pass in the workspace's experts' region
    (`symmring.moe.engines.Scratch`), or None (the engine allocates them).
    call_tokens: int32 [1], this rank's tokens of the call (the workspace's word, filled before each call or
    replay): the producers and the reduce clamp the plan's token bounds to it on the device
    (device/moe/call_tokens.cuh), so a plan and a graph made for a token bucket serve any count up to it;
    None: the plan's counts are exact.
    combine_tokens: the logical tokens every PE's combine rows hold (the workspace's ``max_tokens``): the
    combine sends no row whose token lies past them (device/moe/bounds.cuh).
    bad_groups: int32 [2], where the fp8 engines' Triton GEMMs report pool rows naming no local expert
    (`symmring.moe.engines.Pool.bad_groups`; `symmring.moe.gpu.MoE.check_errors` raises it), or None.
    send_peers: int64 [R], every owner's combine rows mapped into this process, for an engine that sends its rows
    itself (`send_rows`), or None (this PE has rdma peers: the combine scatter sends every row).
    """

    desc: object
    num_ranks: int
    expert_begin: int
    num_local_experts: int
    tokens_per_slot: int
    topk: int
    hidden: int
    fp8_layout: bool
    capacity: int
    counts: object
    begin: object
    group_end: object
    cursor: object
    total: object
    status: object
    counters: object
    pool_x: object
    pool_sf: object
    m_indices: object
    align: int
    bad_id: object
    row_src: object
    row_weight: object
    token_base: object
    stage: object
    outbound: object
    combine_ready: np.uint64
    combine_rows: np.uint64
    stamps: object
    combine_tokens: int
    entry_rows: object = None
    out_rows: object = None
    pass_group_end: object = None
    scratch: object = None
    call_tokens: object = None
    bad_groups: object = None
    send_peers: object = None
    #: The launchers' argument records (`LaunchArgs`), made at the first launch.
    args: object = field(default=None, repr=False, compare=False)

    def pool_scales(self, rows: int):
        """The fp8 pool's scales for a window of ``rows`` rows: ``[rows, hidden / 128]`` float32 with
        strides ``(1, align4(rows))`` (MN-major, each column 16-byte aligned: the layout DeepGEMM's TMA reads
        without a transform; the Triton kernel takes any strides)."""
        column = -(-rows // 4) * 4
        num_sf = self.hidden // 128
        return self.pool_sf[: num_sf * column].view(num_sf, column).t()[:rows]

    def pool(self, rows: int, pass_begin: int = 0, num_passes: int = 1) -> Pool:
        """The pool the engine reads for a pass of ``rows`` rows starting at window row ``pass_begin`` (the torch
        engine's group ends moved into the pass, on the current torch stream, when the window has passes)."""
        group_end = self.group_end
        if num_passes > 1 and self.pool_sf is None:
            group_end = self.pass_group_end
            _torch_sub_clamp(self.group_end, pass_begin, rows, out=group_end)
        if self.pool_sf is None:
            return Pool(x=self.pool_x, group_end=group_end)
        return Pool(x=self.pool_x, group_end=group_end, x_sf=self.pool_scales(rows), m_indices=self.m_indices,
                    bad_groups=self.bad_groups)


def _torch_sub_clamp(group_end, begin: int, rows: int, *, out) -> None:
    """``out = clamp(group_end - begin, 0, rows)``: a pass's cumulative group ends (enqueued; no sync)."""
    import torch
    torch.clamp(group_end - begin, 0, rows, out=out)


class LaunchArgs:
    """Every launcher's argument record for one `State`, as its `kernel_args.KernelArgs.set`: the fields the State
    fixes (its buffers' addresses, the expert range, the grid-handshake words) filled once, when its first kernel
    is launched (`_args`); each launcher sets the rest per call. ``State.entry_rows`` is not fixed here: the
    workspace moves it when the entry map grows (`symmring.moe.gpu.memory`), so `pull` reads it per call."""

    def __init__(self, s: "State"):
        structs, address = kernel_args.STRUCTS, kernel_args.address

        def record(struct: str, per_call: str, **fixed):
            return kernel_args.KernelArgs(structs[struct], per_call.split(), desc=address(s.desc), **fixed).set

        call_tokens = address(s.call_tokens)
        experts = dict(expert_begin=s.expert_begin, num_local_experts=s.num_local_experts)
        pool = dict(row_src=address(s.row_src), row_weight=address(s.row_weight), status=address(s.status),
                    stage=address(s.stage), **experts)
        passes = "pass__entry_rows pass__pass_begin pass__pass_rows"
        # Producer.
        self.wait_slot = record("ChunkArgs", "chunk_idx")
        self.produce_route = record("ProduceRouteArgs", "chunk_idx topk_idx topk_weights num_valid layer",
                                    call_tokens=call_tokens, counter=_counter(s, COUNTER_ROUTE))
        self.produce_layout = record("ProduceLayoutArgs", "chunk_idx x x_row_stride num_valid",
                                     call_tokens=call_tokens, counter=_counter(s, COUNTER_LAYOUT))
        self.produce_chunk = record("ProduceChunkArgs", "chunk_idx topk_idx topk_weights x x_row_stride num_valid "
                                    "layer logits logits_dtype logits_stride router",
                                    call_tokens=call_tokens, counter=_counter(s, COUNTER_ROUTE))
        # Dispatch.
        self.wait = record("DispatchWaitArgs", "chunk_idx parts token_base clear_counts layer",
                           counts=address(s.counts), num_local_experts=s.num_local_experts)
        self.stage = record("DispatchStageArgs", "chunk_idx parts wait", stage=address(s.stage))
        self.count = record("DispatchCountArgs", "chunk_idx", counts=address(s.counts), status=address(s.status),
                            bad_id=address(s.bad_id), stage=address(s.stage), **experts)
        self.scan = record("DispatchScanArgs", "chunk_idx window_rows rows_per_expert", counts=address(s.counts),
                           begin=address(s.begin), group_end=address(s.group_end), cursor=address(s.cursor),
                           total=address(s.total), align=s.align, **experts)
        self.pull = record("DispatchPullArgs", "chunk_idx " + passes, cursor=address(s.cursor),
                           pool_x=address(s.pool_x), **pool)
        self.pull_fp8 = record("DispatchPullFp8Args", "chunk_idx sf_row_stride sf_col_stride " + passes,
                               cursor=address(s.cursor), pool_x=address(s.pool_x), pool_sf=address(s.pool_sf),
                               m_indices=address(s.m_indices), **pool)
        self.ack = record("ChunkArgs", "chunk_idx")
        self.dispatch_fused = record(
            "DispatchFusedArgs", "chunk_idx sf_row_stride sf_col_stride ack_now pool_rows rows_per_expert layer plan",
            token_base=address(s.token_base), expert_counts=address(s.counts), begin=address(s.begin),
            group_end=address(s.group_end), total=address(s.total), pool_x=address(s.pool_x),
            pool_sf=address(s.pool_sf), m_indices=address(s.m_indices), align=s.align, bad_id=address(s.bad_id),
            counter=_counter(s, COUNTER_DISPATCH), **pool)
        self._combine(s, record)
        # Schedule.
        self.end_call = record("EndCallArgs", "num_chunks")
        self.refuse_call = record("RefuseCallArgs", "layer")
        self.stamp = kernel_args.KernelArgs(structs["StampArgs"], ("idx",), stamps=address(s.stamps)).set
        self.sleep = kernel_args.KernelArgs(structs["SleepArgs"], ("duration_ns",)).set

    def _combine(self, s: "State", record) -> None:
        address = kernel_args.address
        rows = dict(m_indices=address(s.m_indices), combine_rows=int(s.combine_rows), token_base=address(s.token_base))
        self.combine_scatter = record("CombineScatterArgs", "pool_out window_begin pass_begin pass_rows rows_sent",
                                      row_src=address(s.row_src), total=address(s.total),
                                      combine_tokens=s.combine_tokens, **rows)
        self.combine_signal = record("CombineSignalArgs", "chunk_begin chunk_end ack_now",
                                     combine_ready=int(s.combine_ready))
        self.combine_wait = record("CombineWaitArgs", "chunk_idx", combine_ready=int(s.combine_ready))
        self.combine_reduce = record("CombineReduceArgs", "topk_idx topk_weights y y_row_stride token_begin num_valid "
                                     "end_call_chunks", combine_rows=int(s.combine_rows),
                                     call_tokens=address(s.call_tokens))
        self.combine_fused = record(
            "CombineFusedArgs", "pool_out chunk_idx ack_now topk_idx topk_weights y y_row_stride token_begin "
            "num_valid end_call_chunks pool_rows rows_sent",
            row_src=address(s.row_src), expert_counts=address(s.counts), begin=address(s.begin),
            num_local_experts=s.num_local_experts, combine_ready=int(s.combine_ready),
            call_tokens=address(s.call_tokens), counters=_counter(s, COUNTER_SEND), combine_tokens=s.combine_tokens,
            **rows)


def _args(s: "State") -> LaunchArgs:
    """``s``'s launch records, made at its first launch."""
    args = getattr(s, "args", None)
    if args is None:
        args = s.args = LaunchArgs(s)
    return args


# --- launchers ------------------------------------------------------------------------------------------
#
# Each launcher fills its kernel's argument struct (device/moe/args.cuh, `kernel_args`) by name: the fields the
# State fixes come from its `LaunchArgs` (made once), the call's own fields are set here.

def wait_slot(k: Kernels, s: State, stream, *, chunk: int) -> None:
    """One block: wait until ``chunk``'s slot is reusable (acks of ``chunk - num_slots``), no reset."""
    k.wait_slot((1,), (32,), _args(s).wait_slot(chunk_idx=chunk), stream=stream)


def produce_route(k: Kernels, s: State, stream, *, chunk: ChunkStep, topk_idx_ptr: int,
                  topk_weights_ptr: int, layer: int) -> None:
    """Acquire the slot, copy ``num_valid`` rows of topk (contiguous ``[n, K]`` at the pointers) and the
    meta row (the call identity of ``layer``) into it, publish route readiness."""
    grid = blocks(chunk.num_valid * s.topk, THREADS_PER_BLOCK, MAX_ROUTE_BLOCKS)
    k.produce_route((grid,), (THREADS_PER_BLOCK,),
                    _args(s).produce_route(chunk_idx=chunk.chunk, topk_idx=topk_idx_ptr, topk_weights=topk_weights_ptr,
                                           num_valid=chunk.num_valid, layer=layer),
                    stream=stream)


def produce_layout(k: Kernels, s: State, stream, *, chunk: ChunkStep, x) -> None:
    """Quantise (fp8 rings) or copy (bf16) the chunk's rows of bf16 ``x`` (the call's ``[n, hidden]``)
    into the slot, publish layout readiness."""
    if s.fp8_layout:  # a warp per token
        fn, grid = k.produce_layout_fp8, blocks(chunk.num_valid, WARPS_PER_BLOCK)
    else:  # 4 vectors of 8 bf16 per thread
        fn, grid = k.produce_layout_bf16, blocks(chunk.num_valid * s.hidden // 8, THREADS_PER_BLOCK * 4)
    stride = x.stride(0)
    fn((grid,), (THREADS_PER_BLOCK,),
       _args(s).produce_layout(chunk_idx=chunk.chunk, x=x.data_ptr() + chunk.token_base * stride * 2,
                               x_row_stride=stride, num_valid=chunk.num_valid),
       stream=stream)


def wait(k: Kernels, s: State, stream, *, chunk: int, parts: int, window_row: int, clear_counts: bool,
         layer: int) -> None:
    """Block r waits for source rank r's ``parts`` (`WAIT_ROUTE` | `WAIT_LAYOUT`) of ``chunk``; the route
    part checks the meta row (this chunk, generation and call of ``layer``) and snapshots each source's token
    base into row ``window_row`` of ``token_base``; ``clear_counts`` zeroes the expert counts (a window's
    first chunk)."""
    token_base = s.token_base.data_ptr() + window_row * s.num_ranks * 8
    k.wait((s.num_ranks,), (32,), _args(s).wait(chunk_idx=chunk, parts=parts, token_base=token_base,
                                                clear_counts=int(clear_counts), layer=layer),
           stream=stream)


def _out_rows(s: State, rows: int):
    """Where the engine writes a pass's L2 output (the workspace's symmetric rows), or None."""
    return None if s.out_rows is None else s.out_rows[:rows]


def outbound(s: State, out):
    """The rows the combine sends: the engine's output ``out`` itself (in the workspace's symmetric out rows,
    where the engines write it), or (this PE has rdma peers and the engine wrote elsewhere) a copy in the
    symmetric outbound rows, since a put's local buffer must be symmetric or registered on a network
    transport. Enqueued on the current torch stream, as the engine."""
    if s.outbound is None or (s.out_rows is not None and out.data_ptr() == s.out_rows.data_ptr()):
        return out
    rows = s.outbound[: out.shape[0]]
    rows.copy_(out)
    return rows


def stage(k: Kernels, s: State, stream, *, chunk: int, parts: int, wait: bool = False) -> None:
    """rdma sources only (nothing is enqueued without them): get ``parts`` of every rdma source's slot of
    ``chunk`` into the staging ring, where `count`, `pull` and `dispatch_fused` read them. ``wait``: poll
    both readiness words first (the small-batch schedule, which has no `wait` kernel)."""
    if s.stage is None or not parts:
        return
    # With wait (the small-batch schedule) every block polls: at most spin_blocks of them in all
    # (docs/PROTOCOL.md 9.2), so the peers' kernels find free SMs.
    most = max(1, k.spin_blocks // s.num_ranks) if wait else MAX_COUNT_BLOCKS
    grid = (blocks(s.tokens_per_slot, WARPS_PER_BLOCK, most), s.num_ranks)
    k.stage(grid, (THREADS_PER_BLOCK,), _args(s).stage(chunk_idx=chunk, parts=parts, wait=wait), stream=stream)


def count(k: Kernels, s: State, stream, *, chunk: int) -> None:
    """Add the chunk's (token, k) entries of every source routed to each local expert to ``counts``; an
    expert id outside ``[-1, num_experts)`` sets `STATUS_BAD_EXPERT_ID` and the bad-id record."""
    grid = (blocks(s.tokens_per_slot * s.topk, THREADS_PER_BLOCK, MAX_COUNT_BLOCKS), s.num_ranks)
    k.count(grid, (THREADS_PER_BLOCK,), _args(s).count(chunk_idx=chunk), stream=stream,
            shared_mem=4 * s.num_local_experts)


def scan(k: Kernels, s: State, stream, *, window: WindowStep) -> None:
    """Row offsets of every local expert's group (begin, group_end; groups aligned to ``s.align`` rows),
    the rows spanned, and each expert's reservation cursor at its group's first row; counts past ``window``'s
    bounds (`WindowStep.rows_spanned`, `WindowStep.expert_rows_bound`) record pool_overflow."""
    k.scan((1,), (1024,), _args(s).scan(chunk_idx=window.first, window_rows=window.rows_spanned,
                                        rows_per_expert=window.expert_rows_bound),
           stream=stream, shared_mem=4 * 1024)


def pull(k: Kernels, s: State, stream, *, chunk: int, window: WindowStep, pass_idx: int = 0) -> None:
    """Pull the chunk's rows routed to local experts from every source into the pool (one warp a token):
    dequantised to bf16, or as fp8 rows with their scales (fp8 pools, laid out for the pass). Only the rows
    of pass ``pass_idx`` of ``window`` (`WindowStep.passes`); the first pass records every entry's window
    row for the later ones."""
    grid = (blocks(s.tokens_per_slot, WARPS_PER_BLOCK, max(1, MAX_BLOCKS // s.num_ranks)), s.num_ranks)
    pass_begin, rows = window.passes[pass_idx]
    entry_rows = 0
    if len(window.passes) > 1:  # this chunk's [R][T][K] block of the map
        entry_rows = s.entry_rows.data_ptr() + (chunk - window.first) * s.entry_rows[0].nbytes
    passes = dict(pass__entry_rows=entry_rows, pass__pass_begin=pass_begin, pass__pass_rows=rows)
    if s.pool_sf is None:
        k.pull(grid, (THREADS_PER_BLOCK,), _args(s).pull(chunk_idx=chunk, **passes), stream=stream)
        return
    sf = s.pool_scales(rows)
    k.pull_fp8(grid, (THREADS_PER_BLOCK,),
               _args(s).pull_fp8(chunk_idx=chunk, sf_row_stride=sf.stride(0), sf_col_stride=sf.stride(1), **passes),
               stream=stream)


def ack(k: Kernels, s: State, stream, *, chunk: int) -> None:
    """Acknowledge every owner's slot of ``chunk`` (after this PE's last read of them)."""
    k.ack((1,), (32,), _args(s).ack(chunk_idx=chunk), stream=stream)


def combine_scatter(k: Kernels, s: State, stream, *, out, window_begin: int, pass_begin: int = 0,
                    pass_rows: Optional[int] = None, rows_sent: bool = False) -> None:
    """Expert output rows ``out`` of the pass of window rows ``[pass_begin, pass_begin + pass_rows)`` to their
    owners' combine rows at (logical token, k); aligned pools skip padding rows and mark every row free (-1)
    again. ``rows_sent``: the engine sent them (`send_rows`): check each row's token and free it only."""
    rows = s.capacity if pass_rows is None else pass_rows
    k.combine_scatter((blocks(rows, WARPS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                      _args(s).combine_scatter(pool_out=out.data_ptr(), window_begin=window_begin,
                                               pass_begin=pass_begin, pass_rows=rows, rows_sent=int(rows_sent)),
                      stream=stream)


def send_rows(s: State, engine: ExpertEngine, window_begin: int) -> Optional[CombineRows]:
    """Where ``engine`` sends the output rows of the window starting at chunk ``window_begin`` itself (its L2
    epilogue writes each row into its owner's combine rows, and `combine_scatter` only frees them): an engine
    with `ExpertEngine.sends_rows` on a PE whose owners are all mapped (``s.send_peers``); else None."""
    if not engine.sends_rows or s.send_peers is None:
        return None
    address = kernel_args.address
    return CombineRows(row_src=address(s.row_src), token_base=address(s.token_base), peers=address(s.send_peers),
                       window_begin=window_begin, num_ranks=s.num_ranks, num_topk=s.topk,
                       combine_tokens=s.combine_tokens)


def combine_signal(k: Kernels, s: State, stream, *, first: int, last: int, ack_chunks: bool) -> None:
    """Signal every owner that this PE's rows of the window are in place; ``ack_chunks``: acknowledge the
    window's chunks too."""
    k.combine_signal((1,), (32,), _args(s).combine_signal(chunk_begin=first, chunk_end=last, ack_now=ack_chunks),
                     stream=stream)


def combine_wait(k: Kernels, s: State, stream, *, chunk: int) -> None:
    """Wait until every source signalled its rows of the window ending at ``chunk``."""
    k.combine_wait((1,), (32,), _args(s).combine_wait(chunk_idx=chunk), stream=stream)


def combine_reduce(k: Kernels, s: State, stream, *, window: WindowStep, topk_idx, topk_weights, y,
                   end_call_chunks: int) -> None:
    """``y``'s rows of the window: the weighted sum of each token's top-k rows in k order; with
    ``end_call_chunks`` > 0 this kernel also ends the call (single-stream schedules)."""
    k.combine_reduce((blocks(window.num_valid * reduce_slices(s.hidden), WARPS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                     _args(s).combine_reduce(topk_idx=topk_idx.data_ptr(), topk_weights=topk_weights.data_ptr(),
                                             y=y.data_ptr(), y_row_stride=y.stride(0), token_begin=window.token_begin,
                                             num_valid=window.num_valid, end_call_chunks=end_call_chunks),
                     stream=stream)


def end_call(k: Kernels, s: State, stream, *, num_chunks: int) -> None:
    """Advance the device-resident generation base by the call's chunks and the call number by one (after every
    kernel of the call)."""
    k.end_call((1,), (32,), _args(s).end_call(num_chunks=num_chunks), stream=stream)


def refuse_call(k: Kernels, s: State, stream, *, layer: int) -> None:
    """This PE refused its call of ``layer`` inside a step: record the refusal on the ring (every other PE's wait
    of the call ends at once, aborted) and count the call (device/moe/schedule.cu moe_refuse_call)."""
    k.refuse_call((1,), (32,), _args(s).refuse_call(layer=layer), stream=stream)


def stamp(k: Kernels, s: State, stream, *, chunk: int, stage, end: bool) -> None:
    """Record the device clock as the start (or end) of ``stage`` (a `timeline.STAGES` pair) of ``chunk``."""
    k.stamp((1,), (32,), _args(s).stamp(idx=timeline.stamp_index(chunk, stage, end)), stream=stream)


def sleep(k: Kernels, s: State, stream, *, ns: int) -> None:
    """Spin the stream for ``ns`` nanoseconds (tests: a deliberately slow producer or consumer)."""
    k.sleep((1,), (32,), _args(s).sleep(duration_ns=ns), stream=stream)


def produce_fused(k: Kernels, s: State, stream, *, chunk: ChunkStep, topk_idx, topk_weights, x, router,
                  layer: int, logits=None) -> None:
    """The small-batch producer (fp8 rings): acquire the slot, write route and the fp8 layout of ``x``, publish
    both, in one grid (a warp per 256 channels of a token, a warp per token's route; at most
    `Kernels.spin_blocks` blocks, which all wait for the slot). ``logits`` None: the route is
    ``topk_idx``/``topk_weights`` (the call's contiguous ``[n, K]``), copied. Else the call's router logits
    (`routing.logits_operand`'s tensor and code), routed in the kernel with ``router`` (a record of
    `kernel_args` ``RouterOptions``, `routing.device_router`; the kernel reads it only with logits) into the
    slot and into ``topk_idx``/``topk_weights``."""
    row_bytes, stride = s.topk * 4, x.stride(0)
    warps = chunk.num_valid * -(-s.hidden // 256) + (chunk.num_valid if logits is not None else 0)
    logits_ptr, code, logits_stride = 0, 0, 0
    if logits is not None:
        tensor, code = logits
        logits_stride = tensor.stride(0)
        logits_ptr = tensor.data_ptr() + chunk.token_base * logits_stride * tensor.element_size()
    args = _args(s).produce_chunk(
        chunk_idx=chunk.chunk, topk_idx=topk_idx.data_ptr() + chunk.token_base * row_bytes,
        topk_weights=topk_weights.data_ptr() + chunk.token_base * row_bytes,
        x=x.data_ptr() + chunk.token_base * stride * 2, x_row_stride=stride, num_valid=chunk.num_valid, layer=layer,
        logits=logits_ptr, logits_dtype=code, logits_stride=logits_stride, router=router)
    k.launch(k.produce_chunk_fp8, (blocks(warps, WARPS_PER_BLOCK, k.spin_blocks),), (THREADS_PER_BLOCK,), args,
             stream=stream)


#: The routing kernel's fields, every one set per call (its router's topk after the router).
ROUTE_TOPK_FIELDS = kernel_args.STRUCTS["RouteTopkArgs"].names + ("router__topk",)


def route_topk(k: Kernels, stream, *, logits, router, topk: int, topk_idx, topk_weights) -> None:
    """The layer's routing of ``logits`` (`routing.logits_operand`'s tensor and code, ``[n, E]``) into
    ``topk_idx`` int32 / ``topk_weights`` float32 (contiguous ``[n, topk]``) on ``stream``: one warp per token
    (``router``: `routing.device_router`'s options; the kernel routes to ``topk`` entries)."""
    tensor, code = logits
    n = int(tensor.shape[0])
    if n == 0:
        return
    args = getattr(k, "route_args", None)  # no State here: the kernels keep the record
    if args is None:
        args = k.route_args = kernel_args.KernelArgs(kernel_args.STRUCTS["RouteTopkArgs"], ROUTE_TOPK_FIELDS).set
    k.route_topk((blocks(n, WARPS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                 args(logits=tensor.data_ptr(), logits_dtype=code, logits_stride=tensor.stride(0), num_tokens=n,
                      topk_idx=topk_idx.data_ptr(), topk_weights=topk_weights.data_ptr(), router=router,
                      router__topk=topk),
                 stream=stream)


def dispatch_fused(k: Kernels, s: State, stream, *, window: WindowStep, ack_now: bool, layer: int,
                   plan: int = 0) -> None:
    """The small-batch dispatch of the one-chunk ``window`` into the fp8 pool: wait, check the meta rows (the
    call of ``layer``), count, scan and pull in one grid of a block per token of all sources, at most
    `Kernels.spin_blocks` (each block a contiguous range of tokens; every block counts every entry);
    ``ack_now``: EARLY. Counts past the window's bounds (its ``rows_bound`` pool rows,
    `WindowStep.expert_rows_bound`) record pool_overflow and place no row. ``plan``: the address of the plan words
    of an experts kernel beside it (`ExpertEngine.begin_beside_dispatch`), or 0."""
    sf = s.pool_scales(window.rows_bound)
    shared = 8 * 4 * s.num_ranks + 4 * (2 * s.num_local_experts + s.num_ranks + 1)
    args = _args(s).dispatch_fused(chunk_idx=window.first, sf_row_stride=sf.stride(0), sf_col_stride=sf.stride(1),
                                   ack_now=ack_now, pool_rows=window.rows_bound,
                                   rows_per_expert=window.expert_rows_bound, layer=layer, plan=plan)
    grid = blocks(window.source_tokens, 1, k.spin_blocks)
    kernel = k.dispatch_fused_fp8_small if small_dispatch(window.source_tokens, s.topk, grid) else k.dispatch_fused_fp8
    k.launch(kernel, (grid,), (THREADS_PER_BLOCK,), args, stream=stream, shared_mem=shared)


#: Most entries (tokens x top-k, all sources) the fused dispatch takes with one load in flight per thread
#: (``moe_dispatch_fused_fp8_small``): two rounds of a block's threads for the count (one round more per source
#: past the first: the count runs source by source).
SMALL_DISPATCH_ENTRIES = 2 * THREADS_PER_BLOCK


def small_dispatch(source_tokens: int, topk: int, grid: int) -> bool:
    """Whether the fused dispatch of ``source_tokens`` (all sources) on ``grid`` blocks takes its small build:
    each block pulls at most one token and counts at most `SMALL_DISPATCH_ENTRIES` entries, so eight loads in
    flight per thread would gain nothing while their unrolled code, fetched cold after the experts kernel, costs
    a decode call 3-9 us (docs/FUSED.md "The dispatch's code").

    Example:
        >>> small_dispatch(8, 8, 8), small_dispatch(64, 8, 64), small_dispatch(65, 8, 65), small_dispatch(80, 8, 66)
        (True, True, False, False)
    """
    return source_tokens <= grid and source_tokens * topk <= SMALL_DISPATCH_ENTRIES


def combine_fused(k: Kernels, s: State, stream, *, out, window: WindowStep, ack_now: bool, topk_idx, topk_weights,
                  y, end_call_chunks: int, rows_sent: bool = False) -> None:
    """The small-batch combine of the one-chunk ``window`` in one grid: `combine_scatter` of the live rows,
    `combine_signal` (``ack_now``: CONSERVATIVE), `combine_wait` and `combine_reduce`; ``end_call_chunks`` > 0
    ends the call. At most `Kernels.spin_blocks` blocks (they wait for the sources' signals); it completes with
    any number of them resident (its blocks take the scatter from a ticket counter, COUNTER_SEND and
    COUNTER_TICKET, before any waits). ``rows_sent``: the engine sent the rows (`send_rows`): the scatter checks each
    row's token and frees it only."""
    # A bound of this PE's live rows' vectors (rows_sent: of its live rows)
    scatter_vecs = s.topk * window.source_tokens * (1 if rows_sent else s.hidden // 8)
    grid = max(blocks(scatter_vecs, THREADS_PER_BLOCK, k.spin_blocks),
               blocks(window.num_valid * reduce_slices(s.hidden), WARPS_PER_BLOCK, k.spin_blocks))
    shared = 16 * s.num_ranks + 4 * (2 * s.num_local_experts + 1)
    args = _args(s).combine_fused(pool_out=out.data_ptr(), chunk_idx=window.first, ack_now=ack_now,
                                  topk_idx=topk_idx.data_ptr(), topk_weights=topk_weights.data_ptr(), y=y.data_ptr(),
                                  y_row_stride=y.stride(0), token_begin=window.token_begin, num_valid=window.num_valid,
                                  end_call_chunks=end_call_chunks, pool_rows=window.rows_bound,
                                  rows_sent=int(rows_sent))
    k.launch(k.combine_fused, (grid,), (THREADS_PER_BLOCK,), args, stream=stream, shared_mem=shared)


# --- the sequences ----------------------------------------------------------------------------------------

def produce_chunk(k: Kernels, s: State, stream, *, chunk: ChunkStep, x, router, kind: str, source, topk_idx,
                  topk_weights, layer: int, delay_ns: int = 0, stamps: bool = False) -> None:
    """Produce ``chunk`` (streamed schedule) on ``stream``, which must be the current torch stream too:
    wait for the slot on one block, route the chunk's rows (``router``, a `symmring.moe.gpu.router.Router`, routes
    them from the call's source ``kind``/``source`` into ``topk_idx``/``topk_weights``, the call's ``[n, K]``
    buffers; None when they were given), then the route and layout kernels."""
    if delay_ns:
        sleep(k, s, stream, ns=delay_ns)
    if stamps:
        stamp(k, s, stream, chunk=chunk.chunk, stage=("producer", "wait"), end=False)
    wait_slot(k, s, stream, chunk=chunk.chunk)
    if stamps:
        stamp(k, s, stream, chunk=chunk.chunk, stage=("producer", "wait"), end=True)
        stamp(k, s, stream, chunk=chunk.chunk, stage=("producer", "route"), end=False)
    if chunk.num_valid and router is not None:
        router.route_rows(k, stream, x, kind, source, slice(chunk.token_base, chunk.token_base + chunk.num_valid),
                          (topk_idx, topk_weights))
    row_bytes = s.topk * 4
    produce_route(k, s, stream, chunk=chunk, topk_idx_ptr=topk_idx.data_ptr() + chunk.token_base * row_bytes,
                  topk_weights_ptr=topk_weights.data_ptr() + chunk.token_base * row_bytes, layer=layer)
    if stamps:
        stamp(k, s, stream, chunk=chunk.chunk, stage=("producer", "route"), end=True)
        stamp(k, s, stream, chunk=chunk.chunk, stage=("producer", "layout"), end=False)
    produce_layout(k, s, stream, chunk=chunk, x=x)
    if stamps:
        stamp(k, s, stream, chunk=chunk.chunk, stage=("producer", "layout"), end=True)


def consume_window(k: Kernels, s: State, stream, *, window: WindowStep, engine: ExpertEngine,
                   ack_policy: protocol.AckPolicy, split_waits: bool, topk_idx, topk_weights, y, layer: int,
                   end_call_chunks: int = 0, delay_ns: int = 0, stamps: bool = False, marks=None,
                   acked: Optional[Dict[int, object]] = None) -> None:
    """Consume the expert window on ``stream`` (the current torch stream too: the engine runs there).

    Args:
        split_waits: wait for each chunk's route before counting and for its layout before pulling (the
            streamed schedule, so counting overlaps the producer's layout); False waits for both at once
            (the batch schedule, whose producers all ran before).
        topk_idx, topk_weights: the owner's ``[n, K]`` routing of the call (the reduce reads it here).
        layer: the call identity's layer the waits check in every source's meta row.
        end_call_chunks: > 0 ends the call in the reduce (the last window of a single-stream schedule).
        delay_ns, stamps: tests and the timeline; marks: a `symmring.moe.debug.Hooks` whose ``mark`` records
            "dispatch", "experts" and "combine" after each part (per-stage timing), or None; acked: EARLY, a
            torch event per chunk, recorded on the current stream right after the chunk's acknowledgement is
            enqueued (the producer of the slot's next use waits for it), or None.
    """
    early = ack_policy == protocol.AckPolicy.EARLY
    if delay_ns:
        sleep(k, s, stream, ns=delay_ns)
    if stamps:
        stamp(k, s, stream, chunk=window.first, stage=("consumer", "wait"), end=False)
    first_parts = WAIT_ROUTE if split_waits else WAIT_ROUTE | WAIT_LAYOUT
    for c in window.chunks:
        # Route readiness alone lets the consumer count (and reserve pool rows across the window's chunks)
        # while the producer still writes the layout.
        wait(k, s, stream, chunk=c, parts=first_parts, window_row=c - window.first, clear_counts=c == window.first,
             layer=layer)
        stage(k, s, stream, chunk=c, parts=first_parts)  # rdma sources: count reads the staged routing
        if stamps and c == window.first:
            stamp(k, s, stream, chunk=window.first, stage=("consumer", "wait"), end=True)
            stamp(k, s, stream, chunk=window.first, stage=("consumer", "dispatch"), end=False)
        count(k, s, stream, chunk=c)
    scan(k, s, stream, window=window)
    # rdma sources: the pull reads the staged layout (not staged yet with split waits) and routing (the
    # staging ring holds one chunk per source: a window of several chunks staged over it while counting).
    restage = (WAIT_LAYOUT if split_waits else 0) | (WAIT_ROUTE | WAIT_LAYOUT if len(window.chunks) > 1 else 0)
    last_pass = len(window.passes) - 1
    for pass_idx, (pass_begin, rows) in enumerate(window.passes):
        # A window whose rows exceed the pool runs in passes (PROTOCOL.md 9.1c): each pulls, computes and
        # scatters the entries of its rows; every pass reads the slots again, so EARLY waits for the last.
        for c in window.chunks:
            if split_waits and pass_idx == 0:
                wait(k, s, stream, chunk=c, parts=WAIT_LAYOUT, window_row=c - window.first, clear_counts=False,
                     layer=layer)
            stage(k, s, stream, chunk=c, parts=restage if pass_idx == 0 or len(window.chunks) > 1 else 0)
            pull(k, s, stream, chunk=c, window=window, pass_idx=pass_idx)
            if early and pass_idx == last_pass:  # this PE's last read of every source's slot (meta snapshotted)
                ack(k, s, stream, chunk=c)
                if acked is not None:
                    acked[c].record()
        if marks is not None and pass_idx == last_pass:
            marks.mark("dispatch")
        if stamps and pass_idx == 0:
            stamp(k, s, stream, chunk=window.first, stage=("consumer", "dispatch"), end=True)
            stamp(k, s, stream, chunk=window.first, stage=("consumer", "experts"), end=False)
        send = send_rows(s, engine, window.first)
        out = outbound(s, engine.forward(s.pool(rows, pass_begin, len(window.passes)), rows,
                                         rows_per_expert=min(window.rows_per_expert, rows), out=_out_rows(s, rows),
                                         scratch=s.scratch, **({} if send is None else {"send": send})))
        if marks is not None and pass_idx == last_pass:
            marks.mark("experts")
        if stamps and pass_idx == last_pass:
            stamp(k, s, stream, chunk=window.first, stage=("consumer", "experts"), end=True)
            stamp(k, s, stream, chunk=window.first, stage=("consumer", "combine"), end=False)
        combine_scatter(k, s, stream, out=out, window_begin=window.first, pass_begin=pass_begin, pass_rows=rows,
                        rows_sent=send is not None)
    combine_signal(k, s, stream, first=window.first, last=window.last, ack_chunks=not early)
    combine_wait(k, s, stream, chunk=window.last)
    combine_reduce(k, s, stream, window=window, topk_idx=topk_idx, topk_weights=topk_weights, y=y,
                   end_call_chunks=end_call_chunks)
    if marks is not None:
        marks.mark("combine")
    if stamps:
        stamp(k, s, stream, chunk=window.first, stage=("consumer", "combine"), end=True)


def small_batch_call(k: Kernels, s: State, stream, *, chunk: ChunkStep, window: WindowStep, engine: ExpertEngine,
                     ack_policy: protocol.AckPolicy, x, topk_idx, topk_weights, y, num_chunks: int,
                     router: tuple, layer: int, marks=None, logits=None) -> None:
    """A one-chunk batch call in the small-batch schedule on ``stream`` (the current torch stream too):
    produce (routing ``logits`` into ``topk_idx``/``topk_weights`` with ``router`` when given, as
    `produce_fused`; else after the router filled them), dispatch, experts, combine (which ends the call).
    ``marks``: as for `consume_window`, with "layout" after the producer."""
    early = ack_policy == protocol.AckPolicy.EARLY
    pool = s.pool(window.rows_bound)
    # An engine that starts beside the dispatch (PDL only; ``marks`` time each kernel alone) is set up before the
    # producer: what it enqueues (its zeroed counters) then precedes the chain of dependent launches.
    beside = None
    if k.launch.enabled and marks is None:
        beside = engine.begin_beside_dispatch(pool, window.rows_bound, rows_per_expert=window.rows_per_expert)
    # An engine after the dispatch that sends its rows (every owner mapped) stores them into the owners' combine rows
    # itself, as in the general schedule: the combine then only reduces them (no pass of the rows through the
    # engine's output). Not beside the dispatch: there a late dispatch leaves NaN tiles whose rows' sources the
    # dispatch never wrote, which must stay in the engine's own output.
    send = send_rows(s, engine, window.first) if beside is None else None
    produce_fused(k, s, stream, chunk=chunk, topk_idx=topk_idx, topk_weights=topk_weights, x=x, logits=logits,
                  router=router, layer=layer)
    if marks is not None:
        marks.mark("layout")
    # rdma sources: wait for and get their slots first (the fused dispatch reads the staged copies).
    stage(k, s, stream, chunk=window.first, parts=WAIT_ROUTE | WAIT_LAYOUT, wait=True)
    dispatch_fused(k, s, stream, window=window, ack_now=early, layer=layer, plan=0 if beside is None else beside.plan)
    if marks is not None:
        marks.mark("dispatch")
    if beside is not None:
        out = outbound(s, beside.launch(k.launch, stream))
    else:
        out = outbound(s, engine.forward(pool, window.rows_bound, rows_per_expert=window.rows_per_expert,
                                         out=_out_rows(s, window.rows_bound), scratch=s.scratch,
                                         **({} if send is None else {"send": send})))
    if marks is not None:
        marks.mark("experts")
    combine_fused(k, s, stream, out=out, window=window, ack_now=not early, topk_idx=topk_idx,
                  topk_weights=topk_weights, y=y, end_call_chunks=num_chunks, rows_sent=send is not None)
    if marks is not None:
        marks.mark("combine")
