"""JobExecutor: the worker side's transfer handler. It runs job specs, decides nothing.

Primitives:
- ``submit(spec)``: StoreSpec -> GPU->CPU copy; SpillSpec -> disk writer thread;
  LoadSpec -> (disk reader threads for ``from_disk`` chunks, remote reader threads for
  ``from_remote`` ones, then) CPU->GPU copy of the chunks that landed; missing or corrupt
  ones are failed keys of the same job, so the engine recomputes them and never sees a
  false hit. Returns at once.
- Pushes to the remote tier (``pusher``, a :class:`~tierkv.tiers.remote.pushes.RemoteIO`):
  as a store job's chunks land in their slots (``push_on="on_store"``) or as a spill job's
  land on disk (``"on_evict"``), ``poll_finished`` queues a copy of each slot before it
  reports the job, so the slot is free to reuse once the job is reported.
- ``poll_finished()``: every finished job exactly once (plain :class:`Completion`s);
  ``poll_finished_jobs()``: the same, each with its job's spec (the worker's slot tracking
  reads what a finished job did from it).
- ``wait(job_ids)``: blocks until those jobs finished; a job already polled has finished.
  Job ids follow :mod:`tierkv.transfer.ledger` (reuse raises :class:`TransferError`, a
  wait before its submit :class:`UnknownJobError`); a job id's record is what to wait on
  (the transfer engine, the disk threads, a chained load, or nothing: a spill refused by
  a broken disk tier has its failed completion ready) and what to push when it lands.
- ``in_flight_ids()``: jobs submitted and not yet polled; ``submitted(job_id)``: the job
  was submitted (in flight, or finished: the ledger's memory of finished ids);
  ``jobs_touching(block_ids)``: the store and load jobs not yet polled that read or write
  any of those GPU blocks (the library store's ``fence()``).
- ``cut(job_id)``: a load past its deadline whose disk and remote reads are still running
  copies nothing to the GPU from then on (True); its reads finish into their slots and it
  completes as usual, its chunks landed in the CPU tier; ``wait`` on it returns at once
  (a fence need not wait: it touches no GPU block). False: its GPU copy is submitted (or
  it has no read): it lands as usual.
- ``shutdown()``: finish what was submitted, flush the disk tier, stop threads.
Called from one thread (the worker's); reader threads only run chained loads' steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Set
from functools import partial
from typing import Protocol

from tierkv.core.jobs import (ChunkCopy, Completion, JobId, JobKind, JobSpec, LoadSpec, SpillSpec,
                              TierRead,
                              StoreSpec, failed_set)
from tierkv.errors import BrokenError, ClosedError, TierKVError, UsageError
from tierkv.transfer.base import TransferEngine
from tierkv.transfer.tier_io import TierIO, ReadOutcome
from tierkv.transfer.ledger import JobLedger
from tierkv.tiers.remote.pushes import RemoteIO

log = logging.getLogger(__name__)


class _Waiter(Protocol):
    def wait(self, job_ids: Iterable[JobId]) -> None: ...


class _Live:
    """The executor's record of a job in flight: its spec, what to wait on (None: its
    completion is ready), whether its chunks are pushed once they land, and the GPU blocks
    it reads or writes (``jobs_touching``: worked out on its first call, then kept)."""

    __slots__ = ("spec", "waiter", "push", "blocks")

    def __init__(self, spec: JobSpec, waiter: _Waiter | None, push: bool) -> None:
        self.spec = spec
        self.waiter = waiter
        self.push = push
        self.blocks: frozenset[int] | None = None


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
        self.reads: tuple[TierRead, ...] = ()  # what each lower tier read, for its path
        self.read_seconds = 0.0
        self.decided = False  # its reads finished and its copy was decided (under the lock)
        self.cut = False  # cut at its deadline (JobExecutor.cut): nothing is copied

    def wait(self, job_ids: Iterable[JobId]) -> None:
        if self.cut:  # it touches no GPU block: a fence need not wait for its reads
            return
        self.read_done.wait()
        if self.submitted_copy:
            self.transfer.wait(job_ids)


class JobExecutor:
    def __init__(self, transfer: TransferEngine, disk_io: TierIO | None = None, *,
                 remote_io: TierIO | None = None, pusher: RemoteIO | None = None,
                 push_on: str = "on_store") -> None:
        self.transfer = transfer
        self.disk_io = disk_io
        self.remote_io = remote_io  # reads of the remote tier
        self.pusher = pusher
        self._push_kind = {"on_store": StoreSpec, "on_evict": SpillSpec}.get(push_on)
        self._ledger: JobLedger[_Live] = JobLedger("worker")
        self._direct: list[Completion] = []  # completions ready at once (see _start)
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ submit
    def submit(self, spec: JobSpec) -> None:
        if self._closed:
            raise ClosedError("worker: job submitted after shutdown")
        self._ledger.check_new(spec.job_id)  # a reused id raises before anything runs
        push = self.pusher is not None and type(spec) is self._push_kind
        self._ledger.add(spec.job_id, _Live(spec, self._start(spec), push))

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
                    self._direct.append(Completion(spec.job_id, spec.kind, ok=False,
                                                   failed_keys=keys, full_keys=keys,
                                                   error=str(exc)))
                return None
        if not any(chunk.from_disk or chunk.from_remote for chunk in spec.chunks):
            self.transfer.submit_load(spec)
            return self.transfer
        return self._submit_chained_load(spec)

    def _submit_chained_load(self, spec: LoadSpec) -> _ChainedLoad:
        """Read the job's disk and remote chunks into their slots (in parallel), then copy
        the chunks that landed to the GPU."""
        reads = [(io, name, chunks) for io, name, chunks in (
            (self.disk_io, "disk", tuple(c for c in spec.chunks if c.from_disk)),
            (self.remote_io, "remote", tuple(c for c in spec.chunks if c.from_remote)))
            if chunks]
        for io, name, _ in reads:
            if io is None:
                raise UsageError(f"worker: load from the {name} tier without one (set "
                                 f"{'disk.path' if name == 'disk' else 'remote'})")
        chained = _ChainedLoad(tuple(c.key for c in spec.chunks), self.transfer)
        outcomes: list[tuple[tuple[ChunkCopy, ...], ReadOutcome]] = []
        tiers: list[str] = []

        def on_done(name: str, chunks: tuple[ChunkCopy, ...], outcome: ReadOutcome) -> None:
            with self._lock:
                outcomes.append((chunks, outcome))
                tiers.append(name)
                if len(outcomes) < len(reads):
                    return
            bad: set[bytes] = set()
            missing: list[bytes] = []
            corrupt: list[bytes] = []
            for part, read in outcomes:
                failed = set(read.missing_keys) | set(read.corrupt_keys) | set(read.failed_keys)
                if read.error is not None and not failed:  # failed as a whole
                    failed = {c.key for c in part}
                bad |= failed
                corrupt += read.corrupt_keys
                tier_failed = set(read.failed_keys)
                missing += (k for k in read.missing_keys if k not in tier_failed)
            landed = tuple(c for c in spec.chunks if c.key not in bad)
            with self._lock:
                chained.decided = True
                if chained.cut:  # past its deadline: the slots hold the chunks, no copy
                    landed = ()
                chained.failed = tuple(k for k in chained.keys if k in bad)
                chained.corrupt = tuple(corrupt)
                chained.missing = tuple(missing)
                chained.reads = tuple(TierRead(tier, read.num_bytes, read.seconds)
                                      for tier, (_, read) in zip(tiers, outcomes))
                chained.read_seconds = max(read.seconds for _, read in outcomes)
                chained.submitted_copy = bool(landed)
                if not landed:
                    self._direct.append(self._merge(spec.job_id, None, chained))
            try:
                if landed:
                    self.transfer.submit_load(LoadSpec(spec.job_id, landed))
            finally:
                chained.read_done.set()

        for io, name, chunks in reads:
            assert io is not None
            try:
                io.submit_read(spec.job_id, chunks, partial(on_done, name, chunks))
            except (BrokenError, ClosedError) as exc:  # a broken tier: those chunks miss
                keys = tuple(c.key for c in chunks)
                log.warning("worker: %s tier unusable, load job %s reads nothing from it: %s",
                            name, spec.job_id, exc)
                on_done(name, chunks, ReadOutcome(spec.job_id, (), keys, (), 0, 0.0,
                                            failed_keys=keys, error=str(exc)))
        return chained

    # ------------------------------------------------------------------ completions
    def _merge(self, job_id: JobId, copy: Completion | None, chained: _ChainedLoad) -> Completion:
        failed = chained.failed
        if copy is not None:
            copied = tuple(k for k in chained.keys if k not in chained.failed)
            failed += tuple(failed_set(copy, copied))
        error = copy.error if copy else None
        if chained.corrupt and not error:
            error = f"{len(chained.corrupt)} chunk(s) failed their checks where they were read"
        return Completion(
            job_id, JobKind.LOAD, not failed, copy.num_bytes if copy else 0,
            (copy.seconds if copy else 0.0) + chained.read_seconds, failed_keys=failed,
            corrupt_keys=chained.corrupt, error=error, missing_keys=chained.missing,
            reads=chained.reads)

    def cut(self, job_id: JobId) -> bool:
        """See the module docstring: whether the load ``job_id`` copies nothing from now on."""
        live = self._ledger.record(job_id)
        chained = live.waiter if live is not None else None
        if not isinstance(chained, _ChainedLoad):
            return False
        with self._lock:
            if chained.decided:
                return False
            chained.cut = True
            return True

    def poll_finished(self) -> list[Completion]:
        return [completion for completion, _ in self.poll_finished_jobs()]

    def poll_finished_jobs(self) -> list[tuple[Completion, JobSpec | None]]:
        """``poll_finished()``, each completion with its job's spec."""
        with self._lock:
            finished, self._direct = self._direct, []
        ledger = self._ledger
        for completion in self.transfer.poll_finished():
            live = ledger.record(completion.job_id)
            if live is not None and isinstance(live.waiter, _ChainedLoad):
                completion = self._merge(completion.job_id, completion, live.waiter)
            finished.append(completion)
        if self.disk_io is not None:
            finished.extend(self.disk_io.poll_finished())
        jobs: list[tuple[Completion, JobSpec | None]] = []
        for completion in finished:
            live = ledger.record(completion.job_id)
            ledger.finish(completion.job_id)
            if live is None:
                jobs.append((completion, None))
                continue
            if live.push:
                self._push(completion, live.spec)
            jobs.append((completion, live.spec))
        return jobs

    def _push(self, completion: Completion, spec: JobSpec) -> None:
        """Queue copies of the landed chunks of a job that pushes (see the docstring)."""
        if self.pusher is None or isinstance(spec, LoadSpec):
            return
        chunks = tuple(zip(spec.keys, spec.slots)) if isinstance(spec, StoreSpec) else spec.writes
        failed = failed_set(completion, tuple(key for key, _ in chunks))
        slab, size = self.transfer.slab, self.pusher.tier.payload_bytes
        for key, slot in chunks:
            if key not in failed:
                self.pusher.push(key, slab.memoryview(slot)[:size])

    def wait(self, job_ids: Iterable[JobId]) -> None:
        for job_id, live in self._ledger.pending(job_ids).items():
            if live.waiter is not None:
                live.waiter.wait([job_id])

    def in_flight_ids(self) -> list[JobId]:
        return self._ledger.live_ids()

    def jobs_touching(self, block_ids: Set[int] | None) -> list[JobId]:
        """The store and load jobs not yet polled that read or write any of ``block_ids``
        (None: every one of them); spills touch no GPU block."""
        jobs = []
        for job_id, live in self._ledger.live_items():
            spec = live.spec
            if isinstance(spec, SpillSpec):
                continue
            if block_ids is None:
                jobs.append(job_id)
                continue
            blocks = live.blocks
            if blocks is None:
                blocks = live.blocks = frozenset(spec.block_ids) if isinstance(spec, StoreSpec) \
                    else frozenset(b for chunk in spec.chunks for b in chunk.block_ids)
            if not blocks.isdisjoint(block_ids):
                jobs.append(job_id)
        return jobs

    def submitted(self, job_id: JobId) -> bool:
        return job_id in self._ledger

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
                for io in (self.disk_io, self.remote_io, self.pusher):
                    if io is not None:
                        io.shutdown()
            finally:
                self.transfer.shutdown()
