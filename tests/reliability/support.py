"""Shared helpers of the reliability suite: one small KV geometry, chunk bytes derived from
the chunk key alone, a TierKVStore factory, raw access to the index and the slab files
for fault injection and a forkserver for child processes.

A chunk's bytes are a pure function of its key (:func:`payload_for`), and
:func:`fill_chunk` lays them into the KV blocks so that the CPU slot, and therefore the
disk payload, holds exactly ``payload_for(key)`` (the slot layout is layer-major, see
``tierkv/transfer/layout.py``). Any process can then check any chunk it finds, through
the store (loaded blocks) or the disk tier (raw payload), without being told what was
written.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import lmdb
import torch

from tests import forkserver as forkserver_lib
from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.core.jobs import Completion
from tierkv.engine.store import TierKVStore, build_namespace
from tierkv.keys import Namespace, Part, chunk_keys
from tierkv.tiers.disk.tier import SHARDS, shard_of
from tierkv.tiers.disk.format import (HEADER_BLOCK, IndexEntry, pack_index, parse_header,
                                      slot_bytes_for, unpack_index)
from tierkv.tiers.disk.slab import SLAB_NAME
from tierkv.transfer.layout import KVLayout

LAYERS = 2
NUM_BLOCKS = 64
PAGE_SHAPE = (2, 16, 256)  # K/V, tokens per block, bytes per token row: 8 KiB per page
PAGE_BYTES = 2 * 16 * 256
TOKENS_PER_BLOCK = 16
BPC = 4  # blocks per chunk
CHUNK_BYTES = LAYERS * BPC * PAGE_BYTES  # 64 KiB
TOKENS_PER_CHUNK = TOKENS_PER_BLOCK * BPC
MODEL_ID = "reliability-tiny"
DISK_OVERHEAD = 8192  # tierkv.engine.store.DISK_OVERHEAD_BYTES


def make_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, *PAGE_SHAPE), dtype=torch.uint8) for _ in range(LAYERS)]


TP_SIZE = 2  # the stores here are ranks of a TP=2 engine: part-<rank>of2 directories


def part(rank: int = 0) -> Part:
    """The part a store of ``rank`` writes (its directory ``part-<rank>of2``)."""
    return Part(rank, TP_SIZE)


def store_config(root: Path | None, *, cpu_chunks: int = 16, disk_chunks: int = 1024,
                 rank: int = 0, **disk: Any) -> StoreConfig:
    disk_config = DiskTierConfig() if root is None else DiskTierConfig(
        path=root, max_bytes=disk_chunks * (CHUNK_BYTES + DISK_OVERHEAD), **disk)
    return StoreConfig(blocks_per_chunk=BPC, cpu=CpuTierConfig(max_bytes=cpu_chunks * CHUNK_BYTES,
                                                               pin_memory="never"),
                       disk=disk_config, device="cpu", rank=rank, tp_size=TP_SIZE)


def open_store(root: Path | None, kv: list[torch.Tensor] | None = None,
               model_id: str = MODEL_ID, **options: Any) -> TierKVStore:
    return TierKVStore(make_kv() if kv is None else kv, model_id=model_id,
                       tokens_per_block=TOKENS_PER_BLOCK, config=store_config(root, **options))


def namespace_of(model_id: str = MODEL_ID, **options: Any) -> Namespace:
    """The namespace :func:`open_store` uses (for DiskTier-level access to its data)."""
    return build_namespace(KVLayout.from_tensors(make_kv()), model_id, TOKENS_PER_BLOCK,
                           store_config(None, **options))


def binding(model_id: str = MODEL_ID, rank: int = 0, **options: Any) -> bytes:
    """What every value of :func:`open_store`'s namespace and ``rank`` is bound to (for
    crafting values whose checksum is right)."""
    from tierkv.tiers.disk.format import binding_of

    return binding_of(namespace_of(model_id, **options).fingerprint(), Part(rank, TP_SIZE))


def payload_for(key: bytes, size: int = CHUNK_BYTES, variant: bytes = b"") -> bytes:
    """The bytes of the chunk ``key``: a pure function of the key (and of ``variant``, for
    two stores that must hold different bytes under one key)."""
    return random.Random(hashlib.sha256(b"payload" + variant + key).digest()).randbytes(size)


def pool_key(i: int, salt: bytes = b"pool") -> bytes:
    return hashlib.sha256(salt + i.to_bytes(8, "big")).digest()


def request_keys(seed: int, num_chunks: int = 4, parent: bytes | None = None) -> list[bytes]:
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(num_chunks * TOKENS_PER_CHUNK)]
    if parent is None:
        return [bytes(k) for k in chunk_keys(tokens, TOKENS_PER_CHUNK)]
    return [bytes(k) for k in chunk_keys(tokens, TOKENS_PER_CHUNK, parent=parent)]


def chunk_blocks(position: int, first_block: int = 0) -> list[int]:
    start = first_block + position * BPC
    return list(range(start, start + BPC))


def _pages(key: bytes, variant: bytes = b"") -> list[torch.Tensor]:
    """Per layer, ``[BPC, *PAGE_SHAPE]`` uint8 pages whose slot layout is ``payload_for(key)``."""
    data = torch.frombuffer(bytearray(payload_for(key, variant=variant)), dtype=torch.uint8)
    per_layer = BPC * PAGE_BYTES
    return [data[layer * per_layer:(layer + 1) * per_layer].view(BPC, *PAGE_SHAPE)
            for layer in range(LAYERS)]


def _index(blocks: Sequence[int]) -> slice | torch.Tensor:
    """A slice for consecutive block ids (a view, fast), else an index tensor."""
    ids = [int(b) for b in blocks]
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return torch.tensor(ids, dtype=torch.long)


def fill_chunk(kv: list[torch.Tensor], key: bytes, blocks: Sequence[int],
               variant: bytes = b"") -> None:
    index = _index(blocks)
    for layer, pages in zip(kv, _pages(key, variant)):
        layer[index] = pages


def chunk_matches(kv: list[torch.Tensor], key: bytes, blocks: Sequence[int],
                  variant: bytes = b"") -> bool:
    index = _index(blocks)
    return all(torch.equal(layer[index], pages)
               for layer, pages in zip(kv, _pages(key, variant)))


def poison(kv: list[torch.Tensor], blocks: Sequence[int], value: int = 0xEE) -> None:
    index = _index(blocks)
    for layer in kv:
        layer[index] = value


def untouched(kv: list[torch.Tensor], blocks: Sequence[int], value: int = 0xEE) -> bool:
    index = _index(blocks)
    return all(bool((layer[index] == value).all()) for layer in kv)


def store_chunks(store: TierKVStore, kv: list[torch.Tensor], keys: Sequence[bytes],
                 first_block: int = 0, variant: bytes = b"") -> Completion | None:
    """Fill blocks with each key's bytes, store them and wait; returns the store completion."""
    blocks = [chunk_blocks(i, first_block) for i in range(len(keys))]
    for key, chunk in zip(keys, blocks):
        fill_chunk(kv, key, chunk, variant)
    job = store.store(list(keys), blocks)
    if job is None:
        return None
    store.wait([job])
    return next((c for c in store.poll() if c.job_id == job), None)


def load_chunks(store: TierKVStore, keys: Sequence[bytes],
                first_block: int = 32) -> tuple[int, Completion | None]:
    """Load ``keys`` into blocks from ``first_block`` on; (chunks planned, completion)."""
    blocks = [chunk_blocks(i, first_block) for i in range(len(keys))]
    handle = store.load(list(keys), blocks)
    if handle.job_id is None:
        return 0, None
    store.wait([handle.job_id])
    return handle.num_chunks, next((c for c in store.poll() if c.job_id == handle.job_id), None)


def env_dirs(root: Path) -> list[Path]:
    """The part directories under ``root`` (each holds one environment per shard)."""
    return sorted(p for p in root.glob("ns-*/part-*") if ".broken-" not in p.name
                  and ".foreign-" not in p.name)


def shard_dirs(env_dir: Path) -> list[Path]:
    """The shard environments of a rank directory (``env_dir`` itself if it is one)."""
    if (env_dir / "data.mdb").exists() or env_dir.name.startswith("shard-"):
        return [env_dir]
    return [env_dir / f"shard-{shard}" for shard in range(SHARDS)]


def data_files(env_dir: Path) -> list[Path]:
    """Every ``data.mdb`` of a rank directory's shards."""
    return [shard / "data.mdb" for shard in shard_dirs(env_dir)]


def slab_files(env_dir: Path) -> list[Path]:
    """Every slab file (the payloads) of a rank directory's shards."""
    return [shard / SLAB_NAME for shard in shard_dirs(env_dir)]


class ShardedTxn:
    """Write txns on every shard of a rank: ``get``/``put``/``delete`` go to the key's.

    ``db="index"`` is the raw index entry. ``db="chunks"`` is the chunk's *value* as format
    3 stored it in LMDB, which format 4 splits between the index and the slab: the slot's
    prefix and header, then its payload (``get``); ``put`` writes a value's prefix and
    header into the key's slot (a new one at the slab's end for a key without an entry),
    its payload after them (clipped to the slot), and points the index entry at it with the
    sequence and checksum its header claims and the payload length the value has, so only
    the checks of the slot's bytes decide (``delete`` drops the index entry)."""

    def __init__(self, txns: dict[int, tuple[lmdb.Transaction, dict[str, Any], Path]]) -> None:
        self._txns = txns

    def _of(self, key: bytes, db: str) -> tuple[lmdb.Transaction, Any, Path]:
        txn, dbs, path = self._txns[shard_of(key)] if len(self._txns) > 1 else self._txns[0]
        return txn, dbs["index"], path

    def _entry(self, key: bytes) -> IndexEntry | None:
        txn, index, _ = self._of(key, "index")
        raw = txn.get(key, db=index)
        return None if raw is None else unpack_index(bytes(raw))

    def _payload_len(self, fallback: int) -> int:
        for txn, dbs, _ in self._txns.values():
            for _, raw in txn.cursor(db=dbs["index"]):
                entry = unpack_index(bytes(raw))
                if entry is not None:
                    return entry.payload_len
        return fallback

    def get(self, key: bytes, db: str) -> Any:
        txn, index, path = self._of(key, db)
        if db == "index":
            return txn.get(key, db=index)
        entry = self._entry(key)
        if entry is None:
            return None
        slot_bytes = slot_bytes_for(entry.payload_len)
        with open(path / SLAB_NAME, "rb") as slab:
            slab.seek(entry.slot * slot_bytes)
            block = slab.read(HEADER_BLOCK)
            payload = slab.read(entry.payload_len)
        header_len = min(int.from_bytes(block[2:4], "little"), 64)
        return block[: 4 + header_len] + payload

    def put(self, key: bytes, value: bytes, db: str) -> bool:
        txn, index, path = self._of(key, db)
        if db == "index":
            return bool(txn.put(key, value, db=index))
        parsed = parse_header(value)
        if isinstance(parsed, str):
            fields, start = [0, 0, 0, 0], min(len(value), HEADER_BLOCK)
        else:
            fields, start = parsed
        old = self._entry(key)
        payload_len = old.payload_len if old is not None else self._payload_len(len(value) - start)
        slot_bytes = slot_bytes_for(payload_len)
        with open(path / SLAB_NAME, "r+b") as slab:
            if old is not None:
                slot = old.slot
            else:
                slab.seek(0, os.SEEK_END)
                slot = -(-slab.tell() // slot_bytes)
            slab.seek(slot * slot_bytes)
            slab.write(value[:start].ljust(HEADER_BLOCK, b"\0"))
            slab.write(value[start:][: slot_bytes - HEADER_BLOCK])
            if slab.tell() < (slot + 1) * slot_bytes:
                slab.truncate(max((slot + 1) * slot_bytes, os.fstat(slab.fileno()).st_size))
        seq, check = (fields[2], fields[3]) if isinstance(parsed, tuple) else (
            (old.seq, old.checksum) if old is not None else (1, 0))
        entry = IndexEntry(0, slot, len(value) - start, seq, check)
        return bool(txn.put(key, pack_index(entry), db=index))

    def delete(self, key: bytes, db: str) -> bool:
        txn, index, _ = self._of(key, db)
        return bool(txn.delete(key, db=index))

    def clear(self, key: bytes) -> None:
        """Zero the key's slot, its index entry left naming it: the value is gone."""
        entry = self._entry(key)
        assert entry is not None, key
        _, _, path = self._of(key, "chunks")
        slot_bytes = slot_bytes_for(entry.payload_len)
        with open(path / SLAB_NAME, "r+b") as slab:
            slab.seek(entry.slot * slot_bytes)
            slab.write(bytes(slot_bytes))


@contextmanager
def raw_env(env_dir: Path) -> Iterator[tuple[ShardedTxn, str, str]]:
    """Write txns on a (closed) tier's environments and slab files, opened directly:
    (txn, "chunks", "index"), the txn routing each key to its shard (see
    :class:`ShardedTxn`). Fault injection at tierkv's boundary, not a mock."""
    with ExitStack() as stack:
        txns: dict[int, tuple[lmdb.Transaction, dict[str, Any], Path]] = {}
        for shard, path in enumerate(shard_dirs(env_dir)):
            env = lmdb.open(str(path), max_dbs=4, subdir=True)
            stack.callback(env.close)
            dbs = {"index": env.open_db(b"index")}
            txns[shard] = (stack.enter_context(env.begin(write=True)), dbs, path)
        yield ShardedTxn(txns), "chunks", "index"


forkserver_lib.preload("tests.reliability.support")


def forkserver() -> Any:
    """The test process's forkserver context (tests/forkserver.py), this module preloaded."""
    return forkserver_lib.context()


def subdb_root(env_dir: Path, name: bytes) -> tuple[int, int]:
    """(root page number, page size) of sub-database ``name`` of a closed environment: the
    main database holds each named one's ``MDB_db`` record (48 bytes, root at offset 40)."""
    env = lmdb.open(str(env_dir), max_dbs=4, subdir=True, readonly=True)
    try:
        with env.begin() as txn:
            record = txn.get(name)
        psize = int(env.stat()["psize"])
    finally:
        env.close()
    assert record is not None and len(record) == 48, record
    return int.from_bytes(record[40:48], "little"), psize


def damage_page(env_dir: Path, pgno: int, psize: int) -> None:
    """Clear the flags of page ``pgno`` of ``data.mdb`` (neither branch nor leaf any more):
    a damaged B-tree page, as a bit flip in a structural page leaves it."""
    with open(env_dir / "data.mdb", "r+b") as file:
        file.seek(pgno * psize + 10)  # MDB_page: pgno (8), pad (2), flags (2)
        file.write(b"\x00\x00")


def damage_subdb(env_dir: Path, name: bytes, keys: Sequence[bytes] | None = None) -> None:
    """Damage sub-database ``name`` of every shard of ``env_dir`` that has one (of those
    holding ``keys``, when given)."""
    shards = shard_dirs(env_dir)
    if keys is not None:
        shards = [shards[shard] for shard in sorted({shard_of(key) for key in keys})]
    for shard in shards:
        pgno, psize = subdb_root(shard, name)
        if pgno != 2**64 - 1:  # P_INVALID: an empty sub-database has no page to damage
            damage_page(shard, pgno, psize)


def damage_slab(env_dir: Path, how: str, keys: Sequence[bytes] | None = None) -> None:
    """Damage the slab file of every shard of ``env_dir`` (of those holding ``keys``, when
    given): ``"missing"`` deletes it (the index still names its chunks: damage of the
    environment), ``"truncated"`` cuts it to nothing (each chunk's slot is past its end)."""
    shards = shard_dirs(env_dir)
    if keys is not None:
        shards = [shards[shard] for shard in sorted({shard_of(key) for key in keys})]
    for shard in shards:
        if how == "missing":
            (shard / SLAB_NAME).unlink()
        else:
            os.truncate(shard / SLAB_NAME, 0)
