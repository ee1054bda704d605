"""Eviction policy: the order in which a tier gives up its chunks, behind one interface.

A policy orders the keys a tier may evict; it knows nothing of slots, states, readers or
jobs. Every key it lists sits in one **pool** (``0 .. num_pools - 1``): the CPU tier has
two, clean chunks (evictable at once) and dirty ones (to be written to disk first), so the
index takes clean victims before dirty ones without walking the dirty ones; the disk tier
has one. What may be evicted (READY, no readers, not the request's own keys) and which pool
goes first stay the index's decisions; the policy only answers "in which order".

Primitives (keys are bytes; every call is O(1) but ``victims``, a lazy walk):

- ``insert(keys, pool)``: keys that just became evictable and are not in the policy (a
  store or a promotion landed), in order, the last the most recent. A policy may remember
  evicted keys ("ghosts") and treat one that comes back differently.
- ``access(key)``: a request reused the chunk (a load of it, a hit in the engine's own
  cache): it becomes the most recent of its pool; a policy may count the reuse. A key the
  policy does not list is ignored (held keys may still be counted).
- ``refresh(key)``: the chunk was used again, but not reused (its own request finished):
  most recent of its kind, no reuse counted. Unknown keys are ignored.
- ``hold(key, pool)``: the listed key leaves the victim order (a spill in flight pins it);
  the policy may keep what it knows of it until ``place``/``evict``/``discard``.
- ``place(key, pool, oldest=...)``: a held key joins ``pool`` again: as the least recent key
  of its kind there (``oldest=True``; with LRU, the pool's next victim) or the most recent.
- ``evict(key, pool)``: the index evicted the listed or held key (a policy may keep a
  ghost of it). ``discard(key, pool)``: the key is gone for another reason (damaged,
  missing): no ghost. Both ignore unknown keys.
- ``victims(pool)``: the pool's keys, the next victim first; the index takes the first it
  may evict, and writes dirty chunks back in this order. Do not change the policy while
  walking it.
- ``count(pool)``, ``len()``: keys listed in a pool, in all pools (held keys not counted);
  ``pool_of(key)``: the pool listing the key, or None (held or unknown).
- ``check(listed, held)``: raise :class:`~tierkv.errors.InvariantError` unless the policy
  lists exactly ``listed`` (key -> pool) and remembers no held key outside ``held``.

A policy is one module ``tierkv/core/policies/<name>.py`` holding one
:class:`EvictionPolicy` subclass whose ``name`` is ``<name>``; :func:`make_policy` finds it
by name, so a new policy is one new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping

from tierkv.errors import ConfigError, InvariantError

DEFAULT_POLICY = "arc"  # the CPU tier's default (benchmarks/policy.md)
DISK_POLICY = "lru"  # the disk tier's order (not a setting: the disk is the last tier)


class EvictionPolicy(ABC):
    name: str = ""

    def __init__(self, capacity: int, num_pools: int = 1) -> None:
        """``capacity``: how many keys the tier holds at most (bounds any ghost memory)."""
        self.capacity = capacity
        self.num_pools = num_pools

    @abstractmethod
    def insert(self, keys: Iterable[bytes], pool: int) -> None: ...
    @abstractmethod
    def access(self, key: bytes) -> None: ...
    @abstractmethod
    def refresh(self, key: bytes) -> None: ...
    @abstractmethod
    def hold(self, key: bytes, pool: int) -> None: ...
    @abstractmethod
    def place(self, key: bytes, pool: int, *, oldest: bool) -> None: ...
    @abstractmethod
    def evict(self, key: bytes, pool: int) -> None: ...
    @abstractmethod
    def discard(self, key: bytes, pool: int) -> None: ...
    @abstractmethod
    def victims(self, pool: int) -> Iterator[bytes]: ...
    @abstractmethod
    def count(self, pool: int) -> int: ...
    @abstractmethod
    def pool_of(self, key: bytes) -> int | None: ...
    @abstractmethod
    def __len__(self) -> int: ...
    @abstractmethod
    def check(self, listed: Mapping[bytes, int], held: Collection[bytes]) -> None: ...


def require(condition: bool, *what: object) -> None:
    """An invariant check that ``python -O`` keeps (``assert`` it strips). ``what`` is
    joined into the message only when the check fails (no formatting on the way)."""
    if not condition:
        raise InvariantError(" ".join(map(str, what)))


def policy_names() -> tuple[str, ...]:
    """Every policy tierkv ships, sorted (the modules of ``tierkv.core.policies``)."""
    from tierkv.core import policies

    return tuple(sorted(info.name for info in pkgutil.iter_modules(policies.__path__)
                        if not info.name.startswith("_")))


def policy_class(name: str) -> type[EvictionPolicy]:
    names = policy_names()
    if name not in names:
        raise ConfigError(f"eviction policy {name!r} is not one of {list(names)}")
    module = importlib.import_module(f"tierkv.core.policies.{name}")
    found = [value for value in vars(module).values()
             if isinstance(value, type) and issubclass(value, EvictionPolicy)
             and value.name == name]
    if len(found) != 1:
        raise ConfigError(f"eviction policy {name!r}: tierkv/core/policies/{name}.py must hold "
                          f"one EvictionPolicy subclass named {name!r}, found {len(found)}")
    return found[0]


def make_policy(name: str, capacity: int, num_pools: int = 1) -> EvictionPolicy:
    """The policy called ``name``, for a tier of ``capacity`` keys in ``num_pools`` pools."""
    return policy_class(name)(capacity, num_pools)
