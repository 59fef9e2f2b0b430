"""One host-side fault in an MPI job, on the CPU layer or the Ring (tests/test_faults.py runs it).

Run on every rank: ``mpiexec -n 3 python tests/faults/driver.py SUBJECT FAULT OUTDIR`` with
``SYMMRING_TIMEOUT_S`` set (the bound). The faulty rank is the last one; after a clean warm-up call and a
barrier, every rank starts one more call, and the faulty rank instead

* ``late``: starts it ``LATE_S`` (20) seconds late;
* ``exit``: calls ``sys.exit(0)`` instead (Python's exit runs, so MPI is finalized on that rank);
* ``hard-exit``: calls ``os._exit(0)`` instead (the process vanishes without finalizing MPI);
* ``stall``: stops publishing part-way through the call (its producer sleeps ``LATE_S`` at chunk 2).

SUBJECT is ``layer`` (`symmring.ExpertParallelMoE`, a streamed forward of 8 chunks through 2 slots) or
``ring`` (`symmring.Ring` driven in `protocol.enqueue_order`, 8 chunks through 2 slots). Every rank that
gets an error writes ``OUTDIR/rank<r>.json`` (error type, text, the peer and missing ranks it names,
seconds from the start of the call), waits ``GRACE_S`` so that every other survivor reaches its own
deadline before the first abort ends the job, then exits with status 3 -- which goes through symmring's
abort at exit (the ranks are out of step), not through ``MPI_Finalize``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import symmring
from symmring import protocol
from symmring.moe.expert_parallel import ExpertParallelMoE, MoEShapes, shard_experts

#: How late the faulty rank starts (late) or how long its producer sleeps (stall): far beyond the bound.
LATE_S = 20.0
#: Chunks of the call and tokens per chunk; slots of the ring.
NUM_CHUNKS, TOKENS_PER_SLOT, NUM_SLOTS = 8, 4, 2
HIDDEN, INTER, NUM_EXPERTS, TOPK = 64, 16, 6, 2
STALL_CHUNK = 2


def layer_subject(ctx):
    """A small streamed MoE layer; returns ``call(stall)`` running one forward."""
    rng = np.random.default_rng(7)
    w_gate = rng.standard_normal((NUM_EXPERTS, INTER, HIDDEN), dtype=np.float32) / 8
    w_up = rng.standard_normal((NUM_EXPERTS, INTER, HIDDEN), dtype=np.float32) / 8
    w_down = rng.standard_normal((NUM_EXPERTS, HIDDEN, INTER), dtype=np.float32) / 4
    router = rng.standard_normal((NUM_EXPERTS, HIDDEN), dtype=np.float32)
    layer = ExpertParallelMoE(ctx, MoEShapes(HIDDEN, NUM_EXPERTS, TOPK, x_format="bf16"),
                              *shard_experts(w_gate, w_up, w_down, ctx.rank, ctx.world_size))
    x = rng.standard_normal((NUM_CHUNKS * TOKENS_PER_SLOT, HIDDEN), dtype=np.float32)
    produce = layer._produce

    def call(stall: bool):
        if stall:
            def stalled(ring, call, chunk, *args):
                if chunk == STALL_CHUNK:
                    time.sleep(LATE_S)  # stops publishing: every later chunk of this rank is late
                return produce(ring, call, chunk, *args)
            layer._produce = stalled
        layer.forward(x, router_weight=router, streaming=True, tokens_per_slot=TOKENS_PER_SLOT,
                      num_slots=NUM_SLOTS)
    return call


def ring_subject(ctx):
    """A small ring; returns ``call(stall)`` running one call of every chunk in the enqueue order."""
    spec = symmring.RingSpec(num_slots=NUM_SLOTS, tokens_per_slot=TOKENS_PER_SLOT, hidden=HIDDEN, num_topk=TOPK,
                             num_experts=NUM_EXPERTS, x_format="bf16")
    ring = symmring.Ring(ctx, spec)
    idx = np.zeros((TOKENS_PER_SLOT, TOPK), np.int32)
    weights = np.ones((TOKENS_PER_SLOT, TOPK), np.float32)
    x = np.zeros((TOKENS_PER_SLOT, HIDDEN), np.uint16)

    def call(stall: bool):
        c = ring.begin_call(NUM_CHUNKS)
        for op, chunk in protocol.enqueue_order(NUM_CHUNKS, NUM_SLOTS):
            if op == "produce":
                if stall and chunk == STALL_CHUNK:
                    time.sleep(LATE_S)
                ring.acquire_slot(c, chunk)
                ring.write_route(c, chunk, idx, weights, chunk * TOKENS_PER_SLOT, TOKENS_PER_SLOT)
                ring.write_layout(c, chunk, x)
                ring.publish_route(c, chunk)
                ring.publish_layout(c, chunk)
            else:
                for src in range(ctx.world_size):
                    ring.wait_ready(c, chunk, src)
                    ring.read(c, chunk, src)
                    ring.ack(c, chunk, src)
        ring.end_call(c)
    return call


def main(subject: str, fault: str, outdir: str) -> int:
    ctx = symmring.init("host")
    rank, faulty = ctx.rank, ctx.world_size - 1
    call = (layer_subject if subject == "layer" else ring_subject)(ctx)
    call(False)  # warm-up: everything allocated, one clean call on every rank
    ctx.collectives.barrier(what="driver: start")
    if rank == faulty:
        if fault == "exit":
            sys.exit(0)
        if fault == "hard-exit":
            os._exit(0)
        if fault == "late":
            time.sleep(LATE_S)
    start_s = time.monotonic()
    record = dict(rank=rank, faulty=rank == faulty, subject=subject, fault=fault, bound_s=ctx.timeout_s)
    try:
        call(rank == faulty and fault == "stall")
        record.update(error=None)
    except Exception as exc:  # noqa: BLE001 - every error is the figure
        record.update(error=type(exc).__name__, text=str(exc), peer=getattr(exc, "peer", None),
                      missing_ranks=list(getattr(exc, "missing_ranks", ()) or ()),
                      typed=isinstance(exc, symmring.ProtocolTimeout))
    record["elapsed_s"] = round(time.monotonic() - start_s, 3)
    path = Path(outdir) / f"rank{rank}.json"
    path.write_text(json.dumps(record))
    if record["error"] is None:
        ctx.close()
        return 0
    time.sleep(0.5 * ctx.timeout_s)  # GRACE_S: the other survivors reach their own deadlines first
    return 3


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
