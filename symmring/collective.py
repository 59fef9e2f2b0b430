"""Bounded host collectives: every barrier and exchange between ranks ends within a timeout, naming the
ranks that did not arrive.

A plain ``MPI_Barrier`` or ``allgather`` (or a gloo collective) waits for a rank that is late, stalled or
gone -- gloo up to its own timeout, after which the group is unusable -- and says nothing about which rank
that is. `Collectives` replaces them for everything symmring does on the host (context setup, ring and
buffer allocation and release, the MoE layers' validation and token-count exchanges, teardown): each
collective is an all-to-all of small messages that every rank polls until every rank's message arrived or
the bound passed. How the messages travel is a `symmring.wire.Wire`: point-to-point MPI messages on a
private duplicate communicator (mpirun), or keys in the c10d store of a torch.distributed ProcessGroup
(torchrun); what follows holds for both.

* **Who is missing** is exactly the set of ranks whose message did not arrive, so the `PeerTimeout`
  every waiting rank raises names them (a barrier built on ``Ibarrier`` could only say "someone").
* **A late rank learns it too.** A rank that gives up leaves a notice (an MPI message to every rank; on the
  store, written into the keys of the ranks that did not come); a rank that arrives later finds it and
  raises `PeerTimeout` naming the rank that gave up. Over MPI, if the notice is still in flight when the
  late rank has found every value, it completes that collective and fails in its next one (the others never
  send theirs); over the store it fails in that one. A late rank never pairs a collective with a different
  one.
* **Different collectives are reported.** Each message carries the collective's name (``what``): ranks
  that reach different collectives at the same point raise `BrokenStateError` naming both at once.
* **Broken is sticky.** After a `PeerTimeout` the channel is broken: every later call raises
  `BrokenStateError`, so no collective is ever matched with a different one on another rank. A new
  ``symmring.init()`` makes a new channel and starts afresh.
* **No hang at exit, and the others report first.** ``MPI_Finalize`` synchronises with every rank (MPICH
  waits for a late one). So a process whose channel broke, or that saw a protocol wait expire
  (`Collectives.record_fault`) with no collective completing afterwards, ends the job at exit
  (``MPI_Abort``; under torch.distributed ``os._exit(1)``, after which torchrun's agent stops the other
  workers), status 1, after logging why -- but first it marks its exit to every other rank and waits, up
  to the failure's bound, until every rank that may still report has marked its own (`await_reports`):
  otherwise the first rank to abort kills the others before they reported. A later collective that every
  rank reached (a ``close()``, a new ``symmring.init()``) resolves it.

Collectives must be called in the same order on every rank (as MPI's); each carries a sequence number,
so a rank that runs ahead never mixes two collectives. Blocking calls that have no bounded form (MPI
window allocation and release, NVSHMEM's init and ``malloc``) are preceded by a bounded barrier, so they
start only when every rank is there.

The bound of a collective is the channel's ``timeout_s``: the context's *host* bound
(``SYMMRING_HOST_TIMEOUT_S``, `symmring.context.init`'s ``host_timeout_s``), separate from the protocol
waits' bound, since a rank may be late to an exchange for long and legitimate reasons (a first call's
compile, loading weights, a long prefill).

Example:
    >>> from symmring import mpi
    >>> chan = Collectives(mpi.load().COMM_WORLD, timeout_s=5.0)
    >>> chan.allgather(chan.rank, what="ranks")            # [0, 1, 2] under mpiexec -n 3 or torchrun
    [0]
    >>> chan.barrier(what="after setup")
    >>> chan.close()
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
from typing import Any, Dict, List, Optional, Set

from .errors import BrokenStateError, ConfigError, PeerTimeout, ProtocolTimeout, SymmringError
from .wire import Backoff, Sealed, WireError, open_wire

log = logging.getLogger(__name__)

#: Every channel made in this process, by creation order (for the check at exit).
_channels: List["Collectives"] = []
_serial = itertools.count(1)
_exit_hook_registered = False


def _check_timeout(timeout_s) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
    return float(timeout_s)


class Collectives:
    """Bounded collectives over the ranks of one communicator or process group (collective constructor).

    Args:
        world: an mpi4py intracommunicator, a torch.distributed ProcessGroup, or None for a process alone.
        timeout_s: the default bound of every collective, in seconds (``ctx.host_timeout_s``).
        what: what the constructor's own exchange is for (named in its `PeerTimeout`).

    Attributes:
        rank, world_size: this process's rank and the number of ranks.
        timeout_s: the default bound.
        kind: how the messages travel: ``"mpi"``, ``"torch"`` (`symmring.wire`), or ``"alone"``.
        failure: what broke the channel (a `PeerTimeout`, or a `BrokenStateError` for ranks found in
            different collectives), or None.
        fault: a protocol wait that expired since the last collective that every rank reached (a rank
            may be stalled or gone), or None: `record_fault`.

    Raises:
        ConfigError: a non-positive timeout.
        PeerTimeout: not every rank made its channel within the bound (MPI: the duplicate of ``world``
            never completed; which ranks are missing is unknown at this point).
    """

    def __init__(self, world, timeout_s: float, *, what: str = "symmring.init"):
        self.timeout_s = _check_timeout(timeout_s)
        self.parent = world
        self.failure: Optional[SymmringError] = None
        self.fault: Optional[BaseException] = None
        self.closed = False
        self.serial = next(_serial)
        self._sequence = 0
        self.established = False  #: every rank joined (the wire exists)
        self._wire = open_wire(world)
        self.rank = self._wire.rank if self._wire is not None else 0
        self.world_size = self._wire.world_size if self._wire is not None else 1
        self.kind = self._wire.kind if self._wire is not None else "alone"
        if self._wire is not None:
            _register(self)  # before the join: a join that times out must end the job at exit too
            try:
                self._wire.join(self.timeout_s, what=what)
            except PeerTimeout as failure:
                self._break(failure)
                raise
        self.established = True

    # --- state ----------------------------------------------------------------------------------------

    @property
    def broken(self) -> bool:
        """Whether a collective failed on this channel (its ranks are in an unknown state)."""
        return self.failure is not None

    def check(self) -> None:
        """Raise `BrokenStateError` if an earlier collective of this channel failed."""
        if self.failure is not None:
            raise BrokenStateError(f"rank {self.rank}: the communicator is in an unknown state after: "
                                   f"{self.failure}; close the context and call symmring.init() again",
                                   self.failure)
        if self.closed:
            raise BrokenStateError(f"rank {self.rank}: the collectives channel was closed")

    def record_fault(self, error: BaseException) -> None:
        """Note that a protocol wait expired (a `ProtocolTimeout` of a ring or layer): until a collective
        completes on every rank, a rank may be stalled or gone, so exiting ends the job (after the report
        wait) instead of entering ``MPI_Finalize``. The channel itself stays usable."""
        if self.world_size > 1:
            self.fault = error

    def _break(self, failure: SymmringError, *, notice: Optional[dict] = None) -> None:
        """Mark the channel broken; with a ``notice`` (ranks found in different collectives), tell every
        other rank why."""
        self.failure = failure
        log.info("%s", failure)
        if notice is not None:
            self._wire.announce(dict(notice, origin=self.rank))

    def _noticed(self, notice: dict) -> SymmringError:
        """The error a rank raises on another rank's notice (it gave up, or found a mismatch)."""
        if notice["kind"] == "mismatch":
            return BrokenStateError(f"rank {self.rank}: rank {notice['origin']} found the ranks in different "
                                    f"collectives: {notice['text']}")
        return PeerTimeout(notice["operation"], rank=self.rank, world_size=self.world_size,
                           missing_ranks=notice["missing"], timeout_s=notice["timeout_s"],
                           sequence=notice["sequence"], origin=notice["origin"])

    # --- collectives ----------------------------------------------------------------------------------

    def allgather(self, value: Any, *, what: str, timeout_s: Optional[float] = None) -> List[Any]:
        """Every rank's ``value`` (any picklable object), in rank order, within the bound.

        Args:
            value: this rank's contribution.
            what: what the exchange is for, e.g. ``"Ring: spec exchange"``: named in errors, and the
                same string on every rank (it identifies the collective: ranks that reach different
                collectives at the same point are reported, not paired).
            timeout_s: the bound; the channel's `timeout_s` (the host bound) when None.

        Raises:
            PeerTimeout: some ranks' values did not arrive within the bound (named), or another rank
                gave up on this collective first (named as ``origin``). The channel is broken after it.
            BrokenStateError: an earlier collective of this channel failed, or the ranks called different
                collectives here (named; the channel is then broken).

        Example:
            >>> from symmring import mpi
            >>> chan = Collectives(mpi.load().COMM_WORLD, timeout_s=5.0)
            >>> chan.allgather(7, what="MoE.forward: token counts")    # one rank: [7]
            [7]
            >>> chan.close()
        """
        self.check()
        bound = self.timeout_s if timeout_s is None else _check_timeout(timeout_s)
        if self._wire is None:
            return [value]
        self._sequence += 1
        try:
            return self._exchange(self._sequence, value, what, bound)
        except WireError as exc:  # the store is gone: the ranks' state is unknown, as after a timeout
            if self.failure is None:
                self._break(BrokenStateError(f"rank {self.rank}: collective '{what}' (#{self._sequence}) "
                                             f"failed: {exc}", exc))
            raise self.failure from exc

    def _exchange(self, sequence: int, value: Any, what: str, bound: float) -> List[Any]:
        """`allgather`'s collective number ``sequence``: post, then poll until complete or past the bound."""
        wire = self._wire
        found = wire.post(sequence, (what, value))
        if found is not None:  # another rank gave up on this collective before this rank came
            self._break(self._noticed(found))
            raise self.failure
        values: Dict[int, Any] = {self.rank: value}
        pending = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + bound
        backoff = Backoff()
        while True:
            for src, message in wire.receive(sequence, pending).items():
                if isinstance(message, Sealed):  # a rank gave up waiting for `src`
                    self._break(self._noticed(message.notice))
                    raise self.failure
                their_what, values[src] = message
                pending.remove(src)
                if their_what != what:
                    text = f"collective #{sequence}: rank {src} called '{their_what}', rank {self.rank} '{what}'"
                    self._break(BrokenStateError(f"rank {self.rank}: the ranks called different collectives: "
                                                 f"{text}"), notice=dict(kind="mismatch", text=text))
                    raise self.failure
            # A notice means another rank gave up (on this or an earlier collective): never complete.
            notice = wire.notice()
            if notice is not None:
                self._break(self._noticed(notice))
                raise self.failure
            if not pending and not wire.undelivered(sequence):
                self.fault = None  # every rank reached this collective: nobody is stalled or gone
                wire.completed(sequence)
                return [values[r] for r in range(self.world_size)]
            if time.monotonic() >= deadline:
                # Ranks whose value never came; if all came, those that never took ours (they left).
                missing = pending or wire.undelivered(sequence)
                missing = wire.give_up(sequence, missing, dict(kind="timeout", operation=what, sequence=sequence,
                                                               missing=list(missing), timeout_s=bound,
                                                               origin=self.rank))
                if missing:
                    self._break(PeerTimeout(what, rank=self.rank, world_size=self.world_size,
                                            missing_ranks=missing, timeout_s=bound, sequence=sequence))
                    raise self.failure
                deadline = time.monotonic()  # (store) every missing message won the race: read them
            backoff()

    def barrier(self, *, what: str, timeout_s: Optional[float] = None) -> None:
        """Return once every rank reached this barrier, within the bound (see `allgather`)."""
        self.allgather(None, what=what, timeout_s=timeout_s)

    def agree(self, ok: bool, *, what: str, timeout_s: Optional[float] = None) -> bool:
        """Whether ``ok`` holds on every rank (a collective verdict, the bounded ``allreduce(MIN)``)."""
        return all(self.allgather(bool(ok), what=what, timeout_s=timeout_s))

    # --- exit -----------------------------------------------------------------------------------------

    def await_reports(self, problem: BaseException) -> Set[int]:
        """At exit with ``problem`` unresolved: mark this rank's exit to every other rank, then wait (bounded
        by the problem's bound) until each other rank is accounted for: it marked its own exit, or a rank
        that marked names it as one it waited for. Returns the ranks not accounted for when the wait ended.

        A rank never counts its own suspicions: the peer a protocol wait named may itself be waiting for a
        third rank, and reports later. So with one rank stalled, the others end the job as soon as they
        have all reported; a `PeerTimeout`'s missing ranks did not come to the collective at all and are
        not waited for.
        """
        suspects = _suspects(problem, self.rank)
        absent = set(problem.missing_ranks) if isinstance(problem, PeerTimeout) else set()
        waited = {r for r in range(self.world_size) if r != self.rank} - absent
        bound = getattr(problem, "timeout_s", None) or self.timeout_s
        if not self.established:  # no wire to carry the marks (its join timed out)
            return waited
        try:
            self._wire.mark_exit(sorted(suspects))
            deadline = time.monotonic() + bound
            backoff = Backoff()
            while True:
                marks = self._wire.exit_marks()
                named = {s for rank, theirs in marks.items() for s in theirs if s != rank}
                left = waited - set(marks) - named
                if not left or time.monotonic() >= deadline:
                    return left
                backoff()
        except WireError as exc:
            log.warning("rank %d: could not wait for the other ranks' reports at exit: %s", self.rank, exc)
            return waited

    # --- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the channel (after a bounded barrier). Idempotent; a broken channel keeps its MPI
        communicator (freeing it is collective) and only drops the reference."""
        if self.closed:
            return
        if self._wire is not None:
            healthy = not self.broken
            if healthy:
                self.barrier(what="close")
            self._wire.close(healthy)
        self.closed = True

    def __repr__(self) -> str:
        state = "broken" if self.broken else ("closed" if self.closed else "open")
        return (f"Collectives(rank={self.rank}, world_size={self.world_size}, {self.kind}, "
                f"timeout_s={self.timeout_s:g}, {state})")


def _suspects(problem: BaseException, rank: int) -> Set[int]:
    """The ranks ``problem`` says this rank waited for in vain (named in its exit mark)."""
    if isinstance(problem, PeerTimeout):
        return set(problem.missing_ranks)
    if isinstance(problem, ProtocolTimeout):
        named = set(problem.missing_ranks or ())
        if problem.peer is not None:
            named.add(problem.peer)
        return named - {rank}
    return set()


def _register(channel: Collectives) -> None:
    global _exit_hook_registered
    _channels.append(channel)
    if not _exit_hook_registered:
        # Runs before mpi4py finalizes MPI (registered later, so earlier in atexit's LIFO order; mpi4py's
        # own finalizer is a C-level exit hook that runs after every atexit handler).
        atexit.register(_abort_if_broken)
        _exit_hook_registered = True


def _unresolved():
    """``(channel, problem)`` of the newest channel whose failure or recorded fault is unresolved, or None."""
    for channel in reversed(_channels):
        problem = channel.failure or channel.fault
        if problem is None:
            continue
        replaced = any(c.serial > channel.serial and c.established and c.failure is None and c.fault is None
                       and c.parent == channel.parent for c in _channels)
        if not replaced:
            return channel, problem
    return None


def unresolved_failure() -> Optional[BaseException]:
    """What makes exiting unsafe, or None: the failure of a broken channel, or a fault recorded on one
    (`Collectives.record_fault`) that no later collective resolved, unless a later channel over the same
    communicator or group (a ``symmring.init()`` that every rank joined) replaced it."""
    found = _unresolved()
    return None if found is None else found[1]


def _abort_if_broken() -> None:
    found = _unresolved()
    if found is None:
        return
    channel, problem = found
    log.error("symmring: rank %d ends the job at exit (after the other ranks report, at most %g s) instead of a "
              "normal exit, which may wait for a rank that never comes, after %s: %s", channel.rank,
              getattr(problem, "timeout_s", None) or channel.timeout_s, type(problem).__name__, problem)
    left = channel.await_reports(problem)
    if left:
        log.error("symmring: rank %d: ranks %s did not report within the bound", channel.rank, sorted(left))
    channel._wire.abort()
