"""The disk tier: chunk payloads in one LMDB environment per namespace and rank.

Layout (``docs/on-disk-format.md`` has every byte)::

    root/ns-<fingerprint>/namespace.json      what the namespace is, for operators
    root/ns-<fingerprint>/rank-<r>/data.mdb   LMDB, sub-dbs "meta", "chunks", "index"

Primitives and contracts (one :class:`DiskTier` holds bytes and starts no threads; it may be
called from several threads: LMDB serializes write transactions, reads run concurrently):

- ``put_many(items, deletes=())`` one write txn: deletes, then puts. Values are copied into
  LMDB before it returns, so slots may be reused. A full map or a full filesystem (ENOSPC,
  EDQUOT, or EIO from a short write with the filesystem out of space) is a value
  (``PutResult.full``), never an exception; the disk cap is soft here (the scheduler side
  accounts for it).
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
- Opening a tier tunes glibc malloc once per process (:func:`tune_malloc`, opt out with
  ``disk.tune_malloc=False`` or ``TIERKV_MALLOPT=0``) so LMDB's per-put page buffers are not faulted in afresh.
- An environment that is damaged (fails to open or fails its meta check) is moved aside to
  ``rank-<r>.broken-<timestamp>`` and rebuilt empty with a logged warning. A namespace
  mismatch raises :class:`NamespaceMismatchError`; other open failures raise
  :class:`BrokenError`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
                                     make_private_dir, map_size_for, move_aside, namespace_record,
                                     pack_index, tune_malloc, unpack_index,
                                     write_private_file)

__all__ = [
    "DiskRecord", "DiskStatistics", "DiskTier", "NamespaceInfo", "PutResult", "ReadStatus",
    "VerifyReport", "list_namespaces", "map_size_for", "tune_malloc",
]

logger = logging.getLogger("tierkv.disk")

MAX_DBS = 4
_META_NAMESPACE = b"namespace"
_META_NEXT_SEQ = b"next_seq"


class _DamagedError(Exception):
    """The meta sub-db does not hold what tierkv writes there."""


# Errors that mean the files are damaged (as opposed to permissions, locks, disk space).
_DAMAGE_ERRORS: tuple[type[Exception], ...] = (
    _DamagedError, lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError,
    lmdb.PageNotFoundError, lmdb.IncompatibleError, lmdb.BadDbiError, lmdb.PanicError,
    lmdb.BadChecksumError)


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
        self.map_size = map_size_for(config.max_bytes, payload_bytes, os.sysconf("SC_PAGE_SIZE"))
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
        if config.tune_malloc:
            tune_malloc(config.write_batch_bytes)
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
            raise BrokenError(f"{self._name}: cannot write {path}: {exc} "
                              f"(check disk.path)") from exc

    def _open(self) -> tuple[lmdb.Environment, Any, Any, Any, int]:
        try:
            return self._open_once()
        except NamespaceMismatchError:
            raise
        except _DAMAGE_ERRORS as exc:
            try:
                aside = move_aside(self.path)
            except OSError as err:
                raise BrokenError(f"{self._name}: {self.path} is damaged ({exc}) and cannot be "
                                  f"moved aside: {err} (remove it by hand)") from err
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
            self._check_file_size(env)
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

    def _check_file_size(self, env: lmdb.Environment) -> None:
        """Damage: a data file shorter than its meta page says would SIGBUS past its end."""
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        actual = (self.path / "data.mdb").stat().st_size
        if actual < needed:
            raise _DamagedError(f"data.mdb has {actual} bytes, its meta page needs {needed}")

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

    # -- helpers ---------------------------------------------------------------------------

    def _live_env(self) -> lmdb.Environment:
        if self._closed:
            raise ClosedError(f"{self._name}: used after close(); open a new DiskTier")
        return self._env

    def _failure(self, action: str, exc: BaseException) -> Exception:
        if self._closed:
            return ClosedError(f"{self._name}: closed while {action}")
        return BrokenError(f"{self._name}: LMDB failed {action} at {self.path}: {exc}")

    @contextmanager
    def _reading(self, action: str, **begin: Any) -> Iterator[Any]:
        """A short read txn; LMDB errors become Broken/ClosedError naming ``action``."""
        env = self._live_env()
        try:
            with env.begin(**begin) as txn:
                yield txn
        except lmdb.Error as exc:
            raise self._failure(action, exc) from exc

    def _out_of_space(self, exc: lmdb.Error, needed_bytes: int) -> bool:
        """Whether a failed write means the filesystem is full (a value, like a full map).

        LMDB reports ENOSPC (``lmdb.DiskError``) or EDQUOT, or EIO when a write came back
        short, which on a full filesystem is what ENOSPC looks like. EIO counts as full only
        when the filesystem has less than ``needed_bytes`` free; otherwise it is a real I/O
        error."""
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
        return fs.f_bavail * fs.f_frsize < needed_bytes

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ConfigError(f"{self._name}: a chunk key must be {KEY_BYTES} bytes, "
                              f"got {key!r:.40}")

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
        deletes, settled, deleted, failed_at = tuple(deletes), 0, 0, None
        no_space = False  # the filesystem (not the map) is full
        while pending or deletes:
            try:
                failed_at, deleted = self._write_txn(env, pending, deletes)
            except lmdb.MapFullError:  # raised by commit: retry without the last item
                failed_at, deleted = len(pending) - 1, 0
            except lmdb.Error as exc:
                if not self._out_of_space(exc, self._txn_bytes(len(pending))):
                    raise self._failure("writing chunks", exc) from exc
                # nothing of this txn landed; after deletes settle, retry once, then give up
                failed_at, deleted, no_space = 0, 0, True
            if failed_at is None:
                break
            if deletes:  # LMDB reuses pages freed by txn T from txn T+2 on
                settled, deletes = self._settle_deletes(env, deletes), ()
                continue
            full[:0] = [key for key, _ in pending[failed_at:]]
            pending = pending[:failed_at]
        deleted = (deleted if failed_at is None else 0) + settled
        written = tuple(key for key, _ in pending)
        num_bytes = len(written) * self.payload_bytes
        self._count(bytes_written=num_bytes, puts=len(written), full=len(full), write_txns=1)
        message = None
        if full and no_space:
            message = (f"{self._name}: filesystem full writing chunk {short_key(full[0])} "
                       f"({len(full)} chunk(s) not written; free space under {self.root} or "
                       f"lower disk.max_bytes, now {format_bytes(self.config.max_bytes)})")
            logger.warning("%s", message)
        elif full:
            message = (f"{self._name}: map full writing chunk {short_key(full[0])} "
                       f"({len(full)} chunk(s) not written; raise disk.max_bytes, now "
                       f"{format_bytes(self.config.max_bytes)})")
            logger.warning("%s", message)
        self._after_commit(num_bytes)
        return PutResult(written, tuple(full), deleted, num_bytes, message)

    def _txn_bytes(self, num_items: int) -> int:
        """Bytes a txn of ``num_items`` values writes, at least (for the out-of-space check)."""
        return max(num_items, 1) * (self.payload_bytes + 4096)

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
            if items:
                txn.put(_META_NEXT_SEQ, seq.to_bytes(8, "little"), db=self._meta)
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        self._next_seq = seq
        return None, deleted

    def _settle_deletes(self, env: lmdb.Environment, deletes: Sequence[bytes]) -> int:
        """Commit ``deletes`` alone, then one small txn, so the next txn can reuse their pages."""
        deleted = self._delete_txn(env, deletes)
        try:
            with env.begin(write=True) as txn:
                txn.put(_META_NEXT_SEQ, self._next_seq.to_bytes(8, "little"), db=self._meta)
        except lmdb.MapFullError:
            pass  # the retry reports its keys as full
        except lmdb.Error as exc:
            if not self._out_of_space(exc, self._txn_bytes(0)):
                raise self._failure("writing chunks", exc) from exc
        return deleted

    def _delete_txn(self, env: lmdb.Environment, keys: Sequence[bytes]) -> int:
        try:
            with env.begin(write=True) as txn:
                deleted = 0
                for key in keys:
                    deleted += bool(txn.delete(key, db=self._chunks))
                    txn.delete(key, db=self._index)
            return deleted
        except lmdb.MapFullError:  # copy-on-write needs a few pages even to delete
            logger.warning("%s: map full even for %d delete(s); raise disk.max_bytes, now %s",
                           self._name, len(keys), format_bytes(self.config.max_bytes))
            return 0
        except lmdb.Error as exc:
            if not self._out_of_space(exc, self._txn_bytes(0)):
                raise self._failure("deleting chunks", exc) from exc
            logger.warning("%s: filesystem full even for %d delete(s); free space under %s",
                           self._name, len(keys), self.root)
            return 0

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (absent ones are ignored) in one write txn; returns how many existed."""
        env = self._live_env()
        for key in keys:
            self._check_key(key)
        return self._delete_txn(env, keys) if keys else 0

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
        self._check_key(key)
        if len(out) < self.payload_bytes or out.readonly:
            raise ConfigError(f"{self._name}: read buffer for chunk {short_key(key)} must be "
                              f"writable and hold {self.payload_bytes} bytes, got {len(out)}")
        with self._reading(f"reading chunk {short_key(key)}", db=self._chunks,
                           buffers=True) as txn:
            value = txn.get(key)
            found = value is not None
            problem = check_value(key, value, self.payload_bytes, out) if found else None
            del value  # LMDB's buffer is valid only inside the txn
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

    @staticmethod
    def _rows_after(txn: Any, db: Any, last: bytes | None, batch: int,
                    values: bool) -> list[tuple[bytes, bytes]]:
        """Up to ``batch`` (key, value or b"") rows of ``db`` after key ``last``, in ``txn``."""
        rows: list[tuple[bytes, bytes]] = []
        cursor = txn.cursor(db=db)
        more = cursor.set_range(last) if last is not None else cursor.first()
        if more and last is not None and bytes(cursor.key()) == last:
            more = cursor.next()
        while more and len(rows) < batch:
            rows.append((bytes(cursor.key()), bytes(cursor.value()) if values else b""))
            more = cursor.next()
        return rows

    def _batches(self, db: Any, batch: int, values: bool) -> Iterator[list[tuple[bytes, bytes]]]:
        """Key order batches, one short read txn each (resumes after the last key)."""
        last: bytes | None = None
        while True:
            with self._reading("scanning", db=db) as txn:
                rows = self._rows_after(txn, db, last, batch, values)
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
        """Check every value's header and checksum and the index; ``repair`` deletes bad keys.

        Each batch is listed and checked inside one short read txn (one snapshot), so a
        chunk that another thread or process deletes meanwhile is simply not seen, never
        reported bad."""
        if batch <= 0:
            raise ConfigError(f"{self._name}: verify batch must be > 0, got {batch}")
        bad: dict[bytes, None] = {}
        checked = 0
        scratch = memoryview(bytearray(self.payload_bytes))
        last: bytes | None = None
        while True:
            with self._reading("verifying", buffers=True) as txn:
                rows = self._rows_after(txn, self._chunks, last, batch, values=False)
                for key, _ in rows:
                    checked += 1
                    value = txn.get(key, db=self._chunks)
                    entry = txn.get(key, db=self._index)
                    problem = "vanished" if value is None else check_value(
                        key, value, self.payload_bytes, scratch)
                    if problem is None and unpack_index(bytes(entry or b"")) is None:
                        problem = "index entry missing or malformed"
                    if problem is not None:
                        bad[key] = None
                    del value, entry
            if len(rows) < batch:
                break
            last = rows[-1][0]
        last = None
        while True:  # index entries without values
            with self._reading("verifying", buffers=True) as txn:
                rows = self._rows_after(txn, self._index, last, 1024, values=False)
                bad.update((key, None) for key, _ in rows
                           if txn.get(key, db=self._chunks) is None)
            if len(rows) < 1024:
                break
            last = rows[-1][0]
        repaired = 0
        if repair and bad:
            self.delete_many(list(bad))
            repaired = len(bad)
        return VerifyReport(checked, tuple(bad), repaired)

    # -- life cycle ------------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        with self._reading("counting chunks") as txn:
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
            self._count(syncs=1)
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

