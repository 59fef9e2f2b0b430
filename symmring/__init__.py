"""symmring: chunk-ready symmetric ring buffers that stream Mixture-of-Experts inputs between GPUs.

Producers write token chunks (``x``, ``x_sf``, ``topk_idx``, ``topk_weights``) into a fixed ring of slots
in symmetric memory and publish route and layout readiness as generation counters; the MoE consumer
pulls ready chunks from every rank and acknowledges each slot with a per-rank bitmask. See
``docs/PROTOCOL.md``.

Importing symmring has no side effects: nothing is initialised until `init()` is called.

Threads: nothing here is thread-safe. A context, its workspaces, rings and layers belong to the thread that
makes their calls: every call and collective is numbered in call order on each rank, and two threads would
interleave them differently on each rank. `symmring.moe.gpu.GpuMoE.async_error` (a read of pinned host memory,
no device call, no collective) may be polled from another thread once every layer is built.

The MoE layer is `MoE` (``symmring.MoE(ctx, Experts(...), RoutingConfig(...), max_tokens=...)``): the GPU layer on
the nvshmem backend, the CPU layer (`ExpertParallelMoE`) on the host backend, chosen from the context.
"""

__version__ = "0.1.0"

from . import protocol  # noqa: E402
from .context import Context, finalize, init  # noqa: E402
from .errors import (BackendError, BrokenStateError, CallMismatch, CallRefused, CompileError,  # noqa: E402
                     ConfigError, DoubleAck, PeerTimeout, PoolOverflow, ProtocolAborted, ProtocolTimeout,
                     ProtocolViolation, RingClosedError, StalePayload, StepFailed, SymmringError)
from .layout import RingLayout, RingSpec  # noqa: E402
from .moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402
from .moe.cpu.layer import ExpertParallelMoE, MoEShapes, local_experts, shard_experts  # noqa: E402
from .moe.layer import MoE  # noqa: E402
from .moe.workspace import Workspace  # noqa: E402
from .moe.workspace_plan import LayerShape  # noqa: E402
from .protocol import AckPolicy  # noqa: E402
from .ring import Call, ChunkView, Ring  # noqa: E402

__all__ = [
    "__version__", "protocol", "init", "finalize", "Context", "Ring", "Call", "ChunkView", "AckPolicy",
    "RingSpec", "RingLayout", "MoE", "Experts", "RoutingConfig", "ScheduleConfig", "ExpertParallelMoE", "MoEShapes",
    "shard_experts", "local_experts", "Workspace", "LayerShape",
    "SymmringError", "ConfigError", "BackendError", "ProtocolTimeout", "PeerTimeout", "BrokenStateError",
    "RingClosedError", "CompileError", "ProtocolAborted", "ProtocolViolation", "StalePayload", "DoubleAck",
    "PoolOverflow", "CallMismatch", "CallRefused", "StepFailed",
]
