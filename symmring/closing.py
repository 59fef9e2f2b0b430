"""`Closing`: what every closeable object of symmring (context, ring, workspace, layers, device rings) shares:
``with obj:`` closes it on the way out, whatever ``close`` does."""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T", bound="Closing")


class Closing:
    """A context manager whose exit calls ``self.close()`` (subclasses define ``close``)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
