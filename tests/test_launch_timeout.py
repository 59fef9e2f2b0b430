"""``python -m symmring.launch --timeout S``: a job past its bound is stopped, with every rank, and the
launcher exits 124; a job within it keeps its own exit status; a bad bound is a launch error (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from symmring import launch
from test_under_mpi import find_mpiexec

ROOT = Path(__file__).resolve().parent.parent


def _launch(*args, env=None, timeout=60):
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to sys.executable or on PATH (pip install -e '.[mpi]' provides one)")
    cmd = [sys.executable, "-m", "symmring.launch", "--mpirun", mpiexec, *args]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.mpi
def test_job_past_its_timeout_is_stopped_with_every_rank(tmp_path):
    # Each rank writes its pid, then sleeps far past the bound.
    script = ("import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close(); "
              "time.sleep(120)")
    start_s = time.monotonic()
    # The bound leaves each rank time to start (its shim imports symmring: seconds on a loaded 2-core machine).
    result = _launch("-n", "2", "--timeout", "8", "--", sys.executable, "-c", script, str(tmp_path))
    elapsed_s = time.monotonic() - start_s
    pids = [int(p.name) for p in tmp_path.iterdir()]
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert result.returncode == launch.TIMEOUT_EXIT_STATUS, result
    assert "ran past --timeout 8 s" in result.stderr
    assert len(pids) == 2 and not alive, (pids, alive)
    assert 8 <= elapsed_s < 8 + launch.KILL_GRACE_S + 10, elapsed_s


@pytest.mark.mpi
def test_job_within_its_timeout_keeps_its_exit_status():
    result = _launch("-n", "2", "--", sys.executable, "-c", "import sys; sys.exit(3)",
                     env={"SYMMRING_JOB_TIMEOUT_S": "60"})
    assert result.returncode == 3, result


@pytest.mark.parametrize("value, env", [("0", {}), ("soon", {}), (None, {"SYMMRING_JOB_TIMEOUT_S": "-1"})])
def test_bad_timeout_is_a_launch_error(value, env):
    os_env = dict(os.environ, **env)
    args = [sys.executable, "-m", "symmring.launch", "-n", "1"] + (["--timeout", value] if value else [])
    result = subprocess.run(args + ["--", sys.executable, "-c", "pass"], env=os_env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "expected a positive number of seconds" in result.stderr, result
