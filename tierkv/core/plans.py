"""The block index's plain records: its record of one chunk (:class:`Entry`, with its
:class:`CpuState` and :class:`DiskState`), what its primitives answer (:class:`Lookup`,
:class:`StorePlan`, :class:`StoreBatch`, :class:`LoadPlan`, :class:`LoadResult`), where a
load reads a chunk from (:class:`Source`), its record of a job in flight (:class:`Job`),
and the CPU eviction policy's pools (``CLEAN``, ``DIRTY``, ``WRITING``).

A chunk's states (an enum, never a bare -1):

CPU side:  STORING (slot allocated, GPU->CPU copy in flight: not a hit)
           -> READY (a hit; evictable when no load reads it)
           READY with ``readers = n > 0`` is LOADING(n): not evictable.
           PROMOTING (disk -> CPU -> GPU in flight for one load: "not yet" to lookups).
Disk side: SPILLING (CPU -> disk write in flight; the CPU slot is pinned until it ends)
           -> ON_DISK -> EVICTED (the disk dropped the copy of a chunk still READY in the CPU
           tier: clean, dropped when the CPU tier evicts it, written again only by a flush,
           into free disk room: a chunk is written once per stay in the CPU tier).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from tierkv.core.jobs import JobId, JobKind, SlotId
from tierkv.core.policy import require
from tierkv.errors import InvariantError


class CpuState(Enum):
    STORING = "storing"
    READY = "ready"
    PROMOTING = "promoting"


class DiskState(Enum):
    SPILLING = "spilling"
    ON_DISK = "on_disk"
    EVICTED = "evicted"


@dataclass(slots=True)
class Entry:
    """Where one chunk is. ``slot is None`` exactly when ``cpu is None``."""

    key: bytes
    slot: SlotId | None = None
    cpu: CpuState | None = None
    readers: int = 0
    disk: DiskState | None = None

    @property
    def on_disk(self) -> bool:
        return self.disk is DiskState.ON_DISK

    def check(self, key: bytes) -> None:
        """Raise :class:`~tierkv.errors.InvariantError` naming this entry (filed under
        ``key``) unless its states agree with each other."""
        cpu, disk = self.cpu, self.disk
        if not (self.key == key and (self.slot is None) == (cpu is None)
                and (cpu is not None or disk is DiskState.ON_DISK) and self.readers >= 0
                and (not self.readers or cpu in (CpuState.READY, CpuState.PROMOTING))
                # promoted from disk (on disk) or remote (not), for one load
                and (cpu is not CpuState.PROMOTING
                     or (self.readers == 1 and disk in (DiskState.ON_DISK, None)))
                and (disk is not DiskState.SPILLING or cpu is CpuState.READY)):
            raise InvariantError(f"inconsistent entry {self} filed under {key[:4].hex()}")

# The CPU policy's pools: READY chunks that are safe to evict now (on disk, or no disk
# tier), READY chunks not on disk yet (disk tier on, no spill in flight), and READY chunks
# being spilled (no victims: never walked).
CLEAN, DIRTY, WRITING = 0, 1, 2


class Source(Enum):
    """Where a load job reads a chunk from."""

    CPU = "cpu"
    DISK = "disk"
    REMOTE = "remote"


class Lookup(NamedTuple):
    num_hits: int  # contiguous ready chunks from the start of the keys
    pending: bool  # the walk stopped at a chunk being promoted: ask again later
    num_on_cpu: int = 0  # of the hits, chunks ready in the CPU tier
    num_remote: int = 0  # of the hits, chunks known on the remote tier only


class StorePlan(NamedTuple):
    job_id: JobId | None
    chunks: tuple[tuple[bytes, SlotId], ...]
    num_present: int
    num_no_room: int


class StoreBatch(NamedTuple):
    job_id: JobId | None
    keys: tuple[bytes, ...]  # the keys to store, in the order given
    slots: tuple[SlotId, ...]
    placed: list[int] | None  # their positions in the keys given; None: every key
    num_present: int
    num_no_room: int


class LoadPlan(NamedTuple):
    job_id: JobId | None
    chunks: tuple[tuple[bytes, SlotId, bool], ...]  # (key, slot, from_disk)
    from_remote: frozenset[bytes] = frozenset()  # keys read from the remote tier first


class LoadResult(NamedTuple):
    ok_keys: tuple[bytes, ...]
    failed_keys: tuple[bytes, ...]


@dataclass(slots=True)
class Job:
    """The index's record of a job in flight."""

    kind: JobKind
    keys: tuple[bytes, ...]
    sources: tuple[Source, ...] = ()  # loads
    deletes: tuple[bytes, ...] = ()
    again: tuple[bytes, ...] = ()  # a flush's EVICTED chunks (EVICTED again if they fail)

    def check(self, job_id: JobId, entries: dict[bytes, Entry], readers: dict[bytes, int]) -> None:
        """Each chunk it names is indexed in the state the job holds it in (a load's
        promotion from its source, a store's STORING, a spill's SPILLING); a load's chunks
        are counted into ``readers``."""
        for key, source in zip(self.keys, self.sources or [None] * len(self.keys)):
            found = entries.get(key)
            require(found is not None, "job", job_id, "names chunk", key[:4].hex(), "not indexed")
            assert found is not None
            if self.kind is JobKind.LOAD:
                readers[key] = readers.get(key, 0) + 1
                require(source is Source.CPU or (found.cpu is CpuState.PROMOTING and (
                    found.disk is DiskState.ON_DISK) == (source is Source.DISK)),
                    "promotion", job_id, "from", source, "for", found)
            else:
                require(found.cpu is CpuState.STORING if self.kind is JobKind.STORE
                        else found.disk is DiskState.SPILLING, self.kind.value, "job",
                        job_id, "for", found)
