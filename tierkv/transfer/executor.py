"""JobExecutor: the worker side's transfer handler. It runs job specs, decides nothing.

Primitives:
- ``submit(spec)``: StoreSpec -> GPU->CPU copy; SpillSpec -> disk writer thread;
  LoadSpec -> (disk reader thread for ``from_disk`` chunks, then) CPU->GPU copy.
  Returns at once.
- ``poll_finished()``: every finished job exactly once (plain :class:`Completion`s).
- ``wait(job_ids)``: blocks until those jobs finished. Waiting on a job id that was never
  submitted raises: a wait must follow its submit (the race tierkv exists to prevent).
- ``shutdown()``: finish what was submitted, flush the disk tier, stop threads.

It lives with the code that moves bytes (transfer/); engine/ only orchestrates.

A load with disk chunks is chained: the reader thread fills the slots, then submits the
CPU->GPU copy of the chunks that landed; missing or corrupt chunks are reported as failed
keys of the same job, so the engine recomputes them and never sees a false hit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from tierkv.core.jobs import (
    Completion,
    JobId,
    JobKind,
    JobSpec,
    LoadSpec,
    SpillSpec,
    StoreSpec,
    failed_set,
)
from tierkv.errors import BrokenError, ClosedError, TierKVError
from tierkv.transfer.base import TransferEngine
from tierkv.transfer.disk_io import DiskIO, ReadOutcome

log = logging.getLogger(__name__)


class _ChainedLoad:
    """A load whose disk part runs first; filled in by the reader thread."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self.read_done = threading.Event()
        self.submitted_copy = False
        self.failed: tuple[bytes, ...] = ()
        self.corrupt: tuple[bytes, ...] = ()
        self.missing: tuple[bytes, ...] = ()  # not on disk at all (not a tier failure)
        self.read_bytes = 0
        self.read_seconds = 0.0


class JobExecutor:
    def __init__(self, transfer: TransferEngine, disk_io: DiskIO | None = None) -> None:
        self.transfer = transfer
        self.disk_io = disk_io
        self._kinds: dict[JobId, JobKind] = {}
        self._chained: dict[JobId, _ChainedLoad] = {}
        self._direct: list[Completion] = []  # chained loads where nothing was left to copy
        self._lock = threading.Lock()
        self._closed = False
        # Finished job ids, kept compact: every id below _floor has finished.
        self._finished: set[JobId] = set()
        self._floor = 1
        self._failed_now: set[JobId] = set()  # spills failed at submit (their disk broke)

    # ------------------------------------------------------------------ submit
    def submit(self, spec: JobSpec) -> None:
        if self._closed:
            raise ClosedError("worker: job submitted after shutdown")
        self._kinds[spec.job_id] = spec.kind
        if isinstance(spec, StoreSpec):
            self.transfer.submit_store(spec)
        elif isinstance(spec, SpillSpec):
            if self.disk_io is None:
                raise TierKVError("worker: spill job without a disk tier (set disk.path)")
            try:
                self.disk_io.submit_spill(spec)
            except (BrokenError, ClosedError) as exc:
                # The engine never fails because its cache did: a broken disk tier fails
                # its spills like a full one (counted, backed off, chunks stay in the CPU
                # tier or are dropped), and the error is logged once per job.
                keys = tuple(key for key, _ in spec.writes)
                log.warning("worker: disk tier unusable, spill job %s failed: %s", spec.job_id, exc)
                with self._lock:
                    self._direct.append(Completion(spec.job_id, ok=False, failed_keys=keys,
                                                   full_keys=keys, error=str(exc)))
                    self._failed_now.add(spec.job_id)
        elif not any(chunk.from_disk for chunk in spec.chunks):
            self.transfer.submit_load(spec)
        else:
            self._submit_chained_load(spec)

    def _submit_chained_load(self, spec: LoadSpec) -> None:
        if self.disk_io is None:
            raise TierKVError("worker: load from disk without a disk tier (set disk.path)")
        chained = _ChainedLoad(tuple(c.key for c in spec.chunks))
        with self._lock:
            self._chained[spec.job_id] = chained
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

    # ------------------------------------------------------------------ completions
    def _merge(self, job_id: JobId, copy: Completion | None, chained: _ChainedLoad) -> Completion:
        copied_failed: tuple[bytes, ...] = ()
        if copy is not None:
            copied = tuple(k for k in chained.keys if k not in chained.failed)
            copied_failed = tuple(failed_set(copy, copied))
        failed = chained.failed + copied_failed
        ok = not failed
        error = copy.error if copy else None
        if chained.corrupt and not error:
            error = f"{len(chained.corrupt)} chunk(s) failed their checksum on disk"
        return Completion(
            job_id=job_id,
            ok=ok,
            num_bytes=(copy.num_bytes if copy else 0) + chained.read_bytes,
            seconds=(copy.seconds if copy else 0.0) + chained.read_seconds,
            failed_keys=failed,
            corrupt_keys=chained.corrupt,
            error=error,
            missing_keys=chained.missing,
        )

    def poll_finished(self) -> list[Completion]:
        finished: list[Completion] = []
        with self._lock:
            finished.extend(self._direct)
            self._direct.clear()
        for completion in self.transfer.poll_finished():
            with self._lock:
                chained = self._chained.pop(completion.job_id, None)
            if chained is not None:
                completion = self._merge(completion.job_id, completion, chained)
            finished.append(completion)
        if self.disk_io is not None:
            finished.extend(self.disk_io.poll_finished())
        for completion in finished:
            self._kinds.pop(completion.job_id, None)
            with self._lock:
                self._chained.pop(completion.job_id, None)
                self._failed_now.discard(completion.job_id)
            self._mark_finished(completion.job_id)
        return finished

    def _mark_finished(self, job_id: JobId) -> None:
        self._finished.add(job_id)
        while self._floor in self._finished:
            self._finished.discard(JobId(self._floor))
            self._floor += 1

    def has_finished(self, job_id: JobId) -> bool:
        return job_id < self._floor or job_id in self._finished

    def wait(self, job_ids: Iterable[JobId]) -> None:
        for job_id in job_ids:
            kind = self._kinds.get(job_id)
            if kind is None:
                if self.has_finished(job_id):
                    continue
                raise TierKVError(
                    f"worker: wait on job {job_id}, which was never submitted "
                    "(submit every pending store before waiting on it)"
                )
            if kind is JobKind.SPILL:
                assert self.disk_io is not None
                with self._lock:
                    failed_now = job_id in self._failed_now
                if not failed_now:
                    self.disk_io.wait([job_id])
            else:
                with self._lock:
                    chained = self._chained.get(job_id)
                if chained is not None:
                    chained.read_done.wait()
                    if not chained.submitted_copy:
                        continue
                self.transfer.wait([job_id])

    def in_flight_ids(self) -> list[JobId]:
        return list(self._kinds)

    def shutdown(self) -> None:
        """Wait for the jobs in flight, then stop the threads; the threads stop even when a
        wait fails (the error is logged)."""
        if self._closed:
            return
        try:
            self.wait(list(self._kinds))
        except TierKVError as exc:
            log.warning("worker: shutting down with jobs that failed to finish: %s", exc)
        finally:
            self._closed = True
            try:
                if self.disk_io is not None:
                    self.disk_io.shutdown()
            finally:
                self.transfer.shutdown()
