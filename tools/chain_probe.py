"""Where a decode call's time goes around the experts: the small-batch chain (producer, dispatch, experts,
combine) of a captured call, replayed.

    python tools/chain_probe.py [--shapes deepseek-v3,v4-flash] [--tokens 1,8,64] [--engine fused] [--stamps]
                                [--wide-dispatch] [--alone]

For each shape and size: the anchor's seeded fp8 layer (`symmring.bench.moe_anchor`, one PE, no router) captured
(`MoE.capture`), then

* the replay's kernels with their start, end and the idle gap before each (`symmring.bench.kernel_timeline`,
  medians over five replays; a negative gap is a kernel launched early by PDL, waiting for the one before);
* ``--stamps``: the phases inside the three protocol kernels (device/symmring/chain_stamps.cuh: %globaltimer at
  each phase's end, microseconds after the producer's start, medians over ``--replays`` replays). The three
  modules are built with ``SYMMRING_CHAIN_STAMPS`` defined (a cache entry of their own); the default build has
  no trace of them;
* the replay's time through `CapturedCall.replay` (what a caller runs) and through the bare ``graph.replay``.

``--alone``: the experts kernel of the same call outside the chain, each a captured graph of its own timed by its
kernel's span (medians of five replays): on the layer's own pool as the call's dispatch left it, with and without
the rows sent, and on the GPU tests' pool of the same routing kind (tests/gpu/test_fused_engine.py ``make_pool``)
with the layer's weights; each at the layer's bound on the rows per expert (given routing: the call's entries) and
at the tokens (distinct experts per token), the layer's pool also with the weights' evict-first hint forced and
copied into torch's memory (as it is, and with the padding rows the kernel computes zeros of scale 1, after a line
on what those rows' bytes hold). What the kernel loses to the chain around it, to the rows it sends, to the bound
and to the pool's memory and content. The layer's pool is put back once, before its lines (the kernel writes none of
it), and freed afterwards as the combine would.

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
    parser.add_argument("--alone", action="store_true",
                        help="also time the experts kernel alone: the layer's pool, with and without the rows sent, "
                             "and the GPU tests' pool")
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
    if args.alone:  # the GPU tests' seeded pool (`alone`)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path[:0] = [os.path.join(root, "tests", "gpu"), os.path.join(root, "tests")]
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
                    if args.alone:
                        alone(layer, x, idx, w, shape, n)
                    del call
            finally:
                layer.close()
            del weights, inputs
            torch.cuda.empty_cache()
    finally:
        ctx.close()
    return 0


def alone(layer, x, idx, w, shape: str, n: int) -> None:
    """``--alone``: the experts kernel of an eager call of ``layer`` (its pool kept as the dispatch left it) in graphs
    of its own, then on the GPU tests' pool of ``n`` tokens; one line each, the kernel's median span. The pool is
    put back once before the layer pool's lines (no copy inside a timed graph: their written-back lines would take
    the kernel's memory bandwidth) and freed at the end as the call's combine would."""
    import torch
    from symmring.bench import captured, kernel_timeline
    from symmring.bench.moe_anchor import ANCHOR_SHAPES
    from symmring.moe.engines import fused
    from symmring.moe.engines.seam import Pool
    import test_fused_engine as t  # the GPU tests' seeded pool (tests/gpu on the path: main)
    engine = layer.engine
    forward = engine.forward
    seen = {"calls": 0}

    def spy(pool, num_rows, rows_per_expert=None, **kw):
        # The pool's tensors as the dispatch left them (the combine frees the rows' expert ids after the kernel).
        seen["calls"] += 1
        seen["call"] = (pool, num_rows, rows_per_expert, kw)
        seen["snap"] = {f: getattr(pool, f).clone() for f in ("x", "x_sf", "group_end", "m_indices")
                        if getattr(pool, f) is not None}
        return forward(pool, num_rows, rows_per_expert, **kw)

    engine.forward = spy
    try:
        layer.forward(x, topk_idx=idx, topk_weights=w, graph_cache=False)
        torch.cuda.synchronize()
    finally:
        del engine.forward  # the class's method again
    if "call" not in seen:
        print("  alone: the call ran no experts kernel through engine.forward")
        return
    pool, num_rows, rows_per_expert, kw = seen["call"]
    snap = seen["snap"]
    if seen["calls"] > 1:
        print(f"  alone: the call ran {seen['calls']} passes; the last one's pool below")

    def kernel_us(fn) -> str:
        replay = captured(fn)
        spans = [s for s in kernel_timeline(replay) if "fused_experts" in s["kernel"]]
        return " ".join(f"{s['end_us'] - s['start_us']:.1f}" for s in spans)

    def line(what: str, fn) -> None:
        print(f"  alone, {what}: {kernel_us(fn)} us", flush=True)

    def layer_pool(send: bool, bound):
        return lambda: forward(pool, num_rows, bound, **(kw if send else {k: v for k, v in kw.items() if k != "send"}))

    try:
        for f, v in snap.items():  # the kernel reads the pool and writes none of it: once serves every line
            getattr(pool, f).copy_(v)
        if "send" in kw:
            line(f"layer pool ({num_rows} rows), rows sent, bound {rows_per_expert}", layer_pool(True, rows_per_expert))
        line(f"layer pool, not sent, bound {rows_per_expert}", layer_pool(False, rows_per_expert))
        line(f"layer pool, not sent, bound {n} (the tokens)", layer_pool(False, n))
        read_once = fused.read_once  # the host's evict-first rule forced on: the bound's other effect (m blocks)
        fused.read_once = lambda bound, rows: True
        try:
            line(f"layer pool, not sent, bound {rows_per_expert}, weights evict-first forced",
                 layer_pool(False, rows_per_expert))
        finally:
            fused.read_once = read_once
        # The same bytes in torch's memory (the layer's pool is in the symmetric heap).
        copy = Pool(x=snap["x"], group_end=snap["group_end"], x_sf=snap["x_sf"], m_indices=snap["m_indices"],
                    bad_groups=pool.bad_groups)
        for bound in (rows_per_expert, n):
            line(f"torch copy, bound {bound}", lambda: forward(copy, num_rows, bound))
        # The padding rows the kernel computes and never stores (no expert, in an m block whose first row has one):
        # what their bytes hold, and the copy's time with them zeros of scale 1.
        ids = snap["m_indices"][:num_rows]
        first = ids[(torch.arange(num_rows, device=ids.device) // 64) * 64]
        dead = (ids < 0) & (first >= 0)
        x8 = snap["x"][:num_rows].view(torch.uint8)[dead]
        sf = snap["x_sf"][:num_rows][dead].float()
        print(f"  computed padding rows {int(dead.sum())} of {num_rows}: e4m3 NaN bytes "
              f"{int(((x8 & 0x7F) == 0x7F).sum())} of {x8.numel()}, non-zero bytes {int((x8 != 0).sum())}; scales "
              f"non-finite {int((~sf.isfinite()).sum())}, above 1e3 {int((sf.abs() > 1e3).sum())}, zero "
              f"{int((sf == 0).sum())} of {sf.numel()}", flush=True)
        zx, zsf = snap["x"].clone(), snap["x_sf"].clone()
        zx.view(torch.uint8)[:num_rows][dead] = 0
        zsf[:num_rows][dead] = 1.0
        clean = Pool(x=zx, group_end=snap["group_end"], x_sf=zsf, m_indices=snap["m_indices"],
                     bad_groups=pool.bad_groups)
        line(f"torch copy, computed padding rows zeros of scale 1, bound {n}", lambda: forward(clean, num_rows, n))
        hidden, _, num_experts, topk = ANCHOR_SHAPES[shape]
        tpool, trows, _, _ = t.make_pool(hidden, num_experts, topk, n, t.SEED + n)
        for bound in (n, rows_per_expert):
            line(f"the tests' pool ({trows} rows), bound {bound}", lambda: forward(tpool, trows, bound))
    finally:
        # The pool was put back without the combine that frees its rows: free them as it would (the next call's
        # pool starts clean; stale group ids would be computed, or reported as bad groups).
        pool.m_indices.fill_(-1)
        torch.cuda.synchronize()
    layer.check_errors()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())
