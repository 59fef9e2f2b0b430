"""This rank's expert weights for the GPU layer: bf16, or fp8 e4m3 with 128x128 block scales.

Two ways in (`expert_weights`):

* bf16 ``w_gate``/``w_up`` ``[E, inter, hidden]`` and ``w_down`` ``[E, hidden, inter]`` (``nn.Linear``
  layout, Mixtral's ``w1``/``w3``/``w2``), kept as bf16 (``expert_dtype="bf16"``) or quantised once, on the
  GPU, to fp8 with one float32 scale per 128x128 block (``expert_dtype="fp8"``);
* fp8 e4m3 weights in the checkpoint layout of DeepSeek-V3 and Qwen3-FP8: the same shapes, plus scales
  ``[E, ceil(inter / 128), ceil(hidden / 128)]`` (``[E, ceil(hidden / 128), ceil(inter / 128)]`` for down),
  each the dequantisation multiplier of its block (the checkpoints' ``weight_scale_inv``). Kept as they are
  (fp8 experts), or dequantised to bf16 for ``expert_dtype="bf16"``.

Block quantisation (`quantize_blocks`), bitwise the CPU rule of
`symmring.moe.fp8_reference.quantize_weight_blocks`: per block ``scale = amax / 448`` in float32 (1.0 for
an all-zero block), ``q = e4m3fn(clip(w / scale, -448, 448))``, round to nearest even.

L1 runs gate and up as one grouped GEMM: `ExpertWeights.w13` is ``[E, 2 * inter, hidden]`` (gate rows, then
up rows) and, for fp8, its scales are the two scale tensors stacked the same way, which needs
``inter % 128 == 0`` (a block must not straddle gate and up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

#: Side of a weight scale block, and the K block of the fp8 GEMMs.
BLOCK = 128
FP8_E4M3_MAX = 448.0
#: Values of ``expert_dtype``.
EXPERT_DTYPES = ("bf16", "fp8")


def _torch():
    import torch
    return torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)



def shape_dim(tensor: str, axis: int) -> property:
    """A read-only int property: dimension ``axis`` of the tensor attribute named ``tensor``."""
    return property(lambda self: int(getattr(self, tensor).shape[axis]),
                    doc=f"``{tensor}.shape[{axis}]``")

@dataclass
class ExpertWeights:
    """This rank's experts as one engine consumes them.

    Attributes:
        dtype: ``"bf16"`` or ``"fp8"``.
        w13: ``[E, 2 * inter, hidden]`` (gate rows, then up rows); w_down: ``[E, hidden, inter]``.
        w13_scale, w_down_scale: float32 block scales ``[E, 2 * inter / 128, hidden / 128]`` and
            ``[E, hidden / 128, inter / 128]`` (fp8), or None (bf16).
    """

    dtype: str
    w13: object
    w_down: object
    w13_scale: Optional[object] = None
    w_down_scale: Optional[object] = None

    num_local_experts = shape_dim("w13", 0)
    inter = shape_dim("w_down", 2)
    hidden = shape_dim("w_down", 1)

    @property
    def nbytes(self) -> int:
        """Device bytes of the weights and their scales."""
        return sum(t.numel() * t.element_size() for t in (self.w13, self.w_down, self.w13_scale, self.w_down_scale)
                   if t is not None)


def quantize_blocks(w):
    """fp8 e4m3 ``q`` and float32 ``scale [G, N / 128, K / 128]`` of ``w [G, N, K]`` (any float dtype, on any
    device; ``N`` and ``K`` multiples of 128): the module's block rule, one group at a time (bounded memory).

    Example:
        >>> import torch
        >>> q, scale = quantize_blocks(torch.randn(2, 256, 128))
        >>> q.dtype, tuple(scale.shape)
        (torch.float8_e4m3fn, (2, 2, 1))
    """
    torch = _torch()
    G, N, K = (int(s) for s in w.shape)
    if N % BLOCK or K % BLOCK:
        raise ConfigError(f"w.shape={tuple(w.shape)}: expected the last two sizes to be multiples of {BLOCK}")
    q = torch.empty((G, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((G, N // BLOCK, K // BLOCK), dtype=torch.float32, device=w.device)
    for g in range(G):
        blocks = w[g].float().reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3))
        # Divide by a tensor: CUDA torch turns division by a Python number into a multiply by its
        # reciprocal, which is not the IEEE quotient NumPy (and the layout kernel) computes.
        s = amax / torch.full_like(amax, FP8_E4M3_MAX)
        s = torch.where(s == 0, torch.ones_like(s), s)  # all-zero block: scale 1 (exact zeros, no 0/0)
        # amax / (amax / 448) can round just above 448; clip first (e4m3fn has no inf).
        scaled = (blocks / s[:, None, :, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        q[g] = scaled.reshape(N, K).to(torch.float8_e4m3fn)
        scale[g] = s
    return q, scale


def dequantize_blocks(q, scale, dtype=None, out=None):
    """``float32(q) * scale`` of each block, as ``dtype`` (default bf16), one group at a time; into ``out`` (a
    ``[G, N, K]`` tensor or view, e.g. a slice of a larger one: no second copy of the weights) when given."""
    torch = _torch()
    dtype = torch.bfloat16 if dtype is None else dtype
    G, N, K = (int(s) for s in q.shape)
    out = torch.empty((G, N, K), dtype=dtype, device=q.device) if out is None else out
    for g in range(G):
        full = scale[g].repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
        out[g] = (q[g].float() * full).to(dtype)
    return out


def check_tensor(name: str, t, dtypes, shape, device) -> None:
    """Raise ConfigError unless ``t`` is a torch tensor on ``device`` of one of ``dtypes`` (a dtype, a tuple of
    them, or None: any) and of ``shape``, naming ``name``."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if t.device != device:
        raise ConfigError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if dtypes is not None:
        dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        if t.dtype not in dtypes:
            raise ConfigError(f"{name}.dtype={t.dtype}: expected {' or '.join(str(d) for d in dtypes)}")
    if tuple(t.shape) != tuple(shape):
        raise ConfigError(f"{name}.shape={tuple(t.shape)}: expected {tuple(shape)}")


def expert_weights(w_gate, w_up, w_down, *, num_local_experts: int, hidden: int, inter: int, device,
                   expert_dtype: Optional[str] = None, w_gate_scale=None, w_up_scale=None,
                   w_down_scale=None) -> ExpertWeights:
    """Validate this rank's expert weights and bring them into the form the experts run (module docstring).

    Args:
        w_gate, w_up, w_down: bf16, or fp8 e4m3 (``torch.float8_e4m3fn``) with the three scales.
        num_local_experts, hidden, inter: the expected shapes; device: where every tensor must be.
        expert_dtype: ``"bf16"``, ``"fp8"``, or None: the weights' own format.
        w_gate_scale, w_up_scale, w_down_scale: float32 block scales of fp8 weights (dequantisation
            multipliers, ``weight_scale_inv``), else None.

    Returns:
        An `ExpertWeights` (new device tensors; the inputs are not kept).

    Raises:
        ConfigError: a bad dtype, shape, device or combination, naming the argument and what was expected.
    """
    torch = _torch()
    E, H, I = num_local_experts, hidden, inter
    fp8_in = isinstance(w_gate, torch.Tensor) and w_gate.dtype == torch.float8_e4m3fn
    dtype = torch.float8_e4m3fn if fp8_in else torch.bfloat16
    for name, w, shape in (("w_gate", w_gate, (E, I, H)), ("w_up", w_up, (E, I, H)), ("w_down", w_down, (E, H, I))):
        check_tensor(name, w, (dtype,) if name != "w_gate" else (torch.bfloat16, torch.float8_e4m3fn), shape, device)
    scales = {"w_gate_scale": w_gate_scale, "w_up_scale": w_up_scale, "w_down_scale": w_down_scale}
    if fp8_in:
        for name, s, shape in (("w_gate_scale", w_gate_scale, (E, _ceil_div(I, BLOCK), _ceil_div(H, BLOCK))),
                               ("w_up_scale", w_up_scale, (E, _ceil_div(I, BLOCK), _ceil_div(H, BLOCK))),
                               ("w_down_scale", w_down_scale, (E, _ceil_div(H, BLOCK), _ceil_div(I, BLOCK)))):
            if s is None:
                raise ConfigError(f"{name}=None: fp8 e4m3 weights need their float32 block scales {shape} "
                                  "(the checkpoint's weight_scale_inv)")
            check_tensor(name, s, torch.float32, shape, device)
    else:
        given = [n for n, s in scales.items() if s is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: scales belong to fp8 e4m3 weights; the weights are bf16")
    if expert_dtype is None:
        expert_dtype = "fp8" if fp8_in else "bf16"
    if expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"expert_dtype={expert_dtype!r}: expected one of {list(EXPERT_DTYPES)} or None")
    if expert_dtype == "fp8" and (H % BLOCK or I % BLOCK):
        raise ConfigError(f"hidden={H}, inter={I}: fp8 experts need both to be multiples of {BLOCK} (128x128 "
                          "weight blocks; gate and up are stacked into one L1 weight)")
    with torch.no_grad():
        if fp8_in and expert_dtype == "fp8":
            return ExpertWeights("fp8", torch.cat([w_gate, w_up], dim=1).contiguous(), w_down.contiguous(),
                                 torch.cat([w_gate_scale, w_up_scale], dim=1).contiguous(), w_down_scale.contiguous())
        if fp8_in:  # bf16 experts from an fp8 checkpoint
            gate, up = dequantize_blocks(w_gate, w_gate_scale), dequantize_blocks(w_up, w_up_scale)
            return ExpertWeights("bf16", torch.cat([gate, up], dim=1).contiguous(),
                                 dequantize_blocks(w_down, w_down_scale))
        if expert_dtype == "bf16":
            return ExpertWeights("bf16", torch.cat([w_gate, w_up], dim=1).contiguous(), w_down.contiguous())
        (q_gate, s_gate), (q_up, s_up) = quantize_blocks(w_gate), quantize_blocks(w_up)
        q_down, s_down = quantize_blocks(w_down)
        return ExpertWeights("fp8", torch.cat([q_gate, q_up], dim=1).contiguous(), q_down,
                             torch.cat([s_gate, s_up], dim=1).contiguous(), s_down)
