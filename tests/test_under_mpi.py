"""Run the multi-process tests (tests/mpi) under mpiexec with 2, 3 and 4 ranks, from a plain pytest run.

Each case runs ``mpiexec -n N python -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider -m "not slow"``
in a subprocess with a hard timeout and short ``SYMMRING_TIMEOUT_S`` and ``SYMMRING_HOST_TIMEOUT_S`` (a
protocol bug becomes a quick ProtocolTimeout or PeerTimeout, not a hang), shows the output on failure and requires exit code 0 (pytest's 5, "no tests
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


def run_bounded(cmd, *, env, timeout_s: float, tail: int = 20000):
    """Run ``cmd`` from the repository root in a session of its own, so that past ``timeout_s`` the whole
    process group (mpiexec and every rank it started) is killed and the test fails with the output so far,
    instead of hanging or leaving orphans. Returns ``(exit status, stdout and stderr together)``."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"HUNG: {' '.join(cmd)} did not finish within {timeout_s} s; output so far:\n{output[-tail:]}",
                    pytrace=False)
    return proc.returncode, output


@pytest.mark.mpi
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_mpi_suite(num_ranks):
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to sys.executable or on PATH (pip install -e '.[mpi]' provides one)")
    cmd = [mpiexec, "-n", str(num_ranks), sys.executable, "-m", "mpi4py", "-m", "pytest", "tests/mpi", "-q",
           "-p", "no:cacheprovider", "-m", "not slow"]
    # The ranks print their figure lines (collected below; -s shows them) and append them to the figure log.
    env = dict(os.environ, SYMMRING_TIMEOUT_S=PROTOCOL_TIMEOUT_S, SYMMRING_HOST_TIMEOUT_S=PROTOCOL_TIMEOUT_S,
               PYTHONUNBUFFERED="1", SYMMRING_FIGURES_SHOW="1")
    env.pop("PYTEST_ADDOPTS", None)
    returncode, output = run_bounded(cmd, env=env, timeout_s=RUN_TIMEOUT_S)
    figures = [line for line in output.splitlines() if "[figure]" in line]
    if returncode != 0:
        what = "collected no tests" if returncode == 5 else f"exited with {returncode}"
        pytest.fail(f"{' '.join(cmd)} {what}; output:\n{output[-20000:]}", pytrace=False)
    print("\n".join(figures))
