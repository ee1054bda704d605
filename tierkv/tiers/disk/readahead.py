"""Read-ahead advice on the map of a disk-tier shard's ``data.mdb`` (``madvise``).

:func:`random_access` turns the map's read-ahead off (``MADV_RANDOM``) within and back on
(``MADV_NORMAL``) after, so walking the index (or the meta records, at open) reads the
pages it touches, not megabytes around each; loads need read-ahead (py-lmdb touches every
page of a value, with the GIL released, before it is copied). :func:`map_span` finds the
map of an open ``data.mdb`` in ``/proc/self/maps``. Where madvise or the map cannot be
found (not Linux), nothing is advised.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

__all__ = ["map_span", "random_access"]

_MADV_NORMAL, _MADV_RANDOM = 0, 1  # <sys/mman.h>


def _load_madvise() -> Callable[[int, int, int], int] | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise() if sys.platform == "linux" else None


@contextmanager
def random_access(data_fd: int | None) -> Iterator[None]:
    """Within: no read-ahead on the map of the ``data.mdb`` open as ``data_fd`` (see the
    module docstring); a no-op where the map cannot be found."""
    span = map_span(data_fd)
    if span is None or _madvise is None or _madvise(span[0], span[1], _MADV_RANDOM):
        yield
        return
    try:
        yield
    finally:
        _madvise(span[0], span[1], _MADV_NORMAL)


def map_span(data_fd: int | None) -> tuple[int, int] | None:
    """(start, length) of the map of the ``data.mdb`` open as ``data_fd``."""
    with suppress(OSError, ValueError):
        inode = os.fstat(data_fd).st_ino if data_fd is not None else None
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if inode and len(fields) == 6 and int(fields[4]) == inode \
                        and int(fields[2], 16) == 0 \
                        and fields[5].strip().endswith(b"/data.mdb"):
                    start, end = (int(part, 16) for part in fields[0].split(b"-"))
                    return start, end - start
    return None
