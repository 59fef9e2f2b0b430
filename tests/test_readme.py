"""The README's Python examples run as written (they stay true as the API changes): every ``python`` block in a
fresh interpreter (the CPU backend here; a block that imports torch needs it), every ``py`` block (GPU only)
at least compiles; and the environment table's defaults are the code's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(kind: str):
    return re.findall(r"```" + kind + r"\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_readme_python_examples_run(tmp_path, index):
    block = _blocks("python")[index]
    if re.search(r"^import torch", block, flags=re.M):
        pytest.importorskip("torch", reason="the example uses torch (the cpu or gpu extra)")
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(block)
    # A fresh interpreter: the example calls symmring.init(), which joins MPI as a world of 1.
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_examples_cover_the_layer():
    """The examples run in CI include the MoE layer (`symmring.MoE`) and its workspace and step; the GPU-only
    ones compile."""
    run = "\n".join(_blocks("python"))
    assert len(_blocks("python")) >= 2 and "symmring.MoE(" in run and "ws.step(" in run
    for block in _blocks("py"):
        compile(block, "README.md (a GPU example)", "exec")


def test_readme_environment_defaults_are_the_codes():
    """The environment table's default of ``SYMMRING_GRAPH_CACHE`` is `ScheduleConfig.graph_cache`'s (the README
    said 8 while the code kept 12)."""
    from symmring.moe.config import ScheduleConfig
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `SYMMRING_GRAPH_CACHE`"))
    default = row.strip().strip("|").split("|")[-1]
    assert re.findall(r"`(\d+)`", default) == [str(ScheduleConfig().graph_cache)], row


def test_readme_commands_are_what_ci_runs():
    """The Quick start's install and test commands are the ones .ci/run runs (the README says so)."""
    ci = (README.parent / ".ci" / "run").read_text()
    readme = README.read_text()
    install = re.search(r'pip install -q (-e "\.\[[a-z,]+\]")', ci)
    assert install is not None
    assert f'pip install {install.group(1)} && python -m symmring demo' in readme
    extras = set(re.search(r"\[([a-z,]+)\]", install.group(1)).group(1).split(","))
    assert {"cpu", "hf", "mpi", "test"} <= extras  # torch and transformers paths run in CI
    test = re.search(r"^python -m pytest (.+)$", ci, flags=re.M)
    assert test is not None and f"python -m pytest {test.group(1)}" in readme


def test_readme_vllm_commands_are_what_ci_runs():
    """The vLLM stage of .ci/run installs and tests with the commands of the README's "Serving with vLLM"."""
    ci = (README.parent / ".ci" / "run").read_text()
    readme = README.read_text()
    install = re.search(r'pip install -q (-e "\.\[[a-z,]+,vllm\]")', ci)
    uninstall = re.search(r"pip uninstall -q -y ([a-z ]+)\n", ci)
    assert install is not None and uninstall is not None
    assert f"pip install {install.group(1)} && pip uninstall -y {uninstall.group(1)}" in readme
    assert "\npython -m pytest -q -m vllm\n" in ci and "\npython -m pytest -q -m vllm\n" in readme
