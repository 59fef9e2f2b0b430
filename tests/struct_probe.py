"""What the host C++ compiler makes of the structs of a device header: parse the field names from the header, compile
a probe that prints each struct's size and each field's offset, size and kind, and compare with NumPy dtypes.

Used by tests/test_kernel_args.py (device/moe/args.cuh); tests/test_layout.py uses `host_compiler` for the
descriptor.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

#: A struct as compiled: ``(sizeof, {field: (offset, size, kind)})``, fields in offset order; kind: "i" signed,
#: "u" unsigned or pointer, "f" floating, "s" a struct.
Compiled = Tuple[int, Dict[str, Tuple[int, int, str]]]

_STRUCT_RE = re.compile(r"struct\s+(?:alignas\(\d+\)\s+)?(?P<name>\w+)\s*\{(?P<body>.*?)\};", re.S)
_FIELD_RE = re.compile(r"^\s*(?P<type>(?:const\s+)?[\w ]*?\w[\s*]*?)\s*(?P<name>\w+)\s*(?:\[\d+\])?\s*;\s*$")


def host_compiler() -> List[str]:
    """A C++ compiler and its options for a host-only probe (skips the test when there is none)."""
    for cxx in ("g++", "c++", "clang++"):
        if shutil.which(cxx):
            return [cxx, "-std=c++17", "-x", "c++"]
    if shutil.which("nvcc"):
        return ["nvcc", "-std=c++17", "-x", "cu"]
    pytest.skip("no C++ compiler (g++, c++, clang++ or nvcc) to compile the header")


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def parse_structs(text: str) -> Dict[str, List[Tuple[str, str]]]:
    """``{struct: [(field type, field name), ...]}`` of every struct in ``text``, in order.

    Every non-blank line of a struct body must be one field (an array of a literal length counts as one):
    anything else (two fields on a line, a nested definition) is reported rather than skipped, so no field escapes
    the comparison.
    """
    structs = {}
    for match in _STRUCT_RE.finditer(strip_comments(text)):
        fields = []
        for line in match["body"].splitlines():
            if not line.strip():
                continue
            field = _FIELD_RE.match(line)
            if field is None or line.count(";") != 1:
                raise AssertionError(f"struct {match['name']}: cannot parse the line {line.strip()!r}")
            fields.append((" ".join(field["type"].split()), field["name"]))
        structs[match["name"]] = fields
    return structs


def compile_structs(header: Path, namespace: str, workdir: Path) -> Dict[str, Compiled]:
    """Compile a probe of every struct of ``header`` (declared in ``namespace``); what the compiler laid out."""
    structs = parse_structs(header.read_text())
    lines = ["#include <cstddef>", "#include <cstdio>", "#include <type_traits>", f'#include "{header.resolve()}"',
             "template <typename T> const char* kind() {",
             '  return std::is_class<T>::value ? "s" : std::is_floating_point<T>::value ? "f"',
             '       : std::is_pointer<T>::value || std::is_unsigned<T>::value ? "u" : "i"; }', "int main() {"]
    for struct, fields in structs.items():
        c = f"{namespace}::{struct}"
        lines.append(f'  std::printf("struct {struct} %zu\\n", sizeof({c}));')
        for _, name in fields:
            lines.append(f'  std::printf("field {struct} {name} %zu %zu %s\\n", offsetof({c}, {name}), '
                         f'sizeof({c}::{name}), kind<std::remove_all_extents_t<decltype({c}::{name})>>());')
    lines += ["  return 0;", "}"]
    src, exe = workdir / "probe.cpp", workdir / "probe"
    src.write_text("\n".join(lines) + "\n")
    build = subprocess.run(host_compiler() + [str(src), "-I", str(header.resolve().parents[1]), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    if build.returncode:
        raise AssertionError(f"compiling the probe of {header.name} failed:\n{build.stderr}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=60).stdout
    compiled: Dict[str, Compiled] = {}
    for line in out.splitlines():
        what, struct, *rest = line.split()
        if what == "struct":
            compiled[struct] = (int(rest[0]), {})
        else:
            name, offset, size, kind = rest
            compiled[struct][1][name] = (int(offset), int(size), kind)
    return {struct: (size, dict(sorted(fields.items(), key=lambda kv: kv[1][0])))
            for struct, (size, fields) in compiled.items()}


def host_kind(field: np.dtype) -> str:
    if field.subdtype is not None:  # an array field: its elements' kind
        field = field.subdtype[0]
    return "s" if field.names else {"i": "i", "u": "u", "f": "f"}.get(field.kind, field.kind)


def struct_mismatches(struct: str, compiled: Compiled, dtype: np.dtype) -> List[str]:
    """Every disagreement between a compiled struct and its dtype: fields both ways, order, offset, size, kind."""
    size, cfields = compiled
    problems = []
    py_names, c_names = list(dtype.names), list(cfields)
    problems += [f"{struct}.{n} is in the header but not in the dtype" for n in c_names if n not in dtype.names]
    problems += [f"{struct}.{n} is in the dtype but not in the header" for n in py_names if n not in cfields]
    if [n for n in py_names if n in cfields] != [n for n in c_names if n in dtype.names]:
        problems.append(f"{struct}: field order differs: python {py_names} vs C {c_names}")
    for name in py_names:
        if name in cfields:
            field, offset = dtype.fields[name][:2]
            host = (offset, field.itemsize, host_kind(field))
            if cfields[name] != host:
                problems.append(f"{struct}.{name}: C offset/size/kind {cfields[name]} vs python {host}")
    if size != dtype.itemsize:
        problems.append(f"sizeof({struct})={size} vs the dtype's itemsize {dtype.itemsize}")
    return problems
