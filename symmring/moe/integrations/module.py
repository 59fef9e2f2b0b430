"""The MoE layer as a ``torch.nn.Module``, its forward as a torch custom op (``torch.compile``, CUDA graphs).

`MoEModule` holds one layer (this rank's experts), the router weight and the routing configuration, and
optionally shared experts (any ``nn.Module``, DeepSeek-V3's, run in torch on the same hidden states). The
context picks the layer, as `symmring.MoE` does: `symmring.moe.gpu.GpuMoE` on the nvshmem backend (tensors on the
GPU), and the CPU layer `symmring.ExpertParallelMoE` (``HostLayer``; torch CPU tensors in and out) on the host
backend; the module is the same class either way. ``forward(hidden_states)`` takes bf16
``[..., hidden]`` of any leading shape:

    logits = F.linear(x.to(router_dtype), router_weight.to(router_dtype))    # the router, in torch
    y      = symmring::moe_forward(x, logits, token, handle, streaming)        # the layer (routing included)
    y      = y + shared_experts(x)                                             # when there are any

* **Weights, no second copy.** The layer copies its weights once into its engine's layout (the fused
  ``w13 [E/R, 2 inter, hidden]``, ``w_down``, fp8 block scales); the module registers *those* tensors as
  its buffers (``w13``, ``w_down``, ``w13_scale``, ``w_down_scale``, ``bias``) beside ``router_weight``.
  ``state_dict()`` is this rank's experts in the engine's layout; ``load_state_dict`` copies into the
  layer's tensors in place (dtype and shape must match: a `ConfigError` otherwise; ``assign=True`` is
  refused) and then lets the engine re-derive what it keeps beside them
  (`symmring.moe.engines.ExpertEngine.refresh_weights`) and drops the layer's cached graphs.
  ``.to()``/``.half()``/``.cuda()`` leave the layer's tensors as they are (they live in the layer's fixed layout on its GPU); the router weight and
  the shared experts follow.
* **Inference only.** The layer has no backward: a call with an input that requires grad while grad is
  enabled is a `ConfigError`; run under ``torch.no_grad()`` or ``torch.inference_mode()``.
* **Collective.** Every rank calls ``forward`` once per layer call, as with the layer; ``close()``
  (collective) frees the layer's symmetric memory.
* **torch.compile and CUDA graphs.** ``forward`` calls the layer through the custom op
  ``symmring::moe_forward(Tensor x, Tensor logits, Tensor(a!) token, int handle, int streaming) -> Tensor``
  (registered on the first module's construction; `moe_op`). Custom ops take no Python objects, so the
  layer is found by an integer handle in a registry of live layers (`layer_of`); ``streaming`` is coded as
  `STREAMING_CODES`. Its fake implementation gives ``empty_like(x)``, so ``torch.compile(model,
  fullgraph=True)`` traces through it, and the compiled code runs the same kernels as eager. The op
  **mutates** ``token`` (the module's non-persistent buffer ``call_token``, int64 ``[1]`` on the layer's
  device: it counts the module's calls): a call is a collective, and a compiler may drop an op whose
  result is unused or reorder independent ones, but never an op that writes a tensor the program still
  holds; so a compiled function that discards the result still makes the call on every rank (a pure op
  was dropped there: one rank skipping a collective deadlocks the others), and the calls of one module
  stay in program order (calls of different modules are ordered by the data between them). A CUDA graph
  captures it like the layer's own `symmring.moe.gpu.MoE.capture` (each replay is a new call; the token
  counts are fixed by the capture; the token's increment is one more tiny kernel). Called eagerly (eager
  module, or compiled code outside a CUDA graph), the GPU layer replays its own cached graph of the call's
  shape (`symmring.moe.gpu.graph_cache`); inside the caller's capture it launches plainly.
* **Checkpoint names.** A module built by `symmring.moe.integrations.hf.from_hf` (``checkpoint_names="hf"``) names its
  state like the transformers block it replaced: ``gate.weight`` (the router), ``experts.gate_up_proj``,
  ``experts.down_proj``, ``gate.e_score_correction_bias`` (DeepSeek-V3) and ``shared_experts.*``, so a
  replaced model loads the original model's state dict: expert tensors of all ``E`` experts are cut to
  this rank's ``[r E/R, (r+1) E/R)`` (tensors of this rank's ``E/R`` experts are taken as they are), and
  the bias and router are cast to the module's dtypes. Its ``state_dict()`` holds this rank's experts
  under those names. Loading transformers' bf16 experts needs bf16 experts in the layer (the CPU layer,
  or the GPU layer's ``engine="torch"``); an fp8 engine refuses them with a `ConfigError`.

Example:
    >>> module = MoEModule(ctx, Experts(w_gate, w_up, w_down), RoutingConfig(16, 2),  # doctest: +SKIP
    ...                    router_weight=router, max_tokens=4096, streaming=False, engine="builtin")
    >>> with torch.inference_mode():  # doctest: +SKIP
    ...     y = module(hidden_states)                       # [batch, seq, 256] bf16
    ...     y = torch.compile(module, fullgraph=True)(hidden_states)
    >>> module.close()  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Tuple

from ... import deps
from ...errors import BackendError, ConfigError
from ..config import Experts, RoutingConfig

try:  # symmring imports without torch; this module needs it
    import torch
except ImportError:  # pragma: no cover - CI without torch imports the module for its docstrings
    torch = None

#: Name of the custom op.
OP_NAME = "symmring::moe_forward"
#: The op's schema: custom ops take tensors and numbers, so the layer is an integer handle.
OP_SCHEMA = "(Tensor x, Tensor logits, Tensor(a!) token, int handle, int streaming) -> Tensor"
#: ``streaming`` values and their codes in the op.
STREAMING_CODES = {False: 0, True: 1, "auto": 2}
_STREAMING_OF = {code: value for value, code in STREAMING_CODES.items()}
#: The layer's tensors the module registers as its buffers (the layer's own storage, never copies).
LAYER_BUFFERS = ("w13", "w_down", "w13_scale", "w_down_scale", "bias")
#: ``checkpoint_names``: the module's own buffer names, or the transformers block's (`HF_NAMES`).
CHECKPOINT_NAMES = ("layer", "hf")
#: Buffer -> the name of the same tensor in a transformers 5.x MoE block (``checkpoint_names="hf"``).
HF_NAMES = {"router_weight": "gate.weight", "bias": "gate.e_score_correction_bias",
            "w13": "experts.gate_up_proj", "w_down": "experts.down_proj"}

_layers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def _require_torch():
    if torch is None:
        raise BackendError(f"symmring.moe.integrations.module needs torch: {deps.hint('torch')}")
    return torch


def register_layer(layer) -> int:
    """A new handle for ``layer`` in the registry the custom op reads (held weakly: the module owns the layer)."""
    handle = next(_next_handle)
    _layers[handle] = layer
    return handle


def unregister_layer(handle: int) -> None:
    _layers.pop(handle, None)


def layer_of(handle: int):
    """The live layer of ``handle``; ConfigError when there is none (closed, or never registered)."""
    layer = _layers.get(handle)
    if layer is None:
        raise ConfigError(f"handle={handle!r}: no live symmring MoE layer has this handle (closed module?)")
    return layer


@functools.lru_cache(maxsize=None)
def moe_op():
    """``torch.ops.symmring.moe_forward.default``, registered with its fake implementation on first use.

    Example:
        >>> op = moe_op()
        >>> str(op)
        'symmring.moe_forward.default'
    """
    torch = _require_torch()

    # mutates_args: the call token (module docstring): what keeps a compiler from dropping or reordering a call.
    @torch.library.custom_op(OP_NAME, mutates_args=("token",), schema=OP_SCHEMA)
    def moe_forward(x, logits, token, handle, streaming):
        if streaming not in _STREAMING_OF:
            raise ConfigError(f"streaming={streaming!r}: expected a code of {STREAMING_CODES}")
        y = layer_of(handle).forward(x, logits=logits, streaming=_STREAMING_OF[streaming])
        token.add_(1)
        return y

    @moe_forward.register_fake
    def _(x, logits, token, handle, streaming):
        return torch.empty_like(x, memory_format=torch.contiguous_format)  # y: bf16 [n, hidden], a new tensor

    return torch.ops.symmring.moe_forward.default


def default_layer_factory(ctx):
    """The layer class of ``ctx``'s backend (`symmring.moe.layer.implementation`, what `symmring.MoE` builds):
    `symmring.moe.cpu.layer.ExpertParallelMoE` (``HostLayer``) on ``host``, `symmring.moe.gpu.GpuMoE` on a device
    backend.

    Raises:
        BackendError: the context's backend has no MoE layer.
    """
    from ..layer import implementation
    return implementation(ctx)


def _check_streaming(streaming):
    if not (streaming is True or streaming is False or (isinstance(streaming, str) and streaming == "auto")):
        raise ConfigError(f"streaming={streaming!r}: expected one of {list(STREAMING_CODES)}")
    return streaming


_Base = torch.nn.Module if torch is not None else object


class MoEModule(_Base):
    """The MoE layer of the context's backend as an ``nn.Module`` (see the module docstring).

    Args:
        ctx, experts, routing, max_tokens: as `symmring.MoE` (``experts``: a
            `symmring.moe.config.Experts` of this rank's experts, rank ``r`` owning ``[r E/R, (r+1) E/R)``, on
            the GPU for the nvshmem backend, on the CPU for the host backend; ``routing``: a
            `symmring.moe.config.RoutingConfig`).
        router_weight: ``[num_experts, hidden]`` float tensor (all experts: every rank routes its own tokens).
        router_dtype: dtype the router runs in (``None``: the router weight's; DeepSeek-V3: float32).
        shared_experts: an ``nn.Module`` added to the routed output (``y + shared_experts(x)``), or None.
        streaming: the layer's schedule for every call: ``False`` (batch), ``True`` or ``"auto"``.
        layer_factory: builds the layer with `symmring.MoE`'s signature (default: the implementation of the
            context's backend, `default_layer_factory`).
        checkpoint_names: ``"layer"`` (the buffers' own names) or ``"hf"`` (the transformers block's names,
            module docstring; what `symmring.moe.integrations.hf.from_hf` sets).
        workspace: the `symmring.Workspace` the layer borrows (None: the context's own, ``ctx.workspace()``, which
            every block of a model then shares).
        **layer_kwargs: the layer's other arguments (``schedule``: a `symmring.moe.config.ScheduleConfig`;
            ``engine``), passed through.

    Raises:
        ConfigError: a bad argument of the module (before the layer is built) or of the layer.
        BackendError: torch is missing, or the context's backend has no layer.
    """

    def __init__(self, ctx, experts: Experts, routing: RoutingConfig, *, router_weight, max_tokens: int,
                 router_dtype=None, shared_experts=None, streaming=False, layer_factory=None,
                 checkpoint_names: str = "layer", workspace=None, **layer_kwargs):
        torch = _require_torch()
        super().__init__()
        self.streaming = _check_streaming(streaming)
        if checkpoint_names not in CHECKPOINT_NAMES:
            raise ConfigError(f"checkpoint_names={checkpoint_names!r}: expected one of {list(CHECKPOINT_NAMES)}")
        self.checkpoint_names = checkpoint_names
        for name, value, cls in (("experts", experts, Experts), ("routing", routing, RoutingConfig)):
            if not isinstance(value, cls):
                raise ConfigError(f"{name}={value!r}: expected a symmring.moe.config.{cls.__name__}")
        num_experts, hidden, inter, topk = routing.num_experts, experts.hidden, experts.inter, routing.topk
        if not isinstance(router_weight, torch.Tensor) or not router_weight.is_floating_point() \
                or tuple(router_weight.shape) != (num_experts, hidden):
            raise ConfigError(f"router_weight: expected a float tensor [num_experts={num_experts}, hidden={hidden}], "
                              f"got {getattr(router_weight, 'dtype', type(router_weight).__name__)} "
                              f"{tuple(getattr(router_weight, 'shape', ()))}")
        if router_dtype is not None and (not isinstance(router_dtype, torch.dtype) or not router_dtype.is_floating_point):
            raise ConfigError(f"router_dtype={router_dtype!r}: expected a floating torch.dtype or None")
        if shared_experts is not None and not isinstance(shared_experts, torch.nn.Module):
            raise ConfigError(f"shared_experts: expected a torch.nn.Module or None, got {type(shared_experts).__name__}")
        if layer_factory is None:
            layer_factory = default_layer_factory(ctx)
        if workspace is not None:  # forwarded only when given: layers without the argument still work
            layer_kwargs["workspace"] = workspace
        layer = layer_factory(ctx, experts, routing, max_tokens=max_tokens, **layer_kwargs)
        self.layer = layer
        self.num_experts, self.hidden, self.inter, self.topk = (int(v) for v in (num_experts, hidden, inter, topk))
        self.max_tokens = int(max_tokens)
        self.device = layer.device
        self.router_dtype = router_weight.dtype if router_dtype is None else router_dtype
        self.register_buffer("router_weight", router_weight.detach().to(self.device))
        weights = layer.engine.weights
        for name in LAYER_BUFFERS[:4]:
            self.register_buffer(name, getattr(weights, name))
        self.register_buffer("bias", layer.bias)
        self.shared_experts = None if shared_experts is None else shared_experts.to(self.device)
        # The op's call token (module docstring), on the layer's device; not part of the state dict.
        with torch.inference_mode(False):  # a normal tensor even when built under inference_mode: the op
            # writes it in place, which an inference tensor refuses outside inference mode
            token = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.register_buffer("call_token", token, persistent=False)
        self._handle = register_layer(layer)
        self._op = moe_op()
        self.register_load_state_dict_post_hook(MoEModule._after_load)
        if checkpoint_names == "hf":
            self._register_state_dict_hook(MoEModule._hf_state_dict)

    # --- the forward ------------------------------------------------------------------------------------

    def _tokens(self, hidden_states):
        """``hidden_states`` validated, as ``[n, hidden]``."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1 \
                or hidden_states.shape[-1] != self.hidden:
            raise ConfigError(f"hidden_states: expected a tensor [..., hidden={self.hidden}], got "
                              f"{tuple(getattr(hidden_states, 'shape', ())) or type(hidden_states).__name__}")
        if hidden_states.dtype != torch.bfloat16:
            raise ConfigError(f"hidden_states.dtype={hidden_states.dtype}: expected torch.bfloat16 (the layer's "
                              "activations; cast the model with model.to(torch.bfloat16))")
        if hidden_states.device != self.device:
            raise ConfigError(f"hidden_states: expected a tensor on {self.device}, got one on {hidden_states.device}")
        if torch.is_grad_enabled() and hidden_states.requires_grad:
            raise ConfigError("hidden_states requires grad: the symmring MoE layer is inference-only (no backward); "
                              "call it under torch.no_grad() or torch.inference_mode()")
        x = hidden_states.reshape(-1, self.hidden)
        if x.shape[0] > self.max_tokens:
            raise ConfigError(f"hidden_states.shape={tuple(hidden_states.shape)}: {x.shape[0]} tokens, expected at "
                              f"most max_tokens={self.max_tokens} per call")
        return x

    def router_logits(self, x):
        """The router on ``x [n, hidden]``: ``F.linear`` in ``router_dtype`` (as the transformers blocks do)."""
        dtype = self.router_dtype
        return torch.nn.functional.linear(x.to(dtype), self.router_weight.to(dtype))

    def route(self, hidden_states) -> Tuple:
        """``(logits, topk_idx, topk_weights)`` of ``hidden_states``: torch's `symmring.moe.routing.route` on
        `router_logits`, the definition the layer's device routing of the same logits follows (the experts
        agree, ties to the lower id; weights to float32 rounding); for inspection and tests, no layer call."""
        from .. import routing
        x = self._tokens(hidden_states)
        logits = self.router_logits(x)
        idx, weights = routing.route(logits, self.topk, **self.routing.route_kwargs())
        return logits, idx, weights

    def forward(self, hidden_states):
        """bf16 ``[..., hidden]`` -> bf16 of the same shape: the routed experts (plus the shared ones).

        Raises:
            ConfigError: not bf16 ``[..., hidden]`` on the layer's device, more than ``max_tokens`` tokens,
                or an input that requires grad while grad is enabled.
        """
        x = self._tokens(hidden_states)
        y = self._op(x, self.router_logits(x), self.call_token, self._handle, STREAMING_CODES[self.streaming])
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(hidden_states.shape)

    # --- configuration, state, teardown -----------------------------------------------------------------

    @property
    def routing(self) -> RoutingConfig:
        """The layer's routing (`symmring.moe.config.RoutingConfig`; its ``bias`` is the layer's, the module's
        ``bias`` buffer)."""
        return self.layer.routing

    def extra_repr(self) -> str:
        layer = self.layer
        begin = layer.expert_begin
        r = self.routing
        options = f"{r.scoring}" + (f", n_group={r.n_group}, topk_group={r.topk_group}" if r.n_group > 1
                                    else "") + ("" if r.norm_topk_prob else ", norm_topk_prob=False")
        return (f"experts [{begin}, {begin + layer.num_local_experts}) of {self.num_experts}, hidden={self.hidden}, "
                f"inter={self.inter}, top-{self.topk} {options}, engine={layer.engine.name}, "
                f"streaming={self.streaming!r}, max_tokens={self.max_tokens}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if local_metadata.get("assign_to_params_buffers", False):
            raise ConfigError("load_state_dict(assign=True): the expert weights are the layer's own tensors; "
                              "load with assign=False (values are copied in place)")
        if self.checkpoint_names == "hf":
            self._from_hf_names(state_dict, prefix)
        for name in LAYER_BUFFERS + ("router_weight",):
            mine, key = self._buffers.get(name), prefix + name
            given = state_dict.get(key)
            if mine is not None and isinstance(given, torch.Tensor) and \
                    (given.dtype != mine.dtype or tuple(given.shape) != tuple(mine.shape)):
                raise ConfigError(f"state_dict[{key!r}]: {given.dtype} {tuple(given.shape)}, expected {mine.dtype} "
                                  f"{tuple(mine.shape)} (this rank's experts in the layer's engine layout, "
                                  f"engine={self.layer.engine.name})")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _from_hf_names(self, state_dict, prefix: str) -> None:
        """Rename the transformers block's entries of ``state_dict`` to the buffers' names (in place), cutting
        expert tensors of all experts to this rank's and casting the router and bias to the buffers' dtypes."""
        layer = self.layer
        begin, local = layer.expert_begin, layer.num_local_experts
        for name, hf_name in HF_NAMES.items():
            key = prefix + hf_name
            if key not in state_dict:
                continue
            given, mine = state_dict.pop(key), self._buffers.get(name)
            if mine is None or not isinstance(given, torch.Tensor):
                state_dict[key] = given  # not ours (no bias here): left for the unexpected-keys report
                continue
            if name in ("w13", "w_down"):
                if given.dim() == 3 and given.shape[0] == self.num_experts and local != self.num_experts:
                    given = given[begin:begin + local]  # all experts: this rank's
                if given.dtype != mine.dtype and given.dtype == torch.bfloat16:
                    raise ConfigError(f"state_dict[{key!r}]: bf16 transformers experts, but the layer keeps "
                                      f"{mine.dtype} experts (engine={layer.engine.name}); build the module with "
                                      "engine='torch' (bf16 experts) to load a transformers checkpoint")
            elif tuple(given.shape) == tuple(mine.shape) and given.is_floating_point():
                given = given.to(mine.dtype)  # the router in the module's dtype, the bias in float32
            state_dict[prefix + name] = given

    @staticmethod
    def _hf_state_dict(module, state_dict, prefix, local_metadata) -> None:
        """``checkpoint_names="hf"``: the buffers under the transformers block's names (this rank's experts)."""
        for name, hf_name in HF_NAMES.items():
            if prefix + name in state_dict:
                state_dict[prefix + hf_name] = state_dict.pop(prefix + name)

    @staticmethod
    def _after_load(module, incompatible_keys) -> None:
        module.layer.refresh_weights()  # the engine's derived tensors, and no graph of the former ones

    def _apply(self, fn, recurse=True):
        # The layer's tensors stay as they are (its fixed layout, on its GPU), as does the call token (on the
        # layer's device); the rest follows .to() etc.
        held = {name: self._buffers[name] for name in LAYER_BUFFERS + ("call_token",) if name in self._buffers}
        for name in held:
            del self._buffers[name]
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers.update(held)

    def close(self) -> None:
        """Collective, idempotent: free the layer (its symmetric memory); the module cannot run afterwards."""
        unregister_layer(self._handle)
        self.layer.close()
