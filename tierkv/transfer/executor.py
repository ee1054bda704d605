"""JobExecutor: the worker side's transfer handler. It runs job specs, decides nothing.

Primitives:
- ``submit(spec)``: StoreSpec -> GPU->CPU copy; SpillSpec -> disk writer thread;
  LoadSpec -> (disk reader threads for ``from_disk`` chunks, then) CPU->GPU copy of the
  chunks that landed; missing or corrupt ones are failed keys of the same job, so the
  engine recomputes them and never sees a false hit. Returns at once.
- ``poll_finished()``: every finished job exactly once (plain :class:`Completion`s).
- ``wait(job_ids)``: blocks until those jobs finished; a job already polled has finished.
  Job ids follow :mod:`tierkv.transfer.ledger` (reuse raises :class:`TransferError`, a
  wait before its submit :class:`UnknownJobError`); a job id's record is what to wait on
  (the transfer engine, the disk threads, a chained load, or nothing: a spill refused by
  a broken disk tier has its failed completion ready).
- ``in_flight_ids()``: jobs submitted and not yet polled.
- ``shutdown()``: finish what was submitted, flush the disk tier, stop threads.
Called from one thread (the worker's); reader threads only run chained loads' steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Protocol

from tierkv.core.jobs import Completion, JobId, JobSpec, LoadSpec, SpillSpec, StoreSpec, failed_set
from tierkv.errors import BrokenError, ClosedError, TierKVError, UsageError
from tierkv.transfer.base import TransferEngine
from tierkv.transfer.disk_io import DiskIO, ReadOutcome
from tierkv.transfer.ledger import JobLedger

log = logging.getLogger(__name__)


class _Waiter(Protocol):
    def wait(self, job_ids: Iterable[JobId]) -> None: ...


class _ChainedLoad:
    """A load whose disk part runs first; filled in by a reader thread."""

    def __init__(self, keys: tuple[bytes, ...], transfer: TransferEngine) -> None:
        self.keys = keys
        self.transfer = transfer
        self.read_done = threading.Event()
        self.submitted_copy = False
        self.failed: tuple[bytes, ...] = ()
        self.corrupt: tuple[bytes, ...] = ()
        self.missing: tuple[bytes, ...] = ()  # not on disk at all (not a tier failure)
        self.read_bytes = 0
        self.read_seconds = 0.0

    def wait(self, job_ids: Iterable[JobId]) -> None:
        self.read_done.wait()
        if self.submitted_copy:
            self.transfer.wait(job_ids)


class JobExecutor:
    def __init__(self, transfer: TransferEngine, disk_io: DiskIO | None = None) -> None:
        self.transfer = transfer
        self.disk_io = disk_io
        self._ledger: JobLedger[_Waiter | None] = JobLedger("worker")
        self._direct: list[Completion] = []  # completions ready at once (see _start)
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ submit
    def submit(self, spec: JobSpec) -> None:
        if self._closed:
            raise ClosedError("worker: job submitted after shutdown")
        self._ledger.check_new(spec.job_id)  # a reused id raises before anything runs
        self._ledger.add(spec.job_id, self._start(spec))

    def _start(self, spec: JobSpec) -> _Waiter | None:
        """Start ``spec``; what to wait on for it (None: its completion is ready)."""
        if isinstance(spec, StoreSpec):
            self.transfer.submit_store(spec)
            return self.transfer
        if isinstance(spec, SpillSpec):
            if self.disk_io is None:
                raise UsageError("worker: spill job without a disk tier (set disk.path)")
            try:
                self.disk_io.submit_spill(spec)
                return self.disk_io
            except (BrokenError, ClosedError) as exc:
                # The engine never fails because its cache did: a broken disk tier fails
                # its spills like a full one (counted, backed off, chunks stay in the CPU
                # tier or are dropped), and the error is logged once per job.
                keys = tuple(key for key, _ in spec.writes)
                log.warning("worker: disk tier unusable, spill job %s failed: %s", spec.job_id, exc)
                with self._lock:
                    self._direct.append(Completion(spec.job_id, ok=False, failed_keys=keys,
                                                   full_keys=keys, error=str(exc)))
                return None
        if not any(chunk.from_disk for chunk in spec.chunks):
            self.transfer.submit_load(spec)
            return self.transfer
        return self._submit_chained_load(spec)

    def _submit_chained_load(self, spec: LoadSpec) -> _ChainedLoad:
        if self.disk_io is None:
            raise UsageError("worker: load from disk without a disk tier (set disk.path)")
        chained = _ChainedLoad(tuple(c.key for c in spec.chunks), self.transfer)
        disk_chunks = [c for c in spec.chunks if c.from_disk]

        def on_done(outcome: ReadOutcome) -> None:
            bad = set(outcome.missing_keys) | set(outcome.corrupt_keys) | set(outcome.failed_keys)
            if outcome.error is not None and not bad:  # failed as a whole: nothing landed
                bad = {c.key for c in disk_chunks}
            landed = tuple(c for c in spec.chunks if c.key not in bad)
            with self._lock:
                chained.failed = tuple(k for k in chained.keys if k in bad)
                chained.corrupt = tuple(outcome.corrupt_keys)
                tier_failed = set(outcome.failed_keys)
                chained.missing = tuple(k for k in outcome.missing_keys if k not in tier_failed)
                chained.read_bytes = outcome.num_bytes
                chained.read_seconds = outcome.seconds
                chained.submitted_copy = bool(landed)
                if not landed:
                    self._direct.append(self._merge(spec.job_id, None, chained))
            try:
                if landed:
                    self.transfer.submit_load(LoadSpec(spec.job_id, landed))
            finally:
                chained.read_done.set()

        try:
            self.disk_io.submit_read(spec.job_id, disk_chunks, on_done)
        except (BrokenError, ClosedError) as exc:  # a broken disk tier: those chunks miss
            keys = tuple(c.key for c in disk_chunks)
            log.warning("worker: disk tier unusable, load job %s reads nothing: %s", spec.job_id, exc)
            on_done(ReadOutcome(spec.job_id, (), keys, (), 0, 0.0, failed_keys=keys, error=str(exc)))
        return chained

    # ------------------------------------------------------------------ completions
    def _merge(self, job_id: JobId, copy: Completion | None, chained: _ChainedLoad) -> Completion:
        failed = chained.failed
        if copy is not None:
            copied = tuple(k for k in chained.keys if k not in chained.failed)
            failed += tuple(failed_set(copy, copied))
        error = copy.error if copy else None
        if chained.corrupt and not error:
            error = f"{len(chained.corrupt)} chunk(s) failed their checksum on disk"
        return Completion(
            job_id, not failed, (copy.num_bytes if copy else 0) + chained.read_bytes,
            (copy.seconds if copy else 0.0) + chained.read_seconds, failed_keys=failed,
            corrupt_keys=chained.corrupt, error=error, missing_keys=chained.missing)

    def poll_finished(self) -> list[Completion]:
        with self._lock:
            finished, self._direct = self._direct, []
        for completion in self.transfer.poll_finished():
            chained = self._ledger.record(completion.job_id)
            if isinstance(chained, _ChainedLoad):
                completion = self._merge(completion.job_id, completion, chained)
            finished.append(completion)
        if self.disk_io is not None:
            finished.extend(self.disk_io.poll_finished())
        for completion in finished:
            self._ledger.finish(completion.job_id)
        return finished

    def wait(self, job_ids: Iterable[JobId]) -> None:
        for job_id, waiter in self._ledger.pending(job_ids).items():
            if waiter is not None:
                waiter.wait([job_id])

    def in_flight_ids(self) -> list[JobId]:
        return self._ledger.live_ids()

    def shutdown(self) -> None:
        """Wait for the jobs in flight, then stop the threads; the threads stop even when a
        wait fails (the error is logged)."""
        if self._closed:
            return
        try:
            self.wait(self._ledger.live_ids())
        except TierKVError as exc:
            log.warning("worker: shutting down with jobs that failed to finish: %s", exc)
        finally:
            self._closed = True
            try:
                if self.disk_io is not None:
                    self.disk_io.shutdown()
            finally:
                self.transfer.shutdown()
