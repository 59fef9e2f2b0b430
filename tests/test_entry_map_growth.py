"""The GPU workspace's entry map growing for a later layer's larger ring (`symmring.moe.gpu.memory.DeviceMemory`),
on the CPU with stand-ins: the old map is freed only after the workspace synchronised (`Workspace.release_memory`),
the bindings' views move to the new map, and the epoch moves on: the one signal of moved memory, which each
layer's executor reads before every call (it then drops its cached graphs and its planner its plans; a graph of
`MoE.capture` refuses to replay). tests/gpu/test_moe_bounds.py runs it with queued calls and captured graphs on
the GPU."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from symmring.moe.gpu import memory as memory_mod  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402
from symmring.moe.workspace_plan import entry_words  # noqa: E402


def _memory(log, world=2, slots=1, tokens=8, topk=2):
    workspace = types.SimpleNamespace(world_size=world, epoch=3, release_memory=lambda: log.append("release"))
    mem = object.__new__(memory_mod.DeviceMemory)
    mem.workspace, mem.device = workspace, torch.device("cpu")
    mem.entry_rows = torch.zeros(entry_words(slots, world, tokens, topk), dtype=torch.int32)
    state = types.SimpleNamespace(entry_rows=mem.entry_rows.view(slots, world, tokens, topk))
    mem._bindings = {"first": types.SimpleNamespace(state=state)}
    return mem, state


def test_a_larger_ring_grows_the_map_after_releasing_its_users():
    log = []
    mem, state = _memory(log)
    old = mem.entry_rows
    same = mem._entry_rows(1, 8, 2)  # the plan's ring: a view of the map as it is, nothing released
    assert same.data_ptr() == old.data_ptr() and log == [] and mem.workspace.epoch == 3
    grown = mem._entry_rows(4, 8, 2)  # a layer's own, larger ring
    assert log == ["release"] and mem.workspace.epoch == 4
    assert tuple(grown.shape) == (4, 2, 8, 2) and grown.data_ptr() == mem.entry_rows.data_ptr() != old.data_ptr()
    assert state.entry_rows.data_ptr() == mem.entry_rows.data_ptr() and tuple(state.entry_rows.shape) == (1, 2, 8, 2)
    mem._entry_rows(2, 8, 2)  # fits the grown map: nothing moves
    assert log == ["release"] and mem.workspace.epoch == 4


def test_release_memory_synchronises_and_calls_no_layer(monkeypatch):
    """Issue 34: the workspace tells no layer (nothing below a layer calls back up into it); it synchronises, and
    the epoch its caller moves on is what the layers read."""
    log = []
    ws = object.__new__(Workspace)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    ws.release_memory()
    assert log == ["sync"] and not hasattr(ws, "_layers")


def _binding(tag):
    state = types.SimpleNamespace(tag=tag)
    return types.SimpleNamespace(state=state, ring=f"ring {tag}", latch=f"latch {tag}", capacity=64 * tag,
                                 topk_idx=None, topk_weights=None, stage_alloc=None)


def test_a_layer_follows_moved_memory_at_its_next_call(monkeypatch):
    """The executor's views follow the workspace's epoch: the same epoch, nothing happens (one comparison per
    call); a moved one drops the cached graphs (after a synchronisation: none is in flight), resets the shared
    graph pool and looks the binding up again; the planner drops the plans made for the old pool."""
    from symmring.moe.gpu.executor import Executor
    from symmring.moe.gpu.plan import Planner
    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    memory = types.SimpleNamespace(bindings={"key": _binding(1)}, kernels="kernels", graph_pool="pool")
    ws = types.SimpleNamespace(epoch=1, gpu=memory)
    spec = types.SimpleNamespace(graph_cache=4)
    executor = Executor(spec, ws, "key", engine=None, router=None, device=torch.device("cpu"))
    planner = Planner(spec)
    assert executor.follow_memory() and executor.state.tag == 1 and executor.capacity == 64
    executor.graphs.insert("call", "graph")
    planner.follow(executor.capacity)
    planner._plans["plan"] = "made for 64 rows"
    assert not executor.follow_memory() and len(executor.graphs) == 1 and log == []
    ws.epoch, ws.gpu = 2, types.SimpleNamespace(bindings={"key": _binding(2)}, kernels="new kernels", graph_pool=None)
    assert executor.follow_memory()
    planner.follow(executor.capacity)
    assert log == ["sync"] and len(executor.graphs) == 0 and memory.graph_pool is None
    assert (executor.state.tag, executor.ring, executor.kernels, executor.capacity) == (2, "ring 2", "new kernels", 128)
    assert planner.capacity == 128 and not planner._plans
