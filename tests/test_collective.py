"""symmring.collective in one process, the errors it raises, and what a broken context does.

The multi-rank behaviour (late ranks named, mismatches, re-init) is in tests/mpi/test_collectives.py and
tests/test_faults.py; here a world of 1 and a failure set by hand.
"""

from __future__ import annotations

import pytest

from symmring import ConfigError, ProtocolTimeout, Ring, RingSpec, collective
from symmring.collective import Collectives
from symmring.context import init
from symmring.errors import BrokenStateError, PeerTimeout

SPEC = RingSpec(num_slots=2, tokens_per_slot=4, hidden=32, num_topk=2, num_experts=8, sf_group_size=16)


def test_world_of_one_needs_nobody():
    chan = Collectives(None, 1.0)
    assert (chan.rank, chan.world_size) == (0, 1)
    assert chan.allgather({"a": 1}, what="x") == [{"a": 1}]
    chan.barrier(what="y")
    assert chan.agree(True, what="z") and not chan.agree(False, what="z")
    chan.record_fault(RuntimeError("ignored alone"))
    assert chan.fault is None and collective.unresolved_failure() is None
    chan.close()
    with pytest.raises(BrokenStateError, match="closed"):
        chan.barrier(what="after close")


@pytest.mark.parametrize("bad", [0, -1, "2", True])
def test_bad_timeout_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="timeout_s"):
        Collectives(None, bad)
    with pytest.raises(ConfigError, match="timeout_s"):
        Collectives(None, 1.0).allgather(1, what="x", timeout_s=bad)


def test_peer_timeout_messages_name_operation_ranks_and_bound():
    waited = PeerTimeout("Ring: spec exchange", rank=0, world_size=4, missing_ranks=[3, 1], timeout_s=2.0,
                         sequence=7)
    assert isinstance(waited, ProtocolTimeout) and waited.kind == "collective"
    assert (waited.peer, waited.missing_ranks, waited.origin) == (1, (1, 3), None)
    assert str(waited) == ("rank 0: timed out after 2 s in collective 'Ring: spec exchange' (#7): ranks [1, 3] "
                           "did not arrive (2 of 4 did)")
    late = PeerTimeout("forward: token counts", rank=3, world_size=4, missing_ranks=[3], timeout_s=2.0,
                       sequence=9, origin=0)
    assert late.peer == 0 and "rank 0 gave up" in str(late) and "this rank arrived too late" in str(late)
    fellow = PeerTimeout("x", rank=2, world_size=4, missing_ranks=[3], timeout_s=2.0, origin=0)
    assert "was waiting for them too" in str(fellow)
    unknown = PeerTimeout("symmring.init", rank=1, world_size=4, missing_ranks=(), timeout_s=2.0)
    assert unknown.peer is None and "unknown" in str(unknown)


def test_broken_context_refuses_work_and_closes_without_collectives():
    ctx = init("host", timeout_s=5.0)
    ring = Ring(ctx, SPEC)
    ctx.collectives.failure = PeerTimeout("injected", rank=0, world_size=2, missing_ranks=[1], timeout_s=5.0)
    assert ctx.broken and "broken" in repr(ctx)
    for thunk in (ctx.check_open, lambda: Ring(ctx, SPEC), lambda: ring.begin_call(1),
                  lambda: ctx.collectives.allgather(1, what="x")):
        with pytest.raises(BrokenStateError, match="unknown state") as info:
            thunk()
        assert info.value.cause is ctx.collectives.failure
    ring.close()  # drops the window: no barrier, no MPI_Win_free
    ctx.close()
    assert ring.closed and ctx.closed
    fresh = init("host", timeout_s=5.0)  # a new init starts afresh
    Ring(fresh, SPEC).close()
    fresh.close()
