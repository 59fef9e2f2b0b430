"""symmring.transport without a GPU: parsing and validation of a transport request, its resolution into one
transport per rank from which peers are mapped, the descriptor's rdma mask bits, and the environment
variable; and that the descriptor carries the mask's address where the device reads it."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from symmring import transport
from symmring.errors import BackendError, ConfigError
from symmring.layout import RingLayout, RingSpec

SEED = 20261216


@pytest.mark.parametrize("value, want", [
    ("auto", ("auto", None)), ("p2p", ("p2p", None)), ("rdma", ("rdma", None)), (" RDMA ", ("rdma", None)),
    ("rdma:1", ("rdma", (1,))), ("rdma:3,1", ("rdma", (1, 3))), ("rdma: 0 , 2", ("rdma", (0, 2))),
])
def test_parse_accepts_every_form(value, want):
    assert transport.parse(value) == want


@pytest.mark.parametrize("bad", ["", "nvlink", "rdma:", "rdma:a", "rdma:1,,2", "rdma:-1", "rdma:1,1", "p2p:1",
                                 "auto:0", None, 3, ["rdma"]])
def test_parse_rejects_anything_else_naming_the_argument(bad):
    with pytest.raises(ConfigError, match=r"^transport="):
        transport.parse(bad)
    with pytest.raises(ConfigError, match=r"^SYMMRING_TRANSPORT="):
        transport.parse(bad, name="SYMMRING_TRANSPORT")


def test_resolve_auto_p2p_rdma_and_mixed():
    mapped = [True, True, False, True]
    assert transport.resolve("auto", rank=0, world_size=4, mapped=mapped) == ["self", "p2p", "rdma", "p2p"]
    assert transport.resolve("rdma", rank=1, world_size=4, mapped=mapped) == ["rdma", "self", "rdma", "rdma"]
    # Mixed: the listed peers rdma, the others p2p where mapped (rdma where not); this PE stays "self".
    assert transport.resolve("rdma:1,3", rank=1, world_size=4, mapped=mapped) == ["p2p", "self", "rdma", "rdma"]
    assert transport.resolve("rdma:3", rank=0, world_size=4, mapped=[True] * 4) == ["self", "p2p", "p2p", "rdma"]


def test_resolve_p2p_names_the_unmapped_peer():
    with pytest.raises(BackendError, match="rank 2's symmetric memory is not load/store reachable from rank 0"):
        transport.resolve("p2p", rank=0, world_size=4, mapped=[True, True, False, True])
    # This PE's own entry never counts as unmapped.
    assert transport.resolve("p2p", rank=2, world_size=3, mapped=[True, True, False]) == ["p2p", "p2p", "self"]


def test_resolve_rejects_ranks_outside_the_world_and_bad_mappings():
    with pytest.raises(ConfigError, match=r"peer ranks \[4\] outside \[0, world_size=4\)"):
        transport.resolve("rdma:1,4", rank=0, world_size=4, mapped=[True] * 4)
    with pytest.raises(ConfigError, match="expected 4 entries"):
        transport.resolve("auto", rank=0, world_size=4, mapped=[True] * 3)


def test_rdma_mask_sets_one_bit_per_rdma_rank_like_the_ack_mask():
    rng = random.Random(SEED)
    for world in (1, 2, 63, 64, 65, 130):
        kinds = [rng.choice(["p2p", "rdma"]) for _ in range(world)]
        kinds[rng.randrange(world)] = "self"
        words = transport.rdma_mask(kinds)
        assert words.dtype == np.uint64 and len(words) == -(-world // 64)
        got = [q for q in range(world) if int(words[q // 64]) >> (q % 64) & 1]
        assert got == [q for q, t in enumerate(kinds) if t == "rdma"], world


def test_request_reads_the_environment_after_the_argument(monkeypatch):
    monkeypatch.delenv(transport.ENV_VAR, raising=False)
    assert transport.request() == ("auto", "default")
    monkeypatch.setenv(transport.ENV_VAR, "rdma:1")
    assert transport.request() == ("rdma:1", "SYMMRING_TRANSPORT")
    assert transport.request("p2p") == ("p2p", "transport=")  # the argument wins
    monkeypatch.setenv(transport.ENV_VAR, "fast")
    with pytest.raises(ConfigError, match=r"^SYMMRING_TRANSPORT='fast'"):
        transport.request()
    monkeypatch.setenv(transport.ENV_VAR, "rdma:2")
    with pytest.raises(ConfigError, match=r"^SYMMRING_TRANSPORT='rdma:2': peer ranks \[2\] outside"):
        transport.request(world_size=2)


class _Backend:
    """The two attributes `for_backend` reads, and a mapping probe."""

    def __init__(self, rank, mapped):
        self.rank, self.world_size, self._mapped = rank, len(mapped), mapped
        self.probed = []

    def peer_mapped(self, alloc, rank):
        self.probed.append((alloc, rank))
        return self._mapped[rank]


def test_for_backend_probes_every_peer_and_logs_the_choice(monkeypatch, caplog):
    monkeypatch.delenv(transport.ENV_VAR, raising=False)
    backend = _Backend(1, [True, True, False])
    with caplog.at_level(logging.INFO, logger="symmring.transport"):
        got = transport.for_backend(backend, "ALLOC", None, what="ring")
    assert got == ["p2p", "self", "rdma"]
    assert backend.probed == [("ALLOC", 0), ("ALLOC", 2)]
    assert "ring on rank 1: transport 'auto' (default): 0:p2p, 1:self, 2:rdma" in caplog.text


class _Collectives:
    """Stand-in for the backend's bounded collectives: allgather returns what the other ranks 'sent'."""

    def __init__(self, others):
        self.others, self.sent = others, []

    def allgather(self, value, *, what):
        self.sent.append((value, what))
        return [value if r is None else r for r in self.others]


def test_for_backend_fails_on_every_rank_when_one_rank_cannot_have_p2p(monkeypatch):
    # Rank 0 maps its peer; rank 1 (simulated) does not and raised: rank 0 must raise too, naming rank 1,
    # instead of going on to the next collective alone.
    monkeypatch.delenv(transport.ENV_VAR, raising=False)
    backend = _Backend(0, [True, True])
    backend.collectives = _Collectives([None, "transport='p2p': rank 0 is not reachable"])
    with pytest.raises(BackendError, match=r"^rank 1: transport='p2p': rank 0 is not reachable"):
        transport.for_backend(backend, "ALLOC", "p2p", what="ring")
    assert backend.collectives.sent == [(None, "ring: transports")]
    # The rank that failed itself raises its own error after telling the others.
    failing = _Backend(1, [False, True])
    failing.collectives = _Collectives([None, None])
    with pytest.raises(BackendError, match="rank 0's symmetric memory is not load/store reachable"):
        transport.for_backend(failing, "ALLOC", "p2p", what="ring")
    assert "not load/store reachable" in failing.collectives.sent[0][0]
    # Everyone fine: the same resolution as without collectives.
    fine = _Backend(0, [True, True])
    fine.collectives = _Collectives([None, None])
    assert transport.for_backend(fine, "ALLOC", "p2p", what="ring") == ["self", "p2p"]


def test_descriptor_carries_the_rdma_mask_address():
    layout = RingLayout(RingSpec(num_slots=2, tokens_per_slot=4, hidden=128, num_topk=2, num_experts=8), 4)
    assert int(layout.descriptor(0x1000, rank=1)["rdma_mask_ptr"]) == 0  # no rdma peer: every peer p2p
    assert int(layout.descriptor(0x1000, rank=1, rdma_mask_address=0xBEEF00)["rdma_mask_ptr"]) == 0xBEEF00
