"""How the messages of a bounded host collective travel between ranks: MPI messages or c10d store keys.

`symmring.collective.Collectives` owns what a collective means (sequence numbers, names compared, the ranks
named in a `PeerTimeout`, broken is sticky, the report wait and abort at exit); a `Wire` only moves its
small messages, and every one of its operations returns at once (no blocking receive, no blocking
``get``), so the collective's own deadline is the only bound on a wait:

* `MpiWire` (an mpi4py communicator, under ``mpirun``/``mpiexec``): point-to-point messages on a private
  duplicate of the communicator (``Idup``, itself bounded), one tag per collective (its sequence number),
  polled with ``improbe``; a rank that gives up sends a notice to every other rank (tag 0), which they
  find at their next poll; exit marks on tag 1.
* `StoreWire` (a ``torch.distributed`` ProcessGroup, or torchrun's workers without one): keys in the
  group's c10d store (torchrun's ``TCPStore``, which lives in its agent, not in a rank). Rank ``r``'s
  message of collective ``s`` is the key ``symmring/<group>/<channel>/<s>/<r>``, written once with
  ``compare_set`` and polled with ``check`` (one round trip each); once collective ``s`` completed on a rank,
  every rank has read ``s - 1``, so it deletes its own key of ``s - 1``. A rank that gives up writes its
  notice *into the keys of the ranks that did not come*, also with ``compare_set``: the late rank's own
  write and the notice cannot both win, so either the late rank's message counts (it was not late after
  all) or every rank, the late one included, finds the notice in that key and raises -- no rank ever
  completes a collective another rank gave up on. Exit marks are keys too.

torch's own collectives (``all_gather_object`` over gloo) are not used: a gloo collective that times out
leaves the group unusable and does not say which rank was missing.

Example (a world of one needs no wire; the torch and MPI cases run under their launchers: tests/mpi):
    >>> open_wire(None) is None
    True
"""

from __future__ import annotations

import abc
import itertools
import logging
import os
import pickle
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Set

from .errors import PeerTimeout, SymmringError

log = logging.getLogger(__name__)

#: Polls that only yield the CPU before the backoff starts sleeping; first and largest sleep (s).
_YIELD_POLLS = 16
_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3


class Backoff:
    """Yield a few times, then sleep 20 us doubling to 1 ms: ranks sharing few cores keep progressing."""

    def __init__(self):
        self.polls = 0
        self.sleep_s = _SLEEP_MIN_S

    def __call__(self) -> None:
        self.polls += 1
        if self.polls <= _YIELD_POLLS:
            os.sched_yield()
        else:
            time.sleep(self.sleep_s)
            self.sleep_s = min(2 * self.sleep_s, _SLEEP_MAX_S)


class WireError(SymmringError):
    """The wire itself failed (the c10d store could not be reached): `Collectives` breaks the channel."""


class Sealed:
    """What a source's key holds when another rank gave up on the collective first: its notice."""

    def __init__(self, notice: dict):
        self.notice = notice

    def __repr__(self) -> str:
        return f"Sealed({self.notice})"


class Wire(abc.ABC):
    """The messages of one channel of `symmring.collective.Collectives`; every call returns at once."""

    #: ``"mpi"`` or ``"torch"``.
    kind: str
    rank: int
    world_size: int

    def join(self, timeout_s: float, *, what: str) -> None:
        """Wait, bounded, until every rank made its end of the wire (nothing to wait for by default)."""

    @abc.abstractmethod
    def post(self, sequence: int, message: Any) -> Optional[dict]:
        """Offer this rank's ``message`` of collective ``sequence`` to every other rank. Returns the notice
        found in its place (a rank gave up on this collective before this one came), else None."""

    @abc.abstractmethod
    def receive(self, sequence: int, sources: Sequence[int]) -> Dict[int, Any]:
        """The messages of collective ``sequence`` that arrived from ``sources`` (a `Sealed` for a source
        whose place holds another rank's notice)."""

    @abc.abstractmethod
    def undelivered(self, sequence: int) -> List[int]:
        """The ranks that have not taken this rank's message of ``sequence`` (empty where taking needs no
        action of theirs)."""

    @abc.abstractmethod
    def notice(self) -> Optional[dict]:
        """A notice another rank sent when it gave up (on any collective), else None."""

    @abc.abstractmethod
    def give_up(self, sequence: int, missing: Sequence[int], notice: dict) -> List[int]:
        """At the deadline of ``sequence``: tell the others this rank gave up, waiting for ``missing``.
        Returns the ranks still missing (a rank whose message beat the notice is not)."""

    @abc.abstractmethod
    def announce(self, notice: dict) -> None:
        """Tell every other rank that this rank found the ranks in different collectives."""

    @abc.abstractmethod
    def completed(self, sequence: int) -> None:
        """Collective ``sequence`` completed on this rank (every rank has posted it)."""

    @abc.abstractmethod
    def mark_exit(self, suspects: Sequence[int]) -> None:
        """Tell every other rank that this rank is about to end the job (naming the ranks it suspects)."""

    @abc.abstractmethod
    def exit_marks(self) -> Dict[int, List[int]]:
        """The exit marks of the other ranks so far: rank -> the ranks it suspects."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End the whole job now, with exit status 1 (does not return)."""

    @abc.abstractmethod
    def close(self, healthy: bool) -> None:
        """Release the wire; ``healthy``: every rank closes too (collective release allowed)."""


# --- MPI --------------------------------------------------------------------------------------------------

#: Tags: a notice of a rank that gave up; an exit mark; collectives from `_FIRST_TAG` (their sequence).
_NOTICE_TAG, _EXIT_TAG, _FIRST_TAG = 0, 1, 2


class MpiWire(Wire):
    """Messages on a private duplicate of an mpi4py communicator (see the module docstring); `join` waits
    (bounded) until every rank made it."""

    kind = "mpi"

    def __init__(self, comm):
        from mpi4py import MPI
        self._MPI = MPI
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self._tag_span = int(comm.Get_attr(MPI.TAG_UB)) - _FIRST_TAG
        self._sends: Dict[int, list] = {}  # sequence -> (dest, request) of this rank's message
        self._pending: List = []  # notices and exit marks: never waited for (a rank gone never takes them)
        self._exits: Dict[int, List[int]] = {}
        # A private duplicate: our messages never meet the application's. Idup, so the wait is bounded.
        self._comm = None
        self._dup, self._dup_request = comm.Idup()

    def join(self, timeout_s: float, *, what: str) -> None:
        """Wait until the private duplicate exists (every rank made its channel).

        Raises:
            PeerTimeout: not within ``timeout_s`` (which ranks are missing is unknown here).
        """
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while not self._dup_request.Test():
            if time.monotonic() >= deadline:
                raise PeerTimeout(what, rank=self.rank, world_size=self.world_size, missing_ranks=(),
                                  timeout_s=timeout_s)
            backoff()
        self._comm = self._dup

    def _tag(self, sequence: int) -> int:
        return _FIRST_TAG + (sequence - 1) % self._tag_span

    def _others(self) -> List[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def post(self, sequence, message):
        tag = self._tag(sequence)
        self._sends[sequence] = [(dest, self._comm.isend(message, dest, tag)) for dest in self._others()]
        return None  # a notice comes as its own message (`notice`)

    def receive(self, sequence, sources):
        found = {}
        for src in sources:
            message = self._comm.improbe(src, self._tag(sequence))
            if message is not None:
                found[src] = message.recv()
        return found

    def undelivered(self, sequence):
        return [dest for dest, request in self._sends.get(sequence, []) if not request.Test()]

    def notice(self):
        message = self._comm.improbe(self._MPI.ANY_SOURCE, _NOTICE_TAG)
        return None if message is None else message.recv()

    def give_up(self, sequence, missing, notice):
        self.announce(notice)
        return list(missing)

    def announce(self, notice):
        self._pending += [self._comm.isend(notice, dest, _NOTICE_TAG) for dest in self._others()]

    def completed(self, sequence):
        self._sends.pop(sequence, None)  # every request tested complete

    def mark_exit(self, suspects):
        if self._comm is not None:
            self._pending += [self._comm.isend(list(suspects), dest, _EXIT_TAG) for dest in self._others()]

    def exit_marks(self):
        while self._comm is not None:
            message = self._comm.improbe(self._MPI.ANY_SOURCE, _EXIT_TAG)
            if message is None:
                return dict(self._exits)
            status = self._MPI.Status()
            suspects = message.recv(status=status)
            self._exits[status.Get_source()] = list(suspects)
        return {}

    def abort(self):
        try:
            self._MPI.COMM_WORLD.Abort(1)
        finally:  # pragma: no cover - Abort does not return
            os._exit(1)

    def close(self, healthy):
        if healthy and self._comm is not None:
            self._comm.Free()
        self._comm = None


# --- torch.distributed: the group's c10d store ------------------------------------------------------------

#: Channels made per group in this process: every rank makes them in the same order (as MPI's Idup), so the
#: n-th channel over a group has the same key prefix on every rank of it.
_store_channels: Dict[str, "itertools.count"] = {}


class StoreWire(Wire):
    """Keys in the c10d store of torch.distributed ranks (see the module docstring).

    Args:
        ranks: a ProcessGroup (this process must be a member), or torchrun's workers
            (`symmring.world.StoreRanks`).
    """

    kind = "torch"

    def __init__(self, ranks):
        from . import world
        self._store, self.rank, self.world_size, name = world.store_of(ranks)
        serial = next(_store_channels.setdefault(name, itertools.count(1)))
        self.prefix = f"symmring/{name}/{serial}"

    def _key(self, sequence, rank) -> str:
        return f"{self.prefix}/{sequence}/{rank}"

    def _call(self, method: str, *args):
        try:
            return getattr(self._store, method)(*args)
        except Exception as exc:  # noqa: BLE001 - DistStoreError, DistNetworkError, RuntimeError
            raise WireError(f"rank {self.rank}: the c10d store of the group failed ({method}): "
                            f"{type(exc).__name__}: {exc}") from exc

    def _claim(self, key: str, payload: bytes) -> Any:
        """Write ``payload`` into ``key`` unless it holds a value already; returns what it holds then."""
        held = self._call("compare_set", key, "", payload)
        return pickle.loads(held)

    def post(self, sequence, message):
        held = self._claim(self._key(sequence, self.rank), pickle.dumps(("value", message)))
        return held[1] if held[0] == "notice" else None

    def receive(self, sequence, sources):
        keys = [self._key(sequence, src) for src in sources]
        if not keys:
            return {}
        if len(keys) > 1 and self._call("check", keys):  # all of them: one more round trip
            ready = list(sources)
        else:
            ready = [src for src, key in zip(sources, keys) if self._call("check", [key])]
            if not ready:
                return {}
        values = self._call("multi_get", [self._key(sequence, src) for src in ready])
        found = {}
        for src, raw in zip(ready, values):
            kind, body = pickle.loads(raw)
            found[src] = Sealed(body) if kind == "notice" else body
        return found

    def undelivered(self, sequence):
        return []  # a key needs nothing from its readers

    def notice(self):
        return None  # notices are in the keys (`give_up`)

    def give_up(self, sequence, missing, notice):
        sealed = pickle.dumps(("notice", notice))
        still = []
        for rank in missing:
            kind, body = self._claim(self._key(sequence, rank), sealed)
            if kind == "notice":  # ours, or another rank's that gave up first: the rank never came
                still.append(rank)
        return still

    def announce(self, notice):
        return None  # every rank reads the same keys, so every rank finds the mismatch itself

    def completed(self, sequence):
        if sequence > 1:  # every rank posted `sequence`, so every rank has read `sequence - 1`
            self._call("delete_key", self._key(sequence - 1, self.rank))

    def mark_exit(self, suspects):
        self._call("set", f"{self.prefix}/exit/{self.rank}", pickle.dumps(list(suspects)))

    def exit_marks(self):
        marks = {}
        for rank in range(self.world_size):
            key = f"{self.prefix}/exit/{rank}"
            if rank != self.rank and self._call("check", [key]):
                marks[rank] = pickle.loads(self._call("get", key))
        return marks

    def abort(self):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
                pass
        os._exit(1)

    def close(self, healthy):
        # This rank's key of the last collective stays (no later collective says when every rank read it):
        # one small key per rank and channel, gone with the store at the end of the job.
        self._store = None


def open_wire(world) -> Optional[Wire]:
    """The wire of ``world``: an mpi4py communicator (`MpiWire`), a torch.distributed ProcessGroup or torchrun's
    `symmring.world.StoreRanks` (`StoreWire`), or None for a world of one rank (no wire: every collective is this rank's own value).
    Call its `Wire.join` before the first collective."""
    if world is None:
        return None
    from . import world as worlds
    if worlds.is_torch_ranks(world):
        return StoreWire(world) if worlds.store_of(world)[2] > 1 else None
    if world.Get_size() == 1:
        return None
    return MpiWire(world)
