"""The ranks of a multi-process test, whichever launcher started them (mpiexec or torchrun).

`RankWorld` gives the tests the few collectives they use to reach one verdict on every rank (``Get_rank``,
``Get_size``, ``allgather``, ``gather``, ``bcast``, ``allreduce`` with `SUM`/`MAX`/`MIN`, ``Barrier``), with
mpi4py's names, over a `symmring.collective.Collectives` channel of its own (bounded by the host bound), so
that a test that breaks the context's channel on purpose still reaches its verdict.
"""

from __future__ import annotations

from typing import Any, List, Optional

from symmring.collective import Collectives

SUM, MAX, MIN = "sum", "max", "min"
_REDUCE = {SUM: sum, MAX: max, MIN: min}


class RankWorld:
    """Verdict collectives over ``ranks`` (an mpi4py communicator, torch.distributed ranks, or None for a
    process alone: what `symmring.init` joined, ``ctx.ranks``), bounded by ``timeout_s`` (collective
    constructor). `of` makes one over a context's ranks."""

    def __init__(self, ranks, timeout_s: float):
        self.chan = Collectives(ranks, timeout_s, what="tests: verdict channel")
        #: How the ranks were started: ``"mpi"``, ``"torch"`` or ``"alone"``.
        self.kind = self.chan.kind

    @classmethod
    def of(cls, ctx) -> "RankWorld":
        """Verdict collectives over the ranks of the `symmring.Context` ``ctx``."""
        return cls(ctx.ranks, ctx.host_timeout_s)

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.chan.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.chan.world_size

    def allgather(self, value: Any) -> List[Any]:
        return self.chan.allgather(value, what="tests: allgather")

    def gather(self, value: Any, root: int = 0) -> Optional[List[Any]]:
        values = self.chan.allgather(value, what="tests: gather")
        return values if self.chan.rank == root else None

    def bcast(self, value: Any, root: int = 0) -> Any:
        return self.chan.allgather(value if self.chan.rank == root else None, what="tests: bcast")[root]

    def allreduce(self, value: Any, op: str = SUM) -> Any:
        return _REDUCE[op](self.chan.allgather(value, what=f"tests: allreduce {op}"))

    def Barrier(self) -> None:  # noqa: N802
        self.chan.barrier(what="tests: barrier")

    barrier = Barrier

    def close(self) -> None:
        self.chan.close()
