"""The block index's KV-event log: which tiers each chunk entered or left.

``touched`` is a plain list of keys whose tiers may have changed since the last ``take``:
:class:`~tierkv.core.index.BlockIndex` holds it as an attribute of its own and appends to
it inline wherever a chunk's tiers change (a method call there cost 2-6 % of an evicting
plan step, bench_adapter.py --cpu-slots 2048). It is only ever mutated in place, never
rebound. ``take`` compares each touched key's tiers now with the tiers it was last
reported in (MEDIUM_CPU | MEDIUM_DISK bits) and names the differences.

The remote tier is not the index's: what the engine learns of it is logged as it learns
it (``remote``: ``(key, held)`` pairs), with no state kept here. A lookup that finds a
chunk there that it had no mark of gives ``stored``; a remote load that finds it missing
or damaged gives ``removed`` (docs/engine-adapter.md, "KV events").

Chunks found on disk at start are touched like any other (``add_on_disk``): the first
takes after a start are the snapshot of the disk tier, ``max_chunks`` at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

from tierkv.core.plans import CpuState, DiskState, Entry

# The tiers a chunk's events name: bits of the media it was last reported in.
MEDIUM_CPU, MEDIUM_DISK = 1, 2
_MEDIA = ((MEDIUM_CPU, "CPU"), (MEDIUM_DISK, "DISK"))
MEDIUM_NAMES = ("CPU", "DISK", "REMOTE")  # every medium an event names


class EventLog:
    __slots__ = ("touched", "remote", "_media")

    def __init__(self) -> None:
        self.touched: list[bytes] = []
        self.remote: list[tuple[bytes, bool]] = []
        self._media: dict[bytes, int] = {}

    def pending(self) -> bool:
        """Whether a ``take`` may have events to give."""
        return bool(self.touched or self.remote)

    def take(self, entries: Mapping[bytes, Entry],
             max_chunks: int | None = None) -> list[tuple[str, str, bytes]]:
        """``("stored" | "removed", medium, key)`` for each tier a chunk entered or left
        since the last call, ``entries`` being the index's chunks now: medium ``"CPU"``
        (READY in the CPU tier), ``"DISK"`` (written to disk) or ``"REMOTE"`` (see the
        module docstring). A chunk that entered and left a local tier between two calls
        gives no event. ``max_chunks``: the events of at most that many chunks (each gives
        at most two); the rest wait for the next call."""
        touched = self.touched
        events: list[tuple[str, str, bytes]] = []
        chunks = 0
        if touched:
            keys = list(dict.fromkeys(touched))
            touched.clear()
            if max_chunks is not None and len(keys) > max_chunks:
                touched.extend(keys[max_chunks:])  # in order, before anything newer
                del keys[max_chunks:]
            chunks = len(keys)
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
        remote = self.remote
        if remote:
            room = len(remote) if max_chunks is None else max(max_chunks - chunks, 0)
            taken = remote[:room]
            del remote[:room]
            events.extend(("stored" if held else "removed", "REMOTE", key)
                          for key, held in taken)
        return events


__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "MEDIUM_NAMES", "EventLog"]
