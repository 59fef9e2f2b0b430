"""Benchmarks (``python -m symmring bench <name>``): `protocol` (publish->observe latency and slot-pull
bandwidth of the device protocol), `gemm` (the fp8 expert GEMM engines), `moe` (the GPU MoE layer, bf16
and fp8 experts, against the fp8 roofline and plain torch) and `stream` (streamed against batch-ready)."""

from __future__ import annotations

import sys
import time
from typing import List, Optional


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
