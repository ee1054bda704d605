"""LMDB sizing and process tuning for the disk tier.

- :func:`map_size_for`: LMDB ``map_size`` from the disk cap, with headroom.
- :func:`tune_malloc` (glibc, once per process, ``TIERKV_MALLOPT=0`` opts out) keeps the
  heap blocks LMDB allocates for each value's pages from being faulted in afresh per put.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from tierkv.tiers.disk_format import LMDB_PAGE_HEADER, MAX_VALUE_OVERHEAD
from tierkv.units import MiB

logger = logging.getLogger("tierkv.disk")


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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_malloc_tuned = False


def tune_malloc(write_batch_bytes: int) -> bool:
    """Keep LMDB's freed dirty pages in the heap (glibc; once per process; opt out with
    ``TIERKV_MALLOPT=0``). Returns whether it changed anything.

    LMDB (``writemap=False``) mallocs each value's overflow pages per write txn; once torch
    is loaded, glibc tends to ``mmap`` those blocks afresh or trim the heap at each commit,
    so every put faults its buffer in again (``docs/benchmarks/disk.md``). Hence
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
    logger.debug("disk tier: mallopt(M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=%d): %s",
                 trim, _malloc_tuned)
    return _malloc_tuned
