"""The block index's statistics, declared once (:mod:`tierkv.core.figures`): the running
counts (:class:`Counters`, which the index increments) and the snapshot
``BlockIndex.statistics()`` returns (:class:`IndexStats`: the counters at that moment and
the index's gauges)."""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.core.figures import Snapshot, counter, gauge


@dataclass
class Counters:
    """The index's running counts (the counters of :class:`IndexStats`)."""

    stores_planned: int = counter("Chunks planned for a store (GPU -> CPU)")
    stores_present: int = counter("Chunks asked to store that the index already held")
    stores_no_room: int = counter("Chunks not stored for want of a free CPU slot")
    stores_failed: int = counter("Chunks whose store job failed")
    loads_cpu: int = counter("Chunks loaded from the CPU tier")
    loads_disk: int = counter("Chunks loaded from the disk tier (through a CPU slot)")
    loads_failed: int = counter("Chunk loads that failed; their tokens are recomputed")
    loads_no_room: int = counter("Chunk loads refused for want of a CPU slot")
    corrupt: int = counter("Chunks read from disk whose bytes failed their checks")
    disk_missing: int = counter("Chunks the index held on disk that were gone when loaded")
    cpu_evictions: int = counter("Chunks evicted from the CPU tier")
    dirty_dropped: int = counter("Chunks evicted from the CPU tier before they reached disk")
    disk_evictions: int = counter("Chunks evicted from the disk tier")
    spills_ok: int = counter("Chunks written from the CPU tier to disk")
    spills_failed: int = counter("Chunks whose write to disk failed")
    disk_no_room: int = counter("Chunks not written to disk for want of room")
    loads_remote: int = counter("Chunks loaded from the remote tier")
    remote_missing: int = counter("Phantoms: chunks noted remotely, gone when loaded")
    remote_corrupt: int = counter("Chunks read from the remote tier whose bytes failed a check")
    remote_failed: int = counter("Remote loads that failed otherwise (network, breaker)")


@dataclass(kw_only=True, unsafe_hash=True)
class IndexStats(Snapshot, Counters):
    """A snapshot (read-only, see :class:`Snapshot`): the counters (fields of
    :class:`Counters`) and the gauges below."""

    num_slots: int = gauge("CPU slots")
    free_slots: int = gauge("CPU slots free")
    cpu_ready: int = gauge("Chunks ready in the CPU tier")
    storing: int = gauge("Chunks being stored into the CPU tier")
    promoting: int = gauge("Chunks being read from disk into the CPU tier")
    spilling: int = gauge("Chunks being written to disk")
    on_disk: int = gauge("Chunks on disk")
    disk_capacity: int = gauge("Chunks the disk tier can hold")
    remote_marks: int = gauge("Remote marks held (aged ones until the next note_remote drops "
                              "them)")


__all__ = ["Counters", "IndexStats"]
