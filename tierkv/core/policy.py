"""Eviction policy: the order in which a tier gives up its chunks, behind one interface.

A policy orders the keys a tier may evict; it knows nothing of slots, states, readers or
jobs. Every key it lists sits in one **pool** (``0 .. num_pools - 1``): the CPU tier has
three, clean chunks (evictable at once), dirty ones (to be written to disk first) and
chunks being written (walked by no one), so the index takes clean victims before dirty
ones without walking the dirty ones; the disk tier has one. What may be evicted (READY, no
readers, not the request's own keys) and which pool goes first stay the index's decisions;
the policy only answers "in which order".

Primitives (keys are bytes; every call is O(1) but ``victims``, a lazy walk); a call on a
key the policy does not list changes nothing:

- ``insert(keys, pool)``: keys that just became evictable and are not in the policy (a
  store or a promotion landed), in order, the last the most recent. A policy may remember
  evicted keys ("ghosts") and treat one that comes back differently.
- ``touch(key, reuse)``: the chunk was used again: the most recent of its kind in its pool.
  ``reuse``: a request reused it (a load, a hit in the engine's own cache), which a policy
  may count; else only a refresh (its own request finished).
- ``move(keys, source, dest)``: each key in turn leaves pool ``source`` for pool ``dest``,
  as the least recent key of its kind there (with LRU, the pool's next victim): a spill
  moves dirty chunks to the pool of chunks being written, and back to clean (or dirty) as
  they land.
- ``evict(key, pool)``: the index dropped the key (a policy may keep a ghost of it).
- ``victims(pool)``: the pool's keys, the next victim first; the index takes the first it
  may evict, and writes dirty chunks back in this order. Do not change the policy while
  walking it.
- ``count(pool)``: the keys listed in a pool.
- ``check(listed)``: raise :class:`~tierkv.errors.InvariantError` unless the policy lists
  exactly ``listed`` (key -> pool).

A policy is one module ``tierkv/core/policies/<name>.py`` holding one
:class:`EvictionPolicy` subclass, and one entry of the registry ``POLICIES`` in
``tierkv/core/policies/__init__.py``, which :func:`~tierkv.core.policies.make_policy` reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping

from tierkv.errors import InvariantError


class EvictionPolicy(ABC):
    def __init__(self, capacity: int, num_pools: int = 1) -> None:
        """``capacity``: how many keys the tier holds at most (bounds any ghost memory)."""
        self.capacity = capacity
        self.num_pools = num_pools

    @abstractmethod
    def insert(self, keys: Iterable[bytes], pool: int) -> None: ...
    @abstractmethod
    def touch(self, key: bytes, reuse: bool) -> None: ...
    @abstractmethod
    def move(self, keys: Iterable[bytes], source: int, dest: int) -> None: ...
    @abstractmethod
    def evict(self, key: bytes, pool: int) -> None: ...
    @abstractmethod
    def victims(self, pool: int) -> Iterator[bytes]: ...
    @abstractmethod
    def count(self, pool: int) -> int: ...
    @abstractmethod
    def check(self, listed: Mapping[bytes, int]) -> None: ...


def require(condition: bool, *what: object) -> None:
    """An invariant check that ``python -O`` keeps (``assert`` it strips). ``what`` is
    joined into the message only when the check fails (no formatting on the way)."""
    if not condition:
        raise InvariantError(" ".join(map(str, what)))
