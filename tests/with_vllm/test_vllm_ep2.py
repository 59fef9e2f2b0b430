"""Two ranks of expert parallelism (CPU) with symmring's experts class in vLLM, symmring joining vLLM's EP group
(``symmring.init(group=...)``) and taking vLLM's data-parallel token counts as given.

* kernel level (tests/with_vllm/ep2_worker.py under ``torchrun --nproc-per-node 2``): each rank's rows from
  `SymmringExperts` over the two ranks equal vLLM's own unquantized path (one rank, every expert) on the same
  inputs within bf16 tolerance; fp8 blocks against the dequantised weights; zero host exchanges in its calls.
* end to end, on the tiny Qwen3-MoE-like and DeepSeek-V3-like models: vLLM's CPU build does not run
  data-parallel expert parallelism itself (0.32: its allgather/reduce-scatter all2all calls ``all_gatherv``,
  which the CPU communicator does not implement; vLLM's offline DP launch, one process per DP rank with
  ``VLLM_DP_RANK``/``VLLM_DP_SIZE``, gets that far), so a two-DP-rank ``LLM`` with symmring's experts (the
  pass-through prepare/finalize: no vLLM all2all; tests/with_vllm/generate_dp.py) is compared with vLLM at one
  rank generating each DP rank's share of the prompts as a batch of its own. That batch composition is the
  reference's, not the whole batch's: vLLM's CPU kernels round by batch, and on the tiny DeepSeek-V3 a prompt
  generated alone and in the three-prompt batch part at a step whose margin (0.035 nats) is above the near-tie
  rule's, with vLLM's experts as with symmring's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def torchrun(script: Path, nproc: int, *args: str):
    from test_vllm_e2e import run_in_session
    exe = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    _, output, returncode = run_in_session([exe, "--standalone", "--nproc-per-node", str(nproc), str(script), *args],
                                           env)
    return returncode, output


def marked_json(output: str, marker: str) -> list:
    """Every JSON value that follows ``marker`` in ``output``, wherever the ranks' interleaved output put it."""
    decoder, found, at = json.JSONDecoder(), [], output.find(marker)
    while at >= 0:
        value, end = decoder.raw_decode(output, at + len(marker))
        found.append(value)
        at = output.find(marker, end)
    return found


def test_two_ranks_equal_vllm_unquantized_with_no_host_exchange():
    rc, output = torchrun(HERE / "ep2_worker.py", 2)
    results = marked_json(output, "EP2 RESULT ")
    assert rc == 0 and len(results) == 2, output[-6000:]
    for rank in results:
        for case in rank["results"]:
            print(f"[figure] vllm ep2 kernel: rank {rank['rank']}, {'fp8' if case['fp8'] else 'bf16'}, counts "
                  f"{case['counts']}: max error {case['max_error']:.4f} (largest value {case['scale']:.3f}), host "
                  f"exchanges {case['exchanges']} in {case['calls']} calls")
            tol = 3e-2 * max(1.0, case["scale"])
            assert case["max_error"] <= tol, (rank["rank"], case)
            assert case["exchanges"] == 0, (rank["rank"], case)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_two_rank_generation_equals_one_rank_vllm_on_each_ranks_share(tmp_path, family):
    from test_vllm_e2e import compared_steps, generate, run_in_session, save_model
    path = tmp_path / family
    save_model(family, path)
    # The reference: one-rank vLLM generating each DP rank's share of the prompts as a batch of its own.
    reference, _ = generate(path, symmring=False, dp_shares=2)
    env = dict(os.environ, SYMMRING_VLLM="1", PYTHONPATH=str(ROOT))
    stdout, output, returncode = run_in_session([sys.executable, str(HERE / "generate_dp.py"), str(path), "2"], env)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and lines, output[-6000:]
    candidate = json.loads(lines[-1][len("RESULT "):])
    # Both DP ranks ran symmring over the 2-rank EP group, with calls, and exchanged nothing while generating.
    assert [(s["rank"], s["ep_size"]) for s in candidate["ranks"]] == [(0, 2), (1, 2)], candidate["ranks"]
    assert all(s["moe_calls"] > 0 and s["host_exchanges"] == 0 for s in candidate["ranks"]), candidate["ranks"]
    # Each rank's prompts were one batch of the reference too: the same batch composition.
    assert [s["prompts"] for s in candidate["ranks"]] == reference["batches"], (candidate["ranks"], reference)
    total = 0
    for stats in candidate["ranks"]:
        steps = compared_steps(reference, candidate, stats["prompts"])
        total += steps
        print(f"[figure] vllm ep2 generate {family}: DP/EP rank {stats['rank']} of {stats['ep_size']}, prompts "
              f"{stats['prompts']}: symmring calls {stats['moe_calls']}, host exchanges {stats['host_exchanges']} "
              f"{stats['what']}; greedy steps equal to one-rank vLLM on the same batch {steps} of "
              f"{sum(len(reference['tokens'][i]) for i in stats['prompts'])}")
    assert total >= sum(len(t) for t in reference["tokens"]) // 3
