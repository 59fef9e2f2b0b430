"""``python -m symmring bench stream [--json PATH] [--timeline PNG]``: streamed vs batch MoE, side by side.

NOT YET RUN ON A GPU (written without device time; docs/MOE_STREAMED.md).

For the three shapes of ``bench moe`` and tokens per rank (default 1024, 4096, 16384) it measures, in
one run and interleaved call by call (so clocks, power and neighbours affect both alike), the end-to-end
latency of producer + MoE (router GEMM and TopK included, fp8 dispatch) of:

* the batch layer (`symmring.moe.gpu.MoE`: the whole batch is one chunk), and
* the streamed layer (`symmring.moe.gpu_streamed.StreamedMoE`) for every ``tokens_per_slot`` x
  ``num_slots`` x ack policy of the sweep with ``tokens_per_slot < tokens``,

and reports the ratio streamed / batch (median of ``--repeats`` warm calls each). ``--graph`` also
measures both captured into CUDA graphs (the streamed path launches ~15 kernels per chunk, so eagerly it
pays the host's launch cost per chunk).

The automatic policy table picks, per shape and token count, the fastest measured configuration, or
batch when no streamed one beats it (its ratio is <= 1 on the data it was picked from; held-out
re-measurement is the honest check, printed as ``recheck``: the chosen configuration timed again against
batch).

``--timeline PNG`` runs the largest size of the first shape once more with the best streamed
configuration and device timestamps (``%globaltimer``, stamped by one-thread kernels between the stages
on each stream), and draws producer and consumer stages per chunk (matplotlib), with the overlap fraction
(time both streams run a stage / span). Under several ranks (``python -m symmring.launch -n N -- python -m
symmring bench stream``) every rank runs the same sweep; rank 0 prints and writes.
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

from .moe import SHAPES, layer_weights

logger = logging.getLogger(__name__)

DEFAULT_TOKENS = (1024, 4096, 16384)
DEFAULT_TOKENS_PER_SLOT = (256, 512, 1024, 2048, 4096)
DEFAULT_NUM_SLOTS = (2, 3)
DEFAULT_ACK = ("conservative", "early")


def _interleaved(fns, repeats: int, warmup: int = 2) -> List[List[float]]:
    """Milliseconds of ``repeats`` calls of each of ``fns``, interleaved call by call (CUDA events)."""
    import torch
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return times


def _call(layer, x, router, graphs: Dict, use_graph: bool):
    """A zero-argument call of ``layer`` on ``x``: eager, or the replay of its graph (captured once)."""
    if not use_graph:
        return lambda: layer.forward(x, router_weight=router)
    key = (id(layer), x.shape[0])
    if key not in graphs:
        graphs[key] = layer.capture(x, router_weight=router)[0]
    return graphs[key].replay


def bench_shape(ctx, name: str, tokens: List[int], configs: List[Dict], repeats: int, use_graph: bool,
                seed: int = 0) -> List[Dict]:
    import torch
    from ..moe.gpu import MoE
    from ..moe.gpu_streamed import StreamedMoE
    hidden, inter, num_experts, topk = SHAPES[name]
    device, gen, (w_gate, w_up, w_down, router) = layer_weights(ctx, name, seed)
    max_tokens = max(tokens)
    xs = {n: torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen) for n in tokens}
    batch = MoE(ctx, num_experts, hidden, inter, topk, w_gate, w_up, w_down, max_tokens=max_tokens)
    rows: List[Dict] = []
    try:
        for cfg in configs:
            sizes = [n for n in tokens if cfg["tokens_per_slot"] < n]
            if not sizes:
                continue
            streamed = StreamedMoE(ctx, num_experts, hidden, inter, topk, w_gate, w_up, w_down,
                                   max_tokens=max_tokens, **cfg)
            graphs: Dict = {}
            try:
                for n in sizes:
                    reps = repeats if n <= 4096 else max(3, repeats // 2)
                    ctx.comm.Barrier()
                    fns = [_call(batch, xs[n], router, graphs, use_graph),
                           _call(streamed, xs[n], router, graphs, use_graph)]
                    t_batch, t_stream = _interleaved(fns, reps)
                    batch.check_errors()
                    streamed.check_errors()
                    row = {"shape": name, "tokens_per_rank": n, "world_size": ctx.world_size,
                           "graph": use_graph, **cfg, "ack_policy": str(cfg["ack_policy"]),
                           "num_chunks": -(-n // cfg["tokens_per_slot"]),
                           "batch_ms": statistics.median(t_batch), "streamed_ms": statistics.median(t_stream)}
                    row["ratio"] = row["streamed_ms"] / row["batch_ms"]
                    rows.append(row)
                    logger.info("%s n=%d %s: batch %.3f ms, streamed %.3f ms (%.2f)", name, n, cfg,
                                row["batch_ms"], row["streamed_ms"], row["ratio"])
            finally:
                graphs.clear()
                streamed.close()
                del streamed
                torch.cuda.empty_cache()
    finally:
        batch.close()
        del batch, xs
        torch.cuda.empty_cache()
    return rows


def policy_table(rows: List[Dict]) -> List[Dict]:
    """Per (shape, tokens): the fastest measured streamed configuration, or batch when none beats it."""
    best: Dict = {}
    for r in rows:
        key = (r["shape"], r["tokens_per_rank"])
        cur = best.get(key)
        if cur is None or r["ratio"] < cur["ratio"]:
            best[key] = r
    table = []
    for (shape, n), r in sorted(best.items()):
        streamed = r["ratio"] < 1.0
        table.append({"shape": shape, "tokens_per_rank": n,
                      "choice": ({k: r[k] for k in ("tokens_per_slot", "num_slots", "ack_policy")}
                                 if streamed else "batch"),
                      "ratio": r["ratio"] if streamed else 1.0, "best_streamed_ratio": r["ratio"]})
    return table


def recheck_policy(ctx, table: List[Dict], repeats: int, use_graph: bool) -> None:
    """Time each chosen streamed configuration against batch again (held-out), in place: ``recheck``."""
    for entry in table:
        if entry["choice"] == "batch":
            entry["recheck"] = 1.0
            continue
        rows = bench_shape(ctx, entry["shape"], [entry["tokens_per_rank"]], [dict(entry["choice"])], repeats,
                           use_graph, seed=1)
        entry["recheck"] = rows[0]["ratio"] if rows else float("nan")


def timeline(ctx, shape: str, n: int, cfg: Dict, png_path: str) -> Dict:
    """One call with device timestamps; the PNG of producer/consumer stages per chunk. Returns the data."""
    import torch
    from ..moe.gpu_streamed import StreamedMoE, overlap_fraction
    hidden, inter, num_experts, topk = SHAPES[shape]
    device = torch.device("cuda", torch.cuda.current_device())
    E_local = num_experts // ctx.world_size
    w = [torch.randn(*s, device=device, dtype=torch.bfloat16) * 0.02
         for s in ((E_local, inter, hidden), (E_local, inter, hidden), (E_local, hidden, inter))]
    router = torch.randn(num_experts, hidden, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16)
    moe = StreamedMoE(ctx, num_experts, hidden, inter, topk, *w, max_tokens=n, **cfg)
    try:
        for _ in range(2):
            moe.forward(x, router_weight=router)
        moe.forward(x, router_weight=router, timeline=True)
        moe.check_errors()
        records = moe.timeline_records()
    finally:
        moe.close()
    frac = overlap_fraction(records)
    if ctx.rank == 0 and png_path:
        draw_timeline(records, f"{shape}, {n} tokens/rank, {cfg['tokens_per_slot']} tokens x {cfg['num_slots']} "
                      f"slots, {cfg['ack_policy']} ack, rank 0 of {ctx.world_size}: overlap {100 * frac:.0f}% of span",
                      png_path)
    return {"shape": shape, "tokens_per_rank": n, **cfg, "ack_policy": str(cfg["ack_policy"]),
            "overlap_fraction": frac, "records": records, "png": png_path}


def draw_timeline(records: List[Dict], title: str, png_path: str) -> None:
    """Producer and consumer stages of every chunk as bars on two lanes (matplotlib, Agg) into a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"route": "tab:blue", "layout": "tab:cyan", "dispatch": "tab:orange", "experts": "tab:red",
              "combine": "tab:green"}
    lanes = {"producer": 1, "consumer": 0}
    fig, ax = plt.subplots(figsize=(12, 3))
    for r in records:
        ax.broken_barh([(r["start_ns"] / 1e3, max(r["end_ns"] - r["start_ns"], 1) / 1e3)],
                       (lanes[r["stream"]] - 0.4, 0.8), color=colors[r["stage"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks([0, 1], ["consumer", "producer"])
    ax.set_ylim(-0.6, 2.0)  # room for the legend above the producer lane
    ax.set_xlabel("us (device %globaltimer)")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
              loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def format_rows(rows: List[Dict]) -> str:
    lines = [f"{'shape':<14} {'tokens':>6} {'T/slot':>6} {'slots':>5} {'ack':>12} {'chunks':>6} "
             f"{'batch ms':>9} {'stream ms':>9} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['shape']:<14} {r['tokens_per_rank']:>6} {r['tokens_per_slot']:>6} {r['num_slots']:>5} "
                     f"{r['ack_policy']:>12} {r['num_chunks']:>6} {r['batch_ms']:>9.3f} {r['streamed_ms']:>9.3f} "
                     f"{r['ratio']:>6.2f}")
    return "\n".join(lines)


def format_policy(table: List[Dict]) -> str:
    lines = [f"{'shape':<14} {'tokens':>6} {'choice':<40} {'ratio':>6} {'recheck':>7}"]
    for e in table:
        choice = e["choice"] if e["choice"] == "batch" else \
            f"{e['choice']['tokens_per_slot']} x {e['choice']['num_slots']} slots, {e['choice']['ack_policy']}"
        lines.append(f"{e['shape']:<14} {e['tokens_per_rank']:>6} {choice:<40} {e['ratio']:>6.2f} "
                     f"{e.get('recheck', float('nan')):>7.2f}")
    return "\n".join(lines)


def _ints(text: str, name: str, parser) -> List[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t})
    except ValueError:
        parser.error(f"{name}={text!r}: expected comma-separated integers")
    if not values or values[0] < 1:
        parser.error(f"{name}={text!r}: expected positive integers")
    return values


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m symmring bench stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument("--timeline", metavar="PNG", help="draw the overlap timeline of one call to this PNG")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="tokens per rank")
    parser.add_argument("--tokens-per-slot", default=",".join(map(str, DEFAULT_TOKENS_PER_SLOT)))
    parser.add_argument("--num-slots", default=",".join(map(str, DEFAULT_NUM_SLOTS)))
    parser.add_argument("--ack", default=",".join(DEFAULT_ACK), help="ack policies: conservative,early")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per size (half above 4096)")
    parser.add_argument("--graph", action="store_true", help="time CUDA graph replays instead of eager calls")
    parser.add_argument("--no-recheck", action="store_true", help="skip the held-out re-timing of the policy")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected some of {list(SHAPES)}")
    tokens = _ints(args.tokens, "--tokens", parser)
    per_slot = _ints(args.tokens_per_slot, "--tokens-per-slot", parser)
    slots = _ints(args.num_slots, "--num-slots", parser)
    acks = [a for a in args.ack.split(",") if a]
    if not acks or any(a not in DEFAULT_ACK for a in acks):
        parser.error(f"--ack={args.ack!r}: expected some of {list(DEFAULT_ACK)}")
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    missing = missing_cuda_torch()
    if missing:
        print(f"bench stream: {missing}", file=sys.stderr)
        return 2
    configs = [dict(tokens_per_slot=t, num_slots=s, ack_policy=a) for t in per_slot for s in slots for a in acks]
    # Symmetric heap: batch ring + combine, streamed ring + combine, of the largest size.
    need = max(2 * tokens[-1] * SHAPES[s][3] * SHAPES[s][0] * 2 + 2 * tokens[-1] * SHAPES[s][0] * 2
               + max(slots) * max(per_slot) * SHAPES[s][0] * 2 for s in shapes)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(2 ** 30, int(need * 1.25) + 2 ** 28)))
    from ..context import init
    ctx = init("nvshmem")
    started = time.perf_counter()
    result: Dict = {"world_size": ctx.world_size, "device": ctx.device, "graph": args.graph}
    try:
        rows: List[Dict] = []
        for shape in shapes:
            rows += bench_shape(ctx, shape, tokens, configs, args.repeats, args.graph)
        table = policy_table(rows)
        if not args.no_recheck:
            recheck_policy(ctx, table, args.repeats, args.graph)
        result.update(rows=rows, policy=table)
        if args.timeline:
            first = [e for e in table if e["shape"] == shapes[0] and e["choice"] != "batch"]
            big = max(first, key=lambda e: e["tokens_per_rank"]) if first else None
            cfg = dict(big["choice"]) if big else dict(tokens_per_slot=per_slot[0], num_slots=slots[-1],
                                                       ack_policy=acks[0])
            result["timeline"] = timeline(ctx, shapes[0], big["tokens_per_rank"] if big else tokens[-1], cfg,
                                          args.timeline)
    finally:
        ctx.close()
    if ctx.rank == 0:
        print(format_rows(result.get("rows", [])))
        print("\nautomatic policy (fastest measured; recheck = the choice timed again vs batch):")
        print(format_policy(result.get("policy", [])))
        if "timeline" in result:
            print(f"\ntimeline: {result['timeline']['png']}, overlap "
                  f"{100 * result['timeline']['overlap_fraction']:.1f}% of the span")
        print(f"bench stream: {len(result.get('rows', []))} measurements in {time.perf_counter() - started:.0f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
