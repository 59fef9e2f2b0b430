"""The GPU layer's per-call plan (symmring.moe.gpu.plan), on the CPU: windows, bounds and the small-batch flag."""

import pytest

from symmring.errors import ConfigError
from symmring.moe.gpu.plan import make_plan

KW = dict(tokens_per_slot=128, num_slots=3, expert_window=3, two_streams=True, topk=2, capacity=4096)


def test_batch_plan_is_one_window_over_every_chunk_on_one_stream():
    plan = make_plan((300, 0, 17), 0, streaming=False, **KW)
    assert plan.num_chunks == 3 and not plan.two_streams and not plan.small_batch
    (window,) = plan.windows.values()
    assert (window.first, window.last, window.num_valid, window.source_tokens) == (0, 2, 300, 317)
    assert window.rows_bound == 2 * 317
    assert [c.num_valid for c in plan.chunks] == [128, 128, 44]


def test_rows_bound_counts_alignment_padding_and_is_capped_by_the_pool():
    plan = make_plan((5, 3), 1, streaming=False, align=128, num_groups=4, **KW)
    (window,) = plan.windows.values()
    assert window.rows_bound == 16 + 4 * 127 and window.source_tokens == 8 and window.num_valid == 3
    assert window.rows_per_expert == 16  # given routing may name an expert twice per token: tokens * topk
    distinct = make_plan((5, 3), 1, streaming=False, align=128, num_groups=4, distinct_experts=True, **KW)
    assert distinct.windows[0].rows_per_expert == 8  # one row per token at most
    assert window.passes == ((0, 16 + 4 * 127),)  # fits the pool: one pass
    capped = make_plan((5, 3), 1, streaming=False, align=128, num_groups=4, **{**KW, "capacity": 256})
    # A pool below the window's bound: passes of whole pools over the bound's rows (the last one short).
    assert capped.windows[0].rows_bound == 256 and capped.windows[0].passes == ((0, 256), (256, 256), (512, 12))
    assert capped.windows[0].rows_per_expert == 16
    with pytest.raises(ConfigError, match="capacity=100: expected a positive multiple of align=128"):
        make_plan((5, 3), 1, streaming=False, align=128, num_groups=4, **{**KW, "capacity": 100})
    with pytest.raises(ConfigError, match="small_batch: the small-batch schedule runs one pass"):
        make_plan((5, 3), 1, streaming=False, align=128, num_groups=4, small_batch=True, **{**KW, "capacity": 256})


def test_small_batch_plan_is_a_one_chunk_batch_plan():
    plan = make_plan((1, 4), 1, streaming=False, small_batch=True, **KW)
    assert plan.small_batch and plan.num_chunks == 1 and plan.order == (("produce", 0, 0), ("consume", 0, 0))
    assert plan.windows[0].source_tokens == 5 and plan.chunks[0].num_valid == 4


@pytest.mark.parametrize("counts,streaming,words", [((129,), False, "2 chunks"), ((5,), True, "streamed")])
def test_small_batch_rejects_calls_it_cannot_run(counts, streaming, words):
    with pytest.raises(ConfigError, match=words):
        make_plan(counts, 0, streaming=streaming, small_batch=True, **KW)


def test_batch_call_larger_than_the_ring_is_rejected():
    with pytest.raises(ConfigError, match="do not fit the ring"):
        make_plan((4 * 128,), 0, streaming=False, **KW)


@pytest.mark.parametrize("num_chunks,num_slots,window", [(5, 2, 1), (6, 3, 3), (7, 4, 2), (1, 1, 1)])
def test_streamed_plan_waits_are_the_protocols_cross_stream_edges(num_chunks, num_slots, window):
    """Every wait names an item enqueued earlier on the other stream; together they are the "own chunks" and
    "own acknowledgement" edges of `protocol.call_dependency_graph`, the ones a captured graph would lose."""
    from symmring import protocol
    kw = {**KW, "tokens_per_slot": 10, "num_slots": num_slots, "expert_window": window}
    plan = make_plan((10 * num_chunks, 3), 0, streaming=True, **kw)
    _, edges = protocol.call_dependency_graph(plan.order, num_slots, two_streams=True)
    want = {(e.before, e.after) for e in edges if e.why in ("own chunks", "own acknowledgement")}
    got = {(b, a) for a, befores in plan.waits.items() for b in befores}
    assert got == want and plan.signals == {b for b, _ in want}
    position = {item: i for i, item in enumerate(plan.order)}
    for before, after in got:
        assert position[before] < position[after] and before[0] != after[0]
    single = make_plan((10 * num_chunks, 3), 0, streaming=True, **{**kw, "two_streams": False})
    assert single.waits == {} and single.signals == frozenset()


def test_token_buckets_cover_every_count_and_are_few():
    """`token_bucket`: at least the count, at most the cap when the count fits it, powers of two up to 256 then
    multiples of 256; 7 buckets up to 64 tokens, 24 up to 4096."""
    from symmring.moe.gpu.plan import BUCKET_STEP, num_buckets, token_bucket
    for cap in (1, 5, 64, 300, 4096):
        for n in range(0, cap + 1):
            b = token_bucket(n, cap)
            assert (b == 0) == (n == 0) and n <= b <= max(n, cap)
            assert b == cap or b & (b - 1) == 0 or b % BUCKET_STEP == 0
    assert token_bucket(5000, 4096) == 5000  # past the cap: the count itself (the layer refuses it first)
    assert (num_buckets(64), num_buckets(4096)) == (7, 24)


def test_own_rows_clamps_this_ranks_bounds_to_its_tensors():
    """A plan made for a bucket, launched on fewer rows (an eager call's ``x``): this rank's chunk and window
    bounds never pass them; the other ranks' bounds (``source_tokens``, rows) are the bucket's."""
    from symmring.moe.gpu.plan import make_plan, own_rows
    plan = make_plan((64, 64), 0, tokens_per_slot=32, num_slots=2, expert_window=2, streaming=True,
                     two_streams=False, topk=2, capacity=4096)
    clamped = own_rows(plan, 40)
    assert [c.num_valid for c in clamped.chunks] == [32, 8]
    assert [w.num_valid for w in clamped.windows.values()] == [40]
    assert clamped.windows[0].source_tokens == plan.windows[0].source_tokens == 128
    assert own_rows(plan, 64) is plan and [c.num_valid for c in own_rows(plan, 0).chunks] == [0, 0]


def _device_counts(plan, window, rank_tokens, routing, expert_begin, num_local, align):
    """What the device counts for ``window`` on the rank owning experts ``[expert_begin, +num_local)``: each
    local expert's rows and the window's aligned total (moe_dispatch_scan)."""
    counts = [0] * num_local
    for r, idx in enumerate(routing):
        for c in window.chunks:
            lo = c * KW_BOUNDS["tokens_per_slot"]
            for token in range(lo, min(rank_tokens[r], lo + KW_BOUNDS["tokens_per_slot"])):
                for e in idx[token]:
                    if expert_begin <= e < expert_begin + num_local:
                        counts[e - expert_begin] += 1
    return counts, sum(-(-n // align) * align for n in counts)


KW_BOUNDS = dict(tokens_per_slot=16, num_slots=4, expert_window=2, two_streams=False, topk=3)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("align, capacity", [(1, 24), (1, 4096), (128, 512), (128, 8192)])
@pytest.mark.parametrize("distinct", [False, True])
def test_plan_bounds_hold_for_every_routing_of_its_counts(streaming, align, capacity, distinct):
    """The bounds the device checks (device/moe/bounds.cuh: `WindowStep.rows_spanned`, `expert_rows_bound`)
    never trip on a call that keeps to its plan: random counts up to each rank's planned tokens, random
    routing (distinct experts per token, or with repeats and masked entries), every window on every rank."""
    import random
    rng = random.Random(align * 7 + capacity + distinct + 2 * streaming)
    world, experts = 3, 12
    num_local = experts // world
    for _ in range(40):
        planned = [rng.randint(0, 64) for _ in range(world)]
        if not any(planned):
            continue
        bucket = [max(planned)] * world  # every rank plans the same bucket (the layer's)
        tokens = [rng.randint(0, n) for n in planned]
        routing = []
        for n in tokens:
            if distinct:
                routing.append([rng.sample(range(experts), 3) for _ in range(n)])
            else:
                routing.append([[rng.choice(list(range(experts)) + [-1]) for _ in range(3)] for _ in range(n)])
        for rank in range(world):
            plan = make_plan(bucket, rank, streaming=streaming, capacity=capacity, align=align,
                             num_groups=num_local, distinct_experts=distinct, **KW_BOUNDS)
            for window in plan.windows.values():
                counts, total = _device_counts(plan, window, tokens, routing, rank * num_local, num_local, align)
                assert total <= window.rows_spanned, (bucket, tokens, window)
                assert max(counts) <= window.expert_rows_bound, (bucket, tokens, window)
                assert window.rows_spanned >= window.rows_bound and window.expert_rows_bound >= 1


def test_plan_bounds_trip_on_a_call_past_its_plan():
    """The same bounds on a plan made for fewer tokens than a peer brings (a rank that planned another bucket):
    the device's counts exceed them (the kernels then record pool_overflow)."""
    small = make_plan([1, 1], 0, streaming=False, capacity=4096, align=128, num_groups=4, distinct_experts=True,
                      **KW_BOUNDS)
    (window,) = small.windows.values()
    routing = [[[0, 1, 2]], [[0, 1, 2]] * 16]  # rank 1 sends 16 tokens, all to experts 0-2
    counts, total = _device_counts(small, window, [1, 16], routing, 0, 4, 128)
    assert max(counts) > window.expert_rows_bound == 2 and total <= window.rows_spanned
    flat = make_plan([1, 1], 0, streaming=False, capacity=4096, align=1, num_groups=4, **KW_BOUNDS)
    (window,) = flat.windows.values()
    counts, total = _device_counts(flat, window, [1, 16], routing, 0, 4, 1)
    assert total > window.rows_spanned == 6
