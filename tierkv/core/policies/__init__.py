"""Eviction policies: one module per policy, named as the policy (see tierkv.core.policy)."""
