"""Eviction policies by name: the registry (the interface is :mod:`tierkv.core.policy`).

A new policy is one module here and one entry of :data:`POLICIES`.
"""

from __future__ import annotations

from tierkv.core.policies.arc import ARCPolicy
from tierkv.core.policies.lru import LRUPolicy
from tierkv.core.policy import EvictionPolicy
from tierkv.errors import UsageError

POLICIES: dict[str, type[EvictionPolicy]] = {"arc": ARCPolicy, "lru": LRUPolicy}
DEFAULT_POLICY = "arc"  # the CPU tier's default (benchmarks/policy.md)
DISK_POLICY = "lru"  # the disk tier's order (not a setting: the disk is the last tier)


def make_policy(name: str, capacity: int, num_pools: int = 1) -> EvictionPolicy:
    """The policy called ``name``, for a tier of ``capacity`` keys in ``num_pools`` pools."""
    policy = POLICIES.get(name)
    if policy is None:
        raise UsageError(f"eviction policy {name!r} is not one of {sorted(POLICIES)}")
    return policy(capacity, num_pools)


__all__ = ["DEFAULT_POLICY", "DISK_POLICY", "POLICIES", "make_policy"]
