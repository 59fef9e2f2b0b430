"""The symmring side of vLLM's fused-MoE seam, in symmring's terms only: this module imports torch and
symmring, never vLLM, so it runs (and is tested) on the GPU machine, where vLLM is not installed.

What vLLM hands an experts class, and what symmring makes of it:

* weights (`experts_from_vllm`): vLLM keeps a layer's local experts as ``w13 [E, 2 * inter, hidden]`` (the
  gate projection's rows first, then the up projection's: vLLM's loader puts ``gate_proj``/``w1`` in the first
  half and ``up_proj``/``w3`` in the second, and its ``silu_and_mul`` applies SiLU to the first half) and
  ``w2 [E, hidden, inter]``; fp8 block checkpoints add ``w13_weight_scale_inv [E, 2 * ceil(inter / 128),
  ceil(hidden / 128)]`` (gate blocks, then up blocks) and ``w2_weight_scale_inv [E, ceil(hidden / 128),
  ceil(inter / 128)]``, each the dequantisation multiplier of a 128x128 block. `Experts` takes the same
  tensors split at ``inter``.
* routing: vLLM's router has already chosen ``topk_ids`` (global expert ids) and ``topk_weights``; the layer
  runs them as given (``topk_idx``/``topk_weights``), it routes nothing itself.
* token counts (`step_counts`): vLLM exchanges every data-parallel rank's token count once per model step
  (``get_forward_context().dp_metadata.num_tokens_across_dp_cpu``); with tensor parallelism 1 the EP rank of
  a MoE layer is its DP rank, so those are the counts of every EP rank. `GivenRoutingLayer` hands them to the
  workspace's step (`given_step`: ``Workspace.step(counts=...)``), which exchanges nothing: a vLLM step adds no
  host exchange to vLLM's own.
* CUDA graphs (`capture_buckets`): vLLM captures one graph per batch size in ``cudagraph_capture_sizes`` and
  pads a step up to the next (on every DP rank); each size lands in one of symmring's token buckets
  (`symmring.moe.gpu.plan.token_bucket`), and every size of one bucket shares that bucket's plan. A call
  captured into vLLM's graph writes its own token count into the graph (`GivenRoutingLayer`:
  ``Workspace.set_call_tokens`` while capturing), since vLLM replays it without symmring.

Example:
    >>> import torch
    >>> w13, w2 = torch.zeros(2, 64, 32, dtype=torch.bfloat16), torch.zeros(2, 32, 32, dtype=torch.bfloat16)
    >>> experts = experts_from_vllm(w13, w2)
    >>> experts.num_local_experts, experts.inter, experts.hidden
    (2, 32, 32)
    >>> step_counts(5, ep_rank=1, ep_size=2, num_tokens_across_dp=torch.tensor([3, 5]))
    (3, 5)
    >>> capture_buckets([1, 2, 4, 8, 16, 24, 32, 40], max_tokens=256)[24]
    32
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional, Sequence, Tuple

from ...errors import ConfigError
from ...moe.config import Experts, RoutingConfig, ScheduleConfig, check_int
from ...moe.weights import BLOCK, dequantize_blocks

log = logging.getLogger(__name__)


def _torch():
    import torch
    return torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _shape(t) -> tuple:
    return tuple(int(s) for s in getattr(t, "shape", ()))


def experts_from_vllm(w13, w2, *, w13_scale=None, w2_scale=None, dequantize: bool = False) -> Experts:
    """This rank's experts from vLLM's layout (module docstring): ``w13 [E, 2 * inter, hidden]`` (gate rows,
    then up rows) and ``w2 [E, hidden, inter]``, bf16, or fp8 e4m3 with their block scales
    (``weight_scale_inv``).

    Args:
        w13, w2: the layer's ``w13_weight`` and ``w2_weight`` (views are taken; the layers copy them).
        w13_scale, w2_scale: float32 block scales of fp8 weights (vLLM's ``w13_weight_scale_inv`` and
            ``w2_weight_scale_inv``), else None.
        dequantize: fp8 weights as bf16 experts (``float32(q) * scale`` per 128x128 block, rounded once to
            bf16; `symmring.moe.weights.dequantize_blocks`): what the CPU layer, which takes bf16 only, runs.

    Raises:
        ConfigError: a shape, dtype or scale that does not match vLLM's layout, named.
    """
    torch = _torch()
    if len(_shape(w13)) != 3 or len(_shape(w2)) != 3:
        raise ConfigError(f"w13.shape={_shape(w13)}, w2.shape={_shape(w2)}: expected 3-D tensors "
                          "[E, 2 * inter, hidden] and [E, hidden, inter]")
    E, inter2, hidden = _shape(w13)
    inter = inter2 // 2
    if inter2 % 2 or _shape(w2) != (E, hidden, inter):
        raise ConfigError(f"w13.shape={_shape(w13)}, w2.shape={_shape(w2)}: expected w13 [E, 2 * inter, hidden] "
                          f"(gate and up stacked) and w2 [E, hidden, inter] = {(E, hidden, inter)}")
    fp8 = w13.dtype == torch.float8_e4m3fn
    if not fp8:
        if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
            raise ConfigError(f"w13.dtype={w13.dtype}, w2.dtype={w2.dtype}: expected bf16, or fp8 e4m3 with block "
                              "scales")
        if w13_scale is not None or w2_scale is not None:
            raise ConfigError("w13_scale/w2_scale: block scales belong to fp8 e4m3 weights; the weights are bf16")
        return Experts(w13[:, :inter], w13[:, inter:], w2)
    blocks_i, blocks_h = _ceil_div(inter, BLOCK), _ceil_div(hidden, BLOCK)
    for name, s, want in (("w13_scale", w13_scale, (E, 2 * blocks_i, blocks_h)),
                          ("w2_scale", w2_scale, (E, blocks_h, blocks_i))):
        if s is None or s.dtype != torch.float32 or _shape(s) != want:
            raise ConfigError(f"{name}: expected float32 block scales {list(want)} (weight_scale_inv, 128x128 "
                              f"blocks), got {None if s is None else (s.dtype, _shape(s))}")
    if w2.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"w2.dtype={w2.dtype}: expected fp8 e4m3 like w13")
    gate, up = w13[:, :inter], w13[:, inter:]
    gate_scale, up_scale = w13_scale[:, :blocks_i], w13_scale[:, blocks_i:]
    if dequantize:
        return Experts(dequantize_blocks(gate, gate_scale), dequantize_blocks(up, up_scale),
                       dequantize_blocks(w2, w2_scale))
    return Experts(gate, up, w2, w_gate_scale=gate_scale.contiguous(), w_up_scale=up_scale.contiguous(),
                   w_down_scale=w2_scale)


def step_counts(num_tokens: int, *, ep_rank: int, ep_size: int, num_tokens_across_dp=None) -> Tuple[int, ...]:
    """Every EP rank's token count of this call, from vLLM's data-parallel counts (module docstring).

    Args:
        num_tokens: this rank's tokens in the call (``hidden_states.shape[0]``).
        ep_rank, ep_size: this rank in the EP group, and its size.
        num_tokens_across_dp: ``dp_metadata.num_tokens_across_dp_cpu`` (one count per DP rank, padded as vLLM
            pads its steps), or None (vLLM sets none without data parallelism).

    Raises:
        ConfigError: no counts with several EP ranks, counts of another length than the EP group, or
            ``num_tokens`` over this rank's count.
    """
    num_tokens = check_int("num_tokens", num_tokens, 0)
    if num_tokens_across_dp is None:
        if ep_size != 1:
            raise ConfigError(f"ep_size={ep_size}: expert parallelism over several ranks needs vLLM's data-parallel "
                              "token counts (dp_metadata); expected data_parallel_size == ep_size")
        return (num_tokens,)
    counts = tuple(int(c) for c in (num_tokens_across_dp.tolist() if hasattr(num_tokens_across_dp, "tolist")
                                    else num_tokens_across_dp))
    if len(counts) != ep_size:
        raise ConfigError(f"num_tokens_across_dp: {len(counts)} counts for an EP group of {ep_size} ranks; expected "
                          "one per EP rank (tensor parallel size 1: EP rank = DP rank)")
    if num_tokens > counts[ep_rank]:
        raise ConfigError(f"num_tokens={num_tokens}: more than EP rank {ep_rank}'s count {counts[ep_rank]} in "
                          f"num_tokens_across_dp={list(counts)}")
    return counts


def capture_buckets(capture_sizes: Iterable[int], max_tokens: int) -> Dict[int, int]:
    """``{capture size: symmring token bucket}`` for vLLM's ``cudagraph_capture_sizes`` (module docstring).

    A graph vLLM captures for ``size`` tokens per rank runs the symmring plan of ``token_bucket(size,
    max_tokens)``: powers of two up to 256, then multiples of 256, at most ``max_tokens``; every size of one
    bucket shares it, and a bucket's plan serves any count up to it on every rank.

    Raises:
        ConfigError: a size that is not an int >= 1, or over ``max_tokens`` (the workspace could not hold
            that step: raise ``max_num_batched_tokens`` or lower ``max_cudagraph_capture_size``).
    """
    from ...moe.gpu.plan import token_bucket
    max_tokens = check_int("max_tokens", max_tokens)
    table = {}
    for size in capture_sizes:
        size = check_int("cudagraph capture size", size)
        if size > max_tokens:
            raise ConfigError(f"cudagraph capture size {size}: over max_tokens={max_tokens} (vLLM's "
                              "max_num_batched_tokens, what the workspace is sized for)")
        table[size] = token_bucket(size, max_tokens)
    return table


def given_step(workspace, num_tokens: int, counts: Sequence[int]):
    """The workspace step of one call of ``num_tokens`` tokens on this rank, whose every rank's token count the
    caller gives (vLLM's): ``Workspace.step(counts[rank], counts=counts)``, which exchanges nothing. Its entry
    raises this rank's own latched device error or failed step; another rank's reaches this rank in the call
    (`symmring.moe.workspace`, "Given counts").

    Raises:
        ConfigError: counts of another length than the ranks, or ``num_tokens`` over this rank's count (named),
            before the step; what ``Workspace.step`` raises at its entry.
    """
    counts = tuple(check_int("counts", c, 0) for c in counts)
    rank = workspace.rank
    if len(counts) != workspace.world_size:
        raise ConfigError(f"counts={list(counts)}: expected one token count per rank ({workspace.world_size})")
    if num_tokens > counts[rank]:
        raise ConfigError(f"hidden_states: {num_tokens} tokens, more than this rank's count {counts[rank]} "
                          f"(counts={list(counts)})")
    return workspace.step(counts[rank], counts=counts, own_router=False)


class GivenRoutingLayer:
    """symmring's expert-parallel layer as vLLM's experts run it: routing and every rank's token count given.

    `symmring.MoE` of the context's backend: the CPU layer on the host backend (bf16 experts; fp8 ones
    dequantised first), the GPU layer on the nvshmem backend (bf16, or native fp8 experts with their block scales).

    Args:
        ctx: the `symmring.Context` of the EP group (collective constructor: every EP rank builds its layer).
        experts: this rank's `Experts` (`experts_from_vllm`).
        num_experts, topk: the layer's global expert count and experts per token.
        max_tokens: most tokens per rank per call (vLLM's ``max_num_batched_tokens``).
        workspace: the `symmring.Workspace` it borrows (default: the context's).
        schedule: a `ScheduleConfig` (default: bf16 dispatch for bf16 experts: the tokens cross the ring as
            vLLM's bf16 path has them; fp8 experts on GPUs read fp8 dispatch rows).

    Raises:
        ConfigError: a bad argument (the layer's own checks, named).
    """

    def __init__(self, ctx, experts: Experts, *, num_experts: int, topk: int, max_tokens: int, workspace=None,
                 schedule: Optional[ScheduleConfig] = None):
        from ...moe.layer import MoE
        routing = RoutingConfig(num_experts, topk)  # only its sizes matter: the routing comes given
        self.ctx, self.topk = ctx, routing.topk
        self.on_host = getattr(ctx.backend, "name", None) == "host"
        if self.on_host and experts.w_gate_scale is not None:
            raise ConfigError("experts: the CPU layer takes bf16 experts; pass experts_from_vllm(..., dequantize=True)")
        if schedule is None and experts.w_gate_scale is None:
            schedule = ScheduleConfig(x_format="bf16")  # a bf16 model's tokens cross the ring as they are
        self.layer = MoE(ctx, experts, routing, max_tokens=max_tokens, schedule=schedule, workspace=workspace)
        self.workspace = self.layer.workspace
        self.max_tokens = max_tokens
        if self.on_host:
            self._warm_up(experts.hidden)

    def _warm_up(self, hidden: int) -> None:
        """One call of ``max_tokens`` zero tokens on every rank (collective): the CPU layer makes its ring and
        combine rows for the largest call on first use (exchanges between the ranks), so a server's later
        calls make none. The GPU layer makes its memory when it is built."""
        torch = _torch()
        n = self.max_tokens
        ids = (torch.arange(n * self.topk, dtype=torch.int32) % self.layer.num_experts).reshape(n, self.topk)
        self(torch.zeros(n, hidden, dtype=torch.bfloat16), ids, torch.zeros(n, self.topk),
             [n] * self.ctx.world_size)

    def __call__(self, x, topk_ids, topk_weights, counts: Sequence[int]):
        """bf16 ``x [n, hidden]``, ``topk_ids`` (any int dtype, global expert ids) and ``topk_weights`` (any
        float dtype) ``[n, topk]``, every EP rank's token count -> bf16 ``[n, hidden]``: the weighted sum of
        each token's experts (collective over the EP group; no host exchange: `given_step`).

        Raises:
            ConfigError: a bad tensor, or counts that do not hold this rank's tokens (named).
            ProtocolTimeout, ProtocolViolation (subclasses), StepFailed: this rank's latched device error or failed
                step, at the step's entry; on the CPU layer also another rank's fault met in this call
                (`CallMismatch`, a `ProtocolTimeout` naming the rank that published nothing). A GPU call that
                meets another rank's fault returns NaN rows and raises at the next call's entry (`given_step`).
        """
        torch = _torch()
        n = int(x.shape[0]) if hasattr(x, "shape") else -1
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ConfigError(f"hidden_states: expected a bf16 tensor [num_tokens, hidden], got "
                              f"{getattr(x, 'dtype', type(x).__name__)} {_shape(x)}")
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor) or _shape(t) != (n, self.topk):
                raise ConfigError(f"{name}: expected a tensor [num_tokens={n}, topk={self.topk}], got {_shape(t)}")
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        with given_step(self.workspace, n, counts):
            if not self.on_host and torch.cuda.is_current_stream_capturing():
                # vLLM captures the call into its own graph and replays it without symmring: set while capturing,
                # the count is written into the graph (each replay sets it). vLLM pads every replay, on every DP
                # rank, to the size it captured, so that count is the replay's.
                self.workspace.set_call_tokens(n)
            return self.layer.forward(x, topk_idx=ids, topk_weights=weights)

    def close(self) -> None:
        """Collective: close the layer (its memory is the workspace's)."""
        self.layer.close()


__all__ = ["experts_from_vllm", "step_counts", "capture_buckets", "given_step", "GivenRoutingLayer"]
