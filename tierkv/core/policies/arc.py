"""ARC (adaptive replacement cache, Megiddo and Modha, FAST 2003) over a tier's pools.

Resident keys are in one of two lists: **T1**, chunks not reused since they came in, and
**T2**, chunks reused at least once (``access``). Each list is an LRU order per pool.
Evicted keys leave a **ghost** (no data, just the key) in B1 or B2 after the list they
left. A chunk that comes back (``insert``) while its ghost is remembered is a sign the
tier evicted the wrong list: a B1 ghost raises the target size ``p`` of T1, a B2 ghost
lowers it, by ``max(1, |other ghost list| / |this ghost list|)`` within ``[0, capacity]``,
and the chunk goes into T2 (it was used twice). Victims come from T1 while T1 holds more
than ``p`` keys, else from T2, each list oldest first (then the other list, so that a
pool is walked whole). A run of one-off chunks (a scan) therefore passes through T1 and
leaves the reused chunks in T2 alone, while a workload whose chunks come back just after
their eviction moves ``p`` up until T1 keeps them: LRU's behaviour, learned.

Differences from the paper, for the index: a refresh (the storing request finishing)
moves a key within its list without counting a reuse; a key moved to another pool (a spill
in flight) keeps its list and is counted in it; ghost hits are seen when a chunk comes back into the
tier (stored again, promoted from disk), not at the lookup that missed.

Ghost memory is bounded as in the paper: when an eviction adds a ghost, B1 is trimmed
(oldest first) to ``|T1| + |B1| <= capacity``, then B2 to ``|T1| + |T2| + |B1| + |B2| <=
2 x capacity`` (inserts may pass these bounds until the next eviction, which is when
ghosts are used; only then are they checked, which keeps inserts cheap). Ghosts are only
added there, so there are never more than ``2 x capacity`` (``capacity`` once the tier is
full), one key each (about 100 bytes with its dict entry): for a CPU tier of
``num_slots`` slots, at most ``2 x num_slots`` keys besides the index's own entries (which
cost about 350 bytes per chunk).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain

from tierkv.core.policy import EvictionPolicy, require

T1, T2 = 0, 1


class ARCPolicy(EvictionPolicy):
    def __init__(self, capacity: int, num_pools: int = 1) -> None:
        super().__init__(capacity, num_pools)
        self._lists: tuple[list[OrderedDict[bytes, None]], ...] = tuple(
            [OrderedDict() for _ in range(num_pools)] for _ in (T1, T2))
        # Where each resident key is: (list, pool). The tuples are made once and shared.
        self._at = tuple(tuple((lst, pool) for pool in range(num_pools)) for lst in (T1, T2))
        self._where: dict[bytes, tuple[int, int]] = {}
        self._sizes = [0, 0]  # resident keys of T1, T2 (every pool)
        self._ghosts: tuple[OrderedDict[bytes, None], OrderedDict[bytes, None]] = (
            OrderedDict(), OrderedDict())
        self.target = 0.0  # p: the size T1 may keep before it gives up its keys

    # ------------------------------------------------------------------ contract
    def insert(self, keys: Iterable[bytes], pool: int) -> None:
        where = self._where
        b1, b2 = self._ghosts
        t1_order, t2_order = self._lists[T1][pool], self._lists[T2][pool]
        t1_at, t2_at = self._at[T1][pool], self._at[T2][pool]
        sizes = self._sizes
        for key in keys:
            if key in where:
                continue
            if key in b1:
                self.target = min(self.target + max(1.0, len(b2) / len(b1)), self.capacity)
                del b1[key]
            elif key in b2:
                self.target = max(self.target - max(1.0, len(b1) / len(b2)), 0.0)
                del b2[key]
            else:
                t1_order[key] = None
                where[key] = t1_at
                sizes[T1] += 1
                continue
            t2_order[key] = None  # a ghost hit: used twice
            where[key] = t2_at
            sizes[T2] += 1

    def touch(self, key: bytes, reuse: bool) -> None:
        at = self._where.get(key)
        if at is None:
            return
        lst, pool = at
        if lst == T2 or not reuse:  # a refresh, or a reuse of a reused key
            self._lists[lst][pool].move_to_end(key)
            return
        del self._lists[T1][pool][key]
        self._lists[T2][pool][key] = None
        self._where[key] = self._at[T2][pool]
        self._sizes[T1] -= 1
        self._sizes[T2] += 1

    def move(self, keys: Iterable[bytes], source: int, dest: int) -> None:
        where = self._where
        lists, ats = self._lists, self._at
        for key in keys:
            at = where.get(key)
            if at is None or at[1] != source:  # not listed, or not in ``source``
                continue
            lst = at[0]
            del lists[lst][source][key]
            order = lists[lst][dest]
            order[key] = None
            order.move_to_end(key, False)
            where[key] = ats[lst][dest]

    def evict(self, key: bytes, pool: int) -> None:
        at = self._where.pop(key, None)
        if at is None:
            return
        lst, listed = at
        del self._lists[lst][listed][key]
        sizes = self._sizes
        sizes[lst] -= 1
        b1, b2 = self._ghosts
        (b1 if lst == T1 else b2)[key] = None
        # The paper's bounds, B1 first (inlined: this is the eviction path).
        capacity = self.capacity
        over = sizes[T1] + len(b1) - capacity
        while over > 0 and b1:
            b1.popitem(False)
            over -= 1
        over = sizes[T1] + sizes[T2] + len(b1) + len(b2) - 2 * capacity
        while over > 0 and b2:
            b2.popitem(False)
            over -= 1

    def victims(self, pool: int) -> Iterator[bytes]:
        first = T1 if self._sizes[T1] > self.target else T2
        head, tail = self._lists[first][pool], self._lists[1 - first][pool]
        if not tail:  # the common case costs no chain
            return iter(head)
        return chain(head, tail) if head else iter(tail)

    def count(self, pool: int) -> int:
        return len(self._lists[T1][pool]) + len(self._lists[T2][pool])

    def list_of(self, key: bytes) -> int | None:
        """T1 or T2 for a resident key, None otherwise (tests, inspection)."""
        at = self._where.get(key)
        return None if at is None else at[0]

    def ghosts(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """B1 and B2, oldest first (tests, inspection)."""
        return tuple(self._ghosts[0]), tuple(self._ghosts[1])

    def check(self, listed: Mapping[bytes, int]) -> None:
        sizes = [0, 0]
        mine: dict[bytes, int] = {}
        for key, (lst, pool) in self._where.items():
            sizes[lst] += 1
            require(key in self._lists[lst][pool], "arc: a key not in its list:", key)
            mine[key] = pool
        require(sum(len(order) for order in self._lists[T1] + self._lists[T2]) == len(mine),
                "arc: a list holds a key that is not resident")
        require(sizes == self._sizes, f"arc: sizes {self._sizes}, counted {sizes}")
        require(mine == dict(listed), f"arc: lists {len(mine)} key(s), the tier {len(listed)}")
        b1, b2 = self._ghosts
        require(not (b1.keys() & b2.keys()), "arc: a key in both ghost lists")
        require(not (self._where.keys() & (b1.keys() | b2.keys())), "arc: a resident ghost")
        require(len(b1) + len(b2) <= 2 * max(self.capacity, 0), f"arc: {len(b1) + len(b2)} ghosts")
        require(0.0 <= self.target <= max(self.capacity, 0), f"arc: target {self.target}")
