"""LMDB sizing for the disk tier: :func:`map_size_for`, LMDB's ``map_size`` from the disk
cap, with headroom. (The process's malloc tuning is :mod:`tierkv.tiers.malloc_tuning`.)"""

from __future__ import annotations

from tierkv.tiers.disk_format import LMDB_PAGE_HEADER, MAX_VALUE_OVERHEAD
from tierkv.units import MiB


def map_size_for(max_bytes: int, payload_bytes: int, page_bytes: int = 4096) -> int:
    """LMDB ``map_size`` for a disk cap of ``max_bytes`` of payloads: every value's overflow
    pages, under 256 bytes per chunk for the two B-trees, 25% for copy-on-write and free-list
    fragmentation and 4 MiB for meta pages and roots, rounded up to 1 MiB (the formula is in
    ``docs/on-disk-format.md``). A sparse file: only written pages take disk space."""
    num_chunks = -(-max_bytes // payload_bytes)
    value_pages = -(-(payload_bytes + MAX_VALUE_OVERHEAD + LMDB_PAGE_HEADER) // page_bytes)
    data = num_chunks * value_pages * page_bytes
    total = data + data // 4 + num_chunks * 256 + 4 * MiB
    return -(-total // MiB) * MiB
