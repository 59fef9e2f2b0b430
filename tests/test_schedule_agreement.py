"""`MoE.forward` picks the schedule (streamed or batch, small-batch or not) from the exchanged token counts, so
every rank runs the same one (docs/PROTOCOL.md 9.1a), whatever its own count (issue 24, item 1).

No GPU: `MoE.forward` runs on a stand-in layer whose collective and plan steps are stubs; the stub `_plan`
records the schedule the call would run and stops it there. The old code asked the policy about the rank's own
count (``self.streams(streaming, n)`` before the exchange): rank 1 of counts [4000, 50] then chose batch while
rank 0 streamed, which `test_auto_decides_from_the_exchanged_counts` catches.
"""

from __future__ import annotations

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


class _Layer:
    """The pieces of `MoE` that `forward` touches before it plans a call."""

    forward = gpu.MoE.forward
    streams = gpu.MoE.streams
    _schedule = gpu.MoE._schedule
    small_batch_applies = gpu.MoE.small_batch_applies
    _small_batch_capable = gpu.MoE._small_batch_capable

    def __init__(self, rank, counts, *, threshold=1000, small_batch_tokens=128, tokens_per_slot=4096):
        self.rank, self.world_size, self.counts = rank, len(counts), list(counts)
        self.policy = _Policy(threshold)
        self.small_batch_tokens, self.tokens_per_slot = small_batch_tokens, tokens_per_slot
        self.x_format, self.engine, self.hidden = "fp8_e4m3", _Engine(), 8

    def _check_open(self):
        pass

    def _check_input(self, x):
        return x

    def _routing_source(self, x, router_weight, logits, topk_idx, topk_weights):
        return "logits", logits

    def _all_token_counts(self, n, own_router):
        assert n == self.counts[self.rank]
        return list(self.counts), own_router

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
    # Policy threshold 100: ranks [120, 10] stream (max 120) and so none runs the small-batch schedule.
    assert set(_schedules([120, 10], threshold=100)) == {((120, 10), True, False)}
    assert set(_schedules([90, 10], threshold=100)) == {((90, 10), False, True)}


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
