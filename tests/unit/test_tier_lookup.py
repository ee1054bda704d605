"""lookup_tiers: one walk of the index, the remote tier asked once at its first unknown
chunk, and what the remote tier has kept in one place (the index's RemoteMarks). A fake
remote tier and a fake clock; no server."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.core.index import BlockIndex, Lookup
from tierkv.engine.tier_lookup import lookup_tiers

KEYS = [bytes([i]) * 32 for i in range(1, 7)]


class Remote:
    """A remote tier's lookups holding ``held`` (key -> part count); it counts the asks."""

    def __init__(self, held: dict[bytes, int]) -> None:
        self.held = held
        self.asked: list[int] = []

    def ask(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        self.asked.append(len(keys))
        return {key: self.held.get(key, 0) for key in keys}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def counted(index: BlockIndex) -> list[int]:
    calls: list[int] = []
    lookup = index.lookup

    def wrapped(keys: Sequence[bytes], *args: object) -> Lookup:
        calls.append(len(keys))
        return lookup(keys, *args)  # type: ignore[arg-type]

    index.lookup = wrapped  # type: ignore[method-assign]
    return calls


def test_a_lookup_with_remote_hits_walks_the_index_once() -> None:
    clock = Clock()
    index = BlockIndex(8, clock=clock)
    calls = counted(index)
    remote = Remote({KEYS[0]: 1, KEYS[1]: 1, KEYS[2]: 2})  # KEYS[2]: under 2 parts
    found, not_yet = lookup_tiers(index, remote, KEYS)
    assert (found.num_hits, found.num_remote, not_yet) == (3, 3, False)
    assert calls == [len(KEYS)]  # once (it used to run twice, around the remote answer)
    assert remote.asked == [len(KEYS)]
    assert index.remote.count_of(KEYS[2]) == 2 and index.remote.count_of(KEYS[3]) == 0


def test_what_the_remote_tier_has_is_kept_in_the_index_alone() -> None:
    """A mark is a hit for mark_seconds, an absence is not asked again for 50 ms: both kept
    in the index's record (lookup_tiers builds a new asker each call)."""
    clock = Clock()
    index = BlockIndex(8, clock=clock, remote_mark_seconds=10.0)
    remote = Remote({KEYS[0]: 1})
    assert lookup_tiers(index, remote, KEYS)[0].num_hits == 1
    clock.now += 0.049
    assert lookup_tiers(index, remote, KEYS)[0].num_hits == 1
    assert remote.asked == [len(KEYS)]  # KEYS[1] was absent a moment ago: not asked
    remote.held[KEYS[1]] = 1  # pushed by another engine
    clock.now += 0.002
    assert lookup_tiers(index, remote, KEYS)[0].num_hits == 2
    assert remote.asked == [len(KEYS), len(KEYS) - 1]  # from the first unknown chunk on
    clock.now += 9.0  # the marks still count: no question
    assert lookup_tiers(index, remote, KEYS[:2])[0].num_hits == 2
    assert len(remote.asked) == 2


def test_no_answer_yet_is_not_yet_and_notes_nothing() -> None:
    class Silent(Remote):
        def ask(self, keys: Sequence[bytes]) -> None:  # type: ignore[override]
            self.asked.append(len(keys))

    index = BlockIndex(8, clock=Clock())
    remote = Silent({})
    found, not_yet = lookup_tiers(index, remote, KEYS)
    assert (found.num_hits, not_yet) == (0, True) and len(index.remote) == 0
