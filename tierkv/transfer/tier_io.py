"""Worker-side threads that move chunks between the CPU slab and a lower tier (the disk tier;
the remote tier's reads run on a TierIO of their own, ``section="remote"``).

It stays in ``transfer/`` (not in a tier's package): it runs job specs and completions
(``core.jobs``) over the CPU slab with the transfer layer's :class:`JobLedger`, and tiers
may not import the transfer layer.

Primitives and contracts:
- ``submit_spill(spec)`` returns at once. A job's keys are split by the tier's write lanes
  (``tier.lane_of``: the disk tier's shards); one writer thread per lane (the only one that
  writes that lane) runs its parts of the jobs in submission order, writes from
  ``slab.memoryview(slot)``. A job's deletes, every lane's, are committed before any write
  of it or of a later job (``tier.delete_many``, by the first writer thread to reach the
  job), so the room an eviction frees exists before the spill that needed it takes it: the
  disk tier's files never hold a job's new chunks beside the ones it evicts for them
  (``docs/on-disk-format.md``, "How close to the cap"). Consecutive queued parts share one
  write transaction up to ``write_batch_bytes``; a part bigger than that runs alone over
  several transactions. A job is reported only after the commit of its last transaction in
  every lane, and jobs are reported in submission order. A key the map could not take is in
  ``full_keys`` and ``failed_keys`` of the job's :class:`Completion` (``ok`` is then False).
- ``submit_read(job_id, chunks, on_done)`` returns at once. ``reader_threads`` threads run
  read jobs, taken in submission order, a job's chunks split between the idle threads:
  each ``chunk.key`` is read into slot ``chunk.slot``, then ``on_done(ReadOutcome)`` runs in
  the thread that read the job's last piece (chain the CPU -> GPU copy from there). Jobs may
  finish out of order. An exception from ``on_done`` is logged and the thread goes on.
  A reader hands the tier a part and the small whole jobs queued after it, up to its
  share of ``tier.read_batch_bytes``, in one ``read_many_into`` (the disk tier keeps them
  all in flight); a network tier's chunks are read one by one.
- ``poll_finished()`` spill completions in FIFO order, non-blocking.
- ``wait(job_ids, timeout=None)`` blocks until those jobs completed (a read: with its
  ``on_done``); it does not consume them from ``poll_finished``. Spill and read ids share
  one :class:`~tierkv.transfer.ledger.JobLedger`, and raise as it does.
- ``flush()`` waits for everything submitted so far (spills, reads and their callbacks), then
  syncs the tier. ``shutdown()`` flushes and stops the threads, idempotent; the tier stays open.
- An exception inside a thread never kills it: the job is reported failed with ``error``
  set. A broken or closed tier underneath surfaces as :class:`BrokenError` on the next call.
- When the tier asks for it (``tier.sync_every_seconds``: the disk tier's ``periodic``
  sync mode) a sync thread calls ``tier.sync_if_due()`` after each commit and every
  ``disk.sync_every_seconds``, so the writer never waits on an fsync and committed data is
  synced even when writes stop (the tier's own inline sync is turned off).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from dataclasses import dataclass, field
from typing import Any

from tierkv.checks import check_int
from tierkv.core.figures import Snapshot, counter
from tierkv.core.jobs import ChunkCopy, Completion, JobId, Key, SpillSpec
from tierkv.errors import BrokenError, ClosedError, ConfigError, TierKVError
from tierkv.keys import KEY_BYTES
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.base import LowerTier, ReadStatus
from tierkv.transfer.ledger import JobLedger

logger = logging.getLogger("tierkv.tier_io")

# The setting a broken tier's message sends the operator to, per config section.
SETTING = {"disk": "disk.path", "remote": "remote.url"}
PIECE_BYTES = 1 << 20  # a read job's pieces are at least this big: a hand-off costs too


@dataclass(frozen=True)
class ReadOutcome:
    """One finished read job. Every key is in exactly one of ``ok_keys`` (landed in its
    slot), ``missing_keys`` (did not land) and ``corrupt_keys`` (failed its checks; deleted
    from disk). ``failed_keys`` is the part of ``missing_keys`` that was not even looked up
    because the tier failed (see ``error``)."""

    job_id: JobId
    ok_keys: tuple[Key, ...]
    missing_keys: tuple[Key, ...]
    corrupt_keys: tuple[Key, ...]
    num_bytes: int
    seconds: float
    failed_keys: tuple[Key, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.missing_keys or self.corrupt_keys)


@dataclass
class TierIOCounts:
    """The disk I/O threads' running counts (:class:`TierIOStatistics` is their snapshot)."""

    spill_jobs: int = counter("Spill jobs written")
    write_txns: int = counter("Write transactions committed")
    read_jobs: int = counter("Read jobs done")
    callback_errors: int = counter("Completion callbacks that raised (logged)")


@dataclass(unsafe_hash=True)
class TierIOStatistics(Snapshot, TierIOCounts):
    """``statistics()``: a read-only snapshot of :class:`TierIOCounts`."""


@dataclass(eq=False)
class _SpillJob:
    spec: SpillSpec
    parts: int  # lane parts not yet committed
    landed: set[Key] = field(default_factory=set)
    full: set[Key] = field(default_factory=set)
    start: float = 0.0  # when its first part began
    error: BaseException | None = None
    number: int = 0  # submission order


_Part = tuple[_SpillJob, tuple[tuple[Key, int], ...], tuple[Key, ...]]  # writes, deletes


@dataclass(eq=False)
class _ReadJob:
    job_id: JobId
    chunks: tuple[ChunkCopy, ...]
    on_done: Callable[[ReadOutcome], None]
    pieces: int  # pieces not yet read
    status: list[ReadStatus | None]  # per chunk; None: not looked up (the tier failed)
    start: float
    error: str | None = None


class TierIO:
    """The threads over a lower tier (``section``: the config section that names it, in
    messages and thread names); see the module docstring."""

    def __init__(self, tier: LowerTier, slab: CpuSlab, write_batch_bytes: int,
                 reader_threads: int = 4, section: str = "disk") -> None:
        self._io = f"{section} io"  # "disk io", "remote io": messages and thread names
        self._tier_name = f"{section} tier"
        self._setting = SETTING.get(section, f"the {section} settings")
        for name, value in (("write_batch_bytes", write_batch_bytes),
                            ("reader_threads", reader_threads)):
            check_int(f"{self._io}: {section}.{name}", value, low=1)
        if slab.slot_bytes < tier.payload_bytes:
            raise ConfigError(f"{self._io}: cpu slots of {slab.slot_bytes} bytes cannot hold "
                              f"{section} chunks of {tier.payload_bytes} bytes")
        self.tier = tier
        self.slab = slab
        # Reads a chunk of another part count (ChunkCopy.parts): (key, count, slot) -> status
        # (tierkv.transfer.parts.PartReader.read); None: such a chunk is MISSING.
        self.other_parts: Callable[[bytes, int, Any], ReadStatus] | None = None
        self.write_batch_bytes = write_batch_bytes
        self._payload = tier.payload_bytes
        self._cond = threading.Condition()
        self._lanes = tier.write_lanes
        self._spills: list[deque[_Part]] = [deque() for _ in range(self._lanes)]
        self._order: deque[_SpillJob] = deque()  # jobs not yet reported, in submission order
        self._undeleted: deque[_SpillJob] = deque()  # jobs whose deletes have not run, in order
        self._delete_lock = threading.Lock()  # one thread runs deletes at a time, in order
        self._submitted = 0
        self._reads: deque[tuple[_ReadJob, int, int]] = deque()  # (job, first, end) pieces
        self._finished: list[Completion] = []
        self._ledger: JobLedger[None] = JobLedger(self._io)  # spill and read jobs
        self._counts = TierIOCounts()
        self._broken: BaseException | None = None
        self._closed = False  # shutdown(): the threads stop once their queues are empty
        self._sync_every = tier.sync_every_seconds
        self._committed = False  # a commit since the sync thread last looked
        threads: list[tuple[Callable[[], None], str]] = [
            (partial(self._writer_main, lane), "writer") for lane in range(self._lanes)]
        threads += [(self._reader_main, "reader")] * reader_threads
        if self._sync_every is not None:
            tier.sync_inline = False
            threads.append((self._syncer_main, "sync"))
        self._threads = [threading.Thread(target=target, name=f"tierkv-{section}-{name}", daemon=True)
                         for target, name in threads]
        self._num_readers = reader_threads
        for thread in self._threads:
            thread.start()

    # -- caller side -----------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError(f"{self._io}: used after shutdown(); create a new TierIO")
        if self._broken is not None:
            raise BrokenError(f"{self._io}: the {self._tier_name} failed underneath "
                              f"({self._broken}); check {self._setting}, then restart the "
                              f"store") from self._broken

    def _check_chunk(self, key: bytes, slot: int) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ConfigError(f"{self._io}: a chunk key must be {KEY_BYTES} bytes, got {key!r:.40}")
        if not 0 <= slot < self.slab.num_slots:
            raise ConfigError(f"{self._io}: slot {slot} out of range [0, {self.slab.num_slots})")

    def submit_spill(self, spec: SpillSpec) -> None:
        """Queue ``spec``'s parts for the writer threads of their lanes; returns at once."""
        for key, slot in spec.writes:
            self._check_chunk(key, slot)
        for key in spec.deletes:
            self._check_chunk(key, 0)
        lane_of = self.tier.lane_of
        writes: dict[int, list[tuple[Key, int]]] = {}
        deletes: dict[int, list[Key]] = {}
        for write in spec.writes:
            writes.setdefault(lane_of(write[0]), []).append(write)
        for key in spec.deletes:
            deletes.setdefault(lane_of(key), []).append(key)
        lanes = sorted(writes.keys() | deletes.keys()) or [0]
        job = _SpillJob(spec, len(lanes))
        with self._cond:
            self._check_usable()
            self._ledger.add(spec.job_id, None)
            self._order.append(job)
            self._submitted += 1
            job.number = self._submitted
            if spec.deletes:
                self._undeleted.append(job)
            for lane in lanes:
                self._spills[lane].append(
                    (job, tuple(writes.get(lane, ())), tuple(deletes.get(lane, ()))))
            self._cond.notify_all()

    def submit_read(self, job_id: JobId, chunks: Sequence[ChunkCopy],
                    on_done: Callable[[ReadOutcome], None]) -> None:
        """Queue a read job for the reader threads; ``on_done`` runs in the one that ends it."""
        for chunk in chunks:
            self._check_chunk(chunk.key, chunk.slot)
        chunks = tuple(chunks)
        size = max(1, -(-len(chunks) // self._num_readers), PIECE_BYTES // self._payload)
        firsts = range(0, max(len(chunks), 1), size)
        job = _ReadJob(job_id, chunks, on_done, len(firsts), [None] * len(chunks),
                       time.perf_counter())
        with self._cond:
            self._check_usable()
            self._ledger.add(job_id, None)
            self._reads.extend((job, first, first + size) for first in firsts)
            self._cond.notify_all()

    def poll_finished(self) -> list[Completion]:
        """Spill completions since the last poll, in FIFO order."""
        with self._cond:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> None:
        """Block until every job in ``job_ids`` completed."""
        with self._cond:
            self._ledger.wait(self._cond, job_ids, timeout)

    def flush(self) -> None:
        """Wait for every job submitted so far (not later ones), then sync the tier."""
        with self._cond:
            self._ledger.wait(self._cond, self._ledger.live_ids())
        self._check_usable()
        self.tier.sync()

    def shutdown(self) -> None:
        """Flush, then stop the threads; idempotent. The tier stays open."""
        if self._closed:
            return
        try:
            self.flush()
        except TierKVError as exc:
            logger.warning("%s: flush at shutdown failed: %s", self._io, exc)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            for thread in self._threads:
                thread.join()

    def statistics(self) -> TierIOStatistics:
        with self._cond:
            return TierIOStatistics.of(self._counts)

    # -- writer threads --------------------------------------------------------------------
    def _take_spills(self, lane: int) -> list[_Part] | None:
        """The next batch of ``lane``'s parts, or None to stop."""
        queue = self._spills[lane]
        with self._cond:
            self._cond.wait_for(lambda: queue or self._closed)
            if not queue:
                return None
            batch = [queue.popleft()]
            total = len(batch[0][1]) * self._payload
            written = {key for key, _ in batch[0][1]}
            while queue:
                nxt = queue[0]
                # a later delete of a key written earlier in the batch must not run first
                if total + len(nxt[1]) * self._payload > self.write_batch_bytes or \
                        not written.isdisjoint(nxt[2]):
                    break
                batch.append(queue.popleft())
                total += len(nxt[1]) * self._payload
                written.update(key for key, _ in nxt[1])
            for job, _, _ in batch:
                job.start = job.start or time.perf_counter()
            return batch

    def _writer_main(self, lane: int) -> None:
        while (batch := self._take_spills(lane)) is not None:
            try:
                landed, full, error = self._run_parts(batch)
            except Exception as exc:  # never die silently: fail the batch
                logger.exception("%s: spill batch failed", self._io)
                self._mark_broken(exc)
                landed, full, error = set(), set(), exc
            with self._cond:
                for job, _, _ in batch:
                    job.landed |= landed
                    job.full |= full
                    job.error = job.error or error
                    job.parts -= 1
                while self._order and not self._order[0].parts:
                    completion = self._completion(self._order.popleft())
                    self._finished.append(completion)
                    self._ledger.finish(completion.job_id)
                    self._counts.spill_jobs += 1
                self._committed = True
                self._cond.notify_all()

    def _syncer_main(self) -> None:
        """Sync when due: woken by each commit, and every ``sync_every_seconds``."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._committed or self._closed, self._sync_every)
                if self._closed:
                    return
                self._committed = False
            try:
                self.tier.sync_if_due()
            except TierKVError as exc:
                self._mark_broken(exc)

    def _mark_broken(self, exc: BaseException) -> None:
        """A tier that failed for good (a disk) refuses every later job; a tier whose
        failures pass (the remote tier: it reconnects, its breaker warns) is kept."""
        if isinstance(exc, BrokenError) and self.tier.transient_failures:
            return
        if isinstance(exc, (BrokenError, ClosedError)):
            with self._cond:
                if self._broken is None:
                    self._broken = exc
                    logger.error("%s: %s failed: %s (check %s)", self._io, self._tier_name, exc,
                                 self._setting)

    def _run_parts(self, batch: list[_Part]) -> tuple[set[Key], set[Key], BaseException | None]:
        """Write one lane's batch: (keys landed, keys the tier had no room for, the error
        that stopped it)."""
        if len(batch) == 1 and len(batch[0][1]) * self._payload > self.write_batch_bytes:
            per_txn = max(1, self.write_batch_bytes // self._payload)
            _, writes, deletes = batch[0]
            plans = [(writes[i : i + per_txn], deletes if i == 0 else ())
                     for i in range(0, len(writes), per_txn)]
        else:
            plans = [(tuple(w for _, part, _ in batch for w in part),
                      tuple(d for _, _, part in batch for d in part))]
        landed: set[Key] = set()
        full: set[Key] = set()
        error = self._run_deletes(max(job.number for job, _, _ in batch))
        if error is not None:
            return landed, full, error
        for writes, _ in plans:
            if not writes:
                continue
            items = [(key, self.slab.memoryview(slot)[: self._payload]) for key, slot in writes]
            try:
                result = self.tier.put_many(items)
            except Exception as exc:  # this and later transactions of the batch did not land
                logger.error("%s: spill job(s) %s failed: %s", self._io,
                             [job.spec.job_id for job, _, _ in batch], exc)
                self._mark_broken(exc)
                return landed, full, exc
            with self._cond:
                self._counts.write_txns += 1
            landed.update(result.written)
            full.update(result.full)
        return landed, full, None

    def _run_deletes(self, number: int) -> BaseException | None:
        """Commit the deletes of every job up to submission ``number`` not yet run, in order
        (each job's keys of every lane); the error that stopped them, if any."""
        with self._delete_lock:
            while True:
                with self._cond:
                    if not self._undeleted or self._undeleted[0].number > number:
                        return None
                    job = self._undeleted[0]
                try:
                    self.tier.delete_many(job.spec.deletes)
                except Exception as exc:  # the tier failed: the writes of this batch too
                    logger.error("%s: deletes of spill job %s failed: %s", self._io,
                                 job.spec.job_id, exc)
                    self._mark_broken(exc)
                    return exc
                finally:
                    with self._cond:
                        self._undeleted.popleft()

    def _completion(self, job: _SpillJob) -> Completion:
        keys = [key for key, _ in job.spec.writes]
        failed = tuple(key for key in keys if key not in job.landed)
        error = job.error
        return Completion(
            job_id=job.spec.job_id, kind=job.spec.kind, ok=not failed and error is None,
            num_bytes=(len(keys) - len(failed)) * self._payload,
            seconds=time.perf_counter() - job.start, failed_keys=failed,
            full_keys=tuple(key for key in keys if key in job.full),
            error=None if error is None else f"{type(error).__name__}: {error}")

    # -- reader threads --------------------------------------------------------------------
    def _take_reads(self) -> list[tuple[_ReadJob, int, int]] | None:
        """The next queued parts of read jobs (None: stop): the first, and the whole jobs
        after it while their chunks fit this reader's share of the tier's
        ``read_batch_bytes`` (many small jobs read at once, as one job's chunks are; a job
        split between the readers stays split)."""
        with self._cond:
            self._cond.wait_for(lambda: self._reads or self._closed)
            if not self._reads:
                return None
            taken = [self._reads.popleft()]
            share = self.tier.read_batch_bytes // self._num_readers
            job, first, end = taken[0]
            size = (min(end, len(job.chunks)) - first) * self._payload
            while self._reads and self._reads[0][0].pieces == 1 and \
                    size + len(self._reads[0][0].chunks) * self._payload <= share:
                size += len(self._reads[0][0].chunks) * self._payload
                taken.append(self._reads.popleft())
            return taken

    def _reader_main(self) -> None:
        while (taken := self._take_reads()) is not None:
            self._read_parts(taken)
            for job, _, _ in taken:
                with self._cond:
                    job.pieces -= 1
                    if job.pieces:
                        continue
                self._end_read(job)

    def _end_read(self, job: _ReadJob) -> None:
        try:
            outcome = self._outcome(job)
            try:
                job.on_done(outcome)
            except Exception:
                logger.exception("%s: on_done of read job %s raised", self._io, job.job_id)
                with self._cond:
                    self._counts.callback_errors += 1
        finally:
            with self._cond:
                self._ledger.finish(job.job_id)
                self._counts.read_jobs += 1
                self._cond.notify_all()

    def _read_parts(self, taken: list[tuple[_ReadJob, int, int]]) -> None:
        """Read ``job.chunks[first:end]`` of each taken part: a disk tier's all in flight
        (one ``read_many_into``; a failure leaves them unread), a network tier's one by
        one, going on past a failure (a chunk on a node that failed fails at once, its
        breaker open; the chunks of other nodes are read)."""
        chunks = [(job, p) for job, first, end in taken
                  for p in range(first, min(end, len(job.chunks)))]
        if not self.tier.transient_failures:
            whole = [(job, p) for job, p in chunks if not job.chunks[p].parts]
            try:
                statuses = self.tier.read_many_into(
                    [(job.chunks[p].key, self.slab.memoryview(job.chunks[p].slot))
                     for job, p in whole])
            except Exception as exc:
                for job in dict.fromkeys(job for job, _, _ in taken):
                    self._read_failed(job, exc)
                return
            for (job, position), status in zip(whole, statuses):
                job.status[position] = status
            chunks = [(job, p) for job, p in chunks if job.chunks[p].parts]
        stopped: set[int] = set()
        for job, position in chunks:
            if id(job) in stopped:
                continue
            chunk = job.chunks[position]
            try:
                if chunk.parts:
                    job.status[position] = (ReadStatus.MISSING if self.other_parts is None else
                                            self.other_parts(chunk.key, chunk.parts,
                                                             self.slab.memoryview(chunk.slot)))
                else:
                    job.status[position] = self.tier.read_into(chunk.key,
                                                               self.slab.memoryview(chunk.slot))
            except Exception as exc:
                if not self._read_failed(job, exc):
                    stopped.add(id(job))

    def _read_failed(self, job: _ReadJob, exc: Exception) -> bool:
        """Note that a read of ``job`` raised ``exc``; True when the job's other reads go on
        (a transient failure of a network tier)."""
        self._mark_broken(exc)
        transient = isinstance(exc, BrokenError) and self.tier.transient_failures
        logger.log(logging.DEBUG if transient else logging.ERROR,
                   "%s: read job %s failed: %s", self._io, job.job_id, exc)
        with self._cond:
            job.error = job.error or f"{type(exc).__name__}: {exc}"
        return transient

    def _outcome(self, job: _ReadJob) -> ReadOutcome:
        keys = {status: tuple(chunk.key for chunk, got in zip(job.chunks, job.status)
                              if got is status) for status in (*ReadStatus, None)}
        return ReadOutcome(
            job_id=job.job_id, ok_keys=keys[ReadStatus.OK],
            missing_keys=keys[ReadStatus.MISSING] + keys[None],
            corrupt_keys=keys[ReadStatus.CORRUPT],
            num_bytes=len(keys[ReadStatus.OK]) * self._payload,
            seconds=time.perf_counter() - job.start, failed_keys=keys[None], error=job.error)
