"""A layer's call agreed by every rank before anything runs: the same call, every rank's argument verdict and
token count (both layers, `symmring.moe.gpu.GpuMoE` and `symmring.moe.cpu.layer.ExpertParallelMoE`).

Outside a `symmring.Workspace.step` a call makes ONE bounded exchange (`outside_step`) of every rank's token
count, whether it routes with the layer's own router, its latched device error (GPU layer), its call identity
(`symmring.protocol.call_identity`), its argument verdict and its call options (``streaming``, ...); every rank
then raises the same error, or none does: a refusal (`symmring.agreement.rejection`), diverged call sequences
(`symmring.agreement.call_mismatch`), other call options. Inside a step the step's exchange stands for every
call of it (`inside_step`): the counts are the step's, and a call whose arguments fail on one rank alone is
refused there (the layer counts it, `symmring.Workspace.refuse_call`, and the step fails on every rank).

Example:
    >>> from types import SimpleNamespace
    >>> step = SimpleNamespace(counts=(4, 2), distinct=True)
    >>> print(inside_step(step, rank=1, num_tokens=3, given=False, max_tokens=8, refusal=None))
    x.shape[0]=3: more tokens than this step declared (2; Workspace.step(num_tokens))
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .. import agreement
from ..errors import ConfigError


def outside_step(workspace, *, rank: int, world_size: int, layer_id: int, num_tokens: int, own_router: bool,
                 latched, options, refusal: Optional[BaseException], what: str) -> Tuple[List[int], bool, List]:
    """Agree a call outside a step (module docstring): ``(counts, distinct, latched)``, every rank's token count,
    whether every rank routes with the layer's own router (distinct experts per token) and every rank's latched
    device error words (None where none). Counts the call on the workspace unless some rank latched an error
    (the layer raises that next).

    Raises:
        ConfigError: ``refusal`` itself on this rank, one naming the refusing ranks on the others; or the ranks'
            call ``options`` differ.
        CallMismatch: the ranks' call identities differ.
        PeerTimeout: a rank did not reach the exchange within the context's bound.
    """
    mine = (num_tokens, own_router, latched, workspace.call_identity(layer_id),
            None if refusal is None else str(refusal), options)
    entries = [mine] if world_size == 1 else \
        workspace.ctx.collectives.allgather(mine, what=f"{what}: token counts")
    rejected = agreement.rejection([e[4] for e in entries], rank, what)
    if rejected is not None:
        raise refusal if refusal is not None else rejected
    mismatch = agreement.call_mismatch([e[3] for e in entries], rank, what)
    if mismatch is not None:
        raise mismatch
    differ = [r for r, e in enumerate(entries) if e[5] != options]
    if differ:
        raise ConfigError(f"{what}: rank {rank} calls with {options}, rank(s) {differ} with "
                          f"{[entries[r][5] for r in differ]}; expected the same options on every rank")
    latched_all = [e[2] for e in entries]
    if all(words is None for words in latched_all):
        workspace.begin_call()
    return [int(e[0]) for e in entries], all(bool(e[1]) for e in entries), latched_all


def inside_step(step, *, rank: int, num_tokens: int, given: bool, max_tokens: int,
                refusal: Optional[BaseException]) -> Optional[BaseException]:
    """This rank's refusal of a call inside ``step`` (a `symmring.moe.workspace.Step`), or None: ``refusal`` (its
    arguments), more tokens than this rank declared, or given routing (``topk_idx``) in a step declared
    ``own_router=True``. The layer refuses the call with it (counted, the step failed).

    Raises:
        ConfigError: on every rank alike, a declared count over ``max_tokens``.
    """
    if max(step.counts) > max_tokens:  # every rank sees the same counts: every rank refuses
        raise ConfigError(f"Workspace.step: ranks declared {list(step.counts)} tokens, over this layer's "
                          f"max_tokens={max_tokens}")
    if refusal is None and num_tokens > step.counts[rank]:
        refusal = ConfigError(f"x.shape[0]={num_tokens}: more tokens than this step declared ({step.counts[rank]}; "
                              "Workspace.step(num_tokens))")
    if refusal is None and given and step.distinct:
        refusal = ConfigError("topk_idx/topk_weights: this step was declared with own_router=True (every call "
                              "routes with the layer's router); open it with own_router=False")
    return refusal


def raise_latched(rank: int, latched: List, decode, backend=None) -> None:
    """Raise the device error latched by an earlier call of this rank (its own record, named, decoded by
    ``decode`` from the words it sent), or else by another rank (`ProtocolAborted` naming it): ``latched`` is the
    exchanged list, the same on every rank, so every rank raises in the same call (the GPU layer; the latch stays
    set until ``reset``). ``backend``: its collectives are told of the fault first, so exiting aborts the job
    instead of hanging."""
    from ..kernels import exchanged_error
    error = exchanged_error(rank, latched, decode)
    if error is None:
        return
    collectives = getattr(backend, "collectives", None)
    if collectives is not None:
        collectives.record_fault(error)
    raise error


__all__ = ["outside_step", "inside_step", "raise_latched"]
