"""The disk tier's write path, one shard at a time, in the order the crash contract
(``docs/on-disk-format.md``) names.

Primitives and contracts (:class:`ShardWrites`, one per :class:`~tierkv.tiers.disk.tier.DiskTier`;
every method runs inside the shard's :meth:`LmdbEnv.run`):

- ``put_shard(lm, env, items, deletes)``: slots from the slab's allocator (free ones
  first; the deletes committed first when that is what makes room), each payload written
  with its header block, made durable when ``disk.sync_mode`` is ``always``, then one index
  txn (deletes, then the entries, and the shard's next sequence). Slots the txn dropped
  are given back only after it committed. Returns (written, full, deleted, why full).
- ``delete_shard(lm, env, keys, expect=None)``: one index txn; ``expect`` deletes only an
  entry still equal to it (a reader's compare-and-delete).
- Every index txn that finds the map full clears the stale readers (reader slots of dead
  processes, which pin old pages) and runs again before the map is reported full.
- Payloads are written in pieces of :data:`PIECE_BYTES` by :data:`WRITE_THREADS` threads
  shared by the shards (started at the first batch with more than one piece, stopped by
  ``close()``); the index txn waits for every piece.
- ``sync_shard(lm, env)``: the slab's ``fdatasync`` (the bulk while writers go on; then,
  with the shard's commits held, what landed meanwhile), then the index's ``fsync``.
- ``trace`` (tests): called with ``(event, shard, slot)`` at each ordered step.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb

from tierkv.config import DiskTierConfig
from tierkv.errors import BrokenError
from tierkv.tiers.disk.env import META_NEXT_SEQ, SHARDS, FilesDamaged, LmdbEnv
from tierkv.tiers.disk.format import IndexEntry, pack_index, seal, unpack_index
from tierkv.tiers.disk.slab import NO_SPACE, SlabFile
from tierkv.units import format_bytes

logger = logging.getLogger("tierkv.disk")

# A payload is written in pieces of this size by the shared writer threads, so several
# writes are in flight (docs/benchmarks/disk.md: 4 MiB x 8 threads was the best of the
# shapes tried on the dev VM, 1 MiB pieces cost more CPU per GiB for no more speed).
PIECE_BYTES = 4 << 20
WRITE_THREADS = 8  # the slab writer threads of one tier (all shards share them)


class ShardWrites:
    """Writes and deletes of one tier's shards; see the module docstring."""

    def __init__(self, *, name: str, root: Path, path: Path, payload_bytes: int,
                 config: DiskTierConfig, binding: bytes, slot_limit: int,
                 trace: Callable[[str, int, int], None] | None) -> None:
        self.name, self.root, self.path = name, root, path
        self.payload_bytes = payload_bytes
        self.config = config
        self.binding = binding
        self.slot_limit = slot_limit
        self.trace = trace
        self._seq_lock = threading.Lock()
        # Per shard: an index commit never lands between a sync's slab and index fsyncs
        # (the index sync would cover payloads not yet durable).
        self.commit_locks = [threading.Lock() for _ in range(SHARDS)]
        self._threads: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def out_of_space(self, exc: lmdb.Error, num_items: int) -> bool:
        """Whether a failed write txn of ``num_items`` values means the filesystem is full:
        ENOSPC (``lmdb.DiskError``) or EDQUOT, or EIO from a short write (what ENOSPC looks
        like on a full filesystem) when less is free than such a txn writes at least (a page
        more per value, one value for deletes); any other EIO is a real I/O error."""
        if isinstance(exc, lmdb.DiskError):
            return True
        text = str(exc)
        if os.strerror(errno.ENOSPC) in text or os.strerror(errno.EDQUOT) in text:
            return True
        return os.strerror(errno.EIO) in text and self._short_of_room(num_items)

    def _short_of_room(self, num_items: int) -> bool:
        """Whether the filesystem has less free than ``num_items`` values need (a page
        more each): what tells an EIO from a short write on a full disk from a real one."""
        try:
            fs = os.statvfs(self.path)
        except OSError:
            return False
        return fs.f_bavail * fs.f_frsize < max(num_items, 1) * (self.payload_bytes + 4096)

    @staticmethod
    def _first_seq(shard: int, stored: int) -> int:
        """A txn's first write sequence: after the shard's ``stored`` next one, at least the
        wall clock in us (so the order holds across shards), and ``shard`` modulo
        :data:`SHARDS` (so no two shards of a rank give the same number)."""
        base = max(stored, time.time_ns() // 1000 * SHARDS)
        return base + (shard - base) % SHARDS

    def trace_event(self, event: str, shard: int, slot: int = -1) -> None:
        if self.trace is not None:
            self.trace(event, shard, slot)

    def _prepare_shard(self, lm: LmdbEnv, env: lmdb.Environment) -> SlabFile:
        """The shard's slab, its allocator seeded from the index and its next sequence read
        (once per environment: a rebuilt one starts afresh)."""
        slab = lm.slab
        if slab is None:
            raise FilesDamaged("slab file missing")
        if not slab.mapped:
            with env.begin(db=lm.index) as txn:  # all of the index: read-ahead helps
                used = [entry.slot for _, raw in txn.cursor()
                        if (entry := unpack_index(raw)) is not None and entry.slab == 0]
                seq_raw = txn.get(META_NEXT_SEQ, db=lm.meta)
            if seq_raw is None or len(seq_raw) != 8:
                raise FilesDamaged("next_seq record missing or malformed")
            slab.next_seq = int.from_bytes(seq_raw, "little")
            slab.adopt_used(used)
        return slab

    def _write_slots(self, lm: LmdbEnv, slab: SlabFile,
                     writes: list[tuple[int, bytes, memoryview]]) -> None:
        """Write every (slot, header, payload) of a batch; returns when all are written.
        The pieces (header blocks, payloads in :data:`PIECE_BYTES`) run on the shared
        writer threads, so a batch keeps several writes in flight (a disk queue deep enough
        for the device, as vLLM's fs tier keeps with its 16 threads)."""
        calls = [call for slot, head, payload in writes
                 for call in slab.pieces(slot, head, payload, PIECE_BYTES)]
        if len(calls) <= 2:
            for call in calls:
                call()
        else:
            futures = [self._pool().submit(call) for call in calls]
            problem: BaseException | None = None
            for future in futures:  # every piece has finished before an error is raised
                error = future.exception()
                problem = problem or error
            if problem is not None:
                raise problem
        for slot, _, _ in writes:
            self.trace_event("payload", lm.shard, slot)

    def _pool(self) -> ThreadPoolExecutor:
        with self._seq_lock:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(WRITE_THREADS, "tierkv-slab-writer")
            return self._threads

    def close(self) -> None:
        """Stop the writer threads (idempotent)."""
        with self._seq_lock:
            threads, self._threads = self._threads, None
        if threads is not None and os.getpid() == self._pid:  # a forked child has none
            threads.shutdown(wait=True)

    def _sync_slab(self, lm: LmdbEnv, slab: SlabFile) -> None:
        slab.sync()
        self.trace_event("payload-sync", lm.shard)

    def _release(self, lm: LmdbEnv, slab: SlabFile, slots: list[int]) -> None:
        """Give ``slots`` back: unused allocations, or slots whose entries a committed index
        txn dropped or replaced (never earlier: a reader may still follow the old entry, and
        its header check is what stops it once the slot is rewritten)."""
        for slot in slots:
            self.trace_event("slot-free", lm.shard, slot)
        slab.release(slots)

    def _take_seqs(self, shard: int, slab: SlabFile, count: int) -> int:
        """The first of ``count`` write sequences (``n, n + SHARDS, ...``), reserved now:
        a slot's header carries its sequence, so it is chosen before the payload is written
        and persisted by the index txn that names it."""
        with self._seq_lock:
            stored = slab.next_seq or 1
            first = self._first_seq(shard, stored)
            slab.next_seq = first + count * SHARDS
        return first

    def _is_out_of_space(self, exc: OSError, num_items: int) -> bool:
        return exc.errno in NO_SPACE or exc.errno == errno.EIO and self._short_of_room(num_items)

    def put_shard(self, lm: LmdbEnv, env: lmdb.Environment,
                   items: list[tuple[bytes, memoryview | bytes]], deletes: tuple[bytes, ...],
                   ) -> tuple[tuple[bytes, ...], tuple[bytes, ...], int, str]:
        """(written, full, deleted, why full) of one shard's part of a ``put_many``."""
        slab = self._prepare_shard(lm, env) if items else lm.slab
        full: list[bytes] = []
        why, early = "", 0
        entries: list[tuple[bytes, IndexEntry]] = []
        if items:
            assert slab is not None
            slots, short = slab.allocate(len(items), self.slot_limit)
            if short and deletes:  # the deletes make room: committed first, slots freed
                freed, early = self._index_deletes(lm, env, deletes)
                self._release(lm, slab, freed)
                deletes = ()
                more, short = slab.allocate(len(items) - len(slots), self.slot_limit)
                slots += more
            full = [key for key, _ in items[len(slots):]]
            why = {"space": "space", "limit": "slab"}.get(short or "", "")
            seq = self._take_seqs(lm.shard, slab, len(slots))
            try:
                writes: list[tuple[int, bytes, memoryview]] = []
                for (key, payload), slot in zip(items, slots):
                    head, check = seal(self.binding, key, payload, seq)
                    writes.append((slot, head, memoryview(payload)))
                    entries.append((key, IndexEntry(0, slot, len(payload), seq, check)))
                    seq += SHARDS
                self._write_slots(lm, slab, writes)
                if entries and self.config.sync_mode == "always":
                    self._sync_slab(lm, slab)  # durable before the index that names them
            except OSError as exc:
                self._release(lm, slab, slots)
                if not self._is_out_of_space(exc, len(slots)):
                    raise BrokenError(f"{self.name}: writing slab {slab.path}: {exc}") from exc
                full, entries, why = [key for key, _ in items], [], "space"
        written, freed, deleted, index_full = self._commit_index(lm, env, entries, deletes)
        deleted += early
        if index_full:
            assert slab is not None
            self._release(lm, slab, [entry.slot for _, entry in entries])
            full += [key for key, _ in entries]
            why = why or index_full
        if slab is not None:
            self._release(lm, slab, freed)
        return written, tuple(full), deleted, why

    def _commit_index(self, lm: LmdbEnv, env: lmdb.Environment,
                      entries: list[tuple[bytes, IndexEntry]], deletes: Sequence[bytes],
                      ) -> tuple[tuple[bytes, ...], list[int], int, str]:
        """Commit ``deletes`` and ``entries`` in one index txn: (keys written, slots freed,
        deleted, "" or why the entries did not fit: "map" or "space"). When the map cannot
        take the entries, the deletes are committed alone and the entries are full."""
        for attempt in (0, 1):
            try:
                freed, deleted = self._index_txn(lm, env, entries, deletes)
                return tuple(key for key, _ in entries), freed, deleted, ""
            except lmdb.MapFullError:
                why = "map"
            except lmdb.Error as exc:
                if not self.out_of_space(exc, len(entries)):
                    raise
                why = "space"
            if attempt or not entries:
                break
            freed, deleted = self._index_deletes(lm, env, deletes)
            return (), freed, deleted, why
        logger.warning("%s: %s full even for %d delete(s); raise disk.max_bytes, now %s, or "
                       "free space under %s", self.name, "map" if why == "map" else
                       "filesystem", len(deletes), format_bytes(self.config.max_bytes),
                       self.root)
        return (), [], 0, why

    def _index_deletes(self, lm: LmdbEnv, env: lmdb.Environment,
                       deletes: Sequence[bytes]) -> tuple[list[int], int]:
        if not deletes:
            return [], 0
        try:
            return self._index_txn(lm, env, [], deletes)
        except lmdb.MapFullError:
            pass
        except lmdb.Error as exc:
            if not self.out_of_space(exc, 0):
                raise
        logger.warning("%s: index full even for %d delete(s); raise disk.max_bytes, now %s, or "
                       "free space under %s", self.name, len(deletes),
                       format_bytes(self.config.max_bytes), self.root)
        return [], 0

    def _index_txn(self, lm: LmdbEnv, env: lmdb.Environment,
                   entries: list[tuple[bytes, IndexEntry]], deletes: Sequence[bytes],
                   expect: bytes | None = None) -> tuple[list[int], int]:
        """One index txn: (slots its deletes and overwrites freed, entries deleted).
        ``expect``: delete the one key of ``deletes`` only if its entry is still that.

        A full map is first taken for stale readers: a reader killed inside its txn (a
        ``tierkv inspect`` under ``kill -9``) pins its snapshot, and no page freed after
        it is reused. They are cleared and the txn run again; only a map still full (or
        one no dead reader held) raises ``MapFullError``, which callers report as full."""
        try:
            return self._index_txn_once(lm, env, entries, deletes, expect)
        except lmdb.MapFullError:
            if not lm.clear_stale_readers(env):
                raise
        return self._index_txn_once(lm, env, entries, deletes, expect)

    def _index_txn_once(self, lm: LmdbEnv, env: lmdb.Environment,
                        entries: list[tuple[bytes, IndexEntry]], deletes: Sequence[bytes],
                        expect: bytes | None) -> tuple[list[int], int]:
        freed: list[int] = []
        dropped: list[int] = []  # slots no entry names any more (deleted or replaced)
        deleted = 0
        txn = env.begin(write=True, db=lm.index)
        try:
            for key in deletes:
                raw = txn.get(key)
                if raw is None or (expect is not None and bytes(raw) != expect):
                    continue
                txn.delete(key)
                deleted += 1
                if (old := unpack_index(raw)) is not None:
                    freed.append(old.slot)
                    dropped.append(old.slot)
            for key, entry in entries:
                raw = txn.get(key)
                if raw is not None and (old := unpack_index(raw)) is not None \
                        and old.slot != entry.slot:
                    freed.append(old.slot)
                    dropped.append(old.slot)
                txn.put(key, pack_index(entry))
            if entries:
                last = max(entry.seq for _, entry in entries) + SHARDS
                seq_raw = txn.get(META_NEXT_SEQ, db=lm.meta)
                stored = int.from_bytes(seq_raw, "little") if seq_raw else 0
                txn.put(META_NEXT_SEQ, max(last, stored).to_bytes(8, "little"), db=lm.meta)
            with self.commit_locks[lm.shard]:  # a sync of the shard is not between syncs
                txn.commit()
        except BaseException:
            txn.abort()
            raise
        if self.trace is not None:
            for slot in dropped:
                self.trace_event("index-delete", lm.shard, slot)
            for _, entry in entries:
                self.trace_event("index-commit", lm.shard, entry.slot)
        return freed, deleted

    def delete_shard(self, lm: LmdbEnv, env: lmdb.Environment, keys: Sequence[bytes],
                      expect: bytes | None = None) -> int:
        try:
            freed, deleted = self._index_txn(lm, env, [], keys, expect)
        except lmdb.MapFullError:  # copy-on-write needs a few pages even to delete
            logger.warning("%s: map full even for %d delete(s); raise disk.max_bytes, now %s",
                           self.name, len(keys), format_bytes(self.config.max_bytes))
            return 0
        except lmdb.Error as exc:
            if not self.out_of_space(exc, 0):
                raise
            logger.warning("%s: filesystem full even for %d delete(s); free space under %s",
                           self.name, len(keys), self.root)
            return 0
        if lm.slab is not None and lm.slab.mapped:
            self._release(lm, lm.slab, freed)
        return deleted

    def sync_shard(self, lm: LmdbEnv, env: lmdb.Environment) -> None:
        try:
            if lm.slab is not None:  # the bulk, while writers go on
                lm.slab.sync()
            with self.commit_locks[lm.shard]:  # no commit between the two syncs below
                if lm.slab is not None:
                    self._sync_slab(lm, lm.slab)  # what landed meanwhile, then the index
                env.sync(True)
                self.trace_event("index-sync", lm.shard)
        except OSError as exc:
            raise BrokenError(f"{self.name}: fdatasync of {lm.path} failed: {exc}") from exc
        lm.clear_stale_readers(env)  # a dead reader pins index pages: freed at each sync

