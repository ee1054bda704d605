"""The block index's statistics: the snapshot ``BlockIndex.statistics()`` returns
(:class:`IndexStats`) and the running counts behind it (:class:`Counters`, whose fields
``statistics()`` passes on by name: every one of them is a field of IndexStats)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexStats:
    num_slots: int
    free_slots: int
    cpu_ready: int
    storing: int
    promoting: int
    spilling: int
    on_disk: int
    disk_capacity: int
    stores_planned: int
    stores_present: int
    stores_no_room: int
    stores_failed: int
    loads_cpu: int
    loads_disk: int
    loads_failed: int
    loads_no_room: int
    corrupt: int
    disk_missing: int
    cpu_evictions: int
    dirty_dropped: int
    disk_evictions: int
    spills_ok: int
    spills_failed: int
    disk_no_room: int
    remote_marks: int = 0  # marks held (aged ones until the next note_remote drops them)
    loads_remote: int = 0
    remote_missing: int = 0  # phantoms: noted remotely, gone when loaded
    remote_corrupt: int = 0
    remote_failed: int = 0  # remote loads that failed otherwise (network, breaker)


@dataclass
class Counters:
    """The index's running counts (IndexStats' counters, in the same order)."""

    stores_planned: int = 0
    stores_present: int = 0
    stores_no_room: int = 0
    stores_failed: int = 0
    loads_cpu: int = 0
    loads_disk: int = 0
    loads_failed: int = 0
    loads_no_room: int = 0
    corrupt: int = 0
    disk_missing: int = 0
    cpu_evictions: int = 0
    dirty_dropped: int = 0
    disk_evictions: int = 0
    spills_ok: int = 0
    spills_failed: int = 0
    disk_no_room: int = 0
    loads_remote: int = 0
    remote_missing: int = 0
    remote_corrupt: int = 0
    remote_failed: int = 0


__all__ = ["Counters", "IndexStats"]
