"""Device headers built for the CPU: the checks in ``tests/*_check.cpp`` include a header of ``device/`` (written
host and device alike), build with the host compiler and print their counts, which the tests read."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which("g++") or shutil.which("c++")

#: Skips a test module without a host C++ compiler.
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) to build the host check")


def build_check(name: str, out_dir: Path, flags: Sequence[str] = ()) -> Path:
    """``tests/NAME.cpp`` built with ``-O2 -std=c++17 -I device`` and ``flags`` into ``out_dir``: the executable."""
    exe = Path(out_dir) / name
    subprocess.run([CXX, "-O2", "-std=c++17", *flags, f"-I{ROOT / 'device'}", "-o", str(exe),
                    str(ROOT / "tests" / f"{name}.cpp")], check=True, capture_output=True)
    return exe


def run_check(exe: Path, timeout: int = 120) -> Tuple[int, int, str]:
    """Run a check that ends with ``checks N failures M`` (exit 1 on a failure): ``(N, M, its stdout)`` (for counts of
    its own that a check prints before)."""
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
    found = re.search(r"checks (\d+) failures (\d+)", run.stdout)
    assert found, run.stdout + run.stderr
    checks, failures = (int(g) for g in found.groups())
    assert (run.returncode == 0) == (failures == 0), run.stdout + run.stderr
    return checks, failures, run.stdout


def run_checks(exe: Path, timeout: int = 120) -> Tuple[int, int]:
    """`run_check`'s ``(N, M)``."""
    return run_check(exe, timeout)[:2]
