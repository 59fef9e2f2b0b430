"""How this PE reaches each peer's symmetric memory: ``p2p`` or ``rdma``, chosen once per ring or layer.

* ``p2p``: loads and stores through the peer's ``nvshmem_ptr`` mapping (NVLink/PCIe P2P on one node).
* ``rdma``: NVSHMEM one-sided operations (gets of slot payloads into a local staging area, puts of combine
  rows, remote atomics for every protocol word), for peers ``nvshmem_ptr`` cannot map (another node). The
  device decides it per peer from the descriptor's ``rdma_mask`` (``device/symmring/protocol.cuh``
  ``is_rdma_peer``); docs/PROTOCOL.md states which NVSHMEM call orders what on that path.

The request (the ``transport=`` argument of `symmring.kernels.DeviceRing`, `symmring.ring.Ring` and
`symmring.moe.gpu.MoE`, else ``SYMMRING_TRANSPORT``) is one of:

* ``"auto"`` (default): p2p where the mapping exists, rdma for every other peer;
* ``"p2p"``: p2p for every peer; a peer without a mapping is an error naming it;
* ``"rdma"``: rdma for every peer but this PE (on one node: to exercise the remote path);
* ``"rdma:1,3"``: rdma for the listed peer ranks, p2p (or rdma where unmapped, as ``auto``) for the others.

`parse` validates a request (no GPU needed); `resolve` turns it into one transport per rank.

Example:
    >>> parse("rdma:3,1")
    ('rdma', (1, 3))
    >>> resolve("rdma:1", rank=0, world_size=3, mapped=[True, True, True])
    ['self', 'rdma', 'p2p']
    >>> resolve("auto", rank=1, world_size=2, mapped=[False, True])
    ['rdma', 'self']
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .errors import BackendError, ConfigError

logger = logging.getLogger(__name__)

#: The environment variable read when no ``transport=`` is given.
ENV_VAR = "SYMMRING_TRANSPORT"
#: Modes of a request (``"rdma:<ranks>"`` is the ``"rdma"`` mode with a rank list).
MODES = ("auto", "p2p", "rdma")
#: Per-peer transports `resolve` returns (``"self"`` for this PE's own entry).
P2P, RDMA, SELF = "p2p", "rdma", "self"


def parse(value, *, name: str = "transport") -> Tuple[str, Optional[Tuple[int, ...]]]:
    """``(mode, ranks)`` of a transport request: ``ranks`` is None except for ``"rdma:<ranks>"``.

    Raises:
        ConfigError: naming ``name`` and the value, for anything but the forms of the module docstring.
    """
    expected = "expected 'auto', 'p2p', 'rdma' or 'rdma:<comma-separated peer ranks>'"
    if not isinstance(value, str):
        raise ConfigError(f"{name}={value!r}: {expected}")
    text = value.strip().lower()
    if text in MODES:
        return text, None
    head, sep, tail = text.partition(":")
    if head != "rdma" or not sep:
        raise ConfigError(f"{name}={value!r}: {expected}")
    ranks = []
    for item in tail.split(","):
        item = item.strip()
        if not item.isdigit():
            raise ConfigError(f"{name}={value!r}: {item!r} is not a peer rank; {expected}")
        ranks.append(int(item))
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"{name}={value!r}: a peer rank is listed twice")
    return "rdma", tuple(sorted(ranks))


def _check_ranks(name: str, value, ranks: Optional[Tuple[int, ...]], world_size: int) -> None:
    outside = [q for q in ranks or () if q >= world_size]
    if outside:
        raise ConfigError(f"{name}={value!r}: peer ranks {outside} outside [0, world_size={world_size})")


def request(transport=None, world_size: Optional[int] = None) -> Tuple[str, str]:
    """``(request, where it came from)``: ``transport`` when given, else ``SYMMRING_TRANSPORT``, else
    ``"auto"``; validated (`parse`; with ``world_size``, listed ranks outside ``[0, world_size)`` too), so
    a constructor can reject it before any collective work.

    Raises:
        ConfigError: naming ``transport`` or ``SYMMRING_TRANSPORT`` and the value.
    """
    if transport is not None:
        value, source, name = transport, "transport=", "transport"
    else:
        raw = os.environ.get(ENV_VAR, "").strip()
        if not raw:
            return "auto", "default"
        value, source, name = raw, ENV_VAR, ENV_VAR
    _, ranks = parse(value, name=name)
    if world_size is not None:
        _check_ranks(name, value, ranks, world_size)
    return value, source


def resolve(value, *, rank: int, world_size: int, mapped: Sequence[bool], name: str = "transport") -> List[str]:
    """One transport per rank (``"self"``, ``"p2p"`` or ``"rdma"``) for PE ``rank`` of ``world_size``,
    given which peers ``nvshmem_ptr`` maps (``mapped[q]``; this PE's entry is ignored).

    Raises:
        ConfigError: a bad request, or a listed rank outside ``[0, world_size)``.
        BackendError: ``"p2p"`` requested and a peer has no mapping (the peer is named).
    """
    mode, ranks = parse(value, name=name)
    if len(mapped) != world_size:
        raise ConfigError(f"mapped={list(mapped)!r}: expected {world_size} entries, one per rank")
    _check_ranks(name, value, ranks, world_size)
    out = []
    for q in range(world_size):
        if q == rank:
            out.append(SELF)
        elif not mapped[q]:
            if mode == P2P:
                raise BackendError(f"{name}={value!r}: rank {q}'s symmetric memory is not load/store reachable "
                                   f"from rank {rank} (nvshmem_ptr returned null); use transport='auto' or "
                                   "'rdma' to reach it with NVSHMEM's one-sided operations")
            out.append(RDMA)
        elif mode == RDMA and (ranks is None or q in ranks):
            out.append(RDMA)
        else:
            out.append(P2P)
    return out


def rdma_mask(transports: Sequence[str]) -> np.ndarray:
    """The descriptor's ``rdma_mask`` words: bit ``q % 64`` of word ``q // 64`` set when rank ``q`` is rdma
    (as the acknowledgement mask's bits; ``RingDescriptor::rdma_mask_ptr``).

    Example:
        >>> [hex(w) for w in rdma_mask(["self", "rdma", "p2p", "rdma"])]
        ['0xa']
    """
    words = np.zeros(-(-len(transports) // 64) or 1, dtype=np.uint64)
    for q, t in enumerate(transports):
        if t == RDMA:
            words[q // 64] |= np.uint64(1 << (q % 64))
    return words


def for_backend(backend, alloc, transport=None, *, what: str) -> List[str]:
    """Resolve ``transport`` (or ``SYMMRING_TRANSPORT``) for this PE of ``backend`` and log the choice at
    INFO. Whether each peer is mapped comes from ``backend.peer_mapped(alloc, q)`` (nvshmem_ptr of the
    symmetric allocation ``alloc``); backends without that method map every peer (the host backend's
    shared window). Collective (bounded): when one rank cannot have what was asked (``"p2p"`` with an
    unmapped peer), every rank raises the `BackendError` naming it, so none goes on to a collective the
    others never reach."""
    value, source = request(transport)
    rank, world = backend.rank, backend.world_size
    probe = getattr(backend, "peer_mapped", None)
    mapped = [True if probe is None or q == rank else bool(probe(alloc, q)) for q in range(world)]
    name = "transport" if source == "transport=" else ENV_VAR
    try:
        out, failure = resolve(value, rank=rank, world_size=world, mapped=mapped, name=name), None
    except BackendError as exc:  # e.g. "p2p" with an unmapped peer: every rank must raise, not this one alone
        out, failure = None, exc
    collectives = getattr(backend, "collectives", None)
    if collectives is not None and world > 1:
        notes = collectives.allgather(None if failure is None else str(failure), what=f"{what}: transports")
        if failure is None and any(notes):
            origin = next(r for r, n in enumerate(notes) if n)
            failure = BackendError(f"rank {origin}: {notes[origin]}")
    if failure is not None:
        raise failure
    logger.info("%s on rank %d: transport %r (%s): %s", what, rank, value, source,
                ", ".join(f"{q}:{t}" for q, t in enumerate(out)))
    return out
