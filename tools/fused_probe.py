"""The fused experts kernel alone, outside the layer: milliseconds and the weights' bandwidth per shape and size.

Usage (on a GPU machine, from a tree's root; ``PYTHONPATH`` naming that tree)::

    python tools/fused_probe.py [--kernels wg64t,wg128t] [--bounds exact,layer,none] [--repeats 10] [--tokens 1,8]
                                [--graph] [--profile]

For each shape (DeepSeek-V3-like and Qwen3-30B-A3B-like, 64, 512 and 4096 tokens) it builds the seeded
dispatch-shaped pool and fp8 weights of ``tests/gpu/test_fused_engine.py`` and times ``FusedExperts.forward``
with CUDA events (median of ``--repeats`` after two warm calls) for each rows-per-expert bound the engine can be
given: ``exact`` (the pool's largest expert), ``layer`` (the call's tokens: what the layer passes) and ``none``
(every m block listed). It prints one line per case: the time, and the weights the call touches over it in TB/s
(each touched expert's ``3 * hidden * inter`` bytes once: the kernel's roofline term where experts hold few rows).

``--graph``: each case's call captured once in a CUDA graph and its replays timed: the device's time alone, where
enqueued calls may not be (a call's host work, `prepare`, its tensor maps and the launch, can outlast a short
kernel, and the events then bracket the wait; session 18's 1-token and Qwen3-like rows sat at 0.36-0.74 ms so).

``--profile``: in a tree built with ``SYMMRING_FUSED_PROFILE`` defined (a ``#define`` at the top of
``device/moe/fused_experts_tma.cu``: device/moe/fused_profile.cuh), each line is followed by where the time went
per block and call: the producer's and math warpgroup 0's phases in microseconds (SM cycles at the clock the
device reports) and as a share of that role's loop, and the launch's span against the blocks' mean span.

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
    parser.add_argument("--tokens", default=None,
                        help="comma-separated tokens per call for every shape (default: 64, 512 and 4096)")
    parser.add_argument("--graph", action="store_true",
                        help="time replays of a CUDA graph of the call (the device's time, no host work)")
    parser.add_argument("--profile", action="store_true",
                        help="print the kernel's phases (a tree built with SYMMRING_FUSED_PROFILE)")
    args = parser.parse_args(argv)
    bounds = args.bounds.split(",")
    if not set(bounds) <= set(BOUNDS) or args.repeats < 1:
        parser.error(f"--bounds: expected some of {', '.join(BOUNDS)}; --repeats: at least 1")
    try:
        tokens = tuple(int(n) for n in args.tokens.split(",")) if args.tokens else None
    except ValueError:
        tokens = ()
    if tokens is not None and (not tokens or min(tokens) < 1):
        parser.error(f"--tokens: expected positive integers separated by commas, got {args.tokens!r}")

    import torch
    if not torch.cuda.is_available():
        print("fused_probe: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    root = os.getcwd()
    sys.path[:0] = [os.path.join(root, "tests", "gpu"), os.path.join(root, "tests")]
    import test_fused_engine as t  # the seeded pool and weights of the GPU tests
    from symmring.bench import captured
    from symmring.moe.engines.fused import FusedExperts
    profile = Profile(root) if args.profile else None
    for shape, sizes in CASES.items():
        sizes = tokens or sizes
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
                    call = lambda: engine.forward(pool, num_rows, bound)  # noqa: E731
                    if args.graph:
                        call = captured(call)
                    # Not symmring.bench.timed_ms: it synchronises after each call, so its events would also
                    # bracket forward's host work (prepare, tensor maps) with the GPU idle; enqueued back to back,
                    # each call's host work overlaps the kernel before it and the events time the device.
                    if profile:
                        profile.reset(kernel)
                    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                              for _ in range(args.repeats)]
                    for start, end in events:
                        start.record()
                        call()
                        end.record()
                    torch.cuda.synchronize()
                    engine.check_status()
                    times = sorted(start.elapsed_time(end) for start, end in events)
                    ms = times[len(times) // 2]
                    print(f"probe {shape} n={n} {kernel} bound={name}({bound}){' graph' if args.graph else ''} "
                          f"rows={num_rows} "
                          f"max/expert={per_expert} experts={touched}: {ms:.3f} ms, "
                          f"{terabytes / (ms / 1e3):.2f} TB/s of weights", flush=True)
                    if profile:
                        print(profile.report(kernel, args.repeats), flush=True)
                del engine
        del weights
        torch.cuda.empty_cache()
    return 0


class Profile:
    """The global `symmring_fused_profile` of a profiled build (device/moe/fused_profile.cuh): its slots' names
    from the header's enum, reset before a case and read after it."""

    def __init__(self, root: str):
        import re
        header = open(os.path.join(root, "device", "moe", "fused_profile.cuh")).read()
        body = re.search(r"enum Slot : int \{(.*?)\};", header, re.S).group(1)
        self.slots = re.findall(r"^\s*(k\w+)", body, re.M)
        assert self.slots[-1] == "kSlots", self.slots
        self.slots = self.slots[:-1]

    def _array(self, kernel: str):
        import cupy
        import torch
        from symmring.moe.engines import fused
        dev = torch.cuda.current_device()
        module = fused._module(dev, fused._device(dev)[0], fused.module_of(kernel))[0]  # the engine's module
        ptr = module.get_global_var("symmring_fused_profile")
        ptr = ptr[0] if isinstance(ptr, tuple) else ptr
        n = len(self.slots)
        memory = cupy.cuda.UnownedMemory(int(ptr), n * 8, module)
        return cupy.ndarray((n,), cupy.uint64, cupy.cuda.MemoryPointer(memory, 0))

    def reset(self, kernel: str) -> None:
        import cupy
        a = self._array(kernel)
        a.fill(0)
        a[self.slots.index("kFirstStartNs")] = cupy.uint64(2 ** 64 - 1)

    def report(self, kernel: str, calls: int) -> str:
        import cupy
        import torch
        cupy.cuda.runtime.deviceSynchronize()
        v = dict(zip(self.slots, (int(x) for x in self._array(kernel).get())))
        props = cupy.cuda.runtime.getDeviceProperties(torch.cuda.current_device())
        blocks, khz = props["multiProcessorCount"], props["clockRate"]
        per = calls * blocks  # one recorder per role and block

        def us(name):
            return v[name] / per / (khz / 1e3)

        def share(name, total):
            return f"{name[1:]} {us(name):.1f} us ({v[name] / max(v[total], 1):.0%})"

        producer = self.slots[self.slots.index("kEmptyWait"):self.slots.index("kProducerItems")]
        math = self.slots[self.slots.index("kPopWait"):self.slots.index("kKBlocks")]
        span = (v["kLastEndNs"] - v["kFirstStartNs"]) / 1e3
        return "\n".join([
            f"  producer {us('kProducerCycles'):.1f} us per block and call: "
            + ", ".join(share(n, "kProducerCycles") for n in producer)
            + f"; items {v['kProducerItems'] / per:.1f}, late arrivals {v['kLateArrivals'] / per:.2f}",
            f"  math wg0 {us('kMathCycles'):.1f} us: " + ", ".join(share(n, "kMathCycles") for n in math)
            + f"; K blocks {v['kKBlocks'] / per:.1f}, items {v['kMathItems'] / per:.1f}",
            f"  blocks' mean span {v['kBlockNs'] / per / 1e3:.1f} us; the {calls} launches' span {span:.1f} us "
            f"(first start to last end, gaps between launches included); clock {khz / 1e3:.0f} MHz",
        ])


if __name__ == "__main__":
    sys.exit(main())
