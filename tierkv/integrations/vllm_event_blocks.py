"""What each chunk's KV events carry, kept beside the disk tier so that a restarted engine
sends the chunks it finds on disk as KV events (docs/vllm.md, "KV events").

A chunk key is a hash of vLLM's block hashes: a router needs the block hashes themselves,
the hash before them and the tokens, which the disk tier does not hold. The scheduler
keeps them, with events on, in a small LMDB environment of its own,
``<disk_path>/ns-<fingerprint>/kv-events[-dp<d>]/`` (one per data-parallel engine; it goes
with the namespace under ``tierkv rm``): a record is written when a chunk's "stored on
disk" event goes out and deleted with its "removed" one, in one transaction per step.

It is a cache of the events, never of KV: a record whose chunk is not on disk at start is
deleted, a chunk on disk without a record (a warm-up's, or one written before events were
on) is sent in no event, and an environment that cannot be opened or written is set aside
with one warning (the snapshot then misses those chunks; nothing else changes).
"""

from __future__ import annotations

import logging
import shutil
from array import array
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack

from tierkv.tiers.disk.files import FILE_MODE, make_private_dir

if TYPE_CHECKING:  # imported where an environment opens: the connector's import stays light
    import lmdb

log = logging.getLogger("tierkv.vllm")

RECORD_OVERHEAD = 4096  # LMDB's page and node overhead per record, at most (map size)


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """What a chunk's KV events carry: vLLM's block hashes of its blocks, the hash of the
    block before it, and its token ids (kept while any tier holds it; 8 bytes a token)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: array[int]


def pack(chunk: ChunkEvent) -> bytes:
    value: bytes = msgpack.packb([list(chunk.block_hashes), chunk.parent_block_hash,
                          chunk.token_ids.tolist()], use_bin_type=True)
    return value


def unpack(value: bytes) -> ChunkEvent:
    """The record :func:`pack` wrote; ValueError for anything else (a damaged file)."""
    record = msgpack.unpackb(value, raw=False, max_ext_len=0)
    if not (isinstance(record, list) and len(record) == 3):
        raise ValueError("not a KV-event block record")
    hashes, parent, tokens = record
    if not (isinstance(hashes, list) and all(isinstance(h, bytes) for h in hashes)
            and (parent is None or isinstance(parent, bytes)) and isinstance(tokens, list)
            and all(isinstance(token, int) for token in tokens)):
        raise ValueError("not a KV-event block record")
    try:
        return ChunkEvent(tuple(hashes), parent, array("l", tokens))
    except OverflowError as exc:
        raise ValueError("not a KV-event block record") from exc


class EventBlocks:
    """The environment at ``path``, sized for ``max_chunks`` records of ``record_bytes``."""

    def __init__(self, path: Path, max_chunks: int, record_bytes: int) -> None:
        import lmdb

        self.path = path
        self._map_size = max(64 << 20, 2 * max_chunks * (record_bytes + RECORD_OVERHEAD))
        self._env: lmdb.Environment | None = None
        try:
            self._env = self._open()
        except (lmdb.Error, OSError, ValueError) as exc:
            log.warning("tierkv: KV-event blocks at %s unreadable (%s); starting them anew "
                        "(a restart sends no events for the chunks on disk now)", path, exc)
            shutil.rmtree(path, ignore_errors=True)
            try:
                self._env = self._open()
            except (lmdb.Error, OSError, ValueError) as again:
                self._give_up(again)

    def _open(self) -> lmdb.Environment:
        import lmdb

        make_private_dir(self.path)
        return lmdb.open(str(self.path), map_size=self._map_size, subdir=True, sync=False,
                         metasync=False, mode=FILE_MODE, max_dbs=0, lock=True)

    def _give_up(self, exc: BaseException) -> None:
        log.warning("tierkv: KV-event blocks at %s set aside (%s): a restart sends no "
                    "events for chunks stored from now on", self.path, exc)
        if self._env is not None:
            self._env.close()
        self._env = None

    def read(self, on_disk: Container[bytes]) -> dict[bytes, ChunkEvent]:
        """The records of the chunks in ``on_disk``; every other record is deleted."""
        import lmdb

        env = self._env
        if env is None:
            return {}
        found: dict[bytes, ChunkEvent] = {}
        try:
            with env.begin(write=True) as txn:
                cursor = txn.cursor()
                for key, value in list(cursor):
                    chunk = None
                    if key in on_disk:
                        try:
                            chunk = unpack(value)
                        except (ValueError, TypeError, msgpack.ExtraData):
                            chunk = None
                    if chunk is None:
                        txn.delete(key)
                    else:
                        found[bytes(key)] = chunk
        except (lmdb.Error, OSError) as exc:
            self._give_up(exc)
            return {}
        return found

    def update(self, stored: Iterable[tuple[bytes, ChunkEvent]], removed: Iterable[bytes]) -> None:
        """Write the records of chunks now on disk, delete those of chunks no longer there."""
        import lmdb

        env = self._env
        if env is None:
            return
        try:
            with env.begin(write=True) as txn:
                for key in removed:
                    txn.delete(key)
                for key, chunk in stored:
                    txn.put(key, pack(chunk))
        except (lmdb.Error, OSError) as exc:
            self._give_up(exc)

    def close(self) -> None:
        if self._env is not None:
            self._env.sync(True)
            self._env.close()
            self._env = None


__all__ = ["ChunkEvent", "EventBlocks"]
