"""One seeded MoE problem in vLLM's terms, shared by the tests of `symmring.integrations.vllm` (CPU, under
mpiexec, on GPUs, and against vLLM itself): every rank builds the same global problem (all experts in vLLM's
``w13``/``w2`` layouts, every rank's tokens and routing) and slices its own part.

The reference is written here from the definition (per token: the sum over its experts of ``weight *
w2 @ (silu(gate) * up)``, gate = the first ``inter`` rows of ``w13``), in float32, independent of symmring's
own references.
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

import torch

from symmring.errors import SymmringError
from symmring.moe.weights import quantize_blocks
from exchanges import ExchangeCounter  # noqa: F401 - the vLLM tests' counter of host exchanges


@dataclasses.dataclass
class Problem:
    w13: torch.Tensor  # [E, 2 * inter, hidden]: bf16, or fp8 e4m3 (then w13_scale)
    w2: torch.Tensor  # [E, hidden, inter]
    w13_scale: Optional[torch.Tensor]
    w2_scale: Optional[torch.Tensor]
    x: List[torch.Tensor]  # per rank: bf16 [n_r, hidden]
    topk_ids: List[torch.Tensor]  # per rank: int64 [n_r, topk], global expert ids
    topk_weights: List[torch.Tensor]  # per rank: float32 [n_r, topk]

    @property
    def counts(self) -> List[int]:
        return [int(x.shape[0]) for x in self.x]

    def local(self, rank: int, world: int, device="cpu"):
        """``(w13, w2, w13_scale, w2_scale)`` of ``rank``'s consecutive experts, on ``device``."""
        per = self.w13.shape[0] // world
        cut = slice(rank * per, (rank + 1) * per)
        scales = (None, None) if self.w13_scale is None else (self.w13_scale[cut].to(device),
                                                              self.w2_scale[cut].to(device))
        return (self.w13[cut].to(device), self.w2[cut].to(device)) + scales

    def dense(self):
        """float32 ``(w13, w2)``: the bf16 weights, or the fp8 ones dequantised block by block."""
        if self.w13_scale is None:
            return self.w13.float(), self.w2.float()
        return _dequantized(self.w13, self.w13_scale), _dequantized(self.w2, self.w2_scale)


def _dequantized(q, scale):
    full = scale.repeat_interleave(128, 1)[:, :q.shape[1]].repeat_interleave(128, 2)[:, :, :q.shape[2]]
    return q.float() * full


def make_problem(seed: int, counts: List[int], *, num_experts: int, hidden: int, inter: int, topk: int,
                 fp8: bool = False) -> Problem:
    """The same problem on every rank from ``seed``: unit-scale experts, softmax top-k routing (renormalised),
    every rank's ``counts[r]`` tokens."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    scales = (None, None)
    if fp8:
        (w13, s13), (w2, s2) = quantize_blocks(w13), quantize_blocks(w2)
        scales = (s13, s2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    xs, ids, weights = [], [], []
    for n in counts:
        xs.append(torch.randn(n, hidden, generator=g).bfloat16())
        probs = torch.softmax(torch.randn(n, num_experts, generator=g), dim=-1)
        w, i = probs.topk(topk, dim=-1)
        ids.append(i)
        weights.append((w / w.sum(dim=-1, keepdim=True)).float())
    return Problem(w13, w2, scales[0], scales[1], xs, ids, weights)


def reference(problem: Problem, rank: int) -> torch.Tensor:
    """float32 ``[n, hidden]``: rank ``rank``'s output rows from the definition (module docstring)."""
    w13, w2 = problem.dense()
    inter = w13.shape[1] // 2
    x, ids, weights = problem.x[rank].float(), problem.topk_ids[rank], problem.topk_weights[rank]
    y = torch.zeros(x.shape[0], w2.shape[1])
    for k in range(ids.shape[1]):
        h = torch.einsum("nh,nih->ni", x, w13[ids[:, k]])
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y += weights[:, k:k + 1] * torch.einsum("ni,nhi->nh", act, w2[ids[:, k]])
    return y


def steps_problem(seed: int, counts: List[List[int]], **shape) -> Problem:
    """One layer's problem over several model steps: ``counts[step][rank]`` tokens; rank r's tokens of step s are
    the problem's ``x[s * world + r]`` (one set of weights for every step). ``shape``: `make_problem`'s."""
    return make_problem(seed, [c for step in counts for c in step], **shape)


#: Faults `fault_step` injects on one rank's call of the step's first layer.
FAULTS = ("refused", "skipped", "stall")


def fault_step(layers, problems: List[Problem], step: int, counts, *, rank: int, world: int, fault=None,
               culprit: int = -1, stall_s: float = 0.0, device="cpu") -> dict:
    """One vLLM model step on this rank: each of ``layers`` (`GivenRoutingLayer`) called in turn on its problem's
    rows of ``step`` (`steps_problem`), every rank's ``counts`` given. ``fault`` (None, or one of `FAULTS`) hits
    ``culprit``'s call of the first layer: ``refused`` (x of another hidden size: a check only that rank can
    see, inside its step), ``skipped`` (its model skips the layer: its call sequence runs one call behind the
    others'), ``stall`` (its host sleeps ``stall_s`` first). Returns what happened here: the errors raised
    (named), the wrong rows of the calls that returned (NaN included), and of those the finite ones."""
    record = dict(errors=[], wrong=0, finite_wrong=0)
    for li, layer in enumerate(layers):
        p, i = problems[li], step * world + rank
        x, ids, w = (t.to(device) for t in (p.x[i], p.topk_ids[i], p.topk_weights[i]))
        hit = li == 0 and rank == culprit
        if hit and fault == "skipped":
            continue
        if hit and fault == "refused":
            x = x[:, :-8].contiguous()
        if hit and fault == "stall":
            time.sleep(stall_s)
        try:
            y = layer(x, ids, w, counts).float().cpu()  # a server that reads its rows (synchronised)
        except SymmringError as exc:  # a server that logs the error and goes on with its next call
            record["errors"].append(f"step {step} layer {li}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        want = reference(p, i)
        if not want.numel():
            continue
        bad = ~torch.isclose(y, want, atol=2e-2 + 2e-2 * want.abs().max().item(), rtol=0).all(dim=1)
        record["wrong"] += int(bad.sum())
        record["finite_wrong"] += int((bad & torch.isfinite(y).all(dim=1)).sum())
    return record


def fault_verdict(records: List[dict], after: dict) -> List[str]:
    """The problems of one rank's `fault_step` records of steps 0 (clean), 1 (the fault) and 2 (clean), and
    ``after``, the step after a reset: the clean step right, an error raised in the fault's step or the next, no
    finite wrong rows from a call that did not raise, no wrong rows without an error within two steps, the step
    after reset right."""
    found = []
    if records[0]["errors"] or records[0]["wrong"]:
        found.append(f"the clean step 0 failed: {records[0]}")
    if not (records[1]["errors"] or records[2]["errors"]):
        found.append("no error raised in the fault's step or the next")
    for s, rec in enumerate(records):
        if rec["finite_wrong"]:
            found.append(f"step {s}: {rec['finite_wrong']} finite wrong rows from calls that did not raise")
        if rec["wrong"] and not (rec["errors"] or (s + 1 < len(records) and records[s + 1]["errors"])):
            found.append(f"step {s}: {rec['wrong']} wrong rows and no error within two steps")
    if after["errors"] or after["wrong"]:
        found.append(f"the step after reset: {after}")
    return found
