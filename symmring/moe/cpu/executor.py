"""The CPU layer's executor: one call of the ring protocol on the host backend, and the layer's experts.

`HostExecutor.run` moves a call's chunks through a ring of the workspace in the host enqueue order
(`symmring.protocol.enqueue_order`: the producer ``lookahead`` chunks ahead): every rank produces its chunks
(route and quantise its rows, acquire the slot, write and publish route then layout), consumes every rank's
chunk (wait for it, pull the rows routed to its experts into the workspace's pool, in passes when they exceed
it, run the experts, write each output row into its owner's combine buffer, signal) and reduces its own rows
(wait for every consumer's signal, the weighted sum over k in order). `HostEngine` holds the experts: the
weights as given (what `symmring.moe.integrations.module.MoEModule` registers) and the float64 operands every
call reads. The module docstring of `symmring.moe.cpu.layer` has the data flow and why batch and streamed calls
agree bitwise; `ExpertParallelMoE` makes one executor and hands it each agreed call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, Tuple

import numpy as np

from ... import env, protocol
from ...errors import ConfigError, ProtocolTimeout, SymmringError
from ...layout import META_CHUNK_IDX, META_PAYLOAD_GEN
from ...protocol import AckPolicy
from ...ring import Call, Ring
from .. import quant
from ..reference import check_expert_weights, combine_rows, row_matmul, swiglu, transposed_f64
from ..weights import ExpertWeights

_WORD_BYTES = 8


@dataclasses.dataclass
class ForwardStats:
    """What the last `ExpertParallelMoE.forward` did on this rank."""

    streaming: bool = False
    num_chunks: int = 0
    num_slots: int = 0
    tokens_per_slot: int = 0
    num_tokens: int = 0
    rows_pulled: int = 0  #: token rows pulled from all ranks (x and x_sf) for local experts
    pairs_computed: int = 0  #: (token, k) pairs computed by local experts
    passes: int = 0  #: passes through the workspace's pool (more than one per chunk when arrivals exceed it)
    elapsed_s: float = 0.0


def as_float32(name: str, value) -> np.ndarray:
    """A weight as a float32 NumPy array: a torch CPU tensor of any float dtype (converted), or a NumPy array
    (checked as it is by `check_expert_weights`).

    Raises:
        ConfigError: a tensor that is not a float tensor on the CPU.
    """
    if hasattr(value, "detach"):
        if value.device.type != "cpu" or not value.is_floating_point():
            raise ConfigError(f"{name}: expected a float CPU tensor or a float32 NumPy array, got "
                              f"{value.dtype} on {value.device}")
        return value.detach().float().numpy()
    return value


class HostEngine:
    """This rank's experts on the CPU: ``weights``, an `symmring.moe.weights.ExpertWeights` of the weights as
    given (``w13 [E/R, 2 inter, hidden]``: gate rows then up rows, and ``w_down [E/R, hidden, inter]``; torch
    tensors when torch tensors were given, copies the layer owns, which `MoEModule` registers as its buffers),
    and the float64 operands every call reads (`refresh_weights` re-derives them after an in-place load).

    Raises:
        ConfigError: weights of another shape, dtype or with a non-finite value (`check_expert_weights`).
    """

    name = "host"

    def __init__(self, w_gate, w_up, w_down, *, hidden: int):
        self.hidden = hidden
        self.num_local_experts, self.inter, _ = check_expert_weights(
            *(as_float32(n, w) for n, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))), hidden=hidden)
        if hasattr(w_gate, "detach"):
            import torch
            with torch.no_grad():
                w13 = torch.cat([w_gate.detach(), w_up.detach()], dim=1).contiguous()
                down = w_down.detach().contiguous().clone()
            dtype = "bf16" if w13.dtype == torch.bfloat16 else str(w13.dtype).replace("torch.", "")
        else:
            w13, down, dtype = np.concatenate([w_gate, w_up], axis=1), np.array(w_down), "float32"
        self.weights = ExpertWeights(dtype, w13, down)
        self.refresh_weights()

    def refresh_weights(self) -> None:
        """Re-derive the float64 operands (``[hidden, 2 inter]`` and ``[inter, hidden]`` per expert) from
        ``weights`` (after an in-place load of its tensors)."""
        w13 = as_float32("w13", self.weights.w13)
        w_down = as_float32("w_down", self.weights.w_down)
        inter = self.inter
        check_expert_weights(w13[:, :inter], w13[:, inter:], w_down, hidden=self.hidden)
        self._w13_t = [transposed_f64(w13[i]) for i in range(self.num_local_experts)]
        self._w_down_t = [transposed_f64(w_down[i]) for i in range(self.num_local_experts)]

    def forward(self, local_idx: int, h: np.ndarray) -> np.ndarray:
        """L1 (gate | up) -> SwiGLU -> L2 for rows ``h`` of local expert ``local_idx`` (row-independent)."""
        gate_up = row_matmul(h, self._w13_t[local_idx])
        act = swiglu(gate_up[:, :self.inter], gate_up[:, self.inter:])
        return row_matmul(act, self._w_down_t[local_idx])


class HostExecutor:
    """Runs the CPU layer's calls (module docstring) on its workspace's rings, combine buffer and pool.

    Args:
        ctx: the context; spec: the layer's `symmring.moe.spec.LayerSpec`; workspace: the `symmring.Workspace`
        (attached); layer_shape: the layer's `symmring.moe.workspace_plan.LayerShape`; engine: its `HostEngine`.

    Attributes:
        stats: the `ForwardStats` of the last call.
    """

    def __init__(self, ctx, spec, workspace, layer_shape, engine: HostEngine):
        self.ctx, self.spec, self.workspace, self.layer_shape, self.engine = ctx, spec, workspace, layer_shape, engine
        self.experts = range(spec.expert_begin, spec.expert_begin + spec.num_local_experts)
        self.stats = ForwardStats()

    def _combine_out(self, rank: int) -> np.ndarray:
        """Zero-copy ``[capacity, K, H]`` float32 view of ``rank``'s combine rows (the workspace's buffer)."""
        return self.workspace.host.combine_rows(rank, self.spec.topk, self.spec.hidden)

    def run(self, ring: Ring, num_chunks: int, x: np.ndarray, route_rows, ack_policy: AckPolicy,
            lookahead: int, call_id: int) -> np.ndarray:
        """Every chunk of one call (identity ``call_id``), in the host enqueue order (producer ``lookahead``
        chunks ahead)."""
        y = np.zeros((x.shape[0], self.spec.hidden), np.float32)
        own_routes: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
        call = ring.begin_call(num_chunks, call_id=call_id)
        host = self.workspace.host
        combine_base = host.combine_base
        for step, chunk in protocol.enqueue_order(num_chunks, ring.spec.num_slots, lookahead):
            combine_gen = protocol.generation(combine_base, chunk)
            if step == "produce":
                own_routes[chunk] = self._produce(ring, call, chunk, x, route_rows)
            else:
                self._consume(ring, call, chunk, ack_policy, combine_gen)
                self._reduce(ring, call, chunk, own_routes.pop(chunk), combine_gen, y)
        ring.end_call(call)
        host.combine_base = protocol.next_base(combine_base, num_chunks)
        if env.debug():
            self._debug_check(ring, call, combine_base, y)
        return y

    def _debug_check(self, ring: Ring, call: Call, combine_base: int, y: np.ndarray) -> None:
        """``SYMMRING_DEBUG=1``: the shared state a finished call must leave behind (module docstring)."""
        backend, alloc, lay = self.ctx.backend, ring.allocation, ring.layout
        rank, timeout_s = self.spec.rank, self.spec.timeout_s
        num_chunks, num_slots = call.num_chunks, ring.spec.num_slots
        base = backend.read_word(alloc, lay["gen_base"].offset, rank)
        if base != protocol.next_base(call.base, num_chunks):
            raise SymmringError(f"SYMMRING_DEBUG: rank {rank}: gen_base is {base} after a call of {num_chunks} "
                                f"chunks from base {call.base}, expected {protocol.next_base(call.base, num_chunks)}")
        for chunk in range(max(0, num_chunks - num_slots), num_chunks):  # the last use of each slot
            slot, gen = protocol.slot_of(chunk, num_slots), protocol.generation(call.base, chunk)
            words = {kind: backend.read_word(alloc, lay[kind].slot_offset(slot), rank)
                     for kind in ("route_ready", "layout_ready")}
            meta = ring.meta(slot)
            if words != {"route_ready": gen, "layout_ready": gen} or int(meta[META_PAYLOAD_GEN]) != gen \
                    or int(meta[META_CHUNK_IDX]) != chunk:
                raise SymmringError(f"SYMMRING_DEBUG: rank {rank}: slot {slot} holds ready words {words} and "
                                    f"metadata {meta.tolist()}, expected generation {gen} of chunk {chunk}")
        required = protocol.full_mask(self.spec.world_size)
        deadline = time.monotonic() + timeout_s
        for slot in range(num_slots):
            for word_idx, want in enumerate(required):
                offset = lay["ack_mask"].slot_offset(slot) + word_idx * _WORD_BYTES
                # Acquire (pairs with each consumer's fence before its atomic_or in Ring.ack): every consumer
                # acknowledges this call's chunks without waiting for this rank, so they must all arrive.
                ok, observed = backend.wait_until(alloc, offset, rank, "eq", want,
                                                  max(deadline - time.monotonic(), 1e-6))
                if not ok:
                    mask = [backend.read_word(alloc, lay["ack_mask"].slot_offset(slot) + w * _WORD_BYTES, rank)
                            for w in range(len(required))]
                    raise ProtocolTimeout("reuse", rank=rank, peer=rank, slot=slot, chunk=num_chunks - 1,
                                          expected=want, observed=observed,
                                          missing_ranks=protocol.missing_ranks(mask, required), timeout_s=timeout_s)
        if num_chunks:
            last = protocol.generation(combine_base, num_chunks - 1)
            behind = [q for q in range(self.spec.world_size)
                      if backend.read_word(self.workspace.host.combine, q * _WORD_BYTES, rank) < last]
            if behind:
                raise SymmringError(f"SYMMRING_DEBUG: rank {rank}: combine signals of consumer(s) {behind} are "
                                    f"below the call's last generation {last}")
        bad = np.nonzero(~np.isfinite(y).all(axis=1))[0]
        if bad.size:
            raise SymmringError(f"SYMMRING_DEBUG: rank {rank}: output rows {bad[:8].tolist()} (of {bad.size}) "
                                "are not finite")

    def _chunk_rows(self, ring: Ring, chunk: int, num_tokens: int) -> slice:
        tokens_per_slot = ring.spec.tokens_per_slot
        token_base = protocol.chunk_token_base(chunk, tokens_per_slot)
        return slice(token_base, token_base + protocol.chunk_valid_tokens(num_tokens, chunk, tokens_per_slot))

    def _produce(self, ring: Ring, call: Call, chunk: int, x: np.ndarray, route_rows):
        """Route and quantise this rank's rows of ``chunk``, then write and publish them (route first)."""
        rows = self._chunk_rows(ring, chunk, x.shape[0])
        topk_idx, topk_weights = route_rows(rows)
        x_bits, x_sf = quant.encode(x[rows], self.spec.x_format, quant.DEFAULT_GROUP_SIZE)
        ring.acquire_slot(call, chunk)
        ring.write_route(call, chunk, topk_idx, topk_weights, rows.start, rows.stop - rows.start)
        # Route before layout: a consumer could start counting its experts' tokens before x arrives.
        ring.publish_route(call, chunk)
        ring.write_layout(call, chunk, x_bits, x_sf)
        ring.publish_layout(call, chunk)
        return topk_idx, topk_weights

    def _entries(self, ring: Ring, call: Call, chunk: int, src_rank: int):
        """The (row, k) entries of ``src_rank``'s ``chunk`` routed to local experts (after `wait_ready`).

        Returns ``(token_base, rows, ks, experts)``: for every local (row, k) pair its row in the chunk, its k
        and its expert (row-major order).
        """
        slot = call.slot(chunk)
        token_base, num_valid = ring.check_meta(call, chunk, src_rank)  # this chunk, generation and call
        topk_idx = np.array(ring.topk_idx(slot, src_rank)[:num_valid])
        local = (topk_idx >= self.experts.start) & (topk_idx < self.experts.stop)
        rows, ks = np.nonzero(local)
        return token_base, rows, ks, topk_idx[rows, ks]

    def _pull(self, ring: Ring, call: Call, chunk: int, src_rank: int, rows: np.ndarray, pool: np.ndarray,
              pool_rows: np.ndarray) -> None:
        """Dequantise the x rows ``rows`` of ``src_rank``'s ``chunk`` into rows ``pool_rows`` of ``pool``: one read
        of each distinct row of the slot."""
        slot = call.slot(chunk)
        pulled_rows, inverse = np.unique(rows, return_inverse=True)
        x_bits = ring.x(slot, src_rank)[pulled_rows]  # fancy indexing: a copy of the rows only
        x_sf = ring.x_sf(slot, src_rank)[pulled_rows] if ring.spec.num_sf else None
        pool[pool_rows] = quant.decode(x_bits, x_sf, self.spec.x_format)[inverse]
        self.stats.rows_pulled += len(pulled_rows)

    def _consume(self, ring: Ring, call: Call, chunk: int, ack_policy: AckPolicy, combine_gen: int) -> None:
        """Dispatch, compute and combine-write ``chunk`` of every rank; signal every owner.

        The chunk's arrivals go through the workspace's pool in passes of at most ``pool_rows`` (token, k)
        entries, grouped by expert: a routing that sends more rows here than the pool holds runs more
        passes, never truncated. Every pass reads the slots, so EARLY acknowledges after the last one."""
        entries = []
        for src_rank in range(self.spec.world_size):
            ring.wait_ready(call, chunk, src_rank)
            entries.append(self._entries(ring, call, chunk, src_rank))
        sources = np.concatenate([np.full(len(e[1]), r, np.int64) for r, e in enumerate(entries)])
        rows = np.concatenate([e[1] for e in entries])
        ks = np.concatenate([e[2] for e in entries])
        experts = np.concatenate([e[3] for e in entries]).astype(np.int64)
        order = np.argsort(experts, kind="stable")  # expert-contiguous, as the GPU pool
        pool_rows = self.workspace.pool_rows(self.layer_shape)
        acked = False
        for begin in range(0, len(order), pool_rows):
            part = order[begin:begin + pool_rows]
            pool = self.workspace.host.pool_view(len(part), self.spec.hidden)
            for src_rank in range(self.spec.world_size):
                sel = np.nonzero(sources[part] == src_rank)[0]
                if sel.size:
                    self._pull(ring, call, chunk, src_rank, rows[part[sel]], pool, sel)
            if begin + pool_rows >= len(order):
                acked = self._early_ack(ring, call, chunk, ack_policy)  # the last read of every slot is done
            out = np.empty((len(part), self.spec.hidden), np.float32)
            for local_idx, expert in enumerate(self.experts):
                sel = np.nonzero(experts[part] == expert)[0]
                if sel.size:
                    out[sel] = self.engine.forward(local_idx, pool[sel])
            self.stats.pairs_computed += len(part)
            self.stats.passes += 1
            for src_rank in range(self.spec.world_size):
                sel = np.nonzero(sources[part] == src_rank)[0]
                if sel.size:
                    # A remote store into the owner's combine buffer at the token's logical row.
                    token_base = entries[src_rank][0]
                    self._combine_out(src_rank)[token_base + rows[part[sel]], ks[part[sel]]] = out[sel]
        if not acked:  # no entry here: the slots were read for their routing only
            self._early_ack(ring, call, chunk, ack_policy)
        self._signal_combine(combine_gen)
        if ack_policy == AckPolicy.CONSERVATIVE:
            for src_rank in range(self.spec.world_size):
                ring.ack(call, chunk, src_rank)  # release: after this chunk's combine was signalled

    def _early_ack(self, ring: Ring, call: Call, chunk: int, ack_policy: AckPolicy) -> bool:
        if ack_policy == AckPolicy.EARLY:
            for src_rank in range(self.spec.world_size):
                ring.ack(call, chunk, src_rank)  # release: after the last read of the slot (fence inside)
        return True

    def _signal_combine(self, combine_gen: int) -> None:
        """Tell every owner that this rank's combine stores of the current chunk are complete."""
        backend = self.ctx.backend
        # Release: the combine stores are visible before the signals; pairs with the acquire in _reduce.
        backend.fence()
        for owner in range(self.spec.world_size):
            backend.signal_set(self.workspace.host.combine, self.spec.rank * _WORD_BYTES, combine_gen, owner)

    def _reduce(self, ring: Ring, call: Call, chunk: int, own_route, combine_gen: int, y: np.ndarray) -> None:
        """Wait for every consumer's combine of this rank's ``chunk``, then reduce over k into ``y``."""
        backend, rank, combine = self.ctx.backend, self.spec.rank, self.workspace.host.combine
        deadline = time.monotonic() + self.spec.timeout_s
        for consumer in range(self.spec.world_size):
            # Acquire: pairs with the fence before the consumer's signal_set in _consume.
            ok, observed = backend.wait_until(combine, consumer * _WORD_BYTES, rank, "ge", combine_gen,
                                              max(deadline - time.monotonic(), 1e-6))
            if not ok:
                missing = [q for q in range(self.spec.world_size)
                           if backend.read_word(combine, q * _WORD_BYTES, rank) < combine_gen]
                error = ProtocolTimeout("combine", rank=rank, peer=consumer, slot=call.slot(chunk), chunk=chunk,
                                        expected=combine_gen, observed=observed, missing_ranks=missing,
                                        timeout_s=self.spec.timeout_s)
                self.ctx.collectives.record_fault(error)  # a peer may be stalled or gone (see Ring)
                raise error
        topk_idx, topk_weights = own_route
        rows = self._chunk_rows(ring, chunk, y.shape[0])
        if rows.stop > rows.start:
            y[rows] = combine_rows(self._combine_out(self.spec.rank)[rows], topk_idx, topk_weights)


__all__ = ["HostExecutor", "HostEngine", "ForwardStats", "as_float32"]
