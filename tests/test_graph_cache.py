"""`symmring.moe.gpu.graph_cache` on the CPU: the capacity option and ``SYMMRING_GRAPH_CACHE``, the cache's
decisions (a key's second call captures, later ones replay), LRU eviction, failed captures, and a
`CachedGraph` replay's input copies and cloned output (on CPU tensors with a stand-in graph). The GPU
layer's use of it: tests/gpu/test_moe_graph_cache.py."""

from __future__ import annotations

import pytest

from symmring import env
from symmring.errors import ConfigError
from symmring.moe.gpu import graph_cache
from symmring.moe.gpu.graph_cache import CachedGraph, GraphCache


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("SYMMRING_GRAPH_CACHE", raising=False)


@pytest.mark.parametrize("value", [0, 1, 8, 100])
def test_capacity_takes_the_argument(value):
    assert graph_cache.capacity(value) == value


@pytest.mark.parametrize("value", [-1, 1.5, "8", True, None])
def test_bad_argument_rejected(value, monkeypatch):
    with pytest.raises(ConfigError, match=r"graph_cache=.*expected an int >= 0"):
        graph_cache.capacity(value)
    monkeypatch.setenv("SYMMRING_GRAPH_CACHE", "4")  # the argument is checked even where the variable wins
    with pytest.raises(ConfigError, match="graph_cache="):
        graph_cache.capacity(value)


@pytest.mark.parametrize("raw,want", [("0", 0), ("3", 3), (" 16 ", 16), ("", 8)])
def test_environment_overrides(raw, want, monkeypatch):
    monkeypatch.setenv("SYMMRING_GRAPH_CACHE", raw)
    assert graph_cache.capacity(8) == want
    assert env.graph_cache() == (None if raw == "" else want)


@pytest.mark.parametrize("raw", ["-1", "1.5", "off", "8x"])
def test_bad_environment_rejected(raw, monkeypatch):
    monkeypatch.setenv("SYMMRING_GRAPH_CACHE", raw)
    with pytest.raises(ConfigError, match=r"SYMMRING_GRAPH_CACHE=.*expected an integer >= 0"):
        graph_cache.capacity(8)


def test_second_call_captures_then_replays():
    cache = GraphCache(4)
    assert cache.decide("a") == ("eager", None)
    assert cache.decide("b") == ("eager", None)
    assert cache.decide("a") == ("capture", None)
    cache.insert("a", "A")
    assert [cache.decide("a") for _ in range(3)] == [("replay", "A")] * 3
    assert cache.decide("b") == ("capture", None)
    assert cache.info() == dict(entries=1, capacity=4, hits=3, captures=1, evictions=0, failures=0, retries=0)


def test_lru_eviction_trace():
    """The sequence tests/gpu/test_moe_graph_cache.py::test_lru_eviction runs: capacity 2, keys 1 3 8 x 3."""
    cache = GraphCache(2)
    actions = []
    for key in (1, 3, 8) * 3:
        action, entry = cache.decide(key)
        actions.append(action)
        if action == "capture":
            cache.make_room()
            cache.insert(key, f"graph {key}")
        elif action == "replay":
            assert entry == f"graph {key}"
    assert actions == ["eager"] * 3 + ["capture"] * 3 + ["eager", "replay", "replay"]
    info = cache.info()
    assert (info["captures"], info["evictions"], info["hits"], info["entries"]) == (3, 1, 2, 2)
    assert 1 not in cache and 3 in cache and 8 in cache


def test_make_room_returns_the_least_recently_used():
    cache = GraphCache(2)
    cache.insert("a", "A")
    cache.insert("b", "B")
    cache.decide("a")  # a is now the most recently used
    assert cache.make_room() == ["B"]
    cache.insert("c", "C")
    assert len(cache) == 2 and "a" in cache and "c" in cache


def test_a_failed_capture_is_tried_once_more_then_stays_eager_and_clear_forgets():
    cache = GraphCache(2)
    cache.decide("a")
    assert cache.decide("a")[0] == "capture"
    assert cache.fail("a")  # the first failure: the next call captures again
    assert cache.info()["retries"] == 1 and cache.info()["failures"] == 0
    assert cache.decide("a")[0] == "capture"
    assert not cache.fail("a")  # the second: eager from now on
    assert [cache.decide("a")[0] for _ in range(3)] == ["eager"] * 3
    assert cache.info()["failures"] == 1 and cache.info()["retries"] == 1
    cache.decide("c")
    assert cache.decide("c")[0] == "capture"
    cache.fail("c")
    cache.insert("c", "graph of c")  # a retry that captured replays
    assert cache.decide("c") == ("replay", "graph of c")
    cache.decide("b")
    cache.clear()
    assert cache.decide("a")[0] == "eager" and cache.decide("b")[0] == "eager"  # seen and failed forgotten
    assert cache.decide("a")[0] == "capture"


def test_capacity_zero_never_captures():
    cache = GraphCache(0)
    assert [cache.decide("a")[0] for _ in range(4)] == ["eager"] * 4
    assert cache.info()["hits"] == cache.info()["captures"] == 0


def test_seen_keys_are_bounded():
    cache = GraphCache(2)
    keys = list(range(graph_cache.SEEN_KEYS + 1))
    for key in keys:
        cache.decide(key)
    assert cache.decide(keys[0])[0] == "eager"  # forgotten: seen once again
    assert cache.decide(keys[-1])[0] == "capture"


def test_insert_refuses_none():
    with pytest.raises(ValueError):
        GraphCache(1).insert("a", None)


def test_cached_graph_copies_inputs_and_clones_the_output():
    torch = pytest.importorskip("torch", reason="CachedGraph replays torch tensors")
    x_static, w_static, out = torch.zeros(3, 4), torch.zeros(3), torch.zeros(3, 4)

    class Graph:  # stands in for torch.cuda.CUDAGraph: replay computes from the static inputs
        def replay(self):
            out.copy_(x_static * w_static[:, None])

    entry = CachedGraph(Graph(), (x_static, w_static), out)
    g = torch.Generator().manual_seed(20261215)
    calls = [(torch.randn(3, 4, generator=g), torch.randn(3, generator=g, requires_grad=True)) for _ in range(3)]
    kept = [entry.replay(values) for values in calls]
    for (x, w), y in zip(calls, kept):  # every kept output is its own call's (none overwritten, none stale)
        assert torch.equal(y, (x * w.detach()[:, None]))
        assert y.data_ptr() != out.data_ptr()
    assert not x_static.requires_grad and not w_static.requires_grad and w_static.grad_fn is None


def test_decode_table_shows_the_cache_off_column():
    from symmring.bench.moe import format_decode_table
    row = dict(shape="deepseek-v3", tokens_per_rank=1, engine="builtin", small_batch=True, layer_graph_ms=0.2,
               layer_ms=0.25, eager_nocache_ms=1.3, fp8_roofline_ms=0.1, target_ms=0.155, eager_vs_graph=1.25)
    header, line = format_decode_table([row]).splitlines()
    assert "nocache" in header.split()
    assert line.split()[4:7] == ["0.200", "0.250", "1.300"]  # graph, eager (cached), eager with the cache off
