"""The block index's plain records: what its primitives answer (:class:`Lookup`,
:class:`StorePlan`, :class:`StoreBatch`, :class:`LoadPlan`, :class:`LoadResult`), where a
load reads a chunk from (:class:`Source`), its record of a job in flight (:class:`Job`),
and the CPU eviction policy's pools (``CLEAN``, ``DIRTY``, ``WRITING``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from tierkv.core.jobs import JobId, JobKind, SlotId

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
