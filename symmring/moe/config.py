"""The MoE layers' configuration as values: `RoutingConfig`, `ScheduleConfig` and `Experts`.

Each is a frozen dataclass validated once, when it is made (what needs no device and no context); the
layers (`symmring.moe.gpu.MoE`, `symmring.moe.cpu.host_layer.HostLayer`, `symmring.ExpertParallelMoE`), the
torch module (`symmring.moe.integrations.module.MoEModule`) and `symmring.moe.integrations.hf.from_hf` take
the same values, and check only what depends on the context, the device or the weights' memory:

* `RoutingConfig`: how tokens choose experts (`symmring.moe.routing`): ``num_experts``, ``topk``,
  ``scoring``, ``bias``, ``routed_scaling_factor``, ``n_group``, ``topk_group``, ``norm_topk_prob``.
* `ScheduleConfig`: the ring and the schedule of calls: ``num_slots``, ``tokens_per_slot``,
  ``expert_window``, ``ack_policy``, ``x_format``, ``single_stream``, ``timeout_s``, ``policy``,
  ``small_batch_tokens``, ``transport``, ``graph_cache``.
* `Experts`: this rank's expert weights (``w_gate``, ``w_up``, ``w_down``, fp8 block scales, ``expert_dtype``);
  ``hidden`` and ``inter`` come from ``w_gate``'s shape.

Example:
    >>> routing = RoutingConfig(256, 8, "sigmoid_bias", n_group=8, topk_group=4)
    >>> routing.route_kwargs()["n_group"]
    8
    >>> RoutingConfig(256, 8, "sigmoid_bias", n_group=3, topk_group=2)
    Traceback (most recent call last):
    ...
    symmring.errors.ConfigError: n_group=3: expected a positive divisor of num_experts=256
    >>> ScheduleConfig(num_slots=2, expert_window=2).expert_window
    2
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError
from . import routing as routing_mod
from .weights import shape_dim

#: ``x_format`` values (what the ring carries); None: the layer's default (GPU ``"fp8_e4m3"``, CPU ``"bf16"``).
X_FORMATS = ("fp8_e4m3", "bf16")
#: Default ``small_batch_tokens``: the most tokens per rank a call may have for the small-batch schedule.
SMALL_BATCH_TOKENS = 128
#: Default ``graph_cache``: CUDA graphs kept per GPU layer (`symmring.moe.gpu.graph_cache`).
GRAPH_CACHE_ENTRIES = 12


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int, when it is one (not a bool) and at least ``minimum``; else a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an int >= {minimum}")
    return int(value)


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)  # normalising a field of a frozen dataclass in __post_init__


def _length(value) -> Optional[tuple]:
    """The shape of an array, tensor or sequence (None when it has none)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return tuple(int(s) for s in shape)
    try:
        return (len(value),)
    except TypeError:
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class RoutingConfig:
    """How tokens choose experts: the options of `symmring.moe.routing.route`, validated once.

    Args:
        num_experts: experts over all ranks (an int >= 1; the layers also need a multiple of the ranks).
        topk: experts per token, ``1 <= topk <= num_experts`` (the GPU layer: at most 32).
        scoring: ``"softmax"`` (Mixtral, Qwen-MoE) or ``"sigmoid_bias"`` (DeepSeek-V3).
        bias: the ``[num_experts]`` selection bias of ``"sigmoid_bias"``, kept as given (the GPU layer and
            `HostLayer` want a float torch tensor on their device and keep a float32 copy; the CPU layer
            `ExpertParallelMoE` also takes a NumPy array or a sequence); None: no bias.
        routed_scaling_factor: factor on the ``"sigmoid_bias"`` weights.
        n_group, topk_group, norm_topk_prob: DeepSeek-V3's group-limited top-k and the variant without
            renormalisation (`symmring.moe.routing.check_options`).

    Equality is identity (``bias`` may be a tensor); compare `key` for the options' values.

    Raises:
        ConfigError: naming the field: ``num_experts`` or ``topk`` not an int >= 1, any check of
            `symmring.moe.routing.check_options`, ``bias`` without ``num_experts`` entries,
            ``routed_scaling_factor`` not a number.
    """

    num_experts: int
    topk: int
    scoring: str = "softmax"
    bias: Any = None
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True

    def __post_init__(self):
        _set(self, "num_experts", check_int("num_experts", self.num_experts))
        _set(self, "topk", check_int("topk", self.topk))
        if self.scoring not in routing_mod.SCORINGS:
            raise ConfigError(f"scoring={self.scoring!r}: expected one of {list(routing_mod.SCORINGS)}")
        routing_mod.check_options(self.num_experts, self.topk, self.scoring, n_group=self.n_group,
                                  topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob)
        _set(self, "n_group", int(self.n_group))
        _set(self, "topk_group", int(self.topk_group))
        if isinstance(self.routed_scaling_factor, bool) or not isinstance(
                self.routed_scaling_factor, (int, float, np.integer, np.floating)):
            raise ConfigError(f"routed_scaling_factor={self.routed_scaling_factor!r}: expected a number")
        self._check_bias()

    def _check_bias(self) -> None:
        if self.bias is not None:
            shape = _length(self.bias)
            if shape != (self.num_experts,):
                raise ConfigError(f"bias: expected a float tensor [num_experts={self.num_experts}], got "
                                  f"{shape if shape is not None else type(self.bias).__name__}")

    def route_kwargs(self) -> dict:
        """The keyword arguments of `symmring.moe.routing.route` (all but ``topk``)."""
        return dict(scoring=self.scoring, bias=self.bias, routed_scaling_factor=self.routed_scaling_factor,
                    n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob)

    def key(self) -> tuple:
        """The options as plain values (the bias as float32 bytes): what every rank's layer must share."""
        bias = self.bias
        if bias is not None:
            if hasattr(bias, "detach"):
                bias = bias.detach().float().cpu().numpy()
            bias = np.asarray(bias, np.float32).tobytes()
        return (self.num_experts, self.topk, self.scoring, bias, float(self.routed_scaling_factor), self.n_group,
                self.topk_group, self.norm_topk_prob)

    def with_bias(self, bias) -> "RoutingConfig":
        """The same options with another ``bias`` (a copy on another device or dtype, say): the options are
        not checked again (they were when this value was made), the new bias's length is."""
        new = copy.copy(self)
        _set(new, "bias", bias)
        new._check_bias()
        return new


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The ring and the schedule of a layer's calls, validated once (what needs no context).

    Args:
        num_slots: slots of the ring (>= 1; the streamed producer runs up to ``num_slots - 1`` chunks ahead).
            None: the layer's default (GPU: from the workspace's chunk; CPU: 2).
        tokens_per_slot: tokens per chunk (>= 1; the layer checks it is at most ``max_tokens``). None: the
            layer's default (GPU: the workspace's chunk, or ``max_tokens`` with ``num_slots``; CPU: at most 64).
        ack_policy: `symmring.AckPolicy`, its name or None (`AckPolicy.parse`; kept parsed).
        expert_window: chunks per expert window of the GPU layer's streamed schedule (``1 <= W <= num_slots``).
        x_format: what the ring carries, ``"fp8_e4m3"`` or ``"bf16"``; None: the layer's default (GPU
            ``"fp8_e4m3"``, CPU ``"bf16"``).
        single_stream: the GPU layer's streamed schedule on the caller's stream (tests, fallback).
        timeout_s: bound of every wait, a positive number of seconds (None: the context's).
        policy: a `symmring.moe.gpu.policy.StreamPolicy` for ``streaming="auto"`` (None: the measured default).
        small_batch_tokens: GPU batch calls of one chunk with at most this many tokens per rank run the
            small-batch schedule (an int >= 0; 0: never unless forced).
        transport: how a GPU PE reaches each peer (`symmring.transport.parse`; None: ``SYMMRING_TRANSPORT``,
            else ``"auto"``); the layer checks listed ranks against the world size.
        graph_cache: CUDA graphs of eager calls kept per GPU layer (an int >= 0; ``SYMMRING_GRAPH_CACHE``
            overrides it when the layer is built).

    ``expert_window``, ``single_stream``, ``policy``, ``small_batch_tokens``, ``transport`` and
    ``graph_cache`` are the GPU layer's (`GPU_ONLY`): the CPU layer refuses values other than the defaults.

    Raises:
        ConfigError: naming the field.
    """

    num_slots: Optional[int] = None
    tokens_per_slot: Optional[int] = None
    ack_policy: Any = None
    expert_window: int = 1
    x_format: Optional[str] = None
    single_stream: bool = False
    timeout_s: Optional[float] = None
    policy: Any = None
    small_batch_tokens: int = SMALL_BATCH_TOKENS
    transport: Optional[str] = None
    graph_cache: int = GRAPH_CACHE_ENTRIES

    #: The fields only the GPU layer reads.
    GPU_ONLY = ("expert_window", "single_stream", "policy", "small_batch_tokens", "transport", "graph_cache")

    def __post_init__(self):
        from .. import protocol, transport as transport_mod  # lazily: no import cycle with the layers
        from .gpu.graph_cache import check_entries
        from .gpu.policy import StreamPolicy
        if self.num_slots is not None:
            _set(self, "num_slots", check_int("num_slots", self.num_slots))
        if self.tokens_per_slot is not None:
            _set(self, "tokens_per_slot", check_int("tokens_per_slot", self.tokens_per_slot))
        _set(self, "ack_policy", protocol.AckPolicy.parse(self.ack_policy))
        if self.num_slots is not None:
            protocol.check_expert_window(self.expert_window, self.num_slots)
        elif isinstance(self.expert_window, bool) or not isinstance(self.expert_window, (int, np.integer)) \
                or self.expert_window < 1:  # at most num_slots: checked by the layer once it has its ring
            raise ConfigError(f"expert_window={self.expert_window!r}: expected 1 <= expert_window <= num_slots")
        _set(self, "expert_window", int(self.expert_window))
        if self.x_format is not None and self.x_format not in X_FORMATS:
            raise ConfigError(f"x_format={self.x_format!r}: expected 'fp8_e4m3' or 'bf16'")
        if not isinstance(self.single_stream, bool):
            raise ConfigError(f"single_stream={self.single_stream!r}: expected a bool")
        timeout_s = self.timeout_s
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        if self.policy is not None and not isinstance(self.policy, StreamPolicy):
            raise ConfigError(f"policy={self.policy!r}: expected a StreamPolicy or None")
        _set(self, "small_batch_tokens", check_int("small_batch_tokens", self.small_batch_tokens, 0))
        if self.transport is not None:
            transport_mod.parse(self.transport)
        _set(self, "graph_cache", check_entries(self.graph_cache))

    def gpu_only_set(self) -> list:
        """The GPU-only fields (`GPU_ONLY`) that differ from their defaults, in order."""
        default = ScheduleConfig()
        return [name for name in self.GPU_ONLY if getattr(self, name) != getattr(default, name)]


@dataclasses.dataclass(frozen=True, eq=False)
class Experts:
    """This rank's experts: ``w_gate``, ``w_up`` ``[E/R, inter, hidden]`` (``nn.Linear`` layout, Mixtral's
    ``w1``/``w3``) and ``w_down`` ``[E/R, hidden, inter]`` (``w2``), bf16 or fp8 e4m3 with float32 block
    scales (``w_gate_scale``, ``w_up_scale``, ``w_down_scale``: the dequantisation multipliers,
    ``weight_scale_inv``); ``expert_dtype``: ``"bf16"``, ``"fp8"`` or None (what the engine needs, else the
    weights' own format; GPU layer only). Tensors are kept as given (equality is identity); the layer checks
    their dtype, device and the shapes of ``w_up``, ``w_down`` and the scales.

    ``num_local_experts``, ``inter`` and ``hidden`` are ``w_gate``'s shape (the layers check the rest
    against them).

    Raises:
        ConfigError: ``w_gate`` without a 3-D shape (the layers check the rest, ``expert_dtype`` included).
    """

    w_gate: Any
    w_up: Any
    w_down: Any
    w_gate_scale: Any = None
    w_up_scale: Any = None
    w_down_scale: Any = None
    expert_dtype: Optional[str] = None

    def __post_init__(self):
        shape = getattr(self.w_gate, "shape", None)
        if shape is None or len(shape) != 3:
            raise ConfigError(f"w_gate: expected a 3-D tensor [num_local_experts, inter, hidden], got "
                              f"{tuple(shape) if shape is not None else type(self.w_gate).__name__}")

    num_local_experts = shape_dim("w_gate", 0)
    inter = shape_dim("w_gate", 1)
    hidden = shape_dim("w_gate", 2)

    def gpu_only_set(self) -> list:
        """The GPU-only fields given (the fp8 scales, ``expert_dtype``), in order."""
        return [name for name in ("expert_dtype", "w_gate_scale", "w_up_scale", "w_down_scale")
                if getattr(self, name) is not None]



#: The test hooks of a call (`symmring.moe.debug.Hooks`' fields, which ``layer.debug.forward`` takes and
#: ``forward`` does not): named here so `misplaced` needs no import of `symmring.moe.debug`, which sits above
#: this module (tests/test_config.py holds the two equal).
TEST_HOOKS = ("stage_events", "timeline", "producer_delay_ns", "consumer_delay_ns", "lookahead")


def misplaced(kwargs: dict, layer: str) -> ConfigError:
    """The error for keyword arguments a layer (or its ``forward``) does not take: for each, the value it belongs
    to, if any (``x_format=`` is `ScheduleConfig`'s, ``scoring=`` is `RoutingConfig`'s, ...; a test hook such as
    ``timeline=`` is ``layer.debug.forward``'s, `symmring.moe.debug`).

    Example:
        >>> print(misplaced({"x_format": "bf16", "timeline": True}, "MoE"))  # doctest: +NORMALIZE_WHITESPACE
        MoE: unexpected keyword argument(s): timeline (a test hook: layer.debug.forward(..., timeline=...));
        x_format (a field of ScheduleConfig: pass ScheduleConfig(x_format=...))
    """
    hooks = set(TEST_HOOKS)
    homes = []
    for name in sorted(kwargs):
        owner = next((cls.__name__ for cls in (RoutingConfig, ScheduleConfig, Experts)
                      if name in {f.name for f in dataclasses.fields(cls)}), None)
        if owner is not None:
            homes.append(f"{name} (a field of {owner}: pass {owner}({name}=...))")
        elif name in hooks:
            homes.append(f"{name} (a test hook: layer.debug.forward(..., {name}=...))")
        else:
            homes.append(f"{name} (not an argument of {layer})")
    return ConfigError(f"{layer}: unexpected keyword argument(s): " + "; ".join(homes))


__all__ = ["RoutingConfig", "ScheduleConfig", "Experts", "X_FORMATS", "check_int", "misplaced", "TEST_HOOKS"]
