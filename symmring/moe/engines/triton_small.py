"""Small-batch fp8 expert kernels: "swap-AB" block-scaled grouped GEMMs for groups of a few rows (decode).

Same formats and pool as `symmring.moe.engines.triton_large` (the contiguous layout: every group starts at a
multiple of `ALIGN_M` = 128 pool rows, ``m_indices`` the group of each row, -1 for padding; 1x128
activation scales with any strides, 128x128 weight block scales), the same checks, and the same per-row
definition ``out[r, n] = sum_kb (a[r, kb] . b[g, n, kb]) * a_sf[r, kb] * b_sf[g, n // 128, kb]``. What
differs is the tiling, for the case where each expert holds 1-64 rows and the layer's time should be the
time to read the touched experts' weights:

* `grouped_gemm_fp8_small`: one program per (row tile of ``BLOCK_T`` pool rows, tile of ``BLOCK_N`` weight
  rows). It computes ``W[g][n0:n0 + BLOCK_N, :] @ A[rows]^T`` with ``tl.dot(W tile [BLOCK_N, 128], A tile^T
  [128, BLOCK_T])``: the weights are the MMA's M side (64 or 128, what Hopper's wgmma wants) and the few
  tokens its N side (16, 32 or 64), so no MMA lane computes a padding row of a 128-row block. Rows are
  the output's columns here; the epilogue stores them transposed back to ``out [M, N]`` rows (bf16).
* `grouped_gemm_swiglu_quant_fp8_small`: L1 fused with SwiGLU and the 1x128 fp8 quantisation of L2's
  input. ``BLOCK_N = 128``: each program computes gate channels ``[n0, n0 + 128)`` and the matching up
  channels ``[n0 + I, n0 + I + 128)`` of ``w13 = [gate rows | up rows]``
  (`symmring.moe.engines.torch_bf16.fuse_gate_up`) as two accumulators, so it owns exactly one 128-channel
  scale group of every row and needs nothing from other programs. It writes L2's ``(q, q_sf)`` (scales
  MN-major, as ``swiglu_quant_fp8(sf_mn_major=True)``).

Which tiles run
    The host passes ``rows_per_group``, a bound on the rows any one group holds (the layer's: the tokens
    of all ranks in the window, since a token sends each expert at most one row). A group starts at a
    128-row block, so only the first ``ceil(min(rows_per_group, 128) / BLOCK_T)`` row tiles of each block
    can hold rows: the grid covers those alone (``cdiv(M, 128)`` blocks of them). A tile reads the group of
    its first row and exits at once when it is padding (-1): the empty blocks at the end of a window's pool
    cost one 4-byte load per program. ``BLOCK_T`` divides 128, so a tile never spans two groups.
    ``rows_per_group=None`` visits every tile (any contiguous layout). With ``split_k = S > 1`` the grid has a
    second dimension of S programs per output tile, each over its own range of K blocks (below).

Numerics (bitwise contracts)
    Per K block of 128 the MMA forms the 128 fp8 products' sum (Hopper's reduced-precision fp8
    accumulation inside the block, as in `triton_large`); the block result is promoted with one explicit
    fused multiply-add ``acc = fma(block, a_sf[r, kb] * b_sf[g, n // 128, kb], acc)`` (scale product
    rounded to float32 first), K blocks in increasing order, and FMA contraction is otherwise off (every
    other float32 step is its own rounding). So a row's result depends only on its own activations, its
    group's weights and the configuration: never on where the row sits in the pool nor on the other rows
    (each output column of the swapped MMA is one row's dot products). With ``split_k = S > 1`` the K blocks
    ``0 .. K / 128 - 1`` are cut into S contiguous ranges fixed by ``(K, S)`` alone (split ``s`` takes
    ``q + (s < r)`` blocks from ``s * q + min(s, r)``, with ``q, r = divmod(K / 128, S)``); each split's
    accumulator starts at 0 and runs the same promotion over its own blocks in increasing order, giving the
    float32 partial ``p_s``; the result is ``((p_0 + p_1) + p_2) + ... + p_{S-1}``, float32 additions in split
    order (see "Split-K" for how). S = 1 is the plain loop above. The fused kernel runs the same K loop
    (and, split, the same reduction) for gate and up, rounds both to bf16 (the rounding the unfused path's
    ``h`` goes through), then evaluates SwiGLU and the quantisation exactly as `triton_large.swiglu_quant_fp8`
    does (CUDA's accurate ``expf``, IEEE divisions, ``scale = amax / 448``, 1.0 for a zero group, clip, e4m3
    nearest even). Hence, for the same configuration (``split_k`` included),
    ``grouped_gemm_swiglu_quant_fp8_small(a, ...)`` is bitwise ``swiglu_quant_fp8(grouped_gemm_fp8_small(a,
    ...), m_indices)`` on every real row. Different ``split_k`` sum in a different order: close, not
    bitwise. Against the float64 definition the GEMM is within the bf16 rounding (as `triton_large`); the swap
    changes which operand is A, not the arithmetic per output element, so results are close to but not
    bitwise those of `triton_large.grouped_gemm_fp8` (its promotion may contract differently).

    Padding rows inside a real tile are computed from whatever the pool holds (garbage or NaN spoils only
    their own columns) and never stored: every output row whose ``m_indices`` is -1 is left as it was, in
    both kernels.

Configuration
    `symmring.moe.engines.triton_heuristics.small_config` picks the row tile, the weight tile and the split of
    K from the problem's sizes (the rule, and why, there; the sweep behind it: docs/PERFORMANCE.md). Weights
    and activations arrive by TMA (pointer loads where a descriptor does not fit).

Split-K (``split_k > 1``)
    Deterministic, in one launch, with a last-arrival reduction: each of a tile's S programs stores its
    float32 partial accumulator(s) (gate and up for the fused L1) to a workspace, ``[tile][split][gate, up]
    [BLOCK_N][BLOCK_T]``, then (after a CTA barrier, so every thread's stores come before the release) adds 1
    to the tile's counter (``atomic_add``, acq_rel, gpu scope). The program that reads ``S - 1`` is the last:
    it sets the counter back to 0 (zero again for the next launch and every graph replay, so no memset per
    call), reads the S partials in split order with L2 loads (``.cg``: never a stale L1 line) and adds them
    as above, then runs the epilogue (bf16 store, or SwiGLU + quantisation). Data moves by plain stores and
    loads only; the one atomic is the counter, so the result does not depend on which split arrives last
    (the grid's split index is rotated by the tile, so under the interpreter's in-order programs too the
    last arrival is a different split on different tiles). Tiles of padding (-1) exit before any of it.

    The workspace (``programs x S x [1 or 2] x BLOCK_N x BLOCK_T`` float32: 8 KiB per accumulator at 128 x 16,
    read back once from L2, small beside the weights each split streams) comes from ``torch.empty`` per call:
    the caching allocator's stream-ordered block (a capture's private pool in a CUDA graph). The counters
    (int32, one per tile of the grid) must be zero before a launch, so they are made zero once
    (``torch.zeros``) and cached (`split_counter_buffers` lists them):

    * an eager launch uses the buffer of the stream it is enqueued on (per device and stream, grown as
      needed): launches on one stream run one after the other, each finds the counters as the previous
      left them, zero; launches on different streams, which may overlap, never share a buffer;
    * a launch being captured into a CUDA graph gets counters no other live graph holds: a slice of one of
      the device's capture arenas (``2**16`` counters each, made zero by an eager launch, outside any capture:
      ``torch.cuda.graph`` synchronises before it captures). A graph's replays on any stream thus share
      counters with nothing but themselves (replaying one graph concurrently with itself is unsupported
      anyway: its intermediates are shared too). The slices go back to their arena with the graph: a capture
      inside `capture_counters` (what `symmring.moe.gpu.MoE` does for every graph it captures) records them
      in the lease it yields, kept with the graph and given back when it is dropped (the layer drops a graph
      after a synchronisation: no replay in flight), so captures and evictions leave the arenas as they found
      them; a graph captured outside one (``torch.cuda.graph`` around a call, by hand) keeps its slices for
      the process. An eager launch makes another arena only when none has half of one free (or this launch's
      count) in one piece, and an arena that gets all its counters back is freed where another has half of one
      free. Where no arena has room (a capture before any eager split launch on the device) the launch takes
      its own ``torch.zeros`` buffer inside the capture: correct, at the cost of one memset node in that graph
      (logged once).

    ``split_k`` larger than the K blocks is a `ConfigError` (a split of no blocks would only add zeros);
    the default rule never asks for it. ``split_k = 1`` is the plain kernel: no workspace, no counters, a
    one-dimensional grid.

DeepGEMM's small-batch kernel wants the masked layout (``[G, max_rows, K]`` per expert), not the contiguous
pool the layer's dispatch writes, so the layer's fp8 engines use these kernels for tiny groups whatever
their large-group GEMM is (`symmring.moe.engines.fp8.Fp8Experts`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ...errors import ConfigError
from . import triton_common, triton_large
from .triton_common import ALIGN_M, BLOCK_K, ceil_div, interpreting, tma_ok
from .triton_heuristics import SmallConfig, small_config
from .triton_large import check_gemm_args

logger = logging.getLogger(__name__)

# Set by _jit() on first use (`triton_common.bind`): the kernel resolves them from this module's globals.
tl = swiglu_quant_rows = gemm_program = tile_group = None


# --- the kernel (a plain function; _jit() wraps it in triton.jit on first use) ----------------------------

def _small_gemm_fp8_kernel(
        a_ptr, a_desc, a_sf_ptr, b_ptr, b_desc, b_sf_ptr, m_indices_ptr, out_ptr, q_sf_ptr, partial_ptr, counter_ptr,
        bad_groups_ptr, M, N_OUT, NB, K, G, tiles_per_block,
        stride_am, stride_asm, stride_ask,
        stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk,
        stride_om, stride_sfm, stride_sfk,
        BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, NUM_STAGES: tl.constexpr, TMA_LOAD: tl.constexpr,
        SWIGLU: tl.constexpr, ACCURATE_EXP: tl.constexpr, SPLIT_K: tl.constexpr, REPORT: tl.constexpr,
):
    # SWIGLU: b is w13 [G, NB = 2 * N_OUT, K]; out is q (fp8 [M, N_OUT]) and q_sf its scales.
    # Else: b is [G, NB = N_OUT, K] and out bf16 [M, N_OUT].
    # SPLIT_K > 1: the grid's second axis holds the tile's splits; partial_ptr is the float32 workspace
    # [tiles][SPLIT_K][1 + SWIGLU][BLOCK_N][BLOCK_T], counter_ptr int32 [tiles], zero at launch and left zero.
    # SPLIT_K == 1: neither is touched.
    BLOCK_KK: tl.constexpr = 128
    tl.assume(tiles_per_block > 0)
    pid = gemm_program(M, N_OUT, K, stride_am, stride_asm, stride_ask, stride_bg, stride_bn, stride_bsg, stride_bsn,
                       stride_bsk, stride_om)
    # Row tile fastest, then the N tile, then the 128-row block: the row tiles of one group read the same
    # weight tile one after the other (L2), and the empty blocks at the pool's end come last.
    num_pid_n = tl.cdiv(N_OUT, BLOCK_N)
    sub = pid % tiles_per_block
    pid_n = (pid // tiles_per_block) % num_pid_n
    blk = pid // (tiles_per_block * num_pid_n)
    off_t = blk * 128 + sub * BLOCK_T
    if off_t >= M:
        return
    # Groups start at multiples of 128 and BLOCK_T divides 128: the first row names the tile's group (an id
    # outside [-1, G) is skipped like padding, and reported: tile_group). Every split of a tile sees the same.
    group = tile_group(m_indices_ptr, off_t, G, bad_groups_ptr, REPORT)
    if group < 0:
        return
    off_n = pid_n * BLOCK_N

    offs_t = off_t + tl.arange(0, BLOCK_T)
    t_ok = offs_t < M
    offs_k = tl.arange(0, BLOCK_KK)
    a_sf_rows = a_sf_ptr + offs_t * stride_asm
    # One weight scale per K block: the tile's BLOCK_N <= 128 rows lie in one 128-row scale block.
    b_sf_g = b_sf_ptr + group.to(tl.int64) * stride_bsg + (off_n // 128) * stride_bsn
    b_row0 = group * NB + off_n  # row of b viewed as [G * NB, K] (TMA coordinates)
    if SWIGLU:
        b_sf_u = b_sf_g + (N_OUT // 128) * stride_bsn
    if not TMA_LOAD:
        a_ptrs = a_ptr + offs_t.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        offs_n = off_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_OUT
        b_ptrs = b_ptr + group.to(tl.int64) * stride_bg + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    if SWIGLU:
        acc_u = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    k_tiles = K // BLOCK_KK
    if SPLIT_K == 1:
        kt_begin = 0
        kt_end = k_tiles
    else:
        # Split s: q + (s < r) blocks from s * q + min(s, r), q, r = divmod(k_tiles, SPLIT_K): fixed by (K, S).
        # The grid index is rotated by the tile, so that even the interpreter's in-order programs have a
        # different split arrive last on different tiles (the reduction must not depend on which).
        split = (tl.program_id(1) + pid) % SPLIT_K
        per_split = k_tiles // SPLIT_K
        extra = k_tiles % SPLIT_K
        kt_begin = split * per_split + tl.minimum(split, extra)
        kt_end = kt_begin + per_split + (split < extra).to(tl.int32)
    for kt in tl.range(kt_begin, kt_end, num_stages=NUM_STAGES):
        off_k = kt * BLOCK_KK
        if TMA_LOAD:
            a = a_desc.load([off_t, off_k])
            w = b_desc.load([b_row0, off_k])
        else:
            a = tl.load(a_ptrs + off_k, mask=t_ok[:, None], other=0.0)
            w = tl.load(b_ptrs + off_k, mask=n_ok[:, None], other=0.0)
        a_s = tl.load(a_sf_rows + kt * stride_ask, mask=t_ok, other=0.0)
        # The promotion: scale = a_sf * b_sf (one float32 rounding), acc = fma(block, scale, acc).
        s = tl.broadcast_to((a_s * tl.load(b_sf_g + kt * stride_bsk))[None, :], (BLOCK_N, BLOCK_T))
        acc = tl.fma(tl.dot(w, a.T), s, acc)
        if SWIGLU:
            if TMA_LOAD:
                w_u = b_desc.load([b_row0 + N_OUT, off_k])
            else:
                w_u = tl.load(b_ptrs + N_OUT * stride_bn + off_k, mask=n_ok[:, None], other=0.0)
            s_u = tl.broadcast_to((a_s * tl.load(b_sf_u + kt * stride_bsk))[None, :], (BLOCK_N, BLOCK_T))
            acc_u = tl.fma(tl.dot(w_u, a.T), s_u, acc_u)

    if SPLIT_K > 1:
        # Last arrival: store this split's partial(s); the tile's last program to count in reduces them all.
        TILE: tl.constexpr = BLOCK_N * BLOCK_T
        SPLIT_STRIDE: tl.constexpr = (1 + SWIGLU) * TILE  # [gate, up] per split when fused
        offs_p = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        tile_p = partial_ptr + pid.to(tl.int64) * (SPLIT_K * SPLIT_STRIDE) + offs_p
        tl.store(tile_p + split * SPLIT_STRIDE, acc)
        if SWIGLU:
            tl.store(tile_p + split * SPLIT_STRIDE + TILE, acc_u)
        tl.debug_barrier()  # every thread's partial stored before the release below
        # release: pairs with the acquire of the last arrival; acquire: pairs with every other split's release
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:
            return
        tl.store(counter_ptr + pid, 0)  # zero again for the next launch (kernel order) or graph replay
        tl.debug_barrier()  # the acquire (one thread's) before any thread's loads
        # Fixed order ((p0 + p1) + p2) + ...; .cg: from L2, never a stale L1 line.
        acc = tl.load(tile_p, cache_modifier=".cg")
        for s_idx in tl.static_range(1, SPLIT_K):
            acc = acc + tl.load(tile_p + s_idx * SPLIT_STRIDE, cache_modifier=".cg")
        if SWIGLU:
            acc_u = tl.load(tile_p + TILE, cache_modifier=".cg")
            for s_idx in tl.static_range(1, SPLIT_K):
                acc_u = acc_u + tl.load(tile_p + s_idx * SPLIT_STRIDE + TILE, cache_modifier=".cg")

    # Only real rows are stored (padding rows of the tile are computed but never written).
    row_ok = t_ok & (tl.load(m_indices_ptr + offs_t, mask=t_ok, other=-1) >= 0)
    rows64 = offs_t.to(tl.int64)
    cols = off_n + tl.arange(0, BLOCK_N)
    o_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :]
    if SWIGLU:
        # Exactly swiglu_quant_fp8 on the bf16 h = [gate | up] the unfused path would have stored.
        gate = tl.trans(acc).to(tl.bfloat16).to(tl.float32)
        up = tl.trans(acc_u).to(tl.bfloat16).to(tl.float32)
        act, q, scale = swiglu_quant_rows(gate, up, ACCURATE_EXP)
        tl.store(o_ptrs, q, mask=row_ok[:, None])
        tl.store(q_sf_ptr + rows64 * stride_sfm + pid_n * stride_sfk, scale, mask=row_ok)
    else:
        tl.store(o_ptrs, tl.trans(acc).to(tl.bfloat16), mask=row_ok[:, None] & (cols < N_OUT)[None, :])


# --- host side --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _jit():
    """torch, the jitted kernel and TensorDescriptor (`triton_common.bind`: BackendError when torch or triton is
    missing)."""
    t = triton_common.bind(globals())
    kernel = t.triton.jit(_small_gemm_fp8_kernel,
                          do_not_specialize=["M", "G", "tiles_per_block", "stride_asm", "stride_ask", "stride_bsg",
                                             "stride_bsn", "stride_bsk", "stride_sfm", "stride_sfk"])
    return t.torch, kernel, t.TensorDescriptor


class _CounterArena:
    """One zeroed int32 tensor of capture counters and the ranges of it not handed out (host bookkeeping:
    first fit; a range given back merges with its free neighbours)."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.free: List[Tuple[int, int]] = [(0, tensor.numel())]  # (first, count), sorted, never adjacent

    def largest(self) -> int:
        """The most counters one slice of it can have now."""
        return max((n for _, n in self.free), default=0)

    def idle(self) -> bool:
        """Whether no slice of it is handed out."""
        return self.free == [(0, self.tensor.numel())]

    def take(self, num: int) -> Optional[int]:
        """The first counter of ``num`` consecutive ones now handed out, or None where no range holds them."""
        for i, (first, n) in enumerate(self.free):
            if n >= num:
                if n == num:
                    del self.free[i]
                else:
                    self.free[i] = (first + num, n - num)
                return first
        return None

    def give(self, first: int, num: int) -> None:
        """Take back ``num`` counters from ``first`` (zero again: each launch leaves its counters zero)."""
        i = bisect.bisect(self.free, (first, num))
        if i < len(self.free) and first + num == self.free[i][0]:  # merge with the next range
            num += self.free.pop(i)[1]
        if i and self.free[i - 1][0] + self.free[i - 1][1] == first:  # ... and with the one before
            first, num = self.free[i - 1][0], self.free[i - 1][1] + num
            del self.free[i - 1]
            i -= 1
        self.free.insert(i, (first, num))


class CounterLease:
    """The capture-arena slices the split-K launches captured inside one `capture_counters` took: given back
    to their arenas by `release` or when the lease is garbage collected. Keep it exactly as long as the graph
    captured with it, and drop both only when no replay of the graph is in flight."""

    def __init__(self, owner: "_SplitCounters"):
        self.slices: List[Tuple[_CounterArena, int, int]] = []  # (arena, first counter, counters)
        self._release = weakref.finalize(self, owner.give_back, self.slices)

    def release(self) -> None:
        """Give the slices back now (idempotent)."""
        self._release()


class _SplitCounters:
    """The split-K launches' arrival counters (int32, one per output tile; zero between launches): per device
    and stream for eager launches, slices of capture arenas for captured ones, given back through a
    `CounterLease` (module notes, "Split-K")."""

    #: Counters of one capture arena; another is made when none has half of one free in one range.
    ARENA = 1 << 16
    #: Slices start at multiples of 32 counters (128 bytes): the pointer keeps the 16-byte alignment the
    #: kernel was specialised on (no new compile inside a capture), and launches do not share a line.
    SLICE_ALIGN = 32

    def __init__(self):
        self._lock = threading.RLock()  # a lease's finalizer may run inside a locked call (garbage collection)
        self._streams: Dict[Tuple[str, int], Any] = {}  # (device, stream handle) -> int32 zeros
        self._arenas: Dict[str, List[_CounterArena]] = {}  # device -> its capture arenas
        self._leases = threading.local()  # .open: the leases of this thread's captures, innermost last
        self._warned = False

    def get(self, torch, device, num: int):
        """``num`` zero counters for a launch on ``device``'s current stream (or into its capture)."""
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        with self._lock:
            if capturing:
                return self._for_capture(torch, device, num)
            stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
            key = (str(device), stream)
            buf = self._streams.get(key)
            if buf is None or buf.numel() < num:
                # The one before (if any) is freed to the allocator: only this stream's launches used it and
                # they are ordered before any later use of its memory on this stream.
                size = max(num, 2 * buf.numel() if buf is not None else 0, 1024)
                buf = self._streams[key] = torch.zeros(size, dtype=torch.int32, device=device)
            arenas = self._arenas.setdefault(str(device), [])
            want = max(self.ARENA // 2, self._aligned(num))
            if not any(a.largest() >= want for a in arenas):
                # Room for the captures to come (twice this launch's count: the next eager launch keeps this).
                arenas.append(_CounterArena(torch.zeros(max(self.ARENA, 2 * self._aligned(num)), dtype=torch.int32,
                                                        device=device)))
            return buf

    def _aligned(self, num: int) -> int:
        return ceil_div(num, self.SLICE_ALIGN) * self.SLICE_ALIGN

    def _for_capture(self, torch, device, num: int):
        size = self._aligned(num)
        for arena in self._arenas.get(str(device), []):
            first = arena.take(size)
            if first is not None:
                open_leases = getattr(self._leases, "open", None)
                if open_leases:
                    open_leases[-1].slices.append((arena, first, size))
                return arena.tensor[first:first + num]
        if not self._warned:
            self._warned = True
            logger.info("triton_small: a split-K launch captured with no zeroed counters left (no eager split "
                        "launch on %s before it): its graph zeroes its own (one memset per replay)", device)
        return torch.zeros(num, dtype=torch.int32, device=device)

    @contextlib.contextmanager
    def lease(self) -> Iterator[CounterLease]:
        """The lease of the captures in the block (`capture_counters`)."""
        lease = CounterLease(self)
        with self._lock:
            if not hasattr(self._leases, "open"):
                self._leases.open = []
            self._leases.open.append(lease)
        try:
            yield lease
        finally:
            self._leases.open.remove(lease)

    def give_back(self, slices: List[Tuple[_CounterArena, int, int]]) -> None:
        """A lease's slices back to their arenas; an arena left idle is freed where another one has half of
        one free (the next eager launch would not make a new one)."""
        with self._lock:
            for arena, first, size in slices:
                arena.give(first, size)
            slices.clear()
            for arenas in self._arenas.values():
                for arena in [a for a in arenas if a.idle()]:
                    if any(b is not arena and b.largest() >= self.ARENA // 2 for b in arenas):
                        arenas.remove(arena)

    def buffers(self) -> List[Any]:
        with self._lock:
            return list(self._streams.values()) + [a.tensor for arenas in self._arenas.values() for a in arenas]


_split_counters = _SplitCounters()


def capture_counters():
    """A context manager around the capture of a CUDA graph: the capture-arena slices that the split-K
    launches captured in the block take are recorded in the `CounterLease` it yields, and given back when the
    lease is released or garbage collected. Keep the lease as long as the graph (module notes, "Split-K").

    Example:
        >>> with capture_counters() as lease, torch.cuda.graph(graph):  # doctest: +SKIP
        ...     out = grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_indices, config=SmallConfig(split_k=2))
        >>> kept = (graph, lease)  # doctest: +SKIP
    """
    return _split_counters.lease()


def split_counter_buffers() -> List[Any]:
    """Every counter tensor the split-K launches use (eager launches' per-stream buffers and the capture
    arenas): all zero whenever no split launch is running (tests check it).

    Example:
        >>> buffers = split_counter_buffers()  # doctest: +SKIP
        >>> all(not bool(b.any()) for b in buffers)  # doctest: +SKIP
        True
    """
    return _split_counters.buffers()


def _check_rows_per_group(rows_per_group) -> Optional[int]:
    if rows_per_group is None:
        return None
    if isinstance(rows_per_group, bool) or not isinstance(rows_per_group, int) or rows_per_group < 1:
        raise ConfigError(f"rows_per_group={rows_per_group!r}: expected None or a positive int (a bound on the "
                          f"rows of any one group)")
    return rows_per_group


def _launch(a, a_sf, b, b_sf, m_indices, out, q_sf, *, M, n_out, K, G, rows_per_group, config, swiglu, bad_groups):
    torch, kernel, tensor_descriptor = _jit()
    NB = b.shape[1]
    tiles_per_block = ceil_div(min(rows_per_group or ALIGN_M, ALIGN_M), config.block_t)
    tma_hw = interpreting() or torch.cuda.get_device_capability(a.device)[0] >= 9
    tma_load = bool(config.tma and tma_hw and tensor_descriptor is not None and tma_ok(a) and
                    b.stride(0) == NB * b.stride(1) and b.data_ptr() % 16 == 0 and b.stride(1) % 16 == 0)
    a_desc = b_desc = None
    if tma_load:
        a_desc = tensor_descriptor(a, [M, K], [a.stride(0), 1], [config.block_t, BLOCK_K])
        b_desc = tensor_descriptor(b, [G * NB, K], [b.stride(1), 1], [config.block_n, BLOCK_K])
    tiles = ceil_div(M, ALIGN_M) * tiles_per_block * ceil_div(n_out, config.block_n)
    if config.split_k == 1:
        grid, partial, counters = (tiles,), a_sf, m_indices  # the kernel touches neither (SPLIT_K=1)
    else:
        grid = (tiles, config.split_k)
        # Stream-ordered (the current stream's, or the capture's pool): freed when this returns, reused
        # only by later work of the same stream.
        partial = torch.empty(tiles * config.split_k * (2 if swiglu else 1) * config.block_n * config.block_t,
                              dtype=torch.float32, device=a.device)
        counters = _split_counters.get(torch, a.device, tiles)
    kernel[grid](
        a, a_desc, a_sf, b, b_desc, b_sf, m_indices, out, q_sf if q_sf is not None else a_sf, partial, counters,
        m_indices if bad_groups is None else bad_groups,  # not touched without REPORT
        M, n_out, NB, K, G, tiles_per_block,
        a.stride(0), a_sf.stride(0), a_sf.stride(1),
        b.stride(0), b.stride(1), b_sf.stride(0), b_sf.stride(1), b_sf.stride(2),
        out.stride(0), q_sf.stride(0) if q_sf is not None else 0, q_sf.stride(1) if q_sf is not None else 0,
        BLOCK_N=config.block_n, BLOCK_T=config.block_t, NUM_STAGES=config.num_stages, TMA_LOAD=tma_load,
        SWIGLU=swiglu, ACCURATE_EXP=not interpreting(), SPLIT_K=config.split_k, REPORT=bad_groups is not None,
        # No FMA contraction: the promotion's fma is explicit, every other step its own rounding, so the
        # fused and the unfused kernels do the same arithmetic (and swiglu_quant_fp8's).
        enable_fp_fusion=False, num_warps=config.num_warps, num_stages=config.num_stages)


def _resolve_config(config, M, N, K, G, rows_per_group, fused) -> SmallConfig:
    if config is None:
        return small_config(M, N, K, G, rows_per_group, fused=fused)
    if not isinstance(config, SmallConfig):
        raise ConfigError(f"config: expected a triton_heuristics.SmallConfig, got {type(config).__name__}")
    if fused and config.block_n != 128:
        raise ConfigError(f"config.block_n={config.block_n}: the fused L1 needs 128 (one program per "
                          f"128-channel scale group)")
    if config.split_k > K // BLOCK_K:
        raise ConfigError(f"config.split_k={config.split_k}: more splits than K blocks (K={K}: {K // BLOCK_K} "
                          f"blocks of {BLOCK_K}); every split needs at least one")
    return config


def grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_indices, out=None, *, rows_per_group: Optional[int] = None,
                           config: Optional[SmallConfig] = None, bad_groups=None):
    """Block-scaled fp8 grouped GEMM of the contiguous layout for small groups (swap-AB tiles, Triton).

    The contract of `triton_large.grouped_gemm_fp8` (``out[r] = a[r] @ b[g]^T`` block-scaled, float32
    accumulation, bf16) with every padding row left unwritten. Enqueued on the current stream.

    Args:
        a, a_sf, b, b_sf, m_indices: as `triton_large.grouped_gemm_fp8` (a ``[M, K]`` fp8, a_sf any strides,
            b ``[G, N, K]`` fp8, b_sf ``[G, ceil(N / 128), K / 128]``, m_indices int32 ``[M]``).
        out: optional bf16 ``[M, N]`` with contiguous rows; allocated when None.
        rows_per_group: a bound on any group's rows (None: every row tile is visited). A group with more
            rows than the bound has rows past it left unwritten: the bound must hold.
        config: a `triton_heuristics.SmallConfig`; `triton_heuristics.small_config` when None. Its ``split_k``
            (at most ``K / 128``) splits K over that many programs per tile, reduced in a fixed order (module
            notes).
        bad_groups: as `triton_large.grouped_gemm_fp8`'s (tiles whose group lies outside ``[-1, G)`` are
            skipped whether or not it is given).

    Returns:
        ``out`` (rows with ``m_indices == -1`` as they were).

    Raises:
        ConfigError: bad shapes, dtypes, strides, devices, bound or config (before any launch).
        BackendError: torch/triton missing, or a GPU without fp8 tensor cores.

    Example:
        >>> out = grouped_gemm_fp8_small(a, a_sf, b, b_sf, m_indices, rows_per_group=1)  # doctest: +SKIP
    """
    torch = triton_common.load().torch
    M, N, K, G = check_gemm_args(a, a_sf, b, b_sf, m_indices, out)
    triton_common.check_bad_groups(bad_groups, a.device)
    rows_per_group = _check_rows_per_group(rows_per_group)
    config = _resolve_config(config, M, N, K, G, rows_per_group, fused=False)
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=a.device)
    if M:
        _launch(a, a_sf, b, b_sf, m_indices, out, None, M=M, n_out=N, K=K, G=G, rows_per_group=rows_per_group,
                config=config, swiglu=False, bad_groups=bad_groups)
    return out


def grouped_gemm_swiglu_quant_fp8_small(a, a_sf, b13, b13_sf, m_indices, *, rows_per_group: Optional[int] = None,
                                        config: Optional[SmallConfig] = None, bad_groups=None):
    """L1 of small groups fused with SwiGLU and the 1x128 fp8 quantisation: L2's input in one kernel.

    Bitwise ``swiglu_quant_fp8(grouped_gemm_fp8_small(a, a_sf, b13, b13_sf, m_indices, config=config),
    m_indices, sf_mn_major=True)`` on every real row (module notes), without the bf16 ``h`` round trip.

    Args:
        a, a_sf, m_indices: as `grouped_gemm_fp8_small`.
        b13, b13_sf: the fused L1 weight ``[G, 2 * I, K]`` (gate rows then up rows, ``I % 128 == 0``) and its
            block scales ``[G, 2 * I / 128, K / 128]``.
        rows_per_group, bad_groups: as `grouped_gemm_fp8_small`.
        config: a `triton_heuristics.SmallConfig` with ``block_n == 128``; `triton_heuristics.small_config(...,
            fused=True)` when None.

    Returns:
        ``(q, q_sf)``: float8_e4m3fn ``[M, I]`` and float32 ``[M, I / 128]`` MN-major (strides
        ``(1, align4(M))``); padding rows undefined.

    Raises:
        ConfigError: bad shapes, dtypes, strides, devices, bound or config (before any launch).
        BackendError: torch/triton missing, or a GPU without fp8 tensor cores.

    Example:
        >>> q, q_sf = grouped_gemm_swiglu_quant_fp8_small(x, x_sf, w13, w13_sf, m_indices, rows_per_group=4)  # doctest: +SKIP
    """
    torch = triton_common.load().torch
    M, two_i, K, G = check_gemm_args(a, a_sf, b13, b13_sf, m_indices)
    triton_common.check_bad_groups(bad_groups, a.device)
    if two_i % 256:
        raise ConfigError(f"b13.shape={tuple(b13.shape)}: expected [G, 2 * I, K] with I a multiple of 128 "
                          f"(gate rows then up rows)")
    inter = two_i // 2
    rows_per_group = _check_rows_per_group(rows_per_group)
    config = _resolve_config(config, M, two_i, K, G, rows_per_group, fused=True)
    q = torch.empty((M, inter), dtype=torch.float8_e4m3fn, device=a.device)
    q_sf = triton_large.act_scales_empty(M, inter // 128, a.device, mn_major=True)
    if M:
        _launch(a, a_sf, b13, b13_sf, m_indices, q, q_sf, M=M, n_out=inter, K=K, G=G,
                rows_per_group=rows_per_group, config=config, swiglu=True, bad_groups=bad_groups)
    return q, q_sf

