"""transformers MoE blocks to `symmring.moe.integrations.module.MoEModule`: Mixtral, Qwen3-MoE and DeepSeek-V3
(transformers 5.x).

The 5.x blocks share one expert layout, which is the layer's own: ``block.experts.gate_up_proj [E, 2I, H]``
(gate rows, then up rows: the layer's fused ``w13``), ``block.experts.down_proj [E, H, I]`` and the router
``block.gate.weight [E, H]``. What differs is the routing, which `from_hf` reads from the block's router
(``block.gate``) and hands to the layer, and the router's dtype:

| block class | routing (`symmring.moe.routing.route`) | router logits |
|---|---|---|
| ``MixtralSparseMoeBlock`` | ``"softmax"``, top-``gate.top_k``, renormalised | ``F.linear(x, w)`` in the model dtype |
| ``Qwen3MoeSparseMoeBlock`` | ``"softmax"``, ``norm_topk_prob=gate.norm_topk_prob`` | the same |
| ``DeepseekV3MoE`` | ``"sigmoid_bias"``, ``bias=gate.e_score_correction_bias``, ``routed_scaling_factor``, ``n_group``, ``topk_group``, ``norm_topk_prob``; plus ``block.shared_experts`` added in torch | float32 (``F.linear(x.float(), w.float())``) |

The module computes the logits as the block does and passes them to the layer (``logits=``), so the
experts chosen are the block's. (Qwen3's router rounds its weights to the model dtype; the layer keeps
them in float32.) Blocks are recognised by class name (their own or a base class's), so transformers
need not be imported here; experts with another activation than SiLU, non-bf16 expert weights (an
fp8-quantised transformers model) and weights on the meta device are refused with a `ConfigError`.

Rank ``r`` of ``R`` takes experts ``[r E/R, (r+1) E/R)``; every rank must hold the same model (the same
weights) and replace the same blocks in the same order (the layer's construction is collective).

The context picks the layer (`symmring.moe.integrations.module.MoEModule`): on the nvshmem backend the GPU layer (the
module on the current CUDA device), on the host backend the CPU layer (the module on the CPU; a whole
transformers model runs with symmring's expert-parallel blocks under ``mpiexec`` on any machine). The
module keeps the block's state names (``checkpoint_names="hf"``): a replaced model loads the original
model's state dict, each rank taking its experts.

transformers: the tested range is `TRANSFORMERS_RANGE` (``>=5.13,<6``, the ``hf`` extra); 5.0-5.12 keep
DeepSeek-V3's routing options on the block instead of its router and fill masked groups with 0 instead of
``-inf``, so `from_hf` refuses them in one line (`check_transformers`). The routing follows transformers'
to the bit where it can: DeepSeek-V3 divides by ``sum + 1e-20`` (`symmring.moe.routing.RENORM_EPS`).

Example:
    >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()  # doctest: +SKIP
    >>> replaced = replace_moe_blocks(model, ctx, max_tokens=4096, engine="builtin")  # doctest: +SKIP
    >>> with torch.inference_mode():  # doctest: +SKIP
    ...     logits = model(input_ids).logits
    >>> for module in replaced.values(): module.close()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Dict, Optional

from ...errors import BackendError, ConfigError
from ..config import Experts, RoutingConfig

#: The transformers versions `from_hf` is tested with: the oldest that works (5.13.0: DeepSeek-V3's router
#: holds ``top_k``, masked groups are ``-inf``) up to the next major version.
TRANSFORMERS_MIN, TRANSFORMERS_BELOW = (5, 13), (6,)
TRANSFORMERS_RANGE = ">=5.13,<6"

#: transformers MoE block classes (matched by name on the class and its bases) -> family.
BLOCK_CLASSES = {"MixtralSparseMoeBlock": "mixtral", "Qwen3MoeSparseMoeBlock": "qwen3_moe",
                 "DeepseekV3MoE": "deepseek_v3"}
#: Module arguments the block sets (passing them to `from_hf` is a ConfigError): the experts, the routing
#: (a `symmring.moe.config.RoutingConfig`), the router and the shared experts.
SET_BY_BLOCK = ("experts", "routing", "router_weight", "router_dtype", "shared_experts")


def _torch():
    import torch
    return torch


def _release(version: str):
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_transformers(version: Optional[str] = None) -> Optional[str]:
    """The installed transformers version (None when it is not installed), refused below the tested range.

    Raises:
        BackendError: transformers older than 5.13, in one line naming the version needed.

    Example:
        >>> check_transformers("5.17.0")
        '5.17.0'
        >>> check_transformers("5.12.1")
        Traceback (most recent call last):
        ...
        symmring.errors.BackendError: transformers 5.12.1 is installed; symmring.moe.integrations.hf needs transformers>=5.13,<6 (pip install "symmring[hf]")
    """
    if version is None:
        import importlib.metadata
        import sys
        module = sys.modules.get("transformers")  # the one imported, when it is (metadata may be another copy's)
        version = getattr(module, "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version("transformers")
            except importlib.metadata.PackageNotFoundError:
                return None
    release = _release(version)
    if release < TRANSFORMERS_MIN:
        raise BackendError(f"transformers {version} is installed; symmring.moe.integrations.hf needs transformers"
                           f"{TRANSFORMERS_RANGE} (pip install \"symmring[hf]\")")
    if release >= TRANSFORMERS_BELOW:
        import logging
        logging.getLogger(__name__).warning("transformers %s is newer than the tested range %s", version,
                                            TRANSFORMERS_RANGE)
    return version


def block_family(module) -> Optional[str]:
    """``"mixtral"``, ``"qwen3_moe"`` or ``"deepseek_v3"`` for a transformers block of that family, else None.

    Example:
        >>> block_family(object()) is None
        True
    """
    for cls in type(module).__mro__:
        if cls.__name__ in BLOCK_CLASSES:
            return BLOCK_CLASSES[cls.__name__]
    return None


def _tensor(block, path: str, ndim: int):
    torch = _torch()
    value = block
    for part in path.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, torch.Tensor) or value.dim() != ndim:
        raise ConfigError(f"block.{path}: expected a {ndim}-D tensor (the transformers 5.x layout), got "
                          f"{getattr(value, 'shape', type(value).__name__)}")
    if value.is_meta:
        raise ConfigError(f"block.{path}: the weights are on the meta device (not loaded); load the model first")
    return value


def block_spec(block, world_size: int) -> dict:
    """What `from_hf` builds from ``block``, validated with no device work: ``family``, ``hidden``,
    ``inter``, the weight tensors (all experts: ``gate_up_proj``, ``down_proj``, ``router_weight``),
    ``routing`` (the block's `symmring.moe.config.RoutingConfig`, its bias the block's tensor),
    ``router_dtype`` and ``shared_experts``.

    Raises:
        ConfigError: not a supported block, an unexpected layout, dtype or activation, or a number of
            experts that ``world_size`` ranks cannot split evenly.
    """
    torch = _torch()
    family = block_family(block)
    if family is None:
        raise ConfigError(f"block: {type(block).__name__} is not a supported transformers MoE block; expected one "
                          f"of {sorted(BLOCK_CLASSES)}")
    gate_up = _tensor(block, "experts.gate_up_proj", 3)
    down = _tensor(block, "experts.down_proj", 3)
    router = _tensor(block, "gate.weight", 2)
    num_experts, inter2, hidden = (int(s) for s in gate_up.shape)
    inter = inter2 // 2
    if inter2 % 2 or tuple(down.shape) != (num_experts, hidden, inter):
        raise ConfigError(f"block.experts.down_proj.shape={tuple(down.shape)}: expected [E, H, I] = "
                          f"{(num_experts, hidden, inter)} beside gate_up_proj {tuple(gate_up.shape)}")
    if tuple(router.shape) != (num_experts, hidden):
        raise ConfigError(f"block.gate.weight.shape={tuple(router.shape)}: expected [E, H] = {(num_experts, hidden)}")
    for path, t in (("experts.gate_up_proj", gate_up), ("experts.down_proj", down)):
        if t.dtype != torch.bfloat16:
            raise ConfigError(f"block.{path}.dtype={t.dtype}: expected torch.bfloat16 (load the model with "
                              "dtype=torch.bfloat16; fp8-quantised transformers experts are not supported)")
    if not router.is_floating_point():
        raise ConfigError(f"block.gate.weight.dtype={router.dtype}: expected a float dtype")
    act = getattr(block.experts, "act_fn", None)
    probe = torch.linspace(-6, 6, 97)
    try:
        silu = act is not None and torch.equal(act(probe), torch.nn.functional.silu(probe))
    except Exception:  # an activation that cannot run on a CPU float32 probe is not SiLU
        silu = False
    if not silu:
        raise ConfigError(f"block.experts.act_fn={act!r}: expected SiLU (the layer's experts are SwiGLU)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1 or num_experts % world_size:
        raise ConfigError(f"block: {num_experts} experts, expected a multiple of world_size={world_size} "
                          "(rank r owns experts [r E/R, (r+1) E/R))")
    gate = block.gate
    topk = int(gate.top_k)
    options = {}
    router_dtype, shared = None, None
    if family == "qwen3_moe":
        options["norm_topk_prob"] = bool(gate.norm_topk_prob)
    elif family == "deepseek_v3":
        bias = _tensor(block, "gate.e_score_correction_bias", 1)
        options = dict(scoring="sigmoid_bias", bias=bias, routed_scaling_factor=float(gate.routed_scaling_factor),
                       n_group=int(gate.num_group), topk_group=int(gate.topk_group),
                       norm_topk_prob=bool(gate.norm_topk_prob))
        router_dtype = torch.float32
        shared = getattr(block, "shared_experts", None)
        if not isinstance(shared, torch.nn.Module):
            raise ConfigError(f"block.shared_experts={shared!r}: expected the DeepSeek-V3 shared experts module")
    return dict(family=family, hidden=hidden, inter=inter, gate_up_proj=gate_up, down_proj=down,
                router_weight=router, routing=RoutingConfig(num_experts, topk, **options), router_dtype=router_dtype,
                shared_experts=shared)


def _check_layer_kwargs(layer_kwargs: dict) -> None:
    clash = sorted(set(layer_kwargs) & set(SET_BY_BLOCK))
    if clash:
        raise ConfigError(f"{', '.join(clash)}: set by the transformers block; expected only the layer's other "
                          "arguments (engine, schedule=ScheduleConfig(...), workspace)")


def from_hf(block, ctx, *, max_tokens: int, streaming=False, device=None, layer_factory=None, workspace=None,
            expert_dtype: Optional[str] = None, **layer_kwargs):
    """A `symmring.moe.integrations.module.MoEModule` computing ``block`` with this rank's experts (module docstring).

    Args:
        block: a transformers 5.x ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock`` or ``DeepseekV3MoE``
            (bf16 experts, on any device; every rank holding the same weights).
        ctx: the symmring context; its backend picks the layer (nvshmem: the GPU layer; host: the CPU layer),
            its rank and world size the experts.
        max_tokens: most tokens per rank per call (the layer's buffers).
        streaming: ``False``, ``True`` or ``"auto"``: the schedule of every call.
        device: where the layer's weights go (default: the CPU on the host backend, else the current CUDA
            device, the GPU layer's device).
        layer_factory: builds the layer (default: by the backend,
            `symmring.moe.integrations.module.default_layer_factory`; tests pass a stand-in).
        workspace: passed to the layer when given (`symmring.moe.integrations.module.MoEModule`).
        expert_dtype: the `symmring.moe.config.Experts` field of the experts `from_hf` makes from the block's
            (None: what the engine needs, else bf16; ``"fp8"``: quantised once by the GPU layer).
        **layer_kwargs: the layer's other arguments: ``schedule`` (a `symmring.moe.config.ScheduleConfig`:
            ``x_format``, ``num_slots``, ``tokens_per_slot``, ``expert_window``, ``ack_policy``, ...), ``engine``.

    Returns:
        The module (``checkpoint_names="hf"``: its state under the block's names); ``block`` itself is left as
        it was (its shared experts, if any, are shared with the module).

    Raises:
        ConfigError: an unsupported block (`block_spec`), a layer argument the block sets, or a bad layer
            argument (before any collective work).
        BackendError: transformers older than the tested range (`check_transformers`).

    Example:
        >>> module = from_hf(model.model.layers[0].mlp, ctx, max_tokens=4096, engine="torch")  # doctest: +SKIP
        >>> module.routing.scoring  # doctest: +SKIP
        'softmax'
    """
    torch = _torch()
    check_transformers()
    spec = block_spec(block, getattr(ctx, "world_size", None))
    _check_layer_kwargs(layer_kwargs)
    if device is None:
        on_host = getattr(getattr(ctx, "backend", None), "name", None) == "host"
        device = torch.device("cpu") if on_host else torch.device("cuda", torch.cuda.current_device())
    routing = spec["routing"]
    E, I = routing.num_experts, spec["inter"]
    local = E // ctx.world_size
    begin = ctx.rank * local
    with torch.no_grad():
        gate_up = spec["gate_up_proj"][begin:begin + local]  # a view: only this rank's experts are copied
        w_gate, w_up = gate_up[:, :I].to(device), gate_up[:, I:].to(device)
        w_down = spec["down_proj"][begin:begin + local].to(device)
        if routing.bias is not None:
            routing = routing.with_bias(routing.bias.detach().to(device))
    return _module_cls()(ctx, Experts(w_gate, w_up, w_down, expert_dtype=expert_dtype), routing,
                         router_weight=spec["router_weight"], max_tokens=max_tokens, router_dtype=spec["router_dtype"],
                         shared_experts=spec["shared_experts"], streaming=streaming, layer_factory=layer_factory,
                         checkpoint_names="hf", workspace=workspace, **layer_kwargs)


def _module_cls():
    from .module import MoEModule
    return MoEModule


def replace_moe_blocks(model, ctx, **kwargs) -> Dict[str, object]:
    """Replace every supported MoE block of ``model`` in place by `from_hf` of it (collective: every rank
    calls it on the same model).

    Args:
        model: a ``torch.nn.Module`` (a transformers model) holding the blocks.
        ctx: the symmring context.
        **kwargs: `from_hf`'s keyword arguments (``max_tokens`` required; ``workspace`` passed to every layer).

    Returns:
        ``{qualified name: the MoEModule now there}``, in model order; the replaced blocks are dropped
        (nothing keeps their experts), so their memory is freed once nothing else holds them.

    Raises:
        ConfigError: no supported block in ``model``, or one that `from_hf` refuses (every block is checked
            before the first is replaced).

    Example:
        >>> replaced = replace_moe_blocks(model, ctx, max_tokens=4096)  # doctest: +SKIP
        >>> sorted(replaced)[:1]  # doctest: +SKIP
        ['model.layers.0.mlp']
    """
    found = [(name, m) for name, m in model.named_modules() if name and block_family(m) is not None]
    if not found:
        raise ConfigError(f"model: {type(model).__name__} holds no supported MoE block (expected one of "
                          f"{sorted(BLOCK_CLASSES)})")
    check_transformers()
    _check_layer_kwargs({k: v for k, v in kwargs.items() if k not in ("max_tokens", "streaming", "device",
                                                                       "layer_factory", "workspace", "expert_dtype")})
    for name, block in found:
        try:
            block_spec(block, getattr(ctx, "world_size", None))
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from exc
    replaced = {}
    for name, block in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = from_hf(block, ctx, **kwargs)
        setattr(parent, child, module)
        replaced[name] = module
    return replaced
