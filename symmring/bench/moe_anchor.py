"""``python -m symmring bench moe --anchor megamoe``: the symmring layer beside DeepGEMM's SM90 MegaMoE.

DeepGEMM's SM90 FP8 MegaMoE (dispatch, both expert GEMMs with SwiGLU and combine fused in one persistent
kernel, ``sm90_fp8_mega_moe_impl``) is the layer the RFC is written for. This benchmark runs it and the
symmring layer (`symmring.moe.gpu.MoE`, fp8 experts) on the SAME inputs and prints their latency side by
side, per model shape and tokens per rank:

* inputs: one seeded ``x`` (bf16), one set of expert weights drawn in bf16 and quantised ONCE to fp8 e4m3
  with float32 128x128 block scales (`symmring.moe.weights.quantize_blocks`), one routing
  (``topk_idx`` int32 of distinct experts, ``topk_weights`` float32 summing to 1 per token);
* symmring: ``MoE(..., w_gate, w_up, w_down, w_*_scale=...)`` given those fp8 weights, called with
  ``topk_idx``/``topk_weights`` (no router), batch (``streaming=False``, the default one-slot ring) and
  streamed (``streaming=True``, a ring of ``--tokens-per-slot`` slots; only where a call has at least two
  chunks; expert windows of one chunk, or with ``--streamed-window call`` one window of the whole call), for each
  engine (``builtin``; ``fused`` when named; ``deepgemm`` where
  `symmring.moe.engines.deepgemm` finds a working ``deep_gemm``);
* MegaMoE: the same fp8 weights as ``l1 = [gate; up]`` (rows interleaved by 8, `interleave_gate_up`, which
  is its ``transform_weights_for_mega_moe_sm90``; scales unchanged) and ``l2 = down``; its symmetric buffer
  (at one rank a plain ``torch.zeros`` of ``get_symm_buffer_size_for_sm90_mega_moe`` bytes, sliced by the
  function that returns, as its ``SymmBuffer`` does at one rank); its routing input
  (``mega_moe_pre_dispatch_sm90``: fp8 ``x`` with per-128 float32 scales, ``topk_idx``, ``topk_weights``,
  ``routed_scaling_factor=1``); then ``fp8_mega_moe(y, l1, l2, None, buffer, [ptr], 0, capacity,
  num_experts, topk, (128, 128, 128), "swiglu", None, fast_math=True)``. Timed: pre-dispatch + kernel
  (``ms``), and the kernel alone after its pre-dispatch (``kernel_ms``);
* ``--modes graph``: each side's call captured once in a CUDA graph and its replays timed (symmring: the batch
  layer's `symmring.moe.gpu.MoE.capture`, and the streamed layer's where ``streamed`` is a mode too; MegaMoE:
  pre-dispatch + kernel under ``torch.cuda.graph``), rows ``symmring ENGINE graph``, ``symmring ENGINE streamed
  graph`` and ``megamoe graph``: the device's time of a call, as a model step captured in a
  graph (vLLM's decode) runs it, where an eager call also times the host's work before its first kernel. Both
  sides' rows time the bare ``graph.replay`` (a model step's graph holds every layer's kernels and replays once);
  symmring's rows also give ``replay_call_ms``, the same graph through `symmring.moe.gpu.CapturedCall.replay` (the
  one-layer replay's host checks: the call order and the latched error, which a model pays once per step), and
  are checked for device errors after their timed replays.

Every call is timed alone (CUDA events around it, then a synchronisation). ``best/megamoe`` is the fastest
symmring row over the fastest MegaMoE row (eager or graph) of the same shape and size.

Both compute the same function, ``y = sum_k w_k * W_down(silu(W_gate x) * (W_up x))`` (MegaMoE's swiglu with
no clamp is ``silu(gate) * up``; it multiplies the topk weight into the SwiGLU output before the second
GEMM, symmring weights each expert's output in the combine: the same sum, rounded differently). Each
output is checked against one reference: the experts in plain torch (`symmring.moe.torch_ref.
experts_forward`) with the DEQUANTISED fp8 weights and the bf16 ``x``, so the tolerance (``--tol``, relative
``||y - y_ref|| / ||y_ref||``) covers the fp8 quantisation of the activations on each side.

Shapes (`ANCHOR_SHAPES`): V4-Flash-like and DeepSeek-V3-like by default; `megamoe_constraints` says which a
shape breaks of what the SM90 kernel asserts; a shape the kernel's host code rejects at run time is
recorded with the error. One PE (MegaMoE's several-rank path needs torch symmetric memory over a process
group; not wired here).

MegaMoE comes from ``megamoe_dg``, a module built by ``tools/megamoe/build.sh`` from DeepGEMM's source
(deepseek-ai/DeepGEMM refs/pull/323/head 8ddf7f9, the newest stored tree with the SM90 kernel) against the
installed torch; it is imported only here, lazily (`load_megamoe`), never by the library. Its own name keeps
it apart from the ``deep_gemm`` of symmring's DeepGEMM engine. ``--warm-only`` compiles MegaMoE's kernel for
some shapes and sizes and exits (the driver, ``tools/megamoe/run_anchor.sh``, runs several at once to
overlap DeepGEMM's JIT compiles).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from . import captured, format_timeline, kernel_timeline, lacks_cuda_torch, progress, timed_ms
from .ceilings import fp8_roofline_ms, measure_ceilings
from ..moe.config import Experts, RoutingConfig, ScheduleConfig

logger = logging.getLogger(__name__)

#: name: (hidden, inter, num_experts, topk). V4-Flash-like: DeepSeek-V4-Flash's routed experts (hidden 4096,
#: expert inter 2048, 256 experts, top-6); DeepSeek-V3-like: (7168, 2048, 256, top-8).
ANCHOR_SHAPES = {
    "v4-flash": (4096, 2048, 256, 6),
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
}
DEFAULT_SHAPES = ("v4-flash", "deepseek-v3")
DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 8192)
ANCHORS = ("megamoe",)
#: symmring's schedules (batch, streamed) and graph replays of each side's call (`--modes`).
MODES = ("batch", "streamed", "graph")
#: Relative error ||y - y_ref|| / ||y_ref|| accepted against the dequantised-weight bf16 reference.
DEFAULT_TOL = 0.05
BUILD_HINT = "tools/megamoe/build.sh (builds DeepGEMM's SM90 MegaMoE as the module megamoe_dg from .megamoe/)"

DESCRIPTION = ("symmring's GPU MoE layer (batch, streamed; each fp8 engine) beside DeepGEMM's SM90 MegaMoE on the "
               "same fp8 weights, inputs and routing, outputs checked against one reference.")


# --------------------------------------------------------------------------------------------- pure logic
def megamoe_constraints(hidden: int, inter: int, num_experts: int, topk: int, num_ranks: int = 1) -> List[str]:
    """What a shape breaks of the SM90 MegaMoE kernel's static assertions and its host layout (empty: none
    known). From DeepGEMM's ``csrc/apis/sm90_mega.hpp`` and ``include/deep_gemm/impls/sm90_fp8_mega_moe.cuh``
    (PR 323 tree): hidden and inter multiples of 128 (per-128 scale factors), ``inter / 64 <= 64`` (the L2
    activations' per-64 scales), ``kNumTopk <= 32``, ``kNumExperts % kNumRanks == 0``; ``kNumRanks <= 32``.

    Example:
        >>> megamoe_constraints(4096, 2048, 256, 6)
        []
        >>> megamoe_constraints(4000, 2048, 256, 40)
        ['hidden=4000: not a multiple of 128', 'topk=40: above 32']
        >>> megamoe_constraints(4096, 14336, 8, 2)  # Mixtral-like
        ['inter=14336: above 4096 (inter / 64 <= 64)']
    """
    out = []
    if hidden % 128:
        out.append(f"hidden={hidden}: not a multiple of 128")
    if inter % 128:
        out.append(f"inter={inter}: not a multiple of 128")
    if inter // 64 > 64:
        out.append(f"inter={inter}: above 4096 (inter / 64 <= 64)")
    if topk > 32:
        out.append(f"topk={topk}: above 32")
    if topk > num_experts:
        out.append(f"topk={topk}: above num_experts={num_experts}")
    if num_experts % num_ranks:
        out.append(f"num_experts={num_experts}: not a multiple of num_ranks={num_ranks}")
    if num_ranks > 32:
        out.append(f"num_ranks={num_ranks}: above 32")
    return out


def interleave_gate_up(w, gran: int = 8):
    """``[G, 2 * I, ...]`` with rows ``[gate | up]`` -> rows ``[gate 0..7, up 0..7, gate 8..15, up 8..15, ...]``:
    MegaMoE's L1 weight layout (``transform_weights_for_mega_moe_sm90``; its scales stay ``[gate | up]``).
    Works on torch tensors and NumPy arrays alike (reshape and stack only).

    Example:
        >>> import numpy as np
        >>> interleave_gate_up(np.arange(8).reshape(1, 8, 1), gran=2)[0, :, 0].tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    g, n = int(w.shape[0]), int(w.shape[1])
    rest = tuple(int(s) for s in w.shape[2:])
    if n % (2 * gran):
        raise ValueError(f"w.shape[1]={n}: expected a multiple of 2 * gran = {2 * gran}")
    half = n // 2
    gate = w[:, :half].reshape(g, half // gran, gran, *rest)
    up = w[:, half:].reshape(g, half // gran, gran, *rest)
    if hasattr(w, "detach"):  # torch
        import torch
        return torch.stack([gate, up], dim=2).reshape(g, n, *rest).contiguous()
    import numpy as np
    return np.stack([gate, up], axis=2).reshape(g, n, *rest)


def parse_tokens(text: str) -> List[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]`` (sorted, distinct, positive); ValueError otherwise."""
    tokens = sorted({int(t) for t in text.split(",") if t.strip()})
    if not tokens or tokens[0] < 1:
        raise ValueError(f"{text!r}: expected comma-separated positive integers")
    return tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m symmring bench moe --anchor megamoe", description=DESCRIPTION)
    parser.add_argument("--anchor", choices=ANCHORS, required=True, help="the layer to run beside symmring")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON (rewritten after each row)")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated subset of {list(ANCHOR_SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated tokens per rank")
    parser.add_argument("--engines", default="builtin,deepgemm",
                        help="symmring fp8 engines: builtin, deepgemm (where it works), fused; 'none': MegaMoE alone")
    parser.add_argument("--modes", default="batch,streamed",
                        help="symmring schedules: batch, streamed; graph: also each side's call replayed from a "
                             "CUDA graph (symmring's batch layer, MegaMoE)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="capacity of every layer and of MegaMoE's buffer (default: the largest --tokens); part of "
                             "MegaMoE's kernel template, so keep it equal across runs that share its JIT cache")
    parser.add_argument("--tokens-per-slot", type=int, default=1024,
                        help="the streamed layer's chunk (streamed rows only where a call has >= 2 chunks)")
    parser.add_argument("--streamed-window", choices=("chunk", "call"), default="chunk",
                        help="the streamed layer's expert window: one chunk (each window reads the weights again) "
                             "or the whole call (every expert's weights read once per call; issue 35 deliverable 2)")
    parser.add_argument("--timeline", action="store_true",
                        help="graph rows: also each kernel's start and end within a replay (the JSON's timeline; "
                             "printed on stderr), where fixed costs between the kernels show")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per row (a quarter above 4096 tokens)")
    parser.add_argument("--tol", type=float, default=DEFAULT_TOL, help="relative error accepted vs the reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-megamoe", action="store_true", help="symmring rows only")
    parser.add_argument("--check-only", action="store_true", help="correctness rows only (one timed call)")
    parser.add_argument("--warm-only", action="store_true",
                        help="compile MegaMoE's kernels for these shapes and sizes (uninitialised weights) and exit")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no GPU: one table (and --json) from the results of several runs (`merge_results`: "
                             "tools/megamoe/run_anchor.sh runs each shape and size in a process of its own)")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parsed and checked arguments (``parser.error`` -> SystemExit 2 on a bad value)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in ANCHOR_SHAPES]
    if not args.shapes or unknown:
        parser.error(f"--shapes: unknown {unknown}; expected some of {list(ANCHOR_SHAPES)}")
    try:
        args.tokens = parse_tokens(args.tokens)
    except ValueError as exc:
        parser.error(f"--tokens: {exc}")
    engines = [e for e in args.engines.split(",") if e]
    args.engines = [] if engines == ["none"] else engines
    if any(e not in ("builtin", "deepgemm", "fused") for e in args.engines):
        parser.error(f"--engines={','.join(engines)}: expected builtin, deepgemm, fused or none")
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in MODES for m in args.modes):
        parser.error(f"--modes: expected some of {', '.join(MODES)}")
    if args.max_tokens is None:
        args.max_tokens = args.tokens[-1]
    if args.max_tokens < args.tokens[-1]:
        parser.error(f"--max-tokens={args.max_tokens}: below the largest --tokens ({args.tokens[-1]})")
    if args.repeats < 1 or args.tokens_per_slot < 1 or not args.tol > 0:
        parser.error("--repeats, --tokens-per-slot and --tol must be positive")
    return args


def is_megamoe(impl: str) -> bool:
    """Whether a row's ``impl`` is MegaMoE's (``megamoe``, ``megamoe graph``)."""
    return impl.split(" ")[0] == "megamoe"


def summarize(rows: List[Dict]) -> List[Dict]:
    """One line per (shape, tokens): each implementation's latency, each symmring variant over MegaMoE's fastest
    row (``ratios``), the best symmring variant (``best``) over MegaMoE's fastest (``best_vs_megamoe``) and over the
    call's fp8 roofline (``best_vs_roofline``; `symmring.bench.ceilings.fp8_roofline_ms`, in ``fp8_roofline_ms``).

    Example:
        >>> rows = [dict(shape="v4-flash", tokens_per_rank=8, impl="megamoe", ms=0.2, rel_err=0.02, ok=True),
        ...         dict(shape="v4-flash", tokens_per_rank=8, impl="symmring builtin batch", ms=0.5,
        ...              rel_err=0.02, ok=True, fp8_roofline_ms=0.1)]
        >>> line = summarize(rows)[0]
        >>> line["ratios"], line["best"], line["best_vs_megamoe"], line["best_vs_roofline"]
        ({'symmring builtin batch': 2.5}, 'symmring builtin batch', 2.5, 5.0)
    """
    lines: Dict[Tuple[str, int], Dict] = {}
    for r in rows:
        key = (r["shape"], r["tokens_per_rank"])
        line = lines.setdefault(key, {"shape": key[0], "tokens_per_rank": key[1], "ms": {}, "rel_err": {}, "ok": True,
                                      "fp8_roofline_ms": None})
        if r.get("ms") is not None:
            line["ms"][r["impl"]] = r["ms"]
        if r.get("rel_err") is not None:
            line["rel_err"][r["impl"]] = r["rel_err"]
        if r.get("fp8_roofline_ms"):
            line["fp8_roofline_ms"] = r["fp8_roofline_ms"]
        line["ok"] = line["ok"] and bool(r.get("ok", True))
    for line in lines.values():
        megas = [v for k, v in line["ms"].items() if is_megamoe(k)]
        mega, roof = (min(megas) if megas else None), line["fp8_roofline_ms"]
        line["ratios"] = {k: v / mega for k, v in line["ms"].items() if not is_megamoe(k) and mega}
        ours = {k: v for k, v in line["ms"].items() if not is_megamoe(k)}
        line["best"] = min(ours, key=ours.get) if ours else None
        best_ms = ours.get(line["best"]) if ours else None
        line["best_vs_megamoe"] = best_ms / mega if best_ms and mega else None
        line["best_vs_roofline"] = best_ms / roof if best_ms and roof else None
    return list(lines.values())


def format_table(rows: List[Dict]) -> str:
    """The side-by-side table: per shape and size, each implementation's ms (and relative error), MegaMoE's
    last, then the best symmring variant over MegaMoE and over the fp8 roofline (`summarize`).

    Example:
        >>> rows = [dict(shape="v4-flash", tokens_per_rank=8, impl="megamoe", ms=0.2, rel_err=0.02, ok=True),
        ...         dict(shape="v4-flash", tokens_per_rank=8, impl="symmring builtin batch", ms=0.3,
        ...              rel_err=0.021, ok=True, fp8_roofline_ms=0.1)]
        >>> print(format_table(rows))  # doctest: +NORMALIZE_WHITESPACE
        shape         tokens  symmring builtin batch     megamoe              best/megamoe best/roofline ok
        v4-flash           8  0.300 ms (2.1e-02)         0.200 ms (2.0e-02)   1.50         3.00          yes
    """
    impls = list(dict.fromkeys(r["impl"] for r in rows if not is_megamoe(r["impl"])))
    impls += list(dict.fromkeys(r["impl"] for r in rows if is_megamoe(r["impl"])))
    width = max([22] + [len(i) for i in impls]) + 3
    head = (f"{'shape':<13} {'tokens':>6}  " + "".join(f"{i:<{width}}" for i in impls)
            + f"{'best/megamoe':<13}{'best/roofline':<14}ok")
    out = [head]
    for line in summarize(rows):
        cells = []
        for impl in impls:
            ms, err = line["ms"].get(impl), line["rel_err"].get(impl)
            cell = "-" if ms is None else f"{ms:.3f} ms" + (f" ({err:.1e})" if err is not None else "")
            cells.append(f"{cell:<{width}}")
        vs_mega, vs_roof = (f"{v:.2f}" if v else "-" for v in (line["best_vs_megamoe"], line["best_vs_roofline"]))
        out.append(f"{line['shape']:<13} {line['tokens_per_rank']:>6}  " + "".join(cells) + f"{vs_mega:<13}"
                   f"{vs_roof:<14}" + ("yes" if line["ok"] else "NO"))
    return "\n".join(out)


def merge_results(payloads: Sequence[Dict], argv: Sequence[str] = ()) -> Dict:
    """One results payload from those of several runs (each a process of its own: a row's time depends on what ran
    before it in a process, docs/PERFORMANCE.md "session 22"): their rows and skips in order, MegaMoE's buffers by
    shape, each run's device ceilings and argv under ``runs`` (every row keeps the roofline its run measured), the
    first run's ceilings at the top; complete when every run was.

    Example:
        >>> a = dict(anchor="megamoe", rows=[dict(shape="v4-flash", tokens_per_rank=1, impl="megamoe", ms=0.1)],
        ...          skipped=[], megamoe={"v4-flash": 1}, ceilings={"copy_gbps": 3000.0}, argv=["--tokens", "1"],
        ...          complete=True)
        >>> b = dict(a, rows=[dict(shape="v4-flash", tokens_per_rank=8, impl="megamoe", ms=0.4)], complete=False)
        >>> m = merge_results([a, b])
        >>> [r["tokens_per_rank"] for r in m["rows"]], m["complete"], len(m["runs"]), m["ceilings"]
        ([1, 8], False, 2, {'copy_gbps': 3000.0})
    """
    if not payloads:
        raise ValueError("merge_results: no results to merge")
    merged = {k: v for k, v in payloads[0].items() if k not in ("rows", "skipped", "megamoe", "summary", "argv")}
    merged.update(rows=[r for p in payloads for r in p.get("rows", [])],
                  skipped=list({json.dumps(s, sort_keys=True): s for p in payloads for s in p.get("skipped", [])}
                               .values()),
                  megamoe={k: v for p in payloads for k, v in p.get("megamoe", {}).items()},
                  runs=[{"argv": p.get("argv"), "ceilings": p.get("ceilings"), "complete": p.get("complete", False)}
                        for p in payloads],
                  argv=list(argv), complete=all(p.get("complete", False) for p in payloads))
    merged["summary"] = summarize(merged["rows"])
    return merged


def write_json(path: Optional[str], payload: Dict) -> None:
    """Write ``payload`` to ``path`` atomically (a partial run keeps its last complete file)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- GPU side
def load_megamoe():
    """``megamoe_dg``: DeepGEMM's SM90 FP8 MegaMoE as tools/megamoe/build.sh builds it.

    Raises:
        ImportError: it is missing, does not load, or lacks an entry point (naming the tool script).
    """
    import torch  # noqa: F401  (libtorch first)
    if importlib.util.find_spec("megamoe_dg") is None:
        raise ImportError(f"megamoe_dg is not importable; build DeepGEMM's MegaMoE with {BUILD_HINT} and put its "
                          "site directory (default /tmp/megamoe-site) on PYTHONPATH")
    try:
        import megamoe_dg
    except Exception as exc:  # an ABI mismatch surfaces as ImportError/OSError/RuntimeError
        raise ImportError(f"megamoe_dg does not load ({type(exc).__name__}: {exc}); see {BUILD_HINT}") from exc
    missing = [n for n in ("fp8_mega_moe", "mega_moe_pre_dispatch_sm90", "get_symm_buffer_size_for_sm90_mega_moe",
                           "get_token_alignment_for_sm90_mega_moe") if not hasattr(megamoe_dg._C, n)]
    if missing:
        raise ImportError(f"megamoe_dg has no {', '.join(missing)}; see {BUILD_HINT}")
    return megamoe_dg


class MegaMoEBuffer:
    """MegaMoE's SM90 symmetric buffer at one rank: its ``SM90SymmBuffer`` with a plain ``torch.zeros``
    instead of torch symmetric memory (what its generic ``SymmBuffer`` does at one rank), so no process group
    is needed; the capacity aligned as its ``get_symm_buffer_for_sm90_mega_moe`` aligns it."""

    def __init__(self, dg, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                 intermediate_hidden: int, activation: str = "swiglu"):
        import torch
        align = int(dg._C.get_token_alignment_for_sm90_mega_moe())
        self.num_max_tokens_per_rank = -(-num_max_tokens_per_rank // align) * align
        self.num_experts, self.num_topk = num_experts, num_topk
        self.nbytes, slice_input_buffers = dg._C.get_symm_buffer_size_for_sm90_mega_moe(
            1, num_experts, self.num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, True, activation)
        self.nbytes = int(self.nbytes)
        self.buffer = torch.zeros(self.nbytes, dtype=torch.int8, device="cuda")
        self.buffer_ptrs = [self.buffer.data_ptr()]
        (self.x, self.x_sf, self.topk_idx, self.topk_weights,
         self.l1_acts, self.l1_acts_sf, self.l2_acts, self.l2_acts_sf) = slice_input_buffers(self.buffer)


def make_inputs(shape: str, tokens: Sequence[int], seed: int, device):
    """Seeded fp8 expert weights (drawn in bf16, quantised once, 16 experts at a time) and, per size, ``x``
    and a routing (`size_inputs`): ``(weights, inputs)`` with ``weights = dict(gate, up, down, gate_scale, up_scale,
    down_scale)`` and ``inputs[n] = (x, topk_idx, topk_weights)``."""
    import torch
    from ..moe.weights import quantize_blocks
    hidden, inter, num_experts, topk = ANCHOR_SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(seed)

    def fp8(n_out, n_in):
        qs, ss = [], []
        for e0 in range(0, num_experts, 16):
            e1 = min(num_experts, e0 + 16)
            w = torch.randn(e1 - e0, n_out, n_in, device=device, dtype=torch.bfloat16, generator=gen) / n_in ** 0.5
            q, s = quantize_blocks(w)
            qs.append(q)
            ss.append(s)
            del w
        return torch.cat(qs), torch.cat(ss)

    weights = {}
    weights["gate"], weights["gate_scale"] = fp8(inter, hidden)
    weights["up"], weights["up_scale"] = fp8(inter, hidden)
    weights["down"], weights["down_scale"] = fp8(hidden, inter)
    return weights, {n: size_inputs(shape, n, seed, device) for n in tokens}


def size_inputs(shape: str, n: int, seed: int, device):
    """``(x, topk_idx, topk_weights)`` of ``n`` tokens, drawn from a generator of their own (seeded by ``seed`` and
    ``n``): a size's inputs are the same whichever other sizes its process draws (tools/megamoe/run_anchor.sh runs
    each size in a process of its own, its dgengine step all of them in one)."""
    import torch
    hidden, _, num_experts, topk = ANCHOR_SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + n)
    x = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    scores = torch.randn(n, num_experts, device=device, dtype=torch.float32, generator=gen)
    top, idx = scores.topk(topk, dim=1)
    return x, idx.to(torch.int32).contiguous(), torch.softmax(top, dim=1).contiguous()


def reference_weights(weights):
    """``(w13, w_down)`` bf16: the fp8 weights dequantised (``float32(q) * scale``), gate rows then up rows.

    The halves are written in place: a concatenation would hold them twice (DeepSeek-V3-like: 30 GB at its
    peak beside the layers and MegaMoE's weights, which ran out of an H100's 80 GB)."""
    import torch
    from ..moe.weights import dequantize_blocks
    gate = weights["gate"]
    experts, inter, hidden = (int(s) for s in gate.shape)
    w13 = torch.empty((experts, 2 * inter, hidden), dtype=torch.bfloat16, device=gate.device)
    dequantize_blocks(gate, weights["gate_scale"], out=w13[:, :inter])
    dequantize_blocks(weights["up"], weights["up_scale"], out=w13[:, inter:])
    return w13, dequantize_blocks(weights["down"], weights["down_scale"])


def reference(ref_weights, x, topk_idx, topk_weights):
    """float32 ``[n, hidden]``: the experts in plain torch (`symmring.moe.torch_ref.experts_forward`) on the
    dequantised fp8 weights (`reference_weights`) and the bf16 ``x``."""
    from ..moe.torch_ref import experts_forward
    return experts_forward(x, topk_idx, topk_weights, *ref_weights)


def rel_error(y, y_ref) -> float:
    import torch
    y, y_ref = y.double(), y_ref.double()
    denom = torch.linalg.vector_norm(y_ref).item()
    num = torch.linalg.vector_norm(y - y_ref).item()
    return num / denom if denom > 0 else num


def _median_ms(fn, repeats: int, warmup: int = 2) -> float:
    return statistics.median(timed_ms(fn, repeats, warmup))


def _median_kernel_ms(runner, x, topk_idx, topk_weights, out, repeats: int, warmup: int = 2) -> float:
    """Milliseconds of MegaMoE's kernel alone: pre-dispatch, then CUDA events around the kernel, per call."""
    import torch
    times = []
    for i in range(warmup + repeats):
        runner.pre_dispatch(x, topk_idx, topk_weights)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.kernel(out)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _symmring_graph(layer, x, topk_idx, topk_weights, streaming: bool = False):
    """The layer's call on these tensors (batch, or ``streaming``) captured (`symmring.moe.gpu.MoE.capture`), replayed
    once through `CapturedCall.replay` and checked: ``(call, y)``, ``y`` the graph's static output."""
    import torch
    call, y = layer.capture(x, topk_idx=topk_idx, topk_weights=topk_weights, streaming=streaming)
    call.replay()
    torch.cuda.synchronize()
    layer.check_errors()
    return call, y


def _megamoe_graph(runner, x, topk_idx, topk_weights):
    """MegaMoE's call (pre-dispatch + kernel) on these tensors captured under ``torch.cuda.graph`` after a warm call
    on the capture's stream, replayed once: ``(replay, y)``."""
    import torch
    y = torch.empty(x.shape[0], runner.hidden, device=x.device, dtype=torch.bfloat16)
    replay = captured(lambda: runner.run(x, topk_idx, topk_weights, y))
    replay()
    torch.cuda.synchronize()
    return replay, y


class MegaMoERunner:
    """MegaMoE on one shape: its weights (``[gate; up]`` interleaved by 8 rows, scales as they are), one buffer
    sized for ``max_tokens``, ``run(x, topk_idx, topk_weights)``."""

    def __init__(self, dg, weights, hidden: int, inter: int, num_experts: int, topk: int, max_tokens: int,
                 transformed=None):
        import torch
        self.dg, self.hidden, self.topk, self.num_experts = dg, hidden, topk, num_experts
        self.buf = MegaMoEBuffer(dg, num_experts, max_tokens, topk, hidden, inter)
        if transformed is not None:  # ((l1, l1_sf), (l2, l2_sf)) already in MegaMoE's layout
            (self.l1, self.l1_sf), (self.l2, self.l2_sf) = transformed
            return
        l1 = torch.cat([weights["gate"], weights["up"]], dim=1)
        self.l1 = interleave_gate_up(l1.view(torch.uint8)).view(torch.float8_e4m3fn)
        del l1
        self.l1_sf = torch.cat([weights["gate_scale"], weights["up_scale"]], dim=1).contiguous()
        self.l2, self.l2_sf = weights["down"], weights["down_scale"]

    def pre_dispatch(self, x, topk_idx, topk_weights):
        b = self.buf
        self.dg._C.mega_moe_pre_dispatch_sm90(x, topk_idx, topk_weights, b.x, b.x_sf, b.topk_idx, b.topk_weights,
                                              int(x.shape[0]), 128, 1.0)

    def kernel(self, y):
        b = self.buf
        self.dg._C.fp8_mega_moe(y, (self.l1, self.l1_sf), (self.l2, self.l2_sf), None, b.buffer, b.buffer_ptrs, 0,
                                b.num_max_tokens_per_rank, self.num_experts, self.topk, (128, 128, 128), "swiglu",
                                None, True)

    def run(self, x, topk_idx, topk_weights, y=None):
        import torch
        if y is None:
            y = torch.empty(x.shape[0], self.hidden, device=x.device, dtype=torch.bfloat16)
        self.pre_dispatch(x, topk_idx, topk_weights)
        self.kernel(y)
        return y


def _symmring_layers(ctx, shape: str, weights, engines: List[str], modes: List[str], max_tokens: int,
                     tokens_per_slot: int, streamed_window: str = "chunk") -> Dict[str, object]:
    from ..moe.gpu.layer import MoE
    hidden, inter, num_experts, topk = ANCHOR_SHAPES[shape]
    experts = Experts(weights["gate"], weights["up"], weights["down"], w_gate_scale=weights["gate_scale"],
                      w_up_scale=weights["up_scale"], w_down_scale=weights["down_scale"], expert_dtype="fp8")
    routing = RoutingConfig(num_experts, topk)
    layers = {}
    for engine in engines:
        if "batch" in modes or "graph" in modes:
            batch = MoE(ctx, experts, routing, max_tokens=max_tokens, engine=engine)
            if "batch" in modes:
                layers[f"symmring {engine} batch"] = batch
            if "graph" in modes:  # the batch layer's call, captured (the same object: closed once)
                layers[f"symmring {engine} graph"] = batch
        if "streamed" in modes and max_tokens >= 2 * tokens_per_slot:
            slots = -(-max_tokens // tokens_per_slot)
            schedule = ScheduleConfig(num_slots=slots, tokens_per_slot=tokens_per_slot,
                                      expert_window=slots if streamed_window == "call" else 1)
            streamed = layers[f"symmring {engine} streamed"] = MoE(ctx, experts, routing, max_tokens=max_tokens,
                                                                   schedule=schedule, engine=engine)
            if "graph" in modes:  # the streamed call, captured
                layers[f"symmring {engine} streamed graph"] = streamed
    return layers


def usable_engines(engines: List[str], payload: Dict) -> List[str]:
    """The engines that work here: ``deepgemm`` only where `symmring.moe.engines.deepgemm` imports a ``deep_gemm`` and
    its probe GEMM agrees with torch (in this process that is whichever ``deep_gemm`` is first on the path);
    each one left out is recorded in ``payload["skipped"]``."""
    out = []
    for engine in engines:
        if engine == "deepgemm":
            from ..moe.engines import deepgemm
            ok, reason = deepgemm.deepgemm_status(probe=True)
            payload["deepgemm_engine"] = reason
            if not ok:
                payload["skipped"].append({"shape": "*", "impl": "symmring deepgemm", "reason": reason})
                logger.warning("bench moe --anchor: engine deepgemm skipped: %s", reason)
                continue
        out.append(engine)
    return out


def bench_shape(ctx, dg, shape: str, args, rows: List[Dict], payload: Dict, started: float) -> None:
    import torch
    hidden, inter, num_experts, topk = ANCHOR_SHAPES[shape]
    device = torch.device("cuda", torch.cuda.current_device())
    base = {"shape": shape, "hidden": hidden, "inter": inter, "num_experts": num_experts, "topk": topk,
            "world_size": 1}
    broken = megamoe_constraints(hidden, inter, num_experts, topk)
    use_mega = dg is not None and not broken
    if dg is not None and broken:
        payload["skipped"].append({**base, "impl": "megamoe", "reason": "; ".join(broken)})
    weights, inputs = make_inputs(shape, args.tokens, args.seed, device)
    # The references first, their bf16 weights freed before MegaMoE and the layers take memory (DeepSeek-V3-like:
    # 22.5 GB of reference weights beside both would not fit an H100's 80 GB).
    ref_weights = reference_weights(weights)
    y_refs = {n: reference(ref_weights, *inputs[n]) for n in args.tokens}
    del ref_weights
    torch.cuda.empty_cache()
    max_tokens = args.max_tokens
    mega = None
    if use_mega:
        try:
            mega = MegaMoERunner(dg, weights, hidden, inter, num_experts, topk, max_tokens)
            payload["megamoe"][shape] = {"buffer_bytes": mega.buf.nbytes,
                                         "num_max_tokens_per_rank": mega.buf.num_max_tokens_per_rank}
        except Exception as exc:
            payload["skipped"].append({**base, "impl": "megamoe", "reason": f"{type(exc).__name__}: {exc}"})
            logger.warning("%s: MegaMoE setup failed: %s", shape, exc)
    layers = _symmring_layers(ctx, shape, weights, args.engines, args.modes, max_tokens, args.tokens_per_slot,
                              args.streamed_window)
    try:
        for n in args.tokens:
            x, idx, w = inputs[n]
            y_ref = y_refs.pop(n)
            touched = int(torch.unique(idx[idx >= 0]).numel())
            roof = fp8_roofline_ms(touched, int((idx >= 0).sum()), hidden, inter, payload["ceilings"])
            reps = 1 if args.check_only else (args.repeats if n <= 4096 else max(3, args.repeats // 4))
            impls = list(layers.items())
            if mega is not None:
                impls += [("megamoe", mega)] + ([("megamoe graph", mega)] if "graph" in args.modes else [])
            for name, impl in impls:
                row = {**base, "impl": name, "tokens_per_rank": n, "fp8_roofline_ms": roof}
                streamed = " streamed" in name
                if streamed and n < 2 * args.tokens_per_slot:
                    continue  # one chunk: the batch path
                try:
                    if name.endswith(" graph"):
                        call = None
                        if name == "megamoe graph":
                            replay, y = _megamoe_graph(impl, x, idx, w)
                        else:
                            call, y = _symmring_graph(impl, x, idx, w, streamed)
                            replay = call.graph.replay
                        row["rel_err"] = rel_error(y.float(), y_ref)
                        row["ms"] = _median_ms(replay, reps)
                        if call is not None:
                            row["replay_call_ms"] = _median_ms(call.replay, reps)
                            torch.cuda.synchronize()
                            impl.check_errors()  # the bare replays met no device error
                        if args.timeline:  # a diagnostic: a replay it cannot place leaves the row as measured
                            try:
                                row["timeline"] = kernel_timeline(replay)
                                print(f"{shape} n={n} {name}:\n{format_timeline(row['timeline'])}", file=sys.stderr)
                            except ValueError as exc:
                                row["timeline_error"] = str(exc)
                        del replay, y, call
                    elif name == "megamoe":
                        y = impl.run(x, idx, w)
                        torch.cuda.synchronize()
                        row["rel_err"] = rel_error(y.float(), y_ref)
                        out = torch.empty_like(y)
                        row["ms"] = _median_ms(lambda: impl.run(x, idx, w, out), reps)
                        # The kernel alone, each call after its own pre-dispatch (as DeepGEMM's benchmark refills
                        # the buffer's inputs before every call), the events around the kernel only.
                        row["kernel_ms"] = _median_kernel_ms(impl, x, idx, w, out, reps)
                    else:
                        y = impl.forward(x, topk_idx=idx, topk_weights=w, streaming=streamed)
                        torch.cuda.synchronize()
                        impl.check_errors()
                        row["rel_err"] = rel_error(y.float(), y_ref)
                        row["ms"] = _median_ms(lambda: impl.forward(x, topk_idx=idx, topk_weights=w,
                                                                    streaming=streamed), reps)
                        impl.check_errors()
                    row["ok"] = row["rel_err"] <= args.tol
                except Exception as exc:  # one failing implementation must not hide the others
                    torch.cuda.synchronize()
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
                    logger.warning("%s n=%d %s failed: %s", shape, n, name, exc)
                rows.append(row)
                payload["summary"] = summarize(rows)
                write_json(args.json, payload)
                progress("bench moe --anchor", len(rows), None,
                         f"{shape} n={n} {name}: {row.get('ms', float('nan')):.3f} ms, rel err "
                         f"{row.get('rel_err', float('nan')):.2e}{'' if row.get('ok') else '  NOT OK'}",
                         started_s=started)
            del y_ref
    finally:
        for layer in {id(layer): layer for layer in layers.values()}.values():
            layer.close()
        del layers, mega, weights, inputs, y_refs
        torch.cuda.empty_cache()


#: Sizes `tools/megamoe/run_anchor.sh` warms side by side per shape, and each warm process's memory beside its
#: fp8 experts (MegaMoE's buffer, the CUDA context, its JIT).
WARM_SIZES, WARM_PROCESS_OVERHEAD = len(DEFAULT_TOKENS), 4 * 2 ** 30


def warm_processes(shape: str, free_bytes: int) -> int:
    """How many warm processes of ``shape`` fit ``free_bytes`` of GPU memory at once (90% of it; at least 1, at
    most one per size): each holds the shape's fp8 experts and `WARM_PROCESS_OVERHEAD` (six DeepSeek-V3-like
    processes ran out of an H100's 80 GB).

    Example:
        >>> warm_processes("deepseek-v3", 79 * 2**30), warm_processes("v4-flash", 79 * 2**30)
        (4, 6)
        >>> warm_processes("deepseek-v3", 2**30)
        1
    """
    hidden, inter, num_experts, _ = ANCHOR_SHAPES[shape]
    per_process = 3 * hidden * inter * num_experts + WARM_PROCESS_OVERHEAD
    return max(1, min(WARM_SIZES, int(0.9 * free_bytes) // per_process))


def warm(dg, args) -> int:
    """Compile MegaMoE's kernel for every (shape, size) of ``args`` with uninitialised weights (one call each)."""
    import torch
    for shape in args.shapes:
        hidden, inter, num_experts, topk = ANCHOR_SHAPES[shape]
        if megamoe_constraints(hidden, inter, num_experts, topk):
            continue
        f8, f32 = dict(device="cuda", dtype=torch.float8_e4m3fn), dict(device="cuda", dtype=torch.float32)
        transformed = ((torch.empty(num_experts, 2 * inter, hidden, **f8),
                        torch.ones(num_experts, 2 * inter // 128, hidden // 128, **f32)),
                       (torch.empty(num_experts, hidden, inter, **f8),
                        torch.ones(num_experts, hidden // 128, inter // 128, **f32)))
        runner = MegaMoERunner(dg, None, hidden, inter, num_experts, topk, args.max_tokens, transformed=transformed)
        for n in args.tokens:
            t0 = time.perf_counter()
            x = torch.zeros(n, hidden, device="cuda", dtype=torch.bfloat16)
            idx = torch.arange(topk, device="cuda", dtype=torch.int32).repeat(n, 1).contiguous()
            w = torch.full((n, topk), 1.0 / topk, device="cuda", dtype=torch.float32)
            try:
                runner.run(x, idx, w)
                torch.cuda.synchronize()
                print(f"warm {shape} n={n}: {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as exc:
                print(f"warm {shape} n={n}: {type(exc).__name__}: {exc}", flush=True)
        del runner, transformed
        torch.cuda.empty_cache()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.merge:
        try:
            payloads = []
            for path in args.merge:
                with open(path) as fh:
                    payloads.append(json.load(fh))
        except (OSError, ValueError) as exc:
            print(f"bench moe --anchor --merge: {exc}", file=sys.stderr)
            return 2
        merged = merge_results(payloads, list(argv) if argv is not None else sys.argv[1:])
        write_json(args.json, merged)
        print(format_table(merged["rows"]))
        print(f"bench moe --anchor --merge: {len(merged['rows'])} rows from {len(payloads)} runs, "
              f"{sum(not r.get('ok', True) for r in merged['rows'])} not ok, "
              f"{'complete' if merged['complete'] else 'NOT complete'}")
        return 0
    if lacks_cuda_torch("bench moe --anchor"):
        return 2
    import torch
    dg = None
    if not args.no_megamoe:
        try:
            dg = load_megamoe()
        except ImportError as exc:
            print(f"bench moe --anchor megamoe: {exc}", file=sys.stderr)
            return 3
    if args.warm_only:
        return warm(dg, args)
    # Each symmring layer keeps a combine buffer of its largest call in the symmetric heap (as bench moe sizes it).
    per_layer = max(args.max_tokens * (ANCHOR_SHAPES[s][3] + 1) * ANCHOR_SHAPES[s][0] * 2 for s in args.shapes)
    num_layers = max(1, len(args.engines) * (("batch" in args.modes or "graph" in args.modes) +
                                             ("streamed" in args.modes)))
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(2 ** 30, int(per_layer * num_layers * 1.25) + 2 ** 28)))
    rows: List[Dict] = []
    payload = {"anchor": args.anchor, "rows": rows, "skipped": [], "megamoe": {}, "tol": args.tol,
               "megamoe_build": getattr(dg, "__version__", None), "torch": torch.__version__,
               "device": torch.cuda.get_device_name(), "argv": list(argv) if argv is not None else sys.argv[1:],
               "complete": False}
    started = time.perf_counter()
    # The ceilings of this run (device copy rate, dense fp8 rate): the rows' fp8 roofline.
    payload["ceilings"] = measure_ceilings(torch.device("cuda", torch.cuda.current_device()))
    ctx = None
    if args.engines:
        from ..context import init
        ctx = init("nvshmem")
        if ctx.world_size != 1:
            ctx.close()
            print("bench moe --anchor: one PE only (MegaMoE's several-rank path needs torch symmetric memory over "
                  "a process group; not wired here)", file=sys.stderr)
            return 2
        args.engines = usable_engines(args.engines, payload)
    try:
        for shape in args.shapes:
            bench_shape(ctx, dg, shape, args, rows, payload, started)
    finally:
        if ctx is not None:
            ctx.close()
    payload["summary"] = summarize(rows)
    payload["complete"] = True
    write_json(args.json, payload)
    print(format_table(rows))
    for s in payload["skipped"]:
        print(f"skipped: {s['shape']} {s['impl']}: {s['reason']}")
    bad = [r for r in rows if not r.get("ok")]
    for r in bad:
        print(f"NOT OK: {r['shape']} n={r['tokens_per_rank']} {r['impl']}: rel err {r.get('rel_err')} "
              f"{r.get('error', '')}")
    print(f"bench moe --anchor: {len(rows)} rows, {len(bad)} not ok, {time.perf_counter() - started:.0f} s")
    return 0 if not bad else 1
