"""End to end on a CPU: vLLM's ``LLM`` on tiny random DeepSeek-V3-like and Qwen3-MoE-like models saved locally
(made from a config, no download), with vLLM's own experts and with symmring's (``SYMMRING_VLLM=1``: the
installed plugin entry point, loaded by vLLM in its engine and worker processes).

Each run is a process of its own (tests/with_vllm/generate.py); the Qwen3-MoE runs put vLLM's engine core and
worker in processes of their own too, as a server does. What must agree:

* the log of the symmring run names every MoE layer as run by symmring (the plugin selected it);
* teacher forcing: both runs score the same fixed token sequences; the tokens' logprobs agree within
  `SCORE_MEAN_ATOL` on average and `SCORE_ATOL` each (vLLM's CPU experts round their intermediates to bf16,
  symmring's CPU layer accumulates in float32; where that flips an expert choice of a later layer, DeepSeek's
  group-limited routing above all, one token's logprob moves by up to a few tenths);
* greedy generation: the same tokens, step by step. Where vLLM's own run had a near-tie (its two best candidates
  within `TIE` nats: the random tiny models give flat distributions, and either candidate is then a correct
  greedy choice) symmring's token must be one of the near-tied ones; if it is the other one, the two runs
  continue from different contexts and the comparison of that prompt stops there, else it goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: Bound of one generation run (import, model build, generation) on a loaded 2-core machine.
RUN_TIMEOUT_S = 420
#: Largest difference of one token's logprob between the runs (nats), and of their mean.
SCORE_ATOL, SCORE_MEAN_ATOL = 0.25, 0.01
#: Two greedy candidates closer than this (nats) are a near-tie.
TIE = 0.02
#: MoE layers of the tiny models (DeepSeek-V3: one dense layer first, then these).
MOE_LAYERS = 2


def save_model(family: str, path: Path) -> None:
    from symmring.moe.integrations.tiny import tiny_model
    overrides = {}
    if family == "deepseek_v3":
        # vLLM's CPU MLA decode kernel is built for DeepSeek's latent size only (kv_lora_rank + rope = 576).
        overrides = dict(kv_lora_rank=512, qk_rope_head_dim=64)
    model, _ = tiny_model(family, seed=0, **overrides)
    model.save_pretrained(path)
    if family == "deepseek_v3":
        # What DeepSeek-V3's own config.json says and transformers 5 no longer writes: vLLM reads it to give the
        # router its score-correction bias (sigmoid scores, group-limited top-k).
        config = json.loads((path / "config.json").read_text())
        config.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (path / "config.json").write_text(json.dumps(config, indent=1))


def run_in_session(cmd, env):
    """``(stdout, stdout + stderr, exit status)`` of ``cmd`` run in a session of its own, whose every process is
    ended when it returns or passes `RUN_TIMEOUT_S`: vLLM's engine core process can outlive the script."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)}: no result within {RUN_TIMEOUT_S} s:\n{(stdout + stderr)[-6000:]}")
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the session (an engine core that did not exit)
    except ProcessLookupError:
        pass
    return stdout, stdout + stderr, proc.returncode


def generate(path: Path, *, symmring: bool, processes: bool = False, dp_shares: int = 1) -> tuple:
    """One run's result and log. ``processes``: vLLM's engine core and worker in processes of their own, as a
    server runs them (the plugin then loads in each); else in the run's process. Compare runs of one mode
    only: the mode alone moves vLLM's own logprobs by a few hundredths (its CPU worker sets other thread
    counts). ``dp_shares``: each of that many data-parallel ranks' share of the prompts generated as a batch of
    its own (generate.py's ``--dp-shares``)."""
    env = dict(os.environ, SYMMRING_VLLM="1" if symmring else "0", SYMMRING_LOG_LEVEL="INFO",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if processes else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, str(HERE / "generate.py"), str(path), "--dp-shares", str(dp_shares)]
    stdout, output, returncode = run_in_session(cmd, env)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and lines, output[-6000:]
    return json.loads(lines[-1][len("RESULT "):]), output


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    paths = {}
    for family in ("deepseek_v3", "qwen3_moe"):
        paths[family] = root / family
        save_model(family, paths[family])
    return paths


def compared_steps(reference: dict, candidate: dict, prompts=None) -> int:
    """Greedy steps compared (module docstring) of the ``prompts`` given (indices; all by default), asserting
    agreement on each."""
    compared = 0
    for prompt in range(len(reference["tokens"])) if prompts is None else prompts:
        want, got = reference["tokens"][prompt], candidate["tokens"][prompt]
        for step, (w, g) in enumerate(zip(want, got)):
            (best, best_lp), (second, second_lp) = reference["top2"][prompt][step]
            assert best == w
            if best_lp - second_lp < TIE:
                assert g in (best, second), (prompt, step, want, got, reference["top2"][prompt][step])
                if g != w:
                    break  # the other near-tied token: the runs go on from different contexts
            else:
                assert g == w, (f"prompt {prompt} step {step}: symmring chose {g}, vLLM {w} (margin "
                                f"{best_lp - second_lp:.3f} nats); tokens {got} vs {want}")
            compared += 1
    return compared


@pytest.mark.parametrize("family, processes", [("deepseek_v3", False), ("qwen3_moe", True)])
def test_greedy_generation_equals_vllm_experts(models, family, processes):
    reference, _ = generate(models[family], symmring=False, processes=processes)
    candidate, log = generate(models[family], symmring=True, processes=processes)
    layers = [line for line in log.splitlines() if "on EP rank 0 of 1" in line and "symmring:" in line]
    assert len(layers) == MOE_LAYERS, log[-4000:]
    diffs = [abs(a - b) for want, got in zip(reference["scores"], candidate["scores"]) for a, b in zip(want, got)]
    assert len(diffs) == 3 * 23
    assert max(diffs) < SCORE_ATOL and sum(diffs) / len(diffs) < SCORE_MEAN_ATOL, diffs
    steps = compared_steps(reference, candidate)
    total = sum(len(t) for t in reference["tokens"])
    print(f"[figure] vllm e2e {family}: {steps}/{total} greedy steps compared and equal; logprobs max diff "
          f"{max(diffs):.4f}, mean {sum(diffs) / len(diffs):.4f}")
    assert steps >= total // 3, (steps, total)
