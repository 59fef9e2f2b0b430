"""Configuration every rank must share, checked once at construction (issue 24, item 5).

A ring (`symmring.kernels.DeviceRing`) or layer (`symmring.moe.gpu.MoE`) whose ranks were built with different
specs would allocate symmetric regions of different sizes and read each other's slots at the wrong offsets:
the mismatch would show up, if at all, as a broken barrier or a timeout far from its cause. So each rank
contributes its fields to one bounded exchange, and `check_same` (a pure function over the gathered values,
testable without a GPU) raises a `ConfigError` naming the first rank and field that differ from rank 0's.

Example:
    >>> check_same([{"hidden": 1024, "topk": 2}, {"hidden": 1024, "topk": 2}], what="MoE")
    >>> check_same([{"hidden": 1024, "topk": 2}, {"hidden": 1024, "topk": 4}], what="MoE")
    Traceback (most recent call last):
    ...
    symmring.errors.ConfigError: MoE: rank 1 has topk=4 but rank 0 has topk=2 (every rank must pass the same value)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .errors import ConfigError

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
