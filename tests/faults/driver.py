"""One host-side fault in an MPI job, on the CPU layer, the Ring, the GPU layer or the device ring.

Run on every rank: ``mpiexec -n 3 python tests/faults/driver.py SUBJECT FAULT OUTDIR`` with
``SYMMRING_TIMEOUT_S`` and ``SYMMRING_HOST_TIMEOUT_S`` set (the bound); the GPU subjects under ``python -m
symmring.launch -n N --mps --``
(tests/test_faults.py and tests/gpu/test_layer_faults.py run it). The faulty rank is the last one; after a
clean warm-up call and a barrier, every rank starts one more call, and the faulty rank instead

* ``late``: starts it ``LATE_S`` (20) seconds late;
* ``exit``: calls ``sys.exit(0)`` instead (Python's exit runs, so MPI is finalized on that rank);
* ``hard-exit``: calls ``os._exit(0)`` instead (the process vanishes without finalizing MPI);
* ``stall``: stops publishing part-way through the call, at chunk ``STALL_CHUNK`` (2): its producer sleeps
  ``LATE_S`` there (on the host for ``layer``, ``ring`` and ``ring-gpu``; on the device for ``gpu-layer``,
  through ``debug.forward(producer_delay_ns=...)``: the host has enqueued the whole call).

SUBJECT is

* ``layer``: `symmring.MoE` on the host backend (the CPU layer), a streamed forward of 8 chunks through 2 slots;
* ``ring``: `symmring.Ring` driven in `protocol.enqueue_order`, 8 chunks through 2 slots;
* ``gpu-layer``: `symmring.moe.gpu.MoE` on the nvshmem backend, a streamed forward of 4 chunks through 2
  slots (bf16 dispatch, torch experts);
* ``ring-gpu``: `symmring.kernels.DeviceRing` on the nvshmem backend, 3 chunks through 2 slots in
  `protocol.enqueue_order` on one stream.

The GPU calls are asynchronous: a rank observes a device wait that hit its bound (the wait records the error,
raises every other PE's abort word, and the kernels return) at ``torch.cuda.synchronize()`` /
``check_errors()`` right after the call, which is part of the timed call. The GPU calls are sized so that
every device wait a survivor can run into is a wait for the faulty rank's publication (no slot is reused
after the stalled chunk): a timed-out wait for acknowledgements (``reuse``) would abort the other PEs with a
word that names the waiting PE, not the one it waited for.

Every rank that gets an error writes ``OUTDIR/rank<r>.json`` (error type, text, the peer, origin and
missing ranks it names, seconds from the start of the call) and exits with status 3 at once -- which goes
through symmring's exit hook (the ranks are out of step): it marks this rank's exit, waits (bounded) until
every other survivor has reported too, then ends the job (``MPI_Abort``; ``os._exit(1)`` under torchrun,
whose agent then stops the other workers), not through ``MPI_Finalize``, and runs no collective teardown
(no ``nvshmem_free``/``nvshmem_finalize``, which would wait for the faulty rank). The driver itself waits
for nobody: that the other survivors still report is the exit hook's doing (`symmring.collective`).

The same driver runs under torchrun (``torchrun --standalone --nproc-per-node 3 tests/faults/driver.py ...``):
`symmring.init` joins torch.distributed's default group.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import symmring
import symmring.world
from symmring import protocol
from symmring.collective import Collectives
from symmring.moe.cpu.layer import shard_experts
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig

#: How late the faulty rank starts (late) or how long its producer sleeps (stall): far beyond the bound.
LATE_S = 20.0
#: The bound of the ranks' start (before the context: imports, torchrun starting its workers).
STARTUP_S = 120.0
#: Chunks of the call and tokens per chunk; slots of the ring.
NUM_CHUNKS, TOKENS_PER_SLOT, NUM_SLOTS = 8, 4, 2
HIDDEN, INTER, NUM_EXPERTS, TOPK = 64, 16, 6, 2
STALL_CHUNK = 2
#: The GPU subjects: a layer and ring that every world of 1, 2, 4 or 8 PEs splits evenly (bf16 rows of 16-byte
#: multiples); chunks per call such that no slot is reused after the stalled chunk (see the docstring).
GPU_HIDDEN, GPU_INTER, GPU_NUM_EXPERTS = 256, 128, 8
GPU_LAYER_CHUNKS, RING_GPU_CHUNKS = 4, 3
SUBJECTS = ("layer", "ring", "gpu-layer", "ring-gpu")
FAULTS = ("late", "exit", "hard-exit", "stall")


def layer_subject(ctx):
    """A small streamed MoE layer; returns ``call(stall)`` running one forward."""
    rng = np.random.default_rng(7)
    w_gate = rng.standard_normal((NUM_EXPERTS, INTER, HIDDEN), dtype=np.float32) / 8
    w_up = rng.standard_normal((NUM_EXPERTS, INTER, HIDDEN), dtype=np.float32) / 8
    w_down = rng.standard_normal((NUM_EXPERTS, HIDDEN, INTER), dtype=np.float32) / 4
    router = rng.standard_normal((NUM_EXPERTS, HIDDEN), dtype=np.float32)
    n = NUM_CHUNKS * TOKENS_PER_SLOT
    layer = symmring.MoE(ctx, symmring.Experts(*shard_experts(w_gate, w_up, w_down, ctx.rank, ctx.world_size)),
                         symmring.RoutingConfig(NUM_EXPERTS, TOPK), max_tokens=n,
                         schedule=symmring.ScheduleConfig(x_format="bf16", tokens_per_slot=TOKENS_PER_SLOT,
                                                          num_slots=NUM_SLOTS))
    x = rng.standard_normal((n, HIDDEN), dtype=np.float32)
    executor = layer.executor
    produce = executor._produce

    def call(stall: bool):
        if stall:
            def stalled(ring, call, chunk, *args):
                if chunk == STALL_CHUNK:
                    time.sleep(LATE_S)  # stops publishing: every later chunk of this rank is late
                return produce(ring, call, chunk, *args)
            executor._produce = stalled
        layer.forward(x, router_weight=router, streaming=True)
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


def gpu_layer_subject(ctx):
    """A small streamed GPU MoE layer (`symmring.moe.gpu.MoE`); ``call(stall)`` runs one forward and
    synchronises, so a device wait that hit its bound is raised here (`MoE.check_errors`)."""
    import torch
    from symmring.moe.gpu import MoE
    device = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(7)
    E, R = GPU_NUM_EXPERTS, ctx.world_size
    lo, hi = ctx.rank * E // R, (ctx.rank + 1) * E // R

    def bf16(a):
        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(device=device, dtype=torch.bfloat16)

    w_gate = rng.standard_normal((E, GPU_INTER, GPU_HIDDEN)) / 16
    w_up = rng.standard_normal((E, GPU_INTER, GPU_HIDDEN)) / 16
    w_down = rng.standard_normal((E, GPU_HIDDEN, GPU_INTER)) / 12
    router = bf16(rng.standard_normal((E, GPU_HIDDEN)) / 16)
    n = GPU_LAYER_CHUNKS * TOKENS_PER_SLOT
    layer = MoE(ctx, Experts(bf16(w_gate[lo:hi]), bf16(w_up[lo:hi]), bf16(w_down[lo:hi])), RoutingConfig(E, TOPK),
                max_tokens=n,
                schedule=ScheduleConfig(num_slots=NUM_SLOTS, tokens_per_slot=TOKENS_PER_SLOT, x_format="bf16"),
                engine="torch")
    x = bf16(np.random.default_rng(11 + ctx.rank).standard_normal((n, GPU_HIDDEN)))

    def call(stall: bool):
        # stall: the producer spins LATE_S on the device before chunk STALL_CHUNK (the host enqueued it all).
        hook = dict(producer_delay_ns={STALL_CHUNK: int(LATE_S * 1e9)}) if stall else {}
        (layer.debug.forward if hook else layer.forward)(x, router_weight=router, streaming=True, **hook)
        torch.cuda.synchronize()  # bounded: every device wait ends within the bound (or at an abort)
        layer.check_errors()
    return call


def ring_gpu_subject(ctx):
    """A small `symmring.kernels.DeviceRing`; ``call(stall)`` enqueues one call in the enqueue order on one
    stream (the stalled rank sleeps on the host before producing chunk STALL_CHUNK), synchronises and
    raises the device error (`RingKernels.check_errors`)."""
    import cupy
    from symmring.kernels import DeviceRing
    spec = symmring.RingSpec(num_slots=NUM_SLOTS, tokens_per_slot=TOKENS_PER_SLOT, hidden=GPU_HIDDEN,
                             num_topk=TOPK, num_experts=GPU_NUM_EXPERTS, x_format="bf16")
    ring = DeviceRing(ctx.backend, spec, timeout_s=ctx.timeout_s)
    k, T = ring.kernels, TOKENS_PER_SLOT
    x = cupy.zeros((T, GPU_HIDDEN), cupy.uint16)
    idx = cupy.zeros((T, TOPK), cupy.int32)
    weights = cupy.ones((T, TOPK), cupy.float32)
    outputs = {src: k.new_outputs() for src in range(ctx.world_size)}  # synchronises: the inputs are ready
    stream = cupy.cuda.Stream(non_blocking=True)

    def call(stall: bool):
        for op, chunk in protocol.enqueue_order(RING_GPU_CHUNKS, NUM_SLOTS):
            if op == "produce":
                if stall and chunk == STALL_CHUNK:
                    time.sleep(LATE_S)
                k.produce(chunk, x=x, topk_idx=idx, topk_weights=weights, token_base=chunk * T, num_valid=T,
                          stream=stream)
            else:
                for src in range(ctx.world_size):
                    k.consume(chunk, src, outputs[src], stream=stream)
        k.end_call(RING_GPU_CHUNKS, stream=stream)
        k.check_errors(synchronize=True)  # bounded: every device wait ends within the bound (or at an abort)
    return call


def main(subject: str, fault: str, outdir: str) -> int:
    if subject not in SUBJECTS or fault not in FAULTS:
        print(f"usage: driver.py {{{','.join(SUBJECTS)}}} {{{','.join(FAULTS)}}} OUTDIR", file=sys.stderr)
        return 2
    gpu = subject in ("gpu-layer", "ring-gpu")
    if subject == "gpu-layer":
        import torch  # noqa: F401 - imported first, so the nvshmem backend puts torch on the PE's device
    # Every rank started (imports done) before the context's collectives, whose bound is the short one under
    # test: torchrun starts its workers one by one, and on a loaded machine one may come seconds after another.
    started = Collectives(symmring.world.resolve(timeout_s=STARTUP_S), STARTUP_S, what="driver: all started")
    started.barrier(what="driver: all started")
    started.close()
    ctx = symmring.init("nvshmem" if gpu else "host")
    rank, faulty = ctx.rank, ctx.world_size - 1
    make = {"layer": layer_subject, "ring": ring_subject, "gpu-layer": gpu_layer_subject,
            "ring-gpu": ring_gpu_subject}[subject]
    call = make(ctx)
    call(False)  # warm-up: everything allocated (and compiled), one clean call on every rank
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
        record.update(error=type(exc).__name__, text=str(exc), kind=getattr(exc, "kind", None),
                      peer=getattr(exc, "peer", None), origin=getattr(exc, "origin", None),
                      origin_peer=getattr(exc, "origin_peer", None),
                      missing_ranks=[int(r) for r in getattr(exc, "missing_ranks", ()) or ()],
                      typed=isinstance(exc, symmring.ProtocolTimeout))
    record["elapsed_s"] = round(time.monotonic() - start_s, 3)
    path = Path(outdir) / f"rank{rank}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record))
    partial.rename(path)  # whole or absent, even if the job ends under this rank
    if record["error"] is None:
        ctx.close()
        return 0
    return 3


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
