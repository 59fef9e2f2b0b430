"""`symmring.bench.moe_anchor` (``bench moe --anchor megamoe``) where no GPU is needed: argument parsing, the
shape constraints, MegaMoE's gate/up interleave against an element-by-element NumPy reference, the table and
the JSON writer, and that nothing in the package imports ``deep_gemm`` at module level. The GPU run itself
(tools/megamoe/run_anchor.sh) is skipped here with its reason."""

import ast
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from symmring.bench import moe_anchor as anchor

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_parse_defaults_and_errors():
    args = anchor.parse_args(["--anchor", "megamoe"])
    assert args.shapes == ["v4-flash", "deepseek-v3"]
    assert args.tokens == [1, 8, 64, 512, 4096, 8192] and args.max_tokens == 8192
    assert args.engines == ["builtin", "deepgemm"] and args.modes == ["batch", "streamed"]
    assert args.streamed_window == "chunk"
    assert anchor.parse_args(["--anchor", "megamoe", "--streamed-window", "call"]).streamed_window == "call"
    args = anchor.parse_args(["--anchor", "megamoe", "--tokens", "64,8", "--engines", "none", "--max-tokens", "8192"])
    assert args.tokens == [8, 64] and args.engines == [] and args.max_tokens == 8192
    for bad in (["--shapes", "nope"], ["--tokens", "0"], ["--tokens", "x"], ["--engines", "torch"],
                ["--modes", "eager"], ["--tokens", "64", "--max-tokens", "8"], ["--repeats", "0"],
                ["--streamed-window", "all"]):
        with pytest.raises(SystemExit) as exc:
            anchor.parse_args(["--anchor", "megamoe", *bad])
        assert exc.value.code == 2
    with pytest.raises(SystemExit):
        anchor.parse_args([])  # --anchor is required


def test_constraints():
    for name in anchor.DEFAULT_SHAPES:
        assert anchor.megamoe_constraints(*anchor.ANCHOR_SHAPES[name]) == []
    assert anchor.megamoe_constraints(4096, 2000, 256, 6) == ["inter=2000: not a multiple of 128"]
    assert anchor.megamoe_constraints(4096, 2048, 250, 6, num_ranks=8) == [
        "num_experts=250: not a multiple of num_ranks=8"]
    assert anchor.megamoe_constraints(4096, 2048, 8, 9) == ["topk=9: above num_experts=8"]
    assert anchor.megamoe_constraints(*anchor.ANCHOR_SHAPES["qwen3-30b-a3b"]) == []
    assert anchor.megamoe_constraints(*anchor.ANCHOR_SHAPES["mixtral"]) == ["inter=14336: above 4096 (inter / 64 <= 64)"]


def _interleave_reference(w, gran):
    """Output row r = gate row or up row, chosen element by element (no reshape)."""
    g, n = w.shape[:2]
    half = n // 2
    out = np.empty_like(w)
    for r in range(n):
        block, within = divmod(r, 2 * gran)
        src = block * gran + within if within < gran else half + block * gran + within - gran
        out[:, r] = w[:, src]
    return out


@pytest.mark.parametrize("gran,n,k", [(8, 32, 5), (8, 256, 3), (2, 8, 1)])
def test_interleave_numpy(gran, n, k):
    w = np.random.default_rng(0).integers(0, 255, size=(3, n, k), dtype=np.uint8)
    np.testing.assert_array_equal(anchor.interleave_gate_up(w, gran), _interleave_reference(w, gran))


def _deepgemm_sm90_transform(t, gran=8):
    """DeepGEMM's transform_weights_for_mega_moe_sm90 on the L1 weight, as written in its Python wrapper (PR 323
    tree, sgl_deep_gemm/__init__.py): stack gate and up blocks of 8 rows."""
    import torch
    g, n, *rest = t.shape
    half = n // 2
    gate = t[:, :half].reshape(g, half // gran, gran, *rest)
    up = t[:, half:].reshape(g, half // gran, gran, *rest)
    return torch.empty_like(t).copy_(torch.stack([gate, up], dim=2).reshape(g, n, *rest))


def test_interleave_torch_fp8_bytes():
    torch = pytest.importorskip("torch")
    w = torch.randn(2, 64, 128).to(torch.float8_e4m3fn)
    got = anchor.interleave_gate_up(w.view(torch.uint8))
    np.testing.assert_array_equal(got.numpy(), _interleave_reference(w.view(torch.uint8).numpy(), 8))
    assert torch.equal(got, _deepgemm_sm90_transform(w.view(torch.uint8)))
    with pytest.raises(ValueError):
        anchor.interleave_gate_up(np.zeros((1, 24, 1)), gran=8)


def test_table_and_json(tmp_path):
    rows = [dict(shape="v4-flash", tokens_per_rank=8, impl="symmring builtin batch", ms=0.30, rel_err=0.021, ok=True,
                 fp8_roofline_ms=0.12),
            dict(shape="v4-flash", tokens_per_rank=8, impl="megamoe", ms=0.20, rel_err=0.020, ok=True),
            dict(shape="v4-flash", tokens_per_rank=8, impl="symmring builtin streamed", ms=None, ok=False,
                 error="RuntimeError: x"),
            dict(shape="deepseek-v3", tokens_per_rank=4096, impl="symmring builtin streamed", ms=2.0, rel_err=0.03,
                 ok=True)]
    summary = anchor.summarize(rows)
    assert summary[0]["ratios"] == {"symmring builtin batch": pytest.approx(1.5)}
    assert summary[0]["ok"] is False and summary[1]["ratios"] == {}
    # Best symmring over MegaMoE and over the fp8 roofline (issue 35): the failed streamed row is no candidate.
    assert summary[0]["best"] == "symmring builtin batch"
    assert summary[0]["best_vs_megamoe"] == pytest.approx(1.5) and summary[0]["best_vs_roofline"] == pytest.approx(2.5)
    assert summary[1]["best_vs_megamoe"] is None and summary[1]["best_vs_roofline"] is None
    table = anchor.format_table(rows).splitlines()
    assert table[0].split()[:2] == ["shape", "tokens"] and table[0].rstrip().endswith("ok")
    assert "megamoe" in table[0] and table[0].index("megamoe") > table[0].index("symmring builtin streamed")
    assert "best/megamoe" in table[0] and "best/roofline" in table[0]
    assert "0.300 ms (2.1e-02)" in table[1] and "1.50" in table[1] and "2.50" in table[1] and table[1].endswith("NO")
    assert table[2].endswith("yes") and "2.000 ms" in table[2]
    path = tmp_path / "a.json"
    anchor.write_json(str(path), {"rows": rows, "summary": summary})
    assert json.loads(path.read_text())["rows"][0]["impl"] == "symmring builtin batch"
    assert not (tmp_path / "a.json.tmp").exists()
    anchor.write_json(None, {})  # no path: nothing written


def test_graph_rows_compare_with_megamoes_fastest_row():
    # --modes graph adds each side's replayed call; best/megamoe is the fastest symmring row over the fastest MegaMoE
    # row, whichever mode each came from.
    assert anchor.parse_args(["--anchor", "megamoe", "--modes", "batch,graph"]).modes == ["batch", "graph"]
    rows = [dict(shape="v4-flash", tokens_per_rank=8, impl="symmring fused batch", ms=0.60, ok=True),
            dict(shape="v4-flash", tokens_per_rank=8, impl="symmring fused graph", ms=0.45, ok=True),
            dict(shape="v4-flash", tokens_per_rank=8, impl="megamoe", ms=0.47, ok=True),
            dict(shape="v4-flash", tokens_per_rank=8, impl="megamoe graph", ms=0.50, ok=True)]
    line = anchor.summarize(rows)[0]
    assert line["best"] == "symmring fused graph" and line["best_vs_megamoe"] == pytest.approx(0.45 / 0.47)
    assert set(line["ratios"]) == {"symmring fused batch", "symmring fused graph"}
    head = anchor.format_table(rows).splitlines()[0]
    assert head.index("symmring fused graph") < head.index("megamoe ") < head.index("megamoe graph")


def test_replay_timeline_medians_and_gaps():
    # --timeline: each kernel's place in a replay, medians over the replays; a kernel launched early (PDL) shows a
    # negative gap. Seeded random start jitter: the medians are the middle replay's, whatever the order given.
    from symmring.bench import format_timeline, replay_timeline
    assert anchor.parse_args(["--anchor", "megamoe", "--timeline"]).timeline
    rng = np.random.default_rng(0)
    kernels = [("produce", 0.0, 10.0), ("dispatch", 8.0, 20.0), ("experts", 22.0, 150.0), ("combine", 151.0, 160.0)]
    spans, shift = [], 0.0
    for jitter in (0.0, 1.0, 2.0):
        spans += [(k, shift + s + (jitter if k == "experts" else 0.0), shift + e + jitter) for k, s, e in kernels]
        shift += 1000.0 + float(rng.integers(0, 50))
    rng.shuffle(spans)
    line = replay_timeline([tuple(s) for s in spans], 3)
    assert [t["kernel"] for t in line] == ["produce", "dispatch", "experts", "combine"]
    assert line[1] == {"kernel": "dispatch", "start_us": 8.0, "end_us": 21.0, "gap_us": -3.0}
    assert line[2]["start_us"] == 23.0 and line[2]["gap_us"] == 2.0 and line[3]["gap_us"] == 0.0
    assert format_timeline(line).splitlines()[2].split() == ["23.0", "151.0", "+2.0", "experts"]
    with pytest.raises(ValueError, match="do not split into 2 calls"):
        replay_timeline(spans[:5], 2)
    with pytest.raises(ValueError, match="different kernels"):
        replay_timeline([("a", 0, 1), ("b", 2, 3), ("b", 10, 11), ("a", 12, 13)], 2)


def test_chain_probe_arguments_and_phase_order():
    # tools/chain_probe.py: its arguments (bad ones exit 2 naming the option), its stamp medians in time order, and
    # on a machine without a GPU a clear exit 2.
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import chain_probe
    finally:
        sys.path.remove(str(ROOT / "tools"))
    args = chain_probe.parse_args([])
    assert args.shapes == ["deepseek-v3", "v4-flash"] and args.tokens == [1, 8, 64] and not args.stamps
    assert not args.alone and chain_probe.parse_args(["--alone"]).alone
    assert chain_probe.parse_args(["--tokens", "64,1", "--stamps", "--engine", "builtin"]).tokens == [1, 64]
    for bad in (["--shapes", "nope"], ["--tokens", "0"], ["--replays", "0"], ["--engine", "torch"]):
        with pytest.raises(SystemExit) as exc:
            chain_probe.parse_args(bad)
        assert exc.value.code == 2
    samples = {("moe_dispatch", 8): [14.0, 13.0, 15.0], ("moe_producer", 0): [0.0, 0.0], ("moe_combine", 16): [],
               ("moe_producer", 6): [13.5, 12.5]}
    assert chain_probe.phases(samples) == [(0.0, "produce: start"), (13.0, "produce: layout ready"),
                                           (14.0, "dispatch: start")]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, "tools/chain_probe.py", "--tokens", "1", "--alone"], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_reference_weights_fill_the_gate_and_up_halves_in_place():
    """The reference's w13 (gate rows then up rows, dequantised in place) equals the concatenation it replaced."""
    torch = pytest.importorskip("torch")
    from symmring.moe.weights import dequantize_blocks, quantize_blocks
    gen = torch.Generator().manual_seed(35)
    weights = {}
    for name, shape in (("gate", (3, 256, 384)), ("up", (3, 256, 384)), ("down", (3, 384, 256))):
        weights[name], weights[name + "_scale"] = quantize_blocks(torch.randn(*shape, generator=gen))
    w13, w2 = anchor.reference_weights(weights)
    expected = torch.cat([dequantize_blocks(weights["gate"], weights["gate_scale"]),
                          dequantize_blocks(weights["up"], weights["up_scale"])], dim=1)
    assert w13.dtype == torch.bfloat16 and torch.equal(w13, expected)
    assert torch.equal(w2, dequantize_blocks(weights["down"], weights["down_scale"]))


def test_no_module_level_deep_gemm_import():
    """Only functions import deep_gemm or the anchor's megamoe_dg (the anchor lazily, the DeepGEMM engine
    lazily): never a module of the package."""
    for path in (ROOT / "symmring").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("deep_gemm", "megamoe_dg") for n in names), \
                f"{path}: imports {names} at module level"


def test_cli_help_and_cpu_exit():
    run = lambda *a: subprocess.run([sys.executable, "-m", "symmring", "bench", "moe", *a], capture_output=True,
                                    text=True, cwd=ROOT, timeout=120)
    out = run("--anchor", "megamoe", "--help")
    assert out.returncode == 0 and "--max-tokens" in out.stdout and "--warm-only" in out.stdout
    assert "--anchor" in run("--help").stdout
    out = run("--anchor", "megamoe", "--shapes", "nope")
    assert out.returncode == 2 and "unknown" in out.stderr
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        out = run("--anchor", "megamoe", "--tokens", "8")
        assert out.returncode == 2 and "needs" in out.stderr


def test_load_error_names_the_tool(monkeypatch):
    pytest.importorskip("torch")
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="tools/megamoe/build.sh"):  # megamoe_dg not importable
        anchor.load_megamoe()


def test_driver_scripts_parse():
    for script in ("tools/megamoe/run_anchor.sh", "tools/megamoe/build.sh", "tools/megamoe/prepare_src.sh",
                   "tools/megamoe/fetch_wheels.sh", "tools/megamoe/check_patch.sh", "tools/megamoe/own_libstdcxx.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0


@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="needs g++ and nm")
def test_own_libstdcxx_tells_a_static_copy_from_the_shared_library(tmp_path):
    """build.sh refuses a _C with libstdc++ linked in: the check must see the copy, and -l:libstdc++.so.6 must
    keep it out even where -static-libstdc++ asks for it."""
    src = tmp_path / "hex.cpp"
    src.write_text('#include <sstream>\n#include <string>\nstd::string hex(unsigned long v) '
                   '{ std::ostringstream o; o << std::hex << v; return o.str(); }\n')
    check = str(ROOT / "tools/megamoe/own_libstdcxx.sh")
    for name, flags, carries in (("shared", [], False), ("static", ["-static-libstdc++"], True),
                                 ("forced", ["-static-libstdc++", "-l:libstdc++.so.6"], False)):
        so = tmp_path / f"{name}.so"
        subprocess.run(["g++", "-O2", "-fPIC", "-shared", str(src), "-o", str(so)] + flags, check=True)
        out = subprocess.run(["bash", check, str(so)], capture_output=True, text=True)
        assert (out.returncode == 0) == carries, (name, out.stdout)
        assert ("libstdc++'s own symbols" in out.stdout) == carries


def test_patch_src_refuses_another_tree(tmp_path):
    """build.sh must stop, not compile an unpatched tree, when the DeepGEMM source is not the one patched."""
    (tmp_path / "csrc" / "jit").mkdir(parents=True)
    (tmp_path / "csrc" / "jit" / "include_parser.hpp").write_text("#include <regex>\n")
    (tmp_path / "csrc" / "jit" / "compiler.hpp").write_text("#include <regex>\n")
    run = subprocess.run([sys.executable, str(ROOT / "tools/megamoe/patch_src.py"), str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert "not the DeepGEMM tree this patch is for" in run.stderr


def test_megamoe_on_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper (sm_90) GPU: run tools/megamoe/run_anchor.sh there")
    try:
        anchor.load_megamoe()
    except ImportError as exc:
        pytest.skip(f"DeepGEMM's SM90 MegaMoE (megamoe_dg) not built here: {exc}")
    pytest.skip("the MegaMoE run is tools/megamoe/run_anchor.sh (several minutes of JIT compiles), not a unit test")


def test_merge_makes_one_table_of_runs_in_processes_of_their_own(tmp_path, capsys):
    """``--merge`` (no GPU: what run_anchor.sh does after one process per shape and size): the runs' rows in order,
    the summary over all of them (best / MegaMoE per size), every run's ceilings kept, complete only when every run
    was; a missing file is a clear error (exit 2), not a partial table."""
    def run(shape, n, ours, mega, copy_gbps, complete=True):
        rows = [dict(shape=shape, tokens_per_rank=n, impl="symmring fused graph", ms=ours, rel_err=0.04, ok=True,
                     fp8_roofline_ms=ours / 2),
                dict(shape=shape, tokens_per_rank=n, impl="megamoe graph", ms=mega, rel_err=0.045, ok=True)]
        return dict(anchor="megamoe", rows=rows, skipped=[], megamoe={shape: {"buffer_bytes": 1}},
                    ceilings={"copy_gbps": copy_gbps}, argv=["--tokens", str(n)], complete=complete,
                    summary=anchor.summarize(rows))
    paths = []
    for i, payload in enumerate((run("deepseek-v3", 1, 0.18, 0.2, 3000.0), run("deepseek-v3", 8, 0.95, 0.9, 2990.0),
                                 run("v4-flash", 1, 0.11, 0.1, 2980.0, complete=False))):
        paths.append(tmp_path / f"a{i}.json")
        paths[-1].write_text(json.dumps(payload))
    out = tmp_path / "anchor.json"
    assert anchor.main(["--anchor", "megamoe", "--merge", *map(str, paths), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [(r["shape"], r["tokens_per_rank"]) for r in merged["rows"]] == [
        ("deepseek-v3", 1), ("deepseek-v3", 1), ("deepseek-v3", 8), ("deepseek-v3", 8),
        ("v4-flash", 1), ("v4-flash", 1)]
    assert [round(line["best_vs_megamoe"], 3) for line in merged["summary"]] == [0.9, 1.056, 1.1]
    assert [r["ceilings"]["copy_gbps"] for r in merged["runs"]] == [3000.0, 2990.0, 2980.0]
    assert merged["ceilings"] == {"copy_gbps": 3000.0} and merged["complete"] is False
    assert set(merged["megamoe"]) == {"deepseek-v3", "v4-flash"}
    table = capsys.readouterr().out
    assert "0.90" in table and "1.06" in table and "1.10" in table
    assert anchor.main(["--anchor", "megamoe", "--merge", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


FAKE_ANCHOR = '''
import json, os, sys
from symmring.bench import moe_anchor
argv = sys.argv[1:]
if "--merge" in argv:
    sys.exit(moe_anchor.main(argv))
value = lambda flag: argv[argv.index(flag) + 1]
if os.environ.get("FAKE_FAIL") == value("--tokens"):
    sys.exit(3)  # a run that fails before its first row: no results written
rows = [dict(shape=s, tokens_per_rank=int(n), impl="megamoe", ms=1.0, argv=argv)
        for s in value("--shapes").split(",") for n in value("--tokens").split(",")]
json.dump(dict(anchor="megamoe", rows=rows, skipped=[], megamoe={}, argv=argv, complete=True),
          open(value("--json"), "w"))
'''


def run_table(tmp_path, split, fail=""):
    """run_anchor.sh's ``table`` function alone, with a stand-in anchor: ``(completed process, merged results)``."""
    script = (ROOT / "tools/megamoe/run_anchor.sh").read_text()
    body = script[script.index("table() {"):]
    body = body[:body.index("\n}\n") + 3]
    fake = tmp_path / "fake_anchor.py"
    fake.write_text(FAKE_ANCHOR)
    out = tmp_path / "anchor.json"
    run = subprocess.run(["bash", "-c", f'{body}\nANCHOR=({sys.executable} {fake} --anchor megamoe)\n'
                          f'table {split} deepseek-v3,v4-flash 1,8 {out} --engines fused --modes graph'],
                         capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "FAKE_FAIL": fail})
    return run, json.loads(out.read_text())


@pytest.mark.parametrize("split, processes", [("size", 4), ("shape", 2), ("none", 1)])
def test_run_anchor_runs_the_table_in_processes_of_their_own_and_merges_them(tmp_path, split, processes):
    """run_anchor.sh's ``table`` (ANCHOR_SPLIT): one process per shape and size, per shape, or one for all, each
    given the row options; their results merged into one JSON in shape-then-size order."""
    run, merged = run_table(tmp_path, split)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("--- run ") == processes
    assert merged["complete"] and len(merged["runs"]) == processes and not merged["skipped"]
    assert "4 rows from %d runs, 0 not ok, complete" % processes in run.stdout
    rows = merged["rows"]
    assert [(r["shape"], r["tokens_per_rank"]) for r in rows] == [
        ("deepseek-v3", 1), ("deepseek-v3", 8), ("v4-flash", 1), ("v4-flash", 8)]
    assert all(r["argv"][-6:-2] == ["--engines", "fused", "--modes", "graph"] for r in rows)


def test_a_run_of_the_table_that_fails_leaves_the_merged_results_not_complete(tmp_path):
    """A run that exits before writing its results (here every 8-token run) keeps its stub: the merged results say
    not complete and name each such run; the other runs' rows are kept; the table's exit status is the failure's."""
    run, merged = run_table(tmp_path, "size", fail="8")
    assert run.returncode == 3, run.stdout + run.stderr
    assert [(r["shape"], r["tokens_per_rank"]) for r in merged["rows"]] == [("deepseek-v3", 1), ("v4-flash", 1)]
    assert merged["complete"] is False and "NOT complete" in run.stdout
    assert [(s["shape"], "--tokens 8" in s["reason"]) for s in merged["skipped"]] == [("deepseek-v3", True),
                                                                                      ("v4-flash", True)]


def test_a_sizes_inputs_do_not_depend_on_the_other_sizes_drawn():
    """`size_inputs` seeds each size's generator from (seed, size): a process that runs one size (run_anchor.sh's
    ANCHOR_SPLIT=size) draws the inputs a process of every size draws for it."""
    torch = pytest.importorskip("torch")
    a, b = anchor.size_inputs("v4-flash", 8, 0, "cpu"), anchor.size_inputs("v4-flash", 8, 0, "cpu")
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    x, idx, w = a
    assert x.shape == (8, 4096) and idx.shape == w.shape == (8, 6) and idx.dtype == torch.int32
    assert torch.allclose(w.sum(dim=1), torch.ones(8))
    assert not torch.equal(anchor.size_inputs("v4-flash", 8, 1, "cpu")[1], idx)
    assert not torch.equal(anchor.size_inputs("v4-flash", 9, 0, "cpu")[1][:8], idx)
