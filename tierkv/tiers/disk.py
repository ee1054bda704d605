"""The disk tier: chunk payloads of one namespace and rank in :data:`SHARDS` LMDB
environments, at ``root/ns-<fingerprint>/rank-<r>/shard-<s>/``, a chunk in the shard
:func:`shard_of` its key (``docs/on-disk-format.md`` has every byte).

Primitives and contracts: those of :class:`~tierkv.tiers.base.LowerTier`, and (one
:class:`DiskTier` holds bytes and starts no threads; it may be called from several threads:
LMDB serializes write transactions, reads run concurrently):

- ``put_many(items, deletes=())`` is one write txn per shard it touches (deletes, then
  puts), ``delete_many`` too; ``write_lanes``/``lane_of`` tell an I/O layer which keys may
  be written in parallel (another shard: another LMDB writer lock). A full map or a full
  filesystem (ENOSPC, EDQUOT, or EIO from a short write with the filesystem out of space)
  is ``PutResult.full``; the disk cap is soft here (the scheduler side accounts for it).
  Pages a delete frees are reused by its own shard only.
- ``read_into(key, out)`` is one short read txn: header and checksum verified, the payload
  copied straight into ``out``; a bad value is deleted and counted.
- ``scan(batch)`` reads the small "index" sub-db in short txns of ``batch`` keys (restart
  warm without reading payloads); ``verify`` also checks the index against the values.
- ``claim()`` makes this process the one writer of the rank's environments
  (``exclusive=True`` does it at open, before anything is judged or moved): a second
  claim, from any process, is refused with a :class:`ConfigError` naming the holder.
- ``read_only=True`` (operator tools): nothing is created, written, moved or chmod-ed;
  what is not trusted, or damaged, raises :class:`DamagedError`; a corrupt value is
  answered ``CORRUPT`` and left in place. ``shards=`` (read-only only) opens some of the
  rank's shards, so a tool reads the good ones beside a damaged one.
- Any call from a forked child raises :class:`UsageError`.
- No read transaction outlives a call. Nothing is ever unpickled or evaluated.

The environment underneath (which files are trusted, damage and rebuilds, a map another
process grew, stale readers) is kept by :class:`tierkv.tiers.disk_env.LmdbEnv`; see its
docstring. Opening a tier tunes glibc malloc once per process (:func:`tune_malloc`, opt
out with ``disk.tune_malloc=False`` or ``TIERKV_MALLOPT=0``).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb

from tierkv.config import DiskTierConfig
from tierkv.errors import ConfigError, UsageError, short_key
from tierkv.keys import KEY_BYTES, Namespace
from tierkv.tiers.base import ChunkRecord, LowerTier, PutResult, ReadStatus, VerifyReport
from tierkv.tiers.disk_env import META_NEXT_SEQ, SHARDS, FilesDamaged, LmdbEnv, shard_of
from tierkv.tiers.disk_files import NamespaceInfo, list_namespaces
from tierkv.tiers.disk_format import ValueWriter, binding_of, check_value, pack_index, unpack_index
from tierkv.tiers.lmdb_tuning import MAP_LIMIT_BYTES, largest_cap, map_size_for, shard_cap
from tierkv.tiers.malloc_tuning import tune_malloc
from tierkv.units import format_bytes

__all__ = [
    "SHARDS", "ChunkRecord", "DiskStatistics", "DiskTier", "NamespaceInfo", "PutResult",
    "ReadStatus", "VerifyReport", "list_namespaces", "map_size_for", "shard_of", "tune_malloc",
    "written_at",
]

logger = logging.getLogger("tierkv.disk")


@dataclass(frozen=True)
class DiskStatistics:
    """Counters since open, over all shards; ``chunks`` and ``map_size`` (all shards' maps)
    are current."""

    chunks: int
    bytes_written: int
    bytes_read: int
    puts: int
    reads: int
    hits: int
    misses: int
    corrupt: int
    full: int
    syncs: int
    map_size: int
    write_txns: int = 0
    rebuilds: int = 0  # damaged or misplaced environments moved aside, started empty
    stale_readers: int = 0  # reader slots of dead processes cleared
    map_adopted: int = 0  # times a map grown by another process was adopted


def written_at(seq: int) -> float:
    """When the value of write sequence ``seq`` was written (seconds since the epoch; the
    clock of the writing host, see :meth:`DiskTier._first_seq`)."""
    return seq // SHARDS / 1e6


class DiskTier(LowerTier):
    """Chunk payloads of one namespace and rank in LMDB. See the module docstring."""

    def __init__(
        self,
        root: Path,
        namespace: Namespace,
        rank: int,
        config: DiskTierConfig,
        payload_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        exclusive: bool = False,
        repair: bool = True,
        read_only: bool = False,
        shards: Sequence[int] | None = None,
    ) -> None:
        for name, value, low in (("payload_bytes", payload_bytes, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"disk tier: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(namespace, Namespace):
            raise ConfigError(f"disk tier: namespace must be a Namespace, got {namespace!r}")
        self.root = Path(root)
        self.namespace = namespace
        self.rank = rank
        self.config = config
        self.payload_bytes = payload_bytes
        self.read_only = read_only
        self._clock = clock
        self.fingerprint = namespace.fingerprint()
        self._name = f"disk tier (namespace {self.fingerprint[:8]}, rank {rank})"
        self._binding = binding_of(self.fingerprint, rank)
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("bytes_written", "bytes_read", "puts", "reads", "hits", "misses", "corrupt",
             "full", "syncs", "write_txns"), 0)
        self._unsynced_bytes = 0
        self._last_sync = clock()
        self._writers = [ValueWriter(payload_bytes, self._binding) for _ in range(SHARDS)]
        if config.tune_malloc:
            tune_malloc(config.write_batch_bytes)
        page = os.sysconf("SC_PAGE_SIZE")

        def total_for(cap: int) -> int:  # every shard's map under a cap of ``cap``
            return SHARDS * map_size_for(shard_cap(cap, payload_bytes, SHARDS), payload_bytes, page)

        map_size = total_for(config.max_bytes) // SHARDS
        if map_size * SHARDS > MAP_LIMIT_BYTES:
            raise ConfigError(
                f"{self._name}: disk.max_bytes={format_bytes(config.max_bytes)} needs "
                f"{format_bytes(map_size * SHARDS)} of LMDB maps (address space, {SHARDS} shards), "
                f"more than the {format_bytes(MAP_LIMIT_BYTES)} a process can map; lower "
                f"disk.max_bytes to at most {format_bytes(largest_cap(total_for))}")
        numbers = range(SHARDS) if shards is None else sorted(set(shards))
        if shards is not None and (not read_only or not numbers
                                   or not all(0 <= shard < SHARDS for shard in numbers)):
            raise UsageError(f"{self._name}: shards={list(shards)!r}: only a read-only tier "
                             f"opens some shards, each in [0, {SHARDS})")
        self._shards: list[LmdbEnv] = []
        try:
            for shard in numbers:
                self._shards.append(LmdbEnv(
                    self.root, namespace, rank, shard, map_size=map_size,
                    sync_always=config.sync_mode == "always", name=f"{self._name[:-1]}, shard "
                    f"{shard})", clock=clock, exclusive=exclusive, repair=repair,
                    read_only=read_only))
        except BaseException:
            for env in self._shards:
                env.close(sync=False)
            raise
        self.namespace_dir = self._shards[0].namespace_dir
        self.path = self._shards[0].rank_dir
        self.shard_paths = tuple(env.path for env in self._shards)
        self._env_of = {env.shard: env for env in self._shards}

    @property
    def map_size(self) -> int:  # all shards; grows when a map another process grew is adopted
        return sum(env.map_size for env in self._shards)

    write_lanes = SHARDS

    @staticmethod
    def lane_of(key: bytes) -> int:
        return shard_of(key)

    def _shard(self, key: bytes) -> LmdbEnv:
        env = self._env_of.get(shard_of(key))
        if env is None:
            raise UsageError(f"{self._name}: chunk {short_key(key)} is in shard "
                             f"{shard_of(key)}, which this tier did not open (shards=)")
        return env

    def _by_shard(self, keys: Sequence[bytes]) -> dict[int, list[bytes]]:
        groups: dict[int, list[bytes]] = {}
        for key in keys:
            groups.setdefault(shard_of(key), []).append(key)
        return groups

    @property
    def sync_every_seconds(self) -> float | None:
        return self.config.sync_every_seconds if self.config.sync_mode == "periodic" else None

    @property
    def claimed(self) -> bool:
        return all(env.claimed for env in self._shards)

    def claim(self) -> None:
        """Make this process the one writer of the rank's environments (idempotent); when
        refused, the shards claimed by this call are given back."""
        taken = [env for env in self._shards if not env.claimed]
        try:
            for env in taken:
                env.claim()
        except BaseException:
            for env in taken:
                env.unclaim()
            raise

    # -- helpers ---------------------------------------------------------------------------

    def _out_of_space(self, exc: lmdb.Error, num_items: int) -> bool:
        """Whether a failed write txn of ``num_items`` values means the filesystem is full:
        ENOSPC (``lmdb.DiskError``) or EDQUOT, or EIO from a short write (what ENOSPC looks
        like on a full filesystem) when less is free than such a txn writes at least (a page
        more per value, one value for deletes); any other EIO is a real I/O error."""
        if isinstance(exc, lmdb.DiskError):
            return True
        text = str(exc)
        if os.strerror(errno.ENOSPC) in text or os.strerror(errno.EDQUOT) in text:
            return True
        if os.strerror(errno.EIO) not in text:
            return False
        try:
            fs = os.statvfs(self.path)
        except OSError:
            return False
        return fs.f_bavail * fs.f_frsize < max(num_items, 1) * (self.payload_bytes + 4096)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ConfigError(f"{self._name}: a chunk key must be {KEY_BYTES} bytes, "
                              f"got {key!r:.40}")

    def _bytes_of(self, buffer: Any, what: str, writable: bool = False) -> memoryview:
        """``buffer`` as a flat byte view of exactly ``payload_bytes`` (or, writable, at
        least that many) bytes; anything else is a :class:`ConfigError`."""
        try:
            view = memoryview(buffer)
        except TypeError as exc:
            raise ConfigError(f"{self._name}: {what} must be a bytes-like buffer, got "
                              f"{type(buffer).__name__}") from exc
        if not view.c_contiguous or (writable and view.readonly):
            raise ConfigError(f"{self._name}: {what} must be a "
                              f"{'writable ' if writable else ''}contiguous buffer")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if writable and len(view) < self.payload_bytes:
            raise ConfigError(f"{self._name}: {what} must be writable and hold at least "
                              f"{self.payload_bytes} bytes, got {len(view)}")
        if not writable and len(view) != self.payload_bytes:
            raise ConfigError(f"{self._name}: {what} has {len(view)} bytes, the tier stores "
                              f"{self.payload_bytes}")
        return view

    @staticmethod
    def _first_seq(shard: int, stored: bytes) -> int:
        """A txn's first write sequence: after the shard's ``stored`` next one, at least the
        wall clock in us (so the order holds across shards), and ``shard`` modulo
        :data:`SHARDS` (so no two shards of a rank give the same number)."""
        base = max(int.from_bytes(stored, "little"), time.time_ns() // 1000 * SHARDS)
        return base + (shard - base) % SHARDS

    def _check_batch(self, batch: Any) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ConfigError(f"{self._name}: batch must be a positive int, got {batch!r}")

    def _check_writable(self, action: str) -> None:
        if self.read_only:
            raise UsageError(f"{self._name}: {action} on a tier opened read-only")

    # -- writes ----------------------------------------------------------------------------

    def put_many(
        self,
        items: Sequence[tuple[bytes, memoryview | bytes]],
        deletes: Sequence[bytes] = (),
    ) -> PutResult:
        """Delete ``deletes`` then write ``items`` in one write transaction.

        When the map cannot take every item and there are deletes, the deletes are committed
        first (LMDB reuses freed pages only two transactions later) and the items retried;
        items that still do not fit come back in ``full``, the rest are written."""
        self._check_writable("writing chunks")
        views: list[tuple[bytes, memoryview | bytes]] = []
        for key, payload in items:
            self._check_key(key)
            views.append((key, self._bytes_of(payload, f"chunk {short_key(key)}")))
        for key in deletes:
            self._check_key(key)
        puts: dict[int, list[tuple[bytes, memoryview | bytes]]] = {}
        for item in views:
            puts.setdefault(shard_of(item[0]), []).append(item)
        drops = self._by_shard(deletes)
        if not views and not deletes:
            self._shards[0].check_usable("writing chunks")
        landed: set[bytes] = set()
        full: list[bytes] = []
        deleted, no_space = 0, False
        for shard in sorted(puts.keys() | drops.keys()):
            lmdb_env = self._shards[shard]
            put, drop = puts.get(shard, []), tuple(drops.get(shard, ()))
            done, no_room, gone, space = lmdb_env.run(
                "writing chunks", partial(self._put, lmdb_env, pending=put, deletes=drop))
            landed.update(done)
            full += no_room
            deleted, no_space = deleted + gone, no_space or space
        written = tuple(key for key, _ in views if key in landed)
        num_bytes = len(written) * self.payload_bytes
        self._count(bytes_written=num_bytes, puts=len(written), full=len(full),
                    write_txns=len(puts.keys() | drops.keys()))
        message = None
        if full:
            what, hint = (("filesystem", f"free space under {self.root} or lower disk.max_bytes")
                          if no_space else ("map", "raise disk.max_bytes"))
            message = (f"{self._name}: {what} full writing chunk {short_key(full[0])} "
                       f"({len(full)} chunk(s) not written; {hint}, now "
                       f"{format_bytes(self.config.max_bytes)})")
            logger.warning("%s", message)
        self._after_commit(num_bytes)
        return PutResult(written, tuple(full), deleted, num_bytes, message)

    def _put(self, lm: LmdbEnv, env: lmdb.Environment,
             pending: list[tuple[bytes, memoryview | bytes]], deletes: tuple[bytes, ...],
             ) -> tuple[tuple[bytes, ...], tuple[bytes, ...], int, bool]:
        """(written, full, deleted, filesystem full) of one ``put_many``."""
        full: list[bytes] = []
        settled, deleted, failed_at = 0, 0, None
        no_space = False  # the filesystem (not the map) is full
        readers_checked = False
        while pending or deletes:
            try:
                failed_at, deleted = self._write_txn(lm, env, pending, deletes)
            except lmdb.MapFullError:  # raised by commit: retry without the last item
                failed_at, deleted = len(pending) - 1, 0
            except lmdb.Error as exc:
                if not self._out_of_space(exc, len(pending)):
                    raise
                # nothing of this txn landed; after deletes settle, retry once, then give up
                failed_at, deleted, no_space = 0, 0, True
            if failed_at is None:
                break
            if deletes:  # LMDB reuses pages freed by txn T from txn T+2 on
                settled, deletes = self._settle_deletes(lm, env, deletes), ()
                continue
            if not no_space and not readers_checked:
                readers_checked = True  # a dead reader may pin the pages we need
                if lm.clear_stale_readers(env):
                    continue
            full[:0] = [key for key, _ in pending[failed_at:]]
            pending = pending[:failed_at]
        return tuple(key for key, _ in pending), tuple(full), deleted + settled, no_space

    def _write_txn(
        self, lm: LmdbEnv, env: lmdb.Environment, items: list[tuple[bytes, memoryview | bytes]],
        deletes: Sequence[bytes],
    ) -> tuple[int | None, int]:
        """One txn; returns (index of the first item the map could not take or None, deleted).
        The write sequence is read and advanced inside the txn, so it stays strictly
        increasing across threads and processes (LMDB serializes writers)."""
        txn = env.begin(write=True)
        try:
            deleted = 0
            for key in deletes:
                deleted += bool(txn.delete(key, db=lm.chunks))
                txn.delete(key, db=lm.index)
            if items:
                seq_raw = txn.get(META_NEXT_SEQ, db=lm.meta)
                if seq_raw is None or len(seq_raw) != 8:
                    raise FilesDamaged("next_seq record missing or malformed")
                seq, writer = self._first_seq(lm.shard, seq_raw), self._writers[lm.shard]
                for position, (key, payload) in enumerate(items):
                    try:
                        txn.put(key, writer.build(key, payload, seq), db=lm.chunks)
                        txn.put(key, pack_index(self.payload_bytes, seq), db=lm.index)
                    except lmdb.MapFullError:
                        txn.abort()
                        return position, 0
                    seq += SHARDS
                txn.put(META_NEXT_SEQ, seq.to_bytes(8, "little"), db=lm.meta)
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        return None, deleted

    def _settle_deletes(self, lm: LmdbEnv, env: lmdb.Environment,
                        deletes: Sequence[bytes]) -> int:
        """Commit ``deletes`` alone, then one small txn, so the next txn can reuse their pages."""
        deleted = self._delete_txn(lm, env, deletes)
        try:
            with env.begin(write=True) as txn:
                seq_raw = txn.get(META_NEXT_SEQ, db=lm.meta)
                if seq_raw is not None:
                    txn.put(META_NEXT_SEQ, seq_raw, db=lm.meta)
        except lmdb.Error as exc:  # full: the retry reports its keys as full
            if not isinstance(exc, lmdb.MapFullError) and not self._out_of_space(exc, 0):
                raise
        return deleted

    def _delete_txn(self, lm: LmdbEnv, env: lmdb.Environment, keys: Sequence[bytes]) -> int:
        try:
            return self._write_txn(lm, env, [], keys)[1]
        except lmdb.MapFullError:  # copy-on-write needs a few pages even to delete
            logger.warning("%s: map full even for %d delete(s); raise disk.max_bytes, now %s",
                           self._name, len(keys), format_bytes(self.config.max_bytes))
            return 0
        except lmdb.Error as exc:
            if not self._out_of_space(exc, 0):
                raise
            logger.warning("%s: filesystem full even for %d delete(s); free space under %s",
                           self._name, len(keys), self.root)
            return 0

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (absent ones are ignored) in one write txn; returns how many existed."""
        self._check_writable("deleting chunks")
        for key in keys:
            self._check_key(key)
        if not keys:
            self._shards[0].check_usable("deleting chunks")
        return sum(self._shards[shard].run("deleting chunks", partial(
            self._delete_txn, self._shards[shard], keys=group))
            for shard, group in self._by_shard(keys).items())

    def _after_commit(self, num_bytes: int) -> None:
        with self._stats_lock:
            self._unsynced_bytes += num_bytes
        for env in self._shards:
            if env.readers_due():
                env.run("checking readers", env.clear_stale_readers)
        if self.config.sync_mode == "periodic" and self.sync_inline:
            self.sync_if_due()

    def sync_if_due(self) -> bool:
        """In ``periodic`` mode, sync when ``disk.sync_every_bytes`` or
        ``disk.sync_every_seconds`` passed since the last sync with data unsynced."""
        if self.config.sync_mode != "periodic" or self._shards[0].closed:
            return False
        with self._stats_lock:
            unsynced = self._unsynced_bytes
        due = unsynced > 0 and (unsynced >= self.config.sync_every_bytes or
                                self._clock() - self._last_sync >= self.config.sync_every_seconds)
        if due:
            self.sync()
        return due

    def sync(self) -> None:
        """fsync everything committed so far (the durability point); nothing to do read-only."""
        if self.read_only:
            self._shards[0].check_usable("syncing")
            return
        with self._stats_lock:  # commits during the fsync count toward the next one
            unsynced, started = self._unsynced_bytes, self._clock()
        for shard in self._shards:
            shard.run("syncing", lambda env: env.sync(True))
        with self._stats_lock:
            self._counts["syncs"] += 1
            self._unsynced_bytes -= unsynced
            self._last_sync = started

    # -- reads -----------------------------------------------------------------------------

    def read_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """Copy the verified payload of ``key`` into ``out[:payload_bytes]``."""
        self._check_key(key)
        if not (type(out) is memoryview and out.format == "B" and out.ndim == 1
                and not out.readonly and out.c_contiguous and len(out) >= self.payload_bytes):
            out = self._bytes_of(out, f"the read buffer for chunk {short_key(key)}",
                                 writable=True)
        lm = self._shard(key)

        def read(env: lmdb.Environment) -> tuple[bool, str | None]:
            with env.begin(db=lm.chunks, buffers=True) as txn:
                value = txn.get(key)  # py-lmdb touches each page first, GIL released
                found = value is not None
                problem = check_value(self._binding, key, value, self.payload_bytes,
                                      out) if found else None
                del value  # LMDB's buffer is valid only inside the txn
            return found, problem

        found, problem = lm.run("reading chunk", read, key)
        if not found:
            self._count(reads=1, misses=1)
            return ReadStatus.MISSING
        if problem is None:
            self._count(reads=1, hits=1, bytes_read=self.payload_bytes)
            return ReadStatus.OK
        self._count(reads=1, misses=1, corrupt=1)
        logger.warning("%s: corrupt chunk %s (%s)%s", self._name, short_key(key), problem,
                       "" if self.read_only else "; deleted it")
        if not self.read_only:
            self.delete_many([key])
        return ReadStatus.CORRUPT

    @staticmethod
    def _rows_after(txn: Any, db: Any, last: bytes | None,
                    batch: int) -> list[tuple[bytes, Any]]:
        """Up to ``batch`` (key, value) rows of ``db`` after key ``last``, in ``txn`` (in a
        ``buffers=True`` txn the values are LMDB's buffers, valid only inside it)."""
        rows: list[tuple[bytes, Any]] = []
        cursor = txn.cursor(db=db)
        more = cursor.set_range(last) if last is not None else cursor.first()
        if more and last is not None and bytes(cursor.key()) == last:
            more = cursor.next()
        while more and len(rows) < batch:
            rows.append((bytes(cursor.key()), cursor.value()))
            more = cursor.next()
        return rows

    def scan(self, batch: int = 1024) -> Iterator[ChunkRecord]:
        """Every stored chunk as (key, payload_len, seq), from the shards' indexes; no
        payload is read.

        A shard's index is read whole (one short txn per ``batch`` keys) before the first
        record is yielded, so damage met anywhere in it (the shard is then rebuilt empty)
        never leaves a caller holding records of an environment that is gone."""
        self._check_batch(batch)
        records = [self._scan_shard(lm, batch) for lm in self._shards]
        for shard_records in records:
            yield from shard_records

    def _scan_shard(self, lm: LmdbEnv, batch: int) -> list[ChunkRecord]:
        records: list[ChunkRecord] = []
        last: bytes | None = None
        replaced = lm.replacements

        def rows_of(env: lmdb.Environment) -> list[tuple[bytes, bytes]]:
            with env.begin(db=lm.index) as txn:
                return self._rows_after(txn, lm.index, last, batch)

        with lm.random_access():  # a restart reads index pages, not read-ahead
            while True:
                rows = lm.run("scanning", rows_of)
                if lm.replacements != replaced:  # rebuilt meanwhile: start over
                    records, replaced = [], lm.replacements
                    if last is not None:
                        last = None
                        continue
                records += [ChunkRecord(key, *parsed) for key, raw in rows
                            if (parsed := unpack_index(raw)) is not None]
                if len(rows) < batch:
                    return records
                last = rows[-1][0]

    def verify(self, repair: bool = False, batch: int = 64,
               progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Check every value's header and checksum, its shard and the index; ``repair``
        deletes bad keys.

        Each batch is listed and checked inside one short read txn (one snapshot), so a
        chunk that another thread or process deletes meanwhile is simply not seen, never
        reported bad. Damage of a shard's environment is reported in ``damaged`` (see
        :class:`VerifyReport`); where it may not be repaired, :class:`DamagedError` says why."""
        self._check_batch(batch)
        if repair:
            self._check_writable("repairing")
        scratch = memoryview(bytearray(self.payload_bytes))
        checked, repaired = 0, 0
        bad: list[bytes] = []
        damaged: list[str] = []
        for lm in self._shards:
            replaced = lm.replacements
            done = checked

            def shard_progress(count: int, done: int = done) -> None:
                if progress is not None:
                    progress(done + count)

            count, found = self._verify_shard(lm, batch, scratch, shard_progress)
            if lm.replacements != replaced:  # rebuilt empty: nothing of it is left
                damaged.append(str(lm.last_damage))
                continue
            checked, bad = checked + count, bad + found
            if repair and found:
                repaired += lm.run("repairing", partial(self._delete_txn, lm, keys=found))
        return VerifyReport(checked, tuple(bad), repaired,
                            damaged="; ".join(damaged) or None, rebuilt=bool(damaged))

    def _verify_shard(self, lm: LmdbEnv, batch: int, scratch: memoryview,
                      progress: Callable[[int], None]) -> tuple[int, list[bytes]]:
        """(values checked, bad keys) of one shard: values failing their checks, in the
        wrong shard or without a good index entry; index entries without a value."""

        def bad_after(env: lmdb.Environment, last: bytes | None,
                      values: bool) -> tuple[list[bytes], list[bytes]]:
            """The next ``batch`` keys after ``last`` of the values (else of the index), and
            the bad ones."""
            chunks, index = lm.chunks, lm.index
            with env.begin(buffers=True) as txn:
                rows = self._rows_after(txn, chunks if values else index, last, batch)
                keys = [key for key, _ in rows]
                if not values:
                    return keys, [key for key in keys if txn.get(key, db=chunks) is None]
                return keys, [key for key, value in rows if shard_of(key) != lm.shard
                              or check_value(self._binding, key, value, self.payload_bytes,
                                             scratch) is not None
                              or unpack_index(bytes(txn.get(key, db=index) or b"")) is None]

        bad: dict[bytes, None] = {}
        checked, replaced = 0, lm.replacements
        for values in (True, False):
            last: bytes | None = None
            while lm.replacements == replaced:
                keys, found = lm.run("verifying", partial(bad_after, last=last, values=values))
                if values:
                    checked += len(keys)
                    progress(checked)
                bad.update(dict.fromkeys(found))
                if len(keys) < batch:
                    break
                last = keys[-1]
        return checked, list(bad)

    # -- life cycle ------------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        def count(lm: LmdbEnv, env: lmdb.Environment) -> int:
            with env.begin() as txn:
                return int(txn.stat(lm.chunks)["entries"])

        chunks = sum(lm.run("counting chunks", partial(count, lm)) for lm in self._shards)
        with self._stats_lock:
            counts = dict(self._counts)
        for lm in self._shards:
            for name, value in lm.counts().items():
                counts[name] = counts.get(name, 0) + value
        return DiskStatistics(chunks=chunks, map_size=self.map_size, **counts)

    def close(self) -> None:
        """Sync and close; idempotent."""
        synced = [lm.close(sync=True) for lm in self._shards]
        if any(synced):
            self._count(syncs=1)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._shards[0].closed else "open"
        return f"DiskTier({str(self.path)!r}, payload_bytes={self.payload_bytes}, {state})"
