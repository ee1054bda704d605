"""How bench_ttft.py and bench_restart.py make a tier's files cold: drop those files' pages
(``posix_fadvise(DONTNEED)``, no root needed, the rest of a shared machine's page cache
left alone), or the whole page cache (``/proc/sys/vm/drop_caches``, root outside a
container)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path


def drop_file_pages(paths: Iterable[Path]) -> None:
    """Drop the pages of ``paths`` from the page cache, each file's dirty pages written
    first (they cannot be dropped). Pages a process has mapped stay resident."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_caches(what: str = "1") -> None:
    """``sync`` and write ``what`` to drop_caches: 1 the page cache, 3 also dentries and
    inodes. Raises OSError where that is not allowed."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text(f"{what}\n")


def cold_method(wanted: str) -> str:
    """``wanted`` (``fadvise``, ``drop_caches`` or another a script knows), or ``fadvise``
    where ``drop_caches`` is not allowed here (not root, or a container's read-only
    /proc/sys)."""
    if wanted != "drop_caches":
        return wanted
    try:
        drop_caches()
        return wanted
    except OSError as exc:
        print(f"--cold drop_caches: not allowed here ({exc}); using fadvise", file=sys.stderr)
        return "fadvise"
