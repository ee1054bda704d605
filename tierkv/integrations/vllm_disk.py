"""The disk tier as both vLLM connector roles see it (imported lazily: it loads LMDB).

- :func:`acquire_tier` / :func:`release_tier`: one :class:`DiskTier` per environment path
  and process, reference counted. LMDB forbids opening one environment twice in a process
  (closing one handle drops the other's locks); with vLLM's single-process executor the
  worker and the scheduler live in the EngineCore process and share the handle.
- :func:`rebuild_keys`: the scheduler's view at start. It scans every rank's environment
  (index records only, no payloads), keeps the keys that **every** rank holds, deletes the
  others on the ranks that hold them (a chunk is only usable whole), trims the oldest
  chunks beyond the disk capacity, and closes what it opened: the scheduler process never
  keeps LMDB open, and never forks with it open.
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
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tierkv.config import DiskTierConfig, StoreConfig
from tierkv.errors import BrokenError, ConfigError, DamagedError
from tierkv.keys import Namespace
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk_files import OWNER_FILE

__all__ = ["OWNER_FILE", "acquire_tier", "claim_env", "open_follower", "rebuild_keys",
           "release_tier", "unclaim_env", "write_chunks"]

log = logging.getLogger("tierkv.vllm")

_LOCK = threading.Lock()
_OPEN: dict[Path, tuple[DiskTier, int]] = {}
_CLAIMED: set[Path] = set()  # environments a worker of this process writes


def env_path(root: Path, namespace: Namespace, rank: int) -> Path:
    return Path(root) / f"ns-{namespace.fingerprint()}" / f"rank-{rank}"


def acquire_tier(root: Path, namespace: Namespace, rank: int, config: DiskTierConfig,
                 payload_bytes: int) -> DiskTier:
    path = env_path(root, namespace, rank).resolve()
    with _LOCK:
        tier, count = _OPEN.get(path, (None, 0))
        if tier is None:
            tier = DiskTier(Path(root), namespace, rank, config, payload_bytes)
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


def open_claimed(namespace: Namespace, config: StoreConfig, payload_bytes: int) -> DiskTier:
    """A worker's disk tier: shared in this process, claimed for this worker."""
    assert config.disk.path is not None
    tier = acquire_tier(Path(config.disk.path), namespace, config.rank, config.disk, payload_bytes)
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


def open_follower(namespace: Namespace, config: StoreConfig, payload_bytes: int,
                  wait_seconds: float = FOLLOWER_WAIT_SECONDS) -> DiskTier:
    """The disk tier of a rank that loads another rank's copy (MLA: rank 0 writes one copy
    for every rank): that rank's environment (``config.rank``), read-only and unclaimed,
    once the writer has created it (both ranks start at once)."""
    assert config.disk.path is not None
    root = Path(config.disk.path)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            return DiskTier(root, namespace, config.rank, config.disk, payload_bytes,
                            read_only=True)
        except (ConfigError, DamagedError, BrokenError) as exc:  # not (fully) created yet
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"tierkv vLLM connector: {env_path(root, namespace, config.rank)} (the "
                    f"environment rank {config.rank} writes for every rank) could not be read "
                    f"within {wait_seconds:.0f} s: {exc}") from exc
            time.sleep(0.05)


def rebuild_keys(root: Path, namespace: Namespace, ranks: Sequence[int], config: DiskTierConfig,
                 payload_bytes: int, capacity: int) -> tuple[list[bytes], int]:
    """Keys usable from disk, oldest first, at most ``capacity`` of them; and how many
    chunks were deleted (held by only some ranks, or beyond the capacity). A rank whose
    environment is damaged and owned by its worker (which rebuilds it when it meets the
    damage) counts as holding nothing."""
    tiers: list[DiskTier] = []
    holders: Counter[bytes] = Counter()  # how many undamaged ranks hold each key
    seqs: dict[bytes, int] = {}
    try:
        for rank in ranks:
            tier = None
            try:
                tier = acquire_tier(root, namespace, rank, config, payload_bytes)
                tiers.append(tier)
                records = list(tier.scan())
            except DamagedError as exc:
                log.warning("tierkv: %s; its chunks are not used", exc)
                if tier is not None:  # opened, but its scan met the damage
                    release_tier(tiers.pop())
                continue
            holders.update(record.key for record in records)
            for record in records:
                seqs[record.key] = max(seqs.get(record.key, 0), record.seq)
        whole = [key for key, count in holders.items() if count == len(ranks)]
        partial = [key for key, count in holders.items() if count != len(ranks)]
        whole.sort(key=seqs.__getitem__)
        excess = whole[: max(len(whole) - capacity, 0)]  # the oldest go first
        keep = whole[len(excess):]
        doomed = partial + excess
        if doomed:
            for tier in tiers:
                try:
                    tier.delete_many(doomed)
                except DamagedError as exc:
                    log.warning("tierkv: %s; its chunks stay until its worker rebuilds it", exc)
            log.warning("tierkv: deleted %d chunk(s) from %s at start (%d held by only some ranks, "
                     "%d over disk_bytes)", len(doomed), root, len(partial), len(excess))
        return keep, len(doomed)
    finally:
        for tier in tiers:
            release_tier(tier)


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
