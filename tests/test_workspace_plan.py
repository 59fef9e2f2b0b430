"""The workspace planner (`symmring.moe.workspace_plan`, ``python -m symmring plan``) and a live host workspace."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from symmring import init
from symmring import plan as plan_cli
from symmring.errors import ConfigError
from symmring import Experts, MoE, RoutingConfig
from symmring.moe.workspace import Workspace
from symmring.moe.workspace_plan import PRESETS, REGIONS, LayerShape, expert_arena, plan, uniform_rows, worst_rows

DEEPSEEK = LayerShape(**{k: v for k, v in PRESETS["deepseek-v3"].items() if k != "layers"})


def _cli(*args: str) -> str:
    """``python -m symmring plan ARGS`` in this process (the same ``main`` the command runs)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_cli.main(list(args)) == 0
    return out.getvalue()


def test_cli_total_is_the_plans_and_independent_of_layers():
    out58 = _cli("--preset", "deepseek-v3", "--ranks", "8", "--max-tokens", "4096", "--layers", "58")
    out2 = _cli("--preset", "deepseek-v3", "--ranks", "8", "--max-tokens", "4096", "--layers", "2")
    expected = plan([DEEPSEEK], world_size=8, max_tokens=4096)
    last = f"total per PE: {expected.total} bytes ({expected.total / 2**20:.1f} MiB)"
    assert out58.splitlines()[-1] == last and out2.splitlines()[-1] == last
    for name in REGIONS:  # one line per region, with the plan's bytes
        assert any(line.startswith(name) and f"{expected.regions[name]:,d} bytes" in line for line in out58.splitlines())
    # Today's per-layer worst-case sizing (one pool row per (rank, token, k) + padding, per layer) is far above.
    assert expected.pool_rows[DEEPSEEK] * 8 <= worst_rows(DEEPSEEK, 8, 4096)


def test_default_fits_a_gib_and_the_experts_parts_overlap_by_lifetime():
    """DeepSeek-V3 at EP8, 4096 tokens per rank: the default (a window of the whole call) is at most 1 GiB
    per PE because the experts' parts that are never alive at once share bytes."""
    free = plan([DEEPSEEK], world_size=8, max_tokens=4096)
    assert free.window_tokens == 4096 and free.total <= 2**30
    arena = expert_arena(DEEPSEEK, free.pool_rows[DEEPSEEK])
    side_by_side = sum(size for part, (_, size) in arena.items() if part != "total")
    assert free.regions["experts"] == arena["total"][1] < 0.55 * side_by_side

    def overlap(a, b):
        (oa, sa), (ob, sb) = arena[a], arena[b]
        return oa < ob + sb and ob < oa + sa

    # Alive together in a pass: (pool, h) for L1, (h, act) for SwiGLU, (act, out) for L2.
    for a, b in (("pool_x", "h"), ("pool_sf", "h"), ("pool_x", "pool_sf"), ("h", "act"), ("act", "out")):
        assert not overlap(a, b), (a, b)
    assert overlap("out", "h") and overlap("out", "pool_x")  # the saving: never alive at once


def test_the_small_group_path_keeps_its_activations_apart():
    """The fp8 engine's small-group path fuses L1 with SwiGLU (it reads the pool while writing activations),
    so its activations are torch's: the plan's scratch counts them, for the rows such a pass can span."""
    from symmring.moe.engines.fp8 import SMALL_ROWS
    from symmring.moe.workspace_plan import SMALL_GROUP_ROWS, small_path_rows
    assert SMALL_GROUP_ROWS == SMALL_ROWS
    rows = small_path_rows(DEEPSEEK, 8)
    assert rows == SMALL_ROWS * 8 + 32 * 127
    free = plan([DEEPSEEK], world_size=8, max_tokens=4096)
    assert free.regions["scratch"] >= rows * DEEPSEEK.inter and free.total <= 2**30


def test_budget_picks_the_largest_window_that_fits():
    free = plan([DEEPSEEK], world_size=8, max_tokens=4096)
    capped = plan([DEEPSEEK], world_size=8, max_tokens=4096, budget=768 << 20)
    assert free.window_tokens == 4096 and capped.total <= 768 << 20 < free.total
    assert capped.window_tokens == 2048 and capped.pool_rows[DEEPSEEK] == uniform_rows(DEEPSEEK, 8, 2048)
    bigger = plan([DEEPSEEK], world_size=8, max_tokens=4096, budget=capped.total + 1,
                  tokens_per_slot=capped.tokens_per_slot)
    assert bigger.window_tokens == capped.window_tokens  # the next window (3072) does not fit one byte more
    out = _cli("--preset", "deepseek-v3", "--ranks", "8", "--max-tokens", "4096", "--budget", "768MiB")
    assert out.splitlines()[-1] == f"total per PE: {capped.total} bytes ({capped.total / 2**20:.1f} MiB)"


def test_uniform_and_worst_rows():
    # DeepSeek-V3 at EP8: 1024 rows for each of 32 local experts (no padding), the worst is 8x the entries.
    assert uniform_rows(DEEPSEEK, 8, 4096) == 32 * 1024
    assert worst_rows(DEEPSEEK, 8, 4096) == 8 * 4096 * 8 + 32 * 127
    assert free_passes() == 9


def free_passes() -> int:
    return plan([DEEPSEEK], world_size=8, max_tokens=4096).passes(DEEPSEEK, 4096)


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget=2**20), "budget=1048576: expected at least"),
    (dict(max_tokens=0), "max_tokens=0: expected an int >= 1"),
    (dict(tokens_per_slot=5000), "tokens_per_slot=5000: expected an int in \\[1, max_tokens=4096\\]"),
    (dict(device="tpu"), "device='tpu'"),
])
def test_bad_plans_are_named(kwargs, message):
    args = dict(world_size=8, max_tokens=4096)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        plan([DEEPSEEK], **args)


def test_cli_rejects_missing_sizes():
    done = subprocess.run([sys.executable, "-m", "symmring", "plan", "--max-tokens", "8", "--hidden", "128"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--inter, --experts, --topk: expected (or --preset)" in done.stderr


def test_live_host_workspace_matches_the_plan():
    """A bounded host workspace allocates the plan's pool when a layer attaches; calls do not grow it."""
    import numpy as np
    ctx = init("host")
    try:
        ws = Workspace(ctx, max_tokens=64, budget=2 << 20)
        rng = np.random.default_rng(7)
        w = [(rng.standard_normal(s) / 8).astype(np.float32) for s in ((4, 32, 128), (4, 32, 128), (4, 128, 32))]
        layer = MoE(ctx, Experts(*w), RoutingConfig(4, 2), max_tokens=64, workspace=ws)
        expected = plan([layer.layer_shape], world_size=1, max_tokens=64, budget=2 << 20, device="cpu")
        assert ws.memory()["experts"] == expected.regions["experts"]
        layer.forward(rng.standard_normal((64, 128), dtype=np.float32),
                      router_weight=rng.standard_normal((4, 128), dtype=np.float32))
        assert ws.memory()["experts"] == expected.regions["experts"]
        assert ws.memory()["combine"] == expected.regions["combine"]
        with pytest.raises(ConfigError, match="workspace=.*expected a symmring.Workspace of this context"):
            MoE(ctx, Experts(*w), RoutingConfig(4, 2), max_tokens=64, workspace=object())
        with pytest.raises(ConfigError, match="this context's workspace exists already"):
            ctx.workspace()
            ctx.workspace(budget=1)
        ws.close()
    finally:
        ctx.close()


def test_dispatch_words_follow_the_layers_arrays():
    """The planner's count of a shape's dispatch words uses the GPU layer's own constants (a drift in
    stages/timeline fails here, not only on a GPU)."""
    from symmring.moe import workspace_plan
    from symmring.moe.gpu import stages
    from symmring.moe.gpu import timeline
    from symmring.moe.engines import triton_common
    assert workspace_plan._STAMPS_PER_CHUNK == timeline.num_stamps(1)
    assert workspace_plan._FIXED_WORDS == 2 + stages.NUM_COUNTERS + stages.BAD_ID_WORDS
    assert workspace_plan._FP8_WORDS == triton_common.BAD_GROUP_WORDS
    shape = LayerShape(256, 128, 16, 2)
    assert workspace_plan.dispatch_words_bytes(shape, 2, 3, 100, 40) == 4 * (5 * 8 + 13) + 8 * 3 * 2 + 8 * 14 * 3
    bf16 = LayerShape(256, 128, 16, 2, expert_format="bf16")
    assert workspace_plan.dispatch_words_bytes(bf16, 2, 3, 100, 40) == 4 * (5 * 8 + 11) + 8 * 3 * 2 + 8 * 14 * 3
