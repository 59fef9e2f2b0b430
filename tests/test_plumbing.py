"""The small shared pieces the house layout introduced: `symmring.closing.Closing` and the GPU layer's `view`
properties (`symmring.moe.gpu.memory.view`), which read (and, where writable, set) a dotted path per use."""

import pytest

from symmring.closing import Closing
from symmring.moe.gpu.memory import view


class _Node:
    pass


class _Holder:
    value = view("inner.box.value", "the box's value")
    settable = view("inner.box.value", writable=True)


def test_view_reads_the_path_on_every_use_and_sets_it_only_where_writable():
    h = _Holder()
    h.inner = _Node()
    h.inner.box = _Node()
    h.inner.box.value = 1
    assert h.value == 1
    h.inner.box = _Node()  # new memory behind the path: the next read sees it
    h.inner.box.value = 2
    assert h.value == 2 and h.settable == 2
    h.settable = 3
    assert h.inner.box.value == 3 and h.value == 3
    with pytest.raises(AttributeError):
        h.value = 4
    assert _Holder.value.__doc__ == "the box's value"


def test_closing_closes_on_the_way_out_even_after_an_error():
    closed = []

    class Thing(Closing):
        def close(self):
            closed.append(self)

    with Thing() as t:
        pass
    assert closed == [t]
    with pytest.raises(RuntimeError):
        with Thing() as u:
            raise RuntimeError("boom")
    assert closed == [t, u]
