"""Where a decode call's time goes around the experts: the small-batch chain (producer, dispatch, experts,
combine) of a captured call, replayed.

    python tools/chain_probe.py [--shapes deepseek-v3,v4-flash] [--tokens 1,8,64] [--engine fused] [--stamps]
                                [--wide-dispatch]

For each shape and size: the anchor's seeded fp8 layer (`symmring.bench.moe_anchor`, one PE, no router) captured
(`MoE.capture`), then

* the replay's kernels with their start, end and the idle gap before each (`symmring.bench.kernel_timeline`,
  medians over five replays; a negative gap is a kernel launched early by PDL, waiting for the one before);
* ``--stamps``: the phases inside the three protocol kernels (device/symmring/chain_stamps.cuh: %globaltimer at
  each phase's end, microseconds after the producer's start, medians over ``--replays`` replays). The three
  modules are built with ``SYMMRING_CHAIN_STAMPS`` defined (a cache entry of their own); the default build has
  no trace of them;
* the replay's time through `CapturedCall.replay` (what a caller runs) and through the bare ``graph.replay``.

``--wide-dispatch`` launches the fused dispatch with eight loads in flight per thread at every size
(``moe_dispatch_fused_fp8``; `stages.small_dispatch` gives decode sizes the build with one, which has half its
code): what the small build saves a decode call. Compare against a run without it in the same call.

One PE, a GPU with NVSHMEM (nvshmem4py). Compare only figures of one run (one card, one process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

#: Name of each stamp slot (device/symmring/chain_stamps.cuh), by module.
STAMPS = {
    "moe_producer": {0: "produce: start", 1: "produce: slot free", 2: "produce: route written",
                     3: "produce: layout written (block 0)", 4: "produce: last block", 5: "produce: route ready",
                     6: "produce: layout ready"},
    "moe_dispatch": {8: "dispatch: start", 9: "dispatch: sources waited", 10: "dispatch: counted and scanned",
                     11: "dispatch: rows pulled (block 0)", 12: "dispatch: last block (EARLY)",
                     13: "dispatch: acknowledged"},
    "moe_combine": {16: "combine: start", 17: "combine: scanned, first ticket", 18: "combine: scatter (block 0)",
                    19: "combine: signalling block", 20: "combine: signalled", 21: "combine: sources waited",
                    22: "combine: reduced (block 0)"},
}
#: The slot every stamp is measured from.
ORIGIN = ("moe_producer", 0)


def parse_args(argv=None) -> argparse.Namespace:
    from symmring.bench.moe_anchor import ANCHOR_SHAPES, parse_tokens
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="deepseek-v3,v4-flash", help=f"comma-separated of {list(ANCHOR_SHAPES)}")
    parser.add_argument("--tokens", default="1,8,64", help="comma-separated tokens per call")
    parser.add_argument("--engine", default="fused", choices=("fused", "builtin"))
    parser.add_argument("--stamps", action="store_true", help="build the protocol kernels with their phase stamps")
    parser.add_argument("--replays", type=int, default=20, help="replays per case (stamps and replay times)")
    parser.add_argument("--wide-dispatch", action="store_true",
                        help="the fused dispatch with eight loads in flight per thread at every size")
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    if not args.shapes or any(s not in ANCHOR_SHAPES for s in args.shapes):
        parser.error(f"--shapes: expected some of {list(ANCHOR_SHAPES)}")
    try:
        args.tokens = parse_tokens(args.tokens)
    except ValueError as exc:
        parser.error(f"--tokens: {exc}")
    if args.replays < 1:
        parser.error("--replays: at least 1")
    return args


def stamped_source(read_source):
    """``symmring.jit.read_source`` with ``SYMMRING_CHAIN_STAMPS`` defined ahead of the sources of the modules in
    `STAMPS`."""
    from symmring.jit import LIBRARY_MODULES
    stamped = {LIBRARY_MODULES[module] for module in STAMPS}

    def read(filename: str) -> str:
        return ("#define SYMMRING_CHAIN_STAMPS\n" if filename in stamped else "") + read_source(filename)
    return read


def phases(samples) -> list:
    """``[(median microseconds after the origin, name)]`` in time order, from ``{(module, slot): [us, ...]}``."""
    rows = [(statistics.median(v), STAMPS[module][slot]) for (module, slot), v in samples.items() if v]
    return sorted(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("chain_probe: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    import cupy
    from symmring import jit
    from symmring.bench import format_timeline, kernel_timeline, timed_ms
    from symmring.bench import moe_anchor as anchor
    from symmring.context import init
    from symmring.moe.gpu import stages
    if args.stamps:
        jit.read_source = stamped_source(jit.read_source)
    if args.wide_dispatch:
        stages.SMALL_DISPATCH_ENTRIES = 0
    ctx = init("nvshmem")
    try:
        if ctx.world_size != 1:
            print("chain_probe: one PE only", file=sys.stderr)
            return 2
        stamps = {}
        if args.stamps:
            for module in STAMPS:
                loaded = ctx.backend.library_module(module).module  # the cupy module (the memory's owner)
                ptr = loaded.get_global_var("symmring_chain_stamps")
                ptr = int(ptr[0] if isinstance(ptr, tuple) else ptr)
                memory = cupy.cuda.UnownedMemory(ptr, 32 * 8, loaded)
                stamps[module] = cupy.ndarray((32,), cupy.uint64, cupy.cuda.MemoryPointer(memory, 0))
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"chain_probe: {torch.cuda.get_device_name()}, engine {args.engine}"
              f"{', wide dispatch' if args.wide_dispatch else ''}", flush=True)
        for shape in args.shapes:
            weights, inputs = anchor.make_inputs(shape, args.tokens, 0, device)
            layer = anchor._symmring_layers(ctx, shape, weights, [args.engine], ["graph"], args.tokens[-1], 1024,
                                            "chunk")[f"symmring {args.engine} graph"]
            try:
                for n in args.tokens:
                    x, idx, w = inputs[n]
                    call, _ = layer.capture(x, topk_idx=idx, topk_weights=w)
                    call.replay()
                    torch.cuda.synchronize()
                    layer.check_errors()
                    print(f"== {shape} n={n}", flush=True)
                    if stamps:
                        samples = {}
                        for _ in range(args.replays):
                            for a in stamps.values():
                                a.fill(0)
                            torch.cuda.synchronize()
                            call.replay()
                            torch.cuda.synchronize()
                            seen = {(m, i): int(v) for m, a in stamps.items() for i, v in enumerate(a.get())
                                    if v and i in STAMPS[m]}
                            if ORIGIN in seen:
                                for key, t in seen.items():
                                    samples.setdefault(key, []).append((t - seen[ORIGIN]) / 1e3)
                        for us, name in phases(samples):
                            print(f"  {us:8.2f} us  {name}")
                    try:
                        print(format_timeline(kernel_timeline(call.replay)))
                    except ValueError as exc:  # replays that differ: no timeline, the rest as measured
                        print(f"  timeline: {exc}")
                    full = statistics.median(timed_ms(call.replay, args.replays))
                    bare = statistics.median(timed_ms(call.graph.replay, args.replays))
                    print(f"  replay: CapturedCall.replay {full * 1e3:.1f} us, graph.replay {bare * 1e3:.1f} us",
                          flush=True)
                    layer.check_errors()
                    del call
            finally:
                layer.close()
            del weights, inputs
            torch.cuda.empty_cache()
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())
