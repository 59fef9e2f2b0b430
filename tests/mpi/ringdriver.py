"""Drive a `symmring.Ring` through whole calls on every rank and check every byte that arrives.

Shared by the MPI stress and error tests. Payloads are derived from ``(source rank, generation, row,
column)`` by a hash, so a consumer recomputes what it must receive without any communication, and a row
left over from an earlier lap, call or rank (a different generation or source) differs from it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from rankworld import MIN, SUM
from symmring import protocol
from symmring.protocol import AckPolicy

_MIX = np.uint64(0x9E3779B97F4A7C15)


def _hash(*parts) -> np.ndarray:
    """A 64-bit mix (splitmix64 finaliser) of broadcast integer arrays."""
    with np.errstate(over="ignore"):
        h = np.uint64(0)
        for p in parts:
            h = (h ^ np.asarray(p, dtype=np.uint64)) * _MIX
            h ^= h >> np.uint64(31)
        return h


def expected_x(spec, src: int, gen: int, num_rows: int) -> np.ndarray:
    """``[num_rows, H]`` bit pattern of ``x`` for (src, gen): uint8 (fp8) or uint16 (bf16)."""
    rows = np.arange(num_rows, dtype=np.uint64)[:, None]
    cols = np.arange(spec.hidden, dtype=np.uint64)[None, :]
    bits = _hash(src, gen, rows, cols)
    return bits.astype(np.uint8 if spec.x_elem_bytes == 1 else np.uint16)


def expected_sf(spec, src: int, gen: int, num_rows: int) -> np.ndarray:
    """``[num_rows, num_sf]`` float32 scales for (src, gen): exact small dyadic values."""
    rows = np.arange(num_rows, dtype=np.uint64)[:, None]
    cols = np.arange(spec.num_sf, dtype=np.uint64)[None, :]
    return ((_hash(src, gen, rows, cols, 7) % np.uint64(4096)).astype(np.float32) + 1) / 64


def expected_route(spec, src: int, gen: int, num_rows: int, routing: str):
    """``(topk_idx int32, topk_weights float32)`` of ``[num_rows, K]`` for (src, gen).

    routing: ``"uniform"`` (ids over all experts), ``"skewed"`` (every token to one expert, the rest
    masked), ``"masked"`` (about half the entries -1).
    """
    rng = np.random.default_rng([src, gen])
    k, num_experts = spec.num_topk, spec.num_experts
    if routing == "uniform":
        idx = np.stack([rng.permutation(num_experts)[:k] for _ in range(num_rows)]) if num_rows else \
            np.zeros((0, k), np.int64)
    elif routing == "skewed":
        idx = np.full((num_rows, k), -1, np.int64)
        idx[:, 0] = gen % num_experts
    elif routing == "masked":
        idx = rng.integers(0, num_experts, (num_rows, k))
        idx[rng.random((num_rows, k)) < 0.5] = -1
    else:
        raise ValueError(f"routing={routing!r}")
    weights = rng.random((num_rows, k), dtype=np.float32)
    return idx.astype(np.int32), weights


@dataclasses.dataclass
class Stats:
    """What one rank checked (summed over ranks by `reduce`)."""

    slot_uses_checked: int = 0  #: (source rank, chunk) pairs whose payload was compared
    bytes_checked: int = 0
    mismatches: int = 0  #: differing payload bytes, plus wrong metadata fields
    delays_injected: int = 0
    chunks_produced: int = 0
    min_uses_per_slot: int = 0  #: fewest uses of any of this rank's slots
    first_mismatch: str = ""

    def reduce(self, comm) -> "Stats":
        total = Stats(**{f.name: comm.allreduce(getattr(self, f.name), op=SUM)
                         for f in dataclasses.fields(self) if f.name not in ("min_uses_per_slot", "first_mismatch")})
        total.min_uses_per_slot = comm.allreduce(self.min_uses_per_slot, op=MIN)
        total.first_mismatch = next((m for m in comm.allgather(self.first_mismatch) if m), "")
        return total


class Delays:
    """Seeded random sleeps before publish, read, ack and reuse (a slow rank or a late fence)."""

    def __init__(self, seed: int, rank: int, probability: float, max_s: float, stats: Stats):
        self.rng = np.random.default_rng([seed, rank, 0xDE1A])
        self.probability = probability
        self.max_s = max_s
        self.stats = stats

    def __call__(self) -> None:
        if self.probability and self.rng.random() < self.probability:
            self.stats.delays_injected += 1
            time.sleep(self.rng.random() * self.max_s)


@dataclasses.dataclass
class Workload:
    """One stress configuration (the same on every rank)."""

    tokens_per_rank: Sequence[int]  #: tokens of each rank in every call (its length is the world size)
    routing: str = "uniform"
    ack_policy: AckPolicy = AckPolicy.EARLY
    calls_chunks: Optional[Sequence[int]] = None  #: chunks of each call; None: one call for the tokens
    delay_probability: float = 0.0
    delay_max_s: float = 0.0


def _compare(stats: Stats, what: str, got: np.ndarray, want: np.ndarray, where: str) -> None:
    stats.bytes_checked += want.nbytes
    if got.shape != want.shape:
        stats.mismatches += max(want.size, 1)
        stats.first_mismatch = stats.first_mismatch or f"{where}: {what} shape {got.shape} != {want.shape}"
        return
    diff = got.view(np.uint8) != want.view(np.uint8)
    if diff.any():
        stats.mismatches += int(diff.sum())
        first = tuple(int(i) for i in np.argwhere(got != want)[0]) if (got != want).any() else "bytes"
        stats.first_mismatch = stats.first_mismatch or f"{where}: {what} first differs at {first}"


def check_chunk(stats: Stats, spec, view, src: int, gen: int, chunk: int, num_tokens: int, routing: str,
                rank: int) -> None:
    """Compare one received chunk with what ``src`` must have published for ``gen``, element by element."""
    where = f"rank {rank} <- rank {src} chunk {chunk} gen {gen}"
    num_valid = protocol.chunk_valid_tokens(num_tokens, chunk, spec.tokens_per_slot)
    token_base = protocol.chunk_token_base(chunk, spec.tokens_per_slot)
    stats.slot_uses_checked += 1
    for what, got, want in (("num_valid", view.num_valid, num_valid), ("token_base", view.token_base, token_base)):
        if got != want:
            stats.mismatches += 1
            stats.first_mismatch = stats.first_mismatch or f"{where}: {what} {got} != {want}"
    rows = min(view.num_valid, num_valid)
    idx, weights = expected_route(spec, src, gen, num_valid, routing)
    _compare(stats, "x", view.x, expected_x(spec, src, gen, num_valid), where)
    _compare(stats, "x_sf", view.x_sf, expected_sf(spec, src, gen, num_valid), where)
    _compare(stats, "topk_idx", view.topk_idx[:rows], idx[:rows], where)
    _compare(stats, "topk_weights", view.topk_weights[:rows], weights[:rows], where)


def produce(ring, call, chunk: int, num_tokens: int, routing: str, delay, order_rng, *, acquire=True) -> None:
    """This rank's producer of ``chunk``: acquire (unless done), write, publish (route/layout in a random
    order)."""
    spec = ring.spec
    if acquire:
        delay()  # before reuse
        ring.acquire_slot(call, chunk)
    gen = call.generation(chunk)
    num_valid = protocol.chunk_valid_tokens(num_tokens, chunk, spec.tokens_per_slot)
    idx, weights = expected_route(spec, ring.rank, gen, num_valid, routing)
    x = expected_x(spec, ring.rank, gen, num_valid)
    x_sf = expected_sf(spec, ring.rank, gen, num_valid) if spec.num_sf else None
    steps = [lambda: ring.write_route(call, chunk, idx, weights,
                                      protocol.chunk_token_base(chunk, spec.tokens_per_slot), num_valid),
             lambda: ring.write_layout(call, chunk, x, x_sf)]
    publishes = [lambda: ring.publish_route(call, chunk), lambda: ring.publish_layout(call, chunk)]
    first = int(order_rng.integers(2))  # routing and layout finish in either order
    steps[first]()
    delay()  # before publish
    publishes[first]()
    steps[1 - first]()
    delay()
    publishes[1 - first]()


def consume(ring, call, chunk: int, workload: Workload, stats: Stats, delay, order_rng) -> None:
    """This rank's consumer of ``chunk``: every source rank (in a random order), checked, acknowledged."""
    sources = order_rng.permutation(ring.world_size)
    gen = call.generation(chunk)
    for src in sources:
        src = int(src)
        ring.wait_ready(call, chunk, src)
        delay()  # before read
        view = ring.read(call, chunk, src)
        check_chunk(stats, ring.spec, view, src, gen, chunk, workload.tokens_per_rank[src], workload.routing,
                    ring.rank)
        if workload.ack_policy == AckPolicy.EARLY:
            delay()  # before ack
            ring.ack(call, chunk, src)
    if workload.ack_policy == AckPolicy.CONSERVATIVE:
        delay()  # the chunk's combine is done: acknowledge every source
        for src in sources:
            ring.ack(call, chunk, int(src))


def run_workload(ring, workload: Workload, seed: int, stats: Optional[Stats] = None) -> Stats:
    """Run every call of ``workload`` on ``ring`` in `protocol.enqueue_order`; returns this rank's stats.

    Exceptions (ProtocolTimeout, ...) propagate; the caller turns them into a collective verdict.
    """
    stats = Stats() if stats is None else stats
    spec = ring.spec
    delay = Delays(seed, ring.rank, workload.delay_probability, workload.delay_max_s, stats)
    order_rng = np.random.default_rng([seed, ring.rank, 0x0DE2])
    num_tokens = workload.tokens_per_rank[ring.rank]
    default_chunks = protocol.call_num_chunks(workload.tokens_per_rank, spec.tokens_per_slot)
    uses = np.zeros(spec.num_slots, np.int64)
    for num_chunks in (workload.calls_chunks or [default_chunks]):
        call = ring.begin_call(num_chunks)
        for op, chunk in protocol.enqueue_order(num_chunks, spec.num_slots):
            if op == "produce":
                produce(ring, call, chunk, num_tokens, workload.routing, delay, order_rng)
                uses[call.slot(chunk)] += 1
                stats.chunks_produced += 1
            else:
                consume(ring, call, chunk, workload, stats, delay, order_rng)
        ring.end_call(call)
    stats.min_uses_per_slot = int(uses.min())
    return stats


def figure_line(name: str, world_size: int, total: Stats, elapsed_s: float, **extra) -> str:
    """The figure line a stress test prints (on rank 0)."""
    more = "".join(f" {k}={v}" for k, v in extra.items())
    return (f"[figure] {name}: ranks={world_size} slot_uses_checked={total.slot_uses_checked} "
            f"wraps_per_slot>={max(total.min_uses_per_slot - 1, 0)} bytes_checked={total.bytes_checked} "
            f"mismatches={total.mismatches} delays_injected={total.delays_injected} "
            f"elapsed_s={elapsed_s:.2f}{more}")


def tokens_for(kind: str, world_size: int, tokens_per_slot: int) -> List[int]:
    """Tokens per rank for a named distribution (same on every rank)."""
    t = tokens_per_slot
    table: Dict[str, List[int]] = {
        "even": [4 * t] * world_size,
        "partial_last": [3 * t + t // 2 + 1] * world_size,
        "uneven": [(r * 5 + 3) * t // 2 + r for r in range(world_size)],
        # rank 0 has no tokens: it still publishes zero-valid chunks; with one rank the world is empty.
        "zero_rank": [0] + [(2 + r) * t + 1 for r in range(1, world_size)],
        "zero_all": [0] * world_size,
    }
    return table[kind]


def bad_inputs(ring, call, chunk: int, other_call) -> List:
    """``[(what, thunk)]``: calls that must each raise ConfigError before touching shared memory.

    ``chunk`` must be acquired by this rank and not yet written; ``chunk + 1`` (if any) not acquired;
    ``other_call`` is an open call of a different ring.
    """
    spec = ring.spec
    t, k, h = spec.tokens_per_slot, spec.num_topk, spec.hidden
    idx = np.zeros((t, k), np.int32)
    weights = np.ones((t, k), np.float32)
    x_dtype = np.uint8 if spec.x_elem_bytes == 1 else np.uint16
    x = np.zeros((t, h), x_dtype)
    x_sf = np.ones((t, spec.num_sf), np.float32) if spec.num_sf else None
    bad_idx = idx.copy()
    bad_idx[0, 0] = spec.num_experts
    below_idx = idx.copy()
    below_idx[-1, -1] = -2
    src = ring.rank
    route = ring.write_route
    cases = [
        ("topk_idx wrong shape", lambda: route(call, chunk, idx[:, :k - 1] if k > 1 else idx[:1], weights, 0, t)),
        ("topk_idx float dtype", lambda: route(call, chunk, idx.astype(np.float32), weights, 0, t)),
        ("expert id == num_experts", lambda: route(call, chunk, bad_idx, weights, 0, t)),
        ("expert id < -1", lambda: route(call, chunk, below_idx, weights, 0, t)),
        ("topk_weights float64", lambda: route(call, chunk, idx, weights.astype(np.float64), 0, t)),
        ("num_valid > tokens_per_slot", lambda: route(call, chunk, np.zeros((t + 1, k), np.int32),
                                                       np.ones((t + 1, k), np.float32), 0, t + 1)),
        ("num_valid negative", lambda: route(call, chunk, idx, weights, 0, -1)),
        ("num_valid not an int", lambda: route(call, chunk, idx, weights, 0, float(t))),
        ("token_base negative", lambda: route(call, chunk, idx, weights, -t, t)),
        ("rows != num_valid", lambda: route(call, chunk, idx, weights, 0, t - 1)),
        ("chunk == num_chunks", lambda: route(call, call.num_chunks, idx, weights, 0, t)),
        ("chunk negative", lambda: route(call, -1, idx, weights, 0, t)),
        ("call of another ring", lambda: route(other_call, chunk, idx, weights, 0, t)),
        ("not a call", lambda: route(None, chunk, idx, weights, 0, t)),
        ("x wrong hidden", lambda: ring.write_layout(call, chunk, x[:, :-8], x_sf)),
        ("x too many rows", lambda: ring.write_layout(call, chunk, np.zeros((t + 1, h), x_dtype), x_sf)),
        ("x float32", lambda: ring.write_layout(call, chunk, x.astype(np.float32), x_sf)),
        ("x 1-D", lambda: ring.write_layout(call, chunk, x.reshape(-1), x_sf)),
        ("publish_route before write_route", lambda: ring.publish_route(call, chunk)),
        ("wait_ready src_rank == world_size", lambda: ring.wait_ready(call, chunk, ring.world_size)),
        ("wait_ready src_rank negative", lambda: ring.wait_ready(call, chunk, -1)),
        ("read before wait_ready", lambda: ring.read(call, chunk, src)),
        ("ack before wait_ready", lambda: ring.ack(call, chunk, src)),
        ("acquire twice", lambda: ring.acquire_slot(call, chunk)),
        ("begin_call while a call is open", lambda: ring.begin_call(1)),
        ("view slot out of range", lambda: ring.x(spec.num_slots)),
        ("view rank out of range", lambda: ring.meta(0, ring.world_size)),
    ]
    if spec.num_sf:
        cases += [
            ("x_sf missing for fp8", lambda: ring.write_layout(call, chunk, x, None)),
            ("x_sf wrong shape", lambda: ring.write_layout(call, chunk, x, x_sf[:, :0])),
            ("x_sf float64", lambda: ring.write_layout(call, chunk, x, x_sf.astype(np.float64))),
        ]
        for name, value in (("NaN", np.nan), ("infinite", np.inf), ("negative", -0.5), ("zero", 0.0)):
            bad_sf = x_sf.copy()
            bad_sf[-1, -1] = value  # one scale: every consumer would dequantise its group wrong
            cases.append((f"x_sf {name}", lambda bad_sf=bad_sf: ring.write_layout(call, chunk, x, bad_sf)))
    else:
        cases.append(("x_sf given for bf16", lambda: ring.write_layout(call, chunk, x, np.ones((t, 1), np.float32))))
    if chunk + 1 < call.num_chunks:
        cases += [
            ("write_route before acquire_slot", lambda: route(call, chunk + 1, idx, weights, 0, t)),
            ("write_layout before acquire_slot", lambda: ring.write_layout(call, chunk + 1, x, x_sf)),
            ("publish_layout before acquire_slot", lambda: ring.publish_layout(call, chunk + 1)),
        ]
    return cases


def own_bytes(ring) -> np.ndarray:
    """A copy of this rank's whole ring allocation (to show a rejected call changed nothing)."""
    return ring.ctx.backend.view(ring.allocation, ring.rank, 0, np.uint8, (ring.layout.nbytes,)).copy()
