"""The multi-process tests under torchrun, subgroups, and the same results under both launchers.

* ``test_torchrun_suite``: ``torchrun --standalone --nproc-per-node N -m pytest tests/mpi`` with 2 and 3 ranks:
  the ring, layer, workspace and step, collective and bad-input suites over a torch.distributed group (the
  bounded collectives over its c10d store, the CPU backend's memory in ``/dev/shm`` with libatomic), as
  tests/test_under_mpi.py runs them under mpiexec.
* ``test_subgroups_equal_two_rank_jobs``: two expert-parallel groups ({0, 1} and {2, 3}) of one 4-rank job,
  each with its own context, workspace and two layers (tests/subgroups/driver.py), compute bit for bit what
  2-rank jobs of the same seeds compute -- under torchrun (``new_group``) and under mpiexec (``comm.Split``).
* ``test_cpu_layer_bitwise_across_launchers``: the same seeded workload gives the same bits under mpiexec
  (MPI windows) and torchrun (POSIX shared memory).

Every run is bounded (`test_under_mpi.run_bounded`) with short protocol and host bounds. torchrun is
``python -m torch.distributed.run`` of this interpreter; without torch the cases skip.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from test_under_mpi import PROTOCOL_TIMEOUT_S, RUN_TIMEOUT_S, find_mpiexec, run_bounded

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "subgroups" / "driver.py"
#: Bound of one driver run (a few seconds each).
DRIVER_TIMEOUT_S = 180


def torchrun(num_ranks: int):
    """torchrun's command line for ``num_ranks`` workers on this node, or None without torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_ranks}"]


def launcher(kind: str, num_ranks: int, extra=()):
    """The command prefix of ``kind`` (``"torchrun"`` or ``"mpiexec"``, with its ``extra`` arguments) that starts
    ``num_ranks`` ranks of this interpreter; skips the test when it is not installed."""
    if kind == "torchrun":
        cmd = torchrun(num_ranks)
        if cmd is None:
            pytest.skip('no torch, so no torchrun (pip install "symmring[cpu]")')
        return cmd
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to sys.executable or on PATH (pip install -e '.[mpi]' provides one)")
    return [mpiexec, *extra, "-n", str(num_ranks), sys.executable]


def job_env(**extra) -> dict:
    env = dict(os.environ, SYMMRING_TIMEOUT_S=PROTOCOL_TIMEOUT_S, SYMMRING_HOST_TIMEOUT_S=PROTOCOL_TIMEOUT_S,
               PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("PYTEST_ADDOPTS", None)
    return env


@pytest.mark.mpi
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_torchrun_suite(num_ranks):
    cmd = launcher("torchrun", num_ranks) + ["-m", "pytest", "tests/mpi", "-q", "-p", "no:cacheprovider", "-m",
                                             "not slow"]
    returncode, output = run_bounded(cmd, env=job_env(SYMMRING_FIGURES_SHOW="1"), timeout_s=RUN_TIMEOUT_S)
    if returncode != 0:
        what = "collected no tests" if returncode == 5 else f"exited with {returncode}"
        pytest.fail(f"{' '.join(cmd)} {what}; output:\n{output[-20000:]}", pytrace=False)
    print("\n".join(line for line in output.splitlines() if "[figure]" in line))


_runs = {}


def driver_run(tmp_path_factory, kind: str, num_ranks: int, groups: int, seed: int) -> Path:
    """The output directory of one driver job (run once per arguments in this session)."""
    key = (kind, num_ranks, groups, seed)
    if key not in _runs:
        outdir = tmp_path_factory.mktemp(f"subgroups-{kind}-{num_ranks}-{groups}-{seed}")
        cmd = launcher(kind, num_ranks) + [str(DRIVER), str(outdir), "--groups", str(groups), "--seed", str(seed)]
        returncode, output = run_bounded(cmd, env=job_env(), timeout_s=DRIVER_TIMEOUT_S)
        verdicts = re.findall(r"(subgroups: group \d+ rank \d+/\d+ [^\n]*?\): (?:ok|FAIL))", output)  # lines may interleave
        files = list(outdir.glob("g*_r*.npz"))
        assert returncode == 0 and len(files) == num_ranks and len(verdicts) == num_ranks and \
            all(v.endswith(": ok") for v in verdicts), f"{' '.join(cmd)}: exit {returncode}\n{output[-8000:]}"
        print("\n".join(sorted(verdicts)))
        _runs[key] = outdir
    return _runs[key]


def differing(a: Path, b: Path) -> list:
    """The outputs of two ranks' files that differ in any bit (or in shape, or are missing); tests/gpu uses it
    too."""
    left, right = np.load(a), np.load(b)
    if set(left) != set(right) or not left.files:
        return [f"outputs {sorted(left)} vs {sorted(right)}"]
    return [k for k in left if left[k].shape != right[k].shape or
            not np.array_equal(left[k].view(np.uint32), right[k].view(np.uint32))]


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["torchrun", "mpiexec"])
def test_subgroups_equal_two_rank_jobs(tmp_path_factory, kind):
    """Groups {0, 1} and {2, 3} of a 4-rank job, seeds 11 and 12: each group's outputs on each of its ranks are
    the 2-rank job's of its seed, bit for bit (the 2-rank jobs run under torchrun)."""
    four = driver_run(tmp_path_factory, kind, 4, 2, 11)
    problems = []
    for group, seed in ((0, 11), (1, 12)):
        two = driver_run(tmp_path_factory, "torchrun", 2, 1, seed)
        for rank in (0, 1):
            bad = differing(four / f"g{group}_r{rank}.npz", two / f"g0_r{rank}.npz")
            if bad:
                problems.append(f"group {group} rank {rank} (seed {seed}): {bad} differ from the 2-rank job's")
    assert not problems, "\n".join(problems)


@pytest.mark.mpi
def test_cpu_layer_bitwise_across_launchers(tmp_path_factory):
    """The same seeded workload on 2 ranks: mpiexec (MPI windows and messages) == torchrun (POSIX shared memory,
    store keys), every output on every rank."""
    mpi = driver_run(tmp_path_factory, "mpiexec", 2, 1, 11)
    torch = driver_run(tmp_path_factory, "torchrun", 2, 1, 11)
    problems = [f"rank {r}: {bad}" for r in (0, 1) if (bad := differing(mpi / f"g0_r{r}.npz", torch / f"g0_r{r}.npz"))]
    assert not problems, "\n".join(problems)
