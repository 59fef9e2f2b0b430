"""Routing of the GPU MoE layer: router logits to ``(topk_idx, topk_weights)``, in torch.

The same definitions as the NumPy reference (`symmring.moe.reference.select_topk`):

* ``"softmax"`` (Mixtral, Qwen-MoE): the ``topk`` largest logits (softmax is monotonic), weights = their
  softmax probabilities renormalised to sum to 1, i.e. a softmax over the chosen logits (float32).
* ``"sigmoid_bias"`` (DeepSeek-V3): ``s = sigmoid(logits)`` in float32; experts chosen by the ``topk``
  largest ``s + bias``; weights ``s`` of the chosen experts (no bias) renormalised to sum to 1, times
  ``routed_scaling_factor``. The renormalisation divides by ``sum + RENORM_EPS`` (1e-20), as transformers'
  DeepSeek-V3 router does: a no-op unless every chosen ``s`` is below ~1e-13, where it gives transformers'
  small weights (0 when the ``s`` underflow) instead of 0/0.

Options (`check_options`; the names of the transformers configs):

* ``norm_topk_prob=False`` (Qwen3-MoE's variant, DeepSeek-V3's option): no renormalisation. With
  ``"softmax"`` the weights are the probabilities of a softmax over ALL experts at the chosen experts
  (chosen by the largest probabilities); with ``"sigmoid_bias"`` the chosen ``s`` times
  ``routed_scaling_factor``.
* ``n_group > 1``, ``topk_group`` (DeepSeek-V3's group-limited top-k, ``"sigmoid_bias"`` only): the
  experts form ``n_group`` groups of ``num_experts / n_group`` consecutive ids; a group's score is the sum
  of its two largest ``s + bias``; only the ``topk_group`` best groups take part in the top-k.

The layer routes on the device (`device_router`, device/moe/router.cuh: one warp per token, inside the
small-batch producer or as one kernel) with the same definitions, ties to the lower expert id as the NumPy
reference; `route` (torch) stays the reference the tests hold it to, and the fallback past the kernel's
limits (`device_routing_applies`).

torch is imported on the first call, not at module import.
"""

from __future__ import annotations

from ..errors import ConfigError


def _torch():
    import torch  # lazy: symmring imports without torch
    return torch


#: Added to the sum of the chosen sigmoid scores before dividing by it (transformers' DeepSeek-V3 router).
RENORM_EPS = 1e-20
#: Routing functions accepted by `route`.
SCORINGS = ("softmax", "sigmoid_bias")
#: Experts of a group whose scores make the group's score (DeepSeek-V3: the two largest).
GROUP_SCORE_TOPK = 2
#: Limits of the device routing (device/moe/router.cuh): experts (16 per lane of a warp), groups (a lane
#: each) and top-k (a lane per entry).
DEVICE_MAX_EXPERTS, DEVICE_MAX_GROUPS, DEVICE_MAX_TOPK = 512, 32, 32
#: Logits element types the device routing reads (router.cuh LogitsDtype); others are read as float32.
LOGITS_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}


def _is_int(value) -> bool:
    import numpy as np
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def check_options(num_experts: int, topk: int, scoring: str = "softmax", *, n_group: int = 1, topk_group: int = 1,
                  norm_topk_prob: bool = True) -> None:
    """Validate a routing configuration (no tensors): what `route` and the layers accept.

    Raises:
        ConfigError: naming the argument: an unknown ``scoring``; ``topk`` outside ``[1, num_experts]``;
            ``n_group`` not a positive divisor of ``num_experts``, or > 1 without ``"sigmoid_bias"`` or with
            groups of fewer than 2 experts; ``topk_group`` outside ``[1, n_group]``; ``topk`` more than the
            chosen groups hold; ``norm_topk_prob`` not a bool.

    Example:
        >>> check_options(256, 8, "sigmoid_bias", n_group=8, topk_group=4)
        >>> check_options(256, 8, "sigmoid_bias", n_group=3, topk_group=2)
        Traceback (most recent call last):
        ...
        symmring.errors.ConfigError: n_group=3: expected a positive divisor of num_experts=256
    """
    if scoring not in SCORINGS:
        raise ConfigError(f"scoring={scoring!r}: expected one of {list(SCORINGS)}")
    if not _is_int(topk) or not 1 <= topk <= num_experts:
        raise ConfigError(f"topk={topk!r}: expected an int in [1, num_experts={num_experts}]")
    if not _is_int(n_group) or n_group < 1 or num_experts % n_group:
        raise ConfigError(f"n_group={n_group!r}: expected a positive divisor of num_experts={num_experts}")
    if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
        raise ConfigError(f"topk_group={topk_group!r}: expected an int in [1, n_group={n_group}]")
    if not isinstance(norm_topk_prob, bool):
        raise ConfigError(f"norm_topk_prob={norm_topk_prob!r}: expected a bool")
    if n_group > 1:
        per_group = num_experts // n_group
        if scoring != "sigmoid_bias":
            raise ConfigError(f"n_group={n_group}: group-limited routing is defined for scoring='sigmoid_bias' "
                              f"(DeepSeek-V3), not {scoring!r}")
        if per_group < GROUP_SCORE_TOPK:
            raise ConfigError(f"n_group={n_group}: groups of {per_group} expert(s); a group's score sums its "
                              f"{GROUP_SCORE_TOPK} best experts (expected num_experts / n_group >= {GROUP_SCORE_TOPK})")
        if topk > topk_group * per_group:
            raise ConfigError(f"topk={topk}: expected at most topk_group * num_experts / n_group = "
                              f"{topk_group * per_group} (the experts of the chosen groups)")


def route(logits, topk: int, scoring: str = "softmax", *, bias=None, routed_scaling_factor: float = 1.0,
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True):
    """TopK routing of router ``logits``.

    Args:
        logits: ``[num_tokens, num_experts]`` tensor (any float dtype; computed in float32).
        topk: experts per token, ``1 <= topk <= num_experts``.
        scoring: ``"softmax"`` (Mixtral) or ``"sigmoid_bias"`` (DeepSeek-V3, with ``bias``).
        bias: float ``[num_experts]`` selection bias (sigmoid_bias only; None means zeros).
        routed_scaling_factor: factor applied to the sigmoid weights.
        n_group, topk_group, norm_topk_prob: see the module docstring (`check_options`).

    Returns:
        ``(topk_idx int32 [num_tokens, topk], topk_weights float32 [num_tokens, topk])``, on the
        device of ``logits``.

    Raises:
        ConfigError: bad ``scoring``, ``topk`` or shapes.

    Example:
        >>> import torch
        >>> idx, w = route(torch.randn(4, 8), topk=2)
        >>> idx.shape, round(float(w.sum(-1)[0]), 6)     # the chosen weights sum to 1 (to float32 rounding)
        (torch.Size([4, 2]), 1.0)
    """
    torch = _torch()
    if scoring not in SCORINGS:
        raise ConfigError(f"scoring={scoring!r}: expected one of {list(SCORINGS)}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ConfigError(f"logits: expected a 2-D tensor [num_tokens, num_experts], got "
                          f"{getattr(logits, 'shape', type(logits).__name__)}")
    num_experts = int(logits.shape[1])
    check_options(num_experts, topk, scoring, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    scores = logits.float()
    if scoring == "softmax":
        if norm_topk_prob:
            chosen, idx = torch.topk(scores, topk, dim=-1)
            weights = torch.softmax(chosen, dim=-1)
        else:  # the probabilities over all experts, as they are
            weights, idx = torch.topk(torch.softmax(scores, dim=-1), topk, dim=-1)
    else:
        probs = torch.sigmoid(scores)
        choice = probs if bias is None else probs + bias.float().to(probs.device)[None, :]
        if n_group > 1:
            num_tokens = choice.shape[0]
            grouped = choice.view(num_tokens, n_group, num_experts // n_group)
            group_scores = grouped.topk(GROUP_SCORE_TOPK, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, topk_group, dim=-1)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, num_experts)
        _, idx = torch.topk(choice, topk, dim=-1)
        weights = probs.gather(1, idx)
        if norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
        weights = weights * float(routed_scaling_factor)
    return idx.to(torch.int32), weights.float()


def device_routing_applies(num_experts: int, topk: int, n_group: int = 1) -> bool:
    """Whether the device routing handles these options (else the layer routes with `route`).

    Example:
        >>> device_routing_applies(256, 8, 8), device_routing_applies(1024, 8)
        (True, False)
    """
    return num_experts <= DEVICE_MAX_EXPERTS and topk <= DEVICE_MAX_TOPK and n_group <= DEVICE_MAX_GROUPS


def device_router(num_experts: int, scoring: str = "softmax", *, bias=None, routed_scaling_factor: float = 1.0,
                  n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True):
    """The routing options as the device kernels read them: a record of the ``RouterOptions`` struct
    (device/moe/args.cuh; `symmring.moe.gpu.kernel_args`), its ``topk`` 0 (the kernels take it from the ring, or
    the launcher sets it). ``bias``: a contiguous float32 device tensor (the caller keeps it alive) or None.
    Options are `check_options`'s (checked by the caller).

    Example:
        >>> options = device_router(128, "softmax")
        >>> [int(options[name]) for name in ("bias", "scoring", "num_experts", "n_group", "norm_topk_prob")]
        [0, 0, 128, 1, 1]
    """
    import numpy as np
    from .gpu.kernel_args import STRUCTS
    options = np.zeros((), STRUCTS["RouterOptions"])
    options["bias"] = 0 if bias is None else bias.data_ptr()
    options["routed_scaling_factor"] = routed_scaling_factor
    options["scoring"] = SCORINGS.index(scoring)
    options["num_experts"] = num_experts
    options["n_group"], options["topk_group"] = n_group, topk_group
    options["norm_topk_prob"] = bool(norm_topk_prob)
    return options


def logits_operand(logits):
    """``(tensor, dtype code)`` the device routing reads: ``logits`` itself when its dtype is one of
    `LOGITS_DTYPE_CODES` and its rows are contiguous (any row stride), else a contiguous float32 copy."""
    name = str(logits.dtype).replace("torch.", "")
    if name not in LOGITS_DTYPE_CODES:
        logits, name = logits.float(), "float32"
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits, LOGITS_DTYPE_CODES[name]
