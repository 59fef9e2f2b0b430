"""The exceptions symmring raises, all under one base class.

``ConfigError`` is raised before any GPU or shared-memory work starts, so a bad argument never leaves a
ring half-written. ``ProtocolTimeout`` is raised when a bounded wait expires; it names who waited for
what, and who did not answer, so a stalled rank is identified rather than merely suspected. Its subclass
``PeerTimeout`` is the same for a host collective (a barrier or an exchange of `symmring.collective`)
that a rank did not reach in time; its subclass ``ProtocolAborted`` is a device wait that gave up because
another rank recorded a device error first (it names that rank and its error). ``ProtocolViolation``
(``StalePayload``, ``DoubleAck``, ``PoolOverflow``, ``CallMismatch``, ``CallRefused``) is a check that found the protocol
broken: ``CallMismatch`` names ranks whose call sequences diverged (another call's or another layer's
payload where this call's was due), found in the token-count exchange or, inside a model step, by the
consumer on the device. ``BrokenStateError`` is what a context, ring or layer raises after such a failure
left the ranks in an unknown state, until it is re-initialised (or, for a workspace, reset); its subclass
``StepFailed`` is what every rank raises when a model step failed on some rank.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .identity import split_call_identity


class SymmringError(Exception):
    """Base class of every symmring error."""


class ConfigError(SymmringError, ValueError):
    """A bad argument or configuration, detected before any work is enqueued.

    The message names the argument, the value received and what was expected.
    """


class BackendError(SymmringError, RuntimeError):
    """A backend could not be initialised or used (no GPU, no NVSHMEM, MPI not usable, ...)."""


class KernelArgsMismatch(BackendError):
    """The host's layout of a kernel's argument struct (`symmring.moe.gpu.kernel_args`) differs from the device
    header's (``device/moe/args.cuh``) as the device compiler lays it out: found when the layer's kernels load,
    before any of them runs; the message names each struct and field that differs."""


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


def _with_advice(message: str, advice: str) -> str:
    """``message``, then ``"; <advice>"`` when there is advice (what the caller can do, e.g. "call reset()")."""
    return f"{message}; {advice}" if advice else message


class _ProtocolError(SymmringError):
    """What every protocol error records (`ProtocolTimeout`, `ProtocolViolation`): the wait or check (``kind``),
    the rank that made it, the peer it concerned, the slot and chunk, and what it expected and observed."""

    def __init__(self, message: str, *, kind: str, rank: int, peer: Optional[int], slot: Optional[int],
                 chunk: Optional[int], expected: Optional[int], observed: int):
        self.kind = kind
        self.rank = rank
        self.peer = peer
        self.slot = slot
        self.chunk = chunk
        self.expected = expected
        self.observed = observed
        super().__init__(message)


class ProtocolTimeout(_ProtocolError, TimeoutError):
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
                 chunk: Optional[int] = None, advice: str = ""):
        missing = tuple(missing_ranks)
        where = f"slot {slot}" + (f" (chunk {chunk})" if chunk is not None else "")
        src = f" of rank {peer}" if peer is not None else ""
        msg = (f"rank {rank}: timed out after {timeout_s:g} s waiting for {kind}{src} on {where}: "
               f"expected {expected}, observed {observed}")
        if missing:
            what = "acknowledgements" if kind == "reuse" else "signals"
            msg += f"; missing {what} from ranks {list(missing)}"
        super().__init__(_with_advice(msg, advice), kind=kind, rank=rank, peer=peer, slot=slot, chunk=chunk,
                         expected=expected, observed=observed)
        self.missing_ranks = missing
        self.timeout_s = timeout_s


class ProtocolAborted(ProtocolTimeout):
    """A device wait (or kernel) of this rank gave up because another rank recorded a device error first and
    raised this rank's abort word (docs/PROTOCOL.md section 10).

    Attributes (beyond `ProtocolTimeout`'s, where ``kind`` is ``"aborted"``, ``peer`` is the origin, and
    ``slot``/``chunk``/``expected`` describe this rank's wait, or are None when a kernel returned at entry):
        origin: the rank whose error aborted the ring.
        origin_kind: that rank's error kind (``"route_ready"``, ``"reuse"``, ``"stale_payload"``, ...).
        origin_peer: the peer named in that rank's record (the rank it waited for, or the slot's owner).
        origin_chunk: the chunk of that rank's record (None when it did not fit the abort word).
        waited: what this rank's wait awaited (``"route_ready"``, ...), or None.
    """

    def __init__(self, *, rank: int, origin: int, origin_kind: str, origin_peer: int,
                 origin_chunk: Optional[int], waited: Optional[str] = None, slot: Optional[int] = None,
                 chunk: Optional[int] = None, expected: Optional[int] = None, advice: str = ""):
        super().__init__("aborted", rank=rank, slot=slot, expected=expected, observed=0, peer=origin, chunk=chunk)
        self.origin = origin
        self.origin_kind = origin_kind
        self.origin_peer = origin_peer
        self.origin_chunk = origin_chunk
        self.waited = waited
        at = f" chunk {origin_chunk}" if origin_chunk is not None else " a chunk"
        if waited is not None:
            what = (f"while waiting for {waited} on slot {slot} (chunk {chunk}, expected {expected})")
        else:
            what = "(a kernel returned at entry, before any wait of its own)"
        msg = (f"rank {rank}: aborted {what}: rank {origin} recorded a device error first ({origin_kind} about "
               f"rank {origin_peer},{at}); rank {origin}'s check_errors() names it")
        self.args = (_with_advice(msg, advice),)


class ProtocolViolation(_ProtocolError, RuntimeError):
    """A device check found the protocol broken (not a timeout): the error record of a detector.

    Attributes:
        kind: ``"stale_payload"`` or ``"double_ack"``.
        rank: the rank whose check failed; peer: the slot's owner; slot, chunk: where.
        expected, observed: what the check wanted and what it found.
    """

    def __init__(self, kind: str, message: str, *, rank: int, peer: int, slot: int, chunk: int, expected: int,
                 observed: int):
        super().__init__(message, kind=kind, rank=rank, peer=peer, slot=slot, chunk=chunk, expected=expected,
                         observed=observed)


class StalePayload(ProtocolViolation):
    """A consumer acquired a slot's readiness for generation ``expected`` of ``chunk``, but the slot's meta
    row named another generation (``observed``) or chunk (``observed_chunk``): the slot was overwritten while
    in use, or the ranks ran different call sequences."""

    def __init__(self, *, rank: int, peer: int, slot: int, chunk: int, expected: int, observed: int,
                 observed_chunk: int, advice: str = ""):
        self.observed_chunk = observed_chunk
        msg = (f"rank {rank}: stale payload in rank {peer}'s slot {slot}: its readiness said chunk {chunk}, "
               f"generation {expected}, but the slot's meta row holds chunk {observed_chunk}, generation "
               f"{observed} (the slot was overwritten while in use, or the ranks ran different call "
               "sequences); the payload was not used")
        super().__init__("stale_payload", _with_advice(msg, advice), rank=rank, peer=peer, slot=slot, chunk=chunk,
                         expected=expected, observed=observed)


class DoubleAck(ProtocolViolation):
    """A consumer's acknowledgement bit was already set in the owner's mask when it acknowledged: the same
    generation acknowledged twice, or a slot the owner never acquired."""

    def __init__(self, *, rank: int, peer: int, slot: int, chunk: int, expected: int, observed: int,
                 advice: str = ""):
        msg = (f"rank {rank}: acknowledged chunk {chunk} (slot {slot}) of rank {peer} twice: its bit "
               f"{expected:#x} was already set in rank {peer}'s mask word ({observed:#x} before the OR)")
        super().__init__("double_ack", _with_advice(msg, advice), rank=rank, peer=peer, slot=slot, chunk=chunk,
                         expected=expected, observed=observed)


class PoolOverflow(ProtocolViolation):
    """A MoE kernel found more rows than the call's plan bounded (or a row whose token lies past its owner's
    combine rows) and wrote none of them past its buffer: the ranks planned different calls (a call refused on
    one rank only, a stale slot), so the call's rows would not be right. The kernel aborted the ring on every
    rank (device/moe/bounds.cuh); ``reset`` is the way back.

    Attributes (beyond `ProtocolViolation`'s, where ``kind`` is ``"pool_overflow"``, ``expected`` the bound and
    ``observed`` what was found):
        bound: ``"window_rows"`` (the pool rows of the window's passes), ``"expert_rows"`` (the rows one
            expert may hold) or ``"combine_token"`` (the tokens of every combine buffer).
        expert: the global expert id of ``"expert_rows"``, else None.
    """

    BOUNDS = ("window_rows", "expert_rows", "combine_token")

    def __init__(self, *, rank: int, peer: int, slot: int, chunk: int, expected: int, observed: int, what: int,
                 advice: str = ""):
        code, expert = what & 0xFF, what >> 8
        self.bound = self.BOUNDS[code] if code < len(self.BOUNDS) else f"bound {code}"
        self.expert = expert if self.bound == "expert_rows" else None
        if self.bound == "combine_token":
            found = (f"a row of chunk {chunk} names token {observed} of rank {peer}, outside the {expected} tokens "
                     "of its combine rows")
        elif self.bound == "expert_rows":
            found = (f"expert {expert} holds {observed} rows of the window at chunk {chunk}, more than the "
                     f"{expected} the call's plan bounded")
        else:
            found = (f"the window at chunk {chunk} holds {observed} pool rows, more than the {expected} the call's "
                     "plan covers")
        msg = (f"rank {rank}: pool overflow: {found} (the ranks planned different calls, or a slot was stale); "
               "no row was written past its buffer and the call's output is not valid")
        super().__init__("pool_overflow", _with_advice(msg, advice), rank=rank, peer=peer, slot=slot, chunk=chunk,
                         expected=expected, observed=observed)


class CallMismatch(ProtocolViolation):
    """Ranks whose call sequences diverged: where this rank expected its call number ``expected_call`` of layer
    ``expected_layer``, rank ``peer`` was at call ``observed_call`` of layer ``observed_layer`` (a rank refused
    or skipped a call the others made, or called another layer). Found in the token-count exchange (before
    anything is enqueued; ``slot``/``chunk`` None) or, inside a model step, by a consumer on the device from
    the slot's meta row (the payload was not used; every rank's output of the call is NaN and the error is
    raised on every rank at the next step, `symmring.Workspace.step`). ``expected``/``observed`` hold the
    raw identities (`symmring.protocol.call_identity`)."""

    def __init__(self, *, rank: int, peer: int, expected: int, observed: int, slot: Optional[int] = None,
                 chunk: Optional[int] = None, where: str = "", advice: str = ""):
        self.expected_call, self.expected_layer = split_call_identity(expected)
        self.observed_call, self.observed_layer = split_call_identity(observed)
        at = f" in rank {peer}'s slot {slot} (chunk {chunk})" if slot is not None else ""
        msg = (f"rank {rank}: call mismatch{at}{where}: this rank is at call #{self.expected_call} of layer "
               f"{self.expected_layer}, rank {peer} at call #{self.observed_call} of layer {self.observed_layer} "
               "(the ranks' call sequences diverged: a rank refused, skipped or reordered a call); no row of it "
               "was used")
        super().__init__("call_mismatch", _with_advice(msg, advice), rank=rank, peer=peer, slot=slot, chunk=chunk,
                         expected=expected, observed=observed)


class CallRefused(ProtocolViolation):
    """This rank refused a call inside a model step (its arguments failed a check the other ranks could not see:
    the `ConfigError` it raised then): it recorded the refusal on the layer's ring, which aborts the call on every
    other rank (their `ProtocolAborted` names it), so no rank pairs this call with another. ``expected``: the
    refused call's identity (`symmring.protocol.call_identity`)."""

    def __init__(self, *, rank: int, expected: int, advice: str = ""):
        self.call, self.layer = split_call_identity(expected)
        msg = (f"rank {rank}: refused its call #{self.call} of layer {self.layer} inside a step (its arguments "
               "failed a check; the ConfigError was raised there) and stopped the ring on every rank")
        super().__init__("peer_refused", _with_advice(msg, advice), rank=rank, peer=rank, slot=0, chunk=0,
                         expected=expected, observed=0)


class PeerTimeout(ProtocolTimeout):
    """A bounded host collective (`symmring.collective`) did not complete: a rank is late, stalled or gone.

    Raised on every rank that waited, naming the ranks that did not arrive; and on a late rank that
    arrives after another rank gave up, naming that rank (``origin``). The communicator is then in an
    unknown state: the context refuses further calls (`BrokenStateError`) until ``symmring.init()``
    runs again (see docs/CPU_BACKEND.md, "Host-side faults").

    Attributes (beyond `ProtocolTimeout`'s, where ``kind`` is ``"collective"``):
        operation: what the collective was for, e.g. ``"Ring: spec exchange"``.
        sequence: the collective's number on this communicator (the same on every rank).
        origin: the rank that gave up first when it is not this rank (a notice it sent), else ``None``.
    """

    def __init__(self, operation: str, *, rank: int, world_size: int, missing_ranks: Sequence[int],
                 timeout_s: float, sequence: int = 0, origin: Optional[int] = None):
        self.operation = operation
        self.sequence = sequence
        self.origin = origin
        missing = sorted(missing_ranks)
        arrived = world_size - len(missing)
        super().__init__("collective", rank=rank, slot=0, expected=world_size, observed=arrived,
                         peer=origin if origin is not None else (missing[0] if missing else None),
                         missing_ranks=missing, timeout_s=timeout_s)
        if origin is not None:
            late = "this rank arrived too late" if rank in missing else "this rank was waiting for them too"
            msg = (f"rank {rank}: rank {origin} gave up on collective '{operation}' (#{sequence}) after "
                   f"{timeout_s:g} s waiting for ranks {missing}; {late}")
        elif missing:
            msg = (f"rank {rank}: timed out after {timeout_s:g} s in collective '{operation}' (#{sequence}): "
                   f"ranks {missing} did not arrive ({arrived} of {world_size} did)")
        else:
            msg = (f"rank {rank}: timed out after {timeout_s:g} s in collective '{operation}' (#{sequence}): "
                   "which ranks are missing is unknown (before the first exchange)")
        self.args = (msg,)


class BrokenStateError(SymmringError, RuntimeError):
    """A context, ring or layer whose state across ranks is unknown after an earlier failure.

    Raised instead of running any further collective or protocol step (which could pair with a different
    step on another rank): after a `PeerTimeout` on the context's communicator, and by a layer after a
    wait expired inside one of its calls. ``close()`` still works (it skips collective teardown when the
    communicator is broken); then ``symmring.init()`` (or a new layer) starts afresh.

    Attributes:
        cause: the error that left the state unknown.
    """

    def __init__(self, message: str, cause: Optional[BaseException] = None):
        self.cause = cause
        super().__init__(message)


class StepFailed(BrokenStateError):
    """A model step (`symmring.Workspace.step`) failed on some rank -- an exception left it, or a call inside it
    was refused -- so the ranks' calls of that step may not have paired; raised on every rank at the entry of
    the next step (its exchange carries every rank's failure), and at every later entry until
    `symmring.Workspace.reset` (collective).

    Attributes:
        failures: ``{rank: what failed there}`` for every rank that reported a failure.
    """

    def __init__(self, rank: int, failures: dict, advice: str = ""):
        self.failures = dict(failures)
        what = "; ".join(f"rank {r}: {text}" for r, text in sorted(self.failures.items()))
        super().__init__(_with_advice(f"rank {rank}: a model step failed on rank(s) {sorted(self.failures)} "
                                      f"({what})", advice))
