"""The GPU workspace's entry map growing for a later layer's larger ring (`symmring.moe.gpu.memory.DeviceMemory`),
on the CPU with stand-ins: the old map is freed only after the workspace synchronised and dropped what addressed
it (the layers' cached graphs and plans: `Workspace.release_memory`), the bindings' views move to the new map,
and the epoch moves on (a graph of `MoE.capture` then refuses to replay). tests/gpu/test_moe_bounds.py runs it
with queued calls and captured graphs on the GPU."""

from __future__ import annotations

import types
import weakref

import pytest

torch = pytest.importorskip("torch")

from symmring.moe.gpu import memory as memory_mod  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402
from symmring.moe.workspace_plan import entry_words  # noqa: E402


class FakeLayer:
    def __init__(self, log):
        self.log, self.closed = log, False

    def forget_workspace_memory(self):
        self.log.append("forget")


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


def test_release_memory_drops_the_layers_graphs_then_synchronises(monkeypatch):
    log = []
    ws = object.__new__(Workspace)
    layers = [FakeLayer(log), FakeLayer(log)]
    ws._layers = [weakref.ref(layer) for layer in layers]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    ws.release_memory()
    assert log == ["forget", "forget", "sync"]
