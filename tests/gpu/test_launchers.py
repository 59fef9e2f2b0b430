"""GPU PEs started by mpirun and by torchrun compute the same bits, and EP groups of one job compute what jobs of
their own do: tests/subgroups/driver.py with ``--backend nvshmem`` (the GPU layer, bf16 experts, ``engine="torch"``:
two layers on the context's workspace, a batch call, a streamed call and a `Workspace.step` of both) in jobs of
``python -m symmring.launch -n N --mps [--torchrun]``:

* the same seeded calls on 2 and on 3 PEs under mpirun (NVSHMEM bootstrapped from a unique id sent over MPI) and
  under torchrun (sent over the group's store): every output of every PE equal bit for bit;
* 4 PEs under torchrun as two groups ({0, 1}, {2, 3}: one NVSHMEM job per group, each from its own unique id)
  equal, group by group, the 2-PE jobs of the same seeds.

Each PE also checks its rows against the NumPy reference (relative error <= 1e-2). It starts jobs of its own, so
it runs alone on the GPU machine, like tests/gpu/test_layer_faults.py (same skip reasons)::

    python -m pytest tests/gpu/test_launchers.py -q -s
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_layer_faults import _skip_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU twin of these comparisons
from test_under_torchrun import differing  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "subgroups" / "driver.py"
#: symmring.launch --timeout of one job (NVSHMEM init, the JIT cache, six layer calls).
JOB_TIMEOUT_S = 300

pytestmark = pytest.mark.gpu

_runs = {}


def job(launcher: str, num_ranks: int, groups: int, seed: int) -> Path:
    """The output directory of one driver job (run once per arguments)."""
    key = (launcher, num_ranks, groups, seed)
    if key in _runs:
        return _runs[key]
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    outdir = Path(tempfile.mkdtemp(prefix=f"symmring-gpu-launchers-{launcher}-{num_ranks}-{groups}-{seed}-"))
    cmd = [sys.executable, "-m", "symmring.launch", "-n", str(num_ranks), "--mps", "--timeout", str(JOB_TIMEOUT_S),
           *(["--torchrun"] if launcher == "torchrun" else []), "--", "python", str(DRIVER), str(outdir),
           "--backend", "nvshmem", "--groups", str(groups), "--seed", str(seed)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SYMMRING_JOB_TIMEOUT_S", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"HUNG: {' '.join(cmd)}; output:\n{output[-8000:]}", pytrace=False)
    verdicts = sorted(re.findall(r"(subgroups: group \d+ rank \d+/\d+ [^\n]*?\): (?:ok|FAIL))", output))
    print("\n" + "\n".join(verdicts))  # (the PEs' lines may interleave in the output)
    assert proc.returncode == 0 and len(list(outdir.glob("g*_r*.npz"))) == num_ranks and \
        len(verdicts) == num_ranks and all(v.endswith(": ok") for v in verdicts), \
        f"{' '.join(cmd)}: exit {proc.returncode}\n{output[-8000:]}"
    _runs[key] = outdir
    return outdir


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_mpirun_and_torchrun_give_the_same_bits(num_ranks):
    mpi, torch = job("mpi", num_ranks, 1, 11), job("torchrun", num_ranks, 1, 11)
    problems = [f"PE {r}: {bad}" for r in range(num_ranks)
                if (bad := differing(mpi / f"g0_r{r}.npz", torch / f"g0_r{r}.npz"))]
    assert not problems, "\n".join(problems)


def test_two_groups_of_four_pes_equal_two_pe_jobs():
    four = job("torchrun", 4, 2, 11)
    problems = []
    for group, seed in ((0, 11), (1, 12)):
        two = job("torchrun", 2, 1, seed)
        for rank in (0, 1):
            bad = differing(four / f"g{group}_r{rank}.npz", two / f"g0_r{rank}.npz")
            if bad:
                problems.append(f"group {group} PE {rank} (seed {seed}): {bad} differ from the 2-PE job's")
    assert not problems, "\n".join(problems)
