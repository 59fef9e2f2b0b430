"""Environment variables symmring reads, in one place (all prefixed ``SYMMRING_``).

| variable | meaning | default |
|---|---|---|
| ``SYMMRING_BACKEND`` | ``auto``, ``host`` (CPU, MPI shared memory) or ``nvshmem`` (GPU) | ``auto`` |
| ``SYMMRING_TIMEOUT_S`` | bound of every protocol wait (host and device), in seconds | ``60`` |
| ``SYMMRING_HOST_TIMEOUT_S`` | bound of every host collective between ranks (`symmring.collective`: setup, allocation, the layers' per-call exchanges, teardown), in seconds: how late a rank may come to an exchange (a first call's compile, loading weights, a long prefill) before every rank raises `PeerTimeout` | ``1800`` |
| ``SYMMRING_CACHE_DIR`` | where compiled device code is cached | ``~/.cache/symmring`` |
| ``SYMMRING_DEBUG`` | ``1``: debug logging, and extra checks after every layer call: on the GPU the device's error records (``MoE.check_errors``); on the CPU layer the ring's generations and acknowledgements, the combine signals, and finite outputs (`symmring.moe.cpu.layer`) | ``0`` |
| ``SYMMRING_FUSED_KERNEL`` | the ``"fused"`` expert engine's kernel when its ``kernel=`` is not given: ``auto`` (``wg64t`` on cc 9.0; elsewhere ``m16`` or ``m32`` by rows per expert), ``m16``, ``m32`` (mma.sync), ``wg64t`` (wgmma fed by TMA loads of a producer warpgroup, cc 9.0 only), ``wg128t`` (the same with 128-row items) or ``wg64`` (wgmma, cp.async loads in the math warps; both cc 9.0 only, never picked by ``auto``) (`symmring.moe.engines.fused.select_kernel`) | ``auto`` |
| ``SYMMRING_FUSED_BESIDE`` | ``1``: the ``"fused"`` engine's TMA kernels start beside the small-batch schedule's fused dispatch instead of after it (programmatic dependent launch; `symmring.moe.engines.fused.FusedExperts.begin_beside_dispatch`; measured no faster on an H100, docs/FUSED.md) | ``0`` |
| ``SYMMRING_GRAPH_CACHE`` | entries of the GPU layer's cache of captured calls (`symmring.moe.gpu.graph_cache`): an int >= 0 that overrides every layer's ``graph_cache`` argument; ``0`` switches eager calls' graph replays off | unset (the argument: ``12``) |
| ``SYMMRING_LOG_LEVEL`` | level of symmring's log lines on stderr: ``DEBUG``, ``INFO`` (backend choice, layer set-up, compiles), ``WARNING``, ``ERROR`` (`configure_logging`; ``-v`` on the CLI is ``INFO``) | ``WARNING`` (``DEBUG`` with ``SYMMRING_DEBUG=1``) |
| ``SYMMRING_PDL`` | ``0``: launch the GPU layer's small-batch kernels without programmatic dependent launch (`symmring.pdl`; used only with one PE per GPU, compute capability >= 9) | ``1`` |
| ``SYMMRING_TRANSPORT`` | how GPU rings and MoE layers reach each peer without ``transport=``: ``auto``, ``p2p``, ``rdma``, ``rdma:<ranks>`` (`symmring.transport`, which reads it) | ``auto`` |
| ``SYMMRING_VLLM`` | ``1``: vLLM's MoE layers run symmring (the ``vllm.general_plugins`` entry point `symmring.integrations.vllm.plugin`; a no-op otherwise) | ``0`` |

GPU jobs also run with the settings of `GPU_ENV` (NVSHMEM, CUDA, NCCL, torch), each set unless the user
set it to a non-empty value: by the nvshmem backend (`apply_gpu_env`, before the first CUDA call), by the
launcher (``python -m symmring.launch``, also as ``launch/symmring-mpirun``) for every rank, and by the GPU
scripts under ``tools/`` (``python -m symmring.launch --print-env`` prints them as ``export`` lines).
The settings marked "one node only" (`EnvDefault.one_node_only`) apply only to a job known to run on one
node: the nvshmem backend counts the job's nodes (every rank's host name) before NVSHMEM starts, and
``python -m symmring.launch`` knows them from its host list; across nodes NVSHMEM picks its own remote
transport.

| variable | value | why |
|---|---|---|
| ``NVSHMEM_DISABLE_NVLS`` | ``1`` | NVLink multicast stays off (see `GPU_ENV`) |
| ``NVSHMEM_REMOTE_TRANSPORT`` | ``none`` (one node only) | one node: no network transport to initialise; a job on several nodes leaves it to NVSHMEM |
| ``CUDA_MODULE_LOADING`` | ``EAGER`` | lazy loading can deadlock kernels that spin on each other |
| ``NCCL_NVLS_ENABLE`` | ``0`` | NVLink multicast off in NCCL too |
| ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` | ``1`` | and in torch's symmetric memory |
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Dict, Iterable, List, MutableMapping, NamedTuple, Optional

from .errors import ConfigError

DEFAULT_TIMEOUT_S = 60.0
#: The host collectives' default bound: vLLM's for DeepEP's host waits (``VLLM_DEEPEP_TIMEOUT_SECS``), for the
#: same reason -- ranks reach a layer's first exchange after loading weights and compiling at their own pace
#: (symmring's device modules, a cold cache: 10-60 s each; the Triton experts' first call; minutes of weight
#: loading on a large model). A rank that died is the launcher's to report (torchrun stops the job when a
#: worker fails; mpiexec when a rank exits without finalizing); this bound only names a rank that is alive
#: but never comes.
DEFAULT_HOST_TIMEOUT_S = 1800.0


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a positive number of seconds") from None
    if not value > 0:
        raise ConfigError(f"{name}={raw!r}: expected a positive number of seconds")
    return value


def timeout_s() -> float:
    """The bound of every protocol wait (``SYMMRING_TIMEOUT_S``), validated."""
    return _seconds("SYMMRING_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def host_timeout_s() -> float:
    """The bound of every host collective (``SYMMRING_HOST_TIMEOUT_S``), validated."""
    return _seconds("SYMMRING_HOST_TIMEOUT_S", DEFAULT_HOST_TIMEOUT_S)


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


def vllm_enabled() -> bool:
    """Whether ``SYMMRING_VLLM`` asks vLLM's MoE layers to run symmring (`symmring.integrations.vllm.plugin`)."""
    return os.environ.get("SYMMRING_VLLM", "0").strip().lower() not in ("", "0", "false", "no")


def fused_kernel() -> str:
    """``SYMMRING_FUSED_KERNEL`` lower-cased, ``"auto"`` when unset or empty (the engine checks the value)."""
    return os.environ.get("SYMMRING_FUSED_KERNEL", "").strip().lower() or "auto"


def fused_beside() -> bool:
    """Whether ``SYMMRING_FUSED_BESIDE`` asks the fused engine's TMA kernels to start beside the fused dispatch
    (``1``; default ``0``)."""
    return os.environ.get("SYMMRING_FUSED_BESIDE", "0").strip() == "1"


def graph_cache() -> Optional[int]:
    """``SYMMRING_GRAPH_CACHE`` as an int >= 0, or None when unset (empty).

    Raises:
        ConfigError: a value that is not a non-negative integer.
    """
    raw = os.environ.get("SYMMRING_GRAPH_CACHE", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"SYMMRING_GRAPH_CACHE={raw!r}: expected an integer >= 0 (cached graphs per layer; "
                          "0 switches the cache off)")
    return int(raw)


#: Names ``SYMMRING_LOG_LEVEL`` accepts (a number works too).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> Optional[int]:
    """The level ``SYMMRING_LOG_LEVEL`` asks for (``DEBUG`` when only ``SYMMRING_DEBUG`` is on), or None.

    Raises:
        ConfigError: a value that is neither one of `LOG_LEVELS` nor a number.
    """
    raw = os.environ.get("SYMMRING_LOG_LEVEL", "").strip()
    if raw:
        if raw.isdigit():
            return int(raw)
        if raw.upper() in LOG_LEVELS:
            return logging.getLevelName(raw.upper())
        raise ConfigError(f"SYMMRING_LOG_LEVEL={raw!r}: expected one of {', '.join(LOG_LEVELS)} or a number")
    return logging.DEBUG if debug() else None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record arrives (like logging's last-resort handler)."""

    symmring_handler = True

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def configure_logging(verbosity: int = 0) -> int:
    """Show symmring's log lines on stderr at the level asked for: the lower (more verbose) of
    ``SYMMRING_LOG_LEVEL`` (`log_level`) and ``verbosity`` (1: INFO, 2 or more: DEBUG; the CLI's ``-v``).

    When neither asks for anything, nothing changes (symmring stays quiet: WARNING and above, Python's
    default). Otherwise the ``symmring`` logger gets that level and, unless the application configured
    logging itself (the root logger has handlers), one stderr handler (``[rank R] LEVEL name: message``
    under an MPI launcher). Called by the CLI and by `symmring.init`; calling it again only updates the
    level. Returns the effective level.

    Raises:
        ConfigError: a bad ``SYMMRING_LOG_LEVEL``.
    """
    logger = logging.getLogger("symmring")
    asked = [level for level in (log_level(), logging.INFO if verbosity == 1 else
                                 logging.DEBUG if verbosity >= 2 else None) if level is not None]
    if not asked:
        return logger.getEffectiveLevel()
    logger.setLevel(min(asked))
    if not logging.getLogger().handlers and not any(getattr(h, "symmring_handler", False) for h in logger.handlers):
        from .mpi import LAUNCHER_SIZE_VARS, launcher_rank
        launched = any(os.environ.get(name) for name in LAUNCHER_SIZE_VARS)
        handler = _StderrHandler()
        prefix = f"[rank {launcher_rank()}] " if launched else ""
        handler.setFormatter(logging.Formatter(prefix + "%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    return logger.getEffectiveLevel()


class EnvDefault(NamedTuple):
    """One setting of the GPU environment policy; ``one_node_only``: set only for a job on one node."""

    name: str
    value: str
    reason: str
    one_node_only: bool = False


#: The GPU environment policy: what every GPU process of symmring runs with unless the user set the
#: variable (to a non-empty value). The one table the backend, the launcher and tools/ read.
GPU_ENV = (
    EnvDefault("NVSHMEM_DISABLE_NVLS", "1",
               "symmring never uses NVLink multicast (NVLS), and multicast objects can take a shared host's "
               "GPUs out of service"),
    EnvDefault("NVSHMEM_REMOTE_TRANSPORT", "none",
               "a job on one node needs no network (IB/UCX) transport to look for or initialise; on several "
               "nodes NVSHMEM picks its own (ibrc unless built for UCX; IBGDA with NVSHMEM_IB_ENABLE_IBGDA=1)",
               one_node_only=True),
    EnvDefault("CUDA_MODULE_LOADING", "EAGER",
               "with lazy loading a kernel's first launch may wait for running kernels, and symmring's "
               "kernels spin on each other across streams and PEs (a deadlock)"),
    EnvDefault("NCCL_NVLS_ENABLE", "0",
               "NVLink multicast off in NCCL too (torch.distributed in the same job)"),
    EnvDefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1",
               "NVLink multicast off in torch's symmetric memory too"),
)


def _applies(default: EnvDefault, num_nodes: Optional[int]) -> bool:
    """Whether ``default`` belongs to a job on ``num_nodes`` nodes (None: not known yet)."""
    return not default.one_node_only or num_nodes == 1


def gpu_env_defaults(num_nodes: Optional[int] = 1) -> Dict[str, str]:
    """`GPU_ENV` as ``{name: value}``, for a job on ``num_nodes`` nodes (None: not known; the settings that
    are for one node only are left out).

    Example:
        >>> gpu_env_defaults()["NVSHMEM_DISABLE_NVLS"]
        '1'
        >>> "NVSHMEM_REMOTE_TRANSPORT" in gpu_env_defaults(1), "NVSHMEM_REMOTE_TRANSPORT" in gpu_env_defaults(2)
        (True, False)
    """
    return {d.name: d.value for d in GPU_ENV if _applies(d, num_nodes)}


def gpu_env(environ: Optional[MutableMapping[str, str]] = None, num_nodes: Optional[int] = 1) -> Dict[str, str]:
    """The values of `GPU_ENV` in effect for a job on ``num_nodes`` nodes: the user's where set (non-empty),
    the default otherwise; a one-node setting the user left unset is absent when ``num_nodes`` is not 1.

    Example:
        >>> gpu_env({"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"], gpu_env({})["NCCL_NVLS_ENABLE"]
        ('1', '0')
        >>> gpu_env({}, 2).get("NVSHMEM_REMOTE_TRANSPORT"), gpu_env({"NVSHMEM_REMOTE_TRANSPORT": "ucx"}, 2)
        (None, {..., 'NVSHMEM_REMOTE_TRANSPORT': 'ucx', ...})
    """
    environ = os.environ if environ is None else environ
    return {d.name: environ.get(d.name) or d.value for d in GPU_ENV
            if environ.get(d.name) or _applies(d, num_nodes)}


def apply_gpu_env(environ: Optional[MutableMapping[str, str]] = None,
                  names: Optional[Iterable[str]] = None, num_nodes: Optional[int] = 1) -> Dict[str, str]:
    """Set each variable of `GPU_ENV` (or of ``names``) in ``environ`` (``os.environ``) unless it holds a
    non-empty value; the settings for one node only just when ``num_nodes`` is 1 (None: not known yet, as
    before the backend has counted the job's nodes). Returns what was set.

    Example:
        >>> environ = {"NVSHMEM_DISABLE_NVLS": "0"}
        >>> sorted(apply_gpu_env(environ)) == sorted(set(gpu_env_defaults()) - {"NVSHMEM_DISABLE_NVLS"})
        True
        >>> environ["NVSHMEM_DISABLE_NVLS"], environ["CUDA_MODULE_LOADING"]   # the user's value is kept
        ('0', 'EAGER')
        >>> "NVSHMEM_REMOTE_TRANSPORT" in apply_gpu_env({}, num_nodes=2)
        False
    """
    environ = os.environ if environ is None else environ
    wanted = None if names is None else set(names)
    applied = {}
    for default in GPU_ENV:
        if (wanted is None or default.name in wanted) and not environ.get(default.name) and \
                _applies(default, num_nodes):
            environ[default.name] = applied[default.name] = default.value
    return applied


def remote_transport_note(num_nodes: Optional[int], environ: Optional[MutableMapping[str, str]] = None) -> str:
    """One line saying which NVSHMEM remote transport a job on ``num_nodes`` nodes gets, and why (logged by
    the launcher and the backend).

    Example:
        >>> remote_transport_note(1, {"NVSHMEM_REMOTE_TRANSPORT": "none"})
        'one node: NVSHMEM_REMOTE_TRANSPORT=none (no network transport)'
        >>> print(remote_transport_note(2, {"NVSHMEM_IB_ENABLE_IBGDA": "1"}))
        2 nodes: NVSHMEM_REMOTE_TRANSPORT left to NVSHMEM (its default: ibrc, the CPU proxy), NVSHMEM_IB_ENABLE_IBGDA=1
    """
    environ = os.environ if environ is None else environ
    transport = environ.get("NVSHMEM_REMOTE_TRANSPORT")
    where = "one node" if num_nodes == 1 else "nodes not known yet" if num_nodes is None else f"{num_nodes} nodes"
    if num_nodes == 1 and transport == "none":
        return f"{where}: NVSHMEM_REMOTE_TRANSPORT=none (no network transport)"
    chosen = f"NVSHMEM_REMOTE_TRANSPORT={transport} (yours)" if transport else \
        "NVSHMEM_REMOTE_TRANSPORT left to NVSHMEM (its default: ibrc, the CPU proxy)" if num_nodes is not None else \
        "NVSHMEM_REMOTE_TRANSPORT left to the backend, which counts the nodes (none on one, else NVSHMEM's ibrc)"
    ibgda = environ.get("NVSHMEM_IB_ENABLE_IBGDA")
    chosen += f", NVSHMEM_IB_ENABLE_IBGDA={ibgda}" if ibgda else ", NVSHMEM_IB_ENABLE_IBGDA unset (IBGDA off)"
    if transport == "none" and num_nodes != 1:
        chosen += ("; peers on other nodes are then reachable only if nvshmem_ptr maps them (a multi-node "
                   "NVLink domain), otherwise NVSHMEM cannot reach them")
    return f"{where}: {chosen}"


def shell_exports(environ: Optional[MutableMapping[str, str]] = None, num_nodes: Optional[int] = 1) -> List[str]:
    """``export NAME=VALUE`` lines (bash) of the `GPU_ENV` values in effect (`gpu_env`) for a job on
    ``num_nodes`` nodes.

    Example:
        >>> shell_exports({})[0]
        'export NVSHMEM_DISABLE_NVLS=1'
    """
    return [f"export {name}={shlex.quote(value)}" for name, value in gpu_env(environ, num_nodes).items()]
