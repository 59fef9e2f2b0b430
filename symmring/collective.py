"""Bounded host collectives: every barrier and exchange between ranks ends within a timeout, naming the
ranks that did not arrive.

A plain ``MPI_Barrier`` or ``allgather`` waits forever for a rank that is late, stalled or gone, and says
nothing about which rank that is. `Collectives` replaces them for everything symmring does on the host
(context setup, ring and buffer allocation and release, the MoE layers' validation and token-count
exchanges, teardown): each collective is an all-to-all of small point-to-point messages on a private
duplicate of the communicator, polled until every rank's message arrived or the bound passed.

* **Who is missing** is exactly the set of ranks whose message did not arrive, so the `PeerTimeout`
  every waiting rank raises names them (a barrier built on ``Ibarrier`` could only say "someone").
* **A late rank learns it too.** A rank that gives up sends a notice to every other rank; a rank that
  arrives later finds it and raises `PeerTimeout` naming the rank that gave up. If the notice is still in
  flight when the late rank has found every value, it completes that collective, and fails in its next
  one (the others never send theirs): a late rank never pairs a collective with a different one.
* **Different collectives are reported.** Each message carries the collective's name (``what``): ranks
  that reach different collectives at the same point raise `BrokenStateError` naming both at once.
* **Broken is sticky.** After a `PeerTimeout` the channel is broken: every later call raises
  `BrokenStateError`, so no collective is ever matched with a different one on another rank. A new
  ``symmring.init()`` makes a new channel (a fresh duplicate) and starts afresh.
* **No hang at exit.** ``MPI_Finalize`` synchronises with every rank (MPICH waits for a late one), so a
  process whose channel broke, or that saw a protocol wait expire (`Collectives.record_fault`) with no
  collective completing afterwards, aborts the MPI job at exit (``MPI_Abort``, exit status 1) after
  logging why, rather than waiting in ``MPI_Finalize`` for a rank that may never come. A later
  collective that every rank reached (a ``close()``, a new ``symmring.init()``) resolves it.

Collectives must be called in the same order on every rank (as MPI's); each carries a sequence number
(its message tag), so a rank that runs ahead never mixes two collectives. Blocking MPI collectives
that have no bounded form (window allocation and release, communicator splits) are preceded by a
bounded barrier, so they start only when every rank is there.

Example:
    >>> from symmring import mpi
    >>> chan = Collectives(mpi.load().COMM_WORLD, timeout_s=5.0)
    >>> chan.allgather(chan.rank, what="ranks")            # [0, 1, 2] under mpiexec -n 3
    [0]
    >>> chan.barrier(what="after setup")
    >>> chan.close()
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import time
from typing import Any, Dict, List, Optional

from .errors import BrokenStateError, ConfigError, PeerTimeout, SymmringError

log = logging.getLogger(__name__)

#: Tag of the notice a rank sends when it gives up on a collective; collectives use tags from 1.
_NOTICE_TAG = 0
#: Polls that only yield the CPU before the backoff starts sleeping; first and largest sleep (s).
_YIELD_POLLS = 16
_SLEEP_MIN_S = 20e-6
_SLEEP_MAX_S = 1e-3

#: Every channel made in this process, by creation order (for the check at exit).
_channels: List["Collectives"] = []
_serial = itertools.count(1)
_exit_hook_registered = False


def _check_timeout(timeout_s) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
    return float(timeout_s)


class _Backoff:
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


class Collectives:
    """Bounded collectives over the ranks of one communicator (collective constructor).

    Args:
        comm: an mpi4py intracommunicator, or None for a process alone (a world of 1).
        timeout_s: the default bound of every collective, in seconds (``ctx.timeout_s``).
        what: what the constructor's own exchange is for (named in its `PeerTimeout`).

    Attributes:
        rank, world_size: this process's rank and the number of ranks.
        timeout_s: the default bound.
        failure: what broke the channel (a `PeerTimeout`, or a `BrokenStateError` for ranks found in
            different collectives), or None.
        fault: a protocol wait that expired since the last collective that every rank reached (a rank
            may be stalled or gone), or None: `record_fault`.

    Raises:
        ConfigError: a non-positive timeout.
        PeerTimeout: not every rank made its channel within the bound (the duplicate of ``comm`` never
            completed; which ranks are missing is unknown at this point).
    """

    def __init__(self, comm, timeout_s: float, *, what: str = "symmring.init"):
        self.timeout_s = _check_timeout(timeout_s)
        self.parent = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.world_size = comm.Get_size() if comm is not None else 1
        self.failure: Optional[SymmringError] = None
        self.fault: Optional[BaseException] = None
        self.closed = False
        self.serial = next(_serial)
        self._sequence = 0
        self._comm = None
        self.established = False  #: every rank joined (the private duplicate exists)
        self._pending_sends: List = []
        if self.world_size > 1:
            from mpi4py import MPI
            self._MPI = MPI
            self._tag_limit = int(comm.Get_attr(MPI.TAG_UB))
            _register(self)
            # A private duplicate: our messages never meet the application's. Idup so the wait is bounded.
            dup, request = comm.Idup()
            deadline = time.monotonic() + self.timeout_s
            backoff = _Backoff()
            while not request.Test():
                if time.monotonic() >= deadline:
                    self._break(PeerTimeout(what, rank=self.rank, world_size=self.world_size, missing_ranks=(),
                                            timeout_s=self.timeout_s))
                    raise self.failure
                backoff()
            self._comm = dup
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
        completes on every rank, a rank may be stalled or gone, so exiting aborts the job instead of
        entering ``MPI_Finalize``. The channel itself stays usable."""
        if self.world_size > 1:
            self.fault = error

    def _break(self, failure: SymmringError, *, notice: Optional[dict] = None) -> None:
        """Mark the channel broken; with a ``notice``, tell every other rank (a late one too) why."""
        self.failure = failure
        log.info("%s", failure)
        if notice is not None and self._comm is not None:
            notice = dict(notice, origin=self.rank)
            # Never waited for: a rank that is gone simply never receives it.
            self._pending_sends += [self._comm.isend(notice, dest, _NOTICE_TAG)
                                    for dest in range(self.world_size) if dest != self.rank]

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
            timeout_s: the bound; the channel's `timeout_s` when None.

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
        if self.world_size == 1:
            return [value]
        comm, MPI = self._comm, self._MPI
        self._sequence += 1
        sequence = self._sequence
        tag = 1 + (sequence - 1) % (self._tag_limit - 1)
        others = [r for r in range(self.world_size) if r != self.rank]
        sends = [comm.isend((what, value), dest, tag) for dest in others]
        values: Dict[int, Any] = {self.rank: value}
        pending = list(others)
        deadline = time.monotonic() + bound
        backoff = _Backoff()
        while True:
            for src in list(pending):
                message = comm.improbe(src, tag)
                if message is None:
                    continue
                their_what, values[src] = message.recv()
                pending.remove(src)
                if their_what != what:
                    text = f"collective #{sequence}: rank {src} called '{their_what}', rank {self.rank} '{what}'"
                    self._break(BrokenStateError(f"rank {self.rank}: the ranks called different collectives: "
                                                 f"{text}"), notice=dict(kind="mismatch", text=text))
                    raise self.failure
            # A notice means another rank gave up (on this or an earlier collective): never complete.
            notice = comm.improbe(MPI.ANY_SOURCE, _NOTICE_TAG)
            if notice is not None:
                self._break(self._noticed(notice.recv()))
                raise self.failure
            if not pending and all(request.Test() for request in sends):
                self.fault = None  # every rank reached this collective: nobody is stalled or gone
                return [values[r] for r in range(self.world_size)]
            if time.monotonic() >= deadline:
                # Ranks whose value never came; if all came, those that never took ours (they left).
                missing = pending or [d for d, request in zip(others, sends) if not request.Test()]
                failure = PeerTimeout(what, rank=self.rank, world_size=self.world_size, missing_ranks=missing,
                                      timeout_s=bound, sequence=sequence)
                self._break(failure, notice=dict(kind="timeout", operation=what, sequence=sequence,
                                                 missing=list(failure.missing_ranks), timeout_s=bound))
                raise self.failure
            backoff()

    def barrier(self, *, what: str, timeout_s: Optional[float] = None) -> None:
        """Return once every rank reached this barrier, within the bound (see `allgather`)."""
        self.allgather(None, what=what, timeout_s=timeout_s)

    def agree(self, ok: bool, *, what: str, timeout_s: Optional[float] = None) -> bool:
        """Whether ``ok`` holds on every rank (a collective verdict, the bounded ``allreduce(MIN)``)."""
        return all(self.allgather(bool(ok), what=what, timeout_s=timeout_s))

    # --- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the private communicator (after a bounded barrier). Idempotent; a broken channel keeps
        it (freeing it is collective) and only drops the reference."""
        if self.closed:
            return
        if self._comm is not None and not self.broken:
            self.barrier(what="close")
            self._comm.Free()
        self._comm = None
        self.closed = True

    def __repr__(self) -> str:
        state = "broken" if self.broken else ("closed" if self.closed else "open")
        return f"Collectives(rank={self.rank}, world_size={self.world_size}, timeout_s={self.timeout_s:g}, {state})"


def _register(channel: Collectives) -> None:
    global _exit_hook_registered
    _channels.append(channel)
    if not _exit_hook_registered:
        # Runs before mpi4py finalizes MPI (registered later, so earlier in atexit's LIFO order; mpi4py's
        # own finalizer is a C-level exit hook that runs after every atexit handler).
        atexit.register(_abort_if_broken)
        _exit_hook_registered = True


def unresolved_failure() -> Optional[BaseException]:
    """What makes exiting unsafe, or None: the failure of a broken channel, or a fault recorded on one
    (`Collectives.record_fault`) that no later collective resolved, unless a later channel over the same
    communicator (a ``symmring.init()`` that every rank joined) replaced it."""
    for channel in reversed(_channels):
        problem = channel.failure or channel.fault
        if problem is None:
            continue
        replaced = any(c.serial > channel.serial and c.established and c.failure is None and c.fault is None
                       and c.parent == channel.parent for c in _channels)
        if not replaced:
            return problem
    return None


def _abort_if_broken() -> None:
    problem = unresolved_failure()
    if problem is None:
        return
    message = (f"symmring: aborting the MPI job at exit instead of entering MPI_Finalize, which would wait "
               f"for a rank that may never come, after {type(problem).__name__}: {problem}")
    log.error("%s", message)
    try:
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)
    finally:  # pragma: no cover - Abort does not return
        os._exit(1)
