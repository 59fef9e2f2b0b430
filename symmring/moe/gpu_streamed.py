"""The expert-parallel MoE layer on GPUs, streamed path: chunks of ``tokens_per_slot`` tokens through a
``num_slots`` NVSHMEM ring, the producer of chunk ``c + 1`` overlapping the consumer of chunk ``c``.

Run on one H200 with 1, 2 and 4 PEs (tests/gpu/test_moe_streamed.py); results and the design in
docs/MOE_STREAMED.md. The batch path (`symmring.moe.gpu.MoE`) stays the default; `symmring.moe.policy`
chooses between them from measurements.

One `StreamedMoE.forward` is one call of the ring protocol with ``call_num_chunks`` chunks (the most any
rank needs; every rank runs them all, publishing and acknowledging zero-token chunks). The host enqueues,
in `symmring.protocol.windowed_enqueue_order` (itself a valid serial schedule, PROTOCOL.md 9.1a):

* **produce c** on the producer stream: ``stream_wait_slot`` (one block: the acks of chunk ``c - S``),
  router GEMM and TopK of the chunk's rows (torch, into the layer's routing buffers), ``moe_produce_route``
  (copy topk + meta, publish route readiness), ``moe_produce_layout_fp8``/``_bf16`` (quantise into the
  slot, publish layout readiness) -- device/producer.cu, the batch layer's kernels with per-chunk pointers;
* **consume the expert window [c0, c1]** (``expert_window`` chunks, 1 = chunk-local pools) on the consumer
  stream: per chunk ``stream_wait_route`` (snapshot of each source's meta token_base) and
  ``moe_dispatch_count`` (counts accumulate over the window: pool rows are reserved across its chunks);
  ``moe_dispatch_scan``; per chunk ``stream_wait_layout``, ``moe_dispatch_pull`` and (EARLY)
  ``stream_ack``; the grouped GEMMs over the window; ``stream_combine_scatter`` (to the owner's combine
  rows at the LOGICAL token row), ``stream_combine_signal`` (combine generation = the window's last
  chunk's ring generation; CONSERVATIVE acknowledges here), ``stream_combine_wait`` (``>=``: PROTOCOL.md
  section 7.1), ``stream_combine_reduce`` (the window's rows of ``y``, topk from the owner's local routing
  buffers, never the slot).

Then the streams join the caller's stream and ``stream_end_call`` advances the device-resident generation
base by the chunk count, so `capture` gives a graph whose replays are fresh calls.

Combine buffer: ``combine_ready[world_size]`` uint64 + rows ``[max_tokens][topk][hidden]`` bf16 indexed by
the owner's logical token row over the whole call, so chunks of one call never share rows; across calls a
consumer writes call ``k + 1``'s rows only after it saw the owner's call-``k + 1`` publication, which the
owner's producer stream issues after joining the caller's stream, i.e. after its call-``k`` reduce.

SM budget of the spinning kernels per PE: ``stream_wait_slot`` (one block, producer stream) and
``stream_wait_route`` / ``stream_wait_layout`` (one block per source rank) or ``stream_combine_wait`` (one
block) on the consumer stream: at most ``world_size + 1`` blocks at a time, far below an H200's 132 SMs
(measured: the producer's kernels run < 2 % slower beside them).

Example:
    >>> moe = StreamedMoE(ctx, num_experts=8, hidden=1024, inter=512, topk=2, w_gate=wg, w_up=wu, w_down=wd,
    ...                   max_tokens=4096, tokens_per_slot=512, num_slots=3)
    >>> y = moe.forward(x, router_weight=router)
    >>> moe.check_errors(); moe.close()
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Dict, List, Optional, Sequence

import numpy as np

from .. import env, protocol
from ..errors import ConfigError, ProtocolTimeout
from ..layout import ALIGN, RingSpec, align_up
from . import torch_ref
from .gpu import (FP8_GROUP_SIZE, MAX_BLOCKS, MAX_ROUTE_BLOCKS, THREADS_PER_BLOCK, WARPS_PER_BLOCK, MoE, _blocks,
                  _check_int, _ptr, _torch)

logger = logging.getLogger(__name__)

#: Device source of the streamed kernels (device/stream.cu).
STREAM_SOURCE = "stream"
#: Stages of the timeline: (stream, stage), each with a start and an end stamp. Producer stages are per
#: chunk; consumer stages per expert window (stamped at the window's first chunk). "wait" stages are spins
#: (the producer for its slot, the consumer for the first chunk's route readiness), not work.
TIMELINE_STAGES = (("producer", "wait"), ("producer", "route"), ("producer", "layout"), ("consumer", "wait"),
                   ("consumer", "dispatch"), ("consumer", "experts"), ("consumer", "combine"))
_STAGE = {key: i for i, key in enumerate(TIMELINE_STAGES)}

_stream_modules: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _load_stream_module(backend):
    module = _stream_modules.get(backend)
    if module is None:
        from .. import jit
        module = _stream_modules[backend] = backend.load_module(jit.read_source(f"{STREAM_SOURCE}.cu"),
                                                                name="moe_stream")
    return module


def _ack_policy(value) -> protocol.AckPolicy:
    if isinstance(value, protocol.AckPolicy):
        return value
    if isinstance(value, str) and value.upper() in protocol.AckPolicy.__members__:
        return protocol.AckPolicy[value.upper()]
    raise ConfigError(f"ack_policy={value!r}: expected an AckPolicy or one of "
                      f"{[p.name.lower() for p in protocol.AckPolicy]}")


class StreamedMoE(MoE):
    """Expert-parallel MoE layer on GPU PEs, streamed through a ring of ``num_slots`` chunks.

    Args:
        ctx, num_experts, hidden, inter, topk, w_gate, w_up, w_down, max_tokens, x_format, scoring, bias,
            routed_scaling_factor: as `symmring.moe.gpu.MoE` (``max_tokens``: most tokens per rank per call,
            the size of the combine buffer).
        tokens_per_slot: tokens per chunk (the ring slot's capacity); at most ``max_tokens``.
        num_slots: slots of the ring (>= 1); the producer runs up to ``num_slots - 1`` chunks ahead.
        ack_policy: ``AckPolicy.CONSERVATIVE`` (acknowledge after the chunk's combine signal) or
            ``AckPolicy.EARLY`` (right after the dispatch pull), or their names.
        expert_window: chunks whose rows share the expert pool and one grouped GEMM (1 <= W <=
            num_slots): 1 = chunk-local expert pools; W > 1 reserves pool rows across the window's chunks
            (counted from route readiness alone) and hands the window to L1 once its last chunk is pulled,
            so the expert weights are read once per window instead of once per chunk.
        single_stream: run producer and consumer on the caller's stream, in the enqueue order (the serial
            schedule of PROTOCOL.md 9.1; for tests and as a fallback).
        timeout_s: bound of every device wait (default: the context's).

    Raises:
        ConfigError: any bad argument, named, before any collective work.
        BackendError: the context is not on the nvshmem backend, or torch is missing.

    Example:
        >>> moe = StreamedMoE(ctx, 8, 1024, 512, 2, wg, wu, wd, max_tokens=4096, tokens_per_slot=512,
        ...                   num_slots=3, ack_policy="early")
        >>> y = moe.forward(x, logits=logits)
    """

    def __init__(self, ctx, num_experts: int, hidden: int, inter: int, topk: int, w_gate, w_up, w_down, *,
                 max_tokens: int, tokens_per_slot: int, num_slots: int = 2,
                 ack_policy=protocol.AckPolicy.CONSERVATIVE, expert_window: int = 1, x_format: str = "fp8_e4m3",
                 scoring: str = "softmax", bias=None, routed_scaling_factor: float = 1.0,
                 single_stream: bool = False, timeout_s: Optional[float] = None):
        torch = _torch()
        # The streamed path's own arguments first: every ConfigError before any collective work.
        max_tokens = _check_int("max_tokens", max_tokens)
        T = _check_int("tokens_per_slot", tokens_per_slot)
        if T > max_tokens:
            raise ConfigError(f"tokens_per_slot={tokens_per_slot}: expected at most max_tokens={max_tokens}")
        self.num_slots = _check_int("num_slots", num_slots)
        self.tokens_per_slot = T
        self.ack_policy = _ack_policy(ack_policy)
        protocol.check_expert_window(expert_window, self.num_slots)
        self.expert_window = int(expert_window)
        if not isinstance(single_stream, bool):
            raise ConfigError(f"single_stream={single_stream!r}: expected a bool")
        self.single_stream = single_stream
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        # The batch layer's validation and setup, sized for ONE expert window: its expert pool
        # (world_size * window tokens * K rows), counters and fused weights are exactly what a window needs.
        # Its one-slot ring and combine buffer are then replaced by the streamed ones (a small collective
        # alloc + free, once).
        window_tokens = min(self.expert_window * T, max_tokens)
        super().__init__(ctx, num_experts, hidden, inter, topk, w_gate, w_up, w_down, max_tokens=window_tokens,
                         x_format=x_format, scoring=scoring, bias=bias, routed_scaling_factor=routed_scaling_factor)
        backend = self.backend
        backend.free(self.combine_alloc)
        self.ring.close()
        self.max_tokens = max_tokens
        self.timeout_s = float(ctx.timeout_s if timeout_s is None else timeout_s)

        from ..kernels import DeviceRing
        K, H = self.topk, self.hidden
        self.spec = RingSpec(num_slots=self.num_slots, tokens_per_slot=T, hidden=H, num_topk=K,
                             num_experts=self.num_experts, x_format=x_format, sf_group_size=FP8_GROUP_SIZE)
        self.ring = DeviceRing(backend, self.spec, timeout_s=self.timeout_s, ack_policy=self.ack_policy)
        # Combine buffer (symmetric): combine_ready[world_size] uint64, then rows [max_tokens][K][H] bf16
        # by logical token row (chunks of a call never share rows).
        self._rows_offset = align_up(self.world_size * 8, ALIGN)
        self.combine_alloc = backend.alloc(self._rows_offset + self.max_tokens * K * H * 2)
        self._combine_ready_ptr = np.uint64(backend.address(self.combine_alloc, self.rank, 0))
        self._combine_rows_ptr = np.uint64(backend.address(self.combine_alloc, self.rank, self._rows_offset))
        self._stream_module = _load_stream_module(backend)

        # Local buffers of the streamed path, fixed size (graph-capturable); the pool is the parent's.
        device = self.device
        i32 = dict(dtype=torch.int32, device=device)
        # Every source's meta token_base per chunk of the window being consumed: [window][world_size].
        self.token_base = torch.zeros((self.expert_window, self.world_size), dtype=torch.int64, device=device)
        # The owner's routing of the whole call (the reduce reads it here, never from the slot).
        self.topk_idx_all = torch.zeros((self.max_tokens, K), **i32)
        self.topk_weights_all = torch.zeros((self.max_tokens, K), dtype=torch.float32, device=device)
        self.max_chunks = protocol.num_chunks_for(self.max_tokens, T)
        self.stamps = torch.zeros(2 * len(TIMELINE_STAGES) * self.max_chunks, dtype=torch.int64, device=device)
        self._timeline_chunks = 0
        self._producer_stream = None if single_stream else torch.cuda.Stream(device=device)
        self._consumer_stream = None if single_stream else torch.cuda.Stream(device=device)
        backend.barrier()
        logger.info("StreamedMoE on rank %d/%d: experts [%d, %d) of %d, hidden %d, inter %d, top-%d, %s, "
                    "max_tokens %d, %d slots x %d tokens, %s ack, %s", self.rank, self.world_size,
                    self.expert_begin, self.expert_begin + self.num_local_experts, self.num_experts, H, self.inter,
                    K, x_format, self.max_tokens, self.num_slots, T, self.ack_policy.name,
                    "one stream" if single_stream else "producer + consumer streams")
        if self.expert_window > 1:
            logger.info("StreamedMoE on rank %d: expert window of %d chunks", self.rank, self.expert_window)

    # --- validation -----------------------------------------------------------------------------------

    @staticmethod
    def _check_delays(name: str, delays) -> Dict[int, int]:
        if delays is None:
            return {}
        if not isinstance(delays, dict):
            raise ConfigError(f"{name}={delays!r}: expected a dict chunk_idx -> nanoseconds")
        for chunk, ns in delays.items():
            _check_int(f"{name} chunk", chunk, 0)
            _check_int(f"{name}[{chunk}]", ns, 0)
        return {int(c): int(ns) for c, ns in delays.items()}

    # --- the layer ------------------------------------------------------------------------------------

    def forward(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None,
                timeline: bool = False, producer_delay_ns: Optional[Dict[int, int]] = None,
                consumer_delay_ns: Optional[Dict[int, int]] = None):
        """Run the layer on this rank's tokens, streamed (collective: every rank calls forward once per call).

        Args:
            x, router_weight, logits, topk_idx, topk_weights: as `symmring.moe.gpu.MoE.forward`.
            timeline: stamp every stage of every chunk with the device clock (`timeline_records`).
            producer_delay_ns: ``{chunk_idx: ns}``: spin the producer stream that long before producing
                the chunk (tests: a deliberately slow or stalled producer).
            consumer_delay_ns: ``{chunk_idx: ns}``: spin the consumer stream that long before consuming
                the expert window that starts at the chunk (tests: a slow consumer).

        Returns:
            bf16 ``[n, hidden]`` tensor ``y`` (enqueued on the current torch stream; no host sync).

        Raises:
            ConfigError: bad shapes, dtypes, devices or routing sources (nothing is enqueued).
            ProtocolTimeout: the ranks' token counts did not arrive within the timeout (host), or, with
                ``SYMMRING_DEBUG=1``, a device wait expired.
        """
        torch = _torch()
        self._check_open()
        x = self._check_input(x)
        n = int(x.shape[0])
        if not isinstance(timeline, bool):
            raise ConfigError(f"timeline={timeline!r}: expected a bool")
        delays = self._check_delays("producer_delay_ns", producer_delay_ns)
        consumer_delays = self._check_delays("consumer_delay_ns", consumer_delay_ns)
        kind, source = self._routing_source(x, router_weight, logits, topk_idx, topk_weights)

        counts = self._all_token_counts(n)
        T = self.tokens_per_slot
        num_chunks = protocol.call_num_chunks(counts, T)
        caller = torch.cuda.current_stream()
        y = torch.empty((n, self.hidden), dtype=torch.bfloat16, device=self.device)
        if num_chunks == 0:  # every rank has zero tokens: no chunk, generation base unchanged
            return y
        producer = caller if self.single_stream else self._producer_stream
        consumer = caller if self.single_stream else self._consumer_stream
        if not self.single_stream:
            # Fork: both streams start after the caller's earlier work (the previous call's end included).
            producer.wait_stream(caller)
            consumer.wait_stream(caller)
        if kind == "given":
            idx_buf, w_buf = source
        else:
            idx_buf, w_buf = self.topk_idx_all, self.topk_weights_all
        self._timeline_chunks = num_chunks if timeline else 0
        for item, first, last in protocol.windowed_enqueue_order(num_chunks, self.num_slots, self.expert_window):
            if item == "produce":
                with torch.cuda.stream(producer):
                    self._produce(first, x, n, kind, source, idx_buf, w_buf, delays.get(first, 0), timeline,
                                  producer)
            else:
                with torch.cuda.stream(consumer):
                    # Rows the window's GEMMs run over: every (token, k) of every rank's chunks of the window.
                    rows_bound = max(1, min(self.capacity, self.topk * sum(
                        protocol.chunk_valid_tokens(c, chunk, T) for c in counts for chunk in range(first, last + 1))))
                    self._consume(first, last, n, idx_buf, w_buf, y, rows_bound, timeline,
                                  consumer_delays.get(first, 0), consumer)
        if not self.single_stream:
            caller.wait_stream(producer)  # join: every kernel that reads the generation base is done
            caller.wait_stream(consumer)
        # End of the call: generation base + num_chunks (device-resident: graph replays stay fresh).
        self._stream_module.function("stream_end_call")((1,), (32,), (self.ring.kernels.desc, np.int32(num_chunks)),
                                                         stream=self._stream(caller.cuda_stream))
        if env.debug():
            self.check_errors()
        return y

    __call__ = forward

    def _stamp(self, stream, chunk: int, stage, end: bool) -> None:
        idx = 2 * (chunk * len(TIMELINE_STAGES) + _STAGE[stage]) + int(end)
        self._stream_module.function("stream_stamp")((1,), (32,), (_ptr(self.stamps), np.int32(idx)), stream=stream)

    def _produce(self, chunk: int, x, n: int, kind: str, source, idx_buf, w_buf, delay_ns: int, timeline: bool,
                 torch_stream) -> None:
        """Enqueue produce ``chunk`` on the current (producer) stream."""
        stream = self._stream(torch_stream.cuda_stream)
        T, K, H = self.tokens_per_slot, self.topk, self.hidden
        base = protocol.chunk_token_base(chunk, T)
        num_valid = protocol.chunk_valid_tokens(n, chunk, T)
        desc = self.ring.kernels.desc
        chunk_i32 = np.int32(chunk)
        fn_p = self._modules["producer"].function
        fn_s = self._stream_module.function
        if delay_ns:
            fn_s("stream_sleep")((1,), (32,), (np.uint64(delay_ns),), stream=stream)
        if timeline:
            self._stamp(stream, chunk, ("producer", "wait"), False)
        # Wait for the slot on one block (acks of chunk - num_slots); the route kernel then finds it free.
        fn_s("stream_wait_slot")((1,), (32,), (desc, chunk_i32), stream=stream)
        if timeline:
            self._stamp(stream, chunk, ("producer", "wait"), True)
            self._stamp(stream, chunk, ("producer", "route"), False)
        if num_valid and kind != "given":
            rows = slice(base, base + num_valid)
            idx, weights = self._route(x[rows], kind, source if kind == "router" else source[rows])
            idx_buf[rows].copy_(idx)
            w_buf[rows].copy_(weights)
        counters = self.grid_counters
        # route: copy topk + meta into the (free) slot, reset its mask, publish route readiness.
        fn_p("moe_produce_route")((_blocks(num_valid * K, THREADS_PER_BLOCK, MAX_ROUTE_BLOCKS),), (THREADS_PER_BLOCK,),
                                  (desc, chunk_i32, np.uint64(idx_buf.data_ptr() + base * K * 4),
                                   np.uint64(w_buf.data_ptr() + base * K * 4), np.int32(num_valid),
                                   np.uint64(counters.data_ptr())), stream=stream)
        if timeline:
            self._stamp(stream, chunk, ("producer", "route"), True)
            self._stamp(stream, chunk, ("producer", "layout"), False)
        fp8 = self.x_format == "fp8_e4m3"
        layout_blocks = (_blocks(num_valid, WARPS_PER_BLOCK) if fp8
                         else _blocks(num_valid * H // 8, THREADS_PER_BLOCK * 4))
        x_ptr = np.uint64(x.data_ptr() + base * x.stride(0) * 2)
        fn_p("moe_produce_layout_fp8" if fp8 else "moe_produce_layout_bf16")(
            (layout_blocks,), (THREADS_PER_BLOCK,),
            (desc, chunk_i32, x_ptr, np.int64(x.stride(0)), np.int32(num_valid), np.uint64(counters.data_ptr() + 4)),
            stream=stream)
        if timeline:
            self._stamp(stream, chunk, ("producer", "layout"), True)

    def _consume(self, first: int, last: int, n: int, idx_buf, w_buf, y, rows_bound: int, timeline: bool,
                 delay_ns: int, torch_stream) -> None:
        """Enqueue consume of the expert window ``[first, last]`` on the current (consumer) stream."""
        stream = self._stream(torch_stream.cuda_stream)
        R, E, T, K = self.world_size, self.num_local_experts, self.tokens_per_slot, self.topk
        desc = self.ring.kernels.desc
        fn_d = self._modules["dispatch"].function
        fn_s = self._stream_module.function
        early = self.ack_policy == protocol.AckPolicy.EARLY
        if delay_ns:
            fn_s("stream_sleep")((1,), (32,), (np.uint64(delay_ns),), stream=stream)
        if timeline:
            self._stamp(stream, first, ("consumer", "wait"), False)
        # Route readiness alone lets the consumer count (and, for a window, reserve pool rows across its
        # chunks) while the producer still writes the layout.
        for chunk in range(first, last + 1):
            chunk_i32 = np.int32(chunk)
            token_base = np.uint64(self.token_base.data_ptr() + (chunk - first) * R * 8)
            fn_s("stream_wait_route")((R,), (32,), (desc, chunk_i32, _ptr(self.counts), np.int32(E), token_base,
                                                    np.int32(chunk == first)), stream=stream)
            if timeline and chunk == first:
                self._stamp(stream, first, ("consumer", "wait"), True)
                self._stamp(stream, first, ("consumer", "dispatch"), False)
            fn_d("moe_dispatch_count")((_blocks(T * K, THREADS_PER_BLOCK, 64), R), (THREADS_PER_BLOCK,),
                                       (desc, chunk_i32, _ptr(self.counts), np.int32(self.expert_begin), np.int32(E),
                                        _ptr(self.status)), stream=stream, shared_mem=4 * E)
        fn_d("moe_dispatch_scan")((1,), (1024,), (_ptr(self.counts), _ptr(self.begin), _ptr(self.group_end),
                                                   _ptr(self.cursor), _ptr(self.total), np.int32(E)),
                                  stream=stream, shared_mem=4 * 1024)
        for chunk in range(first, last + 1):
            chunk_i32 = np.int32(chunk)
            fn_s("stream_wait_layout")((R,), (32,), (desc, chunk_i32), stream=stream)
            fn_d("moe_dispatch_pull")((_blocks(T, WARPS_PER_BLOCK, max(1, MAX_BLOCKS // R)), R), (THREADS_PER_BLOCK,),
                                      (desc, chunk_i32, _ptr(self.begin), _ptr(self.cursor), _ptr(self.pool_x),
                                       _ptr(self.row_src), _ptr(self.row_weight), np.int32(self.expert_begin),
                                       np.int32(E), _ptr(self.status)), stream=stream)
            if early:
                # The pull was the last read of every source's slot (meta was snapshotted by the wait).
                fn_s("stream_ack")((1,), (32,), (desc, chunk_i32), stream=stream)
        if timeline:
            self._stamp(stream, first, ("consumer", "dispatch"), True)
            self._stamp(stream, first, ("consumer", "experts"), False)
        h = torch_ref.grouped_mm(self.pool_x[:rows_bound], self._w13_t, self.group_end)
        act = torch_ref.swiglu(h, self.inter)
        out = torch_ref.grouped_mm(act, self._w_down_t, self.group_end)
        if timeline:
            self._stamp(stream, first, ("consumer", "experts"), True)
            self._stamp(stream, first, ("consumer", "combine"), False)
        fn_s("stream_combine_scatter")((_blocks(self.capacity, WARPS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                                       (desc, _ptr(out), _ptr(self.row_src), _ptr(self.total), _ptr(self.token_base),
                                        np.int32(first), self._combine_rows_ptr), stream=stream)
        fn_s("stream_combine_signal")((1,), (32,), (desc, np.int32(first), np.int32(last), self._combine_ready_ptr,
                                                    np.int32(not early)), stream=stream)
        fn_s("stream_combine_wait")((1,), (32,), (desc, np.int32(last), self._combine_ready_ptr), stream=stream)
        base = protocol.chunk_token_base(first, T)
        num_valid = sum(protocol.chunk_valid_tokens(n, c, T) for c in range(first, last + 1))
        fn_s("stream_combine_reduce")((_blocks(num_valid, WARPS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                                      (desc, self._combine_rows_ptr, _ptr(idx_buf), _ptr(w_buf), _ptr(y),
                                       np.int64(self.hidden), np.int32(base), np.int32(num_valid)), stream=stream)
        if timeline:
            self._stamp(stream, first, ("consumer", "combine"), True)

    def capture(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None,
                warmup: int = 1):
        """Capture one streamed `forward` (producer and consumer streams) into a CUDA graph (collective).

        As `symmring.moe.gpu.MoE.capture`: ``warmup`` eager calls first (every rank makes the same ones),
        then the capture; each ``graph.replay()`` is one more call with fresh generations from the device
        base. The chunk count is fixed by the capture (every rank's token count must stay the same).

        Returns:
            ``(graph, y)``: the ``torch.cuda.CUDAGraph`` and its static output.

        Example:
            >>> graph, y = moe.capture(x, router_weight=router)
            >>> x.copy_(next_batch); graph.replay(); use(y)
        """
        return super().capture(x, router_weight=router_weight, logits=logits, topk_idx=topk_idx,
                               topk_weights=topk_weights, warmup=warmup)

    def _all_token_counts(self, n: int) -> List[int]:
        """Every rank's token count of this call: a non-blocking MPI allgather, polled with the bound."""
        if self.world_size == 1:
            return [n]
        send, recv = np.array([n], np.int64), np.zeros(self.world_size, np.int64)
        request = self.ctx.comm.Iallgather(send, recv)
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise ProtocolTimeout("token_counts", rank=self.rank, slot=0, expected=self.world_size,
                                      observed=0, timeout_s=self.timeout_s)
        return [int(c) for c in recv]

    # --- timeline -------------------------------------------------------------------------------------

    def timeline_records(self) -> List[Dict]:
        """Device timestamps of the last ``forward(timeline=True)`` (synchronises): one record per producer
        stage of every chunk and per consumer stage of every expert window, ``{"chunk", "last_chunk",
        "stream", "stage", "start_ns", "end_ns"}`` (a window's records carry its first and last chunk), times
        relative to the earliest stamp."""
        self._check_open()
        num_chunks = self._timeline_chunks
        if not num_chunks:
            return []
        stamps = self.stamps[: 2 * len(TIMELINE_STAGES) * num_chunks].cpu().numpy().astype(np.int64)
        windows = dict(protocol.expert_windows(num_chunks, self.expert_window))  # first -> last chunk
        stamped = [(chunk, s) for chunk in range(num_chunks) for s, (stream_name, _) in enumerate(TIMELINE_STAGES)
                   if stream_name == "producer" or chunk in windows]
        t0 = min(int(stamps[2 * (chunk * len(TIMELINE_STAGES) + s)]) for chunk, s in stamped)
        records = []
        for chunk, s in stamped:
            stream_name, stage = TIMELINE_STAGES[s]
            i = 2 * (chunk * len(TIMELINE_STAGES) + s)
            records.append({"chunk": chunk, "last_chunk": windows[chunk] if stream_name == "consumer" else chunk,
                            "stream": stream_name, "stage": stage,
                            "start_ns": int(stamps[i]) - t0, "end_ns": int(stamps[i + 1]) - t0})
        return records

    def slot_view(self, name: str, num_tokens: int, slot: int = 0):
        """As `MoE.slot_view`, of ring slot ``slot`` (for tests)."""
        slot = _check_int("slot", slot, 0)
        if slot >= self.num_slots:
            raise ConfigError(f"slot={slot}: expected < num_slots={self.num_slots}")
        if name not in ("x", "x_sf", "topk_idx", "topk_weights"):
            raise ConfigError(f"name={name!r}: expected one of 'x', 'x_sf', 'topk_idx', 'topk_weights'")
        num_tokens = _check_int("num_tokens", num_tokens, 0)
        if num_tokens > self.tokens_per_slot:
            raise ConfigError(f"num_tokens={num_tokens}: expected at most tokens_per_slot={self.tokens_per_slot}")
        self._check_open()
        region = self.ring.layout[name]
        return self.backend.view(self.ring.alloc, self.rank, region.slot_offset(slot), region.dtype,
                                 (num_tokens,) + tuple(region.slot_shape[1:]))


def _work_intervals(records: Sequence[Dict], stream_name: str) -> List[List[int]]:
    """Merged ``[start, end]`` intervals of one stream's work stages ("wait" stages excluded)."""
    spans = sorted((r["start_ns"], r["end_ns"]) for r in records
                   if r["stream"] == stream_name and r["stage"] != "wait")
    merged: List[List[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _both_working_ns(records: Sequence[Dict]) -> int:
    producer, consumer = _work_intervals(records, "producer"), _work_intervals(records, "consumer")
    both = 0
    i = j = 0
    while i < len(producer) and j < len(consumer):
        lo, hi = max(producer[i][0], consumer[j][0]), min(producer[i][1], consumer[j][1])
        both += max(0, hi - lo)
        if producer[i][1] < consumer[j][1]:
            i += 1
        else:
            j += 1
    return both


def hidden_producer_fraction(records: Sequence[Dict]) -> float:
    """Fraction of the producer's work time during which the consumer also worked (the producer time
    that streaming hides; 0 without records)."""
    busy = sum(end - start for start, end in _work_intervals(records, "producer"))
    return _both_working_ns(records) / busy if busy > 0 else 0.0


def overlap_fraction(records: Sequence[Dict]) -> float:
    """Fraction of the timeline's span during which a producer stage and a consumer stage both did work
    ("wait" stages, which only spin, do not count; 0 when nothing overlaps; the records of
    `StreamedMoE.timeline_records`)."""
    if not records:
        return 0.0
    span = max(r["end_ns"] for r in records) - min(r["start_ns"] for r in records)
    return _both_working_ns(records) / span if span > 0 else 0.0
