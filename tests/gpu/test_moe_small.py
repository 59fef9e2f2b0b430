"""The small-batch schedule of the GPU MoE layer (decode): three fused kernels around the experts.

A one-chunk batch call with fp8 dispatch and fp8 experts runs produce (route + layout), dispatch (wait +
count + scan + pull) and combine (scatter + signal + wait + reduce + end of call) as one kernel each
(`symmring.moe.gpu.stages.small_batch_call`). Its pool rows and experts are the general schedule's,
so its output must be BITWISE the general schedule's, for every ack policy, any mix of token counts per rank
(zero-token ranks included), masked entries, and graph replays, also while another stream's kernel holds
nearly every SM (the fused combine needs no residency). Auto selection follows ``small_batch_tokens``; what it
cannot run is a ConfigError before anything is enqueued.

Several PEs: ``python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_moe_small.py``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402
from gpu_helpers import ranks  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason
pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")

from moe_helpers import (agree, cuda_device as dev, fp8_engines, make_tokens, make_weights, to_torch,  # noqa: E402
                         verdict)

from symmring.errors import ConfigError, ProtocolTimeout, ProtocolViolation  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261202))
HIDDEN, INTER, NUM_EXPERTS = 256, 256, 16
ENGINES = fp8_engines()




def layer(ctx, engine, max_tokens, topk, hidden=HIDDEN, **schedule):
    """An fp8 layer with this rank's slice of seeded weights (quantised by the layer); ``schedule``:
    `ScheduleConfig`'s fields."""
    w_gate, w_up, w_down, _ = make_weights(SEED, NUM_EXPERTS, hidden, INTER)
    e = NUM_EXPERTS // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    experts = Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down)), expert_dtype="fp8")
    return MoE(ctx, experts, RoutingConfig(NUM_EXPERTS, topk), max_tokens=max_tokens,
               schedule=ScheduleConfig(**schedule), engine=engine)


def routing(seed, n, topk, masked: bool):
    """Seeded ``(topk_idx, topk_weights)`` with distinct experts per token; ``masked``: some entries -1."""
    rng = np.random.default_rng(seed)
    idx = np.array([rng.permutation(NUM_EXPERTS)[:topk] for _ in range(n)], dtype=np.int32).reshape(n, topk)
    if masked and n:
        idx[rng.random((n, topk)) < 0.2] = -1
    weights = rng.random((n, topk)).astype(np.float32)
    return to_torch(idx, torch.int32, dev()), to_torch(weights, torch.float32, dev())


def call(moe, x, idx, w, **kwargs):
    y = moe.forward(x, topk_idx=idx, topk_weights=w, **kwargs)
    moe.check_errors()
    return y.float().cpu().numpy(), moe.last_plan.small_batch


# Token counts of ranks 0..3 (a world of R ranks takes the first R).
COUNTS = [(1, 1, 1, 1), (7, 0, 3, 128), (0, 5, 0, 0), (128, 128, 128, 128), (33, 64, 1, 0)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("ack_policy", ["conservative", "early"])
@pytest.mark.parametrize("topk", [1, 8])
def test_small_batch_bitwise_equals_general(ctx, engine, ack_policy, topk):
    moe = layer(ctx, engine, 128, topk, ack_policy=ack_policy)
    problems = []
    try:
        for case, counts in enumerate(COUNTS):
            counts = counts[:ctx.world_size]
            if max(counts) == 0:
                continue
            n = counts[ctx.rank]
            x = to_torch(make_tokens(SEED + 10 * case + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
            idx, w = routing(SEED + 100 * case + ctx.rank, n, topk, masked=case % 2 == 1)
            y_small, small = call(moe, x, idx, w, small_batch=True)
            y_general, general = call(moe, x, idx, w, small_batch=False)
            y_auto, auto = call(moe, x, idx, w)
            if not (small and not general and auto):
                problems.append(f"counts {counts}: plans small={small} general={general} auto={auto}")
            for name, y in (("small", y_small), ("auto", y_auto)):
                if not np.array_equal(y, y_general):
                    rows = int(np.sum(np.any(y != y_general, axis=1)))
                    problems.append(f"counts {counts}: {name} != general ({rows} of {n} rows differ)")
            if n and not np.isfinite(y_small).all():
                problems.append(f"counts {counts}: non-finite output")
    finally:
        moe.close()
    verdict(ctx, not problems, f"{engine}/{ack_policy}/top-{topk}: " + "; ".join(problems))


@pytest.mark.parametrize("ack_policy", ["conservative", "early"])
@pytest.mark.parametrize("hidden", [1152, 3072])
def test_small_batch_bitwise_at_wider_rows(ctx, ack_policy, hidden):
    """Rows of several 256-channel warp steps (1152: nine 128-channel groups, so the last step's second
    half-warp idles) take the fused kernels' multi-warp layout, row copies and reduce slices; still
    bitwise the general schedule."""
    moe = layer(ctx, "builtin", 128, 8, hidden=hidden, ack_policy=ack_policy)
    problems = []
    try:
        for case, counts in enumerate(COUNTS[:2] + COUNTS[4:]):
            counts = counts[:ctx.world_size]
            n = counts[ctx.rank]
            x = to_torch(make_tokens(SEED + 20 * case + ctx.rank, n, hidden), torch.bfloat16, dev())
            idx, w = routing(SEED + 200 * case + ctx.rank, n, 8, masked=case == 1)
            y_small, small = call(moe, x, idx, w, small_batch=True)
            y_general, _ = call(moe, x, idx, w, small_batch=False)
            if not small:
                problems.append(f"counts {counts}: not the small-batch schedule")
            if not np.array_equal(y_small, y_general):
                rows = int(np.sum(np.any(y_small != y_general, axis=1)))
                problems.append(f"counts {counts}: small != general ({rows} of {n} rows differ)")
    finally:
        moe.close()
    verdict(ctx, not problems, f"hidden {hidden}/{ack_policy}: " + "; ".join(problems))


@pytest.mark.parametrize("engine", ENGINES)
def test_small_batch_graph_replays_bitwise(ctx, engine):
    n = 4 + ctx.rank
    moe = layer(ctx, engine, 64, 2)
    problems = []
    try:
        x = to_torch(make_tokens(SEED + 1 + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
        idx, w = routing(SEED + 2 + ctx.rank, n, 2, masked=False)
        graph, y_static = moe.capture(x, topk_idx=idx, topk_weights=w, small_batch=True)
        for replay in range(3):
            x_new = to_torch(make_tokens(SEED + 50 + 7 * replay + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
            idx_new, w_new = routing(SEED + 60 + 7 * replay + ctx.rank, n, 2, masked=replay == 1)
            x.copy_(x_new)
            idx.copy_(idx_new)
            w.copy_(w_new)
            graph.replay()
            moe.check_errors()
            got = y_static.float().cpu().numpy()
            want, _ = call(moe, x_new, idx_new, w_new, small_batch=False)
            if not np.array_equal(got, want):
                problems.append(f"replay {replay} != eager general")
        del graph
    finally:
        moe.close()
    verdict(ctx, not problems, f"{engine}: " + "; ".join(problems))


def test_small_batch_with_router_weight_matches_general(ctx):
    """The router path (logits from x @ router.T in torch) feeds the fused producer like given routing."""
    _, _, _, router = make_weights(SEED + 3, NUM_EXPERTS, HIDDEN, INTER)
    router = to_torch(router, torch.bfloat16, dev())
    moe = layer(ctx, "builtin", 32, 4)
    try:
        x = to_torch(make_tokens(SEED + 4 + ctx.rank, 32, HIDDEN), torch.bfloat16, dev())
        y_small = moe.forward(x, router_weight=router, small_batch=True).float().cpu().numpy()
        y_general = moe.forward(x, router_weight=router, small_batch=False).float().cpu().numpy()
        moe.check_errors()
        ok = np.array_equal(y_small, y_general)
    finally:
        moe.close()
    verdict(ctx, ok, "router path: small != general")


def test_auto_selection_follows_small_batch_tokens(ctx):
    moe = layer(ctx, "builtin", 16, 2, small_batch_tokens=4)
    problems = []
    try:
        for n, want in ((4, True), (5, False)):
            x = to_torch(make_tokens(SEED + n, n, HIDDEN), torch.bfloat16, dev())
            idx, w = routing(SEED + n, n, 2, masked=False)
            _, small = call(moe, x, idx, w)
            if small != want:
                problems.append(f"{n} tokens, small_batch_tokens=4: small={small}, expected {want}")
    finally:
        moe.close()
    never = layer(ctx, "builtin", 16, 2, small_batch_tokens=0)
    try:
        x = to_torch(make_tokens(SEED, 1, HIDDEN), torch.bfloat16, dev())
        idx, w = routing(SEED, 1, 2, masked=False)
        if call(never, x, idx, w)[1]:
            problems.append("small_batch_tokens=0 still chose the small-batch schedule")
    finally:
        never.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_small_batch_rejections(ctx):
    problems = []
    moe = layer(ctx, "builtin", 64, 2, tokens_per_slot=16, num_slots=4)
    try:
        x = to_torch(make_tokens(SEED, 32, HIDDEN), torch.bfloat16, dev())
        idx, w = routing(SEED, 32, 2, masked=False)
        for kwargs, what in ((dict(small_batch=True, streaming=True), "streamed"),
                             (dict(small_batch=True), "2 chunks"),
                             (dict(small_batch="yes"), "expected None, True or False")):
            try:
                moe.forward(x, topk_idx=idx, topk_weights=w, **kwargs)
                problems.append(f"{kwargs}: no ConfigError")
            except ConfigError as exc:
                if what not in str(exc):
                    problems.append(f"{kwargs}: message does not say {what!r}: {exc}")
        # Nothing was enqueued: the next call works.
        _, small = call(moe, x[:16], idx[:16], w[:16])
        if not small:
            problems.append("16 tokens (one chunk) did not take the small-batch schedule")
    finally:
        moe.close()
    w_gate, w_up, w_down, _ = make_weights(SEED, NUM_EXPERTS, HIDDEN, INTER)
    e = NUM_EXPERTS // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    bf16 = MoE(ctx, Experts(*(to_torch(a[mine], torch.bfloat16, dev()) for a in (w_gate, w_up, w_down))),
               RoutingConfig(NUM_EXPERTS, 2), max_tokens=8, engine="torch")
    try:
        x = to_torch(make_tokens(SEED, 8, HIDDEN), torch.bfloat16, dev())
        idx, w = routing(SEED, 8, 2, masked=False)
        try:
            bf16.forward(x, topk_idx=idx, topk_weights=w, small_batch=True)
            problems.append("bf16 experts with small_batch=True: no ConfigError")
        except ConfigError as exc:
            if "fp8" not in str(exc):
                problems.append(f"bf16 experts: message does not name fp8: {exc}")
        if call(bf16, x, idx, w)[1]:
            problems.append("bf16 experts chose the small-batch schedule")
    finally:
        bf16.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_programmatic_dependent_launch_is_bitwise_plain(ctx):
    """One PE per GPU on Hopper launches the fused kernels with PDL (`symmring.pdl`; several PEs on one GPU
    never do); the same calls with plain launches give bitwise the same output, eagerly and from a captured
    graph, from given top-k and from logits (the producer then routes before its slot wait)."""
    moe = layer(ctx, "builtin", 32, 8)
    launcher = moe.executor.kernels.launch
    if ctx.backend.pes_per_gpu > 1:
        problem = "PDL enabled with several PEs on one GPU" if launcher.enabled else ""
        moe.close()
        verdict(ctx, not problem, problem)
        return
    if not launcher.enabled:
        moe.close()
        pytest.skip("PDL is off here (compute capability < 9, a driver before CUDA 12.3, or SYMMRING_PDL=0)")
    problems = []
    try:
        _, _, _, router = make_weights(SEED + 73, NUM_EXPERTS, HIDDEN, INTER)
        logits = to_torch(make_tokens(SEED + 74 + ctx.rank, 3, HIDDEN), torch.bfloat16, dev()) \
            @ to_torch(router, torch.bfloat16, dev()).t()
        x = to_torch(make_tokens(SEED + 71 + ctx.rank, 3, HIDDEN), torch.bfloat16, dev())
        idx, w = routing(SEED + 72 + ctx.rank, 3, 8, masked=False)
        sources = {"top-k": dict(topk_idx=idx, topk_weights=w), "logits": dict(logits=logits)}
        outputs = {}
        for enabled in (True, False):
            launcher.enabled = enabled
            before = launcher.launches
            for name, source in sources.items():
                eager = moe.forward(x, small_batch=True, graph_cache=False, **source).float().cpu().numpy()
                graph, y_static = moe.capture(x, small_batch=True, **source)
                graph.replay()
                moe.check_errors()
                outputs[enabled, name] = (eager, y_static.float().cpu().numpy())
                del graph
            made = launcher.launches - before
            if enabled and made < 3 * len(sources):
                problems.append(f"only {made} PDL launches for {len(sources)} calls of 3 fused kernels")
            if not enabled and made:
                problems.append(f"{made} PDL launches with PDL off")
        for name in sources:
            for what, a, b in zip(("eager", "graph"), outputs[True, name], outputs[False, name]):
                if not np.array_equal(a, b):
                    problems.append(f"{name} {what}: PDL launches differ from plain ones")
    finally:
        launcher.enabled = True
        moe.close()
    verdict(ctx, not problems, "; ".join(problems))


# --- the fused combine needs no residency (issue 24, item 5) ----------------------------------------------------

#: A kernel that holds SMs: one block per SM (it takes all of the SM's shared memory, so no block of any other
#: kernel fits beside it), spinning until `stop` is set or `limit_ns` passed (bounded whatever happens).
HOLD_SMS_SOURCE = r"""
extern "C" __global__ void hold_sms(unsigned int* started, const volatile unsigned int* stop,
                                    unsigned long long limit_ns) {
    extern __shared__ unsigned char held[];
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    held[threadIdx.x] = 0;
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(started, 1u);
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (*stop == 0u && now - start < limit_ns);
}
"""
#: SMs the holding kernel leaves free: room for a few blocks of each small-batch kernel (66 on an H200), far
#: fewer than the fused combine's grid.
FREE_SMS = 2
#: The ring's timeout of the layer under test, and the bound of the holding kernel: a combine whose blocks
#: waited for unscheduled blocks of its own grid timed out long before the SMs came free.
HOLD_TIMEOUT_S, HOLD_LIMIT_S = 2.0, 10.0


class SmHolder:
    """`HOLD_SMS_SOURCE` on its own non-blocking CuPy stream (the legacy default stream does not wait for it)."""

    def __init__(self, free_sms: int):
        import cupy
        self.cupy = cupy
        attr, device = cupy.cuda.runtime.deviceGetAttribute, cupy.cuda.Device().id
        num_sms = attr(16, device)  # cudaDevAttrMultiProcessorCount
        # Shared memory: MaxSharedMemoryPerBlockOptin, MaxSharedMemoryPerMultiprocessor, ReservedSharedMemoryPerBlock.
        per_block, per_sm, reserved = attr(97, device), attr(81, device), attr(111, device)
        self.shared = min(per_block, per_sm - reserved)
        #: Why this GPU cannot be held one block per SM with no room beside it (None: it can).
        self.unfit = None if per_sm - self.shared - reserved < reserved else (
            f"a block takes at most {self.shared} of an SM's {per_sm} bytes of shared memory: others fit beside it")
        self.blocks = num_sms - free_sms
        self.kernel = cupy.RawKernel(HOLD_SMS_SOURCE, "hold_sms")
        self.kernel.max_dynamic_shared_size_bytes = self.shared  # compiles it (NVRTC) now, before any timing
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.poll = cupy.cuda.Stream(non_blocking=True)
        self.started = cupy.zeros(1, dtype=cupy.uint32)
        self.stop_flag = cupy.zeros(1, dtype=cupy.uint32)
        cupy.cuda.Device().synchronize()  # both words zeroed before the non-blocking stream's launch

    def start(self, limit_s: float, wait_s: float = 10.0) -> bool:
        """Launch it; True once every block is resident (False: not within ``wait_s``; then stopped)."""
        with self.stream:
            self.kernel((self.blocks,), (32,), (self.started, self.stop_flag, np.uint64(int(limit_s * 1e9))),
                        shared_mem=self.shared)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if int(self.started.get(stream=self.poll)[0]) == self.blocks:
                return True
            time.sleep(0.001)
        self.stop()
        return False

    def holding(self) -> bool:
        """Whether it still runs (a stream query: no synchronisation)."""
        return not self.stream.done

    def stop(self) -> None:
        self.stop_flag.set(np.ones(1, np.uint32), stream=self.poll)  # a copy: needs no SM
        self.stream.synchronize()


def test_small_batch_completes_beside_a_kernel_holding_the_sms(ctx):
    """A kernel on another stream holds all SMs but `FREE_SMS` (as another stream, NCCL or another MPS client may)
    while small-batch calls run, eagerly and from a captured graph: they complete before it ends, with no
    timeout, bitwise the general schedule. The fused combine's grid (`stages.spin_blocks`: 66 blocks on an H200)
    is then far from resident at once; before its blocks took the scatter from a ticket counter, the resident
    ones waited for the arrival of blocks that could not start and the call timed out (docs/PROTOCOL.md 9.2)."""
    one_pe_per_gpu, _ = agree(ranks(ctx), ctx.backend.pes_per_gpu == 1, "")
    if not one_pe_per_gpu:
        pytest.skip("several PEs share a GPU: each one's holding kernel would starve the others")
    holder = SmHolder(FREE_SMS)
    fits, _ = agree(ranks(ctx), holder.unfit is None, "")
    if not fits:
        pytest.skip(f"this GPU cannot be held SM by SM: {holder.unfit}")
    n, topk = 128, 8  # the largest small batch: the fused combine's grid is spin_blocks
    warm = layer(ctx, "builtin", 128, topk)  # compiles the engine's kernels under the default timeout
    try:
        x = to_torch(make_tokens(SEED + 80 + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
        idx, w = routing(SEED + 81 + ctx.rank, n, topk, masked=False)
        for small_batch in (True, False):
            call(warm, x, idx, w, small_batch=small_batch)
    finally:
        warm.close()
    moe = layer(ctx, "builtin", 128, topk, timeout_s=HOLD_TIMEOUT_S)
    problems, lines, failed = [], [], False
    try:
        inputs = []
        for case in range(2):
            x = to_torch(make_tokens(SEED + 90 + 10 * case + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
            idx, w = routing(SEED + 91 + 10 * case + ctx.rank, n, topk, masked=case == 1)
            y_general, _ = call(moe, x, idx, w, small_batch=False)
            y_small, small = call(moe, x, idx, w, small_batch=True)  # its first call: before the SMs are held
            if not small or not np.array_equal(y_small, y_general):
                problems.append(f"case {case}: the small-batch call differs before any SM was held")
            inputs.append((x, idx, w, y_general))
        static = [t.clone() for t in inputs[0][:3]]
        graph, y_static = moe.capture(static[0], topk_idx=static[1], topk_weights=static[2], small_batch=True)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()  # non-blocking: waits for nothing of the holder's
        if not holder.start(HOLD_LIMIT_S):
            problems.append(f"the holding kernel's {holder.blocks} blocks were not all resident within 10 s")
        else:
            start = time.monotonic()
            outputs = []
            try:
                with torch.cuda.stream(side):
                    for x, idx, w, _ in inputs:  # eager, back to back
                        outputs.append(moe.forward(x, topk_idx=idx, topk_weights=w, small_batch=True,
                                                   graph_cache=False))
                    for _ in range(2):  # graph replays (counters reset by each launch, no host memset)
                        graph.replay()
                        outputs.append(y_static.clone())
                side.synchronize()  # this stream only: the holder holds on
                seconds = time.monotonic() - start
                still_held = holder.holding()
            finally:
                holder.stop()
            lines.append(f"{len(outputs)} small-batch calls beside {holder.blocks} held SMs: {seconds:.3f} s")
            if not still_held:
                problems.append(f"the calls ended after the holding kernel ({seconds:.2f} s; its bound "
                                f"{HOLD_LIMIT_S} s): the test proved nothing")
            want = [y for *_, y in inputs] + [inputs[0][3]] * 2
            for i, (got, expected) in enumerate(zip(outputs, want)):
                got = got.float().cpu().numpy()
                if not np.array_equal(got, expected):
                    rows = int(np.sum(np.any(got != expected, axis=1)))
                    problems.append(f"call {i} beside the held SMs != general ({rows} of {n} rows differ)")
        del graph
        try:
            moe.check_errors()
        except (ProtocolTimeout, ProtocolViolation) as exc:
            failed = True
            problems.append(f"{type(exc).__name__}: {exc}")
        none_failed, _ = agree(ranks(ctx), not failed, "")
        if not none_failed:
            moe.reset()  # collective, on every rank alike: the next tests find the workspace clean
    finally:
        moe.close()
    print(f"\nrank {ctx.rank}: " + "; ".join(lines))
    verdict(ctx, not problems, "; ".join(problems))
