"""Which configuration each built-in Triton fp8 kernel runs with: the configuration types, the lists the
benchmarks sweep and the default rules, apart from the kernels (`triton_large`, `triton_small`), which take a
configuration or ask here for the default (as DeepGEMM keeps ``jit_kernels/heuristics`` apart from its kernels).

Pure arithmetic on the problem's sizes: no torch, no Triton (tests/test_fp8_small_rule.py checks the rules on
the CPU). The rules come from sweeps on one H200 (``python -m symmring bench gemm`` and ``bench gemm
--decode-sweep``); the figures behind them are in docs/PERFORMANCE.md ("fp8 GEMM configurations").

* Large groups (`default_config`, the grouped GEMM of `triton_large`): 64x128 tiles at one warpgroup and
  3 stages, so three programs share an SM and each hides the others' promotion of the block results; long
  K (``K >= 7168``) with more than 64 rows per group on average: 128x256 tiles with pointer loads, whose wider
  tile reads each activation tile half as often.
* Small groups (`small_config`, the swap-AB kernels of `triton_small`): the smallest row tile that holds a
  group's rows (a weight-bound GEMM: a second row tile would read the weights again); 64 weight rows per
  program where 128 would leave SMs idle; K split in 2 where the grid still leaves SMs idle (the fused L1,
  whose split costs more, only where it fills at most half of them).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from ...errors import ConfigError
from .triton_common import ALIGN_M, BLOCK_K, ceil_div

#: SMs of an H200/H100 SXM: the default rules' "does the grid fill the machine" estimate.
NUM_SMS_HOPPER = 132

# --- large groups: the grouped GEMM of triton_large --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the grouped GEMM (`triton_large.grouped_gemm_fp8`).

    Attributes:
        block_m: rows per tile, 64 or 128 (a divisor of `ALIGN_M`, so a tile never spans two groups).
        block_n: columns per tile, 64, 128 or 256 (256 runs as two 128-wide halves: `triton_large`).
        group_m: M blocks per band of the tile order (L2 reuse of weights and activations).
        num_warps: 4 (one warpgroup) or 8 (two).
        num_stages: K blocks in flight (shared memory: ``(block_m + block_n) * 128`` bytes each).
        tma: load A and B (and store the output) with TMA descriptors; False: pointer loads (cp.async).
    """
    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 5
    tma: bool = True

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ConfigError(f"block_m={self.block_m}: expected 64 or 128 (a divisor of ALIGN_M={ALIGN_M})")
        if self.block_n not in (64, 128, 256):
            raise ConfigError(f"block_n={self.block_n}: expected 64, 128 or 256")
        if self.num_warps not in (4, 8):
            raise ConfigError(f"num_warps={self.num_warps}: expected 4 or 8")
        if not 1 <= self.num_stages <= 8:
            raise ConfigError(f"num_stages={self.num_stages}: expected 1..8")
        if not 1 <= self.group_m <= 64:
            raise ConfigError(f"group_m={self.group_m}: expected 1..64")

    @property
    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}g{self.group_m}"
                f"{'' if self.tma else '-ptr'}")

    @property
    def smem_bytes(self) -> int:
        """Shared memory of the operand pipeline (fp8 tiles; the epilogue reuses it)."""
        return self.num_stages * (self.block_m + self.block_n) * BLOCK_K


def gemm_configs() -> List[GemmConfig]:
    """The configurations ``python -m symmring bench gemm`` sweeps: 128x128 tiles at two warpgroups (4-6
    stages), 64x128 at one (3-6 stages; at 3, three programs fit on an SM), 128x256 (two halves, whose second
    block result costs registers: kept as a measured point), and pointer-load variants of three of them.

    Example:
        >>> len(gemm_configs()) >= 8 and all(c.smem_bytes <= 227 * 1024 for c in gemm_configs())
        True
    """
    return [
        GemmConfig(128, 128, 8, 8, 4),
        GemmConfig(128, 128, 8, 8, 5),
        GemmConfig(128, 128, 8, 8, 6),
        GemmConfig(64, 128, 8, 4, 3),
        GemmConfig(64, 128, 16, 4, 4),
        GemmConfig(64, 128, 8, 4, 6),
        GemmConfig(128, 256, 8, 8, 3),
        GemmConfig(128, 128, 8, 8, 4, tma=False),
        GemmConfig(64, 128, 8, 4, 3, tma=False),
        GemmConfig(128, 256, 8, 8, 3, tma=False),
    ]


def default_config(M: int, N: int, K: int, G: int, num_sms: int = NUM_SMS_HOPPER) -> GemmConfig:
    """The configuration `triton_large.grouped_gemm_fp8` uses when none is given (the rule of the module notes):
    128x256 tiles with pointer loads for long K (``K >= 7168``) with more than 64 rows per group on average,
    else 64x128 tiles at one warpgroup and 3 stages (small groups keep them: a 64-row tile skips the empty half
    of a half-filled 128-row block).

    Args:
        M: pool rows (upper bound). N: output features. K: input features. G: groups.
        num_sms: SMs of the device (unused by the rule; kept for other devices' rules).

    Returns:
        A `GemmConfig`.

    Example:
        >>> default_config(32 * 256, 4096, 7168, 32).name, default_config(8 * 2048, 28672, 4096, 8).name
        ('128x256w8s3g8-ptr', '64x128w4s3g8')
    """
    if K >= 7168 and M / max(G, 1) > 64:
        return GemmConfig(128, 256, 8, 8, 3, tma=False)
    return GemmConfig(64, 128, 8, 4, 3)


# --- small groups: the swap-AB kernels of triton_small ------------------------------------------------------

#: Row tiles (the MMA's N side) and weight tiles (its M side) the small kernels take.
BLOCK_T_CHOICES = (16, 32, 64)
BLOCK_N_CHOICES = (64, 128)
#: The splits of K the default rule takes where it splits.
DEFAULT_SPLIT_K = 2
#: The fewest K blocks per split the default rule leaves (one fill of its 4-stage pipeline).
MIN_SPLIT_K_BLOCKS = 4
#: Split counts ``bench gemm --decode-sweep`` times besides 1 (`small_configs`).
SWEEP_SPLIT_K = (2, 4)


@dataclasses.dataclass(frozen=True)
class SmallConfig:
    """One launch configuration of the small-batch kernels (`triton_small`).

    Attributes:
        block_n: weight rows per program (the MMA's M side), 64 or 128; the fused L1 needs 128.
        block_t: pool rows per program (the MMA's N side), 16, 32 or 64 (divisors of `ALIGN_M`).
        num_warps: 4 (one warpgroup) or 8.
        num_stages: K blocks in flight.
        tma: TMA loads of weights and activations; False: pointer loads (cp.async).
        split_k: programs per output tile, each over a contiguous range of the K blocks, reduced in split
            order by the last to finish (`triton_small`, "Split-K"); 1: no split. At most the K blocks of the
            call (`ConfigError` there otherwise).

    Example:
        >>> SmallConfig(128, 16).name, SmallConfig(64, 16, split_k=2).name, SmallConfig(64, 32, tma=False).name
        ('n128t16w4s4', 'n64t16w4s4k2', 'n64t32w4s4-ptr')
    """
    block_n: int = 128
    block_t: int = 16
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = True
    split_k: int = 1

    def __post_init__(self):
        if self.block_n not in BLOCK_N_CHOICES:
            raise ConfigError(f"block_n={self.block_n}: expected one of {BLOCK_N_CHOICES}")
        if self.block_t not in BLOCK_T_CHOICES:
            raise ConfigError(f"block_t={self.block_t}: expected one of {BLOCK_T_CHOICES} (divisors of {ALIGN_M})")
        if self.num_warps not in (4, 8):
            raise ConfigError(f"num_warps={self.num_warps}: expected 4 or 8")
        if not 1 <= self.num_stages <= 8:
            raise ConfigError(f"num_stages={self.num_stages}: expected 1..8")
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or self.split_k < 1:
            raise ConfigError(f"split_k={self.split_k!r}: expected a positive int (1: no split)")

    @property
    def name(self) -> str:
        split = f"k{self.split_k}" if self.split_k > 1 else ""
        return f"n{self.block_n}t{self.block_t}w{self.num_warps}s{self.num_stages}{split}{'' if self.tma else '-ptr'}"

    def smem_bytes(self, fused: bool = False) -> int:
        """Shared memory of the operand pipeline (fp8 tiles)."""
        return self.num_stages * (self.block_n * (2 if fused else 1) + self.block_t) * BLOCK_K


def block_t_for(rows_per_group: Optional[int]) -> int:
    """The smallest row tile that holds ``rows_per_group`` rows (64 when it is larger or unknown).

    Example:
        >>> [block_t_for(r) for r in (1, 16, 17, 64, 100, None)]
        [16, 16, 32, 64, 64, 64]
    """
    if rows_per_group is None:
        return BLOCK_T_CHOICES[-1]
    return next((t for t in BLOCK_T_CHOICES if t >= rows_per_group), BLOCK_T_CHOICES[-1])


def tile_programs(M: int, N: int, G: int, rows_per_group: Optional[int], block_n: int, block_t: int, *,
                  fused: bool = False) -> int:
    """Output tiles that can hold rows: ``min(G, cdiv(M, 128))`` groups x row tiles per 128-row block x N
    tiles (the programs of one K split; `small_config`'s measure of whether the grid fills the machine).

    Args:
        M, N, G, rows_per_group, fused: as `small_config` (N is ``2 * I`` for the fused L1).
        block_n, block_t: the tile.

    Example:
        >>> tile_programs(256, 4096, 8, 1, 128, 16), tile_programs(1024, 1536, 128, 1, 128, 16, fused=True)
        (64, 48)
    """
    groups = min(G, ceil_div(M, ALIGN_M))
    tiles_per_block = ceil_div(min(rows_per_group or ALIGN_M, ALIGN_M), block_t)
    return groups * tiles_per_block * ceil_div(N // 2 if fused else N, block_n)


def small_config(M: int, N: int, K: int, G: int, rows_per_group: Optional[int], *, fused: bool = False,
                 num_sms: int = NUM_SMS_HOPPER) -> SmallConfig:
    """The configuration the small kernels use when none is given.

    * ``block_t``: `block_t_for` ``rows_per_group``: one row tile per group.
    * ``block_n``: 128, unless the 128-wide grid (`tile_programs`) has fewer programs than SMs; then 64 (twice
      the programs, each half the weight rows; a tile of <= 128 weight rows inside one 128-row scale block has
      one weight scale per K block). The fused L1 keeps 128 (one scale group per program).
    * ``split_k``: `DEFAULT_SPLIT_K` where the grid leaves SMs idle and each split keeps at least
      `MIN_SPLIT_K_BLOCKS` K blocks, else 1. Idle: fewer programs than SMs for the GEMM; at most half the SMs
      for the fused L1, whose split also round-trips the up accumulator and defers SwiGLU.
    * 4 warps (one warpgroup issues the 64- or 128-row wgmma) and 4 stages of ``(block_n [x2] + block_t) *
      128`` bytes, enough bytes in flight per SM to stream the weights at the memory's rate.

    Args:
        M: pool rows (host bound). N: weight rows per group (``2 * I`` for the fused L1). K: input features.
        G: groups. rows_per_group: host bound of any group's rows (None: unknown).
        fused: the L1 + SwiGLU kernel (always 128 weight rows per program).
        num_sms: SMs of the device.

    Example:
        Mixtral-like L2 at 1 token (2 groups x 32 tiles of 128 = 64 programs for 132 SMs: 64 wide, 128
        programs, split in 2) and at 4 tokens; DeepSeek-V3-like L2 at 1 token (448 programs):

        >>> [small_config(256, 4096, 14336, 8, 1).name, small_config(1024, 4096, 14336, 8, 4).name,
        ...  small_config(1024, 7168, 2048, 256, 1).name]
        ['n64t16w4s4k2', 'n128t16w4s4', 'n128t16w4s4']

        The fused L1: Qwen3-like at 1 and 2 tokens (48 and 96 programs), DeepSeek-V3-like at 1 token (128),
        Mixtral-like at 1 token (224): only the first leaves half the SMs idle:

        >>> [small_config(m, 1536, 2048, 128, t, fused=True).name for m, t in ((1024, 1), (2048, 2))]
        ['n128t16w4s4k2', 'n128t16w4s4']
        >>> [small_config(m, n, k, g, 1, fused=True).name for m, n, k, g in ((1024, 4096, 7168, 256),
        ...                                                                 (256, 28672, 4096, 8))]
        ['n128t16w4s4', 'n128t16w4s4']
    """
    block_t = block_t_for(rows_per_group)
    block_n = 128
    if not fused and tile_programs(M, N, G, rows_per_group, 128, block_t) < num_sms:
        block_n = 64
    programs = tile_programs(M, N, G, rows_per_group, block_n, block_t, fused=fused)
    idle = 0 < (2 * programs if fused else programs) <= (num_sms if fused else num_sms - 1)
    split_k = DEFAULT_SPLIT_K if idle and (K // BLOCK_K) >= DEFAULT_SPLIT_K * MIN_SPLIT_K_BLOCKS else 1
    return SmallConfig(block_n=block_n, block_t=block_t, split_k=split_k)


def small_configs(fused: bool = False) -> List[SmallConfig]:
    """The configurations ``bench gemm --decode-sweep`` times: every row tile, 4 or 8 warps, 3-6 stages, and
    with 4 warps and 3 or 4 stages also split in `SWEEP_SPLIT_K` (the sweep times a split one only where the
    unsplit grid is below the SM count and the K blocks allow it).

    Example:
        >>> all(c.smem_bytes(True) <= 227 * 1024 for c in small_configs(fused=True))
        True
        >>> len(small_configs()), len(small_configs(fused=True)), sorted({c.split_k for c in small_configs()})
        (60, 24, [1, 2, 4])
    """
    out = []
    for block_n in ((128,) if fused else BLOCK_N_CHOICES):
        for block_t in BLOCK_T_CHOICES:
            for num_warps in (4, 8):
                for num_stages in (3, 4, 6):
                    cfg = SmallConfig(block_n, block_t, num_warps, num_stages)
                    if cfg.smem_bytes(fused) <= 200 * 1024:
                        out.append(cfg)
            for split_k in SWEEP_SPLIT_K:
                for num_stages in (3, 4):
                    cfg = SmallConfig(block_n, block_t, 4, num_stages, split_k=split_k)
                    if cfg.smem_bytes(fused) <= 200 * 1024:
                        out.append(cfg)
    return out
