"""The TMA maps of the fused engine's wg64t kernel on the CPU (symmring.moe.gpu.tensor_map): the arguments of
``cuTensorMapEncodeTiled`` against each tensor's shape and strides, the tensors TMA cannot read refused by name,
the 128-byte record the kernel's parameter carries, and the encoder's call into the driver (a stand-in for
libcuda here; the real driver's maps run in tests/gpu/test_fused_engine.py -k wg64t)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from symmring.errors import BackendError, ConfigError
from symmring.moe.gpu import kernel_args, tensor_map

torch = pytest.importorskip("torch", reason="the maps are made of torch tensors")


def aligned_rows(rows, k, offset=0, row_bytes=None):
    """A [rows, k] fp8 view whose base is ``offset`` bytes past a 256-byte boundary, rows ``row_bytes`` apart."""
    row_bytes = k if row_bytes is None else row_bytes
    storage = torch.zeros(rows * row_bytes + 512, dtype=torch.uint8)
    start = -storage.data_ptr() % 256 + offset
    view = storage[start:start + rows * row_bytes].view(rows, row_bytes)[:, :k]
    return view.view(torch.float8_e4m3fn)


def test_a_pool_map_covers_the_pass_rows_in_64_row_boxes():
    x = aligned_rows(512, 7168)
    spec = tensor_map.tile_spec("pool.x", x, 64, rows=300)
    assert spec.address == x.data_ptr() and spec.dims == (7168, 300) and spec.strides == (7168,)
    assert spec.box == (128, 64) and spec.element_strides == (1, 1)
    assert (spec.data_type, spec.interleave, spec.swizzle, spec.oob_fill) == (0, 0, 3, 0)  # uint8, none, 128B, zeros
    assert tensor_map.tile_spec("pool.x", x, 64).dims == (7168, 512)  # every row by default


def test_a_padded_row_stride_is_taken_as_it_is():
    x = aligned_rows(100, 256, row_bytes=384)  # rows 384 bytes apart, 256 of them K
    spec = tensor_map.tile_spec("act", x, 64)
    assert spec.dims == (256, 100) and spec.strides == (384,)


def test_weights_are_mapped_as_experts_times_rows():
    w13 = torch.zeros(4, 2 * 384, 256, dtype=torch.float8_e4m3fn)
    view = tensor_map.weight_view(w13)
    spec = tensor_map.tile_spec("weights.w13", view, 128)
    assert spec.address == w13.data_ptr() and spec.dims == (256, 4 * 768) and spec.strides == (256,)
    assert spec.box == (128, 128)
    with pytest.raises(ConfigError, match=r"contiguous \[E, N, K\]"):
        tensor_map.weight_view(w13.transpose(1, 2))
    with pytest.raises(ConfigError, match=r"contiguous \[E, N, K\]"):
        tensor_map.weight_view(w13[0])


@pytest.mark.parametrize("make, message", [
    (lambda: aligned_rows(64, 256).t(), "K stride 1"),                                  # column-major
    (lambda: aligned_rows(64, 256, offset=8), r"base address 0x[0-9a-f]+ is not 16-byte aligned"),
    (lambda: aligned_rows(64, 256, row_bytes=264), r"row stride 264 bytes: expected a multiple of 16"),
    (lambda: aligned_rows(64, 192), r"K=192: expected a positive multiple of 128"),
    (lambda: torch.zeros(64, 256, dtype=torch.bfloat16), "1-byte elements"),
    (lambda: torch.zeros(2, 64, 256, dtype=torch.uint8), "a 2D tensor"),
])
def test_tensors_tma_cannot_read_are_refused_by_name(make, message):
    with pytest.raises(ConfigError, match=rf"^pool\.x: .*{message}"):
        tensor_map.tile_spec("pool.x", make(), 64)


def mn_major(rows, blocks, column=None, offset=0):
    """float32 scales [rows, blocks] with rows contiguous, each block's column ``column`` floats (default: rows
    rounded up to 4), the base ``offset`` bytes past a 256-byte boundary."""
    column = -(-rows // 4) * 4 if column is None else column
    storage = torch.zeros(blocks * column + 128)
    start = (-storage.data_ptr() % 256 + offset) // 4
    return storage[start:start + blocks * column].view(blocks, column).t()[:rows]


def test_activation_scales_are_mapped_rows_innermost_one_k_block_per_copy():
    sf = mn_major(300, 56)
    spec = tensor_map.scale_spec("pool.x_sf", sf, 64, rows=290)
    assert spec.address == sf.data_ptr() and spec.dims == (290, 56) and spec.strides == (4 * 300,)
    assert spec.box == (64, 1) and (spec.data_type, spec.swizzle, spec.oob_fill) == (7, 0, 0)  # float32, none, zeros
    assert tensor_map.scale_spec("pool.x_sf", sf, 64).dims == (300, 56)
    assert tensor_map.is_mn_major(sf) and not tensor_map.is_mn_major(sf.t().contiguous().t().contiguous())


@pytest.mark.parametrize("make, message", [
    (lambda: torch.zeros(300, 56), "strides"),                                      # row-major
    (lambda: mn_major(301, 56, column=301), "strides"),                             # columns not 16-byte aligned
    (lambda: mn_major(300, 56, offset=4), "16-byte aligned base"),
    (lambda: torch.zeros(56, 300, dtype=torch.float64).t(), "float64"),
])
def test_scales_tma_cannot_read_are_refused_by_name(make, message):
    with pytest.raises(ConfigError, match=rf"^pool\.x_sf: expected MN-major float32 .*{message}"):
        tensor_map.scale_spec("pool.x_sf", make(), 64)
    with pytest.raises(ConfigError, match="box_rows=300"):
        tensor_map.scale_spec("pool.x_sf", mn_major(300, 2), 300)
    with pytest.raises(ConfigError, match="rows=0"):
        tensor_map.scale_spec("pool.x_sf", mn_major(300, 2), 64, rows=0)


def test_rows_and_boxes_out_of_range_are_refused():
    x = aligned_rows(64, 256)
    for rows in (0, 65):
        with pytest.raises(ConfigError, match=rf"rows={rows}: expected 1 to 64"):
            tensor_map.tile_spec("act", x, 64, rows=rows)
    with pytest.raises(ConfigError, match="box_rows=257"):
        tensor_map.tile_spec("act", x, 257)


def test_the_map_record_is_the_kernels_128_bytes():
    raw = bytes(range(128))
    record = tensor_map.map_record(raw)
    assert record.dtype == kernel_args.STRUCTS["TensorMap"] and record.tobytes() == raw
    with pytest.raises(ValueError, match="128 bytes, got 127"):
        tensor_map.map_record(raw[:127])
    layout = kernel_args.STRUCTS["FusedExpertsTmaArgs"]
    offsets = [layout.fields[n][1] for n in ("pool_x_map", "act_map", "w13_map", "w_down_map")]
    assert all(o % 64 == 0 for o in offsets) and layout.itemsize % 64 == 0  # alignas(64), as the driver wants


class FakeDriver:
    """``cuTensorMapEncodeTiled`` as ctypes calls it: records each call's arguments and writes a map of known bytes."""

    def __init__(self, result=0):
        self.calls, self.result = [], result

    def __call__(self, out, data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle,
                 l2_promotion, oob_fill):
        self.calls.append(dict(out=out, data_type=data_type, rank=rank, address=address.value, dims=tuple(dims),
                               strides=tuple(strides), box=tuple(box), element_strides=tuple(element_strides),
                               modes=(interleave, swizzle, l2_promotion, oob_fill)))
        ctypes.memmove(out, bytes(range(1, 129)), 128)
        return self.result


def test_the_encoder_passes_the_spec_to_the_driver():
    driver = FakeDriver()
    encode = tensor_map.Encoder(load=lambda: driver)
    x = aligned_rows(300, 512)
    record = encode(tensor_map.tile_spec("pool.x", x, 64))
    (call,) = driver.calls
    assert call["out"] % 64 == 0  # the driver writes a CUtensorMap at a 64-byte aligned address
    assert (call["data_type"], call["rank"], call["address"]) == (0, 2, x.data_ptr())
    assert (call["dims"], call["strides"], call["box"], call["element_strides"]) == ((512, 300), (512,), (128, 64),
                                                                                      (1, 1))
    assert call["modes"] == (0, 3, 3, 0)
    assert record.tobytes() == bytes(range(1, 129))


def test_the_drivers_refusal_and_absence_are_backend_errors():
    encode = tensor_map.Encoder(load=lambda: FakeDriver(result=1))
    with pytest.raises(BackendError, match=r"cuTensorMapEncodeTiled refused .*CUresult 1"):
        encode(tensor_map.tile_spec("pool.x", aligned_rows(64, 256), 64))
    with pytest.raises(BackendError, match="need the CUDA driver's cuTensorMapEncodeTiled"):
        tensor_map.Encoder(load=lambda: None)
