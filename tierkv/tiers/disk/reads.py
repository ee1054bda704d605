"""Payload reads of one disk tier, many in flight and bounded by bytes.

A cold load waits on the device: buffered ``pread`` on a few reader threads left it far
below what the device takes with more reads queued (docs/benchmarks/disk.md, "O_DIRECT
reads"). So a slot's payload is read with ``O_DIRECT`` straight into the caller's buffer
(the CPU slot: page-aligned) in pieces (:meth:`ReadPool.piece_for`), which a pool of
threads shared by every shard of the tier reads at once. What bounds them is the bytes in
flight (``disk.read_bytes_in_flight``), not a thread count: a large chunk fills the queue
by itself, and many small ones share it.

- :class:`ReadPool` ``(bytes_in_flight)``: :meth:`~ReadPool.submit` starts ``(bytes,
  call)`` pairs on its threads, waiting while the bytes in flight would pass the bound (one
  piece larger than the bound runs alone); :meth:`~ReadPool.gather` returns the calls'
  results once every one has finished (the first error is raised after all have).
  :meth:`~ReadPool.close` stops the threads. A caller that keeps many chunks started
  (:mod:`tierkv.tiers.disk.many`) holds them under the same bound and says how deep it went
  (:meth:`~ReadPool.note_started`, :attr:`~ReadPool.deepest`).
- :meth:`ReadPool.piece_for` the piece size of a payload: a quarter of it, 4 KiB aligned,
  within [:data:`MIN_PIECE_BYTES`, :data:`MAX_PIECE_BYTES`].
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tierkv.tiers.disk.format import ALIGN

MIN_PIECE_BYTES = 128 << 10
MAX_PIECE_BYTES = 1 << 20
MAX_THREADS = 64  # reader threads of one tier at most, whatever the bound


class ReadPool:
    """The read threads of one tier and their bound; see the module docstring."""

    def __init__(self, bytes_in_flight: int) -> None:
        self.limit = bytes_in_flight
        self.threads = max(1, min(MAX_THREADS, bytes_in_flight // MIN_PIECE_BYTES))
        self._cond = threading.Condition()
        self._in_flight = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self.pieces = 0  # pieces read on the pool
        self.waits = 0  # pieces that waited for room under the bound
        self.deepest = 0  # most bytes one caller had started and not yet checked

    @staticmethod
    def piece_for(payload_bytes: int) -> int:
        quarter = -(-payload_bytes // 4 // ALIGN) * ALIGN
        return max(MIN_PIECE_BYTES, min(MAX_PIECE_BYTES, quarter))

    def _executor(self) -> ThreadPoolExecutor:
        with self._cond:
            if self._pool is None or os.getpid() != self._pid:
                self._pool = ThreadPoolExecutor(self.threads, "tierkv-disk-reader")
                self._pid = os.getpid()
            return self._pool

    def _take(self, size: int) -> None:
        with self._cond:
            if self._in_flight and self._in_flight + size > self.limit:
                self.waits += 1
                self._cond.wait_for(lambda: not self._in_flight
                                    or self._in_flight + size <= self.limit)
            self._in_flight += size
            self.pieces += 1

    def _give(self, size: int) -> None:
        with self._cond:
            self._in_flight -= size
            self._cond.notify_all()

    def _run_one(self, size: int, call: Callable[[], int]) -> int:
        try:
            return call()
        finally:
            self._give(size)

    def submit(self, calls: Sequence[tuple[int, Callable[[], int]]]) -> list[Future[int]]:
        """Start each ``(bytes, call)`` on the pool, waiting while the bytes in flight would
        pass the bound; :meth:`gather` their results."""
        executor = self._executor()
        futures: list[Future[int]] = []
        for size, call in calls:
            self._take(size)
            try:
                futures.append(executor.submit(self._run_one, size, call))
            except BaseException:
                self._give(size)
                self.gather(futures, raise_first=False)
                raise
        return futures

    @staticmethod
    def gather(futures: Sequence[Future[int]], raise_first: bool = True) -> list[int]:
        """The results of :meth:`submit`'s calls once every one has finished; the first
        error is raised then."""
        problem = None
        for future in futures:
            problem = problem or future.exception()
        if problem is not None and raise_first:
            raise problem
        return [future.result() for future in futures] if problem is None else []

    def note_started(self, num_bytes: int) -> None:
        """A caller has ``num_bytes`` started and not yet checked (:attr:`deepest`)."""
        if num_bytes > self.deepest:
            self.deepest = num_bytes

    def close(self) -> None:
        with self._cond:
            pool, self._pool = self._pool, None
        if pool is not None and os.getpid() == self._pid:
            pool.shutdown(wait=True)


__all__ = ["MAX_PIECE_BYTES", "MAX_THREADS", "MIN_PIECE_BYTES", "ReadPool"]
