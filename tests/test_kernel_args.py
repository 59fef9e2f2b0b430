"""device/moe/args.cuh and symmring/moe/gpu/kernel_args.py describe the same structs, and the checks that hold them
together can fail.

* The header compiled with the host compiler: every struct's size and every field's name, order, offset, size
  and kind equal its dtype's (`kernel_args.STRUCTS`), both ways; a struct field's type is the struct its dtype
  is. Deliberately edited copies of the header, and edited dtypes, are caught.
* The load-time check (`kernel_args.check_device_layout`: static assertions of the host layout compiled by nvcc
  against the header, as `symmring.moe.gpu.stages.Kernels` runs it): passes as shipped; a dtype edited on the
  host is a `KernelArgsMismatch` naming the struct and field. Needs nvcc and the nvidia-nvshmem wheel (as
  tests/test_device_compile.py); skipped with the reason elsewhere.
* `KernelArgs`: fields fixed once or set per call, by name, every field covered exactly once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from struct_probe import compile_structs, parse_structs, struct_mismatches
from symmring.errors import KernelArgsMismatch
from test_device_compile import _toolchain_missing
from symmring.moe.gpu import kernel_args
from symmring.moe.gpu.kernel_args import STRUCTS, KernelArgs

HEADER = Path(__file__).resolve().parents[1] / "device" / "moe" / "args.cuh"


def mismatches(compiled, structs=STRUCTS, header_text=None):
    """Every disagreement between the compiled header and ``structs``."""
    problems = [f"struct {s} is in args.cuh but not in STRUCTS" for s in compiled if s not in structs]
    problems += [f"struct {s} is in STRUCTS but not in args.cuh" for s in structs if s not in compiled]
    for struct in compiled:
        if struct in structs:
            problems += struct_mismatches(struct, compiled[struct], structs[struct])
    # A struct field holds the struct its dtype is.
    for struct, fields in parse_structs(header_text or HEADER.read_text()).items():
        for ftype, name in fields:
            if ftype in structs and struct in structs and name in structs[struct].names:
                if structs[struct].fields[name][0] != structs[ftype]:
                    problems.append(f"{struct}.{name} is a {ftype} in args.cuh, another struct in STRUCTS")
    return problems


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_structs(HEADER, "symmring_moe", tmp_path_factory.mktemp("args"))


def test_every_struct_matches_its_dtype(compiled):
    assert mismatches(compiled) == []
    assert len(compiled) == len(STRUCTS) >= 20


def test_every_kernel_names_a_struct():
    assert set(kernel_args.KERNELS.values()) <= set(STRUCTS)
    used = set(kernel_args.KERNELS.values()) | {"RouterOptions", "PassRows", "TensorMap"}  # the last 3: inside others
    assert used == set(STRUCTS)


END_WAIT = "    int clear_counts;\n    int layer;\n};"
REDUCE_TAIL = "    int token_begin;\n    int num_valid;\n    const int* call_tokens;\n    int end_call_chunks;\n};"
PULL_TAIL = "    PassRows pass;\n};\n\n// moe_dispatch_pull_fp8"
HEADER_EDITS = {
    "field added": (END_WAIT, END_WAIT.replace("};", "    int extra;\n};")),
    "fields swapped": (REDUCE_TAIL, REDUCE_TAIL.replace("    int token_begin;\n    int num_valid;",
                                                        "    int num_valid;\n    int token_begin;")),
    "field renamed": ("    int pool_rows;\n    int rows_per_expert;", "    int pool_rows;\n    int rows_per_exp;"),
    "field widened": ("    int chunk_begin;", "    long long chunk_begin;"),
    "kind changed": ("    float routed_scaling_factor;", "    int routed_scaling_factor;"),
    "two fields on a line": ("    int scoring;        // RouterScoring", "    int scoring; int more;"),
    "struct dropped": ("// moe_sleep.\nstruct SleepArgs {\n    unsigned long long duration_ns;\n};\n", ""),
    "nested struct changed": (PULL_TAIL, PULL_TAIL.replace("PassRows pass;", "RouterOptions pass;")),
    "tensor map alignment dropped": ("struct alignas(64) TensorMap {", "struct TensorMap {"),
    "array length changed": ("    unsigned long long opaque[16];", "    unsigned long long opaque[15];"),
}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
def test_the_check_catches_header_edits(edit, tmp_path):
    old, new = HEADER_EDITS[edit]
    text = HEADER.read_text()
    assert old in text, f"edit {edit!r} no longer applies to args.cuh: update HEADER_EDITS"
    edited_dir = tmp_path / "moe"
    edited_dir.mkdir()
    edited = edited_dir / "args.cuh"
    edited.write_text(text.replace(old, new, 1))
    (tmp_path / "symmring").symlink_to(HEADER.parents[1] / "symmring")
    if edit == "two fields on a line":  # the parser refuses what it cannot check
        with pytest.raises(AssertionError, match="cannot parse"):
            compile_structs(edited, "symmring_moe", tmp_path)
        return
    assert mismatches(compile_structs(edited, "symmring_moe", tmp_path), header_text=edited.read_text())


def test_the_check_catches_dtype_edits(compiled):
    scan = STRUCTS["DispatchScanArgs"]
    fields = [(n, scan.fields[n][0]) for n in scan.names]
    edits = {
        "field dropped": fields[:-1],
        "field added": fields + [("extra", np.int32)],
        "fields swapped": [fields[0], fields[2], fields[1]] + fields[3:],
        "signedness": [(n, np.uint32 if n == "align" else t) for n, t in fields],
        "widened": [(n, np.int64 if n == "window_rows" else t) for n, t in fields],
    }
    for what, edited in edits.items():
        assert mismatches(compiled, {**STRUCTS, "DispatchScanArgs": np.dtype(edited, align=True)}), what
    pull = STRUCTS["DispatchPullArgs"]
    wrong_nested = [(n, STRUCTS["ChunkArgs"] if n == "pass" else pull.fields[n][0]) for n in pull.names]
    assert mismatches(compiled, {**STRUCTS, "DispatchPullArgs": np.dtype(wrong_nested, align=True)})
    assert mismatches(compiled, {k: v for k, v in STRUCTS.items() if k != "StampArgs"})


# --- the load-time check, with nvcc --------------------------------------------------------------------

needs_nvcc = pytest.mark.skipif(_toolchain_missing() is not None, reason=f"{_toolchain_missing()}")


@needs_nvcc
def test_load_time_check_passes_and_names_a_host_edit(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMMRING_CACHE_DIR", str(tmp_path))
    check = kernel_args.check_device_layout.__wrapped__  # uncached: each call compiles its own source
    check(90)
    reduce = STRUCTS["CombineReduceArgs"]
    swapped = [(n, reduce.fields[n][0]) for n in reduce.names]
    i, j = reduce.names.index("token_begin"), reduce.names.index("y_row_stride")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    monkeypatch.setitem(STRUCTS, "CombineReduceArgs", np.dtype(swapped, align=True))
    with pytest.raises(KernelArgsMismatch, match=r"CombineReduceArgs\.token_begin at offset \d+ on the host"):
        check(90)


def test_layout_source_asserts_every_field():
    source = kernel_args.layout_source()
    for struct, dtype in STRUCTS.items():
        assert f"sizeof(symmring_moe::{struct}) == {dtype.itemsize}" in source
        for name in dtype.names:
            assert f"offsetof(symmring_moe::{struct}, {name}) == {dtype.fields[name][1]}" in source


# --- KernelArgs ---------------------------------------------------------------------------------------

def test_kernel_args_fixed_once_and_set_per_call_by_name():
    args = KernelArgs(STRUCTS["DispatchScanArgs"], per_call=("chunk_idx", "window_rows", "rows_per_expert"),
                      desc=1, counts=2, begin=3, group_end=4, cursor=5, total=6, num_local_experts=7, align=128,
                      expert_begin=9)
    (param,) = args.set(chunk_idx=4, window_rows=1024, rows_per_expert=96)
    record = param.view(STRUCTS["DispatchScanArgs"])[0]
    assert record.tolist() == (1, 4, 2, 3, 4, 5, 6, 7, 128, 9, 1024, 96)
    args.set(chunk_idx=5, window_rows=10, rows_per_expert=2)
    assert param.view(STRUCTS["DispatchScanArgs"])[0].tolist()[-2:] == (10, 2)  # the same record, rewritten
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'rows_per_expert'"):
        args.set(chunk_idx=5, window_rows=10)  # a field left from the last call would be stale
    with pytest.raises(TypeError, match="unexpected keyword argument 'align'"):
        args.set(chunk_idx=5, window_rows=10, rows_per_expert=2, align=1)  # a fixed field
    with pytest.raises(ValueError):
        args.set(chunk_idx=2**31, window_rows=10, rows_per_expert=2)  # does not fit int32


def test_kernel_args_cover_every_field_once():
    with pytest.raises(TypeError, match="must each be fixed or per call"):
        KernelArgs(STRUCTS["ChunkArgs"], per_call=("chunk_idx",))  # desc missing
    with pytest.raises(TypeError, match="must each be fixed or per call"):
        KernelArgs(STRUCTS["ChunkArgs"], per_call=("chunk_idx",), desc=1, chunk_idx=2)  # twice
    with pytest.raises(TypeError, match="must each be fixed or per call"):
        KernelArgs(STRUCTS["ChunkArgs"], per_call=("chunk",), desc=1)  # no such field
    pull = dict(desc=1, cursor=2, pool_x=3, row_src=4, row_weight=5, expert_begin=6, num_local_experts=7, status=8,
                stage=9)
    with pytest.raises(TypeError, match="must each be fixed or per call"):  # a struct field half covered
        KernelArgs(STRUCTS["DispatchPullArgs"], per_call=("chunk_idx", "pass__entry_rows"), **pull)
    with pytest.raises(TypeError, match="not an identifier"):  # a Python keyword: its fields one by one
        KernelArgs(STRUCTS["DispatchPullArgs"], per_call=("chunk_idx", "pass"), **pull)
    args = KernelArgs(STRUCTS["DispatchPullArgs"], per_call=("chunk_idx", "pass__entry_rows", "pass__pass_begin",
                                                             "pass__pass_rows"), **pull)
    (param,) = args.set(chunk_idx=3, pass__entry_rows=0x40, pass__pass_begin=256, pass__pass_rows=12)
    assert param.view(STRUCTS["DispatchPullArgs"])[0]["pass"].tolist() == (0x40, 256, 12)


def test_a_struct_field_takes_a_record_of_its_own_struct():
    router = np.zeros((), STRUCTS["RouterOptions"])
    router["num_experts"], router["routed_scaling_factor"] = 64, 2.5
    args = KernelArgs(STRUCTS["RouteTopkArgs"], per_call=("router",), logits=1, logits_dtype=0, logits_stride=2,
                      num_tokens=3, topk_idx=4, topk_weights=5)
    (param,) = args.set(router=router)
    assert param.view(STRUCTS["RouteTopkArgs"])[0]["router"].tobytes() == router.tobytes()
    with pytest.raises(TypeError, match="expected a record"):
        args.set(router=np.zeros((), STRUCTS["PassRows"]))
    # A struct field, then one of its own fields, in that order.
    args = KernelArgs(STRUCTS["RouteTopkArgs"], per_call=("router", "router__topk"), logits=1, logits_dtype=0,
                      logits_stride=2, num_tokens=3, topk_idx=4, topk_weights=5)
    (param,) = args.set(router=router, router__topk=6)
    got = param.view(STRUCTS["RouteTopkArgs"])[0]["router"]
    assert (got["topk"], got["num_experts"], router["topk"]) == (6, 64, 0)
