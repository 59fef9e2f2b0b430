"""How much memory a `symmring.Workspace` takes, region by region, before anything is allocated.

One workspace serves every MoE layer of a process (`symmring.moe.workspace`). Its size comes from a
*budget*, not from the worst routing: the expert pool holds one **window** of tokens under uniform
routing, and a window whose arrivals exceed the pool runs as more **passes** over the same pool (the
routing decides how many, on the device; PROTOCOL.md 9.1c), so no routing can overflow the pool.

Regions, in bytes per PE (the GPU layer; the CPU layer keeps the ring, combine and pool regions):

    ring       symmetric: one ring per distinct layer shape (`RingLayout`), every slot of every call, and
               (GPU) its combine ready words
    staging    symmetric, rdma peers only: one slot per source rank (`symmring.transport`)
    combine    symmetric: [max_tokens][topk][hidden] rows (bf16 on GPUs, float32 on CPUs, its ready words
               first) at each token's logical row, shared by every layer
    experts    symmetric: what the experts read and write in one pass, placed by lifetime (`expert_arena`):
               the pool rows of x (fp8 + scales, or bf16; dispatch writes them, L1 reads them), the L1
               output (bf16), the fp8 activations (L2's input) and the L2 output rows, which the combine
               sends (rdma puts read them). Parts never live at the same time share bytes.
    scratch    the engines' transient tensors (torch's allocator): the activations' scales (fp8), or the
               torch engine's L1 output and activations (bf16)
    dispatch   the window's entry -> row map (passes agree on every entry's row), every pool row's
               source, weight and group id, counters, token bases
    routing    the owner's top-k ids and weights of a call ([max_tokens][topk])

The window: ``window_tokens`` tokens per rank (a multiple of the chunk, at most ``max_tokens``). Its pool
has rows for uniform routing (every local expert gets ``world * window_tokens * topk / num_experts``
rows, each group padded to the engine's 128-row alignment), and at least for any routing of a decode-sized
call (`DECODE_TOKENS` per rank: the small-batch schedule runs one pass). Without a budget the window is the whole
call (one window, one pass under uniform routing); a budget picks the largest window that fits.

Example:
    >>> shape = LayerShape(hidden=7168, inter=2048, num_experts=256, topk=8)
    >>> p = plan([shape], world_size=8, max_tokens=4096)
    >>> p.window_tokens, p.pool_rows[shape]
    (4096, 32768)
    >>> plan([shape], world_size=8, max_tokens=4096, budget=2**30).total <= 2**30
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import ConfigError
from ..layout import ALIGN, RingLayout, RingSpec, align_up

#: Regions of a workspace, in the order the planner prints them.
REGIONS = ("ring", "staging", "combine", "experts", "scratch", "dispatch", "routing")
#: The regions in NVSHMEM's symmetric heap (GPU).
SYMMETRIC_REGIONS = ("ring", "staging", "combine", "experts")
#: Tokens per rank of a decode-sized call: the pool holds ANY routing of such a call in one pass (the
#: small-batch schedule runs one pass; symmring.moe.gpu.SMALL_BATCH_TOKENS).
DECODE_TOKENS = 128
#: Row alignment of every expert group in an fp8 pool (the contiguous layout the fp8 GEMMs read).
FP8_ALIGN = 128
#: The most rows of one expert the fp8 engine's small-group kernels take (symmring.moe.engines.fp8.SMALL_ROWS).
SMALL_GROUP_ROWS = 64
#: fp8 scale group (channels per scale).
SF_GROUP = 128
#: int32 arrays of one word per local expert a layer shape's dispatch keeps (counts, begin, group_end, cursor,
#: the pass's group ends) and its fixed int32 words (total, status, 5 grid counters, 4 bad-id words); an fp8 pool's
#: shape also keeps the grouped GEMMs' report of skipped group ids (2 int32 words, `stages.State.bad_groups`).
_EXPERT_ARRAYS = 5
_FIXED_WORDS = 11
_FP8_WORDS = 2
#: int64 timeline stamps per chunk (symmring.moe.gpu.timeline.num_stamps: 2 per stage, 7 stages).
_STAMPS_PER_CHUNK = 14

#: Model presets of ``python -m symmring plan --preset``: (hidden, inter, experts, topk, MoE layers). The same
#: names everywhere: ``bench moe``/``bench stream`` shapes, ``demo --model`` (a tiny model of the family).
PRESETS = {
    "deepseek-v3": dict(hidden=7168, inter=2048, num_experts=256, topk=8, layers=58),
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, num_experts=128, topk=8, layers=48),
    "mixtral": dict(hidden=4096, inter=14336, num_experts=8, topk=2, layers=32),
}
#: Former names of presets (``demo --model qwen3-moe``), accepted wherever a preset name is.
PRESET_ALIASES = {"qwen3-moe": "qwen3-30b-a3b"}


@dataclass(frozen=True)
class LayerShape:
    """What the workspace needs to know of one MoE layer.

    Args:
        hidden, inter, num_experts, topk: the layer's sizes.
        x_format: the dispatch format, ``"fp8_e4m3"`` or ``"bf16"``.
        expert_format: the pool's rows, ``"fp8"`` (fp8 engines: 128-row aligned groups) or ``"bf16"``.
    """

    hidden: int
    inter: int
    num_experts: int
    topk: int
    x_format: str = "fp8_e4m3"
    expert_format: str = "fp8"

    def __post_init__(self):
        for name in ("hidden", "inter", "num_experts", "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: expected an int >= 1")
        if self.x_format not in ("fp8_e4m3", "bf16"):
            raise ConfigError(f"x_format={self.x_format!r}: expected 'fp8_e4m3' or 'bf16'")
        if self.expert_format not in ("fp8", "bf16"):
            raise ConfigError(f"expert_format={self.expert_format!r}: expected 'fp8' or 'bf16'")

    @property
    def align(self) -> int:
        """Row alignment of each expert group in the pool."""
        return FP8_ALIGN if self.expert_format == "fp8" else 1

    def ring_spec(self, num_slots: int, tokens_per_slot: int) -> RingSpec:
        return RingSpec(num_slots=num_slots, tokens_per_slot=tokens_per_slot, hidden=self.hidden,
                        num_topk=self.topk, num_experts=self.num_experts, x_format=self.x_format,
                        sf_group_size=SF_GROUP)

    def row_meta_bytes(self) -> int:
        """Bytes per pool row outside the experts' region: its source (int32 x4), routing weight and, for fp8
        rows, its group id (`m_indices`: kept apart, it must stay -1 between calls while the experts' bytes
        hold another shape's rows)."""
        return 16 + 4 + (4 if self.expert_format == "fp8" else 0)

    def scratch_bytes(self, rows: int, world_size: int = 1) -> int:
        """The engine's transient bytes for a pass of ``rows`` rows: the fp8 activations' scales (MN-major,
        columns of ``align4(rows)``) and the small-group path's own activations (its fused L1 writes them
        while the pool is still read, so not in the experts' region: `small_path_rows` rows), or the torch
        engine's bf16 L1 output and activations."""
        if self.expert_format == "fp8":
            small = min(rows, small_path_rows(self, world_size))
            scales = 4 * -(-self.inter // SF_GROUP)
            return scales * align_up(rows, 4) + small * self.inter + scales * align_up(small, 4)
        return rows * (2 * 2 * self.inter + 2 * self.inter)


def small_path_rows(shape: LayerShape, world_size: int) -> int:
    """The most pool rows a pass of the fp8 engine's small-group path spans: it runs when no local expert holds
    more than `SMALL_GROUP_ROWS` rows, that is at most ``SMALL_GROUP_ROWS * topk`` entries (given routing may
    repeat an expert), each group padded to the 128-row alignment."""
    local = max(1, shape.num_experts // world_size)
    return spanned_rows(SMALL_GROUP_ROWS * shape.topk, local, shape.align)


def expert_arena(shape: LayerShape, rows: int) -> Dict[str, Tuple[int, int]]:
    """``{part: (byte offset, bytes)}`` of the experts' region for a pass of ``rows`` pool rows, and
    ``"total"``: ``(0, bytes of the region)``.

    One pass runs in stream order: dispatch writes the pool (``pool_x``, ``pool_sf``), L1 reads it and
    writes ``h``, SwiGLU reads ``h`` and writes ``act``, L2 reads ``act`` and writes ``out``, the combine
    sends ``out`` (its rdma puts are complete before its grid ends), and only then does the next pass's
    dispatch write the pool again. So only parts alive at one time must not overlap: (pool, h), (h, act)
    and (act, out). (The engine's small-group path fuses L1 with SwiGLU, so it reads the pool while it
    writes its activations: those come from torch, `LayerShape.scratch_bytes`.) ``out`` and ``h`` start
    at 0, the pool follows ``h``, ``act`` follows both ``h`` and ``out``. bf16 pools (the torch engine keeps its own ``h`` and activations): the pool and ``out`` at 0.

    Example (DeepSeek-V3 at EP8, 4096 tokens per rank: 512 MiB instead of 1000 MiB side by side):
        >>> arena = expert_arena(LayerShape(7168, 2048, 256, 8), 32768)
        >>> [(part, round(arena[part][1] / 2**20, 1)) for part in ("out", "h", "pool_x", "act", "total")]
        [('out', 448.0), ('h', 256.0), ('pool_x', 224.0), ('act', 64.0), ('total', 512.0)]
    """
    H = shape.hidden
    out = rows * H * 2
    if shape.expert_format != "fp8":
        pool = rows * H * 2
        return {"out": (0, out), "pool_x": (0, pool), "total": (0, align_up(max(out, pool)))}
    h = rows * 2 * shape.inter * 2
    sf_words = (H // SF_GROUP) * align_up(rows, 4)  # symmring.moe.gpu.stages.pool_scale_words
    pool_x = align_up(h)
    pool_sf = align_up(pool_x + rows * H)
    act = align_up(max(out, h))
    parts = {"out": (0, out), "h": (0, h), "pool_x": (pool_x, rows * H), "pool_sf": (pool_sf, 4 * sf_words),
             "act": (act, rows * shape.inter)}
    parts["total"] = (0, align_up(max(offset + size for offset, size in parts.values())))
    return parts


def uniform_rows(shape: LayerShape, world_size: int, window_tokens: int) -> int:
    """Pool rows of one window under uniform routing: every expert gets ``world * window * topk /
    num_experts`` rows (rounded up), each group padded to the engine's alignment; at least one group.

    Example:
        >>> uniform_rows(LayerShape(7168, 2048, 256, 8), 8, 4096)   # 1024 rows for each of 32 experts
        32768
    """
    local = max(1, shape.num_experts // world_size)
    per_expert = -(-world_size * window_tokens * shape.topk // shape.num_experts)
    return max(shape.align, local * align_up(per_expert, shape.align))


def window_rows(shape: LayerShape, world_size: int, window_tokens: int) -> int:
    """The pool rows of a window: its uniform routing's, and at least the worst routing's of a decode-sized
    call (`DECODE_TOKENS` per rank, at most the window), so decode never needs a second pass.

    Example:
        >>> window_rows(LayerShape(7168, 2048, 256, 8), 8, 4096)   # uniform: the decode bound is 12256 rows
        32768
    """
    decode = align_up(worst_rows(shape, world_size, min(window_tokens, DECODE_TOKENS)), shape.align)
    return max(uniform_rows(shape, world_size, window_tokens), decode)


def spanned_rows(entries: int, num_groups: int, align: int) -> int:
    """The most pool rows ``entries`` (token, k) entries over ``num_groups`` expert groups can span when every
    group starts at a multiple of ``align`` rows (the layer's plans and the planner use this one bound).

    Example:
        >>> spanned_rows(16, 4, 128)
        524
    """
    return entries + min(num_groups, entries) * (align - 1)


def entry_words(num_slots: int, world_size: int, tokens_per_slot: int, topk: int) -> int:
    """int32 words of a window's entry -> row map: one per (slot, source rank, token, k)."""
    return num_slots * world_size * tokens_per_slot * topk


def worst_rows(shape: LayerShape, world_size: int, tokens: int) -> int:
    """Pool rows a window of ``tokens`` tokens on every rank can need at most: every (token, k) of every
    rank on this rank's experts, plus every group's alignment padding."""
    return spanned_rows(world_size * tokens * shape.topk, max(1, shape.num_experts // world_size), shape.align)


def num_passes(pool_rows: int, rows_bound: int) -> int:
    """Passes a window whose pool rows are at most ``rows_bound`` needs through a pool of ``pool_rows``
    rows (at least 1)."""
    return max(1, -(-rows_bound // max(1, pool_rows)))


@dataclass(frozen=True)
class WorkspacePlan:
    """The sizes of a workspace (`plan`).

    Attributes:
        shapes: the layer shapes it serves; world_size, max_tokens: ranks and most tokens per rank per call.
        device: ``"gpu"`` or ``"cpu"`` (element sizes differ); rdma: a staging ring is allocated.
        tokens_per_slot, num_slots: the ring's chunk and slots (``num_slots * tokens_per_slot >= max_tokens``).
        window_tokens: tokens per rank of one expert window (a multiple of ``tokens_per_slot``).
        pool_rows: rows of the pool for each shape (one window under uniform routing, all shapes in the
            same bytes); budget: the budget asked for (None: a window of the whole call).
        regions: bytes per region (`REGIONS`); total: their sum.
    """

    shapes: Tuple[LayerShape, ...]
    world_size: int
    max_tokens: int
    device: str
    rdma: bool
    tokens_per_slot: int
    num_slots: int
    window_tokens: int
    pool_rows: Dict[LayerShape, int]
    budget: Optional[int]
    regions: Dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.regions.values())

    @property
    def window_chunks(self) -> int:
        return self.window_tokens // self.tokens_per_slot

    def passes(self, shape: LayerShape, tokens: int) -> int:
        """Passes a window of ``tokens`` tokens per rank may need at most (the worst routing)."""
        return num_passes(self.pool_rows[shape], worst_rows(shape, self.world_size, tokens))

    def table(self) -> List[str]:
        """The planner's lines: one per region, then the window, then the total (last)."""
        lines = [f"{name:<10} {self.regions[name]:>14,d} bytes  ({self.regions[name] / 2**20:9.1f} MiB)"
                 for name in REGIONS]
        for shape in self.shapes:
            if self.device == "gpu":
                arena = expert_arena(shape, self.pool_rows[shape])
                names = {"pool_x": "pool rows", "pool_sf": "their scales", "h": "L1 output", "act": "activations",
                         "out": "L2 output rows"}
                parts = ", ".join(f"{label} {arena[part][1] / 2**20:.1f} MiB at {arena[part][0] / 2**20:.1f}"
                                  for part, label in names.items() if part in arena)
                lines.append(f"experts    {parts} (parts never alive at once share bytes)")
            worst = worst_rows(shape, self.world_size, self.window_tokens)
            lines.append(f"window     {self.window_tokens} tokens per rank ({self.window_chunks} chunk(s) of "
                         f"{self.tokens_per_slot}); pool {self.pool_rows[shape]} rows for hidden {shape.hidden}, "
                         f"inter {shape.inter}, {shape.num_experts} experts, top-{shape.topk} (uniform routing: 1 "
                         f"pass; the worst routing: {num_passes(self.pool_rows[shape], worst)} passes)")
        lines.append(f"total per PE: {self.total} bytes ({self.total / 2**20:.1f} MiB)")
        return lines


def dispatch_words_bytes(shape: LayerShape, world_size: int, num_slots: int, max_tokens: int,
                         tokens_per_slot: int) -> int:
    """Bytes of one layer shape's dispatch words on a GPU (symmring.moe.gpu.memory: per-expert counters, the
    fixed words, the window's token bases [slots][ranks] and the timeline stamps)."""
    local = max(1, shape.num_experts // world_size)
    max_chunks = -(-max_tokens // tokens_per_slot)
    fixed = _FIXED_WORDS + (_FP8_WORDS if shape.expert_format == "fp8" else 0)
    return 4 * (_EXPERT_ARRAYS * local + fixed) + 8 * max(1, num_slots) * world_size \
        + 8 * _STAMPS_PER_CHUNK * max_chunks


def pool_meta_bytes(shapes: Sequence[LayerShape], pool_rows: Dict[LayerShape, int]) -> int:
    """Bytes of the pool rows' sources and weights (two arrays carved from one local buffer, 128-byte aligned,
    sized for the shape of the most rows) and of the fp8 rows' group ids (apart, -1 filled)."""
    return max(pool_rows[s] * 20 for s in shapes) + 2 * ALIGN + 4 * group_id_rows(shapes, pool_rows)


def group_id_rows(shapes: Sequence[LayerShape], pool_rows: Dict[LayerShape, int]) -> int:
    """Rows of the fp8 pools' group ids (`m_indices`): the most pool rows of any fp8 shape (0 without one)."""
    return max((pool_rows[s] for s in shapes if s.expert_format == "fp8"), default=0)


def _regions(shapes: Sequence[LayerShape], world_size: int, max_tokens: int, device: str, rdma: bool,
             tokens_per_slot: int, num_slots: int, window_tokens: int,
             rows: Optional[int]) -> Tuple[Dict[LayerShape, int], Dict[str, int]]:
    gpu = device == "gpu"
    pool_rows = {s: window_rows(s, world_size, window_tokens) if rows is None else align_up(rows, s.align)
                 for s in shapes}
    rings = {s.ring_spec(num_slots, tokens_per_slot) for s in shapes}
    regions = dict.fromkeys(REGIONS, 0)
    # Each GPU ring has its combine ready words (one per rank) beside it: generations are per ring.
    ready = align_up(world_size * 8) if gpu else 0
    regions["ring"] = sum(RingLayout(spec, world_size).nbytes + ready for spec in rings)
    if rdma:  # one staging ring beside each ring
        regions["staging"] = sum(RingLayout(dataclasses.replace(spec, num_slots=world_size), world_size).nbytes
                                 for spec in rings)
    row_elem = 2 if gpu else 4
    words = 0 if gpu else align_up(world_size * 8)  # the CPU buffer keeps its ready words first
    regions["combine"] = words + max(max_tokens * s.topk * s.hidden * row_elem for s in shapes)
    if gpu:
        regions["experts"] = max(expert_arena(s, pool_rows[s])["total"][1] for s in shapes)
        regions["scratch"] = max(s.scratch_bytes(pool_rows[s], world_size) for s in shapes)
        entry_map = 4 * max(entry_words(num_slots, world_size, tokens_per_slot, s.topk) for s in shapes)
        regions["dispatch"] = entry_map + pool_meta_bytes(shapes, pool_rows) \
            + sum(dispatch_words_bytes(s, world_size, num_slots, max_tokens, tokens_per_slot) for s in shapes)
        regions["routing"] = max(max_tokens * s.topk * 8 for s in shapes) + 2 * ALIGN
    else:
        # CPU: the pool is float32 rows dequantised from the dispatch format (experts in float64 per pass), as
        # many rows as the largest shape's of the widest hidden (one buffer: _HostMemory.pool_view).
        regions["experts"] = max(pool_rows.values()) * max(s.hidden for s in shapes) * 4
    return pool_rows, regions


def plan(shapes: Iterable[LayerShape], *, world_size: int, max_tokens: int, budget: Optional[int] = None,
         tokens_per_slot: Optional[int] = None, device: str = "gpu", rdma: bool = False,
         pool_rows: Optional[int] = None) -> WorkspacePlan:
    """The workspace for layers of ``shapes`` on ``world_size`` ranks, calls of at most ``max_tokens`` tokens
    per rank.

    Args:
        shapes: `LayerShape` of every layer that will borrow the workspace (duplicates collapse).
        budget: bytes per PE; None: a window of the whole call (``max_tokens``). Otherwise the largest window
            (a multiple of the chunk) whose total fits; a budget too small for a window of one chunk is a
            `ConfigError` naming the smallest that fits.
        tokens_per_slot: the ring's chunk (default: ``max_tokens`` without a budget, else ``min(max_tokens,
            1024)``; windows are whole chunks).
        device: ``"gpu"`` or ``"cpu"``; rdma: allocate the staging ring.
        pool_rows: the pool's rows for every shape instead of the window's (rounded up to the shape's
            alignment; tests force passes with a small pool).

    Raises:
        ConfigError: no shapes, a bad size, or a budget below the smallest workspace.
    """
    shapes = tuple(dict.fromkeys(shapes))
    if not shapes or not all(isinstance(s, LayerShape) for s in shapes):
        raise ConfigError(f"shapes={shapes!r}: expected at least one LayerShape")
    for name, value in (("world_size", world_size), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected an int >= 1")
    if device not in ("gpu", "cpu"):
        raise ConfigError(f"device={device!r}: expected 'gpu' or 'cpu'")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ConfigError(f"budget={budget!r}: expected a positive int of bytes, or None")
    if tokens_per_slot is None:
        tokens_per_slot = max_tokens if budget is None else min(max_tokens, 1024)
    if isinstance(tokens_per_slot, bool) or not isinstance(tokens_per_slot, int) or not 1 <= tokens_per_slot <= max_tokens:
        raise ConfigError(f"tokens_per_slot={tokens_per_slot!r}: expected an int in [1, max_tokens={max_tokens}]")
    num_slots = -(-max_tokens // tokens_per_slot)

    def make(window: int) -> WorkspacePlan:
        rows, regions = _regions(shapes, world_size, max_tokens, device, rdma, tokens_per_slot, num_slots, window,
                                 pool_rows)
        return WorkspacePlan(shapes, world_size, max_tokens, device, rdma, tokens_per_slot, num_slots, window, rows,
                             budget, regions)

    # Windows are whole chunks; the last one may be the whole call even when max_tokens is not a multiple.
    windows = sorted({min(max_tokens, c * tokens_per_slot) for c in range(1, num_slots + 1)})
    if budget is None:
        return make(windows[-1])
    best = None
    for window in windows:  # the total grows with the window
        candidate = make(window)
        if candidate.total > budget:
            break
        best = candidate
    if best is None:
        smallest = make(windows[0])
        raise ConfigError(f"budget={budget}: expected at least {smallest.total} bytes ({smallest.total / 2**20:.1f} "
                          f"MiB: the ring and combine buffer for max_tokens={max_tokens} and a pool for a window of "
                          f"one chunk of {tokens_per_slot} tokens)")
    return best


def heap_bytes(shapes: Iterable[LayerShape], *, world_size: int, max_tokens: int, rdma: bool = True) -> int:
    """Bytes of NVSHMEM's symmetric heap a GPU workspace for ``shapes`` takes without a budget (ring, staging,
    combine and the experts' region): what ``NVSHMEM_SYMMETRIC_SIZE`` must hold, beside any other symmetric
    memory."""
    p = plan(list(shapes), world_size=world_size, max_tokens=max_tokens, rdma=rdma)
    return sum(p.regions[name] for name in SYMMETRIC_REGIONS)


def parse_bytes(text: str) -> int:
    """``"1GiB"``, ``"512MiB"``, ``"1e9"``, ``"1073741824"`` -> bytes.

    Example:
        >>> parse_bytes("1GiB"), parse_bytes("1.5MiB"), parse_bytes("2048")
        (1073741824, 1572864, 2048)
    """
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit):
            t, mult = t[: -len(unit)], scale
            break
    else:
        mult = 1
    try:
        value = float(t) * mult
    except ValueError:
        raise ConfigError(f"budget={text!r}: expected bytes, e.g. 1073741824, 1GiB or 512MiB") from None
    if not value < float("inf") or value != value or value < 1:
        raise ConfigError(f"budget={text!r}: expected a positive size")
    return int(value)


__all__ = ["LayerShape", "WorkspacePlan", "plan", "heap_bytes", "expert_arena", "pool_meta_bytes", "small_path_rows",
           "SMALL_GROUP_ROWS",
           "SYMMETRIC_REGIONS", "uniform_rows", "window_rows", "worst_rows",
           "spanned_rows", "entry_words", "group_id_rows", "num_passes", "PRESETS", "PRESET_ALIASES", "REGIONS",
           "parse_bytes"]
