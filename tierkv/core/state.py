"""Per-chunk states on the scheduler side (an enum, never a bare -1).

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

from tierkv.core.jobs import SlotId
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
