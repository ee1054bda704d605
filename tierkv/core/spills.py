"""The block index's disk side, :class:`WriteBack`: write-back (which dirty chunks to spill,
and what their completion changes), the disk capacity (its LRU order, evictions, and the
deletes that ride in the next spill job) and the chunks found on disk at open.

It owns its state: the capacity, the disk order, the chunks on disk or being written
(``used``, ``spilling``), the deletes due, the back-off after a full disk and the demand for
room. :class:`~tierkv.core.index.BlockIndex` holds one and calls it; it is given the
index's entries (it sets their ``disk`` state, and forgets an entry that is left in no
tier), the CPU policy (a spill moves a dirty chunk to the WRITING pool, out of the victim
order, and back to CLEAN once written, or to DIRTY if not), the counters and the
touched-keys list of events. It knows nothing of jobs: the index files a plan as a spill
job and hands its keys back at completion. None of it is on the per-key hot path of
lookups, stores or loads: a spill plan is made at most once per engine step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from tierkv.core.jobs import Completion, SlotId, failed_set
from tierkv.core.plans import CLEAN, DIRTY, WRITING, CpuState, DiskState, Entry
from tierkv.core.policies import DISK_POLICY, make_policy
from tierkv.core.policy import EvictionPolicy, require
from tierkv.core.stats import IndexStats

Writes = list[tuple[bytes, SlotId]]


class WriteBack:
    """Write-back and the disk capacity of one block index (module docstring)."""

    def __init__(self, entries: dict[bytes, Entry], cpu: EvictionPolicy, counters: IndexStats,
                 touched: list[bytes] | None, clock: Callable[[], float], *, num_slots: int,
                 capacity: int, write_through: bool, spill_ahead_fraction: float,
                 retry_after_full: float) -> None:
        self._entries = entries
        self._cpu = cpu  # pools CLEAN, DIRTY, WRITING
        self._counters = counters
        self._touched = touched
        self._clock = clock
        self._num_slots = num_slots
        self._spill_ahead = spill_ahead_fraction
        self._clean_target = 0  # the clean reserve write-back keeps (set by resize)
        self._retry_after_full = retry_after_full
        self.write_through = write_through
        self.capacity = capacity  # in chunks; read by the index, set by resize()
        self.used = 0  # chunks on disk and being written there (what the capacity bounds)
        self.spilling = 0  # chunks being written there
        self._order = make_policy(DISK_POLICY, capacity)  # ON_DISK, one pool
        # A chunk on disk was used (``reuse``: a load of it): the most recent on disk. The
        # policy's own method, bound once: the index calls it per key of loads and touches.
        self.use = self._order.touch
        self._deletes: list[bytes] = []  # disk deletes due, sent with the next spill job
        self._retry_at = -math.inf  # a full disk: no spill plan before then
        # Write-through left dirty chunks for want of disk room; the index clears it when any
        # of its jobs completes (room may have changed).
        self.stuck = False
        self._room_wanted = 0  # slots that found no victim since the last spill plan
        self.resize(capacity)

    def __len__(self) -> int:
        """Chunks on disk (not counting those being written)."""
        return self._order.count(0)

    # ------------------------------------------------------------------ asked by the index
    def wanted(self) -> bool:
        """Write-through has dirty chunks it can spill now (``BlockIndex.spills_wanted``)."""
        return (self.write_through and not self.stuck and self._cpu.count(DIRTY) > 0
                and self._clock() >= self._retry_at)

    def may_drop_dirty(self) -> bool:
        """Nothing could write dirty chunks now (no capacity, or backing off after a full
        disk): the CPU tier may evict them unwritten rather than let them hold every slot."""
        return not self.capacity or self._clock() < self._retry_at

    def want_room(self) -> None:
        """A slot found no victim while dirty chunks could become clean: ask the next spill
        plan for one more (the clean reserve may be made of chunks in use)."""
        self._room_wanted += 1

    # ------------------------------------------------------------------ write-back
    def plan(self, free_slots: int, flush: bool, at_least: int
             ) -> tuple[Writes, tuple[bytes, ...], tuple[bytes, ...]] | None:
        """The writes (key, slot) of a spill job, its deletes, and the chunks it writes
        again (a flush's EVICTED ones); None when there is nothing to do."""
        writes: Writes = []
        again: tuple[bytes, ...] = ()
        if flush or self._clock() >= self._retry_at:
            cpu = self._cpu
            if flush or self.write_through:
                want = cpu.count(DIRTY)
            else:
                clean_now = free_slots + cpu.count(CLEAN) + self.spilling
                want = min(cpu.count(DIRTY), max(self._clean_target - clean_now, at_least,
                                                 self._room_wanted))
            self._room_wanted = 0
            # Dirty chunks in the policy's victim order: the next to go become clean first.
            writes = self._start(list(islice(cpu.victims(DIRTY), max(want, 0))), DIRTY)
            self.stuck = len(writes) < want
            if flush:  # written before, their disk copy evicted: again, only into free room
                evicted = [key for key in cpu.victims(CLEAN)
                           if self._entries[key].disk is DiskState.EVICTED]
                again = tuple(evicted[: max(self.capacity - self.used, 0)])
                writes += self._start(again, CLEAN)
        deletes = tuple(self._deletes)
        self._deletes.clear()
        if not writes and not deletes:
            return None
        return writes, deletes, again

    def _start(self, keys: Sequence[bytes], pool: int) -> Writes:
        """Spill ``keys`` of ``pool``, in order, while the disk has room or makes it (LRU)."""
        writes: Writes = []
        entries = self._entries
        spilling = DiskState.SPILLING
        for key in keys:
            if self.used >= self.capacity and not self._evict_one():
                self._counters.disk_no_room += 1
                break
            entry = entries[key]
            assert entry.slot is not None
            entry.disk = spilling
            self.used += 1
            writes.append((key, entry.slot))
        self.spilling += len(writes)
        self._cpu.move([key for key, _ in writes], pool, WRITING)
        return writes

    def landed(self, keys: tuple[bytes, ...], again: tuple[bytes, ...],
               completion: Completion) -> None:
        """A spill job of ``keys`` completed: written chunks are on disk and clean, the
        others as they were (a chunk written once stays EVICTED, clean)."""
        full = set(completion.full_keys)
        failed = failed_set(completion, keys)
        if full:
            self._retry_at = self._clock() + self._retry_after_full
            self._counters.disk_no_room += len(full)
        counters = self._counters
        on_disk: list[bytes] = []
        dirty: list[bytes] = []  # not written: dirty again (the others stay clean)
        for key in keys:
            entry = self._entries[key]
            assert entry.disk is DiskState.SPILLING and entry.cpu is CpuState.READY
            self.spilling -= 1
            if key not in failed:
                entry.disk = DiskState.ON_DISK
                on_disk.append(key)
                if self._touched is not None:
                    self._touched.append(key)
                counters.spills_ok += 1
            else:
                written_before = key in again
                entry.disk = DiskState.EVICTED if written_before else None
                self.used -= 1
                counters.spills_failed += 1
                if not written_before:
                    dirty.append(key)
        # Each the least recent of its pool, in the job's order.
        if dirty:
            again_dirty = set(dirty)
            self._cpu.move([key for key in keys if key not in again_dirty], WRITING, CLEAN)
            self._cpu.move(dirty, WRITING, DIRTY)
        else:
            self._cpu.move(keys, WRITING, CLEAN)
        self._order.insert(on_disk, 0)
        if self.used > self.capacity:  # the capacity shrank meanwhile
            self._evict_over()

    # ------------------------------------------------------------------ the disk capacity
    def resize(self, capacity: int) -> int:
        """Make the capacity ``capacity``; evict the least recently used chunks over it now
        (not those being promoted; spills in flight as they land). Returns how many."""
        self.capacity = max(int(capacity), 0)
        # A reserve larger than the disk would only evict the disk's copies.
        self._clean_target = math.ceil(self._spill_ahead * min(self._num_slots, self.capacity))
        return self._evict_over()

    def lost(self, entry: Entry, *, corrupt: bool) -> None:
        """A load found ``entry``'s chunk damaged (``corrupt``: deleted there) or missing on
        disk; its promotion failed (no CPU slot): the index forgets it."""
        if corrupt:
            self._counters.corrupt += 1
        else:
            self._counters.disk_missing += 1
        self._drop(entry)
        del self._entries[entry.key]

    def add(self, keys: Iterable[bytes]) -> int:
        """Register chunks found on disk at open, oldest first. Where they are more than
        the capacity holds, the oldest are queued for deletion (sent with the next spill
        job) and the newest kept: a restart keeps what was stored last."""
        found: list[bytes] = []
        seen: set[bytes] = set()
        for key in keys:
            if key not in self._entries and key not in seen:
                seen.add(key)
                found.append(key)
        over = max(0, len(found) - max(0, self.capacity - self.used))
        self._deletes.extend(found[:over])
        added = found[over:]
        for key in added:
            self._entries[key] = Entry(key, disk=DiskState.ON_DISK)
        if self._touched is not None:
            self._touched.extend(added)
        self.used += len(added)
        self._order.insert(added, 0)
        return len(added)

    def _evict_over(self) -> int:
        """Evict chunks on disk while the disk holds more than its capacity."""
        evicted = 0
        while self.used > self.capacity and self._evict_one():
            evicted += 1
        return evicted

    def _evict_one(self) -> bool:
        """Evict the least recently used chunk on disk that is not being promoted."""
        for key in self._order.victims(0):
            entry = self._entries[key]
            if entry.cpu is CpuState.PROMOTING:
                continue
            self._deletes.append(key)
            self._counters.disk_evictions += 1
            self._drop(entry)
            if entry.cpu is None:  # in no tier now
                del self._entries[key]
            else:  # READY: written once in this stay, never again (it stays clean)
                entry.disk = DiskState.EVICTED
            return True
        return False

    def _drop(self, entry: Entry) -> None:
        if self._touched is not None:
            self._touched.append(entry.key)
        if entry.disk is DiskState.ON_DISK:
            self._order.evict(entry.key, 0)  # LRU keeps no ghosts
            self.used -= 1
        entry.disk = None

    # ------------------------------------------------------------------ the check
    def check(self) -> None:
        """The disk side's invariants (``BlockIndex.check`` calls it); the error names the
        broken entry."""
        listed: dict[bytes, int] = {}
        spilling = promoting = 0
        for key, entry in self._entries.items():
            if entry.disk is DiskState.SPILLING:
                spilling += 1
            elif entry.disk is DiskState.ON_DISK:
                listed[key] = 0
                promoting += entry.cpu is CpuState.PROMOTING
        self._order.check(listed)
        require(spilling == self.spilling, f"{spilling} chunks spilling, counted {self.spilling}")
        require(self.used == len(self) + spilling,
                f"disk used {self.used} != {len(self)} on disk + {spilling}")
        # Over the capacity only by what could not be evicted when it shrank: chunks being
        # promoted (on disk) or spilled.
        require(self.used <= max(self.capacity, 0) + spilling + promoting,
                f"disk used {self.used} > capacity {self.capacity}")


__all__ = ["WriteBack"]
