"""Start a symmring job on one node: ``python -m symmring.launch -n N [--mps] -- cmd ...``.

What it does around ``mpirun -n N cmd ...``:

* exports the GPU environment policy of `symmring.env.GPU_ENV` (``NVSHMEM_DISABLE_NVLS=1``,
  ``NVSHMEM_REMOTE_TRANSPORT=none``, ``CUDA_MODULE_LOADING=EAGER``, ``NCCL_NVLS_ENABLE=0``,
  ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``) unless already set; ``--print-env`` prints it as ``export``
  lines and exits (``tools/gpu_common.sh`` and ``launch/symmring-mpirun`` read it from there);
* runs a command ``python`` or ``python3`` with this launcher's own interpreter (``sys.executable``),
  as torchrun does: an MPI launcher may put another ``python3`` first on the ranks' ``PATH``;
* maps local ranks to GPUs: every rank runs through a small shim (``--rank-shim``) that sets
  ``CUDA_VISIBLE_DEVICES`` to GPU ``local_rank % num_gpus`` of the GPUs visible to the launcher, so
  ranks beyond the GPU count share GPUs (several PEs per GPU);
* with ``--mps`` (needed for concurrent kernels of several PEs on one GPU) starts the CUDA MPS control
  daemon with private ``CUDA_MPS_PIPE_DIRECTORY``/``CUDA_MPS_LOG_DIRECTORY`` exported to every rank,
  and stops it (``echo quit | nvidia-cuda-mps-control``) when the job ends, also on failure;
* works with Open MPI's ``mpirun`` (adds ``--oversubscribe``, ``--allow-run-as-root`` when run as root,
  and ``-x VAR`` for every exported variable: `symmring.env.GPU_ENV` and ``SYMMRING_*``, ``NVSHMEM_*``,
  ``CUDA_*``, ``NCCL_*``, ``TORCH_SYMM_MEM_*``, ``PYTHON*``, ``PATH``, ``LD_LIBRARY_PATH``) and with MPICH/Hydra's ``mpiexec`` (e.g. the ``mpich``
  wheel's, which forwards the environment itself).

The MPI launcher is ``--mpirun PATH``, else ``$SYMMRING_MPIRUN``, else the ``mpiexec`` next to this
Python (a venv with the ``mpich`` wheel), else ``mpirun``/``mpiexec`` on ``PATH``. The exit status is
the job's; 2 when the launch itself fails (no MPI launcher, MPS cannot start).

``--timeout S`` (or ``SYMMRING_JOB_TIMEOUT_S``) bounds the whole job: past ``S`` seconds the launcher
sends SIGTERM to the MPI launcher and every rank (they run in a process group of their own), SIGKILL
5 s later if any is left, and exits with 124 (as coreutils ``timeout``). It is the last line of defence
behind symmring's own bounds (``SYMMRING_TIMEOUT_S``), for whatever else a job may wait on.

Example::

    python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu -q
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import env

#: Command names that are run with this launcher's interpreter (`rank_command`).
PYTHON_NAMES = ("python", "python3")
#: Prefixes of the variables an Open MPI launch forwards (``-x``), besides `symmring.env.GPU_ENV`.
EXPORTED_PREFIXES = ("SYMMRING_", "NVSHMEM_", "CUDA_", "NCCL_", "TORCH_SYMM_MEM_", "PYTHON")
#: Variables naming a process's rank within its node, by MPI launcher.
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MPIR_CVAR_LOCAL_RANK",
                   "SLURM_LOCALID")


#: Exit status of a job stopped by ``--timeout`` (as coreutils ``timeout``).
TIMEOUT_EXIT_STATUS = 124
#: Seconds between SIGTERM and SIGKILL of a job past its timeout.
KILL_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """The job could not be started (no MPI launcher, MPS did not start, ...)."""


def job_timeout_s(value: Optional[str]) -> Optional[float]:
    """``--timeout``'s value (else ``SYMMRING_JOB_TIMEOUT_S``) in seconds, or None for no bound.

    Raises:
        LaunchError: not a positive number.
    """
    raw = value if value is not None else os.environ.get("SYMMRING_JOB_TIMEOUT_S", "")
    if raw is None or str(raw).strip() == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        source = "--timeout" if value is not None else "SYMMRING_JOB_TIMEOUT_S"
        raise LaunchError(f"{source}={raw!r}: expected a positive number of seconds")
    return seconds


def run_job(cmd: Sequence[str], timeout_s: Optional[float]) -> int:
    """Run the launcher command line and return its exit status; past ``timeout_s`` stop its whole process
    group (SIGTERM, then SIGKILL after `KILL_GRACE_S`) and return `TIMEOUT_EXIT_STATUS`."""
    if timeout_s is None:
        return subprocess.run(list(cmd), check=False).returncode
    # A session of its own: the signals reach the MPI launcher and every rank it started, nothing else.
    proc = subprocess.Popen(list(cmd), start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"symmring.launch: the job ran past --timeout {timeout_s:g} s; stopping it (SIGTERM, SIGKILL "
              f"after {KILL_GRACE_S:g} s)", file=sys.stderr, flush=True)
        _stop_group(proc)
        return TIMEOUT_EXIT_STATUS
    except BaseException:  # Ctrl-C: the job is not in the terminal's process group any more
        _stop_group(proc)
        raise


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the job's process group (mpirun forwards it to its ranks), SIGKILL what is left after
    `KILL_GRACE_S`."""
    _killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline and _group_alive(proc.pid):
        proc.poll()  # reap the MPI launcher, so that only live processes keep the group alive
        time.sleep(0.05)
    _killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def visible_gpus() -> List[str]:
    """GPU ids the launcher sees: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L``'s indices."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        return [g.strip() for g in raw.split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
    return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def find_mpirun(explicit: Optional[str] = None) -> str:
    """The MPI launcher to use (see the module docstring). Raises LaunchError when there is none."""
    for candidate in (explicit, os.environ.get("SYMMRING_MPIRUN"),
                      str(Path(sys.executable).parent / "mpiexec"), shutil.which("mpirun"), shutil.which("mpiexec")):
        if candidate and (shutil.which(candidate) or Path(candidate).is_file()):
            return candidate
    raise LaunchError("no MPI launcher found: pass --mpirun PATH, set SYMMRING_MPIRUN, or install the "
                      "`mpich` wheel (pip install mpich) or Open MPI")


def rank_command(cmd: Sequence[str]) -> List[str]:
    """``cmd`` as every rank runs it: a leading ``python``/``python3`` becomes ``sys.executable``.

    Example:
        >>> rank_command(["python3", "-m", "pytest"])[0] == sys.executable
        True
        >>> rank_command(["/usr/bin/python3", "x.py"])[0]     # an explicit path is kept
        '/usr/bin/python3'
    """
    cmd = list(cmd)
    if cmd and cmd[0] in PYTHON_NAMES:
        cmd[0] = sys.executable
    return cmd


def mpi_flavor(mpirun: str) -> str:
    """``"openmpi"`` or ``"mpich"`` (Hydra), from ``mpirun --version``."""
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, check=False)
    text = (out.stdout + out.stderr).lower()
    return "openmpi" if "open mpi" in text or "open-mpi" in text or "openrte" in text else "mpich"


def mpirun_command(mpirun: str, flavor: str, num_ranks: int, exported: Sequence[str], cmd: Sequence[str],
                   extra: Sequence[str] = ()) -> List[str]:
    """The full launcher command line for ``num_ranks`` ranks of ``cmd`` (each through the rank shim)."""
    shim = [sys.executable, "-m", "symmring.launch", "--rank-shim", "--"]
    if flavor == "openmpi":
        args = [mpirun, "-np", str(num_ranks), "--oversubscribe", "--bind-to", "none"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--allow-run-as-root")
        for name in exported:
            args += ["-x", name]
    else:
        args = [mpirun, "-n", str(num_ranks)]
    return args + list(extra) + shim + list(cmd)


class Mps:
    """The CUDA MPS control daemon, started in private directories (context manager)."""

    def __init__(self, control: Optional[str] = None):
        self.control = control or shutil.which("nvidia-cuda-mps-control")
        self.root: Optional[str] = None
        self.env: Dict[str, str] = {}

    def __enter__(self) -> "Mps":
        if not self.control:
            raise LaunchError("--mps: nvidia-cuda-mps-control not found on PATH (CUDA MPS is needed to run "
                              "several PEs on one GPU concurrently)")
        self.root = tempfile.mkdtemp(prefix="symmring-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.root, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.root, "log")}
        for path in self.env.values():
            os.makedirs(path, exist_ok=True)
        env = {**os.environ, **self.env}
        started = subprocess.run([self.control, "-d"], env=env, capture_output=True, text=True, check=False)
        probe = subprocess.run([self.control], input="get_server_list\n", env=env, capture_output=True,
                               text=True, check=False, timeout=30)
        if started.returncode != 0 or probe.returncode != 0:
            log = self._log()
            self._cleanup()
            raise LaunchError(f"--mps: CUDA MPS did not start (nvidia-cuda-mps-control -d exit "
                              f"{started.returncode}: {started.stderr.strip()}; probe exit {probe.returncode}: "
                              f"{probe.stderr.strip()}){log}")
        return self

    def _log(self) -> str:
        path = Path(self.env.get("CUDA_MPS_LOG_DIRECTORY", "")) / "control.log"
        return f"\ncontrol.log:\n{path.read_text()[-2000:]}" if path.is_file() else ""

    def _cleanup(self) -> None:
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __exit__(self, *exc) -> None:
        env = {**os.environ, **self.env}
        subprocess.run([self.control], input="quit\n", env=env, capture_output=True, text=True, check=False,
                       timeout=60)
        self._cleanup()


def rank_shim(cmd: Sequence[str]) -> int:
    """Run on every rank: pin it to GPU ``local_rank % num_gpus`` of ``SYMMRING_LAUNCH_GPUS``, then exec."""
    gpus = [g for g in os.environ.get("SYMMRING_LAUNCH_GPUS", "").split(",") if g]
    local_rank = next((int(os.environ[v]) for v in LOCAL_RANK_VARS if os.environ.get(v, "").isdigit()), None)
    if gpus and local_rank is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[local_rank % len(gpus)]
    if not cmd:
        print("symmring.launch --rank-shim: no command", file=sys.stderr)
        return 2
    os.execvp(cmd[0], list(cmd))
    return 0  # not reached


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-shim"]:
        rest = argv[1:]
        return rank_shim(rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(
        prog="python -m symmring.launch", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m symmring.launch -n N [--mps] [--mpirun PATH] [--mpirun-arg ARG] -- cmd ...\n"
              "       python -m symmring.launch --print-env",
        description="Start a symmring job on one node: N MPI ranks, each pinned to GPU local_rank % num_gpus\n"
                    "of the GPUs visible here, with the GPU environment set. The MPI launcher is --mpirun,\n"
                    "else $SYMMRING_MPIRUN, else the mpiexec next to this Python, else mpirun/mpiexec on\n"
                    "PATH. Exit status: the job's; 2 when the launch itself fails.",
        epilog="A command `python` or `python3` runs with this launcher's own interpreter on every rank\n"
               f"({sys.executable}), as torchrun does; name another interpreter by its path.\n\n"
               "Every rank gets these unless already set (symmring.env.GPU_ENV):\n" +
               "\n".join(f"  {d.name}={d.value}: {d.reason}" for d in env.GPU_ENV))
    parser.add_argument("-n", "--num-ranks", type=int, help="ranks (PEs) on this node")
    parser.add_argument("--print-env", action="store_true",
                        help="print the GPU environment as bash `export` lines (user-set values kept) and exit")
    parser.add_argument("--mps", action="store_true", help="run CUDA MPS around the job (several PEs per GPU)")
    parser.add_argument("--mpirun", help="MPI launcher (default: $SYMMRING_MPIRUN, the venv's mpiexec, mpirun)")
    parser.add_argument("--mpirun-arg", action="append", default=[], help="extra argument for the MPI launcher")
    parser.add_argument("--timeout", metavar="S", help="stop the whole job after S seconds and exit 124 "
                        "(default: $SYMMRING_JOB_TIMEOUT_S, else no bound)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and its arguments")
    args = parser.parse_args(argv)
    if args.print_env:
        print("\n".join(env.shell_exports()))
        return 0
    cmd = rank_command(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)
    if not cmd:
        parser.error("missing the command: python -m symmring.launch -n N [--mps] -- cmd ...")
    if args.num_ranks is None:
        parser.error("the following arguments are required: -n/--num-ranks")
    if args.num_ranks <= 0:
        parser.error(f"-n {args.num_ranks}: expected a positive number of ranks")
    try:
        timeout_s = job_timeout_s(args.timeout)
        mpirun = find_mpirun(args.mpirun)
        flavor = mpi_flavor(mpirun)
        gpus = visible_gpus()
        env.apply_gpu_env()
        os.environ["SYMMRING_LAUNCH_GPUS"] = ",".join(gpus)
        if gpus and args.num_ranks > len(gpus) and not args.mps:
            print(f"symmring.launch: {args.num_ranks} ranks on {len(gpus)} GPU(s) without --mps: their kernels "
                  "will time-slice, and waits between PEs of one GPU may time out", file=sys.stderr)
        exported = sorted(set(env.gpu_env_defaults()) | {"SYMMRING_LAUNCH_GPUS", "PYTHONPATH", "PATH", "LD_LIBRARY_PATH"} |
                          {k for k in os.environ if k.startswith(EXPORTED_PREFIXES)})
        mps = Mps() if args.mps else None
        if mps is not None:
            mps.__enter__()
            os.environ.update(mps.env)
            exported = sorted(set(exported) | set(mps.env))
        try:
            full = mpirun_command(mpirun, flavor, args.num_ranks, [e for e in exported if e in os.environ], cmd,
                                  args.mpirun_arg)
            return run_job(full, timeout_s)
        finally:
            if mps is not None:
                mps.__exit__(None, None, None)
    except LaunchError as exc:
        print(f"symmring.launch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
