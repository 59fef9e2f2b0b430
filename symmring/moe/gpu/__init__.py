"""The GPU MoE layer, by part: `layer` (`MoE`: checks, the call, its schedule), `memory` (the GPU share of the
workspace every layer borrows), `plan` (which chunks and windows a call runs), `stages` (one launcher per
kernel), `graph_cache` (eager calls replaying captured graphs), `policy` (the measured streaming policy) and
`timeline` (the streamed schedule's device timestamps)."""

from ..config import SMALL_BATCH_TOKENS
from .layer import STAGES, STREAMING_MODES, CapturedCall, MoE

__all__ = ["MoE", "CapturedCall", "SMALL_BATCH_TOKENS", "STAGES", "STREAMING_MODES"]
