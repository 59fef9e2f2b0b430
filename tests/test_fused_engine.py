"""The ``"fused"`` engine's host side on the CPU (its GPU run: tests/gpu/test_fused_engine.py): the shapes it
refuses, the argument record it packs for ``moe_fused_experts_*`` (every field, from CPU tensors standing in
for the pool and the weights), which kernel a call gets (the rule, ``kernel=``, ``SYMMRING_FUSED_KERNEL``), the
work list's arithmetic, and the shared memory size the host asks for against each kernel's layout as nvcc lays
it out."""

from __future__ import annotations

import numpy as np
import pytest

from symmring import jit
from symmring.errors import BackendError, ConfigError
from symmring.moe.engines import ENGINES, CombineRows, Pool, make_engine
from symmring.moe.engines import fused
from symmring.moe.gpu import kernel_args, tensor_map
from symmring.moe.weights import ExpertWeights
from test_device_compile import _toolchain_missing

torch = pytest.importorskip("torch", reason="the engines' host side takes torch tensors")

E, HIDDEN, INTER = 3, 256, 384


def fp8_weights(num_experts=E, hidden=HIDDEN, inter=INTER, **replace) -> ExpertWeights:
    fields = dict(w13=torch.zeros(num_experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn),
                  w_down=torch.zeros(num_experts, hidden, inter, dtype=torch.float8_e4m3fn),
                  w13_scale=torch.ones(num_experts, 2 * inter // 128, hidden // 128),
                  w_down_scale=torch.ones(num_experts, hidden // 128, inter // 128))
    fields.update(replace)
    return ExpertWeights("fp8", **fields)


def pool_of(capacity=512, hidden=HIDDEN, rows_for_sf=None):
    """An fp8 pool as the layer hands it over: scales MN-major with 16-byte aligned columns (`State.pool_scales`)."""
    rows = capacity if rows_for_sf is None else rows_for_sf
    column = -(-rows // 4) * 4
    sf = torch.zeros(hidden // 128 * column).view(hidden // 128, column).t()[:rows]
    return Pool(x=torch.zeros(capacity, hidden, dtype=torch.float8_e4m3fn), group_end=torch.zeros(E, dtype=torch.int32),
                x_sf=sf, m_indices=torch.full((capacity,), -1, dtype=torch.int32),
                bad_groups=torch.zeros(2, dtype=torch.int32))


def test_fused_is_an_engine_name_and_refuses_bf16_weights():
    assert "fused" in ENGINES
    bf16 = ExpertWeights("bf16", torch.zeros(E, 2 * INTER, HIDDEN, dtype=torch.bfloat16),
                         torch.zeros(E, HIDDEN, INTER, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="engine 'fused': expected fp8 expert weights, got bf16"):
        make_engine("fused", bf16)
    engine = make_engine("fused", fp8_weights())
    assert (engine.name, engine.pool_format, engine.align_m) == ("fused", "fp8", 128)


@pytest.mark.parametrize("replace, message", [
    (dict(w13=torch.zeros(E, 2 * INTER, HIDDEN, dtype=torch.float8_e4m3fn).transpose(1, 2).contiguous()
          .transpose(1, 2)), "weights.w13: expected a contiguous tensor"),
    (dict(w_down_scale=torch.ones(E, 1, 3)), r"weights.w_down_scale: expected a contiguous tensor \[3, 2, 3\]"),
    (dict(w13_scale=None), "weights.w13_scale: expected a contiguous tensor"),
])
def test_bad_weights_are_named(replace, message):
    with pytest.raises(ConfigError, match=message):
        fused.FusedExperts(fp8_weights(**replace))


def test_shapes_off_the_128_grid_are_refused():
    w = fp8_weights(inter=192, w13_scale=torch.ones(E, 3, 2), w_down_scale=torch.ones(E, 2, 2))
    with pytest.raises(ConfigError, match="inter=192: expected a positive multiple of 128"):
        fused.FusedExperts(w)


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, "8"])
def test_bad_sm_budgets_are_refused(budget):
    with pytest.raises(ConfigError, match="sm_budget="):
        fused.FusedExperts(fp8_weights(), sm_budget=budget)


class FakeEncoder:
    """Stands in for the driver's tensor map encoder (`tensor_map.Encoder`; none on the CPU): a map's words are
    its spec's address, dims, row stride, box and swizzle, so a test reads back what the engine asked for."""

    def __call__(self, spec):
        words = np.zeros(16, np.uint64)
        words[:7] = (spec.address, *spec.dims, *spec.strides, *spec.box, spec.swizzle)
        return tensor_map.map_record(words.tobytes())


def map_words(record, name):
    return tuple(int(v) for v in record[name]["opaque"][:7])


def test_the_tma_record_carries_the_experts_record_and_six_maps(monkeypatch):
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    weights = fp8_weights()
    engine = fused.FusedExperts(weights, kernel="wg64t")
    pool = pool_of(capacity=512, rows_for_sf=300)
    launch = engine.prepare(pool, 300, rows_per_expert=100, grid_limit=1000, cc=90)
    assert (launch.kernel, launch.shared_bytes, fused.threads("wg64t")) == ("wg64t", fused.shared_bytes("wg64t"), 384)
    # The experts' record (208 bytes) padded to the maps' 64-byte alignment, then six 128-byte maps.
    assert launch.args[0].dtype.itemsize == kernel_args.STRUCTS["FusedExpertsTmaArgs"].itemsize == 256 + 6 * 128
    record = np.frombuffer(launch.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]
    # The experts' record is wg64's (the same work list: 6 m blocks of 64 rows, 2 per group) but for the buffers.
    wg64 = fused.FusedExperts(weights, kernel="wg64").prepare(pool, 300, 100, grid_limit=1000, cc=90)
    assert tuple(launch.counters.shape) == tuple(wg64.counters.shape) == (1 + 6,)
    # wg64t's L2 items take two output blocks (hidden / 128 even): 6 m blocks of INTER / 128 + HIDDEN / 256 items.
    assert launch.grid == 6 * (INTER // 128 + HIDDEN // 256) < wg64.grid == 6 * (INTER // 128 + HIDDEN // 128)
    plain = np.frombuffer(wg64.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsArgs"])[0]
    buffers = {"act", "act_sf", "out", "counters", "status"}  # the call's and the engine's own
    for name in plain.dtype.names:
        if name not in buffers:
            assert record["experts"][name] == plain[name], name
    assert int(record["experts"]["act"]) == launch.act.data_ptr()
    assert int(record["experts"]["status"]) == engine.status.data_ptr()
    w = engine.weights
    # (address, K, rows, row stride, box K, box rows, swizzle 128B): the pass's rows of the pool and intermediate
    # in 64-row boxes, the weights as [E * N, K] in 128-row boxes.
    assert map_words(record, "pool_x_map") == (pool.x.data_ptr(), HIDDEN, 300, HIDDEN, 128, 64, 3)
    assert map_words(record, "act_map") == (launch.act.data_ptr(), INTER, 300, INTER, 128, 64, 3)
    assert map_words(record, "w13_map") == (w.w13.data_ptr(), HIDDEN, E * 2 * INTER, HIDDEN, 128, 128, 3)
    assert map_words(record, "w_down_map") == (w.w_down.data_ptr(), INTER, E * HIDDEN, INTER, 128, 128, 3)
    # (address, rows, K blocks, column stride, box rows, box K blocks, no swizzle): the activation scales, MN-major,
    # 64 rows of one K block per copy: the pool's own (the layer's layout, no copy) and the intermediate's.
    assert launch.pool_sf.data_ptr() == pool.x_sf.data_ptr()
    assert map_words(record, "pool_sf_map") == (pool.x_sf.data_ptr(), 300, HIDDEN // 128, 4 * 300, 64, 1, 0)
    assert launch.act_sf.stride() == (1, 300) and tuple(launch.act_sf.shape) == (300, INTER // 128)
    assert map_words(record, "act_sf_map") == (launch.act_sf.data_ptr(), 300, INTER // 128, 4 * 300, 64, 1, 0)
    empty = np.frombuffer(engine.prepare(pool, 0, None, grid_limit=4, cc=90).args[0].tobytes(),
                          dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]
    for name in ("pool_x_map", "act_map", "w13_map", "w_down_map", "pool_sf_map", "act_sf_map"):
        assert map_words(empty, name) == (0,) * 7, name  # no rows: no launch, no maps


def test_a_pool_whose_scales_are_not_mn_major_is_read_from_an_mn_major_copy(monkeypatch):
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    pool = pool_of(capacity=512, rows_for_sf=301)
    rows = torch.arange(301 * (HIDDEN // 128), dtype=torch.float32).view(301, HIDDEN // 128)  # row-major
    pool = Pool(x=pool.x, group_end=pool.group_end, x_sf=rows, m_indices=pool.m_indices, bad_groups=pool.bad_groups)
    launch = fused.FusedExperts(fp8_weights(), kernel="wg64t").prepare(pool, 301, 100, grid_limit=1000, cc=90)
    record = np.frombuffer(launch.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]
    copy = launch.pool_sf
    assert copy.stride() == (1, 304) and torch.equal(copy, rows)  # columns of 301 rows rounded up to 4
    assert map_words(record, "pool_sf_map") == (copy.data_ptr(), 301, HIDDEN // 128, 4 * 304, 64, 1, 0)


def test_wg128t_takes_whole_groups_and_64_row_weight_boxes(monkeypatch):
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    weights = fp8_weights()
    engine = fused.FusedExperts(weights, kernel="wg128t")
    pool = pool_of(capacity=512, rows_for_sf=300)
    launch = engine.prepare(pool, 300, rows_per_expert=100, grid_limit=1000, cc=90)
    assert (launch.kernel, launch.shared_bytes, fused.threads("wg128t")) == ("wg128t", 213832, 384)
    record = np.frombuffer(launch.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]
    # 128-row items: one m block per 128-row group (3 groups for 300 rows), each with its L1 and L2 items.
    assert int(record["experts"]["m_blocks_per_group"]) == 1 and tuple(launch.counters.shape) == (1 + 3,)
    assert launch.grid == 3 * (INTER // 128 + HIDDEN // 128)
    w = engine.weights
    assert map_words(record, "pool_x_map") == (pool.x.data_ptr(), HIDDEN, 300, HIDDEN, 128, 64, 3)
    assert map_words(record, "act_map") == (launch.act.data_ptr(), INTER, 300, INTER, 128, 64, 3)
    assert map_words(record, "w13_map") == (w.w13.data_ptr(), HIDDEN, E * 2 * INTER, HIDDEN, 128, 64, 3)
    assert map_words(record, "w_down_map") == (w.w_down.data_ptr(), INTER, E * HIDDEN, INTER, 128, 64, 3)
    # The weights' maps are encoded once per box size: wg64t's engine keeps its 128-row boxes.
    wg64t = fused.FusedExperts(weights, kernel="wg64t").prepare(pool, 300, 100, grid_limit=1000, cc=90)
    other = np.frombuffer(wg64t.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]
    assert map_words(other, "w13_map")[5] == 128 and fused.module_of("wg128t") == fused.module_of("wg64t")


def test_weights_evict_first_where_no_expert_spans_two_m_blocks(monkeypatch):
    # Each weight tile read by one item only (every expert within one m block: the decode sizes) -> the L2
    # evict-first hint; a bound above the kernel's m block, or none, keeps the default policy. Set per call.
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    weights = fp8_weights()
    pool = pool_of(capacity=512, rows_for_sf=300)
    for kernel, bound, want in (("wg64t", 8, 1), ("wg64t", 64, 1), ("wg64t", 65, 0), ("wg64t", None, 0),
                                ("wg128t", 100, 1), ("wg128t", 129, 0), ("wg64", 64, 1)):
        engine = fused.FusedExperts(weights, kernel=kernel)
        launch = engine.prepare(pool, 300, rows_per_expert=bound, grid_limit=1000, cc=90)
        struct = "FusedExpertsTmaArgs" if kernel in fused.TMA_KERNELS else "FusedExpertsArgs"
        record = np.frombuffer(launch.args[0].tobytes(), dtype=kernel_args.STRUCTS[struct])[0]
        experts = record["experts"] if kernel in fused.TMA_KERNELS else record
        assert int(experts["weights_evict_first"]) == want, (kernel, bound)
        assert fused.read_once(bound, fused.KERNELS[kernel]) == bool(want)


def test_the_plan_writes_the_first_row_of_every_group():
    # device/moe/args.cuh kPlanRows: the plan writes m_indices every KERNEL_PLAN_ROWS rows from each group's start,
    # so each 64-row block's first row only where the groups start at multiples of it.
    assert fused.FUSED_ALIGN_M % fused.KERNEL_PLAN_ROWS == 0
    assert f"kPlanRows = {fused.KERNEL_PLAN_ROWS};" in jit.read_source("moe/args.cuh")


def test_beside_the_dispatch_the_counters_end_with_its_plan_words(monkeypatch):
    """A TMA kernel prepared beside the fused dispatch: two zeroed words after the ticket and the arrivals, their
    address in the record's ``dispatch_plan`` and the launch's ``plan`` (the dispatch's DispatchFusedArgs::plan);
    prepared after it, neither. A kernel without TMA cannot start beside it."""
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    weights = fp8_weights()
    pool = pool_of(capacity=512, rows_for_sf=300)
    dtype = kernel_args.STRUCTS["FusedExpertsTmaArgs"]
    for kernel, m_blocks in (("wg64t", 6), ("wg128t", 3)):
        engine = fused.FusedExperts(weights, kernel=kernel)
        beside = engine.prepare(pool, 300, 100, grid_limit=1000, cc=90, beside_dispatch=True)
        assert tuple(beside.counters.shape) == (1 + m_blocks + 2,) and not beside.counters.any()
        assert beside.plan == beside.counters.data_ptr() + 4 * (1 + m_blocks)
        assert int(np.frombuffer(beside.args[0].tobytes(), dtype)[0]["experts"]["dispatch_plan"]) == beside.plan
        after = engine.prepare(pool, 300, 100, grid_limit=1000, cc=90)  # the engine's record, set again
        assert tuple(after.counters.shape) == (1 + m_blocks,) and after.plan == 0
        assert int(np.frombuffer(after.args[0].tobytes(), dtype)[0]["experts"]["dispatch_plan"]) == 0
    with pytest.raises(ConfigError, match="kernel 'wg64' cannot start beside the dispatch"):
        fused.FusedExperts(weights, kernel="wg64").prepare(pool, 300, 100, grid_limit=1000, cc=90,
                                                           beside_dispatch=True)


def test_begin_beside_dispatch_only_for_a_tma_kernel_on_sm90_when_on(monkeypatch):
    """`FusedExperts.begin_beside_dispatch`: a TMA kernel on cc 9.0 with ``beside_dispatch`` on
    (``SYMMRING_FUSED_BESIDE=1``; off by default) and rows to compute; its launch goes through the given launcher
    with the kernel's grid, block, record and shared memory."""
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    cc = [90]
    monkeypatch.setattr(fused, "_device", lambda index: (cc[0], 132))
    monkeypatch.setattr(fused, "_module", lambda index, cc, name: (None, {k: f"fn {k}" for k in fused.KERNELS}))
    weights = fp8_weights()
    pool = pool_of(capacity=512, rows_for_sf=300)
    monkeypatch.delenv("SYMMRING_FUSED_BESIDE", raising=False)
    assert not fused.FusedExperts(weights, kernel="wg64t").beside_dispatch  # the default
    monkeypatch.setenv("SYMMRING_FUSED_BESIDE", "1")
    engine = fused.FusedExperts(weights, kernel="wg64t")
    assert engine.beside_dispatch
    beside = engine.begin_beside_dispatch(pool, 300, 100)
    launches = []
    out = beside.launch(lambda *a, **kw: launches.append((a, kw)), "stream")
    ((fn, grid, block, args), kw), = launches
    assert (fn, block, kw) == ("fn wg64t", (384,), {"stream": "stream", "shared_mem": fused.shared_bytes("wg64t")})
    assert grid[0] == 6 * (INTER // 128 + HIDDEN // 256) and tuple(out.shape) == (300, HIDDEN)
    record = np.frombuffer(args[0].tobytes(), kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]
    assert int(record["experts"]["dispatch_plan"]) == beside.plan != 0
    assert fused.FusedExperts(weights, kernel="wg64").begin_beside_dispatch(pool, 300, 100) is None
    assert fused.FusedExperts(weights, kernel="auto").begin_beside_dispatch(pool, 300, 100) is not None  # wg64t
    assert engine.begin_beside_dispatch(pool, 0, 100) is None  # no rows: nothing launches
    rows = torch.zeros(300, HIDDEN // 128)  # row-major scales: their MN-major copy would precede the dispatch
    row_major = Pool(x=pool.x, group_end=pool.group_end, x_sf=rows, m_indices=pool.m_indices,
                     bad_groups=pool.bad_groups)
    assert engine.begin_beside_dispatch(row_major, 300, 100) is None
    engine.beside_dispatch = False
    assert engine.begin_beside_dispatch(pool, 300, 100) is None
    monkeypatch.setenv("SYMMRING_FUSED_BESIDE", "0")
    assert not fused.FusedExperts(weights, kernel="wg64t").beside_dispatch
    cc[0] = 89
    assert fused.FusedExperts(weights, kernel="auto").begin_beside_dispatch(pool, 300, 100) is None


def test_the_tma_kernel_needs_the_drivers_encoder(monkeypatch):
    monkeypatch.setattr(tensor_map, "_load_driver", lambda: None)
    with pytest.raises(BackendError, match="kernels 'wg64t' and 'wg128t' need the CUDA driver's cuTensorMapEncodeTiled"):
        fused.FusedExperts(fp8_weights(), kernel="wg64t")
    fused.FusedExperts(fp8_weights(), kernel="wg64")  # the other kernels need no encoder


@pytest.mark.parametrize("kernel", ["wg64t", "m32"])
def test_each_call_sets_every_field_it_owns(monkeypatch, kernel):
    """The engine makes its records once and sets a call's fields into them: after other calls (one of no rows, whose
    maps are zero), a call's record is the one a fresh engine packs for it, the call's own buffers aside."""
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    weights = fp8_weights()
    engine = fused.FusedExperts(weights, kernel=kernel)
    dtype = kernel_args.STRUCTS["FusedExpertsTmaArgs" if kernel == "wg64t" else "FusedExpertsArgs"]
    own = {"act", "act_sf", "out", "counters", "status"}  # the call's buffers, and the engine's status
    send = CombineRows(row_src=0x5000, token_base=0x6000, peers=0x7000, window_begin=3, num_ranks=4, num_topk=8,
                       combine_tokens=4096)
    calls = [(pool_of(512, rows_for_sf=300), 300, 100, None), (pool_of(256), 0, None, None),
             (pool_of(384), 200, 20, send), (pool_of(512, rows_for_sf=300), 300, 100, None)]
    for pool, rows, bound, to in calls:
        launch = engine.prepare(pool, rows, bound, grid_limit=1000, cc=90, send=to)
        got = np.frombuffer(launch.args[0].tobytes(), dtype=dtype)[0]
        want = np.frombuffer(fused.FusedExperts(weights, kernel=kernel).prepare(
            pool, rows, bound, grid_limit=1000, cc=90, send=to).args[0].tobytes(), dtype=dtype)[0]
        got_experts, want_experts = (got["experts"], want["experts"]) if kernel == "wg64t" else (got, want)
        for name in got_experts.dtype.names:
            if name not in own:
                assert got_experts[name] == want_experts[name], (rows, name)
        assert int(got_experts["status"]) == engine.status.data_ptr()
        for name in ("act", "out", "counters"):
            assert int(got_experts[name]) == getattr(launch, name).data_ptr(), (rows, name)
        with pytest.raises(ConfigError, match=r"send=.*expected a CombineRows"):
            engine.prepare(pool, rows, bound, grid_limit=1000, cc=90, send=(0x5000, 0x6000))
        # A call that sends its rows (the layer's combine) names where, and needs no output rows of its own.
        assert (int(got_experts["send_peers"]), int(got_experts["window_begin"])) == ((0x7000, 3) if to else (0, 0))
        assert tuple(launch.out.shape) == ((0 if to else rows), HIDDEN)
        if kernel == "wg64t":
            for name in ("pool_x_map", "w13_map", "w_down_map", "pool_sf_map"):
                assert map_words(got, name) == map_words(want, name), (rows, name)
            assert map_words(got, "act_map")[0] == (launch.act.data_ptr() if rows else 0)


def test_a_map_is_encoded_once_per_spec(monkeypatch):
    """The engine keeps the maps it encoded by spec: calls over the same tensors encode nothing again (the weights'
    two maps once, four for the first call's pass), a pool elsewhere gets maps of its own."""
    specs = []

    class CountingEncoder(FakeEncoder):
        def __call__(self, spec):
            specs.append(spec)
            return super().__call__(spec)

    monkeypatch.setattr(tensor_map, "Encoder", CountingEncoder)
    engine, pool = fused.FusedExperts(fp8_weights(), kernel="wg64t"), pool_of(capacity=512, rows_for_sf=300)
    kept = [engine.prepare(pool, 300, 100, grid_limit=1000, cc=90) for _ in range(3)]  # kept: no address reused
    assert len(specs) == 2 + 4 * 3 - 2 * 2  # the pool's maps once; each call's intermediate its own
    assert len({s.address for s in specs}) == len(specs)
    again = engine.prepare(pool, 300, 100, grid_limit=1000, cc=90)
    record = np.frombuffer(again.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]
    assert map_words(record, "pool_x_map")[0] == pool.x.data_ptr()
    assert map_words(record, "act_map")[0] == again.act.data_ptr()
    other = pool_of(capacity=512, rows_for_sf=300)
    before = len(specs)
    engine.prepare(other, 300, 100, grid_limit=1000, cc=90)
    assert {s.address for s in specs[before:]} >= {other.x.data_ptr(), other.x_sf.data_ptr()}
    del kept


def test_the_record_names_every_buffer_and_shape():
    engine = fused.FusedExperts(fp8_weights(), timeout_s=2.5)
    pool = pool_of(capacity=512, rows_for_sf=300)
    launch = engine.prepare(pool, 300, rows_per_expert=20, grid_limit=7, cc=89)
    record = np.frombuffer(launch.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsArgs"])[0]
    w = engine.weights
    pointers = dict(pool_x=pool.x, pool_sf=pool.x_sf, m_indices=pool.m_indices, w13=w.w13, w13_sf=w.w13_scale,
                    w_down=w.w_down, w_down_sf=w.w_down_scale, act=launch.act, act_sf=launch.act_sf, out=launch.out,
                    counters=launch.counters, bad_groups=pool.bad_groups, status=engine.status)
    for name, tensor in pointers.items():
        assert int(record[name]) == tensor.data_ptr(), name
    assert (int(record["sf_row_stride"]), int(record["sf_col_stride"])) == (1, 300)  # MN-major, as dispatch writes
    assert int(record["timeout_ns"]) == 2_500_000_000
    assert (int(record["num_rows"]), int(record["hidden"]), int(record["inter"]), int(record["num_local_experts"])) \
        == (300, HIDDEN, INTER, E)
    # 20 rows per expert: 32-row items, one m block listed per 128-row group (the rest is padding): 3 m blocks;
    # each 3 L1 + 2 L2 items.
    assert launch.kernel == "m32" and launch.shared_bytes == fused.shared_bytes("m32") == 166920
    assert int(record["m_blocks_per_group"]) == 1
    assert launch.grid == 7 and tuple(launch.counters.shape) == (1 + 3,) and not launch.counters.any()
    assert tuple(launch.out.shape) == (300, HIDDEN) and launch.out.dtype == torch.bfloat16
    assert tuple(launch.act.shape) == (300, INTER) and tuple(launch.act_sf.shape) == (300, INTER // 128)
    assert engine.prepare(pool, 300, 20, grid_limit=1000, cc=89).grid == 3 * (3 + 2)  # never more blocks than items
    unbounded = engine.prepare(pool, 300, None, grid_limit=1000, cc=89)  # no bound (m32 off cc 9.0): every m block
    assert unbounded.kernel == "m32" and unbounded.grid == 12 * (3 + 2) and tuple(unbounded.counters.shape) == (1 + 12,)
    assert engine.prepare(pool, 0, None, grid_limit=1000, cc=89).grid == 1


def test_the_wgmma_record_covers_64_row_blocks(monkeypatch):
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    engine = fused.FusedExperts(fp8_weights(), kernel="auto")
    pool = pool_of(capacity=512, rows_for_sf=300)
    launch = engine.prepare(pool, 300, rows_per_expert=100, grid_limit=1000, cc=90)
    # 100 rows per expert on cc 9.0: wg64t; 3 groups of 128 rows = 6 m blocks of 64, each 3 L1 items and one L2
    # item of both output blocks.
    assert (launch.kernel, launch.shared_bytes) == ("wg64t", fused.shared_bytes("wg64t"))
    assert tuple(launch.counters.shape) == (1 + 6,) and launch.grid == 6 * (3 + 1)
    record = np.frombuffer(launch.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]["experts"]
    assert int(record["counters"]) == launch.counters.data_ptr() and int(record["num_rows"]) == 300
    assert int(record["m_blocks_per_group"]) == 2
    # 40 rows per expert: one 64-row m block per group (its second would be padding): 3 m blocks.
    launch = engine.prepare(pool, 300, rows_per_expert=40, grid_limit=1000, cc=90)
    record = np.frombuffer(launch.args[0].tobytes(), dtype=kernel_args.STRUCTS["FusedExpertsTmaArgs"])[0]["experts"]
    assert launch.kernel == "wg64t" and int(record["m_blocks_per_group"]) == 1
    assert tuple(launch.counters.shape) == (1 + 3,) and launch.grid == 3 * (3 + 1)
    # The same call on an sm_89 device takes the mma.sync kernel: the record is the same but for the buffers.
    assert engine.prepare(pool, 300, 100, grid_limit=1000, cc=89).kernel == "m32"


@pytest.mark.parametrize("rows_per_expert, cc, kernel", [
    (0, 90, "wg64t"), (1, 90, "wg64t"), (32, 90, "wg64t"), (33, 90, "wg64t"), (512, 90, "wg64t"),
    (None, 90, "wg64t"),  # auto never picks wg64 or wg128t
    (33, 89, "m32"), (None, 89, "m32"), (8, 89, "m16"), (256, 100, "m32"), (None, 120, "m32"),
])
def test_the_kernel_rule(rows_per_expert, cc, kernel):
    assert fused.select_kernel(rows_per_expert, cc) == kernel


class NoEncoder:
    """The driver's encoder where the driver has none (`tensor_map.Encoder` refuses when made)."""

    def __init__(self):
        raise BackendError("no cuTensorMapEncodeTiled here")


def test_auto_resolves_the_encoder_at_its_first_tma_call(monkeypatch):
    # Auto needs the driver's encoder only once a call takes wg64t: made without one, the engine serves the
    # mma.sync kernels' calls (a device other than cc 9.0); a wg64t call raises the encoder's error, before any
    # launch.
    monkeypatch.setattr(tensor_map, "Encoder", NoEncoder)
    engine = fused.FusedExperts(fp8_weights(), kernel="auto")
    pool = pool_of(capacity=512, rows_for_sf=300)
    assert engine.prepare(pool, 300, rows_per_expert=20, grid_limit=1000, cc=89).kernel == "m32"
    assert engine.prepare(pool, 0, None, grid_limit=1000, cc=90).kernel == "wg64t"  # no rows: nothing to encode
    with pytest.raises(BackendError, match="cuTensorMapEncodeTiled"):
        engine.prepare(pool, 300, rows_per_expert=40, grid_limit=1000, cc=90)
    with pytest.raises(BackendError, match="cuTensorMapEncodeTiled"):
        fused.FusedExperts(fp8_weights(), kernel="wg64t")  # forced: refused when made
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    assert engine.prepare(pool, 300, rows_per_expert=40, grid_limit=1000, cc=90).kernel == "wg64t"


def test_a_forced_kernel_is_taken_as_it_is(monkeypatch):
    monkeypatch.delenv("SYMMRING_FUSED_KERNEL", raising=False)
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    pool = pool_of()
    for forced, rows in (("m16", 16), ("m32", 32), ("wg64", 64), ("wg64t", 64), ("wg128t", 128)):
        engine = fused.FusedExperts(fp8_weights(), kernel=forced)
        launch = engine.prepare(pool, 512, None, grid_limit=1000, cc=90)  # no bound: every m block of its rows
        assert launch.kernel == forced and tuple(launch.counters.shape) == (1 + 512 // rows,)
        launch = engine.prepare(pool, 512, 1, grid_limit=1000, cc=90)  # one row per expert: one m block per group
        assert launch.kernel == forced and tuple(launch.counters.shape) == (1 + 4,)  # 4 groups
    assert fused.FusedExperts(fp8_weights()).kernel == "auto"
    monkeypatch.setenv("SYMMRING_FUSED_KERNEL", " WG64 ")
    assert fused.FusedExperts(fp8_weights()).prepare(pool, 512, 1, grid_limit=1000, cc=90).kernel == "wg64"
    assert fused.FusedExperts(fp8_weights(), kernel="m16").kernel == "m16"  # the argument wins over the variable
    monkeypatch.setenv("SYMMRING_FUSED_KERNEL", "wg64t")
    assert fused.FusedExperts(fp8_weights()).prepare(pool, 512, 1, grid_limit=1000, cc=90).kernel == "wg64t"
    monkeypatch.setenv("SYMMRING_FUSED_KERNEL", "m64")
    with pytest.raises(ConfigError, match=r"SYMMRING_FUSED_KERNEL='m64': expected one of \['auto', 'm16', 'm32', "
                                          r"'wg64', 'wg64t', 'wg128t'\]"):
        fused.FusedExperts(fp8_weights())
    with pytest.raises(ConfigError, match="kernel='wgmma': expected one of"):
        fused.FusedExperts(fp8_weights(), kernel="wgmma")


@pytest.mark.parametrize("kernel", ["wg64", "wg64t", "wg128t"])
def test_the_wgmma_kernels_are_refused_off_sm90(kernel, monkeypatch):
    monkeypatch.setattr(tensor_map, "Encoder", FakeEncoder)
    engine = fused.FusedExperts(fp8_weights(), kernel=kernel)
    for cc in (89, 100):
        with pytest.raises(BackendError, match=rf"kernel '{kernel}' uses wgmma \(sm_90a\), device is sm_{cc}"):
            engine.prepare(pool_of(), 512, 64, grid_limit=4, cc=cc)


def test_the_work_list_arithmetic():
    assert [fused.block_rows(r) for r in (None, 0, 1, 16, 17, 32, 33, 128)] == [32, 16, 16, 16, 32, 32, 32, 32]
    # DeepSeek-V3-like: one token on one PE touches 8 experts: 8 groups x 8 m blocks of 16 rows.
    assert fused.work_items(8 * 128, 16, 7168, 2048, 8) == (64, 64 * (16 + 56))
    assert fused.work_items(8 * 128, 16, 7168, 2048, fused.blocks_per_group(1, 16)) == (8, 8 * (16 + 56))
    assert fused.work_items(1, 32, 256, 128, 4) == (4, 4 * 3)
    assert fused.work_items(0, 16, 256, 128, 8) == (0, 0)
    assert fused.work_items(8 * 128, 64, 7168, 2048, 2, l2_pairs=True) == (16, 16 * (16 + 28))  # wg64t's L2 pairs
    assert fused.work_items(128, 64, 384, 128, 1, l2_pairs=True) == (1, 1 + 3)  # hidden / 128 odd: single blocks
    bounds = (None, 0, 1, 32, 33, 64, 128, 129, 5000)
    assert [fused.blocks_per_group(r, 32) for r in bounds] == [4, 1, 1, 1, 2, 2, 4, 4, 4]
    assert [fused.blocks_per_group(r, 16) for r in (None, 1, 16, 17, 100)] == [8, 1, 1, 2, 7]
    assert [fused.blocks_per_group(r, 64) for r in (None, 1, 64, 65, 500)] == [2, 1, 1, 2, 2]  # wg64


@pytest.mark.parametrize("change, message", [
    (lambda p: dict(num_rows=600), r"num_rows=600: expected an int in \[0, 512\]"),
    (lambda p: dict(x=p.x[:, :128]), "pool.x: expected contiguous fp8 rows"),
    (lambda p: dict(m_indices=torch.zeros(1024, dtype=torch.int32)[::2]), "pool.m_indices: expected contiguous"),
    (lambda p: dict(x_sf=None), "expected an fp8 pool with x_sf and m_indices"),
    (lambda p: dict(x_sf=p.x_sf[:, :1]), r"pool.x_sf: expected \[>= 512, 2\]"),
])
def test_a_pool_the_kernel_cannot_read_is_named(change, message):
    pool = pool_of()
    kwargs = change(pool)
    num_rows = kwargs.pop("num_rows", 512)
    for name, value in kwargs.items():
        setattr(pool, name, value)
    with pytest.raises(ConfigError, match=message):
        fused.FusedExperts(fp8_weights()).prepare(pool, num_rows, None, grid_limit=4, cc=90)


def test_check_status_names_what_the_kernel_recorded():
    engine = fused.FusedExperts(fp8_weights(), timeout_s=1.0)
    engine.check_status()  # nothing recorded
    engine.status.copy_(torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(BackendError, match=r"3 L2 tile\(s\) waited past 1 s .*first m block 5"):
        engine.check_status()
    engine.check_status()  # cleared
    engine.status[0] = -1
    with pytest.raises(BackendError, match="less shared memory"):
        engine.check_status()
    engine.status[0] = -2
    with pytest.raises(BackendError, match="not built for sm_90a"):
        engine.check_status()
    engine.status[0] = -3
    with pytest.raises(BackendError, match=r"a wait of a TMA kernel's pipeline \(its ring or item queue\) expired"):
        engine.check_status()
    engine.status[0] = -4
    with pytest.raises(BackendError, match="beside the fused dispatch, the kernel's wait for the dispatch's plan"):
        engine.check_status()
    engine.check_status()


@pytest.mark.skipif(_toolchain_missing() is not None, reason=f"{_toolchain_missing()}")
def test_shared_bytes_is_the_kernels_layout(tmp_path):
    # The kernel refuses a launch with less (status -1); more would waste occupancy: the host's figure is exact.
    asserts = "\n".join(f"static_assert(sizeof(symmring_moe::fused::Shared<{rows}>) == "
                        f"{fused.shared_bytes(f'm{rows}')}, \"fused shared memory of {rows} rows\");"
                        for rows in fused.BLOCK_ROWS)
    asserts += (f"\nstatic_assert(symmring_moe::fused::wg::kDynamicSharedBytes == {fused.shared_bytes('wg64')}, "
                f"\"wgmma fused shared memory\");")
    asserts += "".join(f"\nstatic_assert(symmring_moe::fused::wg::tma::kDynamicSharedBytes<"
                       f"symmring_moe::fused::wg::tma::Tile<{fused.KERNELS[k]}>> == {fused.shared_bytes(k)}, "
                       f"\"{k} shared memory\");" for k in fused.TMA_KERNELS)
    source = (f"#include <moe/fused_experts.cu>\n#include <moe/fused_experts_wgmma.cu>\n"
              f"#include <moe/fused_experts_tma.cu>\n{asserts}\n")
    assert jit.compile_cubin(source, name="fused_layout", cc=90, cache_dir=tmp_path).is_file()
