"""The GPU MoE layer over the rdma transport (`symmring.transport`), forced on one node.

On one node every peer is mapped, so ``transport="rdma"`` (every peer) and ``"rdma:<odd ranks>"`` (the
mixed run) force the remote path: rdma sources' slots are got into the staging ring (moe_dispatch_stage)
and read there, combine rows go to rdma owners as puts followed by nvshmem_quiet, every protocol word is
polled with remote atomics. NVSHMEM carries those calls over P2P here, which is what makes the run possible
on one GPU; the result must be BITWISE the p2p layer's on the same seeded weights and inputs, in the same
process, for each schedule: the batch path (bf16 pull with dequantisation, bf16 ring, fp8 pool), the
small-batch schedule's fused kernels, and the streamed schedule with chunk-local and multi-chunk windows
and both acknowledgement policies. Zero-token ranks are included.

Several PEs (1 PE has no peer: skipped):
``python -m symmring.launch -n 4 --mps -- python -m mpi4py -m pytest tests/gpu/test_transport.py -q``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import cuda_device as dev, make_tokens, make_weights, to_torch, verdict  # noqa: E402

from symmring.errors import ConfigError  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261216))
HIDDEN, INTER, NUM_EXPERTS, TOPK = 256, 256, 16, 4

# name: (layer arguments: engine, expert_dtype and the schedule's fields; forward arguments). Every config runs on
# every transport of TRANSPORTS.
CONFIGS = {
    "batch-bf16-experts-fp8-ring": (dict(engine="torch", expert_dtype="bf16", x_format="fp8_e4m3"), {}),
    "batch-bf16-ring": (dict(engine="torch", expert_dtype="bf16", x_format="bf16"), {}),
    "batch-fp8-pool": (dict(engine="builtin", expert_dtype="fp8"), dict(small_batch=False)),
    "small-batch-fused": (dict(engine="builtin", expert_dtype="fp8"), dict(small_batch=True)),
    "streamed-window-1-early": (dict(engine="builtin", expert_dtype="fp8", num_slots=2, tokens_per_slot=16,
                                     ack_policy="early"), dict(streaming=True)),
    "streamed-window-2-conservative": (dict(engine="torch", expert_dtype="bf16", num_slots=2, tokens_per_slot=16,
                                            expert_window=2, ack_policy="conservative"), dict(streaming=True)),
}
# Token counts of ranks 0..3 per call (a world of R ranks takes the first R); the small batch takes the
# first two (at most 64 tokens a rank, one chunk).
COUNTS = [(37, 0, 64, 5), (64, 64, 1, 64), (3, 50, 0, 0)]


def mixed(world_size: int) -> str:
    """rdma to the odd ranks, p2p to the others."""
    return "rdma:" + ",".join(str(q) for q in range(1, world_size, 2))


def layer(ctx, transport, engine, expert_dtype, **schedule):
    w_gate, w_up, w_down, _ = make_weights(SEED, NUM_EXPERTS, HIDDEN, INTER)
    e = NUM_EXPERTS // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    experts = Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down)),
                      expert_dtype=expert_dtype)
    return MoE(ctx, experts, RoutingConfig(NUM_EXPERTS, TOPK), max_tokens=64,
               schedule=ScheduleConfig(transport=transport, **schedule), engine=engine)


def routing(seed, n, masked: bool):
    rng = np.random.default_rng(seed)
    idx = np.array([rng.permutation(NUM_EXPERTS)[:TOPK] for _ in range(n)], dtype=np.int32).reshape(n, TOPK)
    if masked and n:
        idx[rng.random((n, TOPK)) < 0.2] = -1
    return to_torch(idx, torch.int32, dev()), to_torch(rng.random((n, TOPK)).astype(np.float32), torch.float32, dev())


def outputs(ctx, transport, name):
    """The layer's outputs over COUNTS, its ``transports`` and whether every call took the schedule asked for."""
    kwargs, fwd = CONFIGS[name]
    if "builtin" in kwargs.values():
        pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")
    moe = layer(ctx, transport, **kwargs)
    ys, schedule_ok = [], True
    try:
        counts_list = COUNTS[:2] if fwd.get("small_batch") else COUNTS
        for case, counts in enumerate(counts_list):
            n = counts[:ctx.world_size][ctx.rank]
            x = to_torch(make_tokens(SEED + 10 * case + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
            idx, w = routing(SEED + 100 * case + ctx.rank, n, masked=case == 1)
            y = moe.forward(x, topk_idx=idx, topk_weights=w, **fwd)
            moe.check_errors()
            schedule_ok &= bool(moe.last_plan.small_batch) == bool(fwd.get("small_batch"))
            ys.append(y.float().cpu().numpy())
        return ys, moe.transports, schedule_ok
    finally:
        moe.close()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rdma_and_mixed_transports_bitwise_equal_p2p(ctx, name):
    if ctx.world_size == 1:
        pytest.skip("one PE: no peer to reach over rdma")
    R = ctx.world_size
    reference, got, schedule_ok = outputs(ctx, "p2p", name)
    problems = [] if got == ["self" if q == ctx.rank else "p2p" for q in range(R)] else [f"p2p transports {got}"]
    for transport in ("rdma", mixed(R)):
        ys, got, ok = outputs(ctx, transport, name)
        schedule_ok &= ok
        want = ["self" if q == ctx.rank else "rdma" if transport == "rdma" or q % 2 == 1 else "p2p"
                for q in range(R)]
        if got != want:
            problems.append(f"{transport}: transports {got}, expected {want}")
        for case, (y, y_ref) in enumerate(zip(ys, reference)):
            if not np.array_equal(y, y_ref):
                rows = int(np.sum(np.any(y != y_ref, axis=1))) if y.shape == y_ref.shape else "all"
                problems.append(f"{transport}, call {case}: {rows} of {len(y_ref)} rows differ from p2p")
            elif len(y) and not np.isfinite(y).all():
                problems.append(f"{transport}, call {case}: non-finite output")
    if not schedule_ok:
        problems.append(f"a call did not take the schedule {CONFIGS[name][1]} asks for")
    verdict(ctx, not problems, f"{name}: " + "; ".join(problems))


def test_bad_transport_is_a_config_error_before_any_collective(ctx):
    # Raised on every rank alike before the layer allocates anything (no collective started).
    for bad in ("nvlink", "rdma:", "rdma:x", "rdma:1,1", 3):
        with pytest.raises(ConfigError, match="transport="):
            layer(ctx, bad, engine="torch", expert_dtype="bf16")
    with pytest.raises(ConfigError, match="outside"):
        layer(ctx, f"rdma:{ctx.world_size}", engine="torch", expert_dtype="bf16")
