"""``megamoe_dg``: DeepGEMM's SM90 FP8 MegaMoE alone, built by tools/megamoe/build.sh from DeepGEMM's source
(deepseek-ai/DeepGEMM refs/pull/323/head 8ddf7f9) against the installed torch. Its own name, so it never
shadows the ``deep_gemm`` that symmring's DeepGEMM engine imports. ``include/`` holds the kernels' headers
(deep_gemm, cute, cutlass) that its JIT compiles with nvcc at run time (cache: ``DG_JIT_CACHE_DIR``)."""
import os
import shutil

import torch  # noqa: F401  (libtorch before _C)

from . import _C


def _cuda_home() -> str:
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(key):
            return os.environ[key]
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return "/usr/local/cuda"


_C.init(os.path.dirname(os.path.abspath(__file__)), _cuda_home())
__version__ = "deepseek-ai/DeepGEMM@8ddf7f9 (PR 323 head, SM90 FP8 MegaMoE)"
