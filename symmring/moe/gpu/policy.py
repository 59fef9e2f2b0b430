"""The automatic streaming policy: streamed configuration (or batch) for a token count, from measurements.

`python -m symmring bench stream` measures the streamed layer against the batch layer, side by side, for
every configuration of a sweep. `StreamPolicy` turns those rows into a table: per (shape, tokens per
rank), the fastest streamed configuration **if it beat batch by at least ``margin``** (3 % by default, the
size of run-to-run noise seen on the H200), else batch. Between measured sizes it applies the entry of the
largest measured size at or below the request (the smallest above it when the request is below all);
a configuration whose chunk would hold the whole batch is batch.

Slot counts and expert windows are kept as measured rules: ``num_slots == "call"`` (one slot per chunk)
and ``expert_window == "all"`` (one window of ``num_slots`` chunks) resolve for the requested size.

The GPU layer's ``forward(streaming="auto")`` asks `StreamPolicy.streams` with the layer's spec: it finds the
shape in the table by its dimensions (hidden, inter, num_experts, topk) and rank count, and streams only where
the measured choice is the schedule this layer's ring runs (same chunk size, no more slots, same expert
window); everywhere else -- an unmeasured shape, a size where batch won, another ring -- it runs batch.
`StreamPolicy.default` is the table measured on one H200 (``policy_h200.json`` beside this module; every
entry there chose batch, since one GPU has no NVLink dispatch for streaming to hide).

Example (``StreamPolicy.load("bench_stream.json")`` reads a benchmark's table; here two measured rows):
    >>> rows = [dict(shape="deepseek-v3", tokens_per_rank=n, ratio=r, tokens_per_slot=2048, num_slots=8,
    ...              expert_window=8, ack_policy="early") for n, r in ((8192, 1.01), (16384, 0.90))]
    >>> policy = StreamPolicy.from_rows(rows)   # streamed must beat batch by 3 %
    >>> policy.choose("deepseek-v3", 8192)      # None: use the batch layer
    >>> policy.choose("deepseek-v3", 16384)
    {'tokens_per_slot': 2048, 'num_slots': 8, 'expert_window': 8, 'ack_policy': 'early'}
    >>> StreamPolicy.default().choose("deepseek-v3@1pe", 16384)   # one H200: batch at every size
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import ConfigError

logger = logging.getLogger(__name__)

#: Streamed must beat batch by this fraction to be chosen (measured noise of one ratio: a few percent).
DEFAULT_MARGIN = 0.03
_KEYS = ("tokens_per_slot", "num_slots", "expert_window", "ack_policy")
#: What names a shape in a table: its dimensions and the rank count it was measured with.
DIM_KEYS = ("hidden", "inter", "num_experts", "topk", "world_size")
#: The table measured on one H200, shipped with the package.
DEFAULT_TABLE = Path(__file__).with_name("policy_h200.json")


def resolve(choice: Dict, num_tokens: int) -> Optional[Dict]:
    """``choice`` (its rules ``"call"``/``"all"`` allowed) as `symmring.moe.gpu.MoE` ring arguments for ``num_tokens``
    tokens per rank; None when it means batch (no choice, or one chunk would hold every token)."""
    if not choice:
        return None
    T = int(choice["tokens_per_slot"])
    if T >= num_tokens:
        return None
    chunks = -(-num_tokens // T)
    slots = chunks if choice["num_slots"] == "call" else int(choice["num_slots"])
    window = slots if choice["expert_window"] == "all" else int(choice["expert_window"])
    return {"tokens_per_slot": T, "num_slots": slots, "expert_window": min(window, slots),
            "ack_policy": str(choice["ack_policy"])}


class StreamPolicy:
    """Per shape, measured token counts and the choice at each (a dict of `_KEYS`, or None for batch).

    Args:
        entries: ``{"shape", "tokens_per_rank", "choice", "ratio", "best_streamed_ratio"}`` dicts (the
            ``policy`` list of the benchmark's JSON).
        shapes: ``{shape: {"hidden", "inter", "num_experts", "topk", "world_size"}}``: how a layer finds its
            shape (`streams`); optional for `choose`.
    """

    def __init__(self, entries: Sequence[Dict], shapes: Optional[Dict[str, Dict]] = None):
        self.entries = sorted((dict(e) for e in entries), key=lambda e: (e["shape"], e["tokens_per_rank"]))
        self.shapes = {name: {k: int(dims[k]) for k in DIM_KEYS} for name, dims in (shapes or {}).items()}
        self._by_shape: Dict[str, List[Dict]] = {}
        for e in self.entries:
            self._by_shape.setdefault(e["shape"], []).append(e)
        self._told: set = set()

    @classmethod
    def from_rows(cls, rows: Sequence[Dict], margin: float = DEFAULT_MARGIN) -> "StreamPolicy":
        """The table of measured rows (`bench stream`'s): the best streamed row per (shape, tokens),
        chosen only when its ratio is at most ``1 - margin``."""
        if not 0 <= margin < 1:
            raise ConfigError(f"margin={margin!r}: expected 0 <= margin < 1")
        best: Dict = {}
        for r in rows:
            key = (r["shape"], r["tokens_per_rank"])
            if key not in best or r["ratio"] < best[key]["ratio"]:
                best[key] = r
        entries = []
        for (shape, n), r in best.items():
            streamed = r["ratio"] <= 1.0 - margin
            choice = {k: r.get(f"{k}_rule", r[k]) for k in _KEYS} if streamed else None
            entries.append({"shape": shape, "tokens_per_rank": n, "choice": choice,
                            "ratio": r["ratio"] if streamed else 1.0, "best_streamed_ratio": r["ratio"]})
        shapes = {r["shape"]: {k: r[k] for k in DIM_KEYS} for r in rows if all(k in r for k in DIM_KEYS)}
        return cls(entries, shapes)

    @classmethod
    def load(cls, path) -> "StreamPolicy":
        """The policy of a `bench stream --json` file (its ``policy`` table and ``shapes``)."""
        with open(path) as fh:
            data = json.load(fh)
        if "policy" not in data:
            raise ConfigError(f"{path}: no 'policy' table (written by python -m symmring bench stream --json)")
        return cls(data["policy"], data.get("shapes"))

    @classmethod
    def default(cls) -> "StreamPolicy":
        """The table measured on one H200 (`DEFAULT_TABLE`)."""
        return cls.load(DEFAULT_TABLE)

    def shape_of(self, dims: Dict[str, int]) -> Optional[str]:
        """The name of the measured shape with these `DIM_KEYS` values, or None."""
        wanted = {k: int(dims[k]) for k in DIM_KEYS}
        return next((name for name, d in sorted(self.shapes.items()) if d == wanted and name in self._by_shape),
                    None)

    def streams(self, spec, num_tokens: int) -> bool:
        """Whether a layer of ``spec`` (a `symmring.moe.gpu.spec.GpuSpec`: its sizes and ring) should stream a call
        of ``num_tokens`` tokens per rank: the measured choice for its shape is the streamed schedule its ring
        runs (see the module docstring)."""
        dims = {"hidden": spec.hidden, "inter": spec.inter, "num_experts": spec.num_experts, "topk": spec.topk,
                "world_size": spec.world_size}
        shape = self.shape_of(dims)
        if shape is None:
            self._tell(("shape", tuple(dims.values())), "streaming='auto': no measurement for %s: batch", dims)
            return False
        entry = self._entry(shape, num_tokens)
        choice = resolve(entry["choice"], num_tokens)
        if choice is None:
            return False
        runnable = (choice["tokens_per_slot"] == spec.tokens_per_slot and choice["num_slots"] <= spec.num_slots
                    and choice["expert_window"] == spec.expert_window)
        if not runnable:
            # Once per table entry and layer ring (a bounded set), not per token count: a serving loop asks about
            # every count it sees.
            self._tell(("ring", shape, entry["tokens_per_rank"], spec.num_slots, spec.tokens_per_slot,
                        spec.expert_window),
                       "streaming='auto': %s at %d tokens (and other counts of its measurement, %d tokens) streams "
                       "best with %s; this layer's ring is %d x %d tokens, window %d: batch", shape, num_tokens,
                       entry["tokens_per_rank"], choice, spec.num_slots, spec.tokens_per_slot, spec.expert_window)
        return runnable

    def _tell(self, key: Tuple, message: str, *args) -> None:
        if key not in self._told:  # once per distinct case, not per call
            self._told.add(key)
            logger.info(message, *args)

    def shape_names(self) -> List[str]:
        """The measured shapes' names."""
        return sorted(self._by_shape)

    def choose(self, shape: str, num_tokens: int) -> Optional[Dict]:
        """The streamed schedule (``tokens_per_slot``, ``num_slots``, ``expert_window``, ``ack_policy``: the
        layer's ring and options) for ``num_tokens`` tokens per rank, or None for the batch path."""
        return resolve(self._entry(shape, num_tokens)["choice"], num_tokens)

    def _entry(self, shape: str, num_tokens: int) -> Dict:
        """The table entry a call of ``num_tokens`` tokens per rank of ``shape`` uses: the largest measured size
        at or below it (the smallest one below every size)."""
        if shape not in self._by_shape:
            raise ConfigError(f"shape={shape!r}: not in the policy table (has {self.shape_names()})")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ConfigError(f"num_tokens={num_tokens!r}: expected a non-negative int")
        entries = self._by_shape[shape]
        sizes = [e["tokens_per_rank"] for e in entries]
        return entries[max(0, bisect.bisect_right(sizes, num_tokens) - 1)]
