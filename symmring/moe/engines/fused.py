"""The ``"fused"`` engine: the experts of a pass in one persistent kernel of the project's own device code
(``device/moe/fused_experts.cu``, compiled by `symmring.jit`): L1 (gate and up), SwiGLU and the 1x128 fp8
quantisation of its output on chip, L2 to bf16 rows, over a work list that a fixed grid (the SM budget) takes
by tickets. The design, the roofline per shape and the SM budget rule: docs/FUSED.md.

Two kernel families compute the same work list with the same epilogues: ``mma.sync`` with 16 or 32 rows per
item (``moe_fused_experts_m16``/``_m32``, ``device/moe/fused_experts.cu``, sm_89+) and Hopper ``wgmma`` with 64
or 128 (compiled for sm_90a, cc 9.0 only): ``wg64t`` (``device/moe/fused_experts_tma.cu``), a TMA producer warpgroup
feeding two wgmma warpgroups; ``wg128t``, the same with 128-row items; ``wg64``
(``device/moe/fused_experts_wgmma.cu``), wg64t's items with cp.async loads in the math warps (docs/FUSED.md).
`select_kernel` picks wg64t on cc 9.0, m16 or m32 elsewhere (by the window's rows per expert); ``kernel=`` or
``SYMMRING_FUSED_KERNEL`` forces one (tests, benchmarks; wg128t and wg64 are taken only when forced). The wgmma
kernels give the same bits (the ``"builtin"`` engine's too).

It reads the pool the fp8 dispatch writes (rows, their 1x128 scales, ``m_indices``) and the fp8 weights with
128x128 block scales, as the ``"builtin"`` engine does, and writes the output rows into its own tensor: the
workspace's output rows share bytes with the pool (`symmring.moe.workspace_plan.expert_arena`), which a fused
kernel still reads while its first output tiles are written. Its intermediate (fp8 rows and scales) comes
from torch for the same reason. Given ``send=`` (`CombineRows`: the layer, where every owner is mapped) the L2
epilogue writes each live row straight into its owner's combine rows instead (``sends_rows``), and the output
tensor has no rows. The TMA kernels run each expert's items n block by n block over all its m blocks (the span
order, ``device/moe/fused_spans.cuh``), so its weight tiles are read once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ... import env
from ...errors import BackendError, ConfigError
from ..gpu import kernel_args, tensor_map
from ..weights import ExpertWeights
from .seam import CombineRows, ExpertEngine, Pool, Scratch

#: Row alignment of every expert group (the dispatch's, as for the other fp8 engines).
FUSED_ALIGN_M = 128
#: Columns of an item's output tile and K per scale block: the weights' 128x128 blocks.
TILE = 128
#: Rows per item of each mma.sync kernel (``moe_fused_experts_m<rows>``), smallest first; `block_rows` picks one.
BLOCK_ROWS = (16, 32)
#: The kernels by short name (``kernel=``, ``SYMMRING_FUSED_KERNEL``): rows per item.
KERNELS = {"m16": 16, "m32": 32, "wg64": 64, "wg64t": 64, "wg128t": 128}
#: The wgmma kernel with cp.async loads in its math warps: compiled for sm_90a, so it runs on compute capability 9.0
#: only; forced only since wg64t (the same items and bits) measured faster at every size (docs/FUSED.md).
WGMMA_KERNEL, WGMMA_CC = "wg64", 90
#: The warp-specialised TMA kernels (sm_90a too) and the rows of their weights' TMA boxes: wg64t (wg64's items; B
#: boxes of gate, up or output rows, 128 each) and wg128t (128-row items, forced only; boxes of 64).
TMA_KERNELS = {"wg64t": 128, "wg128t": 64}
#: The kernel `select_kernel` picks on cc 9.0 (for every window: its rule says why).
AUTO_WGMMA_KERNEL = "wg64t"
#: The rows of m_indices the fused dispatch's plan writes ahead of its pull (device/moe/args.cuh kPlanRows): the
#: engine's groups start at multiples of it (FUSED_ALIGN_M; tests/test_fused_engine.py holds the two together).
KERNEL_PLAN_ROWS = 64
#: Rows of the TMA boxes of the pool rows and the intermediate (both kernels).
TMA_ROW_BOX = 64
THREADS = 256
#: The TMA kernels' block: a producer warpgroup and two math warpgroups.
TMA_THREADS = 384
#: The mma.sync kernels' shared memory layout (``fused::Shared``): stages (``fused::kStagesOf``, by rows per
#: item) x (A rows + 256 B rows) x 144-byte rows, the per-warp row maxima, two ints.
_STAGES, _ROW_BYTES, _MAX_ROWS_B, _WARPS = {16: 5, 32: 4}, TILE + 16, 2 * TILE, THREADS // 32
#: The wgmma kernel's (``fused::wg::Shared``): stages x (64 A rows + 256 B rows) x 128-byte swizzled rows, the
#: per-warpgroup row maxima, two ints; launched with 1024 bytes more to align the tiles (``kDynamicSharedBytes``).
_WG_STAGES, _WG_ROWS, _WARPGROUPS, _SWIZZLE_ATOM = 4, 64, THREADS // 128, 1024
#: The TMA kernels' (``fused::wg::tma::Shared<Tile>``): wg128t's kept first-pass values (``wg128::Keep``: 32 floats
#: per math thread), 5 stages of A rows (64 or 128) and two B boxes (128 or 64 rows each), a full and an empty
#: 8-byte mbarrier per stage, a full and an empty mbarrier per entry of the 4-entry item queue, two row-maxima
#: mbarriers and one "stored" mbarrier per math warpgroup, the row maxima twice, the queue's entries (six ints
#: each: ticket, expert, m block, n block, first row, expired), three ints padded to the barriers' 8-byte alignment.
_TMA_STAGES, _TMA_QUEUE, _MBARRIER_BYTES, _TMA_INTS_BYTES = 5, 4, 8, 16
#: 64-row blocks whose expert id a TMA kernel keeps in shared memory (fused_experts_tma.cu kTableBlocks), and the
#: 128-row groups they cover, each with its span's first group and count (int16; fused_spans.cuh).
_TMA_TABLE_BLOCKS = 2048
_TMA_TABLE_GROUPS = _TMA_TABLE_BLOCKS // 2
#: The device modules (names in `symmring.jit.ENGINE_MODULES`, which ``python -m symmring.jit`` prebuilds):
#: mma.sync kernels, wgmma kernel, TMA wgmma kernel.
MODULE, WGMMA_MODULE, TMA_MODULE = "moe_fused_experts", "moe_fused_experts_wgmma", "moe_fused_experts_tma"
#: Accepted values of ``kernel=`` / ``SYMMRING_FUSED_KERNEL``.
KERNEL_CHOICES = ("auto",) + tuple(KERNELS)
#: The record's fields of the layer's combine send (`CombineRows`; all zero: the rows go to ``out``).
_SEND_FIELDS = ("row_src", "token_base", "send_peers", "window_begin", "num_ranks", "num_topk", "combine_tokens")
_NO_SEND = dict.fromkeys(_SEND_FIELDS, 0)
#: The argument record's fields a call sets (the pass's buffers and sizes); the engine fixes the others (weights,
#: status, timeout, shape) when made. The TMA record takes the experts' record and its six tensor maps per call.
_PER_CALL = ("pool_x", "pool_sf", "sf_row_stride", "sf_col_stride", "m_indices", "act", "act_sf", "out", "counters",
             "bad_groups", "num_rows", "m_blocks_per_group", "weights_evict_first", "dispatch_plan") + _SEND_FIELDS
_TMA_PER_CALL = ("experts", "pool_x_map", "act_map", "w13_map", "w_down_map", "pool_sf_map", "act_sf_map")
#: A map of no tensor (a pass of no rows launches nothing and encodes nothing).
_NO_MAP = np.zeros((), kernel_args.STRUCTS["TensorMap"])
#: Encoded maps an engine keeps (`FusedExperts._map`): a layer's calls need four, per pass size.
_MAPS_KEPT = 64


def kernel_name(kernel: str) -> str:
    """The device function of ``kernel`` (one of `KERNELS`): ``moe_fused_experts_<kernel>``."""
    return f"moe_fused_experts_{kernel}"


def module_of(kernel: str) -> str:
    """The device module holding ``kernel`` (one of `KERNELS`)."""
    return WGMMA_MODULE if kernel == WGMMA_KERNEL else TMA_MODULE if kernel in TMA_KERNELS else MODULE


def threads(kernel: str) -> int:
    """Threads per block of ``kernel`` (one of `KERNELS`)."""
    return TMA_THREADS if kernel in TMA_KERNELS else THREADS


def shared_bytes(kernel: str) -> int:
    """Dynamic shared memory of ``kernel`` (one of `KERNELS`): ``sizeof(fused::Shared<rows>)`` for the mma.sync
    kernels, ``fused::wg::kDynamicSharedBytes`` for wg64, ``fused::wg::tma::kDynamicSharedBytes<Tile<rows>>`` for
    wg64t and wg128t; a kernel launched with less records -1 in the status instead of computing.

    Example:
        >>> [shared_bytes(k) for k in ("m16", "m32", "wg64", "wg64t", "wg128t")]
        [196360, 166920, 165384, 220744, 213832]
    """
    if kernel == WGMMA_KERNEL:
        return _WG_STAGES * (_WG_ROWS + _MAX_ROWS_B) * TILE + _WARPGROUPS * _WG_ROWS * 4 + 8 + _SWIZZLE_ATOM
    if kernel in TMA_KERNELS:
        rows, b_box = KERNELS[kernel], TMA_KERNELS[kernel]
        keep = 0 if rows == _WG_ROWS else _WARPGROUPS * 32 * 128 * 4  # wg128::Keep: 32 floats per math thread
        # per stage: A, two B boxes, A's activation scales, the B boxes' weight scales, full and empty barriers
        return (keep + _TMA_STAGES * ((rows + 2 * b_box) * TILE + rows * 4 + 2 * 4 + 2 * _MBARRIER_BYTES)
                + (2 * _TMA_QUEUE + 2 + _WARPGROUPS) * _MBARRIER_BYTES + 2 * _WARPGROUPS * _WG_ROWS * 4
                + _TMA_TABLE_BLOCKS * 4 + _TMA_TABLE_GROUPS * 2 * 2 + 6 * _TMA_QUEUE * 4 + _TMA_INTS_BYTES
                + _SWIZZLE_ATOM)
    rows = KERNELS[kernel]
    return _STAGES[rows] * (rows + _MAX_ROWS_B) * _ROW_BYTES + _WARPS * rows * 4 + 8


def _mn_major_empty(rows: int, blocks: int, device):
    """Uninitialised MN-major float32 scales ``[rows, K blocks]``: columns of rows rounded up to 4 (16-byte aligned),
    as `tensor_map.scale_spec` maps them and the kernels' ``act_scale`` indexes them (triton_large.act_scales_empty
    makes the same, but needs Triton)."""
    import torch
    return torch.empty(blocks, -(-rows // 4) * 4, dtype=torch.float32, device=device).t()[:rows]


def _mn_major(scales):
    """An MN-major copy of float32 scales ``[rows, K blocks]`` (`_mn_major_empty`)."""
    copy = _mn_major_empty(*scales.shape, scales.device)
    copy.copy_(scales)
    return copy


def block_rows(rows_per_expert: Optional[int]) -> int:
    """Rows per item for a window whose experts hold at most ``rows_per_expert`` rows each (None: unknown):
    the smallest of `BLOCK_ROWS` that holds them, else the largest.

    Example:
        >>> block_rows(1), block_rows(16), block_rows(17), block_rows(None)
        (16, 16, 32, 32)
    """
    for rows in BLOCK_ROWS:
        if rows_per_expert is not None and rows_per_expert <= rows:
            return rows
    return BLOCK_ROWS[-1]


def check_kernel(kernel: Optional[str]) -> str:
    """``kernel`` (None: ``SYMMRING_FUSED_KERNEL``, unset: ``"auto"``) as one of `KERNEL_CHOICES`.

    Raises:
        ConfigError: another value (naming the argument or the variable).
    """
    source = "kernel"
    if kernel is None:
        kernel, source = env.fused_kernel(), "SYMMRING_FUSED_KERNEL"
    if kernel not in KERNEL_CHOICES:
        raise ConfigError(f"{source}={kernel!r}: expected one of {list(KERNEL_CHOICES)} (the fused engine's "
                          f"kernel; auto: wg64t on cc 9.0, else m16 or m32 by rows per expert)")
    return kernel


def select_kernel(rows_per_expert: Optional[int], cc: int, kernel: str = "auto") -> str:
    """The kernel (one of `KERNELS`) for a window whose experts hold at most ``rows_per_expert`` rows each (None:
    unknown) on a device of compute capability ``cc`` (90 for H100/H200); ``kernel`` other than ``"auto"`` is
    taken as it is.

    The rule: ``wg64t`` on cc 9.0 for every window, else `block_rows`'s mma.sync kernel. Measured side by side
    on an H100 (docs/FUSED.md "Measured: wg64t and wg128t"), wg64t is faster than m16/m32 where they were the
    pick (up to 32 rows per expert: 1.07-1.22x at 1-512 tokens of the DeepSeek-V3- and V4-Flash-like shapes,
    1.13x at 64-512 tokens of the Qwen3-like) and than wg64 above; the exceptions are the Qwen3-like at 1 and 8
    tokens, where m16 is 1.16x and 1.29x faster (force ``"m16"`` there). Off cc 9.0, up to 32 rows the step
    reads the weights once per m block and 16-row items waste the least tensor work on padding rows.

    Raises:
        BackendError: ``kernel="wg64"``, ``"wg64t"`` or ``"wg128t"`` on a device other than cc 9.0 (their cubins
            are sm_90a).

    Example:
        >>> select_kernel(1, 90), select_kernel(33, 90), select_kernel(None, 90)
        ('wg64t', 'wg64t', 'wg64t')
        >>> select_kernel(16, 89), select_kernel(200, 89), select_kernel(200, 100), select_kernel(200, 90, "m32")
        ('m16', 'm32', 'm32', 'm32')
    """
    if (kernel == WGMMA_KERNEL or kernel in TMA_KERNELS) and cc != WGMMA_CC:
        raise BackendError(f"engine 'fused': kernel {kernel!r} uses wgmma (sm_90a), device is sm_{cc}; use 'm16', "
                           f"'m32' or 'auto'")
    if kernel != "auto":
        return kernel
    if cc == WGMMA_CC:
        return AUTO_WGMMA_KERNEL
    return f"m{block_rows(rows_per_expert)}"


def blocks_per_group(rows_per_expert: Optional[int], rows: int) -> int:
    """m blocks of ``rows`` rows listed per 128-row pool group: those that can hold rows when no local expert
    holds more than ``rows_per_expert`` (None: unknown, all of them). An expert's rows start its group, so the
    rest of the group is padding, and a ticket for it costs a block a draw and a read for nothing (at 64 tokens
    of a DeepSeek-V3-like layer, 7 of every 8 tickets at 16 rows each).

    Example:
        >>> blocks_per_group(1, 16), blocks_per_group(64, 32), blocks_per_group(300, 32), blocks_per_group(None, 16)
        (1, 2, 4, 8)
    """
    if rows_per_expert is None:
        return FUSED_ALIGN_M // rows
    return max(1, -(-min(rows_per_expert, FUSED_ALIGN_M) // rows))


def read_once(rows_per_expert: Optional[int], rows: int) -> bool:
    """Whether every weight tile of a window is read by one item only: no local expert holds more than one m block of
    ``rows`` rows (``rows_per_expert``: the host's bound; None: unknown). The TMA kernels then copy the weights with
    an L2 evict-first hint (``FusedExpertsArgs::weights_evict_first``), so their stream keeps out of L2 what the
    kernels around this one read next (the ring's slots, the pool, their code: the decode chain's fixed costs).

    Example:
        >>> read_once(8, 64), read_once(64, 64), read_once(65, 64), read_once(None, 64)
        (True, True, False, False)
    """
    return rows_per_expert is not None and rows_per_expert <= rows


def work_items(num_rows: int, rows: int, hidden: int, inter: int, per_group: int,
               l2_pairs: bool = False) -> Tuple[int, int]:
    """``(m blocks, items)`` of a pass of ``num_rows`` pool rows at ``rows`` rows per item and ``per_group``
    m blocks per 128-row group (`blocks_per_group`): each m block has ``inter / 128`` L1 items and
    ``hidden / 128`` L2 items, or half as many where ``l2_pairs`` (wg64t) and ``hidden / 128`` is even: L2 items
    of two output blocks (the kernel's ``work_of`` and ``with_l2_pairs``).

    Example:
        >>> work_items(200, 16, 7168, 2048, 8)   # two groups of 8 m blocks, 16 + 56 items each
        (16, 1152)
        >>> work_items(200, 16, 7168, 2048, 1)   # experts of at most 16 rows: one m block per group
        (2, 144)
        >>> work_items(200, 64, 7168, 2048, 2, l2_pairs=True)   # wg64t: 16 + 28 items per m block
        (4, 176)
    """
    m_blocks = -(-num_rows // FUSED_ALIGN_M) * per_group
    n2 = hidden // TILE
    return m_blocks, m_blocks * (inter // TILE + (n2 // 2 if l2_pairs and n2 % 2 == 0 else n2))


def check_weights(weights: ExpertWeights) -> None:
    """The shapes the fused kernel computes, before any GPU work.

    Raises:
        ConfigError: bf16 weights, ``hidden`` or ``inter`` not a positive multiple of 128, a weight or scale
            tensor of another shape or not contiguous.
    """
    if weights.dtype != "fp8":
        raise ConfigError(f"engine 'fused': expected fp8 expert weights, got {weights.dtype} (use engine='torch')")
    E, hidden, inter = weights.num_local_experts, weights.hidden, weights.inter
    for name, size in (("hidden", hidden), ("inter", inter)):
        if size <= 0 or size % TILE:
            raise ConfigError(f"engine 'fused': {name}={size}: expected a positive multiple of {TILE} (one item "
                              f"covers 128 columns of a 128x128 weight block)")
    expected = {"w13": (E, 2 * inter, hidden), "w_down": (E, hidden, inter),
                "w13_scale": (E, 2 * inter // TILE, hidden // TILE), "w_down_scale": (E, hidden // TILE, inter // TILE)}
    for name, shape in expected.items():
        t = getattr(weights, name)
        if t is None or tuple(t.shape) != shape or not t.is_contiguous():
            raise ConfigError(f"engine 'fused': weights.{name}: expected a contiguous tensor {list(shape)}, got "
                              f"{None if t is None else (list(t.shape), 'contiguous' if t.is_contiguous() else 'strided')}")


def check_pool(pool: Pool, num_rows: int, hidden: int) -> None:
    """The pool as the kernel reads it (rows of ``hidden`` contiguous bytes, scales with any strides,
    contiguous ``m_indices``), before the launch.

    Raises:
        ConfigError: which tensor, and what was expected.
    """
    x, sf, m = pool.x, pool.x_sf, pool.m_indices
    if sf is None or m is None:
        raise ConfigError("engine 'fused': expected an fp8 pool with x_sf and m_indices (the fp8 dispatch's)")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or not 0 <= num_rows <= x.shape[0]:
        raise ConfigError(f"num_rows={num_rows!r}: expected an int in [0, {x.shape[0]}] (the pool's rows)")
    if x.element_size() != 1 or x.dim() != 2 or x.shape[1] != hidden or x.stride() != (hidden, 1):
        raise ConfigError(f"pool.x: expected contiguous fp8 rows [capacity, {hidden}], got {x.dtype} "
                          f"{list(x.shape)} strides {x.stride()}")
    if tuple(sf.shape[1:]) != (hidden // TILE,) or sf.shape[0] < num_rows:
        raise ConfigError(f"pool.x_sf: expected [>= {num_rows}, {hidden // TILE}] float32, got {list(sf.shape)}")
    if m.dim() != 1 or m.shape[0] < num_rows or (m.shape[0] > 1 and m.stride(0) != 1):
        raise ConfigError(f"pool.m_indices: expected contiguous int32 [>= {num_rows}], got {list(m.shape)}")


@dataclass
class Launch:
    """One launch of the fused kernel: which kernel, the grid, its shared memory, the argument record, and
    the tensors it writes (kept alive until the launch is enqueued)."""

    kernel: str
    grid: int
    shared_bytes: int
    args: tuple
    out: object
    act: object
    act_sf: object
    counters: object
    pool_sf: object = None  # a TMA kernel's MN-major copy of the pool's scales, where the pool's were not
    plan: int = 0  # beside the fused dispatch: the address of its plan words (DispatchFusedArgs::plan); else 0


def _send_fields(send: CombineRows) -> dict:
    """The record's fields of the layer's combine send ``send`` (`CombineRows`)."""
    if not isinstance(send, CombineRows):
        raise ConfigError(f"send={send!r}: expected a CombineRows or None")
    return dict(row_src=send.row_src, token_base=send.token_base, send_peers=send.peers,
                window_begin=send.window_begin, num_ranks=send.num_ranks, num_topk=send.num_topk,
                combine_tokens=send.combine_tokens)


@functools.lru_cache(maxsize=None)
def _module(device_index: int, cc: int, name: str):
    """The compiled kernels of one source (`module_of`), loaded into CuPy once per device (no NVSHMEM: the
    kernels call none): ``(module, {kernel: function})``."""
    import cupy
    from ... import jit
    path = jit.compile_cubin(jit.read_source(jit.ENGINE_MODULES[name]), name=name, cc=cc)
    with cupy.cuda.Device(device_index):
        module = cupy.cuda.function.Module()
        module.load_file(str(path))
        attribute = getattr(cupy.cuda.driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
        kernels = {}
        for kernel in KERNELS:
            if module_of(kernel) == name:
                fn = kernels[kernel] = module.get_function(kernel_name(kernel))
                cupy.cuda.driver.funcSetAttribute(fn.ptr, attribute, shared_bytes(kernel))
    return module, kernels


def _function(device_index: int, cc: int, kernel: str):
    """The loaded CuPy function of ``kernel`` (one of `KERNELS`) on a device of compute capability ``cc``."""
    return _module(device_index, cc, module_of(kernel))[1][kernel]


@functools.lru_cache(maxsize=None)
def _device(device_index: int) -> Tuple[int, int]:
    """``(compute capability as 90, SMs)`` of a CUDA device."""
    import torch
    props = torch.cuda.get_device_properties(device_index)
    return props.major * 10 + props.minor, props.multi_processor_count


class FusedExperts(ExpertEngine):
    """fp8 experts in one persistent kernel per pass (module docstring; docs/FUSED.md).

    Args:
        weights: fp8 `ExpertWeights` (128x128 block scales), ``hidden`` and ``inter`` multiples of 128.
        sm_budget: the kernel's grid, at most one block per SM (None: every SM of the weights' device; the
            streamed schedule's producers then share them by time, docs/FUSED.md "SM budget").
        timeout_s: the bound of an L2 item's wait for its L1 items (None: ``SYMMRING_TIMEOUT_S``).
        kernel: ``"auto"`` (`select_kernel` per call), or ``"m16"``, ``"m32"``, ``"wg64"``, ``"wg64t"``,
            ``"wg128t"`` for every call (None: ``SYMMRING_FUSED_KERNEL``, unset ``"auto"``).

    Raises:
        ConfigError: bad weights (`check_weights`), ``sm_budget`` or ``kernel``.
        BackendError: ``"wg64t"`` or ``"wg128t"`` without the CUDA driver's tensor map encoder (`tensor_map.Encoder`;
            under ``"auto"``, at the first call that takes wg64t).

    Example:
        >>> engine = FusedExperts(expert_weights(w_gate, w_up, w_down, ..., expert_dtype="fp8"))  # doctest: +SKIP
        >>> out = engine.forward(pool, num_rows, rows_per_expert)                                 # doctest: +SKIP
        >>> engine.check_status()           # synchronises; raises what the kernel recorded       # doctest: +SKIP
    """

    name = "fused"
    pool_format = "fp8"
    align_m = FUSED_ALIGN_M
    sends_rows = True

    def __init__(self, weights: ExpertWeights, sm_budget: Optional[int] = None, timeout_s: Optional[float] = None,
                 kernel: Optional[str] = None):
        check_weights(weights)
        self.kernel = check_kernel(kernel)
        #: Whether a small-batch call's TMA kernel starts beside the fused dispatch (`begin_beside_dispatch`;
        #: ``SYMMRING_FUSED_BESIDE``, off by default, settable to compare).
        self.beside_dispatch = env.fused_beside()
        if sm_budget is not None and (isinstance(sm_budget, bool) or not isinstance(sm_budget, int) or sm_budget < 1):
            raise ConfigError(f"sm_budget={sm_budget!r}: expected a positive int (blocks of the fused kernel) or None")
        self.weights = weights
        self.hidden, self.inter = weights.hidden, weights.inter
        self.num_local_experts = weights.num_local_experts
        self.timeout_ns = int((env.timeout_s() if timeout_s is None else float(timeout_s)) * 1e9)
        self._sm_budget = sm_budget
        import torch
        #: int32 [2] beside the weights: what the kernel records (`check_status`); made here, never under a capture.
        self.status = torch.zeros(2, dtype=torch.int32, device=weights.w13.device)
        #: The TMA kernels' tensor map encoder (the driver's: resolved now for a forced TMA kernel, at the first call
        #: that takes one under auto) and the weights' maps (encoded on first use).
        self._encode = tensor_map.Encoder() if self.kernel in TMA_KERNELS else None
        self._weight_maps = {}  # by box rows
        self._maps = {}  # the pass's maps by spec (`_map`)
        # The argument records, made once (the weights' fields fixed) and set per call: building a record field by
        # field is most of a launch's host cost, which an eager call's GPU waits for between the dispatch and here.
        w, address = weights, kernel_args.address
        self._experts_args = kernel_args.KernelArgs(
            kernel_args.STRUCTS["FusedExpertsArgs"], per_call=_PER_CALL, w13=address(w.w13),
            w13_sf=address(w.w13_scale), w_down=address(w.w_down), w_down_sf=address(w.w_down_scale),
            status=address(self.status), timeout_ns=self.timeout_ns, hidden=self.hidden, inter=self.inter,
            num_local_experts=self.num_local_experts)
        self._tma_record = kernel_args.KernelArgs(kernel_args.STRUCTS["FusedExpertsTmaArgs"], per_call=_TMA_PER_CALL)

    @property
    def sm_budget(self) -> int:
        """Blocks of the kernel's grid: the given budget, capped by the device's SMs."""
        sms = _device(self.weights.w13.device.index)[1]
        return sms if self._sm_budget is None else min(self._sm_budget, sms)

    def prepare(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int], grid_limit: int, cc: int,
                send: Optional[CombineRows] = None, beside_dispatch: bool = False) -> Launch:
        """Check the pool and fill the launch for a device of compute capability ``cc`` (allocates the output and
        intermediates; no kernel runs): what `forward` enqueues, on any device (the CPU tests check the record).
        With ``send`` the rows go to their owners' combine rows and the launch's ``out`` has no rows.
        ``beside_dispatch`` (a TMA kernel only): the counters hold two words more, the fused dispatch's plan
        (``Launch.plan``), and the kernel reads the pool as the dispatch fills it (`begin_beside_dispatch`).
        The launch's argument bytes are the engine's own record, which the next call sets again: launch (or copy)
        them before preparing another call.

        Raises:
            ConfigError: a pool the kernel cannot read (`check_pool`).
            BackendError: a wgmma kernel (``"wg64"``, ``"wg64t"``, ``"wg128t"``) and ``cc`` is not 90 (`select_kernel`);
                a TMA kernel without the driver's tensor map encoder.
        """
        import torch
        check_pool(pool, num_rows, self.hidden)
        address = kernel_args.address
        kernel = select_kernel(rows_per_expert, cc, self.kernel)
        rows = KERNELS[kernel]
        per_group = blocks_per_group(rows_per_expert, rows)
        m_blocks, items = work_items(num_rows, rows, self.hidden, self.inter, per_group, l2_pairs=kernel == "wg64t")
        dev = pool.x.device
        out = torch.empty(0 if send else num_rows, self.hidden, dtype=torch.bfloat16, device=dev)
        act = torch.empty(num_rows, self.inter, dtype=torch.uint8, device=dev)
        act_sf = _mn_major_empty(num_rows, self.inter // TILE, dev)  # [num_rows, inter / 128], MN-major
        if beside_dispatch and kernel not in TMA_KERNELS:
            raise ConfigError(f"engine 'fused': kernel {kernel!r} cannot start beside the dispatch (TMA kernels: "
                              f"{sorted(TMA_KERNELS)})")
        # ticket, arrivals (and beside the dispatch its plan words): fresh per call
        counters = torch.zeros(1 + m_blocks + (2 if beside_dispatch else 0), dtype=torch.int32, device=dev)
        plan = address(counters) + 4 * (1 + m_blocks) if beside_dispatch else 0
        experts = self._experts_args
        args = experts.set(pool_x=address(pool.x), pool_sf=address(pool.x_sf), sf_row_stride=pool.x_sf.stride(0),
                           sf_col_stride=pool.x_sf.stride(1), m_indices=address(pool.m_indices), act=address(act),
                           act_sf=address(act_sf), out=address(out), counters=address(counters),
                           bad_groups=address(pool.bad_groups), num_rows=num_rows, m_blocks_per_group=per_group,
                           weights_evict_first=int(read_once(rows_per_expert, rows)), dispatch_plan=plan,
                           **(_NO_SEND if send is None else _send_fields(send)))
        pool_sf = None
        if kernel in TMA_KERNELS:
            args, pool_sf = self._tma_args(experts.record, pool, num_rows, act, act_sf, TMA_KERNELS[kernel])
        return Launch(kernel, max(1, min(grid_limit, items)), shared_bytes(kernel), args, out, act, act_sf, counters,
                      pool_sf, plan)

    def _tma_args(self, experts: np.ndarray, pool: Pool, num_rows: int, act, act_sf, weight_box: int):
        """A TMA kernel's record and the pool scales it reads: the experts' record ``experts`` and the six tensor maps:
        the pass's pool rows and intermediate (tensor_map.tile_spec, 64-row boxes; rows past ``num_rows`` arrive as
        zeros), the weights as 2D views (boxes of ``weight_box`` rows, encoded once per box size), the pool's and the
        intermediate's activation scales (tensor_map.scale_spec, 64 rows of one K block; a pool whose scales are not
        MN-major, unlike the layer's, gets an MN-major copy). A pass of no rows launches nothing: its maps stay zero,
        and no encoder is needed for it."""
        maps = [_NO_MAP] * 6  # pool rows, intermediate, w13, w_down, their scales
        pool_sf = None
        if num_rows:
            if self._encode is None:
                self._encode = tensor_map.Encoder()
            encode, w = self._encode, self.weights
            if weight_box not in self._weight_maps:
                self._weight_maps[weight_box] = tuple(
                    encode(tensor_map.tile_spec(name, tensor_map.weight_view(t), weight_box))
                    for name, t in (("weights.w13", w.w13), ("weights.w_down", w.w_down)))
            maps[0] = self._map(tensor_map.tile_spec("pool.x", pool.x, TMA_ROW_BOX, num_rows))
            maps[1] = self._map(tensor_map.tile_spec("intermediate", act, TMA_ROW_BOX, num_rows))
            maps[2], maps[3] = self._weight_maps[weight_box]
            pool_sf = pool.x_sf[:num_rows]
            if not tensor_map.is_mn_major(pool_sf):
                pool_sf = _mn_major(pool_sf)
            maps[4] = self._map(tensor_map.scale_spec("pool.x_sf", pool_sf, TMA_ROW_BOX, num_rows))
            maps[5] = self._map(tensor_map.scale_spec("intermediate scales", act_sf, TMA_ROW_BOX, num_rows))
        args = self._tma_record.set(experts=experts, pool_x_map=maps[0], act_map=maps[1], w13_map=maps[2],
                                    w_down_map=maps[3], pool_sf_map=maps[4], act_sf_map=maps[5])
        return args, pool_sf

    def _map(self, spec: tensor_map.TileSpec) -> np.ndarray:
        """The encoded map of ``spec``, from the engine's cache: a map is a function of its spec alone (address,
        shape, box), and a layer's calls repeat theirs (the workspace's pool; the caching allocator gives the
        intermediate the same address again). At most `_MAPS_KEPT` kept: the cache starts over when full."""
        record = self._maps.get(spec)
        if record is None:
            if len(self._maps) >= _MAPS_KEPT:
                self._maps.clear()
            record = self._maps[spec] = self._encode(spec)
        return record

    def forward(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int] = None, out=None,
                scratch: Optional[Scratch] = None, send: Optional[CombineRows] = None):
        # ``out`` and ``scratch`` are the workspace's rows, which share bytes with the pool this kernel is still
        # reading while it writes (module docstring): the output comes back in the engine's own tensor.
        import torch
        dev = pool.x.device
        cc = _device(dev.index)[0]
        launch = self.prepare(pool, num_rows, rows_per_expert, self.sm_budget, cc, send)
        if num_rows == 0:
            return launch.out
        if cc < 89:
            raise BackendError(f"engine 'fused': needs fp8 tensor cores (sm_89 or newer), device {dev} is sm_{cc}")
        stream = _cupy_stream(torch.cuda.current_stream(dev).cuda_stream)
        _function(dev.index, cc, launch.kernel)((launch.grid,), (threads(launch.kernel),), launch.args,
                                               shared_mem=launch.shared_bytes, stream=stream)
        return launch.out

    def begin_beside_dispatch(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int] = None):
        """`ExpertEngine.begin_beside_dispatch`: where the call takes a TMA kernel (``wg64t``, ``wg128t``: cc 9.0)
        and ``beside_dispatch`` is on (``SYMMRING_FUSED_BESIDE=1``), its launch with the dispatch's plan words in
        its counters (zeroed now, on the current stream); else None. The kernel then waits for the plan before it
        reads ``m_indices``, streams the first weights of its first L1 item while the dispatch's blocks write the
        rows, and waits for the dispatch's end at its own (device/moe/fused_experts_tma.cu)."""
        dev = pool.x.device
        cc = _device(dev.index)[0]
        if not self.beside_dispatch or num_rows == 0 or cc != 90:
            return None
        if select_kernel(rows_per_expert, cc, self.kernel) not in TMA_KERNELS:
            return None
        if not tensor_map.is_mn_major(pool.x_sf[:num_rows]):  # its copy (`_tma_args`) would precede the dispatch
            return None
        return _BesideDispatch(self.prepare(pool, num_rows, rows_per_expert, self.sm_budget, cc, beside_dispatch=True),
                               dev, cc)

    def check_status(self) -> None:
        """Synchronise and raise what the kernel recorded since the last check (then cleared).

        Raises:
            BackendError: L2 tiles whose wait for their L1 items expired (written NaN), a launch whose shared
                memory was smaller than the kernel's layout, the wgmma kernel run from a cubin not built for
                sm_90a, a wait of a TMA kernel's pipeline expired (a fault of the kernel; the tiles it left are NaN),
                or beside the fused dispatch its wait for the dispatch's plan or rows expired.
        """
        timed_out, first = (int(v) for v in self.status.tolist())
        self.status.zero_()
        if timed_out == -2:
            raise BackendError("engine 'fused': the wgmma kernel ran from a cubin not built for sm_90a (it "
                               "computed nothing; symmring.jit builds it for sm_90a on cc 9.0 only)")
        if timed_out == -3:
            raise BackendError("engine 'fused': a wait of a TMA kernel's pipeline (its ring or item queue) expired (the "
                               "kernel's own copies or math warps never came: a fault of the kernel; the tiles it "
                               "could not compute are NaN); use kernel 'wg64'")
        if timed_out == -4:
            raise BackendError("engine 'fused': beside the fused dispatch, the kernel's wait for the dispatch's plan or "
                               "its rows expired (the dispatch never published them: a fault of the dispatch; the "
                               "kernel computed nothing or NaN); SYMMRING_FUSED_BESIDE=0 runs it after the dispatch")
        if timed_out < 0:
            raise BackendError("engine 'fused': launched with less shared memory than the kernel needs "
                               "(fused.shared_bytes disagrees with device/moe/fused_experts*.cu)")
        if timed_out:
            raise BackendError(f"engine 'fused': {timed_out} L2 tile(s) waited past {self.timeout_ns / 1e9:g} s for "
                               f"their L1 items (first m block {first}); their rows are NaN")


class _BesideDispatch:
    """A fused call prepared to start beside the fused dispatch (`FusedExperts.begin_beside_dispatch`)."""

    def __init__(self, launch: Launch, device, cc: int):
        self.plan = launch.plan
        self._launch, self._device, self._cc = launch, device, cc

    def launch(self, launcher, stream):
        """Enqueue the kernel on ``stream`` (a CuPy stream) with ``launcher`` (`symmring.pdl.PdlLauncher`): with
        PDL right after the dispatch; returns the output (as `FusedExperts.forward`)."""
        launch = self._launch
        launcher(_function(self._device.index, self._cc, launch.kernel), (launch.grid,), (threads(launch.kernel),),
                 launch.args, stream=stream, shared_mem=launch.shared_bytes)
        return launch.out


@functools.lru_cache(maxsize=None)
def _cupy_stream(handle: int):
    """CuPy's view of a torch stream (one object per handle, as `symmring.moe.gpu.executor.Executor.stream`)."""
    import warnings
    import cupy
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle)
