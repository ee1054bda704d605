"""TierKVStore, the library API: round trips through every tier, restart, namespaces,
corruption and a full disk, on real CPU tensors and real LMDB files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.reliability import support
from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.keys import chunk_keys

BPC = 2
LAYERS = 3
NUM_BLOCKS = 32
PAGE_SHAPE = (2, 4, 8)  # K/V, tokens in a block, head dim
TOKENS_PER_BLOCK = 4


def make_kv() -> list[torch.Tensor]:
    return [torch.zeros((NUM_BLOCKS, *PAGE_SHAPE), dtype=torch.float16) for _ in range(LAYERS)]


def chunk_bytes() -> int:
    return LAYERS * BPC * torch.zeros(PAGE_SHAPE, dtype=torch.float16).numel() * 2


# Room for a store's index files and claims (230 KiB fresh, 290 KiB after some writes
# here), which the disk cap counts too (issue 41): a cap of a few chunks holds none without.
INDEX_FILES = 320 << 10


def open_store(tmp_path: Path | None, kv: list[torch.Tensor], cpu_chunks: int = 4, disk_chunks: int = 64,
               model_id: str = "m", eviction_policy: str | None = None, files_bytes: int = 0,
               **disk_kw) -> TierKVStore:  # type: ignore[no-untyped-def]
    """``files_bytes``: room for the index files beside ``disk_chunks`` chunks."""
    cap = disk_chunks * (chunk_bytes() + 8192) + files_bytes
    disk = DiskTierConfig(path=tmp_path / "store", max_bytes=cap, **disk_kw) \
        if tmp_path is not None else DiskTierConfig()
    cpu_kw = {} if eviction_policy is None else {"eviction_policy": eviction_policy}
    config = StoreConfig(blocks_per_chunk=BPC, cpu=CpuTierConfig(max_bytes=cpu_chunks * chunk_bytes(), **cpu_kw),
                         disk=disk, device="cpu")
    return TierKVStore(kv, model_id=model_id, tokens_per_block=TOKENS_PER_BLOCK, config=config)


def fill(kv: list[torch.Tensor], blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in kv:
        for block in blocks:
            layer[block].copy_(torch.randn(PAGE_SHAPE, generator=gen).to(torch.float16))


def snapshot(kv: list[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [layer[blocks].clone() for layer in kv]


def keys_for(seed: int, num_chunks: int) -> list[bytes]:
    tokens = [(seed * 131 + i) % 1000 for i in range(num_chunks * BPC * TOKENS_PER_BLOCK)]
    return chunk_keys(tokens, BPC * TOKENS_PER_BLOCK)


def store_and_wait(store: TierKVStore, keys: list[bytes], blocks: list[int]) -> None:
    store.wait([store.store(keys, blocks)])
    store.poll()


def load_into(store: TierKVStore, keys: list[bytes], blocks: list[int]) -> tuple[int, tuple[bytes, ...]]:
    handle = store.load(keys, blocks)
    store.wait([handle.job_id])
    failed: tuple[bytes, ...] = ()
    for completion in store.poll():
        if completion.job_id == handle.job_id:
            failed = completion.failed_keys
    return handle.num_chunks, failed


def test_cpu_only_round_trip_and_lru_eviction() -> None:
    kv = make_kv()
    with open_store(None, kv, cpu_chunks=2) as store:
        keys = keys_for(1, 3)
        fill(kv, list(range(6)), 1)
        want = snapshot(kv, list(range(6)))
        store_and_wait(store, keys[:2], list(range(4)))
        assert store.lookup(keys) == 2
        store_and_wait(store, keys[2:], [4, 5])  # evicts the oldest chunk: no disk tier
        assert store.lookup(keys) == 0 and store.lookup(keys[1:]) == 2
        num, failed = load_into(store, keys[1:], [10, 11, 12, 13])
        assert num == 2 and not failed
        for layer, expect in zip(kv, want):
            assert torch.equal(layer[[10, 11, 12, 13]], expect[2:6])


def test_restart_serves_disk_byte_exact_and_other_namespace_sees_nothing(tmp_path: Path) -> None:
    kv = make_kv()
    keys = keys_for(2, 6)
    fill(kv, list(range(12)), 2)
    want = snapshot(kv, list(range(12)))
    with open_store(tmp_path, kv, cpu_chunks=3) as store:
        store_and_wait(store, keys[:3], list(range(6)))
        store_and_wait(store, keys[3:], list(range(6, 12)))
    # close() flushed the CPU tier: every chunk is on disk now.
    kv2 = make_kv()
    with open_store(tmp_path, kv2, cpu_chunks=3) as store:
        assert store.lookup(keys) == 6
        # Disk chunks pass through the CPU tier (3 slots here): a load moves at most that
        # many from disk; the caller loads the rest next.
        num, failed = load_into(store, keys, list(range(12, 24)))
        assert num == 3 and not failed
        num, failed = load_into(store, keys[3:], list(range(18, 24)))
        assert num == 3 and not failed
        for layer, expect in zip(kv2, want):
            assert torch.equal(layer[12:24], expect)
        assert store.statistics().index.loads_disk >= 3
    with open_store(tmp_path, make_kv(), model_id="another-model") as other:
        assert other.lookup(keys) == 0  # another namespace never serves these bytes


def corrupt_one_value(store_dir: Path, key: bytes, offset: int) -> None:
    """Flip a byte of ``key``'s value (its slot's header then payload) in place."""
    with support.raw_env(next(store_dir.glob("ns-*/part-0of1"))) as (txn, chunks, _):
        value = bytearray(txn.get(key, db=chunks))
        value[offset % len(value)] ^= 0x5A
        txn.put(key, bytes(value), db=chunks)


@pytest.mark.parametrize("offset", [0, 5, 17, 40, 300, -1])
def test_flipped_byte_is_a_miss_deleted_and_counted(tmp_path: Path, offset: int) -> None:
    kv = make_kv()
    keys = keys_for(3, 2)
    fill(kv, list(range(4)), 3)
    with open_store(tmp_path, kv, cpu_chunks=2) as store:
        store_and_wait(store, keys, list(range(4)))
    corrupt_one_value(tmp_path / "store", keys[1], offset)
    kv2 = make_kv()
    with open_store(tmp_path, kv2, cpu_chunks=2) as store:
        assert store.lookup(keys) == 2  # the index cannot know yet
        num, failed = load_into(store, keys, list(range(10, 14)))
        assert failed == (keys[1],)  # reported, never served as a hit
        assert torch.equal(kv2[0][12:14], torch.zeros_like(kv2[0][12:14]))  # nothing landed
        assert store.lookup(keys) == 1  # deleted: a miss from now on
        stats = store.statistics()
        assert stats.index.corrupt == 1 and store.disk is not None and store.disk.statistics().corrupt == 1


def test_full_disk_skips_stores_counts_and_reads_go_on(tmp_path: Path) -> None:
    kv = make_kv()
    keys = keys_for(4, 8)
    fill(kv, list(range(16)), 4)
    want = snapshot(kv, list(range(16)))
    # The disk holds 3 chunks, the CPU tier 2: most chunks cannot be kept anywhere. The cap
    # counts the store's index files too (issue 41): a store elsewhere measures them.
    with open_store(tmp_path / "probe", kv) as probe:
        files = probe._share.budgets[0].fixed_bytes  # type: ignore[union-attr]
    with open_store(tmp_path, kv, cpu_chunks=2, disk_chunks=3, write_through=True,
                    files_bytes=files) as store:
        for i in range(8):
            store_and_wait(store, keys[i : i + 1], [2 * i, 2 * i + 1])
        store.flush()
        stats = store.statistics().index
        assert stats.on_disk <= 3 and stats.disk_evictions + stats.stores_no_room > 0
        held = [k for k in keys if store.lookup([k]) == 1]
        assert held, "the newest chunks stay readable"
        for key in held:
            i = keys.index(key)
            num, failed = load_into(store, [key], [20, 21])
            assert num == 1 and not failed
            for layer, expect in zip(kv, want):
                assert torch.equal(layer[20:22], expect[2 * i : 2 * i + 2])
