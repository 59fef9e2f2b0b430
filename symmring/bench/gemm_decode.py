"""``python -m symmring bench gemm --decode`` / ``--decode-sweep``: the expert GEMMs at decode sizes.

One PE's view of the three model shapes of `symmring.bench.moe.SHAPES` (every expert local: DeepSeek-V3-like
256 experts top-8, Qwen3-30B-A3B-like 128 top-8, Mixtral-like 8 top-2) at 1, 2, 4, ... 128 tokens, each token
routed to ``topk`` distinct experts uniformly at random (fixed seed). The pool is the layer's: groups in
expert order at multiples of 128 rows, ``num_rows`` = the plan's ``rows_bound`` (entries + 127 padding rows
per possible group), so empty 128-row blocks trail the touched ones as in a real window.

``--decode`` times, in one run and side by side (CUDA graphs, each replaying the step over several input
sets so the weights do not stay in L2; median of ``--repeats`` replays, per step):

* ``small``: `triton_small.grouped_gemm_swiglu_quant_fp8_small` (L1 + SwiGLU + quantise) then
  `triton_small.grouped_gemm_fp8_small` (L2), their `small_config` choices, ``rows_per_group`` = the tokens;
* ``builtin``: today's `triton_large.grouped_gemm_fp8` L1, `swiglu_quant_fp8`, L2 (default configs);
* ``deepgemm``: the same with DeepGEMM's contiguous GEMM, where it loads;
* ``read``: the fp8 weight bytes (and block scales) of the touched experts over the device copy rate
  measured in the same run (the layer's roofline at these sizes),

and prints ``small / read``, ``builtin / small`` and ``deepgemm / small``, and the relative difference of
the small and builtin outputs over real rows (the same quantised inputs; different rounding points only).

``--decode-sweep`` times each small kernel alone for every configuration of `triton_heuristics.small_configs` (fused L1
and L2 separately, at 1, 8, 32 and 64 tokens unless ``--tokens`` says otherwise) against its own weight-read
time, and prints the best configuration next to `small_config`'s choice, to retune the rule from one run.
Split-K configurations (names ending ``k2``, ``k4``; `small_config` may choose others, e.g. ``k3``) are timed
only where they can help: the unsplit grid below the device's SM count and at least one K block per split
(elsewhere they would only add the reduction, and their workspace grows with the grid).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

from . import captured
from .gemm_common import progress, quant_rows
from .moe import SHAPES

DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_TOKENS = (1, 8, 32, 64)
ALIGN = 128


def _random_fp8(shape, device, gen):
    """Random e4m3 bytes with the top exponent bit clear: finite values in (-2, 2), never NaN."""
    import torch
    bits = torch.randint(0, 256, shape, device=device, dtype=torch.uint8, generator=gen) & 0xBF
    return bits.view(torch.float8_e4m3fn)


class DecodeShape:
    """One model shape's experts on the GPU: fp8 weights (random bytes) and block scales."""

    def __init__(self, name: str, device, seed: int = 1):
        import torch
        self.name = name
        self.hidden, self.inter, self.num_experts, self.topk = SHAPES[name]
        H, I, E = self.hidden, self.inter, self.num_experts
        gen = torch.Generator(device=device).manual_seed(seed)
        self.w13 = _random_fp8((E, 2 * I, H), device, gen)
        self.w13_sf = torch.rand(E, 2 * I // 128, H // 128, device=device, generator=gen) / math.sqrt(H) + 1e-3
        self.w_down = _random_fp8((E, H, I), device, gen)
        self.w_down_sf = torch.rand(E, H // 128, I // 128, device=device, generator=gen) / math.sqrt(I) + 1e-3
        self.device = device

    def l1_bytes(self, touched: int) -> int:
        return touched * (2 * self.inter * self.hidden + (2 * self.inter // 128) * (self.hidden // 128) * 4)

    def l2_bytes(self, touched: int) -> int:
        return touched * (self.hidden * self.inter + (self.hidden // 128) * (self.inter // 128) * 4)


class DecodePool:
    """One routing of ``tokens`` tokens: the contiguous-layout pool (fp8 rows + scales, m_indices)."""

    def __init__(self, shape: DecodeShape, tokens: int, seed: int):
        import numpy as np
        import torch
        rng = np.random.default_rng([seed, tokens, shape.num_experts])
        E, k = shape.num_experts, shape.topk
        experts = np.stack([rng.permutation(E)[:k] for _ in range(tokens)])
        counts = np.bincount(experts.reshape(-1), minlength=E)
        entries = tokens * k
        self.num_rows = entries + min(E, entries) * (ALIGN - 1)  # the plan's rows_bound (uncapped)
        m = np.full(self.num_rows, -1, np.int32)
        row = 0
        for e in range(E):
            m[row:row + counts[e]] = e
            row += -(-int(counts[e]) // ALIGN) * ALIGN
        self.touched = int((counts > 0).sum())
        self.rows_per_expert = min(tokens, self.num_rows)
        dev = shape.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(self.num_rows, shape.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        self.x, x_sf = quant_rows(x)
        # The layer's pool scales are MN-major (State.pool_scales): strides (1, align4(rows)).
        column = -(-self.num_rows // 4) * 4
        self.x_sf = torch.empty(shape.hidden // 128, column, device=dev).t()[:self.num_rows].copy_(x_sf)
        self.m_indices = torch.from_numpy(m).to(dev)
        self.real = self.m_indices >= 0


def _steps(shape: DecodeShape, dg_ok: bool) -> Dict[str, Callable]:
    """name -> fn(pool) running L1, SwiGLU + quantise, L2 of the pool; returns the output rows."""
    from ..moe.engines import triton_large
    from ..moe.engines import triton_small

    def small(p):
        q, q_sf = triton_small.grouped_gemm_swiglu_quant_fp8_small(p.x, p.x_sf, shape.w13, shape.w13_sf, p.m_indices,
                                                                rows_per_group=p.rows_per_expert)
        return triton_small.grouped_gemm_fp8_small(q, q_sf, shape.w_down, shape.w_down_sf, p.m_indices,
                                                rows_per_group=p.rows_per_expert)

    def unfused(gemm):
        def run(p):
            h = gemm(p.x, p.x_sf, shape.w13, shape.w13_sf, p.m_indices)
            q, q_sf = triton_large.swiglu_quant_fp8(h, p.m_indices, sf_mn_major=True)
            return gemm(q, q_sf, shape.w_down, shape.w_down_sf, p.m_indices)
        return run

    steps = {"small": small, "builtin": unfused(triton_large.grouped_gemm_fp8)}
    if dg_ok:
        from ..moe.engines import deepgemm
        steps["deepgemm"] = unfused(lambda a, a_sf, b, b_sf, m: deepgemm.grouped_gemm_fp8(a, a_sf, b, b_sf, m))
    return steps


def graph_ms(fns: Sequence[Callable[[], object]], repeats: int) -> float:
    """Median milliseconds of one call: a CUDA graph holding every fn once (one per input set), replayed
    ``repeats`` times, each replay's time divided by ``len(fns)`` (launch gaps inside the graph count, as
    in the layer's graphs; host overhead does not)."""
    import torch
    replay = captured(lambda: [fn() for fn in fns])  # compiled and warmed by the capture's warm call
    replay()
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / len(fns)


def _num_sets(bytes_per_set: int, l2_bytes: int) -> int:
    """Input sets (routings) per graph: enough that one pass reads three times the L2 in weights."""
    return max(2, min(8, -(-3 * l2_bytes // max(bytes_per_set, 1))))


def _pools(shape: DecodeShape, tokens: int, l2_bytes: int) -> List[DecodePool]:
    first = DecodePool(shape, tokens, seed=0)
    per_set = shape.l1_bytes(first.touched) + shape.l2_bytes(first.touched)
    return [first] + [DecodePool(shape, tokens, seed=s) for s in range(1, _num_sets(per_set, l2_bytes))]


def decode_rows(shapes: Sequence[str], tokens: Sequence[int], state: Dict, repeats: int) -> List[Dict]:
    import torch
    from ..moe.engines import triton_heuristics
    rows = []
    for name in shapes:
        t0 = time.perf_counter()
        shape = DecodeShape(name, state["device"])
        steps = _steps(shape, state["deepgemm_ok"])
        for n in tokens:
            pools = _pools(shape, n, state["l2_bytes"])
            p0 = pools[0]
            touched = statistics.mean(p.touched for p in pools)
            read_ms = (shape.l1_bytes(touched) + shape.l2_bytes(touched)) / (state["copy_gbps"] * 1e9) * 1e3
            l1_cfg = triton_heuristics.small_config(p0.num_rows, 2 * shape.inter, shape.hidden, shape.num_experts,
                                                    p0.rows_per_expert, fused=True)
            l2_cfg = triton_heuristics.small_config(p0.num_rows, shape.hidden, shape.inter, shape.num_experts,
                                                    p0.rows_per_expert)
            row = {"shape": name, "tokens": n, "num_rows": p0.num_rows, "touched_experts": touched,
                   "sets": len(pools), "read_us": read_ms * 1e3,
                   "small_l1_config": l1_cfg.name, "small_l1_split_k": l1_cfg.split_k,
                   "small_l2_config": l2_cfg.name, "small_l2_split_k": l2_cfg.split_k}
            outs = {}
            for step, fn in steps.items():
                try:
                    outs[step] = fn(p0)
                    row[f"{step}_us"] = graph_ms([lambda p=p, f=fn: f(p) for p in pools], repeats) * 1e3
                except Exception as exc:  # one engine failing must not end the run
                    row[f"{step}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if "small" in outs and "builtin" in outs:
                a, b = outs["small"][p0.real].float(), outs["builtin"][p0.real].float()
                row["small_vs_builtin_rel"] = float((a - b).norm() / b.norm())
            if "small_us" in row:
                row["small_vs_read"] = row["small_us"] / row["read_us"]
                for other in ("builtin", "deepgemm"):
                    if f"{other}_us" in row:
                        row[f"{other}_vs_small"] = row[f"{other}_us"] / row["small_us"]
            rows.append(row)
            progress(f"decode {name} {n} tokens: small {row.get('small_us', float('nan')):.1f} us, builtin "
                      f"{row.get('builtin_us', float('nan')):.1f} us, read {row['read_us']:.1f} us")
            del pools, outs
        del shape, steps
        torch.cuda.empty_cache()
        progress(f"decode {name}: {time.perf_counter() - t0:.1f} s")
    return rows


def format_decode(rows: List[Dict], state: Dict) -> str:
    nan = float("nan")
    lines = [f"decode: device copy {state['copy_gbps']:.0f} GB/s (this run); DeepGEMM: {state['deepgemm_reason']}",
             f"{'shape':<14} {'tok':>4} {'rows':>6} {'exp':>6} {'L1 cfg':<14} {'L2 cfg':<14} {'read us':>8} "
             f"{'small':>7} {'builtin':>7} {'DG':>7} {'sm/read':>7} {'bi/sm':>6} {'DG/sm':>6} {'diff':>7}"]
    for r in rows:
        lines.append(
            f"{r['shape']:<14} {r['tokens']:>4} {r['num_rows']:>6} {r['touched_experts']:>6.1f} "
            f"{r['small_l1_config']:<14} {r['small_l2_config']:<14} {r['read_us']:>8.1f} "
            f"{r.get('small_us', nan):>7.1f} {r.get('builtin_us', nan):>7.1f} {r.get('deepgemm_us', nan):>7.1f} "
            f"{r.get('small_vs_read', nan):>7.2f} {r.get('builtin_vs_small', nan):>6.2f} "
            f"{r.get('deepgemm_vs_small', nan):>6.2f} {r.get('small_vs_builtin_rel', nan):>7.1e}")
        errors = [f"{k}: {v}" for k, v in r.items() if k.endswith("_error")]
        lines.extend(f"    {e}" for e in errors)
    lines.append("us per step (L1 + SwiGLU/quantise + L2; CUDA graph, median); read: fp8 weights of the touched "
                 "experts (mean over the sets) / copy rate; small = triton_small (fused L1, L2), builtin = "
                 "grouped_gemm_fp8 + swiglu_quant_fp8 + grouped_gemm_fp8, DG = DeepGEMM + swiglu_quant_fp8; "
                 "diff: ||small - builtin|| / ||builtin|| over real rows; cfg names: n<weight rows>t<row tile>"
                 "w<warps>s<stages>[k<K splits>]")
    return "\n".join(lines)


def sweep_rows(shapes: Sequence[str], tokens: Sequence[int], state: Dict, repeats: int,
               budget_s: float) -> List[Dict]:
    import torch
    from ..moe.engines import triton_heuristics, triton_large, triton_small
    num_sms = torch.cuda.get_device_properties(state["device"]).multi_processor_count
    rows = []
    for name in shapes:
        shape = DecodeShape(name, state["device"])
        for n in tokens:
            pools = _pools(shape, n, state["l2_bytes"])
            p0 = pools[0]
            touched = statistics.mean(p.touched for p in pools)
            acts = [triton_large.swiglu_quant_fp8(
                triton_large.grouped_gemm_fp8(p.x, p.x_sf, shape.w13, shape.w13_sf, p.m_indices), p.m_indices,
                sf_mn_major=True) for p in pools]
            kernels = {
                "L1": (True, shape.l1_bytes(touched), lambda p, a, c: triton_small.grouped_gemm_swiglu_quant_fp8_small(
                    p.x, p.x_sf, shape.w13, shape.w13_sf, p.m_indices, rows_per_group=p.rows_per_expert, config=c),
                    (2 * shape.inter, shape.hidden)),
                "L2": (False, shape.l2_bytes(touched), lambda p, a, c: triton_small.grouped_gemm_fp8_small(
                    a[0], a[1], shape.w_down, shape.w_down_sf, p.m_indices, rows_per_group=p.rows_per_expert,
                    config=c), (shape.hidden, shape.inter)),
            }
            for gemm, (fused, num_bytes, fn, (N, K)) in kernels.items():
                read_us = num_bytes / (state["copy_gbps"] * 1e9) * 1e6
                default = triton_heuristics.small_config(p0.num_rows, N, K, shape.num_experts,
                                                         p0.rows_per_expert, fused=fused)
                row = {"shape": name, "tokens": n, "gemm": gemm, "read_us": read_us, "default": default.name,
                       "configs": {}}

                def useful(c, N=N, K=K, fused=fused):  # split only below the SM count, >= 1 K block per split
                    return c.split_k == 1 or (c.split_k <= K // 128 and triton_heuristics.tile_programs(
                        p0.num_rows, N, shape.num_experts, p0.rows_per_expert, c.block_n, c.block_t,
                        fused=fused) < num_sms)

                candidates = triton_heuristics.small_configs(fused)
                for cfg in [default] + [c for c in candidates if c != default and useful(c)]:
                    if cfg != default and time.perf_counter() - state["started"] > budget_s:
                        row["sweep_truncated"] = True
                        break
                    try:
                        us = graph_ms([lambda p=p, a=a, c=cfg: fn(p, a, c) for p, a in zip(pools, acts)],
                                      repeats) * 1e3
                        row["configs"][cfg.name] = us
                    except Exception as exc:
                        row["configs"][cfg.name] = f"{type(exc).__name__}: {exc}"[:200]
                timed = {k: v for k, v in row["configs"].items() if isinstance(v, float)}
                if timed:
                    best = min(timed, key=timed.get)
                    row.update(best=best, best_us=timed[best], default_us=timed.get(default.name),
                               best_vs_read=timed[best] / read_us)
                rows.append(row)
                progress(f"sweep {name} {n} tokens {gemm}: best {row.get('best')} {row.get('best_us', 0):.1f} us, "
                          f"default {default.name} {row.get('default_us') or float('nan'):.1f} us, read {read_us:.1f} us")
            del pools, acts
        shape = None  # its weights freed before empty_cache (not del: the kernels' lambdas close over it)
        torch.cuda.empty_cache()
    return rows


def format_sweep(rows: List[Dict]) -> str:
    nan = float("nan")
    lines = [f"{'shape':<14} {'tok':>4} {'gemm':<4} {'read us':>8} {'default':<17} {'dflt us':>8} {'best':<17} "
             f"{'best us':>8} {'best/read':>9} {'dflt/best':>9}  runner-up configs"]
    for r in rows:
        timed = sorted((v, k) for k, v in r["configs"].items() if isinstance(v, float))
        runners = ", ".join(f"{k} {v:.1f}" for v, k in timed[1:4])
        dflt = r.get("default_us") or nan
        lines.append(f"{r['shape']:<14} {r['tokens']:>4} {r['gemm']:<4} {r['read_us']:>8.1f} {r['default']:<17} "
                     f"{dflt:>8.1f} {r.get('best', '-'):<17} {r.get('best_us', nan):>8.1f} "
                     f"{r.get('best_vs_read', nan):>9.2f} {dflt / r.get('best_us', nan):>9.2f}  {runners}")
    lines.append("us per kernel (CUDA graph, median); read: that GEMM's fp8 weights of the touched experts / copy rate; "
                 "L1 = fused L1 + SwiGLU + quantise, L2 = the small GEMM; k<S>: split-K in S (only where the unsplit "
                 "grid is below the SM count)")
    return "\n".join(lines)


def run(args, state: Dict) -> Dict:
    """The ``--decode`` / ``--decode-sweep`` part of ``bench gemm``: prints its table, returns its figures."""
    shapes = [s for s in SHAPES if not args.problems or any(w in s for w in args.problems.split(",") if w)]
    out: Dict = {}
    if args.decode:
        tokens = args.tokens or DECODE_TOKENS
        out["decode"] = decode_rows(shapes, tokens, state, args.repeats)
        print(format_decode(out["decode"], state))
    if args.decode_sweep:
        tokens = args.tokens or SWEEP_TOKENS
        out["sweep"] = sweep_rows(shapes, tokens, state, args.repeats, args.budget_s)
        print(format_sweep(out["sweep"]))
    return out


def parse_tokens(text: str) -> Optional[List[int]]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (empty: None)."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v < 1 for v in values):
        raise ValueError(f"--tokens {text!r}: expected positive ints")
    return values or None
