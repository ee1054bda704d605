"""The remote tier's part of the block index: what it remembers about chunks held remotely.

- ``marks``: chunks the remote tier had (key -> when it answered), oldest first. Until
  ``seconds`` pass a mark counts as a hit; at most ``limit`` are kept (the oldest go first).
- ``gone``: chunks whose remote load failed (key -> when): not noted again for as long, so
  a phantom is never a hit twice, and never a loop.

``marks`` is a plain dict on purpose: :class:`~tierkv.core.index.BlockIndex` holds it as an
attribute of its own and reads it inline in ``lookup`` and ``prepare_load`` (no method call
per key on the hot path). It is only ever mutated in place, never rebound.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

from tierkv.core.policy import require


class RemoteMarks:
    __slots__ = ("seconds", "limit", "marks", "gone", "_clock")

    def __init__(self, seconds: float, limit: int, clock: Callable[[], float]) -> None:
        self.seconds = seconds
        self.limit = limit
        self._clock = clock
        self.marks: dict[bytes, float] = {}
        self.gone: dict[bytes, float] = {}

    def __len__(self) -> int:
        """Marks held (aged ones stay until the next ``note`` drops them)."""
        return len(self.marks)

    def note(self, keys: Iterable[bytes], held: Container[bytes]) -> int:
        """Mark ``keys`` as on the remote tier now, skipping those in ``held`` (the index's
        own chunks) and those whose remote load failed lately; drop aged marks and the
        oldest over the limit. Returns how many were noted."""
        now = self._clock()
        marks, gone = self.marks, self.gone
        since = now - self.seconds
        while gone and next(iter(gone.values())) < since:
            del gone[next(iter(gone))]
        noted = 0
        for key in keys:
            if key in held or key in gone:
                continue
            marks.pop(key, None)  # re-inserted: the newest
            marks[key] = now
            noted += 1
        while marks and (len(marks) > self.limit or next(iter(marks.values())) < since):
            del marks[next(iter(marks))]
        return noted

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is noted on the remote tier (and not too long ago)."""
        seen = self.marks.get(key)
        return seen is not None and seen >= self._clock() - self.seconds

    def failed(self, key: bytes) -> None:
        """A remote load of ``key`` failed: not noted again for ``seconds``."""
        self.gone.pop(key, None)
        self.gone[key] = self._clock()

    def check(self) -> None:
        require(len(self.marks) <= self.limit, f"{len(self.marks)} remote marks")


__all__ = ["RemoteMarks"]
