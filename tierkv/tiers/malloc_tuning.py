"""Process-wide glibc malloc tuning for the tiers that allocate chunk-sized buffers (the
disk tier's LMDB pages, the remote tier's values and replies): :func:`tune_malloc`."""

from __future__ import annotations

import ctypes
import logging
import os
import platform

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
