"""Run the multi-process tests (tests/mpi) under mpiexec with 2, 3 and 4 ranks, from a plain pytest run.

Each case runs ``mpiexec -n N python -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider -m "not slow"``
in a subprocess with a hard timeout and a short ``SYMMRING_TIMEOUT_S`` (a protocol bug becomes a quick
ProtocolTimeout, not a hang), shows the output on failure and requires exit code 0 (pytest's 5, "no tests
collected", is a failure too). ``-m mpi4py`` makes one rank's crash abort all ranks.

mpiexec is looked up next to ``sys.executable`` first (the mpich wheel installs it into the venv), then on
``PATH``; without one the cases skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Hard bound of one mpiexec run, in seconds.
RUN_TIMEOUT_S = 540
#: Bound of every protocol wait inside the runs: generous for 4 ranks on 2 cores, far below RUN_TIMEOUT_S.
PROTOCOL_TIMEOUT_S = "60"


def find_mpiexec():
    """mpiexec next to the running interpreter, else on PATH, else None."""
    beside = Path(sys.executable).with_name("mpiexec")
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


@pytest.mark.mpi
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_mpi_suite(num_ranks):
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to sys.executable or on PATH (pip install -e '.[mpi]' provides one)")
    cmd = [mpiexec, "-n", str(num_ranks), sys.executable, "-m", "mpi4py", "-m", "pytest", "tests/mpi", "-q",
           "-p", "no:cacheprovider", "-m", "not slow"]
    env = dict(os.environ, SYMMRING_TIMEOUT_S=PROTOCOL_TIMEOUT_S, PYTHONUNBUFFERED="1")
    env.pop("PYTEST_ADDOPTS", None)
    # A session of its own, so a timeout kills mpiexec and every rank it started (no orphans).
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {RUN_TIMEOUT_S} s; output so far:\n{output[-20000:]}",
                    pytrace=False)
    figures = [line for line in output.splitlines() if "[figure]" in line]
    if proc.returncode != 0:
        what = "collected no tests" if proc.returncode == 5 else f"exited with {proc.returncode}"
        pytest.fail(f"{' '.join(cmd)} {what}; output:\n{output[-20000:]}", pytrace=False)
    print("\n".join(figures))
