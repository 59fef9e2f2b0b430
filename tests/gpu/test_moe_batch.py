"""The GPU MoE layer (symmring.moe.gpu.MoE, batch-ready path) against independent implementations.

* fp8 dispatch: against the NumPy reference (symmring.moe.reference) on the same inputs, which
  quantises them itself (relative error ||y - y_ref|| / ||y_ref|| <= 1e-2 over the output); the fp8
  bytes and scales the producer kernel wrote into the ring slot are also compared bitwise with
  symmring.moe.quant.
* bf16 dispatch: against the plain torch MoE (symmring.moe.torch_ref.TorchMoE, all experts on one GPU)
  and, where `transformers` is importable, its MixtralSparseMoeBlock with the same weights.
* token counts 1, 7, 128, 1000, 4096; top-k 1, 2, 8; uniform and skewed routing; zero-token ranks;
  masked (-1) entries; repeated calls (generations advance, slots are reused).

Skipped, with the reason, where torch with CUDA, CuPy or nvshmem4py is missing (CI's CPU machines).
Several PEs: ``python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu/test_moe_batch.py``
(every rank runs every test; the verdict is agreed over all ranks).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402
from gpu_helpers import ranks  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import (agree, make_tokens, make_weights, mixtral_block, mixtral_forward,  # noqa: E402
                         rel_error, skewed_logits, to_torch)

from symmring.errors import ConfigError  # noqa: E402
from symmring.moe import quant  # noqa: E402
from symmring.moe.gpu import MoE  # noqa: E402
from symmring.moe.reference import reference_moe  # noqa: E402
from symmring.moe.torch_ref import TorchMoE  # noqa: E402
from symmring.moe.config import Experts, RoutingConfig, ScheduleConfig  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("SYMMRING_TEST_SEED", 20261129))
HIDDEN, INTER, NUM_EXPERTS = 256, 128, 16
#: The issue's bound on the relative error over the output.
REL_TOL = 1e-2


@pytest.fixture(scope="module")
def ctx(nvshmem_ctx):
    """The session's nvshmem context (tests/gpu/conftest.py): NVSHMEM initialises once per process."""
    return nvshmem_ctx


def device_of(ctx):
    return torch.device("cuda", torch.cuda.current_device())


def build(ctx, weights, topk, max_tokens, x_format, **routing):
    """The layer with this rank's slice of the global weights; ``routing``: `RoutingConfig`'s options."""
    w_gate, w_up, w_down, _ = weights
    E_local = NUM_EXPERTS // ctx.world_size
    lo, hi = ctx.rank * E_local, (ctx.rank + 1) * E_local
    dev = device_of(ctx)
    experts = Experts(*(to_torch(w[lo:hi], torch.bfloat16, dev) for w in (w_gate, w_up, w_down)))
    return MoE(ctx, experts, RoutingConfig(NUM_EXPERTS, topk, **routing), max_tokens=max(1, max_tokens),
               schedule=ScheduleConfig(x_format=x_format))


def run_case(ctx, *, num_tokens, topk, x_format="fp8_e4m3", logits_fn=None, masked=False, calls=1,
             seed=SEED, scoring="softmax", max_tokens=None):
    """Run the layer ``calls`` times on fresh tokens; compare each output with the NumPy reference.

    ``num_tokens`` is an int or a function of the rank (called once per call; then give ``max_tokens``).
    Returns (ok, message) of this rank.
    """
    weights = make_weights(seed, NUM_EXPERTS, HIDDEN, INTER)
    w_gate, w_up, w_down, _ = weights
    dev = device_of(ctx)
    kwargs = {}
    if scoring == "sigmoid_bias":
        bias = np.random.default_rng(seed + 7).standard_normal(NUM_EXPERTS).astype(np.float32) * 0.1
        kwargs = dict(scoring=scoring, bias=to_torch(bias, torch.float32, dev), routed_scaling_factor=2.5)
    moe = build(ctx, weights, topk, max_tokens or num_tokens, x_format, **kwargs)
    errors = []
    try:
        for call in range(calls):
            n = num_tokens(ctx.rank) if callable(num_tokens) else num_tokens
            tseed = seed + 1000 * (call + 1) + ctx.rank
            x = make_tokens(tseed, n, HIDDEN)
            logits = (logits_fn(tseed, n) if logits_fn else
                      np.random.default_rng(tseed + 1).standard_normal((n, NUM_EXPERTS)).astype(np.float32))
            ref_kwargs = dict(scoring=scoring)
            if scoring == "sigmoid_bias":
                ref_kwargs.update(bias=bias, routed_scaling_factor=2.5)
            if masked:
                # Explicit routing with some entries masked: distinct experts per token, -1 sprinkled in.
                rng = np.random.default_rng(tseed + 2)
                idx = np.argsort(rng.random((n, NUM_EXPERTS)), axis=1)[:, :topk].astype(np.int32)
                idx[rng.random((n, topk)) < 0.3] = -1
                w = rng.random((n, topk)).astype(np.float32)
                y = moe.forward(to_torch(x, torch.bfloat16, dev), topk_idx=to_torch(idx, torch.int32, dev),
                                topk_weights=to_torch(w, torch.float32, dev))
                ref = reference_moe(x, w_gate=w_gate, w_up=w_up, w_down=w_down, num_topk=topk, topk_idx=idx,
                                    topk_weights=w, x_format=x_format)
            else:
                y = moe.forward(to_torch(x, torch.bfloat16, dev), logits=to_torch(logits, torch.float32, dev))
                ref = reference_moe(x, w_gate=w_gate, w_up=w_up, w_down=w_down, num_topk=topk, logits=logits,
                                    x_format=x_format, **ref_kwargs)
            moe.check_errors()
            y_np = y.float().cpu().numpy()
            err = rel_error(y_np, ref.y)
            if not np.all(np.isfinite(y_np)) or err > REL_TOL:
                errors.append(f"call {call}: n={n} relative error {err:.3e} > {REL_TOL}")
            if n and x_format == "fp8_e4m3" and call == calls - 1:
                errors += check_slot_fp8(moe, x, n)
    finally:
        moe.close()
    return not errors, "; ".join(errors)


def check_slot_fp8(moe, x, n):
    """The producer's fp8 bytes and scales in this rank's slot, bitwise against symmring.moe.quant."""
    x_q, x_sf = quant.quantize_fp8(x)
    slot_x = moe.slot_view("x", n).get()
    sf_region = moe.slot_view("x_sf", n).get()
    out = []
    bad = np.argwhere(slot_x != x_q.view(np.uint8))
    if bad.size:
        t, c = bad[0]
        out.append(f"fp8 byte mismatch at token {t} channel {c}: {slot_x[t, c]:#x} != {x_q.view(np.uint8)[t, c]:#x} "
                   f"({len(bad)} bytes differ)")
    if not np.array_equal(sf_region.view(np.uint32), x_sf.view(np.uint32)):
        out.append("x_sf differs from quant.quantize_fp8")
    return out


def verdict(ctx, ok, message):
    all_ok, messages = agree(ranks(ctx), ok, message)
    assert all_ok, messages


@pytest.mark.parametrize("num_tokens", [1, 7, 128, 1000, 4096])
def test_fp8_token_counts(ctx, num_tokens):
    verdict(ctx, *run_case(ctx, num_tokens=num_tokens, topk=2))


@pytest.mark.parametrize("topk", [1, 2, 8])
def test_fp8_topk(ctx, topk):
    verdict(ctx, *run_case(ctx, num_tokens=128, topk=topk))


def test_fp8_sigmoid_bias_topk8(ctx):
    verdict(ctx, *run_case(ctx, num_tokens=1000, topk=8, scoring="sigmoid_bias"))


def test_fp8_skewed_routing(ctx):
    verdict(ctx, *run_case(ctx, num_tokens=1000, topk=2,
                           logits_fn=lambda s, n: skewed_logits(s, n, NUM_EXPERTS, hot_experts=2)))


def test_zero_token_ranks(ctx):
    # Odd ranks have no tokens (with one rank: alternating empty and non-empty calls).
    if ctx.world_size == 1:
        verdict(ctx, *run_case(ctx, num_tokens=lambda r, c=iter([0, 64, 0]): next(c), topk=2, calls=3,
                               max_tokens=64))
    else:
        verdict(ctx, *run_case(ctx, num_tokens=lambda r: 0 if r % 2 else 300, topk=2, calls=2,
                               max_tokens=300))


def test_masked_entries(ctx):
    verdict(ctx, *run_case(ctx, num_tokens=500, topk=4, masked=True))


def test_repeated_calls_uneven(ctx):
    # Several calls on one layer: the generation base advances, the slot and combine buffer are reused;
    # uneven token counts per rank and per call.
    verdict(ctx, *run_case(ctx, num_tokens=lambda r, c=iter([100, 37, 256, 1]): next(c) // (r + 1) or 1,
                           topk=2, calls=4, max_tokens=256))


@pytest.mark.parametrize("num_tokens,topk", [(7, 2), (1000, 8), (4096, 2)])
def test_bf16_vs_torch(ctx, num_tokens, topk):
    weights = make_weights(SEED + 5, NUM_EXPERTS, HIDDEN, INTER)
    dev = device_of(ctx)
    w_gate, w_up, w_down, router = (to_torch(w, torch.bfloat16, dev) for w in weights)
    plain = TorchMoE(w_gate, w_up, w_down, topk)
    moe = build(ctx, weights, topk, num_tokens, "bf16")
    try:
        x_np = make_tokens(SEED + 11 + ctx.rank, num_tokens, HIDDEN)
        x = to_torch(x_np, torch.bfloat16, dev)
        # float32 logits: bf16 logits tie often enough that tie-breaking would decide the comparison.
        logits = x.float() @ router.float().t()
        y = moe.forward(x, logits=logits)
        moe.check_errors()
        y_plain = plain.forward(x, logits=logits)
        err = rel_error(y.float().cpu().numpy(), y_plain.float().cpu().numpy())
        ref = reference_moe(x_np, w_gate=weights[0], w_up=weights[1], w_down=weights[2], num_topk=topk,
                            logits=logits.cpu().numpy(), x_format="bf16")
        err_ref = rel_error(y.float().cpu().numpy(), ref.y)
        ok = err <= REL_TOL and err_ref <= REL_TOL
        message = f"vs torch {err:.3e}, vs reference {err_ref:.3e} (bound {REL_TOL})"
    finally:
        moe.close()
    verdict(ctx, ok, message)


@pytest.mark.parametrize("num_tokens", [7, 1000])
def test_bf16_vs_transformers_mixtral(ctx, num_tokens):
    topk = 2
    weights = make_weights(SEED + 9, NUM_EXPERTS, HIDDEN, INTER)
    dev = device_of(ctx)
    block = mixtral_block(*weights, topk=topk, device=dev)
    if block is None:  # the same on every rank: transformers is installed everywhere or nowhere
        pytest.skip("transformers (with a known MixtralSparseMoeBlock layout) is not importable")
    moe = build(ctx, weights, topk, num_tokens, "bf16")
    try:
        x = to_torch(make_tokens(SEED + 13 + ctx.rank, num_tokens, HIDDEN), torch.bfloat16, dev)
        y_hf, idx, w = mixtral_forward(block, x)
        # The block's own routing (its bf16 logits can tie; feeding its choice compares the experts
        # and the combine, not tie-breaking).
        if idx is not None:
            y = moe.forward(x, topk_idx=idx, topk_weights=w)
        else:
            y = moe.forward(x, router_weight=to_torch(weights[3], torch.bfloat16, dev))
        moe.check_errors()
        err = rel_error(y.float().cpu().numpy(), y_hf.float().cpu().numpy())
        ok, message = err <= REL_TOL, f"vs transformers Mixtral: relative error {err:.3e} (bound {REL_TOL})"
    finally:
        moe.close()
    verdict(ctx, ok, message)


def test_bad_input_is_rejected_and_layer_stays_usable(ctx):
    weights = make_weights(SEED, NUM_EXPERTS, HIDDEN, INTER)
    dev = device_of(ctx)
    moe = build(ctx, weights, 2, 64, "fp8_e4m3")
    problems = []
    try:
        x = to_torch(make_tokens(SEED + ctx.rank, 64, HIDDEN), torch.bfloat16, dev)
        logits = torch.randn(64, NUM_EXPERTS, device=dev)
        cases = {
            "too many tokens": lambda: moe.forward(torch.zeros(65, HIDDEN, dtype=torch.bfloat16, device=dev),
                                                   logits=logits),
            "wrong dtype": lambda: moe.forward(x.float(), logits=logits),
            "two routing sources": lambda: moe.forward(x, logits=logits, topk_idx=torch.zeros(
                64, 2, dtype=torch.int32, device=dev), topk_weights=torch.ones(64, 2, device=dev)),
            "no routing": lambda: moe.forward(x),
            "logits shape": lambda: moe.forward(x, logits=logits[:, :3]),
        }
        for name, call in cases.items():
            try:
                call()
                problems.append(f"{name}: no ConfigError")
            except ConfigError:
                pass
        # Still usable after the rejections (nothing was enqueued).
        y = moe.forward(x, logits=logits)
        moe.check_errors()
        if not torch.isfinite(y.float()).all():
            problems.append("output after rejected calls is not finite")
    finally:
        moe.close()
    verdict(ctx, not problems, "; ".join(problems))


def test_graph_replay_matches_reference(ctx):
    # Generations live in device memory: every replay is a fresh call (a stale generation would make the
    # dispatch wait accept old data or time out); each replay's output is checked on new inputs.
    num_tokens, topk = 300, 2
    weights = make_weights(SEED + 21, NUM_EXPERTS, HIDDEN, INTER)
    dev = device_of(ctx)
    moe = build(ctx, weights, topk, num_tokens, "fp8_e4m3")
    errors = []
    try:
        x_static = torch.zeros(num_tokens, HIDDEN, dtype=torch.bfloat16, device=dev)
        logits_static = torch.zeros(num_tokens, NUM_EXPERTS, dtype=torch.float32, device=dev)
        x_static.copy_(to_torch(make_tokens(SEED + 1, num_tokens, HIDDEN), torch.bfloat16, dev))
        logits_static.normal_()
        graph, y_static = moe.capture(x_static, logits=logits_static)
        for replay in range(3):
            tseed = SEED + 100 * (replay + 1) + ctx.rank
            x = make_tokens(tseed, num_tokens, HIDDEN)
            logits = np.random.default_rng(tseed).standard_normal((num_tokens, NUM_EXPERTS)).astype(np.float32)
            x_static.copy_(to_torch(x, torch.bfloat16, dev))
            logits_static.copy_(to_torch(logits, torch.float32, dev))
            graph.replay()
            moe.check_errors()
            ref = reference_moe(x, w_gate=weights[0], w_up=weights[1], w_down=weights[2], num_topk=topk,
                                logits=logits)
            err = rel_error(y_static.float().cpu().numpy(), ref.y)
            if err > REL_TOL:
                errors.append(f"replay {replay}: relative error {err:.3e} > {REL_TOL}")
    finally:
        moe.close()
    verdict(ctx, not errors, "; ".join(errors))
