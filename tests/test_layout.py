"""Tests of symmring/layout.py: RingSpec validation, region placement, and agreement with the device header.

The descriptor agreement test compiles a tiny host program that includes ``device/symmring/descriptor.cuh``
and prints, for every field of ``struct RingDescriptor`` (names parsed from the header) and every
enumerator of its enums, what the compiler made of it. The Python side is compared field by field, both
ways, so a field or a constant edited on one side alone fails. ``test_agreement_check_catches_*`` run the
same comparison on deliberately edited copies to show that it can fail.
"""

from __future__ import annotations

import itertools
import random
import re
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

from struct_probe import host_compiler, strip_comments
from symmring import layout, protocol
from symmring.errors import ConfigError
from symmring.layout import ALIGN, DESCRIPTOR_DTYPE, RingLayout, RingSpec

SEED = 20261130
HEADER = Path(__file__).resolve().parents[1] / "device" / "symmring" / "descriptor.cuh"

GOOD = dict(num_slots=4, tokens_per_slot=128, hidden=7168, num_topk=8, num_experts=256)
PAYLOADS = ("x", "x_sf", "topk_idx", "topk_weights")


# --- RingSpec validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, bad", [
    (name, value)
    for name in ("num_slots", "tokens_per_slot", "hidden", "num_topk", "num_experts", "sf_group_size")
    for value in (0, -3, 2.5, "4", True, None)
])
def test_spec_rejects_non_positive_or_non_int(field, bad):
    with pytest.raises(ConfigError, match=rf"{field}={re.escape(repr(bad))}"):
        RingSpec(**{**GOOD, field: bad})


@pytest.mark.parametrize("changes, field", [
    (dict(x_format="fp16"), "x_format"),
    (dict(x_format="FP8_E4M3"), "x_format"),
    (dict(num_topk=9, num_experts=8), "num_topk"),
    (dict(hidden=7160, x_format="fp8_e4m3"), "hidden"),  # not a multiple of 16 bytes
    (dict(hidden=100, x_format="bf16"), "hidden"),  # 200 bytes: not a multiple of 16
    (dict(hidden=7168 + 16, sf_group_size=128), "hidden"),  # 16-byte rows, but not whole scale groups
])
def test_spec_rejects_inconsistent_fields(changes, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        RingSpec(**{**GOOD, **changes})


def test_spec_accepts_numpy_ints_and_derives_sizes():
    spec = RingSpec(**{k: np.int64(v) for k, v in GOOD.items()})
    assert all(type(getattr(spec, k)) is int for k in GOOD)
    assert (spec.x_elem_bytes, spec.x_format_code, spec.num_sf) == (1, 0, 7168 // 128)
    bf16 = RingSpec(**{**GOOD, "x_format": "bf16"})
    assert (bf16.x_elem_bytes, bf16.x_format_code, bf16.num_sf) == (2, 1, 0)
    # bf16 carries no scales, so hidden need not be a multiple of sf_group_size.
    RingSpec(**{**GOOD, "hidden": 72, "x_format": "bf16"})


def test_layout_rejects_bad_num_ranks_and_rank():
    spec = RingSpec(**GOOD)
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match=rf"num_ranks={re.escape(repr(bad))}"):
            RingLayout(spec, bad)
    ring = RingLayout(spec, 3)
    for bad in (-1, 3):
        with pytest.raises(ConfigError, match=rf"rank={bad}"):
            ring.descriptor(rank=bad)
    with pytest.raises(ConfigError, match="slot=4"):
        ring["x"].slot_offset(4)


# --- region placement ---------------------------------------------------------------------------------

def _random_specs(count: int):
    rng = random.Random(SEED)
    for _ in range(count):
        x_format = rng.choice(["fp8_e4m3", "bf16"])
        group = rng.choice([16, 32, 64, 128])
        hidden = group * rng.randint(1, 64) if x_format == "fp8_e4m3" else 8 * rng.randint(1, 1000)
        num_experts = rng.randint(1, 300)
        spec = RingSpec(num_slots=rng.randint(1, 9), tokens_per_slot=rng.randint(1, 300), hidden=hidden,
                        num_topk=rng.randint(1, min(num_experts, 16)), num_experts=num_experts,
                        x_format=x_format, sf_group_size=group)
        yield spec, rng.choice([1, 2, 3, 8, 63, 64, 65, 130])


def test_regions_aligned_disjoint_and_covered():
    for spec, num_ranks in _random_specs(200):
        ring = RingLayout(spec, num_ranks)
        S, T, H, K = spec.num_slots, spec.tokens_per_slot, spec.hidden, spec.num_topk
        expected_slot_shapes = {
            "route_ready": ((), np.uint64, S), "layout_ready": ((), np.uint64, S),
            "ack_mask": ((protocol.mask_words(num_ranks),), np.uint64, S),
            "gen_base": ((1,), np.uint64, 1), "call": ((1,), np.uint64, 1),
            "error": ((layout.ERROR_WORDS,), np.int64, 1),
            "abort": ((1,), np.uint64, 1),
            "meta": ((layout.META_COLUMNS,), np.int64, S),
            "x": ((T, H), np.uint8 if spec.x_format == "fp8_e4m3" else np.uint16, S),
            "x_sf": ((T, spec.num_sf), np.float32, S),
            "topk_idx": ((T, K), np.int32, S), "topk_weights": ((T, K), np.float32, S),
        }
        assert set(ring.regions) == set(expected_slot_shapes)
        for name, (shape, dtype, slots) in expected_slot_shapes.items():
            region = ring[name]
            assert (region.slot_shape, region.dtype, region.num_slots) == (shape, np.dtype(dtype), slots)
            assert region.slot_stride >= region.slot_nbytes
            assert region.offset % ALIGN == 0, name
            if name in PAYLOADS:
                # Every slot of every payload starts on a 128-byte boundary (vector loads, TMA).
                assert region.slot_stride % ALIGN == 0, name
                assert all(region.slot_offset(s) % ALIGN == 0 for s in range(slots))
            else:
                # Signal words and metadata rows are packed so a slot's words are one array.
                assert region.slot_stride == region.slot_nbytes, name
        # Regions in allocation order, none overlapping the next, all inside nbytes.
        spans = sorted((r.offset, r.offset + r.nbytes, r.name) for r in ring.regions.values())
        for (_, end, name), (start, _, nxt) in zip(spans, spans[1:]):
            assert end <= start, (name, nxt)
        assert spans[-1][1] <= ring.nbytes
        assert ring.nbytes % ALIGN == 0 and ring.nbytes > 0
        # No padding beyond what alignment needs: the allocation ends at the last region rounded up.
        assert ring.nbytes == max(layout.align_up(spans[-1][1]), ALIGN)


def test_per_slot_offsets_address_disjoint_slots():
    for spec, num_ranks in _random_specs(50):
        ring = RingLayout(spec, num_ranks)
        for region in ring.regions.values():
            offsets = [region.slot_offset(s) for s in range(region.num_slots)]
            assert offsets == [region.offset + s * region.slot_stride for s in range(region.num_slots)]
            # Slot s's bytes end before slot s + 1 begins.
            for a, b in zip(offsets, offsets[1:]):
                assert a + region.slot_nbytes <= b


def test_layout_identical_for_identical_arguments():
    # Symmetric memory relies on every rank computing the same offsets independently.
    for spec, num_ranks in _random_specs(20):
        a, b = RingLayout(spec, num_ranks), RingLayout(RingSpec(**dataclass_fields(spec)), num_ranks)
        assert a.nbytes == b.nbytes
        assert {n: (r.offset, r.slot_stride) for n, r in a.regions.items()} == \
               {n: (r.offset, r.slot_stride) for n, r in b.regions.items()}


def dataclass_fields(spec: RingSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def test_descriptor_values_follow_the_layout():
    rng = random.Random(SEED + 1)
    for spec, num_ranks in _random_specs(30):
        ring = RingLayout(spec, num_ranks)
        base = rng.randrange(0, 2**40) * ALIGN
        rank = rng.randrange(num_ranks)
        d = ring.descriptor(base, rank=rank, timeout_ns=12345)
        assert d.dtype == DESCRIPTOR_DTYPE
        for name in ring.regions:
            assert int(d[f"{name}_ptr"]) == base + ring[name].offset
        assert int(d["x_slot_stride"]) == ring["x"].slot_stride
        assert int(d["x_sf_slot_stride"]) == ring["x_sf"].slot_stride
        # One stride serves both top-k arrays: they must agree.
        assert int(d["topk_slot_stride"]) == ring["topk_idx"].slot_stride == ring["topk_weights"].slot_stride
        for name in ("num_slots", "tokens_per_slot", "hidden", "num_topk", "num_experts", "num_sf",
                     "sf_group_size", "x_elem_bytes"):
            assert int(d[name]) == getattr(spec, name)
        assert int(d["x_format"]) == spec.x_format_code
        assert (int(d["rank"]), int(d["num_ranks"]), int(d["mask_words"])) == (rank, num_ranks, ring.mask_words)
        assert int(d["timeout_ns"]) == 12345


# --- agreement with device/symmring/descriptor.cuh ----------------------------------------------------

_STRUCT_RE = re.compile(r"struct\s+RingDescriptor\s*\{(?P<body>.*?)\};", re.S)
_FIELD_RE = re.compile(r"^\s*(?:u?int(?:8|16|32|64)_t|float|double)\s+(?P<name>\w+)\s*;\s*$")
_ENUM_RE = re.compile(r"enum\s+(?P<name>\w+)\s*:\s*\w+\s*\{(?P<body>.*?)\}\s*;", re.S)


def parse_header(text: str) -> Tuple[List[str], Dict[str, List[str]]]:
    """Field names of ``RingDescriptor`` in order, and ``{enum: [enumerator, ...]}``.

    Every non-blank line of the struct body must be one scalar field: anything else (two fields on a
    line, an array, a nested struct) is reported rather than skipped, so no field escapes the check.
    """
    text = strip_comments(text)
    match = _STRUCT_RE.search(text)
    if match is None:
        raise AssertionError("struct RingDescriptor not found in descriptor.cuh")
    fields = []
    for line in match["body"].splitlines():
        if not line.strip():
            continue
        field = _FIELD_RE.match(line)
        if field is None:
            raise AssertionError(f"descriptor.cuh: cannot parse struct line {line.strip()!r}")
        fields.append(field["name"])
    enums = {m["name"]: [e.split("=")[0].strip() for e in m["body"].split(",") if e.strip()]
             for m in _ENUM_RE.finditer(text)}
    return fields, enums


def compile_report(header: Path, workdir: Path) -> Tuple[int, Dict[str, Tuple[int, int, bool]], Dict[str, int]]:
    """Compile a probe of ``header``: ``(sizeof, {field: (offset, size, signed)}, {enumerator: value})``."""
    fields, enums = parse_header(header.read_text())
    lines = ["#include <cstddef>", "#include <cstdio>", "#include <type_traits>",
             f'#include "{header.resolve()}"', "using symmring::RingDescriptor;", "int main() {",
             '  std::printf("sizeof %zu\\n", sizeof(RingDescriptor));']
    for f in fields:
        lines.append(f'  std::printf("field {f} %zu %zu %d\\n", offsetof(RingDescriptor, {f}), '
                     f'sizeof(RingDescriptor::{f}), '
                     f'(int)std::is_signed<decltype(RingDescriptor::{f})>::value);')
    for e in itertools.chain.from_iterable(enums.values()):
        lines.append(f'  std::printf("enum {e} %lld\\n", (long long)symmring::{e});')
    lines += ["  return 0;", "}"]
    src = workdir / "probe.cpp"
    src.write_text("\n".join(lines) + "\n")
    exe = workdir / "probe"
    build = subprocess.run(host_compiler() + [str(src), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    if build.returncode:
        raise AssertionError(f"compiling the descriptor probe failed:\n{build.stderr}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=60).stdout
    size, cfields, cenums = -1, {}, {}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "sizeof":
            size = int(rest[0])
        elif kind == "field":
            cfields[rest[0]] = (int(rest[1]), int(rest[2]), rest[3] == "1")
        elif kind == "enum":
            cenums[rest[0]] = int(rest[1])
    # Field order as the compiler laid them out (offsets), names as the header spells them.
    cfields = dict(sorted(cfields.items(), key=lambda kv: kv[1][0]))
    return size, cfields, cenums


def descriptor_mismatches(size: int, cfields: Dict[str, Tuple[int, int, bool]], dtype: np.dtype) -> List[str]:
    """Every disagreement between the compiled struct and a NumPy descriptor dtype."""
    problems = []
    py_names, c_names = list(dtype.names), list(cfields)
    for name in c_names:
        if name not in dtype.names:
            problems.append(f"field {name} is in descriptor.cuh but not in DESCRIPTOR_DTYPE")
    for name in py_names:
        if name not in cfields:
            problems.append(f"field {name} is in DESCRIPTOR_DTYPE but not in descriptor.cuh")
    if [n for n in py_names if n in cfields] != [n for n in c_names if n in dtype.names]:
        problems.append(f"field order differs: python {py_names} vs C {c_names}")
    for name in py_names:
        if name in cfields:
            offset, nbytes, signed = cfields[name]
            ftype, foffset = dtype.fields[name][:2]
            if (offset, nbytes, signed) != (foffset, ftype.itemsize, ftype.kind == "i"):
                problems.append(f"field {name}: C offset/size/signed {(offset, nbytes, signed)} vs python "
                                f"{(foffset, ftype.itemsize, ftype.kind == 'i')}")
    if size != dtype.itemsize:
        problems.append(f"sizeof(RingDescriptor)={size} vs DESCRIPTOR_DTYPE.itemsize={dtype.itemsize}")
    return problems


def _camel(snake: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in snake.lower().split("_"))


def python_enums(layout_module=layout, protocol_module=protocol) -> Dict[str, Dict[str, int]]:
    """The constants descriptor.cuh mirrors, keyed by the C enum and the (lower-cased) C enumerator name."""
    def consts(prefix: str) -> Dict[str, int]:
        return {n[len(prefix):]: v for n, v in vars(layout_module).items()
                if n.startswith(prefix) and isinstance(v, int)}
    groups = {
        "XFormat": {"kXFormat" + _camel(name): code for name, (code, _) in layout_module.X_FORMATS.items()},
        "MetaColumn": {"kMeta" + _camel(n): v for n, v in consts("META_").items()},
        "ErrorKind": {"kError" + _camel(n): v for n, v in consts("ERROR_KIND_").items()},
        "ErrorWord": {**{"kErr" + _camel(n): v for n, v in consts("ERROR_WORD_").items()},
                      "kErrorWords": layout_module.ERROR_WORDS},
        "AbortWord": {"kAbort" + _camel(n): v for n, v in consts("ABORT_").items()},
    }
    return {enum: {name.lower(): value for name, value in members.items()} for enum, members in groups.items()}


def enum_mismatches(header_enums: Dict[str, List[str]], cenums: Dict[str, int],
                    py_enums: Dict[str, Dict[str, int]], error_words: int) -> List[str]:
    problems = []
    for enum, members in py_enums.items():
        if enum not in header_enums:
            problems.append(f"enum {enum} missing from descriptor.cuh")
            continue
        c_members = {name.lower(): cenums[name] for name in header_enums[enum]}
        for name in sorted(set(c_members) | set(members)):
            if c_members.get(name) != members.get(name):
                problems.append(f"{enum}.{name}: C {c_members.get(name)} vs python {members.get(name)}")
    # The error record's words: kErrorWords matches layout.ERROR_WORDS and the words index it exactly once.
    words = {name: cenums[name] for name in header_enums.get("ErrorWord", [])}
    if words.get("kErrorWords") != error_words:
        problems.append(f"ErrorWord.kErrorWords={words.get('kErrorWords')} vs layout.ERROR_WORDS={error_words}")
    indices = sorted(v for n, v in words.items() if n != "kErrorWords")
    if indices != list(range(error_words)):
        problems.append(f"ErrorWord indices {indices} are not 0..{error_words - 1}, each once")
    return problems


@pytest.fixture(scope="module")
def compiled_header(tmp_path_factory):
    return compile_report(HEADER, tmp_path_factory.mktemp("descriptor"))


def test_descriptor_struct_matches_dtype(compiled_header):
    size, cfields, _ = compiled_header
    assert descriptor_mismatches(size, cfields, DESCRIPTOR_DTYPE) == []


def test_descriptor_enums_match_python_constants(compiled_header):
    _, _, cenums = compiled_header
    _, header_enums = parse_header(HEADER.read_text())
    assert enum_mismatches(header_enums, cenums, python_enums(), layout.ERROR_WORDS) == []


# The comparison itself must be able to fail: each edit below, made to one side only, is caught.

HEADER_EDITS = {
    "field added": ("int32_t mask_words;", "int32_t mask_words;\n    int32_t extra_field;"),
    "fields swapped": ("int32_t num_slots;\n    int32_t tokens_per_slot;",
                       "int32_t tokens_per_slot;\n    int32_t num_slots;"),
    "field renamed": ("uint64_t timeout_ns;", "uint64_t timeout_us;"),
    "field widened": ("int32_t num_ranks;", "int64_t num_ranks;"),
    "two fields on a line": ("int32_t mask_words;", "int32_t mask_words; int32_t more;"),
}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
def test_agreement_check_catches_header_edits(edit, tmp_path):
    old, new = HEADER_EDITS[edit]
    text = HEADER.read_text()
    assert old in text, f"edit {edit!r} no longer applies to descriptor.cuh: update HEADER_EDITS"
    edited = tmp_path / "descriptor.cuh"
    edited.write_text(text.replace(old, new, 1))
    try:
        size, cfields, _ = compile_report(edited, tmp_path)
    except AssertionError:  # the parser refuses what it cannot check
        return
    assert descriptor_mismatches(size, cfields, DESCRIPTOR_DTYPE)


def test_agreement_check_catches_dtype_edits(compiled_header):
    size, cfields, _ = compiled_header
    descr = [(n, DESCRIPTOR_DTYPE.fields[n][0]) for n in DESCRIPTOR_DTYPE.names]
    edits = [
        descr[:-1],  # a field dropped
        descr + [("extra", np.int32)],  # a field added
        [descr[1], descr[0]] + descr[2:],  # two fields swapped
        [(n, np.uint32 if n == "rank" else t) for n, t in descr],  # signedness changed
    ]
    for fields in edits:
        assert descriptor_mismatches(size, cfields, np.dtype(fields, align=True)), fields


def test_agreement_check_catches_constant_edits(compiled_header):
    _, _, cenums = compiled_header
    _, header_enums = parse_header(HEADER.read_text())
    py = python_enums()
    edits = []
    for enum, members in py.items():
        name = sorted(members)[-1]
        edits.append({**py, enum: {**members, name: members[name] + 7}})  # a value changed
        edits.append({**py, enum: {**members, "knewconstant": 99}})  # a constant added in python only
    for edited in edits:
        assert enum_mismatches(header_enums, cenums, edited, layout.ERROR_WORDS)
    assert enum_mismatches(header_enums, cenums, py, layout.ERROR_WORDS + 1)
    dropped = {**header_enums, "ErrorKind": header_enums["ErrorKind"][:-1]}  # a constant removed in C
    assert enum_mismatches(dropped, cenums, py, layout.ERROR_WORDS)
