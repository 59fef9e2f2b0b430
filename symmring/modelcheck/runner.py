"""Running the checks: the protocol, the equivalence variants and the mutants over a suite (`check`,
`run_mutant`), the `Report`, and its text (progress lines, counterexample traces, `summary_table`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from ..errors import ConfigError
from .config import ModelConfig, Shape
from .mutants import _MUTANT_BY_NAME, EQUIVALENT_VARIANTS, MUTANT_NAMES, MutantSpec
from .search import RunResult, Violation, explore
from .suites import CrossCheck, mutant_configs, protocol_configs


@dataclasses.dataclass
class MutantResult:
    """Outcome of one mutant: killed (by which invariant, in which configuration) or survived."""

    spec: MutantSpec
    runs: List[RunResult]
    #: The killing configuration explored again with the partial-order reduction on (evidence that the
    #: reduction used for the protocol does not hide this bug); ``None`` when not killed.
    reduced_run: Optional[RunResult] = None

    @property
    def killing_run(self) -> Optional[RunResult]:
        """The run that produced the counterexample, if any."""
        return next((run for run in self.runs if run.violation is not None), None)

    @property
    def killed(self) -> bool:
        """Whether some configuration produced a counterexample."""
        return self.killing_run is not None

    @property
    def invariant(self) -> Optional[str]:
        """The violated invariant of the counterexample."""
        run = self.killing_run
        return run.violation.invariant if run is not None else None


def run_mutant(spec: MutantSpec, shapes: Sequence[Shape], window_shapes: Sequence[Shape] = ()) -> MutantResult:
    """Explore the mutant's configurations, smallest first, until one yields a counterexample (a windowed
    mutant on ``window_shapes``)."""
    runs = []
    for cfg in mutant_configs(spec, window_shapes if spec.window else shapes):
        run = explore(cfg)
        runs.append(run)
        if run.violation is not None:
            return MutantResult(spec, runs, explore(dataclasses.replace(cfg, reduce=True)))
    return MutantResult(spec, runs)


@dataclasses.dataclass
class Report:
    """Everything one invocation checked."""

    protocol_runs: List[RunResult]
    mutants: List[MutantResult]
    equivalents: Dict[str, List[RunResult]]

    @property
    def states(self) -> int:
        """States explored for the real protocol, summed over its configurations."""
        return sum(run.states for run in self.protocol_runs)

    @property
    def violations(self) -> int:
        """Configurations in which the real protocol violated an invariant."""
        return sum(run.violation is not None for run in self.protocol_runs)

    @property
    def mutants_killed(self) -> int:
        """Mutants with a counterexample."""
        return sum(result.killed for result in self.mutants)

    def summary_line(self) -> str:
        """The last line printed."""
        return (f"modelcheck: states={self.states} violations={self.violations} "
                f"mutants_killed={self.mutants_killed}/{len(self.mutants)}")

    def ok(self) -> bool:
        """No violation of the real protocol and every mutant killed."""
        return self.violations == 0 and self.mutants_killed == len(self.mutants)

    def to_json(self) -> dict:
        """A JSON-serialisable report."""
        return {
            "protocol": [run.to_json() for run in self.protocol_runs],
            "mutants": [{
                "name": result.spec.name,
                "description": result.spec.description,
                "expected_invariant": result.spec.expected,
                "killed": result.killed,
                "invariant": result.invariant,
                "runs": [run.to_json() for run in result.runs],
                "reduced_run": result.reduced_run.to_json() if result.reduced_run else None,
            } for result in self.mutants],
            "equivalent_variants": {name: [run.to_json() for run in runs]
                                    for name, runs in self.equivalents.items()},
            "states": self.states,
            "violations": self.violations,
            "mutants_killed": self.mutants_killed,
            "mutants_total": len(self.mutants),
        }


def check(shapes: Sequence[Shape],
          cross_checks: Sequence[CrossCheck] = (),
          mutants: Optional[Sequence[str]] = None, check_protocol: bool = True,
          log: Optional[TextIO] = None,
          equivalence_cross_checks: Optional[Sequence[CrossCheck]] = None,
          window_shapes: Sequence[Shape] = (),
          window_cross_checks: Sequence[Tuple[Shape, int]] = ()) -> Report:
    """Check the protocol, the mutants and the equivalence variants over ``shapes``.

    Args:
        shapes: ``(P, Q, S, N, C)`` tuples.
        cross_checks: ``(shape, fine, reduce)`` runs that cross-check the step granularity and reduction.
        window_shapes: shapes of the windowed consumer (the GPU layer's order), P == Q; the windowed
            mutants run on them.
        window_cross_checks: ``(shape, window)`` runs of the windowed consumer without reduction.
        mutants: names of the mutants to run (``None``: all of `MUTANT_NAMES`).
        check_protocol: also explore the real protocol and the equivalence variants.
        log: where progress lines go (``None``: nowhere).
        equivalence_cross_checks: cross-checks for the equivalence variants (``None``: ``cross_checks``).

    Returns:
        A `Report`.

    Raises:
        ConfigError: an unknown mutant name or a bad shape.

    Example:
        >>> check([(1, 1, 2, 3, 2)], mutants=["reset_forgotten"]).ok()
        True
    """
    names = MUTANT_NAMES if mutants is None else tuple(mutants)
    for name in names:
        if name not in _MUTANT_BY_NAME:
            raise ConfigError(f"mutant={name!r}: expected one of {MUTANT_NAMES}")
    write = log.write if log is not None else (lambda text: None)
    protocol_runs: List[RunResult] = []
    equivalents: Dict[str, List[RunResult]] = {}
    if check_protocol:
        write("== protocol ==\n")
        for cfg in protocol_configs(shapes, cross_checks, window_shapes=window_shapes,
                                    window_cross_checks=window_cross_checks):
            protocol_runs.append(_explore_and_log(cfg, write))
        for variant in EQUIVALENT_VARIANTS:
            write(f"== equivalence variant {variant} (expected: no counterexample) ==\n")
            equivalents[variant] = []
            variant_checks = cross_checks if equivalence_cross_checks is None else equivalence_cross_checks
            for cfg in protocol_configs(shapes, variant_checks, mutant=variant):
                if cfg.serial:
                    continue
                equivalents[variant].append(_explore_and_log(cfg, write))
    write("== mutants ==\n")
    results = []
    for name in names:
        result = run_mutant(_MUTANT_BY_NAME[name], shapes, window_shapes)
        results.append(result)
        write(_mutant_text(result))
    report = Report(protocol_runs, results, equivalents)
    for variant, runs in equivalents.items():
        killed = [run for run in runs if run.violation is not None]
        verdict = (f"KILLED in {len(killed)} configurations (not equivalent)" if killed else
                   f"equivalent: no counterexample in {len(runs)} configurations, "
                   f"{sum(run.states for run in runs)} states")
        write(f"finding: variant {variant}: {verdict}\n")
    return report


def _explore_and_log(cfg: ModelConfig, write: Callable[[str], object]) -> RunResult:
    """`explore` ``cfg``, then ``write`` its line and, after a violation, its counterexample."""
    run = explore(cfg)
    write(_run_line(run))
    if run.violation is not None:
        write(_violation_text(run.violation))
    return run


def _run_line(run: RunResult) -> str:
    verdict = "all invariants held" if run.violation is None else f"VIOLATION {run.violation.invariant}"
    return (f"  {run.config.label():<62} states={run.states:>8} transitions={run.transitions:>9} "
            f"time={run.seconds:7.2f}s  {verdict}\n")


def _violation_text(violation: Violation) -> str:
    lines = [f"    {violation.invariant}: {violation.message}\n", "    shortest counterexample:\n"]
    lines += [f"    {line}\n" for line in violation.trace]
    return "".join(lines)


def _mutant_text(result: MutantResult) -> str:
    spec = result.spec
    head = f"mutant {spec.name}: {spec.description}\n"
    run = result.killing_run
    if run is None:
        tried = ", ".join(r.config.label() for r in result.runs) or "no applicable configuration"
        return head + f"  SURVIVED (tried: {tried})\n"
    match = "as expected" if run.violation.invariant == spec.expected else f"expected {spec.expected}"
    text = (f"  KILLED by {run.violation.invariant} ({match}) in {run.config.label()} after "
            f"{run.states} states, {run.seconds:.2f}s\n")
    reduced = result.reduced_run
    if reduced is not None:
        outcome = (f"also killed by {reduced.violation.invariant}" if reduced.violation is not None
                   else "NOT killed")
        text += f"  with partial-order reduction: {outcome} ({reduced.states} states)\n"
    return head + text + _violation_text(run.violation)


def summary_table(report: "Report") -> str:
    """The short table printed without ``-v``: one row per kind of check and per mutant (the real protocol's
    violations, if any, in full: they are the finding)."""
    rows = []
    runs = report.protocol_runs
    if runs:
        rows.append(("protocol", len(runs), sum(r.states for r in runs),
                     "all invariants held" if not report.violations else f"{report.violations} VIOLATION(S)"))
    for variant, variant_runs in report.equivalents.items():
        killed = sum(r.violation is not None for r in variant_runs)
        rows.append((f"variant {variant}", len(variant_runs), sum(r.states for r in variant_runs),
                     "equivalent (no counterexample)" if not killed else f"KILLED in {killed} (not equivalent)"))
    for result in report.mutants:
        run = result.killing_run
        if run is None:
            rows.append((f"mutant {result.spec.name}", len(result.runs), sum(r.states for r in result.runs),
                         "SURVIVED"))
        else:
            match = "" if result.invariant == result.spec.expected else f" (expected {result.spec.expected})"
            rows.append((f"mutant {result.spec.name}", len(result.runs), run.states,
                         f"killed by {result.invariant}{match}"))
    width = max([len(r[0]) for r in rows] + [5])
    lines = [f"{'check':<{width}}  {'configs':>7}  {'states':>9}  result"]
    lines += [f"{name:<{width}}  {n:>7}  {states:>9}  {result}" for name, n, states, result in rows]
    text = "\n".join(lines) + "\n"
    for run in runs:
        if run.violation is not None:
            text += f"{run.config.label()}:\n" + _violation_text(run.violation)
    return text
