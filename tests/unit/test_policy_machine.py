"""Every eviction policy against the contract of ``tierkv.core.policy``, and against a plain
reference model of its order, driven by a hypothesis state machine with ``check()``
after every step.

The contract part holds for any policy: ``victims(pool)`` walks exactly the keys listed in
the pool, each once; held keys are no victims; counts, ``len`` and ``pool_of`` agree; no
call on an unknown key changes anything. The reference part (LRU and ARC here, written
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
from tierkv.core.policies.arc import ARCPolicy
from tierkv.core.policy import EvictionPolicy, make_policy, policy_names

KEYS = [bytes([i]) * 4 for i in range(10)]
POOLS = 2


class ReferenceLRU:
    def __init__(self, capacity: int, num_pools: int) -> None:
        self.orders: list[list[bytes]] = [[] for _ in range(num_pools)]

    def _find(self, key: bytes) -> list[bytes] | None:
        return next((order for order in self.orders if key in order), None)

    def insert(self, keys: list[bytes], pool: int) -> None:
        for key in keys:
            if self._find(key) is None:
                self.orders[pool].append(key)

    def access(self, key: bytes) -> None:
        order = self._find(key)
        if order is not None:
            order.remove(key)
            order.append(key)

    refresh = access

    def hold(self, key: bytes, pool: int) -> None:
        if key in self.orders[pool]:
            self.orders[pool].remove(key)

    def place(self, key: bytes, pool: int, oldest: bool) -> None:
        if key in self.orders[pool]:
            self.orders[pool].remove(key)
        self.orders[pool].insert(0, key) if oldest else self.orders[pool].append(key)

    def evict(self, key: bytes, pool: int) -> None:
        self.hold(key, pool)

    discard = evict

    def victims(self, pool: int) -> list[bytes]:
        return list(self.orders[pool])

    def state(self) -> object:
        return None


class ReferenceARC:
    """ARC as the module docstring states it, with lists."""

    def __init__(self, capacity: int, num_pools: int) -> None:
        self.capacity = capacity
        self.lists = {(lst, pool): [] for lst in (1, 2) for pool in range(num_pools)}
        self.held: dict[bytes, int] = {}  # key -> 1 (T1) or 2 (T2)
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []
        self.p = 0.0

    def _find(self, key: bytes) -> tuple[int, int] | None:
        return next((at for at, keys in self.lists.items() if key in keys), None)

    def _size(self, lst: int) -> int:
        return sum(len(keys) for (which, _), keys in self.lists.items() if which == lst) + \
            sum(1 for which in self.held.values() if which == lst)

    def _bound(self) -> None:
        while self.b1 and self._size(1) + len(self.b1) > self.capacity:
            self.b1.pop(0)
        while self.b2 and self._size(1) + self._size(2) + len(self.b1) + len(self.b2) > \
                2 * self.capacity:
            self.b2.pop(0)

    def insert(self, keys: list[bytes], pool: int) -> None:
        for key in keys:
            if key in self.held or self._find(key) is not None:
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

    def access(self, key: bytes) -> None:
        if key in self.held:
            self.held[key] = 2
            return
        at = self._find(key)
        if at is not None:
            self.lists[at].remove(key)
            self.lists[(2, at[1])].append(key)

    def refresh(self, key: bytes) -> None:
        at = self._find(key)
        if at is not None:
            self.lists[at].remove(key)
            self.lists[at].append(key)

    def hold(self, key: bytes, pool: int) -> None:
        at = self._find(key)
        if at is not None:
            self.lists[at].remove(key)
            self.held[key] = at[0]

    def place(self, key: bytes, pool: int, oldest: bool) -> None:
        at = self._find(key)
        if key in self.held:
            lst = self.held.pop(key)
        elif at is not None:
            self.lists[at].remove(key)
            lst = at[0]
        else:
            lst = 1
            for ghost in (self.b1, self.b2):
                if key in ghost:
                    ghost.remove(key)
        keys = self.lists[(lst, pool)]
        keys.insert(0, key) if oldest else keys.append(key)

    def _remove(self, key: bytes) -> int | None:
        if key in self.held:
            return self.held.pop(key)
        at = self._find(key)
        if at is None:
            return None
        self.lists[at].remove(key)
        return at[0]

    def evict(self, key: bytes, pool: int) -> None:
        lst = self._remove(key)
        if lst is not None:
            (self.b1 if lst == 1 else self.b2).append(key)
            self._bound()

    def discard(self, key: bytes, pool: int) -> None:
        self._remove(key)

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
            self.held: set[bytes] = set()

        @precondition(lambda self: self.policy is None)
        @rule(capacity=st.integers(0, 6))
        def open(self, capacity: int) -> None:
            self.policy = make_policy(name, capacity, POOLS)
            self.reference = REFERENCES[name](capacity, POOLS) if name in REFERENCES else None

        def _both(self, method: str, *args: object, **kwargs: object) -> None:
            assert self.policy is not None
            getattr(self.policy, method)(*args, **kwargs)
            if self.reference is not None:
                getattr(self.reference, method)(*args, **kwargs)

        @precondition(lambda self: self.policy is not None)
        @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
              pool=st.integers(0, POOLS - 1))
        def insert(self, keys: list[bytes], pool: int) -> None:
            new = [key for key in keys if key not in self.listed and key not in self.held]
            self._both("insert", new, pool)
            self.listed.update(dict.fromkeys(new, pool))

        @precondition(lambda self: self.policy is not None)
        @rule(key=st.sampled_from(KEYS), reuse=st.booleans())
        def use(self, key: bytes, reuse: bool) -> None:
            self._both("access" if reuse else "refresh", key)

        @precondition(lambda self: bool(self.listed))
        @rule(data=st.data())
        def hold(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.listed)))
            self._both("hold", key, self.listed.pop(key))
            self.held.add(key)

        @precondition(lambda self: bool(self.held))
        @rule(data=st.data(), pool=st.integers(0, POOLS - 1), oldest=st.booleans())
        def place(self, data: st.DataObject, pool: int, oldest: bool) -> None:
            key = data.draw(st.sampled_from(sorted(self.held)))
            self.held.discard(key)
            self._both("place", key, pool, oldest=oldest)
            self.listed[key] = pool

        @precondition(lambda self: bool(self.listed) or bool(self.held))
        @rule(data=st.data(), ghost=st.booleans())
        def remove(self, data: st.DataObject, ghost: bool) -> None:
            key = data.draw(st.sampled_from(sorted(self.listed.keys() | self.held)))
            pool = self.listed.pop(key, 0)
            self.held.discard(key)
            self._both("evict" if ghost else "discard", key, pool)

        @precondition(lambda self: self.policy is not None)
        @rule(key=st.sampled_from(KEYS), pool=st.integers(0, POOLS - 1))
        def unknown_keys_change_nothing(self, key: bytes, pool: int) -> None:
            assert self.policy is not None
            if key in self.listed or key in self.held:
                return
            before = [list(self.policy.victims(p)) for p in range(POOLS)]
            self.policy.access(key)
            self.policy.refresh(key)
            self.policy.hold(key, pool)
            self.policy.evict(key, pool)
            self.policy.discard(key, pool)
            assert [list(self.policy.victims(p)) for p in range(POOLS)] == before

        @invariant()
        def agrees(self) -> None:
            if self.policy is None:
                return
            policy = self.policy
            policy.check(self.listed, self.held)
            for pool in range(POOLS):
                walked = list(policy.victims(pool))
                assert len(walked) == len(set(walked)) == policy.count(pool)
                assert set(walked) == {k for k, p in self.listed.items() if p == pool}
                if self.reference is not None:
                    assert walked == self.reference.victims(pool)
            assert len(policy) == len(self.listed)
            for key in KEYS:
                assert policy.pool_of(key) == self.listed.get(key)
            if isinstance(policy, ARCPolicy) and isinstance(self.reference, ReferenceARC):
                assert (policy.ghosts(), policy.target) == self.reference.state()

    PolicyMachine.__name__ = f"PolicyMachine_{name}"
    return PolicyMachine


@pytest.mark.parametrize("name", policy_names())
def test_policy_against_contract_and_reference(name: str) -> None:
    run_state_machine_as_test(machine_for(name), settings=thorough(300, 50))


def test_every_policy_has_a_reference_model() -> None:
    assert set(policy_names()) <= set(REFERENCES), "add a reference model for the new policy"
