"""The disk tier as both vLLM connector roles see it (imported lazily: it loads LMDB).

- :func:`acquire_tier` / :func:`release_tier`: one :class:`DiskTier` per environment path
  and process, reference counted. LMDB forbids opening one environment twice in a process
  (closing one handle drops the other's locks); with vLLM's single-process executor the
  worker and the scheduler live in the EngineCore process and share the handle.
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
- :func:`claim_env`: a worker makes itself its environment's one writer for its lifetime
  (:meth:`DiskTier.claim`, an exclusive ``flock``). Two engines on one environment (two
  servers given the same ``disk_path``) would evict each other's chunks and turn hits into
  failed loads; the second one is refused with a message instead. The claim ends when the
  tier closes or the process dies.
- :func:`write_chunks`: the worker's shutdown flush, in write transactions of about
  ``write_batch_bytes``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tierkv.config import DiskTierConfig, StoreConfig
from tierkv.engine.disk_start import FoundOnDisk
from tierkv.errors import BrokenError, ConfigError, DamagedError
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.tier import DiskTier
from tierkv.tiers.disk.files import OWNER_FILE
from tierkv.tiers.disk.layout import StoreLayout

__all__ = ["OWNER_FILE", "acquire_tier", "claim_env", "open_follower", "rebuild_keys",
           "release_tier", "unclaim_env", "write_chunks"]

log = logging.getLogger("tierkv.vllm")

_LOCK = threading.Lock()
_OPEN: dict[Path, tuple[DiskTier, int]] = {}
_CLAIMED: set[Path] = set()  # environments a worker of this process writes


def env_path(root: Path, namespace: Namespace, part: Part, replica: int = 0) -> Path:
    return StoreLayout(root).part_dir(namespace.fingerprint(), part, replica)


def acquire_tier(root: Path, namespace: Namespace, part: Part, config: DiskTierConfig,
                 payload_bytes: int, replica: int = 0) -> DiskTier:
    path = env_path(root, namespace, part, replica).resolve()
    with _LOCK:
        tier, count = _OPEN.get(path, (None, 0))
        if tier is None:
            tier = DiskTier(Path(root), namespace, part, config, payload_bytes, replica=replica)
        _OPEN[tier.path.resolve()] = (tier, count + 1)
        return tier


def release_tier(tier: DiskTier) -> None:
    path = tier.path.resolve()
    with _LOCK:
        shared, count = _OPEN.get(path, (None, 0))
        if shared is tier and count > 1:
            _OPEN[path] = (tier, count - 1)
            return
        if shared is tier:
            del _OPEN[path]
    tier.close()


def claim_env(tier: DiskTier) -> None:
    """Take the environment for this worker: refused while another worker, of this process
    or another, holds it."""
    path = tier.path.resolve()
    with _LOCK:
        try:
            if path in _CLAIMED:
                raise ConfigError(f"{tier.path} is claimed by a worker of this process")
            tier.claim()
        except ConfigError as exc:
            raise ConfigError(
                f"tierkv vLLM connector: the disk tier at {tier.path} is in use by another "
                f"tierkv worker (another vLLM server with the same model and disk_path?); give "
                f"each server its own disk_path ({exc})") from exc
        _CLAIMED.add(path)


def unclaim_env(tier: DiskTier) -> None:
    """The worker is done with the environment (the claim itself ends when the tier closes)."""
    with _LOCK:
        _CLAIMED.discard(tier.path.resolve())


def open_claimed(namespace: Namespace, config: StoreConfig, payload_bytes: int, part: Part,
                 replica: int = 0) -> DiskTier:
    """A worker's disk tier: shared in this process, claimed for this worker."""
    assert config.disk.path is not None
    tier = acquire_tier(Path(config.disk.path), namespace, part, config.disk, payload_bytes,
                        replica)
    try:
        claim_env(tier)
    except BaseException:
        release_tier(tier)
        raise
    return tier


def release_claimed(tier: DiskTier) -> None:
    unclaim_env(tier)
    release_tier(tier)


FOLLOWER_WAIT_SECONDS = 30.0  # for the writing rank to create its environment at start


def open_follower(namespace: Namespace, config: StoreConfig, payload_bytes: int, part: Part,
                  replica: int = 0, wait_seconds: float = FOLLOWER_WAIT_SECONDS) -> DiskTier:
    """The disk tier of a rank that loads a part another rank writes (MLA: rank 0 writes one
    part for every rank; heads fewer than ranks: the first rank of each part): that part's
    environment, read-only and unclaimed, once the writer has created it (both ranks start
    at once)."""
    assert config.disk.path is not None
    root = Path(config.disk.path)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            return DiskTier(root, namespace, part, config.disk, payload_bytes, read_only=True,
                            replica=replica)
        except (ConfigError, DamagedError, BrokenError) as exc:  # not (fully) created yet
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"tierkv vLLM connector: {env_path(root, namespace, part, replica)} (the "
                    f"environment of part {part.name}, which another rank writes) could not "
                    f"be read within {wait_seconds:.0f} s: {exc}") from exc
            time.sleep(0.05)


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
            if own:
                tier = acquire_tier(root, namespace, part, config, payload_bytes, replica)
            else:
                if not env_path(root, namespace, part, replica).is_dir():
                    return None
                tier = DiskTier(root, namespace, part, config, payload_bytes, read_only=True,
                                replica=replica)
            tiers.append(tier)
            found.scan(tier)
        except (DamagedError, BrokenError, ConfigError) as exc:
            if own and not isinstance(exc, DamagedError):
                raise
            log.warning("tierkv: %s; its chunks are not used", exc)
            if tier is not None:  # opened, but its scan met the damage
                tiers.pop()
                (release_tier if own else DiskTier.close)(tier)
            if not own:
                return None
            continue
    return found


def rebuild_keys(root: Path, namespace: Namespace, own_count: int, config: DiskTierConfig,
                 payload_bytes: int, capacity: int, *, counts: Sequence[int] = (),
                 replica: int = 0) -> tuple[list[bytes], int, dict[bytes, int]]:
    """Keys usable from disk, oldest first, at most ``capacity`` of them; how many chunks
    were deleted (held by only some of this engine's parts, or beyond the capacity); and
    the part count of each key usable only from another count's parts (``counts``, in
    order of preference). A part whose environment is damaged and owned by its worker
    (which rebuilds it when it meets the damage) counts as holding nothing.
    ``payload_bytes`` is one part of ``own_count``'s; another count's are in proportion."""
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
        for tier in own_tiers:
            release_tier(tier)
        for tier in other_tiers:
            tier.close()


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

    def __init__(self, root: Path, namespace: Namespace, config: DiskTierConfig,
                 model_chunk_bytes: int, replica: int = 0) -> None:
        self.root, self.namespace, self.config = Path(root), namespace, config
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
                tier = DiskTier(self.root, self.namespace, part, self.config,
                                self.model_chunk_bytes // part.count, read_only=True,
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


def write_chunks(tier: DiskTier, slab: CpuSlab, chunks: Sequence[tuple[bytes, int]],
                 payload_bytes: int, write_batch_bytes: int) -> int:
    """Write ``(key, slot)`` chunks from the slab; returns how many landed. A failed write
    is logged and ends the flush: the engine is shutting down, nothing is raised."""
    per_txn = max(1, write_batch_bytes // payload_bytes)
    written = 0
    for start in range(0, len(chunks), per_txn):
        batch = chunks[start : start + per_txn]
        items = [(key, slab.memoryview(slot)[:payload_bytes]) for key, slot in batch]
        try:
            result = tier.put_many(items)
        except Exception as exc:
            log.warning("tierkv: flush at shutdown failed: %s", exc)
            break
        written += len(result.written)
        if result.full:
            break
    return written
