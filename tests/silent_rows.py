"""Issue 33's end-to-end checks, shared by the CPU layer (tests/mpi) and the GPU layer (tests/gpu): every row a
rank gets back is right, or every rank raises.

A *layer set* (`Adapter`) is a few layers on one workspace, two or more of one shape (so they share a ring) and
one of another; every rank builds every layer's weights for ALL experts from one seed, so it can compute the
reference of its own rows (`reference_rows`: the NumPy reference MoE, row by row, with the call's routing).

* `refused_then_next` is the measured defect: inside a `Workspace.step` one rank's call of layer A is refused
  (one token more than the step declared), that rank catches the `ConfigError` and calls layer B; the others call
  A then B. Every rank must raise a named error in that step or at the next step's entry, and no rank may keep
  rows that differ from the reference without one; after `Workspace.reset` a step is right on every rank.
* `soak` runs many steps with random per-rank counts (zero included) and injected faults -- a refused call on
  one rank, a stalled PE (a device wait past the device bound), a late host (past the device bound, within the
  host bound) -- checks every output row against the reference and returns the counts (`SoakTally`).

A *silent wrong row* is a row that differs from the reference in a step on a rank where no error was raised
within that step or the next one (at the next step's entry, or in its calls). Stricter, and counted apart: a
*finite wrong row* is a finite row that differs from the reference, returned by a call that did not raise (the
measured defect: other calls' rows, with relative errors of 0.6 to 1.2). A call may return NaN rows without
raising (the GPU layer poisons its output when a device error is pending, and raises at the next step); it may
never return finite wrong rows.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from symmring.errors import ConfigError, SymmringError
from symmring.moe import quant

#: Kinds of injected faults of the soak.
FAULTS = ("refused", "stall", "late_host")


@dataclasses.dataclass
class LayerDef:
    """One layer of a set: its shape and its global weights (float32, every expert)."""

    hidden: int
    inter: int
    num_experts: int
    topk: int
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray

    def float64(self):
        """The weights as float64 (made once)."""
        if not hasattr(self, "_w64"):
            self._w64 = tuple(np.asarray(w, np.float64) for w in (self.w_gate, self.w_up, self.w_down))
        return self._w64


def make_layer_defs(seed: int, shapes: Sequence[tuple], num_experts: int, bf16: bool) -> List[LayerDef]:
    """Weights of one layer per ``(hidden, inter, topk)`` of ``shapes``, the same on every rank (``bf16``:
    bf16-representable values, so a bf16 layer and the reference see the same weights)."""
    rng = np.random.default_rng(seed)
    defs = []
    for hidden, inter, topk in shapes:
        ws = [rng.standard_normal(s) / math.sqrt(s[-1]) for s in
              ((num_experts, inter, hidden), (num_experts, inter, hidden), (num_experts, hidden, inter))]
        ws = [_bf16(w) if bf16 else w.astype(np.float32) for w in ws]
        defs.append(LayerDef(hidden, inter, num_experts, topk, *ws))
    return defs


def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def step_inputs(seed: int, step: int, layer: int, rank: int, n: int, d: LayerDef, bf16: bool):
    """This rank's ``(x, topk_idx, topk_weights)`` of one layer's call in one step: distinct experts per token."""
    rng = np.random.default_rng([seed, step, layer, rank])
    x = rng.standard_normal((n, d.hidden)) * np.exp2(rng.uniform(-2, 2, (n, 1)))
    x = _bf16(x) if bf16 else x.astype(np.float32)
    idx = np.argsort(rng.random((n, d.num_experts)), axis=1)[:, :d.topk].astype(np.int32)
    weights = rng.random((n, d.topk)).astype(np.float32) + np.float32(0.05)
    return x, idx, weights


def reference_rows(d: LayerDef, x, idx, weights, x_format: str) -> np.ndarray:
    """float64 reference of these rows: ``x`` as the ring carries it (``x_format``: fp8 quantised and back, or
    bf16 as it is), each (token, k) through its expert (SwiGLU) in float64, combined with its weight. Row by
    row independent, so the rows of one rank are enough; BLAS (``@``) where `symmring.moe.reference` uses its
    slower row-exact products: a soak checks thousands of calls. Equal to `reference_moe` within float32
    rounding (`tests/test_silent_rows.py`)."""
    out = np.zeros((x.shape[0], d.hidden))
    if x.shape[0] == 0:
        return out
    if x_format == "fp8_e4m3":
        x = quant.decode(*quant.encode(x, x_format), x_format)
    x64 = np.asarray(x, np.float64)
    w_gate, w_up, w_down = d.float64()
    for e in np.unique(idx[idx >= 0]):
        rows, ks = np.nonzero(idx == e)
        h = x64[rows]
        with np.errstate(over="ignore"):  # silu(g) of g << 0: -0, as the reference's
            gate = h @ w_gate[e].T
            act = gate / (1.0 + np.exp(-gate)) * (h @ w_up[e].T)
        np.add.at(out, rows, weights[rows, ks, None].astype(np.float64) * (act @ w_down[e].T))
    return out


def wrong_rows(y, ref: np.ndarray, rtol: float, finite_only: bool = False) -> int:
    """Rows of ``y`` (float, any array) farther than ``rtol`` of their reference row's norm from it (NaN rows
    too, unless ``finite_only``), with a floor of ``rtol`` times the median row norm for rows whose reference is
    near zero."""
    y = np.asarray(y, np.float64)
    if y.shape != ref.shape:
        return max(y.shape[0] if y.ndim else 0, ref.shape[0])
    if not ref.shape[0]:
        return 0
    norms = np.linalg.norm(ref, axis=1)
    floor = float(np.median(norms)) if norms.size else 0.0
    diff = np.linalg.norm(y - ref, axis=1)
    finite = np.isfinite(diff)
    bad = finite & (diff > rtol * np.maximum(norms, floor))
    return int(bad.sum()) if finite_only else int(bad.sum() + (~finite).sum())


class Adapter:
    """A layer set on one backend (subclassed by the CPU and GPU tests).

    Attributes:
        ws: the `symmring.Workspace`; defs: the `LayerDef` of each layer; rank, world: this rank and the ranks;
        max_tokens: most tokens per rank; x_format: what the reference models; rtol: the row tolerance;
        bf16: inputs bf16-representable; device_bound_s: the layers' device (ring) wait bound;
        stall_layer_streams: whether a stalled call must run streamed on every rank (GPU: consumer_delay_ns).
    """

    ws = None
    defs: List[LayerDef] = []
    rank = world = max_tokens = 0
    x_format = "bf16"
    rtol = 1e-4
    bf16 = False
    device_bound_s = 1.0
    stall_layer_streams = False

    def forward(self, layer: int, x, idx, weights, *, streaming: bool = False, stall_s: float = 0.0):
        """``layer``'s call on this rank's rows: its output as a NumPy array (synchronised); ``stall_s``: this
        rank stalls its device (or its host, on the CPU) for that long in the call."""
        raise NotImplementedError

    def reference(self, layer: int, x, idx, weights) -> np.ndarray:
        """The reference of ``layer``'s call on these rows (`reference_rows`; a backend may compute the same
        elsewhere, e.g. on its device)."""
        return reference_rows(self.defs[layer], x, idx, weights, self.x_format)


@dataclasses.dataclass
class StepRecord:
    """What one step did on one rank."""

    step: int
    fault: Optional[str]  # the fault injected in this step (on any rank), or None
    culprit: int = -1
    entry_raised: bool = False  # Workspace.step raised at entry (the step ran nothing; every rank reset after)
    body_raised: bool = False  # a call of the step raised on this rank
    wrong: int = 0  # rows that differ from the reference, over the step's calls
    finite_wrong: int = 0  # of those, finite rows (returned by calls that did not raise)
    after_reset: bool = False  # the first step after a reset
    errors: List[str] = dataclasses.field(default_factory=list)


def run_step(a: Adapter, seed: int, step: int, counts: Sequence[int], fault: Optional[tuple],
             given: bool = False) -> StepRecord:
    """One step on this rank: ``counts`` (every rank's), ``fault`` None or ``(kind, culprit, layer)``; ``given``:
    the step takes ``counts`` as given (``Workspace.step(counts=...)``, no exchange)."""
    me = a.rank
    kind, culprit = fault[:2] if fault else (None, -1)
    record = StepRecord(step, kind, culprit)
    n = int(counts[me])
    if kind == "late_host" and me == culprit:
        time.sleep(1.5 * a.device_bound_s)  # past the device bound, far within the host bound
    entered = False
    try:
        with a.ws.step(n, own_router=False, counts=list(counts) if given else None):
            entered = True
            for li in range(len(a.defs)):
                _run_call(a, seed, step, li, n, fault, record)
    except SymmringError as exc:
        if entered:  # every call's error is caught in _run_call: nothing else may leave the step
            raise
        record.entry_raised = True
        record.errors.append(f"entry: {type(exc).__name__}: {exc}")
    return record


def _run_call(a: Adapter, seed: int, step: int, li: int, n: int, fault: Optional[tuple], record: StepRecord) -> None:
    """Layer ``li``'s call of a step on this rank, its rows checked, its error (named) recorded."""
    kind, culprit, fault_layer = fault if fault else (None, -1, -1)
    me, d = a.rank, a.defs[li]
    hit = li == fault_layer
    try:
        if kind == "refused" and hit and me == culprit:
            extra = step_inputs(seed, step, li, me, n + 1, d, a.bf16)
            try:
                a.forward(li, *extra)
                record.errors.append(f"layer {li}: a call of {n + 1} tokens in a step of {n} ran")
            except ConfigError as exc:  # the refusal: a named error on this rank, at once
                record.body_raised = True
                record.errors.append(f"layer {li} refused: {exc}")
            return  # a server that logs the refusal and goes on with the next layer
        x, idx, w = step_inputs(seed, step, li, me, n, d, a.bf16)
        streaming = kind == "stall" and hit and a.stall_layer_streams
        stall = 2.0 * a.device_bound_s if kind == "stall" and hit and me == culprit else 0.0
        y = a.forward(li, x, idx, w, streaming=streaming, stall_s=stall)
        ref = a.reference(li, x, idx, w)
        record.wrong += wrong_rows(y, ref, a.rtol)
        record.finite_wrong += wrong_rows(y, ref, a.rtol, finite_only=True)
    except SymmringError as exc:
        record.body_raised = True
        record.errors.append(f"layer {li}: {type(exc).__name__}: {exc}")


def raised_in(records: Dict[int, StepRecord], step: int) -> bool:
    """Whether this rank raised within ``step`` or the next one (in a call, or at the next step's entry)."""
    here, after = records.get(step), records.get(step + 1)
    return bool((here and here.body_raised) or (after and (after.entry_raised or after.body_raised)))


@dataclasses.dataclass
class SoakTally:
    """The soak's counts over every rank (`tally`)."""

    steps: int = 0
    faults: Dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    silent_wrong_rows: int = 0
    finite_wrong_rows: int = 0
    raised_everywhere: Dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    late_absorbed: int = 0
    resets: int = 0
    right_after_reset: int = 0
    unexpected_errors: int = 0
    rows_checked: int = 0
    problems: List[str] = dataclasses.field(default_factory=list)

    def line(self, what: str) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in self.faults.items())
        everywhere = ", ".join(f"{k} {self.raised_everywhere[k]}/{self.faults[k]}" for k in ("refused", "stall"))
        return (f"{what}: steps {self.steps}, faults injected ({faults}), wrong rows returned without an error "
                f"{self.silent_wrong_rows} (finite wrong rows from calls that did not raise {self.finite_wrong_rows}), "
                f"faults raised on every rank within two steps ({everywhere}), late hosts "
                f"absorbed {self.late_absorbed}/{self.faults['late_host']}, steps right again after reset "
                f"{self.right_after_reset}/{self.resets}, unexpected errors {self.unexpected_errors}, rows checked "
                f"{self.rows_checked}")


def tally(all_records: Sequence[Sequence[StepRecord]], rows: Sequence[int]) -> SoakTally:
    """The counts of every rank's step records (``all_records[rank]``); ``rows``: rows checked per rank."""
    by_rank = [{r.step: r for r in records} for records in all_records]
    t = SoakTally(steps=len(all_records[0]), rows_checked=sum(rows))
    for rec in all_records[0]:
        if rec.fault:
            t.faults[rec.fault] += 1
        if rec.after_reset:
            t.resets += 1
            ok = all(not b[rec.step].entry_raised and not b[rec.step].body_raised and b[rec.step].wrong == 0
                     for b in by_rank)
            t.right_after_reset += ok
            if not ok:
                t.problems.append(f"step {rec.step} (after a reset): " + "; ".join(
                    f"rank {r}: {b[rec.step].wrong} wrong, {b[rec.step].errors[:2]}" for r, b in enumerate(by_rank)))
    for r, b in enumerate(by_rank):
        for step, rec in b.items():
            if rec.finite_wrong:
                t.finite_wrong_rows += rec.finite_wrong
                t.problems.append(f"rank {r}, step {step} (fault {rec.fault}): {rec.finite_wrong} finite wrong rows "
                                  "from calls that did not raise")
            if rec.wrong and not raised_in(b, step):
                t.silent_wrong_rows += rec.wrong
                t.problems.append(f"rank {r}, step {step} (fault {rec.fault}): {rec.wrong} wrong rows, no error")
            previous = b.get(step - 1)
            explained = rec.fault or (previous is not None and previous.fault) or rec.after_reset
            if (rec.entry_raised or rec.body_raised) and not explained:
                t.unexpected_errors += 1
                t.problems.append(f"rank {r}, step {step}: an error without a fault: {rec.errors[:2]}")
    for rec in all_records[0]:
        if rec.fault in ("refused", "stall"):
            if all(raised_in(b, rec.step) for b in by_rank):
                t.raised_everywhere[rec.fault] += 1
            else:
                t.problems.append(f"step {rec.step}: fault {rec.fault} (rank {rec.culprit}) not raised on ranks "
                                  f"{[r for r, b in enumerate(by_rank) if not raised_in(b, rec.step)]}")
        elif rec.fault == "late_host":
            if all(not b[rec.step].body_raised and not b[rec.step].entry_raised and b[rec.step].wrong == 0
                   and not (b.get(rec.step + 1) and b[rec.step + 1].entry_raised) for b in by_rank):
                t.late_absorbed += 1
            else:
                t.problems.append(f"step {rec.step}: a late host (rank {rec.culprit}) was not absorbed: " + "; ".join(
                    f"rank {r}: {b[rec.step].errors[:1]}" for r, b in enumerate(by_rank)))
    return t


def soak(a: Adapter, *, seed: int, steps: int, fault_every: int, warmup_counts: Sequence[int],
         allgather: Callable) -> SoakTally:
    """The soak (module docstring) on this rank; ``allgather``: every rank's value (a host collective of the
    test, outside symmring). Collective. Returns the counts over every rank, the same on every rank."""
    rng = np.random.default_rng(seed)  # the same on every rank: counts and faults agree everywhere
    records: List[StepRecord] = []
    rows = 0
    reset_before = False
    last_fault, injected = -10, 0
    for step in range(steps):
        warm = step < len(warmup_counts)
        if warm:
            counts = [int(warmup_counts[step])] * a.world
        else:
            counts = [int(c) for c in rng.integers(0, a.max_tokens + 1, a.world)]
            if rng.random() < 0.15:
                counts[int(rng.integers(a.world))] = 0  # a rank with nothing to send, often
        fault = None
        if not warm and step - last_fault > 2 and rng.random() < 1.0 / fault_every:
            kind = FAULTS[injected % len(FAULTS)]  # every kind in turn; the rank and the layer at random
            fault = (kind, int(rng.integers(a.world)), int(rng.integers(len(a.defs))))
            counts[fault[1]] = max(1, counts[fault[1]])  # a call with a chunk: a stall has a wait to stall
            last_fault, injected = step, injected + 1
        record = run_step(a, seed, step, counts, fault)
        record.after_reset = reset_before
        reset_before = False
        if record.entry_raised:  # every rank raised at this entry (one exchange): every rank resets here
            a.ws.reset()
            reset_before = True
        rows += sum(counts[a.rank] for _ in a.defs) if not record.entry_raised else 0
        records.append(record)
    gathered = allgather((records, rows))
    return tally([g[0] for g in gathered], [g[1] for g in gathered])


def refused_then_next(a: Adapter, *, seed: int, culprit: int, first: int, second: int, n: int,
                      allgather: Callable, given: bool = False) -> List[str]:
    """The measured defect (module docstring) on layers ``first`` then ``second``, after a warm-up step; then the
    next step (which must raise at entry on every rank), a reset, and a step that must be right. Returns the
    problems found over every rank (the same list on every rank). ``given``: every step takes its counts as given
    (no exchange at its entry: every rank learnt of the fault in the step itself, and raises its own error)."""
    problems = []
    order = [first, second]
    counts = [n] * a.world if given else None
    warm = run_step(a, seed, 0, [n] * a.world, None, given)  # every ring made, every graph of the bucket seen
    if warm.entry_raised or warm.body_raised or warm.wrong:
        problems.append(f"rank {a.rank}: the warm-up step failed: {warm.errors[:2]}, {warm.wrong} wrong rows")
    record = StepRecord(1, "refused", culprit)
    with a.ws.step(n, own_router=False, counts=counts):
        for li in order:  # the culprit: `first` refused (caught, as a server that logs and goes on), `second`
            _run_call(a, seed, 1, li, n, ("refused", culprit, first), record)
    after = StepRecord(2, None)
    try:
        with a.ws.step(n, own_router=False, counts=counts):
            pass
    except SymmringError as exc:
        after.entry_raised = True
        after.errors.append(f"{type(exc).__name__}: {exc}")
    if after.entry_raised or given:  # given: a rank that did not raise resets too (reset is collective)
        a.ws.reset()
    right = run_step(a, seed, 3, [n] * a.world, None, given)
    mine = dict(rank=a.rank, wrong=record.wrong, finite=record.finite_wrong, raised=record.body_raised,
                entry=after.entry_raised,
                errors=record.errors + after.errors, right=not (right.entry_raised or right.body_raised or right.wrong),
                right_errors=right.errors)
    for m in allgather(mine):
        if m["wrong"] and not (m["raised"] or m["entry"]):
            problems.append(f"rank {m['rank']}: {m['wrong']} wrong rows returned without an error")
        if m["finite"]:
            problems.append(f"rank {m['rank']}: {m['finite']} finite wrong rows from calls that did not raise")
        if not m["entry"]:
            problems.append(f"rank {m['rank']}: the next step's entry did not raise ({m['errors']})")
        if not (m["raised"] or m["entry"]):
            problems.append(f"rank {m['rank']}: no named error within two steps")
        if not m["right"]:
            problems.append(f"rank {m['rank']}: the step after reset was not right: {m['right_errors'][:2]}")
    return problems
