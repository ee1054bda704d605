"""The disk tier as both vLLM connector roles see it (imported lazily: it loads LMDB);
every tier is opened by :func:`tierkv.tiers.disk.opener.open_disk`.

- :func:`rebuild_keys`: the scheduler's view at start. It scans every part of this
  engine's part count (index records only, no payloads), keeps the keys that **every**
  part holds, deletes the others on the parts that hold them (a chunk is only usable
  whole), trims the oldest chunks beyond the disk capacity; then, read-only, the parts of
  every other part count found under the namespace (engines of another TP size): a chunk
  every part of such a count holds is usable too, loaded from those parts (never deleted
  here: they are another engine's). It closes what it opened: the scheduler process never
  keeps LMDB open, and never forks with it open.
  It scans through :class:`tierkv.engine.disk_start.FoundOnDisk`, and the scheduler
  registers the keys with :func:`tierkv.engine.disk_start.rebuild_index`, as the library
  store does.
- :class:`OtherParts`: a worker's lazily opened, read-only, unclaimed view of the parts
  another part count wrote (:mod:`tierkv.transfer.parts` reads them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tierkv.config import DiskTierConfig
from tierkv.engine.disk_start import FoundOnDisk
from tierkv.errors import BrokenError, ConfigError, DamagedError
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.opener import close_disk, open_disk
from tierkv.tiers.disk.tier import DiskTier

__all__ = ["OtherParts", "rebuild_keys"]

log = logging.getLogger("tierkv.vllm")


def _scan_parts(root: Path, namespace: Namespace, count: int, config: DiskTierConfig,
                payload_bytes: int, replica: int, own: bool,
                tiers: list[DiskTier]) -> FoundOnDisk | None:
    """How many parts of ``count`` hold each key, and each key's newest sequence; None when
    (another count's) parts are not all there."""
    found = FoundOnDisk()
    for index in range(count):
        part = Part(index, count)
        tier = None
        try:
            if not own and not StoreLayout(root).part_dir(namespace.fingerprint(), part,
                                                          replica).is_dir():
                return None
            tier = open_disk(config, namespace, part, "scan" if own else "tool",
                             payload_bytes=payload_bytes, replica=replica)
            tiers.append(tier)
            found.scan(tier)
        except (DamagedError, BrokenError, ConfigError) as exc:
            if own and not isinstance(exc, DamagedError):
                raise
            log.warning("tierkv: %s; its chunks are not used", exc)
            if tier is not None:  # opened, but its scan met the damage
                tiers.pop()
                close_disk(tier)
            if not own:
                return None
            continue
    return found


def rebuild_keys(namespace: Namespace, own_count: int, config: DiskTierConfig,
                 payload_bytes: int, capacity: int, *, counts: Sequence[int] = (),
                 replica: int = 0) -> tuple[list[bytes], int, dict[bytes, int]]:
    """Keys usable from disk, oldest first, at most ``capacity`` of them; how many chunks
    were deleted (held by only some of this engine's parts, or beyond the capacity); and
    the part count of each key usable only from another count's parts (``counts``, in
    order of preference). A part whose environment is damaged and owned by its worker
    (which rebuilds it when it meets the damage) counts as holding nothing.
    ``payload_bytes`` is one part of ``own_count``'s; another count's are in proportion."""
    assert config.path is not None
    root = Path(config.path)
    own_tiers: list[DiskTier] = []
    other_tiers: list[DiskTier] = []
    model_bytes = payload_bytes * own_count
    try:
        scanned = _scan_parts(root, namespace, own_count, config, payload_bytes, replica,
                              True, own_tiers)
        assert scanned is not None
        holders, seqs = scanned.holders, scanned.seqs
        whole = [key for key, count in holders.items() if count == own_count]
        partial = [key for key, count in holders.items() if count != own_count]
        elsewhere: dict[bytes, int] = {}
        for count in counts:
            if count == own_count or model_bytes % count:
                continue
            found = _scan_parts(root, namespace, count, config, model_bytes // count, replica,
                                False, other_tiers)
            if found is None:
                continue
            for key, held in found.holders.items():
                if held == count and key not in elsewhere and holders.get(key) != own_count:
                    elsewhere[key] = count
                    seqs[key] = max(seqs.get(key, 0), found.seqs[key])
        usable = scanned.oldest_first([*whole, *elsewhere])
        dropped = usable[: max(len(usable) - capacity, 0)]  # the oldest go first
        keep = usable[len(dropped):]
        excess = [key for key in dropped if key not in elsewhere]  # another's: not deleted
        doomed = partial + excess
        if doomed:
            for tier in own_tiers:
                try:
                    tier.delete_many(doomed)
                except DamagedError as exc:
                    log.warning("tierkv: %s; its chunks stay until its worker rebuilds it", exc)
            log.warning("tierkv: deleted %d chunk(s) from %s at start (%d held by only some "
                        "parts, %d over disk_bytes)", len(doomed), root, len(partial),
                        len(excess))
        kept = set(keep)
        return keep, len(doomed), {key: count for key, count in elsewhere.items() if key in kept}
    finally:
        for tier in [*own_tiers, *other_tiers]:
            close_disk(tier)


@dataclass
class OtherPartsCounts:
    """What a worker's :class:`OtherParts` counts."""

    opened: int = 0  # parts of another part count opened for reading
    # Parts of another part count not read: damaged, misplaced or untrusted (warned about
    # once each, never reopened).
    skipped: int = 0


class OtherParts:
    """The parts of other part counts on disk, as one worker reads them: each part's
    environment opened read-only and unclaimed at its first read, kept open after (another
    engine writes it; this one never claims, writes or repairs it). ``read_part_into``
    answers ``MISSING`` for a part whose environment is not there, and for one that cannot
    be read (damaged, misplaced: another part's or namespace's directory in its place, or
    untrusted): that one is warned about once, counted in ``counts().skipped`` and
    remembered, never reopened by later reads."""

    def __init__(self, namespace: Namespace, config: DiskTierConfig, model_chunk_bytes: int,
                 replica: int = 0) -> None:
        self.namespace, self.config = namespace, config
        self.model_chunk_bytes, self.replica = model_chunk_bytes, replica
        self._tiers: dict[Part, DiskTier | None] = {}
        self._counts = OtherPartsCounts()
        self._lock = threading.Lock()

    def _tier(self, part: Part) -> DiskTier | None:
        with self._lock:
            if part in self._tiers:
                return self._tiers[part]
            tier: DiskTier | None
            try:
                tier = open_disk(self.config, self.namespace, part, "tool",
                                 payload_bytes=self.model_chunk_bytes // part.count,
                                 replica=self.replica)
                self._counts.opened += 1
            except (ConfigError, DamagedError, BrokenError) as exc:  # MisplacedError too
                log.warning("tierkv: part %s on disk cannot be read, its chunks are misses "
                            "until a restart: %s", part.name, exc)
                self._counts.skipped += 1
                tier = None
            self._tiers[part] = tier
            return tier

    def counts(self) -> OtherPartsCounts:
        with self._lock:
            return replace(self._counts)

    def read_part_into(self, key: bytes, part: Part, out: memoryview) -> ReadStatus:
        tier = self._tier(part)
        if tier is None:
            return ReadStatus.MISSING
        return tier.read_into(key, out)

    def close(self) -> None:
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        for tier in tiers:
            if tier is not None:
                tier.close()
