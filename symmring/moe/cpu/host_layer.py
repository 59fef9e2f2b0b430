"""The CPU layer behind `symmring.moe.integrations.module.MoEModule`: `HostLayer`, `symmring.ExpertParallelMoE` with the
GPU layer's constructor and forward (torch CPU tensors in and out).

`MoEModule` (and so `from_hf`, `replace_moe_blocks`) builds this layer when its context is on the host
backend (``symmring.init("host")``, or ``"auto"`` without a usable GPU), and `symmring.moe.gpu.MoE` on the
nvshmem backend: the same module class on any machine, under ``mpiexec`` as on GPUs.

What it keeps, as the GPU layer's bf16 engine does (`symmring.moe.weights.ExpertWeights`): this rank's
experts as bf16 ``w13 [E/R, 2 inter, hidden]`` (gate rows, then up rows: transformers' ``gate_up_proj``)
and ``w_down [E/R, hidden, inter]``, and the routing bias as float32; the module registers these tensors
as its buffers. The CPU layer computes in float32 (float64 accumulation, `symmring.moe.reference`) from
float32 copies of them, which `refresh_weights` re-derives after the module loaded a state dict in place.

A call: ``x`` bf16 ``[n, hidden]`` and the router logits go to the CPU layer as float32 (exact), the ring
carries ``x`` in ``x_format`` (default ``"bf16"``: bf16 activations cross it bit for bit; ``"fp8_e4m3"``
quantises them with 1x128 scales, as the GPU layer's fp8 dispatch does), and the float32 output is rounded
once to bf16. ``streaming=True`` streams ``tokens_per_slot``-token chunks through a ``num_slots`` ring;
``"auto"`` runs batch-ready (the CPU layer has no measured policy; batch is the GPU policy's default too).

Example:
    >>> import torch, symmring
    >>> ctx = symmring.init("host")
    >>> g = torch.Generator().manual_seed(0)
    >>> wg, wu = (torch.randn(4, 32, 128, generator=g).bfloat16() / 11 for _ in range(2))
    >>> wd = (torch.randn(4, 128, 32, generator=g) / 6).bfloat16()
    >>> from symmring.moe.config import Experts, RoutingConfig
    >>> layer = HostLayer(ctx, Experts(wg, wu, wd), RoutingConfig(num_experts=4, topk=2), max_tokens=16)
    >>> x = torch.randn(5, 128, generator=g).bfloat16()
    >>> y = layer.forward(x, logits=torch.randn(5, 4, generator=g))
    >>> y.shape, y.dtype
    (torch.Size([5, 128]), torch.bfloat16)
    >>> layer.close(); ctx.close()
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from ...errors import BackendError, ConfigError
from ..config import Experts, RoutingConfig, ScheduleConfig
from ..weights import ExpertWeights

#: ``x_format`` values of the CPU layer's ring.
X_FORMATS = ("bf16", "fp8_e4m3")
#: The GPU layer's options that have no meaning on the CPU layer (refused, naming them, unless at their
#: defaults): ``engine`` and the fields of `Experts` and `ScheduleConfig` listed here.
GPU_ONLY = ("engine",) + tuple(f"experts.{name}" for name in ("expert_dtype", "w_gate_scale", "w_up_scale",
                                                              "w_down_scale")) \
    + tuple(f"schedule.{name}" for name in ScheduleConfig.GPU_ONLY)


def _torch():
    from ... import deps
    try:
        import torch
    except ImportError:
        raise BackendError(f"symmring.moe.cpu.host_layer: {deps.hint('torch')}") from None
    return torch


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive int")
    return value


class HostLayer:
    """`symmring.ExpertParallelMoE` with `symmring.moe.gpu.MoE`'s constructor and forward (module docstring).

    Args:
        ctx: a context on the host backend (collective constructor: every rank builds its layer).
        experts: a `symmring.moe.config.Experts`: ``w_gate``, ``w_up`` bf16 ``[E/R, inter, hidden]``,
            ``w_down`` bf16 ``[E/R, hidden, inter]``: this rank's experts (``hidden``, ``inter`` from ``w_gate``).
        routing: a `symmring.moe.config.RoutingConfig` (``num_experts`` a multiple of the ranks).
        max_tokens: most tokens per rank per call.
        schedule: a `symmring.moe.config.ScheduleConfig`: ``num_slots``, ``tokens_per_slot``, ``ack_policy``
            for the streamed ring (``streaming=True`` calls; defaults 2, 64 (at most ``max_tokens``) and
            `symmring.AckPolicy.CONSERVATIVE`), ``x_format`` (what the ring carries: ``"bf16"``, the default
            here, lossless for bf16 activations, or ``"fp8_e4m3"``) and ``timeout_s`` (default: the context's);
            its GPU-only fields at their defaults.
        engine: ``"auto"`` (the GPU layer's option; the CPU layer has one engine).
        workspace: passed to the CPU layer when given (the shared memory it borrows).

    Raises:
        ConfigError: a bad argument, or one of the GPU layer's arguments that have no meaning here
            (`GPU_ONLY`: ``engine``, ``experts.expert_dtype``, ``schedule.graph_cache``, ...) set, before any
            collective work.
        BackendError: the context is not on the host backend, or torch is missing.
    """

    def __init__(self, ctx, experts: Experts, routing: RoutingConfig, *, max_tokens: int,
                 schedule: Optional[ScheduleConfig] = None, engine: str = "auto", workspace=None, **unknown):
        torch = _torch()
        from .layer import ExpertParallelMoE, MoEShapes
        if unknown:
            raise ConfigError(f"{', '.join(sorted(unknown))}: unexpected argument(s) of the CPU MoE layer")
        schedule = ScheduleConfig() if schedule is None else schedule
        for name, value, cls in (("experts", experts, Experts), ("routing", routing, RoutingConfig),
                                 ("schedule", schedule, ScheduleConfig)):
            if not isinstance(value, cls):
                raise ConfigError(f"{name}={value!r}: expected a symmring.moe.config.{cls.__name__}")
        gpu_only = (["engine"] if engine != "auto" else []) + [f"experts.{n}" for n in experts.gpu_only_set()] \
            + [f"schedule.{n}" for n in schedule.gpu_only_set()]
        if gpu_only:
            raise ConfigError(f"{', '.join(gpu_only)}: options of the GPU layer (symmring.moe.gpu.MoE); the "
                              "CPU layer (host backend) computes in float32 and takes schedule.x_format, num_slots, "
                              "tokens_per_slot, ack_policy, timeout_s and the routing")
        backend = getattr(ctx, "backend", None)
        if getattr(backend, "name", None) != "host":
            raise BackendError(f"ctx: expected a context on the host backend, got {getattr(backend, 'name', ctx)!r} "
                               "(symmring.moe.gpu.MoE is the layer of the nvshmem backend)")
        self.routing, self.schedule = routing, schedule
        self.max_tokens = _positive_int("max_tokens", max_tokens)
        self.num_slots = 2 if schedule.num_slots is None else schedule.num_slots
        self.tokens_per_slot = min(64, self.max_tokens) if schedule.tokens_per_slot is None else \
            schedule.tokens_per_slot
        self.ack_policy = schedule.ack_policy
        x_format = schedule.x_format or "bf16"
        num_experts, topk = routing.num_experts, routing.topk
        hidden, inter = (_positive_int(n, v) for n, v in (("hidden (w_gate.shape[2])", experts.hidden),
                                                          ("inter (w_gate.shape[1])", experts.inter)))
        w_gate, w_up, w_down, bias = experts.w_gate, experts.w_up, experts.w_down, routing.bias
        self.rank, self.world_size = ctx.rank, ctx.world_size
        if num_experts % self.world_size:
            raise ConfigError(f"num_experts={num_experts}: expected a multiple of the number of ranks {self.world_size}")
        self.num_experts, self.hidden, self.inter, self.topk = num_experts, hidden, inter, topk
        self.num_local_experts = num_experts // self.world_size
        self.expert_begin = self.rank * self.num_local_experts
        self.device = torch.device("cpu")
        shape = (self.num_local_experts, inter, hidden)
        for name, w, want in (("w_gate", w_gate, shape), ("w_up", w_up, shape),
                              ("w_down", w_down, (self.num_local_experts, hidden, inter))):
            if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or tuple(w.shape) != want \
                    or w.device.type != "cpu":
                raise ConfigError(f"{name}: expected a bf16 CPU tensor {list(want)} (this rank's experts), got "
                                  f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))} "
                                  f"on {getattr(w, 'device', '?')}")
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_experts,):
                raise ConfigError(f"routing.bias: expected a float tensor [num_experts={num_experts}], got "
                                  f"{tuple(getattr(bias, 'shape', ())) or type(bias).__name__}")
            # float32, contiguous, on the CPU: the CPU layer reads it through a NumPy view of this memory,
            # so a load into it in place is what the next call routes with.
            bias = bias.detach().to("cpu", torch.float32).contiguous().clone()
        self.bias = bias
        with torch.no_grad():
            w13 = torch.cat([w_gate, w_up], dim=1).contiguous()
            self.engine = SimpleNamespace(name="host", weights=ExpertWeights("bf16", w13, w_down.detach().contiguous()
                                                                             .clone()),
                                          refresh_weights=self.refresh_weights)
        #: The routing this layer runs (``routing.bias``: its float32 copy, the module's buffer).
        self.routing = routing if bias is None else routing.with_bias(bias)
        self.scoring, self.routed_scaling_factor = routing.scoring, float(routing.routed_scaling_factor)
        self.n_group, self.topk_group, self.norm_topk_prob = routing.n_group, routing.topk_group, routing.norm_topk_prob
        kwargs = dict(routing=self.routing, max_tokens_per_rank=self.max_tokens, timeout_s=schedule.timeout_s)
        if workspace is not None:
            kwargs["workspace"] = workspace
        self.layer = ExpertParallelMoE(ctx, MoEShapes(hidden, num_experts, topk, x_format), *self._f32_weights(),
                                       **kwargs)
        self.num_calls = 0  #: forward calls made (each one collective)
        self.closed = False

    def _f32_weights(self):
        w = self.engine.weights
        w13 = w.w13.float()
        return (w13[:, :self.inter].contiguous().numpy(), w13[:, self.inter:].contiguous().numpy(),
                w.w_down.float().contiguous().numpy())

    def refresh_weights(self) -> None:
        """Re-derive the CPU layer's float32 operands from ``engine.weights`` (after an in-place load)."""
        self.layer.set_expert_weights(*self._f32_weights())

    def clear_graph_cache(self) -> None:
        """Nothing to drop: the CPU layer captures no graphs (the GPU layer's method, for the module)."""

    def forward(self, x, logits=None, *, streaming=False):
        """bf16 ``x [n, hidden]`` and float ``logits [n, num_experts]`` -> bf16 ``[n, hidden]`` (collective).

        Raises:
            ConfigError: a bad ``x``, ``logits`` or ``streaming`` (on every rank, before any shared-memory work).
        """
        torch = _torch()
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ConfigError(f"x: expected a bf16 tensor [num_tokens, hidden={self.hidden}], got "
                              f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            raise ConfigError(f"logits: expected a float tensor [num_tokens, num_experts={self.num_experts}], got "
                              f"{type(logits).__name__}")
        if not (streaming is True or streaming is False or streaming == "auto"):
            raise ConfigError(f"streaming={streaming!r}: expected one of [False, True, 'auto']")
        stream = dict(streaming=True, tokens_per_slot=self.tokens_per_slot, num_slots=self.num_slots) \
            if streaming is True else {}
        y = self.layer.forward(x.float(), logits=logits.detach().float().contiguous(), ack_policy=self.ack_policy,
                               **stream)
        self.num_calls += 1
        return y.to(torch.bfloat16)

    __call__ = forward

    def close(self) -> None:
        """Collective, idempotent: free the CPU layer's shared memory."""
        self.closed = True
        self.layer.close()

    def __repr__(self) -> str:
        return (f"HostLayer(experts [{self.expert_begin}, {self.expert_begin + self.num_local_experts}) of "
                f"{self.num_experts}, rank {self.rank}/{self.world_size}, closed={self.closed})")


__all__ = ["HostLayer", "GPU_ONLY", "X_FORMATS"]
