"""Start a symmring job: ``python -m symmring.launch -n N [--mps] -- cmd ...`` on this node, or beyond it
with ``--hosts``/``--hostfile``/``-N``/``--srun`` (docs/GPU.md, "More than one node").

What it does around ``mpirun -n N cmd ...``:

* exports the GPU environment policy of `symmring.env.GPU_ENV` (``NVSHMEM_DISABLE_NVLS=1``,
  ``NVSHMEM_REMOTE_TRANSPORT=none`` for a job on one node only, ``CUDA_MODULE_LOADING=EAGER``,
  ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``) unless already set; ``--print-env``
  prints the one-node policy as ``export`` lines and exits (``tools/gpu_common.sh`` reads it through
  ``launch/symmring-mpirun``, the bash wrapper that runs this module), ``--dry-run`` prints a job's
  environment and command line and starts nothing;
* places the ranks (`plan_job`, `launcher_command`): ``--hosts n1:8,n2:8``, ``--hostfile FILE`` (Open MPI
  or MPICH syntax), ``-N K`` ranks per node, in the launcher's own syntax (Open MPI ``--host``/
  ``--hostfile``/``--map-by``, Hydra ``-hosts``/``-f``/``-ppn``, srun ``--nodelist``/``--nodes``/
  ``--ntasks-per-node``), checked before anything starts; the node count it gives decides the transport
  policy (the backend counts the nodes itself where the MPI launcher places ranks in an allocation);
* runs a command ``python`` or ``python3`` with this launcher's own interpreter (``sys.executable``),
  as torchrun does: an MPI launcher may put another ``python3`` first on the ranks' ``PATH``;
* maps local ranks to GPUs: every rank runs through a small shim (``--rank-shim``) that sets
  ``CUDA_VISIBLE_DEVICES`` to GPU ``local_rank % num_gpus`` (`rank_gpu`) of the GPUs visible to the
  launcher when every rank runs on its node, else of the rank's own node; the local rank is the node's
  (`node_local_rank`), never the world rank; ranks beyond the GPU count share GPUs (several PEs per GPU);
* with ``--mps`` (needed for concurrent kernels of several PEs on one GPU; one node only) starts the CUDA
  MPS control daemon with private ``CUDA_MPS_PIPE_DIRECTORY``/``CUDA_MPS_LOG_DIRECTORY`` exported to every
  rank, and stops it (``echo quit | nvidia-cuda-mps-control``) when the job ends, also on failure;
* works with Open MPI's ``mpirun`` (adds ``--oversubscribe``, ``--allow-run-as-root`` when run as root,
  and ``-x VAR`` for every exported variable: `symmring.env.GPU_ENV` and ``SYMMRING_*``, ``NVSHMEM_*``,
  ``CUDA_*``, ``NCCL_*``, ``TORCH_SYMM_MEM_*``, ``PYTHON*``, ``PATH``, ``LD_LIBRARY_PATH``), with
  MPICH/Hydra's ``mpiexec`` (e.g. the ``mpich`` wheel's, which forwards the environment itself), with
  Slurm's ``srun`` (``--srun``), and with torchrun on this node (``--torchrun``: ``python -m
  torch.distributed.run --standalone --nproc-per-node N --no-python``; its workers inherit the
  environment; symmring's context then joins torch.distributed's default group, no MPI needed).

The MPI launcher is ``--mpirun PATH``, else ``$SYMMRING_MPIRUN``, else the ``mpiexec`` next to this
Python (a venv with the ``mpich`` wheel), else ``mpirun``/``mpiexec`` on ``PATH``. The exit status is
the job's; 2 when the launch itself fails (no MPI launcher, a bad placement, MPS cannot start).

``--timeout S`` (or ``SYMMRING_JOB_TIMEOUT_S``) bounds the whole job: past ``S`` seconds the launcher
sends SIGTERM to the MPI launcher and every rank (they run in a process group of their own), SIGKILL
5 s later if any is left, and exits with 124 (as coreutils ``timeout``). It is the last line of defence
behind symmring's own bounds (``SYMMRING_TIMEOUT_S``), for whatever else a job may wait on.

Example::

    python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu -q
    python -m symmring.launch -n 2 --mps --torchrun -- python -m pytest tests/gpu -q
    python -m symmring.launch --hosts node1:8,node2:8 --dry-run -- python -m mpi4py serve.py
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import env

#: Command names that are run with this launcher's interpreter (`rank_command`).
PYTHON_NAMES = ("python", "python3")
#: Prefixes of the variables an Open MPI launch forwards (``-x``), besides `symmring.env.GPU_ENV`.
EXPORTED_PREFIXES = ("SYMMRING_", "NVSHMEM_", "CUDA_", "NCCL_", "TORCH_SYMM_MEM_", "PYTHON")
#: Variables naming a process's rank within its node, by launcher (MPI's, torchrun's, then Slurm's).
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MPIR_CVAR_LOCAL_RANK",
                   "LOCAL_RANK", "SLURM_LOCALID")


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


def visible_gpus(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """GPU ids this node shows: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L``'s indices."""
    environ = os.environ if environ is None else environ
    raw = environ.get("CUDA_VISIBLE_DEVICES")
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


class Host(NamedTuple):
    """One host of ``--hosts``/``--hostfile``: its name and how many ranks it takes (None: not given)."""

    name: str
    slots: Optional[int] = None


#: Launcher arguments that place ranks on hosts: with one of them in ``--mpirun-arg`` the launcher
#: does not know the job's nodes (the backend counts them), and ``--hosts``/``--hostfile``/``-N`` conflict.
PLACEMENT_ARGS = ("--host", "-host", "-H", "--hostfile", "-hostfile", "--machinefile", "-machinefile", "-f",
                  "-hosts", "--map-by", "-npernode", "--npernode", "-ppn", "--nodelist", "-w", "--nodes",
                  "--ntasks-per-node")


def placement_args(extra: Sequence[str]) -> List[str]:
    """The arguments of ``extra`` that place ranks on hosts (`PLACEMENT_ARGS`, also as ``--flag=value``)."""
    return [a for a in extra if a in PLACEMENT_ARGS or a.split("=", 1)[0] in PLACEMENT_ARGS and "=" in a]


#: Environment variables of batch systems whose allocation an MPI launcher reads by itself.
ALLOCATION_VARS = ("PBS_NODEFILE", "LSB_HOSTS", "LSB_MCPU_HOSTS", "COBALT_NODEFILE", "PE_HOSTFILE")


def _slots(raw: str, where: str) -> int:
    if not raw.isdigit() or int(raw) <= 0:
        raise LaunchError(f"{where}: slots {raw!r}: expected a positive number of ranks")
    return int(raw)


def _host_name(name: str, where: str) -> str:
    if not name or any(c.isspace() or c in ",:=" for c in name):
        raise LaunchError(f"{where}: host name {name!r}: expected a name without spaces, ',', ':' or '='")
    return name


def _unique(hosts: List[Host], where: str) -> List[Host]:
    names = [h.name for h in hosts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise LaunchError(f"{where}: host {', '.join(repeated)} given more than once (name each host once, "
                          "with its ranks: host:8)")
    if not hosts:
        raise LaunchError(f"{where}: no host")
    return hosts


def parse_hosts(text: str) -> List[Host]:
    """``--hosts``'s value: comma-separated ``name`` or ``name:slots``.

    Raises:
        LaunchError: an empty or repeated name, slots that are not a positive number.

    Example:
        >>> parse_hosts("node1:8,node2:8")
        [Host(name='node1', slots=8), Host(name='node2', slots=8)]
    """
    hosts = []
    for item in text.split(","):
        name, sep, slots = item.strip().partition(":")
        where = f"--hosts {text!r}"
        hosts.append(Host(_host_name(name, where), _slots(slots, where) if sep else None))
    return _unique(hosts, f"--hosts {text!r}")


def read_hostfile(path: str) -> Tuple[List[Host], str]:
    """The hosts of a hostfile and its syntax: ``"openmpi"`` (``name slots=N [max_slots=M]``), ``"mpich"``
    (Hydra's ``name:N``) or ``"plain"`` (names only, read by both). ``#`` starts a comment.

    Raises:
        LaunchError: no such file, a line of neither syntax, both syntaxes in one file, no host.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LaunchError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    hosts, syntaxes = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path} line {number}"
        name, sep, slots = words[0].partition(":")
        if sep:
            if len(words) > 1:
                raise LaunchError(f"{where}: {line.strip()!r}: expected 'name:N' (MPICH) or 'name slots=N' "
                                  "(Open MPI)")
            syntaxes.add("mpich")
            hosts.append(Host(_host_name(name, where), _slots(slots, where)))
            continue
        options = dict(word.partition("=")[::2] for word in words[1:])
        unknown = sorted(set(options) - {"slots", "max_slots", "max-slots"})
        if unknown or any(not v for v in options.values()):
            raise LaunchError(f"{where}: {line.strip()!r}: expected 'name slots=N [max_slots=M]' (Open MPI) or "
                              "'name:N' (MPICH)")
        if options:
            syntaxes.add("openmpi")
        hosts.append(Host(_host_name(name, where), _slots(options["slots"], where) if "slots" in options else None))
    if len(syntaxes) > 1:
        raise LaunchError(f"--hostfile {path}: mixes Open MPI lines (name slots=N) with MPICH lines (name:N)")
    return _unique(hosts, f"--hostfile {path}"), syntaxes.pop() if syntaxes else "plain"


def _slurm_nodes(environ: Mapping[str, str]) -> Optional[int]:
    """The nodes of the Slurm allocation this runs in, or None outside one."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


@dataclass
class Job:
    """What `launcher_command` starts: where the ranks go, and how many nodes that makes.

    Attributes:
        launcher: ``"openmpi"``, ``"mpich"`` (Hydra) or ``"srun"``; program: its path.
        num_ranks: ranks (PEs) in all; ranks_per_node: ``-N`` (None: not given).
        hosts: the host list (empty: the MPI launcher's own default or allocation), each with its slots.
        hostfile: a hostfile passed to the launcher as is (its syntax is the launcher's), else None.
        num_nodes: the nodes the ranks land on, None where the launcher cannot know (an allocation the MPI
            launcher fills by itself; the backend counts them); nodes_from: how it was decided.
        extra: ``--mpirun-arg`` values, passed before the rank command.
    """

    launcher: str
    program: str
    num_ranks: int
    ranks_per_node: Optional[int] = None
    hosts: List[Host] = field(default_factory=list)
    hostfile: Optional[str] = None
    num_nodes: Optional[int] = 1
    nodes_from: str = "no host list: this node"
    extra: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def on_this_node(self) -> bool:
        """Whether every rank runs on the launcher's own node: one node, no srun, and no host list or one
        that names this host (`is_this_host`)."""
        return self.num_nodes == 1 and self.launcher != "srun" and all(
            is_this_host(h.name) for h in self.hosts[:1])


def is_this_host(name: str) -> bool:
    """Whether host ``name`` is this machine: ``localhost``, a loopback address, or its host name (short
    or full)."""
    import socket
    here = socket.gethostname()
    return name in ("localhost", "127.0.0.1", "::1", here, here.split(".")[0], socket.getfqdn())


def plan_job(launcher: str, program: str, num_ranks: Optional[int], *, ranks_per_node: Optional[int] = None,
             hosts: Optional[str] = None, hostfile: Optional[str] = None, extra: Sequence[str] = (),
             environ: Optional[Mapping[str, str]] = None) -> Job:
    """Check the placement options and decide how many nodes the job spans (`Job`).

    Ranks fill the hosts in order (each up to its slots, or ``-N``), so ``-n`` may leave the last hosts
    empty. Without a host list the ranks go where the MPI launcher puts them: this node, or a Slurm
    (PBS, LSF) allocation it reads by itself.

    Raises:
        LaunchError: bad counts, both ``--hosts`` and ``--hostfile``, hosts without slots and no ``-N``,
            more ranks than slots, placement flags in ``--mpirun-arg`` together with ``--hosts``/``-N``, a
            host list srun cannot express (uneven slots).
    """
    environ = os.environ if environ is None else environ
    for name, value in (("-n", num_ranks), ("-N/--ranks-per-node", ranks_per_node)):
        if value is not None and value <= 0:
            raise LaunchError(f"{name} {value}: expected a positive number")
    if hosts is not None and hostfile is not None:
        raise LaunchError("--hosts and --hostfile: give one of them")
    placement = placement_args(extra)
    if placement and (hosts is not None or hostfile is not None or ranks_per_node is not None):
        raise LaunchError(f"--mpirun-arg {' '.join(placement)}: places ranks itself; give either it or "
                          "--hosts/--hostfile/-N")
    job = Job(launcher, program, 0, ranks_per_node, extra=list(extra))
    rpn = ranks_per_node
    if hosts is not None or hostfile is not None:
        if hosts is not None:
            job.hosts, job.nodes_from = parse_hosts(hosts), "--hosts"
        else:
            job.hosts, syntax = read_hostfile(hostfile)
            job.nodes_from = "--hostfile"
            if launcher != "srun" and syntax in ("plain", launcher):
                job.hostfile = hostfile
            elif launcher != "srun":
                job.notes.append(f"--hostfile {hostfile} is in {syntax} syntax; passing its hosts to "
                                 f"{launcher} as a host list")
        missing = [h.name for h in job.hosts if h.slots is None]
        if missing and rpn is None:
            raise LaunchError(f"{job.nodes_from}: {', '.join(missing)} without slots: give each host its ranks "
                              "(host:8, or 'host slots=8' in an Open MPI hostfile) or -N ranks per node")
        small = [f"{h.name}:{h.slots}" for h in job.hosts if rpn is not None and h.slots is not None and h.slots < rpn]
        if small:
            raise LaunchError(f"-N {rpn}: more ranks per node than the slots of {', '.join(small)}")
        per_host = [rpn if rpn is not None else h.slots for h in job.hosts]
        capacity = sum(per_host)
        num_ranks = capacity if num_ranks is None else num_ranks
        if num_ranks > capacity:
            raise LaunchError(f"-n {num_ranks}: more ranks than the {capacity} slots of {job.nodes_from} "
                              f"({', '.join(f'{h.name}:{k}' for h, k in zip(job.hosts, per_host))})")
        filled, job.num_nodes = 0, 0
        while filled < num_ranks:
            filled += per_host[job.num_nodes]
            job.num_nodes += 1
        if launcher == "srun" and rpn is None:
            used = set(per_host[:job.num_nodes])
            if len(used) > 1:
                raise LaunchError(f"--srun: srun puts the same number of ranks on every node; {job.nodes_from} "
                                  f"gives {', '.join(f'{h.name}:{k}' for h, k in zip(job.hosts, per_host))} "
                                  "(give -N, or equal slots)")
            job.ranks_per_node = used.pop()
    else:
        allocation = _slurm_nodes(environ)
        if num_ranks is None:
            if rpn is None or allocation is None:
                raise LaunchError("the following arguments are required: -n/--num-ranks (or --hosts with slots, "
                                  "or -N inside a Slurm allocation)")
            num_ranks = rpn * allocation
        if rpn is not None:
            job.num_nodes = -(-num_ranks // rpn)
            job.nodes_from = f"-n {num_ranks} at -N {rpn} per node"
            if allocation is not None and job.num_nodes > allocation:
                raise LaunchError(f"-n {num_ranks} at -N {rpn} per node needs {job.num_nodes} nodes; the Slurm "
                                  f"allocation has {allocation}")
        elif placement:
            job.num_nodes, job.nodes_from = None, f"--mpirun-arg {' '.join(placement)}"
        elif launcher == "srun" and allocation != 1:
            job.num_nodes, job.nodes_from = None, "srun places the ranks"
        elif allocation is not None and allocation > 1:
            job.num_nodes, job.nodes_from = None, f"a Slurm allocation of {allocation} nodes"
        elif allocation is None and any(environ.get(v) for v in ALLOCATION_VARS):
            job.num_nodes = None
            job.nodes_from = f"a batch allocation ({next(v for v in ALLOCATION_VARS if environ.get(v))})"
        elif allocation == 1:
            job.nodes_from = "a Slurm allocation of 1 node"
    job.num_ranks = num_ranks
    return job


def launcher_command(job: Job, exported: Sequence[str], cmd: Sequence[str]) -> List[str]:
    """The full launcher command line of ``job`` (each rank through the rank shim), in the launcher's own
    syntax: Open MPI ``--host a:8,b:8``/``--hostfile F``, ``--map-by ppr:K:node`` (``slot`` for a host
    list), ``-x VAR``; MPICH/Hydra ``-hosts a:8,b:8``/``-f F``, ``-ppn K`` (it forwards the environment
    itself); srun ``--nodes``, ``--ntasks-per-node``, ``--nodelist``, ``--kill-on-bad-exit=1``,
    ``--export=ALL``."""
    shim = [sys.executable, "-m", "symmring.launch", "--rank-shim", "--"]
    rpn = job.ranks_per_node
    host_list = ",".join(f"{h.name}:{rpn if rpn is not None else h.slots}" for h in job.hosts)
    if job.launcher == "openmpi":
        args = [job.program, "-np", str(job.num_ranks), "--oversubscribe", "--bind-to", "none"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.append("--allow-run-as-root")
        if job.hostfile:
            args += ["--hostfile", job.hostfile]
        elif job.hosts:
            args += ["--host", host_list]
        if rpn is not None:
            args += ["--map-by", f"ppr:{rpn}:node"]
        elif job.hosts:
            args += ["--map-by", "slot"]
        for name in exported:
            args += ["-x", name]
    elif job.launcher == "mpich":
        args = [job.program, "-n", str(job.num_ranks)]
        if job.hostfile:
            args += ["-f", job.hostfile]
        elif job.hosts:
            args += ["-hosts", host_list]
        if rpn is not None:
            args += ["-ppn", str(rpn)]
    elif job.launcher == "torchrun":
        # --no-python: the rank shim is the worker's program; --standalone: a free rendezvous port of its own.
        args = [*job.program.split(), "--standalone", f"--nproc-per-node={job.num_ranks}", "--no-python"]
    elif job.launcher == "srun":
        args = [job.program, f"--ntasks={job.num_ranks}"]
        if job.num_nodes is not None and (job.hosts or rpn is not None):
            args.append(f"--nodes={job.num_nodes}")
        if rpn is not None:
            args.append(f"--ntasks-per-node={rpn}")
        if job.hosts:
            args.append("--nodelist=" + ",".join(h.name for h in job.hosts[:job.num_nodes]))
        args += ["--distribution=block", "--kill-on-bad-exit=1", "--export=ALL"]
    else:
        raise LaunchError(f"launcher {job.launcher!r}: expected openmpi, mpich, srun or torchrun")
    return args + list(job.extra) + shim + list(cmd)


def mpirun_command(mpirun: str, flavor: str, num_ranks: int, exported: Sequence[str], cmd: Sequence[str],
                   extra: Sequence[str] = ()) -> List[str]:
    """`launcher_command` of a job on this node only (``num_ranks`` ranks, no host list)."""
    return launcher_command(Job(flavor, mpirun, num_ranks, extra=list(extra)), exported, cmd)


def find_torchrun() -> str:
    """torchrun as this Python runs it (``python -m torch.distributed.run``). Raises LaunchError without torch."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        raise LaunchError("--torchrun: torch is not installed in this Python (pip install \"symmring[cpu]\" or "
                          "\"symmring[gpu]\")")
    return f"{sys.executable} -m torch.distributed.run"


def find_srun(environ: Optional[Mapping[str, str]] = None) -> str:
    """``srun`` on ``PATH``. Raises LaunchError outside Slurm."""
    srun = shutil.which("srun", path=(os.environ if environ is None else environ).get("PATH"))
    if not srun:
        raise LaunchError("--srun: srun not found on PATH (run inside a Slurm allocation, or use mpirun with "
                          "--hosts/--hostfile)")
    return srun


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


def node_local_rank(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, str]]:
    """This process's rank on its node and the variable it came from, from the first of `LOCAL_RANK_VARS`
    that holds a number (Open MPI's, MPICH/Hydra's, PMI's, torchrun's ``LOCAL_RANK``, then Slurm's
    ``SLURM_LOCALID``, which a batch script's environment may carry into ranks started by mpirun or
    torchrun); never a world rank. None without one.

    Example:
        >>> node_local_rank({"PMI_RANK": "9", "MPI_LOCALRANKID": "1", "SLURM_LOCALID": "0"})
        (1, 'MPI_LOCALRANKID')
        >>> node_local_rank({"OMPI_COMM_WORLD_RANK": "9"}) is None
        True
    """
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value), name
    return None


def rank_gpu(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The GPU a rank pins itself to: ``local_rank % num_gpus`` of ``SYMMRING_LAUNCH_GPUS`` (the launcher's
    GPUs, set when every rank runs on the launcher's node), else of the GPUs its own node shows
    (`visible_gpus`: ``CUDA_VISIBLE_DEVICES``, e.g. as Slurm set it, else ``nvidia-smi -L``). None (no pin)
    without a node-local rank or a GPU.

    Example:
        >>> rank_gpu({"SYMMRING_LAUNCH_GPUS": "0,1", "OMPI_COMM_WORLD_LOCAL_RANK": "3"})
        '1'
    """
    environ = os.environ if environ is None else environ
    local = node_local_rank(environ)
    if local is None:
        return None
    if "SYMMRING_LAUNCH_GPUS" in environ:
        gpus = [g for g in environ["SYMMRING_LAUNCH_GPUS"].split(",") if g]
    else:
        gpus = visible_gpus(environ)
    return gpus[local[0] % len(gpus)] if gpus else None


def rank_shim(cmd: Sequence[str]) -> int:
    """Run on every rank: pin it to its GPU (`rank_gpu`), then exec ``cmd``."""
    gpu = rank_gpu()
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    if not cmd:
        print("symmring.launch --rank-shim: no command", file=sys.stderr)
        return 2
    os.execvp(cmd[0], list(cmd))
    return 0  # not reached


def _dry_run(job: Job, full: Sequence[str], names: Sequence[str]) -> None:
    """Print what a launch would run: the ranks' environment as ``export`` lines, then the command line."""
    print(f"# symmring.launch --dry-run: {job.num_ranks} ranks, {job.launcher} ({job.program}); nodes: "
          f"{'not known here (the backend counts them)' if job.num_nodes is None else job.num_nodes} "
          f"({job.nodes_from})")
    print(f"# {env.remote_transport_note(job.num_nodes)}")
    for name in names:
        if name in os.environ:
            print(f"export {name}={shlex.quote(os.environ[name])}")
    print(shlex.join(full))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank-shim"]:
        rest = argv[1:]
        return rank_shim(rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(
        prog="python -m symmring.launch", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m symmring.launch -n N [-N K] [--hosts H:K,... | --hostfile F] [--srun] [--mps]\n"
              "       [--mpirun PATH] [--mpirun-arg ARG] [--timeout S] [--dry-run] -- cmd ...\n"
              "       python -m symmring.launch -n N --torchrun [--mps] [--timeout S] -- cmd ...\n"
              "       python -m symmring.launch --print-env",
        description="Start a symmring job: N MPI ranks, each pinned to GPU local_rank % num_gpus of its node\n"
                    "(local rank from the launcher's variables, never the world rank), with the GPU\n"
                    "environment set. On this node by default; on several with --hosts/--hostfile, -N, or\n"
                    "--srun inside a Slurm allocation. The MPI launcher is --mpirun, else $SYMMRING_MPIRUN,\n"
                    "else the mpiexec next to this Python, else mpirun/mpiexec on PATH. Exit status: the\n"
                    "job's; 2 when the launch itself fails.",
        epilog="A command `python` or `python3` runs with this launcher's own interpreter on every rank\n"
               f"({sys.executable}), as torchrun does; name another interpreter by its path. On several\n"
               "nodes that path (and symmring) must exist on every node.\n\n"
               "Every rank gets these unless already set (symmring.env.GPU_ENV):\n" +
               "\n".join(f"  {d.name}={d.value}{' (one node only)' if d.one_node_only else ''}: {d.reason}"
                         for d in env.GPU_ENV))
    parser.add_argument("-n", "-np", "--num-ranks", type=int, help="ranks (PEs) in all (default with "
                        "--hosts/--hostfile: the sum of the slots; with -N in a Slurm allocation: K per node)")
    parser.add_argument("-N", "--ranks-per-node", type=int, metavar="K", help="ranks per node (Open MPI "
                        "--map-by ppr:K:node, Hydra -ppn K, srun --ntasks-per-node K)")
    parser.add_argument("--hosts", metavar="H[:K],...", help="hosts, each with its ranks: node1:8,node2:8 "
                        "(Open MPI --host, Hydra -hosts, srun --nodelist)")
    parser.add_argument("--hostfile", metavar="FILE", help="hostfile: 'name slots=K' (Open MPI) or 'name:K' "
                        "(MPICH) lines; passed as is to the launcher that reads its syntax, as a host list otherwise")
    parser.add_argument("--srun", action="store_true", help="start the ranks with Slurm's srun (inside an "
                        "allocation) instead of an MPI launcher")
    parser.add_argument("--torchrun", action="store_true", help="start the ranks with torchrun on this node "
                        "(python -m torch.distributed.run --standalone --no-python) instead of an MPI launcher: "
                        "symmring joins torch.distributed's default group")
    parser.add_argument("--print-env", action="store_true",
                        help="print the GPU environment of a job on one node as bash `export` lines (user-set "
                             "values kept) and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the ranks' environment and the launcher "
                        "command line, start nothing, exit 0")
    parser.add_argument("--mps", action="store_true", help="run CUDA MPS around the job (several PEs per GPU; "
                        "one node only)")
    parser.add_argument("--mpirun", help="MPI launcher (default: $SYMMRING_MPIRUN, the venv's mpiexec, mpirun)")
    parser.add_argument("--mpirun-arg", "--launcher-arg", dest="mpirun_arg", action="append", default=[],
                        metavar="ARG", help="extra argument for the MPI launcher or srun (repeat it)")
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
    if sum(map(bool, (args.srun, args.mpirun, args.torchrun))) > 1:
        parser.error("--srun, --mpirun and --torchrun: give one of them")
    if args.torchrun and (args.hosts or args.hostfile or args.ranks_per_node or args.mpirun_arg):
        parser.error("--torchrun starts the ranks on this node only: no --hosts/--hostfile/-N/--mpirun-arg")
    for flag, value in (("-n", args.num_ranks), ("-N", args.ranks_per_node)):
        if value is not None and value <= 0:
            parser.error(f"{flag} {value}: expected a positive number of ranks")
    try:
        timeout_s = job_timeout_s(args.timeout)
        if args.srun:
            launcher, program = "srun", find_srun()
        elif args.torchrun:
            launcher, program = "torchrun", find_torchrun()
        else:
            program = find_mpirun(args.mpirun)
            launcher = mpi_flavor(program)
        job = plan_job(launcher, program, args.num_ranks, ranks_per_node=args.ranks_per_node, hosts=args.hosts,
                       hostfile=args.hostfile, extra=args.mpirun_arg)
        if launcher == "torchrun":  # --standalone: every worker on this node
            job.num_nodes, job.nodes_from = 1, "torchrun --standalone: this node"
        if args.mps and not job.on_this_node:
            where = (f"may span nodes ({job.nodes_from})" if job.num_nodes is None else
                     f"run on {job.num_nodes} nodes ({job.nodes_from})" if job.num_nodes > 1 else
                     "are placed by srun" if job.launcher == "srun" else f"run on {job.hosts[0].name}")
            raise LaunchError(f"--mps starts CUDA MPS on this node only, and this job's ranks {where}: across "
                              "nodes run one PE per GPU, or start nvidia-cuda-mps-control -d on every node "
                              "yourself (e.g. in a Slurm prolog) and export CUDA_MPS_PIPE_DIRECTORY to the ranks")
        env.apply_gpu_env(num_nodes=job.num_nodes)
        for note in job.notes:
            print(f"symmring.launch: {note}", file=sys.stderr)
        if job.num_nodes != 1 and not args.dry_run:
            print(f"symmring.launch: {job.nodes_from}: {env.remote_transport_note(job.num_nodes)}", file=sys.stderr)
        if job.on_this_node:
            gpus = visible_gpus()
            os.environ["SYMMRING_LAUNCH_GPUS"] = ",".join(gpus)
            if gpus and job.num_ranks > len(gpus) and not args.mps:
                print(f"symmring.launch: {job.num_ranks} ranks on {len(gpus)} GPU(s) without --mps: their "
                      "kernels will time-slice, and waits between PEs of one GPU may time out", file=sys.stderr)
        else:  # each rank reads its own node's GPUs (rank_gpu)
            os.environ.pop("SYMMRING_LAUNCH_GPUS", None)
        exported = sorted(set(env.gpu_env_defaults()) | {"SYMMRING_LAUNCH_GPUS", "PYTHONPATH", "PATH", "LD_LIBRARY_PATH"} |
                          {k for k in os.environ if k.startswith(EXPORTED_PREFIXES)})
        if args.dry_run:
            names = sorted(set(env.gpu_env_defaults()) | {"SYMMRING_LAUNCH_GPUS"} | {
                k for k in os.environ if k.startswith("NVSHMEM_")})
            _dry_run(job, launcher_command(job, [e for e in exported if e in os.environ], cmd), names)
            return 0
        mps = Mps() if args.mps else None
        if mps is not None:
            mps.__enter__()
            os.environ.update(mps.env)
            exported = sorted(set(exported) | set(mps.env))
        try:
            full = launcher_command(job, [e for e in exported if e in os.environ], cmd)
            return run_job(full, timeout_s)
        finally:
            if mps is not None:
                mps.__exit__(None, None, None)
    except LaunchError as exc:
        print(f"symmring.launch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
