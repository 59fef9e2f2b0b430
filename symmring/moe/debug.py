"""Test and benchmark hooks of a layer's calls, kept off `forward`'s signature: ``layer.debug.forward(...)``.

A hook changes how a call runs or records it, never what it computes:

* GPU layer: ``stage_events`` (batch calls: ``(stage name, torch.cuda.Event)`` pairs after each stage of
  `symmring.moe.gpu.STAGES`, with a leading ``("start", event)``), ``timeline`` (streamed calls: every stage of
  every chunk stamped with the device clock, `Debug.timeline_records`), ``producer_delay_ns`` /
  ``consumer_delay_ns`` (streamed calls, ``{chunk: ns}``: spin the producer before producing the chunk, or the
  consumer before consuming the window that starts at it: a deliberately slow producer or consumer);
* CPU layer: ``lookahead`` (streamed calls: chunks the producer runs ahead, ``0 <= lookahead < num_slots``;
  default ``num_slots - 1``).

A call with hooks is an ordinary collective call (every rank makes it), checked like any other: a hook the
call cannot honour is a `ConfigError` on every rank. The GPU layer never serves it from its graph cache.

Example:
    >>> Hooks(producer_delay_ns={0: 1000}).checked(True, "gpu").producer_delay_ns
    {0: 1000}
    >>> Hooks(timeline=True).checked(False, "gpu")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    symmring.errors.ConfigError: timeline/producer_delay_ns/consumer_delay_ns: only for the streamed schedule ...
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ..errors import ConfigError
from .config import check_int


def _delays(name: str, delays) -> Dict[int, int]:
    if delays is None:
        return {}
    if not isinstance(delays, dict):
        raise ConfigError(f"{name}={delays!r}: expected a dict chunk_idx -> nanoseconds")
    for chunk, ns in delays.items():
        check_int(f"{name} chunk", chunk, 0)
        check_int(f"{name}[{chunk}]", ns, 0)
    return {int(c): int(ns) for c, ns in delays.items()}


@dataclasses.dataclass(frozen=True)
class Hooks:
    """The hooks of one call (module docstring), as given: `checked` validates them for the call."""

    stage_events: Optional[List] = None
    timeline: bool = False
    producer_delay_ns: Optional[Dict[int, int]] = None
    consumer_delay_ns: Optional[Dict[int, int]] = None
    lookahead: Optional[int] = None

    def checked(self, streaming, device: str) -> "Hooks":
        """These hooks validated for a call of ``streaming`` on the ``device`` layer (``"gpu"`` or ``"cpu"``),
        the delays as ``{int: int}``. Part of the call's own checks, so a bad hook refuses the call on every
        rank.

        Raises:
            ConfigError: a hook of the wrong type, or one this layer or call cannot honour, named.
        """
        if self.stage_events is not None and not isinstance(self.stage_events, list):
            raise ConfigError(f"stage_events={self.stage_events!r}: expected a list (it receives the events)")
        if not isinstance(self.timeline, bool):
            raise ConfigError(f"timeline={self.timeline!r}: expected a bool")
        hooks = dataclasses.replace(self, producer_delay_ns=_delays("producer_delay_ns", self.producer_delay_ns),
                                    consumer_delay_ns=_delays("consumer_delay_ns", self.consumer_delay_ns),
                                    lookahead=None if self.lookahead is None else check_int("lookahead",
                                                                                            self.lookahead, 0))
        gpu_only = [name for name in ("stage_events", "timeline", "producer_delay_ns", "consumer_delay_ns")
                    if getattr(hooks, name) not in (None, False, {})]
        if device == "cpu":
            if gpu_only:
                raise ConfigError(f"{', '.join(gpu_only)}: hooks of the GPU layer; the CPU layer takes lookahead")
            if hooks.lookahead is not None and streaming is not True:
                raise ConfigError("lookahead: only for the streamed schedule (streaming=True)")
            return hooks
        if hooks.lookahead is not None:
            raise ConfigError("lookahead: a hook of the CPU layer (the GPU layer's producer runs up to num_slots - 1 "
                              "chunks ahead)")
        if streaming is not True and (hooks.timeline or hooks.producer_delay_ns or hooks.consumer_delay_ns):
            raise ConfigError("timeline/producer_delay_ns/consumer_delay_ns: only for the streamed schedule "
                              "(streaming=True)")
        if streaming is not False and hooks.stage_events is not None:
            raise ConfigError("stage_events: only for the batch path (streaming=False); the streamed schedule "
                              "records a timeline (timeline=True)")
        return hooks

    def mark(self, name: str) -> None:
        """Record a timing event after stage ``name`` on the current torch stream (``stage_events``)."""
        if self.stage_events is not None:
            import torch
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stage_events.append((name, event))


class Debug:
    """``layer.debug``: the layer's calls with hooks (`Hooks`), and what they recorded.

    Args:
        forward: the layer's ``forward``.
        holder: what reads the hooks during a call (its ``hooks`` attribute, None between calls) and keeps
            their records (``timeline_records``, GPU layer).
    """

    def __init__(self, forward, holder):
        self._forward, self._holder = forward, holder

    def forward(self, x, *args, stage_events=None, timeline: bool = False, producer_delay_ns=None,
                consumer_delay_ns=None, lookahead=None, **kwargs):
        """``layer.forward(x, *args, **kwargs)`` (collective, as every call) with these hooks (module docstring).

        Raises:
            ConfigError: a bad hook, or one this call cannot honour (on every rank), or as ``forward``.
        """
        self._holder.hooks = Hooks(stage_events=stage_events, timeline=timeline, producer_delay_ns=producer_delay_ns,
                                   consumer_delay_ns=consumer_delay_ns, lookahead=lookahead)
        try:
            return self._forward(x, *args, **kwargs)
        finally:
            self._holder.hooks = None

    def timeline_records(self, relative: bool = True) -> List[Dict]:
        """GPU layer: the device timestamps of the last ``debug.forward(..., streaming=True, timeline=True)``
        (synchronises): see `symmring.moe.gpu.timeline.records` (``relative=False``: the device clock's values)."""
        return self._holder.timeline_records(relative)


__all__ = ["Hooks", "Debug"]
