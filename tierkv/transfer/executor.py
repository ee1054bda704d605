"""JobExecutor: the worker side's transfer handler. It runs job specs, decides nothing.

Primitives:
- ``submit(spec)``: each step of a job runs on the handler of its medium pair (the
  transfer table ``reads`` and ``transfer``): StoreSpec -> GPU->CPU copy; SpillSpec ->
  CPU->disk writer threads; LoadSpec -> disk->CPU reads of its ``from_disk`` chunks and
  remote->CPU reads of its ``from_remote`` ones (in parallel), chained with the CPU->GPU
  copy of the chunks that landed; missing or corrupt ones are failed keys of the same
  job, so the engine recomputes them and never sees a false hit. Returns at once.
  The chain is advanced by the executor on its caller's thread (``advance()``, and in
  ``poll_finished*``, ``wait``, ``cut``): a reader thread only finishes its read, it calls
  nothing here. A copy so starts at the caller's next call, not the moment the read ends;
  ``poll_finished*`` waits for the copies started since the last poll (a copy of the
  chunks just read: short), so a load whose reads ended during a step is reported at that
  step's poll, as it would be had its copy started at once, not one step later.
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
Called from one thread (the worker's); it holds no lock: no other thread touches its state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Set
from typing import Protocol

from tierkv.core.jobs import (ChunkCopy, Completion, JobId, JobKind, JobSpec, LoadSpec,
                              SpillSpec, StoreSpec, TierRead, failed_set)
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
    completion is ready, or it is a chained load), whether its chunks are pushed once they
    land, and the GPU blocks it reads or writes (``jobs_touching``: worked out on its first
    call, then kept)."""

    __slots__ = ("spec", "waiter", "push", "blocks")

    def __init__(self, spec: JobSpec, waiter: _Waiter | None, push: bool) -> None:
        self.spec = spec
        self.waiter = waiter
        self.push = push
        self.blocks: frozenset[int] | None = None


class _Chain:
    """A load whose chunks are read from lower tiers into their slots first (one read per
    source medium, in parallel), then copied to the GPU; advanced by the executor
    (:meth:`JobExecutor.advance`) on its caller's thread."""

    __slots__ = ("spec", "pending", "outcomes", "cut", "copying")

    def __init__(self, spec: LoadSpec, pending: dict[str, tuple[ChunkCopy, ...]]) -> None:
        self.spec = spec
        self.pending = pending  # the reads not in yet: source medium -> its chunks
        self.outcomes: list[tuple[str, tuple[ChunkCopy, ...], ReadOutcome]] = []
        self.cut = False  # cut at its deadline (JobExecutor.cut): nothing is copied
        self.copying = False  # its reads are in and its copy to the GPU was submitted

    def _bad(self) -> set[bytes]:
        """The keys that did not land in their slots."""
        bad: set[bytes] = set()
        for _, part, read in self.outcomes:
            failed = set(read.missing_keys) | set(read.corrupt_keys) | set(read.failed_keys)
            bad |= failed if read.error is None or failed else {c.key for c in part}
        return bad  # (an error naming no key: the read failed as a whole)

    def landed(self) -> tuple[ChunkCopy, ...]:
        """Its reads are all in: the chunks to copy to the GPU (none once cut: the slots
        hold the chunks, nothing is copied)."""
        bad = self._bad()
        return () if self.cut else tuple(c for c in self.spec.chunks if c.key not in bad)

    def merge(self, copy: Completion | None) -> Completion:
        """The load's completion: its reads' and (``copy``) its copy's."""
        bad = self._bad()
        failed = tuple(c.key for c in self.spec.chunks if c.key in bad)
        if copy is not None:
            copied = tuple(c.key for c in self.spec.chunks if c.key not in bad)
            failed += tuple(failed_set(copy, copied))
        reads = [read for _, _, read in self.outcomes]
        corrupt = tuple(key for read in reads for key in read.corrupt_keys)
        error = copy.error if copy else None
        if corrupt and not error:
            error = f"{len(corrupt)} chunk(s) failed their checks where they were read"
        return Completion(
            self.spec.job_id, JobKind.LOAD, not failed, copy.num_bytes if copy else 0,
            (copy.seconds if copy else 0.0) + max(read.seconds for read in reads),
            failed_keys=failed, corrupt_keys=corrupt, error=error,
            missing_keys=tuple(key for read in reads for key in read.missing_keys
                               if key not in read.failed_keys),  # not a tier failure
            reads=tuple(TierRead(medium, read.num_bytes, read.seconds)
                        for medium, _, read in self.outcomes))


class JobExecutor:
    def __init__(self, transfer: TransferEngine, disk_io: TierIO | None = None, *,
                 remote_io: TierIO | None = None, pusher: RemoteIO | None = None,
                 push_on: str = "on_store") -> None:
        self.transfer = transfer
        self.disk_io = disk_io
        self.remote_io = remote_io  # reads of the remote tier
        self.pusher = pusher
        # The transfer table: the handler of each (source, destination) medium pair.
        # GPU <-> CPU: the transfer engine; CPU -> disk: the disk tier's writers; a lower
        # tier -> CPU: its readers, chained with CPU -> GPU by the executor.
        self.reads: dict[str, TierIO] = {medium: io for medium, io in (
            ("disk", disk_io), ("remote", remote_io)) if io is not None}
        self._push_kind = {"on_store": StoreSpec, "on_evict": SpillSpec}.get(push_on)
        self._ledger: JobLedger[_Live] = JobLedger("worker")
        self._direct: list[Completion] = []  # completions ready at once (see _start)
        self._copying: list[JobId] = []  # chained loads' copies started since the last poll
        self._chains: dict[JobId, _Chain] = {}  # chained loads not yet polled
        self._closed = False

    # ------------------------------------------------------------------ submit
    def submit(self, spec: JobSpec) -> None:
        if self._closed:
            raise ClosedError("worker: job submitted after shutdown")
        self._ledger.check_new(spec.job_id)  # a reused id raises before anything runs
        push = self.pusher is not None and type(spec) is self._push_kind
        self._ledger.add(spec.job_id, _Live(spec, self._start(spec), push))

    def _start(self, spec: JobSpec) -> _Waiter | None:
        """Start ``spec``; what to wait on for it (None: its completion is ready, or it is
        a chained load)."""
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
                self._direct.append(Completion(spec.job_id, spec.kind, ok=False,
                                               failed_keys=keys, full_keys=keys,
                                               error=str(exc)))
                return None
        by_medium = {medium: chunks for medium, chunks in (
            ("disk", tuple(c for c in spec.chunks if c.from_disk)),
            ("remote", tuple(c for c in spec.chunks if c.from_remote))) if chunks}
        if not by_medium:
            self.transfer.submit_load(spec)
            return self.transfer
        for medium in by_medium:
            if medium not in self.reads:
                raise UsageError(f"worker: load from the {medium} tier without one (set "
                                 f"{'disk.path' if medium == 'disk' else 'remote'})")
        chain = self._chains[spec.job_id] = _Chain(spec, dict(by_medium))
        for medium, chunks in by_medium.items():
            try:
                self.reads[medium].submit_read(spec.job_id, chunks)
            except (BrokenError, ClosedError) as exc:  # a broken tier: those chunks miss
                keys = tuple(c.key for c in chunks)
                log.warning("worker: %s tier unusable, load job %s reads nothing from it: %s",
                            medium, spec.job_id, exc)
                self._read_in(chain, medium, ReadOutcome(spec.job_id, (), keys, (), 0, 0.0,
                                                         failed_keys=keys, error=str(exc)))
        return None

    # ------------------------------------------------------------------ chained loads
    def advance(self) -> None:
        """Take the reads that finished; a chained load whose reads are all in goes on to
        its copy to the GPU (or completes, nothing to copy)."""
        for medium, io in self.reads.items():
            for outcome in io.poll_reads():
                chain = self._chains.get(outcome.job_id)
                if chain is not None:
                    self._read_in(chain, medium, outcome)

    def _read_in(self, chain: _Chain, medium: str, outcome: ReadOutcome) -> None:
        chain.outcomes.append((medium, chain.pending.pop(medium), outcome))
        if chain.pending:
            return
        landed, copy = chain.landed(), None
        if landed:
            try:
                self.transfer.submit_load(LoadSpec(chain.spec.job_id, landed))
                chain.copying = True
                self._copying.append(chain.spec.job_id)
                return
            except (BrokenError, ClosedError) as exc:  # the copy thread died: a failed copy
                copy = Completion(chain.spec.job_id, JobKind.LOAD, False, error=str(exc),
                                  failed_keys=tuple(c.key for c in landed))
        self._direct.append(chain.merge(copy))

    def cut(self, job_id: JobId) -> bool:
        """See the module docstring: whether the load ``job_id`` copies nothing from now on."""
        self.advance()
        chain = self._chains.get(job_id)
        if chain is None or not chain.pending:
            return False
        chain.cut = True
        return True

    # ------------------------------------------------------------------ completions
    def poll_finished(self) -> list[Completion]:
        return [completion for completion, _ in self.poll_finished_jobs()]

    def poll_finished_jobs(self) -> list[tuple[Completion, JobSpec | None]]:
        """``poll_finished()``, each completion with its job's spec."""
        self.advance()
        if self._copying:  # the copies advance() started: reported now, not a poll later
            copying, self._copying = self._copying, []
            self.transfer.wait(copying)
        finished, self._direct = self._direct, []
        ledger = self._ledger
        for completion in self.transfer.poll_finished():
            chain = self._chains.get(completion.job_id)
            if chain is not None:
                completion = chain.merge(completion)
            finished.append(completion)
        if self.disk_io is not None:
            finished.extend(self.disk_io.poll_finished())
        jobs: list[tuple[Completion, JobSpec | None]] = []
        for completion in finished:
            live = ledger.record(completion.job_id)
            ledger.finish(completion.job_id)
            self._chains.pop(completion.job_id, None)
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
            chain = self._chains.get(job_id)
            if chain is not None:
                if chain.cut:  # it touches no GPU block: a fence need not wait for its reads
                    continue
                for medium in list(chain.pending):
                    self.reads[medium].wait([job_id])
                self.advance()
                if chain.copying:
                    self.transfer.wait([job_id])
            elif live.waiter is not None:
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
