"""The suites: the shapes of ``--quick`` and of the full run, and the configurations each kind of check
explores on them (the protocol, the windowed consumer, the split producer, each mutant)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..protocol import AckPolicy
from .config import ModelConfig, Shape
from .mutants import MutantSpec

#: A cross-check: a shape explored with (fine steps?, partial-order reduction?).
CrossCheck = Tuple[Shape, bool, bool]

#: ``--quick``: CI size. Shapes are (P, Q, S, N, C); a tuple N gives each call its own chunk count.
QUICK_SHAPES: Tuple[Shape, ...] = (
    (1, 1, 1, 2, 2), (1, 1, 2, 3, 2), (2, 1, 2, 3, 2), (1, 2, 2, 3, 2), (2, 2, 2, 3, 2), (2, 2, 2, 4, 2),
    (3, 3, 2, 3, 1), (2, 2, 2, (3, 1, 2), 3),
)
#: ``--quick`` cross-checks of the reductions: the same shape without reduction and with fine steps.
QUICK_CROSS_CHECKS: Tuple[CrossCheck, ...] = (
    ((1, 1, 2, 3, 2), True, False), ((2, 1, 2, 3, 1), True, False), ((2, 2, 2, 3, 1), False, False),
)
#: Full run.
FULL_SHAPES: Tuple[Shape, ...] = QUICK_SHAPES + (
    (1, 1, 3, 7, 2), (2, 2, 1, 3, 2), (2, 2, 3, 6, 2), (3, 2, 2, 4, 2), (2, 3, 2, 4, 2),
    (3, 3, 2, 4, 2), (3, 3, 3, 6, 2), (4, 4, 2, 4, 2), (2, 1, 2, (3, 0, 2), 3), (2, 2, 2, (1, 3, 0, 2), 4),
    (3, 3, 2, (3, 1), 2),
)
#: Shapes of the windowed consumer (the GPU layer's order; every rank producer and consumer, P == Q): every
#: window 1..S, both policies, two streams and serial (`window_configs`).
QUICK_WINDOW_SHAPES: Tuple[Shape, ...] = (
    (1, 1, 1, 2, 2), (1, 1, 2, 3, 2), (2, 2, 2, 3, 2), (2, 2, 2, 4, 2), (3, 3, 2, 3, 1), (2, 2, 3, 4, 1),
    (2, 2, 2, (3, 1, 2), 3),
)
FULL_WINDOW_SHAPES: Tuple[Shape, ...] = QUICK_WINDOW_SHAPES + (
    (1, 1, 3, 7, 2), (2, 2, 1, 3, 2), (2, 2, 3, 6, 2), (3, 3, 2, 4, 2), (3, 3, 3, 6, 2),
    (2, 2, 3, (4, 1, 2), 3), (3, 3, 2, (3, 1), 2),
)
#: Cross-checks of the windowed consumer's reduction: (shape, window) explored unreduced.
QUICK_WINDOW_CROSS_CHECKS: Tuple[Tuple[Shape, int], ...] = (((2, 2, 2, 3, 1), 1), ((2, 2, 2, 3, 1), 2))
FULL_WINDOW_CROSS_CHECKS: Tuple[Tuple[Shape, int], ...] = QUICK_WINDOW_CROSS_CHECKS + (
    ((2, 2, 2, 4, 2), 1), ((2, 2, 2, 4, 2), 2), ((3, 3, 2, 3, 1), 2), ((2, 2, 3, 4, 1), 3),
)
FULL_CROSS_CHECKS: Tuple[CrossCheck, ...] = QUICK_CROSS_CHECKS + (
    ((2, 2, 2, 2, 1), True, False), ((2, 2, 2, 3, 1), True, False),
    ((2, 2, 2, 4, 2), False, False), ((2, 2, 2, 4, 2), True, True), ((2, 2, 2, 4, 2), True, False),
    ((3, 3, 1, 2, 1), False, False), ((3, 3, 2, 4, 2), True, True),
)


def window_configs(shape: Shape) -> List[ModelConfig]:
    """The windowed consumer (the GPU layer) on ``shape``: every window ``1..num_slots``, both policies;
    two streams, serial (`protocol.windowed_enqueue_order`), and each rank's call as its captured graph
    (`protocol.call_dependency_graph`) run one item at a time in any topological order or concurrently."""
    return [ModelConfig(*shape, ack_policy=policy, serial=serial, expert_window=width, graph=graph)
            for width in range(1, shape[2] + 1) for graph in (False, True) for serial in (False, True)
            for policy in (AckPolicy.CONSERVATIVE, AckPolicy.EARLY)]


def protocol_configs(shapes: Sequence[Shape], cross_checks: Sequence[CrossCheck] = (),
                     mutant: Optional[str] = None, window_shapes: Sequence[Shape] = (),
                     window_cross_checks: Sequence[Tuple[Shape, int]] = ()) -> List[ModelConfig]:
    """Every configuration the real protocol (or an equivalence variant) is checked in.

    Per shape: both ack policies with two streams, and serial streams with every allowed lookahead
    (``0..num_slots-1``) and with two mixes of lookaheads over the ranks, all with coarse steps and
    partial-order reduction. Per window shape (the protocol only): `window_configs`; per window
    cross-check, the two-stream runs of both policies without reduction. Each cross-check adds two-stream
    runs of both policies with the given step granularity and reduction.
    """
    configs = []
    for shape in shapes:
        for policy in (AckPolicy.CONSERVATIVE, AckPolicy.EARLY):
            configs.append(ModelConfig(*shape, ack_policy=policy, mutant=mutant))
        for lookahead in range(shape[2]):
            configs.append(ModelConfig(*shape, serial=True, lookahead=lookahead, mutant=mutant))
        ranks, slots = max(shape[0], shape[1]), shape[2]
        if ranks > 1 and slots > 1:
            # Ranks with different lookaheads: the rule is per rank (0 and S-1, alternating, and the reverse).
            for phase in (0, 1):
                mixed = tuple((slots - 1) * ((r + phase) % 2) for r in range(ranks))
                configs.append(ModelConfig(*shape, serial=True, lookahead=mixed, mutant=mutant))
    if mutant is None:
        for shape in window_shapes:
            configs += window_configs(shape)
        for shape, width in window_cross_checks:
            for policy in (AckPolicy.CONSERVATIVE, AckPolicy.EARLY):
                configs.append(ModelConfig(*shape, ack_policy=policy, expert_window=width, reduce=False))
    for shape, fine, reduce in cross_checks:
        for policy in (AckPolicy.CONSERVATIVE, AckPolicy.EARLY):
            configs.append(ModelConfig(*shape, ack_policy=policy, mutant=mutant, fine=fine, reduce=reduce))
    if mutant is None:
        configs += split_configs(shapes)
    return configs


def split_configs(shapes: Sequence[Shape]) -> List[ModelConfig]:
    """The split producer (``split_acquire``) on ``shapes``: both policies with two streams, and serial
    streams with the default lookahead."""
    configs = []
    for shape in shapes:
        for policy in (AckPolicy.CONSERVATIVE, AckPolicy.EARLY):
            configs.append(ModelConfig(*shape, ack_policy=policy, split_acquire=True))
        configs.append(ModelConfig(*shape, serial=True, split_acquire=True))
    return configs


def mutant_configs(spec: MutantSpec, shapes: Sequence[Shape]) -> List[ModelConfig]:
    """Configurations a mutant is tried in, smallest first (the first violation kills it)."""
    configs = []
    for shape in sorted((sh for sh in shapes if isinstance(sh[3], int)),  # one chunk count for every call
                        key=lambda sh: (sh[0] * sh[1] * sh[3] * sh[4], sh)):
        P, Q, S, N, C = shape
        if Q < spec.min_consumers or C < spec.min_calls or S < spec.min_slots or (
                spec.needs_wrap and N <= S and C < 2):
            continue
        if spec.window and (P != Q or (spec.needs_wrap and N <= S)):  # a slot reused within the call
            continue
        policies = (spec.policy,) if spec.policy is not None else (AckPolicy.CONSERVATIVE, AckPolicy.EARLY)
        width = S + 1 if spec.name == "window_exceeds_slots" else 1
        for policy in policies:
            configs.append(ModelConfig(*shape, ack_policy=policy, serial=spec.serial, mutant=spec.name,
                                       expert_window=width if spec.window else None, graph=spec.graph,
                                       split_acquire=spec.split))
    return configs
