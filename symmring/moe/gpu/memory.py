"""The GPU share of a `symmring.Workspace`: the memory every `symmring.moe.gpu.MoE` of a process borrows.

`DeviceMemory` allocates the workspace's regions once (`symmring.moe.workspace_plan`): the combine buffer and
the experts' region (pool rows, L1 output, activations and L2 output rows, placed by lifetime:
`symmring.moe.workspace_plan.expert_arena`) in the symmetric heap, the pool rows' sources, weights and group
ids and the window's entry map as flat device buffers, the owner's routing rows, the call's token count, the
call counter every ring's call identities come from (`symmring.protocol.call_identity`: advanced once per call
of any layer, so ranks whose call sequences diverged are told apart on the device), and the streams, the graph
memory pool and the end-of-call event that every layer's calls share (calls of all layers are ordered one
after another on it). `DeviceMemory.bind`
gives a layer shape its view of them: a ring (one per distinct ring spec and transport request: layers
of one shape share it and its generations keep growing across their calls), its staging ring for rdma
peers, and a `symmring.moe.gpu.stages.State` over the shared bytes sized for that shape.

Layers of different shapes read the same bytes with their own row sizes (``pool_rows`` per shape: the
plan sizes every region for the largest); a pass writes every row it reads before reading it. What must
stay clean between calls lives apart: the fp8 rows' group ids (`m_indices`, one -1 filled array every
fp8 shape views; the combine scatter puts each row it sends back to -1), each binding's counters and each
ring's combine ready words (their generations only grow).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Dict, Optional, Tuple

import numpy as np

from ...errors import ConfigError
from ...layout import ALIGN, RingLayout, RingSpec, align_up
from ..engines.triton_common import BAD_GROUP_WORDS
from ..workspace_plan import LayerShape, WorkspacePlan, entry_words, expert_arena, group_id_rows, pool_meta_bytes
from . import stages, timeline



def _torch():
    import torch
    return torch


def _cupy():
    import cupy
    return cupy


def view(path: str, doc: str = "", writable: bool = False) -> property:
    """A property reading ``self.<path>`` (a dotted path), looked up on every use (and, ``writable``, setting
    it): how a `Binding` and a layer reach the parts of the workspace memory they view."""
    owner, name = path.rsplit(".", 1)
    get_owner = operator.attrgetter(owner)

    def set_value(self, value) -> None:
        setattr(get_owner(self), name, value)
    return property(operator.attrgetter(path), set_value if writable else None, doc=doc or f"``self.{path}``")


@dataclasses.dataclass
class RingEntry:
    """One ring of the workspace and what goes with it: the staging ring of rdma sources (or None) and its
    device descriptor, the combine ready words of this ring's calls, and its async-error latch."""

    ring: object
    stage_alloc: object
    stage_desc: object
    ready_alloc: object
    latch: object


@dataclasses.dataclass
class Binding:
    """One layer shape's view of the workspace: its ring entry, state, pool rows and routing rows."""

    entry: RingEntry
    state: stages.State
    capacity: int
    topk_idx: object
    topk_weights: object

    ring = view("entry.ring")
    stage_alloc = view("entry.stage_alloc")
    latch = view("entry.latch")


class DeviceMemory:
    """The regions of a GPU workspace (module docstring). Collective constructor (`Workspace.attach`)."""

    def __init__(self, workspace, plan: WorkspacePlan):
        torch = _torch()
        self.workspace, self.plan = workspace, plan
        backend = workspace.ctx.backend
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device())
        r = plan.regions
        world = workspace.world_size
        # Symmetric: the combine rows ([max_tokens][K][H] bf16 by logical token) and the experts' region (its
        # L2 output rows are what the combine sends, and rdma puts read them where they are). Each ring has its
        # own combine ready words (`_ring`): their generations are that ring's.
        self.combine_alloc = backend.alloc(max(r["combine"], 16))
        self.experts_alloc = backend.alloc(max(r["experts"], 16))
        # Local: the pool rows' sources and weights, the fp8 rows' group ids apart (those stay -1 between calls,
        # whatever another shape's rows do to the experts' bytes), the window's entry -> row map and the owner's
        # routing rows.
        group_rows = group_id_rows(plan.shapes, plan.pool_rows)
        self.row_bytes = torch.empty(max(pool_meta_bytes(plan.shapes, plan.pool_rows) - 4 * group_rows, 16),
                                     dtype=torch.uint8, device=self.device)
        self.m_indices = torch.full((max(group_rows, 1),), -1, dtype=torch.int32, device=self.device)
        self.entry_rows = torch.empty(max(entry_words(plan.num_slots, world, plan.tokens_per_slot, s.topk)
                                          for s in plan.shapes), dtype=torch.int32, device=self.device)
        self.routing_bytes = torch.empty(max(r["routing"], 16), dtype=torch.uint8, device=self.device)
        # This rank's token count of the current call (every layer's kernels clamp their bucket's bounds to it).
        self.call_tokens = torch.zeros(1, dtype=torch.int32, device=self.device)
        # This PE's call number (uint64; every ring's descriptor points at it: RingDescriptor::call_ptr), advanced
        # by each call's end-of-call kernel and by a call refused inside a step; zeroed by `reset`.
        self.call_number = torch.zeros(1, dtype=torch.int64, device=self.device)
        # What that word holds while only `begin_call` writes it (every layer of a decode step sets the same count:
        # one fill per step, not per layer); None once a captured graph writes it too (`record_call_tokens`).
        self._call_tokens_holds: Optional[int] = 0
        self.producer_stream = torch.cuda.Stream(device=self.device)
        self.consumer_stream = torch.cuda.Stream(device=self.device)
        self.graph_pool = None  # the torch graph memory pool every layer's cached graphs share
        self.call_done = None  # torch.cuda.Event after the last call's end (any layer's)
        self.kernels = stages.Kernels(backend)
        self._rings: Dict[Tuple, RingEntry] = {}  # (spec, transport, timeout) -> its ring and what goes with it
        self._bindings: Dict[Tuple, Binding] = {}
        self.requests = []  # (key, bind arguments) in the order layers bound (`rebind` after the workspace grew)
        self.closed = False

    def fits(self, plan: WorkspacePlan) -> bool:
        """Whether this memory holds every region of ``plan`` (a layer that fits attaches without a move)."""
        r = plan.regions
        group_rows = group_id_rows(plan.shapes, plan.pool_rows)
        words = max(entry_words(plan.num_slots, self.workspace.world_size, plan.tokens_per_slot, s.topk)
                    for s in plan.shapes)
        return (r["combine"] <= self.combine_alloc.nbytes and r["experts"] <= self.experts_alloc.nbytes
                and pool_meta_bytes(plan.shapes, plan.pool_rows) - 4 * group_rows <= self.row_bytes.numel()
                and group_rows <= self.m_indices.numel()
                and r["routing"] <= self.routing_bytes.numel() and words <= self.entry_rows.numel())

    # --- binding a layer ----------------------------------------------------------------------------------

    def bind(self, shape: LayerShape, *, num_slots: int, tokens_per_slot: int, transport, timeout_s: float,
             align: int) -> Tuple:
        """Make the view of a layer of ``shape`` with a ring of ``num_slots`` x ``tokens_per_slot`` and return its
        key (`bindings`). Collective on first use of a ring spec (every rank's layer asks for the same)."""
        key = (shape, num_slots, tokens_per_slot, str(transport), float(timeout_s))
        if key not in self._bindings:
            self._bindings[key] = self._make_binding(shape, num_slots, tokens_per_slot, transport, timeout_s, align)
            self.requests.append((key, (shape, num_slots, tokens_per_slot, transport, timeout_s, align)))
        return key

    def rebind(self, requests) -> None:
        """Make the views an earlier `DeviceMemory` of this workspace had, in the same order (collective: a
        workspace grows inside a layer's constructor, on every rank alike)."""
        for key, (shape, num_slots, tokens_per_slot, transport, timeout_s, align) in requests:
            self._bindings[key] = self._make_binding(shape, num_slots, tokens_per_slot, transport, timeout_s, align)
            self.requests.append((key, (shape, num_slots, tokens_per_slot, transport, timeout_s, align)))

    @property
    def bindings(self) -> Dict[Tuple, Binding]:
        return self._bindings

    def _entry_rows(self, num_slots: int, tokens_per_slot: int, topk: int):
        """The entry map's view ``[num_slots, ranks, tokens_per_slot, topk]`` for a ring of that shape; a ring
        larger than the plan's (a layer's own schedule) grows the map. Growing frees the old map, which queued
        calls and the captured graphs of windows with passes address: the workspace first synchronises and
        drops the layers' graphs (`Workspace.release_memory`), then the views of the bindings so far move to
        the new map and the epoch moves on (graphs of `MoE.capture` refuse to replay), as when the workspace
        makes its memory anew."""
        world = self.workspace.world_size
        words = entry_words(num_slots, world, tokens_per_slot, topk)
        if words > self.entry_rows.numel():
            self.workspace.release_memory()
            self.entry_rows = _torch().empty(words, dtype=_torch().int32, device=self.device)
            for b in self._bindings.values():
                s = b.state
                s.entry_rows = self.entry_rows[: s.entry_rows.numel()].view(s.entry_rows.shape)
            self.workspace.epoch += 1
        return self.entry_rows[:words].view(num_slots, world, tokens_per_slot, topk)

    def _make_binding(self, shape: LayerShape, num_slots: int, tokens_per_slot: int, transport, timeout_s: float,
                      align: int) -> Binding:
        torch = _torch()
        pool_rows = self.workspace.pool_rows(shape)
        entry = self._ring(shape.ring_spec(num_slots, tokens_per_slot), transport, timeout_s)
        ring, stage_desc, ready_alloc = entry.ring, entry.stage_desc, entry.ready_alloc
        world, rank = self.workspace.world_size, self.workspace.rank
        E, K, H = max(1, shape.num_experts // world), shape.topk, shape.hidden
        R = pool_rows
        fp8_pool = shape.expert_format == "fp8"
        i32 = dict(dtype=torch.int32, device=self.device)
        # The experts' region, shared by every shape (every pass writes the rows it uses before reading them):
        # pool rows, their scales, L1 output, activations and L2 output rows where `expert_arena` puts them.
        # The rows' sources and weights live through the combine: carved from their own bytes.
        arena = _Arena(self.backend, self.experts_alloc, rank, expert_arena(shape, R))
        pool_x = arena.take("pool_x", (R, H), torch.float8_e4m3fn if fp8_pool else torch.bfloat16)
        pool_sf = arena.take("pool_sf", (stages.pool_scale_words(R, H),), torch.float32) if fp8_pool else None
        out_rows = arena.take("out", (R, H), torch.bfloat16)
        scratch = None
        if fp8_pool:
            from ..engines import Scratch
            scratch = Scratch(h=arena.take("h", (R, 2 * shape.inter), torch.bfloat16),
                              act=arena.take("act", (R, shape.inter), torch.float8_e4m3fn))
        carve = _Carver(self.row_bytes)
        row_src = carve.take((R, 4), torch.int32)
        row_weight = carve.take((R,), torch.float32)
        if fp8_pool and R > self.m_indices.numel():
            raise ConfigError(f"workspace: {R} pool rows of {shape} exceed its {self.m_indices.numel()} group ids "
                              "(the plan sized them for other shapes)")
        m_indices = self.m_indices[:R] if fp8_pool else None
        entry_rows = self._entry_rows(num_slots, tokens_per_slot, K)
        routing = _Carver(self.routing_bytes)
        max_tokens = self.workspace.max_tokens
        topk_idx = routing.take((max_tokens, K), torch.int32)
        topk_weights = routing.take((max_tokens, K), torch.float32)
        max_chunks = -(-max_tokens // tokens_per_slot)
        state = stages.State(
            desc=ring.kernels.desc, num_ranks=world, expert_begin=rank * E, num_local_experts=E,
            tokens_per_slot=tokens_per_slot, topk=K, hidden=H, fp8_layout=shape.x_format == "fp8_e4m3",
            capacity=R, counts=torch.zeros(E, **i32), begin=torch.zeros(E, **i32), group_end=torch.zeros(E, **i32),
            cursor=torch.zeros(E, **i32), total=torch.zeros(1, **i32), status=torch.zeros(1, **i32),
            counters=torch.zeros(stages.NUM_COUNTERS, **i32), pool_x=pool_x, pool_sf=pool_sf, m_indices=m_indices,
            align=align, bad_id=torch.zeros(stages.BAD_ID_WORDS, **i32), row_src=row_src, row_weight=row_weight,
            token_base=torch.zeros((max(num_slots, 1), world), dtype=torch.int64, device=self.device),
            stage=stage_desc, outbound=out_rows if stage_desc is not None else None,
            combine_ready=np.uint64(self.backend.address(ready_alloc, rank, 0)),
            combine_rows=np.uint64(self.backend.address(self.combine_alloc, rank, 0)),
            stamps=torch.zeros(timeline.num_stamps(max_chunks), dtype=torch.int64, device=self.device),
            combine_tokens=max_tokens, bad_groups=torch.zeros(BAD_GROUP_WORDS, **i32) if fp8_pool else None,
            entry_rows=entry_rows, out_rows=out_rows, pass_group_end=torch.zeros(E, **i32), scratch=scratch,
            call_tokens=self.call_tokens, send_peers=None if stage_desc is not None else torch.tensor(
                [self.backend.address(self.combine_alloc, q, 0) for q in range(world)], dtype=torch.int64,
                device=self.device))
        return Binding(entry=entry, state=state, capacity=R, topk_idx=topk_idx, topk_weights=topk_weights)

    def _ring(self, spec: RingSpec, transport, timeout_s: float):
        # The bound of every device wait lives in the ring's descriptor: layers with another timeout get a ring
        # of their own.
        key = (spec, str(transport), float(timeout_s))
        found = self._rings.get(key)
        if found is not None:
            return found
        from ... import transport as transport_mod
        from ...kernels import DeviceRing
        ring = DeviceRing(self.backend, spec, timeout_s=timeout_s, transport=transport,
                          call_address=self.call_number.data_ptr())
        # rdma sources are read from a staging ring of one slot per source rank (symmetric: a get's local
        # buffer must be on every NVSHMEM transport), so every PE allocates it when any PE has an rdma peer.
        any_rdma = transport_mod.RDMA in ring.transports
        wanted = self.workspace.ctx.collectives.allgather(any_rdma, what="Workspace: transports")
        stage_alloc, stage_desc = None, None
        if any(wanted):
            layout = RingLayout(dataclasses.replace(spec, num_slots=self.workspace.world_size),
                                self.workspace.world_size)
            stage_alloc = self.backend.alloc(layout.nbytes)
            if any_rdma:  # only the payload regions are used: slot r holds source rank r's staged chunk
                stage_desc = _cupy().asarray(np.frombuffer(
                    layout.descriptor(stage_alloc.ptr, rank=self.workspace.rank).tobytes(), dtype=np.uint8))
        # The combine ready words of this ring's calls (one per source rank, zero-filled): a SET of the chunk's
        # generation, which only grows on this ring, so no other ring's signal can satisfy its waits.
        ready_alloc = self.backend.alloc(align_up(self.workspace.world_size * 8, ALIGN))
        from ...kernels import AsyncErrorLatch
        self._rings[key] = RingEntry(ring, stage_alloc, stage_desc, ready_alloc,
                                     AsyncErrorLatch(ring.kernels))  # device errors, seen without a sync
        return self._rings[key]

    def after_last_call(self) -> None:
        """Order what the current torch stream does next after the end of the last call of any layer
        (`call_done`: its generation base and call number advance), whatever stream that call was issued on."""
        if self.call_done is not None:
            _torch().cuda.current_stream().wait_event(self.call_done)

    def end_of_call(self) -> None:
        """Mark the end of a call (or replay) on the current torch stream: the next one waits for it
        (`after_last_call`). One event, re-recorded: a wait already enqueued keeps the record it saw."""
        if self.call_done is None:
            self.call_done = _torch().cuda.Event()
        self.call_done.record()

    def begin_call(self, num_tokens: int) -> None:
        """Order the next call (or replay) after the end of the last call of any layer (`after_last_call`), so no
        call publishes a stale generation or call number; then set its token count on the device (a call's
        producers and its reduce read one count). On the current torch stream."""
        self.after_last_call()
        if num_tokens != self._call_tokens_holds:  # a fill is a kernel on the call's critical path: skip a no-op
            self.call_tokens.fill_(num_tokens)
            if self._call_tokens_holds is not None:
                self._call_tokens_holds = num_tokens

    def record_call_tokens(self, num_tokens: int) -> None:
        """Write the count into the graph being captured (a graph captured outside a step replays its own count).
        Its replays write the word behind `begin_call`'s back, so from now on every call fills it."""
        self._call_tokens_holds = None
        self.call_tokens.fill_(num_tokens)

    def set_call_tokens(self, num_tokens: int) -> None:
        """`Workspace.set_call_tokens`: while the current stream captures a graph, the count written into the graph
        (`record_call_tokens`); else the next call's count (`begin_call`)."""
        if _torch().cuda.is_current_stream_capturing():
            self.record_call_tokens(num_tokens)
        else:
            self.begin_call(num_tokens)

    def rings(self):
        """Every `RingEntry` of this memory."""
        return list(self._rings.values())

    def latched(self):
        """The first latched device error words of this PE's rings (`AsyncErrorLatch.latched`), or None."""
        for e in self._rings.values():
            words = e.latch.latched()
            if words is not None:
                return words
        return None

    def decode_latched(self, words):
        """The named error of latched ``words`` of this PE (`latched`; exchanged, so perhaps older than the latch
        now holds): decoded by the ring whose latch holds them, else by any (only its timeout is named)."""
        entries = list(self._rings.values())
        entry = next((e for e in entries if e.latch.latched() == list(words)), entries[0])
        return entry.latch.error_of(words)

    def latched_error(self):
        """This PE's first latched device error as the named exception (not raised), or None: host memory only."""
        words = self.latched()
        return None if words is None else self.decode_latched(words)

    # --- accounting, reset, teardown ----------------------------------------------------------------------

    def memory(self) -> Dict[str, int]:
        """Bytes by region (the plan's ``scratch``: the engines' transient tensors, which torch allocates)."""
        entries = self._rings.values()
        return {"ring": sum(e.ring.alloc.nbytes + e.ready_alloc.nbytes for e in entries),
                "staging": sum(e.stage_alloc.nbytes for e in entries if e.stage_alloc is not None),
                "combine": self.combine_alloc.nbytes, "experts": self.experts_alloc.nbytes,
                "scratch": self.plan.regions["scratch"],
                "dispatch": self.entry_rows.numel() * 4 + self.row_bytes.numel() + 4 * self.m_indices.numel()
                + sum(_dispatch_bytes(b.state) for b in self._bindings.values()),
                "routing": self.routing_bytes.numel()}

    def reset(self) -> None:
        """Collective: clear every ring, the combine buffer, every binding's error state and pool marks, and the
        async-error latches (the one recovery path of every layer on the workspace)."""
        torch = _torch()
        cupy = _cupy()
        for e in self._rings.values():
            e.ring.reset()  # its generation base restarts at 0: so do its combine ready words
        stream = torch.cuda.current_stream().cuda_stream
        for e in self._rings.values():
            cupy.cuda.runtime.memsetAsync(e.ready_alloc.ptr, 0, e.ready_alloc.nbytes, stream)
        for b in self._bindings.values():
            s = b.state
            s.counters.zero_()
            s.status.zero_()
            s.bad_id.zero_()
            if s.bad_groups is not None:
                s.bad_groups.zero_()
        self.m_indices.fill_(-1)  # a window cut short by a timeout leaves rows marked
        self.call_number.zero_()  # every PE's calls count from 0 again
        # The same stream as the fills above (torch's current one); the barrier synchronises the device.
        cupy.cuda.runtime.memsetAsync(self.combine_alloc.ptr, 0, self.combine_alloc.nbytes, stream)
        self.call_done = None
        self.backend.barrier()
        for e in self._rings.values():
            e.latch.clear()  # every device idle (the barrier synchronised): no latch kernel can still run

    def close(self) -> None:
        """Collective, idempotent: free the symmetric allocations and the rings."""
        if self.closed:
            return
        self.closed = True
        for e in self._rings.values():
            e.latch.close()
            if e.stage_alloc is not None:
                self.backend.free(e.stage_alloc)
            self.backend.free(e.ready_alloc)
            e.ring.close()
        self._rings.clear()
        self._bindings.clear()
        self.backend.free(self.experts_alloc)
        self.backend.free(self.combine_alloc)


def _dispatch_bytes(s: stages.State) -> int:
    return sum(t.numel() * t.element_size() for t in (s.counts, s.begin, s.group_end, s.cursor, s.total, s.status,
                                                     s.counters, s.bad_id, s.token_base, s.stamps, s.pass_group_end,
                                                     s.bad_groups) if t is not None)


class _Arena:
    """Typed views of the parts of the experts' region (`expert_arena`: ``{part: (offset, bytes)}``)."""

    def __init__(self, backend, alloc, rank: int, parts):
        self.backend, self.alloc, self.rank, self.parts = backend, alloc, rank, parts
        if parts["total"][1] > alloc.nbytes:
            raise ConfigError(f"workspace: the experts' region of {parts['total'][1]} bytes does not fit its "
                              f"{alloc.nbytes} bytes (the plan sized it for other shapes)")

    def take(self, part: str, shape, dtype):
        offset, nbytes = self.parts[part]
        size = int(np.prod(shape)) * _torch().empty((), dtype=dtype).element_size()
        assert size <= max(nbytes, 1), part
        flat = self.backend.torch_view(self.alloc, self.rank, offset, np.uint8, (max(nbytes, 1),))
        return flat[:size].view(dtype).view(shape)


class _Carver:
    """Consecutive 128-byte aligned typed views of one flat uint8 tensor."""

    def __init__(self, flat):
        self.flat, self.offset = flat, 0

    def take(self, shape, dtype):
        torch = _torch()
        count = int(np.prod(shape))
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        begin = align_up(self.offset, ALIGN)
        if begin + nbytes > self.flat.numel():
            from ...errors import ConfigError
            raise ConfigError(f"workspace: a region of {nbytes} bytes at {begin} does not fit its {self.flat.numel()} "
                              "bytes (the plan sized it for other shapes)")
        self.offset = begin + nbytes
        return self.flat[begin:begin + nbytes].view(dtype).view(shape)
