"""``python -m symmring demo``: the main job -- a small MoE layer run both ways and checked.

On seeded data (the same global problem on every rank: each rank holds ``--tokens`` tokens and
``experts / ranks`` experts) the demo

1. initialises symmring (``--backend auto``: the GPU backend when a GPU, CuPy and nvshmem4py are usable,
   else the CPU backend) and says which backend it got and why;
2. on the GPU backend, runs the GPU layer (`symmring.MoE` there: `symmring.moe.gpu.GpuMoE`, bf16 experts; a ring of
   ``--tokens-per-slot`` slots, one per chunk, and one expert window over the call) against the reference
   (relative error <= 1e-2): batch-ready (``streaming=False``), streamed (``streaming=True``: the chunks
   pipeline; its expert GEMMs see the batch path's groups) and ``streaming="auto"`` (what the measured
   policy picks), and checks streamed == batch **bitwise**; then, on the CPU backend, step 3 as well;
3. runs the layer on the CPU backend (`symmring.MoE` there: `symmring.moe.cpu.layer.ExpertParallelMoE`)
   batch-ready (one chunk of the whole batch) and streamed (``--tokens-per-slot`` chunks through a
   ``--num-slots`` ring), with CONSERVATIVE and with EARLY acknowledgements;
4. checks streamed == batch **bitwise**, both against `symmring.moe.reference.reference_moe` of the
   global problem (rtol 1e-5, atol 1e-5 of the largest output), and reruns bitwise identical;
5. prints what it did and the timings (rank 0), and ends with ``demo: PASS ...`` (exit 0) or
   ``demo: FAIL ...`` (exit 1; 2 for bad arguments).

Run: ``python -m symmring demo``, ``mpiexec -n 4 python -m symmring demo`` or
``torchrun --nproc-per-node 4 -m symmring demo``.

``--model mixtral|qwen3-30b-a3b|deepseek-v3`` runs a tiny transformers model of that family instead
(`symmring.demo_model`; the names of ``python -m symmring plan --preset``, `symmring.moe.workspace_plan.PRESETS`;
``qwen3-moe`` is the former name of ``qwen3-30b-a3b``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from .demo_run import Reporter, fail, start, world_reporter
from .errors import SymmringError
from .moe.config import Experts, RoutingConfig, ScheduleConfig
from .moe.workspace_plan import PRESET_ALIASES, PRESETS

log = logging.getLogger(__name__)

#: ``--model`` values: the model presets' names (`symmring.moe.workspace_plan.PRESETS`, as ``plan --preset``)
#: and their former names.
MODELS = tuple(sorted(PRESETS)) + tuple(sorted(PRESET_ALIASES))
#: Tolerances of the checks (float32 arithmetic on the CPU; bf16 experts on the GPU).
CPU_RTOL = 1e-5
GPU_REL_TOL = 1e-2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m symmring demo",
                                description="Run a small MoE layer batch-ready and streamed; check both.")
    p.add_argument("--tokens", type=int, default=96, help="tokens per rank (default 96)")
    p.add_argument("--hidden", type=int, default=256, help="model size (default 256)")
    p.add_argument("--experts", type=int, default=24, help="experts over all ranks (default 24: splits "
                   "evenly over 1, 2, 3, 4, 6 or 8 ranks)")
    p.add_argument("--topk", type=int, default=4, help="experts per token (default 4)")
    p.add_argument("--inter", type=int, default=64, help="expert intermediate size (default 64)")
    p.add_argument("--tokens-per-slot", type=int, default=32, help="tokens per streamed chunk (default 32)")
    p.add_argument("--num-slots", type=int, default=2, help="slots of the streamed ring (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data (default 0)")
    p.add_argument("--backend", default="auto", choices=("auto", "host", "nvshmem"),
                   help="auto (GPU when usable, else CPU), host (CPU) or nvshmem (GPU)")
    p.add_argument("--x-format", default=None, choices=("fp8_e4m3", "bf16"),
                   help="what the ring carries (default fp8_e4m3 with 128-channel scales; with --model: bf16)")
    p.add_argument("--scoring", "--topk-method", dest="scoring", default="softmax",
                   choices=("softmax", "sigmoid_bias"),
                   help="router scoring (RoutingConfig's): softmax (Mixtral) or sigmoid_bias (DeepSeek-V3); "
                        "--topk-method is its former name")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per path after one warm-up (default 2)")
    p.add_argument("--model", default=None, choices=MODELS,
                   help="instead: a tiny random transformers model of this family (the names of plan --preset; "
                        "qwen3-moe: qwen3-30b-a3b's former name; built locally, no download) "
                        "with its MoE blocks replaced by symmring's, its logits against the unreplaced model's "
                        "(needs torch and transformers: the cpu/gpu and hf extras)")
    p.add_argument("--seq", type=int, default=24, help="with --model: tokens per sequence, 2 sequences per rank "
                   "(rank r adds 4 r: uneven counts; default 24)")
    return p


@dataclasses.dataclass
class Problem:
    """The global problem (identical on every rank) and this rank's rows of it."""

    counts: List[int]
    x: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    router_weight: np.ndarray
    options: dict  # scoring, bias, routed_scaling_factor
    rows: slice

    @property
    def x_local(self) -> np.ndarray:
        return self.x[self.rows]


def make_problem(args, world_size: int, rank: int) -> Problem:
    """Seeded global data; values are bf16-representable so a GPU layer's bf16 copies are exact."""
    import ml_dtypes

    def bf16_exact(a):
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    rng = np.random.default_rng(args.seed)
    counts = [args.tokens] * world_size
    E, H, I = args.experts, args.hidden, args.inter
    x = bf16_exact(rng.standard_normal((sum(counts), H)) * np.exp2(rng.uniform(-2, 2, (sum(counts), 1))))
    w_gate = bf16_exact(rng.standard_normal((E, I, H)) / math.sqrt(H))
    w_up = bf16_exact(rng.standard_normal((E, I, H)) / math.sqrt(H))
    w_down = bf16_exact(rng.standard_normal((E, H, I)) / math.sqrt(I))
    router_weight = bf16_exact(rng.standard_normal((E, H)) / math.sqrt(H))
    options = dict(scoring=args.scoring)
    if args.scoring == "sigmoid_bias":
        options.update(bias=(rng.standard_normal(E) * 0.1).astype(np.float32), routed_scaling_factor=2.5)
    start = sum(counts[:rank])
    return Problem(counts, x, w_gate, w_up, w_down, router_weight, options, slice(start, start + counts[rank]))


def _timed_calls(fn: Callable[[], np.ndarray], report: Reporter, repeats: int,
                 sync: Callable[[], None] = lambda: None) -> Tuple[List[np.ndarray], float]:
    """Outputs of one warm-up and ``repeats`` timed calls, and the median over calls of the slowest
    rank's seconds."""
    outputs = [fn()]
    sync()
    times_s = []
    for _ in range(repeats):
        report.barrier()
        start_s = time.perf_counter()
        outputs.append(fn())
        sync()
        times_s.append(report.max(time.perf_counter() - start_s))
    return outputs, statistics.median(times_s) if times_s else float("nan")


def _bit_differences(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32))) if a.shape == b.shape else a.size + 1


def run_cpu(ctx, args, prob: Problem, report: Reporter) -> Tuple[bool, str]:
    """Batch and streamed on the CPU layer; returns ``(passed, summary)`` (the same on every rank)."""
    from .moe.cpu.layer import shard_experts
    from .moe.layer import MoE
    from .moe.reference import reference_moe
    start_s = time.perf_counter()
    ref = reference_moe(prob.x, w_gate=prob.w_gate, w_up=prob.w_up, w_down=prob.w_down, num_topk=args.topk,
                        router_weight=prob.router_weight, x_format=args.x_format, **prob.options)
    ref_s = report.max(time.perf_counter() - start_s)
    y_ref = ref.y[prob.rows]
    results = {}
    experts = Experts(*shard_experts(prob.w_gate, prob.w_up, prob.w_down, ctx.rank, ctx.world_size))
    routing = RoutingConfig(args.experts, args.topk, **prob.options)
    max_tokens = max(1, max(prob.counts))

    def layer(ack: str):
        return MoE(ctx, experts, routing, max_tokens=max_tokens, schedule=ScheduleConfig(
            x_format=args.x_format, tokens_per_slot=min(args.tokens_per_slot, max_tokens), num_slots=args.num_slots,
            ack_policy=ack))

    with layer("conservative") as conservative, layer("early") as early:
        for name, streaming in (("batch", False), ("streamed", True)):
            outputs, seconds = _timed_calls(
                lambda: conservative.forward(prob.x_local, router_weight=prob.router_weight, streaming=streaming),
                report, args.repeats)
            results[name] = (outputs, seconds, conservative.last_stats)
        # EARLY acknowledgement must not change a single bit either.
        y_early = early.forward(prob.x_local, router_weight=prob.router_weight, streaming=True)
    y_batch, y_stream = results["batch"][0][0], results["streamed"][0][0]
    num_elements = report.sum(y_batch.size)
    for name, (outputs, seconds, stats) in results.items():
        if name == "batch":
            shape = f"1 chunk of {stats.tokens_per_slot} tokens (1-slot ring sized to the largest batch)"
        else:
            shape = (f"{stats.num_chunks} chunks of {stats.tokens_per_slot} tokens through a "
                     f"{stats.num_slots}-slot ring (producer {stats.num_slots - 1} ahead)")
        report.say(f"  {name:<8} {seconds * 1e3:9.2f} ms  {shape}; rows pulled {report.sum(stats.rows_pulled)}, "
                   f"(token, k) pairs computed {report.sum(stats.pairs_computed)}")
    report.say(f"  {'reference':<8} {ref_s * 1e3:9.2f} ms  NumPy, all {sum(prob.counts)} tokens, one process")
    diff_bits = report.sum(_bit_differences(y_stream, y_batch))
    diff_early = report.sum(_bit_differences(y_early, y_batch))
    diff_reruns = report.sum(sum(_bit_differences(y, outs[0]) for outs, _, _ in results.values()
                                 for y in outs[1:]))
    max_diff = report.max(float(np.max(np.abs(y_batch - y_ref))) if y_ref.size else 0.0)
    scale = float(np.max(np.abs(ref.y))) if ref.y.size else 0.0
    close = report.all_ok(all(np.allclose(y, y_ref, rtol=CPU_RTOL, atol=CPU_RTOL * max(scale, 1e-30))
                              for y in (y_batch, y_stream)))
    live = int(np.count_nonzero(ref.topk_idx != -1))
    pairs_ok = all(report.sum(stats.pairs_computed) == live for _, _, stats in results.values())
    report.say(f"  check: streamed == batch bitwise: {_yes(diff_bits == 0)} ({diff_bits} of {num_elements} "
               f"elements differ); EARLY ack == CONSERVATIVE: {_yes(diff_early == 0)}; reruns identical: "
               f"{_yes(diff_reruns == 0)}")
    report.say(f"  check: vs reference: max|y - ref| = {max_diff:.3g} (|ref| <= {scale:.3g}; rtol {CPU_RTOL:g}): "
               f"{_yes(close)}; each live (token, k) computed once ({live}): {_yes(pairs_ok)}")
    passed = diff_bits == 0 and diff_early == 0 and diff_reruns == 0 and close and pairs_ok
    summary = f"streamed==batch bitwise, max|y-ref|={max_diff:.3g}" if passed else (
        f"streamed vs batch: {diff_bits} bits differ, reference match: {close}, pairs: {pairs_ok}")
    return passed, summary


def run_gpu(ctx, args, prob: Problem, report: Reporter) -> Tuple[bool, str]:
    """The GPU layer's batch-ready path against the reference (bf16 experts: relative error)."""
    import torch

    from .moe.cpu.layer import local_experts
    from .moe.layer import MoE
    from .moe.reference import reference_moe, router_logits
    device = torch.device("cuda", torch.cuda.current_device())

    def on_gpu(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    experts = local_experts(ctx.rank, ctx.world_size, args.experts)
    local = slice(experts.start, experts.stop)
    options = dict(scoring=args.scoring)
    if args.scoring == "sigmoid_bias":
        options.update(bias=on_gpu(prob.options["bias"], torch.float32),
                       routed_scaling_factor=prob.options["routed_scaling_factor"])
    # float32 logits from the reference's router, so the GPU and the reference pick the same experts.
    logits = router_logits(prob.x, prob.router_weight)
    ref = reference_moe(prob.x, w_gate=prob.w_gate, w_up=prob.w_up, w_down=prob.w_down, num_topk=args.topk,
                        logits=logits, x_format=args.x_format, **prob.options)
    from .protocol import call_num_chunks
    weights = [on_gpu(w[local], torch.bfloat16) for w in (prob.w_gate, prob.w_up, prob.w_down)]
    max_tokens = max(1, max(prob.counts))
    T = min(args.tokens_per_slot, max_tokens)
    slots = max(args.num_slots, call_num_chunks(list(prob.counts), T), 1)
    x_gpu = on_gpu(prob.x_local, torch.bfloat16)
    logits_gpu = on_gpu(logits[prob.rows], torch.float32)
    y_ref = ref.y[prob.rows]
    results = {}
    moe = MoE(ctx, Experts(*weights), RoutingConfig(args.experts, args.topk, **options), max_tokens=max_tokens,
              schedule=ScheduleConfig(num_slots=slots, tokens_per_slot=T, ack_policy="early", expert_window=slots,
                                      x_format=args.x_format))
    try:
        for name, streaming in (("batch", False), ("streamed", True), ("auto", "auto")):
            outputs, seconds = _timed_calls(lambda: moe.forward(x_gpu, logits=logits_gpu, streaming=streaming),
                                            report, args.repeats, sync=torch.cuda.synchronize)
            moe.check_errors()
            results[name] = (outputs[0].float().cpu().numpy(), seconds)
        auto_streams = moe.last_plan.streaming  # the schedule the last ("auto") call ran: agreed by the ranks
    finally:
        moe.close()
    passed, parts = True, []
    for name, (y, seconds) in results.items():
        # Relative error over all ranks' rows: sqrt(sum of squared errors / sum of squared reference values).
        num = math.sqrt(report.fsum(float(np.sum((y.astype(np.float64) - y_ref) ** 2))))
        den = math.sqrt(report.fsum(float(np.sum(y_ref.astype(np.float64) ** 2))))
        rel = num / den if den > 0 else num
        ok = report.all_ok(bool(np.all(np.isfinite(y)))) and rel <= GPU_REL_TOL
        passed = passed and ok
        what = {"batch": f"the batch-ready path: every {T}-token chunk produced, then one window",
                "streamed": f"{T}-token chunks pipelined through a {slots}-slot NVSHMEM ring, one expert window",
                "auto": "the measured policy's choice: " + ("streamed" if auto_streams else "batch")}[name]
        report.say(f"  gpu {name:<8} {seconds * 1e3:9.3f} ms  {what}, bf16 experts")
        report.say(f"  check: GPU {name} vs reference: relative error {rel:.3g} (<= {GPU_REL_TOL:g}): {_yes(ok)}")
        parts.append(f"GPU {name} rel.err {rel:.3g}")
    diff = report.sum(_bit_differences(results["streamed"][0], results["batch"][0]))
    report.say(f"  check: GPU streamed == GPU batch bitwise: {_yes(diff == 0)} ({diff} values differ)")
    passed = passed and diff == 0
    parts.append("GPU streamed==batch bitwise" if diff == 0 else f"GPU streamed!=batch ({diff} values)")
    return passed, ", ".join(parts)


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def memory_of(ctx) -> str:
    """What the CPU backend's symmetric memory is, in words."""
    from . import mpi
    return "process memory, no MPI library" if mpi.is_standin(ctx.comm) else ctx.backend.memory.name


def main(argv: Optional[List[str]] = None) -> int:
    """Run the demo; returns 0 (PASS), 1 (FAIL) or 2 (bad arguments)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.model is not None:
        from .demo_model import main as model_main  # needs torch and transformers
        return model_main(args)
    if args.x_format is None:
        args.x_format = "fp8_e4m3"
    from . import __version__, world
    from .context import init
    report = world_reporter()
    if report is None:
        return 1
    for name in ("tokens", "hidden", "experts", "topk", "inter", "tokens_per_slot", "num_slots", "repeats"):
        low = 0 if name in ("tokens", "repeats") else 1
        if getattr(args, name) < low:
            report.say(f"demo: FAIL --{name.replace('_', '-')}={getattr(args, name)}: expected >= {low}")
            return 2
    started = start(args.backend, report)
    if started is None:
        return 1
    ctx, report, reason = started
    report.say(f"symmring {__version__} demo: {ctx.world_size} rank(s), backend {ctx.backend.name} "
               f"({reason}) on {ctx.device}")
    report.say(f"problem: {args.tokens} tokens/rank x hidden {args.hidden}, {args.experts} experts "
               f"({args.experts // max(ctx.world_size, 1)}/rank), top-{args.topk} {args.scoring}, inter "
               f"{args.inter}, x as {args.x_format}, seed {args.seed}")
    results: List[Tuple[bool, str]] = []
    backends_used: List[str] = []
    try:
        prob = make_problem(args, ctx.world_size, ctx.rank)
        if ctx.backend.name == "nvshmem":
            backends_used.append("nvshmem")
            results.append(run_gpu(ctx, args, prob, report))
            report.say("and the same problem on the CPU layer (backend host):")
            ranks = ctx.ranks
            ctx.close()
            ctx = init("host", **world.init_kwargs(ranks))
        report.say(f"CPU layer (backend {ctx.backend.name}, {memory_of(ctx)}):")
        backends_used.append(ctx.backend.name)
        results.append(run_cpu(ctx, args, prob, report))
    except SymmringError as exc:
        return fail(ctx, report, exc)
    passed = all(ok for ok, _ in results)
    ctx.close()
    report.close()
    verdict = "PASS" if passed else "FAIL"
    report.say(f"demo: {verdict} backend={'+'.join(backends_used)} ranks={report.size} "
               f"tokens={args.tokens * report.size}: " + "; ".join(s for _, s in results))
    return 0 if passed else 1

