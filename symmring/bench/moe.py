"""``python -m symmring bench moe [--json PATH] [--plot PNG]``: latency of the GPU MoE layer, bf16 and fp8 experts.

For three model shapes -- DeepSeek-V3-like (hidden 7168, inter 2048, 256 experts, top-8), Qwen3-30B-A3B-
like (2048, 768, 128, top-8) and Mixtral-like (4096, 14336, 8, top-2) -- and tokens per rank from 1 to
16384, it measures, in one run, with CUDA events on warm runs (median of ``--repeats``, fewer at large
sizes), for each expert engine (``--engines``: ``torch`` = bf16 experts, ``builtin`` = fp8 Triton,
``deepgemm`` = fp8 DeepGEMM where it imports, ``fused`` = the fp8 persistent kernel, only when named):

* the layer's latency (`symmring.moe.gpu.MoE.forward`, batch-ready path, fp8 dispatch, router GEMM and TopK
  included), eagerly and replayed from a CUDA graph, and its stages (route, layout, dispatch, experts,
  combine); an eager call of at most 256 tokens per rank replays the layer's own cached graph of its shape
  once warm (`symmring.moe.gpu.graph_cache`), so such rows also give the eager latency with the cache off
  (``eager_nocache_ms``, ``forward(graph_cache=False)``) beside it;
* the expert stage's rate (TFLOP/s over the rows actually routed), and, for the fp8 engines, each fp8
  engine's expert step timed alone on the SAME pool (the same grouped problem), so ``vs DG`` is the
  built-in engine's rate over DeepGEMM's on identical data; against the dense fp8 GEMM rate
  (``torch._scaled_mm`` of 8192^3) measured in the same run;
* the fp8 roofline ``max(fp8 weight bytes of the experts the call touched / copy rate, FLOPs / dense fp8
  rate)`` with both rates measured in the same run, and the layer's graph latency over it;
* the pool and symmetric-heap bytes per PE;
* with one rank, the same layer written plainly in torch (`symmring.moe.torch_ref.TorchMoE`, bf16) as the
  ratio layer / torch;
* where a call takes the small-batch schedule (fp8, at most ``small_batch_tokens`` per rank), the general
  schedule on the same inputs too (``general_ms``, ``general_graph_ms``), so the fused kernels' gain is
  measured side by side.

``--transport p2p,rdma`` runs every measurement with each transport (`symmring.transport`; p2p is the
default) and prints the rdma rows beside p2p with their ratio, labelled "rdma forced on one node: a lower
bound of its overhead": on one node NVSHMEM carries the rdma path's gets, puts and atomics over the same
P2P mapping, so the ratio is what the remote path costs in staging copies and protocol, not over a
network (two nodes were not run). With one rank no peer exists, so rdma changes nothing there.

``--decode`` is the decode sweep: 1, 2, 4, ..., 128 tokens per rank, the fp8 engines, and per row the target
of the decode issue, ``1.3 x the fp8 weight-read limit + 25 us`` (``target_ms``; at these sizes the roofline
is the weight read), graph latency over the limit and eager over graph.

Weights and tokens are random (seeded); routing comes from random router weights, so expert loads are
roughly uniform. Prints a table (progress on stderr); ``--json PATH`` writes every figure, ``--plot PNG``
draws latency against tokens per shape with the roofline. Under several ranks (``python -m
symmring.launch -n N -- python -m symmring bench moe``) each rank holds its experts and its own tokens;
rank 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

from . import device_spans, lacks_cuda_torch, progress, timed_ms
from .ceilings import fp8_roofline_ms, measure_ceilings
from ..moe.config import Experts, RoutingConfig, ScheduleConfig
from ..moe.workspace_plan import PRESETS

logger = logging.getLogger(__name__)

#: name: (hidden, inter, num_experts, topk): the model presets (`symmring.moe.workspace_plan.PRESETS`, the names of
#: ``plan --preset`` and ``demo --model``).
SHAPES = {name: (p["hidden"], p["inter"], p["num_experts"], p["topk"]) for name, p in PRESETS.items()}
DEFAULT_TOKENS = (1, 8, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
#: The decode target: graph latency <= DECODE_SLOPE x the fp8 weight-read limit + DECODE_OFFSET_MS.
DECODE_SLOPE, DECODE_OFFSET_MS = 1.3, 0.025
ENGINE_NAMES = ("torch", "builtin", "deepgemm", "fused")
#: ``--engines``' default: "fused" (the first version of the persistent kernel, docs/FUSED.md) only when asked.
DEFAULT_ENGINES = ("torch", "builtin", "deepgemm")


#: The command's one-line description (plain text for --help).
DESCRIPTION = ("Latency of the GPU MoE layer with bf16 and fp8 experts (every engine) against the fp8 roofline, "
               "per model shape and tokens per rank.")


def kernel_profile(fn, repeats: int) -> Dict[str, float]:
    """Device microseconds per call of every kernel ``fn`` runs (`symmring.bench.device_spans` of ``repeats``
    calls; CUDA graph replays show their kernels too), largest first."""
    out: Dict[str, float] = {}
    for name, start, end in device_spans(fn, repeats):
        out[name] = out.get(name, 0.0) + (end - start) / repeats
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


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


def available_engines(names) -> List[str]:
    """The requested engines that can run here (DeepGEMM only where it imports; reasons logged)."""
    out = []
    for name in names:
        if name == "deepgemm":
            from ..moe.engines import deepgemm
            ok, reason = deepgemm.deepgemm_status()
            if not ok:
                logger.warning("bench moe: engine deepgemm skipped: %s", reason)
                continue
        out.append(name)
    return out


def _mark_rows(state, mark: bool) -> None:
    """Rebuild the fp8 pool's row -> expert marks of the last window from its counts (``mark``), or put
    every row back to -1 (the layer's invariant between windows: its combine clears the marks)."""
    import torch
    m = state.m_indices
    m.fill_(-1)
    if mark:
        begin, counts = state.begin.tolist(), state.counts.tolist()
        for e, (b, c) in enumerate(zip(begin, counts)):
            if c:
                m[b:b + c] = e
        torch.cuda.synchronize()


def bench_shape(ctx, name: str, tokens: List[int], repeats: int, ceilings: Dict[str, float], engines: List[str],
                graphs: bool = True, seed: int = 0, done: Optional[List[int]] = None, total: Optional[int] = None,
                started: Optional[float] = None, kernels: bool = False, transport: str = "p2p") -> List[Dict]:
    import torch
    from ..moe.engines.fp8 import Fp8Experts
    from ..moe.gpu.layer import MoE, STAGES
    from ..moe.torch_ref import TorchMoE
    hidden, inter, num_experts, topk = SHAPES[name]
    device, gen, (w_gate, w_up, w_down, router) = layer_weights(ctx, name, seed)
    layers = {}
    for engine in engines:
        layers[engine] = MoE(ctx,
                             Experts(w_gate, w_up, w_down, expert_dtype="bf16" if engine == "torch" else "fp8"),
                             RoutingConfig(num_experts, topk), max_tokens=max(tokens),
                             schedule=ScheduleConfig(transport=transport), engine=engine)
    # The other fp8 engine on the same weights: each fp8 layer's pool is timed under both engines.
    twins = {}
    if "builtin" in layers and "deepgemm" in layers:
        twins = {"builtin": Fp8Experts(layers["builtin"].engine.weights, "deepgemm"),
                 "deepgemm": Fp8Experts(layers["deepgemm"].engine.weights, "builtin")}
    plain = TorchMoE(w_gate, w_up, w_down, topk) if ctx.world_size == 1 and "torch" in layers else None
    rows = []
    try:
        for n in tokens:
            x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
            reps = repeats if n <= 4096 else max(3, repeats // 4)
            torch_ms = None
            if plain is not None:
                torch_ms = statistics.median(timed_ms(lambda: plain.forward(x, router_weight=router), reps))
            for engine, moe in layers.items():
                ctx.collectives.barrier(what="bench: timing")
                hits = moe.graph_cache_info()["hits"]
                layer_ms = statistics.median(timed_ms(lambda: moe.forward(x, router_weight=router), reps))
                moe.check_errors()
                # Whether the timed eager calls replayed the layer's cached graph (warm: the warm-up captured it).
                eager_cached = moe.graph_cache_info()["hits"] - hits >= reps
                eager_nocache_ms = None
                if eager_cached:  # the same calls launched kernel by kernel, side by side
                    ctx.collectives.barrier(what="bench: timing")
                    eager_nocache_ms = statistics.median(
                        timed_ms(lambda: moe.forward(x, router_weight=router, graph_cache=False), reps))
                    moe.check_errors()
                # Per-stage split (a separate pass, so the events do not perturb the latency above).
                stage_runs: Dict[str, List[float]] = {s: [] for s in STAGES}
                for _ in range(reps):
                    events: List = []
                    moe.debug.forward(x, router_weight=router, stage_events=events)
                    events[-1][1].synchronize()
                    for s, ms in _stage_ms(events).items():
                        stage_runs[s].append(ms)
                stages = {s: statistics.median(v) for s, v in stage_runs.items()}
                counts = moe.executor.state.counts
                num_rows = int(counts.sum().item())
                touched = int((counts > 0).sum().item())
                gemm_flops = 2.0 * num_rows * 3 * hidden * inter
                mem = moe.memory()
                row = {"shape": name, "engine": engine, "transport": transport, "expert_dtype": moe.expert_dtype,
                       "hidden": hidden,
                       "inter": inter, "num_experts": num_experts, "topk": topk, "world_size": ctx.world_size,
                       "tokens_per_rank": n, "routed_rows": num_rows, "touched_experts": touched,
                       "layer_ms": layer_ms, "eager_cached": eager_cached, "stages_ms": stages,
                       "pool_bytes": mem["pool_bytes"],
                       "heap_bytes": mem["heap_bytes"], "weight_bytes": mem["weight_bytes"],
                       "expert_tflops": gemm_flops / (stages["experts"] * 1e-3) / 1e12 if stages["experts"] else 0.0}
                row["expert_fraction_of_fp8_dense"] = row["expert_tflops"] / ceilings["fp8_matmul_tflops"]
                row["fp8_roofline_ms"] = fp8_roofline_ms(touched, num_rows, hidden, inter, ceilings)
                if moe.expert_dtype == "fp8" and num_rows:
                    # Both fp8 engines on this layer's pool as the last forward left it (the same grouped problem;
                    # its row marks are rebuilt for the timing and cleared again after).
                    window = moe.last_plan.windows[0]
                    window_rows, bound = window.rows_bound, window.rows_per_expert
                    pool = moe.executor.state.pool(window_rows)
                    _mark_rows(moe.executor.state, True)
                    own = statistics.median(timed_ms(lambda: moe.engine.forward(pool, window_rows, bound), reps))
                    row["engine_step_ms"] = own
                    row["engine_step_tflops"] = gemm_flops / (own * 1e-3) / 1e12
                    if engine in twins:
                        other = statistics.median(timed_ms(lambda: twins[engine].forward(pool, window_rows, bound),
                                                         reps))
                        dg_ms = other if engine == "builtin" else own
                        bi_ms = own if engine == "builtin" else other
                        row["builtin_vs_deepgemm_rate"] = dg_ms / bi_ms
                    _mark_rows(moe.executor.state, False)
                if graphs:
                    try:
                        graph, _ = moe.capture(x, router_weight=router)
                        row["layer_graph_ms"] = statistics.median(timed_ms(graph.replay, reps))
                        if kernels:  # where a replay's time goes, kernel by kernel
                            row["graph_kernels_us"] = kernel_profile(graph.replay, 5)
                        moe.check_errors()
                        del graph
                    except Exception as exc:  # report, keep benchmarking the eager path
                        row["layer_graph_error"] = f"{type(exc).__name__}: {exc}"
                        logger.warning("%s %s n=%d: graph capture failed: %s", name, engine, n, exc)
                row["small_batch"] = bool(moe.last_plan.small_batch)
                if row["small_batch"]:  # the general schedule on the same inputs, side by side
                    ctx.collectives.barrier(what="bench: timing")
                    row["general_ms"] = statistics.median(
                        timed_ms(lambda: moe.forward(x, router_weight=router, small_batch=False), reps))
                    if graphs:
                        graph, _ = moe.capture(x, router_weight=router, small_batch=False)
                        row["general_graph_ms"] = statistics.median(timed_ms(graph.replay, reps))
                        del graph
                        # What PDL gives: the same graph with plain launches.
                        with _plain_launches(moe):
                            graph, _ = moe.capture(x, router_weight=router)
                            row["no_pdl_graph_ms"] = statistics.median(timed_ms(graph.replay, reps))
                            del graph
                    moe.check_errors()
                best = row.get("layer_graph_ms", layer_ms)
                row["vs_fp8_roofline"] = best / row["fp8_roofline_ms"] if row["fp8_roofline_ms"] else float("nan")
                if torch_ms is not None:
                    row["torch_ms"] = torch_ms
                    row["ratio_vs_torch"] = layer_ms / torch_ms
                row["target_ms"] = DECODE_SLOPE * row["fp8_roofline_ms"] + DECODE_OFFSET_MS
                row["eager_vs_graph"] = layer_ms / row["layer_graph_ms"] if "layer_graph_ms" in row else float("nan")
                if eager_nocache_ms is not None:
                    row["eager_nocache_ms"] = eager_nocache_ms
                    row["nocache_vs_graph"] = (eager_nocache_ms / row["layer_graph_ms"] if "layer_graph_ms" in row
                                               else float("nan"))
                rows.append(row)
                if done is not None:
                    done[0] += 1
                progress("bench moe", done[0] if done else len(rows), total,
                         f"{name} {engine} {transport} n={n}: {layer_ms:.3f} ms eager, "
                         f"{row.get('layer_graph_ms', float('nan')):.3f} ms graph, {row['vs_fp8_roofline']:.2f}x the "
                         "fp8 roofline", rank=ctx.rank, started_s=started)
            del x
    finally:
        for moe in layers.values():
            moe.close()
        del w_gate, w_up, w_down, router, plain, layers, twins
        torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def _plain_launches(moe):
    """``moe`` with its programmatic dependent launches off (`symmring.pdl`), restored after."""
    launcher = moe.executor.kernels.launch
    was = launcher.enabled
    launcher.enabled = False
    try:
        yield
    finally:
        launcher.enabled = was


def add_ratios(rows: List[Dict]) -> None:
    """``fp8_vs_bf16``: each fp8 row's graph (else eager) latency over the bf16 row's at the same size."""
    base = {(r["shape"], r["tokens_per_rank"], r.get("transport")): r for r in rows if r["engine"] == "torch"}
    for r in rows:
        b = base.get((r["shape"], r["tokens_per_rank"], r.get("transport")))
        if b is not None and r["engine"] != "torch":
            r["fp8_vs_bf16"] = r.get("layer_graph_ms", r["layer_ms"]) / b.get("layer_graph_ms", b["layer_ms"])


def format_decode_table(rows: List[Dict]) -> str:
    """The decode view: per row the small-batch and general schedules (graph, eager), the eager latency with
    the layer's graph cache off (``nocache``), the weight-read limit, the target and the ratios the decode
    issue asks for."""
    nan = float("nan")
    lines = [f"{'shape':<14} {'tokens':>6} {'engine':<8} {'small':>5} {'graph ms':>9} {'eager ms':>9} "
             f"{'nocache':>9} {'gen graph':>9} {'gen eager':>9} {'limit ms':>8} {'target':>7} {'/limit':>6} "
             f"{'eag/gr':>6} {'ok':>3} {'no pdl':>7}"]
    for r in rows:
        graph = r.get("layer_graph_ms", nan)
        ok = graph <= r["target_ms"] and r["eager_vs_graph"] <= 2.0
        limit = r["fp8_roofline_ms"] or nan
        lines.append(f"{r['shape']:<14} {r['tokens_per_rank']:>6} {r['engine']:<8} {str(r['small_batch'])[0]:>5} "
                     f"{graph:>9.3f} {r['layer_ms']:>9.3f} {r.get('eager_nocache_ms', nan):>9.3f} "
                     f"{r.get('general_graph_ms', nan):>9.3f} "
                     f"{r.get('general_ms', nan):>9.3f} {r['fp8_roofline_ms']:>8.3f} {r['target_ms']:>7.3f} "
                     f"{graph / limit:>6.2f} {r['eager_vs_graph']:>6.2f} {'yes' if ok else 'NO':>3} "
                     f"{r.get('no_pdl_graph_ms', nan):>7.3f}")
    return "\n".join(lines)


def add_transport_ratios(rows: List[Dict]) -> None:
    """``rdma_vs_p2p``: each rdma row's eager (and ``rdma_vs_p2p_graph``: graph) latency over the p2p row of
    the same shape, engine and size."""
    base = {(r["shape"], r["engine"], r["tokens_per_rank"]): r for r in rows if r.get("transport") == "p2p"}
    for r in rows:
        b = base.get((r["shape"], r["engine"], r["tokens_per_rank"]))
        if r.get("transport") != "rdma" or b is None:
            continue
        r["rdma_vs_p2p"] = r["layer_ms"] / b["layer_ms"]
        if "layer_graph_ms" in r and "layer_graph_ms" in b:
            r["rdma_vs_p2p_graph"] = r["layer_graph_ms"] / b["layer_graph_ms"]


def format_transport_table(rows: List[Dict]) -> str:
    """rdma beside p2p (rows of `add_transport_ratios`), under the one-node label; empty without rdma rows.

    Example:
        >>> rows = [dict(shape="mixtral", engine="builtin", tokens_per_rank=8, transport=t, layer_ms=ms)
        ...         for t, ms in (("p2p", 0.2), ("rdma", 0.3))]
        >>> add_transport_ratios(rows)
        >>> print(format_transport_table(rows).splitlines()[0])
        rdma forced on one node: a lower bound of its overhead
    """
    from .protocol import RDMA_LABEL
    nan = float("nan")
    pairs = [r for r in rows if "rdma_vs_p2p" in r]
    if not pairs:
        return ""
    base = {(r["shape"], r["engine"], r["tokens_per_rank"]): r for r in rows if r.get("transport") == "p2p"}
    lines = [RDMA_LABEL, f"{'shape':<14} {'tokens':>6} {'engine':<8} {'p2p ms':>9} {'rdma ms':>9} {'ratio':>6} "
             f"{'p2p graph':>9} {'rdma graph':>10} {'ratio':>6}"]
    for r in pairs:
        b = base[(r["shape"], r["engine"], r["tokens_per_rank"])]
        lines.append(f"{r['shape']:<14} {r['tokens_per_rank']:>6} {r['engine']:<8} {b['layer_ms']:>9.3f} "
                     f"{r['layer_ms']:>9.3f} {r['rdma_vs_p2p']:>6.2f} {b.get('layer_graph_ms', nan):>9.3f} "
                     f"{r.get('layer_graph_ms', nan):>10.3f} {r.get('rdma_vs_p2p_graph', nan):>6.2f}")
    return "\n".join(lines)


def format_table(rows: List[Dict], ceilings: Dict[str, float]) -> str:
    nan = float("nan")
    lines = [f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, fp8 matmul {ceilings['fp8_matmul_tflops']:.0f} "
             f"TFLOP/s, copy {ceilings['copy_gbps']:.0f} GB/s (measured in this run)",
             f"{'shape':<14} {'tokens':>6} {'engine':<8} {'eager ms':>9} {'graph ms':>9} {'experts':>8} "
             f"{'TFLOP/s':>7} {'vs DG':>5} {'roof ms':>8} {'/roof':>6} {'/bf16':>6} {'/torch':>6} {'pool MB':>8} "
             f"{'heap MB':>8}"]
    for r in rows:
        lines.append(f"{r['shape']:<14} {r['tokens_per_rank']:>6} {r['engine']:<8} {r['layer_ms']:>9.3f} "
                     f"{r.get('layer_graph_ms', nan):>9.3f} {r['stages_ms']['experts']:>8.3f} "
                     f"{r.get('engine_step_tflops', r['expert_tflops']):>7.0f} "
                     f"{r.get('builtin_vs_deepgemm_rate', nan):>5.2f} {r['fp8_roofline_ms']:>8.3f} "
                     f"{r['vs_fp8_roofline']:>6.2f} {r.get('fp8_vs_bf16', nan):>6.2f} {r.get('ratio_vs_torch', nan):>6.2f} "
                     f"{r['pool_bytes'] / 2 ** 20:>8.1f} {r['heap_bytes'] / 2 ** 20:>8.1f}")
    return "\n".join(lines)


def draw_plot(rows: List[Dict], png_path: str) -> None:
    """Per shape: graph latency (eager where no graph) against tokens per rank, one line per engine, and the
    fp8 roofline (matplotlib, Agg, log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        for engine in dict.fromkeys(r["engine"] for r in mine):
            pts = sorted((r["tokens_per_rank"], r.get("layer_graph_ms", r["layer_ms"])) for r in mine
                         if r["engine"] == engine)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=engine)
        roof = sorted({(r["tokens_per_rank"], r["fp8_roofline_ms"]) for r in mine if r["engine"] == mine[0]["engine"]})
        ax.plot([p[0] for p in roof], [p[1] for p in roof], "k--", label="fp8 roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("ms (CUDA graph replay)")
        ax.set_title(shape)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--anchor" or a.startswith("--anchor=") for a in argv):
        # Another layer beside this one (symmring.bench.moe_anchor, its own options): it alone imports the anchor.
        from . import moe_anchor
        return moe_anchor.main(argv)
    parser = argparse.ArgumentParser(prog="python -m symmring bench moe", description=DESCRIPTION)
    parser.add_argument("--anchor", choices=("megamoe",),
                        help="instead: this layer beside DeepGEMM's SM90 MegaMoE on the same inputs (its own options: "
                             "bench moe --anchor megamoe --help; build it with tools/megamoe/build.sh)")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw latency vs tokens with the fp8 roofline")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="comma-separated tokens per rank")
    parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                        help=f"comma-separated subset of {list(ENGINE_NAMES)} (deepgemm only where it imports)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per size (a quarter above 4096)")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA graph timings")
    parser.add_argument("--kernels", action="store_true",
                        help="profile each graph replay kernel by kernel (torch.profiler; the JSON's graph_kernels_us)")
    parser.add_argument("--decode", action="store_true",
                        help=f"the decode sweep: tokens {','.join(map(str, DECODE_TOKENS))}, fp8 engines, the "
                             "decode table (unless --tokens/--engines are given)")
    parser.add_argument("--transport", default="p2p",
                        help="p2p, rdma or p2p,rdma (symmring.transport): every measurement with each; rdma is "
                             "printed beside p2p with its ratio (rdma forced on one node: a lower bound of its "
                             "overhead)")
    args = parser.parse_args(argv)
    from .protocol import parse_transports
    try:
        transports = parse_transports(args.transport)
    except ValueError as exc:
        parser.error(str(exc))
    if args.decode:
        if args.tokens == ",".join(map(str, DEFAULT_TOKENS)):
            args.tokens = ",".join(map(str, DECODE_TOKENS))
        if args.engines == ",".join(DEFAULT_ENGINES):
            args.engines = "builtin,deepgemm"

    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected some of {list(SHAPES)}")
    engines = [e for e in args.engines.split(",") if e]
    if not engines or any(e not in ENGINE_NAMES for e in engines):
        parser.error(f"--engines={args.engines!r}: expected some of {list(ENGINE_NAMES)}")
    try:
        tokens = sorted({int(t) for t in args.tokens.split(",") if t})
    except ValueError:
        parser.error(f"--tokens={args.tokens!r}: expected comma-separated integers")
    if not tokens or tokens[0] < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")
    if lacks_cuda_torch("bench moe"):
        return 2
    import torch
    # Every layer borrows the context's workspace: its symmetric regions (ring, combine, output rows) for the
    # largest shape and token count (symmring.moe.workspace_plan), in the heap (NVSHMEM's default: 1 GiB).
    from ..moe.workspace_plan import LayerShape, heap_bytes
    need = max(heap_bytes([LayerShape(*SHAPES[s][:2], SHAPES[s][2], SHAPES[s][3], expert_format=fmt)
                           for fmt in ("fp8", "bf16")], world_size=1, max_tokens=tokens[-1])
               + tokens[-1] * 4 * SHAPES[s][0] * 2 for s in shapes)  # + rdma staging of a few peers (per-PE sizes
                                                                     # barely depend on the ranks)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(2 ** 30, int(need * 1.25) + 2 ** 28)))
    from ..context import init
    ctx = init("nvshmem")
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    try:
        engines = available_engines(engines)
        ceilings = measure_ceilings(device)
        rows: List[Dict] = []
        done, total = [0], len(shapes) * len(tokens) * len(engines) * len(transports)
        for shape in shapes:
            for transport in transports:
                rows += bench_shape(ctx, shape, tokens, args.repeats, ceilings, engines, graphs=not args.no_graph,
                                    done=done, total=total, started=started, kernels=args.kernels,
                                    transport=transport)
            add_ratios(rows)
            add_transport_ratios(rows)
            if args.json and ctx.rank == 0:  # after every shape: a run cut short keeps what it measured
                with open(args.json, "w") as fh:
                    json.dump({"ceilings": ceilings, "rows": rows, "device": ctx.device,
                               "world_size": ctx.world_size, "complete": False}, fh, indent=1)
    finally:
        ctx.close()
    if ctx.rank == 0:
        print(format_table(rows, ceilings))
        if args.decode:
            print(format_decode_table(rows))
        if len(transports) > 1:
            print(format_transport_table(rows))
        for r in rows:
            if r.get("graph_kernels_us"):
                top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["graph_kernels_us"].items())[:8])
                print(f"kernels {r['shape']} n={r['tokens_per_rank']} {r['engine']} (us per replay): {top}")
        print(f"bench moe: {len(rows)} measurements in {time.perf_counter() - started:.0f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"ceilings": ceilings, "rows": rows, "device": ctx.device,
                           "world_size": ctx.world_size, "complete": True}, fh, indent=1)
        if args.plot:
            draw_plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
