"""Python launchers of the ready-made ring kernels (``device/ring.cu``) on the nvshmem backend.

`DeviceRing` owns one ring allocation on GPU PEs (the layout of `symmring.layout.RingLayout`, fresh
slots free, i.e. full acknowledgement masks) and the device copy of its descriptor. `RingKernels`
launches the kernels of one ring on any stream:

* producer: `RingKernels.produce` copies a chunk from user tensors (torch, CuPy, anything with
  ``__cuda_array_interface__`` or DLPack) into this PE's slot and publishes route and/or layout;
  `acquire` and `publish` split that for producers that write the slot themselves.
* consumer: `RingKernels.consume` waits for a chunk of a source rank, pulls its valid rows over NVLink
  (16-byte loads through ``nvshmem_ptr``; from rdma peers, `symmring.transport`, block-wide
  ``nvshmemx_getmem_block`` gets) into local buffers and acknowledges; `ack` acknowledges separately (the
  CONSERVATIVE policy, after the combine).
* `end_call` advances the device-resident generation base (graph-safe), `check_errors` turns the device
  error record and the abort word into a named error (`ProtocolTimeout`, `ProtocolAborted`,
  `StalePayload`, `DoubleAck`), and `reset` (collective) is the one way back after any of them.

SM budget: kernels that spin (consume, acquire) are launched with at most ``MAX_SPIN_BLOCKS`` blocks by
default, so producers and compute always find SMs; every wait is bounded by the ring's timeout.

Every argument is checked before anything is enqueued (``ConfigError``); a rejected call leaves the ring
untouched.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from . import agreement, env, protocol
from . import transport as transport_mod
from .backends.base import DeviceBackend
from .errors import (BackendError, CallMismatch, CallRefused, ConfigError, DoubleAck, PoolOverflow,
                     ProtocolAborted, ProtocolTimeout, RingClosedError, StalePayload, SymmringError)
from .layout import (ABORT_CHUNK_MAX, ERROR_KIND_ABORTED, ERROR_KIND_CALL_MISMATCH, ERROR_KIND_DOUBLE_ACK,
                     ERROR_KIND_NAMES, ERROR_KIND_NONE, ERROR_KIND_PEER_REFUSED, ERROR_KIND_POOL_OVERFLOW,
                     ERROR_KIND_REUSE, ERROR_KIND_STALE_PAYLOAD, ERROR_WORDS, META_COLUMNS, RingLayout, RingSpec,
                     unpack_abort)
from .closing import Closing

logger = logging.getLogger(__name__)

#: Parts of a produce/publish launch (device/ring.cu ProduceFlags).
PRODUCE_ACQUIRE, PRODUCE_ROUTE, PRODUCE_LAYOUT = 1, 2, 4
#: Option of a consume launch (device/ring.cu ConsumeFlags).
CONSUME_ACK = 1
#: Most blocks a spinning kernel gets by default (an H200 has 132 SMs): the rest stay free for producers
#: and compute. Pass ``num_blocks`` (up to the SM count) to pull large slots at full bandwidth.
MAX_SPIN_BLOCKS = 32
#: Threads per block of the ready-made kernels.
THREADS_PER_BLOCK = 512
_PARTS = {"route": PRODUCE_ROUTE, "layout": PRODUCE_LAYOUT, "both": PRODUCE_ROUTE | PRODUCE_LAYOUT}
#: What every device error's text tells the user to do.
RESET_ADVICE = ("the ring stays stopped (its kernels return at once) until reset: call reset() on every rank "
                "(collective: DeviceRing.reset / RingKernels.reset, or the layer's MoE.reset)")
_U64 = (1 << 64) - 1


def _cupy():
    import cupy
    return cupy


_external_streams: Dict[int, object] = {}


def as_stream(stream):
    """A CuPy stream for ``stream``: None (CuPy's current stream), a CuPy stream, a torch.cuda.Stream, or
    a raw ``cudaStream_t`` handle (int)."""
    cupy = _cupy()
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream
    if isinstance(handle, (int, np.integer)):
        handle = int(handle)
        wrapped = _external_streams.get(handle)
        if wrapped is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for protocol objects
                warnings.simplefilter("ignore", DeprecationWarning)
                wrapped = _external_streams[handle] = cupy.cuda.ExternalStream(handle)
        return wrapped
    raise ConfigError(f"stream={stream!r}: expected None, a CuPy stream, a torch.cuda.Stream or a "
                      "cudaStream_t handle (int)")


def _torch_bits(obj, dtype):
    """A torch tensor of a dtype CuPy cannot describe (bf16, fp8) reinterpreted as same-size integers."""
    import torch
    if obj.dtype.itemsize == np.dtype(dtype).itemsize and obj.dtype in (
            torch.bfloat16, torch.float16, getattr(torch, "float8_e4m3fn", None)):
        return obj.view({1: torch.uint8, 2: torch.int16}[obj.dtype.itemsize])
    return obj


def as_device_array(name: str, obj, dtype, shape, *, bits: bool = False):
    """Zero-copy CuPy view of a device tensor (torch, CuPy, ``__cuda_array_interface__``, DLPack),
    checked for dtype, shape and C-contiguity. ``bits``: any dtype of the same size is accepted and
    reinterpreted (fp8/bf16 payloads travel as raw bytes). Raises ConfigError naming ``name``."""
    cupy = _cupy()
    dtype = np.dtype(dtype)
    if obj is None:
        raise ConfigError(f"{name}=None: expected a device tensor of shape {tuple(shape)} and dtype {dtype}")
    if isinstance(obj, np.ndarray):
        raise ConfigError(f"{name}: a NumPy array is host memory; expected a device tensor (torch/CuPy)")
    if bits and type(obj).__module__.startswith("torch"):
        obj = _torch_bits(obj, dtype)
    try:
        arr = obj if isinstance(obj, cupy.ndarray) else (
            cupy.asarray(obj) if hasattr(obj, "__cuda_array_interface__") else cupy.from_dlpack(obj))
    except Exception as exc:
        raise ConfigError(f"{name}: {type(obj).__name__} is not a CUDA device tensor CuPy can view ({exc})") \
            from None
    if bits and arr.dtype != dtype and arr.dtype.itemsize == dtype.itemsize:
        arr = arr.view(dtype)
    if arr.dtype != dtype:
        raise ConfigError(f"{name}.dtype={arr.dtype}: expected {dtype}")
    if tuple(arr.shape) != tuple(shape):
        raise ConfigError(f"{name}.shape={tuple(arr.shape)}: expected {tuple(shape)}")
    if not arr.flags.c_contiguous:
        raise ConfigError(f"{name}: expected a C-contiguous tensor (call .contiguous() first)")
    return arr


def _check_index(name: str, value, upper: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0 or (
            upper is not None and value >= upper):
        bound = f" and < {upper}" if upper is not None else ""
        raise ConfigError(f"{name}={value!r}: expected an int >= 0{bound}")
    return int(value)


class DeviceRing(Closing):
    """One ring's symmetric allocation on GPU PEs, its layout and device descriptor (collective).

    Args:
        backend: an initialised `symmring.backends.base.DeviceBackend` (the nvshmem backend).
        spec: the `RingSpec` (identical on every PE).
        timeout_s: bound of every device wait (default ``SYMMRING_TIMEOUT_S``).
        transport: how this PE reaches each peer (`symmring.transport`: ``"auto"``, ``"p2p"``, ``"rdma"``,
            ``"rdma:1,3"``; None: ``SYMMRING_TRANSPORT``, else ``"auto"``); the result per rank is
            ``ring.transports``.
        call_address: this PE's device address of the uint64 call counter the ring's call identities come
            from (`symmring.protocol.call_identity`; a workspace passes its one word, which all its rings
            share); None: the ring's own ``call`` word. `reset` zeroes only the ring's own.

    Raises:
        ConfigError: bad backend, spec, timeout or transport.
        BackendError: ``transport="p2p"`` and a peer's memory is not load/store reachable (named).

    Example:
        >>> ring = DeviceRing(backend, RingSpec(num_slots=2, tokens_per_slot=64, hidden=512, num_topk=4,  # doctest: +SKIP
        ...                                      num_experts=16, x_format="bf16"))
        >>> k = ring.kernels  # doctest: +SKIP
        >>> k.produce(0, x=x, topk_idx=idx, topk_weights=w, token_base=0, num_valid=64)  # doctest: +SKIP
        >>> out = k.new_outputs(); k.consume(0, src_rank=0, out=out); k.end_call(1)  # doctest: +SKIP
        >>> k.check_errors(); ring.close()  # doctest: +SKIP
    """

    def __init__(self, backend, spec: RingSpec, *, timeout_s: Optional[float] = None, transport=None,
                 call_address: Optional[int] = None):
        if not isinstance(backend, DeviceBackend):
            raise ConfigError(f"backend={backend!r}: expected a DeviceBackend (the nvshmem backend)")
        if not isinstance(spec, RingSpec):
            raise ConfigError(f"spec={spec!r}: expected a RingSpec")
        timeout_s = env.timeout_s() if timeout_s is None else timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s={timeout_s!r}: expected a positive number of seconds")
        transport_mod.request(transport, backend.world_size)  # a bad request fails before the allocation
        # Once, before the allocation: a rank with another spec is a ConfigError naming it, on every rank.
        agreement.exchange_and_check(backend.collectives, dataclasses.asdict(spec), what="DeviceRing spec")
        self.backend = backend
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self.layout = RingLayout(spec, backend.world_size)
        self.alloc = backend.alloc(self.layout.nbytes)
        self.closed = False
        self._init_words()
        try:
            self.kernels = RingKernels(backend, self.layout, self.alloc, timeout_s=self.timeout_s, transport=transport,
                                       call_address=call_address)
        except BackendError:  # every rank (the transport is agreed collectively): give the heap back together
            backend.free(self.alloc)
            raise

    @property
    def transports(self):
        """How this PE reaches each rank: ``"self"``, ``"p2p"`` or ``"rdma"`` (`symmring.transport`)."""
        return self.kernels.transports

    def region(self, name: str, rank: Optional[int] = None):
        """Zero-copy CuPy view of a protocol-word region (``route_ready``, ``layout_ready``, ``ack_mask``,
        ``gen_base``, ``error``, ``abort``, ``meta``) of ``rank``'s copy (default: this PE), all slots."""
        self._check_open()
        region = self.layout[name]
        if region.slot_stride != region.slot_nbytes:
            raise ConfigError(f"name={name!r}: expected a packed word region, not a padded payload")
        shape = (region.num_slots,) + region.slot_shape
        return self.backend.view(self.alloc, self.backend.rank if rank is None else rank, region.offset,
                                 region.dtype, shape)

    def _init_words(self) -> None:
        _fill_full_masks(self.backend, self.layout, self.alloc)
        self.backend.barrier(what="DeviceRing: initial masks")

    def reset(self) -> None:
        """Collective: put the ring back to its initial state after any device error (`RingKernels.reset`)."""
        self._check_open()
        self.kernels.reset()

    def close(self) -> None:
        """Collective, idempotent: free the allocation."""
        if self.closed:
            return
        self.closed = True
        self.kernels.closed = True
        self.backend.free(self.alloc)

    def _check_open(self) -> None:
        if self.closed:
            raise RingClosedError("the device ring was closed")


def _fill_full_masks(backend, layout: RingLayout, alloc) -> None:
    """Fresh slots are free: store full_mask(R) into every slot's acknowledgement mask (on CuPy's stream)."""
    full = np.array(protocol.full_mask(backend.world_size), dtype=np.uint64)
    region = layout["ack_mask"]
    masks = backend.view(alloc, backend.rank, region.offset, region.dtype, (region.num_slots,) + region.slot_shape)
    masks[...] = _cupy().asarray(np.broadcast_to(full, masks.shape))


class RingKernels:
    """Launchers of the ready-made kernels for one ring allocation (see the module docstring).

    Args:
        backend: the `DeviceBackend` holding ``alloc``.
        layout: the ring's `RingLayout`; alloc: its allocation (``alloc.ptr`` is this PE's address).
        timeout_s: bound of every device wait.
        transport: as for `DeviceRing` (`symmring.transport`); the result is ``transports``.
        call_address: as for `DeviceRing`.
    """

    def __init__(self, backend, layout: RingLayout, alloc, *, timeout_s: float, transport=None,
                 call_address: Optional[int] = None):
        cupy = _cupy()
        self.backend = backend
        self.layout = layout
        self.spec = layout.spec
        self.alloc = alloc
        self.timeout_s = float(timeout_s)
        self.closed = False
        #: How this PE reaches each rank ("self", "p2p", "rdma"); rdma peers' bits go to the descriptor.
        self.transports = transport_mod.for_backend(backend, alloc, transport, what="ring")
        # Local words the descriptor points at (kept alive with the kernels; reset() leaves them alone).
        self._rdma_mask = cupy.asarray(transport_mod.rdma_mask(self.transports))
        any_rdma = transport_mod.RDMA in self.transports
        desc = layout.descriptor(alloc.ptr, rank=backend.rank, timeout_ns=int(self.timeout_s * 1e9),
                                 rdma_mask_address=int(self._rdma_mask.data.ptr) if any_rdma else 0,
                                 call_address=call_address)
        self.descriptor = desc
        self.desc = cupy.asarray(np.frombuffer(desc.tobytes(), dtype=np.uint8))
        S, R = self.spec.num_slots, backend.world_size
        # Grid handshake counters: [slot][parts] for produce, then [slot][src] for consume.
        self.counters = cupy.zeros(S * 4 + S * R, dtype=cupy.uint32)
        self._module = backend.library_module("ring")
        self._x_dtype = self.layout["x"].dtype
        # The descriptor copy and the zeroed counters ran on CuPy's stream; kernels may be launched on any
        # (non-blocking) stream next, so they must be complete now.
        cupy.cuda.runtime.deviceSynchronize()

    @classmethod
    def for_ring(cls, ring) -> "RingKernels":
        """Kernels over the allocation of a `symmring.ring.Ring` built on the nvshmem backend."""
        if not isinstance(ring.ctx.backend, DeviceBackend):
            raise ConfigError("ring: expected a Ring on a device backend (the nvshmem backend)")
        return cls(ring.ctx.backend, ring.layout, ring.allocation, timeout_s=ring.timeout_s,
                   transport=ring.transport)

    # --- helpers --------------------------------------------------------------------------------------

    def _fn(self, name: str):
        if self.closed:
            raise RingClosedError("the ring was closed")
        return self._module.function(name)

    def _grid(self, num_blocks: Optional[int], default: int) -> int:
        if num_blocks is None:
            return default
        return _check_index("num_blocks", num_blocks) or 1

    def _payload_blocks(self, num_valid: int) -> int:
        row_bytes = self.spec.hidden * self.spec.x_elem_bytes
        vectors = max(1, num_valid * row_bytes // 16)
        return int(min(MAX_SPIN_BLOCKS, max(1, -(-vectors // (THREADS_PER_BLOCK * 4)))))

    def new_outputs(self) -> Dict[str, object]:
        """Receive buffers for one chunk: ``x`` [T, H], ``x_sf`` [T, num_sf], ``topk_idx`` [T, K],
        ``topk_weights`` [T, K], ``meta`` [`META_COLUMNS`] int64 (token_base, num_valid, chunk_idx, generation,
        call identity).

        Zero-filled and complete on return (synchronised), so any stream may use them at once."""
        cupy = _cupy()
        s = self.spec
        outputs = {"x": cupy.zeros((s.tokens_per_slot, s.hidden), dtype=self._x_dtype),
                "x_sf": cupy.zeros((s.tokens_per_slot, max(s.num_sf, 1)), dtype=cupy.float32),
                "topk_idx": cupy.zeros((s.tokens_per_slot, s.num_topk), dtype=cupy.int32),
                "topk_weights": cupy.zeros((s.tokens_per_slot, s.num_topk), dtype=cupy.float32),
                "meta": cupy.zeros((META_COLUMNS,), dtype=cupy.int64)}
        cupy.cuda.runtime.deviceSynchronize()  # zero fills ran on CuPy's stream
        return outputs

    # --- producer -------------------------------------------------------------------------------------

    def produce(self, chunk: int, *, x=None, x_sf=None, topk_idx=None, topk_weights=None, token_base: int = 0,
                num_valid: int, parts: str = "both", acquire: bool = True, stream=None,
                num_blocks: Optional[int] = None, generation_override: int = 0, layer: int = 0) -> None:
        """Copy chunk ``chunk`` from device tensors into this PE's slot and publish it (enqueued).

        Args:
            chunk: chunk index within the call (generation = gen_base + chunk + 1, read on the device).
            x: [num_valid, H] uint8 (fp8 bytes; torch.float8_e4m3fn accepted) or uint16/bf16; layout part.
            x_sf: [num_valid, num_sf] float32 (fp8 rings only); layout part.
            topk_idx: [num_valid, K] int32; topk_weights: [num_valid, K] float32; route part.
            token_base: logical index of the chunk's first token; num_valid: valid tokens (0..T).
            parts: ``"route"``, ``"layout"`` or ``"both"``.
            acquire: wait for the previous use's acknowledgements first (and reset the mask). Use False
                only after an explicit `acquire` of this chunk. A chunk produced in two parts
                (``parts="route"`` and ``parts="layout"``, either order, one stream or two) may acquire in
                both: a part also stops waiting once the other part of this generation is published (that
                part acquired the slot and may have reset the mask already).
            stream: where to enqueue (see `as_stream`); num_blocks: grid size (default by size).
            generation_override: tests only; publishes that generation instead of the device one.
            layer: the layer of the call identity the meta row carries (`symmring.protocol.call_identity`, with
                the device's call number); consumers pass the same (0 for a ring of one kind of call).

        Raises:
            ConfigError: bad chunk, counts, parts, shapes, dtypes or non-device tensors (nothing enqueued).
        """
        s = self.spec
        chunk = _check_index("chunk", chunk)
        layer = _check_index("layer", layer, 1 << protocol.CALL_LAYER_BITS)
        num_valid = _check_index("num_valid", num_valid, s.tokens_per_slot + 1)
        token_base = _check_index("token_base", token_base)
        if parts not in _PARTS:
            raise ConfigError(f"parts={parts!r}: expected one of {sorted(_PARTS)}")
        flags = _PARTS[parts] | (PRODUCE_ACQUIRE if acquire else 0)
        null = np.uint64(0)
        args_x = args_sf = args_idx = args_w = null
        if flags & PRODUCE_LAYOUT:
            args_x = as_device_array("x", x, self._x_dtype, (num_valid, s.hidden), bits=True) if num_valid else null
            if s.num_sf:
                args_sf = as_device_array("x_sf", x_sf, np.float32, (num_valid, s.num_sf)) if num_valid else null
            elif x_sf is not None:
                raise ConfigError(f"x_sf: a {s.x_format} ring carries no scales; expected None")
        if flags & PRODUCE_ROUTE:
            if num_valid:
                args_idx = as_device_array("topk_idx", topk_idx, np.int32, (num_valid, s.num_topk))
                args_w = as_device_array("topk_weights", topk_weights, np.float32, (num_valid, s.num_topk))
        slot = protocol.slot_of(chunk, s.num_slots)
        counter = self.counters[slot * 4 + (flags >> 1 & 3):]
        grid = self._grid(num_blocks, self._payload_blocks(num_valid))
        self._fn("symmring_produce")(
            (grid,), (THREADS_PER_BLOCK,),
            (self.desc, np.int32(chunk), args_x, args_sf, args_idx, args_w, np.int64(token_base),
             np.int32(num_valid), np.int32(flags), counter, np.uint64(generation_override), np.int32(layer)),
            stream=as_stream(stream))

    def acquire(self, chunk: int, *, stream=None) -> None:
        """Enqueue: wait until the slot of ``chunk`` is acknowledged by every consumer, then reset its mask."""
        chunk = _check_index("chunk", chunk)
        self._fn("symmring_acquire")((1,), (32,), (self.desc, np.int32(chunk)), stream=as_stream(stream))

    def publish(self, chunk: int, *, parts: str = "both", stream=None, generation_override: int = 0) -> None:
        """Enqueue the publication of a slot whose payload was written earlier on ``stream``."""
        chunk = _check_index("chunk", chunk)
        if parts not in _PARTS:
            raise ConfigError(f"parts={parts!r}: expected one of {sorted(_PARTS)}")
        self._fn("symmring_publish")((1,), (32,), (self.desc, np.int32(chunk), np.int32(_PARTS[parts]),
                                                   np.uint64(generation_override)), stream=as_stream(stream))

    # --- consumer -------------------------------------------------------------------------------------

    def consume(self, chunk: int, src_rank: int, out: Dict[str, object], *, ack: bool = True, stream=None,
                num_blocks: Optional[int] = None, generation_override: int = 0, layer: int = 0) -> None:
        """Enqueue: wait for ``src_rank``'s chunk, pull its valid rows into ``out`` (`new_outputs`), and
        (``ack``) acknowledge it. ``out["meta"]`` receives token_base, num_valid, chunk_idx, generation and
        call identity. The slot must hold this chunk's generation and this PE's call of ``layer`` (the
        producer's ``layer``): else a `StalePayload` or `CallMismatch` record, and nothing is pulled.
        Like every launcher here it only orders against ``stream``: buffers written on another stream
        must be made ready for it by the caller (event or synchronisation).

        Raises ConfigError for a bad chunk, rank or buffer (nothing enqueued).
        """
        s = self.spec
        chunk = _check_index("chunk", chunk)
        src_rank = _check_index("src_rank", src_rank, self.backend.world_size)
        layer = _check_index("layer", layer, 1 << protocol.CALL_LAYER_BITS)
        if not isinstance(out, dict):
            raise ConfigError(f"out={type(out).__name__}: expected the dict of new_outputs()")
        bufs = (as_device_array("out['x']", out.get("x"), self._x_dtype, (s.tokens_per_slot, s.hidden), bits=True),
                as_device_array("out['x_sf']", out.get("x_sf"), np.float32, (s.tokens_per_slot, max(s.num_sf, 1))),
                as_device_array("out['topk_idx']", out.get("topk_idx"), np.int32, (s.tokens_per_slot, s.num_topk)),
                as_device_array("out['topk_weights']", out.get("topk_weights"), np.float32,
                                (s.tokens_per_slot, s.num_topk)),
                as_device_array("out['meta']", out.get("meta"), np.int64, (META_COLUMNS,)))
        slot = protocol.slot_of(chunk, s.num_slots)
        counter = self.counters[s.num_slots * 4 + slot * self.backend.world_size + src_rank:]
        grid = self._grid(num_blocks, self._payload_blocks(s.tokens_per_slot))
        self._fn("symmring_consume")(
            (grid,), (THREADS_PER_BLOCK,),
            (self.desc, np.int32(chunk), np.int32(src_rank), *bufs, np.int32(CONSUME_ACK if ack else 0), counter,
             np.uint64(generation_override), np.int32(layer)), stream=as_stream(stream))

    def ack(self, chunk: int, src_rank: int, *, stream=None) -> None:
        """Enqueue this PE's acknowledgement of ``src_rank``'s chunk (after its last use of the data)."""
        chunk = _check_index("chunk", chunk)
        src_rank = _check_index("src_rank", src_rank, self.backend.world_size)
        self._fn("symmring_ack")((1,), (32,), (self.desc, np.int32(chunk), np.int32(src_rank)),
                                 stream=as_stream(stream))

    def end_call(self, num_chunks: int, *, stream=None) -> None:
        """Enqueue the end of a call: gen_base += num_chunks and the call number += 1 on the device (once per
        call, after every producer and consumer of the call in stream order)."""
        num_chunks = _check_index("num_chunks", num_chunks)
        self._fn("symmring_end_call")((1,), (32,), (self.desc, np.int32(num_chunks)), stream=as_stream(stream))

    # --- state and errors -----------------------------------------------------------------------------

    def _words(self, name: str, count: int, dtype):
        return self.backend.view(self.alloc, self.backend.rank, self.layout[name].offset, dtype, (count,))

    def gen_base(self) -> int:
        """The device-resident generation base (synchronises the device)."""
        _cupy().cuda.runtime.deviceSynchronize()
        return int(self._words("gen_base", 1, np.uint64)[0].get())

    def call_number(self) -> int:
        """The device-resident call number (synchronises the device): the ``number`` of the call identity
        (`symmring.protocol.call_identity`) this ring's kernels write into, and expect in, the meta rows."""
        cupy = _cupy()
        cupy.cuda.runtime.deviceSynchronize()
        word = np.zeros(1, np.uint64)  # the descriptor's call_ptr: the ring's own word or the workspace's
        cupy.cuda.runtime.memcpy(word.ctypes.data, int(self.descriptor["call_ptr"]), 8,
                                 cupy.cuda.runtime.memcpyDeviceToHost)
        return int(word[0])

    def check_errors(self, *, synchronize: bool = True) -> None:
        """Raise the device error of this PE, if any (its first one), after synchronising the device.

        Raises:
            ProtocolTimeout: a device wait of this PE expired (kind ``route_ready``, ``layout_ready``,
                ``reuse`` or ``combine``: who waited for whom, on which slot and chunk, expected and observed).
            ProtocolAborted: a wait (or kernel) of this PE gave up because another PE recorded an error
                first; names that PE and its error.
            StalePayload, DoubleAck, CallMismatch: a device detector found the protocol broken
                (`ProtocolViolation`); CallRefused: this PE refused a call inside a step.
            PoolOverflow: a MoE kernel found more rows than its call's plan bounded and wrote none past its buffer
                (`ProtocolViolation`; the ranks planned different calls).

        The error is also recorded with the context's collectives (`Collectives.record_fault`: until a
        collective completes on every rank, exiting aborts the job rather than waiting for a rank that may
        be gone). The record and the abort word stay set -- every later kernel of the ring returns at once
        -- until `reset` (collective) clears them on every PE.
        """
        cupy = _cupy()
        if synchronize:
            cupy.cuda.runtime.deviceSynchronize()
        record = [int(v) for v in self._words("error", ERROR_WORDS, np.int64).get()]
        abort_word = int(self._words("abort", 1, np.uint64).get()[0])
        error = self._device_error(record, abort_word)
        if error is None:
            return
        collectives = getattr(self.backend, "collectives", None)
        if collectives is not None:
            collectives.record_fault(error)
        raise error

    def _device_error(self, record, abort_word: int, *, read_masks: bool = True) -> Optional[SymmringError]:
        """The error a record and an abort word describe (None when both are clear). ``read_masks``: name a
        reuse timeout's missing ranks from the slot's mask as it is now (a copy from the device) rather than
        from the record's missing bits (False: no device access, for `AsyncErrorLatch`)."""
        kind, rank, peer, slot, chunk, expected, observed, missing = record
        names = ERROR_KIND_NAMES
        if kind == ERROR_KIND_NONE and abort_word == 0:
            return None
        if kind in (ERROR_KIND_NONE, ERROR_KIND_ABORTED):
            # Aborted: by the record (a wait that gave up: observed holds the abort word) or, when a kernel
            # returned at entry before any wait, by the abort word alone.
            info = unpack_abort(observed if kind == ERROR_KIND_ABORTED else abort_word)
            origin_chunk = None if info["chunk"] == ABORT_CHUNK_MAX else info["chunk"]
            common = dict(origin=info["origin"], origin_kind=names.get(info["kind"], f"kind {info['kind']}"),
                          origin_peer=info["peer"], origin_chunk=origin_chunk, advice=RESET_ADVICE)
            if kind == ERROR_KIND_NONE:
                return ProtocolAborted(rank=self.backend.rank, **common)
            return ProtocolAborted(rank=rank, waited=names.get(missing, f"kind {missing}"), slot=slot, chunk=chunk,
                                   expected=expected & _U64, **common)
        if kind == ERROR_KIND_STALE_PAYLOAD:
            return StalePayload(rank=rank, peer=peer, slot=slot, chunk=chunk, expected=expected & _U64,
                                observed=observed & _U64, observed_chunk=missing, advice=RESET_ADVICE)
        if kind == ERROR_KIND_DOUBLE_ACK:
            return DoubleAck(rank=rank, peer=peer, slot=slot, chunk=chunk, expected=expected & _U64,
                             observed=observed & _U64, advice=RESET_ADVICE)
        if kind == ERROR_KIND_POOL_OVERFLOW:  # bound and found are signed (a token below 0 is one)
            return PoolOverflow(rank=rank, peer=peer, slot=slot, chunk=chunk, expected=expected, observed=observed,
                                what=missing & _U64, advice=RESET_ADVICE)
        if kind == ERROR_KIND_CALL_MISMATCH:
            return CallMismatch(rank=rank, peer=peer, slot=slot, chunk=chunk, expected=expected & _U64,
                                observed=observed & _U64, advice=RESET_ADVICE)
        if kind == ERROR_KIND_PEER_REFUSED:
            return CallRefused(rank=rank, expected=expected & _U64, advice=RESET_ADVICE)
        missing_ranks = ()
        if kind == ERROR_KIND_REUSE and read_masks:
            W = self.layout.mask_words
            masks = self.backend.view(self.alloc, self.backend.rank, self.layout["ack_mask"].offset + slot * W * 8,
                                      np.uint64, (W,)).get()
            missing_ranks = protocol.missing_ranks([int(m) for m in masks],
                                                   protocol.full_mask(self.backend.world_size))
        if kind == ERROR_KIND_REUSE:
            if not missing_ranks:  # arrived after the timeout, or not read: report what the device saw
                missing_ranks = protocol.missing_ranks([_U64 - (missing & _U64)], [expected & _U64])
            peer = None
        return ProtocolTimeout(names.get(kind, f"kind {kind}"), rank=rank, peer=peer, slot=slot, chunk=chunk,
                               expected=expected & _U64, observed=observed & _U64, missing_ranks=missing_ranks,
                               timeout_s=self.timeout_s, advice=RESET_ADVICE)

    def reset(self) -> None:
        """Collective: the one recovery path after any device error (or to start afresh). On every PE:
        wait until the device is idle and every PE arrived (so no kernel anywhere can still write an
        acknowledgement or an abort word into this PE), zero the whole ring allocation (ready words, masks,
        generation base, payload, meta, error record, abort word), zero the grid counters, store the full
        initial masks, and meet every PE again before returning. Afterwards the ring is as new.

        Raises:
            PeerTimeout: a PE did not reach the reset within the bound.
            RingClosedError: the ring was closed.
        """
        if self.closed:
            raise RingClosedError("the ring was closed")
        cupy = _cupy()
        self.backend.barrier(what="RingKernels.reset: every device idle")
        # One stream, in order: the zeroing, then the counters, then the full masks (a memset on the legacy
        # stream could land after a fill on a non-blocking current stream and clear the fresh masks).
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memsetAsync(self.alloc.ptr, 0, self.alloc.nbytes, stream.ptr)
        self.counters.fill(0)
        _fill_full_masks(self.backend, self.layout, self.alloc)
        cupy.cuda.runtime.deviceSynchronize()
        self.backend.barrier(what="RingKernels.reset: ring cleared")


# --- asynchronous errors (NCCL's ncclCommGetAsyncError) ---------------------------------------------------

#: Words of `AsyncErrorLatch`'s host-mapped status (device/ring.cu LatchWord): the error record
#: (`ERROR_WORDS`), the abort word, then the flag the device sets last.
LATCH_ABORT, LATCH_FLAG, LATCH_WORDS = ERROR_WORDS, ERROR_WORDS + 1, ERROR_WORDS + 2
#: Threads and most blocks of a latch launch (it only works, poisoning the output, after an error).
_LATCH_THREADS, _LATCH_MAX_BLOCKS = 256, 64


class AsyncErrorLatch:
    """A ring's device error, latched in pinned host-mapped memory so the host sees it without synchronising.

    `enqueue` puts ``symmring_error_latch`` (device/ring.cu) on a stream after a call's kernels: when the PE has
    an error pending (its record, or another PE's abort) the kernel fills the call's bf16 output with NaN and,
    the first time, copies the record and the abort word into the host words and sets the flag. `latched`
    and `error` read those words (plain host loads: no device call, no synchronisation), so a serving loop
    learns of a device error on its next call, as NCCL reports ``ncclCommGetAsyncError``. The latch stays set
    until `clear` (after the collective reset, when every device is idle).

    Args:
        kernels: the ring's `RingKernels` (its descriptor and module).
    """

    def __init__(self, kernels: "RingKernels"):
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        self.kernels = kernels
        # Mapped and portable: with unified addressing (every 64-bit CUDA process) the kernel uses the host
        # pointer itself.
        flags = getattr(runtime, "hostAllocMapped", 2) | getattr(runtime, "hostAllocPortable", 1)
        self._ptr = int(runtime.hostAlloc(LATCH_WORDS * 8, flags))
        self.words = np.ctypeslib.as_array((ctypes.c_uint64 * LATCH_WORDS).from_address(self._ptr))
        self.words[:] = 0

    def enqueue(self, stream, poison=None) -> None:
        """Enqueue the latch on ``stream`` (see `as_stream`), after the call's last kernel there; ``poison``: the
        call's contiguous 2-byte (bf16) output, NaN-filled when an error is pending (None: nothing)."""
        ptr, count = 0, 0
        if poison is not None and poison.numel():
            if poison.element_size() != 2 or not poison.is_contiguous():
                raise ConfigError("poison: expected a contiguous 2-byte (bf16) tensor")
            ptr, count = int(poison.data_ptr()), int(poison.numel())
        grid = max(1, min(_LATCH_MAX_BLOCKS, -(-count // (_LATCH_THREADS * 8))))
        self.kernels._fn("symmring_error_latch")(
            (grid,), (_LATCH_THREADS,), (self.kernels.desc, np.uint64(self._ptr), np.uint64(ptr), np.int64(count)),
            stream=as_stream(stream))

    def latched(self) -> Optional[List[int]]:
        """The latched words (record, then abort word; int64 values), or None while nothing is latched."""
        if int(self.words[LATCH_FLAG]) == 0:
            return None
        return [int(v) for v in self.words[:LATCH_FLAG].view(np.int64)]

    def error(self) -> Optional[SymmringError]:
        """This PE's latched device error as the named exception (not raised), or None."""
        words = self.latched()
        return None if words is None else self.error_of(words)

    def error_of(self, words: Sequence[int]) -> SymmringError:
        """The named exception of latched ``words`` (`latched`'s list, e.g. as exchanged with the other ranks)."""
        return self.kernels._device_error(list(words[:ERROR_WORDS]), words[LATCH_ABORT] & _U64, read_masks=False)

    def clear(self) -> None:
        """Forget the latched error: only once no kernel can latch again (after the collective reset)."""
        self.words[:] = 0

    def close(self) -> None:
        """Free the host words (synchronises the device first: a latch kernel may still be queued)."""
        if self._ptr:
            runtime = _cupy().cuda.runtime
            runtime.deviceSynchronize()
            self.words = None
            runtime.freeHost(self._ptr)
            self._ptr = 0


def exchanged_error(rank: int, latched: Sequence[Optional[Sequence[int]]],
                    decode: Callable[[Sequence[int]], SymmringError]) -> Optional[SymmringError]:
    """The error rank ``rank`` raises for every rank's latched words ``latched`` (exchanged: the same list on every
    rank, so every rank raises, or none): its own, decoded from the words it sent (``decode``:
    `AsyncErrorLatch.error_of`; never re-read from its latch, which a reset may have cleared since), where it
    latched one; else a `ProtocolAborted` naming the first other rank that did (`peer_async_error`). None when no
    rank latched anything.

    Example:
        >>> from symmring import layout
        >>> words = [layout.ERROR_KIND_REUSE, 0, 2, 0, 1, 7, 3, 4, 0]
        >>> exchanged_error(0, [words, None], decode=lambda w: RuntimeError(f"own kind {w[0]}"))
        RuntimeError('own kind 3')
        >>> exchanged_error(1, [None, None], decode=None) is None
        True
    """
    if latched[rank] is not None:
        return decode(latched[rank])
    return peer_async_error(rank, latched)


def peer_async_error(rank: int, latched: Sequence[Optional[Sequence[int]]]) -> Optional[ProtocolAborted]:
    """The error rank ``rank`` raises when another rank's latch holds a device error (``latched[r]``: rank r's
    `AsyncErrorLatch.latched` words, gathered in the call's token-count exchange, so every rank sees the same
    list) and its own does not hold one yet: a `ProtocolAborted` naming the lowest such rank as the origin, with
    that rank's error kind, peer and chunk. None when no other rank latched anything.

    Example:
        >>> from symmring import layout
        >>> words = [layout.ERROR_KIND_REUSE, 0, 2, 0, 1, 7, 3, 4, 0]  # rank 0: reuse wait, rank 2 never acked
        >>> print(peer_async_error(1, [words, None, None]))  # doctest: +ELLIPSIS
        rank 1: rank 0 latched a device error (reuse about rank 2, chunk 1); this call was not enqueued...
    """
    for origin, words in enumerate(latched):
        if words is None or origin == rank:
            continue
        kind, record_rank, peer, chunk = words[0], words[1], words[2], words[4]
        if kind in (ERROR_KIND_NONE, ERROR_KIND_ABORTED):  # that rank was itself aborted: name the first origin
            info = unpack_abort(words[6] if kind == ERROR_KIND_ABORTED else words[LATCH_ABORT])
            kind, record_rank, peer = info["kind"], info["origin"], info["peer"]
            chunk = None if info["chunk"] == ABORT_CHUNK_MAX else info["chunk"]
        name = ERROR_KIND_NAMES.get(kind, f"kind {kind}")
        error = ProtocolAborted(rank=rank, origin=record_rank, origin_kind=name, origin_peer=peer, origin_chunk=chunk,
                                advice=RESET_ADVICE)
        at = f", chunk {chunk}" if chunk is not None else ""
        via = f" (reported by rank {origin})" if record_rank != origin else ""
        error.args = (f"rank {rank}: rank {record_rank} latched a device error ({name} about rank {peer}{at}){via}; "
                      f"this call was not enqueued on any rank; {RESET_ADVICE}",)
        return error
    return None
