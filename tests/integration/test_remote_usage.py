"""The remote tier's capacity gauges on real redis-server processes: what INFO memory says,
polled in the background at most every ``remote.usage_seconds`` (an injected clock), read by
``usage()`` and a scrape without a network call, even once the servers are gone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_remote_store import caches, config
from tests.redis_cluster import HOST, RedisCluster, RedisServer
from tierkv.config import RemoteTierConfig
from tierkv.engine.metrics import TierUsage, register_store_metrics, remote_usage, usage_figures
from tierkv.engine.store import TierKVStore
from tierkv.keys import KEY_BYTES, Part
from tierkv.tiers.remote.format import HEADER_BYTES, redis_key
from tierkv.tiers.remote.lookup import RemoteLookup
from tierkv.tiers.remote.tier import RemoteTier

WAIT = 60.0  # seconds a poll may take on a loaded CI box (an event ends the wait sooner)
MiB = 1 << 20


def clients(ports: list[int]) -> list[redis.Redis]:
    """A connected client of each server, opened before what it measures (a connection
    takes memory of its own: ~20 KiB of used_memory)."""
    out = [redis.Redis(host=HOST, port=port) for port in ports]
    for client in out:
        client.ping()
    return out


def memory_sums(servers: list[redis.Redis]) -> tuple[int, int]:
    """(sum of used_memory, sum of maxmemory) as INFO memory says on each server."""
    infos = [client.info("memory") for client in servers]
    return (sum(int(info["used_memory"]) for info in infos),
            sum(int(info["maxmemory"]) for info in infos))


def scraped(registry: CollectorRegistry, metric: str, tier: str) -> float | None:
    """The sample of ``tierkv:<metric>{tier=...}`` a scrape gives (None: no sample)."""
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name == f"tierkv:{metric}" and sample.labels.get("tier") == tier:
                return float(sample.value)
    return None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A plain server of its own: no maxmemory (unbounded)."""
    with RedisServer(tmp_path / "redis") as started:
        yield started


def test_polls_follow_the_interval_and_an_unbounded_server_has_no_capacity(
        server: RedisServer) -> None:
    clock = Clock()
    payload = 4096
    measure = clients([server.port])
    tier = RemoteTier(RemoteTierConfig(url=server.url, timeout_seconds=5.0), "ab" * 16,
                      Part(0, 2), payload, lazy=True, role="lookups")
    lookup = RemoteLookup(tier, [[Part(0, 2), Part(1, 2)]], 1.0, clock=clock,
                          usage_seconds=30.0)
    try:
        assert lookup.usage.wait_polls(1, WAIT)  # the first right after connecting
        memory = lookup.server_memory()
        assert memory is not None and memory.nodes == 1
        used, maximum = memory_sums(measure)
        assert maximum == 0 and memory.max_bytes is None  # maxmemory 0: unbounded
        assert memory.used_bytes > 0  # a fresh connection's first command: not quite used
        # Two parts of 4096 bytes, each with its 80-byte header and its key's name.
        key_bytes = len(redis_key(b"tierkv:", "ab" * 16, Part(0, 2), bytes(KEY_BYTES)))
        assert lookup.stored_chunk_bytes == 2 * (HEADER_BYTES + payload + key_bytes)
        usage = remote_usage(memory, lookup.stored_chunk_bytes, 32)
        assert usage == {"remote": TierUsage(
            None, memory.used_bytes, None, memory.used_bytes // lookup.stored_chunk_bytes * 32)}
        figures = usage_figures(usage)
        assert math.isnan(figures["remote_capacity_bytes"])
        assert math.isnan(figures["remote_capacity_tokens"])
        assert figures["remote_used_bytes"] == memory.used_bytes

        measure[0].config_set("maxmemory", 64 * MiB)
        clock.now += 29.0  # not due yet: reading wakes nothing
        assert lookup.server_memory() == memory and not lookup.usage.due()
        assert lookup.usage.polls == 1
        clock.now += 1.0  # due: a read wakes the lookup's thread, which polls
        assert lookup.server_memory() == memory  # the last values meanwhile
        assert lookup.usage.wait_polls(2, WAIT)
        polled = lookup.server_memory()
        assert polled is not None and polled.max_bytes == 64 * MiB
        assert (polled.used_bytes, polled.max_bytes) == memory_sums(measure)
        assert tier.statistics().calls_ok >= 2  # each poll is a call of the tier (counted)
    finally:
        lookup.shutdown()
        measure[0].close()


def test_usage_and_the_scrape_give_info_s_sums_and_never_call_the_servers(
        tmp_path: Path) -> None:
    with RedisCluster(tmp_path / "redis") as cluster:
        measure = clients(cluster.ports)
        for client, mib in zip(measure, (100, 200, 300)):
            client.config_set("maxmemory", mib * MiB)
        store = TierKVStore(caches(1), model_id="m",
                            config=config(cluster.url, usage_seconds=600.0))
        try:
            usage = check_store(store, cluster, measure)
        finally:
            store.close()
    assert store.usage()["remote"] == usage  # after close() too


def check_store(store: TierKVStore, cluster: RedisCluster,
                measure: list[redis.Redis]) -> TierUsage:
    registry = CollectorRegistry()
    register_store_metrics(store, registry, labels={"engine": "a"})
    lookup = store._remote  # noqa: SLF001
    assert lookup is not None and lookup.usage.wait_polls(1, WAIT)
    # used_memory of a connection's first command counts less: INFO's sums are those of
    # the next poll (this thread's: the lookup's own next is not due for 600 s).
    lookup.usage.poll(lookup.tier)
    used, maximum = memory_sums(measure)
    usage = store.usage()["remote"]
    assert maximum == 600 * MiB and usage.capacity_bytes == maximum
    assert usage.used_bytes == used
    per_chunk = lookup.stored_chunk_bytes
    assert usage.capacity_tokens == maximum // per_chunk * store.tokens_per_chunk
    assert usage.used_tokens == used // per_chunk * store.tokens_per_chunk
    for metric, value in (("capacity_bytes", usage.capacity_bytes),
                          ("usage_bytes", usage.used_bytes),
                          ("capacity_tokens", usage.capacity_tokens),
                          ("usage_tokens", usage.used_tokens)):
        assert scraped(registry, metric, "remote") == value

    # The servers gone, usage() and a scrape give the last values and call nobody.
    for client in measure:
        client.close()
    for port in list(cluster.ports):
        cluster.stop_node(port)
    calls = lookup.tier.statistics()
    before = (calls.calls_ok, calls.errors, calls.calls_skipped, lookup.usage.polls)
    assert store.usage()["remote"] == usage
    assert store.figures()["remote_used_bytes"] == used
    assert scraped(registry, "usage_bytes", "remote") == used
    calls = lookup.tier.statistics()
    assert (calls.calls_ok, calls.errors, calls.calls_skipped, lookup.usage.polls) == before
    return usage


def test_without_a_remote_tier_no_remote_gauge(tmp_path: Path) -> None:
    """A store without one: usage() and the scrape have no remote tier, never a 0."""
    from tierkv.config import CpuTierConfig, StoreConfig

    with TierKVStore(caches(1), model_id="m", config=StoreConfig(
            blocks_per_chunk=2, cpu=CpuTierConfig(max_bytes=1 << 22), device="cpu")) as store:
        registry = CollectorRegistry()
        register_store_metrics(store, registry)
        assert set(store.usage()) == {"cpu", "disk"}
        for metric in ("usage_bytes", "capacity_bytes", "usage_tokens", "capacity_tokens"):
            assert scraped(registry, metric, "remote") is None
            assert scraped(registry, metric, "cpu") is not None
