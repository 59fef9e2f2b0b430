"""`MoE.forward` picks the schedule (streamed or batch, small-batch or not) from the exchanged token counts, so
every rank runs the same one (docs/PROTOCOL.md 9.1a), whatever its own count (issue 24, item 1).

No GPU: `MoE.forward` runs on a stand-in layer whose collective and plan steps are stubs; the stub `_plan`
records the schedule the call would run and stops it there. The old code asked the policy about the rank's own
count (``self.streams(streaming, n)`` before the exchange): rank 1 of counts [4000, 50] then chose batch while
rank 0 streamed, which `test_auto_decides_from_the_exchanged_counts` catches.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from symmring import protocol  # noqa: E402
from symmring.errors import ConfigError  # noqa: E402
from symmring.moe import gpu  # noqa: E402


class _Planned(Exception):
    def __init__(self, counts, streaming, small_batch):
        super().__init__("planned")
        self.schedule = (tuple(counts), streaming, small_batch)


class _Policy:
    """Streams calls of at least ``threshold`` tokens per rank (the real one: `StreamPolicy.streams`)."""

    def __init__(self, threshold):
        self.threshold = threshold
        self.asked = []

    def streams(self, layer, num_tokens):
        self.asked.append(num_tokens)
        return num_tokens >= self.threshold


class _Engine:
    pool_format = "fp8"
    align_m = 128


class _Workspace:
    """The workspace's part in a call outside a step: its call count, latch (decoded as the rank's own error)."""

    def __init__(self, own_words):
        self.active_step, self.calls, self.own_words = None, 0, own_words
        self.gpu = SimpleNamespace(latched=lambda: self.own_words,
                                   decode_latched=lambda words: RuntimeError("own latched error"))

    def check_open(self):
        pass

    def call_identity(self, layer_id):
        return protocol.call_identity(self.calls, layer_id)

    def begin_call(self):
        self.calls += 1


class _Layer:
    """The pieces of `MoE` that `forward` touches before it plans a call; the exchange is a stub that hands back
    every rank's entry (`refusals`: rank -> message, `identities`: rank -> call identity, else this rank's)."""

    forward = gpu.MoE.forward
    streams = gpu.MoE.streams
    _bucket = gpu.MoE._bucket
    _schedule = gpu.MoE._schedule
    small_batch_applies = gpu.MoE.small_batch_applies
    _small_batch_capable = gpu.MoE._small_batch_capable
    _raise_async_error = gpu.MoE._raise_async_error
    _all_token_counts = gpu.MoE._all_token_counts
    _check_call = gpu.MoE._check_call

    def __init__(self, rank, counts, *, threshold=1000, small_batch_tokens=128, tokens_per_slot=4096, latched=None,
                 refusals=None, identities=None):
        self.rank, self.world_size, self.counts = rank, len(counts), list(counts)
        self.latched = latched or [None] * len(counts)
        self.refusals, self.identities, self.exchanged = refusals or {}, identities or {}, []
        self.backend = None
        self.policy = _Policy(threshold)
        self.small_batch_tokens, self.tokens_per_slot = small_batch_tokens, tokens_per_slot
        self.max_tokens, self.num_slots, self.layer_id = 4096, 1, 3
        self.workspace = _Workspace(self.latched[rank])  # no model step: forward exchanges the counts
        self.x_format, self.engine, self.hidden = "fp8_e4m3", _Engine(), 8
        # The pool holds any of these calls in one pass (small_batch_applies checks it).
        self.topk, self.num_local_experts, self.capacity = 2, 4, 1 << 30

    def _check_closed(self):
        pass

    def _check_input(self, x):
        return x

    def _routing_source(self, x, router_weight, logits, topk_idx, topk_weights):
        return "logits", logits

    def _exchange_counts(self, mine):
        self.exchanged.append(mine)
        n, own_router, _, identity, refusal = mine
        assert refusal is not None or n == self.counts[self.rank]
        return [mine if r == self.rank else
                (c, own_router, self.latched[r], self.identities.get(r, identity), self.refusals.get(r))
                for r, c in enumerate(self.counts)]

    def _plan(self, counts, streaming, small_batch=False, distinct_experts=False):
        raise _Planned(counts, streaming, small_batch)


def _schedules(counts, streaming="auto", small_batch=None, **kw):
    """The schedule each rank's forward plans for a call of ``counts`` tokens per rank."""
    out = []
    for rank, n in enumerate(counts):
        layer = _Layer(rank, counts, **kw)
        with pytest.raises(_Planned) as planned:
            layer.forward(torch.zeros((n, 8)), logits=torch.zeros((n, 4)), streaming=streaming,
                          small_batch=small_batch)
        out.append(planned.value.schedule)
    return out


@pytest.mark.parametrize("counts", [[4000, 50], [50, 4000], [4000, 50, 0, 999], [0, 0, 1000, 1]])
def test_auto_decides_from_the_exchanged_counts(counts):
    schedules = _schedules(counts)
    assert len(set(schedules)) == 1, schedules  # every rank: the same schedule
    assert schedules[0][1] is (max(counts) >= 1000)


@pytest.mark.parametrize("counts", [[100, 129], [129, 100], [128, 1, 0, 128], [0, 0], [5, 4096]])
def test_small_batch_decides_from_the_exchanged_counts(counts):
    schedules = _schedules(counts, streaming=False)
    assert len(set(schedules)) == 1, schedules
    assert schedules[0][2] is (0 < max(counts) <= 128)


def test_auto_small_batch_agree_together():
    # Policy threshold 100: ranks [120, 10] stream (max 120) and so none runs the small-batch schedule. Every
    # rank plans for the token bucket of the largest count (128 here), its own count goes to the device.
    assert set(_schedules([120, 10], threshold=100)) == {((128, 128), True, False)}
    assert set(_schedules([90, 10], threshold=100)) == {((128, 128), False, True)}


@pytest.mark.parametrize("counts", [[3, 1], [1, 3], [0, 3, 2], [60, 33]])
def test_every_rank_plans_the_bucket_of_the_largest_count(counts):
    from symmring.moe.gpu.plan import token_bucket
    schedules = _schedules(counts, streaming=False)
    assert len(set(schedules)) == 1, schedules
    assert schedules[0][0] == (token_bucket(max(counts), 4096),) * len(counts)


def test_bad_options_travel_in_the_exchange_and_every_rank_raises():
    """Issue 33, item 1: a rank whose arguments fail still joins the call's one exchange with its error, so every
    rank raises (its own message there, one naming it elsewhere) and none plans or waits."""
    layer = _Layer(0, [4, 4])
    with pytest.raises(ConfigError, match="streaming='always'"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="always")
    assert len(layer.exchanged) == 1 and "streaming='always'" in layer.exchanged[0][4]
    # timeline and delays need the streamed schedule by request, not by the policy's answer (which would
    # differ between ranks' arguments only after the exchange).
    with pytest.raises(ConfigError, match="timeline"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="auto", timeline=True)
    with pytest.raises(ConfigError, match="stage_events"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="auto", stage_events=[])
    # The other rank (whose arguments are fine) raises in the same exchange, naming rank 0's error.
    other = _Layer(1, [4, 4], refusals={0: "timeline/producer_delay_ns/consumer_delay_ns: only for ..."})
    with pytest.raises(ConfigError, match=r"rejected by rank\(s\) \[0\]: rank 0: timeline"):
        other.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
    assert layer.workspace.calls == other.workspace.calls == 0  # a refused call is counted nowhere


def test_diverged_call_sequences_raise_on_every_rank_before_planning():
    """Issue 33, item 1: the call identity (call number and layer) travels with the counts; a rank at another call
    or layer makes every rank raise a CallMismatch naming it, before anything is planned."""
    from symmring.errors import CallMismatch
    for rank in range(2):
        layer = _Layer(rank, [4, 4], identities={1: protocol.call_identity(0, 2)})
        if rank == 1:  # its own identity is what it sent: layer 3; rank 0's is layer 3 too (the stub's default)
            layer.identities = {0: protocol.call_identity(0, 2)}
        with pytest.raises(CallMismatch) as info:
            layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
        assert (info.value.peer, info.value.expected_layer, info.value.observed_layer) == (1 - rank, 3, 2)
        assert layer.workspace.calls == 0
    agreed = _Layer(0, [4, 4])
    with pytest.raises(_Planned):
        agreed.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
    assert agreed.workspace.calls == 1  # counted once agreed


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_latched_error_on_one_rank_stops_the_call_on_every_rank(world_size):
    """Issue 24, item 2: the latched device errors travel with the token counts, so every rank raises in the
    same forward, before anything is planned or enqueued: the rank that latched it raises its own error, the
    others a ProtocolAborted naming it."""
    from symmring import layout
    from symmring.errors import ProtocolAborted

    culprit = world_size - 1
    words = [layout.ERROR_KIND_DOUBLE_ACK, culprit, 0, 0, 3, 1, 1, 0, 0]
    latched = [None] * world_size
    latched[culprit] = words
    for rank in range(world_size):
        layer = _Layer(rank, [4] * world_size, latched=latched)
        if rank == culprit:
            with pytest.raises(RuntimeError, match="own latched error"):
                layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
        else:
            with pytest.raises(ProtocolAborted) as info:
                layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
            error = info.value
            assert (error.rank, error.origin, error.origin_kind, error.origin_peer, error.origin_chunk) == \
                (rank, culprit, "double_ack", 0, 3), str(error)
            assert f"rank {culprit} latched a device error" in str(error) and "reset()" in str(error)


def test_a_latched_abort_names_the_first_origin():
    from symmring import layout
    from symmring.kernels import peer_async_error

    word = layout.pack_abort(2, layout.ERROR_KIND_REUSE, 3, 5)
    aborted = [layout.ERROR_KIND_ABORTED, 1, 2, 0, 5, 9, word, layout.ERROR_KIND_ROUTE, word]
    error = peer_async_error(0, [None, aborted, None, None])
    assert (error.origin, error.origin_kind, error.origin_peer, error.origin_chunk) == (2, "reuse", 3, 5)
    assert "(reported by rank 1)" in str(error)
    entry_only = [layout.ERROR_KIND_NONE, 0, 0, 0, 0, 0, 0, 0, word]  # a kernel returned at entry
    assert peer_async_error(0, [None, entry_only]).origin == 2
    assert peer_async_error(1, [None, aborted]) is None  # its own: the caller raises the latch's own error


def test_the_bucket_never_adds_a_chunk():
    # Chunks of 48 tokens: 40 tokens plan one chunk (48, not the power of two 64), 50 plan two (64 <= 96).
    assert set(_schedules([40, 3], streaming=False, tokens_per_slot=48)) == {((48, 48), False, True)}
    assert {s[0] for s in _schedules([50, 3], streaming=False, tokens_per_slot=48)} == {(64, 64)}


def test_an_error_latched_before_a_reset_is_raised_from_the_exchanged_words():
    """Issue 33, item 8: a rank's latch words were exchanged, then a reset (inside a step) cleared its latch; the
    error it raises comes from the words it sent. The old code read the cleared latch back, found nothing and
    ran ``raise None`` (a TypeError on that rank alone)."""
    from symmring import layout
    words = [layout.ERROR_KIND_REUSE, 0, 1, 0, 2, 3, 1, 2, 0]
    layer = _Layer(0, [4, 4], latched=[words, None])
    layer.workspace.own_words = None  # cleared by the reset since the exchange
    decoded = []
    layer.workspace.gpu.decode_latched = lambda w: decoded.append(w) or RuntimeError("named from the words")
    # What the code before the fix read instead (the cleared latch and rings): nothing.
    layer._latch = SimpleNamespace(error=lambda: None, latched=lambda: None)
    layer.workspace.gpu.rings = lambda: []
    with pytest.raises(RuntimeError, match="named from the words"):
        layer._raise_async_error([words, None])
    assert decoded == [words]
