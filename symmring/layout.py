"""Byte layout of a ring: one symmetric allocation holding every slot and every protocol word.

`RingSpec` is the user-facing shape of a ring (validated up front, `ConfigError` on anything wrong).
`RingLayout` places every region of the ring in one allocation of identical size on every rank, so an
offset valid on one rank is valid on all (NVSHMEM's symmetric heap and the CPU backend's shared window
both rely on that). `DESCRIPTOR_DTYPE` is the device-visible descriptor, mirrored field by field by
``struct RingDescriptor`` in ``device/symmring/descriptor.cuh`` (``tests/test_layout.py`` compiles that
header and checks every offset and the size).

Regions (each starts on a 128-byte boundary; per-slot payloads are 128-byte aligned too, so rows can be
read with 16-byte vector loads and described to the TMA engine)::

    route_ready   uint64 [S]            generation whose topk_idx/topk_weights are published
    layout_ready  uint64 [S]            generation whose x/x_sf are published
    ack_mask      uint64 [S, W]         consumer acknowledgement bits of the current generation
    gen_base      uint64 [1]            device-resident generation base (advanced once per call)
    call          uint64 [1]            call counter: the number of every call's identity (advanced with gen_base)
    error         int64  [8]            error record written by a device wait that timed out (or a detector)
    abort         uint64 [1]            abort word: raised by another PE that recorded an error (0: running)
    meta          int64  [S, 5]         token_base, num_valid, chunk_idx, payload generation, call identity
    x             fp8/bf16 [S, T, H]    activations (fp8 e4m3 stored as uint8, bf16 as uint16)
    x_sf          float32 [S, T, H/G]   per-token, per-G-channel scales (fp8 only; empty for bf16)
    topk_idx      int32  [S, T, K]      expert of each (token, k); -1 = masked
    topk_weights  float32 [S, T, K]     combine weight of each (token, k)
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np

from . import protocol
from .errors import ConfigError

#: Alignment of every region and every per-slot payload, in bytes (16-byte vectors, TMA, cache lines).
ALIGN = 128

#: ``x_format`` values and their element sizes; the codes are ``RingDescriptor::x_format``.
X_FORMATS = {"fp8_e4m3": (0, 1), "bf16": (1, 2)}

#: Columns of the per-slot metadata rows. ``META_CALL_ID``: the identity of the call that wrote the slot
#: (`symmring.protocol.call_identity`: its call number and layer), which a consumer compares with its own.
META_TOKEN_BASE, META_NUM_VALID, META_CHUNK_IDX, META_PAYLOAD_GEN, META_CALL_ID = range(5)
META_COLUMNS = 5

#: Words of the device error record (``ErrorWord`` in descriptor.cuh), and their count.
(ERROR_WORD_KIND, ERROR_WORD_RANK, ERROR_WORD_PEER, ERROR_WORD_SLOT, ERROR_WORD_CHUNK, ERROR_WORD_EXPECTED,
 ERROR_WORD_OBSERVED, ERROR_WORD_MISSING) = range(8)
ERROR_WORDS = 8
(ERROR_KIND_NONE, ERROR_KIND_ROUTE, ERROR_KIND_LAYOUT, ERROR_KIND_REUSE, ERROR_KIND_COMBINE, ERROR_KIND_ABORTED,
 ERROR_KIND_STALE_PAYLOAD, ERROR_KIND_DOUBLE_ACK) = range(8)
#: A consumer found another call's identity in a source's meta row (the ranks' call sequences diverged), and
#: a rank refused its call inside a step (its arguments failed a check no other rank could see).
ERROR_KIND_CALL_MISMATCH, ERROR_KIND_PEER_REFUSED = 8, 9
#: A MoE kernel found more rows than its plan bounded (or a token past its owner's combine rows) and wrote
#: none past its buffer (device/moe/bounds.cuh); the record's ``missing`` word says which bound (OVERFLOW_*).
ERROR_KIND_POOL_OVERFLOW = 10
ERROR_KIND_NAMES = {ERROR_KIND_ROUTE: "route_ready", ERROR_KIND_LAYOUT: "layout_ready",
                    ERROR_KIND_REUSE: "reuse", ERROR_KIND_COMBINE: "combine", ERROR_KIND_ABORTED: "aborted",
                    ERROR_KIND_STALE_PAYLOAD: "stale_payload", ERROR_KIND_DOUBLE_ACK: "double_ack",
                    ERROR_KIND_CALL_MISMATCH: "call_mismatch", ERROR_KIND_PEER_REFUSED: "peer_refused",
                    ERROR_KIND_POOL_OVERFLOW: "pool_overflow"}
#: The bound a pool_overflow record names (the low byte of its ``missing`` word; device/moe/bounds.cuh
#: OverflowBound): the window's rows, one expert's rows (its global id above the byte), a combine token.
OVERFLOW_WINDOW_ROWS, OVERFLOW_EXPERT_ROWS, OVERFLOW_COMBINE_TOKEN = range(3)
#: Kinds that are timeouts of a wait (the others are raised by detectors, or by an abort).
ERROR_TIMEOUT_KINDS = (ERROR_KIND_ROUTE, ERROR_KIND_LAYOUT, ERROR_KIND_REUSE, ERROR_KIND_COMBINE)

#: The abort word (``AbortWord`` in descriptor.cuh): bit fields of the one uint64 a PE that recorded an
#: error stores into every other PE's ``abort`` region (0 while the ring runs).
ABORT_CHUNK_SHIFT, ABORT_PEER_SHIFT, ABORT_ORIGIN_SHIFT, ABORT_KIND_SHIFT, ABORT_FLAG_SHIFT = 0, 24, 40, 56, 63
ABORT_FIELD_BITS = 16
#: The chunk field's largest value: chunks outside [0, ABORT_CHUNK_MAX) are stored as ABORT_CHUNK_MAX.
ABORT_CHUNK_MAX = (1 << (ABORT_PEER_SHIFT - ABORT_CHUNK_SHIFT)) - 1


def pack_abort(origin: int, kind: int, peer: int, chunk: int) -> int:
    """The abort word ``origin`` raises for its error ``kind`` about ``(peer, chunk)`` (as the device's
    ``pack_abort``).

    Example:
        >>> unpack_abort(pack_abort(3, ERROR_KIND_DOUBLE_ACK, 1, 7))
        {'origin': 3, 'kind': 7, 'peer': 1, 'chunk': 7}
    """
    field = (1 << ABORT_FIELD_BITS) - 1
    chunk = ABORT_CHUNK_MAX if chunk < 0 or chunk > ABORT_CHUNK_MAX else chunk
    return ((1 << ABORT_FLAG_SHIFT) | (kind & 0x7F) << ABORT_KIND_SHIFT | (origin & field) << ABORT_ORIGIN_SHIFT
            | (peer & field) << ABORT_PEER_SHIFT | chunk << ABORT_CHUNK_SHIFT)


def unpack_abort(word: int) -> Dict[str, int]:
    """The fields of an abort word: ``origin`` (the PE that recorded the error), its error ``kind``
    (``ERROR_KIND_*``), the ``peer`` and ``chunk`` of its record."""
    word &= (1 << 64) - 1
    field = (1 << ABORT_FIELD_BITS) - 1
    return {"origin": word >> ABORT_ORIGIN_SHIFT & field, "kind": word >> ABORT_KIND_SHIFT & 0x7F,
            "peer": word >> ABORT_PEER_SHIFT & field, "chunk": word >> ABORT_CHUNK_SHIFT & ABORT_CHUNK_MAX}


def align_up(value: int, alignment: int = ALIGN) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive integer")
    return int(value)


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Shape of a chunk ring; every field is checked when the spec is made.

    Args:
        num_slots: slots in the ring (``S``); the producer may run ``num_slots - 1`` chunks ahead.
        tokens_per_slot: tokens per chunk (``T``).
        hidden: channels of ``x`` (``H``); its row must be a multiple of 16 bytes.
        num_topk: experts per token (``K``), ``1 <= num_topk <= num_experts``.
        num_experts: experts of the MoE layer, over all ranks.
        x_format: ``"fp8_e4m3"`` (with ``x_sf`` scales) or ``"bf16"``.
        sf_group_size: channels per fp8 scale (``G``); ``hidden`` must be a multiple of it.

    Raises:
        ConfigError: naming the argument, the value and what was expected.

    Example:
        >>> spec = RingSpec(num_slots=4, tokens_per_slot=128, hidden=7168, num_topk=8, num_experts=256)
        >>> spec.x_format, spec.num_sf                     # fp8 by default: 7168 / 128 scales per token
        ('fp8_e4m3', 56)
    """

    num_slots: int
    tokens_per_slot: int
    hidden: int
    num_topk: int
    num_experts: int
    x_format: str = "fp8_e4m3"
    sf_group_size: int = 128

    def __post_init__(self):
        for name in ("num_slots", "tokens_per_slot", "hidden", "num_topk", "num_experts", "sf_group_size"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.x_format not in X_FORMATS:
            raise ConfigError(f"x_format={self.x_format!r}: expected one of {sorted(X_FORMATS)}")
        if self.num_topk > self.num_experts:
            raise ConfigError(f"num_topk={self.num_topk}: expected at most num_experts={self.num_experts}")
        if (self.hidden * self.x_elem_bytes) % 16:
            raise ConfigError(f"hidden={self.hidden}: a {self.x_format} row must be a multiple of 16 bytes "
                              f"(hidden a multiple of {16 // self.x_elem_bytes})")
        if self.x_format == "fp8_e4m3" and self.hidden % self.sf_group_size:
            raise ConfigError(f"hidden={self.hidden}: expected a multiple of sf_group_size="
                              f"{self.sf_group_size} for fp8_e4m3")

    @property
    def x_elem_bytes(self) -> int:
        return X_FORMATS[self.x_format][1]

    @property
    def x_format_code(self) -> int:
        return X_FORMATS[self.x_format][0]

    @property
    def num_sf(self) -> int:
        """Scale factors per token (0 for bf16, which carries no scales)."""
        return self.hidden // self.sf_group_size if self.x_format == "fp8_e4m3" else 0


@dataclasses.dataclass(frozen=True)
class Region:
    """One region of the ring allocation: ``shape`` elements of ``dtype`` at ``offset`` bytes.

    Per-slot regions have ``slot_stride`` (bytes between slots, >= the slot's payload) and ``slot_shape``;
    their ``shape`` is ``(num_slots, *slot_shape)`` when the stride equals the payload size.
    """

    name: str
    offset: int
    dtype: np.dtype
    slot_shape: Tuple[int, ...]
    num_slots: int
    slot_stride: int

    @property
    def slot_nbytes(self) -> int:
        return int(np.prod(self.slot_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.slot_stride * self.num_slots

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s payload within the ring allocation."""
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"slot={slot}: expected 0 <= slot < num_slots={self.num_slots}")
        return self.offset + slot * self.slot_stride


class RingLayout:
    """Offsets of every region of a ring for ``num_ranks`` ranks; identical on every rank.

    Attributes:
        spec: the `RingSpec`.
        num_ranks: ranks sharing the ring (every one a producer and a consumer).
        mask_words: 64-bit words per acknowledgement mask.
        regions: ``{name: Region}`` in allocation order.
        nbytes: size of the allocation.
    """

    def __init__(self, spec: RingSpec, num_ranks: int):
        self.spec = spec
        self.num_ranks = _positive_int("num_ranks", num_ranks)
        self.mask_words = protocol.mask_words(self.num_ranks)
        S, T, H, K = spec.num_slots, spec.tokens_per_slot, spec.hidden, spec.num_topk
        x_dtype = np.dtype(np.uint8 if spec.x_elem_bytes == 1 else np.uint16)
        entries = [
            # name, dtype, per-slot shape, per-slot (True) or single region (False)
            ("route_ready", np.uint64, (), True),
            ("layout_ready", np.uint64, (), True),
            ("ack_mask", np.uint64, (self.mask_words,), True),
            ("gen_base", np.uint64, (1,), False),
            ("call", np.uint64, (1,), False),
            ("error", np.int64, (ERROR_WORDS,), False),
            ("abort", np.uint64, (1,), False),
            ("meta", np.int64, (META_COLUMNS,), True),
            ("x", x_dtype, (T, H), True),
            ("x_sf", np.float32, (T, spec.num_sf), True),
            ("topk_idx", np.int32, (T, K), True),
            ("topk_weights", np.float32, (T, K), True),
        ]
        self.regions: Dict[str, Region] = {}
        offset = 0
        for name, dtype, shape, per_slot in entries:
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if per_slot and name in ("x", "x_sf", "topk_idx", "topk_weights"):
                stride = align_up(nbytes)  # payloads: every slot 128-byte aligned
            else:
                stride = nbytes  # signal words and metadata are packed arrays
            slots = S if per_slot else 1
            region = Region(name, offset, dtype, tuple(shape), slots, stride)
            self.regions[name] = region
            offset = align_up(offset + region.nbytes)
        self.nbytes = max(offset, ALIGN)

    def __getitem__(self, name: str) -> Region:
        return self.regions[name]

    def __repr__(self) -> str:
        return f"RingLayout({self.spec}, num_ranks={self.num_ranks}, nbytes={self.nbytes})"

    def descriptor(self, base_address: int = 0, *, rank: int = 0, timeout_ns: int = 0,
                   rdma_mask_address: int = 0, call_address: Optional[int] = None) -> np.ndarray:
        """The device-visible descriptor (a 0-d array of `DESCRIPTOR_DTYPE`).

        Pointers are ``base_address + region offset``: the local address of each region; a device reads
        a peer's copy through ``nvshmem_ptr(ptr, pe)`` (same offsets everywhere), or with NVSHMEM's
        one-sided operations for the peers whose bit is set in the ``mask_words`` uint64 words at
        ``rdma_mask_address`` (`symmring.transport.rdma_mask`; 0: every peer p2p). The expected generation
        of chunk ``c`` is ``*gen_base_ptr + c + 1``: read from device memory, never baked into a launch.
        ``call_address``: the call counter the identities come from (`symmring.protocol.call_identity`; a
        workspace's one word that all its rings share), else the ring's own ``call`` region.
        """
        if not 0 <= rank < self.num_ranks:
            raise ConfigError(f"rank={rank}: expected 0 <= rank < num_ranks={self.num_ranks}")
        spec = self.spec
        d = np.zeros((), dtype=DESCRIPTOR_DTYPE)
        for name in ("x", "x_sf", "topk_idx", "topk_weights", "meta", "route_ready", "layout_ready",
                     "ack_mask", "gen_base", "call", "error", "abort"):
            d[f"{name}_ptr"] = base_address + self.regions[name].offset
        if call_address is not None:
            d["call_ptr"] = call_address
        d["rdma_mask_ptr"] = rdma_mask_address
        d["x_slot_stride"] = self.regions["x"].slot_stride
        d["x_sf_slot_stride"] = self.regions["x_sf"].slot_stride
        d["topk_slot_stride"] = self.regions["topk_idx"].slot_stride
        d["timeout_ns"] = timeout_ns
        for name, value in (("num_slots", spec.num_slots), ("tokens_per_slot", spec.tokens_per_slot),
                            ("hidden", spec.hidden), ("num_topk", spec.num_topk),
                            ("num_experts", spec.num_experts), ("num_sf", spec.num_sf),
                            ("sf_group_size", spec.sf_group_size), ("x_format", spec.x_format_code),
                            ("x_elem_bytes", spec.x_elem_bytes), ("rank", rank), ("num_ranks", self.num_ranks),
                            ("mask_words", self.mask_words)):
            d[name] = value
        return d


#: Device-visible ring descriptor; mirrors ``struct RingDescriptor`` in device/symmring/descriptor.cuh.
DESCRIPTOR_DTYPE = np.dtype([
    ("x_ptr", np.uint64),
    ("x_sf_ptr", np.uint64),
    ("topk_idx_ptr", np.uint64),
    ("topk_weights_ptr", np.uint64),
    ("meta_ptr", np.uint64),
    ("route_ready_ptr", np.uint64),
    ("layout_ready_ptr", np.uint64),
    ("ack_mask_ptr", np.uint64),
    ("gen_base_ptr", np.uint64),
    ("call_ptr", np.uint64),
    ("error_ptr", np.uint64),
    ("abort_ptr", np.uint64),
    ("rdma_mask_ptr", np.uint64),
    ("x_slot_stride", np.uint64),
    ("x_sf_slot_stride", np.uint64),
    ("topk_slot_stride", np.uint64),
    ("timeout_ns", np.uint64),
    ("num_slots", np.int32),
    ("tokens_per_slot", np.int32),
    ("hidden", np.int32),
    ("num_topk", np.int32),
    ("num_experts", np.int32),
    ("num_sf", np.int32),
    ("sf_group_size", np.int32),
    ("x_format", np.int32),
    ("x_elem_bytes", np.int32),
    ("rank", np.int32),
    ("num_ranks", np.int32),
    ("mask_words", np.int32),
], align=True)
