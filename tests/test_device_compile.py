"""Every device source compiles and device-links for sm_90 with nvcc, as on the GPU machine.

The same two nvcc steps `symmring.jit` runs there (``-dc``, then ``--cubin --device-link x.o
-lnvshmem_device`` against the installed nvidia-nvshmem wheel) need no GPU, so CI runs them here for
every ``.cu`` under ``device/`` and for a "user" kernel file that includes <symmring/protocol.cuh> from outside the
package (tests/gpu/user_kernels.cu). Skipped, with the reason, only where nvcc or the wheel is missing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from symmring import jit
from symmring.errors import BackendError, CompileError

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "device").rglob("*.cu")) + [ROOT / "tests" / "gpu" / "user_kernels.cu"]


def _toolchain_missing():
    try:
        jit.nvcc_path()
        jit.nvshmem_paths()
    except BackendError as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason=f"{_toolchain_missing()}")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{source: cubin path or the exception}, every source compiled concurrently (one nvcc per core)."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    cache_dir = tmp_path_factory.mktemp("symmring-cache")

    def build(source):
        try:
            return jit.compile_cubin(source.read_text(), name=source.stem, cc=90, cache_dir=cache_dir)
        except Exception as exc:  # reported by the test of that source
            return exc

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(SOURCES, pool.map(build, SOURCES)))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_compiles_and_device_links_for_sm90(source, compiled):
    cubin = compiled[source]
    if isinstance(cubin, CompileError):
        pytest.fail(f"{source.name} failed to compile:\n{cubin}")
    if isinstance(cubin, Exception):
        raise cubin
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF", f"{cubin} is not a cubin (ELF)"
    # Every extern "C" kernel of the source is in the linked image, under its own (unmangled) name.
    kernels = jit.kernel_names(source.read_text())
    assert kernels, f"{source} defines no extern \"C\" kernel"
    missing = [k for k in kernels if k.encode() not in data]
    assert not missing, f"kernels missing from {cubin.name}: {missing}"


def test_compile_error_carries_the_compiler_log(tmp_path):
    source = '#include <symmring/protocol.cuh>\nextern "C" __global__ void broken() { undefined_symbol_xyz(); }\n'
    with pytest.raises(CompileError) as info:
        jit.compile_cubin(source, name="broken", cc=90, cache_dir=tmp_path)
    assert "undefined_symbol_xyz" in info.value.log
    assert "-dc" in info.value.options
    assert not list(tmp_path.glob("*.cubin"))


def test_second_request_is_a_cache_hit(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(jit, "device_hash", lambda: "fixed")  # other edits under device/ must not interfere
    monkeypatch.setattr(jit, "_run", lambda cmd, **kw: calls.append(cmd) or Path(cmd[cmd.index("-o") + 1])
                        .write_bytes(b"\x7fELF"))
    first = jit.compile_cubin('extern "C" __global__ void k() {}', name="k", cc=90, cache_dir=tmp_path)
    second = jit.compile_cubin('extern "C" __global__ void k() {}', name="k", cc=90, cache_dir=tmp_path)
    third = jit.compile_cubin('extern "C" __global__ void k2() {}', name="k", cc=90, cache_dir=tmp_path)
    assert first == second != third
    assert len(calls) == 4  # two nvcc steps for the first source, two for the changed one, none for the hit


def test_cache_key_follows_the_device_headers(tmp_path, monkeypatch):
    # A copy of device/ with one header changed gives a different device hash, hence a different cubin name.
    copy = tmp_path / "device"
    shutil.copytree(ROOT / "device", copy)
    monkeypatch.setattr(jit, "device_dir", lambda: copy)
    before = jit.device_hash()
    header = copy / "symmring" / "timeout.cuh"
    header.write_text(header.read_text() + "\n// changed\n")
    assert jit.device_hash() != before


def test_arch_specific_sources_build_for_sm90a(compiled):
    # The wgmma kernels' sources ask for sm_90a (wgmma has no sm_90 encoding); every other source keeps sm_90.
    asking = {s for s in SOURCES if jit.target_arch(s.read_text(), 90) == "sm_90a"}
    assert asking == {ROOT / "device" / "moe" / name for name in ("fused_experts_wgmma.cu", "fused_experts_tma.cu")}
    for source in SOURCES:
        cubin = compiled[source]
        if isinstance(cubin, Exception):
            continue  # reported by test_source_compiles_and_device_links_for_sm90
        assert (b"sm_90a" in cubin.read_bytes()) == (source in asking), source


def test_the_marker_picks_the_target_of_both_steps(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(jit, "_run", lambda cmd, **kw: calls.append(cmd) or Path(cmd[cmd.index("-o") + 1])
                        .write_bytes(b"\x7fELF"))
    marked = f'{jit.ARCH_SPECIFIC_MARKER}\nextern "C" __global__ void k() {{}}\n'
    jit.compile_cubin(marked, name="k", cc=90, cache_dir=tmp_path)
    assert all("-arch=sm_90a" in cmd for cmd in calls) and len(calls) == 2
    calls.clear()
    jit.compile_cubin(marked, name="k", cc=89, cache_dir=tmp_path)  # no sm_89a: the plain target
    assert all("-arch=sm_89" in cmd for cmd in calls) and len(calls) == 2
    # Only a line of its own asks; a mention inside other text does not.
    assert jit.target_arch(f'// see "{jit.ARCH_SPECIFIC_MARKER}"\n', 90) == "sm_90"
    assert jit.target_arch(f"  {jit.ARCH_SPECIFIC_MARKER}  \r\n", 90) == "sm_90a"


def test_whole_program_sources_build_in_one_step_and_keep_setmaxnreg(tmp_path, monkeypatch):
    """The TMA kernel asks for a whole-program build: one ``nvcc --cubin`` step, no ``-dc``, no device link, so
    ptxas keeps its ``setmaxnreg`` (the producer warpgroup's 40 registers, the math warpgroups' 232); the same
    source through ``-dc`` gets C7504 ("setmaxnreg ignored")."""
    import subprocess
    source = ROOT / "device" / "moe" / "fused_experts_tma.cu"
    text = source.read_text()
    asking = {s for s in SOURCES if jit.whole_program(s.read_text())}
    assert asking == {source}
    calls = []
    real_run = jit._run
    monkeypatch.setattr(jit, "_run", lambda cmd, **kw: calls.append(list(cmd)) or real_run(cmd, **kw))
    cubin = jit.compile_cubin(text, name="tma", cc=90, cache_dir=tmp_path)
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    assert len(calls) == 1 and "--cubin" in calls[0] and "-dc" not in calls[0] and "-arch=sm_90a" in calls[0]
    # The same command again with ptxas's report (the jit's temporary directory is gone: a copy of the source).
    cu = tmp_path / "tma.cu"
    cu.write_text(text)
    cmd = calls[0][:-1]
    cmd[cmd.index("-o") + 1] = str(tmp_path / "tma.cubin")
    whole = subprocess.run(cmd + ["-Xptxas", "-v", str(cu)], capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    assert "C7504" not in whole.stderr and "setmaxnreg" not in whole.stderr, whole.stderr
    separate = [("-dc" if o == "--cubin" else o) for o in cmd]
    separate[separate.index("-o") + 1] = str(tmp_path / "tma.o")
    dc = subprocess.run(separate + ["-Xptxas", "-v", str(cu)], capture_output=True, text=True)
    assert dc.returncode == 0 and "C7504" in dc.stderr, dc.stderr  # what the marker avoids


def test_the_profiled_tma_build_exports_its_counters_and_the_default_build_has_none(tmp_path, compiled):
    """``SYMMRING_FUSED_PROFILE`` (device/moe/fused_profile.cuh, read by ``tools/fused_probe.py --profile``) adds
    the global the probe reads; without it the kernels carry no trace of the probe, and the probe's slot names
    (parsed from the header's enum) end where the header's array does."""
    import sys
    source = ROOT / "device" / "moe" / "fused_experts_tma.cu"
    profiled = jit.compile_cubin(source.read_text(), name="tma_profiled", cc=90, cache_dir=tmp_path,
                                 extra_options=("-DSYMMRING_FUSED_PROFILE",))
    assert b"symmring_fused_profile" in profiled.read_bytes()
    assert b"symmring_fused_profile" not in compiled[source].read_bytes()
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import fused_probe
    finally:
        sys.path.remove(str(ROOT / "tools"))
    slots = fused_probe.Profile(str(ROOT)).slots
    assert slots[0] == "kProducerCycles" and slots[-1] == "kLastEndNs" and len(slots) == len(set(slots)) == 20


def test_the_stamped_chain_build_exports_its_stamps_and_the_default_build_has_none(tmp_path, compiled):
    """``SYMMRING_CHAIN_STAMPS`` (device/symmring/chain_stamps.cuh, read by ``tools/chain_probe.py --stamps``, which
    defines it ahead of the three protocol modules' text) adds the global the probe reads; the default build
    carries no trace of it. Every stamp slot the sources write is named by the probe under its module, and the
    probe names no slot the sources do not write."""
    import re
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import chain_probe
    finally:
        sys.path.remove(str(ROOT / "tools"))
    read = chain_probe.stamped_source(jit.read_source)
    for module, filename in jit.LIBRARY_MODULES.items():
        text = read(filename)
        assert text.startswith("#define SYMMRING_CHAIN_STAMPS\n") == (module in chain_probe.STAMPS), module
        if module not in chain_probe.STAMPS:
            continue
        stamped = jit.compile_cubin(text, name=f"{module}_stamped", cc=90, cache_dir=tmp_path)
        assert b"symmring_chain_stamps" in stamped.read_bytes(), module
        assert b"symmring_chain_stamps" not in compiled[ROOT / "device" / filename].read_bytes(), module
    slot = re.compile(r"CHAIN_STAMP(?:_ANY)?\((\d+)\)")
    written = {m: {int(s) for s in slot.findall((ROOT / "device" / jit.LIBRARY_MODULES[m]).read_text())}
               for m in chain_probe.STAMPS}
    protocol = (ROOT / "device" / "symmring" / "protocol.cuh").read_text()  # grid_publish: the producer's
    written["moe_producer"] |= {int(s) for s in slot.findall(protocol)}
    assert written == {m: set(names) for m, names in chain_probe.STAMPS.items()}


def text_sizes(cubin: bytes) -> dict:
    """``{section name: bytes}`` of a cubin's ``.text.*`` sections (each kernel's or function's SASS): a 64-bit
    little-endian ELF's section headers."""
    import struct
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    strtab = headers[names][4]

    def name(offset):
        return cubin[strtab + offset:cubin.index(b"\0", strtab + offset)].decode()
    return {name(h[0]): h[5] for h in headers if name(h[0]).startswith(".text.")}


def test_the_small_fused_dispatch_has_about_half_the_code(compiled):
    """``moe_dispatch_fused_fp8_small`` (one load in flight per thread; decode sizes, `stages.small_dispatch`) is
    the same body as ``moe_dispatch_fused_fp8`` with the unrolled count and copy loops an eighth as long: at most
    60% of its code (69 KB against 132 KB with nvcc 13.0), which is what it saves a decode call."""
    sizes = text_sizes(compiled[ROOT / "device" / "moe" / "dispatch.cu"].read_bytes())
    wide, small = sizes[".text.moe_dispatch_fused_fp8"], sizes[".text.moe_dispatch_fused_fp8_small"]
    assert 0 < small <= 0.6 * wide, (small, wide)
