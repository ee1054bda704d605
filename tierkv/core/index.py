"""BlockIndex: the scheduler side's one source of truth about where every chunk is.

Pure and single-threaded, plain data in and out. Its primitives (``lookup``,
``note_remote``, ``prepare_store`` / ``prepare_store_many`` / ``complete_store``,
``prepare_load`` / ``complete_load``, ``take_spills`` / ``complete_spill``, ``touch``,
``add_on_disk``, ``check``) and their contracts: docs/design.md, "The index's
primitives". Misuse (completing a job that is not in flight, or as another kind of job;
runs of keys that do not cover the keys given) raises :class:`~tierkv.errors.UsageError`
naming the job and changes nothing.

Parts: its records (core/plans.py, re-exported here), remote marks (core/remote_marks.py),
events (core/events.py), statistics (core/stats.py), and two parts of the class itself,
which it inherits: write-back and disk capacity (core/spills.py, ``Spills``) and the
consistency check (core/invariants.py, ``Invariants``), methods over the attributes that
core/index_state.py declares for all three. Imports run one way: this module imports the
parts, they never import it. The hot methods (lookup, stores, loads, CPU eviction) stay
here and read the plain dicts inline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from tierkv.core.events import MEDIUM_CPU, MEDIUM_DISK, EventLog  # MEDIUM_*: importable here
from tierkv.core.invariants import Invariants
# SpillSpec: importable here, as before its methods moved to core/spills.py.
from tierkv.core.jobs import (ChunkCopy, Completion, JobId, JobIds, JobKind, SlotId, SpillSpec,
                              failed_set)
# The records and pools of core/plans.py: importable here, as before it was split out.
from tierkv.core.plans import (CLEAN, DIRTY, Job, LoadPlan, LoadResult, Lookup, Source,
                               StoreBatch, StorePlan)
from tierkv.core.policy import DEFAULT_POLICY, DISK_POLICY, make_policy, require  # noqa: F401
from tierkv.core.remote_marks import RemoteMarks
from tierkv.core.slots import SlotAllocator
from tierkv.core.spills import Spills
from tierkv.core.state import CpuState, DiskState, Entry
from tierkv.core.stats import Counters, IndexStats
from tierkv.errors import InvariantError, UsageError  # noqa: F401 (importable here)

_ON_DISK = DiskState.ON_DISK  # for every eviction: an Enum member lookup costs 50 ns on 3.11


class BlockIndex(Spills, Invariants):
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
        self.disk_capacity = disk_capacity  # in chunks
        # A disk tier is there (None: when it holds a chunk); its capacity may reach 0 later
        # (set_disk_capacity), which is "no room", not "no disk tier".
        self._has_disk = disk_capacity > 0 if disk_tier is None else disk_tier
        self.write_through = write_through
        self._spill_ahead_fraction = spill_ahead_fraction
        # A reserve larger than the disk would only evict the disk's copies of CPU chunks.
        self._clean_target = math.ceil(spill_ahead_fraction * min(num_slots, disk_capacity))
        self._retry_after_full = retry_after_full_seconds
        self._clock = clock
        self._job_ids = job_ids or JobIds()
        self._slots = SlotAllocator(num_slots)
        self._entries: dict[bytes, Entry] = {}
        self.eviction_policy = eviction_policy
        self._cpu = make_policy(eviction_policy, num_slots, num_pools=2)  # CLEAN, DIRTY
        self._disk = make_policy(DISK_POLICY, disk_capacity)  # ON_DISK, one pool
        self._disk_used = 0  # ON_DISK + SPILLING
        self._num_spilling = 0
        # The transient CPU states, counted as they change (READY chunks are the rest of the
        # used slots), so that statistics() walks nothing.
        self._num_storing = 0
        self._num_promoting = 0
        self._pending_deletes: list[bytes] = []
        self._disk_retry_at = -math.inf
        self._spills_stuck = False  # write-through left dirty chunks for want of disk room
        self._room_wanted = 0  # slots that found no victim since the last spill plan
        self._jobs: dict[JobId, Job] = {}
        self._counters = Counters()
        # Events (core/events.py): the log's list of touched keys, held here and appended
        # inline where a chunk's tiers change (None: no events recorded).
        self._events = EventLog() if record_events else None
        self._touched = self._events.touched if self._events is not None else None
        # The remote tier's part of the index (core/remote_marks.py); lookup reads its marks
        # dict inline.
        self._marks = RemoteMarks(remote_mark_seconds, max_remote_marks, clock)
        self._remote = self._marks.marks

    # ------------------------------------------------------------------ queries
    # has_disk (a property): core/index_state.py, with the helpers every part uses.
    @property
    def disk_used(self) -> int:
        """Chunks on disk or being written there (what the disk capacity bounds)."""
        return self._disk_used

    @property
    def disk_wanted(self) -> int:
        """Chunks the disk would hold once every chunk not on disk yet is written there:
        :attr:`disk_used` and the dirty CPU chunks. A disk budget plans again once this
        fills the capacity: once :attr:`disk_used` does is too late, the spills have evicted
        chunks on disk for room the cap still had (issue 41)."""
        return self._disk_used + (self._cpu.count(DIRTY) if self._has_disk else 0)

    def set_disk_capacity(self, num_chunks: int) -> int:
        """Make the disk capacity ``num_chunks`` (a budget shared with other stores moved).
        When the disk holds more, its least recently used chunks are evicted now (their
        deletes ride in the next spill job), except chunks being promoted, and spills in
        flight, which are evicted as they land. Returns how many were evicted; raises
        :class:`UsageError` without a disk tier."""
        if not self._has_disk:
            raise UsageError("block index: set_disk_capacity without a disk tier")
        self.disk_capacity = max(int(num_chunks), 0)
        self._clean_target = math.ceil(self._spill_ahead_fraction *
                                       min(self.num_slots, self.disk_capacity))
        return self._evict_over()

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
        """The remote tier has every rank's value of ``keys`` (docs/design.md, "The index's
        primitives"); keys the index holds, or whose remote load failed lately, are
        skipped. Returns how many were noted. With events, a key noted that had no mark is
        a ``stored`` event of medium ``REMOTE`` (core/events.py)."""
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
        """How many of ``keys`` would find neither a free slot nor a clean chunk to evict,
        while chunks not on disk yet (dirty, or spilling now) could become clean: the
        chunks to write back, or wait for, to make room for them. A store needs a slot for
        each key not present; a load (``load=True``) for each key not in the CPU tier
        (on disk or remote only), and its keys clean in the CPU tier are not victims."""
        if not (self._cpu.count(DIRTY) or self._num_spilling):
            return 0
        entries = self._entries
        if not load:
            new = sum(1 for key in keys if key not in entries)
            return max(new - self._slots.num_free - self._cpu.count(CLEAN), 0)
        new = held = 0
        pool_of = self._cpu.pool_of
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.cpu is None:
                new += 1
            elif pool_of(key) == CLEAN:
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
        (an idle engine would otherwise leave them on the CPU tier only, lost to a kill).
        False while the disk waits out a full disk, and after a plan left dirty chunks for
        want of disk room, until a job completes."""
        return (self.write_through and self.has_disk and not self._spills_stuck
                and self._cpu.count(DIRTY) > 0 and self._clock() >= self._disk_retry_at)

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
        # The scheduler's hot path (benchmarks/adapter.md): free slots are taken in one
        # bulk call, and while every key is new and finds a free slot, a key costs its
        # Entry and nothing else; the general loop takes over at the first exception.
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
                self._cpu.access(key)
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
                self._disk.access(key)
                chunks.append((key, slot, Source.DISK))
                self._counters.loads_disk += 1
                self._num_promoting += 1
            else:
                break
        if not chunks:
            return LoadPlan(None, ())
        job_id = self._job_ids.allocate()
        self._jobs[job_id] = Job(
            JobKind.LOAD, tuple(k for k, _, _ in chunks), tuple(d for _, _, d in chunks)
        )
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
                if key in corrupt:
                    self._counters.corrupt += 1
                else:
                    self._counters.disk_missing += 1
                self._drop_disk(entry, evicted=False)
                self._remove(key)
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

    # ------------------------------------------------------------------ spills
    # take_spills, complete_spill, add_on_disk: inherited from Spills (core/spills.py).
    def touch(self, keys: Iterable[bytes], *, reuse: bool = True) -> None:
        """Mark chunks as just used (``reuse``: see docs/design.md; a policy may count
        a reuse, ARC protects reused chunks from scans): READY chunks become the most recent
        of their CPU pool, chunks on disk the most recent on disk. Keys touched later count
        as more recent; absent or in-flight keys are skipped. No other effect."""
        entries = self._entries
        cpu_use = self._cpu.access if reuse else self._cpu.refresh
        disk_use = self._disk.access if reuse else self._disk.refresh
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                continue
            if entry.cpu is CpuState.READY:
                cpu_use(key)
            if entry.disk is DiskState.ON_DISK:
                disk_use(key)

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
    # _pop_job, _remove: core/index_state.py; _drop_disk: core/spills.py.
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
        # Dirty chunks are dropped without a disk tier, while it backs off after "full", and
        # while its capacity is 0 (a shared budget gave it all to other stores): nothing
        # could write them, and they would hold every slot.
        if victim is None and (not self.has_disk or not self.disk_capacity
                               or self._clock() < self._disk_retry_at):
            pool = DIRTY
            for key in cpu.victims(DIRTY):
                entry = entries[key]
                if entry.readers == 0 and key not in guard:
                    victim = entry
                    self._counters.dirty_dropped += 1
                    break
        if victim is None:
            if cpu.count(DIRTY) and self.has_disk:
                # Demand-driven write-back: the clean reserve may be made of chunks in use
                # (readers, the request's own keys); ask the next spill for one more.
                self._room_wanted += 1
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

    def cpu_only_keys(self) -> list[bytes]:
        """Chunks READY in the CPU tier and not on disk: what a shutdown flush writes."""
        ready = CpuState.READY
        return [key for key, entry in self._entries.items()
                if entry.cpu is ready and entry.disk is not _ON_DISK]

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
        return IndexStats.of(
            self._counters,
            num_slots=self.num_slots,
            free_slots=free,
            cpu_ready=self.num_slots - free - self._num_storing - self._num_promoting,
            storing=self._num_storing,
            promoting=self._num_promoting,
            spilling=self._num_spilling,
            on_disk=len(self._disk),
            disk_capacity=self.disk_capacity,
            remote_marks=len(self._remote),
        )

    # check(): every invariant, inherited from Invariants (core/invariants.py).


__all__ = [
    "BlockIndex",
    "ChunkCopy",
    "IndexStats",
    "LoadPlan",
    "LoadResult",
    "Lookup",
    "StoreBatch",
    "StorePlan",
]
