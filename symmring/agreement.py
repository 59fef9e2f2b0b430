"""What every rank must share: the configuration, checked once at construction (issue 24, item 5), and each
call's verdict and identity, checked in the call's exchange.

A ring (`symmring.kernels.DeviceRing`) or layer (`symmring.moe.gpu.MoE`) whose ranks were built with different
specs would allocate symmetric regions of different sizes and read each other's slots at the wrong offsets:
the mismatch would show up, if at all, as a broken barrier or a timeout far from its cause. So each rank
contributes its fields to one bounded exchange, and `check_same` (a pure function over the gathered values,
testable without a GPU) raises a `ConfigError` naming the first rank and field that differ from rank 0's.

A call is agreed the same way, inside the exchange it already makes (its token counts): every rank sends its
argument check's verdict (`rejection`: a rank whose arguments failed still joins, so every rank raises the
same `ConfigError` and none waits for it) and its call identity (`call_mismatch`: the call number and layer
of `symmring.protocol.call_identity`; ranks whose call sequences diverged get a `CallMismatch` on every rank
before anything is enqueued).

Example:
    >>> check_same([{"hidden": 1024, "topk": 2}, {"hidden": 1024, "topk": 2}], what="MoE")
    >>> check_same([{"hidden": 1024, "topk": 2}, {"hidden": 1024, "topk": 4}], what="MoE")
    Traceback (most recent call last):
    ...
    symmring.errors.ConfigError: MoE: rank 1 has topk=4 but rank 0 has topk=2 (every rank must pass the same value)
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from .errors import CallMismatch, ConfigError

_MISSING = object()


def check_same(values: Sequence[Mapping[str, Any]], *, what: str) -> None:
    """Raise ConfigError unless every rank's ``values[rank]`` equals rank 0's, field by field.

    Args:
        values: one mapping of field name to value per rank, in rank order (`Collectives.allgather`).
        what: the object checked, named in the error (``"DeviceRing spec"``).

    Raises:
        ConfigError: names the lowest rank that differs and its first differing field (in rank 0's field
            order; a field only one side has counts as differing), with both values.
    """
    if not values:
        return
    first = values[0]
    for rank, mine in enumerate(values[1:], start=1):
        for field in list(first) + [f for f in mine if f not in first]:
            theirs, ours = first.get(field, _MISSING), mine.get(field, _MISSING)
            if theirs != ours:
                show = lambda v: "nothing" if v is _MISSING else f"{field}={v!r}"  # noqa: E731
                raise ConfigError(f"{what}: rank {rank} has {show(ours)} but rank 0 has {show(theirs)} "
                                  "(every rank must pass the same value)")


def exchange_and_check(collectives, fields: Mapping[str, Any], *, what: str, timeout_s=None) -> None:
    """Collective: gather every rank's ``fields`` (bounded, `Collectives.allgather`: the host bound unless
    ``timeout_s``) and `check_same` them. Every rank gets the same list, so every rank raises the same
    ConfigError."""
    check_same(collectives.allgather(dict(fields), what=f"{what}: agreement", timeout_s=timeout_s), what=what)


def rejection(errors: Sequence[Optional[str]], rank: int, what: str) -> Optional[ConfigError]:
    """The `ConfigError` this rank raises when some rank's argument check failed, or None when none did.

    Args:
        errors: every rank's message (None where its arguments passed), in rank order: one exchange, so
            the same list on every rank, and every rank raises.
        rank: this rank (its own message where it failed; else one naming the ranks that failed).

    Example:
        >>> print(rejection([None, "x.shape=(3, 5): expected (n, 8)", None], 0, "forward"))
        forward: rejected by rank(s) [1]: rank 1: x.shape=(3, 5): expected (n, 8)
        >>> rejection([None, None], 1, "forward") is None
        True
    """
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if not bad:
        return None
    if errors[rank]:
        return ConfigError(errors[rank])
    return ConfigError(f"{what}: rejected by rank(s) {[r for r, _ in bad]}: " +
                       "; ".join(f"rank {r}: {e}" for r, e in bad))


def call_mismatch(identities: Sequence[int], rank: int, what: str) -> Optional[CallMismatch]:
    """The `CallMismatch` this rank raises when the ranks' call identities (`symmring.protocol.call_identity`,
    exchanged: the same list on every rank) are not all equal, naming the lowest rank whose identity differs
    from this rank's (or, on a rank alone with its identity, the lowest other rank); None when they agree.

    Example:
        >>> from symmring.protocol import call_identity
        >>> print(call_mismatch([call_identity(5, 1), call_identity(4, 1)], 0, "MoE.forward"))  # doctest: +ELLIPSIS
        rank 0: call mismatch in MoE.forward: this rank is at call #5 of layer 1, rank 1 at call #4 of layer 1 ...
    """
    mine = identities[rank]
    odd = next((r for r, other in enumerate(identities) if other != mine), None)
    if odd is None:
        return None
    return CallMismatch(rank=rank, peer=odd, expected=mine, observed=identities[odd], where=f" in {what}",
                        advice="reset() (collective) puts every rank's call count back to 0")
