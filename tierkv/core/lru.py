"""Recency order over keys: the eviction policy, one small class.

- ``touch(key)`` makes the key most recently used (inserting it if absent);
  ``add_new(keys)`` inserts absent keys in bulk.
- ``move_to_oldest(key)`` makes a present key the least recently used.
- ``discard(key)`` forgets it.
- ``oldest_first()`` iterates keys from least to most recently used.

A second policy is one new class with the same methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def touch(self, key: bytes) -> None:
        order = self._order
        if key in order:
            order.move_to_end(key)
        else:
            order[key] = None

    def add_new(self, keys: Iterable[bytes]) -> None:
        """Insert keys that are not present, as the most recent, in order (one bulk call)."""
        self._order.update(dict.fromkeys(keys))

    def move_to_oldest(self, key: bytes) -> None:
        self._order.move_to_end(key, last=False)

    def discard(self, key: bytes) -> None:
        self._order.pop(key, None)

    def oldest_first(self) -> Iterator[bytes]:
        return iter(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
