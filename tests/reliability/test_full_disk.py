"""A full disk is "no room" (a value, counted), never an error: stores are skipped, reads
and the engine go on, and stores resume once space returns.

Every test runs twice:
- ``tmpfs``: the disk tier on a real 4 MiB filesystem (a tmpfs mounted for the test; this
  needs root). The filesystem fills long before the disk cap, so growing a slab
  (``posix_fallocate``) or an index commit fails with ENOSPC (or EIO from a short write).
  Space returns by deleting a file.
- ``small-slab``: the slab files may grow to 4 MiB in all (``slab_slots_for`` patched:
  tierkv's own boundary), so a slab at its limit is what fills. Space returns by
  reopening with the real limit (raising the cap). Where a tmpfs cannot be mounted, the ``tmpfs`` run falls back to
  this one and says why in a warning (shown in pytest's summary).

A third way space returns, for both: reopening with a lower ``disk.max_bytes`` evicts the
oldest chunks and new stores land again. ``tests/integration/test_disk_tier.py`` and
``test_disk_io.py`` cover a full slab at the tier and I/O-thread level.
"""

from __future__ import annotations

import os
import subprocess
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reliability import support
from tierkv.engine.store import TierKVStore
from tierkv.tiers.disk import tier as disk_module
from tierkv.tiers.disk.tier import SHARDS, DiskTier, ReadStatus, shard_of
from tierkv.tiers.disk.format import slot_bytes_for

FS_SIZE = "4m"
SMALL_MAP = 4 << 20
FILLER_BYTES = 2 << 20
STORE_OPTIONS: dict[str, Any] = dict(cpu_chunks=8, write_through=True, retry_after_full_seconds=0.05,
                                     write_batch_bytes=4 * support.CHUNK_BYTES)


@dataclass
class SmallDisk:
    root: Path  # disk.path
    kind: str  # "tmpfs" or "small-slab"
    filler: Path | None
    monkeypatch: pytest.MonkeyPatch

    def make_room(self) -> None:
        """tmpfs: delete a file (the store keeps running). small-slab: restore the real slab limit
        size; the caller reopens to raise the cap."""
        if self.filler is not None:
            self.filler.unlink()
        else:
            self.monkeypatch.setattr(disk_module, "slab_slots_for", _REAL_SLAB_SLOTS_FOR)

    @property
    def reopen_needed(self) -> bool:
        return self.filler is None


_REAL_SLAB_SLOTS_FOR = disk_module.slab_slots_for
SMALL_SLOTS = SMALL_MAP // SHARDS // slot_bytes_for(support.CHUNK_BYTES)  # per shard


def _mount_tmpfs(path: Path) -> str | None:
    """Mount a small tmpfs on ``path``; None on success, else why it could not."""
    if os.geteuid() != 0:
        return "not running as root"
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE},mode=0700", "tmpfs",
                               str(path)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    if done.returncode != 0:
        return f"mount failed: {(done.stderr or done.stdout).strip()}"
    return None


@pytest.fixture(params=["tmpfs", "small-slab"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    mounted = False
    if request.param == "tmpfs":
        reason = _mount_tmpfs(mount_point)
        if reason is None:
            mounted = True
        else:
            warnings.warn(f"full-disk test: cannot mount a {FS_SIZE} tmpfs ({reason}); "
                          f"running it on {SMALL_MAP >> 20} MiB of slabs instead", stacklevel=1)
    try:
        if mounted:
            filler = mount_point / "filler"
            filler.write_bytes(b"\0" * FILLER_BYTES)
            yield SmallDisk(mount_point / "cache", "tmpfs", filler, monkeypatch)
        else:
            monkeypatch.setattr(disk_module, "slab_slots_for", lambda *args: SMALL_SLOTS)
            yield SmallDisk(mount_point / "cache", "small-slab", None, monkeypatch)
    finally:
        if mounted:
            if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def serve_all(store: TierKVStore, kv: list[Any], keys: list[bytes]) -> int:
    """Load every chunk the store answers hit for; each must land byte-exact."""
    served = 0
    blocks = support.chunk_blocks(0, 32)
    for key in keys:
        if store.lookup([key]) != 1:
            continue
        support.poison(kv, blocks)
        num, completion = support.load_chunks(store, [key], first_block=32)
        assert num == 1 and completion is not None and completion.ok, completion
        assert support.chunk_matches(kv, key, blocks)
        served += 1
    return served


def store_when_room(store: TierKVStore, kv: list[Any], keys: list[bytes],
                    timeout: float = 10.0) -> None:
    """Store ``keys`` the way an engine does: "no room" now, so try again next step (the
    spills started meanwhile make CPU slots clean), until every chunk is present."""
    deadline = time.monotonic() + timeout
    while store.lookup(keys) < len(keys):
        assert time.monotonic() < deadline, store.statistics().index
        completion = support.store_chunks(store, kv, keys)
        assert completion is None or completion.ok, completion
        time.sleep(0.01)


def fill_until_full(store: TierKVStore, kv: list[Any], first_seed: int,
                    requests: int = 30) -> list[bytes]:
    """Store ``requests`` requests of 4 chunks (about twice what the disk holds)."""
    keys: list[bytes] = []
    for seed in range(first_seed, first_seed + requests):
        request = support.request_keys(seed)
        support.store_chunks(store, kv, request)  # a full disk never raises here
        assert store.lookup(request) >= 0
        keys += request
    store.flush()
    return keys


def test_store_skips_and_counts_stores_on_a_full_disk_and_resumes(small_disk: SmallDisk) -> None:
    kv = support.make_kv()
    store = support.open_store(small_disk.root, kv, **STORE_OPTIONS)
    try:
        keys = fill_until_full(store, kv, first_seed=500)
        stats = store.statistics().index
        assert store.disk is not None
        assert stats.disk_no_room > 0 and stats.spills_failed > 0, stats
        assert store.disk.statistics().full > 0
        assert 0 < stats.on_disk < len(keys)
        assert stats.stores_no_room + stats.dirty_dropped > 0  # skipped, and counted
        # reads go on: every chunk the store still answers hit for is served byte-exact
        assert serve_all(store, kv, keys) >= stats.on_disk
        # space returns
        small_disk.make_room()
        if small_disk.reopen_needed:
            store.close()
            store = support.open_store(small_disk.root, kv, **STORE_OPTIONS)
        time.sleep(0.06)  # retry_after_full_seconds
        assert store.disk is not None
        chunks_before = store.disk.statistics().chunks
        spills_before = store.statistics().index.spills_ok
        new = [key for seed in (900, 901) for key in support.request_keys(seed)]
        for start in (0, 4):
            store_when_room(store, kv, new[start : start + 4])
        store.flush()
        assert store.statistics().index.spills_ok >= spills_before + len(new)
        assert store.disk.statistics().chunks >= chunks_before + len(new)
    finally:
        store.close()
    kv = support.make_kv()
    with support.open_store(small_disk.root, kv, **STORE_OPTIONS) as store:
        assert store.disk is not None and store.disk.verify().bad_keys == ()
        assert store.lookup(new[:4]) == 4 and store.lookup(new[4:]) == 4
        assert serve_all(store, kv, keys + new) >= len(new)


def test_disk_tier_full_is_a_value_and_reads_go_on(small_disk: SmallDisk) -> None:
    size = support.CHUNK_BYTES
    config = support.store_config(small_disk.root).disk
    namespace = support.namespace_of()
    keys = [support.pool_key(i, b"full") for i in range(120)]

    def items(batch: list[bytes]) -> list[tuple[bytes, bytes]]:
        return [(key, support.payload_for(key, size)) for key in batch]

    def check_reads(tier: DiskTier, written: list[bytes]) -> None:
        out = bytearray(size)
        for key in written:
            assert tier.read_into(key, memoryview(out)) is ReadStatus.OK
            assert bytes(out) == support.payload_for(key, size)

    written: list[bytes] = []
    full: list[bytes] = []
    messages: set[str] = set()
    with DiskTier(small_disk.root, namespace, support.part(0), config, size) as tier:
        for start in range(0, len(keys), 6):
            result = tier.put_many(items(keys[start : start + 6]))  # never raises
            written += result.written
            full += result.full
            if result.message:
                messages.add(result.message)
        assert written and full and len(written) + len(full) == len(keys)
        assert tier.statistics().full == len(full)
        assert messages and all("disk.max_bytes" in message for message in messages), messages
        check_reads(tier, written)
        assert tier.read_into(full[-1], memoryview(bytearray(size))) is ReadStatus.MISSING
        assert tier.verify().bad_keys == ()
        # deletes make room within the same call (they run first) in their shard
        (shard,) = {shard_of(key) for key in full[:1]}
        drop = [key for key in written if shard_of(key) == shard][:4]
        result = tier.put_many(items(full[:1]), deletes=drop)
        assert result.written == tuple(full[:1]) and result.deleted == 4
        written = [key for key in written if key not in drop] + full[:1]
        full = full[1:]
    # a restart on the still full disk opens and serves what is there
    with DiskTier(small_disk.root, namespace, support.part(0), config, size) as tier:
        check_reads(tier, written)
        assert tier.put_many(items(full[:6])).full
        small_disk.make_room()
        if not small_disk.reopen_needed:
            result = tier.put_many(items(full[:6]))
            assert result.written == tuple(full[:6]), result.message
    if small_disk.reopen_needed:
        with DiskTier(small_disk.root, namespace, support.part(0), config, size) as tier:
            assert tier.put_many(items(full[:6])).written == tuple(full[:6])
    with DiskTier(small_disk.root, namespace, support.part(0), config, size) as tier:
        check_reads(tier, written + full[:6])
        assert tier.verify().bad_keys == ()


def test_a_lower_cap_evicts_chunks_and_stores_resume(small_disk: SmallDisk) -> None:
    kv = support.make_kv()
    with support.open_store(small_disk.root, kv, **STORE_OPTIONS) as store:
        old = fill_until_full(store, kv, first_seed=700, requests=25)
        assert store.statistics().index.disk_no_room > 0
    # On a full filesystem an eviction frees pages in its own shard only. The cap counts
    # the index files too (issue 41): 16 chunks' bytes hold about 9 chunks here.
    cap = 16
    kv = support.make_kv()
    with support.open_store(small_disk.root, kv, disk_chunks=cap, **STORE_OPTIONS) as store:
        new = [key for seed in (950, 951) for key in support.request_keys(seed)]
        for start in range(0, len(new), 4):
            store_when_room(store, kv, new[start : start + 4])
        store.flush()
        stats = store.statistics().index
        assert stats.on_disk <= cap and stats.spills_ok >= len(new), stats
        assert store.disk is not None and store.disk.statistics().chunks <= cap
        assert store.lookup(new[-4:]) == 4
        assert serve_all(store, kv, old + new) >= len(new)
    with support.open_store(small_disk.root, support.make_kv(), disk_chunks=cap,
                            **STORE_OPTIONS) as store:
        assert store.disk is not None and store.disk.verify().bad_keys == ()
        assert store.lookup(new[-4:]) == 4


def test_a_disk_tier_that_breaks_underneath_never_breaks_the_store(tmp_path: Path) -> None:
    """Regression: once the disk tier failed, every store call raised and close() failed on
    a spill job the worker never took. A broken disk now fails spills like a full one."""
    from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
    from tierkv.engine.store import TierKVStore
    from tierkv.keys import chunk_keys

    kv = [torch.zeros((32, 2, 4, 8), dtype=torch.float16) for _ in range(2)]
    chunk = 2 * 2 * kv[0][0].numel() * 2
    config = StoreConfig(blocks_per_chunk=2, cpu=CpuTierConfig(max_bytes=3 * chunk),
                         disk=DiskTierConfig(path=tmp_path / "store", max_bytes=64 << 20), device="cpu")
    store = TierKVStore(kv, model_id="broken-disk", tokens_per_block=4, config=config)
    keys = chunk_keys(list(range(8 * 10)), 8)
    store.wait([store.store(keys[:3], list(range(6)))])
    store.flush()
    assert store.disk is not None
    store.disk.close()  # the disk tier fails underneath the running store
    for i in range(3, 10):  # keeps storing: evictions need spills, which now fail
        store.wait([store.store(keys[i : i + 1], [2 * (i % 16), 2 * (i % 16) + 1])])
        store.poll()
    handle = store.load(keys[:1], [30, 31])  # a chunk only on disk: fails, is not a hit
    store.wait([handle.job_id])
    for completion in store.poll():
        if completion.job_id == handle.job_id:
            assert completion.failed_keys == (keys[0],)
    stats = store.statistics().index
    assert stats.spills_failed + stats.disk_no_room > 0
    store.close()  # no exception: the cache failing must not fail its user
