"""``python -m symmring.launch`` beyond one node, without a second node: the host options are checked
before anything starts, the command lines built for Open MPI, MPICH/Hydra and srun (`launcher_command`,
not run), the node count that decides the transport policy and refuses ``--mps``, the node-local rank a
rank pins its GPU by (each launcher's variables), and ``--dry-run`` (prints, starts nothing)."""

from __future__ import annotations

import os
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from symmring import launch
from symmring.launch import Host, LaunchError, launcher_command, node_local_rank, plan_job, rank_gpu

ROOT = Path(__file__).resolve().parents[1]
SHIM = [sys.executable, "-m", "symmring.launch", "--rank-shim", "--"]
CMD = ["prog", "--flag"]
NO_ALLOCATION = {"PATH": os.environ.get("PATH", "")}


def _plan(launcher="openmpi", num_ranks=None, **kw):
    kw.setdefault("environ", NO_ALLOCATION)
    return plan_job(launcher, f"{launcher}-launcher", num_ranks, **kw)


def _tail(argv):
    """The launcher's own arguments: ``argv`` without the program and the rank command."""
    assert argv[-len(SHIM) - len(CMD):] == SHIM + CMD
    return argv[1:-len(SHIM) - len(CMD)]


# --- host lists ---------------------------------------------------------------------------------------

def test_hosts_parse_and_bad_ones_are_refused():
    assert launch.parse_hosts("a:8,b") == [Host("a", 8), Host("b", None)]
    for text, words in (("a:0", "positive number"), ("a:x", "positive number"), ("a,,b", "host name ''"),
                        ("a:2,a:2", "more than once"), ("a b:2", "without spaces")):
        with pytest.raises(LaunchError, match=words):
            launch.parse_hosts(text)


def test_hostfiles_of_either_syntax(tmp_path):
    ompi = tmp_path / "ompi"
    ompi.write_text("# two nodes\nnode1 slots=8 max_slots=8\nnode2 slots=4  # the small one\n\n")
    mpich = tmp_path / "mpich"
    mpich.write_text("node1:8\nnode2:4\n")
    plain = tmp_path / "plain"
    plain.write_text("node1\nnode2\n")
    want = [Host("node1", 8), Host("node2", 4)]
    assert launch.read_hostfile(str(ompi)) == (want, "openmpi")
    assert launch.read_hostfile(str(mpich)) == (want, "mpich")
    assert launch.read_hostfile(str(plain)) == ([Host("node1"), Host("node2")], "plain")
    for text, words in (("node1:8\nnode2 slots=4\n", "mixes"), ("node1 cpus=4\n", "line 1"),
                        ("node1:8 extra\n", "line 1"), ("# nothing\n", "no host"), ("n slots=0\n", "positive")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(LaunchError, match=words):
            launch.read_hostfile(str(bad))
    with pytest.raises(LaunchError, match="cannot read it"):
        launch.read_hostfile(str(tmp_path / "missing"))


# --- plans: the node count ----------------------------------------------------------------------------

def test_plan_counts_the_nodes_the_ranks_fill():
    job = _plan(hosts="a:8,b:8")
    assert (job.num_ranks, job.num_nodes, job.nodes_from, job.on_this_node) == (16, 2, "--hosts", False)
    assert _plan(num_ranks=4, hosts="a:8,b:8").num_nodes == 1  # ranks fill the hosts in order
    assert _plan(num_ranks=9, hosts="a:8,b:8").num_nodes == 2
    assert _plan(hosts="a,b,c", ranks_per_node=2).num_ranks == 6
    job = _plan(num_ranks=16, ranks_per_node=8)
    assert (job.num_nodes, job.hosts) == (2, [])
    assert _plan(num_ranks=4, ranks_per_node=8).num_nodes == 1
    job = _plan(num_ranks=4)
    assert (job.num_nodes, job.on_this_node) == (1, True)
    assert not _plan(num_ranks=2, hosts="other:2").on_this_node  # one node, but not this one
    assert _plan(hosts=f"{socket.gethostname()}:2").on_this_node and _plan(hosts="localhost:2").on_this_node


def test_plan_leaves_the_count_to_the_backend_where_the_mpi_launcher_places_ranks():
    slurm2 = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}
    assert _plan(num_ranks=8, environ=slurm2).num_nodes is None
    assert _plan(num_ranks=8, environ={"SLURM_JOB_ID": "7", "SLURM_NNODES": "1"}).num_nodes == 1
    assert _plan(num_ranks=8, environ={"PBS_NODEFILE": "nodefile"}).num_nodes is None
    job = _plan(num_ranks=8, extra=["--hostfile", "f"])
    assert (job.num_nodes, job.nodes_from) == (None, "--mpirun-arg --hostfile")
    assert _plan("srun", num_ranks=8).num_nodes is None  # srun makes its own allocation
    assert _plan("srun", num_ranks=8, environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"}).num_nodes == 1
    job = _plan(ranks_per_node=4, environ=slurm2)  # -n from the allocation
    assert (job.num_ranks, job.num_nodes) == (8, 2)


@pytest.mark.parametrize("kw, words", [
    (dict(num_ranks=0), "-n 0"),
    (dict(num_ranks=2, ranks_per_node=-1), "-N/--ranks-per-node -1"),
    (dict(hosts="a,b", num_ranks=4), "a, b without slots"),
    (dict(hosts="a:2,b:2", num_ranks=5), "more ranks than the 4 slots"),
    (dict(hosts="a:2,b:8", ranks_per_node=4), "slots of a:2"),
    (dict(hosts="a:2", hostfile="f"), "give one of them"),
    (dict(hosts="a:2", extra=["-H", "b"]), "places ranks itself"),
    (dict(ranks_per_node=2, extra=["--map-by=node"]), "places ranks itself"),
    (dict(), "required: -n/--num-ranks"),
    (dict(num_ranks=24, ranks_per_node=8, environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}),
     "needs 3 nodes; the Slurm allocation has 2"),
    (dict(launcher="srun", hosts="a:8,b:4"), "same number of ranks on every node"),
])
def test_plan_refuses_bad_placements(kw, words):
    with pytest.raises(LaunchError, match=words):
        _plan(**kw)


# --- the command lines ----------------------------------------------------------------------------------

def test_open_mpi_command(tmp_path):
    argv = launcher_command(_plan(hosts="a:8,b:8"), ["NVSHMEM_DISABLE_NVLS", "PATH"], CMD)
    tail = _tail(argv)
    assert argv[0] == "openmpi-launcher"
    assert tail[:5] == ["-np", "16", "--oversubscribe", "--bind-to", "none"]
    assert tail[tail.index("--host") + 1] == "a:8,b:8" and tail[tail.index("--map-by") + 1] == "slot"
    assert tail[-4:] == ["-x", "NVSHMEM_DISABLE_NVLS", "-x", "PATH"]
    tail = _tail(launcher_command(_plan(hosts="a,b", ranks_per_node=4), [], CMD))
    assert tail[tail.index("--host") + 1] == "a:4,b:4" and tail[tail.index("--map-by") + 1] == "ppr:4:node"
    native = tmp_path / "hosts"
    native.write_text("a slots=2\nb slots=2\n")
    tail = _tail(launcher_command(_plan(hostfile=str(native)), [], CMD))
    assert tail[tail.index("--hostfile") + 1] == str(native) and "--host" not in tail
    other = tmp_path / "mpich-hosts"
    other.write_text("a:2\nb:2\n")
    job = _plan(hostfile=str(other))
    tail = _tail(launcher_command(job, [], CMD))
    assert tail[tail.index("--host") + 1] == "a:2,b:2" and "--hostfile" not in tail
    assert job.notes == [f"--hostfile {other} is in mpich syntax; passing its hosts to openmpi as a host list"]
    tail = _tail(launcher_command(_plan(num_ranks=2, extra=["--mca", "btl", "tcp"]), [], CMD))
    assert tail[-3:] == ["--mca", "btl", "tcp"] and "--host" not in tail and "--map-by" not in tail


def test_mpich_command(tmp_path):
    assert _tail(launcher_command(_plan("mpich", hosts="a:8,b:8"), ["PATH"], CMD)) == [
        "-n", "16", "-hosts", "a:8,b:8"]
    assert _tail(launcher_command(_plan("mpich", num_ranks=16, ranks_per_node=8), [], CMD)) == [
        "-n", "16", "-ppn", "8"]
    native = tmp_path / "hosts"
    native.write_text("a:2\nb:2\n")
    assert _tail(launcher_command(_plan("mpich", hostfile=str(native)), [], CMD)) == ["-n", "4", "-f", str(native)]
    assert _tail(launcher_command(_plan("mpich", num_ranks=3), [], CMD)) == ["-n", "3"]


def test_srun_command(tmp_path):
    fixed = ["--distribution=block", "--kill-on-bad-exit=1", "--export=ALL"]
    assert _tail(launcher_command(_plan("srun", hosts="a:8,b:8,c:8", num_ranks=16), [], CMD)) == [
        "--ntasks=16", "--nodes=2", "--ntasks-per-node=8", "--nodelist=a,b"] + fixed
    assert _tail(launcher_command(_plan("srun", num_ranks=16, ranks_per_node=4), [], CMD)) == [
        "--ntasks=16", "--nodes=4", "--ntasks-per-node=4"] + fixed
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=4\nb slots=4\n")
    job = _plan("srun", hostfile=str(hostfile), extra=["--mpi=pmix"])
    assert job.hostfile is None and job.notes == []
    assert _tail(launcher_command(job, ["PATH"], CMD)) == [
        "--ntasks=8", "--nodes=2", "--ntasks-per-node=4", "--nodelist=a,b"] + fixed + ["--mpi=pmix"]
    assert _tail(launcher_command(_plan("srun", num_ranks=8, environ={"SLURM_JOB_ID": "1"}), [], CMD)) == [
        "--ntasks=8"] + fixed


# --- the node-local rank and the rank's GPU ----------------------------------------------------------------

@pytest.mark.parametrize("launcher, environ, want", [
    ("Open MPI", {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "0"},
     (1, "OMPI_COMM_WORLD_LOCAL_RANK")),
    ("MPICH/Hydra", {"PMI_RANK": "9", "MPI_LOCALRANKID": "1", "SLURM_LOCALID": "0"}, (1, "MPI_LOCALRANKID")),
    ("srun", {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "PMI_RANK": "9"}, (1, "SLURM_LOCALID")),
    ("world rank only", {"PMI_RANK": "9", "OMPI_COMM_WORLD_RANK": "9", "SLURM_PROCID": "9"}, None),
])
def test_local_rank_comes_from_the_node(launcher, environ, want):
    assert node_local_rank(environ) == want, launcher


def test_rank_gpu_from_the_launchers_list_or_its_own_node():
    # One node: the launcher's GPUs; rank 9 of the world is local rank 1 -> GPU "5".
    assert rank_gpu({"SYMMRING_LAUNCH_GPUS": "4,5", "PMI_RANK": "9", "MPI_LOCALRANKID": "1"}) == "5"
    assert rank_gpu({"SYMMRING_LAUNCH_GPUS": "0,1", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}) == "1"  # shared GPUs
    # Several nodes: the node's own CUDA_VISIBLE_DEVICES (e.g. set by Slurm), not the launcher's.
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_LOCALID": "2", "SLURM_PROCID": "10"}) == "6"
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": "3", "SLURM_LOCALID": "2"}) == "3"  # srun bound one GPU
    assert rank_gpu({"SYMMRING_LAUNCH_GPUS": "0,1", "PMI_RANK": "1"}) is None  # no local rank: no pin
    assert rank_gpu({"SYMMRING_LAUNCH_GPUS": "", "MPI_LOCALRANKID": "0"}) is None


def test_rank_shim_pins_the_node_gpu(tmp_path):
    environ = {k: v for k, v in os.environ.items() if k not in launch.LOCAL_RANK_VARS and k != "SYMMRING_LAUNCH_GPUS"}
    environ.update(CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_LOCALID="2", SLURM_PROCID="10")
    out = subprocess.run([sys.executable, "-m", "symmring.launch", "--rank-shim", "--", sys.executable, "-c",
                          "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=environ)
    assert (out.returncode, out.stdout.strip()) == (0, "6"), out.stderr


# --- the command line of the launcher ------------------------------------------------------------------------

@pytest.fixture
def fake_mpirun(tmp_path):
    """An Open MPI look-alike that only answers ``--version`` (a dry run starts nothing else)."""
    path = tmp_path / "mpirun"
    path.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "mpirun (Open MPI) 4.1.6"; exit 0; }\n'
                    'echo "started a job" >&2; exit 9\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _launch(args, tmp_path, command=(sys.executable, "-m", "symmring.launch"), **extra):
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("NVSHMEM_", "SLURM_", "SYMMRING_LAUNCH"))}
    environ.pop("PYTEST_ADDOPTS", None)
    environ.update(extra)
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=environ)


def test_dry_run_across_nodes_prints_the_environment_and_command(fake_mpirun, tmp_path):
    run = _launch(["--mpirun", str(fake_mpirun), "--hosts", "n1:4,n2:4", "--dry-run", "--", "python", "x.py"],
                  tmp_path, NVSHMEM_IB_ENABLE_IBGDA="1")
    assert run.returncode == 0 and "started a job" not in run.stderr, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("# symmring.launch --dry-run: 8 ranks, openmpi") and "nodes: 2 (--hosts)" in lines[0]
    assert "NVSHMEM_REMOTE_TRANSPORT left to NVSHMEM" in lines[1] and "NVSHMEM_IB_ENABLE_IBGDA=1" in lines[1]
    assert "export NVSHMEM_DISABLE_NVLS=1" in lines and "export NVSHMEM_IB_ENABLE_IBGDA=1" in lines
    assert not any("NVSHMEM_REMOTE_TRANSPORT" in line or "SYMMRING_LAUNCH_GPUS" in line for line in lines[2:])
    command = lines[-1].split()
    assert command[:3] == [str(fake_mpirun), "-np", "8"] and "n1:4,n2:4" in command
    assert command[-2:] == [sys.executable, "x.py"] and "-x" in command


def test_dry_run_on_one_node_keeps_the_one_node_policy(fake_mpirun, tmp_path):
    run = _launch(["--mpirun", str(fake_mpirun), "-n", "2", "--dry-run", "--", "prog"], tmp_path,
                  CUDA_VISIBLE_DEVICES="0")
    assert run.returncode == 0, run.stderr
    assert "export NVSHMEM_REMOTE_TRANSPORT=none" in run.stdout.splitlines()
    assert "export SYMMRING_LAUNCH_GPUS=0" in run.stdout.splitlines()


def test_np_is_an_alias_of_n(fake_mpirun, tmp_path):
    """``-np N`` (mpirun's spelling, which launch/symmring-mpirun always took) is ``-n N``."""
    run = _launch(["--mpirun", str(fake_mpirun), "-np", "3", "--dry-run", "--", "prog"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("# symmring.launch --dry-run: 3 ranks, openmpi"), run.stdout
    assert shlex.split(run.stdout.splitlines()[-1])[1:3] == ["-np", "3"]


@pytest.mark.parametrize("args, words", [
    (["--hosts", "n1:2,n2:2", "--mps"], "--mps starts CUDA MPS on this node only, and this job's ranks run on 2 nodes"),
    (["--hosts", "n1,n2", "-n", "4"], "n1, n2 without slots"),
    (["--hosts", "n1:2", "--mps"], "this job's ranks run on n1"),
    (["--srun", "-n", "2"], None),
    (["-n", "0"], "-n 0: expected a positive number of ranks"),
])
def test_bad_launches_fail_before_starting(fake_mpirun, tmp_path, args, words):
    extra = ["--mpirun", str(fake_mpirun)] if "--srun" not in args else []
    run = _launch(extra + args + ["--", "prog"], tmp_path, PATH=str(tmp_path))  # no srun on this PATH
    assert run.returncode == 2 and "started a job" not in run.stderr, run.stderr
    assert (words or "--srun: srun not found on PATH") in run.stderr, run.stderr


@pytest.mark.parametrize("args", [
    ["--hosts", "n1:4,n2:4", "--dry-run", "--", "python", "x.py"],
    ["-np", "2", "--dry-run", "--", "prog"],
    ["--hosts", "n1,n2", "-n", "4", "--", "prog"],  # a bad launch: exit 2, the same message
])
def test_bash_launcher_is_the_python_launcher(fake_mpirun, tmp_path, args):
    """launch/symmring-mpirun hands every argument to ``python -m symmring.launch``: the same output and exit
    status (the host options too, which it refused when it was a launcher of its own)."""
    extra = {"SYMMRING_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "0"}
    python = _launch(["--mpirun", str(fake_mpirun), *args], tmp_path, **extra)
    wrapper = _launch(["--mpirun", str(fake_mpirun), *args], tmp_path,
                      command=["bash", str(ROOT / "launch" / "symmring-mpirun")], **extra)
    assert (wrapper.returncode, wrapper.stdout, wrapper.stderr) == (python.returncode, python.stdout, python.stderr)
    assert "started a job" not in wrapper.stderr and wrapper.returncode == (2 if "--dry-run" not in args else 0)


@pytest.mark.mpi
def test_a_host_list_of_this_node_runs_under_the_real_mpiexec(tmp_path):
    """``--hosts localhost:2`` through the MPI launcher of this venv: both ranks start, each with its own
    node-local rank, and a one-node job keeps ``NVSHMEM_REMOTE_TRANSPORT=none``."""
    from test_under_mpi import find_mpiexec
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to sys.executable or on PATH (pip install -e '.[mpi]' provides one)")
    # One write() of the whole line per rank: print() of several items (unbuffered, as PYTHONUNBUFFERED makes it)
    # writes them one by one, and the launcher's forwarded output once read "RANKRANK 0 none".
    probe = ("import os; from symmring.launch import node_local_rank; "
             "os.write(1, ('RANK %s %s\\n' % (node_local_rank()[0], "
             "os.environ.get('NVSHMEM_REMOTE_TRANSPORT'))).encode())")
    run = _launch(["--mpirun", mpiexec, "--hosts", "localhost:2", "--", "python", "-c", probe], tmp_path,
                  PYTHONPATH=str(ROOT))
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(line for line in run.stdout.splitlines() if line.startswith("RANK")) == [
        "RANK 0 none", "RANK 1 none"], run.stdout
