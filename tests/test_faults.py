"""Host-side faults under ``mpiexec -n 3`` and ``torchrun --nproc-per-node 3`` with a 2 s bound
(``SYMMRING_TIMEOUT_S`` and ``SYMMRING_HOST_TIMEOUT_S``): a late rank, a rank that exits and a mid-stream stall,
on the CPU layer (`symmring.ExpertParallelMoE`) and on the `symmring.Ring`.

Each case is one job of ``tests/faults/driver.py`` (the faulty rank is rank 2) under an outer timeout far above
the bound. Every surviving rank must end with a typed error (`ProtocolTimeout` or its subclass `PeerTimeout`)
naming rank 2 within 2x the bound -- *both* survivors: the driver waits for nobody after its report, so the
first survivor to end the job must wait (symmring's report wait at exit) until the other reported -- and the job
must end long before the faulty rank would have come back (no hang: the outer timeout never fires), through
symmring's end of the job at exit (``MPI_Abort``, status 1, rather than ``MPI_Finalize``, which would wait for
the faulty rank; under torchrun ``os._exit(1)``, after which torchrun's agent stops the remaining workers and
exits non-zero). These cases are the quick version of the absent-rank run (tests/faults/absent_rank.py: 20
runs per mode). Each case prints one figure line per rank: the fault, the error text and the seconds from the
start of the call to the error.

One case is MPICH's, not symmring's: a rank that vanishes without finalizing MPI (``os._exit``) makes
mpiexec kill every other rank at once (within a second, before any bound expires; its exit status was 9,
and in some runs 0). The survivors then cannot report anything, so that case only checks that the job
ended quickly. With ``mpiexec -disable-auto-cleanup`` the survivors live on and report the rank. torchrun
leaves the other workers running when one exits with status 0 (``os._exit(0)`` included; it stops them all
when one fails), so there the survivors report it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from test_under_mpi import run_bounded
from test_under_torchrun import launcher

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "faults" / "driver.py"
#: The bound of every wait and collective inside the runs, in seconds.
BOUND_S = 2.0
#: Hard bound of one mpiexec run: if it fires, the job hung.
OUTER_TIMEOUT_S = 90
#: The faulty rank comes back (late, stall) only after this many seconds (driver.LATE_S): a job that
#: ends sooner did not wait for it.
LATE_S = 20.0
NUM_RANKS, FAULTY = 3, 2

CASES = [
    ("mpiexec", "layer", "late", ()), ("mpiexec", "layer", "exit", ()), ("mpiexec", "layer", "stall", ()),
    ("mpiexec", "layer", "hard-exit", ("-disable-auto-cleanup",)),
    ("mpiexec", "ring", "late", ()), ("mpiexec", "ring", "exit", ()), ("mpiexec", "ring", "stall", ()),
    ("torchrun", "layer", "late", ()), ("torchrun", "layer", "exit", ()), ("torchrun", "layer", "stall", ()),
    ("torchrun", "layer", "hard-exit", ()),
    ("torchrun", "ring", "late", ()), ("torchrun", "ring", "exit", ()), ("torchrun", "ring", "stall", ()),
]


def _run(subject: str, fault: str, extra=(), kind: str = "mpiexec"):
    outdir = tempfile.mkdtemp(prefix=f"symmring-fault-{kind}-{subject}-{fault}-")
    cmd = launcher(kind, NUM_RANKS, extra) + [str(DRIVER), subject, fault, outdir]
    env = dict(os.environ, SYMMRING_TIMEOUT_S=str(BOUND_S), SYMMRING_HOST_TIMEOUT_S=str(BOUND_S),
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start_s = time.monotonic()
    returncode, output = run_bounded(cmd, env=env, timeout_s=OUTER_TIMEOUT_S, tail=8000)
    wall_s, end_wall = time.monotonic() - start_s, time.time()
    records = {}
    for path in Path(outdir).glob("rank*.json"):
        # How long after this rank's report the job ended (the driver writes the record whole, then exits).
        records[int(path.stem[4:])] = dict(json.loads(path.read_text()), ended_after_s=end_wall - path.stat().st_mtime)
    return returncode, wall_s, records, output


def _figures(config, subject, fault, extra, rc, wall_s, records, kind="mpiexec"):
    import figures
    mode = f" {' '.join(extra)}" if extra else ""
    figures.emit(config, f"[figure] fault {subject}/{fault}{mode}: {kind} exit {rc} after {wall_s:.2f} s "
                         f"(bound {BOUND_S:g} s, faulty rank {FAULTY})")
    for rank, rec in sorted(records.items()):
        figures.emit(config, f"[figure]   rank {rank}: {rec['error']} after {rec['elapsed_s']:.2f} s (job ended "
                             f"{rec['ended_after_s']:.1f} s later): {rec.get('text', '')}")


@pytest.mark.mpi
@pytest.mark.parametrize("kind, subject, fault, extra", CASES, ids=[f"{k}-{s}-{f}" for k, s, f, _ in CASES])
def test_survivors_raise_a_typed_error_naming_the_rank(pytestconfig, kind, subject, fault, extra):
    rc, wall_s, records, output = _run(subject, fault, extra, kind)
    _figures(pytestconfig, subject, fault, extra, rc, wall_s, records, kind)
    survivors = [r for r in range(NUM_RANKS) if r != FAULTY]
    problems = []
    for rank in survivors:
        rec = records.get(rank)
        if rec is None:
            problems.append(f"rank {rank} reported nothing")
            continue
        names_it = rec.get("peer") == FAULTY or FAULTY in rec.get("missing_ranks", [])
        if not (rec["error"] and rec.get("typed") and names_it and rec["elapsed_s"] <= 2 * BOUND_S):
            problems.append(f"rank {rank}: expected a ProtocolTimeout naming rank {FAULTY} within "
                            f"{2 * BOUND_S:g} s, got {rec}")
    # Exit status 1 is MPI_Abort's (symmring's end of the job at exit); the driver's own status, through
    # MPI_Finalize, would be 3. (mpiexec does not always forward the aborting ranks' last output.) torchrun
    # exits 1 when a worker failed. The job must end soon after the survivors' reports, long before the faulty
    # rank would come back (LATE_S after its call began): measured from the reports, not from the job's start,
    # whose duration (torch's import in every worker, on a loaded machine) says nothing about waiting.
    waited_s = max((rec["ended_after_s"] for rank, rec in records.items() if rank in survivors), default=0.0)
    if rc != 1 or waited_s >= LATE_S / 2:
        problems.append(f"the job should end through symmring's end of the job at exit (status 1) well before the "
                        f"faulty rank returns ({LATE_S:g} s): exit {rc}, {waited_s:.1f} s after the last report")
    assert not problems, "\n".join(problems) + f"\noutput:\n{output[-6000:]}"


@pytest.mark.mpi
def test_vanished_rank_under_mpiexec_cleanup(pytestconfig):
    """os._exit without MPI_Finalize, mpiexec's default: it kills the job before the bound expires."""
    rc, wall_s, records, output = _run("layer", "hard-exit")
    _figures(pytestconfig, "layer", "hard-exit", ("(mpiexec default: auto-cleanup)",), rc, wall_s, records)
    survivors_reported = all(r in records for r in range(NUM_RANKS) if r != FAULTY)
    # Either mpiexec killed the survivors before their bound, or (if it ever lets them run) they reported.
    assert wall_s < BOUND_S + 5 or survivors_reported, (rc, wall_s, records, output[-4000:])
    assert not records or survivors_reported, records
