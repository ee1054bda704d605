"""The block index's disk side: write-back (spill plans and their completions) and the
disk capacity (LRU disk eviction; the deletes ride in the next spill job), and the chunks
found on disk at open (``add_on_disk``).

:class:`Spills` is a part of :class:`~tierkv.core.index.BlockIndex` (which inherits it):
methods over the index's attributes, declared in core/index_state.py. None is on the
per-key hot path of lookups, stores or loads: a spill plan is made at most once per engine
step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from tierkv.core.index_state import IndexState
from tierkv.core.jobs import Completion, JobKind, SlotId, SpillSpec, failed_set
from tierkv.core.plans import CLEAN, DIRTY, Job
from tierkv.core.state import CpuState, DiskState, Entry


class Spills(IndexState):
    """Write-back, the disk capacity and the chunks found on disk: BlockIndex's methods."""

    def take_spills(self, flush: bool = False, at_least: int = 0) -> SpillSpec | None:
        """Write-back: a spill job for dirty chunks, and the disk deletes due; None when
        there is nothing to do."""
        if not self.has_disk:
            return None
        writes: list[tuple[bytes, SlotId]] = []
        again: tuple[bytes, ...] = ()
        if flush or self._clock() >= self._disk_retry_at:
            cpu = self._cpu
            if flush or self.write_through:
                want = cpu.count(DIRTY)
            else:
                clean_now = self._slots.num_free + cpu.count(CLEAN) + self._num_spilling
                wanted = max(self._clean_target - clean_now, at_least, self._room_wanted)
                want = min(cpu.count(DIRTY), wanted)
            self._room_wanted = 0
            # Dirty chunks in the policy's victim order: the next to go become clean first.
            writes = self._start_spills(list(islice(cpu.victims(DIRTY), max(want, 0))), DIRTY)
            self._spills_stuck = len(writes) < want
            if flush:  # written before, their disk copy evicted: again, only into free room
                evicted = [key for key in cpu.victims(CLEAN)
                           if self._entries[key].disk is DiskState.EVICTED]
                again = tuple(evicted[: max(self.disk_capacity - self._disk_used, 0)])
                writes += self._start_spills(again, CLEAN)
        deletes = tuple(self._pending_deletes)
        self._pending_deletes.clear()
        if not writes and not deletes:
            return None
        job_id = self._job_ids.allocate()
        self._jobs[job_id] = Job(JobKind.SPILL, tuple(k for k, _ in writes), deletes=deletes,
                                 again=again)
        return SpillSpec(job_id, tuple(writes), deletes)

    def _start_spills(self, keys: Sequence[bytes], pool: int) -> list[tuple[bytes, SlotId]]:
        """Spill ``keys`` of ``pool``, in order, while the disk has room or makes it (LRU)."""
        writes: list[tuple[bytes, SlotId]] = []
        entries = self._entries
        hold = self._cpu.hold
        spilling = DiskState.SPILLING
        for key in keys:
            if self._disk_used >= self.disk_capacity and not self._evict_disk():
                self._counters.disk_no_room += 1
                break
            entry = entries[key]
            assert entry.slot is not None
            hold(key, pool)
            entry.disk = spilling
            self._disk_used += 1
            writes.append((key, entry.slot))
        self._num_spilling += len(writes)
        return writes

    def complete_spill(self, completion: Completion) -> None:
        job = self._pop_job(completion.job_id, JobKind.SPILL)
        full = set(completion.full_keys)
        failed = failed_set(completion, job.keys)
        if full:
            self._disk_retry_at = self._clock() + self._retry_after_full
            self._counters.disk_no_room += len(full)
        cpu = self._cpu
        on_disk: list[bytes] = []
        for key in job.keys:
            entry = self._entries[key]
            assert entry.disk is DiskState.SPILLING and entry.cpu is CpuState.READY
            self._num_spilling -= 1
            if key not in failed:
                entry.disk = DiskState.ON_DISK
                on_disk.append(key)
                if self._touched is not None:
                    self._touched.append(key)
                self._counters.spills_ok += 1
                cpu.place(key, CLEAN, oldest=True)
            else:  # not written: as it was (a chunk written once stays EVICTED, clean)
                again = key in job.again
                entry.disk = DiskState.EVICTED if again else None
                self._disk_used -= 1
                self._counters.spills_failed += 1
                cpu.place(key, CLEAN if again else DIRTY, oldest=True)
        self._disk.insert(on_disk, 0)
        if self._disk_used > self.disk_capacity:  # the capacity shrank meanwhile
            self._evict_over()

    def _evict_over(self) -> int:
        """Evict chunks on disk while the disk holds more than its capacity."""
        evicted = 0
        while self._disk_used > self.disk_capacity and self._evict_disk():
            evicted += 1
        return evicted

    def _evict_disk(self) -> bool:
        """Evict the least recently used chunk on disk that is not being promoted."""
        for key in self._disk.victims(0):
            entry = self._entries[key]
            if entry.cpu is CpuState.PROMOTING:
                continue
            self._pending_deletes.append(key)
            self._counters.disk_evictions += 1
            self._drop_disk(entry, evicted=True)
            if entry.cpu is None:
                self._remove(key)
            else:  # READY: written once in this stay, never again (it stays clean)
                entry.disk = DiskState.EVICTED
            return True
        return False

    def _drop_disk(self, entry: Entry, *, evicted: bool) -> None:
        """The disk tier no longer holds ``entry``'s chunk (``evicted``: by the capacity)."""
        if self._touched is not None:
            self._touched.append(entry.key)
        if entry.disk is DiskState.ON_DISK:
            if evicted:
                self._disk.evict(entry.key, 0)
            else:
                self._disk.discard(entry.key, 0)
            self._disk_used -= 1
        entry.disk = None

    def add_on_disk(self, keys: Iterable[bytes]) -> int:
        """Register chunks found on disk at open, oldest first. Where they are more than the
        disk capacity holds, the oldest are queued for deletion (sent with the next spill
        job) and the newest kept: a restart keeps what was stored last."""
        found: list[bytes] = []
        seen: set[bytes] = set()
        for key in keys:
            if key not in self._entries and key not in seen:
                seen.add(key)
                found.append(key)
        room = max(0, self.disk_capacity - self._disk_used)
        over = max(0, len(found) - room)
        self._pending_deletes.extend(found[:over])
        added = found[over:]
        for key in added:
            self._entries[key] = Entry(key, disk=DiskState.ON_DISK)
            if self._touched is not None:
                self._touched.append(key)
        self._disk_used += len(added)
        self._disk.insert(added, 0)
        return len(added)

__all__ = ["Spills"]
