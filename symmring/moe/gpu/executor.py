"""The GPU layer's executor: it owns what a call runs on and runs a plan.

`Executor` holds the layer's view of its workspace memory (`symmring.moe.gpu.memory.Binding`: the ring, the
device state, the routing rows, the async-error latch), the kernels, the CuPy views of the streams, the router,
the expert engine and the cache of captured calls (`symmring.moe.gpu.graph_cache`). Given a plan
(`symmring.moe.gpu.plan.Plan`) and the call's tensors it enqueues the call's kernels (`symmring.moe.gpu.stages`):
the batch schedule on the caller's stream, the small-batch schedule's fused kernels, or the streamed schedule on
the producer and consumer streams; or it replays the call's cached graph. Nothing it calls calls back up: the
stages get the router and the call's tensors, and their instrumentation (`symmring.moe.debug.Hooks`) as data.

Workspace memory that moves (the workspace grew for a larger layer, or its entry map for a larger ring) bumps
`symmring.Workspace.epoch`; `follow_memory`, called before every call, is the one place that reacts: it looks
the layer's binding up again and drops what addressed the old memory (the cached graphs; the layer's planner
drops its plans with it).
"""

from __future__ import annotations

import logging
import warnings
from typing import Dict, Optional

import numpy as np

from ...errors import BackendError, ConfigError
from ...protocol import AckPolicy
from ..config import check_int
from ..engines import capture_scope
from ..routing import logits_operand
from . import graph_cache as graph_cache_mod
from . import stages, timeline
from .inputs import torch_module
from .plan import Plan, own_rows

logger = logging.getLogger(__name__)


def _rows_like(t, rows: int):
    """An uninitialised tensor like ``t`` with ``rows`` rows (a cached graph's static input for its bucket)."""
    return torch_module().empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)


def _skipped_groups(state, rank: int, num_local_experts: int) -> Optional[BackendError]:
    """The error of what the fp8 GEMMs reported in ``state.bad_groups`` (tiles skipped for a group id outside
    ``[-1, E)``), the report then cleared; None when nothing was skipped (after a synchronisation)."""
    if state.bad_groups is None:
        return None
    tiles, value = (int(v) for v in state.bad_groups.tolist())
    if not tiles:
        return None
    state.bad_groups.zero_()
    return BackendError(f"rank {rank}: the expert GEMMs skipped {tiles} tile(s) of pool rows naming group {value}, "
                        f"outside [-1, {num_local_experts}) (stale or corrupt group ids); those rows were not "
                        "computed and the call's output is not valid")


class Executor:
    """Runs the plans of one GPU layer (module docstring).

    Args:
        spec: the layer's `symmring.moe.gpu.spec.GpuSpec`.
        workspace: the `symmring.Workspace` the layer borrows (attached and bound).
        bind_key: the layer's binding in the workspace memory (`DeviceMemory.bind`).
        engine: the `symmring.moe.engines.ExpertEngine`.
        router: the `symmring.moe.gpu.router.Router`.
        device: the layer's torch device.

    Attributes:
        hooks: the `symmring.moe.debug.Hooks` of the call being made (None but inside ``layer.debug.forward``).
        state, kernels, ring, latch, capacity: the current memory's (`follow_memory`).
    """

    def __init__(self, spec, workspace, bind_key, engine, router, device):
        self.spec, self.workspace, self.bind_key = spec, workspace, bind_key
        self.engine, self.router, self.device = engine, router, device
        self.graphs = graph_cache_mod.GraphCache(spec.graph_cache)
        self.hooks = None
        self.epoch = -1  # of the workspace memory the views below are of
        self._streams: Dict[int, object] = {}  # torch stream handle -> CuPy view of it
        self._timeline = (0, {})  # (chunks, windows) of the last call with a timeline

    # --- the workspace memory ---------------------------------------------------------------------------

    def follow_memory(self) -> bool:
        """Take the views of the workspace's current memory (its `epoch`) when it moved since the last call:
        drop the cached graphs (they address the old memory) and look the binding up again. Returns whether
        it moved (the caller's planner then drops its plans)."""
        workspace = self.workspace
        if self.epoch == workspace.epoch:
            return False
        if self.epoch >= 0:
            self.clear_graphs()
        memory = workspace.gpu
        binding = memory.bindings[self.bind_key]
        self.memory, self.kernels, self.binding = memory, memory.kernels, binding
        self.state, self.ring, self.latch, self.capacity = binding.state, binding.ring, binding.latch, binding.capacity
        self.topk_idx, self.topk_weights = binding.topk_idx, binding.topk_weights
        self.epoch = workspace.epoch
        return True

    def stream(self, handle: int):
        """CuPy's view of a torch stream (cached: one object per stream handle)."""
        stream = self._streams.get(handle)
        if stream is None:
            import cupy
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; kernels.as_stream uses it too
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._streams[handle] = cupy.cuda.ExternalStream(handle)
        return stream

    # --- a call -------------------------------------------------------------------------------------------

    def execute(self, plan: Plan, x, kind: str, source, *, distinct: bool, graph_cache: bool, in_step: bool):
        """Run the call ``plan`` on ``x`` and its routing source (``kind``, ``source``) and return ``y``: from its
        cached graph where the cache serves it, else its kernels launched (or captured, when the caller's stream
        is capturing), ordered after the previous call of any layer and marked as the last."""
        torch = torch_module()
        capturing = torch.cuda.is_current_stream_capturing()
        y = None
        if graph_cache and not capturing and self.hooks is None:
            y = self._cached_call(plan, distinct, x, kind, source)
        if y is None:
            n = int(x.shape[0])
            y = torch.empty((n, self.spec.hidden), dtype=torch.bfloat16, device=self.device)
            if not capturing:
                self.memory.begin_call(n)
            else:
                self.workspace.note_capture()  # Workspace.replay refuses a graph of old memory
                if not in_step:  # a graph captured outside a step replays this count (it fixed the bucket too)
                    self.memory.record_call_tokens(n)
                # else: a step's graph reads the count set before each replay (Workspace.set_call_tokens)
            self.enqueue(plan, x, kind, source, y)
            if not capturing:
                self.memory.end_of_call()
        return y

    def enqueue(self, plan: Plan, x, kind: str, source, y) -> None:
        """The call's kernels on the current stream (eagerly, or into the graph being captured)."""
        plan = own_rows(plan, int(x.shape[0]))  # never past x's or y's rows, whatever the count word says
        stream = torch_module().cuda.current_stream()
        if plan.streaming:
            self._run_streamed(plan, x, kind, source, y, stream)
        else:
            self._run_batch(plan, x, kind, source, y, self.stream(stream.cuda_stream))
        # Last on the caller's stream: after an error, y is NaN and the error latched for the next forward.
        self.latch.enqueue(stream.cuda_stream, y)

    def refuse(self, layer_id: int) -> None:
        """This rank refused its call inside a step (`symmring.Workspace.refuse_call` counted it): unless a graph
        is being captured, record the refusal on the layer's ring after the last call (``moe_refuse_call``: every
        other PE's wait of this call ends at once, aborted; their outputs are NaN), the latch after it, as after
        any call."""
        torch = torch_module()
        if torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream()
        self.memory.after_last_call()
        stages.refuse_call(self.kernels, self.state, self.stream(stream.cuda_stream), layer=layer_id)
        self.latch.enqueue(stream.cuda_stream)
        self.memory.end_of_call()

    # --- the schedules ------------------------------------------------------------------------------------

    def _run_batch(self, plan: Plan, x, kind: str, source, y, stream) -> None:
        """The batch schedule on the caller's stream: every route, every layout, one window, the end."""
        k, s, spec, hooks = self.kernels, self.state, self.spec, self.hooks
        marks = hooks if hooks is not None and hooks.stage_events is not None else None
        if marks is not None:
            marks.mark("start")
        if plan.small_batch:
            # The producer routes the logits itself (the same device routing as Router.route).
            logits = None
            if kind == "given":
                idx, weights = source
            elif self.router.on_device:
                logits = logits_operand(self.router.logits(x, kind, source))
                idx, weights = self.topk_idx[:x.shape[0]], self.topk_weights[:x.shape[0]]
            else:
                idx, weights = self.router.route(k, stream, x, kind, source)
            if marks is not None:
                marks.mark("route")
            stages.small_batch_call(k, s, stream, chunk=plan.chunks[0], window=plan.windows[0], engine=self.engine,
                                    ack_policy=spec.ack_policy, x=x, topk_idx=idx, topk_weights=weights, y=y,
                                    num_chunks=plan.num_chunks, marks=marks, logits=logits, router=self.router.args,
                                    layer=spec.layer_id)
            return
        idx, weights = source if kind == "given" else self.router.route(k, stream, x, kind, source)
        row_bytes = spec.topk * 4
        for chunk in plan.chunks:
            stages.produce_route(k, s, stream, chunk=chunk, topk_idx_ptr=idx.data_ptr() + chunk.token_base * row_bytes,
                                 topk_weights_ptr=weights.data_ptr() + chunk.token_base * row_bytes,
                                 layer=spec.layer_id)
        if marks is not None:
            marks.mark("route")
        for chunk in plan.chunks:
            stages.produce_layout(k, s, stream, chunk=chunk, x=x)
        if marks is not None:
            marks.mark("layout")
        # One window over the call's chunks, or (a budgeted workspace) windows of its window's chunks in turn.
        for first, window in plan.windows.items():
            last = first == plan.last_window
            stages.consume_window(k, s, stream, window=window, engine=self.engine, ack_policy=spec.ack_policy,
                                  split_waits=False, topk_idx=idx, topk_weights=weights, y=y, layer=spec.layer_id,
                                  end_call_chunks=plan.num_chunks if last else 0, marks=marks if last else None)

    def _run_streamed(self, plan: Plan, x, kind: str, source, y, caller) -> None:
        """The streamed schedule: the plan's enqueue order on the producer and consumer streams (or the
        caller's stream alone), joined on the caller's stream, which then ends the call."""
        torch = torch_module()
        k, s, spec, hooks = self.kernels, self.state, self.spec, self.hooks
        if plan.two_streams:
            producer, consumer = self.memory.producer_stream, self.memory.consumer_stream
            # Fork: both streams start after the caller's earlier work (the previous call's end included).
            producer.wait_stream(caller)
            consumer.wait_stream(caller)
        else:
            producer = consumer = caller
        router = None if kind == "given" else self.router
        idx, weights = source if kind == "given" else (self.topk_idx, self.topk_weights)
        stamps = hooks is not None and hooks.timeline
        delays = hooks.producer_delay_ns if hooks is not None else {}
        consumer_delays = hooks.consumer_delay_ns if hooks is not None else {}
        self._timeline = (plan.num_chunks, {w.first: w.last for w in plan.windows.values()}) if stamps else (0, {})
        p_stream, c_stream = self.stream(producer.cuda_stream), self.stream(consumer.cuda_stream)
        # The local edges between the streams (plan.waits): a captured graph keeps them, so no executor can
        # run a window before this rank's own chunks of it, or a chunk before the acknowledgement of its slot.
        # EARLY acknowledges each chunk right after its pull, inside its window: the producer of the slot's
        # next use waits for that acknowledgement (its event, recorded by consume_window), not the whole window.
        early = spec.ack_policy == AckPolicy.EARLY
        done = {b: torch.cuda.Event() for b in plan.signals}
        acked = {c: torch.cuda.Event() for c in range(plan.num_chunks)} if early and plan.two_streams else None
        for entry in plan.order:
            item, first, _ = entry
            for before in plan.waits.get(entry, ()):
                if early and item == "produce" and before[0] == "consume":
                    producer.wait_event(acked[first - spec.num_slots])
                else:
                    (producer if item == "produce" else consumer).wait_event(done[before])
            if item == "produce":
                with torch.cuda.stream(producer):
                    stages.produce_chunk(k, s, p_stream, chunk=plan.chunks[first], x=x, router=router, kind=kind,
                                         source=source, topk_idx=idx, topk_weights=weights, layer=spec.layer_id,
                                         delay_ns=delays.get(first, 0), stamps=stamps)
            else:
                end_here = not plan.two_streams and first == plan.last_window
                with torch.cuda.stream(consumer):
                    stages.consume_window(k, s, c_stream, window=plan.windows[first], engine=self.engine,
                                          ack_policy=spec.ack_policy, split_waits=True, topk_idx=idx,
                                          topk_weights=weights, y=y, layer=spec.layer_id,
                                          end_call_chunks=plan.num_chunks if end_here else 0,
                                          delay_ns=consumer_delays.get(first, 0), stamps=stamps, acked=acked)
            if entry in done:
                done[entry].record(producer if item == "produce" else consumer)
        if plan.two_streams:
            caller.wait_stream(producer)  # join: every kernel that reads the generation base is done
            caller.wait_stream(consumer)
            # End of the call: generation base + num_chunks (device-resident: graph replays stay fresh).
            stages.end_call(k, s, self.stream(caller.cuda_stream), num_chunks=plan.num_chunks)

    # --- the cache of captured calls (symmring.moe.gpu.graph_cache) ---------------------------------------

    def _cached_call(self, plan: Plan, distinct: bool, x, kind: str, source):
        """``y`` of this call from its cached graph (captured first if this is the key's second call), or None
        when the call runs eagerly (nothing enqueued then)."""
        found = graph_cache_mod.call_key(plan, distinct, x, kind, source)
        if found is None:
            return None
        key, values = found
        action, entry = self.graphs.decide(key)
        if action == "eager":
            return None
        if action == "capture":
            torch = torch_module()
            torch.cuda.synchronize()  # the graphs evicted below have no replay in flight
            self.graphs.make_room()
            try:
                entry = self._capture_call(plan, x, kind, source)
            except Exception as exc:  # the call runs eagerly; the key's next call captures again, once
                then = "its next call captures again" if self.graphs.fail(key) else "calls of this shape run eagerly"
                logger.warning("MoE rank %d: capturing a call of counts %s for the graph cache failed (%s: %s); %s",
                               self.spec.rank, plan.counts, type(exc).__name__, exc, then)
                return None
            self.graphs.insert(key, entry)
        self.memory.begin_call(x.shape[0])  # before the copies: the previous replay may still read the static inputs
        y = entry.replay(values)
        self.memory.end_of_call()  # after the clone: the next call (any graph of the shared pool) comes after it
        return y

    def _capture_call(self, plan: Plan, x, kind: str, source) -> graph_cache_mod.CachedGraph:
        """Capture this call's kernels on static inputs (a side stream, the cache's memory pool; nothing runs)."""
        torch = torch_module()
        rows = plan.counts[self.spec.rank]  # the bucket: the graph serves any count up to it (the device reads it)
        with torch.inference_mode(False):  # normal tensors: later calls may copy into them outside inference mode
            inputs = [_rows_like(x, rows)]
            if kind == "given":
                inputs += [_rows_like(t, rows) for t in source]
            elif kind == "logits":
                inputs.append(_rows_like(source, rows))
        static_source = {"given": tuple(inputs[1:]), "logits": inputs[-1]}.get(kind, source)
        if self.memory.graph_pool is None:
            self.memory.graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        try:
            with capture_scope() as held, torch.cuda.graph(
                    graph, pool=self.memory.graph_pool, capture_error_mode=graph_cache_mod.CAPTURE_ERROR_MODE):
                y = torch.empty((rows, self.spec.hidden), dtype=torch.bfloat16, device=self.device)
                self.enqueue(plan, inputs[0], kind, static_source, y)
        finally:
            torch.cuda.set_stream(caller)  # a failed capture_end would leave the capture stream current
        return graph_cache_mod.CachedGraph(graph, inputs, y, held)

    def clear_graphs(self) -> None:
        """Drop every cached graph (synchronises first, so no replay of theirs is in flight)."""
        if len(self.graphs):
            torch_module().cuda.synchronize()
        self.graphs.clear()
        # torch releases a graph memory pool with its last graph; a capture into the released handle fails
        # (CUDACachingAllocator's use_count assertion), so the next capture makes a new pool.
        if self.epoch >= 0:
            self.memory.graph_pool = None

    # --- state, records, errors ---------------------------------------------------------------------------

    def timeline_records(self, relative: bool = True):
        """Device timestamps of the last streamed call with ``timeline`` (synchronises): see
        `symmring.moe.gpu.timeline.records` (``relative=False``: the device clock's values)."""
        num_chunks, windows = self._timeline
        if not num_chunks:
            return []
        stamps = self.state.stamps[: timeline.num_stamps(num_chunks)].cpu().numpy().astype(np.int64)
        return timeline.records(stamps, num_chunks, windows, relative)

    def memory_bytes(self) -> Dict[str, int]:
        """Device bytes this layer's calls use (`symmring.moe.gpu.MoE.memory`)."""
        s, memory = self.state, self.memory
        pool = sum(t.numel() * t.element_size() for t in (s.pool_x, s.pool_sf, s.m_indices, s.row_src, s.row_weight)
                   if t is not None)
        stage = 0 if self.binding.stage_alloc is None else self.binding.stage_alloc.nbytes
        return {"pool_bytes": pool, "heap_bytes": self.ring.alloc.nbytes + memory.combine_alloc.nbytes + stage
                + memory.experts_alloc.nbytes, "weight_bytes": self.engine.weights.nbytes}

    def slot_view(self, name: str, num_tokens: int, slot: int = 0):
        """Zero-copy CuPy view of this rank's ring slot ``slot``'s payload ``name``, its first ``num_tokens`` rows
        (`symmring.moe.gpu.GpuMoE.slot_view`)."""
        spec = self.spec
        if name not in ("x", "x_sf", "topk_idx", "topk_weights"):
            raise ConfigError(f"name={name!r}: expected one of 'x', 'x_sf', 'topk_idx', 'topk_weights'")
        slot = check_int("slot", slot, 0)
        if slot >= spec.num_slots:
            raise ConfigError(f"slot={slot}: expected < num_slots={spec.num_slots}")
        num_tokens = check_int("num_tokens", num_tokens, 0)
        if num_tokens > spec.tokens_per_slot:
            raise ConfigError(f"num_tokens={num_tokens}: expected at most tokens_per_slot={spec.tokens_per_slot}")
        region = self.ring.layout[name]
        return self.memory.backend.view(self.ring.alloc, spec.rank, region.slot_offset(slot), region.dtype,
                                        (num_tokens,) + tuple(region.slot_shape[1:]))

    def check_errors(self) -> None:
        """Synchronise; raise the device error records of this layer's ring and state
        (`symmring.moe.gpu.GpuMoE.check_errors`)."""
        spec = self.spec
        self.ring.kernels.check_errors(synchronize=True)
        state = self.state
        status = int(state.status.item())
        if status & stages.STATUS_BAD_EXPERT_ID:
            value, src, token, k = (int(v) for v in state.bad_id.tolist())
            state.status.fill_(status & ~stages.STATUS_BAD_EXPERT_ID)
            state.bad_id.zero_()
            torch_module().cuda.synchronize()
            raise ConfigError(f"topk_idx: expert id {value} of token {token} (k={k}) on rank {src} is outside "
                              f"[-1, num_experts={spec.num_experts}); that entry contributed nothing")
        skipped = _skipped_groups(state, spec.rank, spec.num_local_experts)
        if skipped is not None:
            raise skipped
        if status & stages.STATUS_NO_PEER_MAPPING:
            raise BackendError(f"rank {spec.rank}: a peer's ring slot was readable neither through a P2P mapping "
                               f"nor from the staging ring (transports {self.ring.transports}): an rdma peer "
                               "without a staging ring")
        self.engine.check_status()  # the expert kernels' own records (the fused engine's expired L2 waits)


__all__ = ["Executor"]
