"""The lighter installs the README lists work: ``pip install symmring`` and ``pip install "symmring[mpi]"``
into fresh venvs, then ``info`` and ``demo`` (and ``mpiexec -n 4 ... demo`` where an mpiexec exists); and
``pip install "symmring[cpu]"`` (torch, no MPI) under ``torchrun --nproc-per-node 3``.

Each variant is installed from a copy of this source tree (not editable, so the wheel's contents are what
runs) into a new ``python -m venv``, with pip's cache (a variant without torch takes a few seconds once the
cache is warm; the ``cpu`` one unpacks torch's CPU wheel, about a minute). The commands run outside the source
tree with a clean environment.
Without the ``mpi`` extra (no mpi4py) the core install runs as one process (`symmring.mpi`'s stand-in), or
as many ranks as torchrun starts (torch.distributed's store and POSIX shared memory: no MPI at all).

Marked ``install`` (``-m "not install"`` deselects it); the README's test command runs it, so CI does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                                 ".pytest_cache", "out", ".whl", "*.o", "*.cubin", ".symcache")
DEMO = ["-m", "symmring", "demo", "--tokens", "24", "--repeats", "1"]
PIP_TIMEOUT_S = 600
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    if not (ROOT / "setup.cfg").is_file():
        pytest.skip(f"no source tree at {ROOT} (tests run from an installed copy)")
    src = tmp_path_factory.mktemp("install") / "symmring-src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=IGNORED)  # symmring/_device stays a symlink
    return src


def _clean_env(venv: Path) -> dict:
    """This environment without the test venv, SYMMRING_* settings and MPI launcher variables."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS", "MPI4PY_LIBMPI", "PMI_SIZE", "PMI_RANK",
            "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
    environ = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SYMMRING_")}
    test_bin = str(Path(sys.executable).parent)
    path = [p for p in environ.get("PATH", "").split(os.pathsep) if p and p != test_bin]
    environ["PATH"] = os.pathsep.join([str(venv / "bin")] + path)
    return environ


def _install(source: Path, tmp_path: Path, extra: str) -> Path:
    venv = tmp_path / f"venv-{extra or 'core'}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, capture_output=True)
    target = f"{source}[{extra}]" if extra else str(source)
    run = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", target], capture_output=True,
                         text=True, timeout=PIP_TIMEOUT_S, cwd=tmp_path, env=_clean_env(venv))
    assert run.returncode == 0, f"pip install {target} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    return venv


def _run(venv: Path, tmp_path: Path, args, prefix=()) -> subprocess.CompletedProcess:
    run = subprocess.run([*prefix, str(venv / "bin" / "python"), *args], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, cwd=tmp_path, env=_clean_env(venv))
    assert "Traceback" not in run.stdout + run.stderr, f"{args}: a traceback\n{run.stdout}\n{run.stderr}"
    return run


def _last_line(run: subprocess.CompletedProcess) -> str:
    lines = run.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _check_variant(venv: Path, tmp_path: Path, mpiexec) -> None:
    info = _run(venv, tmp_path, ["-m", "symmring", "info"])
    assert info.returncode == 0, info.stdout + info.stderr
    assert _last_line(info).startswith("GPU environment (symmring.env.GPU_ENV): NVSHMEM_DISABLE_NVLS=1"), info.stdout
    assert "backend (auto): host -- " in info.stdout
    demo = _run(venv, tmp_path, DEMO)
    assert demo.returncode == 0 and _last_line(demo).startswith("demo: PASS backend=host ranks=1 "), \
        demo.stdout + demo.stderr
    if mpiexec is not None:
        demo4 = _run(venv, tmp_path, DEMO, prefix=(mpiexec, "-n", "4"))
        last = _last_line(demo4)
        assert demo4.returncode == 0 and last.startswith("demo: PASS backend=host ranks=4 "), \
            demo4.stdout + demo4.stderr
    # The installed scripts: the console script, and the bash wrapper of the launcher finding the venv's python
    # beside it (its output is the venv's `python -m symmring.launch --print-env`).
    helps = subprocess.run([str(venv / "bin" / "symmring"), "--help"], capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S, cwd=tmp_path, env=_clean_env(venv))
    assert helps.returncode == 0 and "bench stream" in helps.stdout, helps.stdout + helps.stderr
    exports = subprocess.run(["bash", str(venv / "bin" / "symmring-mpirun"), "--print-env"], capture_output=True,
                             text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path, env=_clean_env(venv))
    assert exports.returncode == 0 and exports.stderr == "", exports.stderr
    assert "export NVSHMEM_DISABLE_NVLS=1" in exports.stdout
    assert exports.stdout == _run(venv, tmp_path, ["-m", "symmring.launch", "--print-env"]).stdout


@pytest.fixture(scope="module")
def core_venv(source) -> Path:
    return _install(source, source.parent, "")


def test_core_install_runs_info_and_demo(core_venv, tmp_path):
    """``pip install symmring``: no mpi4py, no mpich wheel; one process needs no MPI library."""
    venv = core_venv
    info = _run(venv, tmp_path, ["-m", "symmring", "info"])
    mpi_line = next(line for line in info.stdout.splitlines() if line.startswith("mpi4py:"))
    system_mpi = "MPI library: none" not in mpi_line
    if not system_mpi:
        assert 'pip install "symmring[mpi]"' in mpi_line, mpi_line
    # An mpiexec of the system (not the venv's: there is none) is used only when mpi4py found an MPI library.
    mpiexec = shutil.which("mpiexec", path=_clean_env(venv)["PATH"]) if system_mpi else None
    _check_variant(venv, tmp_path, mpiexec)


def test_core_install_under_a_launcher_without_mpi_library_fails_in_one_line(core_venv, tmp_path):
    """What ``mpiexec -n 4`` of another MPI looks like to a core install that finds no MPI library."""
    venv = core_venv
    environ = dict(_clean_env(venv), MPI4PY_LIBMPI=str(tmp_path / "no-libmpi.so"), PMI_SIZE="4", PMI_RANK="0")
    run = subprocess.run([str(venv / "bin" / "python"), *DEMO], capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, cwd=tmp_path, env=environ)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stdout + run.stderr
    assert lines[0].startswith("demo: FAIL this process is one of 4 ranks") and "symmring[mpi]" in lines[0]
    assert "Traceback" not in run.stderr


def test_mpi_install_runs_info_and_demo_also_on_4_ranks(source, tmp_path):
    """``pip install "symmring[mpi]"``: the mpich wheel brings libmpi and mpiexec."""
    venv = _install(source, tmp_path, "mpi")
    info = _run(venv, tmp_path, ["-m", "symmring", "info"])
    mpi_line = next(line for line in info.stdout.splitlines() if line.startswith("mpi4py:"))
    assert "MPI library: MPICH" in mpi_line, mpi_line
    mpiexec = venv / "bin" / "mpiexec"
    assert mpiexec.is_file(), "the mpich wheel installs mpiexec into the venv"
    _check_variant(venv, tmp_path, str(mpiexec))


def test_cpu_install_under_torchrun_needs_no_mpi(source, tmp_path):
    """``pip install "symmring[cpu]"`` (torch's CPU build, no MPI of any kind): ``torchrun --nproc-per-node 3 -m
    symmring demo`` is one job of 3 ranks (torch.distributed's store, POSIX shared memory), not three of one."""
    venv = _install(source, tmp_path, "cpu")
    no_mpi = _run(venv, tmp_path, ["-c", "import importlib.util as u; print(u.find_spec('mpi4py') is None)"])
    assert no_mpi.stdout.strip() == "True", no_mpi.stdout + no_mpi.stderr
    run = _run(venv, tmp_path, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", *DEMO])
    passes = [line for line in run.stdout.splitlines() if line.startswith("demo: PASS")]
    assert run.returncode == 0 and len(passes) == 1 and passes[0].startswith("demo: PASS backend=host ranks=3 "), \
        run.stdout + run.stderr
