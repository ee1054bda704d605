"""The block index's disk side: write-back (spill plans and their completions) and the
disk capacity (LRU disk eviction; the deletes ride in the next spill job), and the chunks
found on disk at open (``add_on_disk``).

Functions of a :class:`~tierkv.core.index.BlockIndex`, which owns every attribute they
read and change (its methods of the same names call them). None is on the per-key hot
path of lookups, stores or loads: a spill plan is made at most once per engine step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from tierkv.core.jobs import Completion, JobKind, SlotId, SpillSpec, failed_set
from tierkv.core.plans import CLEAN, DIRTY, Job
from tierkv.core.state import CpuState, DiskState, Entry

if TYPE_CHECKING:
    from tierkv.core.index import BlockIndex


def take_spills(index: BlockIndex, flush: bool, at_least: int) -> SpillSpec | None:
    """The next spill job (see BlockIndex.take_spills), or None when there is nothing to do."""
    if not index.has_disk:
        return None
    writes: list[tuple[bytes, SlotId]] = []
    again: tuple[bytes, ...] = ()
    if flush or index._clock() >= index._disk_retry_at:
        cpu = index._cpu
        if flush or index.write_through:
            want = cpu.count(DIRTY)
        else:
            clean_now = index._slots.num_free + cpu.count(CLEAN) + index._num_spilling
            wanted = max(index._clean_target - clean_now, at_least, index._room_wanted)
            want = min(cpu.count(DIRTY), wanted)
        index._room_wanted = 0
        # Dirty chunks in the policy's victim order: the next to go become clean first.
        writes = start_spills(index, list(islice(cpu.victims(DIRTY), max(want, 0))), DIRTY)
        index._spills_stuck = len(writes) < want
        if flush:  # written before, their disk copy evicted: again, only into free room
            evicted = [key for key in cpu.victims(CLEAN)
                       if index._entries[key].disk is DiskState.EVICTED]
            again = tuple(evicted[: max(index.disk_capacity - index._disk_used, 0)])
            writes += start_spills(index, again, CLEAN)
    deletes = tuple(index._pending_deletes)
    index._pending_deletes.clear()
    if not writes and not deletes:
        return None
    job_id = index._job_ids.allocate()
    index._jobs[job_id] = Job(JobKind.SPILL, tuple(k for k, _ in writes), deletes=deletes,
                              again=again)
    return SpillSpec(job_id, tuple(writes), deletes)


def start_spills(index: BlockIndex, keys: Sequence[bytes],
                 pool: int) -> list[tuple[bytes, SlotId]]:
    """Spill ``keys`` of ``pool``, in order, while the disk has room or makes it (LRU)."""
    writes: list[tuple[bytes, SlotId]] = []
    entries = index._entries
    hold = index._cpu.hold
    spilling = DiskState.SPILLING
    for key in keys:
        if index._disk_used >= index.disk_capacity and not evict_disk(index):
            index._counters.disk_no_room += 1
            break
        entry = entries[key]
        assert entry.slot is not None
        hold(key, pool)
        entry.disk = spilling
        index._disk_used += 1
        writes.append((key, entry.slot))
    index._num_spilling += len(writes)
    return writes


def complete_spill(index: BlockIndex, completion: Completion) -> None:
    job = index._pop_job(completion.job_id, JobKind.SPILL)
    full = set(completion.full_keys)
    failed = failed_set(completion, job.keys)
    if full:
        index._disk_retry_at = index._clock() + index._retry_after_full
        index._counters.disk_no_room += len(full)
    cpu = index._cpu
    on_disk: list[bytes] = []
    for key in job.keys:
        entry = index._entries[key]
        assert entry.disk is DiskState.SPILLING and entry.cpu is CpuState.READY
        index._num_spilling -= 1
        if key not in failed:
            entry.disk = DiskState.ON_DISK
            on_disk.append(key)
            if index._touched is not None:
                index._touched.append(key)
            index._counters.spills_ok += 1
            cpu.place(key, CLEAN, oldest=True)
        else:  # not written: as it was (a chunk written once stays EVICTED, clean)
            again = key in job.again
            entry.disk = DiskState.EVICTED if again else None
            index._disk_used -= 1
            index._counters.spills_failed += 1
            cpu.place(key, CLEAN if again else DIRTY, oldest=True)
    index._disk.insert(on_disk, 0)
    if index._disk_used > index.disk_capacity:  # the capacity shrank meanwhile
        evict_over(index)


def evict_over(index: BlockIndex) -> int:
    """Evict chunks on disk while the disk holds more than its capacity."""
    evicted = 0
    while index._disk_used > index.disk_capacity and evict_disk(index):
        evicted += 1
    return evicted


def evict_disk(index: BlockIndex) -> bool:
    """Evict the least recently used chunk on disk that is not being promoted."""
    for key in index._disk.victims(0):
        entry = index._entries[key]
        if entry.cpu is CpuState.PROMOTING:
            continue
        index._pending_deletes.append(key)
        index._counters.disk_evictions += 1
        index._drop_disk(entry, evicted=True)
        if entry.cpu is None:
            index._remove(key)
        else:  # READY: written once in this stay, never again (it stays clean)
            entry.disk = DiskState.EVICTED
        return True
    return False


def add_on_disk(index: BlockIndex, keys: Iterable[bytes]) -> int:
    """Register chunks found on disk at open, oldest first (see BlockIndex.add_on_disk)."""
    added: list[bytes] = []
    for key in keys:
        if key in index._entries:
            continue
        if index._disk_used >= index.disk_capacity:
            index._pending_deletes.append(key)
            continue
        index._entries[key] = Entry(key, disk=DiskState.ON_DISK)
        added.append(key)
        if index._touched is not None:
            index._touched.append(key)
        index._disk_used += 1
    index._disk.insert(added, 0)
    return len(added)
