"""BlockIndex: the scheduler side's one source of truth about where every chunk is.

Pure and single-threaded, plain data in and out. Its primitives (``lookup``,
``note_remote``, ``prepare_store`` / ``prepare_store_many`` / ``complete_store``,
``prepare_load`` / ``complete_load``, ``take_spills`` / ``complete_spill``, ``touch``,
``add_on_disk``, ``check``) and their contracts: docs/design.md, "The index's
primitives". Misuse (completing a job that is not in flight, or as another kind of job;
runs of keys that do not cover the keys given) raises :class:`~tierkv.errors.UsageError`
naming the job and changes nothing.

It holds its parts, each with its own state: the disk side (core/spills.py,
:class:`~tierkv.core.spills.WriteBack`: write-back and the disk capacity), the remote marks
(core/remote_marks.py), events (core/events.py) and counters (core/stats.py); its records
are core/plans.py's. The hot methods (lookup, stores, loads, CPU eviction) read the plain
dicts inline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence

from tierkv.core.events import EventLog
from tierkv.core.jobs import Completion, JobId, JobIds, JobKind, SlotId, SpillSpec, failed_set
from tierkv.core.plans import (CLEAN, DIRTY, WRITING, CpuState, DiskState, Entry, Job, LoadPlan,
                               LoadResult, Lookup, Source, StoreBatch, StorePlan)
from tierkv.core.policies import DEFAULT_POLICY, make_policy
from tierkv.core.policy import require
from tierkv.core.remote_marks import RemoteMarks
from tierkv.core.slots import SlotAllocator
from tierkv.core.spills import WriteBack
from tierkv.core.stats import IndexStats
from tierkv.errors import UsageError

_ON_DISK = DiskState.ON_DISK  # for every eviction: an Enum member lookup costs 50 ns on 3.11
_WRITTEN = (DiskState.ON_DISK, DiskState.EVICTED)  # a READY chunk is clean in these states


class BlockIndex:
    def __init__(
        self,
        num_slots: int,
        disk_capacity: int = 0,
        *,
        write_through: bool = False,
        spill_ahead_fraction: float = 0.25,
        retry_after_full_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        job_ids: JobIds | None = None,
        record_events: bool = False,
        eviction_policy: str = DEFAULT_POLICY,
        remote_mark_seconds: float = 10.0,
        max_remote_marks: int = 1 << 16,
        disk_tier: bool | None = None,
    ) -> None:
        self.num_slots = num_slots
        # A disk tier (None: when it holds a chunk); a capacity of 0 later is "no room".
        self.has_disk = disk_capacity > 0 if disk_tier is None else disk_tier
        self._clock = clock
        self._job_ids = job_ids or JobIds()
        self._slots = SlotAllocator(num_slots)
        self._entries: dict[bytes, Entry] = {}
        self.eviction_policy = eviction_policy
        self._cpu = make_policy(eviction_policy, num_slots, num_pools=3)  # CLEAN, DIRTY, WRITING
        # The transient CPU states, counted as they change (READY chunks are the rest of the
        # used slots), so that statistics() walks nothing.
        self._num_storing = 0
        self._num_promoting = 0
        self._jobs: dict[JobId, Job] = {}
        self._counters = IndexStats()
        # Events: the log's list of keys whose tiers changed, appended inline (None: off).
        self._events = EventLog() if record_events else None
        self._touched = self._events.touched if self._events is not None else None
        # The remote tier's part (core/remote_marks.py); lookup reads its dict inline.
        self._marks = RemoteMarks(remote_mark_seconds, max_remote_marks, clock)
        self._remote = self._marks.marks
        self._disk = WriteBack(self._entries, self._cpu, self._counters, self._touched, clock,
                               num_slots=num_slots, capacity=disk_capacity,
                               write_through=write_through,
                               spill_ahead_fraction=spill_ahead_fraction,
                               retry_after_full=retry_after_full_seconds)

    # ------------------------------------------------------------------ queries
    @property
    def disk_capacity(self) -> int:
        """The disk capacity in chunks (set_disk_capacity changes it)."""
        return self._disk.capacity

    @property
    def disk_used(self) -> int:
        """Chunks on disk or being written there (what the disk capacity bounds)."""
        return self._disk.used

    @property
    def disk_wanted(self) -> int:
        """:attr:`disk_used` and the dirty CPU chunks: what the disk would hold once every
        chunk is written (a disk budget plans again when this fills the capacity)."""
        return self._disk.used + self._cpu.count(DIRTY)  # no dirty chunk without a disk

    def set_disk_capacity(self, num_chunks: int) -> int:
        """Make the disk capacity ``num_chunks`` (a shared budget moved): chunks over it are
        evicted (``WriteBack.resize``), how many is returned; :class:`UsageError` without a
        disk tier."""
        if not self.has_disk:
            raise UsageError("block index: set_disk_capacity without a disk tier")
        return self._disk.resize(num_chunks)

    @property
    def remote(self) -> RemoteMarks:
        """What is known of the remote tier's chunks (core/remote_marks.py)."""
        return self._marks

    def lookup(self, keys: Sequence[bytes],
               ask: Callable[[Sequence[bytes]], None] | None = None) -> Lookup:
        """``ask(rest)``: called once, at the first chunk neither held nor marked, with the
        keys from there on: it asks the remote tier and notes what it has
        (:func:`tierkv.engine.tier_lookup.lookup_tiers`); the walk goes on from there."""
        hits = 0
        on_cpu = 0
        remote = 0
        entries = self._entries
        marks = self._remote
        oldest = self._clock() - self._marks.seconds if marks else 0.0
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                seen = marks.get(key)
                if (seen is None or seen < oldest) and ask is not None:
                    ask(keys[hits:])  # hits: this key's position
                    ask = None
                    seen = marks.get(key)
                if seen is None or seen < oldest:
                    break
                remote += 1
                hits += 1
                continue
            cpu = entry.cpu
            if cpu is CpuState.READY:
                on_cpu += 1
            elif cpu is None and entry.disk is DiskState.ON_DISK:
                pass
            elif cpu is CpuState.PROMOTING:
                return Lookup(hits, True, on_cpu, remote)
            else:
                break
            hits += 1
        return Lookup(hits, False, on_cpu, remote)

    def note_remote(self, keys: Iterable[bytes]) -> int:
        """The remote tier has every rank's value of ``keys`` (docs/design.md); returns how
        many were noted. With events, a new mark is a ``stored`` event of medium REMOTE."""
        events = self._events
        if events is None:
            return self._marks.note(keys, self._entries)
        keys = list(keys)
        marks = self._remote
        fresh = [key for key in dict.fromkeys(keys) if key not in marks]
        noted = self._marks.note(keys, self._entries)
        events.remote.extend((key, True) for key in fresh if key in marks)
        return noted

    def shortfall(self, keys: Sequence[bytes], *, load: bool = False) -> int:
        """How many of ``keys`` (new ones; with ``load``, those not in the CPU tier) would
        find neither a free slot nor a clean victim (a load's own keys are none), while
        dirty or spilling chunks could become clean: the chunks to write back, or wait for."""
        if not (self._cpu.count(DIRTY) or self._disk.spilling):
            return 0
        entries = self._entries
        if not load:
            new = sum(1 for key in keys if key not in entries)
            return max(new - self._slots.num_free - self._cpu.count(CLEAN), 0)
        new = held = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.cpu is None:
                new += 1
            elif entry.cpu is CpuState.READY and entry.disk in _WRITTEN:  # clean
                held += 1
        return max(new - self._slots.num_free - (self._cpu.count(CLEAN) - held), 0)

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def entry(self, key: bytes) -> Entry | None:
        """The entry for ``key`` (read-only use: tests, inspection)."""
        return self._entries.get(key)

    def jobs_in_flight(self) -> int:
        return len(self._jobs)

    def spills_wanted(self) -> bool:
        """Write-through has dirty chunks it can spill now: the engine should plan a step
        (an idle engine would leave them on the CPU tier only, lost to a kill)."""
        return self.has_disk and self._disk.wanted()

    def spill_jobs(self) -> list[JobId]:
        """Spill jobs in flight (their chunks become clean, evictable, when they land)."""
        return [job_id for job_id, job in self._jobs.items() if job.kind is JobKind.SPILL]

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[bytes], protected: Sequence[bytes] = ()) -> StorePlan:
        batch = self.prepare_store_many(keys, (len(keys),), lambda run: (*protected, *keys))
        return StorePlan(batch.job_id, tuple(zip(batch.keys, batch.slots)), batch.num_present,
                         batch.num_no_room)

    def prepare_store_many(self, keys: Sequence[bytes], run_ends: Sequence[int],
                           protected: Callable[[int], Collection[bytes]]) -> StoreBatch:
        """One store job for several runs of keys laid end to end: run ``r`` is
        ``keys[run_ends[r - 1]:run_ends[r]]`` and may not evict ``protected(r)`` (the
        run's own keys and its request's earlier ones). Runs are decided in order, each
        exactly as one ``prepare_store`` of it (a key an earlier run planned is present),
        so the batch only saves per-job costs."""
        # The scheduler's hot path (benchmarks/adapter.md): free slots taken in one call; while
        # every key is new and finds one, a key costs its Entry; else the general loop.
        entries = self._entries
        count = len(keys)
        if (run_ends[-1] if run_ends else 0) != count:
            raise UsageError(f"block index: runs of keys end at {list(run_ends)[-3:]} but "
                             f"{count} keys were given; the last run must end at the last key")
        free = self._slots.allocate_many(count)
        storing = CpuState.STORING
        taken = 0
        if len(free) == count:
            for key in keys:
                if key in entries:
                    break
                entries[key] = Entry(key, free[taken], storing)
                taken += 1
        placed: list[int] | None = None  # positions of the keys stored; None: all
        slots = free
        present = no_room = 0
        if taken < count:
            slots = free[:taken]
            run = 0
            failed_run = -1  # a run that found no room stores nothing after that point
            # The eviction guard: the run's protected keys as given for its first eviction
            # (one scan, usually of one candidate), a set from its second on.
            guard_run = -1
            guard: Collection[bytes] = ()
            for position in range(taken, count):
                while position >= run_ends[run]:
                    run += 1
                key = keys[position]
                slot: SlotId | None = None
                if key in entries:
                    present += 1
                elif run == failed_run:
                    no_room += 1
                elif taken < len(free):
                    slot = free[taken]
                    taken += 1
                else:
                    if guard_run != run:
                        guard_run, guard = run, protected(run)
                    elif not isinstance(guard, set):
                        guard = set(guard)
                    slot = self._evict_for(guard)
                    if slot is None:  # a prefix of the run is stored, never a gap
                        failed_run = run
                        no_room += 1
                if slot is None:
                    if placed is None:  # the first key not stored: positions from now on
                        placed = list(range(position))
                    continue
                entries[key] = Entry(key, slot, storing)
                if placed is not None:
                    placed.append(position)
                slots.append(slot)
            if taken < len(free):
                self._slots.give_back(free[taken:])
        counters = self._counters
        counters.stores_present += present
        counters.stores_no_room += no_room
        if not slots:
            return StoreBatch(None, (), (), placed, present, no_room)
        stored = tuple(keys) if placed is None else tuple(keys[i] for i in placed)
        counters.stores_planned += len(stored)
        self._num_storing += len(stored)
        job_id = self._job_ids.allocate()
        self._jobs[job_id] = Job(JobKind.STORE, stored)
        return StoreBatch(job_id, stored, tuple(slots), placed, present, no_room)

    def complete_store(self, completion: Completion) -> None:
        job = self._pop_job(completion.job_id, JobKind.STORE)
        failed = failed_set(completion, job.keys)
        self._num_storing -= len(job.keys)  # each becomes READY or is forgotten
        entries = self._entries
        ready = CpuState.READY
        storing = CpuState.STORING
        landed = job.keys if not failed else [key for key in job.keys if key not in failed]
        for key in landed:
            entry = entries[key]
            assert entry.cpu is storing
            entry.cpu = ready
        # A newly READY chunk joins the dirty pool when a disk tier is there (a STORING key
        # is never on disk, nor in any pool), else the clean one.
        self._cpu.insert(landed, DIRTY if self.has_disk else CLEAN)
        if self._touched is not None:
            self._touched.extend(landed)
        if failed:
            for key in job.keys:
                if key in failed:
                    entry = entries[key]
                    assert entry.cpu is storing
                    self._counters.stores_failed += 1
                    self._release_slot(entry)
                    del entries[key]

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        guard = set(keys)
        chunks: list[tuple[bytes, SlotId, Source]] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                if not self._marks.holds(key):
                    break
                slot = self._take_slot(guard)
                if slot is None:
                    self._counters.loads_no_room += 1
                    break
                del self._remote[key]  # an entry now: PROMOTING from the remote tier
                self._entries[key] = Entry(key, slot, CpuState.PROMOTING, readers=1)
                chunks.append((key, slot, Source.REMOTE))
                self._counters.loads_remote += 1
                self._num_promoting += 1
                continue
            if entry.cpu is CpuState.READY:
                assert entry.slot is not None
                entry.readers += 1
                self._cpu.touch(key, True)
                chunks.append((key, entry.slot, Source.CPU))
                self._counters.loads_cpu += 1
            elif entry.cpu is None and entry.disk is DiskState.ON_DISK:
                slot = self._take_slot(guard)
                if slot is None:
                    self._counters.loads_no_room += 1
                    break
                entry.slot = slot
                entry.cpu = CpuState.PROMOTING
                entry.readers = 1
                self._disk.use(key, True)
                chunks.append((key, slot, Source.DISK))
                self._counters.loads_disk += 1
                self._num_promoting += 1
            else:
                break
        if not chunks:
            return LoadPlan(None, ())
        job_id = self._job_ids.allocate()
        self._jobs[job_id] = Job(JobKind.LOAD, tuple(k for k, _, _ in chunks),
                                 tuple(d for _, _, d in chunks))
        remote = frozenset(k for k, _, source in chunks if source is Source.REMOTE)
        return LoadPlan(job_id, tuple((k, slot, source is Source.DISK)
                                      for k, slot, source in chunks), remote)

    def complete_load(self, completion: Completion) -> LoadResult:
        job = self._pop_job(completion.job_id, JobKind.LOAD)
        corrupt = set(completion.corrupt_keys)
        missing = set(completion.missing_keys)
        failed = failed_set(completion, job.keys)
        ok_keys: list[bytes] = []
        failed_keys: list[bytes] = []
        for key, source in zip(job.keys, job.sources):
            entry = self._entries[key]
            entry.readers -= 1
            assert entry.readers >= 0
            landed = key not in failed
            (ok_keys if landed else failed_keys).append(key)
            if not landed:
                self._counters.loads_failed += 1
            if source is Source.CPU:
                continue
            assert entry.cpu is CpuState.PROMOTING and entry.readers == 0
            self._num_promoting -= 1
            if source is Source.REMOTE:
                self._landed_remote(entry, landed, key in corrupt, key in missing)
                continue
            if landed:  # a PROMOTING chunk is on disk (never a disk victim): clean
                entry.cpu = CpuState.READY
                self._cpu.insert((key,), CLEAN)
                if self._touched is not None:
                    self._touched.append(key)
                continue
            self._release_slot(entry)
            if key in corrupt or key in missing:  # deleted on disk, or not there at all
                self._disk.lost(entry, corrupt=key in corrupt)
        return LoadResult(tuple(ok_keys), tuple(failed_keys))

    def _landed_remote(self, entry: Entry, landed: bool, corrupt: bool, missing: bool) -> None:
        """A chunk promoted from the remote tier landed (READY, dirty: the disk tier gets a
        copy) or did not (forgotten, and not noted again for a while: see note_remote)."""
        key = entry.key
        if landed:
            entry.cpu = CpuState.READY
            self._cpu.insert((key,), DIRTY if self.has_disk else CLEAN)
            if self._touched is not None:
                self._touched.append(key)
            return
        self._release_slot(entry)
        del self._entries[key]  # never reported "stored" in a local tier: no "removed"
        if (corrupt or missing) and self._events is not None:  # the remote tier lost it
            self._events.remote.append((key, False))
        counters = self._counters
        if corrupt:
            counters.remote_corrupt += 1
        elif missing:
            counters.remote_missing += 1
        else:
            counters.remote_failed += 1
        self._marks.failed(key)

    # ------------------------------------------------------------------ the disk side
    def take_spills(self, flush: bool = False, at_least: int = 0) -> SpillSpec | None:
        """Write-back: a spill job for dirty chunks, and the disk deletes due; None when
        there is nothing to do."""
        if not self.has_disk:
            return None
        planned = self._disk.plan(self._slots.num_free, flush, at_least)
        if planned is None:
            return None
        writes, deletes, again = planned
        job_id = self._job_ids.allocate()
        self._jobs[job_id] = Job(JobKind.SPILL, tuple(k for k, _ in writes), deletes=deletes,
                                 again=again)
        return SpillSpec(job_id, tuple(writes), deletes)

    def complete_spill(self, completion: Completion) -> None:
        job = self._pop_job(completion.job_id, JobKind.SPILL)
        self._disk.landed(job.keys, job.again, completion)

    def add_on_disk(self, keys: Iterable[bytes]) -> int:
        """Register chunks found on disk at open, oldest first (over the capacity, the
        oldest are deleted with the next spill job); returns how many were added."""
        return self._disk.add(keys)

    def touch(self, keys: Iterable[bytes], *, reuse: bool = True) -> None:
        """Mark chunks as just used (``reuse``: a policy may count it; docs/design.md): the
        most recent of their CPU pool and on disk. Absent or in-flight keys are skipped."""
        entries = self._entries
        cpu_use = self._cpu.touch
        disk_use = self._disk.use
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                continue
            if entry.cpu is CpuState.READY:
                cpu_use(key, reuse)
            if entry.disk is DiskState.ON_DISK:
                disk_use(key, reuse)

    # ------------------------------------------------------------------ completion
    def complete(self, completion: Completion) -> LoadResult | None:
        """Route a completion to the matching ``complete_*`` by its kind."""
        kind = completion.kind
        if kind is JobKind.LOAD:
            return self.complete_load(completion)
        if kind is JobKind.STORE:
            self.complete_store(completion)
        else:
            self.complete_spill(completion)
        return None

    # ------------------------------------------------------------------ internals
    def _pop_job(self, job_id: JobId, kind: JobKind) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise UsageError(f"block index: no {kind.value} job {job_id} in flight (completed "
                             f"already, or never planned by this index)")
        if job.kind is not kind:  # the job stays in flight: nothing changed
            raise UsageError(f"block index: job {job_id} is a {job.kind.value} job, not a "
                             f"{kind.value} job")
        del self._jobs[job_id]
        self._disk.stuck = False  # room may have changed
        return job

    def _remove(self, key: bytes) -> None:
        del self._entries[key]
        if self._touched is not None:
            self._touched.append(key)

    def _take_slot(self, guard: set[bytes]) -> SlotId | None:
        slot = self._slots.allocate()
        return slot if slot is not None else self._evict_for(guard)

    def _evict_for(self, guard: Collection[bytes]) -> SlotId | None:
        """Free the slot of the policy's first evictable clean chunk outside ``guard`` (a
        dirty one when there is no disk tier to write it to, or it is backing off)."""
        cpu = self._cpu
        entries = self._entries
        pool = CLEAN
        victim = None
        for key in cpu.victims(CLEAN):  # walks inline: every eviction passes here
            entry = entries[key]
            if entry.readers == 0 and key not in guard:
                victim = entry
                break
        # Dirty chunks are dropped when nothing could write them (no disk tier, a full one
        # backing off, a capacity of 0): else they would hold every slot.
        if victim is None and (not self.has_disk or self._disk.may_drop_dirty()):
            pool = DIRTY
            for key in cpu.victims(DIRTY):
                entry = entries[key]
                if entry.readers == 0 and key not in guard:
                    victim = entry
                    self._counters.dirty_dropped += 1
                    break
        if victim is None:
            if cpu.count(DIRTY) and self.has_disk:
                self._disk.want_room()  # the clean reserve may be made of chunks in use
            return None
        self._counters.cpu_evictions += 1
        slot = victim.slot
        assert slot is not None
        cpu.evict(victim.key, pool)  # a READY chunk is in one pool: its victim's
        victim.slot = None
        victim.cpu = None
        if self._touched is not None:
            self._touched.append(victim.key)
        if victim.disk is not _ON_DISK:  # dirty or EVICTED: nowhere else
            self._remove(victim.key)
        return slot

    def take_events(self, max_chunks: int | None = None) -> list[tuple[str, str, bytes]]:
        """``("stored" | "removed", medium, key)`` for each tier a chunk entered or left since
        the last call, of at most ``max_chunks`` chunks (empty unless ``record_events``):
        see core/events.py."""
        events = self._events
        return events.take(self._entries, max_chunks) if events is not None else []

    def unwritten_keys(self) -> list[bytes]:
        """Chunks READY in the CPU tier and never written to disk (or being written): what
        a shutdown flush writes. A chunk the disk evicted is not written back."""
        ready = CpuState.READY
        return [key for key, entry in self._entries.items()
                if entry.cpu is ready and entry.disk not in _WRITTEN]

    def events_pending(self) -> bool:
        """Whether ``take_events`` may have events to give."""
        return self._events is not None and self._events.pending()

    def _release_slot(self, entry: Entry) -> None:
        assert entry.slot is not None
        self._slots.free(entry.slot)
        entry.slot = None
        entry.cpu = None
        if self._touched is not None:
            self._touched.append(entry.key)

    # ------------------------------------------------------------------ reports
    def statistics(self) -> IndexStats:
        """A snapshot in O(1): every used slot holds a STORING, PROMOTING or READY chunk."""
        free = self._slots.num_free
        return self._counters.snapshot(
            num_slots=self.num_slots,
            free_slots=free,
            cpu_ready=self.num_slots - free - self._num_storing - self._num_promoting,
            storing=self._num_storing,
            promoting=self._num_promoting,
            spilling=self._disk.spilling,
            on_disk=len(self._disk),
            disk_capacity=self._disk.capacity,
            remote_marks=len(self._remote),
        )

    def check(self) -> None:
        """Every invariant of the index, for tests after each step; the error names the
        broken entry (:class:`~tierkv.errors.InvariantError`, kept by ``python -O``)."""
        used: set[SlotId] = set()
        cpu_listed: dict[bytes, int] = {}
        for key, entry in self._entries.items():
            entry.check(key)
            if entry.slot is not None:
                require(entry.slot not in used, "slot held twice:", entry)
                used.add(entry.slot)
            if entry.disk is DiskState.SPILLING:
                cpu_listed[key] = WRITING
            elif entry.cpu is CpuState.READY:
                clean = entry.disk is not None or not self.has_disk  # else dirty
                cpu_listed[key] = CLEAN if clean else DIRTY
        self._cpu.check(cpu_listed)
        self._disk.check()
        self._marks.check()
        self._slots.check(used)
        # The counts statistics() reports (every used slot: STORING, PROMOTING or READY).
        states = [entry.cpu for entry in self._entries.values()]
        ready = self.num_slots - self._slots.num_free - self._num_storing - self._num_promoting
        for state, kept in ((CpuState.STORING, self._num_storing),
                            (CpuState.PROMOTING, self._num_promoting), (CpuState.READY, ready)):
            require(states.count(state) == kept,
                    f"{states.count(state)} chunks {state.value}, counted {kept}")
        readers: dict[bytes, int] = {}
        for job_id, job in self._jobs.items():
            job.check(job_id, self._entries, readers)
        for key, entry in self._entries.items():
            require(entry.readers == readers.get(key, 0), "readers != load jobs:", entry)


__all__ = ["BlockIndex"]
