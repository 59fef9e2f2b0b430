"""The GPU MoE layer, by part: `layer` (`GpuMoE`: the call's checks and agreement; `symmring.MoE` on the nvshmem
backend; ``MoE`` here is its former name), `spec` (`GpuSpec`: what a layer runs with, resolved and agreed once),
`plan` (`Planner`: which chunks and windows a call runs), `executor` (`Executor`: the memory views, kernels,
streams, router and graph cache; it runs a plan), `router` (the routing of a call), `inputs` (a call's tensors
checked), `stages` (one launcher per kernel, and the sequences a plan is made of), `memory` (the GPU share of the
workspace every layer borrows), `graph_cache` (eager calls replaying captured graphs), `policy` (the measured
streaming policy) and `timeline` (the streamed schedule's device timestamps)."""

from ..config import SMALL_BATCH_TOKENS
from .layer import STAGES, STREAMING_MODES, CapturedCall, GpuMoE, MoE

__all__ = ["GpuMoE", "MoE", "CapturedCall", "SMALL_BATCH_TOKENS", "STAGES", "STREAMING_MODES"]
