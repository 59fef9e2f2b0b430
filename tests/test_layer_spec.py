"""The layers' specs on the CPU (issue 34): the GPU layer's `GpuSpec` resolved from its arguments, its engine and
its workspace's plan (the ring's defaults, the batch window, what every rank must share), and the one
construction exchange (`symmring.moe.spec.agree`) that carries every rank's spec or its error."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from symmring.errors import ConfigError
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig
from symmring.moe.gpu.spec import GpuSpec, check_gpu_sizes, resolve
from symmring.moe.spec import agree

CTX = SimpleNamespace(rank=1, world_size=2, timeout_s=30.0)


def experts(hidden=256, inter=128, local=4):
    return Experts(np.zeros((local, inter, hidden)), np.zeros((local, inter, hidden)), np.zeros((local, hidden, inter)))


def engine(dtype="fp8"):
    return SimpleNamespace(weights=SimpleNamespace(dtype=dtype), pool_format=dtype, align_m=128 if dtype == "fp8" else 1,
                           name="builtin" if dtype == "fp8" else "torch")


def spec_of(schedule=ScheduleConfig(), max_tokens=1000, chunk=512, window=1024, dtype="fp8", **kw) -> GpuSpec:
    return resolve(CTX, experts(), RoutingConfig(8, 2), schedule, max_tokens=max_tokens, engine=engine(dtype),
                   workspace_plan=SimpleNamespace(tokens_per_slot=chunk, window_tokens=window), layer_id=3,
                   graph_cache=12, **kw)


def test_the_ring_defaults_from_the_workspace_plan():
    s = spec_of()  # the workspace's chunk, and enough slots for a batch call of max_tokens
    assert (s.num_slots, s.tokens_per_slot, s.batch_window, s.max_chunks) == (2, 512, 2, 2)
    s = spec_of(ScheduleConfig(tokens_per_slot=100))  # only the chunk: one slot
    assert (s.num_slots, s.tokens_per_slot, s.batch_window) == (1, 100, 10)
    s = spec_of(ScheduleConfig(num_slots=3))  # only the slots: slots of max_tokens
    assert (s.num_slots, s.tokens_per_slot) == (3, 1000)
    assert (s.rank, s.num_local_experts, s.expert_begin, s.timeout_s) == (1, 4, 4, 30.0)
    assert s.x_format == "fp8_e4m3" and s.small_batch_capable and s.align == 128
    assert not spec_of(ScheduleConfig(x_format="bf16"), dtype="bf16").small_batch_capable


def test_what_every_rank_shares():
    agreed = spec_of().agreed()
    assert {"rank", "align", "engine", "single_stream", "graph_cache", "transport"}.isdisjoint(agreed)
    assert agreed["ack_policy"] == "CONSERVATIVE" and agreed["layer_id"] == 3 and agreed["batch_window"] == 2
    assert agreed["transport_request"] == "('auto', 'default')" and agreed["routing"] == RoutingConfig(8, 2).key()


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule=ScheduleConfig(x_format="bf16")), "x_format='bf16': fp8 experts read the fp8 dispatch rows"),
    (dict(schedule=ScheduleConfig(expert_window=3)), "expert_window=3: expected 1 <= expert_window <= num_slots=2"),
])
def test_resolve_refuses_what_only_the_resolved_values_show(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_of(**kwargs)


@pytest.mark.parametrize("sizes, message", [
    (dict(hidden=200), "hidden=200 (w_gate.shape[2]): expected a multiple of 128"),
    (dict(inter=132), "inter=132 (w_gate.shape[1]): expected a multiple of 8"),
])
def test_the_kernels_limits(sizes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_gpu_sizes(experts(**sizes), RoutingConfig(8, 2), ScheduleConfig(), 2)
    with pytest.raises(ConfigError, match="topk=33"):
        check_gpu_sizes(experts(), RoutingConfig(64, 33), ScheduleConfig(), 2)


class Exchange:
    """A stand-in of `Collectives.allgather`: every rank's entry, this rank's the one it sends."""

    def __init__(self, rank, others):
        self.rank, self.others, self.sent = rank, others, []

    def allgather(self, value, *, what, timeout_s=None):
        self.sent.append((what, value))
        return [value if r == self.rank else other for r, other in enumerate(self.others)]


def test_one_exchange_carries_every_ranks_spec_or_error():
    s = spec_of()
    mine = s.agreed()
    # Every rank the same: nothing raised, one exchange.
    ex = Exchange(1, [(None, mine), None])
    agree(ex, 1, s, None, what="MoE")
    assert [w for w, _ in ex.sent] == ["MoE: agreement"]
    # Another rank's arguments failed: this rank raises a ConfigError naming it, before anything is allocated.
    with pytest.raises(ConfigError, match=r"MoE: rejected by rank\(s\) \[0\]: rank 0: topk=3"):
        agree(Exchange(1, [("topk=3: ...", None), None]), 1, s, None, what="MoE")
    # This rank's own error is raised as it is (the others name this rank).
    own = ConfigError("w_down.shape=(4, 256, 100): expected ...")
    with pytest.raises(ConfigError) as info:
        agree(Exchange(1, [(None, mine), None]), 1, None, own, what="MoE")
    assert info.value is own
    # A rank built with another ring: named with the field.
    other = dict(mine, tokens_per_slot=256)
    with pytest.raises(ConfigError, match="rank 1 has tokens_per_slot=512 but rank 0 has tokens_per_slot=256"):
        agree(Exchange(1, [(None, other), None]), 1, s, None, what="MoE")
