"""The tiers' sizing and process tuning.

- Disk sizing: :func:`map_size_for`, the index's LMDB ``map_size`` from the disk cap, with
  headroom; :func:`slab_slots_for`, the slots a shard's slab may grow to; :func:`shard_cap`
  what each shard of a rank is sized for and :func:`largest_cap` the largest
  ``disk.max_bytes`` whose maps fit :data:`MAP_LIMIT_BYTES`.
- :func:`tune_malloc`: process-wide glibc malloc tuning for the tiers that allocate
  chunk-sized buffers (the disk tier's LMDB pages, the remote tier's values and replies).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Callable

from tierkv.units import MiB, TiB

# Address space one disk tier's maps may take: x86-64 and arm64 give a process 128 TiB
# (47 bits); LMDB maps its whole map_size at open (mmap, ENOMEM past that: measured here
# with one 64 TiB map opening and one of 100 TiB failing), and the rest of the process
# (torch, the slab, other stores) needs some.
MAP_LIMIT_BYTES = 96 * TiB


INDEX_BYTES_PER_CHUNK = 512  # an index entry (32 + 36 bytes) in B-tree pages, copy-on-write


def map_size_for(max_bytes: int, payload_bytes: int, page_bytes: int = 4096) -> int:
    """LMDB ``map_size`` of a shard's index for a disk cap of ``max_bytes`` of payloads:
    :data:`INDEX_BYTES_PER_CHUNK` per chunk (entries, B-tree, copy-on-write and free-list
    slack) and 8 MiB for meta pages and roots, rounded up to 1 MiB (the payloads are in the
    slab files, ``docs/on-disk-format.md``). A sparse file: only written pages take disk
    space. ``page_bytes`` is kept for callers; the index needs no per-value pages."""
    num_chunks = -(-max_bytes // payload_bytes)
    total = num_chunks * INDEX_BYTES_PER_CHUNK + 8 * MiB
    return -(-total // MiB) * MiB


def slab_slots_for(max_bytes: int, payload_bytes: int) -> int:
    """The slots a shard's slab file may grow to under a shard cap of ``max_bytes`` (its
    hard limit; the cap itself is kept by the scheduler side): one per chunk of the cap."""
    return max(1, -(-max_bytes // payload_bytes))


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


logger = logging.getLogger("tierkv")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_malloc_tuned = False


def tune_malloc(write_batch_bytes: int) -> bool:
    """Keep big freed blocks in the heap (glibc; once per process; opt out with
    ``TIERKV_MALLOPT=0``). Returns whether it changed anything.

    LMDB (``writemap=False``) mallocs each value's overflow pages per write txn, and the
    remote tier a value buffer per put and redis-py one per reply; once torch is loaded,
    glibc tends to ``mmap`` such blocks afresh or trim the heap after them, so every one is
    faulted in again (``docs/benchmarks/disk.md``, ``remote.md``: 442-621 faults per 2 MiB
    chunk put and read back, 1-5 tuned). Hence
    ``M_MMAP_THRESHOLD`` 32 MiB (glibc's own dynamic ceiling) and ``M_TRIM_THRESHOLD``
    ``max(4 * write_batch_bytes, 32 MiB)``, at most 1 GiB: the free heap kept."""
    global _malloc_tuned
    if _malloc_tuned or os.environ.get("TIERKV_MALLOPT", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    trim = min(max(4 * write_batch_bytes, 32 << 20), 1 << 30)
    _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim))
    logger.debug("tierkv: mallopt(M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=%d): %s",
                 trim, _malloc_tuned)
    return _malloc_tuned
