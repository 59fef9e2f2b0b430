"""Environment variables symmring reads, in one place (all prefixed ``SYMMRING_``).

| variable | meaning | default |
|---|---|---|
| ``SYMMRING_BACKEND`` | ``auto``, ``host`` (CPU, MPI shared memory) or ``nvshmem`` (GPU) | ``auto`` |
| ``SYMMRING_TIMEOUT_S`` | bound of every protocol wait, in seconds | ``60`` |
| ``SYMMRING_CACHE_DIR`` | where compiled device code is cached | ``~/.cache/symmring`` |
| ``SYMMRING_DEBUG`` | ``1`` turns on debug logging and extra payload checks | ``0`` |
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

DEFAULT_TIMEOUT_S = 60.0


def timeout_s() -> float:
    """The bound of every protocol wait (``SYMMRING_TIMEOUT_S``), validated."""
    raw = os.environ.get("SYMMRING_TIMEOUT_S")
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"SYMMRING_TIMEOUT_S={raw!r}: expected a positive number of seconds") from None
    if not value > 0:
        raise ConfigError(f"SYMMRING_TIMEOUT_S={raw!r}: expected a positive number of seconds")
    return value


def backend_name() -> str:
    """The requested backend (``SYMMRING_BACKEND``): ``auto``, ``host`` or ``nvshmem``."""
    return os.environ.get("SYMMRING_BACKEND", "auto").strip().lower() or "auto"


def cache_dir() -> Path:
    """Directory of the device-code cache (``SYMMRING_CACHE_DIR``)."""
    raw = os.environ.get("SYMMRING_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "symmring"


def debug() -> bool:
    """Whether ``SYMMRING_DEBUG`` asks for debug logging and extra checks."""
    return os.environ.get("SYMMRING_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")
