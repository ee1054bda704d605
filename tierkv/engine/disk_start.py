"""The index rebuilt from the disk tier at start: the one way, shared by the library store
(:meth:`tierkv.engine.store.TierKVStore`) and the vLLM connector's scheduler
(:func:`rebuild_keys`, then ``vllm_scheduler.SchedulerSide``).

- :class:`FoundOnDisk` collects what tiers hold from their index records (``scan``, no
  payloads): how many of the scanned tiers (an engine's parts) hold each key, and each key's
  newest write sequence; :meth:`FoundOnDisk.oldest_first` orders keys by it.
- :class:`DiskShare`: an engine's share of the disk cap, one cap for every namespace under
  the disk path (:mod:`tierkv.tiers.disk.budget`, docs/operations.md, "One cap per disk
  path"): one budget per part the engine stores, planned at start (:meth:`DiskShare.start`,
  with the line naming the other namespaces), again as the index fills or the root changes
  (:meth:`DiskShare.rebalance`), and released at close.
- :func:`rebuild_keys`: the vLLM scheduler's view at start. It scans every part of this
  engine's part count (index records only, no payloads), keeps the keys that **every**
  part holds, deletes the others on the parts that hold them (a chunk is only usable
  whole), trims the oldest chunks beyond the disk capacity; then, read-only, the parts of
  every other part count found under the namespace (engines of another TP size): a chunk
  every part of such a count holds is usable too, loaded from those parts (never deleted
  here: they are another engine's). It closes what it opened: the scheduler process never
  keeps LMDB open, and never forks with it open.
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

import time
from collections.abc import Callable

from tierkv.config import DISK_OVERHEAD_BYTES, DiskTierConfig
from tierkv.core.index import BlockIndex
from tierkv.errors import BrokenError, ConfigError, DamagedError
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import LowerTier
from tierkv.tiers.disk.budget import DiskBudget
from tierkv.tiers.disk.files import empty_namespace_warning
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.opener import close_disk, open_disk
from tierkv.tiers.disk.tier import DiskTier


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


class DiskShare:
    """An engine's share of the disk cap under ``root``; see the module docstring. It
    stores ``part_dirs`` (its part directories: one for a library store, one per rank of a
    vLLM engine), each part's budget planning the engine's whole chunks of
    ``chunk_bytes`` (every part's) and publishing its part's share. ``poll_seconds``: the
    least time between two looks at the root (a ``stat``) while the disk is not full."""

    def __init__(self, root: Path, fingerprint: str, part_dirs: Sequence[str], cap_bytes: int,
                 chunk_bytes: int, *, check_seconds: float, min_step: int,
                 poll_seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        unit = (chunk_bytes + DISK_OVERHEAD_BYTES) * len(part_dirs)
        self.budgets = [DiskBudget(root, fingerprint, name, cap_bytes, unit,
                                   check_seconds=check_seconds, clock=clock,
                                   parts=len(part_dirs), siblings=tuple(part_dirs),
                                   min_step=min_step) for name in part_dirs]
        self.poll_seconds, self._clock = poll_seconds, clock
        self._polled = -float("inf")

    def start(self, held: int, log: logging.Logger) -> int:
        """The capacity in chunks (the smallest part's share) for the ``held`` chunks found
        on disk, and a step of room more; logs the other namespaces under the root (a
        WARNING when one is no engine's: it is deleted first when room is needed)."""
        capacity = min(budget.plan(held) for budget in self.budgets)
        first = self.budgets[0]
        line = first.start_line()
        if line:
            unclaimed = any(holding.deletable for holding in first.others)
            log.log(logging.WARNING if unclaimed else logging.INFO, "tierkv: %s", line)
        self._polled = self._clock()
        return capacity

    def rebalance(self, index: BlockIndex) -> None:
        """Plan the share again when it is due (:meth:`DiskBudget.due`); a smaller share
        evicts at once, a larger one is room. Never waits on another engine's plan."""
        # Full once what is on disk and what is to be written fill it: a plan only at
        # disk_used would come after the spills evicted for room the cap still had.
        full = index.disk_wanted >= index.disk_capacity
        now = self._clock()
        if not full and now - self._polled < self.poll_seconds:
            return
        self._polled = now
        if not any(budget.due(full) for budget in self.budgets):
            return
        capacity = min(budget.plan(index.disk_used, wait=False) for budget in self.budgets)
        if capacity != index.disk_capacity:
            index.set_disk_capacity(capacity)

    def release(self, held: int) -> None:
        """The engine closes: its share becomes the ``held`` chunks it leaves on disk."""
        budgets, self.budgets = self.budgets, []
        for budget in budgets:
            budget.release(held)


def _scan_parts(root: Path, namespace: Namespace, count: int, config: DiskTierConfig,
                payload_bytes: int, replica: int, own: bool,
                tiers: list[DiskTier], log: logging.Logger) -> FoundOnDisk | None:
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
                 replica: int = 0,
                 log: logging.Logger = logging.getLogger("tierkv")
                 ) -> tuple[list[bytes], int, dict[bytes, int]]:
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
                              True, own_tiers, log)
        assert scanned is not None
        holders, seqs = scanned.holders, scanned.seqs
        whole = [key for key, count in holders.items() if count == own_count]
        partial = [key for key, count in holders.items() if count != own_count]
        elsewhere: dict[bytes, int] = {}
        for count in counts:
            if count == own_count or model_bytes % count:
                continue
            found = _scan_parts(root, namespace, count, config, model_bytes // count, replica,
                                False, other_tiers, log)
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


__all__ = ["DiskShare", "FoundOnDisk", "rebuild_index", "rebuild_keys"]
