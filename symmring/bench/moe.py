"""``python -m symmring bench moe [--json PATH]``: latency of the GPU MoE layer (batch-ready path).

For three model shapes -- DeepSeek-V3-like (hidden 7168, inter 2048, 256 experts, top-8), Qwen3-30B-A3B-
like (2048, 768, 128, top-8) and Mixtral-like (4096, 14336, 8, top-2) -- and tokens per rank from 128 to
16384, it measures, with CUDA events on warm runs (median of ``--repeats``, fewer at large sizes):

* the layer's latency (`symmring.moe.gpu.MoE.forward`, fp8 dispatch, router GEMM and TopK included) and
  its stages (route, layout, dispatch, experts, combine);
* the expert GEMMs' rate as a fraction of the bf16 matmul rate measured in the same run (dense
  8192^3), and dispatch + combine bytes per second as a fraction of the measured device copy bandwidth;
* the same layer written plainly in torch on one GPU (`symmring.moe.torch_ref.TorchMoE`: router, topk,
  sort by expert, grouped GEMM, scatter-add), as the ratio layer / torch (<= 1.0 is the goal; only
  with one rank, where both see the same work).

Weights and tokens are random (seeded); routing comes from random router weights, so expert loads are
roughly uniform. Prints a table; ``--json PATH`` writes every figure. Under several ranks
(``python -m symmring.launch -n N -- python -m symmring bench moe``) each rank holds its experts and its
own tokens; rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

from . import missing_cuda_torch

logger = logging.getLogger(__name__)

#: name: (hidden, inter, num_experts, topk)
SHAPES = {
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
}
DEFAULT_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _timed(fn, repeats: int, warmup: int = 2) -> List[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` (CUDA events around each, after ``warmup`` calls)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure_ceilings(device) -> Dict[str, float]:
    """bf16 dense matmul rate (TFLOP/s, 8192^3) and device copy bandwidth (GB/s, bytes read + written)."""
    import torch
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = statistics.median(_timed(lambda: a @ b, 10, 3))
    src = torch.empty(2 ** 30 // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(_timed(lambda: dst.copy_(src), 10, 3))
    del a, b, src, dst
    return {"matmul_tflops": 2 * 8192 ** 3 / (mm_ms * 1e-3) / 1e12,
            "copy_gbps": 2 * 2 ** 30 / (copy_ms * 1e-3) / 1e9}


def _stage_ms(events) -> Dict[str, float]:
    out = {}
    for (_, prev), (name, ev) in zip(events, events[1:]):
        out[name] = prev.elapsed_time(ev)
    return out


def layer_weights(ctx, name: str, seed: int):
    """Seeded bf16 weights of shape ``name`` for this rank's experts, drawn in a fixed order.

    Returns ``(device, gen, (w_gate, w_up, w_down, router))``; ``gen`` goes on to draw the inputs, so every
    benchmark that calls this sees the same weights and inputs for the same seed.
    """
    import torch
    hidden, inter, num_experts, _ = SHAPES[name]
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(seed)
    E_local = num_experts // ctx.world_size

    def weights(*shape, fan_in):
        return (torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen) / fan_in ** 0.5)

    return device, gen, (weights(E_local, inter, hidden, fan_in=hidden), weights(E_local, inter, hidden, fan_in=hidden),
                         weights(E_local, hidden, inter, fan_in=inter), weights(num_experts, hidden, fan_in=hidden))


def bench_shape(ctx, name: str, tokens: List[int], repeats: int, ceilings: Dict[str, float],
                seed: int = 0) -> List[Dict]:
    import torch
    from ..moe.gpu import MoE, STAGES
    from ..moe.torch_ref import TorchMoE
    hidden, inter, num_experts, topk = SHAPES[name]
    device, gen, (w_gate, w_up, w_down, router) = layer_weights(ctx, name, seed)
    moe = MoE(ctx, num_experts, hidden, inter, topk, w_gate, w_up, w_down, max_tokens=max(tokens))
    plain = TorchMoE(w_gate, w_up, w_down, topk) if ctx.world_size == 1 else None
    rows = []
    try:
        for n in tokens:
            x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
            reps = repeats if n <= 4096 else max(3, repeats // 4)
            ctx.comm.Barrier()
            layer_ms = statistics.median(_timed(lambda: moe.forward(x, router_weight=router), reps))
            moe.check_errors()
            # Per-stage split (a separate pass, so the events do not perturb the latency above).
            stage_runs: Dict[str, List[float]] = {s: [] for s in STAGES}
            for _ in range(reps):
                events: List = []
                moe.forward(x, router_weight=router, stage_events=events)
                events[-1][1].synchronize()
                for s, ms in _stage_ms(events).items():
                    stage_runs[s].append(ms)
            stages = {s: statistics.median(v) for s, v in stage_runs.items()}
            num_rows = moe.routed_rows()
            gemm_flops = 2.0 * num_rows * (hidden * 2 * inter + inter * hidden)
            x_bytes = 1 if moe.x_format == "fp8_e4m3" else 2
            # dispatch: read each token row once per rank, write bf16 pool rows; combine: read pool rows,
            # write combine rows, read them again and write y.
            dispatch_bytes = n * hidden * x_bytes + num_rows * hidden * 2
            combine_bytes = 3 * num_rows * hidden * 2 + n * hidden * 2
            row = {
                "shape": name, "hidden": hidden, "inter": inter, "num_experts": num_experts, "topk": topk,
                "world_size": ctx.world_size, "tokens_per_rank": n, "routed_rows": num_rows,
                "layer_ms": layer_ms, "stages_ms": stages,
                "expert_tflops": gemm_flops / (stages["experts"] * 1e-3) / 1e12 if stages["experts"] else 0.0,
                "dispatch_combine_gbps": (dispatch_bytes + combine_bytes) /
                ((stages["dispatch"] + stages["combine"]) * 1e-3) / 1e9,
            }
            row["expert_fraction_of_matmul"] = row["expert_tflops"] / ceilings["matmul_tflops"]
            row["dc_fraction_of_copy"] = row["dispatch_combine_gbps"] / ceilings["copy_gbps"]
            # The same call captured into a CUDA graph (removes the host's launch cost; every replay is a
            # call with a fresh device-side generation).
            try:
                graph, _ = moe.capture(x, router_weight=router)
                row["layer_graph_ms"] = statistics.median(_timed(graph.replay, reps))
                moe.check_errors()
                del graph
            except Exception as exc:  # report, keep benchmarking the eager path
                row["layer_graph_error"] = f"{type(exc).__name__}: {exc}"
                logger.warning("%s n=%d: graph capture failed: %s", name, n, exc)
            if plain is not None:
                torch_ms = statistics.median(_timed(lambda: plain.forward(x, router_weight=router), reps))
                row["torch_ms"] = torch_ms
                row["ratio_vs_torch"] = layer_ms / torch_ms
                if "layer_graph_ms" in row:
                    row["ratio_graph_vs_torch"] = row["layer_graph_ms"] / torch_ms
            rows.append(row)
            logger.info("%s n=%d: %.3f ms", name, n, layer_ms)
            del x
    finally:
        moe.close()
        del w_gate, w_up, w_down, router, plain
        torch.cuda.empty_cache()
    return rows


def format_table(rows: List[Dict], ceilings: Dict[str, float]) -> str:
    lines = [f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s "
             "(measured in this run)",
             f"{'shape':<14} {'tokens':>6} {'layer ms':>9} {'graph ms':>9} {'torch ms':>9} {'ratio':>6} "
             f"{'g.ratio':>7} {'route':>7} "
             f"{'layout':>7} {'disp':>7} {'experts':>8} {'combine':>8} {'GEMM %':>7} {'D+C %':>6}"]
    for r in rows:
        s = r["stages_ms"]
        nan = float("nan")
        lines.append(f"{r['shape']:<14} {r['tokens_per_rank']:>6} {r['layer_ms']:>9.3f} "
                     f"{r.get('layer_graph_ms', nan):>9.3f} {r.get('torch_ms', nan):>9.3f} "
                     f"{r.get('ratio_vs_torch', nan):>6.2f} {r.get('ratio_graph_vs_torch', nan):>7.2f} "
                     f"{s['route']:>7.3f} {s['layout']:>7.3f} {s['dispatch']:>7.3f} {s['experts']:>8.3f} "
                     f"{s['combine']:>8.3f} {100 * r['expert_fraction_of_matmul']:>6.1f}% "
                     f"{100 * r['dc_fraction_of_copy']:>5.1f}%")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m symmring bench moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="comma-separated tokens per rank")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per size (a quarter above 4096)")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected some of {list(SHAPES)}")
    try:
        tokens = sorted({int(t) for t in args.tokens.split(",") if t})
    except ValueError:
        parser.error(f"--tokens={args.tokens!r}: expected comma-separated integers")
    if not tokens or tokens[0] < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")
    missing = missing_cuda_torch()
    if missing:
        print(f"bench moe: {missing}", file=sys.stderr)
        return 2
    import torch
    # The combine buffer of the largest size must fit the symmetric heap (default 1 GiB).
    need = max(t * SHAPES[s][3] * SHAPES[s][0] * 2 + t * SHAPES[s][0] * 2 for s in shapes for t in tokens[-1:])
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(2 ** 30, int(need * 1.25) + 2 ** 28)))
    from ..context import init
    ctx = init("nvshmem")
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    try:
        ceilings = measure_ceilings(device)
        rows = []
        for shape in shapes:
            rows += bench_shape(ctx, shape, tokens, args.repeats, ceilings)
    finally:
        ctx.close()
    if ctx.rank == 0:
        print(format_table(rows, ceilings))
        print(f"bench moe: {len(rows)} sizes in {time.perf_counter() - started:.0f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"ceilings": ceilings, "rows": rows, "device": ctx.device,
                           "world_size": ctx.world_size}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
