"""Optional dependencies: whether each is installed, and which extra of ``pip install symmring[...]``
brings it, so a missing one is reported in one line instead of a traceback.

| module | distribution | extra |
|---|---|---|
| ``cupy`` | ``cupy-cuda13x`` | ``gpu`` |
| ``nvshmem`` | ``nvshmem4py-cu13`` | ``gpu`` |
| ``nvidia.nvshmem`` | ``nvidia-nvshmem-cu13`` | ``gpu`` or ``device`` |
| ``torch`` | ``torch`` | ``gpu`` (CUDA build) or ``cpu`` (CPU build) |
| ``transformers`` | ``transformers`` | ``hf`` |
| ``matplotlib`` | ``matplotlib`` | ``bench`` |
| ``triton`` | ``triton`` (comes with torch's Linux CUDA wheels) | ``gpu`` |
| ``deep_gemm`` | ``tokenspeed-deepgemm`` | ``deepgemm`` |
| ``pytest`` | ``pytest`` | ``test`` |
| ``mpi4py`` | ``mpi4py`` (and ``mpich``: an MPI library and ``mpiexec``) | ``mpi`` |

MPI (for jobs started by ``mpiexec``) comes with the ``mpi`` extra; see `symmring.mpi`. Jobs started by
``torchrun`` need none (`symmring.world`).

Example:
    >>> installed("numpy"), installed("nvidia.no_such_module")
    (True, False)
    >>> hint("transformers")
    'transformers is not installed (pip install "symmring[hf]")'
    >>> hint("torch")
    'torch is not installed (pip install "symmring[gpu]" on a GPU machine, "symmring[cpu]" elsewhere)'
"""

from __future__ import annotations

import importlib.util
from typing import Dict, Optional, Tuple

#: module -> (distribution, extra that installs it; ``"gpu|cpu"``: either, by the machine).
OPTIONAL: Dict[str, Tuple[str, str]] = {
    "cupy": ("cupy-cuda13x", "gpu"),
    "nvshmem": ("nvshmem4py-cu13", "gpu"),
    "nvidia.nvshmem": ("nvidia-nvshmem-cu13", "device"),
    "nvidia": ("nvidia-nvshmem-cu13", "device"),
    "torch": ("torch", "gpu|cpu"),
    "transformers": ("transformers", "hf"),
    "matplotlib": ("matplotlib", "bench"),
    "triton": ("triton", "gpu"),
    "deep_gemm": ("tokenspeed-deepgemm", "deepgemm"),
    "pytest": ("pytest", "test"),
    "mpi4py": ("mpi4py", "mpi"),
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it. Never raises (``find_spec`` of
    ``a.b`` raises ModuleNotFoundError when the parent package ``a`` is absent: the ``nvidia`` namespace
    exists only once an ``nvidia-*`` wheel is installed)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def extra_of(module: str) -> Optional[str]:
    """The extra that brings ``module`` (its top-level package is looked up too), or None."""
    for name in (module, module.split(".")[0]):
        if name in OPTIONAL:
            return OPTIONAL[name][1]
    return None


def hint(module: str) -> str:
    """One line: ``module`` is missing and which ``pip install`` brings it."""
    extra = extra_of(module)
    distribution = OPTIONAL.get(module, OPTIONAL.get(module.split(".")[0], (module, None)))[0]
    if extra is None:
        return f"{module} is not installed"
    if extra == "gpu|cpu":
        return f'{distribution} is not installed (pip install "symmring[gpu]" on a GPU machine, "symmring[cpu]" elsewhere)'
    return f'{distribution} is not installed (pip install "symmring[{extra}]")'


__all__ = ["OPTIONAL", "installed", "extra_of", "hint"]
