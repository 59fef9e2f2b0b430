"""Fixtures of the GPU tests (tests/gpu).

Collected everywhere; every test here is skipped, with the reason, where `symmring.backends.nvshmem.gpu_available()`
is False (no CUDA GPU, CuPy, nvshmem4py or nvidia-nvshmem). On a GPU machine run them with one PE::

    python -m pytest tests/gpu -q

and with several PEs (one GPU shared under CUDA MPS, or one GPU each)::

    python -m symmring.launch -n 2 --mps -- python -m mpi4py -m pytest tests/gpu -q

Every rank runs every test in the same order (they are collective) and reaches the same verdict
(`gpu_helpers.collective`: one allgather of every rank's outcome per test). ``tools/gpu_check.sh`` runs all of it on the GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _skip_reason():
    try:
        from symmring.backends.nvshmem import gpu_available
    except Exception as exc:  # pragma: no cover - symmring itself is importable in CI
        return f"symmring.backends.nvshmem is not importable: {exc}"
    if not gpu_available():
        return ("needs a CUDA GPU, CuPy, nvshmem4py and nvidia-nvshmem "
                "(symmring.backends.nvshmem.gpu_available() is False)")
    return None


@pytest.fixture(scope="session")
def nvshmem_ctx():
    """One symmring context on the nvshmem backend for the whole session: NVSHMEM initialises once per
    process, so every GPU test file (ring kernels and MoE alike) shares it; closed at the end."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from symmring.context import init
    ctx = init("nvshmem")
    yield ctx
    ctx.close()


@pytest.fixture(scope="session")
def backend(nvshmem_ctx):
    """The session's NvshmemBackend."""
    return nvshmem_ctx.backend


@pytest.fixture(scope="session")
def user_module(backend):
    """tests/gpu/user_kernels.cu: kernels that publish and consume through <symmring/protocol.cuh> only."""
    source = Path(__file__).with_name("user_kernels.cu").read_text()
    return backend.load_module(source, name="user_kernels")


@pytest.fixture
def seed(request):
    """A seed per test, the same on every rank."""
    import zlib
    return zlib.crc32(request.node.nodeid.encode()) ^ 20261129


@pytest.fixture(scope="module")
def ctx(nvshmem_ctx):
    """The session's NVSHMEM context under the name the layer tests use."""
    return nvshmem_ctx
