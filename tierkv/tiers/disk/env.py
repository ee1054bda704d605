"""One LMDB environment of the disk tier, kept trustworthy and usable under its calls.

:class:`LmdbEnv` owns ``root/ns-<fingerprint>/part-<p>of<P>/shard-<s>``: one LMDB environment
(the index: sub-dbs ``meta`` and ``index``), the shard's slab file of payloads
(:class:`~tierkv.tiers.disk.slab.SlabFile`, ``slab``), the writer claim and the checks
around them. A part's chunks are spread
over :data:`SHARDS` such environments by :func:`shard_of` (each has its own writer lock, so
their commits run in parallel). :class:`~tierkv.tiers.disk.tier.DiskTier` does its reads and
writes through :meth:`LmdbEnv.run`.

Primitives and contracts:

- Opening trusts only this user's private files (:mod:`tierkv.tiers.disk.files`; an
  untrusted root is a ``ConfigError``): an untrusted namespace, part or shard directory is moved
  aside (``.foreign-<time>``) and made anew; ``namespace.json`` is rewritten when it is
  not exactly this namespace's. ``read_only=True`` creates, writes, moves and chmods nothing.
- The meta record (namespace, fingerprint, part, shard, format version) must match: another
  environment is never read nor deleted, but moved aside (``.foreign-<time>``) and an
  empty one opened when this handle may repair (below); else :class:`MisplacedError` (a
  :class:`NamespaceMismatchError` and a :class:`DamagedError`: skipped as damage is).
- ``run(action, work)`` calls ``work(env)`` in a shared section of a readers/writer guard
  (:class:`~tierkv.tiers.disk.guard.Guard`: one plain lock on entry and on exit). Before
  it, a fork check (:class:`UsageError` in a child), a closed check (:class:`ClosedError`)
  and a size check of ``data.mdb`` (it never shrinks; smaller means truncated under us,
  which would SIGBUS). What stops ``work`` is dealt with in the exclusive section and the
  call retried (at most twice): ``MDB_MAP_RESIZED`` adopts the map another process grew;
  a full reader table clears stale readers; **damage** (:data:`DAMAGE_ERRORS`: what LMDB
  reports as corrupt, a panic, or what tierkv finds, :class:`FilesDamaged`) moves the
  environment aside (``.broken-<time>``, the slab file with it) and opens an empty one,
  the retried call running on it. Repair needs ``repair`` and the claim (taken then if no
  other process holds it); otherwise :class:`DamagedError`, nothing changed. Other LMDB
  errors are :class:`BrokenError`.
- ``claim()`` makes this process the environment's one writer (an ``flock``); refused with
  :class:`ConfigError` naming the holder.
- ``clear_stale_readers(env)`` frees reader slots of dead processes (also at open, and
  every :data:`READER_CHECK_SECONDS` through ``readers_due()``).
- ``replacements`` counts environments moved aside and started empty (a caller holding
  keys of the old one checks it); ``counts()`` the repairs; ``close(sync)``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import msgpack

from tierkv.errors import (BrokenError, ClosedError, ConfigError, DamagedError,
                           MisplacedError, NamespaceMismatchError, TierKVError, UsageError,
                           short_key)
from tierkv.core.figures import Record, counter, gauge
from tierkv.keys import FORMAT_VERSION, Namespace, Part
from tierkv.tiers.disk.files import (FILE_MODE, OwnerLock, Trust, check_dir, check_file,
                                     list_namespaces, make_private_dir, move_aside,
                                     namespace_record, prepare_root,
                                     read_private_file, write_private_file)
from tierkv.tiers.disk.guard import Guard
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.readahead import random_access
from tierkv.tiers.disk.slab import SLAB_NAME, SlabFile
from tierkv.units import format_bytes

logger = logging.getLogger("tierkv.disk")

MAX_DBS = 4
READER_CHECK_SECONDS = 1.0
META_NAMESPACE = b"namespace"
META_NEXT_SEQ = b"next_seq"
_ENV_FILES = ("data.mdb", "lock.mdb")
SHARDS = 4  # environments per part: a format constant (docs/on-disk-format.md)


def shard_of(key: bytes) -> int:
    """The shard of a chunk key (keys are hashes: their first byte is uniform)."""
    return key[0] % SHARDS


_T = TypeVar("_T")


def _action(action: str, key: bytes | None) -> str:
    return action if key is None else f"{action} {short_key(key)}"


@dataclass(eq=False, kw_only=True)
class DiskStatistics(Record):
    """The disk tier's record, declared here because its environments count on it too
    (each :class:`LmdbEnv` on its own: :data:`ENV_FIGURES`, which the tier sums over its
    shards). The tier's ``statistics()`` is its snapshot: counters since open, over all
    shards; ``chunks`` and ``map_size`` (all shards' maps) are current."""

    bytes_written: int = counter("Value bytes written")
    bytes_read: int = counter("Value bytes read (good ones)")
    puts: int = counter("Chunks written")
    reads: int = counter("Chunks asked for")
    hits: int = counter("Chunks read and found good")
    misses: int = counter("Chunks asked for and absent (or corrupt)")
    corrupt: int = counter("Chunks that failed their checks on read")
    full: int = counter("Chunks not written: the disk was full")
    syncs: int = counter("Syncs of every shard to the device")
    write_txns: int = counter("Write transactions committed")
    rebuilds: int = counter("Damaged or misplaced environments moved aside, started empty")
    stale_readers: int = counter("Reader slots of dead processes cleared")
    map_adopted: int = counter("Times a map grown by another process was adopted")
    chunks: int = gauge("Chunks on disk")
    map_size: int = gauge("Bytes of all shards' maps")


ENV_FIGURES = ("rebuilds", "stale_readers", "map_adopted")  # what an environment counts


class FilesDamaged(Exception):
    """The files are not what tierkv writes (meta records, file sizes, file kinds)."""


# LMDB errors that mean the files are damaged (as opposed to permissions, locks, space).
DAMAGE_ERRORS: tuple[type[Exception], ...] = (
    FilesDamaged, lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError,
    lmdb.PageNotFoundError, lmdb.IncompatibleError, lmdb.BadDbiError, lmdb.PanicError,
    lmdb.BadChecksumError)
# What run() deals with (in the exclusive section) before retrying the call.
_FIXABLE = DAMAGE_ERRORS + (lmdb.MapResizedError, lmdb.ReadersFullError)


class LmdbEnv:
    """One namespace, part and shard's environment; see the module docstring."""

    def __init__(self, root: Path, namespace: Namespace, part: Part, shard: int, *, map_size: int,
                 sync_always: bool, name: str, payload_bytes: int,
                 clock: Callable[[], float] = time.monotonic, exclusive: bool = False,
                 repair: bool = True, read_only: bool = False, direct_io: bool = True,
                 replica: int = 0) -> None:
        self.root = Path(root)
        self.namespace = namespace
        self.part, self.shard = part, shard
        self.map_size = map_size
        self.payload_bytes = payload_bytes
        self._direct_io = direct_io
        self.read_only = read_only
        self.repair = repair and not read_only
        self.fingerprint = namespace.fingerprint()
        layout = StoreLayout(self.root)
        self.namespace_dir = layout.namespace_dir(self.fingerprint)
        self.rank_dir = layout.part_dir(self.fingerprint, part, replica)
        self.path = layout.shard_dir(self.fingerprint, part, shard, replica)
        self._name = name
        self._sync_always = sync_always
        self._clock = clock
        self._record = namespace_record(self.fingerprint, namespace.describe())
        meta = namespace_record(self.fingerprint, namespace.describe(), part) | {"shard": shard}
        self._meta_raw: bytes = msgpack.packb(meta)
        self._expected_meta = msgpack.unpackb(msgpack.packb(meta), raw=False)
        self._guard = Guard()
        self._pid = os.getpid()
        self.generation = 0  # bumped whenever the environment underneath is changed
        self.replacements = 0  # times it was moved aside and started empty
        self.last_damage: str | None = None
        self._owner: OwnerLock | None = None
        self._claim_lock = threading.Lock()
        self._env: lmdb.Environment | None = None
        self.slab: SlabFile | None = None
        self.index: Any = None
        self.meta: Any = None
        self._data_fd: int | None = None
        self._data_floor = 0  # data.mdb never shrinks; smaller means truncated under us
        self._size_lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self._counts = DiskStatistics()
        self._last_reader_check = clock()
        self.closed = False
        if exclusive and read_only:
            raise UsageError(f"{name}: a read-only tier cannot claim its environment")
        try:
            if read_only:
                self._check_existing()
            else:
                prepare_root(self.root)
                self._prepare_dir(self.namespace_dir)
                self._write_namespace_json()
                self._prepare_dir(self.rank_dir)
                self._prepare_dir(self.path)
                if exclusive:
                    self.claim()
            self._open()
        except BaseException:
            self.closed = True
            self._release()
            raise

    # -- opening -------------------------------------------------------------------------

    def _check_existing(self) -> None:
        """Read-only: the environment must exist and be trusted; nothing is changed."""
        if not self.root.is_dir():
            raise ConfigError(f"{self._name}: no store directory at {self.root} (disk.path)")
        for path in (self.namespace_dir, self.rank_dir, self.path):
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
            if check_file(path) is not Trust.OK or read_private_file(path, len(text)) != text:
                write_private_file(path, text)
        except OSError as exc:
            raise BrokenError(f"{self._name}: cannot write {path}: {exc} "
                              f"(check disk.path)") from exc

    def claim(self) -> None:
        """Make this process the one writer of the environment (idempotent)."""
        if self.read_only:
            raise UsageError(f"{self._name}: opened read-only; it cannot claim {self.path}")
        with self._claim_lock:  # two threads' first writes claim once
            self.check_usable("claiming the environment")  # closed: nothing is left held
            if self._owner is None:
                self._owner = OwnerLock(self.path, self._name)

    def unclaim(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()

    @property
    def claimed(self) -> bool:
        return self._owner is not None

    def _open(self) -> None:
        try:
            self._open_once()
        except DAMAGE_ERRORS + (NamespaceMismatchError,) as exc:
            self._repair(exc)
        except (OSError, lmdb.Error) as exc:
            if "already open in this process" in str(exc):
                raise UsageError(f"{self._name}: {self.path} is already open in this process; "
                                 f"open each environment once per process and share that "
                                 f"DiskTier (or close the other one first)") from exc
            if isinstance(exc, lmdb.MemoryError):  # mmap of the map refused (ENOMEM)
                raise ConfigError(f"{self._name}: cannot map {format_bytes(self.map_size)} "
                                  f"for {self.path} (no address space or memory left: "
                                  f"{exc}); lower disk.max_bytes") from exc
            raise BrokenError(f"{self._name}: cannot open {self.path}: {exc} "
                              f"(check disk.path permissions and free space)") from exc

    def _open_once(self) -> None:
        """Open the environment at ``self.path``; raises damage as damage."""
        writable = not self.read_only
        if writable:
            make_private_dir(self.path)
        for name in (*_ENV_FILES, SLAB_NAME):
            if check_file(self.path / name, fix=writable) is Trust.FOREIGN:
                raise FilesDamaged(f"{name} is not a regular file that only this user can write")
        fresh = not (self.path / "data.mdb").exists()
        if fresh and not writable:
            raise BrokenError(f"{self._name}: no environment at {self.path} (no data.mdb)")
        env = lmdb.open(
            str(self.path), map_size=self.map_size, subdir=True, sync=self._sync_always,
            metasync=self._sync_always, map_async=False, mode=FILE_MODE, readahead=True,
            writemap=False, meminit=True, max_dbs=MAX_DBS, lock=True, readonly=not writable,
        )
        data_fd: int | None = None
        slab: SlabFile | None = None
        try:
            data_fd = os.open(self.path / "data.mdb", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            floor = self._check_file_size(env, data_fd)
            self.clear_stale_readers(env)  # before any txn: dead readers may fill the table
            with self.random_access(data_fd):  # a few pages, not the read-ahead around each
                meta, index = (self._open_db(env, name) for name in (b"meta", b"index"))
                entries = self._check_meta(env, meta, index)
            if entries and not os.path.lexists(self.path / SLAB_NAME):
                raise FilesDamaged(f"{SLAB_NAME} missing while the index names {entries} "
                                   f"chunk(s)")
            try:  # read-only beside an empty index and no slab yet: no slab (no chunks)
                if writable or os.path.lexists(self.path / SLAB_NAME):
                    slab = SlabFile(self.path / SLAB_NAME, self.payload_bytes,
                                    read_only=not writable, direct_io=self._direct_io)
            except OSError as exc:
                raise BrokenError(f"{self._name}: cannot open {self.path / SLAB_NAME}: {exc} "
                                  f"(check disk.path permissions)") from exc
        except BaseException:
            if data_fd is not None:
                os.close(data_fd)
            env.close()
            raise
        for name in (*_ENV_FILES, SLAB_NAME):
            check_file(self.path / name, fix=writable)  # created here: clears read bits
        self._env, self.slab, self.index, self.meta = env, slab, index, meta
        self._data_fd, self._data_floor = data_fd, floor
        if fresh and self.shard == 0:
            self._warn_old_formats()

    def _open_db(self, env: lmdb.Environment, name: bytes) -> Any:
        try:
            return env.open_db(name, create=not self.read_only)
        except lmdb.NotFoundError as exc:
            raise FilesDamaged(f"sub-db {name.decode()} missing") from exc

    @staticmethod
    def _check_file_size(env: lmdb.Environment, data_fd: int) -> int:
        """Damage: a data file shorter than its meta page says would SIGBUS past its end."""
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        actual = os.fstat(data_fd).st_size
        if actual < needed:
            raise FilesDamaged(f"data.mdb has {actual} bytes, its meta page needs {needed}")
        return actual

    def _check_meta(self, env: lmdb.Environment, meta: Any, index: Any) -> int:
        """Check the meta records (a fresh environment gets them); the index's entries."""
        with env.begin(write=not self.read_only) as txn:
            raw = txn.get(META_NAMESPACE, db=meta)
            entries = int(txn.stat(index)["entries"])
            if raw is None:
                if entries:
                    raise FilesDamaged("chunks present but no namespace record")
                if not self.read_only:
                    txn.put(META_NAMESPACE, self._meta_raw, db=meta)
                    txn.put(META_NEXT_SEQ, (1).to_bytes(8, "little"), db=meta)
                return 0
            try:
                stored = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0)
            except Exception as exc:
                raise FilesDamaged(f"namespace record does not decode: {exc}") from exc
            if not isinstance(stored, dict) or "namespace" not in stored:
                raise FilesDamaged("namespace record has the wrong shape")
            if stored != self._expected_meta:
                what = (f"format version {stored.get('format_version')!r}, namespace "
                        f"{stored.get('fingerprint')!r}, part {stored.get('part', '?')!r}, "
                        f"shard {stored.get('shard', '?')!r}")
                raise NamespaceMismatchError(
                    f"{self._name}: {self.path} holds {what}; expected format version "
                    f"{FORMAT_VERSION}, namespace {self.fingerprint}, part {self.part.name}, shard "
                    f"{self.shard}. The directory was copied, swapped or renamed, or written "
                    f"by another tierkv version; nothing was read from it")
            seq_raw = txn.get(META_NEXT_SEQ, db=meta)
            if seq_raw is None or len(seq_raw) != 8:
                raise FilesDamaged("next_seq record missing or malformed")
            return entries

    def _warn_old_formats(self) -> None:
        old = [info for info in list_namespaces(self.root) if info.format_version != FORMAT_VERSION]
        if old:
            logger.warning(
                "%s: %s holds %d namespace(s) of another tierkv format (%s); this tierkv "
                "(format %d) never reads them and starts this namespace empty. Delete them when "
                "no older tierkv uses them: %s (tierkv inspect %s lists them)", self._name,
                self.root, len(old),
                ", ".join(f"{info.path} v{info.format_version}" for info in old),
                FORMAT_VERSION, "; ".join(
                    f"tierkv rm {self.root} --namespace {info.fingerprint} --yes"
                    for info in old), self.root)

    # -- damage, resizes, stale readers -----------------------------------------------------

    def _why_not_repaired(self) -> str | None:
        """Why damage may not be repaired here, or None: repair needs ``repair`` and the
        claim (taken now if no other process holds it)."""
        if self.read_only:
            return "opened read-only (run tierkv verify --repair)"
        if not self.repair:
            return "opened with repair=False (run tierkv verify --repair)"
        if self._owner is None:
            try:
                self.claim()
            except ConfigError as err:
                return str(err)
        return None

    def _close_env(self) -> None:
        env, self._env = self._env, None
        slab, self.slab = self.slab, None
        if slab is not None:
            slab.close()
        fd, self._data_fd = self._data_fd, None
        if fd is not None:
            os.close(fd)
        if env is not None:
            env.close()

    def _repair(self, exc: BaseException, during: str = "") -> None:
        """Move the damaged (``broken``) or misplaced (``foreign``: a NamespaceMismatchError)
        environment aside and open an empty one, the claim held; where this handle may not
        repair, raise :class:`MisplacedError` if misplaced, else :class:`DamagedError`
        (``during``: what met it); both are damage to whoever skips damaged parts."""
        why = "foreign" if isinstance(exc, NamespaceMismatchError) else "broken"
        refused = self._why_not_repaired()
        if refused is not None:
            if why == "foreign":  # skipped like damage by whoever skips damaged parts
                raise MisplacedError(f"{exc}; not moved aside here: {refused}") from exc
            raise DamagedError(f"{self._name}: environment at {self.path} is damaged ({exc})"
                               f"{during}; not repaired here: {refused}") from exc
        self._close_env()
        if isinstance(exc, lmdb.PanicError):  # a fatal write error: the files may be fine
            try:
                self._open_once()
                self.generation += 1
                logger.warning("%s: LMDB panicked (%s); reopened %s", self._name, exc, self.path)
                return
            except DAMAGE_ERRORS as again:
                exc = again
            except (lmdb.Error, OSError, TierKVError) as err:
                raise BrokenError(f"{self._name}: cannot reopen {self.path} after an LMDB "
                                  f"panic ({exc}): {err}") from err
        old_owner = self._owner
        aside = self._move(self.path, why)
        self._owner = None
        try:
            make_private_dir(self.path)
            self.claim()
            self._open_once()
        except (lmdb.Error, FilesDamaged, OSError, TierKVError) as err:
            raise BrokenError(f"{self._name}: cannot rebuild {self.path}: {err}") from err
        finally:
            if old_owner is not None:
                old_owner.release()
        self.generation += 1
        self.replacements += 1
        self.last_damage = str(exc)
        with self._counts_lock:
            self._counts.rebuilds += 1
        if why == "foreign":
            logger.warning("%s: %s; moved it to %s (kept, never read) and started empty",
                           self._name, exc, aside.name)
        else:
            logger.warning("%s: environment at %s is damaged (%s); moved it to %s and started "
                           "empty", self._name, self.path, exc, aside)

    def _fix(self, problem: BaseException, generation: int, action: str) -> None:
        """Deal with what stopped a call, outside its shared section; the call is retried."""
        with self._guard.exclusive():
            if self.closed or self._env is None:
                raise self._stopped(action)
            if self.generation != generation:
                return  # another thread replaced or resized the environment meanwhile
            if isinstance(problem, lmdb.MapResizedError):
                self._env.set_mapsize(0)  # adopt the size another process grew the map to
                self.map_size = int(self._env.info()["map_size"])
                self.generation += 1
                with self._counts_lock:
                    self._counts.map_adopted += 1
                logger.info("%s: adopted a map grown by another process (%s)", self._name,
                            format_bytes(self.map_size))
            elif isinstance(problem, lmdb.ReadersFullError):
                self.clear_stale_readers(self._env)
                self.generation += 1
            else:
                self._repair(problem, during=f" while {action}")

    def clear_stale_readers(self, env: lmdb.Environment) -> int:
        """Free the reader slots of dead processes; how many there were."""
        self._last_reader_check = self._clock()
        cleared = int(env.reader_check())
        if cleared:
            with self._counts_lock:
                self._counts.stale_readers += cleared
            logger.warning("%s: cleared %d reader slot(s) of dead processes (they pinned old "
                           "pages)", self._name, cleared)
        return cleared

    def readers_due(self) -> bool:
        return self._clock() - self._last_reader_check >= READER_CHECK_SECONDS

    # -- access pattern ----------------------------------------------------------------------

    def random_access(self, data_fd: int | None = None) -> AbstractContextManager[None]:
        """Within: no read-ahead on the map (``MADV_RANDOM``), so walking the index (or the
        meta records, at open) reads the pages it touches, not megabytes around each. Loads
        need read-ahead, so it is back on after (:mod:`tierkv.tiers.disk.readahead`). A
        no-op where the map cannot be found (not Linux). ``data_fd``: of the environment
        being opened."""
        return random_access(self._data_fd if data_fd is None else data_fd)

    # -- running calls -----------------------------------------------------------------------

    def check_usable(self, action: str) -> None:
        if os.getpid() != self._pid:
            raise UsageError(f"{self._name}: {action} in a forked child (pid {os.getpid()}) of "
                             f"the process that opened it (pid {self._pid}); LMDB environments "
                             f"do not survive fork(): open the tier in the child")
        if self.closed:
            raise ClosedError(f"{self._name}: used after close(); open a new DiskTier")

    def _check_data_file(self) -> None:
        """The file only grows (LMDB never shrinks it); read and compare under one lock, or
        a size read before another thread's commit grew the file would look like a shrink."""
        assert self._data_fd is not None
        with self._size_lock:
            size = os.lseek(self._data_fd, 0, os.SEEK_END)  # 0.2 us; fstat costs 0.8
            if size < self._data_floor:
                raise FilesDamaged(f"data.mdb shrank from {self._data_floor} to {size} bytes "
                                   f"under the running tier (truncated)")
            self._data_floor = size

    def run(self, action: str, work: Callable[[lmdb.Environment], _T],
            key: bytes | None = None) -> _T:
        """``work(env)`` as the module docstring says; ``action`` (with ``key``'s short hex,
        when given) names the call in errors, formatted only for one."""
        guard = self._guard
        for _ in range(3):
            if self.closed or os.getpid() != self._pid:
                self.check_usable(_action(action, key))
            guard.enter()
            try:
                env, generation = self._env, self.generation
                if env is None:
                    raise self._stopped(_action(action, key))
                try:
                    self._check_data_file()
                    return work(env)
                except _FIXABLE as exc:
                    problem: BaseException = exc
                except lmdb.Error as exc:
                    raise self._stopped(_action(action, key), exc) from exc
            finally:
                guard.leave()
            self._fix(problem, generation, _action(action, key))
        raise BrokenError(f"{self._name}: {_action(action, key)} kept failing after repairs "
                          f"({problem})")

    def _stopped(self, action: str, exc: lmdb.Error | None = None) -> TierKVError:
        """What a call that cannot go on raises: closed meanwhile; else LMDB's error ``exc``;
        else no environment (a rebuild after damage failed)."""
        if self.closed:
            return ClosedError(f"{self._name}: closed while {action}")
        if exc is not None:
            return BrokenError(f"{self._name}: LMDB failed {action} at {self.path}: {exc}")
        return BrokenError(f"{self._name}: no environment ({action}): it could not be rebuilt "
                           f"after damage; restart the store")

    def counts(self) -> DiskStatistics:
        """A copy of the environment's counts."""
        with self._counts_lock:
            return replace(self._counts)

    # -- life cycle ------------------------------------------------------------------------

    def _release(self) -> None:
        try:
            self._close_env()
        finally:
            self.unclaim()

    def close(self, sync: bool) -> bool:
        """Close (after an fsync when ``sync``); idempotent. Whether the fsync happened."""
        if self.closed:
            return False
        self.check_usable("closing")
        synced = False
        with self._guard.exclusive():
            try:
                if self._env is not None and sync and not self.read_only:
                    if self.slab is not None:  # payloads before the index that names them
                        self.slab.shrink_to_used()
                        self.slab.sync()
                    self._env.sync(True)
                    synced = True
            except (lmdb.Error, OSError) as exc:  # committed data survives a crash; only the fsync failed
                logger.warning("%s: sync at close failed (%s); what was written since the last "
                               "sync may not survive a power loss", self._name, exc)
            finally:
                self.closed = True
                self._release()
        return synced
