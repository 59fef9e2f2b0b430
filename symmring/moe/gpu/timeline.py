"""The streamed schedule's timeline: device timestamps of every stage, turned into records and overlap figures.

With ``layer.debug.forward(..., timeline=True)`` (`symmring.moe.debug`) the layer stamps the start and end of
every stage with the device's nanosecond clock (``moe_stamp``, a one-thread kernel between the stages on each
stream): producer stages per chunk, consumer stages per expert window (stamped at the window's first chunk).
"wait" stages are spins (the producer for its slot, the consumer for the first chunk's route readiness), not work.
`records` turns the stamps into dicts, `overlap_fraction` and `hidden_producer_fraction` into the figures
``bench stream`` reports.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

#: Stages of the timeline: (stream, stage), each with a start and an end stamp.
STAGES = (("producer", "wait"), ("producer", "route"), ("producer", "layout"), ("consumer", "wait"),
          ("consumer", "dispatch"), ("consumer", "experts"), ("consumer", "combine"))
_STAGE = {key: i for i, key in enumerate(STAGES)}


def num_stamps(max_chunks: int) -> int:
    """Stamp words a call of up to ``max_chunks`` chunks needs."""
    return 2 * len(STAGES) * max_chunks


def stamp_index(chunk: int, stage, end: bool) -> int:
    """Index of the start (or end) stamp of ``stage`` (a `STAGES` pair) of ``chunk``."""
    return 2 * (chunk * len(STAGES) + _STAGE[stage]) + int(end)


def records(stamps: np.ndarray, num_chunks: int, windows: Dict[int, int], relative: bool = True) -> List[Dict]:
    """One record per producer stage of every chunk and per consumer stage of every expert window.

    Args:
        stamps: the int64 stamps of the call (`num_stamps` words at least).
        num_chunks: chunks of the call; windows: first chunk -> last chunk of every expert window.
        relative: times relative to the earliest stamp; False: the device clock's own values (PEs that share
            a GPU share that clock, so their records can be compared).

    Returns:
        ``{"chunk", "last_chunk", "stream", "stage", "start_ns", "end_ns"}`` dicts (a window's records carry
        its first and last chunk).
    """
    stamped = [(chunk, s) for chunk in range(num_chunks) for s, (stream_name, _) in enumerate(STAGES)
               if stream_name == "producer" or chunk in windows]
    if not stamped:
        return []
    t0 = min(int(stamps[2 * (chunk * len(STAGES) + s)]) for chunk, s in stamped) if relative else 0
    out = []
    for chunk, s in stamped:
        stream_name, stage = STAGES[s]
        i = 2 * (chunk * len(STAGES) + s)
        out.append({"chunk": chunk, "last_chunk": windows[chunk] if stream_name == "consumer" else chunk,
                    "stream": stream_name, "stage": stage,
                    "start_ns": int(stamps[i]) - t0, "end_ns": int(stamps[i + 1]) - t0})
    return out


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
    `symmring.moe.debug.Debug.timeline_records`)."""
    if not records:
        return 0.0
    span = max(r["end_ns"] for r in records) - min(r["start_ns"] for r in records)
    return _both_working_ns(records) / span if span > 0 else 0.0
