"""One GPU environment policy (symmring.env.GPU_ENV), applied by the backend, the launcher (also through
launch/symmring-mpirun) and tools/.

No GPU is needed: the backend's environment step runs in `gpu_available` before any CUDA call, and the
launchers are run with a stand-in MPI launcher that starts the rank command once, so the rank's
interpreter and environment can be read back.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from symmring import env
from symmring.launch import rank_command

ROOT = Path(__file__).resolve().parents[1]
BASH_LAUNCHER = ROOT / "launch" / "symmring-mpirun"
NAMES = [d.name for d in env.GPU_ENV]
#: What a rank prints: its interpreter and the policy's variables.
PROBE = ("import json, os, sys; print('RANK ' + json.dumps({'exe': sys.executable, "
         f"'env': {{k: os.environ.get(k) for k in {NAMES!r}}}}}))")


def _env_without_policy(**extra):
    environ = {k: v for k, v in os.environ.items() if k not in NAMES and k != "SYMMRING_PYTHON"}
    environ.pop("PYTEST_ADDOPTS", None)
    environ.update(extra)
    return environ


def _exports(text: str) -> dict:
    """``export K=V`` lines as a dict (values unquoted by bash itself)."""
    out = subprocess.run(["bash", "-c", f'{text}\nfor n in {" ".join(NAMES)}; do echo "$n=${{!n}}"; done'],
                         capture_output=True, text=True, check=True, env=_env_without_policy()).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


@pytest.fixture
def fake_mpirun(tmp_path):
    """An "MPI launcher" that drops ``-n N`` and runs the rank command once, in this environment."""
    path = tmp_path / "fake-mpirun"
    path.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake launcher"; exit 0; }\nshift 2\nexec "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def decoy_path(tmp_path):
    """A PATH whose first ``python``/``python3`` is not this interpreter (as an MPI launcher's PATH was)."""
    bin_dir = tmp_path / "decoy-bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        decoy = bin_dir / name
        decoy.write_text("#!/bin/sh\necho 'decoy python ran' >&2\nexit 3\n")
        decoy.chmod(decoy.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _rank_report(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("RANK ")]
    assert len(lines) == 1, run.stdout + run.stderr
    return json.loads(lines[0][5:])


def test_table_has_one_reason_per_variable_and_the_issue_values():
    assert env.gpu_env_defaults() == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none",
                                      "CUDA_MODULE_LOADING": "EAGER", "NCCL_NVLS_ENABLE": "0",
                                      "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert all(d.reason and "\n" not in d.reason for d in env.GPU_ENV)
    assert [d.name for d in env.GPU_ENV if d.one_node_only] == ["NVSHMEM_REMOTE_TRANSPORT"]
    assert env.gpu_env_defaults(2) == env.gpu_env_defaults(None) == {
        k: v for k, v in env.gpu_env_defaults().items() if k != "NVSHMEM_REMOTE_TRANSPORT"}


def test_apply_keeps_user_values_and_fills_empty_ones():
    environ = {"NCCL_NVLS_ENABLE": "1", "CUDA_MODULE_LOADING": ""}
    applied = env.apply_gpu_env(environ)
    assert environ == {**env.gpu_env_defaults(), "NCCL_NVLS_ENABLE": "1"}
    assert set(applied) == set(NAMES) - {"NCCL_NVLS_ENABLE"}
    assert env.apply_gpu_env(environ) == {}  # idempotent


def test_backend_env_step_applies_the_table(monkeypatch):
    """`gpu_available` (the backend's first step, before any CUDA call) sets the table but the one-node
    transport, which waits for the node count; `node_env` then sets it on one node only, and a user value
    stays in every case."""
    from symmring.backends import nvshmem
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    nvshmem.gpu_available()
    assert {n: os.environ.get(n) for n in NAMES} == {**env.gpu_env_defaults(), "NVSHMEM_REMOTE_TRANSPORT": None}
    one, two, users = dict(os.environ), dict(os.environ), {**os.environ, "NVSHMEM_REMOTE_TRANSPORT": "ucx"}
    assert nvshmem.node_env(1, one) == {"NVSHMEM_REMOTE_TRANSPORT": "none"}
    assert nvshmem.node_env(2, two) == {} and "NVSHMEM_REMOTE_TRANSPORT" not in two
    assert nvshmem.node_env(1, users) == {} and users["NVSHMEM_REMOTE_TRANSPORT"] == "ucx"


def test_node_env_logs_the_transport_and_warns_on_none_across_nodes(caplog):
    from symmring.backends import nvshmem
    with caplog.at_level(logging.INFO, logger="symmring.backends.nvshmem"):
        nvshmem.node_env(1, {})
        nvshmem.node_env(2, {"NVSHMEM_IB_ENABLE_IBGDA": "1"})
        nvshmem.node_env(2, {}, rank=3)  # only rank 0 says it
        nvshmem.node_env(4, {"NVSHMEM_REMOTE_TRANSPORT": "none"}, rank=3)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("INFO", "nvshmem backend: one node: NVSHMEM_REMOTE_TRANSPORT=none (no network transport)"),
        ("INFO", "nvshmem backend: 2 nodes: NVSHMEM_REMOTE_TRANSPORT left to NVSHMEM (its default: ibrc, the CPU "
                 "proxy), NVSHMEM_IB_ENABLE_IBGDA=1"),
        ("WARNING", "nvshmem backend: 4 nodes: NVSHMEM_REMOTE_TRANSPORT=none (yours), NVSHMEM_IB_ENABLE_IBGDA unset "
                    "(IBGDA off); peers on other nodes are then reachable only if nvshmem_ptr maps them (a "
                    "multi-node NVLink domain), otherwise NVSHMEM cannot reach them")], lines


def test_rank_command_rewrites_only_bare_python():
    assert rank_command(["python", "-c", "1"]) == [sys.executable, "-c", "1"]
    assert rank_command(["python3", "x.py"]) == [sys.executable, "x.py"]
    assert rank_command(["/opt/py/bin/python3", "x.py"]) == ["/opt/py/bin/python3", "x.py"]
    assert rank_command(["pytest", "python"]) == ["pytest", "python"]


def test_python_launcher_ranks_get_its_interpreter_and_the_table(fake_mpirun, decoy_path, tmp_path):
    environ = _env_without_policy(PATH=decoy_path, CUDA_MODULE_LOADING="LAZY")
    run = subprocess.run([sys.executable, "-m", "symmring.launch", "-n", "2", "--mpirun", str(fake_mpirun), "--",
                          "python3", "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=environ)
    report = _rank_report(run)
    assert report["exe"] == sys.executable
    assert report["env"] == {**env.gpu_env_defaults(), "CUDA_MODULE_LOADING": "LAZY"}


def test_python_launcher_help_and_print_env(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "symmring.launch", "--help"], capture_output=True, text=True,
                               timeout=60, cwd=tmp_path, env=_env_without_policy()).stdout
    assert "`python` or `python3` runs with this launcher's own interpreter" in help_text
    assert all(name in help_text for name in NAMES)
    out = subprocess.run([sys.executable, "-m", "symmring.launch", "--print-env"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env=_env_without_policy(), check=True).stdout
    assert _exports(out) == env.gpu_env_defaults()


@pytest.mark.parametrize("user", [{}, {"NCCL_NVLS_ENABLE": "1 2"}])
def test_bash_launcher_print_env_is_the_python_launchers(user, tmp_path):
    """launch/symmring-mpirun runs ``python -m symmring.launch``: its ``--print-env`` is the Python launcher's,
    to the byte, a user-set value kept."""
    environ = _env_without_policy(SYMMRING_PYTHON=sys.executable, **user)
    wrapper, python = (subprocess.run(cmd + ["--print-env"], capture_output=True, text=True, timeout=60,
                                      cwd=tmp_path, env=environ)
                       for cmd in (["bash", str(BASH_LAUNCHER)], [sys.executable, "-m", "symmring.launch"]))
    assert (wrapper.returncode, wrapper.stderr) == (0, ""), wrapper.stderr
    assert wrapper.stdout == python.stdout
    assert _exports(wrapper.stdout) == {**env.gpu_env_defaults(), **user}


def test_bash_launcher_without_a_usable_python_fails_in_one_line(tmp_path):
    run = subprocess.run(["bash", str(BASH_LAUNCHER), "--print-env"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=_env_without_policy(SYMMRING_PYTHON=str(tmp_path / "no-such-python")))
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    assert run.stderr.startswith("symmring-mpirun: ") and "SYMMRING_PYTHON" in run.stderr, run.stderr


def test_bash_launcher_ranks_get_its_interpreter_and_the_table(fake_mpirun, decoy_path, tmp_path):
    """The interpreter that runs the Python launcher for the bash script: SYMMRING_PYTHON names it; without
    it, the python3 installed beside the script (a venv's bin/) wins over the PATH's."""
    installed = tmp_path / "venv-bin"
    installed.mkdir()
    (installed / "symmring-mpirun").write_bytes(BASH_LAUNCHER.read_bytes())
    beside = installed / "python3"  # this venv's interpreter, as a venv's bin/python3 would be
    beside.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    beside.chmod(beside.stat().st_mode | stat.S_IEXEC)
    for script, extra in ((BASH_LAUNCHER, {"SYMMRING_PYTHON": sys.executable}), (installed / "symmring-mpirun", {})):
        environ = _env_without_policy(PATH=decoy_path, TORCH_SYMM_MEM_DISABLE_MULTICAST="0", **extra)
        run = subprocess.run(["bash", str(script), "-n", "2", "--mpirun", str(fake_mpirun), "--", "python", "-c",
                              PROBE], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=environ)
        report = _rank_report(run)
        assert Path(report["exe"]).resolve() == Path(sys.executable).resolve(), script
        assert report["env"] == {**env.gpu_env_defaults(), "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}


def test_every_gpu_tool_sources_the_common_helper_and_sets_no_policy_variable_itself():
    tools = sorted((ROOT / "tools").glob("*.sh"))
    assert {p.name for p in tools} >= {"gpu_common.sh", "gpu_check.sh", "multi_gpu_check.sh"}
    assignment = re.compile(r"\b(" + "|".join(NAMES) + r")=")
    for path in tools:
        text = path.read_text()
        assert not assignment.search(text), f"{path.name} sets a GPU_ENV variable itself"
        if path.name != "gpu_common.sh":
            assert 'source "$(dirname "$0")/gpu_common.sh"' in text, f"{path.name} does not source gpu_common.sh"


def test_sourcing_gpu_common_exports_the_table(tmp_path):
    environ = _env_without_policy(OUT=str(tmp_path / "out"), PYTHON=sys.executable, NVSHMEM_DISABLE_NVLS="1")
    run = subprocess.run(["bash", "-c", f'source tools/gpu_common.sh && for n in {" ".join(NAMES)}; do '
                          'echo "$n=${!n}"; done; env | grep -c "^PYTHONPATH="'], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=environ)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert dict(line.split("=", 1) for line in lines[:-1]) == env.gpu_env_defaults()


def test_docs_list_the_table():
    """README's and env.py's environment tables name every variable with its value."""
    readme = (ROOT / "README.md").read_text()
    for default in env.GPU_ENV:
        value = default.value + ("` (one node only)" if default.one_node_only else "`")
        assert re.search(rf"\| `{default.name}` \|.*`{re.escape(value)} \|", readme), default.name
        value = default.value + ("`` (one node only)" if default.one_node_only else "``")
        assert f"| ``{default.name}`` | ``{value} |" in env.__doc__, default.name
