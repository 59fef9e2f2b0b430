"""``python -m symmring bench stream [--json PATH] [--timeline PNG]``: streamed vs batch MoE, side by side.

For the three shapes of ``bench moe`` and tokens per rank (default 1024, 4096, 16384) it measures, in
one run and interleaved call by call (so clocks, power and neighbours affect both alike), the end-to-end
latency of producer + MoE (router GEMM and TopK included, fp8 dispatch) of:

* the batch-ready path (`symmring.moe.gpu.MoE` with its default ring: the whole batch is one chunk), and
* the streamed schedule (``MoE(..., tokens_per_slot, num_slots, expert_window, ack_policy)`` called with
  ``streaming=True``) for every ``tokens_per_slot`` x
  ``num_slots`` x ack policy x expert window of the sweep with ``tokens_per_slot < tokens``
  (``--num-slots call``: as many slots as the call has chunks; ``--windows 1,all``: chunk-local expert
  pools, or one window of ``num_slots`` chunks, so with ``call`` one grouped GEMM over the whole call),

and reports the ratio streamed / batch (median of ``--repeats`` warm calls each). ``--graph`` also
measures both captured into CUDA graphs (the streamed path launches ~15 kernels per chunk, so eagerly it
pays the host's launch cost per chunk).

The automatic policy table (`symmring.moe.gpu.policy.StreamPolicy`) picks, per shape and token count, the
fastest measured streamed configuration when it beat batch by at least 3 % (the run-to-run noise of one
ratio), else batch; ``recheck`` times each streamed choice again against batch on other inputs and
weights with twice the repeats (the honest check: the choice was picked on the data it was measured on).

``--timeline PNG`` runs the largest size of the first shape once more with device timestamps
(``%globaltimer``, stamped by one-thread kernels between the stages on each stream) for two
configurations -- the best streamed one, and the best with chunk-local expert pools (window 1), whose
chunks pipeline -- and draws producer and consumer stages per chunk (matplotlib), with the overlap fraction
(time both streams do work, waits excluded / span). ``--spin-check`` measures what waiting costs:
the producer's work for one call (router GEMM, TopK, route and layout kernels of every chunk) timed alone
and beside ``world_size + 1`` blocks running the consumer's wait loop (the documented spin budget), as
the slowdown in percent. Under several ranks (``python -m symmring.launch -n N -- python -m
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

from . import lacks_cuda_torch, progress

from ..moe.gpu.policy import DEFAULT_MARGIN, StreamPolicy, resolve
from .moe import SHAPES, layer_weights
from ..moe.config import Experts, RoutingConfig, ScheduleConfig

logger = logging.getLogger(__name__)

DEFAULT_TOKENS = (1024, 4096, 16384)
DEFAULT_TOKENS_PER_SLOT = (1024, 2048, 4096)
DEFAULT_NUM_SLOTS = ("2", "4", "call")
DEFAULT_ACK = ("conservative", "early")
DEFAULT_WINDOWS = ("1", "all")


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


def _call(layer, x, router, graphs: Dict, use_graph: bool, streaming: bool):
    """A zero-argument call of ``layer`` on ``x``: eager, or the replay of its graph (captured once)."""
    if not use_graph:
        return lambda: layer.forward(x, router_weight=router, streaming=streaming)
    key = (id(layer), x.shape[0], streaming)
    if key not in graphs:
        graphs[key] = layer.capture(x, router_weight=router, streaming=streaming)[0]
    return graphs[key].replay


def bench_shape(ctx, name: str, tokens: List[int], configs: List[Dict], repeats: int, use_graph: bool,
                seed: int = 0) -> List[Dict]:
    import torch
    from ..moe.gpu.layer import MoE
    hidden, inter, num_experts, topk = SHAPES[name]
    device, gen, (w_gate, w_up, w_down, router) = layer_weights(ctx, name, seed)
    max_tokens = max(tokens)
    xs = {n: torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen) for n in tokens}
    batch = MoE(ctx, Experts(w_gate, w_up, w_down), RoutingConfig(num_experts, topk), max_tokens=max_tokens)
    # Resolved layer arguments -> {size: the sweep entry (its rules "call"/"all")}; a layer measured once
    # per size even when several entries resolve to it (window 2 == "all" with 2 slots).
    plans: Dict = {}
    for cfg in configs:
        for n in tokens:
            layer_cfg = resolve(cfg, n)
            if layer_cfg is not None:
                plans.setdefault(tuple(sorted(layer_cfg.items())), {}).setdefault(n, cfg)
    rows: List[Dict] = []
    try:
        for key, rules in plans.items():
            layer_cfg, sizes = dict(key), sorted(rules)
            streamed = MoE(ctx, Experts(w_gate, w_up, w_down), RoutingConfig(num_experts, topk),
                           max_tokens=max(sizes), schedule=ScheduleConfig(**layer_cfg))
            graphs: Dict = {}
            try:
                for n in sizes:
                    reps = repeats if n <= 4096 else max(3, repeats // 2)
                    ctx.collectives.barrier(what="bench: timing")
                    fns = [_call(batch, xs[n], router, graphs, use_graph, streaming=False),
                           _call(streamed, xs[n], router, graphs, use_graph, streaming=True)]
                    t_batch, t_stream = _interleaved(fns, reps)
                    batch.check_errors()
                    streamed.check_errors()
                    row = {"shape": name, "tokens_per_rank": n, "world_size": ctx.world_size, "hidden": hidden,
                           "inter": inter, "num_experts": num_experts, "topk": topk,
                           "graph": use_graph, **layer_cfg, "ack_policy": str(layer_cfg["ack_policy"]),
                           "num_slots_rule": rules[n]["num_slots"], "expert_window_rule": rules[n]["expert_window"],
                           "num_chunks": -(-n // layer_cfg["tokens_per_slot"]),
                           "batch_ms": statistics.median(t_batch), "streamed_ms": statistics.median(t_stream)}
                    row["ratio"] = row["streamed_ms"] / row["batch_ms"]
                    rows.append(row)
                    progress("bench stream", len(rows), None, f"{name} n={n} {layer_cfg}: ratio {row['ratio']:.2f}",
                             rank=ctx.rank)
                    logger.info("%s n=%d %s: batch %.3f ms, streamed %.3f ms (%.2f)", name, n, layer_cfg,
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


def policy_table(rows: List[Dict], margin: float = DEFAULT_MARGIN) -> List[Dict]:
    """Per (shape, tokens): the fastest streamed configuration if it beat batch by ``margin``, else batch
    (`symmring.moe.gpu.policy.StreamPolicy`)."""
    return StreamPolicy.from_rows(rows, margin).entries


def recheck_policy(ctx, table: List[Dict], repeats: int, use_graph: bool) -> None:
    """Time each chosen streamed configuration against batch again (held-out: other random inputs and
    weights, twice the repeats), in place: ``recheck`` (1.0 where batch was chosen)."""
    for entry in table:
        if entry["choice"] is None:
            entry["recheck"] = 1.0
            continue
        rows = bench_shape(ctx, entry["shape"], [entry["tokens_per_rank"]], [dict(entry["choice"])], 2 * repeats,
                           use_graph, seed=1)
        entry["recheck"] = rows[0]["ratio"] if rows else float("nan")


def timeline(ctx, shape: str, n: int, cfgs: List[Dict], png_path: str) -> List[Dict]:
    """One call per configuration with device timestamps; one PNG with a panel each. Returns the data."""
    import torch
    from ..moe.gpu.layer import MoE
    from ..moe.gpu.timeline import hidden_producer_fraction, overlap_fraction
    hidden, inter, num_experts, topk = SHAPES[shape]
    device, gen, (w_gate, w_up, w_down, router) = layer_weights(ctx, shape, seed=3)
    x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    panels = []
    for cfg in cfgs:
        moe = MoE(ctx, Experts(w_gate, w_up, w_down), RoutingConfig(num_experts, topk), max_tokens=n,
                  schedule=ScheduleConfig(**cfg))
        try:
            for _ in range(2):
                moe.forward(x, router_weight=router, streaming=True)
            moe.debug.forward(x, router_weight=router, streaming=True, timeline=True)
            moe.check_errors()
            records = moe.debug.timeline_records()
        finally:
            moe.close()
        frac, hidden_frac = overlap_fraction(records), hidden_producer_fraction(records)
        title = (f"{shape}, {n} tokens/rank, {cfg['tokens_per_slot']} tokens x {cfg['num_slots']} slots, window "
                 f"{cfg['expert_window']}, {cfg['ack_policy']} ack, rank 0 of {ctx.world_size}: both working "
                 f"{100 * frac:.0f}% of the span, {100 * hidden_frac:.0f}% of the producer's work hidden")
        panels.append({"shape": shape, "tokens_per_rank": n, **cfg, "ack_policy": str(cfg["ack_policy"]),
                       "overlap_fraction": frac, "hidden_producer_fraction": hidden_frac, "title": title,
                       "records": records, "png": png_path})
    if ctx.rank == 0 and png_path:
        draw_timeline([(p["records"], p["title"]) for p in panels], png_path)
    return panels


def draw_timeline(panels: List, png_path: str) -> None:
    """Per panel ``(records, title)``: producer and consumer stages of every chunk (window) as bars on two
    lanes (matplotlib, Agg), one PNG; spins ("wait") in light grey."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"wait": "0.85", "route": "tab:blue", "layout": "tab:cyan", "dispatch": "tab:orange",
              "experts": "tab:red", "combine": "tab:green"}
    lanes = {"producer": 1, "consumer": 0}
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 2.8 * len(panels)), squeeze=False)
    for ax, (records, title) in zip(axes[:, 0], panels):
        for r in records:
            ax.broken_barh([(r["start_ns"] / 1e3, max(r["end_ns"] - r["start_ns"], 1) / 1e3)],
                           (lanes[r["stream"]] - 0.4, 0.8), color=colors[r["stage"]], edgecolor="black",
                           linewidth=0.3)
        ax.set_yticks([0, 1], ["consumer", "producer"])
        ax.set_ylim(-0.6, 2.0)  # room for the legend above the producer lane
        ax.set_xlabel("us (device %globaltimer)")
        ax.set_title(title, fontsize=8)
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
                  loc="upper right", ncol=len(colors), fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def spin_check(ctx, shape: str, n: int, tokens_per_slot: int, repeats: int) -> Dict:
    """The producer's work of one call (every chunk's router GEMM, TopK, route and layout kernels, on the
    producer stream of a ring with a slot per chunk, so it never waits; all launches enqueued behind a
    50 ms sleep kernel first) timed alone and beside ``world_size + 1`` blocks of the consumer's wait loop
    (``moe_spin_probe``), interleaved."""
    import torch
    from ..moe.gpu import plan as plans
    from ..moe.gpu import kernel_args, stages
    from ..moe.gpu.layer import MoE
    hidden, inter, num_experts, topk = SHAPES[shape]
    device, gen, (w_gate, w_up, w_down, router) = layer_weights(ctx, shape, seed=2)
    x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    chunks = -(-n // tokens_per_slot)
    moe = MoE(ctx, Experts(w_gate, w_up, w_down), RoutingConfig(num_experts, topk), max_tokens=n,
              schedule=ScheduleConfig(num_slots=chunks, tokens_per_slot=tokens_per_slot))
    plan = plans.make_plan([n] * ctx.world_size, ctx.rank, tokens_per_slot=tokens_per_slot, num_slots=chunks,
                           expert_window=1, streaming=True, two_streams=True, topk=topk, capacity=moe.capacity)
    blocks = ctx.world_size + 1
    word = torch.zeros(1, dtype=torch.int64, device=device)
    spinner = torch.cuda.Stream(device=device)
    producer = torch.cuda.Stream(device=device)
    executor = moe.executor
    k, state = executor.kernels, executor.state
    probe = moe.backend.library_module("moe_schedule").function("moe_spin_probe")
    idx, weights = executor.topk_idx, executor.topk_weights

    def produce_call(spin: bool) -> float:
        moe.reset()  # fresh ring: every slot free, generation base 0 (collective)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin:  # spin well past the producer's work; nobody ever sets the word
            probe((blocks,), (32,), kernel_args.pack(kernel_args.STRUCTS["SpinProbeArgs"], word=word.data_ptr(),
                                                     until=1, duration_ns=200_000_000),
                  stream=executor.stream(spinner.cuda_stream))
        p_stream = executor.stream(producer.cuda_stream)
        with torch.cuda.stream(producer):
            # Hold the stream while the host enqueues every launch, so the events time the device's work,
            # not the host's launch rate.
            stages.sleep(k, state, p_stream, ns=50_000_000)
            start.record()
            for chunk in plan.chunks:
                stages.produce_chunk(k, state, p_stream, chunk=chunk, x=x, router=moe.router, kind="router",
                                     source=router, topk_idx=idx, topk_weights=weights, layer=moe.layer_id)
            end.record()
        end.synchronize()
        torch.cuda.synchronize()  # the probe ends by its bound
        return start.elapsed_time(end)

    try:
        for _ in range(2):
            produce_call(False)
            produce_call(True)
        alone, beside = [], []
        for _ in range(repeats):
            alone.append(produce_call(False))
            beside.append(produce_call(True))
        moe.reset()
    finally:
        moe.close()
    a, b = statistics.median(alone), statistics.median(beside)
    return {"shape": shape, "tokens_per_rank": n, "tokens_per_slot": tokens_per_slot, "spin_blocks": blocks,
            "producer_alone_ms": a, "producer_beside_spin_ms": b, "slowdown_pct": 100 * (b / a - 1)}


def format_rows(rows: List[Dict]) -> str:
    lines = [f"{'shape':<14} {'tokens':>6} {'T/slot':>6} {'slots':>5} {'window':>6} {'ack':>12} {'chunks':>6} "
             f"{'batch ms':>9} {'stream ms':>9} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['shape']:<14} {r['tokens_per_rank']:>6} {r['tokens_per_slot']:>6} {r['num_slots']:>5} "
                     f"{r.get('expert_window', 1):>6} {r['ack_policy']:>12} {r['num_chunks']:>6} {r['batch_ms']:>9.3f} "
                     f"{r['streamed_ms']:>9.3f} {r['ratio']:>6.2f}")
    return "\n".join(lines)


def format_policy(table: List[Dict]) -> str:
    lines = [f"{'shape':<14} {'tokens':>6} {'choice':<40} {'best streamed':>13} {'chosen':>6} {'recheck':>7}"]
    for e in table:
        choice = "batch" if e["choice"] is None else \
            (f"{e['choice']['tokens_per_slot']} x {e['choice']['num_slots']} slots, window "
             f"{e['choice'].get('expert_window', 1)}, {e['choice']['ack_policy']}")
        lines.append(f"{e['shape']:<14} {e['tokens_per_rank']:>6} {choice:<40} {e['best_streamed_ratio']:>13.2f} "
                     f"{e['ratio']:>6.2f} {e.get('recheck', float('nan')):>7.2f}")
    return "\n".join(lines)


def _ints(text: str, name: str, parser) -> List[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t})
    except ValueError:
        parser.error(f"{name}={text!r}: expected comma-separated integers")
    if not values or values[0] < 1:
        parser.error(f"{name}={text!r}: expected positive integers")
    return values


def _ints_or(text: str, name: str, word: str, parser) -> List:
    """Comma-separated positive integers and/or ``word`` (kept as the string), in the given order."""
    values: List = []
    for t in (t for t in text.split(",") if t):
        if t == word:
            values.append(word)
            continue
        try:
            v = int(t)
        except ValueError:
            parser.error(f"{name}={text!r}: expected comma-separated positive integers or {word!r}")
        if v < 1:
            parser.error(f"{name}={text!r}: expected positive integers or {word!r}")
        values.append(str(v))
    if not values:
        parser.error(f"{name}={text!r}: expected at least one value")
    return list(dict.fromkeys(values))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m symmring bench stream",
                                     description="The streamed schedule against the batch-ready path of the GPU MoE "
                                                 "layer, side by side, and the automatic streaming policy.")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument("--timeline", metavar="PNG", help="draw the overlap timeline of one call to this PNG")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="tokens per rank")
    parser.add_argument("--tokens-per-slot", default=",".join(map(str, DEFAULT_TOKENS_PER_SLOT)))
    parser.add_argument("--num-slots", default=",".join(DEFAULT_NUM_SLOTS),
                        help="slots per ring; 'call' = one slot per chunk of the call")
    parser.add_argument("--windows", default=",".join(DEFAULT_WINDOWS),
                        help="expert windows (chunks per grouped GEMM); 'all' = num_slots")
    parser.add_argument("--spin-check", action="store_true",
                        help="measure the producer's slowdown beside spinning consumer waits")
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
    slots = _ints_or(args.num_slots, "--num-slots", "call", parser)
    windows = _ints_or(args.windows, "--windows", "all", parser)
    acks = [a for a in args.ack.split(",") if a]
    if not acks or any(a not in DEFAULT_ACK for a in acks):
        parser.error(f"--ack={args.ack!r}: expected some of {list(DEFAULT_ACK)}")
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    if lacks_cuda_torch("bench stream"):
        return 2
    configs = [dict(tokens_per_slot=t, num_slots=s, expert_window=w, ack_policy=a)
               for t in per_slot for s in slots for w in windows for a in acks]
    # Symmetric heap: batch ring + combine, streamed ring (at most a slot per chunk: ~ one batch ring, or
    # num_slots slots) + combine, of the largest size; bf16 rows bound the fp8 ones.
    ring_tokens = max([tokens[-1] + max(per_slot)] + [int(s) * max(per_slot) for s in slots if s != "call"])
    from ..moe.workspace_plan import LayerShape, heap_bytes
    need = max(heap_bytes([LayerShape(*SHAPES[s][:2], SHAPES[s][2], SHAPES[s][3])], world_size=1,
                          max_tokens=tokens[-1]) + (tokens[-1] + ring_tokens) * SHAPES[s][0] * 2 for s in shapes)
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
            # The first shape at its largest size: the best streamed configuration (even if batch won) and
            # the best with chunk-local pools (window 1), whose chunks pipeline.
            big = [r for r in rows if r["shape"] == shapes[0] and r["tokens_per_rank"] == tokens[-1]]
            picks = [min(group, key=lambda r: r["ratio"])
                     for group in (big, [r for r in big if r["expert_window"] == 1]) if group]
            cfgs = [{k: r[k] for k in ("tokens_per_slot", "num_slots", "expert_window", "ack_policy")}
                    for r in picks]
            cfgs = [c for i, c in enumerate(cfgs) if c not in cfgs[:i]]
            if cfgs:
                result["timeline"] = timeline(ctx, shapes[0], tokens[-1], cfgs, args.timeline)
        if args.spin_check:
            n = tokens[-1]
            result["spin_check"] = [spin_check(ctx, shape, n, min(per_slot), max(5, args.repeats))
                                    for shape in shapes]
    finally:
        ctx.close()
    if ctx.rank == 0:
        print(format_rows(result.get("rows", [])))
        print("\nautomatic policy (fastest measured; recheck = the choice timed again vs batch):")
        print(format_policy(result.get("policy", [])))
        for panel in result.get("timeline", []):
            print(f"\ntimeline {panel['png']}: {panel['title']}")
        for sc in result.get("spin_check", []):
            print(f"spin check: {sc['shape']} {sc['tokens_per_rank']} tokens in chunks of {sc['tokens_per_slot']}: "
                  f"producer {sc['producer_alone_ms']:.3f} ms alone, {sc['producer_beside_spin_ms']:.3f} ms beside "
                  f"{sc['spin_blocks']} spinning blocks: {sc['slowdown_pct']:+.2f}%")
        print(f"bench stream: {len(result.get('rows', []))} measurements in {time.perf_counter() - started:.0f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
