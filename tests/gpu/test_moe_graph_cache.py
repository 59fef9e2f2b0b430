"""The GPU layer's cache of captured calls (`symmring.moe.gpu.graph_cache`): eager calls replay a CUDA graph.

An eager `MoE.forward` whose key (every rank's token count, the schedule, the routing kind) was seen
before replays a graph of that call. Every output must equal, BITWISE, the same call with the cache off
(``forward(graph_cache=False)``) over sequences that alternate shapes with fresh random inputs per call
(a stale static input would show), with every earlier output kept and compared at the end (an output
overwritten by a later replay would show), calls alternating streams, zero-token ranks, for the
small-batch schedule (every fp8 engine), the general batch schedule and the streamed one, and for each
routing kind (router weight, logits, given top-k). The cache's counters must say the graphs were
captured on each key's second call and replayed after. A new router tensor is a new key; one updated in
place is read as it is. LRU eviction, `reset`, the bypasses (the caller capturing, stage events,
non-contiguous input, ``graph_cache=False``, capacity 0 and ``SYMMRING_GRAPH_CACHE``), and the module's
custom op path.

Several PEs: ``python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_moe_graph_cache.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import cuda_device as dev, fp8_engines, make_tokens, make_weights, to_torch, verdict  # noqa: E402

from symmring.errors import ConfigError  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261215))
HIDDEN, INTER, NUM_EXPERTS, TOPK = 256, 256, 16, 4
MAX_TOKENS = 32
#: Tokens of rank 0 per distinct key; odd ranks take one fewer (so a rank has 0 tokens at 1).
SHAPES = (1, 3, 8, 32)
#: The order of the sequence (indices into SHAPES): repeats, back-to-back repeats, every shape 3+ times.
ORDER = (0, 1, 2, 0, 0, 1, 2, 3, 3, 0, 2, 1, 0, 3)

CASES = {
    "small-batch builtin": dict(engine="builtin", kwargs={}),
    "small-batch deepgemm": dict(engine="deepgemm", kwargs={}),
    "general bf16": dict(engine="torch", kwargs={}),
    "streamed bf16": dict(engine="torch", kwargs={"streaming": True}, ring=dict(num_slots=2, tokens_per_slot=8)),
}
KINDS = ("router", "given", "logits")


def _params():
    engines = {p if isinstance(p, str) else p.values[0]: p for p in fp8_engines()}
    out = []
    for case, spec in CASES.items():
        for kind in KINDS:
            if case.startswith("streamed") and kind == "logits":
                continue
            marks = []
            if spec["engine"] in engines and not isinstance(engines[spec["engine"]], str):
                marks = list(engines[spec["engine"]].marks)
            out.append(pytest.param(case, kind, marks=marks, id=f"{case}-{kind}"))
    return out


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("SYMMRING_GRAPH_CACHE", raising=False)


def layer(ctx, engine, **schedule):
    if engine != "torch":
        pytest.importorskip("triton", reason="the fp8 engines need Triton")
    w_gate, w_up, w_down, _ = make_weights(SEED, NUM_EXPERTS, HIDDEN, INTER)
    e = NUM_EXPERTS // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    experts = Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down)),
                      expert_dtype="bf16" if engine == "torch" else "fp8")
    return MoE(ctx, experts, RoutingConfig(NUM_EXPERTS, TOPK), max_tokens=MAX_TOKENS,
               schedule=ScheduleConfig(**schedule), engine=engine)


def router_weight(seed):
    _, _, _, router = make_weights(seed, NUM_EXPERTS, HIDDEN, INTER)
    return to_torch(router, torch.bfloat16, dev())


def routing_of(kind, seed, n, router=None):
    """The forward keyword arguments of one call's routing, seeded."""
    rng = np.random.default_rng(seed)
    if kind == "router":
        return {"router_weight": router}
    if kind == "logits":
        return {"logits": to_torch(rng.standard_normal((n, NUM_EXPERTS)).astype(np.float32), torch.float32, dev())}
    idx = np.array([rng.permutation(NUM_EXPERTS)[:TOPK] for _ in range(n)], dtype=np.int32).reshape(n, TOPK)
    weights = rng.random((n, TOPK)).astype(np.float32)
    return {"topk_idx": to_torch(idx, torch.int32, dev()), "topk_weights": to_torch(weights, torch.float32, dev())}


def tokens_of(ctx, shape):
    return shape if ctx.rank % 2 == 0 else shape - 1


def inputs(ctx, kind, step, n, router):
    seed = SEED + 1000 * step + ctx.rank
    x = to_torch(make_tokens(seed, n, HIDDEN), torch.bfloat16, dev())
    return x, routing_of(kind, seed + 7, n, router)


def counters(moe, captures: int, hits: int) -> list:
    """A problem (or none) if the layer's cache did not capture and replay as often as expected."""
    info = moe.graph_cache_info()
    if (info["captures"], info["hits"]) == (captures, hits):
        return []
    return [f"captures {info['captures']}, hits {info['hits']}: expected {captures} and {hits}"]


def differs(y, ref) -> str:
    if y.shape != ref.shape:
        return f"shape {tuple(y.shape)} != {tuple(ref.shape)}"
    if torch.equal(y, ref):
        return ""
    return f"{int((y != ref).any(dim=1).sum())} of {y.shape[0]} rows differ"


@pytest.mark.parametrize("case,kind", _params())
def test_cached_calls_bitwise_equal_uncached(ctx, case, kind):
    spec = CASES[case]
    moe = layer(ctx, spec["engine"], **spec.get("ring", {}))
    kwargs = spec["kwargs"]
    router = router_weight(SEED + 5)
    problems = []
    try:
        calls = [inputs(ctx, kind, step, tokens_of(ctx, SHAPES[s]), router) for step, s in enumerate(ORDER)]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        torch.cuda.synchronize()  # the inputs (made on the default stream) are read on the two streams
        # Cache on: back-to-back calls, alternating streams, every output kept.
        kept = []
        for step, (x, routing) in enumerate(calls):
            with torch.cuda.stream(streams[step % 2]):
                kept.append(moe.forward(x, **routing, **kwargs))
                if moe.last_plan.small_batch != case.startswith("small-batch"):
                    problems.append(f"step {step}: small_batch={moe.last_plan.small_batch}")
        torch.cuda.synchronize()
        moe.check_errors()
        info = moe.graph_cache_info()
        want = dict(captures=len(SHAPES), hits=len(ORDER) - 2 * len(SHAPES), entries=len(SHAPES), failures=0)
        got = {k: info[k] for k in want}
        if got != want:
            problems.append(f"cache counters {got}, expected {want}")
        # Cache off: the same calls launched kernel by kernel.
        for step, (x, routing) in enumerate(calls):
            ref = moe.forward(x, **routing, **kwargs, graph_cache=False)
            what = differs(kept[step], ref)
            if what:
                problems.append(f"step {step} ({tokens_of(ctx, SHAPES[ORDER[step]])} tokens): {what}")
        moe.check_errors()
        if moe.graph_cache_info()["hits"] != info["hits"]:
            problems.append("graph_cache=False calls replayed")
    finally:
        moe.close()
    verdict(ctx, not problems, f"{case}/{kind}: " + "; ".join(problems))


def test_router_weight_is_read_in_place_and_a_new_tensor_is_a_new_key(ctx):
    moe = layer(ctx, "builtin")
    a, b, c = router_weight(SEED + 11), router_weight(SEED + 12), router_weight(SEED + 13)
    n = tokens_of(ctx, 8)
    problems = []
    try:
        for step, (name, router) in enumerate([("a", a)] * 3 + [("b", b)] * 3 + [("a updated", a)] * 2):
            if step == 6:
                a.copy_(c)  # in place: the captured graph must read the new values
            x = to_torch(make_tokens(SEED + 50 + step + 3 * ctx.rank, n, HIDDEN), torch.bfloat16, dev())
            y = moe.forward(x, router_weight=router)
            ref = moe.forward(x, router_weight=router, graph_cache=False)
            what = differs(y, ref)
            if what:
                problems.append(f"step {step} (router {name}): {what}")
        moe.check_errors()
        problems += counters(moe, 2, 4)  # a and b captured
    finally:
        moe.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_lru_eviction(ctx):
    moe = layer(ctx, "builtin", graph_cache=2)
    router = router_weight(SEED + 21)
    problems = []
    try:
        if moe.graph_cache_info()["capacity"] != 2:
            problems.append(f"capacity {moe.graph_cache_info()['capacity']}, expected 2")
        for step, shape in enumerate((1, 3, 8) * 3):
            x = to_torch(make_tokens(SEED + 60 + step + 3 * ctx.rank, tokens_of(ctx, shape), HIDDEN), torch.bfloat16,
                         dev())
            y = moe.forward(x, router_weight=router)
            ref = moe.forward(x, router_weight=router, graph_cache=False)
            what = differs(y, ref)
            if what:
                problems.append(f"step {step} ({shape}): {what}")
            if moe.graph_cache_info()["entries"] > 2:
                problems.append(f"step {step}: {moe.graph_cache_info()['entries']} entries > capacity 2")
        moe.check_errors()
        info = moe.graph_cache_info()
        # 1 3 8 eager, 1 3 captured, 8 captured (1 evicted), 1 eager again, 3 and 8 replayed.
        got = (info["captures"], info["evictions"], info["hits"], info["entries"])
        if got != (3, 1, 2, 2):
            problems.append(f"(captures, evictions, hits, entries) = {got}, expected (3, 1, 2, 2)")
    finally:
        moe.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_reset_drops_the_cache_and_calls_still_work(ctx):
    moe = layer(ctx, "builtin")
    router = router_weight(SEED + 31)
    n = tokens_of(ctx, 3)
    problems = []
    try:
        def step(i):
            x = to_torch(make_tokens(SEED + 70 + i + 5 * ctx.rank, n, HIDDEN), torch.bfloat16, dev())
            what = differs(moe.forward(x, router_weight=router), moe.forward(x, router_weight=router,
                                                                             graph_cache=False))
            if what:
                problems.append(f"call {i}: {what}")

        for i in range(3):
            step(i)
        before = moe.graph_cache_info()
        moe.reset()
        after = moe.graph_cache_info()
        if (before["entries"], after["entries"]) != (1, 0):
            problems.append(f"entries {before['entries']} before reset, {after['entries']} after: expected 1, 0")
        for i in range(3, 6):  # eager, captured again, replayed
            step(i)
        moe.check_errors()
        problems += counters(moe, 2, 2)
    finally:
        moe.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_bypasses(ctx, monkeypatch):
    """Calls the cache must not serve: inside the caller's capture, with stage events, non-contiguous x,
    graph_cache=False; capacity 0 (argument or SYMMRING_GRAPH_CACHE)."""
    moe = layer(ctx, "builtin")
    router = router_weight(SEED + 41)
    n = tokens_of(ctx, 8)
    problems = []
    try:
        x = to_torch(make_tokens(SEED + 80 + ctx.rank, n, HIDDEN), torch.bfloat16, dev())
        want = moe.forward(x, router_weight=router, graph_cache=False)
        for _ in range(3):  # the key is cached now
            moe.forward(x, router_weight=router)
        base = moe.graph_cache_info()
        try:
            moe.forward(x, router_weight=router, graph_cache=1)
            problems.append("graph_cache=1: no ConfigError")
        except ConfigError as exc:
            if "expected a bool" not in str(exc):
                problems.append(f"graph_cache=1: {exc}")
        events = []
        y_events = moe.debug.forward(x, router_weight=router, stage_events=events)
        padded = torch.zeros(n, HIDDEN + 128, dtype=torch.bfloat16, device=dev())
        padded[:, :HIDDEN] = x
        strided = padded[:, :HIDDEN]  # rows 16-byte aligned: the layer takes it as it is, not contiguous
        y_strided = [moe.forward(strided, router_weight=router) for _ in range(3)][-1]
        want_strided = moe.forward(strided, router_weight=router, graph_cache=False)
        # The caller's own capture holds the plain kernels (its replay is a call of the layer).
        x_static = x.clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = moe.forward(x_static, router_weight=router)
        graph.replay()
        torch.cuda.synchronize()
        moe.check_errors()
        if moe.graph_cache_info() != base:
            problems.append(f"cache counters moved: {base} -> {moe.graph_cache_info()}")
        if len(events) != 6:
            problems.append(f"stage_events: {len(events)} events, expected 6")
        for name, y, ref in (("stage_events", y_events, want), ("non-contiguous x", y_strided, want_strided),
                             ("caller's graph", y_static, want)):
            what = differs(y, ref)
            if what:
                problems.append(f"{name}: {what}")
    finally:
        moe.close()
    for kwargs, env, capacity in ((dict(graph_cache=0), None, 0), ({}, "0", 0), (dict(graph_cache=0), "3", 3)):
        if env is None:
            monkeypatch.delenv("SYMMRING_GRAPH_CACHE", raising=False)
        else:
            monkeypatch.setenv("SYMMRING_GRAPH_CACHE", env)
        off = layer(ctx, "builtin", **kwargs)
        try:
            got = off.graph_cache_info()["capacity"]
            if got != capacity:
                problems.append(f"{kwargs} with SYMMRING_GRAPH_CACHE={env}: capacity {got}, expected {capacity}")
            if capacity == 0:
                for _ in range(3):
                    off.forward(x, router_weight=router)
                if off.graph_cache_info()["captures"] or off.graph_cache_info()["hits"]:
                    problems.append(f"{kwargs} with SYMMRING_GRAPH_CACHE={env}: the disabled cache captured")
            off.check_errors()
        finally:
            off.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_module_op_path_replays_and_matches(ctx):
    """`MoEModule` calls the layer through its custom op, eagerly: those calls replay too, bitwise."""
    pytest.importorskip("triton", reason="the built-in fp8 engine needs Triton")
    from symmring.moe.integrations.module import MoEModule
    w_gate, w_up, w_down, router = make_weights(SEED + 51, NUM_EXPERTS, HIDDEN, INTER)
    e = NUM_EXPERTS // ctx.world_size
    mine = slice(ctx.rank * e, (ctx.rank + 1) * e)
    experts = Experts(*(to_torch(w[mine], torch.bfloat16, dev()) for w in (w_gate, w_up, w_down)), expert_dtype="fp8")
    module = MoEModule(ctx, experts, RoutingConfig(NUM_EXPERTS, TOPK),
                       router_weight=to_torch(router, torch.bfloat16, dev()), max_tokens=MAX_TOKENS, engine="builtin")
    problems = []
    try:
        with torch.inference_mode():
            kept = []
            for step, shape in enumerate((1, 8, 1, 8, 1, 8)):
                n = tokens_of(ctx, shape)
                h = to_torch(make_tokens(SEED + 90 + step + 7 * ctx.rank, n, HIDDEN), torch.bfloat16,
                             dev()).view(1, n, HIDDEN)
                kept.append((h, module(h)))
            for step, (h, y) in enumerate(kept):
                x = h.reshape(-1, HIDDEN)
                ref = module.layer.forward(x, logits=module.router_logits(x), graph_cache=False).view(h.shape)
                what = differs(y.reshape(-1, HIDDEN), ref.reshape(-1, HIDDEN))
                if what:
                    problems.append(f"step {step}: {what}")
        module.layer.check_errors()
        problems += counters(module.layer, 2, 2)
    finally:
        module.close()
    verdict(ctx, not problems, "; ".join(problems))
