"""The once-at-construction agreement of ring specs and layer options (issue 24, item 5): a pure check over
the gathered values (`symmring.agreement.check_same`), and `DeviceRing` running it before its allocation.

No GPU: `DeviceRing` gets a stand-in device backend whose collectives hand back every rank's spec; a mismatch
must raise before ``alloc`` is reached. On the old code `DeviceRing` never exchanged its spec, so
`test_device_ring_refuses_a_spec_mismatch_before_allocating` reached ``alloc`` (the stand-in's AssertionError).
"""

from __future__ import annotations

import dataclasses

import pytest

from symmring import agreement
from symmring.backends.base import DeviceBackend
from symmring.errors import ConfigError
from symmring.layout import RingSpec


def test_same_values_pass():
    agreement.check_same([], what="x")
    agreement.check_same([{"a": 1, "b": "bf16"}] * 4, what="x")


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_mismatch_names_rank_and_field(rank):
    values = [{"hidden": 1024, "topk": 2, "num_slots": 4} for _ in range(4)]
    values[rank]["num_slots"] = 8
    with pytest.raises(ConfigError, match=rf"^MoE: rank {rank} has num_slots=8 but rank 0 has num_slots=4"):
        agreement.check_same(values, what="MoE")


def test_lowest_rank_and_first_field_named():
    values = [{"a": 1, "b": 2}, {"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 9, "b": 3}]
    with pytest.raises(ConfigError, match="rank 2 has b=3"):
        agreement.check_same(values, what="t")


def test_field_missing_on_one_side():
    with pytest.raises(ConfigError, match="rank 1 has extra=1 but rank 0 has nothing"):
        agreement.check_same([{"a": 1}, {"a": 1, "extra": 1}], what="t")
    with pytest.raises(ConfigError, match="rank 1 has nothing but rank 0 has a=1"):
        agreement.check_same([{"a": 1}, {}], what="t")


class _Collectives:
    """Every rank's contribution is ours, except the ranks in ``others`` (rank -> value)."""

    def __init__(self, world_size, others):
        self.world_size, self.others, self.calls = world_size, others, []

    def allgather(self, value, *, what, timeout_s=None):
        self.calls.append(what)
        return [self.others.get(r, value) for r in range(self.world_size)]


def _fake_backend(collectives):
    methods = {name: (lambda self, *a, **k: (_ for _ in ()).throw(AssertionError("reached the allocation")))
               for name in DeviceBackend.__abstractmethods__}
    cls = type("FakeDeviceBackend", (DeviceBackend,), methods)
    backend = cls.__new__(cls)
    backend.rank, backend.world_size, backend.collectives = 0, collectives.world_size, collectives
    return backend


SPEC = RingSpec(num_slots=2, tokens_per_slot=64, hidden=512, num_topk=4, num_experts=16, x_format="bf16")


def test_device_ring_refuses_a_spec_mismatch_before_allocating():
    from symmring.kernels import DeviceRing

    other = dataclasses.asdict(dataclasses.replace(SPEC, tokens_per_slot=128))
    collectives = _Collectives(3, {2: other})
    with pytest.raises(ConfigError, match="DeviceRing spec: rank 2 has tokens_per_slot=128 but rank 0 has "
                                          "tokens_per_slot=64"):
        DeviceRing(_fake_backend(collectives), SPEC, timeout_s=1.0)
    assert collectives.calls == ["DeviceRing spec: agreement"]


def test_device_ring_with_agreed_specs_goes_on_to_allocate():
    from symmring.kernels import DeviceRing

    with pytest.raises(AssertionError, match="reached the allocation"):
        DeviceRing(_fake_backend(_Collectives(2, {})), SPEC, timeout_s=1.0)
