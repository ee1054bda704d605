"""The index rebuilt from the disk tier at start: the one way, shared by the library store
(:meth:`tierkv.engine.store.TierKVStore`) and the vLLM connector's scheduler
(:func:`tierkv.integrations.vllm_disk.rebuild_keys`, then
``vllm_scheduler.TierKVScheduler``).

- :class:`FoundOnDisk` collects what tiers hold from their index records (``scan``, no
  payloads): how many of the scanned tiers (an engine's parts) hold each key, and each key's
  newest write sequence; :meth:`FoundOnDisk.oldest_first` orders keys by it.
- :func:`rebuild_index` registers the keys found, oldest first, in the index under a disk
  capacity: the index keeps the newest it has room for, and the oldest over the capacity
  are deleted (:meth:`BlockIndex.add_on_disk` queues them for the next spill job), with one
  warning that names the cap's setting. Then the warning for a namespace that found nothing
  while the root holds others (a setting changed since they were written).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.core.index import BlockIndex
from tierkv.keys import Namespace
from tierkv.tiers.base import LowerTier
from tierkv.tiers.disk.files import empty_namespace_warning


@dataclass
class FoundOnDisk:
    """What scanned tiers hold; see the module docstring."""

    holders: Counter[bytes] = field(default_factory=Counter)  # tiers holding each key
    seqs: dict[bytes, int] = field(default_factory=dict)  # each key's newest write sequence

    def scan(self, tier: LowerTier) -> None:
        """Add ``tier``'s index records (read whole first: a failing scan adds nothing)."""
        records = list(tier.scan())
        self.holders.update(record.key for record in records)
        for record in records:
            self.seqs[record.key] = max(self.seqs.get(record.key, 0), record.seq)

    def oldest_first(self, keys: Iterable[bytes] | None = None) -> list[bytes]:
        """``keys`` (every key found) ordered by their newest write, oldest first."""
        return sorted(self.seqs if keys is None else keys, key=self.seqs.__getitem__)


def rebuild_index(index: BlockIndex, keys: Sequence[bytes], capacity: int, *, root: Path,
                  namespace: Namespace, cap: str, log: logging.Logger) -> int:
    """Register ``keys`` (oldest first) in ``index`` under ``capacity`` chunks; returns how
    many it holds. ``cap`` names the setting and share the capacity comes from, for the
    warning about the chunks over it (``disk.max_bytes=...``)."""
    if capacity != index.disk_capacity:
        index.set_disk_capacity(capacity)
    found = index.add_on_disk(keys)
    if found < len(keys):  # the oldest over the capacity, deleted with the next spill
        log.warning("tierkv: deleting %d of the %d chunk(s) found on disk at start: they "
                    "are over this store's share (%d chunks) of %s, one cap for every "
                    "namespace under %s", len(keys) - found, len(keys), capacity, cap, root)
    warning = empty_namespace_warning(root, namespace, found)
    if warning:
        log.warning("tierkv: %s", warning)
    return found


__all__ = ["FoundOnDisk", "rebuild_index"]
