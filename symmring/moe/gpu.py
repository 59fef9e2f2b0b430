"""The expert-parallel MoE layer on GPUs, batch-ready path: one chunk per call, through the NVSHMEM ring.

Every rank (PE) owns ``num_experts / world_size`` consecutive experts and its own tokens. One `MoE.forward`
enqueues, on the current torch stream, with no host synchronisation:

1. **route** (producer): router GEMM and TopK in torch (`symmring.moe.torch_ref.route`, the definitions
   of `symmring.moe.reference`), then ``moe_produce_route`` (device/producer.cu): acquire the ring slot
   (every consumer acknowledged the previous call), copy ``topk_idx``/``topk_weights`` and the metadata
   into it, publish route readiness.
2. **layout** (producer): ``moe_produce_layout_fp8`` reads bf16 ``x`` and writes fp8 e4m3 ``x`` with
   per-token, per-128-channel float32 ``x_sf`` straight into the slot (bitwise `symmring.moe.quant`),
   then publishes layout readiness; ``moe_produce_layout_bf16`` copies bf16 rows instead.
3. **dispatch** (device/dispatch.cu): wait for both readiness generations of every source rank; count
   the (token, k) entries routed to each local expert; scan to expert-contiguous row offsets (they stay
   on the device and feed ``torch._grouped_mm``'s ``offs``); pull every routed row over NVLink with
   16-byte loads, dequantising fp8 to bf16 on the way, and record its source (rank, token, k).
4. **experts**: L1 (gate and up, one grouped GEMM), SwiGLU, L2 (grouped GEMM), all bf16 with float32
   accumulation (``torch._grouped_mm``).
5. **combine** (device/combine.cu): store every output row at its (token, k) place in the owner's
   symmetric combine buffer, signal each owner, acknowledge its ring slot (the CONSERVATIVE policy);
   then wait for every rank's signal and reduce each token's rows over k in fixed order, weighted by
   ``topk_weights``, into ``y`` (bf16). Masked (-1) entries contribute nothing.

Capacity: the expert pool has ``world_size * max_tokens * topk`` rows, one per possible (source rank,
token, k), so no routing can overflow it (no device overflow flag is needed); ``max_tokens`` (tokens per
rank per call) is fixed at construction and a larger batch is a ConfigError before anything is enqueued.

Errors: a device wait that times out (``SYMMRING_TIMEOUT_S``) writes the ring's error record and every
later kernel returns at once; `MoE.check_errors` (which synchronises) raises the `ProtocolTimeout`. With
``SYMMRING_DEBUG=1`` every forward checks. After a timeout, `MoE.reset` (collective) makes the layer
usable again.

Example:
    >>> ctx = symmring.context.init("nvshmem")
    >>> moe = MoE(ctx, num_experts=8, hidden=1024, inter=512, topk=2, w_gate=wg, w_up=wu, w_down=wd,
    ...           max_tokens=4096)
    >>> y = moe.forward(x, router_weight=router)        # x: [n, 1024] bf16 on this rank's GPU
    >>> moe.check_errors(); moe.close()
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import env, protocol
from ..errors import BackendError, ConfigError, ProtocolTimeout, RingClosedError
from ..layout import ALIGN, RingSpec, align_up
from . import torch_ref

logger = logging.getLogger(__name__)

#: Threads per block of the MoE kernels (8 warps).
THREADS_PER_BLOCK = 256
WARPS_PER_BLOCK = THREADS_PER_BLOCK // 32
#: Grid caps: enough blocks to fill an H200 (132 SMs) several times over, few enough to stay cheap.
MAX_BLOCKS = 1056
#: Blocks of the route kernel, whose blocks all poll the acknowledgement mask while they wait.
MAX_ROUTE_BLOCKS = 16
#: Largest top-k the dispatch kernel handles (one lane per k).
MAX_TOPK = 32
#: Bits of the device status word (device/dispatch.cu MoeStatus).
STATUS_NO_PEER_MAPPING = 1
#: fp8 scale group the fused layout kernel implements.
FP8_GROUP_SIZE = 128
#: Stage names of `MoE.forward(stage_events=...)`, in order.
STAGES = ("route", "layout", "dispatch", "experts", "combine")
#: Device sources of the layer, by short name (device/<name>.cu).
SOURCES = ("producer", "dispatch", "combine")

#: Loaded modules per backend: every MoE on a backend shares them (loading is collective per node).
_modules_by_backend: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _torch():
    import torch
    return torch


def _cupy():
    import cupy
    return cupy


def _ptr(tensor) -> np.uint64:
    """A tensor's device address as a kernel argument."""
    return np.uint64(tensor.data_ptr())


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an int >= {minimum}")
    return int(value)


def _blocks(num_items: int, per_block: int, cap: int = MAX_BLOCKS) -> int:
    return max(1, min(cap, -(-num_items // per_block)))


def _load_modules(backend) -> Dict[str, object]:
    """The layer's compiled modules on ``backend`` (compiled and registered once per backend)."""
    modules = _modules_by_backend.get(backend)
    if modules is None:
        from .. import jit
        modules = {name: backend.load_module(jit.read_source(f"{name}.cu"), name=f"moe_{name}")
                   for name in SOURCES}
        _modules_by_backend[backend] = modules
    return modules


class MoE:
    """Expert-parallel MoE layer on GPU PEs (batch-ready: the whole batch is one ring chunk).

    Args:
        ctx: a `symmring.context.Context` on the ``nvshmem`` backend.
        num_experts: experts over all ranks; a multiple of ``ctx.world_size``.
        hidden, inter: model and expert intermediate sizes (multiples of 128 for fp8, of 8 for bf16;
            ``inter`` a multiple of 8).
        topk: experts per token (``1 <= topk <= min(32, num_experts)``).
        w_gate, w_up: this rank's experts, bf16 CUDA tensors ``[num_experts / world_size, inter, hidden]``
            (``nn.Linear`` layout, Mixtral's ``w1``/``w3``); w_down: ``[num_experts / world_size, hidden,
            inter]`` (``w2``). Copied once into the fused ``[E, 2 * inter, hidden]`` L1 weight.
        max_tokens: most tokens per rank per call (the ring slot's capacity).
        x_format: dispatch format, ``"fp8_e4m3"`` (per-token, per-128-channel scales) or ``"bf16"``.
        scoring: ``"softmax"`` (Mixtral) or ``"sigmoid_bias"`` (DeepSeek-V3); bias and
            routed_scaling_factor: as in `symmring.moe.reference.select_topk`.

    Raises:
        ConfigError: any bad argument, named, before any collective work.
        BackendError: the context is not on the nvshmem backend, or torch is missing.

    Example:
        >>> moe = MoE(ctx, num_experts=8, hidden=1024, inter=512, topk=2, w_gate=wg, w_up=wu, w_down=wd,
        ...           max_tokens=1024)
        >>> y = moe.forward(x, logits=logits)
    """

    def __init__(self, ctx, num_experts: int, hidden: int, inter: int, topk: int, w_gate, w_up, w_down, *,
                 max_tokens: int, x_format: str = "fp8_e4m3", scoring: str = "softmax", bias=None,
                 routed_scaling_factor: float = 1.0):
        torch = _torch()
        if getattr(getattr(ctx, "backend", None), "name", None) != "nvshmem":
            raise BackendError(f"ctx: expected a context on the 'nvshmem' backend, got "
                               f"{getattr(getattr(ctx, 'backend', None), 'name', ctx)!r}")
        ctx.check_open()
        self.ctx = ctx
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.num_experts = _check_int("num_experts", num_experts)
        self.hidden = _check_int("hidden", hidden)
        self.inter = _check_int("inter", inter)
        self.topk = _check_int("topk", topk)
        self.max_tokens = _check_int("max_tokens", max_tokens)
        if self.num_experts % self.world_size:
            raise ConfigError(f"num_experts={num_experts}: expected a multiple of world_size={self.world_size} "
                              "(experts are split evenly)")
        if self.topk > min(MAX_TOPK, self.num_experts):
            raise ConfigError(f"topk={topk}: expected at most min({MAX_TOPK}, num_experts={num_experts})")
        if x_format not in ("fp8_e4m3", "bf16"):
            raise ConfigError(f"x_format={x_format!r}: expected 'fp8_e4m3' or 'bf16'")
        multiple = FP8_GROUP_SIZE if x_format == "fp8_e4m3" else 8
        if self.hidden % multiple:
            raise ConfigError(f"hidden={hidden}: expected a multiple of {multiple} for x_format={x_format!r}")
        if self.inter % 8:
            raise ConfigError(f"inter={inter}: expected a multiple of 8 (16-byte rows for the grouped GEMM)")
        if scoring not in torch_ref.SCORINGS:
            raise ConfigError(f"scoring={scoring!r}: expected one of {list(torch_ref.SCORINGS)}")
        self.num_local_experts = self.num_experts // self.world_size
        self.expert_begin = self.rank * self.num_local_experts
        self.x_format = x_format
        self.scoring = scoring
        self.routed_scaling_factor = float(routed_scaling_factor)
        device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        local_shape = (self.num_local_experts, self.inter, self.hidden)
        for name, w, shape in (("w_gate", w_gate, local_shape), ("w_up", w_up, local_shape),
                               ("w_down", w_down, (self.num_local_experts, self.hidden, self.inter))):
            self._check_tensor(name, w, torch.bfloat16, shape)
        self.bias = None
        if bias is not None:
            self._check_tensor("bias", bias, None, (self.num_experts,))
            self.bias = bias.float()
        # L1 as one grouped GEMM: [E, 2I, H] (gate rows, then up rows); grouped_mm takes its [E, H, 2I] view.
        self.w13 = torch_ref.fuse_gate_up(w_gate, w_up)
        self.w_down = w_down.contiguous()
        self._w13_t, self._w_down_t = self.w13.transpose(1, 2), self.w_down.transpose(1, 2)  # [E, K, N] views

        from ..kernels import DeviceRing  # the nvshmem ring allocation + descriptor (GPU runtime)
        backend = ctx.backend
        self.backend = backend
        self.spec = RingSpec(num_slots=1, tokens_per_slot=self.max_tokens, hidden=self.hidden,
                             num_topk=self.topk, num_experts=self.num_experts, x_format=x_format,
                             sf_group_size=FP8_GROUP_SIZE)
        self.ring = DeviceRing(backend, self.spec, timeout_s=ctx.timeout_s,
                               ack_policy=protocol.AckPolicy.CONSERVATIVE)
        # Combine buffer (symmetric): combine_ready[world_size] uint64, then rows [T][K][H] bf16.
        self._rows_offset = align_up(self.world_size * 8, ALIGN)
        rows_bytes = self.max_tokens * self.topk * self.hidden * 2
        self.combine_alloc = backend.alloc(self._rows_offset + rows_bytes)
        # Local addresses; the kernels reach a peer's copy through nvshmem_ptr.
        self._combine_ready_ptr = np.uint64(backend.address(self.combine_alloc, self.rank, 0))
        self._combine_rows_ptr = np.uint64(backend.address(self.combine_alloc, self.rank, self._rows_offset))
        self._modules = _load_modules(backend)

        # Local device buffers (fixed size: no allocation depends on the routing).
        self.capacity = self.world_size * self.max_tokens * self.topk
        E = self.num_local_experts
        i32 = dict(dtype=torch.int32, device=device)
        self.counts = torch.zeros(E, **i32)
        self.begin = torch.zeros(E, **i32)
        self.group_end = torch.zeros(E, **i32)  # torch._grouped_mm offs: cumulative row ends
        self.cursor = torch.zeros(E, **i32)
        self.total = torch.zeros(1, **i32)
        self.status = torch.zeros(1, **i32)
        self.grid_counters = torch.zeros(4, **i32)  # grid_last_block counters of the producer kernels
        self.pool_x = torch.empty((self.capacity, self.hidden), dtype=torch.bfloat16, device=device)
        self.row_src = torch.zeros((self.capacity, 4), **i32)
        self.row_weight = torch.zeros(self.capacity, dtype=torch.float32, device=device)
        self._streams: Dict[int, object] = {}  # torch stream handle -> CuPy view of it
        self.closed = False
        backend.barrier()
        logger.info("MoE on rank %d/%d: experts [%d, %d) of %d, hidden %d, inter %d, top-%d, %s, "
                    "max_tokens %d, pool %d rows", self.rank, self.world_size, self.expert_begin,
                    self.expert_begin + E, self.num_experts, self.hidden, self.inter, self.topk, x_format,
                    self.max_tokens, self.capacity)

    # --- validation -----------------------------------------------------------------------------------

    def _check_tensor(self, name: str, t, dtype, shape) -> None:
        torch = _torch()
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{name}: expected a torch tensor, got {type(t).__name__}")
        if not t.is_cuda or t.device != self.device:
            raise ConfigError(f"{name}: expected a tensor on {self.device}, got one on {t.device}")
        if dtype is not None and t.dtype != dtype:
            raise ConfigError(f"{name}.dtype={t.dtype}: expected {dtype}")
        if tuple(t.shape) != tuple(shape):
            raise ConfigError(f"{name}.shape={tuple(t.shape)}: expected {tuple(shape)}")

    def _check_input(self, x):
        """``x`` validated (bf16 ``[n <= max_tokens, hidden]`` on this GPU), with 16-byte aligned rows."""
        torch = _torch()
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ConfigError(f"x: expected a 2-D torch tensor [n, hidden={self.hidden}], got "
                              f"{getattr(x, 'shape', type(x).__name__)}")
        n = int(x.shape[0])
        if n > self.max_tokens:
            raise ConfigError(f"x.shape[0]={n}: expected at most max_tokens={self.max_tokens}")
        self._check_tensor("x", x, torch.bfloat16, (n, self.hidden))
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()  # the kernels read 16-byte vectors of rows
        return x

    def _check_open(self) -> None:
        if self.closed:
            raise RingClosedError("this MoE layer was closed")
        self.ctx.check_open()

    def _routing_source(self, x, router_weight, logits, topk_idx, topk_weights) -> Tuple:
        """Validate the routing source (nothing enqueued): ``("given", (topk_idx, topk_weights))``,
        ``("router", router_weight)`` or ``("logits", logits)``."""
        torch = _torch()
        n = x.shape[0]
        sources = [s for s, v in (("router_weight", router_weight), ("logits", logits), ("topk_idx", topk_idx))
                   if v is not None]
        if len(sources) != 1:
            raise ConfigError(f"routing: got {sources or 'none'}; expected exactly one of router_weight, "
                              "logits, or topk_idx with topk_weights")
        if topk_idx is not None:
            self._check_tensor("topk_idx", topk_idx, torch.int32, (n, self.topk))
            self._check_tensor("topk_weights", topk_weights, torch.float32, (n, self.topk))
            return "given", (topk_idx.contiguous(), topk_weights.contiguous())
        if topk_weights is not None:
            raise ConfigError("topk_weights: given without topk_idx")
        if router_weight is not None:
            self._check_tensor("router_weight", router_weight, torch.bfloat16, (self.num_experts, self.hidden))
            return "router", router_weight
        self._check_tensor("logits", logits, None, (n, self.num_experts))
        return "logits", logits

    def _route(self, x, kind: str, source) -> Tuple:
        """``(topk_idx, topk_weights)`` of the rows of ``x`` from a validated routing source (enqueued)."""
        if kind == "given":
            return source
        logits = x @ source.t() if kind == "router" else source
        idx, weights = torch_ref.route(logits, self.topk, self.scoring, bias=self.bias,
                                       routed_scaling_factor=self.routed_scaling_factor)
        return idx.contiguous(), weights.contiguous()

    # --- the layer ------------------------------------------------------------------------------------

    def forward(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None,
                stage_events: Optional[List] = None):
        """Run the layer on this rank's tokens (collective: every rank calls forward once per call).

        Args:
            x: bf16 ``[n, hidden]`` on this rank's GPU, ``0 <= n <= max_tokens``, rows contiguous.
            router_weight: bf16 ``[num_experts, hidden]`` (logits = ``x @ router_weight.T``), or
            logits: ``[n, num_experts]`` (any float dtype), or
            topk_idx / topk_weights: int32 / float32 ``[n, topk]`` routing (``-1`` = masked).
            stage_events: when a list, ``(stage name, torch.cuda.Event)`` pairs are appended after each
                stage of `STAGES` (with a leading ``("start", event)``) for per-stage timing.

        Returns:
            bf16 ``[n, hidden]`` tensor ``y`` (enqueued on the current torch stream; no host sync).

        Raises:
            ConfigError: bad shapes, dtypes, devices or routing sources (nothing is enqueued).
            ProtocolTimeout: only with ``SYMMRING_DEBUG=1`` (which checks after every call).
        """
        torch = _torch()
        self._check_open()
        x = self._check_input(x)
        n = int(x.shape[0])
        events = stage_events

        def mark(name: str) -> None:
            if events is not None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                events.append((name, ev))

        kind, source = self._routing_source(x, router_weight, logits, topk_idx, topk_weights)
        mark("start")
        topk_idx, topk_weights = self._route(x, kind, source)
        # Rows the grouped GEMMs run over: a host-side bound, since the exact count stays on the device.
        # Every pool row is a (source token, k) pair, so topk * (tokens of all ranks) bounds it: exact with
        # one rank; with several, one integer all-reduce of the token counts (host MPI, no device sync).
        rows_bound = max(1, min(self.capacity, self._all_tokens(n) * self.topk))
        stream = self._stream(torch.cuda.current_stream().cuda_stream)
        desc = self.ring.kernels.desc
        chunk = np.int32(0)
        fn_p = self._modules["producer"].function
        fn_d = self._modules["dispatch"].function
        fn_c = self._modules["combine"].function
        R, E, T, K, H = self.world_size, self.num_local_experts, self.max_tokens, self.topk, self.hidden
        counters = self.grid_counters

        # 1. route: acquire the slot, write topk + meta, publish route readiness.
        fn_p("moe_produce_route")((_blocks(n * K, THREADS_PER_BLOCK, MAX_ROUTE_BLOCKS),), (THREADS_PER_BLOCK,),
                                  (desc, chunk, _ptr(topk_idx), _ptr(topk_weights), np.int32(n),
                                   np.uint64(counters.data_ptr())), stream=stream)
        mark("route")
        # 2. layout: fp8 quantisation (or bf16 copy) into the slot, publish layout readiness.
        layout_kernel = "moe_produce_layout_fp8" if self.x_format == "fp8_e4m3" else "moe_produce_layout_bf16"
        layout_blocks = (_blocks(n, WARPS_PER_BLOCK) if self.x_format == "fp8_e4m3"  # a warp per token
                         else _blocks(n * H // 8, THREADS_PER_BLOCK * 4))                # 4 vectors per thread
        fn_p(layout_kernel)((layout_blocks,), (THREADS_PER_BLOCK,),
                            (desc, chunk, _ptr(x), np.int64(x.stride(0)), np.int32(n),
                             np.uint64(counters.data_ptr() + 4)), stream=stream)
        mark("layout")
        # 3. dispatch.
        fn_d("moe_dispatch_wait")((R,), (32,), (desc, chunk, _ptr(self.counts), np.int32(E)), stream=stream)
        fn_d("moe_dispatch_count")((_blocks(T * K, THREADS_PER_BLOCK, 64), R), (THREADS_PER_BLOCK,),
                                   (desc, chunk, _ptr(self.counts), np.int32(self.expert_begin), np.int32(E),
                                    _ptr(self.status)), stream=stream, shared_mem=4 * E)
        fn_d("moe_dispatch_scan")((1,), (1024,), (_ptr(self.counts), _ptr(self.begin), _ptr(self.group_end),
                                                   _ptr(self.cursor), _ptr(self.total), np.int32(E)),
                                  stream=stream, shared_mem=4 * 1024)
        fn_d("moe_dispatch_pull")((_blocks(T, WARPS_PER_BLOCK, max(1, MAX_BLOCKS // R)), R), (THREADS_PER_BLOCK,),
                                  (desc, chunk, _ptr(self.begin), _ptr(self.cursor), _ptr(self.pool_x),
                                   _ptr(self.row_src), _ptr(self.row_weight), np.int32(self.expert_begin),
                                   np.int32(E), _ptr(self.status)), stream=stream)
        mark("dispatch")
        # 4. experts over the first rows_bound pool rows; rows past group_end[-1] are never read.
        h = torch_ref.grouped_mm(self.pool_x[:rows_bound], self._w13_t, self.group_end)
        act = torch_ref.swiglu(h, self.inter)
        out = torch_ref.grouped_mm(act, self._w_down_t, self.group_end)
        mark("experts")
        # 5. combine.
        rows_ptr = self._combine_rows_ptr
        fn_c("moe_combine_scatter")((_blocks(self.capacity, WARPS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                                    (desc, _ptr(out), _ptr(self.row_src), _ptr(self.total), rows_ptr),
                                    stream=stream)
        fn_c("moe_combine_signal")((1,), (32,), (desc, chunk, self._combine_ready_ptr), stream=stream)
        fn_c("moe_combine_wait")((1,), (32,), (desc, chunk, self._combine_ready_ptr), stream=stream)
        y = torch.empty((n, H), dtype=torch.bfloat16, device=self.device)
        # The reduce also ends the call (generation base + 1; nothing after it reads the base).
        fn_c("moe_combine_reduce")((_blocks(n, WARPS_PER_BLOCK),), (THREADS_PER_BLOCK,),
                                   (desc, chunk, rows_ptr, _ptr(y), np.int64(H), np.int32(n)), stream=stream)
        mark("combine")
        if env.debug():
            self.check_errors()
        return y

    __call__ = forward

    def capture(self, x, router_weight=None, logits=None, *, topk_idx=None, topk_weights=None,
                warmup: int = 1):
        """Capture one `forward` on these (static) tensors into a CUDA graph (collective).

        Runs ``warmup`` eager calls first (real calls: every rank must make the same ones), then
        captures. Each ``graph.replay()`` is one more call on every rank: the generations come from the
        device-resident generation base, so replays never reuse a stale one. Refill ``x`` (and the
        routing tensors) in place between replays.

        Returns:
            ``(graph, y)``: the ``torch.cuda.CUDAGraph`` and its static output tensor.

        Raises:
            ConfigError: as `forward`.

        Example:
            >>> graph, y = moe.capture(x, router_weight=router)
            >>> x.copy_(next_batch); graph.replay(); use(y)
        """
        torch = _torch()
        kwargs = dict(router_weight=router_weight, logits=logits, topk_idx=topk_idx, topk_weights=topk_weights)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_check_int("warmup", warmup, 0)):
                self.forward(x, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = self.forward(x, **kwargs)
        return graph, y

    def _all_tokens(self, n: int) -> int:
        """Tokens of this call over all ranks: a non-blocking MPI sum, polled with the protocol's bound."""
        if self.world_size == 1:
            return n
        send, recv = np.array([n], np.int64), np.zeros(1, np.int64)
        request = self.ctx.comm.Iallreduce(send, recv)  # MPI.SUM is the default op
        deadline = time.monotonic() + self.ctx.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise ProtocolTimeout("token_counts", rank=self.rank, slot=0, expected=self.world_size,
                                      observed=0, timeout_s=self.ctx.timeout_s)
        return int(recv[0])

    def _stream(self, handle: int):
        """CuPy's view of a torch stream (cached: one object per stream handle)."""
        stream = self._streams.get(handle)
        if stream is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; kernels.as_stream uses it too
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._streams[handle] = _cupy().cuda.ExternalStream(handle)
        return stream

    # --- state, errors, teardown ----------------------------------------------------------------------

    def slot_view(self, name: str, num_tokens: int):
        """Zero-copy CuPy view of this rank's ring slot payload ``name`` (``x``, ``x_sf``, ``topk_idx``,
        ``topk_weights``), its first ``num_tokens`` rows (for tests: what the producer kernels wrote)."""
        self._check_open()
        region = self.ring.layout[name]
        if name not in ("x", "x_sf", "topk_idx", "topk_weights"):
            raise ConfigError(f"name={name!r}: expected one of 'x', 'x_sf', 'topk_idx', 'topk_weights'")
        num_tokens = _check_int("num_tokens", num_tokens, 0)
        if num_tokens > self.max_tokens:
            raise ConfigError(f"num_tokens={num_tokens}: expected at most max_tokens={self.max_tokens}")
        return self.backend.view(self.ring.alloc, self.rank, region.slot_offset(0), region.dtype,
                                 (num_tokens,) + tuple(region.slot_shape[1:]))


    def check_errors(self) -> None:
        """Synchronise the device; raise `ProtocolTimeout` if a wait of this rank timed out, or
        `BackendError` if a peer's memory was not load/store reachable."""
        self._check_open()
        self.ring.kernels.check_errors(synchronize=True)
        status = int(self.status.item())
        if status & STATUS_NO_PEER_MAPPING:
            raise BackendError(f"rank {self.rank}: a peer's ring is not load/store reachable (nvshmem_ptr "
                               "returned null); the MoE layer needs all PEs on one node with P2P/NVLink")

    def routed_rows(self) -> int:
        """Rows the last forward computed on this rank (synchronises; for tests and benchmarks)."""
        return int(self.total.item())

    def reset(self) -> None:
        """Collective: clear the ring, the combine buffer and the error state (after a ProtocolTimeout)."""
        self._check_open()
        self.ring.reset()
        self.grid_counters.zero_()
        self.status.zero_()
        _cupy().cuda.runtime.memset(self.combine_alloc.ptr, 0, self.combine_alloc.nbytes)
        self.backend.barrier()

    def close(self) -> None:
        """Collective, idempotent: free the symmetric allocations."""
        if self.closed:
            return
        self.closed = True
        self.backend.free(self.combine_alloc)
        self.ring.close()

    def __enter__(self) -> "MoE":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
