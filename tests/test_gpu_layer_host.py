"""The GPU layer's host side on the CPU (issue 34): `GpuMoE` built and called with stand-ins for the device (the
workspace's `DeviceMemory`, the kernels, CUDA streams and events), so its construction (checks, engine, spec,
agreement, attach, bind), its calls (agreement, plan, executor, stages) and its test hooks run here; the GPU
tests (tests/gpu) run the same layer on the device. What it checks: the arguments the workspace memory is bound
with, the spec, the kernels a call launches, the hooks, and that nothing below the layer reaches back into it."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from symmring.errors import ConfigError  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402
from symmring.moe.gpu import stages  # noqa: E402
from symmring.moe.gpu import layer as layer_mod  # noqa: E402
from symmring.moe.gpu import memory as memory_mod  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402

E, H, I, K = 8, 256, 64, 2


class Stream:
    def __init__(self, handle=7):
        self.cuda_stream = handle

    def wait_event(self, event):
        pass

    def wait_stream(self, other):
        pass


class Event:
    def __init__(self, *args, **kwargs):
        self.recorded = 0

    def record(self, stream=None):
        self.recorded += 1


class Kernel:
    """A launcher that records its kernel's name (the arguments are built as on the device)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, grid, block, args, stream=None, shared_mem=0):
        self.log.append(self.name)


class Memory(memory_mod.DeviceMemory):
    """`DeviceMemory` without a device: every binding a `stages.State` of CPU tensors, the kernels recorders."""

    def __init__(self, workspace, plan):
        self.workspace, self.plan, self.backend = workspace, plan, None
        self.call_tokens, self._call_tokens_holds, self.call_done = torch.zeros(1, dtype=torch.int32), 0, None
        self.launched, self.bound = [], []
        names = [n for n in vars(stages.Kernels(_FakeModules())) if n not in ("spin_blocks", "launch")]
        self.kernels = types.SimpleNamespace(**{n: Kernel(n, self.launched) for n in names}, spin_blocks=66)
        self.kernels.launch = lambda fn, grid, block, args, *, stream, shared_mem=0: fn(grid, block, args)
        self.producer_stream, self.consumer_stream, self.graph_pool = Stream(8), Stream(9), None
        self._bindings, self.requests, self.closed = {}, [], False
        nbytes = types.SimpleNamespace(nbytes=0)
        self.combine_alloc = self.experts_alloc = nbytes

    def bind(self, shape, *, num_slots, tokens_per_slot, transport, timeout_s, align):
        key = (shape, num_slots, tokens_per_slot, str(transport), float(timeout_s))
        self.bound.append(dict(num_slots=num_slots, tokens_per_slot=tokens_per_slot, transport=transport,
                               timeout_s=timeout_s, align=align))
        self.requests.append((key, (shape, num_slots, tokens_per_slot, transport, timeout_s, align)))
        R = self.workspace.pool_rows(shape)
        i32 = dict(dtype=torch.int32)
        e = shape.num_experts // self.workspace.world_size
        state = stages.State(
            desc=np.uint64(0xD0), num_ranks=self.workspace.world_size, expert_begin=0, num_local_experts=e,
            tokens_per_slot=tokens_per_slot, topk=shape.topk, hidden=shape.hidden, fp8_layout=False, capacity=R,
            counts=torch.zeros(e, **i32), begin=torch.zeros(e, **i32), group_end=torch.zeros(e, **i32),
            cursor=torch.zeros(e, **i32), total=torch.zeros(1, **i32), status=torch.zeros(1, **i32),
            counters=torch.zeros(5, **i32), pool_x=torch.zeros((R, shape.hidden), dtype=torch.bfloat16), pool_sf=None,
            m_indices=None, align=align, bad_id=torch.zeros(4, **i32), row_src=torch.zeros((R, 4), **i32),
            row_weight=torch.zeros(R), token_base=torch.zeros((num_slots, 1), dtype=torch.int64), stage=None,
            outbound=None, combine_ready=np.uint64(0xA0), combine_rows=np.uint64(0xB0),
            stamps=torch.zeros(14 * 64, dtype=torch.int64), combine_tokens=self.workspace.max_tokens,
            entry_rows=torch.zeros((num_slots, 1, tokens_per_slot, shape.topk), **i32), call_tokens=self.call_tokens)
        latch = types.SimpleNamespace(enqueue=lambda stream, y=None: None, latched=lambda: None)
        entry = memory_mod.RingEntry(types.SimpleNamespace(alloc=types.SimpleNamespace(nbytes=0), transports=["self"]),
                                     None, None, None, latch)
        self._bindings[key] = memory_mod.Binding(entry, state, R, torch.zeros((64, shape.topk), **i32),
                                                 torch.zeros((64, shape.topk)))
        return key

    def rebind(self, requests):
        for _, (shape, num_slots, tokens_per_slot, transport, timeout_s, align) in requests:
            self.bind(shape, num_slots=num_slots, tokens_per_slot=tokens_per_slot, transport=transport,
                      timeout_s=timeout_s, align=align)

    def fits(self, plan):
        return True

    def close(self):
        self.closed = True

    def latched(self):
        return None


class _FakeModules:
    """What `stages.Kernels` asks of a backend, to learn the names of the layer's kernels."""

    num_sms, compute_capability = 132, 90

    def library_module(self, name):
        return types.SimpleNamespace(function=lambda kernel: kernel)


@pytest.fixture
def fake_device(monkeypatch):
    """The CUDA pieces the layer touches, on the CPU."""
    stream = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(layer_mod, "this_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(layer_mod, "DeviceBackend", object)  # the context's backend passes as a device backend
    from symmring.backends import base
    monkeypatch.setattr(base, "DeviceBackend", types.SimpleNamespace)  # ... and the workspace takes it for one
    monkeypatch.setattr(memory_mod, "DeviceMemory", Memory)
    monkeypatch.setattr("symmring.moe.gpu.executor.Executor.stream", lambda self, handle: handle)
    exchanged = []
    collectives = types.SimpleNamespace(allgather=lambda value, **kw: exchanged.append(kw["what"]) or [value])
    backend = types.SimpleNamespace(name="fake-device", barrier=lambda: None, collectives=collectives)
    ctx = types.SimpleNamespace(rank=0, world_size=1, timeout_s=9.0, backend=backend, collectives=collectives,
                                check_open=lambda: None, closed=False)
    ctx.workspace = lambda collective=False: Workspace(ctx, max_tokens=64)
    return ctx, exchanged


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) / 8).bfloat16() for shape in ((E, I, H), (E, I, H), (E, H, I))]


def test_construction_binds_what_the_schedule_says(fake_device):
    ctx, exchanged = fake_device
    ws = Workspace(ctx, max_tokens=64)
    moe = layer_mod.GpuMoE(ctx, Experts(*weights()), RoutingConfig(E, K), max_tokens=64, engine="torch",
                           workspace=ws, schedule=ScheduleConfig(x_format="bf16", num_slots=2, tokens_per_slot=32,
                                                                 transport="p2p", timeout_s=4.0))
    spec = moe.spec
    assert (spec.num_slots, spec.tokens_per_slot, spec.x_format, spec.expert_dtype, spec.layer_id) == \
        (2, 32, "bf16", "bf16", 0)
    # The memory is bound with the schedule's own transport request (the ring parses it), not the agreed string.
    assert ws.gpu.bound == [dict(num_slots=2, tokens_per_slot=32, transport="p2p", timeout_s=4.0, align=1)]
    assert spec.transport_request == "('p2p', 'transport=')" and exchanged == ["MoE: agreement"]
    assert (moe.num_slots, moe.hidden, moe.layer_id, moe.capacity) == (2, H, 0, ws.pool_rows(moe.layer_shape))
    assert ws.next_layer_id == 1  # taken once agreed
    with pytest.raises(ConfigError, match=r"x_format \(a field of ScheduleConfig"):
        layer_mod.GpuMoE(ctx, Experts(*weights()), RoutingConfig(E, K), max_tokens=64, x_format="bf16")
    # A window past the ring's slots shows only once the ring is resolved (one slot of 32 tokens here).
    with pytest.raises(ConfigError, match="expert_window=3: expected 1 <= expert_window <= num_slots=1"):
        layer_mod.GpuMoE(ctx, Experts(*weights()), RoutingConfig(E, K), max_tokens=64, engine="torch", workspace=ws,
                         schedule=ScheduleConfig(x_format="bf16", tokens_per_slot=32, expert_window=3))
    assert ws.next_layer_id == 1 and exchanged == ["MoE: agreement"] * 2  # refused in its exchange; no id taken


def test_calls_run_down_the_layers_parts(fake_device):
    ctx, exchanged = fake_device
    ws = Workspace(ctx, max_tokens=64)
    moe = layer_mod.GpuMoE(ctx, Experts(*weights()), RoutingConfig(E, K), max_tokens=64, engine="torch",
                           workspace=ws, schedule=ScheduleConfig(x_format="bf16", num_slots=2, tokens_per_slot=32,
                                                                 expert_window=2, ack_policy="early"))
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(50, H, generator=g).bfloat16(), torch.randn(50, E, generator=g)
    launched = ws.gpu.launched
    y = moe.forward(x, logits=logits, graph_cache=False)
    assert y.shape == (50, H) and not moe.last_plan.streaming and ws.calls == 1
    assert launched.count("produce_route") == 2 and launched.count("combine_reduce") == 1
    launched.clear()
    y = moe.forward(x, logits=logits, streaming=True)  # two chunks, one window of both, EARLY acks
    assert moe.last_plan.streaming and launched.count("wait_slot") == 2 and launched.count("ack") == 2
    assert launched.count("route_topk") == 2 and launched[-1] == "end_call"  # each chunk routed on the producer
    # Hooks go through layer.debug; the timeline's stamps and delays are kernels of the call.
    launched.clear()
    moe.debug.forward(x, logits=logits, streaming=True, timeline=True, consumer_delay_ns={0: 5})
    assert launched.count("stamp") == 2 * (3 * 2 + 4) and launched.count("sleep") == 1
    assert moe.executor.hooks is None and moe.debug.timeline_records() != []
    events = []
    moe.debug.forward(x, logits=logits, stage_events=events)
    assert [name for name, _ in events] == ["start", "route", "layout", "dispatch", "experts", "combine"]
    with pytest.raises(ConfigError, match=r"timeline \(a test hook: layer.debug.forward"):
        moe.forward(x, logits=logits, streaming=True, timeline=True)
    assert ws.calls == 4 and exchanged.count("MoE.forward: token counts") == 0  # one rank: no exchange


def test_moved_memory_reaches_the_layer_at_its_next_call(fake_device):
    """Growth through the epoch alone: a larger layer built later makes the memory anew; the first layer's next
    call takes views of the new memory (its plans and graphs dropped) without the workspace calling it."""
    ctx, _ = fake_device
    ws = Workspace(ctx, max_tokens=64)
    first = layer_mod.GpuMoE(ctx, Experts(*weights()), RoutingConfig(E, K), max_tokens=64, engine="torch",
                             workspace=ws, schedule=ScheduleConfig(x_format="bf16"))
    old_memory, old_state = ws.gpu, first.executor.state
    first.executor.graphs.insert("key", "a graph of the old memory")
    ws.gpu.fits = lambda plan: False  # the next layer does not fit: the workspace makes its memory anew
    layer_mod.GpuMoE(ctx, Experts(*weights()), RoutingConfig(E, K), max_tokens=128, engine="torch", workspace=ws,
                     schedule=ScheduleConfig(x_format="bf16"))
    assert ws.gpu is not old_memory and first.executor.state is old_state  # nothing reached the first layer
    first.forward(torch.zeros(3, H).bfloat16(), logits=torch.zeros(3, E))
    assert first.executor.state is not old_state and first.executor.memory is ws.gpu
    assert len(first.executor.graphs) == 0 and first.planner.capacity == first.executor.capacity


def test_check_errors_ends_with_the_expert_engines_own_records(fake_device):
    """The layer's device check asks the expert engine last (the fused kernel records expired L2 waits in a
    status word of its own): what the engine raises reaches the caller, and nothing recorded raises nothing."""
    from symmring.errors import BackendError
    ctx, _ = fake_device
    ws = Workspace(ctx, max_tokens=64)
    moe = layer_mod.GpuMoE(ctx, Experts(*weights()), RoutingConfig(E, K), max_tokens=64, engine="torch",
                           workspace=ws, schedule=ScheduleConfig(x_format="bf16"))
    moe.forward(torch.zeros(3, H).bfloat16(), logits=torch.zeros(3, E))
    moe.executor.ring.kernels = types.SimpleNamespace(check_errors=lambda synchronize: None)
    recorded = []

    def check_status():
        if recorded:
            raise BackendError(recorded.pop())

    moe.executor.engine.check_status = check_status
    moe.check_errors()  # nothing recorded
    recorded.append("engine 'fused': 1 L2 tile(s) waited past 9 s")
    with pytest.raises(BackendError, match="L2 tile"):
        moe.check_errors()
    moe.check_errors()


def test_captured_call_sets_the_count_first_only_for_a_steps_graph():
    # A graph captured outside a step writes its own token count: its replay enqueues no fill before it (one kernel
    # and one host launch less per decode call). A step's graph reads the count the replay sets first.
    from symmring.moe.gpu.layer import CapturedCall
    seen = []

    class Workspace:
        def replay(self, graph, num_tokens=None):
            seen.append((graph, num_tokens))

    class Layer:
        workspace = Workspace()

        def _check_closed(self):
            seen.append("checked")

    CapturedCall(Layer(), "own", 7, own_count=True).replay()
    CapturedCall(Layer(), "step's", 7).replay()
    assert seen == ["checked", ("own", None), "checked", ("step's", 7)]
