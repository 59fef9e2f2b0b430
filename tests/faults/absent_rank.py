"""The absent-rank run: one of 3 ranks exits, sleeps, or stops mid-stream; do both survivors report, every time?

Repeats tests/faults/driver.py (subject ``layer``: the CPU layer, a streamed call) ``--runs`` times per mode
under one launcher and counts the runs in which *both* survivors wrote a typed error (`ProtocolTimeout` or
`PeerTimeout`) naming the faulty rank (rank 2) within 2x the bound -- the first survivor to give up must not end
the job before the other reported (`symmring.collective`: the report wait at exit)::

    python tests/faults/absent_rank.py --launcher mpiexec --runs 20
    python tests/faults/absent_rank.py --launcher torchrun --runs 20

Modes: ``exit`` (rank 2 calls ``sys.exit(0)`` instead of the call), ``sleep`` (it starts the call 20 s late:
the driver's ``late``), ``midstream`` (its producer stops at chunk 2 for 20 s: the driver's ``stall``). The
bound is ``--bound`` seconds (``SYMMRING_TIMEOUT_S`` and ``SYMMRING_HOST_TIMEOUT_S``). Prints one line per mode
(``exit: 20 of 20 runs ...``) and exits 0 when every run of every mode passed. tests/test_faults.py runs a quick
version (one run per mode and launcher) in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "faults" / "driver.py"
#: The issue's mode names and the driver's faults.
MODES = {"exit": "exit", "sleep": "late", "midstream": "stall"}
NUM_RANKS, FAULTY = 3, 2
#: Hard bound of one job: if it fires, the job hung.
OUTER_TIMEOUT_S = 90


def launcher_command(launcher: str) -> List[str]:
    """The command prefix that starts ``NUM_RANKS`` ranks of this interpreter."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NUM_RANKS}"]
    beside = Path(sys.executable).with_name("mpiexec")
    mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("no mpiexec next to this Python or on PATH")
    return [mpiexec, "-n", str(NUM_RANKS), sys.executable]


def run_once(launcher: str, fault: str, bound_s: float,
             subject: str = "layer") -> Tuple[Optional[int], float, Dict[int, dict], str]:
    """One job: (exit status, wall seconds, {rank: its record}, output)."""
    outdir = tempfile.mkdtemp(prefix=f"symmring-absent-{launcher}-{fault}-")
    cmd = launcher_command(launcher) + [str(DRIVER), subject, fault, outdir]
    env = dict(os.environ, SYMMRING_TIMEOUT_S=str(bound_s), SYMMRING_HOST_TIMEOUT_S=str(bound_s),
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("PYTEST_ADDOPTS", None)
    start_s = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=OUTER_TIMEOUT_S)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = None
    wall_s = time.monotonic() - start_s
    records = {}
    for path in Path(outdir).glob("rank*.json"):
        try:
            records[int(path.stem[4:])] = json.loads(path.read_text())
        except ValueError:  # cut off while writing (the job ended under it): not reported
            pass
    shutil.rmtree(outdir, ignore_errors=True)
    return status, wall_s, records, output


def verdict(records: Dict[int, dict], bound_s: float) -> Optional[str]:
    """None when both survivors reported a typed error naming the faulty rank within 2x the bound, else why not."""
    for rank in range(NUM_RANKS):
        if rank == FAULTY:
            continue
        rec = records.get(rank)
        if rec is None:
            return f"rank {rank} reported nothing"
        names_it = rec.get("peer") == FAULTY or FAULTY in rec.get("missing_ranks", [])
        if not (rec.get("error") and rec.get("typed") and names_it and rec["elapsed_s"] <= 2 * bound_s):
            return f"rank {rank}: {rec.get('error')} after {rec.get('elapsed_s')} s: {rec.get('text', '')}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tests/faults/absent_rank.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", choices=("mpiexec", "torchrun"), default="mpiexec")
    parser.add_argument("--runs", type=int, default=20, help="runs per mode (default 20)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--bound", type=float, default=2.0, help="the bound in seconds (default 2)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.runs < 1:
        parser.error(f"modes {unknown}: expected {list(MODES)}; --runs >= 1")
    all_passed = True
    for mode in modes:
        passed, walls, why = 0, [], []
        for _ in range(args.runs):
            status, wall_s, records, output = run_once(args.launcher, MODES[mode], args.bound)
            walls.append(wall_s)
            problem = "hung (outer timeout)" if status is None else verdict(records, args.bound)
            if problem is None:
                passed += 1
            else:
                why.append(problem)
        all_passed = all_passed and passed == args.runs
        print(f"{mode}: {passed} of {args.runs} runs both survivors reported a typed error naming rank {FAULTY} "
              f"within {2 * args.bound:g} s ({args.launcher}, bound {args.bound:g} s; jobs {min(walls):.1f}-"
              f"{max(walls):.1f} s)" + (f"; failures: {sorted(set(why))}" if why else ""), flush=True)
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
