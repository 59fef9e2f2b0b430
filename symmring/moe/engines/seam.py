"""The experts step of the GPU MoE layer: one seam, pool rows in, output rows out.

Dispatch (`symmring.moe.gpu.stages`) gathers every (token, k) entry routed to this rank's experts into an
expert-contiguous `Pool`; an `ExpertEngine` turns the pool's first ``num_rows`` rows into output rows
(L1 = gate and up as one grouped GEMM, SwiGLU, L2 = down), which the combine sends back to the tokens'
owners. The engine says which pool it wants: its row format (``"bf16"``: dispatch dequantises fp8 on the
way) and the row alignment of every expert's group (1: packed). Nothing else in the layer knows how the
experts compute.

Engines (`make_engine`, the layer's ``engine=`` argument):

* ``"torch"``: `TorchBf16Experts`, bf16 experts on ``torch._grouped_mm`` (float32 accumulation, bf16
  SwiGLU); dispatch dequantises the fp8 rows into a bf16 pool.
* ``"builtin"``: `Fp8Experts` on the project's Triton kernels (`symmring.moe.engines.triton_large`): fp8 pool (rows
  and their 1x128 scales as the producer wrote them), L1 block-scaled fp8 grouped GEMM, SwiGLU fused with
  the 1x128 fp8 quantisation of its output, L2 fp8 grouped GEMM to bf16.
* ``"deepgemm"``: `Fp8Experts` with DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` for both GEMMs
  (`symmring.moe.engines.deepgemm`; optional, imported lazily) and the same SwiGLU kernel.
* ``"auto"``: ``"torch"`` for bf16 experts; for fp8, DeepGEMM where it loads, else the built-in kernels.

For tiny groups (decode: ``forward``'s ``rows_per_expert`` bound at most ``small_rows``) both fp8 engines run
`symmring.moe.engines.triton_small`'s swap-AB kernels instead (L1 fused with SwiGLU and the quantisation).

The fp8 engines want the contiguous layout: every expert's group starts at a multiple of 128 pool rows
and ``m_indices`` names each row's expert (-1 for padding). Weights: `symmring.moe.weights`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional


@dataclass
class Pool:
    """The expert pool of one window, as dispatch left it (device tensors, fixed size: graph-capturable).

    Attributes:
        x: ``[capacity, hidden]`` rows, in the engine's `ExpertEngine.pool_format`.
        x_sf: ``[capacity, hidden / 128]`` float32 scales of fp8 rows, or None.
        group_end: int32 ``[E]``: cumulative row end of each local expert's group (``torch._grouped_mm``'s
            ``offs``); with an alignment > 1, the end of its aligned block.
        m_indices: int32 ``[capacity]``: the local expert of each row, -1 for padding (aligned pools), or None.
        bad_groups: int32 ``[2]`` where an engine whose GEMMs read ``m_indices`` reports rows naming no local
            expert (outside ``[-1, E)``: skipped, never computed; `symmring.moe.engines.triton_common.BAD_GROUP_WORDS`),
            or None.
    """

    x: object
    group_end: object
    x_sf: Optional[object] = None
    m_indices: Optional[object] = None
    bad_groups: Optional[object] = None


@dataclass
class Scratch:
    """Where an fp8 engine puts a pass's intermediates on its general path, L1 then SwiGLU then L2 (the
    workspace's experts' region: rows past the pass's are another pass's or shape's;
    `symmring.moe.workspace_plan.expert_arena`). ``act`` may share bytes with the pool (dead after L1) and ``h``
    with the output rows (written by L2): an engine must not read the pool after writing ``act``, nor write
    the output before it is done with ``h``; a bf16 pool shares its bytes with the output rows.

    Attributes:
        h: bf16 ``[capacity, 2 * inter]``: L1's output (gate then up).
        act: float8_e4m3fn ``[capacity, inter]``: SwiGLU's output quantised for L2.
    """

    h: object
    act: object


@dataclass(frozen=True)
class CombineRows:
    """Where an engine that sends its own output (`ExpertEngine.sends_rows`) writes each live row: straight into
    its owner's combine rows at (logical token, k), where the layer's combine scatter would put it
    (device/moe/combine.cu); the layer then only checks each row's token and frees it. Only p2p owners: every
    address is a mapping into this process.

    Attributes:
        row_src: device address of int32 ``[rows, 4]``: each pool row's (owner, chunk-local token, k, chunk).
        token_base: device address of int64 ``[chunks, num_ranks]``: the owners' token bases of the window.
        peers: device address of int64 ``[num_ranks]``: each owner's combine rows (an address), mapped into this
            process.
        window_begin: the window's first chunk (``token_base``'s row 0).
        num_ranks, num_topk: the ring's ranks and top-k.
        combine_tokens: the logical tokens every owner's combine rows hold (a row past them is not written).
    """

    row_src: int
    token_base: int
    peers: int
    window_begin: int
    num_ranks: int
    num_topk: int
    combine_tokens: int


class ExpertEngine(abc.ABC):
    """How this rank's experts compute (see the module docstring).

    Attributes:
        name: the engine's name (``"torch"``, ...).
        pool_format: ``"bf16"`` or ``"fp8"``: the rows dispatch writes into the pool.
        align_m: every expert group starts at a multiple of this many pool rows (1: packed).
        num_local_experts, hidden, inter: the shapes it was built for.
        sends_rows: `forward` takes ``send=`` (`CombineRows`) and then writes every live row to its owner's
            combine rows itself (the combine's scatter folded into L2's epilogue).
    """

    name: str
    pool_format: str
    align_m: int = 1
    sends_rows: bool = False

    @abc.abstractmethod
    def forward(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int] = None, out=None,
                scratch: Optional[Scratch] = None):
        """bf16 ``[num_rows, hidden]``: the expert output of pool rows ``[0, num_rows)`` (a host-side bound;
        rows past the groups' end are undefined and never read). Enqueued on the current torch stream.

        ``rows_per_expert``: a host bound on the rows any one local expert holds in this window (None:
        unknown); an engine may pick its kernels by it, and must then trust it. ``out``: bf16 ``[num_rows,
        hidden]`` to write the output into (the workspace's rows the combine sends); the engine returns it
        (an engine that cannot write into it returns its own tensor, which the layer then copies).
        ``scratch``: where to put the intermediates (`Scratch`; None: the engine allocates them); an engine
        that keeps its own ignores it. An engine with `sends_rows` also takes ``send=`` (a `CombineRows`, or
        None): the rows then go to their owners' combine rows, and the returned tensor holds nothing."""

    def begin_beside_dispatch(self, pool: Pool, num_rows: int, rows_per_expert: Optional[int] = None):
        """A call of `forward` that starts before the small-batch schedule's fused dispatch into ``pool`` ends, or
        None (this default): the engine runs after it. Called before the call's producer (what it enqueues, such
        as zeroed counters, precedes the chain); returns an object with ``plan`` (the device address of the two
        plan words the dispatch publishes, ``DispatchFusedArgs::plan``) and ``launch(launcher, stream)``, which
        enqueues the kernel right after the dispatch with ``launcher`` (`symmring.pdl.PdlLauncher`, enabled)
        and returns what `forward` would."""
        return None

    def check_status(self) -> None:
        """Synchronise and raise what this engine's own kernels recorded on the device since the last check
        (then cleared). An engine whose kernels record nothing has nothing to raise; the layer's
        ``check_errors`` calls it after its own records."""

    def refresh_weights(self) -> None:
        """Re-derive whatever the engine keeps beside `weights` (views, prepared layouts) after the
        weights' tensors were overwritten in place (`symmring.moe.integrations.module.MoEModule.load_state_dict`)."""
