"""Triton fp8 expert engines of the MoE layer: the block-scaled grouped GEMM and the fused SwiGLU + quantise.

Formats (DeepSeek-V3 / DeepGEMM; `symmring.moe.fp8_reference` restates them and is the CPU yardstick):

* activations ``a`` float8_e4m3fn ``[M, K]``, ``K % 128 == 0``, with float32 scales ``a_sf [M, K // 128]``
  (any strides: the producer's row-major ``[M, K // 128]`` and DeepGEMM's MN-major layout both work);
* weights ``b`` float8_e4m3fn ``[G, N, K]`` (nn.Linear layout) with float32 block scales
  ``b_sf [G, ceil(N / 128), K // 128]`` (``weight_scale_inv`` of the checkpoints);
* the pool in the contiguous layout: rows of one group contiguous, every group starting at a multiple of
  `ALIGN_M` = 128 rows, ``m_indices int32 [M]`` the group of each row, ``-1`` for padding rows. ``M`` is a
  host-side upper bound; blocks that start with a padding row cost one 4-byte load and exit.

`grouped_gemm_fp8` computes ``out[r, n] = sum_kb (a[r, kb] . b[g, n, kb]) * a_sf[r, kb] * b_sf[g, n // 128, kb]``
(``g = m_indices[r]``) in bf16. `swiglu_quant_fp8` turns L1's output ``h = [gate | up]`` into L2's fp8 input.

Numerics
    GEMM. For each 128-wide K block the tensor cores form the dot product of 128 e4m3 pairs. The products
    are exact; Hopper's fp8 MMA adds them with a reduced-precision accumulator (about 14 bits, per the
    DeepSeek-V3 report: the reason DeepGEMM "promotes" every 128 K), which is the only inexact step inside a K
    block. The block's result is then multiplied by ``a_sf[r, kb] * b_sf[g, n // 128, kb]`` (that product
    rounded to float32 first, as DeepGEMM does) and added to a float32 accumulator with one fused multiply-add,
    K blocks in increasing order. The accumulator is rounded once to bf16 (nearest even) at the end, so against
    the float64 definition the error is dominated by that rounding (at most 2^-9 relative per element, the same
    as rounding the float64 result itself); float32 accumulation and the in-block MMA precision add far less.
    Rows are independent: a row's result never depends on other rows' data, so padding rows holding garbage
    (even NaN) only spoil their own, never-read, output rows. Output rows of blocks that start with a padding
    row are not written; padding rows inside a group's last block are computed from whatever the pool holds
    there.

    SwiGLU + quantise (one kernel). ``act = silu(g) * u`` in float32 from the bf16 values with
    ``silu(g) = g / (1 + exp(-g))``: ``exp`` is CUDA's accurate ``expf`` (libdevice ``__nv_expf``, what
    torch's float32 ``exp`` compiles to; Triton links it flush-to-zero, which changes nothing here since
    ``1 + exp(-g)`` rounds to 1 wherever ``exp(-g)`` is subnormal; NumPy's float32 ``exp`` under the Triton
    interpreter), the division is IEEE (``div_rn``; Triton's ``/`` is the approximate ``div.full.f32``),
    and fused multiply-add contraction is disabled for this kernel, so every step is one float32 rounding
    in the formula's order, as torch's or NumPy's elementwise ops do it. The quantisation is exactly the rule of
    `symmring.moe.quant.quantize_fp8` and of ``device/moe/producer.cu`` (``moe_produce_layout_fp8``): per row
    and 128 columns ``scale = amax / 448`` (IEEE division; 1.0 when 0), ``q = e4m3fn(clip(act / scale,
    -448, 448))`` with round-to-nearest-even (the hardware ``cvt.rn.satfinite.e4m3x2.f32``). Given the same
    float32 ``act``, ``(q, q_sf)`` are bitwise those of ``quantize_fp8``; ``act`` itself equals a float32
    evaluation of the same formula as long as both sides' ``expf`` agree (CUDA's ``expf`` and NumPy's are
    both within ~1 ulp, not necessarily the same ulp).

Performance design (Hopper, sm_90)
    One program per (BLOCK_M x BLOCK_N) output tile, BLOCK_K = 128 = the scale block, a plain grid (the
    hardware scheduler balances tiles; padding tiles exit after one load, which a persistent grid would
    have to skip itself). Per K block: A ``[BLOCK_M, 128]`` and B ``[128 rows of N, 128]`` tiles arrive
    by TMA (host-side tensor descriptors; B is read as ``[N, K]`` K-major tiles and fed to ``tl.dot``
    transposed, which is the K-major operand fp8 wgmma needs, no data movement), the per-row activation
    scales and the weight block scale by cp.async, all software-pipelined over ``num_stages`` K blocks
    (``tl.range(num_stages=...)``, so the scale loads are pipelined too). The scale multiply per K block
    forces every block's MMA result out of the accumulator (``acc += dot(a, b) * s`` instead of
    ``dot(a, b, acc)``): the wgmma writes a fresh block result (zero-initialised by the instruction
    itself), waits, and the promotion is one FMA per element with a per-row scalar ``a_sf[r] * b_sf``
    (a 128-wide N slice has one weight scale). So a thread holds two register sets, accumulator and block
    result, which bounds the tile: 128x128 at two warpgroups or 64x128 at one fit without spilling. With two
    warpgroups per program, or several programs per SM, one warpgroup's promotion overlaps another's MMA, which
    is what DeepGEMM's two math warpgroups do. A 256-wide tile runs as two 128-wide halves with their own dots.
    Tiles are visited in a grouped order (``group_m`` M blocks per band, M fastest within it) so the M blocks of
    one expert read each weight tile from L2 at about the same time. The configuration a call runs with:
    `symmring.moe.engines.triton_heuristics` (register use and the sweeps: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Tuple

from ...errors import ConfigError
from . import triton_common
from .triton_common import ALIGN_M, BLOCK_K, ceil_div, check_bad_groups, check_device, interpreting, tma_ok
from .triton_heuristics import GemmConfig, default_config

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = 448.0
#: Rows per program of the SwiGLU + quantise kernel (8 bf16 = 16 bytes per thread and load at 4 warps).
SWIGLU_BLOCK_ROWS = 32

# Set by _triton() on first use (`triton_common.bind`): the kernels below resolve them from this module's globals.
tl = swiglu_quant_rows = gemm_program = tile_group = None


# --- the kernels (plain functions; _triton() wraps them in triton.jit on first use) -----------------------

def _grouped_gemm_fp8_kernel(
        a_ptr, a_desc, a_sf_ptr, b_ptr, b_desc, b_sf_ptr, out_ptr, out_desc, m_indices_ptr, bad_groups_ptr,
        M, N, K, G,
        stride_am, stride_asm, stride_ask,
        stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk,
        stride_om,
        BLOCK_M: tl.constexpr, SUB_N: tl.constexpr, TWO_HALVES: tl.constexpr, GROUP_M: tl.constexpr,
        NUM_STAGES: tl.constexpr, TMA_LOAD: tl.constexpr, TMA_STORE: tl.constexpr, REPORT: tl.constexpr,
):
    BLOCK_KK: tl.constexpr = 128
    BLOCK_N: tl.constexpr = SUB_N * (1 + TWO_HALVES)
    pid = gemm_program(M, N, K, stride_am, stride_asm, stride_ask, stride_bg, stride_bn, stride_bsg, stride_bsn,
                       stride_bsk, stride_om)
    # Grouped tile order: GROUP_M M blocks per band, the band's M blocks fastest, so the blocks of one
    # expert ask for the same weight tile at about the same time (one HBM read, the rest from L2).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_band = GROUP_M * num_pid_n
    band = pid // num_pid_in_band
    first_pid_m = band * GROUP_M
    band_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_band) % band_rows
    pid_n = (pid % num_pid_in_band) // band_rows
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    # Groups start at multiples of ALIGN_M >= BLOCK_M, so the first row names the tile's group; a padding
    # row there means the whole tile is padding (the end of a group's last block, or past the last group).
    # An id outside [-1, G) is skipped too (and reported: tile_group).
    group = tile_group(m_indices_ptr, off_m, G, bad_groups_ptr, REPORT)
    if group < 0:
        return

    offs_m = off_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_KK)
    a_sf_rows = a_sf_ptr + offs_m * stride_asm
    b_sf_block = b_sf_ptr + group.to(tl.int64) * stride_bsg + (off_n // 128) * stride_bsn
    # The second half's scale block may lie past the last one when N <= off_n + 128: load 0 there (its
    # columns are never stored).
    half1_ok = off_n + SUB_N < N
    b_row0 = group * N + off_n  # row of b viewed as [G * N, K] (TMA coordinates)
    if not TMA_LOAD:
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        offs_n0 = off_n + tl.arange(0, SUB_N)
        n_ok0 = offs_n0 < N
        b_group = b_ptr + group.to(tl.int64) * stride_bg
        b_ptrs0 = b_group + offs_n0.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
        if TWO_HALVES:
            n_ok1 = (offs_n0 + SUB_N) < N
            b_ptrs1 = b_ptrs0 + SUB_N * stride_bn

    acc0 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    if TWO_HALVES:
        acc1 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    k_tiles = K // BLOCK_KK
    # tl.range's num_stages pipelines every load of the loop, the scale loads included (the kernel-level
    # num_stages would pipeline only the loads that feed the dots).
    for kt in tl.range(0, k_tiles, num_stages=NUM_STAGES):
        off_k = kt * BLOCK_KK
        if TMA_LOAD:
            a = a_desc.load([off_m, off_k])
            b0 = b_desc.load([b_row0, off_k])
        else:
            a = tl.load(a_ptrs + off_k, mask=m_ok[:, None], other=0.0)
            b0 = tl.load(b_ptrs0 + off_k, mask=n_ok0[:, None], other=0.0)
        a_s = tl.load(a_sf_rows + kt * stride_ask, mask=m_ok, other=0.0)
        # DeepGEMM's promotion: scale = a_sf * b_sf (one float32 rounding), then acc += scale * block.
        s0 = a_s * tl.load(b_sf_block + kt * stride_bsk)
        acc0 += tl.dot(a, b0.T) * s0[:, None]
        if TWO_HALVES:
            if TMA_LOAD:
                b1 = b_desc.load([b_row0 + SUB_N, off_k])
            else:
                b1 = tl.load(b_ptrs1 + off_k, mask=n_ok1[:, None], other=0.0)
            s1 = a_s * tl.load(b_sf_block + stride_bsn + kt * stride_bsk, mask=half1_ok, other=0.0)
            acc1 += tl.dot(a, b1.T) * s1[:, None]

    if TMA_STORE:
        # The descriptor clips rows >= M and columns >= N.
        out_desc.store([off_m, off_n], acc0.to(tl.bfloat16))
        if TWO_HALVES:
            out_desc.store([off_m, off_n + SUB_N], acc1.to(tl.bfloat16))
    else:
        offs_n = off_n + tl.arange(0, SUB_N)
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc0.to(tl.bfloat16), mask=m_ok[:, None] & (offs_n < N)[None, :])
        if TWO_HALVES:
            tl.store(o_ptrs + SUB_N, acc1.to(tl.bfloat16), mask=m_ok[:, None] & (offs_n + SUB_N < N)[None, :])


def _swiglu_quant_fp8_kernel(
        h_ptr, q_ptr, q_sf_ptr, act_ptr, m_indices_ptr, M, I,
        stride_hm, stride_qm, stride_sfm, stride_sfk, stride_actm,
        BLOCK_ROWS: tl.constexpr, HAS_M_INDICES: tl.constexpr, STORE_ACT: tl.constexpr,
        ACCURATE_EXP: tl.constexpr):
    GROUP: tl.constexpr = 128
    tl.assume(M > 0)
    tl.assume(I > 0)
    tl.assume(stride_hm > 0)
    tl.assume(stride_qm > 0)
    tl.assume(stride_sfm >= 0)
    tl.assume(stride_sfk >= 0)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)  # one 128-column scale group per program along axis 1
    rows = pid_m * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = pid_k * GROUP + tl.arange(0, GROUP)
    ok = rows < M
    if HAS_M_INDICES:
        # Padding rows are skipped: masked lanes issue no memory traffic.
        ok = ok & (tl.load(m_indices_ptr + rows, mask=ok, other=-1) >= 0)
    rows64 = rows.to(tl.int64)
    h_tile = h_ptr + rows64[:, None] * stride_hm + cols[None, :]
    gate = tl.load(h_tile, mask=ok[:, None], other=0.0).to(tl.float32)
    up = tl.load(h_tile + I, mask=ok[:, None], other=0.0).to(tl.float32)
    act, q, scale = swiglu_quant_rows(gate, up, ACCURATE_EXP)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=ok[:, None])
    tl.store(q_sf_ptr + rows64 * stride_sfm + pid_k * stride_sfk, scale, mask=ok)
    if STORE_ACT:
        tl.store(act_ptr + rows64[:, None] * stride_actm + cols[None, :], act, mask=ok[:, None])


# --- host side --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _triton():
    """torch, triton, the jitted kernels and TensorDescriptor (`triton_common.bind`: BackendError when torch or
    triton is missing)."""
    t = triton_common.bind(globals())
    # No value specialisation (divisibility by 16, == 1) of the row count and the scale strides: they do
    # not matter for speed, and specialising on them would compile one more variant per pattern (the pool
    # bound M varies; K / 128 is 56 for DeepSeek-V3, 16 for Qwen3; MN-major a_sf has stride 1 along M).
    gemm = t.triton.jit(_grouped_gemm_fp8_kernel,
                        do_not_specialize=["M", "G", "stride_asm", "stride_ask", "stride_bsg", "stride_bsn",
                                           "stride_bsk"])
    swiglu = t.triton.jit(_swiglu_quant_fp8_kernel, do_not_specialize=["M", "stride_sfm", "stride_sfk"])
    return t.torch, t.triton, gemm, swiglu, t.TensorDescriptor


def _torch():
    return _triton()[0]


def check_gemm_args(a, a_sf, b, b_sf, m_indices, out=None) -> Tuple[int, int, int, int]:
    """Validate the grouped GEMM's arguments (shapes, dtypes, devices, strides); no device work.

    Args:
        a, a_sf, b, b_sf, m_indices, out: as `grouped_gemm_fp8`.

    Returns:
        ``(M, N, K, G)``.

    Raises:
        ConfigError: any argument that does not fit, named, with what was expected.
    """
    torch = _torch()
    named = [("a", a), ("a_sf", a_sf), ("b", b), ("b_sf", b_sf), ("m_indices", m_indices)]
    if out is not None:
        named.append(("out", out))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2 or a.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"a: expected float8_e4m3fn [M, K], got {a.dtype} {tuple(a.shape)}")
    M, K = a.shape
    if K == 0 or K % BLOCK_K:
        raise ConfigError(f"a.shape={tuple(a.shape)}: expected K a positive multiple of {BLOCK_K}")
    if a.stride(1) != 1:
        raise ConfigError(f"a.stride()={a.stride()}: expected contiguous rows (stride 1 along K)")
    if b.dim() != 3 or b.dtype != torch.float8_e4m3fn or b.shape[2] != K:
        raise ConfigError(f"b: expected float8_e4m3fn [G, N, K={K}], got {b.dtype} {tuple(b.shape)}")
    G, N, _ = b.shape
    if G == 0 or N == 0:
        raise ConfigError(f"b.shape={tuple(b.shape)}: expected G > 0 and N > 0")
    if b.stride(2) != 1:
        raise ConfigError(f"b.stride()={b.stride()}: expected K-contiguous weights (stride 1 along K)")
    if a_sf.dtype != torch.float32 or tuple(a_sf.shape) != (M, K // BLOCK_K):
        raise ConfigError(f"a_sf: expected float32 [{M}, {K // BLOCK_K}], got {a_sf.dtype} {tuple(a_sf.shape)}")
    nb = ceil_div(N, 128)
    if b_sf.dtype != torch.float32 or tuple(b_sf.shape) != (G, nb, K // BLOCK_K):
        raise ConfigError(f"b_sf: expected float32 [{G}, {nb}, {K // BLOCK_K}] (one scale per 128x128 block), "
                          f"got {b_sf.dtype} {tuple(b_sf.shape)}")
    if m_indices.dtype != torch.int32 or tuple(m_indices.shape) != (M,) or (M and m_indices.stride(0) != 1):
        raise ConfigError(f"m_indices: expected contiguous int32 [{M}], got {m_indices.dtype} "
                          f"{tuple(m_indices.shape)}")
    if out is not None:
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (M, N) or (M and out.stride(1) != 1):
            raise ConfigError(f"out: expected bfloat16 [{M}, {N}] with contiguous rows, got {out.dtype} "
                              f"{tuple(out.shape)} strides {out.stride()}")
    check_device([t for _, t in named], [n for n, _ in named])
    return M, N, K, G


def check_contiguous_layout(m_indices, num_groups: int, align: int = ALIGN_M) -> None:
    """Check, on the host, that ``m_indices`` is a contiguous layout (synchronises with the device).

    The engines read the group of a tile from its first row and trust the layout; this debugging aid
    verifies what they assume: values in ``[-1, num_groups)``, each group's rows contiguous and starting
    at a multiple of ``align``, and nothing but padding (-1) between the end of a group and the next
    multiple of ``align``.

    Raises:
        ConfigError: the first violation, with the row.

    Example:
        >>> import numpy as np
        >>> check_contiguous_layout(np.array([0, 0, -1, -1, 1, -1, -1, -1], np.int32), 2, align=4)
    """
    import numpy as np
    values = m_indices.detach().cpu().numpy() if hasattr(m_indices, "detach") else np.asarray(m_indices)
    values = values.astype(np.int64).reshape(-1)
    if values.size and (values.min() < -1 or values.max() >= num_groups):
        raise ConfigError(f"m_indices: values in [{values.min()}, {values.max()}], expected [-1, {num_groups})")
    # A group starts where a row's group differs from the row before. Each start must be aligned and each
    # group start once (a group interrupted by padding or another group would start twice).
    prev = np.concatenate([[-1], values[:-1]])
    starts = np.flatnonzero((values >= 0) & (values != prev))
    misaligned = starts[starts % align != 0]
    if misaligned.size:
        row = int(misaligned[0])
        raise ConfigError(f"m_indices[{row}]={values[row]}: group starts at row {row}, not a multiple of {align}")
    groups, first = np.unique(values[starts], return_index=True)
    if groups.size != starts.size:
        repeated = np.setdiff1d(np.arange(starts.size), first)
        row = int(starts[repeated[0]])
        raise ConfigError(f"m_indices[{row}]={values[row]}: group {values[row]} is not contiguous "
                          f"(it starts a second time at row {row})")


def grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices, out=None, config: Optional[GemmConfig] = None, *,
                     bad_groups=None):
    """Block-scaled fp8 grouped GEMM of the contiguous layout (Triton; DeepGEMM's
    ``m_grouped_fp8_gemm_nt_contiguous`` contract).

    ``out[r, n] = sum_kb (a[r, kb] . b[g, n, kb]) * a_sf[r, kb] * b_sf[g, n // 128, kb]`` for rows with
    ``g = m_indices[r] >= 0``, accumulated in float32, rounded to bf16. Enqueued on the current stream.

    Args:
        a: float8_e4m3fn ``[M, K]``, contiguous rows, ``K % 128 == 0``.
        a_sf: float32 ``[M, K // 128]``, any strides.
        b: float8_e4m3fn ``[G, N, K]``, K-contiguous.
        b_sf: float32 ``[G, ceil(N / 128), K // 128]``, any strides.
        m_indices: contiguous int32 ``[M]``: each row's group, -1 for padding; groups start at multiples of
            `ALIGN_M` (not checked here: `check_contiguous_layout` does, with a device sync). A tile whose
            first row names a group outside ``[-1, G)`` is skipped (never reads past ``b``).
        out: optional bf16 ``[M, N]`` with contiguous rows; allocated when None.
        config: a `triton_heuristics.GemmConfig`; `triton_heuristics.default_config` when None.
        bad_groups: optional int32 ``[>= 2]`` on the device: the tiles skipped for such an id are added to
            word 0 and the first id is stored in word 1 (`triton_common.BAD_GROUP_WORDS`; zero it first).

    Returns:
        ``out``. Rows of tiles that start with a padding row are left as they were (undefined when
        allocated here); padding rows inside a group's last block hold whatever their pool rows produce.

    Raises:
        ConfigError: bad shapes, dtypes, strides or devices (before any launch).
        BackendError: torch/triton missing, or a GPU without fp8 tensor cores.

    Example:
        >>> out = grouped_gemm_fp8(a, a_sf, b, b_sf, m_indices)  # doctest: +SKIP
    """
    torch, triton, gemm_kernel, _, TensorDescriptor = _triton()
    M, N, K, G = check_gemm_args(a, a_sf, b, b_sf, m_indices, out)
    check_bad_groups(bad_groups, a.device)
    if config is None:
        config = default_config(M, N, K, G)
    elif not isinstance(config, GemmConfig):
        raise ConfigError(f"config: expected a triton_heuristics.GemmConfig, got {type(config).__name__}")
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    if M == 0:
        return out
    sub_n = min(config.block_n, 128)
    two_halves = config.block_n == 256
    tma_hw = interpreting() or torch.cuda.get_device_capability(a.device)[0] >= 9
    # b as [G * N, K] (one descriptor for every group) needs the groups back to back.
    b_flat_ok = b.stride(0) == N * b.stride(1)
    tma_load = bool(config.tma and tma_hw and TensorDescriptor is not None and tma_ok(a) and b_flat_ok and
                    b.data_ptr() % 16 == 0 and (b.stride(1) % 16 == 0))
    tma_store = bool(config.tma and tma_hw and TensorDescriptor is not None and tma_ok(out))
    if config.tma and not (tma_load and tma_store):
        logger.debug("grouped_gemm_fp8: TMA %s; pointer %s used instead", config.name,
                     "loads and stores" if not (tma_load or tma_store) else ("loads" if not tma_load else "stores"))
    a_desc = b_desc = out_desc = None
    if tma_load:
        a_desc = TensorDescriptor(a, [M, K], [a.stride(0), 1], [config.block_m, BLOCK_K])
        b_desc = TensorDescriptor(b, [G * N, K], [b.stride(1), 1], [sub_n, BLOCK_K])
    if tma_store:
        out_desc = TensorDescriptor(out, [M, N], [out.stride(0), 1], [config.block_m, sub_n])
    grid = (ceil_div(M, config.block_m) * ceil_div(N, config.block_n),)
    gemm_kernel[grid](
        a, a_desc, a_sf, b, b_desc, b_sf, out, out_desc, m_indices,
        m_indices if bad_groups is None else bad_groups,  # not touched without REPORT
        M, N, K, G,
        a.stride(0), a_sf.stride(0), a_sf.stride(1),
        b.stride(0), b.stride(1), b_sf.stride(0), b_sf.stride(1), b_sf.stride(2),
        out.stride(0),
        BLOCK_M=config.block_m, SUB_N=sub_n, TWO_HALVES=two_halves, GROUP_M=config.group_m,
        NUM_STAGES=config.num_stages, TMA_LOAD=tma_load, TMA_STORE=tma_store, REPORT=bad_groups is not None,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def act_scales_empty(M: int, num_groups: int, device, *, mn_major: bool):
    """An uninitialised float32 ``[M, num_groups]`` of 1x128 activation scales: row-major, or MN-major with
    16-byte aligned columns (strides ``(1, align4(M))``, what DeepGEMM's TMA reads without a transform)."""
    torch = _torch()
    if mn_major:
        return torch.empty((num_groups, -(-M // 4) * 4), dtype=torch.float32, device=device).t()[:M]
    return torch.empty((M, num_groups), dtype=torch.float32, device=device)


def swiglu_quant_fp8(h, m_indices=None, *, act_out=None, sf_mn_major: bool = False, q_out=None):
    """SwiGLU of L1's output and fp8 quantisation for L2, in one kernel.

    ``act = silu(gate) * up`` (``gate = h[:, :I]``, ``up = h[:, I:]``) in float32, then per row and 128
    columns ``scale = amax / 448`` (1.0 when 0) and ``q = e4m3fn(clip(act / scale, -448, 448))`` (nearest
    even): bitwise `symmring.moe.quant.quantize_fp8` of the float32 ``act`` (module notes).

    Args:
        h: bf16 ``[M, 2 * I]`` with contiguous rows, ``I % 128 == 0``.
        m_indices: optional contiguous int32 ``[M]``; rows with -1 are skipped (left undefined).
        act_out: optional float32 ``[M, I]`` (contiguous rows) that also receives ``act`` (for tests).
        sf_mn_major: lay ``q_sf`` out MN-major with 16-byte aligned columns (strides ``(1, align4(M))``, what
            DeepGEMM reads without a transform; the Triton GEMM takes either).
        q_out: optional float8_e4m3fn ``[M, I]`` (contiguous rows) to write ``q`` into (the workspace's rows).

    Returns:
        ``(q, q_sf)``: float8_e4m3fn ``[M, I]`` and float32 ``[M, I // 128]`` (row-major unless
        ``sf_mn_major``: L2's ``a_sf``).

    Raises:
        ConfigError: bad shapes, dtypes, strides or devices (before any launch).
        BackendError: torch/triton missing.

    Example:
        >>> q, q_sf = swiglu_quant_fp8(h, m_indices)  # doctest: +SKIP
    """
    torch, _, _, swiglu_kernel, _ = _triton()
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.dtype != torch.bfloat16:
        raise ConfigError(f"h: expected a bfloat16 tensor [M, 2 * I], got "
                          f"{getattr(h, 'dtype', type(h).__name__)} {tuple(getattr(h, 'shape', ()))}")
    M, two_i = h.shape
    if two_i % 256 or two_i == 0:
        raise ConfigError(f"h.shape={tuple(h.shape)}: expected 2 * I columns with I a positive multiple of 128")
    inter = two_i // 2
    if M and h.stride(1) != 1:
        raise ConfigError(f"h.stride()={h.stride()}: expected contiguous rows")
    tensors, names = [h], ["h"]
    if m_indices is not None:
        if (not isinstance(m_indices, torch.Tensor) or m_indices.dtype != torch.int32 or
                tuple(m_indices.shape) != (M,) or (M and m_indices.stride(0) != 1)):
            raise ConfigError(f"m_indices: expected contiguous int32 [{M}], got "
                              f"{getattr(m_indices, 'dtype', type(m_indices).__name__)} "
                              f"{tuple(getattr(m_indices, 'shape', ()))}")
        tensors.append(m_indices)
        names.append("m_indices")
    for name, out, dtype in (("act_out", act_out, torch.float32), ("q_out", q_out, torch.float8_e4m3fn)):
        if out is None:
            continue
        if (not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != (M, inter) or
                (M and out.stride(1) != 1)):
            raise ConfigError(f"{name}: expected {str(dtype).split('.')[-1]} [{M}, {inter}] with contiguous rows, "
                              f"got {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        tensors.append(out)
        names.append(name)
    check_device(tensors, names)
    q = q_out if q_out is not None else torch.empty((M, inter), dtype=torch.float8_e4m3fn, device=h.device)
    q_sf = act_scales_empty(M, inter // 128, h.device, mn_major=sf_mn_major)
    if M == 0:
        return q, q_sf
    grid = (ceil_div(M, SWIGLU_BLOCK_ROWS), inter // 128)
    swiglu_kernel[grid](
        h, q, q_sf, act_out if act_out is not None else q_sf, m_indices if m_indices is not None else q_sf,
        M, inter, h.stride(0), q.stride(0), q_sf.stride(0), q_sf.stride(1),
        act_out.stride(0) if act_out is not None else 0,
        BLOCK_ROWS=SWIGLU_BLOCK_ROWS, HAS_M_INDICES=m_indices is not None, STORE_ACT=act_out is not None,
        ACCURATE_EXP=not interpreting(),
        # No FMA contraction: every step of silu(g) * u is its own float32 rounding, as in torch and NumPy.
        enable_fp_fusion=False, num_warps=4)
    return q, q_sf
