"""`GpuMoE.forward` picks the schedule (streamed or batch, small-batch or not) from the exchanged token counts, so
every rank runs the same one (docs/PROTOCOL.md 9.1a), whatever its own count (issue 24, item 1).

No GPU: `GpuMoE.forward` runs on a stand-in layer (a real spec and `Planner`, stub workspace, exchange and
executor); `make_plan` is replaced by a stub that records the schedule the planner chose and stops the call
there. The old code asked the policy about the rank's own count (``self.streams(streaming, n)`` before the
exchange): rank 1 of counts [4000, 50] then chose batch while rank 0 streamed, which
`test_auto_decides_from_the_exchanged_counts` catches.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from symmring import protocol  # noqa: E402
from symmring.errors import ConfigError  # noqa: E402
from symmring.moe.debug import Debug  # noqa: E402
from symmring.moe.gpu import layer as layer_mod  # noqa: E402
from symmring.moe.gpu import plan as plans  # noqa: E402
from symmring.moe.gpu.spec import GpuSpec  # noqa: E402


class _Planned(Exception):
    def __init__(self, counts, streaming, small_batch):
        super().__init__("planned")
        self.schedule = (tuple(counts), streaming, small_batch)


class _Policy:
    """Streams calls of at least ``threshold`` tokens per rank (the real one: `StreamPolicy.streams`)."""

    def __init__(self, threshold):
        self.threshold = threshold
        self.asked = []

    def streams(self, spec, num_tokens):
        self.asked.append(num_tokens)
        return num_tokens >= self.threshold


def make_spec(rank, world_size, **fields):
    """A `GpuSpec` of an fp8 layer (the small-batch schedule capable), ``fields`` overriding."""
    base = dict(rank=rank, world_size=world_size, num_experts=4 * world_size, topk=2, hidden=8, inter=8,
                max_tokens=4096, num_slots=1, tokens_per_slot=4096, ack_policy=protocol.AckPolicy.CONSERVATIVE,
                x_format="fp8_e4m3", timeout_s=1.0, routing=(), layer_id=3, expert_window=1, batch_window=1,
                small_batch_tokens=128, small_batch_capable=True, expert_dtype="fp8", pool_format="fp8",
                transport_request="('auto', 'default')", transport=None, align=128, engine="builtin", single_stream=False, graph_cache=0)
    base.update(fields)
    return GpuSpec(**base)


class _Workspace:
    """The workspace's part in a call outside a step: its call count, latch (decoded as the rank's own error),
    and the context's exchange, a stub that hands back every rank's entry (`refusals`: rank -> message,
    `identities`: rank -> call identity, else this rank's)."""

    def __init__(self, rank, counts, latched, refusals, identities, options=None):
        self.active_step, self.calls, self.closed, self.epoch = None, 0, False, 0
        self.options = options or {}
        self.rank, self.counts, self.latched = rank, counts, latched
        self.refusals, self.identities, self.exchanged = refusals, identities, []
        self.own_words = latched[rank]
        self.gpu = SimpleNamespace(latched=lambda: self.own_words,
                                   decode_latched=lambda words: RuntimeError("own latched error"))
        self.ctx = SimpleNamespace(check_open=lambda: None, collectives=SimpleNamespace(allgather=self.allgather))

    def allgather(self, mine, what):
        self.exchanged.append(mine)
        n, own_router, _, identity, refusal, options = mine
        assert refusal is not None or n == self.counts[self.rank]
        return [mine if r == self.rank else
                (c, own_router, self.latched[r], self.identities.get(r, identity), self.refusals.get(r),
                 self.options.get(r, options))
                for r, c in enumerate(self.counts)]

    def check_open(self):
        pass

    def call_identity(self, layer_id):
        return protocol.call_identity(self.calls, layer_id)

    def begin_call(self):
        self.calls += 1


def _layer(rank, counts, *, threshold=1000, latched=None, refusals=None, identities=None, options=None,
           **spec_fields):
    """A `GpuMoE` of rank ``rank`` whose forward runs until it has planned (`_Planned`)."""
    layer = object.__new__(layer_mod.GpuMoE)
    latched = latched or [None] * len(counts)
    layer.spec = make_spec(rank, len(counts), **spec_fields)
    layer.closed, layer.backend, layer.device, layer.last_plan = False, None, torch.device("cpu"), None
    layer.workspace = _Workspace(rank, list(counts), latched, refusals or {}, identities or {}, options)
    layer.planner = plans.Planner(layer.spec, _Policy(threshold))
    layer.planner.follow(1 << 30)  # the pool holds any of these calls in one pass (small_batch_applies checks it)
    layer.executor = SimpleNamespace(follow_memory=lambda: False, hooks=None)
    layer.debug = Debug(layer.forward, layer.executor)
    return layer


@pytest.fixture(autouse=True)
def _stubs(monkeypatch):
    """The call's tensor checks pass CPU tensors through (they need a GPU); planning stops at `make_plan`."""
    monkeypatch.setattr(layer_mod, "check_x", lambda x, spec, device: x)
    monkeypatch.setattr(layer_mod, "routing_source", lambda x, spec, device, rw, logits, idx, w: ("logits", logits))

    def planned(counts, rank, *, streaming, small_batch, **kw):
        raise _Planned(counts, streaming, small_batch)
    monkeypatch.setattr(plans, "make_plan", planned)


def _schedules(counts, streaming="auto", small_batch=None, **kw):
    """The schedule each rank's forward plans for a call of ``counts`` tokens per rank."""
    out = []
    for rank, n in enumerate(counts):
        layer = _layer(rank, counts, **kw)
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
    layer = _layer(0, [4, 4])
    with pytest.raises(ConfigError, match="streaming='always'"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="always")
    exchanged = layer.workspace.exchanged
    assert len(exchanged) == 1 and "streaming='always'" in exchanged[0][4]
    # timeline and delays need the streamed schedule by request, not by the policy's answer (which would
    # differ between ranks' arguments only after the exchange); the hooks are checked with the call's arguments.
    with pytest.raises(ConfigError, match="timeline"):
        layer.debug.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="auto", timeline=True)
    with pytest.raises(ConfigError, match="stage_events"):
        layer.debug.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming="auto", stage_events=[])
    with pytest.raises(ConfigError, match=r"producer_delay_ns=\[1\]"):
        layer.debug.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming=True, producer_delay_ns=[1])
    with pytest.raises(ConfigError, match="timeline .a test hook: layer.debug.forward"):
        layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming=True, timeline=True)
    assert len(exchanged) == 5 and all(e[4] for e in exchanged) and layer.executor.hooks is None
    # The other rank (whose arguments are fine) raises in the same exchange, naming rank 0's error.
    other = _layer(1, [4, 4], refusals={0: "timeline/producer_delay_ns/consumer_delay_ns: only for ..."})
    with pytest.raises(ConfigError, match=r"rejected by rank\(s\) \[0\]: rank 0: timeline"):
        other.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
    assert layer.workspace.calls == other.workspace.calls == 0  # a refused call is counted nowhere


def test_diverged_call_sequences_raise_on_every_rank_before_planning():
    """Issue 33, item 1: the call identity (call number and layer) travels with the counts; a rank at another call
    or layer makes every rank raise a CallMismatch naming it, before anything is planned."""
    from symmring.errors import CallMismatch
    for rank in range(2):
        layer = _layer(rank, [4, 4], identities={1: protocol.call_identity(0, 2)})
        if rank == 1:  # its own identity is what it sent: layer 3; rank 0's is layer 3 too (the stub's default)
            layer.workspace.identities = {0: protocol.call_identity(0, 2)}
        with pytest.raises(CallMismatch) as info:
            layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
        assert (info.value.peer, info.value.expected_layer, info.value.observed_layer) == (1 - rank, 3, 2)
        assert layer.workspace.calls == 0
    agreed = _layer(0, [4, 4])
    with pytest.raises(_Planned):
        agreed.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)))
    assert agreed.workspace.calls == 1  # counted once agreed


def test_ranks_calling_with_other_options_raise_on_every_rank():
    """Issue 34: the call's options travel with its counts (as the CPU layer's always did), so ranks that pass
    another ``streaming`` or ``small_batch`` raise on every rank, before anything is planned; the code before
    sent no options and each rank planned its own schedule (a hang, or rows paired across schedules)."""
    for rank in range(2):
        layer = _layer(rank, [4, 4], options={1 - rank: (True, None)})
        with pytest.raises(ConfigError, match=r"rank\(s\) \[%d\] with \[\(True, None\)\]" % (1 - rank)):
            layer.forward(torch.zeros((4, 8)), logits=torch.zeros((4, 4)), streaming=False)
        assert layer.workspace.calls == 0


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
        layer = _layer(rank, [4] * world_size, latched=latched)
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
    from symmring.moe import calls
    decoded = []
    # What the code before the fix read instead (the cleared latch and rings) held nothing: the words decide.
    with pytest.raises(RuntimeError, match="named from the words"):
        calls.raise_latched(0, [words, None], lambda w: decoded.append(w) or RuntimeError("named from the words"))
    assert decoded == [words]
