"""The exceptions symmring raises, all under one base class.

``ConfigError`` is raised before any GPU or shared-memory work starts, so a bad argument never leaves a
ring half-written. ``ProtocolTimeout`` is raised when a bounded wait expires; it names who waited for
what, and who did not answer, so a stalled rank is identified rather than merely suspected.
"""

from __future__ import annotations

from typing import Optional, Sequence


class SymmringError(Exception):
    """Base class of every symmring error."""


class ConfigError(SymmringError, ValueError):
    """A bad argument or configuration, detected before any work is enqueued.

    The message names the argument, the value received and what was expected.
    """


class BackendError(SymmringError, RuntimeError):
    """A backend could not be initialised or used (no GPU, no NVSHMEM, MPI not usable, ...)."""


class RingClosedError(SymmringError, RuntimeError):
    """A ring (or a context) was used after ``close()``/``finalize()``."""


class CompileError(SymmringError, RuntimeError):
    """Device code failed to compile or link; carries the source name, the options and the log."""

    def __init__(self, message: str, *, source: str = "", options: Sequence[str] = (), log: str = ""):
        self.source = source
        self.options = tuple(options)
        self.log = log
        detail = f"{message}\n  source: {source}\n  options: {' '.join(self.options)}"
        if log:
            detail += f"\n  compiler log:\n{log}"
        super().__init__(detail)


class ProtocolTimeout(SymmringError, TimeoutError):
    """A bounded protocol wait expired.

    Attributes:
        kind: what was awaited: ``"route_ready"``, ``"layout_ready"``, ``"reuse"`` (acknowledgements of a
            slot's previous use) or ``"combine"``.
        rank: the rank that waited.
        peer: the rank whose signal was awaited (the slot owner for ready/combine waits), or ``None``.
        slot: the ring slot.
        expected: the generation (or mask) that was awaited.
        observed: the value seen when the wait gave up.
        missing_ranks: the ranks that never answered: for ``"reuse"`` those whose acknowledgement bit never
            arrived, for other waits those whose signal never came (where the waiter knows them).
        timeout_s: the bound that expired.
    """

    def __init__(self, kind: str, *, rank: int, slot: int, expected: int, observed: int,
                 peer: Optional[int] = None, missing_ranks: Sequence[int] = (), timeout_s: float = 0.0,
                 chunk: Optional[int] = None):
        self.kind = kind
        self.rank = rank
        self.peer = peer
        self.slot = slot
        self.chunk = chunk
        self.expected = expected
        self.observed = observed
        self.missing_ranks = tuple(missing_ranks)
        self.timeout_s = timeout_s
        where = f"slot {slot}" + (f" (chunk {chunk})" if chunk is not None else "")
        src = f" of rank {peer}" if peer is not None else ""
        msg = (f"rank {rank}: timed out after {timeout_s:g} s waiting for {kind}{src} on {where}: "
               f"expected {expected}, observed {observed}")
        if self.missing_ranks:
            what = "acknowledgements" if kind == "reuse" else "signals"
            msg += f"; missing {what} from ranks {list(self.missing_ranks)}"
        super().__init__(msg)
