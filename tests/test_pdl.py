"""`symmring.pdl` on the CPU: when programmatic dependent launch is used, and what a launch passes on.

The launch itself (cuLaunchKernelEx) needs a GPU: tests/gpu runs every small-batch call through it on one PE.
"""

from __future__ import annotations

import numpy as np
import pytest

from symmring import pdl
from symmring.errors import BackendError


class _Data:
    def __init__(self, ptr):
        self.ptr = ptr


class _DeviceArray:  # what the launcher reads of a CuPy array
    def __init__(self, ptr):
        self.data = _Data(ptr)


def test_arguments_are_their_bytes():
    assert pdl._arg_bytes(np.int32(-2)) == np.int32(-2).tobytes()
    assert pdl._arg_bytes(np.float32(2.5)) == np.float32(2.5).tobytes()
    assert pdl._arg_bytes(np.uint64(2**40 + 3)) == (2**40 + 3).to_bytes(8, "little")
    assert pdl._arg_bytes(_DeviceArray(0x7F0000001000)) == (0x7F0000001000).to_bytes(8, "little")
    # A struct passed by value (symmring.moe.gpu.kernel_args): the one-element array's bytes, padding included.
    record = np.zeros((), np.dtype([("a", np.uint64), ("b", np.int32)], align=True))
    record["a"], record["b"] = 2**40 + 3, -2
    param = record.reshape(1).view(np.dtype((np.void, 16)))
    assert pdl._arg_bytes(param) == (2**40 + 3).to_bytes(8, "little") + (-2).to_bytes(4, "little", signed=True) + bytes(4)
    with pytest.raises(BackendError, match="unsupported kernel argument int"):
        pdl._arg_bytes(3)
    with pytest.raises(BackendError, match="unsupported kernel argument ndarray"):
        pdl._arg_bytes(np.zeros(2, np.int32))  # an array of several values is no by-value argument


@pytest.mark.parametrize("cc, pes, env, want", [(9, 1, None, True), (9, 2, None, False), (8, 1, None, False),
                                                 (9, 1, "0", False), (10, 1, "1", True)])
def test_enabled_only_for_one_pe_per_hopper_gpu(monkeypatch, cc, pes, env, want):
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: object())  # a driver that has cuLaunchKernelEx
    if env is None:
        monkeypatch.delenv("SYMMRING_PDL", raising=False)
    else:
        monkeypatch.setenv("SYMMRING_PDL", env)
    assert pdl.PdlLauncher(cc, pes).enabled is want


def test_without_pdl_the_kernel_is_called_as_cupy_does(monkeypatch):
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: None)  # a driver without it
    calls = []

    def fn(grid, block, args, stream=None, shared_mem=0):
        calls.append((grid, block, args, stream, shared_mem))

    launcher = pdl.PdlLauncher(9, 1)
    assert not launcher.enabled
    launcher(fn, (3,), (256,), (np.int32(1),), stream="s", shared_mem=64)
    assert calls == [((3,), (256,), (np.int32(1),), "s", 64)]


def test_the_launch_attribute_is_programmatic_stream_serialization():
    """CUlaunchAttribute: id 6 (PROGRAMMATIC_STREAM_SERIALIZATION), 4 bytes of padding, the flag 1, 72 bytes."""
    import ctypes
    attr = pdl.PdlLauncher(9, 1)._attr
    assert ctypes.sizeof(attr) == 72 and ctypes.sizeof(pdl._LaunchConfig) == 56
    assert bytes(attr)[:12] == (6).to_bytes(4, "little") + bytes(4) + (1).to_bytes(4, "little")
    assert bytes(attr)[12:] == bytes(60)


def test_a_pdl_launch_passes_grid_block_stream_and_every_argument(monkeypatch):
    """What cuLaunchKernelEx receives: the config (grid, block, shared memory, stream, the one attribute), the
    function handle and a pointer to each argument's bytes, in order."""
    import ctypes
    seen = {}

    def fake(config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(pdl._LaunchConfig)).contents
        seen["dims"] = (config.grid_x, config.grid_y, config.grid_z, config.block_x, config.block_y, config.block_z)
        seen["shared"], seen["stream"], seen["num_attrs"] = config.shared_mem, config.stream, config.num_attrs
        seen["attr"] = (config.attrs[0].id, config.attrs[0].value)
        seen["function"] = function.value if isinstance(function, ctypes.c_void_p) else function
        seen["args"] = [ctypes.string_at(params[i], n) for i, n in enumerate((4, 8, 8, 4))]
        return 0

    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: fake)
    monkeypatch.delenv("SYMMRING_PDL", raising=False)

    class Fn:
        ptr = 0xF00

    class Stream:
        ptr = 0x5EED

    launcher = pdl.PdlLauncher(9, 1)
    launcher(Fn(), (7, 2), (256,), (np.int32(-3), np.uint64(2**40), _DeviceArray(0x1000), np.float32(1.5)),
             stream=Stream(), shared_mem=96)
    assert seen["dims"] == (7, 2, 1, 256, 1, 1) and seen["shared"] == 96 and seen["stream"] == 0x5EED
    assert seen["num_attrs"] == 1 and seen["attr"] == (6, 1) and seen["function"] == 0xF00
    assert seen["args"] == [np.int32(-3).tobytes(), np.uint64(2**40).tobytes(), np.uint64(0x1000).tobytes(),
                            np.float32(1.5).tobytes()]
    assert launcher.launches == 1
    monkeypatch.setattr(pdl, "_launch_kernel_ex", lambda: (lambda *a: 999))
    with pytest.raises(BackendError, match="CUresult 999; SYMMRING_PDL=0"):
        launcher(Fn(), (1,), (32,), (), stream=Stream())
