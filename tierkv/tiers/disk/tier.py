"""The disk tier: chunk payloads of one namespace and part in :data:`SHARDS` shards at
``root/ns-<fingerprint>/part-<p>of<P>/shard-<s>/``, a chunk in the shard :func:`shard_of` its
key; each shard a slab file of fixed slots holding the payloads and an LMDB environment
holding the index (key -> slab, slot, length, sequence, checksum).
``docs/on-disk-format.md`` has every byte and the crash contract.

Primitives and contracts: those of :class:`~tierkv.tiers.base.LowerTier`, and (one
:class:`DiskTier` holds bytes and starts no threads; it may be called from several threads:
LMDB serializes write transactions, reads run concurrently):

- ``put_many(items, deletes=())``, per shard it touches: the payloads are written into
  free slots of the slab (``pwrite``, ``O_DIRECT`` where the filesystem takes it), made
  durable first when ``disk.sync_mode`` is ``always``, and only then is one index txn
  committed (deletes, then the entries). Writing takes the shard's claim (one writing
  process per shard). ``delete_many`` is one index txn per shard; a slot is free once the
  txn that dropped its entry committed. ``write_lanes``/``lane_of`` tell an I/O layer which
  keys may be written in parallel (another shard). A slab at its size limit, a full
  filesystem (ENOSPC, EDQUOT, a short write) or a full index map is ``PutResult.full``; the
  disk cap is soft here (the scheduler side accounts for it).
- ``read_into(key, out)``: the index entry in one short read txn, then the slot read
  (``O_DIRECT`` pieces on the tier's :class:`~tierkv.tiers.disk.reads.ReadPool` when
  ``out`` is page-aligned, else one buffered ``preadv``), its payload straight into
  ``out``; the slot's header must name the entry's sequence
  and checksum and the payload match the checksum bound to key, namespace and part. A bad
  slot whose entry is still the one read is deleted and counted (an entry changed meanwhile
  is read again). ``read_many_into(items)`` does the same for many chunks, all in flight:
  per shard one read txn, every slot read started before the first is checked, one window
  of reads across the shards (:mod:`tierkv.tiers.disk.many`, which says the lock order).
- ``sync()``: every slab's ``fdatasync``, then the index's (payloads before the index
  that names them). ``trace`` (tests): called with each ordering event.
- ``scan(batch)`` reads the index sub-db in short txns of ``batch`` keys (restart warm
  without reading payloads); ``verify`` reads every entry's slot and checks it (both walk
  each shard's index through :mod:`tierkv.tiers.disk.walk`).
- ``claim()`` makes this process the one writer of the part's environments
  (``exclusive=True`` does it at open, before anything is judged or moved): a second
  claim, from any process, is refused with a :class:`ConfigError` naming the holder.
- ``read_only=True`` (operator tools): nothing is created, written, moved or chmod-ed;
  what is not trusted, or damaged, raises :class:`DamagedError`; a corrupt value is
  answered ``CORRUPT`` and left in place. ``shards=`` (read-only only) opens some of the
  part's shards, so a tool reads the good ones beside a damaged one.
- Any call from a forked child raises :class:`UsageError`.
- No read transaction outlives a call. Nothing is ever unpickled or evaluated.

The environment underneath (which files are trusted, damage and rebuilds, a map another
process grew, stale readers) is kept by :class:`tierkv.tiers.disk.env.LmdbEnv`; see its
docstring. Opening a tier tunes glibc malloc once per process (:func:`tune_malloc`, opt
out with ``disk.tune_malloc=False`` or ``TIERKV_MALLOPT=0``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lmdb

from tierkv.checks import check_int
from tierkv.config import DiskTierConfig
from tierkv.errors import ConfigError, UsageError, short_key
from tierkv.keys import KEY_BYTES, Namespace, Part, as_part
from tierkv.tiers.base import ChunkRecord, LowerTier, PutResult, ReadStatus, VerifyReport
from tierkv.tiers.disk.env import ENV_FIGURES, SHARDS, DiskStatistics, LmdbEnv, shard_of
from tierkv.tiers.disk.files import NamespaceInfo, list_namespaces
from tierkv.tiers.disk.format import (HEADER_BLOCK, IndexEntry, binding_of, check_slot,
                                      unpack_index)
from tierkv.tiers.disk.many import read_shards
from tierkv.tiers.disk.reads import ReadPool
from tierkv.tiers.disk.walk import scan_shard, verify_shard
from tierkv.tiers.disk.write import ShardWrites
from tierkv.tiers.tuning import (MAP_LIMIT_BYTES, largest_cap, map_size_for, shard_cap,
                                 slab_slots_for, tune_malloc)
from tierkv.units import format_bytes

__all__ = [
    "SHARDS", "ChunkRecord", "DiskTier", "NamespaceInfo", "PutResult",
    "ReadStatus", "VerifyReport", "list_namespaces", "map_size_for", "shard_of", "tune_malloc",
    "written_at",
]

logger = logging.getLogger("tierkv.disk")


def written_at(seq: int) -> float:
    """When the value of write sequence ``seq`` was written (seconds since the epoch; the
    clock of the writing host, see :meth:`ShardWrites._first_seq`)."""
    return seq // SHARDS / 1e6


class DiskTier(LowerTier):
    """Chunk payloads of one namespace and rank in slab files indexed by LMDB. See the
    module docstring."""

    medium = "disk"
    setting = "disk.path"

    def __init__(
        self,
        root: Path,
        namespace: Namespace,
        part: Part | int,
        config: DiskTierConfig,
        payload_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        replica: int = 0,
        exclusive: bool = False,
        repair: bool = True,
        read_only: bool = False,
        shards: Sequence[int] | None = None,
        trace: Callable[[str, int, int], None] | None = None,
    ) -> None:
        part = as_part(part)
        check_int("disk tier: payload_bytes", payload_bytes, low=1)
        check_int("disk tier: replica", replica, low=0)
        if not isinstance(namespace, Namespace):
            raise UsageError(f"disk tier: namespace must be a Namespace, got {namespace!r}")
        self.root = Path(root)
        self.namespace = namespace
        self.part = part
        self.replica = replica
        self.config = config
        self.payload_bytes = payload_bytes
        self.read_only = read_only
        self._clock = clock
        self.fingerprint = namespace.fingerprint()
        self._name = f"disk tier (namespace {self.fingerprint[:8]}, part {part.name}" + (
            f", data-parallel engine {replica})" if replica else ")")
        self._binding = binding_of(self.fingerprint, part)
        self._stats_lock = threading.Lock()
        self._counts = DiskStatistics()
        self._reads = ReadPool(config.read_bytes_in_flight)  # O_DIRECT pieces in flight
        self.read_batch_bytes = config.read_bytes_in_flight
        self._unsynced_bytes = 0
        self._last_sync = clock()
        if config.tune_malloc:
            tune_malloc(config.write_batch_bytes)
        page = os.sysconf("SC_PAGE_SIZE")

        def total_for(cap: int) -> int:  # every shard's map under a cap of ``cap``
            return SHARDS * map_size_for(shard_cap(cap, payload_bytes, SHARDS), payload_bytes, page)

        map_size = total_for(config.max_bytes) // SHARDS
        slot_limit = slab_slots_for(shard_cap(config.max_bytes, payload_bytes, SHARDS),
                                    payload_bytes)
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
                    self.root, namespace, part, shard, map_size=map_size, replica=replica,
                    sync_always=config.sync_mode == "always", name=f"{self._name[:-1]}, shard "
                    f"{shard})", payload_bytes=payload_bytes, clock=clock,
                    exclusive=exclusive, repair=repair, read_only=read_only,
                    direct_io=config.direct_io))
        except BaseException:
            for env in self._shards:
                env.close(sync=False)
            raise
        self.namespace_dir = self._shards[0].namespace_dir
        self.path = self._shards[0].rank_dir
        self.shard_paths = tuple(env.path for env in self._shards)
        self._env_of = {env.shard: env for env in self._shards}
        # Tests: ``trace`` is called with (event, shard, slot) at each step the crash
        # contract orders: "payload" (a slot written), "payload-sync", "index-commit" (per
        # entry), "index-delete" (per entry dropped or replaced), "index-sync", "slot-free".
        self._writes = ShardWrites(name=self._name, root=self.root, path=self.path,
                                   payload_bytes=payload_bytes, config=config,
                                   binding=self._binding, slot_limit=slot_limit, trace=trace)

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

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise UsageError(f"{self._name}: a chunk key must be {KEY_BYTES} bytes, "
                              f"got {key!r:.40}")

    def _bytes_of(self, buffer: Any, what: str, writable: bool = False) -> memoryview:
        """``buffer`` as a flat byte view of exactly ``payload_bytes`` (or, writable, at
        least that many) bytes; anything else is a :class:`UsageError`."""
        try:
            view = memoryview(buffer)
        except TypeError as exc:
            raise UsageError(f"{self._name}: {what} must be a bytes-like buffer, got "
                              f"{type(buffer).__name__}") from exc
        if not view.c_contiguous or (writable and view.readonly):
            raise UsageError(f"{self._name}: {what} must be a "
                              f"{'writable ' if writable else ''}contiguous buffer")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if writable and len(view) < self.payload_bytes:
            raise UsageError(f"{self._name}: {what} must be writable and hold at least "
                              f"{self.payload_bytes} bytes, got {len(view)}")
        if not writable and len(view) != self.payload_bytes:
            raise UsageError(f"{self._name}: {what} has {len(view)} bytes, the tier stores "
                              f"{self.payload_bytes}")
        return view

    def _check_batch(self, batch: Any) -> None:
        check_int(f"{self._name}: batch", batch, low=1)

    def _check_writable(self, action: str) -> None:
        if self.read_only:
            raise UsageError(f"{self._name}: {action} on a tier opened read-only")

    # -- writes ----------------------------------------------------------------------------

    def put_many(
        self,
        items: Sequence[tuple[bytes, memoryview | bytes]],
        deletes: Sequence[bytes] = (),
    ) -> PutResult:
        """Delete ``deletes`` then write ``items``: per shard, payloads into slots, then one
        index txn. Items that find no slot (the slab at its limit, the filesystem full) or
        no room in the index come back in ``full``, the rest are written."""
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
        deleted, why_full = 0, ""
        for shard in sorted(puts.keys() | drops.keys()):
            lm = self._shards[shard]
            put, drop = puts.get(shard, []), tuple(drops.get(shard, ()))
            if put and not lm.claimed:
                lm.claim()  # one writing process per shard: its slots are allocated here
            done, no_room, gone, why = lm.run(
                "writing chunks", partial(self._writes.put_shard, lm, items=put, deletes=drop))
            landed.update(done)
            full += no_room
            deleted, why_full = deleted + gone, why_full or why
        written = tuple(key for key, _ in views if key in landed)
        num_bytes = len(written) * self.payload_bytes
        with self._stats_lock:
            counts = self._counts
            counts.bytes_written += num_bytes
            counts.puts += len(written)
            counts.full += len(full)
            counts.write_txns += len(puts.keys() | drops.keys())
        message = None
        if full:
            what, hint = {
                "space": ("filesystem", f"free space under {self.root} or lower disk.max_bytes"),
                "map": ("index map", "raise disk.max_bytes"),
            }.get(why_full, ("slab", "raise disk.max_bytes"))
            message = (f"{self._name}: {what} full writing chunk {short_key(full[0])} "
                       f"({len(full)} chunk(s) not written; {hint}, now "
                       f"{format_bytes(self.config.max_bytes)})")
            logger.warning("%s", message)
        self._after_commit(num_bytes)
        return PutResult(written, tuple(full), deleted, num_bytes, message)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` (absent ones are ignored) in one index txn per shard; returns how
        many existed. Their slots are free from then on."""
        self._check_writable("deleting chunks")
        for key in keys:
            self._check_key(key)
        if not keys:
            self._shards[0].check_usable("deleting chunks")
        return sum(self._shards[shard].run("deleting chunks", partial(
            self._writes.delete_shard, self._shards[shard], keys=group))
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
        """fsync everything committed so far (the durability point): per shard, the slab's
        payloads first, then the index; nothing to do read-only."""
        if self.read_only:
            self._shards[0].check_usable("syncing")
            return
        with self._stats_lock:  # commits during the fsync count toward the next one
            unsynced, started = self._unsynced_bytes, self._clock()
        for lm in self._shards:
            lm.run("syncing", partial(self._writes.sync_shard, lm))
        with self._stats_lock:
            self._counts.syncs += 1
            self._unsynced_bytes -= unsynced
            self._last_sync = started

    # -- reads -----------------------------------------------------------------------------

    def _entry_of(self, lm: LmdbEnv, key: bytes, raw: bytes | None) -> IndexEntry | str:
        """The index entry ``raw`` of ``key``, or what is wrong with it."""
        entry = unpack_index(raw)
        if entry is None:
            return "malformed index entry"
        if shard_of(key) != lm.shard:
            return f"found in shard {lm.shard}, its key's shard is {shard_of(key)}"
        if entry.slab != 0:
            return f"index names slab {entry.slab}, which this format does not have"
        if entry.payload_len != self.payload_bytes:
            return (f"index says {entry.payload_len} payload bytes, the tier stores "
                    f"{self.payload_bytes}")
        if lm.slab is None:
            return "slab file missing"
        return entry

    def _judge(self, key: bytes, entry: IndexEntry, head: memoryview, count: int,
               out: memoryview) -> str | None:
        """None when the slot read holds ``key``'s payload ``entry`` names, else why not."""
        if count < HEADER_BLOCK + self.payload_bytes:
            return f"slot {entry.slot} is past the slab's end (truncated)"
        return check_slot(self._binding, key, head, entry, self.payload_bytes, out)

    def _read_slot(self, lm: LmdbEnv, key: bytes, raw: bytes | None,
                   out: memoryview) -> str | None:
        """None when the slot ``raw`` names holds ``key``'s payload (now in ``out``)."""
        entry = self._entry_of(lm, key, raw)
        if isinstance(entry, str):
            return entry
        assert lm.slab is not None  # _entry_of said so
        head, count = lm.slab.read(entry.slot, out, self._reads)
        return self._judge(key, entry, head, count, out)

    def _out_of(self, key: bytes, out: Any) -> memoryview:
        """``out`` as a writable flat byte view of at least ``payload_bytes`` bytes."""
        self._check_key(key)
        if type(out) is memoryview and out.format == "B" and out.ndim == 1 and \
                not out.readonly and out.c_contiguous and len(out) >= self.payload_bytes:
            return out
        return self._bytes_of(out, f"the read buffer for chunk {short_key(key)}", writable=True)

    def read_many_into(self, items: Sequence[tuple[bytes, Any]]) -> list[ReadStatus]:
        """:meth:`read_into` of each ``(key, out)``, all in flight across shards (:mod:`tierkv.
        tiers.disk.many`); a chunk that fails a check goes through :meth:`read_into` (again,
        deleted)."""
        views = [(key, self._out_of(key, out)) for key, out in items]
        statuses: list[ReadStatus] = [ReadStatus.MISSING] * len(views)
        again: list[int] = []
        hits = 0
        shards: dict[int, list[int]] = {}
        for position, (key, _) in enumerate(views):
            shards.setdefault(shard_of(key), []).append(position)
        order = sorted(shards)  # the lock order read_shards relies on
        found = read_shards([(self._shards[shard], [views[p] for p in shards[shard]])
                             for shard in order], self._reads, self._entry_of, self._judge)
        for shard, results in zip(order, found):
            for position, (raw, problem) in zip(shards[shard], results):
                if problem is not None:
                    again.append(position)
                elif raw is not None:
                    statuses[position], hits = ReadStatus.OK, hits + 1
        misses = len(views) - hits - len(again)
        with self._stats_lock:
            counts = self._counts
            counts.reads += hits + misses
            counts.hits += hits
            counts.misses += misses
            counts.bytes_read += hits * self.payload_bytes
        for position in again:
            statuses[position] = self.read_into(*views[position])
        return statuses

    def read_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """Copy the verified payload of ``key`` into ``out[:payload_bytes]``."""
        out = self._out_of(key, out)
        lm = self._shard(key)

        def read(env: lmdb.Environment) -> tuple[bytes | None, str | None]:
            with env.begin(db=lm.index) as txn:
                raw = txn.get(key)
            if raw is None:
                return None, None
            return raw, self._read_slot(lm, key, raw, out)

        def still(env: lmdb.Environment, raw: bytes) -> bool:
            with env.begin(db=lm.index) as txn:
                return txn.get(key) == raw

        for _ in range(3):  # an entry rewritten or deleted while its slot was read: again
            raw, problem = lm.run("reading chunk", read, key)
            if raw is None:
                break
            if problem is None:
                with self._stats_lock:
                    counts = self._counts
                    counts.reads += 1
                    counts.hits += 1
                    counts.bytes_read += self.payload_bytes
                return ReadStatus.OK
            if self.read_only and lm.run("reading chunk", partial(still, raw=raw), key):
                break
            if not self.read_only and lm.run("deleting chunk", partial(
                    self._writes.delete_shard, lm, keys=[key], expect=raw), key):
                break
        else:
            raw = None
        with self._stats_lock:
            counts = self._counts
            counts.reads += 1
            counts.misses += 1
            counts.corrupt += raw is not None
        if raw is None:
            return ReadStatus.MISSING
        logger.warning("%s: corrupt chunk %s (%s)%s", self._name, short_key(key), problem,
                       "" if self.read_only else "; deleted it")
        return ReadStatus.CORRUPT

    def scan(self, batch: int = 1024) -> Iterator[ChunkRecord]:
        """Every stored chunk as (key, payload_len, seq), from the shards' indexes; no
        payload is read.

        A shard's index is read whole (one short txn per ``batch`` keys) before the first
        record is yielded, so damage met anywhere in it (the shard is then rebuilt empty)
        never leaves a caller holding records of an environment that is gone."""
        self._check_batch(batch)
        records = [scan_shard(lm, batch) for lm in self._shards]
        for shard_records in records:
            yield from shard_records

    def verify(self, repair: bool = False, batch: int = 64,
               progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Read and check every index entry's slot (header, sequence, checksum) and its
        shard; ``repair`` deletes bad keys.

        Each batch of entries is listed in one short read txn; an entry that fails is read
        again from the index, so a chunk another thread or process rewrote or deleted
        meanwhile is checked anew or not at all, never reported bad. Damage of a shard's
        environment is reported in ``damaged`` (see :class:`VerifyReport`); where it may
        not be repaired, :class:`DamagedError` says why."""
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

            count, found = verify_shard(lm, batch, scratch, shard_progress, self._read_slot)
            if lm.replacements != replaced:  # rebuilt empty: nothing of it is left
                damaged.append(str(lm.last_damage))
                continue
            checked, bad = checked + count, bad + [key for key, _ in found]
            for key, raw in found if repair else ():
                repaired += lm.run("repairing", partial(self._writes.delete_shard, lm, keys=[key],
                                                        expect=raw))
        return VerifyReport(checked, tuple(bad), repaired,
                            damaged="; ".join(damaged) or None, rebuilt=bool(damaged))

    # -- life cycle ------------------------------------------------------------------------

    def statistics(self) -> DiskStatistics:
        def count(lm: LmdbEnv, env: lmdb.Environment) -> int:
            with env.begin() as txn:
                return int(txn.stat(lm.index)["entries"])

        chunks = sum(lm.run("counting chunks", partial(count, lm)) for lm in self._shards)
        shards = [lm.counts() for lm in self._shards]
        with self._stats_lock:
            return self._counts.snapshot(
                chunks=chunks, map_size=self.map_size,
                **{name: sum(getattr(counts, name) for counts in shards) for name in ENV_FIGURES})

    def close(self) -> None:
        """Sync and close; idempotent."""
        try:
            synced = [lm.close(sync=True) for lm in self._shards]
        finally:
            self._writes.close()  # after the shards: no batch is in flight any more
            self._reads.close()
        if any(synced):
            with self._stats_lock:
                self._counts.syncs += 1

    def __repr__(self) -> str:
        state = "closed" if self._shards[0].closed else "open"
        return f"DiskTier({str(self.path)!r}, payload_bytes={self.payload_bytes}, {state})"
