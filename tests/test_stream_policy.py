"""The streaming policy (symmring.moe.gpu.policy) and the timeline arithmetic of the streamed layer, on the CPU.

Synthetic benchmark rows (seeded): the policy must pick the fastest streamed configuration only when it
beats batch by the margin, apply the entry of the largest measured size at or below a request, resolve
the "call"/"all" rules for the requested size, and fall back to batch when one chunk holds the batch.
"""

from __future__ import annotations

import json
import random

import pytest

from symmring.errors import ConfigError
from symmring.moe.gpu.timeline import hidden_producer_fraction, overlap_fraction
from symmring.moe.gpu.policy import DEFAULT_MARGIN, StreamPolicy, resolve

SEED = 20261129


def row(shape, n, ratio, T=1024, slots=2, window=1, ack="early", slots_rule=None, window_rule=None):
    r = {"shape": shape, "tokens_per_rank": n, "tokens_per_slot": T, "num_slots": slots, "expert_window": window,
         "ack_policy": ack, "ratio": ratio}
    if slots_rule is not None:
        r["num_slots_rule"] = slots_rule
    if window_rule is not None:
        r["expert_window_rule"] = window_rule
    return r


def test_policy_picks_fastest_only_beyond_the_margin():
    rng = random.Random(SEED)
    rows = []
    for n in (1024, 4096, 16384):
        ratios = [rng.uniform(0.9, 1.3) for _ in range(6)]
        rows += [row("a", n, r, T=256 * (i + 1)) for i, r in enumerate(ratios)]
    policy = StreamPolicy.from_rows(rows)
    for e in policy.entries:
        mine = [r for r in rows if r["tokens_per_rank"] == e["tokens_per_rank"]]
        best = min(mine, key=lambda r: r["ratio"])
        assert e["best_streamed_ratio"] == best["ratio"]
        if best["ratio"] <= 1 - DEFAULT_MARGIN:
            assert e["choice"]["tokens_per_slot"] == best["tokens_per_slot"] and e["ratio"] == best["ratio"]
        else:
            assert e["choice"] is None and e["ratio"] == 1.0


def test_margin_boundary():
    rows = [row("a", 4096, 0.975), row("b", 4096, 0.965)]
    policy = StreamPolicy.from_rows(rows, margin=0.03)
    assert policy.choose("a", 4096) is None  # 2.5 % faster: within noise, batch
    assert policy.choose("b", 4096) == {"tokens_per_slot": 1024, "num_slots": 2, "expert_window": 1,
                                        "ack_policy": "early"}
    assert StreamPolicy.from_rows(rows, margin=0.0).choose("a", 4096) is not None
    with pytest.raises(ConfigError, match="margin"):
        StreamPolicy.from_rows(rows, margin=1.0)


def test_lookup_between_sizes_and_rules_resolved():
    rows = [row("m", 4096, 0.90, T=1024, slots=4, window=4, slots_rule="call", window_rule="all"),
            row("m", 16384, 1.10, T=2048),
            row("m", 1024, 0.80, T=512, slots=2, window=1)]
    policy = StreamPolicy.from_rows(rows)
    # Below every measured size: the smallest entry (512-token chunks), resolved for 600 tokens.
    assert policy.choose("m", 600) == {"tokens_per_slot": 512, "num_slots": 2, "expert_window": 1,
                                       "ack_policy": "early"}
    # 1024-entry chunks hold 512 tokens whole: batch.
    assert policy.choose("m", 512) is None
    # 8192 uses the 4096 entry; "call"/"all" give one slot and one window per chunk of 8192 tokens.
    assert policy.choose("m", 8192) == {"tokens_per_slot": 1024, "num_slots": 8, "expert_window": 8,
                                        "ack_policy": "early"}
    assert policy.choose("m", 16384) is None and policy.choose("m", 100000) is None
    with pytest.raises(ConfigError, match="shape"):
        policy.choose("nope", 10)
    with pytest.raises(ConfigError, match="num_tokens"):
        policy.choose("m", -1)


def test_load_round_trip(tmp_path):
    rows = [row("a", 2048, 0.5, T=256), row("a", 8192, 0.99)]
    table = StreamPolicy.from_rows(rows).entries
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows, "policy": table}))
    loaded = StreamPolicy.load(str(path))
    for n in (1, 300, 2048, 5000, 9000):
        assert loaded.choose("a", n) == StreamPolicy(table).choose("a", n)
    (tmp_path / "bad.json").write_text(json.dumps({"rows": rows}))
    with pytest.raises(ConfigError, match="policy"):
        StreamPolicy.load(str(tmp_path / "bad.json"))


def test_resolve_rules():
    assert resolve(None, 100) is None
    choice = {"tokens_per_slot": 100, "num_slots": "call", "expert_window": "all", "ack_policy": "conservative"}
    assert resolve(choice, 100) is None
    assert resolve(choice, 250) == {"tokens_per_slot": 100, "num_slots": 3, "expert_window": 3,
                                    "ack_policy": "conservative"}
    assert resolve(dict(choice, num_slots=2, expert_window=5), 1000)["expert_window"] == 2


def rec(stream, stage, start, end):
    return {"chunk": 0, "last_chunk": 0, "stream": stream, "stage": stage, "start_ns": start, "end_ns": end}


def test_overlap_and_hidden_producer_fractions():
    records = [rec("producer", "wait", 0, 50), rec("producer", "route", 50, 100), rec("producer", "layout", 100, 150),
               rec("consumer", "wait", 0, 120), rec("consumer", "dispatch", 120, 200),
               rec("consumer", "experts", 200, 400)]
    # Work overlaps on [120, 150]: 30 ns of a 400 ns span; the producer worked 100 ns.
    assert overlap_fraction(records) == pytest.approx(30 / 400)
    assert hidden_producer_fraction(records) == pytest.approx(30 / 100)
    # Spinning ("wait") is not work: a consumer that only waits hides nothing.
    waiting = [r for r in records if r["stream"] == "producer"] + [rec("consumer", "wait", 0, 400)]
    assert overlap_fraction(waiting) == 0 and hidden_producer_fraction(waiting) == 0
    assert overlap_fraction([]) == 0 and hidden_producer_fraction([]) == 0


def test_benchmark_tables_format_without_a_gpu():
    # The printing code of the GPU benchmarks, on synthetic figures (it runs only after device work).
    from symmring.bench import protocol, stream
    pull = {"bytes": 1 << 20, "src_rank": 1, "copy_GBps": 4000.0, "peer_copy_GBps": 360.0}
    for label, blocks in (("spin_budget", 32), ("all_sms", 132), ("two_per_sm", 264)):
        pull.update({f"pull_{label}_blocks": blocks, f"pull_{label}_GBps": 600.0, f"pull_{label}_ratio": 0.15,
                     f"pull_{label}_vs_peer_copy": 0.83})
    text = protocol.format_table({"device": "x", "world_size": 2, "publish_observe_one_way_us": 1.5, "pull": pull})
    assert "360 GB/s per direction" in text and "0.83 of the peer copy" in text
    rows = [dict(row("deepseek-v3", 4096, r, T=1024, slots=4, window=4), batch_ms=10.0, streamed_ms=10.0 * r,
                 num_chunks=4) for r in (0.95, 1.1)]
    table = stream.policy_table(rows)
    assert "0.95" in stream.format_rows(rows)
    assert "1024 x 4 slots, window 4, early" in stream.format_policy(table)
    assert "batch" in stream.format_policy(stream.policy_table([rows[1]]))


def test_the_policy_tells_once_per_entry_not_per_token_count():
    """Issue 33, item 8: `StreamPolicy.streams` logs a ring it cannot run once per table entry and layer ring; it
    kept one record per distinct token count before (a serving loop sees thousands: memory grew per count)."""
    from types import SimpleNamespace
    rows = [dict(row("m", 1024, 0.8, T=512), hidden=256, inter=512, num_experts=8, topk=2, world_size=1),
            dict(row("m", 8192, 0.8, T=2048), hidden=256, inter=512, num_experts=8, topk=2, world_size=1)]
    policy = StreamPolicy.from_rows(rows)
    spec = SimpleNamespace(hidden=256, inter=512, num_experts=8, topk=2, world_size=1, num_slots=2,
                           tokens_per_slot=256, expert_window=1)  # a layer's spec; no measured chunk fits its ring
    assert not any(policy.streams(spec, n) for n in range(600, 20000, 7))
    assert len(policy._told) == 2, policy._told  # the two entries, whatever the counts
    stranger = SimpleNamespace(**{**vars(spec), "hidden": 128})  # no measurement: one record for the shape
    assert not any(policy.streams(stranger, n) for n in range(1, 3000, 3))
    assert len(policy._told) == 3
