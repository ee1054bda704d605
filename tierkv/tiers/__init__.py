"""Tiers hold bytes: the pinned CPU slab and the LMDB disk tier."""
