"""The command line (``python -m symmring.modelcheck``): its options, the suite they choose, what it prints
and the exit status."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence, TextIO, Tuple

from ..errors import ConfigError
from .config import Shape
from .mutants import MUTANT_NAMES, MUTANTS
from .runner import check, summary_table
from .suites import (FULL_CROSS_CHECKS, FULL_SHAPES, FULL_WINDOW_CROSS_CHECKS, FULL_WINDOW_SHAPES, QUICK_CROSS_CHECKS,
                     QUICK_SHAPES, QUICK_WINDOW_CROSS_CHECKS, QUICK_WINDOW_SHAPES, CrossCheck)


def _parse_shape(text: str) -> Shape:
    """``P,Q,S,N,C``; ``N`` may be one count per call joined by ``/`` (e.g. ``2,2,2,3/1/3,3``)."""
    try:
        parts = text.split(",")
        values = [tuple(int(n) for n in part.split("/")) if i == 3 and "/" in part else int(part)
                  for i, part in enumerate(parts)]
    except ValueError:
        values = []
    ints = [v for v in values if isinstance(v, int)]
    if len(values) != 5 or not ints or min(ints) <= 0 or (isinstance(values[3], tuple) and len(values[3]) != values[4]):
        raise ConfigError(f"--config={text!r}: expected five positive integers P,Q,S,N,C (N may be one count per "
                          "call, joined by '/')")
    return tuple(values)  # type: ignore[return-value]


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout) -> int:
    """Command line entry point; returns the exit status (0: no violation and every mutant killed).

    Example:
        >>> main(["--config", "1,1,2,3,2", "--mutant", "reset_forgotten"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="python -m symmring.modelcheck",
                                     description=sys.modules[__package__].__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-size configurations")
    parser.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    parser.add_argument("--config", metavar="P,Q,S,N,C", help="check only this configuration")
    parser.add_argument("--mutant", metavar="NAME", action="append", choices=MUTANT_NAMES,
                        help="run only this mutant (repeatable); the real protocol is then not checked")
    parser.add_argument("--list-mutants", action="store_true", help="list the mutants and exit")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every configuration's line, each mutant's counterexample trace (default: a short table)")
    args = parser.parse_args(argv)
    if args.list_mutants:
        for spec in MUTANTS:
            out.write(f"{spec.name}: {spec.description} (expected: {spec.expected})\n")
        return 0
    try:
        window_cross_checks: Sequence[Tuple[Shape, int]] = ()
        if args.config:
            shapes: Sequence[Shape] = (_parse_shape(args.config),)
            cross_checks: Sequence[CrossCheck] = ()
            window_shapes: Sequence[Shape] = tuple(sh for sh in shapes if sh[0] == sh[1])
        elif args.quick:
            shapes, cross_checks = QUICK_SHAPES, QUICK_CROSS_CHECKS
            window_shapes, window_cross_checks = QUICK_WINDOW_SHAPES, QUICK_WINDOW_CROSS_CHECKS
        else:
            shapes, cross_checks = FULL_SHAPES, FULL_CROSS_CHECKS
            window_shapes, window_cross_checks = FULL_WINDOW_SHAPES, FULL_WINDOW_CROSS_CHECKS
        start = time.perf_counter()
        # The equivalence variants skip the full run's largest unreduced cross-checks (minutes each).
        report = check(shapes, cross_checks, mutants=args.mutant, check_protocol=not args.mutant,
                       log=out if args.verbose else None,
                       equivalence_cross_checks=[cc for cc in cross_checks if cc in QUICK_CROSS_CHECKS],
                       window_shapes=window_shapes, window_cross_checks=window_cross_checks)
    except ConfigError as exc:
        parser.error(str(exc))
    if not args.verbose:
        out.write(summary_table(report))
    out.write(f"total time {time.perf_counter() - start:.1f}s\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report.to_json(), handle, indent=1)
    out.write(report.summary_line() + "\n")
    return 0 if report.ok() else 1
