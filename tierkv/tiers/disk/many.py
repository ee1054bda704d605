"""Many chunks of several disk shards read at once, for one caller thread.

A cold load of small chunks waited on the device with few reads queued: a reader thread
that reads one chunk at a time keeps one chunk's pieces in flight, whatever the bound
(docs/benchmarks/disk.md, "O_DIRECT reads"), and one that drains its reads at each shard's
end keeps one shard's (a reader's call of 16 small chunks was 4 windows of about 4). So
:func:`read_shards` keeps one window of reads in flight across the shards of its batch: it
starts the reads of every chunk (:meth:`~tierkv.tiers.disk.slab.SlabFile.start_read`:
header block and payload in one call on the tier's :class:`~tierkv.tiers.disk.reads.
ReadPool`; pieces only for a chunk read alone, since the other chunks fill the queue),
shard after shard without waiting at a shard's end, and checks each chunk as its reads
finish, oldest first. What it has started and not yet checked stays within the pool's bound
(``disk.read_bytes_in_flight``): one reader alone fills the queue, and several share it.

- :func:`read_shards` ``(groups, pool, entry_of, judge)``: ``groups`` is ``(lm, batch)`` per
  shard; per shard the index entries of every ``(key, out)`` of its batch in one LMDB read
  txn, then the slot reads; per shard and chunk ``(raw entry or None, what is wrong or
  None)`` as :meth:`DiskTier.read_into <tierkv.tiers.disk.tier.DiskTier.read_into>` judges
  one (``entry_of(lm, key, raw)``: the entry, or what is wrong with it; the slot's header
  check and checksum, ``judge``, then run on every chunk read). No read started is still
  running when it returns or raises.
- :func:`head_blocks` ``(count)``: this thread's ``count`` page-aligned header blocks.

**Lock order.** A slot read needs its shard's slab file open and unmoved, which the
shard's guard (:class:`~tierkv.tiers.disk.guard.Guard`, a shared section of
:meth:`LmdbEnv.run <tierkv.tiers.disk.env.LmdbEnv.run>`) ensures: repair and close take
the exclusive section. So a window spanning shards holds the shared sections of all its
shards at once, nested: shard ``a``'s ``run`` calls shard ``b``'s inside it. What keeps that
deadlock-free:

1. Guards are entered in ascending shard order only (``groups`` sorted, each shard once;
   the guard is not reentrant). A thread holding shard ``a``'s section waits only for a
   higher shard's guard, for the read pool's bound (freed by the pool's threads, which take
   no lock but the pool's own) and for LMDB read txns (readers never wait on LMDB's
   writer lock).
2. An exclusive section of shard ``b`` is requested by a thread holding no section, or
   (the nested ``run``'s repair of ``b``) only sections of shards below ``b``; its holder
   then waits for nothing that a section holder keeps.
3. Writers (:mod:`tierkv.tiers.disk.write`) hold one shard's section at a time and take
   that shard's commit lock and LMDB write lock inside it, never a guard inside those.

Along any chain of waits the shard waited for never decreases and whoever holds the highest
one waits on nothing held, so no cycle forms. The error of a later shard's call is carried
through an earlier shard's ``run`` untouched (:class:`_Later`): that ``run`` must not take
it for its own shard's damage and repair or retry the wrong environment.
"""

from __future__ import annotations

import mmap
import threading
from collections import deque
from collections.abc import Callable, Sequence

import lmdb

from tierkv.tiers.disk.env import LmdbEnv
from tierkv.tiers.disk.format import HEADER_BLOCK, IndexEntry
from tierkv.tiers.disk.reads import ReadPool
from tierkv.tiers.disk.slab import PendingRead, SlabFile

_LOCAL = threading.local()

# (lm, key, raw index entry) -> the entry, or what is wrong with it
EntryCheck = Callable[[LmdbEnv, bytes, bytes | None], IndexEntry | str]
# (key, entry, header block, bytes read, out) -> what is wrong with the slot, or None
SlotCheck = Callable[[bytes, IndexEntry, memoryview, int, memoryview], str | None]
Found = tuple[bytes | None, str | None]  # (raw index entry, what is wrong)
_UNREAD: Found = (None, "read never finished")


class _Later(Exception):
    """An error raised in a later shard's call, carried unchanged through this one's."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


def head_blocks(count: int) -> list[memoryview]:
    """``count`` page-aligned header blocks of this thread (an anonymous map, grown as
    needed), valid until this thread's next call."""
    blocks: list[memoryview] = getattr(_LOCAL, "blocks", [])
    if len(blocks) < count:
        arena = mmap.mmap(-1, max(count, 2 * len(blocks)) * HEADER_BLOCK)
        view = memoryview(arena)
        blocks = [view[i : i + HEADER_BLOCK] for i in range(0, len(view), HEADER_BLOCK)]
        _LOCAL.arena, _LOCAL.blocks = arena, blocks
    return blocks[:count]


def read_shards(groups: Sequence[tuple[LmdbEnv, Sequence[tuple[bytes, memoryview]]]],
                pool: ReadPool, entry_of: EntryCheck, judge: SlotCheck) -> list[list[Found]]:
    """See the module docstring."""
    order = [lm.shard for lm, _ in groups]
    if order != sorted(set(order)):
        raise ValueError(f"shards must be given once each, in ascending order: {order}")
    results: list[list[Found]] = [[_UNREAD] * len(batch) for _, batch in groups]
    starts = [0]  # each group's first header block
    for _, batch in groups:
        starts.append(starts[-1] + len(batch))
    total = starts[-1]
    heads = head_blocks(total)
    # (group, position, key, out, slab, entry, pending), oldest first, all groups'
    window: deque[tuple[int, int, bytes, memoryview, SlabFile, IndexEntry, PendingRead]] = \
        deque()

    def finish_oldest() -> None:
        group, position, key, out, slab, entry, pending = window.popleft()
        count = slab.finish_read(pending)
        results[group][position] = (results[group][position][0],
                                    judge(key, entry, pending.head, count, out))

    def drop(group: int) -> None:
        """No read of ``group``'s shard may run on once its section is left (an error)."""
        kept = [item for item in window if item[0] != group]
        for item in window:
            if item[0] == group:
                ReadPool.gather(item[6].futures, raise_first=False)
        window.clear()
        window.extend(kept)

    def shard_reads(group: int, env: lmdb.Environment) -> None:
        lm, batch = groups[group]
        with env.begin(db=lm.index) as txn:
            raws: list[bytes | None] = [txn.get(key) for key, _ in batch]
        found = results[group]
        slab = lm.slab
        cost = HEADER_BLOCK + (slab.payload_bytes if slab is not None else 0)
        try:
            for position, ((key, out), raw) in enumerate(zip(batch, raws)):
                entry = None if raw is None else entry_of(lm, key, raw)
                if entry is None or isinstance(entry, str):
                    found[position] = (raw, entry)
                    continue
                assert slab is not None  # entry_of said so
                found[position] = (raw, _UNREAD[1])
                while window and (len(window) + 1) * cost > pool.limit:
                    finish_oldest()
                window.append((group, position, key, out, slab, entry, slab.start_read(
                    entry.slot, out, heads[starts[group] + position], pool, pieces=total == 1)))
                pool.note_started(len(window) * cost)
            if group + 1 < len(groups):
                try:
                    shard_call(group + 1)
                except _Later:
                    raise
                except BaseException as exc:
                    raise _Later(exc) from None
            while window:
                finish_oldest()
        except BaseException:
            drop(group)
            raise

    def shard_call(group: int) -> None:
        lm, batch = groups[group]
        lm.run("reading chunks", lambda env: shard_reads(group, env), batch[0][0])

    try:
        if groups:
            shard_call(0)
    except _Later as carried:
        raise carried.error from None
    return results


__all__ = ["Found", "head_blocks", "read_shards"]
