"""The reference Mixture-of-Experts layer (NumPy, one process) and the arithmetic every layer shares.

A MoE layer here is::

    logits  = x @ router_weight.T                                  [T, E]   (or given)
    topk_idx, topk_weights = TopK(logits)                          [T, K]   (or given; -1 = masked)
    x_q, x_sf = fp8 e4m3 per-token, per-128-channel quantisation   (or bf16)   see `quant`
    for every (token t, k) with expert e = topk_idx[t, k] != -1:
        h       = dequant(x_q, x_sf)[t]                            float32 [H]
        gate    = w_gate[e] @ h,  up = w_up[e] @ h                 float32 [I]
        act     = silu(gate) * up                                  float32 [I]   (SwiGLU)
        out[t,k]= w_down[e] @ act                                  float32 [H]
    y[t] = sum over k = 0..K-1 (in that order, masked k skipped) of topk_weights[t, k] * out[t, k]

Precision contract (what every implementation in symmring computes, so they agree to float32 rounding):
weights and activations are float32; every dot product is accumulated in float64 (products of two
float32 values are exact in float64) and rounded to float32; SwiGLU is evaluated in float64 from the
float32 gate/up and rounded to float32; the combine accumulates ``float64(weight) * float64(out)`` over
``k`` in ascending order and rounds once to float32.

TopK variants (`select_topk`):

* ``"softmax"`` (Mixtral): probabilities ``softmax(logits)`` over all experts (float64), the ``K``
  experts with the largest logits (softmax is monotonic, so the same experts as the largest
  probabilities), weights = their probabilities renormalised to sum to 1.
* ``"sigmoid_bias"`` (DeepSeek-V3): ``scores = sigmoid(logits)``; the ``K`` experts with the largest
  ``scores + bias`` are chosen; weights = their *unbiased* scores divided by the sum of those scores
  plus 1e-20 (`symmring.moe.routing.RENORM_EPS`, transformers' guard against 0/0), times
  ``routed_scaling_factor``.
* ``norm_topk_prob=False`` (Qwen3-MoE's variant; a DeepSeek-V3 option): the chosen probabilities (times
  ``routed_scaling_factor`` for ``"sigmoid_bias"``) are not divided by their sum.
* ``n_group > 1`` with ``topk_group`` (DeepSeek-V3's group-limited top-k, ``"sigmoid_bias"``): experts
  form ``n_group`` groups of consecutive ids; a group scores the sum of its two largest
  ``scores + bias``; the ``K`` experts are chosen among the ``topk_group`` best groups only.

The options are validated by `symmring.moe.routing.check_options`, the one rule of the torch routing.

Tie-breaking is deterministic: among equal selection keys the lower expert id wins (a stable sort of the
negated key). The selected experts are listed in decreasing key order, so ``k = 0`` is the top choice.

Row independence: `row_matmul`, `swiglu`, `select_topk` and `combine_rows` compute each token's result
from that token's inputs only, with elementwise NumPy operations in a fixed order, never with BLAS (whose
blocking can change a row's rounding with the number of rows). Hence the expert-parallel layer gets
bitwise the same values whether a token is computed in a whole batch or in a chunk. `reference_moe`
itself evaluates the experts with float64 ``np.einsum`` (a different summation order, so the test
against it is not circular); its results agree with the row-independent ones to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Tuple

import numpy as np

from ..errors import ConfigError
from . import quant
from .routing import RENORM_EPS, SCORINGS, check_options  # pure Python: routing imports torch only inside `route`

#: TopK variants accepted by `select_topk` (its ``scoring``): the torch routing's `routing.SCORINGS`, one list for
#: both (the former name, kept).
TOPK_METHODS = SCORINGS
#: Expert id of a masked (token, k) entry: it contributes nothing.
MASKED_EXPERT = -1
#: What the experts' intermediates are: ``"f32"`` (the contract above) or ``"fp8"`` (the GPU layer's fp8
#: experts: gate and up rounded to bf16, the SwiGLU output quantised to 1x128-scaled fp8 e4m3 before L2;
#: the weights given are the dequantised fp8 ones).
EXPERT_FORMATS = ("f32", "fp8")


# --- validation ---------------------------------------------------------------------------------------

def _check_array(name: str, value, dtype, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ConfigError(f"{name}: expected a NumPy {np.dtype(dtype)} array, got {type(value).__name__}")
    if value.dtype != dtype or value.ndim != ndim:
        raise ConfigError(f"{name}: expected a {ndim}-D {np.dtype(dtype)} array, got {value.ndim}-D "
                          f"{value.dtype} with shape {value.shape}")
    return value


def _check_finite(name: str, value: np.ndarray) -> None:
    if not np.all(np.isfinite(value)):
        raise ConfigError(f"{name}: expected finite values (found NaN or inf)")


def check_expert_weights(w_gate, w_up, w_down, hidden: Optional[int] = None) -> Tuple[int, int, int]:
    """Validate expert weights; return ``(num_experts, inter, hidden)``.

    Args:
        w_gate, w_up: float32 ``[E, inter, hidden]``.
        w_down: float32 ``[E, hidden, inter]``.
        hidden: when given, the hidden size the weights must have.

    Raises:
        ConfigError: naming the first argument with a wrong type, dtype, shape or a non-finite value.
    """
    _check_array("w_gate", w_gate, np.float32, 3)
    num_experts, inter, w_hidden = w_gate.shape
    if hidden is not None and w_hidden != hidden:
        raise ConfigError(f"w_gate.shape={w_gate.shape}: expected hidden={hidden} in the last dimension")
    _check_array("w_up", w_up, np.float32, 3)
    if w_up.shape != w_gate.shape:
        raise ConfigError(f"w_up.shape={w_up.shape}: expected w_gate's shape {w_gate.shape}")
    _check_array("w_down", w_down, np.float32, 3)
    if w_down.shape != (num_experts, w_hidden, inter):
        raise ConfigError(f"w_down.shape={w_down.shape}: expected [E, hidden, inter] = "
                          f"{(num_experts, w_hidden, inter)}")
    if num_experts == 0 or inter == 0 or w_hidden == 0:
        raise ConfigError(f"w_gate.shape={w_gate.shape}: expected non-empty dimensions")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        _check_finite(name, w)
    return num_experts, inter, w_hidden


def check_route(topk_idx, topk_weights, num_tokens: int, num_topk: int, num_experts: int) -> None:
    """Validate a given routing: int32 ids in ``[-1, num_experts)``, finite float32 weights.

    Raises:
        ConfigError: naming ``topk_idx`` or ``topk_weights`` and what is wrong.
    """
    _check_array("topk_idx", topk_idx, np.int32, 2)
    _check_array("topk_weights", topk_weights, np.float32, 2)
    expected = (num_tokens, num_topk)
    if topk_idx.shape != expected:
        raise ConfigError(f"topk_idx.shape={topk_idx.shape}: expected [num_tokens, num_topk] = {expected}")
    if topk_weights.shape != expected:
        raise ConfigError(f"topk_weights.shape={topk_weights.shape}: expected [num_tokens, num_topk] = "
                          f"{expected}")
    if topk_idx.size:
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < MASKED_EXPERT or high >= num_experts:
            raise ConfigError(f"topk_idx: values in [{low}, {high}], expected -1 (masked) or an expert id "
                              f"in [0, {num_experts})")
    _check_finite("topk_weights", topk_weights)


# --- row-independent arithmetic -----------------------------------------------------------------------

def transposed_f64(w: np.ndarray) -> np.ndarray:
    """``w.T`` as a C-contiguous float64 array: the weight operand `row_matmul` expects."""
    return np.ascontiguousarray(w.T, dtype=np.float64)


def row_matmul(a: np.ndarray, w_t64: np.ndarray) -> np.ndarray:
    """``float32(a @ w_t64)`` with each output a float64 sum over the inner index in ascending order.

    Each output element is ``sum_j float64(a[i, j]) * w_t64[j, n]`` accumulated sequentially in ``j``,
    using only elementwise operations, so row ``i`` of the result is bitwise independent of the other
    rows of ``a`` (unlike a BLAS product, whose blocking depends on the matrix sizes).

    Args:
        a: float32 ``[rows, inner]``.
        w_t64: float64 ``[inner, cols]`` (see `transposed_f64`).

    Returns:
        float32 ``[rows, cols]``.

    Example:
        >>> a = np.arange(6, dtype=np.float32).reshape(2, 3)
        >>> row_matmul(a, transposed_f64(np.eye(3, dtype=np.float32)))[1].tolist()
        [3.0, 4.0, 5.0]
    """
    rows, inner = a.shape
    acc = np.zeros((rows, w_t64.shape[1]), dtype=np.float64)
    if rows == 0:
        return acc.astype(np.float32)
    a64 = a.astype(np.float64)
    term = np.empty_like(acc)
    for j in range(inner):
        np.multiply(a64[:, j:j + 1], w_t64[j], out=term)
        acc += term
    return acc.astype(np.float32)


def router_logits(x: np.ndarray, router_weight: np.ndarray) -> np.ndarray:
    """Router logits ``x @ router_weight.T`` (float32 ``[T, E]``), row-independent (`row_matmul`).

    Raises:
        ConfigError: ``router_weight`` is not a finite float32 ``[E, hidden]`` array.
    """
    _check_array("router_weight", router_weight, np.float32, 2)
    if router_weight.shape[1] != x.shape[1] or router_weight.shape[0] == 0:
        raise ConfigError(f"router_weight.shape={router_weight.shape}: expected [num_experts, "
                          f"hidden={x.shape[1]}]")
    _check_finite("router_weight", router_weight)
    return row_matmul(x, transposed_f64(router_weight))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``float32(silu(gate) * up)`` evaluated elementwise in float64 (``silu(g) = g / (1 + exp(-g))``)."""
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-g) overflows to inf for g << 0: silu is then -0, correctly
        act = g64 / (1.0 + np.exp(-g64)) * up.astype(np.float64)
    return act.astype(np.float32)


def select_topk(logits: np.ndarray, num_topk: int, scoring: str = "softmax", *,
                bias: Optional[np.ndarray] = None, routed_scaling_factor: float = 1.0, n_group: int = 1,
                topk_group: int = 1, norm_topk_prob: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """TopK routing of each token from its logits (see the module docstring for the variants).

    Args:
        logits: float32 ``[num_tokens, num_experts]``, finite.
        num_topk: experts per token, ``1 <= num_topk <= num_experts``.
        scoring: ``"softmax"`` or ``"sigmoid_bias"`` (`symmring.moe.config.RoutingConfig`'s ``scoring``).
        bias: float32 ``[num_experts]`` selection bias (``sigmoid_bias`` only; zeros when omitted).
        routed_scaling_factor: factor on the weights (``sigmoid_bias`` only).
        n_group, topk_group: group-limited top-k (``sigmoid_bias`` only; ``n_group=1``: none).
        norm_topk_prob: renormalise the chosen weights to sum to 1 (the default).

    Returns:
        ``(topk_idx int32 [T, K], topk_weights float32 [T, K])``, experts in decreasing selection key,
        ties to the lower expert id.

    Raises:
        ConfigError: bad ``logits``, ``num_topk``, ``scoring``, ``bias`` or ``routed_scaling_factor``, or
            group and normalisation options that `routing.check_options` rejects.

    Example:
        >>> idx, w = select_topk(np.array([[0.0, 2.0, 2.0, 1.0]], np.float32), 2)
        >>> idx.tolist(), [round(float(v), 3) for v in w[0]]
        ([[1, 2]], [0.5, 0.5])
    """
    _check_array("logits", logits, np.float32, 2)
    _check_finite("logits", logits)
    num_tokens, num_experts = logits.shape
    if isinstance(num_topk, bool) or not isinstance(num_topk, (int, np.integer)) \
            or not 1 <= num_topk <= num_experts:
        raise ConfigError(f"num_topk={num_topk!r}: expected an int in [1, num_experts={num_experts}]")
    if scoring not in SCORINGS:
        raise ConfigError(f"scoring={scoring!r}: expected one of {SCORINGS}")
    check_options(num_experts, int(num_topk), scoring, n_group=n_group, topk_group=topk_group,
                  norm_topk_prob=norm_topk_prob)
    logits64 = logits.astype(np.float64)
    if scoring == "softmax":
        if bias is not None:
            raise ConfigError("bias: only 'sigmoid_bias' scoring takes a selection bias")
        key = logits64
        shifted = np.exp(logits64 - logits64.max(axis=1, keepdims=True, initial=-np.inf))
        probs = shifted / shifted.sum(axis=1, keepdims=True)
    else:
        if bias is None:
            bias = np.zeros(num_experts, np.float32)
        _check_array("bias", bias, np.float32, 1)
        if bias.shape != (num_experts,):
            raise ConfigError(f"bias.shape={bias.shape}: expected [num_experts] = ({num_experts},)")
        _check_finite("bias", bias)
        if not (isinstance(routed_scaling_factor, (int, float, np.floating))
                and np.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
            raise ConfigError(f"routed_scaling_factor={routed_scaling_factor!r}: expected a positive "
                              "finite number")
        with np.errstate(over="ignore"):  # exp(-l) overflows to inf for l << 0: sigmoid is then 0
            probs = 1.0 / (1.0 + np.exp(-logits64))
        key = probs + bias.astype(np.float64)
        if n_group > 1:
            key = _limit_to_groups(key, n_group, topk_group)
    # Stable sort of the negated key: equal keys keep ascending expert order, so the lower id wins.
    order = np.argsort(-key, axis=1, kind="stable")[:, :num_topk]
    chosen = np.take_along_axis(probs, order, axis=1)
    if norm_topk_prob:
        # Accumulate the normaliser in k order (row-independent; a sum() could use pairwise blocking).
        total = np.zeros((num_tokens, 1), np.float64)
        for k in range(num_topk):
            total += chosen[:, k:k + 1]
        if scoring == "sigmoid_bias":
            total += RENORM_EPS  # transformers' DeepSeek-V3 router: sum + 1e-20
        weights = chosen / total
    else:
        weights = chosen
    if scoring == "sigmoid_bias":
        weights = weights * float(routed_scaling_factor)
    return order.astype(np.int32), weights.astype(np.float32)


def _limit_to_groups(key: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """``key`` with every expert outside each token's ``topk_group`` best groups set to ``-inf`` (a group's
    score: the sum of its two largest keys, added in decreasing order; equal group scores: lower group id)."""
    num_tokens, num_experts = key.shape
    grouped = key.reshape(num_tokens, n_group, num_experts // n_group)
    best = -np.sort(-grouped, axis=2)
    group_score = best[:, :, 0] + best[:, :, 1]
    groups = np.argsort(-group_score, axis=1, kind="stable")[:, :topk_group]
    keep = np.zeros((num_tokens, n_group), bool)
    np.put_along_axis(keep, groups, True, axis=1)
    return np.where(keep[:, :, None], grouped, -np.inf).reshape(num_tokens, num_experts)


def combine_rows(outputs: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
    """Weighted combine of expert outputs over ``k = 0..K-1`` in order, skipping masked entries.

    Args:
        outputs: float32 ``[T, K, H]`` expert output of each (token, k); masked entries are never read,
            so they may hold anything.
        topk_idx: int32 ``[T, K]`` (``-1`` = masked).
        topk_weights: float32 ``[T, K]``.

    Returns:
        float32 ``[T, H]``: ``float32(sum_k float64(w[t, k]) * float64(out[t, k]))``.
    """
    num_tokens, num_topk, hidden = outputs.shape
    acc = np.zeros((num_tokens, hidden), np.float64)
    for k in range(num_topk):
        live = topk_idx[:, k] != MASKED_EXPERT
        if np.any(live):
            acc[live] += topk_weights[live, k, None].astype(np.float64) * outputs[live, k].astype(np.float64)
    return acc.astype(np.float32)


# --- the reference layer ------------------------------------------------------------------------------

def _matmul_t64(a64: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a64 @ w.T`` in float64 by ``np.einsum`` (its own SIMD loops; no BLAS thread pool, which on
    oversubscribed CI cores -- several MPI ranks on two cores -- is several times slower)."""
    return np.einsum("ti,oi->to", a64, w.astype(np.float64), optimize=False)


@dataclasses.dataclass
class ReferenceResult:
    """Output and intermediates of `reference_moe`.

    Attributes:
        y: float32 ``[T, H]`` layer output.
        topk_idx: int32 ``[T, K]``; topk_weights: float32 ``[T, K]``.
        x_q: the ring's representation of ``x`` (uint8 fp8 bytes or uint16 bf16 bits).
        x_sf: float32 ``[T, H / G]`` scales (fp8) or ``None`` (bf16).
        x_deq: float32 ``[T, H]`` values the experts saw.
        logits: float32 ``[T, E]`` router logits, or ``None`` when the routing was given.
        expert_out: float32 ``[T, K, H]`` output of each (token, k); zeros at masked entries.
    """

    y: np.ndarray
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    x_q: np.ndarray
    x_sf: Optional[np.ndarray]
    x_deq: np.ndarray
    logits: Optional[np.ndarray]
    expert_out: np.ndarray


def check_routing(num_tokens: int, hidden: int, num_topk: int, num_experts: int, *, router_weight=None,
                  logits=None, topk_idx=None, topk_weights=None) -> str:
    """Validate a routing source as given (the caller's arrays, so messages name their shapes) without
    computing anything. Returns the source's name: ``"router_weight"``, ``"logits"`` or ``"topk_idx"``.

    Raises:
        ConfigError: zero or several sources, or a source with the wrong type, dtype, shape, expert ids
            or non-finite values.

    Example:
        >>> check_routing(5, 128, 2, 8, logits=np.zeros((5, 8), np.float32))
        'logits'
        >>> check_routing(5, 128, 2, 8, topk_idx=np.zeros((5, 3), np.int32),
        ...               topk_weights=np.ones((5, 3), np.float32))
        Traceback (most recent call last):
        ...
        symmring.errors.ConfigError: topk_idx.shape=(5, 3): expected [num_tokens, num_topk] = (5, 2)
    """
    sources = [name for name, v in (("router_weight", router_weight), ("logits", logits),
                                    ("topk_idx", topk_idx)) if v is not None]
    if len(sources) != 1:
        raise ConfigError(f"routing: got {sources or 'none'}; expected exactly one of router_weight, "
                          "logits, or topk_idx with topk_weights")
    if topk_idx is not None:
        if topk_weights is None:
            raise ConfigError("topk_weights=None: expected float32 [num_tokens, num_topk] with topk_idx")
        check_route(topk_idx, topk_weights, num_tokens, num_topk, num_experts)
    elif topk_weights is not None:
        raise ConfigError("topk_weights: given without topk_idx")
    elif router_weight is not None:
        _check_array("router_weight", router_weight, np.float32, 2)
        if router_weight.shape != (num_experts, hidden):
            raise ConfigError(f"router_weight.shape={router_weight.shape}: expected "
                              f"[num_experts={num_experts}, hidden={hidden}]")
        _check_finite("router_weight", router_weight)
    else:
        _check_array("logits", logits, np.float32, 2)
        if logits.shape != (num_tokens, num_experts):
            raise ConfigError(f"logits.shape={logits.shape}: expected [num_tokens, num_experts] = "
                              f"{(num_tokens, num_experts)}")
        _check_finite("logits", logits)
    return sources[0]


def _scoring(scoring: str, topk_method: Optional[str]) -> str:
    """``scoring``, or ``topk_method`` (its former name) when that is given (a DeprecationWarning).

    Raises:
        ConfigError: both given, and different.
    """
    if topk_method is None:
        return scoring
    warnings.warn("topk_method= is the former name of scoring= (as in RoutingConfig); pass scoring=",
                  DeprecationWarning, stacklevel=3)
    if scoring != "softmax" and scoring != topk_method:
        raise ConfigError(f"topk_method={topk_method!r} and scoring={scoring!r}: the same option twice (topk_method "
                          "is scoring's former name)")
    return topk_method


def route(x: np.ndarray, num_topk: int, num_experts: int, *, router_weight=None, logits=None,
          topk_idx=None, topk_weights=None, scoring: str = "softmax", bias=None,
          routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          topk_method: Optional[str] = None):
    """Routing of ``x`` from exactly one source: ``router_weight``, ``logits`` or ``topk_idx`` +
    ``topk_weights``. Returns ``(topk_idx, topk_weights, logits or None)``. ``topk_method``: the former name
    of ``scoring`` (an alias, with a DeprecationWarning).

    Raises:
        ConfigError: zero or several sources given, or a source with the wrong shape or dtype
            (`check_routing`); bad ``scoring``, ``bias``, ``routed_scaling_factor`` or group and
            normalisation options (`select_topk`).
    """
    scoring = _scoring(scoring, topk_method)
    source = check_routing(x.shape[0], x.shape[1], num_topk, num_experts, router_weight=router_weight,
                           logits=logits, topk_idx=topk_idx, topk_weights=topk_weights)
    if source == "topk_idx":
        return topk_idx, topk_weights, None
    if source == "router_weight":
        logits = router_logits(x, router_weight)
    idx, weights = select_topk(logits, num_topk, scoring, bias=bias,
                               routed_scaling_factor=routed_scaling_factor, n_group=n_group,
                               topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    return idx, weights, logits


def reference_moe(x: np.ndarray, *, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
                  num_topk: int, router_weight: Optional[np.ndarray] = None,
                  logits: Optional[np.ndarray] = None, topk_idx: Optional[np.ndarray] = None,
                  topk_weights: Optional[np.ndarray] = None, scoring: str = "softmax",
                  bias: Optional[np.ndarray] = None, routed_scaling_factor: float = 1.0,
                  x_format: str = "fp8_e4m3", sf_group_size: int = quant.DEFAULT_GROUP_SIZE,
                  expert_format: str = "f32", n_group: int = 1, topk_group: int = 1,
                  norm_topk_prob: bool = True, topk_method: Optional[str] = None) -> ReferenceResult:
    """The whole MoE layer on one process, all experts local.

    Args:
        x: float32 ``[T, H]`` activations.
        w_gate, w_up: float32 ``[E, inter, H]``; w_down: float32 ``[E, H, inter]``.
        num_topk: experts per token (``K``).
        router_weight / logits / (topk_idx, topk_weights): exactly one routing source (float32
            ``[E, H]``; float32 ``[T, E]``; int32 and float32 ``[T, K]`` with ``-1`` = masked).
        scoring, bias, routed_scaling_factor, n_group, topk_group, norm_topk_prob: see `select_topk` (the names
            of `symmring.moe.config.RoutingConfig`; ``topk_method``: the former name of ``scoring``, an alias
            with a DeprecationWarning).
        x_format: ``"fp8_e4m3"`` or ``"bf16"``, how the experts see ``x``.
        sf_group_size: channels per fp8 scale.
        expert_format: `EXPERT_FORMATS`: ``"fp8"`` models the fp8 experts' intermediate roundings.

    Returns:
        `ReferenceResult`.

    Raises:
        ConfigError: any bad argument, named.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> x = rng.standard_normal((4, 128), dtype=np.float32)
        >>> wg, wu = (rng.standard_normal((2, 16, 128), dtype=np.float32) for _ in range(2))
        >>> wd = rng.standard_normal((2, 128, 16), dtype=np.float32)
        >>> reference_moe(x, w_gate=wg, w_up=wu, w_down=wd, num_topk=1,
        ...               logits=np.zeros((4, 2), np.float32)).topk_idx.ravel().tolist()
        [0, 0, 0, 0]
    """
    num_experts, _, hidden = check_expert_weights(w_gate, w_up, w_down)
    if expert_format not in EXPERT_FORMATS:
        raise ConfigError(f"expert_format={expert_format!r}: expected one of {list(EXPERT_FORMATS)}")
    quant._check_x(x)
    if x.shape[1] != hidden:
        raise ConfigError(f"x.shape={x.shape}: expected hidden={hidden} (from the expert weights)")
    idx, weights, logits = route(x, num_topk, num_experts, router_weight=router_weight, logits=logits,
                                 topk_idx=topk_idx, topk_weights=topk_weights, scoring=_scoring(scoring, topk_method),
                                 bias=bias, routed_scaling_factor=routed_scaling_factor, n_group=n_group,
                                 topk_group=topk_group, norm_topk_prob=norm_topk_prob)
    x_q, x_sf = quant.encode(x, x_format, sf_group_size)
    x_deq = quant.decode(x_q, x_sf, x_format)
    num_tokens = x.shape[0]
    expert_out = np.zeros((num_tokens, num_topk, hidden), np.float32)
    for expert in range(num_experts):
        rows, ks = np.nonzero(idx == expert)
        if rows.size == 0:
            continue
        h64 = x_deq[rows].astype(np.float64)
        gate = _matmul_t64(h64, w_gate[expert]).astype(np.float32)
        up = _matmul_t64(h64, w_up[expert]).astype(np.float32)
        if expert_format == "fp8":  # L1 writes bf16; L2 reads the SwiGLU output as 1x128-scaled fp8
            gate, up = quant.from_bf16(quant.to_bf16(gate)), quant.from_bf16(quant.to_bf16(up))
            act64 = quant.decode(*quant.encode(swiglu(gate, up), "fp8_e4m3", sf_group_size),
                                 "fp8_e4m3").astype(np.float64)
        else:
            act64 = swiglu(gate, up).astype(np.float64)
        expert_out[rows, ks] = _matmul_t64(act64, w_down[expert]).astype(np.float32)
    y = combine_rows(expert_out, idx, weights)
    return ReferenceResult(y=y, topk_idx=idx, topk_weights=weights, x_q=x_q, x_sf=x_sf, x_deq=x_deq,
                           logits=logits, expert_out=expert_out)
