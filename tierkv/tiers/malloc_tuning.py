"""Process tuning for the tiers: glibc malloc for the tiers that allocate chunk-sized
buffers (the disk tier's LMDB pages, the remote tier's values and replies):
:func:`tune_malloc`; the CPU priority of tierkv's background threads: :func:`lower_priority`
(called first thing by a write, sync or push thread; :func:`niced` wraps a thread's
target so) and :func:`thread_nice`.

Why a background thread runs niced (``StoreConfig.background_nice``,
docs/configuration.md): its writes, syncs and pushes may finish later, the engine's forward
pass and the threads that serve hits (reads, loads, lookups: never niced) may not. Linux
lets a process raise a thread's nice value, never lower it again, and a thread starts with
its creator's: so a niced thread's own helper threads are niced too, and a pool shared with
threads that serve hits must not be started from a niced thread
(:class:`~tierkv.tiers.remote.spread.Spread` keeps one pool per priority)."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Callable

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


def thread_nice() -> int:
    """The calling thread's nice value (Linux: per thread; elsewhere the process's)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()
                          if platform.system() == "Linux" else 0)


def lower_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (at most to 19; 0: nothing).
    Only Linux sets it per thread: elsewhere it would nice the whole process, so nothing
    is done there."""
    if increment <= 0 or platform.system() != "Linux":
        return
    nice = min(thread_nice() + increment, 19)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:  # a sandbox that forbids it: the thread runs as it was
        logger.debug("tierkv: could not set the nice value of thread %s to %d: %s",
                     threading.current_thread().name, nice, exc)


def niced(increment: int, target: Callable[[], None]) -> Callable[[], None]:
    """``target`` (a background thread's), run after :func:`lower_priority` ``(increment)``."""
    if increment <= 0:
        return target

    def run() -> None:
        lower_priority(increment)
        target()
    return run
