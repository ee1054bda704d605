"""The disk tier: chunk payloads in one LMDB environment per namespace and rank.

Layout (``docs/on-disk-format.md`` has every byte)::

    root/ns-<fingerprint>/namespace.json      what the namespace is, for operators
    root/ns-<fingerprint>/rank-<r>/data.mdb   LMDB, sub-dbs "meta", "chunks", "index"

Primitives and contracts (one :class:`DiskTier` holds bytes and starts no threads; it may be
called from several threads: LMDB serializes write transactions, reads run concurrently):

- ``put_many(items, deletes=())`` one write txn: deletes, then puts. Values are copied into
  LMDB before it returns, so slots may be reused. A full map is a value (``PutResult.full``),
  never an exception; the disk cap is soft here (the scheduler side accounts for it).
- ``delete_many(keys)`` one write txn.
- ``read_into(key, out)`` a short read txn: verify header and checksum, copy the payload
  straight into ``out``. ``OK`` only for verified bytes; a bad value is deleted, counted and
  answered ``CORRUPT``. On anything but ``OK`` the contents of ``out`` are unspecified.
- ``scan(batch)`` yields ``DiskRecord`` from the small "index" sub-db, one short txn per batch
  (restart warm without reading payloads).
- ``verify(repair)`` checks every value (and index consistency); ``repair`` deletes bad ones.
- ``sync()``, ``sync_if_due()``, ``statistics()``, ``close()`` (idempotent; later calls raise
  :class:`ClosedError`).
- No read transaction outlives a call. Nothing is ever unpickled or evaluated.
- An environment that is damaged (fails to open or fails its meta check) is moved aside to
  ``rank-<r>.broken-<timestamp>`` and rebuilt empty with a logged warning. A namespace
  mismatch raises :class:`NamespaceMismatchError`; other open failures raise
  :class:`BrokenError`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb
import msgpack

from tierkv.config import DiskTierConfig
from tierkv.errors import BrokenError, ClosedError, ConfigError, NamespaceMismatchError, short_key
from tierkv.keys import KEY_BYTES, Namespace
from tierkv.tiers.disk_format import (FILE_MODE, DiskRecord, DiskStatistics, NamespaceInfo,
                                     PutResult, ReadStatus, ValueWriter, VerifyReport,
                                     check_value, format_bytes, list_namespaces,
                                     make_private_dir, map_size_for, namespace_record,
                                     pack_index, unpack_index, write_private_file)

__all__ = [
    "DiskRecord", "DiskStatistics", "DiskTier", "NamespaceInfo", "PutResult", "ReadStatus",
    "VerifyReport", "list_namespaces", "map_size_for",
]

logger = logging.getLogger("tierkv.disk")

MAX_DBS = 4
_META_NAMESPACE = b"namespace"
_META_NEXT_SEQ = b"next_seq"
# LMDB errors that mean the files are damaged (as opposed to permissions, locks, disk space).
_DAMAGE_ERRORS: tuple[type[Exception], ...] = (
    lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.PageNotFoundError,
    lmdb.IncompatibleError, lmdb.BadDbiError, lmdb.PanicError, lmdb.BadChecksumError)


class _DamagedError(Exception):
    """The meta sub-db does not hold what tierkv writes there."""


class DiskTier:
    """Chunk payloads of one namespace and rank in LMDB. See the module docstring."""

    def __init__(
        self,
        root: Path,
        namespace: Namespace,
        rank: int,
        config: DiskTierConfig,
        payload_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value, low in (("payload_bytes", payload_bytes, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"disk tier: {name} must be an int >= {low}, got {value!r}")
        self.root = Path(root)
        self.namespace = namespace
        self.rank = rank
        self.config = config
        self.payload_bytes = payload_bytes
        self._clock = clock
        self.fingerprint = namespace.fingerprint()
        self.namespace_dir = self.root / f"ns-{self.fingerprint}"
        self.path = self.namespace_dir / f"rank-{rank}"
        self.map_size = map_size_for(config.max_bytes, payload_bytes)
        self._name = f"disk tier (namespace {self.fingerprint[:8]}, rank {rank})"
        self._record = namespace_record(self.fingerprint, namespace.describe())
        self._expected_meta = msgpack.unpackb(msgpack.packb(self._record), raw=False)
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("bytes_written", "bytes_read", "puts", "reads", "hits", "misses", "corrupt",
             "full", "syncs", "write_txns"), 0)
        self._unsynced_bytes = 0
        self._last_sync = clock()
        self._writer = ValueWriter(payload_bytes)
        self._closed = False
        make_private_dir(self.root)
        make_private_dir(self.namespace_dir)
        self._write_namespace_json()
        self._env, self._chunks, self._index, self._meta, self._next_seq = self._open()

    # -- opening -------------------------------------------------------------------------

    def _write_namespace_json(self) -> None:
        path = self.namespace_dir / "namespace.json"
        text = json.dumps(self._record, indent=2, sort_keys=True) + "\n"
        try:
            if path.exists() and path.read_text() == text:
                return
            write_private_file(path, text.encode())
        except OSError as exc:
            raise BrokenError(f"{self._name}: cannot write {path}: {exc} (check disk.path)") from exc

    def _open(self) -> tuple[lmdb.Environment, Any, Any, Any, int]:
        try:
            return self._open_once()
        except NamespaceMismatchError:
            raise
        except (_DamagedError, *_DAMAGE_ERRORS) as exc:
            aside = self._move_aside()
            logger.warning("%s: environment at %s is damaged (%s); moved it to %s and started "
                           "empty", self._name, self.path, exc, aside)
        except lmdb.Error as exc:
            raise BrokenError(f"{self._name}: cannot open {self.path}: {exc} "
                              f"(check disk.path permissions and free space)") from exc
        try:
            return self._open_once()
        except (lmdb.Error, _DamagedError) as exc:
            raise BrokenError(f"{self._name}: cannot rebuild {self.path}: {exc}") from exc

    def _open_once(self) -> tuple[lmdb.Environment, Any, Any, Any, int]:
        make_private_dir(self.path)
        always = self.config.sync_mode == "always"
        env = lmdb.open(
            str(self.path), map_size=self.map_size, subdir=True, sync=always, metasync=always,
            map_async=False, mode=FILE_MODE, readahead=True, writemap=False, meminit=True,
            max_dbs=MAX_DBS, lock=True,
        )
        try:
            meta = env.open_db(b"meta")
            chunks = env.open_db(b"chunks")
            index = env.open_db(b"index")
            next_seq = self._check_meta(env, meta, chunks)
        except BaseException:
            env.close()
            raise
        for name in ("data.mdb", "lock.mdb"):
            if (self.path / name).exists():
                os.chmod(self.path / name, FILE_MODE)
        return env, chunks, index, meta, next_seq

    def _check_meta(self, env: lmdb.Environment, meta: Any, chunks: Any) -> int:
        with env.begin(write=True) as txn:
            raw = txn.get(_META_NAMESPACE, db=meta)
            if raw is None:
                if txn.stat(chunks)["entries"]:
                    raise _DamagedError("chunks present but no namespace record")
                txn.put(_META_NAMESPACE, msgpack.packb(self._record), db=meta)
                txn.put(_META_NEXT_SEQ, (1).to_bytes(8, "little"), db=meta)
                return 1
            try:
                stored = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0)
            except Exception as exc:
                raise _DamagedError(f"namespace record does not decode: {exc}") from exc
            if not isinstance(stored, dict) or "namespace" not in stored:
                raise _DamagedError("namespace record has the wrong shape")
            if stored != self._expected_meta:
                raise NamespaceMismatchError(
                    f"{self._name}: {self.path} holds namespace {stored.get('fingerprint')!r} "
                    f"({stored.get('namespace')}), expected {self.fingerprint} "
                    f"({self.namespace.describe()}); point disk.path elsewhere or remove it")
            seq_raw = txn.get(_META_NEXT_SEQ, db=meta)
            if seq_raw is None or len(seq_raw) != 8:
                raise _DamagedError("next_seq record missing or malformed")
            return int.from_bytes(seq_raw, "little")

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.broken-{stamp}")
        counter = 0
        while target.exists():
            counter += 1
            target = self.path.with_name(f"{self.path.name}.broken-{stamp}-{counter}")
        try:
            os.rename(self.path, target)
        except OSError as exc:
            raise BrokenError(f"{self._name}: {self.path} is damaged and cannot be moved "
                              f"aside: {exc} (remove it by hand)") from exc
        return target

    # -- helpers ---------------------------------------------------------------------------

    def _live_env(self) -> lmdb.Environment:
        if self._closed:
            raise ClosedError(f"{self._name}: used after close(); open a new DiskTier")
        return self._env

    def _failure(self, action: str, exc: BaseException) -> Exception:
        if self._closed:
            return ClosedError(f"{self._name}: closed while {action}")
        return BrokenError(f"{self._name}: LMDB failed {action} at {self.path}: {exc}")

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ConfigError(f"{self._name}: a chunk key must be {KEY_BYTES} bytes, got {key!r:.40}")

    # -- writes ----------------------------------------------------------------------------

    def put_many(
        self,
        items: Sequence[tuple[bytes, memoryview | bytes]],
        deletes: Sequence[bytes] = (),
    ) -> PutResult:
        """Delete ``deletes`` then write ``items`` in one write transaction."""
        env = self._live_env()
        for key, payload in items:
            self._check_key(key)
            if len(payload) != self.payload_bytes:
                raise ConfigError(f"{self._name}: chunk {short_key(key)} has {len(payload)} "
                                  f"bytes, the tier stores {self.payload_bytes}")
        for key in deletes:
            self._check_key(key)
        pending = list(items)
        full: list[bytes] = []
        while True:
            try:
                failed_at, deleted = self._write_txn(env, pending, deletes)
            except lmdb.MapFullError:  # raised by commit: retry without the last item
                failed_at, deleted = len(pending) - 1, 0
            except lmdb.Error as exc:
                raise self._failure("writing chunks", exc) from exc
            if failed_at is None:
                break
            if failed_at < 0:  # not even the deletes fit: leave everything as it was
                logger.warning("%s: map full even for %d delete(s); raise disk.max_bytes, now "
                               "%s", self._name, len(deletes), format_bytes(self.config.max_bytes))
                break
            full[:0] = [key for key, _ in pending[failed_at:]]
            pending = pending[:failed_at]
        written = tuple(key for key, _ in pending)
        num_bytes = len(written) * self.payload_bytes
        self._count(bytes_written=num_bytes, puts=len(written), full=len(full), write_txns=1)
        message = None
        if full:
            message = (f"{self._name}: map full writing chunk {short_key(full[0])} "
                       f"({len(full)} chunk(s) not written; raise disk.max_bytes, now "
                       f"{format_bytes(self.config.max_bytes)})")
            logger.warning("%s", message)
        self._after_commit(num_bytes)
        return PutResult(written, tuple(full), deleted, num_bytes, message)

    def _write_txn(
        self, env: lmdb.Environment, items: list[tuple[bytes, memoryview | bytes]],
        deletes: Sequence[bytes],
    ) -> tuple[int | None, int]:
        """One txn; returns (index of the first item the map could not take or None, deleted)."""
        txn = env.begin(write=True)
        try:
            deleted = 0
            for key in deletes:
                deleted += bool(txn.delete(key, db=self._chunks))
                txn.delete(key, db=self._index)
            seq = self._next_seq
            for position, (key, payload) in enumerate(items):
                try:
                    txn.put(key, self._writer.build(key, payload, seq), db=self._chunks)
                    txn.put(key, pack_index(self.payload_bytes, seq), db=self._index)
                except lmdb.MapFullError:
                    txn.abort()
                    return position, 0
                seq += 1
            txn.put(_META_NEXT_SEQ, seq.to_bytes(8, "little"), db=self._meta)
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        self._next_seq = seq
        return None, deleted

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (absent ones are ignored) in one write txn; returns how many existed."""
        env = self._live_env()
        for key in keys:
            self._check_key(key)
        try:
            with env.begin(write=True) as txn:
                deleted = 0
                for key in keys:
                    deleted += bool(txn.delete(key, db=self._chunks))
                    txn.delete(key, db=self._index)
        except lmdb.Error as exc:
            raise self._failure("deleting chunks", exc) from exc
        return deleted

    def _after_commit(self, num_bytes: int) -> None:
        with self._stats_lock:
            self._unsynced_bytes += num_bytes
        if self.config.sync_mode == "periodic":
            self.sync_if_due()

    def sync_if_due(self) -> bool:
        """In ``periodic`` mode, sync when ``disk.sync_every_bytes`` or
        ``disk.sync_every_seconds`` passed since the last sync with data unsynced."""
        if self.config.sync_mode != "periodic" or self._closed:
            return False
        with self._stats_lock:
            unsynced = self._unsynced_bytes
        if unsynced <= 0:
            return False
        elapsed = self._clock() - self._last_sync
        if unsynced >= self.config.sync_every_bytes or elapsed >= self.config.sync_every_seconds:
            self.sync()
            return True
        return False

    def sync(self) -> None:
        """fsync everything committed so far (the durability point)."""
        env = self._live_env()
        try:
            env.sync(True)
        except lmdb.Error as exc:
            raise self._failure("syncing", exc) from exc
        with self._stats_lock:
            self._counts["syncs"] += 1
            self._unsynced_bytes = 0
        self._last_sync = self._clock()

    # -- reads -----------------------------------------------------------------------------

    def read_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """Copy the verified payload of ``key`` into ``out[:payload_bytes]``."""
        env = self._live_env()
        self._check_key(key)
        if len(out) < self.payload_bytes or out.readonly:
            raise ConfigError(f"{self._name}: read buffer for chunk {short_key(key)} must be "
                              f"writable and hold {self.payload_bytes} bytes, got {len(out)}")
        try:
            with env.begin(db=self._chunks, buffers=True) as txn:
                value = txn.get(key)
                problem = None if value is None else check_value(
                    key, value, self.payload_bytes, out)
                found = value is not None
                del value
        except lmdb.Error as exc:
            raise self._failure(f"reading chunk {short_key(key)}", exc) from exc
        if not found:
            self._count(reads=1, misses=1)
            return ReadStatus.MISSING
        if problem is None:
            self._count(reads=1, hits=1, bytes_read=self.payload_bytes)
            return ReadStatus.OK
        self._count(reads=1, misses=1, corrupt=1)
        logger.warning("%s: corrupt chunk %s (%s); deleted it", self._name, short_key(key), problem)
        self.delete_many([key])
        return ReadStatus.CORRUPT

    def _batches(self, db: Any, batch: int, values: bool) -> Iterator[list[tuple[bytes, bytes]]]:
        """Key order batches, one short read txn each (resumes after the last key)."""
        last: bytes | None = None
        while True:
            env = self._live_env()
            rows: list[tuple[bytes, bytes]] = []
            try:
                with env.begin(db=db) as txn:
                    cursor = txn.cursor()
                    more = cursor.set_range(last) if last is not None else cursor.first()
                    if more and last is not None and cursor.key() == last:
                        more = cursor.next()
                    while more and len(rows) < batch:
                        rows.append((cursor.key(), cursor.value() if values else b""))
                        more = cursor.next()
            except lmdb.Error as exc:
                raise self._failure("scanning", exc) from exc
            if rows:
                yield rows
            if len(rows) < batch:
                return
            last = rows[-1][0]

    def scan(self, batch: int = 1024) -> Iterator[DiskRecord]:
        """Every stored chunk as (key, payload_len, seq), from the index; no payload is read."""
        if batch <= 0:
            raise ConfigError(f"{self._name}: scan batch must be > 0, got {batch}")
        for rows in self._batches(self._index, batch, values=True):
            for key, raw in rows:
                parsed = unpack_index(raw)
                if parsed is not None:
                    yield DiskRecord(key, parsed[0], parsed[1])

    def verify(self, repair: bool = False, batch: int = 64) -> VerifyReport:
        """Check every value's header and checksum and the index; ``repair`` deletes bad keys."""
        bad: dict[bytes, None] = {}
        checked = 0
        scratch = memoryview(bytearray(self.payload_bytes))
        for rows in self._batches(self._chunks, batch, values=False):
            env = self._live_env()
            try:
                with env.begin(buffers=True) as txn:
                    for key, _ in rows:
                        checked += 1
                        value = txn.get(key, db=self._chunks)
                        entry = txn.get(key, db=self._index)
                        problem = "vanished" if value is None else check_value(
                            key, value, self.payload_bytes, scratch)
                        if problem is None and (entry is None or unpack_index(bytes(entry)) is None):
                            problem = "index entry missing or malformed"
                        if problem is not None:
                            bad[key] = None
                        del value, entry
            except lmdb.Error as exc:
                raise self._failure("verifying", exc) from exc
        for rows in self._batches(self._index, 1024, values=False):
            env = self._live_env()
            try:
                with env.begin(db=self._chunks) as txn:
                    bad.update((key, None) for key, _ in rows if txn.get(key) is None)
            except lmdb.Error as exc:
                raise self._failure("verifying", exc) from exc
        repaired = 0
        if repair and bad:
            self.delete_many(list(bad))
            repaired = len(bad)
        return VerifyReport(checked, tuple(bad), repaired)

    # -- life cycle ------------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        env = self._live_env()
        with env.begin(db=self._chunks) as txn:
            chunks = int(txn.stat(self._chunks)["entries"])
        with self._stats_lock:
            counts = dict(self._counts)
        return DiskStatistics(chunks=chunks, map_size=self.map_size, **counts)

    def close(self) -> None:
        """Sync and close; idempotent."""
        if self._closed:
            return
        try:
            self._env.sync(True)
            with self._stats_lock:
                self._counts["syncs"] += 1
        finally:
            self._closed = True
            self._env.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"DiskTier({str(self.path)!r}, payload_bytes={self.payload_bytes}, {state})"

