"""The bit layout of a call identity: the word every meta row carries and every consumer compares with its own
(`symmring.protocol.call_identity` makes one; docs/PROTOCOL.md, device/symmring/protocol.cuh mirrors it).

No dependencies: `symmring.errors` reads identities with `split_call_identity` to name the calls of a mismatch,
and `symmring.protocol` (which raises `symmring.errors.ConfigError`) builds them.

Example:
    >>> split_call_identity(3 << CALL_LAYER_BITS | 2)
    (3, 2)
"""

from __future__ import annotations

from typing import Tuple

#: Low bits of a call identity that hold the layer id (the bits above: the call number).
CALL_LAYER_BITS = 16
#: Bits of the call number in an identity (an identity fits a non-negative int64 meta word).
CALL_NUMBER_BITS = 63 - CALL_LAYER_BITS


def split_call_identity(identity: int) -> Tuple[int, int]:
    """``(call number, layer)`` of an identity (`symmring.protocol.call_identity`), for messages."""
    identity = int(identity) & ((1 << 64) - 1)
    return identity >> CALL_LAYER_BITS, identity & ((1 << CALL_LAYER_BITS) - 1)
