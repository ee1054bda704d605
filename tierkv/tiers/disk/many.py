"""Many chunks of one disk shard read at once, for one caller thread.

A cold load of small chunks waited on the device with few reads queued: a reader thread
that reads one chunk at a time keeps one chunk's pieces in flight, whatever the bound
(docs/benchmarks/disk.md, "O_DIRECT reads"). So :func:`read_shard_batch` starts the reads of
every chunk of its batch (:meth:`~tierkv.tiers.disk.slab.SlabFile.start_read`: header block
and payload in one call on the tier's :class:`~tierkv.tiers.disk.reads.ReadPool`; pieces
only for a chunk read alone, since the other chunks fill the queue) and checks each chunk as its reads finish, oldest first. What it has started and not
yet checked stays within the pool's bound (``disk.read_bytes_in_flight``): one reader alone
fills the queue, and several share it.

- :func:`read_shard_batch` ``(lm, batch, pool, check, env)``: the index entries of every
  ``(key, out)`` of ``batch`` in one LMDB read txn, then the slot reads; per chunk ``(raw
  entry or None, what is wrong or None)`` as :meth:`DiskTier.read_into
  <tierkv.tiers.disk.tier.DiskTier.read_into>` judges one (``check(lm, key, raw)``: the
  entry's slot, or what is wrong with the entry; the slot's header check and checksum then
  run on every chunk). No read started is still running when it returns or raises.
- :func:`head_blocks` ``(count)``: this thread's ``count`` page-aligned header blocks.
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
from tierkv.tiers.disk.slab import PendingRead

_LOCAL = threading.local()

# (lm, key, raw index entry) -> the entry, or what is wrong with it
EntryCheck = Callable[[LmdbEnv, bytes, bytes | None], IndexEntry | str]
# (key, entry, header block, bytes read, out) -> what is wrong with the slot, or None
SlotCheck = Callable[[bytes, IndexEntry, memoryview, int, memoryview], str | None]


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


def read_shard_batch(lm: LmdbEnv, batch: Sequence[tuple[bytes, memoryview]], pool: ReadPool,
                     entry_of: EntryCheck, judge: SlotCheck, env: lmdb.Environment
                     ) -> list[tuple[bytes | None, str | None]]:
    """See the module docstring."""
    with env.begin(db=lm.index) as txn:
        raws: list[bytes | None] = [txn.get(key) for key, _ in batch]
    results: list[tuple[bytes | None, str | None]] = [(raw, None) for raw in raws]
    slab = lm.slab
    if slab is None:
        return [(raw, None if raw is None else "slab file missing") for raw in raws]
    heads = head_blocks(len(batch))
    window: deque[tuple[int, IndexEntry, PendingRead]] = deque()
    cost = HEADER_BLOCK + slab.payload_bytes  # what one chunk holds in flight

    def finish_oldest() -> None:
        position, entry, pending = window.popleft()
        key, out = batch[position]
        count = slab.finish_read(pending)
        results[position] = (raws[position], judge(key, entry, pending.head, count, out))

    try:
        for position, ((key, out), raw) in enumerate(zip(batch, raws)):
            if raw is None:
                continue
            entry = entry_of(lm, key, raw)
            if isinstance(entry, str):
                results[position] = (raw, entry)
                continue
            while window and (len(window) + 1) * cost > pool.limit:
                finish_oldest()
            window.append((position, entry, slab.start_read(
                entry.slot, out, heads[position], pool, pieces=len(batch) == 1)))
            pool.note_started(len(window) * cost)
        while window:
            finish_oldest()
    finally:
        for _, _, pending in window:  # an error: no read may still write into a slot
            ReadPool.gather(pending.futures, raise_first=False)
    return results


__all__ = ["head_blocks", "read_shard_batch"]
