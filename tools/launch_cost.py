"""Host cost per launch of the MoE layer's launchers (`symmring.moe.gpu.stages`), with fake kernels: no GPU.

Each launcher is called on a fake layer state (a distinct address per buffer) and fake tensors, its kernel a
fake; the figure is the median over rounds of the mean microseconds per call. Two fakes:

* ``noop``: the kernel does nothing: the launcher's own work (grid, argument packing);
* ``cupy``: CuPy's ``Function`` with no module behind it (``--cupy``, where CuPy imports): CuPy converts every
  argument as for a real launch, then the driver call fails; the same failing launch with no argument is timed
  in every round and subtracted.

The launchers' signatures are the same before and after the kernel-argument structs, so the same script
measures both trees: ``PYTHONPATH=<tree> python tools/launch_cost.py [--cupy]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from symmring.moe import routing
from symmring.moe.gpu import stages
from symmring.moe.gpu.plan import ChunkStep, WindowStep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from stage_fakes import FakeTensor, fake_kernels, fake_state  # noqa: E402 - the tests' stand-ins


def launch_state():
    """The fake state of a DeepSeek-V3-like layer at 2 ranks (`stage_fakes.fake_state`)."""
    return fake_state(entry_rows=(2, 2, 128, 8), scale_columns=56, num_ranks=2, num_local_experts=64,
                      tokens_per_slot=128, hidden=7168, capacity=4096, combine_tokens=4096, stage=None)


def launches(k, s):
    """``{launcher: a call of it}``: one window's launches of the batch schedule, the producer's and the
    small-batch call's."""
    chunk = ChunkStep(chunk=3, token_base=0, num_valid=64)
    window = WindowStep(3, 3, rows_bound=1024, token_begin=0, num_valid=64, source_tokens=128, rows_per_expert=128,
                        passes=((0, 1024),))
    x = FakeTensor(0xA00000, (64, 7168), element_size=2)
    y = FakeTensor(0xB00000, (64, 7168), element_size=2)
    idx, w, out = FakeTensor(0xC00000, (64, 8)), FakeTensor(0xC80000, (64, 8)), FakeTensor(0xD00000, (1024, 7168))
    router = routing.device_router(256, "sigmoid_bias", routed_scaling_factor=2.5, n_group=8, topk_group=4)
    logits = (FakeTensor(0xE00000, (64, 256), element_size=2), 1)
    return {
        "wait_slot": lambda: stages.wait_slot(k, s, None, chunk=3),
        "produce_route": lambda: stages.produce_route(k, s, None, chunk=chunk, topk_idx_ptr=0xC00000,
                                                      topk_weights_ptr=0xC80000, layer=1),
        "produce_layout": lambda: stages.produce_layout(k, s, None, chunk=chunk, x=x),
        "wait": lambda: stages.wait(k, s, None, chunk=3, parts=3, window_row=0, clear_counts=True, layer=1),
        "count": lambda: stages.count(k, s, None, chunk=3),
        "scan": lambda: stages.scan(k, s, None, window=window),
        "pull_fp8": lambda: stages.pull(k, s, None, chunk=3, window=window),
        "ack": lambda: stages.ack(k, s, None, chunk=3),
        "combine_scatter": lambda: stages.combine_scatter(k, s, None, out=out, window_begin=3, pass_rows=1024),
        "combine_signal": lambda: stages.combine_signal(k, s, None, first=3, last=3, ack_chunks=True),
        "combine_wait": lambda: stages.combine_wait(k, s, None, chunk=3),
        "combine_reduce": lambda: stages.combine_reduce(k, s, None, window=window, topk_idx=idx, topk_weights=w, y=y,
                                                        end_call_chunks=1),
        "produce_fused": lambda: stages.produce_fused(k, s, None, chunk=chunk, topk_idx=idx, topk_weights=w, x=x,
                                                      router=router, layer=1, logits=logits),
        "dispatch_fused": lambda: stages.dispatch_fused(k, s, None, window=window, ack_now=True, layer=1),
        "combine_fused": lambda: stages.combine_fused(k, s, None, out=out, window=window, ack_now=False,
                                                      topk_idx=idx, topk_weights=w, y=y, end_call_chunks=1),
        "route_topk": lambda: stages.route_topk(k, None, logits=logits, router=router, topk=8, topk_idx=idx,
                                                topk_weights=w),
    }


def per_call_us(fn, calls: int, rounds: int, base=None) -> float:
    """Median over ``rounds`` of the mean microseconds per call of ``fn``, less ``base``'s measured in the same
    round (rounds interleave the two, so load on the machine falls on both alike)."""
    fn()  # the first launch of a state makes its records
    times = []
    for _ in range(rounds):
        spent = []
        for f in (fn, base) if base is not None else (fn,):
            start = time.perf_counter()
            for _ in range(calls):
                f()
            spent.append((time.perf_counter() - start) / calls * 1e6)
        times.append(spent[0] - (spent[1] if base is not None else 0.0))
    return statistics.median(times)


def cupy_kernel():
    """CuPy's argument conversion: a ``Function`` with no module; returns (kernel, a launch with no argument)."""
    from cupy.cuda import function
    fn = function.Function.__new__(function.Function)
    no_stream = SimpleNamespace(ptr=0)

    def kernel(grid, block, args, stream=None, shared_mem=0):
        try:
            fn(grid, block, args, stream=no_stream, shared_mem=shared_mem)
        except Exception:  # the driver call, after every argument was converted
            pass

    return kernel, lambda: kernel((1,), (1,), ())


def fused_prepare():
    """A call of the fused engine's host work (`FusedExperts.prepare` for wg64t: the argument records, the tensor
    maps through the tests' stand-in encoder, the call's buffers as CPU tensors), or None without torch."""
    try:
        import torch  # noqa: F401 - the engine's host side takes torch tensors
    except ImportError:
        return None
    from test_fused_engine import FakeEncoder, fp8_weights, pool_of  # noqa: E402 - the tests' stand-ins
    from symmring.moe.engines import fused
    from symmring.moe.gpu import tensor_map
    tensor_map.Encoder = FakeEncoder  # no driver here
    engine, pool = fused.FusedExperts(fp8_weights(), kernel="wg64t"), pool_of(capacity=512, rows_for_sf=300)
    return lambda: engine.prepare(pool, 300, 100, grid_limit=132, cc=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cupy", action="store_true", help="CuPy's argument conversion instead of a no-op kernel")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kernel, base = (cupy_kernel() if args.cupy else (lambda *a, **kw: None, None))
    k, s = fake_kernels(lambda attr: kernel), launch_state()
    total = {}
    for name, fn in launches(k, s).items():
        total[name] = per_call_us(fn, args.calls, args.rounds, base)
        print(f"{name:16s} {total[name]:7.2f} us")
    batch = [n for n in total if n not in ("produce_fused", "dispatch_fused", "combine_fused", "route_topk")]
    what = "CuPy's conversion, less a launch with no argument" if args.cupy else "no-op kernels"
    print(f"{'mean':16s} {statistics.mean(total.values()):7.2f} us per launch ({what})")
    print(f"batch window + producer ({len(batch)} launches): {sum(total[n] for n in batch):.1f} us; small-batch call "
          f"(3 launches): {sum(total[n] for n in ('produce_fused', 'dispatch_fused', 'combine_fused')):.1f} us")
    prepare = fused_prepare()
    if prepare is not None:
        print(f"fused engine's prepare (wg64t, stand-in encoder, CPU buffers): "
              f"{per_call_us(prepare, args.calls // 10, args.rounds):.1f} us per call")


if __name__ == "__main__":
    main()
