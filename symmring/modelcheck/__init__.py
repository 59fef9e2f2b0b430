"""Explicit-state model checker of the chunk-ready ring protocol (``python -m symmring.modelcheck``).

The model is the protocol of `symmring.protocol`'s module docstring, with every generation, slot and mask
computed by the functions of `symmring.protocol` (``generation``, ``next_base``, ``slot_of``,
``is_ready``, ``ack_bit``, ``required_mask``, ``full_mask``, ``mask_complete``, ``enqueue_order``). A
breadth-first search visits every reachable state once (states are ``bytes``, hashed in a dict) and checks
the five ring invariants (docs/MODELCHECK.md section 2) on every transition and every terminal state. Pure
Python, no dependencies. ``docs/MODELCHECK.md`` explains the model, the step granularity and the figures.

Usage::

    python -m symmring.modelcheck            # full run (several minutes)
    python -m symmring.modelcheck --quick    # CI size (seconds)
    python -m symmring.modelcheck --config 2,2,2,4,2 --mutant fence_removed
    python -m symmring.modelcheck --quick --json out.json

The last line printed is ``modelcheck: states=<N> violations=<V> mutants_killed=<K>/<M>``; the exit status
is non-zero when the real protocol violates an invariant (V > 0) or a mutant survives (K < M).

The package, by role: `invariants` (the five invariants by name), `mutants` (the broken variants and the
equivalent ones), `config` (`ModelConfig`, `Shape`), `model` (`RingModel`: state encoding, steps, the
invariants checked on each step, trace text), `search` (`explore`: the breadth-first search of one
configuration), `suites` (the shapes and the configurations each check explores), `runner` (`check`,
`run_mutant`, the `Report` and its text) and `cli` (``main``). Every public name is importable from
``symmring.modelcheck``.
"""

from .cli import main
from .config import ModelConfig, Shape
from .invariants import (INV_COMBINE_ONCE, INV_EXACT_READ, INV_LIVENESS, INV_NO_STALE_WAIT, INV_REUSE,
                         INVARIANTS)
from .model import OP_ACK, OP_COMBINE, OP_READ_LAYOUT, OP_READ_ROUTE, OP_WAIT, Label, RingModel, Successor
from .mutants import (EQUIVALENT_VARIANTS, FINE_MUTANTS, GRAPH_MUTANTS, MUTANT_NAMES, MUTANTS, WINDOW_MUTANTS,
                      MutantSpec)
from .runner import MutantResult, Report, check, run_mutant, summary_table
from .search import RunResult, Violation, explore
from .suites import (FULL_CROSS_CHECKS, FULL_SHAPES, FULL_WINDOW_CROSS_CHECKS, FULL_WINDOW_SHAPES, QUICK_CROSS_CHECKS,
                     QUICK_SHAPES, QUICK_WINDOW_CROSS_CHECKS, QUICK_WINDOW_SHAPES, CrossCheck, mutant_configs,
                     protocol_configs, split_configs, window_configs)

__all__ = [
    "INV_COMBINE_ONCE", "INV_EXACT_READ", "INV_LIVENESS", "INV_NO_STALE_WAIT", "INV_REUSE", "INVARIANTS",
    "EQUIVALENT_VARIANTS", "FINE_MUTANTS", "GRAPH_MUTANTS", "MUTANT_NAMES", "MUTANTS", "WINDOW_MUTANTS",
    "MutantSpec",
    "ModelConfig", "Shape",
    "OP_ACK", "OP_COMBINE", "OP_READ_LAYOUT", "OP_READ_ROUTE", "OP_WAIT", "Label", "RingModel", "Successor",
    "RunResult", "Violation", "explore",
    "FULL_CROSS_CHECKS", "FULL_SHAPES", "FULL_WINDOW_CROSS_CHECKS", "FULL_WINDOW_SHAPES", "QUICK_CROSS_CHECKS",
    "QUICK_SHAPES", "QUICK_WINDOW_CROSS_CHECKS", "QUICK_WINDOW_SHAPES", "CrossCheck", "mutant_configs",
    "protocol_configs", "split_configs", "window_configs",
    "MutantResult", "Report", "check", "run_mutant", "summary_table",
    "main",
]
