"""One seeded MoE problem in vLLM's terms, shared by the tests of `symmring.integrations.vllm` (CPU, under
mpiexec, on GPUs, and against vLLM itself): every rank builds the same global problem (all experts in vLLM's
``w13``/``w2`` layouts, every rank's tokens and routing) and slices its own part.

The reference is written here from the definition (per token: the sum over its experts of ``weight *
w2 @ (silu(gate) * up)``, gate = the first ``inter`` rows of ``w13``), in float32, independent of symmring's
own references.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from symmring.moe.weights import quantize_blocks


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


class ExchangeCounter:
    """Counts the bounded host exchanges of a context (`symmring.collective.Collectives.allgather`, which
    ``barrier`` and ``agree`` use too) while installed: ``with ExchangeCounter(ctx) as counter: ...``."""

    def __init__(self, ctx):
        self.collectives = ctx.collectives
        self.count = 0
        self.what: List[str] = []

    def __enter__(self):
        original = self.collectives.allgather

        def counted(value, *, what, timeout_s=None):
            self.count += 1
            self.what.append(what)
            return original(value, what=what, timeout_s=timeout_s)

        self.collectives.allgather = counted
        return self

    def __exit__(self, *exc):
        del self.collectives.allgather  # the instance attribute: the class's method again
        return False
