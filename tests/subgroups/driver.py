"""Independent expert-parallel groups in one job: each group its own context, workspace and two MoE layers.

Run on every rank of a job (mpiexec, torchrun, or ``python -m symmring.launch [--torchrun] [--mps]``)::

    python tests/subgroups/driver.py OUTDIR [--groups G] [--seed S] [--backend host|nvshmem]

The job's ranks split into ``G`` groups of consecutive ranks (``{0, 1}`` and ``{2, 3}`` for 4 ranks and
``--groups 2``): a torch.distributed subgroup per group (``new_group``, after the driver initialised the
default group with gloo) under torchrun, an MPI ``comm.Split`` under mpiexec, and ``symmring.init(group=...)`` / ``init(comm=...)`` on each. Group ``g`` runs
the seeded workload of seed ``S + g``, which depends only on the seed and the group's size: two layers of
different shapes on the context's workspace, layer A batch-ready, layer B streamed, then one
`symmring.Workspace.step` with both (uneven token counts, zero included). Every rank writes its outputs to
``OUTDIR/g<g>_r<group rank>.npz`` and checks them against the NumPy reference (the CPU layer: rtol 1e-5;
the GPU layer, bf16 experts: relative error 1e-2), printing one line per rank; exit status 0 when they match.

tests/test_under_mpi.py compares the files of a 4-rank job of two groups with those of 2-rank jobs of one
group (bitwise: a group in a larger job computes exactly what a job of its own does), and those of the same
job under mpiexec and torchrun; tests/gpu/test_launchers.py does the same on GPU PEs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

import symmring
from symmring import world as worlds
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig

NUM_EXPERTS = 12  # an even split over groups of 1, 2, 3 or 4 ranks (the GPU layer needs one)
#: Layer A and B: (hidden, inter, top-k).
SHAPES = {"a": (256, 64, 2), "b": (128, 32, 3)}
TOKENS_PER_SLOT, NUM_SLOTS = 8, 2


def split(num_groups: int):
    """This rank's group: ``(group index, the ranks to pass to init as comm= or group=)``."""
    if worlds.launcher_world()[0] == "torchrun":
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")  # subgroups need the default group (new_group)
        size, rank = dist.get_world_size(), dist.get_rank()
        per = size // num_groups
        groups = [dist.new_group(list(range(g * per, (g + 1) * per))) for g in range(num_groups)]  # every rank
        return rank // per, dict(group=groups[rank // per])
    from symmring.env import host_timeout_s
    ranks = worlds.resolve(timeout_s=host_timeout_s())
    size, rank = ranks.Get_size(), ranks.Get_rank()
    per = size // num_groups
    return rank // per, dict(comm=ranks.Split(color=rank // per, key=rank))


def problem(seed: int, size: int):
    """The group's global problem: per layer weights, router and every rank's tokens; the step's counts."""
    rng = np.random.default_rng(seed)
    layers = {}
    for name, (hidden, inter, topk) in SHAPES.items():
        w = [(rng.standard_normal(s) / math.sqrt(s[-1])).astype(np.float32)
             for s in ((NUM_EXPERTS, inter, hidden), (NUM_EXPERTS, inter, hidden), (NUM_EXPERTS, hidden, inter))]
        router = (rng.standard_normal((NUM_EXPERTS, hidden)) / math.sqrt(hidden)).astype(np.float32)
        layers[name] = (w, router, topk)
    counts = [int(c) for c in rng.integers(0, 24, size)]
    counts[0] = 0 if size > 1 else counts[0]  # a rank with no tokens
    step_counts = [int(c) for c in rng.integers(1, 20, size)]
    xs = {(name, part): _bf16((rng.standard_normal((sum(c), SHAPES[name][0]))).astype(np.float32))
          for name in SHAPES for part, c in (("call", counts), ("step", step_counts))}
    return layers, counts, step_counts, xs


def _bf16(a: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)  # exact on the GPU layer's bf16 path too


def host_layers(ctx, layers, max_tokens: int):
    from symmring.moe.cpu.layer import ExpertParallelMoE, shard_experts
    schedule = ScheduleConfig(num_slots=NUM_SLOTS, tokens_per_slot=min(TOKENS_PER_SLOT, max_tokens), x_format="bf16")
    return {name: ExpertParallelMoE(ctx, Experts(*shard_experts(*w, ctx.rank, ctx.world_size)),
                                    RoutingConfig(NUM_EXPERTS, topk), max_tokens=max_tokens, schedule=schedule)
            for name, (w, _, topk) in layers.items()}


def gpu_layers(ctx, layers, max_tokens: int):
    import torch
    from symmring.moe.gpu import MoE
    lo, hi = ctx.rank * NUM_EXPERTS // ctx.world_size, (ctx.rank + 1) * NUM_EXPERTS // ctx.world_size
    device = torch.device("cuda", torch.cuda.current_device())

    def on_gpu(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=torch.bfloat16)

    # A ring with a slot for every chunk of the largest call (as the demo's): batch and streamed alike.
    slots = max(NUM_SLOTS, -(-max_tokens // TOKENS_PER_SLOT))
    return {name: MoE(ctx, Experts(*(on_gpu(a[lo:hi]) for a in w)), RoutingConfig(NUM_EXPERTS, topk),
                      max_tokens=max_tokens, engine="torch",
                      schedule=ScheduleConfig(num_slots=slots, tokens_per_slot=TOKENS_PER_SLOT, x_format="bf16"))
            for name, (w, _, topk) in layers.items()}


def run(ctx, seed: int):
    """The group's workload on this rank: ``{output name: array}`` and ``{output name: the reference rows}``."""
    from symmring.moe.reference import reference_moe
    size, rank = ctx.world_size, ctx.rank
    layers, counts, step_counts, xs = problem(seed, size)
    gpu = ctx.backend.name != "host"
    most = max(counts + step_counts)
    made = gpu_layers(ctx, layers, most) if gpu else host_layers(ctx, layers, most)

    def rows(part_counts):
        return slice(sum(part_counts[:rank]), sum(part_counts[:rank + 1]))

    def call(name, x, streaming):
        w, router, _ = layers[name]
        if not gpu:
            return made[name].forward(x, router_weight=router, streaming=streaming)
        import torch
        from symmring.moe.reference import router_logits
        device = torch.device("cuda", torch.cuda.current_device())
        logits = torch.from_numpy(router_logits(x, router)).to(device)
        y = made[name].forward(torch.from_numpy(x).to(device=device, dtype=torch.bfloat16), logits=logits,
                               streaming=streaming)
        torch.cuda.synchronize()
        return y.float().cpu().numpy()

    outputs = {"a_batch": call("a", xs["a", "call"][rows(counts)], False),
               "b_streamed": call("b", xs["b", "call"][rows(counts)], True)}
    with ctx.workspace().step(step_counts[rank]):
        for name in SHAPES:
            outputs[f"{name}_step"] = call(name, xs[name, "step"][rows(step_counts)], False)
    for layer in made.values():
        layer.close()
    refs = {}
    for key in outputs:
        name, part = key[0], "step" if key.endswith("step") else "call"
        w, router, topk = layers[name]
        ref = reference_moe(xs[name, part], w_gate=w[0], w_up=w[1], w_down=w[2], num_topk=topk,
                            router_weight=router, x_format="bf16")
        refs[key] = ref.y[rows(step_counts if part == "step" else counts)]
    return outputs, refs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tests/subgroups/driver.py")
    parser.add_argument("outdir")
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--backend", default="host", choices=("host", "nvshmem"))
    args = parser.parse_args(argv)
    if args.backend == "nvshmem":
        import torch  # noqa: F401 - first, so the nvshmem backend puts torch on the PE's device
    g, ranks = split(args.groups)
    ctx = symmring.init(args.backend, **ranks)
    outputs, refs = run(ctx, args.seed + g)
    np.savez(Path(args.outdir) / f"g{g}_r{ctx.rank}.npz", **outputs)
    errors = {}
    for key, y in outputs.items():
        ref = refs[key]
        scale = float(np.linalg.norm(ref)) or 1.0
        errors[key] = float(np.linalg.norm(y.astype(np.float64) - ref)) / scale if y.size else 0.0
    bound = 1e-2 if args.backend == "nvshmem" else 1e-5
    ok = all(e <= bound for e in errors.values())
    print(f"subgroups: group {g} rank {ctx.rank}/{ctx.world_size} seed {args.seed + g} over {ctx.collectives.kind}: "
          + ", ".join(f"{k} rel.err {e:.2e}" for k, e in errors.items()) + f" (<= {bound:g}): {'ok' if ok else 'FAIL'}",
          flush=True)
    ctx.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
