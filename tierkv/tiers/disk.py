"""The disk tier: chunk payloads in one LMDB environment per namespace and rank, at
``root/ns-<fingerprint>/rank-<r>/`` (``docs/on-disk-format.md`` has every byte).

Primitives and contracts: those of :class:`~tierkv.tiers.base.LowerTier`, and (one
:class:`DiskTier` holds bytes and starts no threads; it may be called from several threads:
LMDB serializes write transactions, reads run concurrently):

- ``put_many(items, deletes=())`` is one write txn (deletes, then puts), ``delete_many``
  one too. A full map or a full filesystem (ENOSPC, EDQUOT, or EIO from a short write with
  the filesystem out of space) is ``PutResult.full``; the disk cap is soft here (the
  scheduler side accounts for it).
- ``read_into(key, out)`` is one short read txn: header and checksum verified, the payload
  copied straight into ``out``; a bad value is deleted and counted.
- ``scan(batch)`` reads the small "index" sub-db in short txns of ``batch`` keys (restart
  warm without reading payloads); ``verify`` also checks the index against the values.
- ``claim()`` makes this process the environment's one writer (``exclusive=True`` does it
  at open, before anything is judged or moved): a second claim, from any process, is
  refused with a :class:`ConfigError` naming the holder.
- ``read_only=True`` (operator tools): nothing is created, written, moved or chmod-ed;
  what is not trusted, or damaged, raises :class:`DamagedError`; a corrupt value is
  answered ``CORRUPT`` and left in place.
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
from tierkv.tiers.disk_env import META_NEXT_SEQ, FilesDamaged, LmdbEnv
from tierkv.tiers.disk_files import NamespaceInfo, list_namespaces
from tierkv.tiers.disk_format import ValueWriter, binding_of, check_value, pack_index, unpack_index
from tierkv.tiers.lmdb_tuning import map_size_for, tune_malloc
from tierkv.units import format_bytes

__all__ = [
    "ChunkRecord", "DiskStatistics", "DiskTier", "NamespaceInfo", "PutResult", "ReadStatus",
    "VerifyReport", "list_namespaces", "map_size_for", "tune_malloc",
]

logger = logging.getLogger("tierkv.disk")


@dataclass(frozen=True)
class DiskStatistics:
    """Counters since open; ``chunks`` and ``map_size`` are current."""

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
        self._writer = ValueWriter(payload_bytes, self._binding)
        if config.tune_malloc:
            tune_malloc(config.write_batch_bytes)
        self._lmdb = LmdbEnv(
            self.root, namespace, rank,
            map_size=map_size_for(config.max_bytes, payload_bytes, os.sysconf("SC_PAGE_SIZE")),
            sync_always=config.sync_mode == "always", name=self._name, clock=clock,
            exclusive=exclusive, repair=repair, read_only=read_only)
        self.path, self.namespace_dir = self._lmdb.path, self._lmdb.namespace_dir

    @property
    def map_size(self) -> int:  # grows when a map another process grew is adopted
        return self._lmdb.map_size

    @property
    def sync_every_seconds(self) -> float | None:
        return self.config.sync_every_seconds if self.config.sync_mode == "periodic" else None

    @property
    def claimed(self) -> bool:
        return self._lmdb.claimed

    def claim(self) -> None:
        """Make this process the one writer of the environment (idempotent)."""
        self._lmdb.claim()

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
        written, full, deleted, no_space = self._lmdb.run(
            "writing chunks", lambda env: self._put(env, views, tuple(deletes)))
        num_bytes = len(written) * self.payload_bytes
        self._count(bytes_written=num_bytes, puts=len(written), full=len(full), write_txns=1)
        message = None
        if full:
            what, hint = (("filesystem", f"free space under {self.root} or lower disk.max_bytes")
                          if no_space else ("map", "raise disk.max_bytes"))
            message = (f"{self._name}: {what} full writing chunk {short_key(full[0])} "
                       f"({len(full)} chunk(s) not written; {hint}, now "
                       f"{format_bytes(self.config.max_bytes)})")
            logger.warning("%s", message)
        self._after_commit(num_bytes)
        return PutResult(written, full, deleted, num_bytes, message)

    def _put(self, env: lmdb.Environment, pending: list[tuple[bytes, memoryview | bytes]],
             deletes: tuple[bytes, ...]) -> tuple[tuple[bytes, ...], tuple[bytes, ...], int, bool]:
        """(written, full, deleted, filesystem full) of one ``put_many``."""
        full: list[bytes] = []
        settled, deleted, failed_at = 0, 0, None
        no_space = False  # the filesystem (not the map) is full
        readers_checked = False
        while pending or deletes:
            try:
                failed_at, deleted = self._write_txn(env, pending, deletes)
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
                settled, deletes = self._settle_deletes(env, deletes), ()
                continue
            if not no_space and not readers_checked:
                readers_checked = True  # a dead reader may pin the pages we need
                if self._lmdb.clear_stale_readers(env):
                    continue
            full[:0] = [key for key, _ in pending[failed_at:]]
            pending = pending[:failed_at]
        return tuple(key for key, _ in pending), tuple(full), deleted + settled, no_space

    def _write_txn(
        self, env: lmdb.Environment, items: list[tuple[bytes, memoryview | bytes]],
        deletes: Sequence[bytes],
    ) -> tuple[int | None, int]:
        """One txn; returns (index of the first item the map could not take or None, deleted).
        The write sequence is read and advanced inside the txn, so it stays strictly
        increasing across threads and processes (LMDB serializes writers)."""
        txn = env.begin(write=True)
        try:
            deleted = 0
            for key in deletes:
                deleted += bool(txn.delete(key, db=self._lmdb.chunks))
                txn.delete(key, db=self._lmdb.index)
            if items:
                seq_raw = txn.get(META_NEXT_SEQ, db=self._lmdb.meta)
                if seq_raw is None or len(seq_raw) != 8:
                    raise FilesDamaged("next_seq record missing or malformed")
                seq = int.from_bytes(seq_raw, "little")
                for position, (key, payload) in enumerate(items):
                    try:
                        txn.put(key, self._writer.build(key, payload, seq), db=self._lmdb.chunks)
                        txn.put(key, pack_index(self.payload_bytes, seq), db=self._lmdb.index)
                    except lmdb.MapFullError:
                        txn.abort()
                        return position, 0
                    seq += 1
                txn.put(META_NEXT_SEQ, seq.to_bytes(8, "little"), db=self._lmdb.meta)
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        return None, deleted

    def _settle_deletes(self, env: lmdb.Environment, deletes: Sequence[bytes]) -> int:
        """Commit ``deletes`` alone, then one small txn, so the next txn can reuse their pages."""
        deleted = self._delete_txn(env, deletes)
        try:
            with env.begin(write=True) as txn:
                seq_raw = txn.get(META_NEXT_SEQ, db=self._lmdb.meta)
                if seq_raw is not None:
                    txn.put(META_NEXT_SEQ, seq_raw, db=self._lmdb.meta)
        except lmdb.Error as exc:  # full: the retry reports its keys as full
            if not isinstance(exc, lmdb.MapFullError) and not self._out_of_space(exc, 0):
                raise
        return deleted

    def _delete_txn(self, env: lmdb.Environment, keys: Sequence[bytes]) -> int:
        try:
            return self._write_txn(env, [], keys)[1]
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
            self._lmdb.check_usable("deleting chunks")
            return 0
        return self._lmdb.run("deleting chunks", lambda env: self._delete_txn(env, keys))

    def _after_commit(self, num_bytes: int) -> None:
        with self._stats_lock:
            self._unsynced_bytes += num_bytes
        if self._lmdb.readers_due():
            self._lmdb.run("checking readers", self._lmdb.clear_stale_readers)
        if self.config.sync_mode == "periodic" and self.sync_inline:
            self.sync_if_due()

    def sync_if_due(self) -> bool:
        """In ``periodic`` mode, sync when ``disk.sync_every_bytes`` or
        ``disk.sync_every_seconds`` passed since the last sync with data unsynced."""
        if self.config.sync_mode != "periodic" or self._lmdb.closed:
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
            self._lmdb.check_usable("syncing")
            return
        with self._stats_lock:  # commits during the fsync count toward the next one
            unsynced, started = self._unsynced_bytes, self._clock()
        self._lmdb.run("syncing", lambda env: env.sync(True))
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

        def read(env: lmdb.Environment) -> tuple[bool, str | None]:
            with env.begin(db=self._lmdb.chunks, buffers=True) as txn:
                value = txn.get(key)  # py-lmdb touches each page first, GIL released
                found = value is not None
                problem = check_value(self._binding, key, value, self.payload_bytes,
                                      out) if found else None
                del value  # LMDB's buffer is valid only inside the txn
            return found, problem

        found, problem = self._lmdb.run("reading chunk", read, key)
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
        """Every stored chunk as (key, payload_len, seq), from the index; no payload is read.

        The index is read whole (one short txn per ``batch`` keys) before the first record
        is yielded, so damage met anywhere in it (the environment is then rebuilt empty)
        never leaves a caller holding records of an environment that is gone."""
        self._check_batch(batch)
        records: list[ChunkRecord] = []
        last: bytes | None = None
        replaced = self._lmdb.replacements

        def rows_of(env: lmdb.Environment) -> list[tuple[bytes, bytes]]:
            with env.begin(db=self._lmdb.index) as txn:
                return self._rows_after(txn, self._lmdb.index, last, batch)

        with self._lmdb.random_access():  # a restart reads index pages, not read-ahead
            while True:
                rows = self._lmdb.run("scanning", rows_of)
                if self._lmdb.replacements != replaced:  # rebuilt meanwhile: start over
                    records, replaced = [], self._lmdb.replacements
                    if last is not None:
                        last = None
                        continue
                records += [ChunkRecord(key, *parsed) for key, raw in rows
                            if (parsed := unpack_index(raw)) is not None]
                if len(rows) < batch:
                    break
                last = rows[-1][0]
        yield from records

    def verify(self, repair: bool = False, batch: int = 64) -> VerifyReport:
        """Check every value's header and checksum and the index; ``repair`` deletes bad keys.

        Each batch is listed and checked inside one short read txn (one snapshot), so a
        chunk that another thread or process deletes meanwhile is simply not seen, never
        reported bad. Damage of the environment itself is reported in ``damaged`` (see
        :class:`VerifyReport`); where it may not be repaired, :class:`DamagedError` says why."""
        self._check_batch(batch)
        if repair:
            self._check_writable("repairing")
        bad: dict[bytes, None] = {}
        checked = 0
        scratch = memoryview(bytearray(self.payload_bytes))
        replaced = self._lmdb.replacements

        def bad_after(env: lmdb.Environment, last: bytes | None,
                      values: bool) -> tuple[list[bytes], list[bytes]]:
            """The next ``batch`` keys after ``last`` of the values (else of the index), and
            the bad ones: values failing their checks or without a good index entry (index
            entries without a value)."""
            chunks, index = self._lmdb.chunks, self._lmdb.index
            with env.begin(buffers=True) as txn:
                rows = self._rows_after(txn, chunks if values else index, last, batch)
                keys = [key for key, _ in rows]
                if not values:
                    return keys, [key for key in keys if txn.get(key, db=chunks) is None]
                return keys, [key for key, value in rows if check_value(
                    self._binding, key, value, self.payload_bytes, scratch) is not None
                    or unpack_index(bytes(txn.get(key, db=index) or b"")) is None]

        for values in (True, False):
            last: bytes | None = None
            while self._lmdb.replacements == replaced:
                keys, found = self._lmdb.run("verifying",
                                             partial(bad_after, last=last, values=values))
                if self._lmdb.replacements != replaced:
                    break  # rebuilt empty meanwhile: nothing of the old environment is left
                checked += len(keys) if values else 0
                bad.update(dict.fromkeys(found))
                if len(keys) < batch:
                    break
                last = keys[-1]
        rebuilt = self._lmdb.replacements != replaced
        if rebuilt:
            bad.clear()
        if repair and bad:
            self.delete_many(list(bad))
        return VerifyReport(checked, tuple(bad), len(bad) if repair else 0,
                            damaged=self._lmdb.last_damage if rebuilt else None, rebuilt=rebuilt)

    # -- life cycle ------------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        def count(env: lmdb.Environment) -> int:
            with env.begin() as txn:
                return int(txn.stat(self._lmdb.chunks)["entries"])

        chunks = self._lmdb.run("counting chunks", count)
        with self._stats_lock:
            counts = dict(self._counts)
        return DiskStatistics(chunks=chunks, map_size=self.map_size, **counts,
                              **self._lmdb.counts())

    def close(self) -> None:
        """Sync and close; idempotent."""
        if self._lmdb.close(sync=True):
            self._count(syncs=1)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._lmdb.closed else "open"
        return f"DiskTier({str(self.path)!r}, payload_bytes={self.payload_bytes}, {state})"
