"""Benchmarks (``python -m symmring bench <name>``): `protocol` (publish->observe latency and slot-pull
bandwidth of the device protocol), `gemm` (the fp8 expert GEMM engines), `moe` (the GPU MoE layer, bf16
and fp8 experts, against the fp8 roofline and plain torch) and `stream` (streamed against batch-ready)."""

from __future__ import annotations

import sys
import time
from typing import List, Optional, Tuple


def missing_cuda_torch() -> Optional[str]:
    """Why a torch benchmark cannot run here (``None`` when torch sees a CUDA GPU)."""
    try:
        import torch
    except ImportError:
        return 'needs torch with CUDA: torch is not installed (pip install "symmring[gpu]")'
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


def lacks_cuda_torch(bench: str) -> bool:
    """Whether a torch benchmark cannot run here; if so, says why on stderr (``<bench>: <reason>``, the
    reason from `missing_cuda_torch`), and the benchmark returns 2."""
    missing = missing_cuda_torch()
    if missing:
        print(f"{bench}: {missing}", file=sys.stderr)
    return missing is not None


def progress(bench: str, done: int, total: Optional[int], what: str, *, rank: int = 0,
             started_s: Optional[float] = None, stream=None) -> None:
    """Say on stderr (rank 0 only; stdout keeps the table) that an item of a sweep finished.

    Args:
        bench: the benchmark, e.g. ``"bench moe"``.
        done: items finished so far, this one included; total: items in the sweep (None: unknown).
        what: the item and its figure, e.g. ``"qwen3-30b-a3b n=4096: 0.532 ms"``.
        rank: the caller's rank; started_s: ``time.perf_counter()`` at the sweep's start (adds the elapsed
            seconds); stream: where to write (``sys.stderr`` when None).

    Example:
        >>> progress("bench moe", 3, 12, "mixtral n=4096: 1.250 ms", stream=sys.stdout)
        bench moe: [3/12] mixtral n=4096: 1.250 ms
    """
    if rank != 0:
        return
    count = f"[{done}/{total}]" if total else f"[{done}]"
    elapsed = f" ({time.perf_counter() - started_s:.0f} s)" if started_s is not None else ""
    print(f"{bench}: {count} {what}{elapsed}", file=sys.stderr if stream is None else stream, flush=True)


def captured(call):
    """``call`` captured in a CUDA graph after one warm call on a side stream (as torch's docs ask; its buffers
    come from the graph's own pool and stay with it): the graph's ``replay``."""
    import torch
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def replay_timeline(spans, calls: int) -> List[dict]:
    """The kernels of one call as ``calls`` back-to-back calls ran them: ``spans`` are ``(name, start_us, end_us)``
    of every kernel of every call in any order, each call the same kernels; returns, per kernel in start order,
    ``{"kernel", "start_us", "end_us", "gap_us"}``, the medians over the calls of its start and end after its
    call's first kernel started and of the idle time since the latest end before it (negative: it started before
    the kernels ahead of it ended, as a programmatic dependent launch does). ValueError where the spans do not
    split into ``calls`` calls of the same kernels.

    Example:
        >>> replay_timeline([("a", 0, 2), ("b", 3, 9), ("a", 20, 21), ("b", 22, 30)], 2)[1]
        {'kernel': 'b', 'start_us': 2.5, 'end_us': 9.5, 'gap_us': 1.0}
    """
    import statistics
    spans = sorted(spans, key=lambda s: s[1])
    if calls < 1 or not spans or len(spans) % calls:
        raise ValueError(f"{len(spans)} kernels do not split into {calls} calls")
    per = len(spans) // calls
    runs = [spans[i * per:(i + 1) * per] for i in range(calls)]
    if any([s[0] for s in run] != [s[0] for s in runs[0]] for run in runs):
        raise ValueError("the calls ran different kernels (or overlapped)")
    out = []
    for j in range(per):
        starts = [run[j][1] - run[0][1] for run in runs]
        ends = [run[j][2] - run[0][1] for run in runs]
        gaps = [run[j][1] - max(s[2] for s in run[:j]) if j else 0.0 for run in runs]
        out.append({"kernel": runs[0][j][0], "start_us": statistics.median(starts),
                    "end_us": statistics.median(ends), "gap_us": statistics.median(gaps)})
    return out


def device_spans(fn, calls: int) -> List[Tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every device activity (kernels, copies, fills; a CUDA graph's replay shows
    its nodes) of ``calls`` calls of ``fn`` under torch.profiler, after one warm call, each call synchronised.
    Names are cut to 60 characters."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    return [(evt.name[:60], evt.time_range.start, evt.time_range.end) for evt in prof.events()
            if getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type)]


def kernel_timeline(fn, calls: int = 5) -> List[dict]:
    """`replay_timeline` of ``calls`` calls of ``fn`` (`device_spans`). Where the kernels ran ahead of the next one
    can be seen, which per-kernel totals hide: a kernel launched early (PDL) counts its wait for the one before."""
    return replay_timeline(device_spans(fn, calls), calls)


def format_timeline(timeline: List[dict]) -> str:
    """One line per kernel: start and end (us after the call's first kernel started), gap, name."""
    return "\n".join(f"{t['start_us']:9.1f} {t['end_us']:9.1f} {t['gap_us']:+7.1f}  {t['kernel']}" for t in timeline)


def timed_ms(fn, repeats: int, warmup: int = 2) -> List[float]:
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
