"""The automatic streaming policy: streamed configuration (or batch) for a token count, from measurements.

`python -m symmring bench stream` measures the streamed layer against the batch layer, side by side, for
every configuration of a sweep. `StreamPolicy` turns those rows into a table: per (shape, tokens per
rank), the fastest streamed configuration **if it beat batch by at least ``margin``** (3 % by default, the
size of run-to-run noise seen on the H200), else batch. Between measured sizes it applies the entry of the
largest measured size at or below the request (the smallest above it when the request is below all);
a configuration whose chunk would hold the whole batch is batch.

Slot counts and expert windows are kept as measured rules: ``num_slots == "call"`` (one slot per chunk)
and ``expert_window == "all"`` (one window of ``num_slots`` chunks) resolve for the requested size.

Example:
    >>> policy = StreamPolicy.load("bench_stream.json")
    >>> policy.choose("deepseek-v3", 8192)      # None: use the batch layer
    >>> policy.choose("deepseek-v3", 16384)
    {'tokens_per_slot': 2048, 'num_slots': 8, 'expert_window': 8, 'ack_policy': 'early'}
"""

from __future__ import annotations

import bisect
import json
from typing import Dict, List, Optional, Sequence

from ..errors import ConfigError

#: Streamed must beat batch by this fraction to be chosen (measured noise of one ratio: a few percent).
DEFAULT_MARGIN = 0.03
_KEYS = ("tokens_per_slot", "num_slots", "expert_window", "ack_policy")


def resolve(choice: Dict, num_tokens: int) -> Optional[Dict]:
    """``choice`` (its rules ``"call"``/``"all"`` allowed) as StreamedMoE arguments for ``num_tokens``
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
    """

    def __init__(self, entries: Sequence[Dict]):
        self.entries = sorted((dict(e) for e in entries), key=lambda e: (e["shape"], e["tokens_per_rank"]))
        self._by_shape: Dict[str, List[Dict]] = {}
        for e in self.entries:
            self._by_shape.setdefault(e["shape"], []).append(e)

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
        return cls(entries)

    @classmethod
    def load(cls, path: str) -> "StreamPolicy":
        """The policy of a `bench stream --json` file."""
        with open(path) as fh:
            data = json.load(fh)
        if "policy" not in data:
            raise ConfigError(f"{path}: no 'policy' table (written by python -m symmring bench stream --json)")
        return cls(data["policy"])

    def shapes(self) -> List[str]:
        return sorted(self._by_shape)

    def choose(self, shape: str, num_tokens: int) -> Optional[Dict]:
        """StreamedMoE arguments (``tokens_per_slot``, ``num_slots``, ``expert_window``, ``ack_policy``)
        for ``num_tokens`` tokens per rank, or None for the batch layer."""
        if shape not in self._by_shape:
            raise ConfigError(f"shape={shape!r}: not in the policy table (has {self.shapes()})")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ConfigError(f"num_tokens={num_tokens!r}: expected a non-negative int")
        entries = self._by_shape[shape]
        sizes = [e["tokens_per_rank"] for e in entries]
        i = max(0, bisect.bisect_right(sizes, num_tokens) - 1)
        return resolve(entries[i]["choice"], num_tokens)
