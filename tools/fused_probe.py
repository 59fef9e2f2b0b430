"""The fused experts kernel alone, outside the layer: milliseconds and the weights' bandwidth per shape and size.

Usage (on a GPU machine, from a tree's root; ``PYTHONPATH`` naming that tree)::

    python tools/fused_probe.py [--kernels wg64t,wg128t] [--bounds exact,layer,none] [--repeats 10]

For each shape (DeepSeek-V3-like and Qwen3-30B-A3B-like, 64, 512 and 4096 tokens) it builds the seeded
dispatch-shaped pool and fp8 weights of ``tests/gpu/test_fused_engine.py`` and times ``FusedExperts.forward``
with CUDA events (median of ``--repeats`` after two warm calls) for each rows-per-expert bound the engine can be
given: ``exact`` (the pool's largest expert), ``layer`` (the call's tokens: what the layer passes) and ``none``
(every m block listed). It prints one line per case: the time, and the weights the call touches over it in TB/s
(each touched expert's ``3 * hidden * inter`` bytes once: the kernel's roofline term where experts hold few rows).

Two trees side by side (the same card, one machine call) compare kernels without the layer around them; session
14 ran it so in probe trees with experiment switches (docs/FUSED.md "Measured: where wg64t's time goes").
"""

from __future__ import annotations

import argparse
import os
import sys

BOUNDS = ("exact", "layer", "none")
CASES = {"deepseek-v3": (64, 512, 4096), "qwen3-30b-a3b": (64, 512, 4096)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="wg64t",
                        help="comma-separated fused kernels (symmring.moe.engines.fused.KERNELS)")
    parser.add_argument("--bounds", default=",".join(BOUNDS), help="comma-separated of " + ", ".join(BOUNDS))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    bounds = args.bounds.split(",")
    if not set(bounds) <= set(BOUNDS) or args.repeats < 1:
        parser.error(f"--bounds: expected some of {', '.join(BOUNDS)}; --repeats: at least 1")

    import torch
    if not torch.cuda.is_available():
        print("fused_probe: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    root = os.getcwd()
    sys.path[:0] = [os.path.join(root, "tests", "gpu"), os.path.join(root, "tests")]
    import test_fused_engine as t  # the seeded pool and weights of the GPU tests
    from symmring.moe.engines.fused import FusedExperts
    for shape, sizes in CASES.items():
        hidden, inter, num_experts, topk = t.SHAPES[shape]
        weights = t.fp8_weights(hidden, inter, num_experts, t.SEED)
        for n in sizes:
            pool, num_rows, per_expert, live = t.make_pool(hidden, num_experts, topk, n, t.SEED + n)
            touched = int(torch.unique(pool.m_indices[live]).numel())
            terabytes = touched * 3 * hidden * inter / 1e12
            for kernel in args.kernels.split(","):
                engine = FusedExperts(weights, kernel=kernel)
                for name in bounds:
                    bound = {"exact": per_expert, "layer": n, "none": None}[name]
                    for _ in range(2):
                        engine.forward(pool, num_rows, bound)
                    # Not symmring.bench.timed_ms: it synchronises after each call, so its events would also
                    # bracket forward's host work (prepare, tensor maps) with the GPU idle; enqueued back to back,
                    # each call's host work overlaps the kernel before it and the events time the device.
                    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                              for _ in range(args.repeats)]
                    for start, end in events:
                        start.record()
                        engine.forward(pool, num_rows, bound)
                        end.record()
                    torch.cuda.synchronize()
                    engine.check_status()
                    times = sorted(start.elapsed_time(end) for start, end in events)
                    ms = times[len(times) // 2]
                    print(f"probe {shape} n={n} {kernel} bound={name}({bound}) rows={num_rows} "
                          f"max/expert={per_expert} experts={touched}: {ms:.3f} ms, "
                          f"{terabytes / (ms / 1e3):.2f} TB/s of weights", flush=True)
                del engine
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
