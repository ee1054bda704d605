"""The block index's KV-event log: which tiers each chunk entered or left.

``touched`` is a plain list of keys whose tiers may have changed since the last ``take``:
:class:`~tierkv.core.index.BlockIndex` holds it as an attribute of its own and appends to
it inline wherever a chunk's tiers change (a method call there cost 2-6 % of an evicting
plan step, bench_adapter.py --cpu-slots 2048). It is only ever mutated in place, never
rebound. ``take`` compares each touched key's tiers now with the tiers it was last
reported in (MEDIUM_CPU | MEDIUM_DISK bits) and names the differences.
"""

from __future__ import annotations

from collections.abc import Mapping

from tierkv.core.state import CpuState, DiskState, Entry

# The tiers a chunk's events name: bits of the media it was last reported in.
MEDIUM_CPU, MEDIUM_DISK = 1, 2
_MEDIA = ((MEDIUM_CPU, "CPU"), (MEDIUM_DISK, "DISK"))


class EventLog:
    __slots__ = ("touched", "_media")

    def __init__(self) -> None:
        self.touched: list[bytes] = []
        self._media: dict[bytes, int] = {}

    def take(self, entries: Mapping[bytes, Entry]) -> list[tuple[str, str, bytes]]:
        """``("stored" | "removed", medium, key)`` for each tier a chunk entered or left
        since the last call, ``entries`` being the index's chunks now: medium ``"CPU"``
        (READY in the CPU tier) or ``"DISK"`` (written to disk). A chunk that entered and
        left between two calls gives no event."""
        touched = self.touched
        if not touched:
            return []
        keys = dict.fromkeys(touched)
        touched.clear()
        events: list[tuple[str, str, bytes]] = []
        media = self._media
        for key in keys:
            entry = entries.get(key)
            now = 0
            if entry is not None:
                now = (MEDIUM_CPU if entry.cpu is CpuState.READY else 0) \
                    | (MEDIUM_DISK if entry.disk is DiskState.ON_DISK else 0)
            before = media.pop(key, 0)
            if now:
                media[key] = now
            for bit, medium in _MEDIA:
                if now & bit and not before & bit:
                    events.append(("stored", medium, key))
                elif before & bit and not now & bit:
                    events.append(("removed", medium, key))
        return events


__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "EventLog"]
