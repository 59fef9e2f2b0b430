"""The README's Python example runs as written (it stays true as the API changes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    script = tmp_path / "readme_example.py"
    script.write_text(blocks[0])
    # A fresh interpreter: the example calls symmring.init(), which joins MPI as a world of 1.
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


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
