"""``python -m symmring info``: versions, the backend ``auto`` would pick and why, devices, settings.

Nothing is initialised: GPU facts come from CuPy's runtime queries (or ``nvidia-smi -L`` when CuPy is
missing), and NVSHMEM is never started.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

#: Distributions whose versions are reported when installed: (label, distribution names to try).
_OPTIONAL_DISTRIBUTIONS = (
    ("torch", ("torch",)),
    ("transformers", ("transformers",)),
    ("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")),
    ("nvshmem4py", ("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py")),
    ("nvidia-nvshmem", ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")),
    ("mpich (wheel)", ("mpich",)),
)


def _distribution_version(names) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _module_version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"not importable ({type(exc).__name__}: {exc})"


def gpu_devices() -> Tuple[List[str], str]:
    """``(GPU names, how they were found or why there are none)``; never raises, initialises nothing
    beyond the CUDA runtime query."""
    from . import deps
    if deps.installed("cupy"):
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
            names = []
            for device_idx in range(count):
                name = cupy.cuda.runtime.getDeviceProperties(device_idx)["name"]
                names.append(name.decode() if isinstance(name, bytes) else str(name))
            return names, "CuPy"
        except Exception as exc:  # noqa: BLE001 - no driver, no device: reported
            return [], f"CuPy could not query devices: {exc}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
            return [line.strip() for line in out.splitlines() if line.strip()], "nvidia-smi (CuPy not installed)"
        except (OSError, subprocess.SubprocessError) as exc:
            return [], f"nvidia-smi failed: {exc}"
    return [], "no GPU found (CuPy not installed, no nvidia-smi)"


def auto_backend() -> Tuple[str, str]:
    """``(backend, reason)``: what ``symmring.init(backend="auto")`` would pick here, and why.

    Mirrors `symmring.context` (``SYMMRING_BACKEND``, then `symmring.backends.nvshmem.gpu_available`), adding the
    reason a GPU is not usable.

    Example:
        >>> auto_backend()[0] in ("host", "nvshmem")
        True
    """
    from . import env
    requested = env.backend_name()
    if requested != "auto":
        return requested, f"SYMMRING_BACKEND={requested}"
    from . import deps
    from .backends.nvshmem import GPU_MODULES, gpu_available
    missing = [m for m in GPU_MODULES if not deps.installed(m)]
    if missing:
        names = [deps.OPTIONAL[m][0] for m in missing]
        return "host", f"no usable GPU: {', '.join(names)} not installed (pip install \"symmring[gpu]\")"
    if gpu_available():
        return "nvshmem", "a CUDA GPU, CuPy and nvshmem4py are usable"
    return "host", "CuPy and nvshmem4py are installed but no CUDA device is visible"


def main(argv: Optional[List[str]] = None) -> int:
    """Print the report. Returns 0 (2 for bad arguments)."""
    parser = argparse.ArgumentParser(
        prog="python -m symmring info",
        description="Print versions, the backend 'auto' would pick and why, the GPUs, and the SYMMRING_*, "
                    "NVSHMEM_* and GPU environment settings. Initialises nothing (no NVSHMEM; GPU facts come "
                    "from CuPy or nvidia-smi). Under mpiexec or torchrun only rank 0 prints.")
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    import numpy
    from . import __version__, env
    user_env = dict(os.environ)  # before auto_backend, whose GPU probe applies env.GPU_ENV
    lines = [f"symmring: {__version__}",
             f"python: {sys.version.split()[0]} ({platform.python_implementation()}, {sys.executable})",
             f"platform: {platform.platform()}, {os.cpu_count()} CPUs",
             f"numpy: {numpy.__version__}",
             f"ml_dtypes: {_module_version('ml_dtypes')}"]
    from . import mpi, world
    rank = world.launcher_rank()  # under mpiexec or torchrun only rank 0 prints
    launcher, size = world.launcher_world()
    lines.append("launcher: " + {
        "mpi": f"an MPI launcher, {size} ranks (symmring.init joins MPI's COMM_WORLD)",
        "torchrun": f"torchrun, {size} ranks (symmring.init joins them over torchrun's store, or torch.distributed's "
                    "default group when the program initialised it)",
        None: "none (one process)"}[launcher])
    try:
        MPI = mpi.load()
        if launcher == "mpi":
            rank = MPI.COMM_WORLD.Get_rank()
        if mpi.is_standin(MPI):
            lines.append(f"mpi4py: {_module_version('mpi4py')}; MPI library: none ({mpi.unavailable_reason()}); "
                         f"one process only; for mpiexec and several ranks: {mpi.INSTALL_HINT}")
        else:
            # Open MPI's version string carries a trailing NUL byte.
            library = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
            lines.append(f"mpi4py: {_module_version('mpi4py')}; MPI library: {library}; world size "
                         f"{MPI.COMM_WORLD.Get_size()}")
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        lines.append(f"mpi4py: not usable ({type(exc).__name__}: {exc})")
    for label, names in _OPTIONAL_DISTRIBUTIONS:
        version = _distribution_version(names)
        if version is None and label in ("torch", "transformers"):  # what the torch module needs: name the extra
            from . import deps
            lines.append(f"{label}: {deps.hint(label).split(' is ', 1)[1]}")
        else:
            lines.append(f"{label}: {version or 'not installed'}")
    backend, reason = auto_backend()
    lines.append(f"backend (auto): {backend} -- {reason}")
    gpus, how = gpu_devices()
    if gpus:
        lines += [f"GPUs ({how}): {len(gpus)}"] + [f"  {i}: {name}" for i, name in enumerate(gpus)]
    else:
        lines.append(f"GPUs: none ({how})")
    settings = sorted((k, v) for k, v in user_env.items() if k.startswith(("SYMMRING_", "NVSHMEM_")))
    lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in settings) if settings
                                    else "no SYMMRING_*/NVSHMEM_* variables set (defaults in effect)"))
    lines.append("GPU environment (symmring.env.GPU_ENV): " + ", ".join(
        f"{k}={v}" + (" (yours)" if user_env.get(k) else "") for k, v in env.gpu_env(user_env).items()))
    if rank == 0:
        print("\n".join(lines), flush=True)
    return 0
