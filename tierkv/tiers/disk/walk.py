"""Walking one shard's index of the disk tier in short read transactions.

- :func:`rows_after` lists up to ``batch`` (key, entry) rows after a key, in a txn the
  caller holds.
- :func:`scan_shard` reads a shard's index whole, ``batch`` keys a txn, into
  :class:`~tierkv.tiers.base.ChunkRecord` s (no payload is read; the map's read-ahead
  stays on: the map holds little but the index); a shard rebuilt meanwhile is read again
  from its start.
- :func:`verify_shard` checks every entry's slot, ``batch`` entries listed a txn; an entry
  that fails is read again from the index, so a chunk rewritten or deleted meanwhile is
  checked anew or not at all, never reported bad.

:class:`~tierkv.tiers.disk.tier.DiskTier` calls them for ``scan`` and ``verify``; every txn runs
through :meth:`LmdbEnv.run <tierkv.tiers.disk.env.LmdbEnv.run>`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lmdb

from tierkv.tiers.base import ChunkRecord
from tierkv.tiers.disk.env import LmdbEnv
from tierkv.tiers.disk.format import unpack_index

__all__ = ["SlotCheck", "rows_after", "scan_shard", "verify_shard"]

# What is wrong with the slot an index entry names (None: it holds the key's payload, now
# in the buffer): (shard, key, entry, buffer) -> problem.
SlotCheck = Callable[[LmdbEnv, bytes, bytes | None, memoryview], str | None]


def rows_after(txn: Any, db: Any, last: bytes | None, batch: int) -> list[tuple[bytes, Any]]:
    """Up to ``batch`` (key, value) rows of ``db`` after key ``last``, in ``txn``."""
    rows: list[tuple[bytes, Any]] = []
    cursor = txn.cursor(db=db)
    more = cursor.set_range(last) if last is not None else cursor.first()
    if more and last is not None and bytes(cursor.key()) == last:
        more = cursor.next()
    while more and len(rows) < batch:
        rows.append((bytes(cursor.key()), bytes(cursor.value())))
        more = cursor.next()
    return rows


def scan_shard(lm: LmdbEnv, batch: int) -> list[ChunkRecord]:
    """Every chunk of the shard's index as a record, read whole (see the module docstring)."""
    records: list[ChunkRecord] = []
    last: bytes | None = None
    replaced = lm.replacements

    def rows_of(env: lmdb.Environment) -> list[tuple[bytes, bytes]]:
        with env.begin(db=lm.index) as txn:
            return rows_after(txn, lm.index, last, batch)

    # With the map's read-ahead on: the map holds the index and little else since the
    # payloads moved to slab files (format 4), and a scan reads all of it; MADV_RANDOM made
    # a cold restart slower for 17-47% fewer bytes (docs/benchmarks/disk.md, "Restart per
    # tier size").
    while True:
        rows = lm.run("scanning", rows_of)
        if lm.replacements != replaced:  # rebuilt meanwhile: start over
            records, replaced = [], lm.replacements
            if last is not None:
                last = None
                continue
        records += [ChunkRecord(key, entry.payload_len, entry.seq) for key, raw in rows
                    if (entry := unpack_index(raw)) is not None]
        if len(rows) < batch:
            return records
        last = rows[-1][0]


def verify_shard(lm: LmdbEnv, batch: int, scratch: memoryview, progress: Callable[[int], None],
                 read_slot: SlotCheck) -> tuple[int, list[tuple[bytes, bytes]]]:
    """(entries checked, (bad key, its entry)) of one shard; ``read_slot`` checks a slot
    (into ``scratch``), ``progress`` is told the entries checked so far."""

    def rows_of(env: lmdb.Environment, last: bytes | None) -> list[tuple[bytes, bytes]]:
        with env.begin(db=lm.index) as txn:
            return rows_after(txn, lm.index, last, batch)

    def bad_of(env: lmdb.Environment, key: bytes, raw: bytes) -> bytes | None:
        """The entry of ``key`` that fails its checks, reading it again when it does."""
        for _ in range(3):
            if read_slot(lm, key, raw, scratch) is None:
                return None
            with env.begin(db=lm.index) as txn:
                now = txn.get(key)
            if now is None:
                return None
            if now == raw:
                return raw
            raw = now
        return None

    bad: list[tuple[bytes, bytes]] = []
    checked, replaced = 0, lm.replacements
    last: bytes | None = None
    while lm.replacements == replaced:
        rows = lm.run("verifying", partial(rows_of, last=last))
        for key, raw in rows:
            found = lm.run("verifying", partial(bad_of, key=key, raw=raw))
            if found is not None:
                bad.append((key, found))
        checked += len(rows)
        progress(checked)
        if len(rows) < batch:
            break
        last = rows[-1][0]
    return checked, bad
