"""Compile symmring's device code with nvcc, cache the result, and load it into CuPy with NVSHMEM.

Device code calls NVSHMEM device functions, so it is compiled as relocatable code and device-linked
against ``libnvshmem_device.a`` -- the two nvcc steps CuPy's ``RawModule(backend="nvcc",
options=("-dc", ...))`` runs, done here directly so that the cache key, the atomic write and the
compiler log are under our control (CuPy's own cache ignores headers reached through ``-I``)::

    nvcc -dc -std=c++17 -arch=sm_<cc> -I<device dir> -I<nvshmem include> -o x.o x.cu
    nvcc --cubin -arch=sm_<cc> --device-link x.o -L<nvshmem lib> -lnvshmem_device -o x.cubin

Target: ``sm_<cc>``, except for a source with the line ``// symmring-jit: sm_90a`` (`ARCH_SPECIFIC_MARKER`)
on a cc 9.0 device: it is compiled and linked for ``sm_90a``, the arch-specific target that ``wgmma`` (and
``setmaxnreg``) need (`target_arch`). Such a source guards those instructions with
``__CUDA_ARCH_FEAT_SM90_ALL``, so that it still builds for other devices (``sm_<cc>``). Everything else keeps
``sm_<cc>``: an ``sm_90a`` cubin runs only on cc 9.0.

The headers and library come from the ``nvidia-nvshmem`` wheel whose ``libnvshmem_host`` is loaded
(the host library checks the device library's version). The device sources are found as
``symmring/_device`` (a link to the repository's ``device/``, shipped in the wheel).

Cache: ``SYMMRING_CACHE_DIR`` (default ``~/.cache/symmring``), one ``<name>-<key>.cubin`` per module. The
key is a sha256 of the source, every file under the device directory, the nvcc version, the
nvidia-nvshmem version, the compute capability, the target and the options (no paths, so a cache built on a machine
without GPU with the same tools is valid on the GPU machine); the
source handed to nvcc starts with ``// symmring-device-hash: <sha>`` so a cubin is traceable to the
headers it was built from. Files are written to a temporary name and renamed, so concurrent ranks never
read a half-written cubin. With several ranks on a node, local rank 0 compiles first and the others load
its file after a barrier (`compile_on_node`).

This module only compiles: it needs no GPU, no CuPy and no NVSHMEM runtime. Loading a cubin and
registering it with NVSHMEM is the device backend's job (`symmring.backends.nvshmem.NvshmemBackend.load_module`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

from . import env
from .errors import BackendError, CompileError

logger = logging.getLogger(__name__)

#: Options of the compile step (before -arch/-I); kept in the cache key.
BASE_OPTIONS = ("-dc", "-std=c++17", "--expt-relaxed-constexpr")


def device_dir() -> Path:
    """Directory holding ``symmring/*.cuh`` and the ``.cu`` sources (``symmring/_device``)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_device", here.parent / "device"):
        if (candidate / "symmring" / "protocol.cuh").is_file():
            return candidate.resolve()
    raise BackendError(f"symmring device sources not found under {here / '_device'} "
                       "(expected symmring/protocol.cuh; is the package installed with its device files?)")


def nvshmem_paths() -> Tuple[Path, Path]:
    """``(include dir, lib dir)`` of the installed nvidia-nvshmem wheel.

    Raises:
        BackendError: the wheel (``pip install nvidia-nvshmem-cu13``) is not installed.
    """
    try:
        import nvidia.nvshmem as nvshmem_pkg  # the wheel nvshmem4py loads libnvshmem_host from
    except ImportError:
        raise BackendError("nvidia-nvshmem is not installed (pip install 'nvidia-nvshmem-cu13>=3.4.5,<3.5')") \
            from None
    for root in map(Path, nvshmem_pkg.__path__):
        if (root / "include" / "nvshmem.h").is_file() and (root / "lib" / "libnvshmem_device.a").is_file():
            return root / "include", root / "lib"
    raise BackendError(f"nvidia-nvshmem at {list(nvshmem_pkg.__path__)} has no include/nvshmem.h and "
                       "lib/libnvshmem_device.a")


@functools.lru_cache(maxsize=None)
def nvshmem_version() -> str:
    """Version of the nvidia-nvshmem wheel plus the size of its libnvshmem_device.a (cache key part)."""
    from importlib import metadata
    _, lib = nvshmem_paths()
    version = "unknown"
    for dist in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"):
        try:
            version = f"{dist}=={metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    return f"{version}:{(lib / 'libnvshmem_device.a').stat().st_size}"


def nvcc_path() -> str:
    """The nvcc to use: ``$CUDA_HOME/bin/nvcc`` when set, else the one on ``PATH``."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise BackendError("nvcc not found (set CUDA_HOME or put nvcc on PATH); symmring JIT-compiles its "
                           "device code with it")
    return found


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: Optional[str] = None) -> str:
    """The last line of ``nvcc --version`` (the build id), part of every cache key."""
    out = subprocess.run([nvcc or nvcc_path(), "--version"], capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else out.stderr.strip()


def device_hash() -> str:
    """sha256 over the relative path and the bytes of every file under `device_dir`."""
    root = device_dir()
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


#: The line by which a source asks for the arch-specific target ``sm_90a`` on a cc 9.0 device (`target_arch`).
ARCH_SPECIFIC_MARKER = "// symmring-jit: sm_90a"
_ARCH_SPECIFIC_LINE = re.compile(r"^[ \t]*" + re.escape(ARCH_SPECIFIC_MARKER) + r"[ \t\r]*$", re.MULTILINE)


def target_arch(source: str, cc: int) -> str:
    """The nvcc target of ``source`` on a device of compute capability ``cc``: ``sm_90a`` where the source
    carries `ARCH_SPECIFIC_MARKER` on a line of its own and ``cc`` is 90, else ``sm_<cc>``.

    Example:
        >>> target_arch("// symmring-jit: sm_90a\\n", 90), target_arch("// symmring-jit: sm_90a\\n", 100)
        ('sm_90a', 'sm_100')
        >>> target_arch('extern "C" __global__ void k() {}', 90)
        'sm_90'
    """
    return "sm_90a" if cc == 90 and _ARCH_SPECIFIC_LINE.search(source) else f"sm_{cc}"


#: The line by which a source that calls no NVSHMEM device function asks to be built as one program
#: (``nvcc --cubin``, no ``-dc`` and no device link): ptxas keeps ``setmaxnreg`` only in whole-program builds
#: (with ``-dc`` it reports C7504 "setmaxnreg ignored to maintain compatibility across compilation units").
WHOLE_PROGRAM_MARKER = "// symmring-jit: whole-program"
_WHOLE_PROGRAM_LINE = re.compile(r"^[ \t]*" + re.escape(WHOLE_PROGRAM_MARKER) + r"[ \t\r]*$", re.MULTILINE)


def whole_program(source: str) -> bool:
    """Whether ``source`` carries `WHOLE_PROGRAM_MARKER` on a line of its own.

    Example:
        >>> whole_program("// symmring-jit: whole-program\\n"), whole_program("// whole-program\\n")
        (True, False)
    """
    return bool(_WHOLE_PROGRAM_LINE.search(source))


def compile_options(cc: int, extra_options: Sequence[str] = (), arch: Optional[str] = None) -> Tuple[str, ...]:
    """Options of the ``-dc`` compile step for compute capability ``cc`` (e.g. 90), for target ``arch``
    (default ``sm_<cc>``; `target_arch` picks it per source)."""
    include, _ = nvshmem_paths()
    arch = arch or f"sm_{cc}"
    return BASE_OPTIONS + (f"-arch={arch}", f"-I{device_dir()}", f"-I{include}") + tuple(extra_options)


def _run(cmd: Sequence[str], *, source_name: str, options: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed (exit {proc.returncode}): {' '.join(cmd)}", source=source_name,
                           options=options, log=(proc.stdout + proc.stderr).strip())


def compile_cubin(source: str, *, name: str, cc: int, extra_options: Sequence[str] = (),
                  cache_dir: Optional[Path] = None) -> Path:
    """Compile and device-link ``source`` for ``sm_<cc>`` (``sm_90a`` for a source that asks, `target_arch`;
    in one step for a source that asks, `whole_program`); return the cached cubin's path.

    Args:
        source: CUDA source (kernels ``extern "C"``); may ``#include <symmring/protocol.cuh>``.
        name: a short name for logs, error messages and the cache file.
        cc: compute capability as an int (90 for H100/H200).
        extra_options: more nvcc options for the compile step (e.g. ``("-DNDEBUG",)``).
        cache_dir: overrides ``SYMMRING_CACHE_DIR``.

    Returns:
        Path of ``<cache_dir>/<name>-<key>.cubin``; compiled only when it is not there yet.

    Raises:
        CompileError: nvcc failed; carries the compiler log.
        BackendError: nvcc or the nvidia-nvshmem wheel is missing.

    Example:
        >>> path = compile_cubin('extern "C" __global__ void noop() {}', name="noop", cc=90)
        >>> path.suffix                       # symmring's own modules: (device_dir() / "ring.cu").read_text()
        '.cubin'
    """
    nvcc = nvcc_path()
    _, lib = nvshmem_paths()
    arch = target_arch(source, cc)
    options = compile_options(cc, extra_options, arch)
    link_options = (f"-arch={arch}", f"-L{lib}", "-lnvshmem_device")
    dev_hash = device_hash()
    # Paths stay out of the key (a cubin built on one machine is valid on another with the same tools).
    key = hashlib.sha256("\0".join((source, dev_hash, nvcc_version(nvcc), nvshmem_version(), str(cc), arch,
                                    *BASE_OPTIONS, *extra_options)).encode()).hexdigest()[:32]
    cache = Path(cache_dir) if cache_dir is not None else env.cache_dir()
    target = cache / f"{name}-{key}.cubin"
    if target.is_file() and target.stat().st_size > 0:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"symmring-{name}-", dir=cache) as tmp:
        cu, obj, cubin = Path(tmp) / f"{name}.cu", Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.cubin"
        cu.write_text(f"// symmring-device-hash: {dev_hash}\n{source}")
        logger.info("compiling %s for %s (cache %s)", name, arch, target)
        if whole_program(source):  # one step, no NVSHMEM device library (WHOLE_PROGRAM_MARKER says why)
            whole = tuple("--cubin" if o == "-dc" else o for o in options)
            _run([nvcc, *whole, "-o", str(cubin), str(cu)], source_name=name, options=whole)
        else:
            _run([nvcc, *options, "-o", str(obj), str(cu)], source_name=name, options=options)
            _run([nvcc, "--cubin", *link_options, "--device-link", str(obj), "-o", str(cubin)],
                 source_name=name, options=link_options)
        os.replace(cubin, target)  # atomic: a concurrent reader sees no file or the whole file
    return target


#: An ``extern "C"`` kernel's definition (or declaration) and its name, with or without ``__launch_bounds__``.
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


def kernel_names(source: str) -> list:
    """The names of the ``extern "C"`` kernels ``source`` defines, in order (each once).

    Example:
        >>> kernel_names('extern "C" __global__ void __launch_bounds__(256, 1) k2(int a) {}')
        ['k2']
    """
    return list(dict.fromkeys(_KERNEL.findall(source)))


def read_source(filename: str) -> str:
    """Text of ``<device dir>/<filename>`` (e.g. ``"ring.cu"``, ``"moe/dispatch.cu"``)."""
    return (device_dir() / filename).read_text()


#: Bound, in seconds, of the wait of `compile_on_node` for local rank 0's compile (a cold cache compiles a
#: module in 10-60 s; the protocol bound ``SYMMRING_TIMEOUT_S`` may be a few seconds). The larger of the two
#: applies.
COMPILE_WAIT_S = 600.0


def compile_on_node(source: str, *, name: str, cc: int, local_rank: int = 0,
                    extra_options: Sequence[str] = (), collectives=None) -> Path:
    """`compile_cubin` once per node: local rank 0 compiles, the others wait at a bounded verdict and then
    find the cubin in the cache (a cache hit). Returns the cubin's path.

    Args:
        source, name, cc, extra_options: as for `compile_cubin`.
        local_rank: this process's place among the ranks of its node (`symmring.world.local_rank`).
        collectives: the context's bounded collectives (`symmring.collective.Collectives`, every rank of the
            job calls this at the same point): the wait is their verdict, within the larger of their bound and
            `COMPILE_WAIT_S` (a rank that never comes is named in a `PeerTimeout`). Without them (a process
            alone) this process compiles (the cache's atomic writes make concurrent compiles safe).

    Raises:
        CompileError, BackendError: as for `compile_cubin` (on every local rank when rank 0 failed).
        PeerTimeout: with ``collectives``, a rank did not reach the verdict within the bound.
    """
    if collectives is not None and collectives.world_size > 1:  # every rank of the job takes part
        error = None
        if local_rank == 0:
            try:
                compile_cubin(source, name=name, cc=cc, extra_options=extra_options)
            except Exception as exc:  # the others must still leave the verdict
                error = exc
        failed = not collectives.agree(error is None, what=f"jit: {name} compiled on local rank 0",
                                       timeout_s=max(collectives.timeout_s, COMPILE_WAIT_S))
        if error is not None:
            raise error
        if failed:
            raise CompileError(f"{name}: compilation failed on local rank 0 (see its log)", source=name)
    return compile_cubin(source, name=name, cc=cc, extra_options=extra_options)


#: The library's device modules: module name -> source under the device directory. ``ring`` holds the
#: ready-made ring kernels and the backend's host primitives; ``moe_*`` the MoE layer's kernels by role.
LIBRARY_MODULES = {
    "ring": "ring.cu",
    "moe_producer": "moe/producer.cu",
    "moe_dispatch": "moe/dispatch.cu",
    "moe_combine": "moe/combine.cu",
    "moe_schedule": "moe/schedule.cu",
}


#: Device modules an engine loads itself (plain CuPy modules: their kernels call no NVSHMEM): module name ->
#: source. ``python -m symmring.jit`` builds them too, so that the engine's first call is a cache hit.
ENGINE_MODULES = {
    "moe_fused_experts": "moe/fused_experts.cu",
    "moe_fused_experts_wgmma": "moe/fused_experts_wgmma.cu",
    "moe_fused_experts_tma": "moe/fused_experts_tma.cu",
}


def precompile(sources: Sequence[Tuple[Path, str]], cc: int, workers: int = 4) -> list:
    """Compile ``(path, module name)`` pairs into the cache in parallel (then loading them is a cache hit);
    returns one line per module. Raises CompileError for the first that fails."""
    import concurrent.futures as cf
    import time

    def build(item):
        path, name = item
        start = time.monotonic()
        cubin = compile_cubin(Path(path).read_text(), name=name, cc=cc)
        return f"{path}: {cubin} ({cubin.stat().st_size} bytes, {time.monotonic() - start:.1f} s)"

    with cf.ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(build, sources))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m symmring.jit [--cc 90] [PATH=NAME ...]``: fill the device-code cache ahead of a job."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m symmring.jit", description=main.__doc__)
    parser.add_argument("--cc", type=int, default=90, help="compute capability (default 90: H100/H200)")
    parser.add_argument("--workers", type=int, default=4, help="parallel nvcc jobs (default 4)")
    parser.add_argument("modules", nargs="*", metavar="PATH=NAME",
                        help="more sources and their module names (e.g. tests/gpu/user_kernels.cu=user_kernels); "
                             "the library's own modules and the engines' are always built")
    args = parser.parse_args(argv)
    sources = [(device_dir() / f, name) for name, f in {**LIBRARY_MODULES, **ENGINE_MODULES}.items()]
    for item in args.modules:
        path, sep, name = item.partition("=")
        if not sep or not path or not name:
            parser.error(f"{item!r}: expected PATH=NAME")
        sources.append((Path(path), name))
    try:
        for line in precompile(sources, args.cc, args.workers):
            print(line)
    except (CompileError, BackendError) as exc:
        print(f"python -m symmring.jit: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
