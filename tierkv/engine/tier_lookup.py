"""lookup_tiers: one lookup across the local tiers (the index) and the remote tier.

Shared by the engine adapter and :class:`~tierkv.engine.store.TierKVStore`. The index is
asked once: its walk asks the remote tier (through ``RemoteAsker``) at the first chunk it
neither holds nor knows of, and goes on with what the remote tier has. What is known of
the remote tier's chunks lives in one place, the index's
:class:`~tierkv.core.remote_marks.RemoteMarks`; the asker keeps nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from tierkv.core.index import BlockIndex
from tierkv.core.plans import Lookup

__all__ = ["RemoteAsker", "lookup_tiers"]


class RemoteAsker(Protocol):
    """What a lookup needs of a remote tier's lookups
    (:class:`tierkv.tiers.remote.lookup.RemoteLookup`): for each of ``keys`` (the first
    ``max_keys`` at least), the part count the remote tier has it under (0: absent), or
    None ("not yet")."""

    def ask(self, keys: Sequence[bytes]) -> Mapping[bytes, int] | None: ...


def lookup_tiers(index: BlockIndex, remote: RemoteAsker | None,
                 keys: Sequence[bytes]) -> tuple[Lookup, bool]:
    """The index's lookup of ``keys``, the chunks past its hits asked of the remote tier
    (noted in the index when it has them), and whether the remote tier has not answered
    yet ("not yet")."""
    if remote is None:
        return index.lookup(keys), False
    known = index.remote
    not_yet = False

    def ask(rest: Sequence[bytes]) -> None:
        nonlocal not_yet
        if known.absent_lately(rest[0]):
            return  # not asked again yet
        answers = remote.ask(rest)
        if answers is None:
            not_yet = True
            return
        known.answered(answers)
        found = []
        for key in rest:
            if not answers.get(key):
                break
            found.append(key)
        if found:
            index.note_remote(found)

    return index.lookup(keys, ask), not_yet
