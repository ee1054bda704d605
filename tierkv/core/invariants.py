"""The block index's consistency check: every invariant of a
:class:`~tierkv.core.index.BlockIndex` (its ``check()``), for tests after each step.

Raises :class:`~tierkv.errors.InvariantError` naming the broken entry, through
:func:`~tierkv.core.policy.require` rather than ``assert``, so ``python -O`` keeps it.
Reads the index's attributes and changes nothing. :class:`Invariants` is a part of
:class:`~tierkv.core.index.BlockIndex` (which inherits it), over the attributes declared
in core/index_state.py.
"""

from __future__ import annotations

from tierkv.core.index_state import IndexState
from tierkv.core.jobs import JobKind, SlotId
from tierkv.core.plans import CLEAN, DIRTY, Source
from tierkv.core.policy import require
from tierkv.core.state import CpuState, DiskState
from tierkv.errors import InvariantError


class Invariants(IndexState):
    """The consistency check: BlockIndex's ``check()``."""

    def check(self) -> None:
        """Every invariant of the index; the error names the broken entry."""
        used: set[SlotId] = set()
        spilling: set[bytes] = set()
        cpu_listed: dict[bytes, int] = {}
        disk_listed: dict[bytes, int] = {}
        for key, entry in self._entries.items():
            require(entry.key == key, "entry filed under another key:", entry)
            require((entry.slot is None) == (entry.cpu is None), entry)
            require(entry.cpu is not None or entry.disk is DiskState.ON_DISK, "empty entry:",
                    entry)
            require(entry.readers >= 0, entry)
            if entry.readers:
                require(entry.cpu in (CpuState.READY, CpuState.PROMOTING), entry)
            if entry.cpu is CpuState.PROMOTING:  # from disk (on disk) or remote (not)
                require(entry.readers == 1 and entry.disk in (DiskState.ON_DISK, None), entry)
            if entry.slot is not None:
                require(entry.slot not in used, "slot held twice:", entry)
                require(not self._slots.is_free(entry.slot), "slot of an entry is free:", entry)
                used.add(entry.slot)
            if entry.disk is DiskState.SPILLING:
                require(entry.cpu is CpuState.READY, entry)
                spilling.add(key)
            if entry.cpu is CpuState.READY and entry.disk is not DiskState.SPILLING:
                clean = entry.disk is not None or not self.has_disk  # else dirty
                cpu_listed[key] = CLEAN if clean else DIRTY
            require(self._cpu.pool_of(key) == cpu_listed.get(key), "cpu pool of", entry)
            if entry.disk is DiskState.ON_DISK:
                disk_listed[key] = 0
            require(self._disk.pool_of(key) == disk_listed.get(key), "disk order of", entry)
        self._cpu.check(cpu_listed, spilling)
        self._disk.check(disk_listed, ())
        require(len(used) + self._slots.num_free == self.num_slots,
                f"{len(used)} slots used + {self._slots.num_free} free != {self.num_slots}")
        require(len(spilling) == self._num_spilling,
                f"{len(spilling)} chunks spilling, counted {self._num_spilling}")
        states = [entry.cpu for entry in self._entries.values()]
        # The counts statistics() reports (every used slot: STORING, PROMOTING or READY).
        ready = self.num_slots - self._slots.num_free - self._num_storing - self._num_promoting
        for state, kept in ((CpuState.STORING, self._num_storing),
                            (CpuState.PROMOTING, self._num_promoting),
                            (CpuState.READY, ready)):
            require(states.count(state) == kept,
                    f"{states.count(state)} chunks {state.value}, counted {kept}")
        require(self._disk_used == len(self._disk) + len(spilling),
                f"disk used {self._disk_used} != {len(self._disk)} on disk + {len(spilling)}")
        self._marks.check()
        # Over the capacity only by what could not be evicted when it shrank: chunks being
        # promoted (on disk) or spilled.
        promoting = sum(1 for entry in self._entries.values()
                        if entry.cpu is CpuState.PROMOTING and entry.disk is DiskState.ON_DISK)
        require(self._disk_used <= max(self.disk_capacity, 0) + len(spilling) + promoting,
                f"disk used {self._disk_used} > capacity {self.disk_capacity}")
        readers: dict[bytes, int] = {}
        for job_id, job in self._jobs.items():
            for i, key in enumerate(job.keys):
                found = self._entries.get(key)
                if found is None:
                    raise InvariantError(f"job {job_id} names chunk {key[:4].hex()}, not indexed")
                if job.kind is JobKind.STORE:
                    require(found.cpu is CpuState.STORING, "store job", job_id, "for", found)
                elif job.kind is JobKind.SPILL:
                    require(found.disk is DiskState.SPILLING, "spill job", job_id, "for", found)
                else:
                    readers[key] = readers.get(key, 0) + 1
                    source = job.sources[i]
                    if source is not Source.CPU:
                        on_disk = found.disk is DiskState.ON_DISK
                        require(found.cpu is CpuState.PROMOTING and
                                on_disk == (source is Source.DISK), "promotion", job_id,
                                "from", source.name, "for", found)
        for key, entry in self._entries.items():
            require(entry.readers == readers.get(key, 0), "readers != load jobs:", entry)


__all__ = ["Invariants"]
