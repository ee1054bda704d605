"""lookup_tiers: one lookup across the local tiers (the index) and the remote tier.

Shared by the engine adapter and :class:`~tierkv.engine.store.TierKVStore`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tierkv.core.index import BlockIndex
from tierkv.core.plans import Lookup

__all__ = ["RemoteAsker", "lookup_tiers"]


class RemoteAsker(Protocol):
    """What the adapter needs of a remote tier's lookups
    (:class:`tierkv.tiers.remote.lookup.RemoteLookup`): the prefix of ``keys`` whose
    every rank's value exists, or None ("not yet")."""

    def ask(self, keys: Sequence[bytes]) -> list[bytes] | None: ...


def lookup_tiers(index: BlockIndex, remote: RemoteAsker | None,
                 keys: Sequence[bytes]) -> tuple[Lookup, bool]:
    """The index's lookup of ``keys``, the chunks past its hits asked of the remote tier
    first (noted in the index when it has them), and whether the remote tier has not
    answered yet ("not yet")."""
    found = index.lookup(keys)
    if remote is None or found.pending or found.num_hits >= len(keys) \
            or index.contains(keys[found.num_hits]):
        return found, False
    answer = remote.ask(keys[found.num_hits:])
    if answer is None:
        return found, True
    if answer and index.note_remote(answer):
        found = index.lookup(keys)
    return found, False
