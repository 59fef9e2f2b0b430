"""Where an eager call's host time goes: one layer of a ``bench moe`` shape, eager calls with the graph cache.

Usage (one PE, on a GPU machine): ``python tools/eager_probe.py [--shape qwen3-30b-a3b] [--tokens 1]
[--engine fused]``; run it once per package to compare (``PYTHONPATH=OTHER`` puts another commit's package
first). Prints one line: the median milliseconds of an eager call (CUDA events, the graph cache on) with
Python's garbage collector on and off, and of one call timed as ``bench moe --anchor`` times it (events around
it, then a synchronisation: the host's work before the GPU's shows), the host microseconds per call
(``perf_counter`` around ``forward`` alone), the process's CPU affinity, its thread count and the number of
objects the collector tracks. ``--profile CALLS`` then profiles that many calls (cProfile, top 25 by own time:
where the host microseconds go).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--engine", default="builtin", help="the layer's expert engine (builtin, fused, ...)")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also profile this many calls with cProfile and print the top 25 by own time")
    args = parser.parse_args()
    import torch
    import symmring
    from symmring.bench.moe import SHAPES, layer_weights
    from symmring.context import init
    from symmring.moe.gpu import MoE
    from symmring.moe.config import Experts, RoutingConfig
    ctx = init("nvshmem")
    hidden, inter, num_experts, topk = SHAPES[args.shape]
    device, gen, (w_gate, w_up, w_down, router) = layer_weights(ctx, args.shape, seed=0)
    moe = MoE(ctx, Experts(w_gate, w_up, w_down, expert_dtype="fp8"), RoutingConfig(num_experts, topk),
              max_tokens=max(args.tokens, 64), engine=args.engine)
    x = torch.randn(args.tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    for _ in range(50):
        moe.forward(x, router_weight=router)
    torch.cuda.synchronize()

    def timed(calls: int):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = []
        start.record()
        for _ in range(calls):
            t0 = time.perf_counter()
            moe.forward(x, router_weight=router)
            host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls, statistics.median(host) * 1e6

    def synced(calls: int):  # as `bench moe --anchor` times a call: events around it, then a synchronisation
        from symmring.bench import timed_ms
        return statistics.median(timed_ms(lambda: moe.forward(x, router_weight=router), calls))

    on_ms, on_us = timed(args.calls)
    one_ms = synced(min(args.calls, 50))
    gc.disable()
    off_ms, off_us = timed(args.calls)
    gc.enable()
    threads = len(os.listdir("/proc/self/task"))
    print(f"eager_probe {symmring.__file__}: {args.shape} {args.engine} {args.tokens} tokens: {on_ms:.4f} ms per "
          f"call (host {on_us:.1f} us median), gc off {off_ms:.4f} ms (host {off_us:.1f} us); affinity "
          f"{len(os.sched_getaffinity(0))} cpus, {threads} threads, {len(gc.get_objects())} gc objects, "
          f"graph cache {moe.graph_cache_info()}; one call then a synchronisation: {one_ms:.4f} ms", flush=True)
    if args.profile:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.profile):
            moe.forward(x, router_weight=router)
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    moe.close()
    ctx.close()


if __name__ == "__main__":
    main()
