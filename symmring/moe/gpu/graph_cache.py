"""The GPU layer's cache of captured calls: an eager `symmring.moe.gpu.MoE.forward` replays a CUDA graph.

An eager call pays the host launch cost of every kernel and torch op it runs (0.7-1.3 ms for a decode
call of the small-batch schedule on an H200, against 0.09-1.8 ms for a replay of the same call; with the
cache an eager call took 1.03-1.52x the replay at 1-32 tokens on 1 PE).
So the layer's executor (`symmring.moe.gpu.executor`) keeps, per distinct call, a CUDA graph of it
(`symmring.moe.gpu.MoE.capture`'s capture, on a side stream) and an eager call that finds its graph only
copies its inputs into the graph's static inputs, replays it and clones the static output (all on the
current stream, no host synchronisation):

* **Key**: everything that fixes the captured work: the plan's key (the call's token bucket, the
  schedule, small-batch, distinct experts; each rank's exact count is on the device, so one graph serves
  every count up to its bucket on every rank: at most one graph per bucket,
  `symmring.moe.gpu.plan.token_bucket`), the routing kind, and for ``router_weight`` its data pointer
  and strides (the graph reads the router weight in place: another tensor is another key, one updated in
  place is read as it is at replay), for ``logits`` their dtype. ``x``, the logits and given
  ``topk_idx``/``topk_weights`` are copied into the graph's own static tensors.
* **When**: a key's first call runs eagerly (Triton/DeepGEMM compile, cuBLAS warms up), its second call
  captures (after a device synchronisation) and replays, later calls replay. Only calls of at most
  `MAX_TOKENS` tokens on every rank, with contiguous ``x`` (and logits), and never while the caller's
  stream is capturing (a graph the caller captures around the layer then holds the plain kernels), nor
  with test hooks (``layer.debug.forward``, `symmring.moe.debug`). A capture that fails (the call then runs
  eagerly; nothing was launched) is tried once more at the key's next call: a first capture can meet a
  one-time cost of the process that is illegal inside a capture (a module loaded at its first launch); a
  second failure keeps the key eager. The ranks' keys agree on the bucket
  through the token-count exchange of the call, or of the model step (`symmring.Workspace.step`: one for
  every layer of the step).
* **Ranks need not agree** on replaying: a replay runs exactly the kernels an eager call launches (the
  generations come from the device-resident generation base), and capturing is no collective, so one
  rank replaying while another launches (a router weight that moved on one rank only) is still one call.
* **Output**: a clone of the static output (a kept ``y`` is never overwritten by a later call).
* **Memory**: at most ``capacity`` graphs (least recently used evicted, after a synchronisation, so no
  replay in flight loses its memory), all in one torch graph memory pool: a graph's intermediates may
  share memory with another graph's, which is safe because calls never overlap (each call waits for the
  previous one's end) and the static output is cloned before the call ends.

The capacity is the layer's ``graph_cache`` argument (default `symmring.moe.config.GRAPH_CACHE_ENTRIES`; 0
disables), overridden by ``SYMMRING_GRAPH_CACHE``; ``forward(graph_cache=False)`` skips the cache for one call.
`MoE.reset`, `MoE.close` and `MoE.clear_graph_cache` drop every graph, and so does the executor when the
workspace's memory moved (`symmring.Workspace.epoch`: the graphs address the old memory).

Example:
    >>> cache = GraphCache(2)
    >>> [cache.decide("a")[0], cache.decide("a")[0]]      # first call eager, the second captures
    ['eager', 'capture']
    >>> cache.insert("a", "graph of a"); cache.decide("a")
    ('replay', 'graph of a')
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from ... import env
from ...errors import ConfigError

#: The most tokens per rank of a call the cache serves (a graph's static output is ``[n, hidden]``).
MAX_TOKENS = 256
#: Keys remembered as seen once (so a key's second call captures), least recently seen dropped first.
SEEN_KEYS = 64
#: What `GraphCache.decide` answers.
ACTIONS = ("eager", "capture", "replay")

#: ``torch.cuda.graph``'s ``capture_error_mode`` of every capture symmring makes (this cache's, and
#: `symmring.Workspace.capture`'s by default): another thread's unsafe CUDA call during a global-mode capture
#: invalidates it. Seen at 2 and 3 PEs under MPS (mpirun): a capture failed on some PEs now and then
#: ("operation failed due to a previous error during capture"), never at one PE, never the same test twice;
#: this thread's own calls are the capture's, so ``thread_local`` loses no check of them.
CAPTURE_ERROR_MODE = "thread_local"


def check_entries(value) -> int:
    """``graph_cache`` validated: an int >= 0.

    Example:
        >>> check_entries(8)
        8
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"graph_cache={value!r}: expected an int >= 0 (graphs kept; 0 switches the cache off)")
    return int(value)


def capacity(value) -> int:
    """The cache's capacity of a layer built with ``graph_cache=value``: ``SYMMRING_GRAPH_CACHE`` where it is
    set, else ``value`` (validated either way).

    Raises:
        ConfigError: ``value`` or the variable is not an int >= 0.
    """
    value = check_entries(value)
    override = env.graph_cache()
    return value if override is None else override


def _remember(keys: "OrderedDict[Hashable, None]", key: Hashable) -> None:
    """Add ``key`` to a bounded set of keys (the least recently added dropped beyond `SEEN_KEYS`)."""
    keys[key] = None
    if len(keys) > SEEN_KEYS:
        keys.popitem(last=False)


class GraphCache:
    """The bookkeeping of the cache (what is kept, when to capture, what to evict); the graphs themselves
    are opaque entries (`CachedGraph` on the GPU).

    Args:
        capacity: entries kept (0: `decide` always answers ``"eager"``).
    """

    def __init__(self, capacity: int):
        self.capacity = check_entries(capacity)
        self._entries: "OrderedDict[Hashable, object]" = OrderedDict()
        self._seen: "OrderedDict[Hashable, None]" = OrderedDict()
        self._failed: "OrderedDict[Hashable, None]" = OrderedDict()
        self._failed_once: "OrderedDict[Hashable, None]" = OrderedDict()
        self.hits = self.captures = self.evictions = self.failures = self.retries = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def decide(self, key: Hashable) -> Tuple[str, Optional[object]]:
        """``("replay", entry)`` for a kept key (now the most recently used), ``("capture", None)`` for a key
        seen once before or whose first capture failed (the caller captures and `insert`s), ``("eager", None)``
        otherwise (a key seen for the first time is remembered; one whose capture failed twice stays eager)."""
        if not self.capacity:
            return "eager", None
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return "replay", entry
        if key in self._failed:
            return "eager", None
        if key in self._seen:
            del self._seen[key]
            return "capture", None
        _remember(self._seen, key)
        return "eager", None

    def make_room(self) -> List[object]:
        """Evict least recently used entries until one more fits; returns them (the caller synchronised, so
        no replay of theirs is in flight)."""
        evicted = []
        while self._entries and len(self._entries) >= self.capacity:
            evicted.append(self._entries.popitem(last=False)[1])
            self.evictions += 1
        return evicted

    def insert(self, key: Hashable, entry: object) -> None:
        """Keep ``entry`` (a fresh capture) as the most recently used; evicts to stay within capacity."""
        if entry is None:
            raise ValueError("GraphCache.insert: entry is None")
        self.make_room()
        self._entries[key] = entry
        self.captures += 1

    def fail(self, key: Hashable) -> bool:
        """Remember that ``key``'s capture failed: its next call captures again (counted in ``retries``); after
        a second failure (counted in ``failures``) its calls stay eager. Returns whether it will be retried."""
        if key not in self._failed_once:
            self.retries += 1
            _remember(self._failed_once, key)
            _remember(self._seen, key)
            return True
        del self._failed_once[key]
        self.failures += 1
        _remember(self._failed, key)
        return False

    def clear(self) -> None:
        """Drop every entry and what was seen (the counters stay)."""
        self._entries.clear()
        self._seen.clear()
        self._failed.clear()
        self._failed_once.clear()

    def info(self) -> Dict[str, int]:
        """``entries``, ``capacity``, ``hits`` (replays), ``captures``, ``evictions``, ``failures`` (keys left
        eager), ``retries`` (failed first captures, tried again)."""
        return {"entries": len(self._entries), "capacity": self.capacity, "hits": self.hits,
                "captures": self.captures, "evictions": self.evictions, "failures": self.failures,
                "retries": self.retries}


def call_key(plan, distinct: bool, x, kind: str, source) -> Optional[Tuple]:
    """``(key, the call's tensors for the graph's static inputs)`` of a call the cache may serve (module
    docstring, "Key"), or None: ``plan`` (`symmring.moe.gpu.plan.Plan`), whether every rank routes with the
    layer's router, ``x`` and the routing source (``kind``, ``source``: `symmring.moe.gpu.inputs.routing_source`)."""
    if max(plan.counts) > MAX_TOKENS or not x.is_contiguous():
        return None
    base = (plan.counts, plan.streaming, plan.small_batch, distinct, kind)
    if kind == "given":
        return base, (x,) + tuple(source)  # made contiguous by routing_source
    if kind == "logits":
        if not source.is_contiguous():
            return None
        return base + (source.dtype,), (x, source)
    # The router weight is read in place: its address and strides are part of what the graph captured.
    return base + (source.data_ptr(), tuple(source.stride())), (x,)


class CachedGraph:
    """One captured call: the graph, its static inputs (in the order `replay` takes the new values), its
    static output and what the engines' launches in it hold while it lives (`symmring.moe.engines.capture_scope`:
    given back when this entry is dropped, after the synchronisation that precedes every eviction)."""

    __slots__ = ("graph", "inputs", "output", "held")

    def __init__(self, graph, inputs: Sequence, output, held=None):
        self.graph, self.inputs, self.output, self.held = graph, tuple(inputs), output, held

    def replay(self, values: Sequence):
        """Copy ``values`` into the first rows of the static inputs (a graph captured for a token bucket holds
        that many rows; the call's count is on the device), replay, and return a clone of the output's rows of
        this call (all enqueued on the current stream)."""
        import torch
        rows = int(values[0].shape[0]) if values else self.output.shape[0]
        with torch.no_grad():  # an input that requires grad must not give the static inputs a history
            for static, value in zip(self.inputs, values):
                static[: value.shape[0]].copy_(value)
        self.graph.replay()
        return self.output[:rows].clone()
