"""The readers/writer guard of one LMDB environment of the disk tier.

:class:`Guard` gives ordinary calls a shared section (``enter``/``leave``: one plain lock
each way, the read path's cost) and gives what swaps or resizes the environment underneath
them an exclusive one (``exclusive()``: no call in flight). :class:`~tierkv.tiers.disk.env.
LmdbEnv` runs every call in the shared section and deals with damage, a map another
process grew and a full reader table in the exclusive one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Guard"]


class Guard:
    """Shared sections for ordinary calls (``enter``/``leave``: one plain lock each way, the
    read path's cost); an exclusive one (no call in flight) to swap or resize the
    environment underneath them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._shared = 0
        self._exclusive = False

    def enter(self) -> None:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1

    def leave(self) -> None:
        with self._lock:
            self._shared -= 1
            if self._exclusive and not self._shared:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._lock:
                self._exclusive = False
                self._cond.notify_all()
