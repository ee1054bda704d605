"""RemoteMarks: what this scheduler knows of the remote tier's chunks, in one place.

The one record of what the remote server holds (the block index keeps it as an attribute
of its own, and lives as long; the remote lookup keeps only answers no ask has taken yet,
and hands each one here, through :func:`tierkv.engine.tier_lookup.lookup_tiers`):

- ``marks``: chunks the remote tier had (key -> when it answered), oldest first. Until
  ``seconds`` pass a mark counts as a hit; at most ``limit`` are kept (the oldest go first).
- ``parts``: the part count each chunk was last found under (key -> count, oldest first,
  at most ``limit``): a load of another TP size's chunk reads it under that count; kept
  past the mark's promotion (the load needs it after ``prepare_load``).
- ``absent``: chunks the remote tier did not have (key -> when), not asked again for
  ``answer_seconds`` (a request waiting for GPU blocks is not asked about every step; a
  chunk another engine pushes is found that much later at most).
- ``gone``: chunks whose remote load failed (key -> when): not noted again for
  ``seconds``, so a phantom is never a hit twice, and never a loop.

``marks`` is a plain dict on purpose: :class:`~tierkv.core.index.BlockIndex` reads it
inline in ``lookup`` and ``prepare_load`` (no method call per key on the hot path). It is
only ever mutated in place, never rebound.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping

from tierkv.core.policy import require

ANSWER_SECONDS = 0.05  # how long an "absent" answer is kept (docs/benchmarks/remote.md)


class RemoteMarks:
    __slots__ = ("seconds", "limit", "answer_seconds", "marks", "parts", "absent", "gone",
                 "_clock")

    def __init__(self, seconds: float, limit: int, clock: Callable[[], float],
                 answer_seconds: float = ANSWER_SECONDS) -> None:
        self.seconds = seconds
        self.limit = limit
        self.answer_seconds = answer_seconds
        self._clock = clock
        self.marks: dict[bytes, float] = {}
        self.parts: dict[bytes, int] = {}
        self.absent: dict[bytes, float] = {}
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

    def answered(self, answers: Mapping[bytes, int]) -> None:
        """The remote tier's answers (key -> the part count found under, 0: absent): the
        part counts kept, the absences kept ``answer_seconds`` (the presences are marked
        by ``note``, which knows what the index holds)."""
        now = self._clock()
        parts, absent = self.parts, self.absent
        since = now - self.answer_seconds
        while absent and next(iter(absent.values())) < since:
            del absent[next(iter(absent))]
        for key, count in answers.items():
            absent.pop(key, None)  # re-inserted: the newest
            parts.pop(key, None)
            if count:
                parts[key] = count
            else:
                absent[key] = now
        for table in (parts, absent):
            while len(table) > self.limit:
                del table[next(iter(table))]

    def absent_lately(self, key: bytes) -> bool:
        """Whether the remote tier lacked ``key`` less than ``answer_seconds`` ago."""
        seen = self.absent.get(key)
        return seen is not None and seen >= self._clock() - self.answer_seconds

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is noted on the remote tier (and not too long ago)."""
        seen = self.marks.get(key)
        return seen is not None and seen >= self._clock() - self.seconds

    def count_of(self, key: bytes) -> int:
        """The part count ``key`` was last found under (0: never found)."""
        return self.parts.get(bytes(key), 0)

    def failed(self, key: bytes) -> None:
        """A remote load of ``key`` failed: not noted again for ``seconds``."""
        self.gone.pop(key, None)
        self.gone[key] = self._clock()

    def check(self) -> None:
        require(len(self.marks) <= self.limit, f"{len(self.marks)} remote marks")


__all__ = ["ANSWER_SECONDS", "RemoteMarks"]
