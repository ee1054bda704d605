"""JobLedger: the job ids one worker-side component was given, and which of them finished.

Both transfer engines, TierIO and the JobExecutor keep one (why: docs/design.md).

Primitives and their contracts (not thread-safe: the owner holds its lock around calls):
- ``add(job_id, record)``: a submitted job and the owner's record of it. An id is taken
  once: a live or remembered id raises :class:`TransferError`; ``check_new(job_id)``
  raises the same without adding. ``record(job_id)``: the live record or None.
- ``finish(job_id)``: the job finished (the owner decides when: threads when the job ran,
  CUDA and the executor when a poll saw it). Remembered compactly: every id below a floor
  (dense ids), plus at most ``remember`` finished ids above it, the oldest forgotten first.
- ``job_id in ledger``: live or remembered; ``is_finished(job_id)``; ``live_ids()``;
  ``live_items()``: each live id with its record.
- ``pending(job_ids)``: the live records among ``job_ids``, finished ones skipped. An id
  never submitted raises :class:`UnknownJobError`: a wait before its submit is the race
  tierkv exists to prevent (a flush waiting on a store that was never started).
- ``wait(cond, job_ids, timeout=None)``: with ``cond`` held (notified by whoever calls
  ``finish``), block until all of ``job_ids`` finished; unknown ids raise as in
  ``pending``, an expired timeout raises :class:`JobTimeoutError`, which
  ``timed_out(job_ids, timeout)`` builds for owners that wait otherwise (CUDA events).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

from tierkv.core.jobs import JobId
from tierkv.errors import ConfigError, JobTimeoutError, TransferError, UnknownJobError

REMEMBER_FINISHED = 1 << 16

RecordT = TypeVar("RecordT")


class JobLedger(Generic[RecordT]):
    """Live jobs with their records, and the finished ones; see the module docstring."""

    def __init__(self, component: str, remember: int = REMEMBER_FINISHED) -> None:
        if remember < 0:
            raise ConfigError(f"{component}: remember_finished must be >= 0, got {remember}")
        self.component = component
        self._live: dict[JobId, RecordT] = {}
        self._floor = 1  # every id in [1, floor) finished
        # The other finished ids still remembered, oldest first (an OrderedDict forgets
        # its oldest in O(1); a plain dict's first key is found by a scan).
        self._finished: OrderedDict[JobId, None] = OrderedDict()
        self._remember = remember

    def __contains__(self, job_id: JobId) -> bool:
        return job_id in self._live or self.is_finished(job_id)

    def check_new(self, job_id: JobId) -> None:
        if job_id in self:
            raise TransferError(f"{self.component}: job {job_id} was already submitted; job "
                                f"ids are never reused (allocate them with JobIds)")

    def add(self, job_id: JobId, record: RecordT) -> None:
        self.check_new(job_id)
        self._live[job_id] = record

    def record(self, job_id: JobId) -> RecordT | None:
        return self._live.get(job_id)

    def finish(self, job_id: JobId) -> None:
        self._live.pop(job_id, None)
        finished = self._finished
        if job_id != self._floor:
            finished[job_id] = None
            if len(finished) > self._remember:
                finished.popitem(last=False)
            return
        floor = job_id + 1
        while floor in finished:
            del finished[JobId(floor)]
            floor += 1
        self._floor = floor

    def is_finished(self, job_id: JobId) -> bool:
        return 1 <= job_id < self._floor or job_id in self._finished

    def live_ids(self) -> list[JobId]:
        return list(self._live)

    def live_items(self) -> list[tuple[JobId, RecordT]]:
        return list(self._live.items())

    def pending(self, job_ids: Iterable[JobId]) -> dict[JobId, RecordT]:
        live, pending = self._live, {}
        for job_id in job_ids:
            if job_id in live:
                pending[job_id] = live[job_id]
            elif not self.is_finished(job_id):
                raise UnknownJobError(
                    f"{self.component}: wait on job {job_id}, which was never submitted "
                    f"(submit every pending store before waiting on it)")
        return pending

    def wait(self, cond: threading.Condition, job_ids: Iterable[JobId],
             timeout: float | None = None) -> None:
        pending, live = self.pending(job_ids), self._live
        if not cond.wait_for(lambda: live.keys().isdisjoint(pending), timeout):
            raise self.timed_out([job_id for job_id in pending if job_id in live], timeout)

    def timed_out(self, job_ids: Iterable[JobId], timeout: float | None) -> JobTimeoutError:
        return JobTimeoutError(f"{self.component}: job(s) {sorted(job_ids)} still running after "
                               f"{timeout} s (wait longer, or without a timeout; a job that "
                               f"never ends points at a stuck copy or disk thread)")
