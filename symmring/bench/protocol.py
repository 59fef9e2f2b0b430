"""Protocol benchmark on GPU PEs: ``python -m symmring bench protocol [--json PATH]``.

Two figures, both measured in the same run:

* **publish->observe latency** (one way, microseconds): a ping-pong of publications (``fence`` + signal
  SET on the publisher's own word, observed by the other side polling that word over NVLink with
  ``ld.acquire.sys``), timed on the device with ``%globaltimer``; one way = round trip / 2. With one PE
  the two sides are kernels on two streams of the same GPU; with several PEs, ranks 0 and 1 (on one GPU
  that needs CUDA MPS; see `symmring.launch`). Goal: <= 2 us on one GPU.
* **slot-pull bandwidth** as a ratio: the ready-made consumer pulling a large slot (``x``, ``topk``)
  from a peer's ring (its own with one PE) into local buffers, against a device-to-device copy of the
  same bytes (``cudaMemcpyAsync``) within this GPU, and against a plain peer-to-peer copy of the same bytes
  from the peer's slot (``cudaMemcpyAsync`` from its ``nvshmem_ptr`` mapping: over NVLink when the peer
  is another GPU; the same as the local copy with one PE); all timed with CUDA events, median of
  ``--repeats``. Reported with the default spinning-kernel budget (`symmring.kernels.MAX_SPIN_BLOCKS`
  blocks) and with one block per SM. Goal: pull >= 0.8 of copy. (The peer-copy reference was added
  after the last GPU session and has not run on a GPU yet.)

``--transport p2p,rdma`` measures both figures again with the rdma transport (`symmring.transport`: the
ping-pong polls the other side's word with NVSHMEM's remote atomic fetch, the consumer pulls the slot with
``nvshmemx_getmem_block``) and prints them beside p2p with their ratio. On one node NVSHMEM carries those
calls over the same P2P mapping, so the rdma rows are labelled "rdma forced on one node: a lower bound of its
overhead" (what the remote path costs in instructions and protocol, not over a network; two nodes were not
run). With one PE the pull reads this PE's own slot, which is never rdma, so only the latency row moves.

Prints a table on rank 0 and writes the figures as JSON (``--json``; the rdma figures under
``transports``). Returns the exit status.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

GOAL_LATENCY_US = 2.0
GOAL_PULL_RATIO = 0.8
#: The label of every rdma figure measured on one node.
RDMA_LABEL = "rdma forced on one node: a lower bound of its overhead"
_PULL_LABELS = ("spin_budget", "all_sms", "two_per_sm")


def _pingpong(backend, num_rounds: int, first_value: int, timeout_s: float, rdma: bool = False) -> Optional[float]:
    """One-way latency in us between ranks 0 and 1 (two streams of rank 0 with one PE); None elsewhere.
    ``rdma``: the observing side polls with NVSHMEM's remote atomic fetch instead of its mapping."""
    import cupy
    module = backend.library_module("ring")
    fn = module.function("symmring_bench_pingpong")
    alloc = backend.alloc(256)
    out_init = cupy.zeros(2, dtype=cupy.uint64)
    out_resp = cupy.zeros(2, dtype=cupy.uint64)
    word0, word1 = np.uint64(backend.address(alloc, backend.rank)), np.uint64(backend.address(alloc, backend.rank) + 128)
    timeout_ns = np.uint64(int(timeout_s * 1e9))
    rounds, first = np.int32(num_rounds), np.uint64(first_value)
    result = None
    try:
        backend.barrier()
        if backend.world_size == 1:
            responder, initiator = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
            fn((1,), (32,), (word1, word0, np.int32(0), rounds, np.int32(0), first, timeout_ns, out_resp,
                             np.int32(rdma)), stream=responder)
            fn((1,), (32,), (word0, word1, np.int32(0), rounds, np.int32(1), first, timeout_ns, out_init,
                             np.int32(rdma)), stream=initiator)
            cupy.cuda.runtime.deviceSynchronize()
        elif backend.rank in (0, 1):
            other = 1 - backend.rank
            fn((1,), (32,), (word0, word0, np.int32(other), rounds, np.int32(1 if backend.rank == 0 else 0), first,
                             timeout_ns, out_init, np.int32(rdma)), stream=cupy.cuda.Stream(non_blocking=True))
            cupy.cuda.runtime.deviceSynchronize()
        if backend.rank == 0:
            elapsed_ns, done = (int(v) for v in out_init.get())
            result = elapsed_ns / 1e3 / (2 * done) if done == num_rounds else None
        backend.barrier()
    finally:
        backend.free(alloc)
    return result


def _median_ms(launch, repeats: int, hold, inner: int = 5) -> float:
    """Median device time of ``launch()`` in ms: each sample enqueues ``inner`` launches behind a device
    wait of ``hold`` (so the host's enqueue cost never shows up as idle device time)."""
    import cupy
    times: List[float] = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        hold()
        start.record()
        for _ in range(inner):
            launch()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / inner)
    return statistics.median(times)


#: Items of one run, for the progress lines: latency, the copy references, three pull configurations.
_NUM_ITEMS = 5


def _pull(backend, tokens: int, hidden: int, repeats: int, started_s: float,
          transport: str = "p2p") -> Optional[Dict[str, float]]:
    """Pull-vs-copy figures on rank 0 (pulling from rank 1, or from itself with one PE) with ``transport``."""
    import cupy

    from . import progress
    from ..kernels import MAX_SPIN_BLOCKS, DeviceRing
    from ..layout import RingSpec
    spec = RingSpec(num_slots=1, tokens_per_slot=tokens, hidden=hidden, num_topk=8, num_experts=256,
                    x_format="bf16")
    ring = DeviceRing(backend, spec, timeout_s=30.0, transport=transport)
    hold_word = backend.alloc(64)  # a word nobody sets: a bounded wait on it holds the stream ~2 ms

    def hold():
        backend._launch("symmring_word_wait", (np.uint64(hold_word.ptr), np.int32(backend.rank), np.int32(0),
                                               np.uint64(1), np.uint64(2_000_000), backend._result))

    result = None
    try:
        k = ring.kernels
        rng = np.random.default_rng(backend.rank)
        x = cupy.asarray(rng.integers(0, 2**16, (tokens, hidden), dtype=np.uint16))
        idx = cupy.asarray(rng.integers(0, 256, (tokens, 8), dtype=np.int32))
        w = cupy.asarray(rng.random((tokens, 8), dtype=np.float32))
        k.produce(0, x=x, topk_idx=idx, topk_weights=w, token_base=0, num_valid=tokens, num_blocks=backend.num_sms)
        backend.barrier()
        if backend.rank == 0:
            src = 1 if backend.world_size > 1 else 0
            out = k.new_outputs()
            num_bytes = tokens * (hidden * 2 + 8 * 8)
            figures = {"bytes": num_bytes, "src_rank": src}
            # The reference: a device-to-device copy of the same bytes (local slot -> local buffer).
            local = backend.address(ring.alloc, backend.rank, ring.layout["x"].offset)
            dst = cupy.empty(num_bytes, dtype=cupy.uint8)
            copy_ms = _median_ms(lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, local, num_bytes, 3,
                                                                       cupy.cuda.get_current_stream().ptr),
                                 repeats, hold)
            figures["copy_GBps"] = 2 * num_bytes / copy_ms / 1e6  # bytes read + written
            # The peer-to-peer reference: the same bytes copied from the source's slot (one direction).
            peer = backend.address(ring.alloc, src, ring.layout["x"].offset)
            peer_ms = _median_ms(lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, peer, num_bytes, 3,
                                                                       cupy.cuda.get_current_stream().ptr),
                                 repeats, hold)
            figures["peer_copy_GBps"] = num_bytes / peer_ms / 1e6  # bytes moved in one direction
            progress("bench protocol", 2, _NUM_ITEMS, f"copy {figures['copy_GBps']:.0f} GB/s, peer copy "
                     f"{figures['peer_copy_GBps']:.0f} GB/s", started_s=started_s)
            for label, blocks in (("spin_budget", MAX_SPIN_BLOCKS), ("all_sms", backend.num_sms),
                                  ("two_per_sm", 2 * backend.num_sms)):
                k.consume(0, src, out, ack=False, num_blocks=blocks)  # warm-up
                pull_ms = _median_ms(lambda: k.consume(0, src, out, ack=False, num_blocks=blocks), repeats, hold)
                figures[f"pull_{label}_blocks"] = blocks
                figures[f"pull_{label}_GBps"] = 2 * num_bytes / pull_ms / 1e6
                figures[f"pull_{label}_ratio"] = copy_ms / pull_ms
                figures[f"pull_{label}_vs_peer_copy"] = peer_ms / pull_ms
                progress("bench protocol", 3 + ("spin_budget", "all_sms", "two_per_sm").index(label),
                         _NUM_ITEMS, f"pull with {blocks} blocks: {figures[f'pull_{label}_ratio']:.2f} of copy",
                         started_s=started_s)
            k.check_errors()
            want = np.random.default_rng(src).integers(0, 2**16, (tokens, hidden), dtype=np.uint16)
            figures["pulled_bitwise_equal"] = bool(np.array_equal(out["x"].get(), want))
            result = figures
        backend.barrier()
    finally:
        backend.free(hold_word)
        ring.close()
    return result


def parse_transports(text: str) -> List[str]:
    """``--transport``'s comma-separated list: ``p2p`` and/or ``rdma``, p2p first (the reference).

    Example:
        >>> parse_transports("rdma,p2p")
        ['p2p', 'rdma']
    """
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in ("p2p", "rdma")]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"--transport={text!r}: expected p2p, rdma or p2p,rdma")
    return sorted(names, key=("p2p", "rdma").index)


def run(*, rounds: int = 10000, tokens: int = 8192, hidden: int = 7168, repeats: int = 20,
        transports: Sequence[str] = ("p2p",)) -> Dict[str, object]:
    """Run the benchmark on this process's PE (collective); returns the figures (complete on rank 0): the
    first transport's at the top level, every transport's under ``transports``."""
    from ..backends.nvshmem import NvshmemBackend
    from . import progress
    started_s = time.perf_counter()
    backend = NvshmemBackend()
    per_transport: Dict[str, Dict[str, object]] = {}
    try:
        for t in transports:
            rdma = t == "rdma"
            _pingpong(backend, 200, 1, 10.0, rdma)  # warm-up: module load, first launches
            latency_us = _pingpong(backend, rounds, 1_000_000, 30.0, rdma)
            progress("bench protocol", 1, _NUM_ITEMS, f"{t}: publish->observe {latency_us or float('nan'):.2f} us "
                     "one way", rank=backend.rank, started_s=started_s)
            pull = _pull(backend, tokens, hidden, repeats, started_s, transport=t)
            per_transport[t] = {"publish_observe_one_way_us": latency_us, "pull": pull}
        first = per_transport[transports[0]]
        return {"benchmark": "protocol", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "device": backend.device, "world_size": backend.world_size, "pes_per_gpu": backend.pes_per_gpu,
                "rounds": rounds, "publish_observe_one_way_us": first["publish_observe_one_way_us"],
                "goal_latency_us": GOAL_LATENCY_US, "pull": first["pull"], "goal_pull_ratio": GOAL_PULL_RATIO,
                "transports": per_transport, "rank": backend.rank}
    finally:
        backend.finalize()


def format_table(figures: Dict[str, object]) -> str:
    pull = figures.get("pull") or {}
    lat = figures.get("publish_observe_one_way_us")
    where = "2 streams, 1 PE" if figures["world_size"] == 1 else f"PE 0 <-> PE 1 of {figures['world_size']}"
    rows = [("device", figures["device"]),
            ("publish->observe, one way", f"{lat:.2f} us ({where}; goal <= {GOAL_LATENCY_US} us)" if lat else "failed")]
    if pull:
        rows.append(("copy (D2D, same bytes)", f"{pull['copy_GBps']:.0f} GB/s ({pull['bytes'] / 1e6:.1f} MB)"))
        rows.append((f"peer copy from PE {pull['src_rank']}", f"{pull['peer_copy_GBps']:.0f} GB/s per direction"))
        for label in ("spin_budget", "all_sms", "two_per_sm"):
            rows.append((f"pull, {pull[f'pull_{label}_blocks']} blocks",
                         f"{pull[f'pull_{label}_GBps']:.0f} GB/s = {pull[f'pull_{label}_ratio']:.2f} of copy "
                         f"(goal >= {GOAL_PULL_RATIO}); {pull[f'pull_{label}_GBps'] / 2:.0f} GB/s per direction = "
                         f"{pull[f'pull_{label}_vs_peer_copy']:.2f} of the peer copy"))
    rows += _rdma_rows(figures)
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _rdma_rows(figures: Dict[str, object]) -> List[tuple]:
    """The rdma transport's rows beside p2p (when both ran), each with its ratio to p2p."""
    per = figures.get("transports") or {}
    p2p, rdma = per.get("p2p"), per.get("rdma")
    if not p2p or not rdma:
        return []
    rows = [(RDMA_LABEL, "")]
    lat, ref = rdma["publish_observe_one_way_us"], p2p["publish_observe_one_way_us"]
    rows.append(("rdma publish->observe, one way",
                 f"{lat:.2f} us = {lat / ref:.2f}x p2p" if lat and ref else "failed"))
    pull, ref_pull = rdma.get("pull") or {}, p2p.get("pull") or {}
    if pull and ref_pull:
        note = " (1 PE: its own slot, not rdma)" if figures["world_size"] == 1 else ""
        for label in _PULL_LABELS:
            gbps, ref_gbps = pull[f"pull_{label}_GBps"], ref_pull[f"pull_{label}_GBps"]
            rows.append((f"rdma pull, {pull[f'pull_{label}_blocks']} blocks",
                         f"{gbps:.0f} GB/s = {gbps / ref_gbps:.2f} of p2p pull{note}"))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m symmring bench protocol",
        description="Protocol benchmark on GPU PEs: one-way publish->observe latency (goal <= 2 us) and the "
                    "slot-pull bandwidth as a ratio of a device-to-device copy of the same bytes (goal >= 0.8). "
                    "One PE: two streams of one GPU; several PEs: ranks 0 and 1 (start them with "
                    "python -m symmring.launch). Prints a table on rank 0.")
    parser.add_argument("--json", help="write the figures to this file (rank 0)")
    parser.add_argument("--rounds", type=int, default=10000, help="ping-pong rounds")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the pulled slot")
    parser.add_argument("--hidden", type=int, default=7168, help="bf16 channels per token")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (median)")
    parser.add_argument("--transport", default="p2p",
                        help="p2p, rdma or p2p,rdma: measure with each (symmring.transport); rdma is printed beside "
                             "p2p with its ratio (" + RDMA_LABEL + ")")
    args = parser.parse_args(argv)
    try:
        transports = parse_transports(args.transport)
    except ValueError as exc:
        parser.error(str(exc))
    from ..backends.nvshmem import gpu_available
    if not gpu_available():
        print("symmring bench protocol: needs a CUDA GPU, CuPy, nvshmem4py and nvidia-nvshmem", file=sys.stderr)
        return 2
    figures = run(rounds=args.rounds, tokens=args.tokens, hidden=args.hidden, repeats=args.repeats,
                  transports=transports)
    if figures["rank"] != 0:
        return 0
    print(format_table(figures))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)
    ok = all(f["publish_observe_one_way_us"] is not None and f["pull"] is not None
             for f in figures["transports"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
