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
    >>> layer = HostLayer(ctx, 4, 128, 32, 2, wg, wu, wd, max_tokens=16)
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
from ..weights import ExpertWeights

#: ``x_format`` values of the CPU layer's ring.
X_FORMATS = ("bf16", "fp8_e4m3")
#: The GPU layer's arguments that have no meaning on the CPU layer (refused, naming them).
GPU_ONLY = ("engine", "expert_dtype", "expert_window", "single_stream", "policy", "w_gate_scale", "w_up_scale",
            "w_down_scale", "small_batch_tokens", "transport", "graph_cache")


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
        num_experts, hidden, inter, topk: the layer's sizes (``num_experts`` a multiple of the ranks).
        w_gate, w_up: bf16 ``[E/R, inter, hidden]``, w_down: bf16 ``[E/R, hidden, inter]``: this rank's experts.
        max_tokens: most tokens per rank per call.
        num_slots, tokens_per_slot, ack_policy: the streamed ring (``streaming=True`` calls); defaults 2, 64
            (at most ``max_tokens``) and `symmring.AckPolicy.CONSERVATIVE`.
        x_format: what the ring carries: ``"bf16"`` (default; lossless for bf16 activations) or ``"fp8_e4m3"``.
        scoring, bias, routed_scaling_factor, n_group, topk_group, norm_topk_prob: the routing options
            (`symmring.moe.routing.check_options`).
        timeout_s: bound of every wait (default: the context's).
        workspace: passed to the CPU layer when given (the shared memory it borrows).

    Raises:
        ConfigError: a bad argument, or one of the GPU layer's arguments that have no meaning here
            (`GPU_ONLY`: ``engine``, ``expert_dtype``, ...), before any collective work.
        BackendError: the context is not on the host backend, or torch is missing.
    """

    def __init__(self, ctx, num_experts: int, hidden: int, inter: int, topk: int, w_gate, w_up, w_down, *,
                 max_tokens: int, num_slots: int = 2, tokens_per_slot: Optional[int] = None, ack_policy=None,
                 x_format: str = "bf16", scoring: str = "softmax", bias=None, routed_scaling_factor: float = 1.0,
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 timeout_s: Optional[float] = None, workspace=None, **gpu_only):
        torch = _torch()
        from ... import protocol
        from .layer import ExpertParallelMoE, MoEShapes
        if gpu_only:
            unknown = sorted(set(gpu_only) - set(GPU_ONLY))
            if unknown:
                raise ConfigError(f"{', '.join(unknown)}: unexpected argument(s) of the CPU MoE layer")
            raise ConfigError(f"{', '.join(sorted(gpu_only))}: options of the GPU layer (symmring.moe.gpu.MoE); the "
                              "CPU layer (host backend) computes in float32 and takes x_format, num_slots, "
                              "tokens_per_slot, ack_policy, timeout_s and the routing options")
        backend = getattr(ctx, "backend", None)
        if getattr(backend, "name", None) != "host":
            raise BackendError(f"ctx: expected a context on the host backend, got {getattr(backend, 'name', ctx)!r} "
                               "(symmring.moe.gpu.MoE is the layer of the nvshmem backend)")
        self.max_tokens = _positive_int("max_tokens", max_tokens)
        self.num_slots = _positive_int("num_slots", num_slots)
        self.tokens_per_slot = min(64, self.max_tokens) if tokens_per_slot is None else \
            _positive_int("tokens_per_slot", tokens_per_slot)
        self.ack_policy = protocol.AckPolicy.parse(ack_policy)
        if x_format not in X_FORMATS:
            raise ConfigError(f"x_format={x_format!r}: expected one of {list(X_FORMATS)}")
        num_experts, hidden, inter, topk = (_positive_int(n, v) for n, v in (
            ("num_experts", num_experts), ("hidden", hidden), ("inter", inter), ("topk", topk)))
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
                raise ConfigError(f"bias: expected a float tensor [num_experts={num_experts}], got "
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
        self.scoring, self.routed_scaling_factor = scoring, float(routed_scaling_factor)
        self.n_group, self.topk_group, self.norm_topk_prob = n_group, topk_group, norm_topk_prob
        kwargs = dict(scoring=scoring, bias=bias, routed_scaling_factor=routed_scaling_factor, n_group=n_group,
                      topk_group=topk_group, norm_topk_prob=norm_topk_prob, max_tokens_per_rank=self.max_tokens,
                      timeout_s=timeout_s)
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
