"""Host-side faults on the GPU layer and the device ring, each in a job of its own:
``python -m symmring.launch -n N --mps -- python tests/faults/driver.py SUBJECT FAULT OUTDIR`` with
``SYMMRING_TIMEOUT_S=3`` (the bound), the faulty rank the last one (tests/faults/driver.py says what each fault
and subject does). Every surviving rank must end with a typed error (`ProtocolTimeout` or a subclass:
`PeerTimeout` from the bounded token-count exchange, `ProtocolAborted` from another PE's device error) naming
the faulty rank (as the peer it waited for, among the missing ranks, or as the origin's peer) within 2x the
bound plus `MARGIN_S`; the job must exit non-zero (symmring's abort at exit) and end within `LATE_S` of the
survivors' reports (it did not wait for the faulty rank); the launcher's ``--timeout`` must never fire.

Cases (about 20-30 s a job: NVSHMEM init, the JIT cache, a warm-up call): 2 PEs, the GPU layer
(`symmring.moe.gpu.MoE`) with every fault (late, exit, hard-exit, stall) and the device ring
(`symmring.kernels.DeviceRing`) late and stalled; 4 PEs, the GPU layer late and stalled; and under torchrun
(``symmring.launch --torchrun``: the PEs a torch.distributed group) 2 PEs, the GPU layer late, hard-exit and
stalled. ``SYMMRING_HOST_TIMEOUT_S`` is the bound too (the token-count exchange's). ``hard-exit``
(``os._exit``: no ``MPI_Finalize``) runs under MPICH with ``-disable-auto-cleanup`` (by default mpiexec kills
every rank at once: tests/test_faults.py shows it) and is skipped under another MPI.

It starts jobs of its own, so it runs in a process that is neither an MPI rank nor a CUDA user (an MPS
server does not start while another process holds the GPU without MPS); on the GPU machine::

    python -m pytest tests/gpu/test_layer_faults.py -s

prints one figure line per rank (the fault, the error text, the seconds from the start of the call to the
error); with ``SYMMRING_FAULT_REPORT=DIR`` each case also writes ``DIR/<case>.json`` (the job's exit status,
wall time and every rank's record). Skipped, with the reason, without a GPU, CuPy, nvshmem4py or CUDA MPS.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "faults" / "driver.py"
#: The bound of every wait and collective inside the jobs, in seconds.
BOUND_S = 3.0
#: Slack beyond 2x the bound for a survivor's report (the device sync and check after the wait gave up).
MARGIN_S = 1.0
#: The faulty rank comes back (late, stall) only this long after the others started (driver.LATE_S).
LATE_S = 20.0
#: symmring.launch --timeout of one job (its exit status is then 124): if it fires, the job hung.
JOB_TIMEOUT_S = 240
#: Exit status of symmring.launch past --timeout.
TIMEOUT_STATUS = 124

CASES = [(2, "gpu-layer", fault, "mpi") for fault in ("late", "exit", "hard-exit", "stall")] + \
        [(2, "ring-gpu", "late", "mpi"), (2, "ring-gpu", "stall", "mpi"), (4, "gpu-layer", "late", "mpi"),
         (4, "gpu-layer", "stall", "mpi")] + \
        [(2, "gpu-layer", fault, "torchrun") for fault in ("late", "hard-exit", "stall")]

pytestmark = pytest.mark.gpu


def _skip_reason():
    """Why these jobs cannot run from this process, or None. Initialises no CUDA here: a process that
    initialises CUDA before the jobs' MPS daemon starts is not an MPS client."""
    try:
        from symmring import context, deps, launch, world
        from symmring.backends.nvshmem import GPU_MODULES
    except Exception as exc:  # pragma: no cover - symmring itself is importable in CI
        return f"symmring.backends.nvshmem is not importable: {exc}"
    if world.launcher_world()[1] > 1:
        return ("started as one of several ranks (mpiexec or torchrun): this file launches jobs of its own; run it "
                "alone (python -m pytest tests/gpu/test_layer_faults.py)")
    missing = [deps.OPTIONAL[m][0] for m in GPU_MODULES if not deps.installed(m)]
    if missing:
        return f"needs {', '.join(missing)} (pip install \"symmring[gpu]\")"
    if not launch.visible_gpus():
        return "needs a CUDA GPU (nvidia-smi -L lists none, or CUDA_VISIBLE_DEVICES is empty)"
    if shutil.which("nvidia-cuda-mps-control") is None:
        return "needs CUDA MPS (nvidia-cuda-mps-control on PATH) to run several PEs on one GPU"
    if context.current() is not None or _has_cuda_context():
        return ("this process already uses the GPU (an NVSHMEM context or a CUDA context): the jobs' MPS server "
                "would share the GPU with it; run this file alone (python -m pytest tests/gpu/test_layer_faults.py)")
    return None


def _has_cuda_context() -> bool:
    """Whether torch or CuPy made a CUDA context in this process (neither is imported for the check)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    try:
        return int(cupy.cuda.driver.ctxGetCurrent()) != 0
    except Exception:  # the driver is not initialised: no context either
        return False


def _mpi_flavor() -> str:
    from symmring import launch
    return launch.mpi_flavor(launch.find_mpirun())


def _run(num_ranks: int, subject: str, fault: str, launcher: str = "mpi"):
    """One job (``launcher``: ``"mpi"`` or ``"torchrun"``); returns (exit status, wall seconds, {rank: record},
    {rank: seconds from the rank's report to the end of the job}, output)."""
    outdir = tempfile.mkdtemp(prefix=f"symmring-gpu-fault-{num_ranks}-{subject}-{fault}-")
    if launcher == "torchrun":  # a worker that exits 0 leaves the others running: no flag needed
        extra = ["--torchrun"]
    else:
        extra = ["--mpirun-arg=-disable-auto-cleanup"] if fault == "hard-exit" else []
    cmd = [sys.executable, "-m", "symmring.launch", "-n", str(num_ranks), "--mps", "--timeout", str(JOB_TIMEOUT_S),
           *extra, "--", "python", str(DRIVER), subject, fault, outdir]
    env = dict(os.environ, SYMMRING_TIMEOUT_S=str(BOUND_S), SYMMRING_HOST_TIMEOUT_S=str(BOUND_S), PYTHONUNBUFFERED="1")
    env.pop("SYMMRING_JOB_TIMEOUT_S", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start_s = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT_S + 60)  # the launcher's own bound comes first
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"HUNG: {' '.join(cmd)} outlived its --timeout {JOB_TIMEOUT_S} s; output:\n{output[-8000:]}",
                    pytrace=False)
    end_wall = time.time()
    wall_s = time.monotonic() - start_s
    records, before_end = {}, {}
    for path in Path(outdir).glob("rank*.json"):
        rank = int(path.stem[4:])
        records[rank] = json.loads(path.read_text())
        before_end[rank] = end_wall - path.stat().st_mtime
    shutil.rmtree(outdir, ignore_errors=True)
    return proc.returncode, wall_s, records, before_end, output


def _report(capsys, case: str, rc: int, wall_s: float, records, before_end, faulty: int) -> None:
    with capsys.disabled():
        print(f"\n[figure] fault {case}: launch exit {rc} after {wall_s:.1f} s (bound {BOUND_S:g} s, faulty rank "
              f"{faulty}; the job includes NVSHMEM init and a warm-up call)")
        for rank, rec in sorted(records.items()):
            print(f"[figure]   rank {rank}: {rec['error']} after {rec['elapsed_s']:.2f} s (job ended "
                  f"{before_end[rank]:.1f} s later): {rec.get('text', '')}")
    directory = os.environ.get("SYMMRING_FAULT_REPORT")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        summary = dict(case=case, bound_s=BOUND_S, faulty=faulty, exit_status=rc, wall_s=round(wall_s, 2),
                       records={str(r): dict(rec, job_ended_after_s=round(before_end[r], 2))
                                for r, rec in sorted(records.items())})
        (Path(directory) / f"{case}.json").write_text(json.dumps(summary, indent=1) + "\n")


def names_rank(rec: dict, rank: int) -> bool:
    """Whether a driver record's error names ``rank``: as the peer it waited for, among the missing ranks,
    as the origin of an abort or as that origin's peer.

    Example:
        >>> names_rank({"peer": 0, "missing_ranks": [1]}, 1), names_rank({"peer": 0, "origin_peer": 0}, 1)
        (True, False)
    """
    return rank in (rec.get("peer"), rec.get("origin"), rec.get("origin_peer")) or \
        rank in (rec.get("missing_ranks") or [])


@pytest.mark.parametrize("num_ranks, subject, fault, launcher", CASES,
                         ids=[f"{n}pe-{s}-{f}" + ("-torchrun" if how == "torchrun" else "") for n, s, f, how in CASES])
def test_survivors_name_the_faulty_rank_within_the_bound(capsys, num_ranks, subject, fault, launcher):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if fault == "hard-exit" and launcher == "mpi" and _mpi_flavor() != "mpich":
        pytest.skip("hard-exit needs MPICH's mpiexec -disable-auto-cleanup (another MPI kills every rank at once)")
    case = f"{num_ranks}pe-{subject}-{fault}" + ("-torchrun" if launcher == "torchrun" else "")
    faulty = num_ranks - 1
    rc, wall_s, records, before_end, output = _run(num_ranks, subject, fault, launcher)
    _report(capsys, case, rc, wall_s, records, before_end, faulty)
    problems = []
    if rc == TIMEOUT_STATUS:
        problems.append(f"the job ran past --timeout {JOB_TIMEOUT_S} s (it hung)")
    elif rc == 0:
        problems.append("the job exited 0: the survivors should end through symmring's abort at exit")
    bound = 2 * BOUND_S + MARGIN_S
    for rank in range(num_ranks - 1):
        rec = records.get(rank)
        if rec is None:
            problems.append(f"rank {rank} reported nothing")
            continue
        if not (rec["error"] and rec.get("typed") and names_rank(rec, faulty) and rec["elapsed_s"] <= bound):
            problems.append(f"rank {rank}: expected a ProtocolTimeout naming rank {faulty} within {bound:g} s, "
                            f"got {rec}")
        if before_end[rank] >= LATE_S:
            problems.append(f"rank {rank}: the job ended {before_end[rank]:.1f} s after its report: it waited for "
                            f"the faulty rank")
    assert not problems, "\n".join(problems) + f"\noutput:\n{output[-6000:]}"
