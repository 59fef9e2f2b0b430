"""``python -m symmring demo --model NAME``: a transformers model with symmring's expert-parallel MoE blocks.

On every rank (the same seed everywhere) the demo

1. initialises symmring (``--backend``: auto, host or nvshmem) and builds two copies of a tiny random
   transformers model of the family (`symmring.moe.integrations.tiny`: Mixtral, Qwen3-MoE or DeepSeek-V3; 24 experts,
   two MoE layers; built from a config, no download);
2. replaces the MoE blocks of one copy by `symmring.moe.integrations.module.MoEModule` (`replace_moe_blocks`): the CPU
   layer on the host backend, the GPU layer (bf16 experts, ``engine="torch"``) on nvshmem; rank ``r`` of
   ``R`` computes experts ``[r E/R, (r+1) E/R)`` for every rank's tokens; the ring carries x as ``--x-format``
   (default bf16: bit for bit);
3. runs its own batch (2 sequences of ``--seq + 4 r`` tokens) through both copies and compares the logits
   per token (``||a_t - b_t|| / ||b_t||``): the median over every rank's tokens must stay within
   `MEDIAN_TOL` of the format (bf16 2e-2: what transformers' own bf16 expert arithmetic differs by; fp8 1e-1:
   x quantised to e4m3 in the ring), and the whole batch within `WHOLE_TOL` (a near-tie routing choice of
   the second MoE layer that flips moves a few tokens' logits a lot; tests/mpi/test_moe_module_mpi.py);
4. prints one line per rank (rank 0) and ends with ``demo: PASS ...`` (exit 0) or ``demo: FAIL ...`` (1; 2 for
   bad arguments).

Run: ``mpiexec -n 2 python -m symmring demo --model deepseek-v3`` or
``torchrun --nproc-per-node 2 -m symmring demo --model deepseek-v3``.
"""

from __future__ import annotations

import logging
import time

from .errors import SymmringError
from .moe.config import ScheduleConfig

log = logging.getLogger(__name__)

#: Bounds of the logits' relative error per token, median over every rank's tokens, by the ring's x format.
MEDIAN_TOL = {"bf16": 2e-2, "fp8_e4m3": 1e-1}
#: Bounds of the whole batch's relative error (every rank's own batch).
WHOLE_TOL = {"bf16": 3e-1, "fp8_e4m3": 4e-1}
NUM_EXPERTS = 24


def _errors(got, want):
    got, want = got.double(), want.double()
    per_token = ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
    whole = float((got - want).norm() / want.norm())
    top1 = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    return per_token, whole, top1


def main(args) -> int:
    """Run the model demo with the demo's parsed ``args``; returns 0 (PASS), 1 (FAIL) or 2 (bad arguments)."""
    import torch
    from . import __version__
    from .demo_run import fail, start, world_reporter
    from .moe.integrations import tiny
    from .moe.integrations.hf import check_transformers, replace_moe_blocks

    x_format = args.x_format or "bf16"
    report = world_reporter()
    if report is None:
        return 1
    if args.seq < 1:
        report.say(f"demo: FAIL --seq={args.seq}: expected >= 1")
        return 2
    try:
        version = check_transformers()
    except SymmringError as exc:
        report.say(f"demo: FAIL {exc}")
        return 2
    if version is None:  # the command line names the extra that brings it
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
    started = start(args.backend, report)
    if started is None:
        return 1
    ctx, report, reason = started
    family = tiny.canonical_family(args.model)
    on_gpu = ctx.backend.name != "host"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    layer_kwargs = dict(engine="torch") if on_gpu else {}
    report.say(f"symmring {__version__} demo --model {args.model}: {ctx.world_size} rank(s), backend "
               f"{ctx.backend.name} ({reason}) on {ctx.device}, torch {torch.__version__}, transformers {version}")
    replaced = {}
    try:
        start_s = time.perf_counter()
        reference, config = tiny.tiny_model(family, args.seed, device=device, num_experts=NUM_EXPERTS)
        model, _ = tiny.tiny_model(family, args.seed, device=device, num_experts=NUM_EXPERTS)
        ids = tiny.input_ids(args.seed + 101 * ctx.rank, 2, args.seq + 4 * ctx.rank).to(device)
        max_tokens = 2 * (args.seq + 4 * (ctx.world_size - 1))  # the largest rank's batch (the same everywhere)
        replaced = replace_moe_blocks(model, ctx, max_tokens=max_tokens,
                                      schedule=ScheduleConfig(x_format=x_format), **layer_kwargs)
        first = next(iter(replaced.values()))
        report.say(f"model: {type(model).__name__}, {len(replaced)} MoE blocks replaced ({', '.join(replaced)}): "
                   f"{first.extra_repr()}; x as {x_format}, seed {args.seed}")
        with torch.inference_mode():
            want = reference(ids).logits
            got = model(ids).logits
        per_token, whole, top1 = _errors(got, want)
        elapsed_s = time.perf_counter() - start_s
    except SymmringError as exc:
        return fail(ctx, report, exc)
    rows = report.allgather((ctx.rank, int(per_token.numel()), float(per_token.median()), float(per_token.max()),
                             whole, top1, elapsed_s))
    tokens = report.allgather(per_token.cpu().tolist())
    all_tokens = torch.tensor([e for rank_errors in tokens for e in rank_errors], dtype=torch.float64)
    median = float(all_tokens.median())
    worst_whole = report.max(whole)
    if ctx.rank == 0:
        report.say("rank  tokens  median/token  max/token  whole batch  top-1 agree  s")
        for rank, n, med, mx, wh, t1, el in rows:
            report.say(f"{rank:>4}  {n:>6}  {med:>12.2e}  {mx:>9.2e}  {wh:>11.2e}  {t1:>10.0%}  {el:.1f}")
    for module in replaced.values():
        module.close()
    ctx.close()
    report.close()
    passed = median <= MEDIAN_TOL[x_format] and worst_whole <= WHOLE_TOL[x_format]
    report.say(f"demo: {'PASS' if passed else 'FAIL'} model={args.model} backend={ctx.backend.name} "
               f"ranks={ctx.world_size} tokens={int(all_tokens.numel())} x={x_format}: logits rel err per token "
               f"median {median:.2e} (<= {MEDIAN_TOL[x_format]:g}), whole batch max over ranks {worst_whole:.2e} "
               f"(<= {WHOLE_TOL[x_format]:g})")
    return 0 if passed else 1
