"""The mutants: deliberately broken variants of the protocol, each with the invariant expected to catch it
(`MUTANTS`), and the variants expected to be equivalent to the protocol (`EQUIVALENT_VARIANTS`)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ..protocol import AckPolicy
from .invariants import INV_EXACT_READ, INV_LIVENESS, INV_NO_STALE_WAIT, INV_REUSE


@dataclasses.dataclass(frozen=True)
class MutantSpec:
    """A deliberately broken variant of the protocol and the invariant expected to catch it.

    Attributes:
        name: the flag name (``--mutant NAME``).
        description: what is broken.
        expected: the invariant whose violation is the expected counterexample.
        serial: run in serial stream mode (one stream per rank) instead of two streams.
        policy: the acknowledgement policy to run under (``None``: both, CONSERVATIVE first).
        min_consumers: smallest consumer count for which the mutant is observable.
        min_calls: smallest call count for which the mutant is observable.
        min_slots: smallest slot count for which the mutant is observable.
        needs_wrap: needs ``num_chunks > num_slots`` (a slot reused within a call).
        window: runs with the GPU layer's windowed consumer (`protocol.windowed_enqueue_order`) instead of
            the per-chunk one.
        graph: runs each rank's call as a captured graph (`protocol.call_dependency_graph`).
        split: runs with the split producer (``split_acquire``: route and layout acquire separately).
    """

    name: str
    description: str
    expected: str
    serial: bool = False
    policy: Optional[AckPolicy] = None
    min_consumers: int = 1
    min_calls: int = 1
    min_slots: int = 1
    needs_wrap: bool = False
    window: bool = False
    graph: bool = False
    split: bool = False


MUTANTS: Tuple[MutantSpec, ...] = (
    MutantSpec("fence_removed", "no release fence: the ready word may be published before the payload "
               "stores are visible (payload stores sit in a per-rank store buffer drained at any time)",
               INV_EXACT_READ),
    MutantSpec("no_acquire", "consumer without acquire: its payload reads may be satisfied before its "
               "ready wait", INV_EXACT_READ),
    MutantSpec("ack_before_last_read", "consumer acknowledges after the route read but before the layout "
               "read", INV_EXACT_READ, needs_wrap=True),
    MutantSpec("reset_forgotten", "owner never resets the ack mask when it acquires a slot",
               INV_REUSE, needs_wrap=True),
    MutantSpec("reset_after_publish", "owner resets the ack mask after publishing instead of before: an "
               "acknowledgement arriving in between is lost", INV_LIVENESS, needs_wrap=True),
    MutantSpec("ready_ignores_generation", "ready test accepts any nonzero generation",
               INV_NO_STALE_WAIT, needs_wrap=True),
    MutantSpec("wait_route_only", "consumer waits for route_ready only, not layout_ready",
               INV_NO_STALE_WAIT),
    MutantSpec("generation_baked", "generation base baked into the replayed program (not advanced "
               "between calls)", INV_NO_STALE_WAIT, min_calls=2),
    MutantSpec("reuse_on_any_ack", "owner reuses a slot when any acknowledgement bit is present instead "
               "of all", INV_REUSE, min_consumers=2, needs_wrap=True),
    MutantSpec("lookahead_eq_slots", "serial streams where one rank (the last) runs its producer num_slots "
               "chunks ahead (lookahead == num_slots)",
               INV_LIVENESS, serial=True, needs_wrap=True),
    MutantSpec("combine_rereads_slot", "EARLY ack, but the combine re-reads route metadata (source token "
               "index, top-k weights) from the slot after acknowledging", INV_EXACT_READ,
               policy=AckPolicy.EARLY, needs_wrap=True),
    MutantSpec("required_mask_excludes_owner", "the owner's required mask leaves out its own consumer "
               "(as if local reads needed no acknowledgement)", INV_REUSE, needs_wrap=True),
    MutantSpec("window_exceeds_slots", "expert windows of num_slots + 1 chunks (two streams): a window's "
               "consumer counts the route of every chunk of the window before it acknowledges any",
               INV_LIVENESS, needs_wrap=True, window=True),
    MutantSpec("windows_differ_per_rank", "serial streams whose ranks use different expert windows "
               "(num_slots - 1 and num_slots, alternating): a window's combine waits for every consumer's "
               "window ending at or after its last chunk", INV_LIVENESS, serial=True, min_consumers=2,
               min_slots=3, needs_wrap=True, window=True),
    MutantSpec("graph_without_own_chunk_edges", "each rank's captured graph lacks the edges 'consume a "
               "window after this rank's produce of its last chunk', run by an executor that runs one item at "
               "a time in any topological order", INV_LIVENESS, serial=True, window=True, graph=True),
    MutantSpec("graph_without_own_ack_edges", "each rank's captured graph lacks the edges 'produce c after this "
               "rank's consume of the window holding c - num_slots', run by an executor that runs one item at "
               "a time in any topological order", INV_LIVENESS, serial=True, window=True, graph=True,
               needs_wrap=True),
    MutantSpec("split_acquire_full_mask_only", "split producer whose second part waits for a complete mask "
               "like the first, not also for the first part's publication (RingKernels.produce before "
               "2026-12: the first part's reset left the second waiting for acknowledgements that need it)",
               INV_LIVENESS, needs_wrap=True, split=True),
)

MUTANT_NAMES = tuple(m.name for m in MUTANTS)
#: Mutants of the windowed consumer (run on the window shapes).
WINDOW_MUTANTS = tuple(m.name for m in MUTANTS if m.window)
#: Mutants of the captured graph (run with graph=True).
GRAPH_MUTANTS = tuple(m.name for m in MUTANTS if m.graph)
_MUTANT_BY_NAME = {m.name: m for m in MUTANTS}

#: Mutants that break a premise of the coarse-step reduction (payload visible at publish, reads after
#: the wait, acknowledgement after the last read of slot memory): they always run with fine steps.
FINE_MUTANTS = ("fence_removed", "no_acquire", "ack_before_last_read", "combine_rereads_slot")

#: Variants that are *not* mutants: expected equivalent to the protocol (reported as findings).
#: ``ready_ge``: the ready test ``==`` replaced by ``>=``.
EQUIVALENT_VARIANTS = ("ready_ge",)
