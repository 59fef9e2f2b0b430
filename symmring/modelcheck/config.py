"""`ModelConfig`, one instance of the model (counts, acknowledgement policy, streams, consumer kind,
mutant, step granularity), and `Shape`, its ``(P, Q, S, N, C)``."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

from .. import protocol
from ..protocol import AckPolicy
from .mutants import EQUIVALENT_VARIANTS

#: ``(P, Q, S, N, C)``; ``N`` an int, or one chunk count per call.
Shape = Tuple[int, int, int, Union[int, Tuple[int, ...]], int]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One model instance.

    Attributes:
        num_producers: producer ranks ``0..P-1`` (each owns ``num_slots`` slots).
        num_consumers: consumer ranks ``0..Q-1`` (each reads every producer's slots).
        num_slots: ring slots per owner.
        num_chunks: chunks per call, or one count per call (eager calls of different token counts; a
            slot's previous use may then lie several calls back).
        num_calls: calls (call ``k > 0`` is a CUDA Graph replay of call 0, or with per-call counts the
            next eager call).
        ack_policy: when consumers acknowledge (`AckPolicy`).
        serial: one stream per rank running `protocol.enqueue_order` (else two independent streams).
        lookahead: producer lookahead of the serial order (``None``: ``num_slots - 1``), or one per rank.
        expert_window: ``None``: the per-chunk consumer of `symmring.ring` and the CPU layer. An int ``W``
            (or one per rank): the GPU layer's windowed consumer, whose serial order is
            `protocol.windowed_enqueue_order` (docs/MODELCHECK.md, section 1a).
        graph: (windowed consumer) each rank's call is the captured graph of its order with the layer's
            local edges (`protocol.call_dependency_graph`): an item starts once its predecessors finished;
            with ``serial`` one item at a time per rank, in any topological order (docs/MODELCHECK.md, 1b).
        split_acquire: the split producer (`RingKernels.produce(parts="route")` and ``(parts="layout")``,
            both acquiring): each part acquires the slot on its own, when the mask is complete or when the
            other part of this chunk is published, and resets the mask in its publication step
            (``symmring_produce``: ``wait_reusable_or_published`` then ``grid_publish(reset_mask=true)``).
        mutant: name of a mutant in `MUTANT_NAMES` or `EQUIVALENT_VARIANTS`, or ``None``.
        fine: one step per memory operation even where the coarse steps are sound (a cross-check; the
            variants in `FINE_MUTANTS` always use fine steps).
        reduce: partial-order reduction on/off (``None``: on for the protocol, off for mutants).
    """

    num_producers: int
    num_consumers: int
    num_slots: int
    num_chunks: Union[int, Tuple[int, ...]]
    num_calls: int
    ack_policy: AckPolicy = AckPolicy.CONSERVATIVE
    serial: bool = False
    lookahead: Optional[Union[int, Tuple[int, ...]]] = None
    mutant: Optional[str] = None
    fine: bool = False
    reduce: Optional[bool] = None
    expert_window: Optional[Union[int, Tuple[int, ...]]] = None
    graph: bool = False
    split_acquire: bool = False

    def reduced(self) -> bool:
        """Whether the partial-order reduction applies: by default for the protocol and the equivalence
        variants, never for mutants (their counterexamples come from the unreduced state space)."""
        if self.reduce is None:
            return self.mutant is None or self.mutant in EQUIVALENT_VARIANTS
        return self.reduce

    def shape(self) -> "Shape":
        """``(P, Q, S, N, C)``."""
        return (self.num_producers, self.num_consumers, self.num_slots, self.num_chunks, self.num_calls)

    def chunks_per_call(self) -> Tuple[int, ...]:
        """Chunks of each call."""
        if isinstance(self.num_chunks, tuple):
            return self.num_chunks
        return (self.num_chunks,) * self.num_calls

    def label(self) -> str:
        """Short human-readable name of this configuration."""
        if self.expert_window is not None:
            widths = self.window_widths()
            window = str(widths[0]) if len(set(widths)) == 1 else "/".join(map(str, widths))
            mode = f"serial(window={window})" if self.serial else f"two-stream(window={window})"
            if self.graph:
                mode = f"graph-{'serial' if self.serial else 'concurrent'}(window={window})"
        else:
            lookaheads = self.lookaheads()
            ahead = str(lookaheads[0]) if len(set(lookaheads)) == 1 else "/".join(map(str, lookaheads))
            mode = f"serial(lookahead={ahead})" if self.serial else "two-stream"
        chunks = "/".join(map(str, self.num_chunks)) if isinstance(self.num_chunks, tuple) else self.num_chunks
        text = "P={},Q={},S={},N={},C={}".format(self.num_producers, self.num_consumers, self.num_slots, chunks,
                                                 self.num_calls)
        text += f" {self.ack_policy.name.lower()} {mode}"
        text += " split-acquire" if self.split_acquire else ""
        text += " fine" if self.fine else ""
        text += "" if self.reduced() else " unreduced"
        return text + (f" mutant={self.mutant}" if self.mutant else "")

    def effective_lookahead(self) -> int:
        """The lookahead the serial order uses (rank 0's, when they differ)."""
        return self.lookaheads()[0]

    def lookaheads(self) -> Tuple[int, ...]:
        """The lookahead of each rank's serial order."""
        ranks = max(self.num_producers, self.num_consumers)
        if self.mutant == "lookahead_eq_slots":
            return (protocol.default_lookahead(self.num_slots),) * (ranks - 1) + (self.num_slots,)
        if self.lookahead is None:
            return (protocol.default_lookahead(self.num_slots),) * ranks
        if isinstance(self.lookahead, tuple):
            return self.lookahead
        return (self.lookahead,) * ranks

    def window_widths(self) -> Tuple[int, ...]:
        """Chunks per expert window of each rank (windowed consumer only)."""
        ranks = max(self.num_producers, self.num_consumers)
        if self.mutant == "window_exceeds_slots":
            return (self.num_slots + 1,) * ranks
        if self.mutant == "windows_differ_per_rank":
            return tuple(self.num_slots - 1 + r % 2 for r in range(ranks))
        if isinstance(self.expert_window, tuple):
            return self.expert_window
        return (self.expert_window,) * ranks
