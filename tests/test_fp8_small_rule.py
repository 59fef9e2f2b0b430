"""`symmring.moe.engines.triton_heuristics`' default rule of the small kernels on the CPU (no torch, no triton):
where it splits K and where it does not, for the decode shapes of `symmring.bench.moe.SHAPES` at 1-64 tokens,
with the pool bound the layer's plan gives (``entries + min(E, entries) * 127`` rows); the sweep's
configurations; the split in the names the decode benchmark prints. The kernels themselves: tests/gpu/test_fp8_small.py."""

from __future__ import annotations

import pytest

from symmring.bench import gemm_decode
from symmring.bench.moe import SHAPES
from symmring.moe.engines import triton_heuristics, triton_small
from symmring.moe.engines.triton_heuristics import (DEFAULT_SPLIT_K, MIN_SPLIT_K_BLOCKS, SmallConfig, small_config,
                                                    tile_programs)

NUM_SMS = 132
TOKENS = (1, 2, 4, 8, 16, 32, 64)


def _decode_gemms(name, tokens):
    """(what, M, N, K, G, rows_per_group, fused) of the fused L1 and the L2 at ``tokens`` tokens."""
    hidden, inter, experts, topk = SHAPES[name]
    entries = tokens * topk
    M = entries + min(experts, entries) * 127
    return [("L1", M, 2 * inter, hidden, experts, tokens, True), ("L2", M, hidden, inter, experts, tokens, False)]


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tokens", TOKENS)
def test_split_rule_only_where_sms_idle(name, tokens):
    for what, M, N, K, G, rows, fused in _decode_gemms(name, tokens):
        cfg = small_config(M, N, K, G, rows, fused=fused, num_sms=NUM_SMS)
        programs = tile_programs(M, N, G, rows, cfg.block_n, cfg.block_t, fused=fused)
        label = f"{name} {tokens} tokens {what}: {cfg.name}, {programs} programs unsplit"
        k_blocks = K // 128
        idle = 2 * programs <= NUM_SMS if fused else programs < NUM_SMS  # the fused L1 splits less eagerly
        if not idle or k_blocks < DEFAULT_SPLIT_K * MIN_SPLIT_K_BLOCKS:
            assert cfg.split_k == 1, label
        else:
            assert cfg.split_k == DEFAULT_SPLIT_K, label
            assert programs * cfg.split_k < 2 * NUM_SMS, f"{label}: a split grid of more than two waves"
        assert cfg.num_stages == 4 and (cfg.block_n == 128 or not fused), label


def test_split_rule_on_the_measured_shapes():
    """The three grids the H200 found below the SM count, and what the rule makes of them (module notes)."""
    got = {}
    for name, gemm in (("qwen3-30b-a3b", "L1"), ("deepseek-v3", "L1"), ("mixtral", "L2")):
        for tokens in (1, 2, 4):
            what, M, N, K, G, rows, fused = next(g for g in _decode_gemms(name, tokens) if g[0] == gemm)
            cfg = small_config(M, N, K, G, rows, fused=fused)
            got[name, tokens] = (cfg.name, tile_programs(M, N, G, rows, cfg.block_n, cfg.block_t, fused=fused)
                                 * cfg.split_k)
    assert got == {
        ("qwen3-30b-a3b", 1): ("n128t16w4s4k2", 96), ("qwen3-30b-a3b", 2): ("n128t16w4s4", 96),
        ("qwen3-30b-a3b", 4): ("n128t16w4s4", 192),
        ("deepseek-v3", 1): ("n128t16w4s4", 128), ("deepseek-v3", 2): ("n128t16w4s4", 256),
        ("deepseek-v3", 4): ("n128t16w4s4", 512),
        ("mixtral", 1): ("n64t16w4s4k2", 256), ("mixtral", 2): ("n64t16w4s4", 256),
        ("mixtral", 4): ("n128t16w4s4", 256),
    }


def test_split_rule_edges():
    # No rows: no programs, no split; few K blocks: no split however small the grid.
    assert small_config(0, 4096, 14336, 8, 1).split_k == 1
    assert small_config(128, 256, 7 * 128, 1, 1).split_k == 1  # 7 blocks: a split would leave 3
    assert small_config(128, 256, 8 * 128, 1, 1).name == "n64t16w4s4k2"  # 4 programs, 8 blocks
    assert small_config(128, 256, 1024 * 128, 1, 1, num_sms=132).split_k == DEFAULT_SPLIT_K
    assert small_config(128, 256, 1024 * 128, 1, 1, num_sms=4).split_k == 1  # 4 programs on 4 SMs


def test_sweep_configs_and_names():
    for fused in (False, True):
        names = [c.name for c in triton_heuristics.small_configs(fused)]
        assert len(names) == len(set(names)), f"fused={fused}: two sweep configurations share a name"
    splits = [c for c in triton_heuristics.small_configs() if c.split_k > 1]
    assert {(c.num_warps, c.num_stages, c.split_k) for c in splits} == {(4, s, k) for s in (3, 4) for k in (2, 4)}
    assert all(c.name.endswith(f"k{c.split_k}") for c in splits)
    assert all(c.smem_bytes(True) <= 200 * 1024 for c in triton_heuristics.small_configs(fused=True))
    assert SmallConfig(128, 64, 8, 6, tma=False, split_k=4).name == "n128t64w8s6k4-ptr"


def test_decode_tables_show_the_split():
    row = {"shape": "qwen3-30b-a3b", "tokens": 1, "num_rows": 1024, "touched_experts": 8.0, "sets": 2,
           "read_us": 8.9, "small_l1_config": "n128t16w4s3k3", "small_l2_config": "n64t16w4s4", "small_us": 10.0}
    header, line = gemm_decode.format_decode([row], {"copy_gbps": 4200.0, "deepgemm_reason": "-"}).splitlines()[1:3]
    assert line.split()[4:6] == ["n128t16w4s3k3", "n64t16w4s4"]
    assert header.index("L2 cfg") == line.index("n64t16w4s4")  # the column holds the longer names
    sweep = {"shape": "mixtral", "tokens": 1, "gemm": "L2", "read_us": 28.0, "default": "n64t16w4s4k2",
             "configs": {"n64t16w4s4k2": 30.0, "n128t64w8s6k4-ptr": 40.0}, "best": "n64t16w4s4k2", "best_us": 30.0,
             "default_us": 30.0, "best_vs_read": 30 / 28}
    header, line = gemm_decode.format_sweep([sweep]).splitlines()[:2]
    assert line.split()[4] == "n64t16w4s4k2" and header.index("dflt us") > line.index("n64t16w4s4k2")


def test_split_counters_cache():
    """The counter cache's bookkeeping (CPU tensors): eager launches get their stream's buffer, grown as
    needed and zero at creation; captured launches get disjoint, 128-byte aligned slices of the arena an
    eager launch stocked; with no room, a fresh zeroed buffer; an eager launch then adds an arena, and the
    first is kept while a graph holds its slices. (The kernel keeping them zero: tests/gpu/test_fp8_small.py.)"""
    torch = pytest.importorskip("torch")
    cpu = torch.device("cpu")
    cache = triton_small._SplitCounters()
    assert cache._for_capture(torch, cpu, 8).numel() == 8  # no arena yet: its own zeros
    first = cache.get(torch, cpu, 100)
    assert first.numel() >= 100 and not first.any() and cache.get(torch, cpu, 50) is first
    grown = cache.get(torch, cpu, 5000)
    assert grown.numel() >= 5000 and grown is not first and not grown.any()
    arena = cache._arenas["cpu"][0].tensor
    slices = [cache._for_capture(torch, cpu, n) for n in (1, 33, 100, 7)]
    starts = [(s.data_ptr() - arena.data_ptr()) // 4 for s in slices]
    assert starts == [0, 32, 96, 224] and [s.numel() for s in slices] == [1, 33, 100, 7]
    assert all(s.data_ptr() % 16 == 0 and not s.any() for s in slices)
    while cache._arenas["cpu"][0].largest() >= 1024:
        cache._for_capture(torch, cpu, 1000)
    spare = cache._for_capture(torch, cpu, 1000)  # the arena is out of room: a buffer of its own
    assert spare.numel() == 1000 and not spare.any()
    assert not (arena.data_ptr() <= spare.data_ptr() < arena.data_ptr() + 4 * arena.numel())
    cache.get(torch, cpu, 10)  # an eager launch restocks; the old arena is kept (graphs address it)
    assert [a.tensor for a in cache._arenas["cpu"]][0] is arena and len(cache._arenas["cpu"]) == 2
    kept = {b.data_ptr() for b in cache.buffers()}
    assert arena.data_ptr() in kept and grown.data_ptr() in kept and first.data_ptr() not in kept


def test_counter_arena_gives_back_and_merges():
    """An arena's free ranges: first fit, and a range given back merges with its neighbours, so slices taken
    and given back in any order leave it whole again."""
    torch = pytest.importorskip("torch")
    arena = triton_small._CounterArena(torch.zeros(256, dtype=torch.int32))
    a, b, c = arena.take(64), arena.take(32), arena.take(96)
    assert (a, b, c) == (0, 64, 96) and arena.free == [(192, 64)] and arena.take(65) is None
    arena.give(b, 32)
    assert arena.free == [(64, 32), (192, 64)] and arena.take(48) == 192  # first fit: the 32 are too few
    arena.give(a, 64)
    assert arena.free == [(0, 96), (240, 16)]
    arena.give(c, 96)
    arena.give(192, 48)
    assert arena.idle() and arena.largest() == 256


def test_captures_and_evictions_leave_the_counters_flat():
    """Graph-cache churn (a capture takes slices inside `capture_counters`; its graph, and so its lease, is
    dropped later; eager launches in between): after 1,000 and after 10,000 captures the arenas hold the same
    counters (one arena), every slice back. Without the leases' return the arenas grew by one per
    ``ARENA / 2`` counters captured."""
    torch = pytest.importorskip("torch")
    import random
    cpu = torch.device("cpu")
    cache = triton_small._SplitCounters()
    rng = random.Random(7)
    live = []  # the leases of the graphs a small cache keeps (at most 3)

    def counters():
        return sum(b.numel() for b in cache.buffers()), len(cache._arenas["cpu"])

    figures = {}
    for call in range(1, 10_001):
        cache.get(torch, cpu, rng.randint(1, 600))  # the eager launch of a key's first call
        with cache.lease() as lease:
            for _ in range(2):  # the fused L1 and L2 of one captured call
                cache._for_capture(torch, cpu, rng.randint(1, 900))
        assert lease.slices
        live.append(lease)
        if len(live) > 3:
            live.pop(0)  # evicted: the lease goes with its graph (garbage collected here)
        if call in (1_000, 10_000):
            figures[call] = counters()
    assert figures[1_000] == figures[10_000] and figures[10_000][1] == 1, figures
    for lease in live:
        lease.release()
    lease.release()  # idempotent
    assert all(a.idle() for a in cache._arenas["cpu"])