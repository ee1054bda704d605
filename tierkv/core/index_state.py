"""The block index's state, declared once: the base class of its parts.

:class:`~tierkv.core.index.BlockIndex` is one class written in three modules: its hot
paths (core/index.py), its disk side (core/spills.py: :class:`Spills`) and its consistency
check (core/invariants.py: :class:`Invariants`). Each part is a class over
:class:`IndexState`, which declares every attribute ``BlockIndex.__init__`` sets (that is
where their values and meaning are given) and the helpers all parts use, so mypy checks
each part against one declaration and the imports run one way: index.py imports the
parts, the parts import this module, never index.py.
"""

from __future__ import annotations

from collections.abc import Callable

from tierkv.core.events import EventLog
from tierkv.core.jobs import JobId, JobIds, JobKind
from tierkv.core.plans import Job
from tierkv.core.policy import EvictionPolicy
from tierkv.core.remote_marks import RemoteMarks
from tierkv.core.slots import SlotAllocator
from tierkv.core.state import Entry
from tierkv.core.stats import IndexStats
from tierkv.errors import UsageError


class IndexState:
    """Every attribute of a block index (set by ``BlockIndex.__init__``), and the helpers
    its parts share. Holds no code of its own beyond those helpers; never made alone."""

    num_slots: int
    disk_capacity: int  # in chunks
    write_through: bool
    eviction_policy: str
    _has_disk: bool
    _spill_ahead_fraction: float
    _clean_target: int
    _retry_after_full: float
    _clock: Callable[[], float]
    _job_ids: JobIds
    _slots: SlotAllocator
    _entries: dict[bytes, Entry]
    _cpu: EvictionPolicy  # pools CLEAN, DIRTY
    _disk: EvictionPolicy  # ON_DISK, one pool
    _disk_used: int  # ON_DISK + SPILLING
    _num_spilling: int
    _num_storing: int
    _num_promoting: int
    _pending_deletes: list[bytes]
    _disk_retry_at: float
    _spills_stuck: bool
    _room_wanted: int
    _jobs: dict[JobId, Job]
    _counters: IndexStats
    _events: EventLog | None
    _touched: list[bytes] | None
    _marks: RemoteMarks
    _remote: dict[bytes, float]

    @property
    def has_disk(self) -> bool:
        return self._has_disk

    def _pop_job(self, job_id: JobId, kind: JobKind) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise UsageError(f"block index: no {kind.value} job {job_id} in flight (completed "
                             f"already, or never planned by this index)")
        if job.kind is not kind:  # the job stays in flight: nothing changed
            raise UsageError(f"block index: job {job_id} is a {job.kind.value} job, not a "
                             f"{kind.value} job")
        del self._jobs[job_id]
        self._spills_stuck = False  # room may have changed
        return job

    def _remove(self, key: bytes) -> None:
        del self._entries[key]
        if self._touched is not None:
            self._touched.append(key)


__all__ = ["IndexState"]
