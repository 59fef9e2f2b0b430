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


class _Layer:
    """The pieces of `MoE` that `forward` touches before it plans a call."""

    forward = gpu.MoE.forward
    streams = gpu.MoE.streams
    _bucket = gpu.MoE._bucket
    _schedule = gpu.MoE._schedule
    small_batch_applies = gpu.MoE.small_batch_applies
    _small_batch_capable = gpu.MoE._small_batch_capable
    _raise_async_error = gpu.MoE._raise_async_error

    def __init__(self, rank, counts, *, threshold=1000, small_batch_tokens=128, tokens_per_slot=4096, latched=None):
        self.rank, self.world_size, self.counts = rank, len(counts), list(counts)
        self.latched = latched or [None] * len(counts)
        self.backend = None
        self.policy = _Policy(threshold)
        self.small_batch_tokens, self.tokens_per_slot = small_batch_tokens, tokens_per_slot
        self.max_tokens, self.num_slots = 4096, 1
        self.workspace = SimpleNamespace(active_step=None)  # no model step: forward exchanges the counts
        self.x_format, self.engine, self.hidden = "fp8_e4m3", _Engine(), 8
        # The pool holds any of these calls in one pass (small_batch_applies checks it).
        self.topk, self.num_local_experts, self.capacity = 2, 4, 1 << 30

    def _check_open(self):
        pass

    def _check_input(self, x):
        return x

    def _routing_source(self, x, router_weight, logits, topk_idx, topk_weights):
        return "logits", logits

    def _all_token_counts(self, n, own_router):
        assert n == self.counts[self.rank]
        return list(self.counts), own_router, list(self.latched)

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


def test_bad_streaming_and_options_raise_before_the_exchange():
    layer = _Layer(0, [4, 4])
    layer._all_token_counts = None  # the exchange must not be reached
    with pytest.raises(ConfigError, match="streaming='always'"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="always")
    # timeline and delays need the streamed schedule by request, not by the policy's answer (which would
    # differ between ranks' arguments only after the exchange).
    with pytest.raises(ConfigError, match="timeline"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="auto", timeline=True)
    with pytest.raises(ConfigError, match="stage_events"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="auto", stage_events=[])


class _OwnLatch:
    def error(self):
        return RuntimeError("own latched error")


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
        layer._latch = _OwnLatch()
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
