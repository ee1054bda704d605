"""LMDB sizing for the disk tier: :func:`map_size_for`, LMDB's ``map_size`` from the disk
cap, with headroom; :func:`shard_cap` what each shard of a rank is mapped for and
:func:`largest_cap` the largest ``disk.max_bytes`` whose maps fit :data:`MAP_LIMIT_BYTES`.
(The process's malloc tuning is :mod:`tierkv.tiers.malloc_tuning`.)"""

from __future__ import annotations

from collections.abc import Callable

from tierkv.tiers.disk_format import LMDB_PAGE_HEADER, MAX_VALUE_OVERHEAD
from tierkv.units import MiB, TiB

# Address space one disk tier's maps may take: x86-64 and arm64 give a process 128 TiB
# (47 bits); LMDB maps its whole map_size at open (mmap, ENOMEM past that: measured here
# with one 64 TiB map opening and one of 100 TiB failing), and the rest of the process
# (torch, the slab, other stores) needs some.
MAP_LIMIT_BYTES = 96 * TiB


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


def shard_cap(max_bytes: int, payload_bytes: int, shards: int) -> int:
    """The payload bytes each of a rank's ``shards`` environments is mapped for under a cap
    of ``max_bytes``: a shard's fair share twice over (keys spread unevenly), at most the
    whole cap; the cap itself is kept by the scheduler side."""
    return min(max_bytes, -(-max_bytes // shards) * 2 + 64 * payload_bytes)


def largest_cap(total_for: Callable[[int], int], limit: int = MAP_LIMIT_BYTES) -> int:
    """The largest cap ``c`` (to 1 MiB) with ``total_for(c) <= limit`` (``total_for``
    grows with ``c``); 0 when none fits."""
    low, high = 0, limit
    while high - low > MiB:
        middle = (low + high) // 2
        low, high = (middle, high) if total_for(middle) <= limit else (low, middle)
    return low // MiB * MiB
