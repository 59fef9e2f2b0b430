"""The command line holds: every command in the top-level help, helps that exit 0 and read as plain
text, one-line errors for what is missing, and -v / SYMMRING_LOG_LEVEL showing the library's INFO lines."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from symmring import ConfigError, env
from symmring.__main__ import BENCHMARKS, COMMANDS, _run, main, split_verbosity

DEMO = ["demo", "--tokens", "8", "--repeats", "0"]


def _cli(args, tmp_path, **extra_env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SYMMRING_") and k != "PYTEST_ADDOPTS"}
    environ.update(extra_env)
    return subprocess.run([sys.executable, "-m", "symmring", *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=environ)


def test_top_level_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        if name != "bench":
            assert f"\n  {name} " in out, name
    for name in ("protocol", "moe", "stream", "gemm"):
        assert name in BENCHMARKS and f"\n  bench {name} " in out, name
    assert "-v, --verbose" in out and "python -m symmring.launch" in out
    assert main([]) == 2  # no command: the help on stderr, status 2
    assert "usage: python -m symmring" in capsys.readouterr().err


def test_bench_help_exits_0_and_lists_the_benchmarks(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in BENCHMARKS)
    assert main(["bench"]) == 2 and "benchmarks (GPU):" in capsys.readouterr().err
    assert main(["bench", "nope"]) == 2 and "unknown benchmark 'nope'" in capsys.readouterr().err


def test_bench_gemm_is_registered():
    assert BENCHMARKS["gemm"] == "symmring.bench.gemm"


@pytest.mark.parametrize("args", [["info", "--help"], ["demo", "--help"], ["bench", "protocol", "--help"],
                                  ["bench", "moe", "--help"], ["bench", "stream", "--help"],
                                  ["bench", "gemm", "--help"]])
def test_command_help_exits_0_in_plain_text(args, tmp_path):
    run = _cli(args, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m symmring")
    assert "``" not in run.stdout and "`symmring." not in run.stdout, run.stdout


def test_missing_optional_dependency_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "needs_nvshmem_mod.py").write_text("import nvidia.nvshmem_not_a_module\n")
    (tmp_path / "needs_unknown_mod.py").write_text("import not_a_dependency_of_symmring\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _run("bench x", "needs_nvshmem_mod", []) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("symmring bench x: ") and 'pip install "symmring[device]"' in err[0]
    with pytest.raises(ModuleNotFoundError):  # not an optional dependency: a real bug, not hidden
        _run("bench y", "needs_unknown_mod", [])


def test_split_verbosity():
    assert split_verbosity(["demo", "-v"]) == (1, ["demo"])
    assert split_verbosity(["-vv", "info"]) == (2, ["info"])
    assert split_verbosity(["bench", "stream", "--", "-v"]) == (0, ["bench", "stream", "--", "-v"])


def test_log_level_from_the_environment(monkeypatch):
    monkeypatch.delenv("SYMMRING_DEBUG", raising=False)
    monkeypatch.delenv("SYMMRING_LOG_LEVEL", raising=False)
    assert env.log_level() is None
    monkeypatch.setenv("SYMMRING_DEBUG", "1")
    assert env.log_level() == logging.DEBUG
    monkeypatch.setenv("SYMMRING_LOG_LEVEL", "info")
    assert env.log_level() == logging.INFO
    monkeypatch.setenv("SYMMRING_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="SYMMRING_LOG_LEVEL='loud'"):
        env.log_level()


@pytest.mark.parametrize("how", ["-v", "SYMMRING_LOG_LEVEL=INFO", "quiet"])
def test_verbose_shows_backend_choice_and_layer_setup_on_stderr(how, tmp_path):
    from symmring.backends.nvshmem import gpu_available
    if gpu_available():
        pytest.skip("checks the lines of a CPU machine's demo (backend host); here auto picks the GPU")
    if how == "-v":
        run = _cli(DEMO + ["-v"], tmp_path)
    elif how == "quiet":
        run = _cli(DEMO, tmp_path)
    else:
        run = _cli(DEMO, tmp_path, SYMMRING_LOG_LEVEL="INFO")
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1].startswith("demo: PASS"), run.stdout + run.stderr
    info_lines = [line for line in run.stderr.splitlines() if line.startswith("INFO ")]
    if how == "quiet":
        assert info_lines == [], run.stderr
        return
    assert any(line.startswith("INFO symmring.backends.nvshmem: no GPU backend: ") for line in info_lines), \
        run.stderr  # why "auto" chose the host backend (this CPU machine)
    assert any(line.startswith("INFO symmring.context: ") and "uses the host backend" in line for line in info_lines)
    assert any(line.startswith("INFO symmring.moe.cpu.layer: ExpertParallelMoE on rank 0/1") for line in info_lines)
    assert not any(line.startswith("DEBUG ") for line in run.stderr.splitlines())


def test_bad_log_level_is_one_line(tmp_path):
    run = _cli(["info"], tmp_path, SYMMRING_LOG_LEVEL="loud")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "symmring: SYMMRING_LOG_LEVEL='loud': expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL or a number"]


def test_progress_lines_go_to_stderr_on_rank_0_only(capsys):
    from symmring.bench import progress
    progress("bench moe", 2, 5, "mixtral n=128: 0.100 ms")
    progress("bench moe", 2, 5, "mixtral n=128: 0.100 ms", rank=1)
    progress("bench stream", 7, None, "qwen3 n=64", started_s=0.0)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == "bench moe: [2/5] mixtral n=128: 0.100 ms"
    assert len(lines) == 2 and lines[1].startswith("bench stream: [7] qwen3 n=64 (") and lines[1].endswith(" s)")


def test_demo_model_under_mpiexec_passes(tmp_path):
    """``mpiexec -n 2 python -m symmring demo --model deepseek-v3``: a tiny DeepSeek-V3 with its MoE blocks
    replaced by the CPU layer, its logits against the unreplaced model's on both ranks: PASS, exit 0."""
    pytest.importorskip("torch", reason='needs torch (pip install "symmring[cpu]")')
    pytest.importorskip("transformers", reason='needs transformers (pip install "symmring[hf]")')
    from test_under_mpi import find_mpiexec
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to sys.executable or on PATH (pip install -e '.[mpi]' provides one)")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SYMMRING_") and k != "PYTEST_ADDOPTS"}
    run = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "symmring", "demo", "--model", "deepseek-v3"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environ)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines[-1].startswith("demo: PASS model=deepseek-v3 backend=host ranks=2"), lines[-1]
    assert sum(line.split()[:1] in (["0"], ["1"]) for line in lines) == 2  # one table row per rank


def test_demo_model_bad_name_is_an_argument_error(tmp_path):
    run = _cli(["demo", "--model", "llama"], tmp_path)
    assert run.returncode == 2 and "invalid choice: 'llama'" in run.stderr
