"""Counting a context's bounded host exchanges in a test (no torch needed): ``with ExchangeCounter(ctx) as c:``."""

from __future__ import annotations

from typing import List


class ExchangeCounter:
    """Counts the bounded host exchanges of a context (`symmring.collective.Collectives.allgather`, which
    ``barrier`` and ``agree`` use too) while installed: ``with ExchangeCounter(ctx) as counter: ...``."""

    def __init__(self, ctx):
        self.collectives = ctx.collectives
        self.count = 0
        self.what: List[str] = []

    def __enter__(self):
        original = self.collectives.allgather

        def counted(value, *, what, timeout_s=None):
            self.count += 1
            self.what.append(what)
            return original(value, what=what, timeout_s=timeout_s)

        self.collectives.allgather = counted
        return self

    def __exit__(self, *exc):
        del self.collectives.allgather  # the instance attribute: the class's method again
        return False
