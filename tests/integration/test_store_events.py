"""The library store's KV events and usage gauges (issue 45), on real LMDB files in temp
dirs and a real Redis cluster: every kind of event a router needs (disk stores, spills,
cap evictions, damaged values, the remote tier, the snapshot of the disk at start), and
``usage()`` against the index, the Prometheus scrape and ``tierkv inspect``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from redis.cluster import RedisCluster as ClusterClient

from tests.integration.test_remote_store import (caches, cluster, config,  # noqa: F401 (fixture)
                                                 conversation, loaded, store_all)
from tests.integration.test_remote_store import TPC as REMOTE_TPC
from tests.integration.test_store import (BPC, INDEX_FILES, TOKENS_PER_BLOCK, chunk_bytes,
                                          corrupt_one_value,
                                          keys_for, load_into, make_kv, store_and_wait)
from tests.redis_cluster import RedisCluster
from tierkv import chunk_keys
from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.core.plans import CpuState, DiskState
from tierkv.engine.metrics import TierUsage, register_store_metrics
from tierkv.engine.store import TierKVStore
from tierkv.tiers.remote.format import redis_key

TPC = BPC * TOKENS_PER_BLOCK
Event = tuple[str, str, bytes]


def open_store(root: Path, cpu_chunks: int, disk_chunks: int) -> TierKVStore:
    """A store that records events, ``disk_chunks`` of disk (each chunk with its overhead,
    and room for the index files, which the cap counts)."""
    config = StoreConfig(blocks_per_chunk=BPC, device="cpu",
                         cpu=CpuTierConfig(max_bytes=cpu_chunks * chunk_bytes()),
                         disk=DiskTierConfig(path=root / "store",
                                             max_bytes=disk_chunks * (chunk_bytes() + 8192)
                                             + INDEX_FILES))
    return TierKVStore(make_kv(), model_id="m", tokens_per_block=TOKENS_PER_BLOCK,
                       config=config, record_events=True)


class Replay:
    """A router's view: what each medium holds, from the events alone."""

    def __init__(self) -> None:
        self.held: set[tuple[str, bytes]] = set()
        self.seen: list[Event] = []

    def apply(self, events: list[Event]) -> None:
        for kind, medium, key in events:
            if kind == "stored":
                assert (medium, key) not in self.held, f"{medium} stored twice"
                self.held.add((medium, key))
            else:
                assert (medium, key) in self.held, f"{medium} removed, never stored"
                self.held.remove((medium, key))
        self.seen.extend(events)

    def matches(self, store: TierKVStore, keys: list[bytes]) -> None:
        """What the events say each local tier holds is what the index holds."""
        held = set()
        for key in keys:
            entry = store.index.entry(key)
            if entry is not None and entry.cpu is CpuState.READY:
                held.add(("CPU", key))
            if entry is not None and entry.disk is DiskState.ON_DISK:
                held.add(("DISK", key))
        assert {item for item in self.held if item[0] != "REMOTE"} == held


def test_spills_disk_stores_and_cap_evictions_are_events(tmp_path: Path) -> None:
    keys = keys_for(7, 8)
    replay = Replay()
    with open_store(tmp_path, cpu_chunks=2, disk_chunks=3) as store:
        assert store.take_events() == []  # an empty disk: an empty snapshot
        for index, key in enumerate(keys):  # one chunk at a time through 2 CPU slots
            store_and_wait(store, [key], [2 * index, 2 * index + 1])
            replay.apply(store.take_events())
            replay.matches(store, keys)
        store.flush()
        replay.apply(store.take_events())
        replay.matches(store, keys)
        stats = store.statistics().index
        assert stats.spills_ok >= 3 and stats.disk_evictions >= 1 and stats.cpu_evictions >= 1
        kinds = {(kind, medium) for kind, medium, _ in replay.seen}
        assert kinds == {("stored", "CPU"), ("removed", "CPU"), ("stored", "DISK"),
                         ("removed", "DISK")}
        # Every chunk went to disk through a spill; the evicted ones left it.
        assert [key for kind, medium, key in replay.seen if (kind, medium) == ("stored", "DISK")] \
            == keys
        evicted = [key for kind, medium, key in replay.seen if (kind, medium) == ("removed", "DISK")]
        assert len(evicted) == stats.disk_evictions and evicted == keys[:len(evicted)]


def test_a_restart_sends_the_disk_tier_in_batches_and_a_damaged_value_is_removed(
        tmp_path: Path) -> None:
    keys = keys_for(8, 7)
    with open_store(tmp_path, cpu_chunks=8, disk_chunks=16) as store:
        store_and_wait(store, keys, list(range(2 * len(keys))))
    corrupt_one_value(tmp_path / "store", keys[3], 300)
    with open_store(tmp_path, cpu_chunks=8, disk_chunks=16) as store:
        batches = [store.take_events(max_chunks=3) for _ in range(4)]
        assert [len(batch) for batch in batches] == [3, 3, 1, 0]  # bounded, then done
        snapshot = [event for batch in batches for event in batch]
        assert sorted(snapshot) == sorted(("stored", "DISK", key) for key in keys)
        replay = Replay()
        replay.apply(snapshot)
        num, failed = load_into(store, keys, list(range(2 * len(keys))))
        assert num == len(keys) and failed == (keys[3],)
        events = store.take_events()
        # The damaged value is deleted: removed from disk; the others are promoted.
        assert ("removed", "DISK", keys[3]) in events
        assert sorted(events) == sorted([("removed", "DISK", keys[3])] + [
            ("stored", "CPU", key) for key in keys if key != keys[3]])
        replay.apply(events)
        replay.matches(store, keys)


def test_usage_agrees_with_the_index_the_scrape_and_tierkv_inspect(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = keys_for(9, 5)
    with open_store(tmp_path, cpu_chunks=2, disk_chunks=8) as store:
        for index, key in enumerate(keys):
            store_and_wait(store, [key], [2 * index, 2 * index + 1])
        store.flush()
        usage = store.usage()
        stats = store.statistics().index
        registry = CollectorRegistry()
        register_store_metrics(store, registry, labels={"engine": "a"})
        text = generate_latest(registry).decode()
    cb = chunk_bytes()
    assert usage == {
        "cpu": TierUsage(2 * cb, (2 - stats.free_slots) * cb, 2 * TPC, (2 - stats.free_slots) * TPC),
        "disk": TierUsage(stats.disk_capacity * cb, 5 * cb, stats.disk_capacity * TPC, 5 * TPC)}
    for tier, tier_usage in usage.items():
        for metric, value in (("capacity_tokens", tier_usage.capacity_tokens),
                              ("usage_tokens", tier_usage.used_tokens),
                              ("capacity_bytes", tier_usage.capacity_bytes),
                              ("usage_bytes", tier_usage.used_bytes)):
            assert f'tierkv:{metric}{{engine="a",tier="{tier}"}} {float(value)}' in text
    # tierkv inspect counts the same chunks on disk.
    from tierkv.cli import main

    assert main(["inspect", str(tmp_path / "store"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    chunks = sum(rank["chunks"] for namespace in report for rank in namespace["ranks"])
    assert chunks * TPC == usage["disk"].used_tokens


def test_remote_events_say_what_this_engine_learned_of_the_remote_tier(
        cluster: RedisCluster) -> None:
    keys = chunk_keys(conversation(11, 4), REMOTE_TPC)
    source = caches(5)
    with TierKVStore(source, model_id="m", config=config(cluster.url)) as engine_a:
        store_all(engine_a, keys)
        fingerprint = engine_a.namespace.fingerprint()
    with TierKVStore([torch.zeros_like(t) for t in source], model_id="m",
                     config=config(cluster.url), record_events=True) as engine_b:
        assert engine_b.lookup(keys) == 4
        assert engine_b.take_events() == [("stored", "REMOTE", key) for key in keys]
        assert engine_b.lookup(keys) == 4 and engine_b.take_events() == []  # known already
        raw = ClusterClient.from_url(cluster.url)
        assert raw.delete(redis_key(b"tierkv:", fingerprint, 0, keys[2])) == 1
        raw.close()
        count, failed = loaded(engine_b, keys)
        assert count == 4 and failed == (keys[2],)
        events = engine_b.take_events()
        assert sorted(events) == sorted([("removed", "REMOTE", keys[2])] + [
            ("stored", "CPU", key) for key in keys if key != keys[2]])
