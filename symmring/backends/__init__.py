"""Backends: where the symmetric memory lives (``host``: MPI shared memory; ``nvshmem``: GPU heap)."""

from .base import CMP, Backend, SymmetricAllocation

__all__ = ["Backend", "SymmetricAllocation", "CMP"]
