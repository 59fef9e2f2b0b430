"""``python -m symmring bench gemm [--json PATH] [--quick]``: the fp8 expert GEMM engines on one GPU.

Problems: the grouped L1 (gate+up: ``N = 2 * inter``, ``K = hidden``) and L2 (down: ``N = hidden``,
``K = inter``) GEMMs of three model shapes at 128, 256 and 2048 rows per group -- DeepSeek-V3-like
(hidden 7168, inter 2048, 256 experts -> 32 local groups), Qwen3-30B-A3B-like (2048, 768, 128 groups),
Mixtral-like (4096, 14336, 8 groups). Four of them are the anchors measured for DeepGEMM on the H200
(measured there earlier with this wheel: 32 x 256 rows N 4096 K 7168: 1093 TFLOP/s; 32 x 128: 728; 8 x 2048
N 28672 K 4096: 1358; 128 x 256 N 1536 K 2048: 960); the goal is Triton >= 0.8x DeepGEMM there.

For each problem, in one run (TFLOP/s = ``2 * M_real * N * K / time``, median of ``--repeats`` timed calls
with CUDA events after warm-up; the GPU is kept busy by a short ``torch.cuda._sleep`` before each timed
call so host launch overhead is not counted; inputs rotate between several sets when one set would fit in
L2):

* the Triton engine (`symmring.moe.engines.triton_large.grouped_gemm_fp8`) for every configuration of
  ``configs()`` plus `default_config`'s choice: the best and the default are reported;
* DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` when `symmring.moe.engines.deepgemm.deepgemm_status` says it
  is usable (else the reason is printed), and the ratios Triton best / DeepGEMM and default / DeepGEMM;
* torch's bf16 ``torch._grouped_mm`` on the same rows, and a dense fp8 ``torch._scaled_mm`` (per-tensor
  scales: the cuBLAS fp8 ceiling) of the same total ``M x N x K``;
* each engine's correctness once: ``||out - ref|| / ||ref||`` over the rows of up to four groups, the
  reference being float32 dequantise-then-matmul on the GPU;
* for each L1 problem, `swiglu_quant_fp8` on its output ``[M, N]``: GB/s (bytes read + written) and the
  fraction of a device-to-device copy measured in the same run, and whether it is bitwise equal to the
  quantisation rule evaluated with torch.

``--decode`` and ``--decode-sweep`` run the decode-size problems of `symmring.bench.gemm_decode` instead
(the small-group kernels of `symmring.moe.engines.triton_small` against today's path and the weight-read time).

Progress goes to stderr, the table last to stdout; ``--json PATH`` writes every figure (all configs'
rates, so `default_config` can be retuned from it). ``--quick``: the four anchors, four configurations,
10 repeats. A time budget (``--budget-s``, 270 s) stops the configuration sweep early (defaults only) so
the run stays inside five minutes even when DeepGEMM's JIT compiles are slow. Also runnable as
``python -m symmring.bench.gemm``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import sys
import time
import zlib
from typing import Callable, Dict, List, Optional, Sequence

from . import lacks_cuda_torch
from .gemm_common import progress, quant_rows
from .moe import SHAPES

logger = logging.getLogger(__name__)

#: Expert groups per GPU for each model shape of `symmring.bench.moe.SHAPES`: DeepSeek-V3's 256 experts
#: over 8 ranks; Qwen3's and Mixtral's all on one.
LOCAL_GROUPS = {"deepseek-v3": 32, "qwen3-30b-a3b": 128, "mixtral": 8}
#: name: (hidden, inter, local groups)
MODELS = {name: (SHAPES[name][0], SHAPES[name][1], groups) for name, groups in LOCAL_GROUPS.items()}
ROWS_PER_GROUP = (128, 256, 2048)
#: (groups, rows per group, N, K) -> DeepGEMM TFLOP/s measured on the H200 earlier (tokenspeed-deepgemm 2.5.0.post20260424)
ANCHORS = {
    (32, 256, 4096, 7168): 1093.0,
    (32, 128, 4096, 7168): 728.0,
    (8, 2048, 28672, 4096): 1358.0,
    (128, 256, 1536, 2048): 960.0,
}


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    groups: int
    rows_per_group: int
    N: int
    K: int
    layer: str  # "L1" or "L2"

    @property
    def M(self) -> int:
        return self.groups * self.rows_per_group

    @property
    def flops(self) -> float:
        return 2.0 * self.M * self.N * self.K

    @property
    def anchor(self) -> Optional[float]:
        return ANCHORS.get((self.groups, self.rows_per_group, self.N, self.K))


def problems(quick: bool) -> List[Problem]:
    """The problem list: every model's L1 and L2 at each rows-per-group (the anchors are among them)."""
    out = []
    for model, (hidden, inter, groups) in MODELS.items():
        for rows in ROWS_PER_GROUP:
            out.append(Problem(f"{model} L1 x{rows}", groups, rows, 2 * inter, hidden, "L1"))
            out.append(Problem(f"{model} L2 x{rows}", groups, rows, hidden, inter, "L2"))
    if quick:
        out = [p for p in out if p.anchor is not None]
    return out


def _time_ms(fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of one call, cycling through ``fns`` (one per input set).

    Every timed call is preceded by a ~100 us device sleep, so the GPU is busy while the host enqueues it
    (host overhead is not timed); all samples are enqueued, then read after one synchronisation.
    """
    import torch
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    events = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)
        start.record()
        fns[i % len(fns)]()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def measure_copy_gbps(device) -> float:
    """Device-to-device copy bandwidth (bytes read + written), 1 GiB."""
    import torch
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms([lambda: dst.copy_(src)], 10)
    return 2 * 2 ** 30 / (ms * 1e-3) / 1e9


# --- data -------------------------------------------------------------------------------------------------

def _quant_blocks(w):
    """128x128 block quantisation of bf16 ``[G, N, K]`` (N, K multiples of 128): (q fp8, sf [G, N/128, K/128])."""
    import torch
    G, N, K = w.shape
    blocks = w.float().view(G, N // 128, 128, K // 128, 128)
    amax = blocks.abs().amax(dim=(2, 4))
    sf = amax / torch.full_like(amax, 448.0)
    sf = torch.where(sf == 0, torch.ones_like(sf), sf)
    q = (blocks / sf[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(G, N, K)
    return q, sf.contiguous()


class Inputs:
    """One problem's data on the GPU: fp8 pool and weights, their bf16 originals, the layout."""

    def __init__(self, p: Problem, device, seed: int, num_sets: int):
        import torch
        gen = torch.Generator(device=device).manual_seed(seed)
        self.sets = []
        for _ in range(num_sets):
            x = torch.randn(p.M, p.K, device=device, dtype=torch.bfloat16, generator=gen)
            a, a_sf = quant_rows(x)
            self.sets.append((x, a, a_sf))
        w = torch.randn(p.groups, p.N, p.K, device=device, dtype=torch.bfloat16, generator=gen) / math.sqrt(p.K)
        self.w_bf16 = w
        self.b, self.b_sf = _quant_blocks(w)
        self.m_indices = (torch.arange(p.M, device=device, dtype=torch.int32) // p.rows_per_group).contiguous()
        self.offs = (torch.arange(1, p.groups + 1, device=device, dtype=torch.int32) * p.rows_per_group)
        self.out = torch.empty(p.M, p.N, device=device, dtype=torch.bfloat16)

    def check(self, p: Problem, out) -> float:
        """||out - ref|| / ||ref|| over up to four groups' rows; ref = float32 dequantise-then-matmul."""
        _, a, a_sf = self.sets[0]
        picks = sorted({round(i * (p.groups - 1) / 3) for i in range(4)}) if p.groups > 1 else [0]
        num = den = 0.0
        for g in picks:
            rows = slice(g * p.rows_per_group, (g + 1) * p.rows_per_group)
            a_deq = a[rows].float() * a_sf[rows].repeat_interleave(128, dim=1)
            b_deq = self.b[g].float() * self.b_sf[g].repeat_interleave(128, 0).repeat_interleave(128, 1)
            ref = a_deq @ b_deq.T
            num += float((out[rows].float() - ref).square().sum())
            den += float(ref.square().sum())
        return math.sqrt(num / den) if den else float("nan")


def _num_sets(p: Problem, l2_bytes: int) -> int:
    """Input sets to rotate: enough that one pass over them exceeds twice the L2 size."""
    per_set = p.M * p.K + p.groups * p.N * p.K + 2 * p.M * p.N
    return 1 if per_set > 2 * l2_bytes else min(8, -(-2 * l2_bytes // per_set) + 1)


# --- engines ----------------------------------------------------------------------------------------------

def bench_problem(p: Problem, device, args, state: Dict) -> Dict:
    import torch
    from ..moe.engines import triton_heuristics, triton_large
    row: Dict = {"problem": p.name, "layer": p.layer, "groups": p.groups, "rows_per_group": p.rows_per_group,
                 "M_real": p.M, "N": p.N, "K": p.K, "flops": p.flops, "deepgemm_anchor_tflops": p.anchor}
    tflops = lambda ms: p.flops / (ms * 1e-3) / 1e12  # noqa: E731
    data = Inputs(p, device, seed=zlib.crc32(p.name.encode()), num_sets=_num_sets(p, state["l2_bytes"]))
    row["input_sets"] = len(data.sets)
    b, b_sf, m_idx, out = data.b, data.b_sf, data.m_indices, data.out

    # Triton: every configuration (default first); the sweep stops once the time budget is spent.
    default = triton_heuristics.default_config(p.M, p.N, p.K, p.groups)
    cfgs = [default] + [c for c in state["configs"] if c != default]
    row["triton"] = {}
    for i, cfg in enumerate(cfgs):
        if i and time.perf_counter() - state["started"] > args.budget_s:
            row["sweep_truncated"] = True
            break
        fns = [lambda s=s, c=cfg: triton_large.grouped_gemm_fp8(s[1], s[2], b, b_sf, m_idx, out=out, config=c)
               for s in data.sets]
        try:
            fns[0]()
            torch.cuda.synchronize()
            err = data.check(p, out)
            ms = _time_ms(fns, args.repeats)
            row["triton"][cfg.name] = {"ms": ms, "tflops": tflops(ms), "rel_err": err}
        except Exception as exc:  # one config failing (e.g. out of shared memory) must not end the sweep
            row["triton"][cfg.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            logger.warning("%s %s: %s", p.name, cfg.name, exc)
    good = {k: v for k, v in row["triton"].items() if "tflops" in v}
    row["triton_default"] = default.name
    if good:
        best = max(good, key=lambda k: good[k]["tflops"])
        row["triton_best"] = best
        row["triton_best_tflops"] = good[best]["tflops"]
        row["triton_default_tflops"] = good.get(default.name, {}).get("tflops")
        row["triton_rel_err"] = good[best]["rel_err"]

    # DeepGEMM
    if state["deepgemm_ok"]:
        from ..moe.engines import deepgemm
        try:
            fns = [lambda s=s: deepgemm.grouped_gemm_fp8(s[1], s[2], b, b_sf, m_idx, out) for s in data.sets]
            fns[0]()
            torch.cuda.synchronize()
            row["deepgemm_rel_err"] = data.check(p, out)
            ms = _time_ms(fns, args.repeats)
            row["deepgemm_tflops"] = tflops(ms)
            for key in ("best", "default"):
                if row.get(f"triton_{key}_tflops"):
                    row[f"ratio_{key}_vs_deepgemm"] = row[f"triton_{key}_tflops"] / row["deepgemm_tflops"]
        except Exception as exc:
            row["deepgemm_error"] = f"{type(exc).__name__}: {exc}"[:300]
            logger.warning("%s DeepGEMM: %s", p.name, exc)

    # torch bf16 grouped GEMM on the same rows (the layer's current engine)
    try:
        w_t = data.w_bf16.transpose(1, 2)
        fns = [lambda s=s: torch._grouped_mm(s[0], w_t, offs=data.offs) for s in data.sets]
        row["torch_bf16_grouped_tflops"] = tflops(_time_ms(fns, args.repeats))
    except Exception as exc:
        row["torch_bf16_grouped_error"] = f"{type(exc).__name__}: {exc}"[:300]

    # dense fp8 of the same total M x N x K (cuBLAS, per-tensor scales, fast accumulation: its ceiling)
    try:
        one = torch.ones((), device=device, dtype=torch.float32)
        b0_t = b[0].t()
        fns = [lambda s=s: torch._scaled_mm(s[1], b0_t, one, one, out_dtype=torch.bfloat16,
                                                     use_fast_accum=True) for s in data.sets]
        row["torch_fp8_dense_tflops"] = tflops(_time_ms(fns, args.repeats))
    except Exception as exc:
        row["torch_fp8_dense_error"] = f"{type(exc).__name__}: {exc}"[:300]

    if p.layer == "L1":
        row["swiglu"] = bench_swiglu(data, p, args, state)
    return row


def bench_swiglu(data: Inputs, p: Problem, args, state: Dict) -> Dict:
    """swiglu_quant_fp8 on an L1 output [M, N] (random bf16 rows): GB/s and bitwise agreement."""
    import torch
    from ..moe.engines import triton_large
    gen = torch.Generator(device=data.out.device).manual_seed(5)
    h = torch.randn(p.M, p.N, device=data.out.device, dtype=torch.bfloat16, generator=gen) * 2
    inter = p.N // 2
    try:
        q, q_sf = triton_large.swiglu_quant_fp8(h, data.m_indices)
        rows = slice(0, min(p.M, 4096))
        g, u = h[rows, :inter].float(), h[rows, inter:].float()
        act = g / (1.0 + torch.exp(-g)) * u
        q_ref, sf_ref = quant_rows(act)
        q_bad = int((q[rows].view(torch.uint8) != q_ref.view(torch.uint8)).sum())
        sf_bad = int((q_sf[rows] != sf_ref).sum())
        ms = _time_ms([lambda: triton_large.swiglu_quant_fp8(h, data.m_indices)], args.repeats)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    num_bytes = p.M * p.N * 2 + p.M * inter + p.M * (inter // 128) * 4 + p.M * 4
    gbps = num_bytes / (ms * 1e-3) / 1e9
    return {"ms": ms, "gbps": gbps, "fraction_of_copy": gbps / state["copy_gbps"],
            "checked_rows": rows.stop, "q_mismatches": q_bad, "sf_mismatches": sf_bad}


def format_table(rows: List[Dict], state: Dict) -> str:
    nan = float("nan")
    lines = [f"device copy {state['copy_gbps']:.0f} GB/s (this run); DeepGEMM: {state['deepgemm_reason']}",
             f"{'problem':<24} {'M':>6} {'N':>6} {'K':>6} {'best cfg':<18} {'best':>6} {'dflt':>6} {'DG':>6} "
             f"{'b/DG':>5} {'d/DG':>5} {'DGnote':>6} {'bf16':>5} {'fp8d':>5} {'err tr':>7} {'err dg':>7} "
             f"{'swiglu GB/s':>11} {'%copy':>5} {'bits':>4}"]
    for r in rows:
        sw = r.get("swiglu") or {}
        anchor = r.get("deepgemm_anchor_tflops")
        bits = "" if not sw or "error" in sw else ("ok" if sw["q_mismatches"] == 0 and sw["sf_mismatches"] == 0
                                                     else "DIFF")
        lines.append(
            f"{r['problem']:<24} {r['M_real']:>6} {r['N']:>6} {r['K']:>6} {r.get('triton_best', '-'):<18} "
            f"{r.get('triton_best_tflops') or nan:>6.0f} {r.get('triton_default_tflops') or nan:>6.0f} "
            f"{r.get('deepgemm_tflops', nan):>6.0f} {r.get('ratio_best_vs_deepgemm', nan):>5.2f} "
            f"{r.get('ratio_default_vs_deepgemm', nan):>5.2f} {anchor if anchor else nan:>6.0f} "
            f"{r.get('torch_bf16_grouped_tflops', nan):>5.0f} {r.get('torch_fp8_dense_tflops', nan):>5.0f} "
            f"{r.get('triton_rel_err', nan):>7.1e} {r.get('deepgemm_rel_err', nan):>7.1e} "
            f"{sw.get('gbps', nan):>11.0f} {100 * sw.get('fraction_of_copy', nan):>5.1f} {bits:>4}")
    lines.append("TFLOP/s = 2*M*N*K/time (median); best/dflt: Triton's best config and default_config's; DG: "
                 "DeepGEMM now; DGnote: DeepGEMM measured earlier on the H200; bf16: torch._grouped_mm; fp8d: dense "
                 "torch._scaled_mm of the same total size; err: ||out-ref||/||ref||; bits: swiglu_quant bitwise "
                 "equal to the rule evaluated in torch")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m symmring bench gemm",
                                     description="The fp8 expert GEMM engines on one GPU: the built-in Triton kernel "
                                                 "(every configuration), DeepGEMM, torch bf16 and a dense fp8 GEMM, "
                                                 "on the grouped L1 and L2 problems of three model shapes.")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument("--quick", action="store_true", help="the four anchor problems, four configs, 10 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per engine (default 20, quick 10)")
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="after this many seconds only default configs are timed (default 270)")
    parser.add_argument("--problems", default="", help="only problems whose name contains one of these "
                                                       "comma-separated words")
    parser.add_argument("--no-deepgemm", action="store_true", help="skip DeepGEMM even when importable")
    parser.add_argument("--decode", action="store_true",
                        help="instead: decode sizes (1..128 tokens), the small-group kernels (triton_small: fused L1, "
                             "L2) vs grouped_gemm_fp8 + swiglu_quant_fp8 (and DeepGEMM) vs the weight-read time")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="instead: every triton_small configuration per shape and token count (fused L1, L2)")
    parser.add_argument("--tokens", default="", help="with --decode/--decode-sweep: comma-separated token counts")
    args = parser.parse_args(argv)
    try:
        from .gemm_decode import parse_tokens
        args.tokens = parse_tokens(args.tokens)
    except ValueError as exc:
        parser.error(str(exc))
    args.repeats = args.repeats or (10 if args.quick else 20)
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    if lacks_cuda_torch("bench gemm"):
        return 2
    import torch
    from ..moe.engines import triton_heuristics
    from ..moe.engines.deepgemm import deepgemm_status
    logging.basicConfig(level=logging.WARNING)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference of the correctness checks
    # DeepGEMM's JIT compiles with nvcc (its NVRTC path fails on the H200 image: NVRTC finds no
    # <cuda/std/cstdint>); DG_JIT_CACHE_DIR keeps the kernels across runs.
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    configs = triton_heuristics.gemm_configs()
    if args.quick:
        quick = ("128x128w8s5g8", "64x128w4s3g8", "128x256w8s3g8", "128x128w8s4g8-ptr")
        configs = [c for c in configs if c.name in quick]
    if args.no_deepgemm:
        dg_ok, dg_reason = False, "skipped (--no-deepgemm)"
    else:
        dg_ok, dg_reason = deepgemm_status(probe=True)
    progress(f"DeepGEMM: {dg_reason}")
    state = {"started": started, "configs": configs, "deepgemm_ok": dg_ok, "deepgemm_reason": dg_reason,
             "l2_bytes": torch.cuda.get_device_properties(device).L2_cache_size,
             "copy_gbps": measure_copy_gbps(device)}
    progress(f"device copy {state['copy_gbps']:.0f} GB/s")
    if args.decode or args.decode_sweep:
        from . import gemm_decode
        state["device"] = device
        figures = gemm_decode.run(args, state)
        print(f"bench gemm: decode in {time.perf_counter() - started:.0f} s")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                           "triton": __import__("triton").__version__, "deepgemm": dg_reason,
                           "copy_gbps": state["copy_gbps"], **figures}, fh, indent=1)
        return 0
    todo = problems(args.quick)
    if args.problems:
        words = [w for w in args.problems.split(",") if w]
        todo = [p for p in todo if any(w in p.name for w in words)]
    rows = []
    for i, p in enumerate(todo):
        t0 = time.perf_counter()
        rows.append(bench_problem(p, device, args, state))
        torch.cuda.empty_cache()  # the problem's tensors are gone with bench_problem's frame
        r = rows[-1]
        progress(f"{i + 1}/{len(todo)} {p.name}: Triton best {r.get('triton_best')} "
                  f"{r.get('triton_best_tflops') or float('nan'):.0f} TFLOP/s, DeepGEMM "
                  f"{r.get('deepgemm_tflops', float('nan')):.0f} ({time.perf_counter() - t0:.1f} s)")
    elapsed = time.perf_counter() - started
    print(format_table(rows, state))
    print(f"bench gemm: {len(rows)} problems in {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "deepgemm": dg_reason,
                       "copy_gbps": state["copy_gbps"], "configs": [dataclasses.asdict(c) | {"name": c.name}
                                                                    for c in configs],
                       "elapsed_s": elapsed, "rows": rows}, fh, indent=1)
    failed = [r["problem"] for r in rows if r.get("triton_rel_err", 1.0) > 1e-2]
    if failed:
        print(f"bench gemm: Triton relative error above 1e-2 on {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
