"""LRU: each pool is one recency order; the least recently used key is the next victim.

A reuse and a refresh are the same thing here (the key becomes the most recent of its
pool); no ghosts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from tierkv.core.policy import EvictionPolicy, require


class LRUPolicy(EvictionPolicy):
    def __init__(self, capacity: int, num_pools: int = 1) -> None:
        super().__init__(capacity, num_pools)
        self._orders: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_pools)]

    def insert(self, keys: Iterable[bytes], pool: int) -> None:
        order = self._orders[pool]
        for key in keys:  # 2-4x faster than order.update(dict.fromkeys(keys)) here
            order[key] = None

    def touch(self, key: bytes, reuse: bool) -> None:
        for order in self._orders:
            if key in order:
                order.move_to_end(key)
                return

    def move(self, keys: Iterable[bytes], source: int, dest: int) -> None:
        left, order = self._orders[source], self._orders[dest]
        for key in keys:
            if key in left:
                del left[key]
                order[key] = None
                order.move_to_end(key, False)  # positional: faster

    def evict(self, key: bytes, pool: int) -> None:
        self._orders[pool].pop(key, None)

    def victims(self, pool: int) -> Iterator[bytes]:
        return iter(self._orders[pool])

    def count(self, pool: int) -> int:
        return len(self._orders[pool])

    def check(self, listed: Mapping[bytes, int]) -> None:
        for pool, order in enumerate(self._orders):
            mine = set(order)
            theirs = {key for key, want in listed.items() if want == pool}
            require(mine == theirs, f"lru pool {pool}: lists {len(mine - theirs)} key(s) it "
                                    f"should not and misses {len(theirs - mine)}")
