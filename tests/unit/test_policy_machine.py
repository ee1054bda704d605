"""Every eviction policy against the contract of ``tierkv.core.policy``, and against a plain
reference model of its order, driven by a hypothesis state machine with ``check()``
after every step.

The contract part holds for any policy: ``victims(pool)`` walks exactly the keys listed in
the pool, each once; the counts agree; ``check`` accepts what the tier listed; no call on
an unknown key changes anything. The reference part (LRU and ARC here, written
with plain lists, slowly and obviously) must give the same victim order after every
step, and for ARC the same ghosts and target.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.profiles import thorough
from tierkv.core.policies import POLICIES, make_policy
from tierkv.core.policies.arc import ARCPolicy
from tierkv.core.policy import EvictionPolicy

KEYS = [bytes([i]) * 4 for i in range(10)]
POOLS = 3  # as the CPU tier's: clean, dirty, being written


class ReferenceLRU:
    def __init__(self, capacity: int, num_pools: int) -> None:
        self.orders: list[list[bytes]] = [[] for _ in range(num_pools)]

    def _find(self, key: bytes) -> list[bytes] | None:
        return next((order for order in self.orders if key in order), None)

    def insert(self, keys: list[bytes], pool: int) -> None:
        for key in keys:
            if self._find(key) is None:
                self.orders[pool].append(key)

    def touch(self, key: bytes, reuse: bool) -> None:
        order = self._find(key)
        if order is not None:
            order.remove(key)
            order.append(key)

    def move(self, keys: list[bytes], source: int, dest: int) -> None:
        for key in keys:
            if key in self.orders[source]:
                self.orders[source].remove(key)
                self.orders[dest].insert(0, key)

    def evict(self, key: bytes, pool: int) -> None:
        if key in self.orders[pool]:
            self.orders[pool].remove(key)

    def victims(self, pool: int) -> list[bytes]:
        return list(self.orders[pool])

    def state(self) -> object:
        return None


class ReferenceARC:
    """ARC as the module docstring states it, with lists."""

    def __init__(self, capacity: int, num_pools: int) -> None:
        self.capacity = capacity
        self.lists: dict[tuple[int, int], list[bytes]] = {
            (lst, pool): [] for lst in (1, 2) for pool in range(num_pools)}
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []
        self.p = 0.0

    def _find(self, key: bytes) -> tuple[int, int] | None:
        return next((at for at, keys in self.lists.items() if key in keys), None)

    def _size(self, lst: int) -> int:
        return sum(len(keys) for (which, _), keys in self.lists.items() if which == lst)

    def _bound(self) -> None:
        while self.b1 and self._size(1) + len(self.b1) > self.capacity:
            self.b1.pop(0)
        while self.b2 and self._size(1) + self._size(2) + len(self.b1) + len(self.b2) > \
                2 * self.capacity:
            self.b2.pop(0)

    def insert(self, keys: list[bytes], pool: int) -> None:
        for key in keys:
            if self._find(key) is not None:
                continue
            lst = 1
            if key in self.b1:
                self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.remove(key)
                lst = 2
            elif key in self.b2:
                self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
                self.b2.remove(key)
                lst = 2
            self.lists[(lst, pool)].append(key)

    def touch(self, key: bytes, reuse: bool) -> None:
        at = self._find(key)
        if at is not None:
            self.lists[at].remove(key)
            self.lists[(2, at[1]) if reuse else at].append(key)

    def move(self, keys: list[bytes], source: int, dest: int) -> None:
        for key in keys:
            at = self._find(key)
            if at is not None and at[1] == source:
                self.lists[at].remove(key)
                self.lists[(at[0], dest)].insert(0, key)

    def evict(self, key: bytes, pool: int) -> None:
        at = self._find(key)
        if at is not None:
            self.lists[at].remove(key)
            (self.b1 if at[0] == 1 else self.b2).append(key)
            self._bound()

    def victims(self, pool: int) -> list[bytes]:
        first = 1 if self._size(1) > self.p else 2
        return self.lists[(first, pool)] + self.lists[(3 - first, pool)]

    def state(self) -> object:
        return (tuple(self.b1), tuple(self.b2)), self.p


REFERENCES = {"lru": ReferenceLRU, "arc": ReferenceARC}


def machine_for(name: str) -> type[RuleBasedStateMachine]:
    class PolicyMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.policy: EvictionPolicy | None = None
            self.reference: ReferenceLRU | ReferenceARC | None = None
            self.listed: dict[bytes, int] = {}  # what the tier has told the policy

        @precondition(lambda self: self.policy is None)
        @rule(capacity=st.integers(0, 6))
        def open(self, capacity: int) -> None:
            self.policy = make_policy(name, capacity, POOLS)
            self.reference = REFERENCES[name](capacity, POOLS) if name in REFERENCES else None

        def _both(self, method: str, *args: object) -> None:
            assert self.policy is not None
            getattr(self.policy, method)(*args)
            if self.reference is not None:
                getattr(self.reference, method)(*args)

        @precondition(lambda self: self.policy is not None)
        @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
              pool=st.integers(0, POOLS - 1))
        def insert(self, keys: list[bytes], pool: int) -> None:
            new = [key for key in keys if key not in self.listed]
            self._both("insert", new, pool)
            self.listed.update(dict.fromkeys(new, pool))

        @precondition(lambda self: self.policy is not None)
        @rule(key=st.sampled_from(KEYS), reuse=st.booleans())
        def touch(self, key: bytes, reuse: bool) -> None:
            self._both("touch", key, reuse)

        @precondition(lambda self: bool(self.listed))
        @rule(data=st.data(), source=st.integers(0, POOLS - 1), dest=st.integers(0, POOLS - 1))
        def move(self, data: st.DataObject, source: int, dest: int) -> None:
            keys = [key for key in sorted(self.listed) if self.listed[key] == source]
            if not keys:
                return
            moved = data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3,
                                       unique=True))
            self._both("move", moved, source, dest)
            self.listed.update(dict.fromkeys(moved, dest))

        @precondition(lambda self: bool(self.listed))
        @rule(data=st.data(), source=st.integers(0, POOLS - 1), dest=st.integers(0, POOLS - 1))
        def move_from_another_pool_changes_nothing(self, data: st.DataObject, source: int,
                                                   dest: int) -> None:
            # The contract: a key leaves pool ``source`` only; one listed in another pool stays.
            assert self.policy is not None
            keys = [key for key in sorted(self.listed) if self.listed[key] != source]
            if not keys:
                return
            key = data.draw(st.sampled_from(keys))
            before = [list(self.policy.victims(p)) for p in range(POOLS)]
            self._both("move", [key], source, dest)
            assert [list(self.policy.victims(p)) for p in range(POOLS)] == before

        @precondition(lambda self: bool(self.listed))
        @rule(data=st.data())
        def evict(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.listed)))
            self._both("evict", key, self.listed.pop(key))

        @precondition(lambda self: self.policy is not None)
        @rule(key=st.sampled_from(KEYS), pool=st.integers(0, POOLS - 1),
              dest=st.integers(0, POOLS - 1))
        def unknown_keys_change_nothing(self, key: bytes, pool: int, dest: int) -> None:
            assert self.policy is not None
            if key in self.listed:
                return
            before = [list(self.policy.victims(p)) for p in range(POOLS)]
            self.policy.touch(key, True)
            self.policy.touch(key, False)
            self.policy.move([key], pool, dest)
            self.policy.evict(key, pool)
            assert [list(self.policy.victims(p)) for p in range(POOLS)] == before

        @invariant()
        def agrees(self) -> None:
            if self.policy is None:
                return
            policy = self.policy
            policy.check(self.listed)
            for pool in range(POOLS):
                walked = list(policy.victims(pool))
                assert len(walked) == len(set(walked)) == policy.count(pool)
                assert set(walked) == {k for k, p in self.listed.items() if p == pool}
                if self.reference is not None:
                    assert walked == self.reference.victims(pool)
            assert sum(map(policy.count, range(POOLS))) == len(self.listed)
            if isinstance(policy, ARCPolicy) and isinstance(self.reference, ReferenceARC):
                assert (policy.ghosts(), policy.target) == self.reference.state()

    PolicyMachine.__name__ = f"PolicyMachine_{name}"
    return PolicyMachine


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_against_contract_and_reference(name: str) -> None:
    run_state_machine_as_test(machine_for(name), settings=thorough(300, 50))


def test_every_policy_has_a_reference_model() -> None:
    assert set(POLICIES) <= set(REFERENCES), "add a reference model for the new policy"
