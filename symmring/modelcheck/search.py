"""The search: `explore` visits every state reachable in one `ModelConfig`, breadth-first, and returns a
`RunResult` with the first (a shortest) `Violation` and its trace."""

from __future__ import annotations

import dataclasses
import time
from array import array
from typing import Dict, List, Optional

from ..errors import ConfigError
from .config import ModelConfig
from .invariants import INV_LIVENESS
from .model import RingModel


@dataclasses.dataclass
class Violation:
    """The first (shallowest) violation found: which invariant, why, and the step-by-step trace."""

    invariant: str
    message: str
    trace: List[str]


@dataclasses.dataclass
class RunResult:
    """Outcome of exploring one `ModelConfig`."""

    config: ModelConfig
    states: int
    transitions: int
    terminal_states: int
    seconds: float
    violation: Optional[Violation]

    def to_json(self) -> dict:
        """A JSON-serialisable summary."""
        data = {
            "config": self.config.label(),
            "shape": list(self.config.shape()),
            "ack_policy": self.config.ack_policy.name,
            "serial": self.config.serial,
            "lookahead": self.config.effective_lookahead() if self.config.serial else None,
            "mutant": self.config.mutant,
            "states": self.states,
            "transitions": self.transitions,
            "terminal_states": self.terminal_states,
            "seconds": round(self.seconds, 3),
            "violation": None,
        }
        if self.violation is not None:
            data["violation"] = dataclasses.asdict(self.violation)
        return data


def _trace(model: RingModel, states: List[bytes], parents: array, idx: int) -> List[str]:
    path = []
    while idx >= 0:
        path.append(idx)
        idx = parents[idx]
    path.reverse()
    lines = []
    for step, (a, b) in enumerate(zip(path, path[1:]), 1):
        label = next(lbl for lbl, child, _ in model.successors(states[a]) if child == states[b])
        lines.append(f"{step:3d}. {model.describe(label)}")
    return lines


def explore(cfg: ModelConfig, max_states: Optional[int] = None) -> RunResult:
    """Breadth-first search of every state reachable in ``cfg``; stops at the first violation.

    Breadth-first order makes the reported counterexample a shortest one.

    Args:
        cfg: the configuration to explore.
        max_states: give up (raise) beyond this many states; ``None`` for no bound.

    Returns:
        A `RunResult`; ``violation`` is ``None`` when every invariant held in every reachable state.

    Raises:
        ConfigError: bad configuration, or the state space exceeded ``max_states``.

    Example:
        >>> explore(ModelConfig(1, 1, 2, 3, 1)).violation is None
        True
    """
    model = RingModel(cfg)
    start = time.perf_counter()
    init = model.initial()
    index: Dict[bytes, int] = {init: 0}
    states: List[bytes] = [init]
    parents = array("i", [-1])
    transitions = 0
    terminal = 0
    violation: Optional[Violation] = None
    i = 0
    while i < len(states):
        state = states[i]
        succs = model.successors(state)
        if not succs:
            terminal += 1
            if not model.is_final(state):
                blocked = "; ".join(model.blocked(state))
                violation = Violation(INV_LIVENESS,
                                      f"deadlock: a non-final state with no enabled step: {blocked}",
                                      _trace(model, states, parents, i))
                break
            final = model.final_violation(state)
            if final is not None:
                violation = Violation(final[0], final[1], _trace(model, states, parents, i))
                break
        for label, child, bad in succs:
            transitions += 1
            if bad is not None:
                trace = _trace(model, states, parents, i)
                trace.append(f"{len(trace) + 1:3d}. {model.describe(label)}   <-- {bad[0]}")
                violation = Violation(bad[0], bad[1], trace)
                break
            if child not in index:
                index[child] = len(states)
                states.append(child)
                parents.append(i)
        if violation is not None:
            break
        if max_states is not None and len(states) > max_states:
            raise ConfigError(f"{cfg.label()}: more than max_states={max_states} states")
        i += 1
    return RunResult(cfg, len(states), transitions, terminal, time.perf_counter() - start, violation)
