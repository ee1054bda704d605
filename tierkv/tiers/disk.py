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
  straight into ``out``. ``OK`` only for verified bytes of this namespace, rank and key; a
  bad value is deleted, counted and answered ``CORRUPT``. On anything but ``OK`` the
  contents of ``out`` are unspecified.
- ``scan(batch)`` yields ``DiskRecord`` from the small "index" sub-db, read in short txns
  of ``batch`` keys (restart warm without reading payloads).
- ``verify(repair)`` checks every value (and index consistency); ``repair`` deletes bad ones.
- ``claim()`` makes this process the environment's one writer (``exclusive=True`` does it
  at open, before anything is judged or moved): a second claim, from any process, is
  refused with a :class:`ConfigError` naming the holder.
- ``read_only=True`` (operator tools): nothing is created, written, moved or chmod-ed;
  what is not trusted, or damaged, raises :class:`DamagedError`; a corrupt value is
  answered ``CORRUPT`` and left in place; writes raise :class:`UsageError`.
- ``sync()``, ``sync_if_due()``, ``statistics()``, ``close()`` (idempotent; later calls raise
  :class:`ClosedError`; any call from a forked child raises :class:`UsageError`).
- No read transaction outlives a call. Nothing is ever unpickled or evaluated.

What the tier trusts, and what it does about the rest:

- The root must be this user's and writable by no one else (else ``ConfigError``); a
  namespace or rank directory, ``data.mdb`` or ``lock.mdb`` that is not this user's
  regular file/directory (another owner, a link, a FIFO) is moved aside unused, with a
  warning (:mod:`tierkv.tiers.disk_files`).
- Damage (LMDB reports a corrupted or invalid file or page, the meta records do not
  decode, ``data.mdb`` is shorter than its meta page, or shrank under the running tier),
  met at open, scan, read, write or verify, moves ``rank-<r>`` aside to
  ``rank-<r>.broken-<timestamp>`` and starts an empty environment, with a warning; the
  call then runs on the empty environment (a read answers ``MISSING``). This needs the
  claim: a tier opened with ``repair=False``, or one whose environment another process
  owns, raises :class:`DamagedError` instead and changes nothing.
- A map grown by another process (``MDB_MAP_RESIZED``) is adopted; reader slots of dead
  processes are cleared at open, every ``READER_CHECK_SECONDS`` of writing and before a
  full map is reported (a reader killed inside its transaction would pin old pages).
- A namespace mismatch (the meta record names another namespace, rank or format version:
  a directory copied or renamed by hand) raises :class:`NamespaceMismatchError`; other open
  failures raise :class:`BrokenError`.
- Opening a tier tunes glibc malloc once per process (:func:`tune_malloc`, opt out with
  ``disk.tune_malloc=False`` or ``TIERKV_MALLOPT=0``).
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
from typing import Any, TypeVar

import lmdb
import msgpack

from tierkv.config import DiskTierConfig
from tierkv.errors import (BrokenError, ClosedError, ConfigError, DamagedError,
                           NamespaceMismatchError, TierKVError, UsageError, short_key)
from tierkv.keys import FORMAT_VERSION, KEY_BYTES, Namespace
from tierkv.tiers.disk_files import (FILE_MODE, OwnerLock, Trust, check_dir, check_file,
                                     make_private_dir, move_aside, prepare_root,
                                     read_private_file, write_private_file)
from tierkv.tiers.disk_format import (DiskRecord, DiskStatistics, NamespaceInfo, PutResult,
                                     ReadStatus, ValueWriter, VerifyReport, binding_of,
                                     check_value, format_bytes, list_namespaces, map_size_for,
                                     namespace_record, pack_index, tune_malloc, unpack_index)

__all__ = [
    "DiskRecord", "DiskStatistics", "DiskTier", "NamespaceInfo", "PutResult", "ReadStatus",
    "VerifyReport", "list_namespaces", "map_size_for", "tune_malloc",
]

logger = logging.getLogger("tierkv.disk")

MAX_DBS = 4
READER_CHECK_SECONDS = 1.0
_META_NAMESPACE = b"namespace"
_META_NEXT_SEQ = b"next_seq"
_ENV_FILES = ("data.mdb", "lock.mdb")
_T = TypeVar("_T")


class _DamagedError(Exception):
    """The files are not what tierkv writes (meta records, file sizes, file kinds)."""


# LMDB errors that mean the files are damaged (as opposed to permissions, locks, space).
_DAMAGE_ERRORS: tuple[type[Exception], ...] = (
    _DamagedError, lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError,
    lmdb.PageNotFoundError, lmdb.IncompatibleError, lmdb.BadDbiError, lmdb.PanicError,
    lmdb.BadChecksumError)


class _Guard:
    """Shared sections for ordinary calls (``enter``/``leave``: one plain lock each way, the
    read path's cost); an exclusive one (no call in flight) to swap or resize the
    environment underneath them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._shared = 0
        self._exclusive = False

    def enter(self) -> None:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1

    def leave(self) -> None:
        with self._lock:
            self._shared -= 1
            if self._exclusive and not self._shared:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._lock:
                self._exclusive = False
                self._cond.notify_all()


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
        self.repair = repair and not read_only
        self._clock = clock
        self.fingerprint = namespace.fingerprint()
        self.namespace_dir = self.root / f"ns-{self.fingerprint}"
        self.path = self.namespace_dir / f"rank-{rank}"
        self.map_size = map_size_for(config.max_bytes, payload_bytes, os.sysconf("SC_PAGE_SIZE"))
        self._name = f"disk tier (namespace {self.fingerprint[:8]}, rank {rank})"
        self._binding = binding_of(self.fingerprint, rank)
        self._record = namespace_record(self.fingerprint, namespace.describe())
        meta = namespace_record(self.fingerprint, namespace.describe(), rank)
        self._meta_raw: bytes = msgpack.packb(meta)
        self._expected_meta = msgpack.unpackb(msgpack.packb(meta), raw=False)
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("bytes_written", "bytes_read", "puts", "reads", "hits", "misses", "corrupt",
             "full", "syncs", "write_txns", "rebuilds", "stale_readers", "map_adopted"), 0)
        self._unsynced_bytes = 0
        self._last_sync = clock()
        self._last_reader_check = clock()
        self._writer = ValueWriter(payload_bytes, self._binding)
        self._guard = _Guard()
        self._pid = os.getpid()
        self._generation = 0  # bumped whenever the environment underneath is changed
        self._replacements = 0  # times it was moved aside and started empty
        self._last_damage: str | None = None
        self._unclaimable = ""
        self._owner: OwnerLock | None = None
        self._env: lmdb.Environment | None = None
        self._data_fd: int | None = None
        self._data_floor = 0  # data.mdb never shrinks; smaller means truncated under us
        self._size_lock = threading.Lock()
        self._closed = False
        if config.tune_malloc:
            tune_malloc(config.write_batch_bytes)
        if exclusive and read_only:
            raise ConfigError(f"{self._name}: a read-only tier cannot claim its environment")
        try:
            if read_only:
                self._check_existing()
            else:
                prepare_root(self.root)
                self._prepare_dir(self.namespace_dir)
                self._write_namespace_json()
                self._prepare_dir(self.path)
                if exclusive:
                    self.claim()
            self._open()
        except BaseException:
            self._closed = True
            self._release()
            raise

    # -- opening -------------------------------------------------------------------------

    def _check_existing(self) -> None:
        """Read-only: the environment must exist and be trusted; nothing is changed."""
        if not self.root.is_dir():
            raise ConfigError(f"{self._name}: no store directory at {self.root} (disk.path)")
        for path in (self.namespace_dir, self.path):
            trust = check_dir(path, fix=False)
            if trust is Trust.MISSING:
                raise BrokenError(f"{self._name}: no environment at {self.path}")
            if trust is Trust.FOREIGN:
                raise DamagedError(f"{self._name}: {path} is not a directory that only this "
                                   f"user can write; not read")

    def _prepare_dir(self, path: Path) -> None:
        """Create ``path`` private, or move aside what is there if it is not this user's."""
        if check_dir(path) is Trust.FOREIGN:
            aside = self._move(path, "foreign")
            logger.warning("%s: %s was not this user's private directory; moved it to %s and "
                           "started afresh", self._name, path, aside)
        make_private_dir(path)

    def _move(self, path: Path, why: str) -> Path:
        try:
            return move_aside(path, why)
        except OSError as exc:
            raise BrokenError(f"{self._name}: cannot move {path} aside ({why}): {exc} "
                              f"(remove it by hand)") from exc

    def _write_namespace_json(self) -> None:
        path = self.namespace_dir / "namespace.json"
        text = (json.dumps(self._record, indent=2, sort_keys=True) + "\n").encode()
        try:
            if check_file(path) is Trust.OK and read_private_file(path, len(text)) == text:
                return
            write_private_file(path, text)
        except OSError as exc:
            raise BrokenError(f"{self._name}: cannot write {path}: {exc} "
                              f"(check disk.path)") from exc

    def claim(self) -> None:
        """Make this process the one writer of the environment (idempotent)."""
        if self.read_only:
            raise UsageError(f"{self._name}: opened read-only; it cannot claim {self.path}")
        if self._owner is None:
            self._owner = OwnerLock(self.path, self._name)

    @property
    def claimed(self) -> bool:
        return self._owner is not None

    def _open(self) -> None:
        try:
            self._open_once()
            return
        except NamespaceMismatchError:
            raise
        except _DAMAGE_ERRORS as exc:
            if not self._may_repair(exc):
                raise DamagedError(f"{self._name}: environment at {self.path} is damaged "
                                   f"({exc}); not repaired here: {self._why_not_repaired()}"
                                   ) from exc
            self._replace_env(exc)
            return
        except OSError as exc:
            raise BrokenError(f"{self._name}: cannot open {self.path}: {exc} "
                              f"(check disk.path)") from exc
        except lmdb.Error as exc:
            if "already open in this process" in str(exc):
                raise UsageError(f"{self._name}: {self.path} is already open in this process; "
                                 f"open each environment once per process and share that "
                                 f"DiskTier (or close the other one first)") from exc
            raise BrokenError(f"{self._name}: cannot open {self.path}: {exc} "
                              f"(check disk.path permissions and free space)") from exc

    def _open_once(self) -> None:
        """Open the environment at ``self.path``; raises damage as damage."""
        writable = not self.read_only
        if writable:
            make_private_dir(self.path)
        for name in _ENV_FILES:
            if check_file(self.path / name, fix=writable) is Trust.FOREIGN:
                raise _DamagedError(f"{name} is not a regular file that only this user can write")
        fresh = not (self.path / "data.mdb").exists()
        if fresh and not writable:
            raise BrokenError(f"{self._name}: no environment at {self.path} (no data.mdb)")
        always = self.config.sync_mode == "always"
        env = lmdb.open(
            str(self.path), map_size=self.map_size, subdir=True, sync=always, metasync=always,
            map_async=False, mode=FILE_MODE, readahead=True, writemap=False, meminit=True,
            max_dbs=MAX_DBS, lock=True, readonly=not writable,
        )
        data_fd: int | None = None
        try:
            data_fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            floor = self._check_file_size(env, data_fd)
            cleared = env.reader_check()
            meta, chunks, index = (self._open_db(env, name) for name in (b"meta", b"chunks", b"index"))
            self._check_meta(env, meta, chunks)
        except BaseException:
            if data_fd is not None:
                os.close(data_fd)
            env.close()
            raise
        for name in _ENV_FILES:
            check_file(self.path / name, fix=writable)  # created by LMDB: clears read bits
        self._env, self._chunks, self._index, self._meta = env, chunks, index, meta
        self._data_fd, self._data_floor = data_fd, floor
        self._count(stale_readers=cleared)
        if cleared:
            logger.warning("%s: cleared %d reader slot(s) of dead processes", self._name, cleared)
        if fresh:
            self._warn_old_formats()

    def _open_db(self, env: lmdb.Environment, name: bytes) -> Any:
        if not self.read_only:
            return env.open_db(name)
        try:
            return env.open_db(name, create=False)
        except lmdb.NotFoundError as exc:
            raise _DamagedError(f"sub-db {name.decode()} missing") from exc

    @staticmethod
    def _check_file_size(env: lmdb.Environment, data_fd: int) -> int:
        """Damage: a data file shorter than its meta page says would SIGBUS past its end."""
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        actual = os.fstat(data_fd).st_size
        if actual < needed:
            raise _DamagedError(f"data.mdb has {actual} bytes, its meta page needs {needed}")
        return actual

    def _check_meta(self, env: lmdb.Environment, meta: Any, chunks: Any) -> None:
        with env.begin(write=not self.read_only) as txn:
            raw = txn.get(_META_NAMESPACE, db=meta)
            if raw is None:
                if txn.stat(chunks)["entries"]:
                    raise _DamagedError("chunks present but no namespace record")
                if not self.read_only:
                    txn.put(_META_NAMESPACE, self._meta_raw, db=meta)
                    txn.put(_META_NEXT_SEQ, (1).to_bytes(8, "little"), db=meta)
                return
            try:
                stored = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0)
            except Exception as exc:
                raise _DamagedError(f"namespace record does not decode: {exc}") from exc
            if not isinstance(stored, dict) or "namespace" not in stored:
                raise _DamagedError("namespace record has the wrong shape")
            if stored != self._expected_meta:
                what = (f"format version {stored.get('format_version')!r}, namespace "
                        f"{stored.get('fingerprint')!r}, rank {stored.get('rank', '?')!r}")
                raise NamespaceMismatchError(
                    f"{self._name}: {self.path} holds {what}; expected format version "
                    f"{FORMAT_VERSION}, namespace {self.fingerprint}, rank {self.rank} "
                    f"({self.namespace.describe()}). The directory was copied or renamed, or "
                    f"written by another tierkv version; nothing was read from it. Point "
                    f"disk.path elsewhere or move that directory away")
            seq_raw = txn.get(_META_NEXT_SEQ, db=meta)
            if seq_raw is None or len(seq_raw) != 8:
                raise _DamagedError("next_seq record missing or malformed")

    def _warn_old_formats(self) -> None:
        old = [info for info in list_namespaces(self.root) if info.format_version != FORMAT_VERSION]
        if old:
            logger.warning(
                "%s: %s holds %d namespace(s) of another tierkv format (%s); this tierkv "
                "(format %d) never reads them and starts this namespace empty. Delete them when "
                "no older tierkv uses them (tierkv inspect %s lists them)", self._name, self.root,
                len(old), ", ".join(f"{info.path.name} v{info.format_version}" for info in old),
                FORMAT_VERSION, self.root)

    # -- damage, resizes, stale readers -----------------------------------------------------

    def _may_repair(self, exc: BaseException) -> bool:
        """Whether damage may be repaired here: it needs ``repair`` and the claim (taken now
        if no other process holds it)."""
        if not self.repair:  # also false when read-only
            return False
        if self._owner is None:
            try:
                self.claim()
            except ConfigError as err:
                self._unclaimable = str(err)
                return False
        return True

    def _why_not_repaired(self) -> str:
        if self.read_only:
            return "opened read-only (run tierkv verify --repair)"
        if not self.repair:
            return "opened with repair=False (run tierkv verify --repair)"
        return self._unclaimable or "another process owns it"

    def _close_env(self) -> None:
        env, self._env = self._env, None
        fd, self._data_fd = self._data_fd, None
        if fd is not None:
            os.close(fd)
        if env is not None:
            env.close()

    def _replace_env(self, exc: BaseException) -> None:
        """Move the damaged environment aside and open an empty one (the claim held)."""
        self._close_env()
        if isinstance(exc, lmdb.PanicError):  # a fatal write error: the files may be fine
            try:
                self._open_once()
                self._generation += 1
                logger.warning("%s: LMDB panicked (%s); reopened %s", self._name, exc, self.path)
                return
            except _DAMAGE_ERRORS as again:
                exc = again
            except (lmdb.Error, OSError, TierKVError) as err:
                raise BrokenError(f"{self._name}: cannot reopen {self.path} after an LMDB "
                                  f"panic ({exc}): {err}") from err
        old_owner = self._owner
        aside = self._move(self.path, "broken")
        self._owner = None
        try:
            make_private_dir(self.path)
            self.claim()
            self._open_once()
        except (lmdb.Error, _DamagedError, OSError, TierKVError) as err:
            raise BrokenError(f"{self._name}: cannot rebuild {self.path}: {err}") from err
        finally:
            if old_owner is not None:
                old_owner.release()
        self._generation += 1
        self._replacements += 1
        self._last_damage = str(exc)
        self._count(rebuilds=1)
        logger.warning("%s: environment at %s is damaged (%s); moved it to %s and started "
                       "empty", self._name, self.path, exc, aside)

    def _fix(self, problem: BaseException, generation: int, action: str) -> None:
        """Deal with what stopped a call, outside its shared section; the call is retried."""
        with self._guard.exclusive():
            if self._closed:
                raise ClosedError(f"{self._name}: closed while {action}")
            if self._env is None:
                raise BrokenError(f"{self._name}: no environment ({action}): it could not be "
                                  f"rebuilt after damage; restart the store")
            if self._generation != generation:
                return  # another thread replaced or resized the environment meanwhile
            if isinstance(problem, lmdb.MapResizedError):
                self._env.set_mapsize(0)  # adopt the size another process grew the map to
                self.map_size = int(self._env.info()["map_size"])
                self._generation += 1
                self._count(map_adopted=1)
                logger.info("%s: adopted a map grown by another process (%s)", self._name,
                            format_bytes(self.map_size))
            elif isinstance(problem, lmdb.ReadersFullError):
                self._clear_stale_readers(self._env)
                self._generation += 1
            elif not self._may_repair(problem):
                raise DamagedError(f"{self._name}: environment at {self.path} is damaged "
                                   f"({problem}) while {action}; not repaired here: "
                                   f"{self._why_not_repaired()}") from problem
            else:
                self._replace_env(problem)

    def _clear_stale_readers(self, env: lmdb.Environment) -> int:
        self._last_reader_check = self._clock()
        cleared = int(env.reader_check())
        if cleared:
            self._count(stale_readers=cleared)
            logger.warning("%s: cleared %d reader slot(s) of dead processes (they pinned old "
                           "pages)", self._name, cleared)
        return cleared

    # -- running calls -----------------------------------------------------------------------

    def _check_usable(self, action: str) -> None:
        if os.getpid() != self._pid:
            raise UsageError(f"{self._name}: {action} in a forked child (pid {os.getpid()}) of "
                             f"the process that opened it (pid {self._pid}); LMDB environments "
                             f"do not survive fork(): open the tier in the child")
        if self._closed:
            raise ClosedError(f"{self._name}: used after close(); open a new DiskTier")

    def _check_data_file(self) -> None:
        """The file only grows (LMDB never shrinks it); read and compare under one lock, or
        a size read before another thread's commit grew the file would look like a shrink."""
        assert self._data_fd is not None
        with self._size_lock:
            size = os.lseek(self._data_fd, 0, os.SEEK_END)  # 0.2 us; fstat costs 0.8
            if size < self._data_floor:
                raise _DamagedError(f"data.mdb shrank from {self._data_floor} to {size} bytes "
                                    f"under the running tier (truncated)")
            self._data_floor = size

    def _run(self, action: str, work: Callable[[lmdb.Environment], _T]) -> _T:
        """``work(env)`` in a shared section; damage, a grown map or a full reader table are
        dealt with and the call retried (at most twice)."""
        guard = self._guard
        for _ in range(3):
            if self._closed or os.getpid() != self._pid:
                self._check_usable(action)
            guard.enter()
            try:
                env, generation = self._env, self._generation
                if env is None:
                    if self._closed:
                        raise ClosedError(f"{self._name}: closed while {action}")
                    raise BrokenError(f"{self._name}: no environment ({action}): it could not "
                                      f"be rebuilt after damage; restart the store")
                try:
                    self._check_data_file()
                    return work(env)
                except (lmdb.MapResizedError, lmdb.ReadersFullError) as exc:
                    problem: BaseException = exc
                except _DAMAGE_ERRORS as exc:
                    problem = exc
                except lmdb.Error as exc:
                    raise self._failure(action, exc) from exc
            finally:
                guard.leave()
            self._fix(problem, generation, action)
        raise BrokenError(f"{self._name}: {action} kept failing after repairs ({problem})")

    def _failure(self, action: str, exc: BaseException) -> Exception:
        if self._closed:
            return ClosedError(f"{self._name}: closed while {action}")
        return BrokenError(f"{self._name}: LMDB failed {action} at {self.path}: {exc}")

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
        written, full, deleted, no_space = self._run(
            "writing chunks", lambda env: self._put(env, views, tuple(deletes)))
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
                if not self._out_of_space(exc, self._txn_bytes(len(pending))):
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
                if self._clear_stale_readers(env):
                    continue
            full[:0] = [key for key, _ in pending[failed_at:]]
            pending = pending[:failed_at]
        deleted = (deleted if failed_at is None else 0) + settled
        return tuple(key for key, _ in pending), tuple(full), deleted, no_space

    def _txn_bytes(self, num_items: int) -> int:
        """Bytes a txn of ``num_items`` values writes, at least (for the out-of-space check)."""
        return max(num_items, 1) * (self.payload_bytes + 4096)

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
                deleted += bool(txn.delete(key, db=self._chunks))
                txn.delete(key, db=self._index)
            if items:
                seq_raw = txn.get(_META_NEXT_SEQ, db=self._meta)
                if seq_raw is None or len(seq_raw) != 8:
                    raise _DamagedError("next_seq record missing or malformed")
                seq = int.from_bytes(seq_raw, "little")
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
        return None, deleted

    def _settle_deletes(self, env: lmdb.Environment, deletes: Sequence[bytes]) -> int:
        """Commit ``deletes`` alone, then one small txn, so the next txn can reuse their pages."""
        deleted = self._delete_txn(env, deletes)
        try:
            with env.begin(write=True) as txn:
                seq_raw = txn.get(_META_NEXT_SEQ, db=self._meta)
                if seq_raw is not None:
                    txn.put(_META_NEXT_SEQ, seq_raw, db=self._meta)
        except lmdb.MapFullError:
            pass  # the retry reports its keys as full
        except lmdb.Error as exc:
            if not self._out_of_space(exc, self._txn_bytes(0)):
                raise
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
            self._check_usable("deleting chunks")
            return 0
        return self._run("deleting chunks", lambda env: self._delete_txn(env, keys))

    def _after_commit(self, num_bytes: int) -> None:
        with self._stats_lock:
            self._unsynced_bytes += num_bytes
        if self._clock() - self._last_reader_check >= READER_CHECK_SECONDS:
            self._run("checking readers", self._clear_stale_readers)
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
        """fsync everything committed so far (the durability point); nothing to do read-only."""
        if self.read_only:
            self._check_usable("syncing")
            return
        self._run("syncing", lambda env: env.sync(True))
        with self._stats_lock:
            self._counts["syncs"] += 1
            self._unsynced_bytes = 0
        self._last_sync = self._clock()

    # -- reads -----------------------------------------------------------------------------

    def read_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """Copy the verified payload of ``key`` into ``out[:payload_bytes]``."""
        self._check_key(key)
        out = self._bytes_of(out, f"the read buffer for chunk {short_key(key)}", writable=True)

        def read(env: lmdb.Environment) -> tuple[bool, str | None]:
            with env.begin(db=self._chunks, buffers=True) as txn:
                value = txn.get(key)
                found = value is not None
                problem = check_value(self._binding, key, value, self.payload_bytes,
                                      out) if found else None
                del value  # LMDB's buffer is valid only inside the txn
            return found, problem

        found, problem = self._run(f"reading chunk {short_key(key)}", read)
        if not found:
            self._count(reads=1, misses=1)
            return ReadStatus.MISSING
        if problem is None:
            self._count(reads=1, hits=1, bytes_read=self.payload_bytes)
            return ReadStatus.OK
        self._count(reads=1, misses=1, corrupt=1)
        if self.read_only:
            logger.warning("%s: corrupt chunk %s (%s)", self._name, short_key(key), problem)
        else:
            logger.warning("%s: corrupt chunk %s (%s); deleted it", self._name, short_key(key),
                           problem)
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

    def scan(self, batch: int = 1024) -> Iterator[DiskRecord]:
        """Every stored chunk as (key, payload_len, seq), from the index; no payload is read.

        The index is read whole (one short txn per ``batch`` keys) before the first record
        is yielded, so damage met anywhere in it (the environment is then rebuilt empty)
        never leaves a caller holding records of an environment that is gone."""
        self._check_batch(batch)
        records: list[DiskRecord] = []
        last: bytes | None = None
        replaced = self._replacements

        def rows_of(env: lmdb.Environment) -> list[tuple[bytes, bytes]]:
            with env.begin(db=self._index) as txn:
                return self._rows_after(txn, self._index, last, batch, True)

        while True:
            rows = self._run("scanning", rows_of)
            if self._replacements != replaced:  # rebuilt meanwhile: start over, on empty
                records, replaced = [], self._replacements
                if last is not None:
                    last = None
                    continue
            for key, raw in rows:
                parsed = unpack_index(raw)
                if parsed is not None:
                    records.append(DiskRecord(key, parsed[0], parsed[1]))
            if len(rows) < batch:
                break
            last = rows[-1][0]
        yield from records

    def verify(self, repair: bool = False, batch: int = 64) -> VerifyReport:
        """Check every value's header and checksum and the index; ``repair`` deletes bad keys.

        Each batch is listed and checked inside one short read txn (one snapshot), so a
        chunk that another thread or process deletes meanwhile is simply not seen, never
        reported bad. Damage of the environment itself is reported in ``damaged``: with
        the tier's ``repair`` the environment was rebuilt empty (``rebuilt``); without it,
        :class:`DamagedError` says why not."""
        self._check_batch(batch)
        if repair:
            self._check_writable("repairing")
        bad: dict[bytes, None] = {}
        checked = 0
        scratch = memoryview(bytearray(self.payload_bytes))
        replaced = self._replacements

        def values_after(env: lmdb.Environment, last: bytes | None) -> tuple[list[bytes], list[bytes]]:
            found: list[bytes] = []
            with env.begin(buffers=True) as txn:
                keys = [key for key, _ in self._rows_after(txn, self._chunks, last, batch, False)]
                for key in keys:
                    value = txn.get(key, db=self._chunks)
                    entry = txn.get(key, db=self._index)
                    problem = "vanished" if value is None else check_value(
                        self._binding, key, value, self.payload_bytes, scratch)
                    if problem is None and unpack_index(bytes(entry or b"")) is None:
                        problem = "index entry missing or malformed"
                    if problem is not None:
                        found.append(key)
                    del value, entry
            return keys, found

        def orphans_after(env: lmdb.Environment, last: bytes | None) -> tuple[list[bytes], list[bytes]]:
            with env.begin(buffers=True) as txn:  # index entries without values
                keys = [key for key, _ in self._rows_after(txn, self._index, last, batch, False)]
                return keys, [key for key in keys if txn.get(key, db=self._chunks) is None]

        for step in (values_after, orphans_after):
            last: bytes | None = None
            while self._replacements == replaced:
                keys, found = self._run("verifying", lambda env: step(env, last))
                if self._replacements != replaced:
                    break  # rebuilt empty meanwhile: nothing of the old environment is left
                checked += len(keys) if step is values_after else 0
                bad.update((key, None) for key in found)
                if len(keys) < batch:
                    break
                last = keys[-1]
        rebuilt = self._replacements != replaced
        if rebuilt:
            bad.clear()
        repaired = 0
        if repair and bad:
            self.delete_many(list(bad))
            repaired = len(bad)
        return VerifyReport(checked, tuple(bad), repaired,
                            damaged=self._last_damage if rebuilt else None, rebuilt=rebuilt)

    # -- life cycle ------------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        def count(env: lmdb.Environment) -> int:
            with env.begin() as txn:
                return int(txn.stat(self._chunks)["entries"])

        chunks = self._run("counting chunks", count)
        with self._stats_lock:
            counts = dict(self._counts)
        return DiskStatistics(chunks=chunks, map_size=self.map_size, **counts)

    def _release(self) -> None:
        try:
            self._close_env()
        finally:
            owner, self._owner = self._owner, None
            if owner is not None:
                owner.release()

    def close(self) -> None:
        """Sync and close; idempotent."""
        if self._closed:
            return
        self._check_usable("closing")
        with self._guard.exclusive():
            try:
                if self._env is not None and not self.read_only:
                    self._env.sync(True)
                    self._count(syncs=1)
            except lmdb.Error as exc:  # committed data survives a crash; only the fsync failed
                logger.warning("%s: sync at close failed (%s); what was written since the last "
                               "sync may not survive a power loss", self._name, exc)
            finally:
                self._closed = True
                self._release()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"DiskTier({str(self.path)!r}, payload_bytes={self.payload_bytes}, {state})"
