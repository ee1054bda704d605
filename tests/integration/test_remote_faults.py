"""Remote-tier faults on a real 3-master Redis Cluster of this module's own (``maxmemory``
1 GiB a node): a SIGSTOPped master (every stopped node is continued in a ``finally``), the
cluster saying it is down, a 256 MiB value and keys of another type under a chunk's key.
Each call is bounded by ``remote.timeout_seconds`` as a whole; a stalled node costs one
deadline, then its calls are skipped at once; bad values are misses, counted and deleted,
never breaker failures. Times are asserted with generous bounds relative to the deadline;
the figures come from counted outcomes."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from redis.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

from tests.integration.test_remote_store import (TPC, caches, config, conversation, loaded,
                                                 push, store_all, zeros)
from tests.integration.test_remote_tier import NS, PAYLOAD, key_of, payload_of, read
from tests.redis_cluster import HOST, RedisCluster
from tierkv import chunk_keys
from tierkv.config import RemoteTierConfig
from tierkv.engine.store import TierKVStore
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.client import RemoteError
from tierkv.tiers.remote.format import redis_key, value_bytes

# remote.timeout_seconds of the engines and tiers that meet the fault (the others get the
# test config's 2 s): a healthy call on a loaded 2-core CI machine must fit in it, since a
# timeout opens its node's breaker. With it, before the fix: 4-6 s a read (0.5 s timeout).
TIMEOUT = 1.0
SLACK = 1.0  # a loaded 2-core CI machine; the failures these tests catch took 4-40 s


@pytest.fixture(scope="module")
def faults_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path_factory.mktemp("faults-cluster"), maxmemory="1gb") as cluster:
        yield cluster


@pytest.fixture()
def cluster(faults_cluster: RedisCluster) -> Iterator[RedisCluster]:
    faults_cluster.wait_ok()
    faults_cluster.flushall()
    yield faults_cluster


@contextmanager
def stopped(cluster: RedisCluster, port: int) -> Iterator[None]:
    """The master on ``port`` SIGSTOPped (it keeps its sockets: connections hang), then
    continued, whatever happens."""
    pid = cluster.procs[port].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def on_node(cluster: RedisCluster, port: int, keys: list[bytes], namespace: Namespace = NS,
            rank: Part | int = 0) -> set[bytes]:
    """The chunk keys among ``keys`` whose value lives on the master on ``port``."""
    slots = set(cluster.slots_of(port))
    return {key for key in keys
            if key_slot(redis_key(b"tierkv:", namespace.fingerprint(), rank, key)) in slots}


def chunks_of(i: int, chunks: int) -> list[bytes]:
    return chunk_keys(conversation(i, chunks), TPC)


def open_tier(cluster: RedisCluster, **settings: object) -> RemoteTier:
    settings.setdefault("timeout_seconds", TIMEOUT)
    return RemoteTier(RemoteTierConfig(url=cluster.url, **settings),  # type: ignore[arg-type]
                      NS, 0, PAYLOAD)


def outcome(tier: RemoteTier, key: bytes) -> str:
    try:
        return read(tier, key)[0].value
    except RemoteError as exc:
        return "skipped" if exc.skipped else exc.cause


def test_a_stalled_master_costs_one_deadline_then_its_chunks_fail_at_once(
        cluster: RedisCluster) -> None:
    keys = [key_of(i, 40) for i in range(30)]
    port = cluster.ports[1]
    stalled = on_node(cluster, port, keys)
    assert 0 < len(stalled) < len(keys)
    with open_tier(cluster) as tier:
        tier.put_many([(key, payload_of(key)) for key in keys])
        with stopped(cluster, port):
            started = time.perf_counter()
            outcomes = {}
            slowest = 0.0
            for key in keys:
                began = time.perf_counter()
                outcomes[key] = outcome(tier, key)
                slowest = max(slowest, time.perf_counter() - began)
            took = time.perf_counter() - started
        stats = tier.statistics()
    assert {outcomes[key] for key in keys if key not in stalled} == {"ok"}
    assert sorted(outcomes[key] for key in stalled) == \
        ["skipped"] * (len(stalled) - 1) + ["timeout"]
    assert slowest < TIMEOUT + SLACK, slowest  # one read: its deadline (4-6 s before)
    assert took < TIMEOUT + 2 * SLACK, took  # all 30: one deadline, not one per chunk
    assert (stats.errors, stats.calls_skipped, dict(stats.causes)) == \
        (1, len(stalled) - 1, {"timeout": 1})
    assert dict(stats.breakers)[f"{HOST}:{port}"] == 1


def test_a_push_batch_and_a_lookup_with_a_stalled_master_serve_the_other_masters(
        cluster: RedisCluster) -> None:
    """A batch over every master is sent node by node at once, each under the call's one
    deadline: the stalled master fails its own chunks only (they failed the whole batch,
    and a lookup answered nothing, before), the first time as when its breaker is open."""
    first = [key_of(i, 41) for i in range(16)]
    second = [key_of(i, 42) for i in range(16)]
    port = cluster.ports[2]
    node = f"{HOST}:{port}"
    stalled = on_node(cluster, port, first + second)
    assert stalled & set(first) and set(first) - stalled
    with open_tier(cluster) as pushes, open_tier(cluster) as lookups:
        pushes.exists_many(first)  # both connected before the stop
        lookups.exists_many(first)
        with stopped(cluster, port):
            started = time.perf_counter()
            result = pushes.put_many([(key, payload_of(key)) for key in first])
            assert time.perf_counter() - started < TIMEOUT + SLACK  # a batch took 7-40 s
            assert set(result.written) == set(first) - stalled
            stats = pushes.statistics()
            assert (stats.errors, dict(stats.causes)) == (1, {"timeout": 1})
            assert dict(stats.breakers)[node] == 1
            # The next batch skips the stalled node's chunks at once and stores the others.
            result = pushes.put_many([(key, payload_of(key)) for key in second])
            assert set(result.written) == set(second) - stalled
            assert pushes.statistics().errors == 1
            # A lookup over every master: the healthy ones answer, within the deadline.
            started = time.perf_counter()
            found = lookups.exists_many(first + second)
            assert time.perf_counter() - started < TIMEOUT + SLACK
            assert found == [key not in stalled for key in first + second]
            stats = lookups.statistics()
            assert (stats.errors, dict(stats.causes)) == (1, {"timeout": 1})
            started = time.perf_counter()
            assert pushes.exists_many(second) == [key not in stalled for key in second]
            assert time.perf_counter() - started < SLACK  # no wait: its chunks are skipped
    for key in (set(first) | set(second)) - stalled:
        with open_tier(cluster) as reader:
            assert read(reader, key) == (ReadStatus.OK, payload_of(key))


def test_a_first_connect_to_a_node_that_never_answers_costs_one_deadline() -> None:
    """The tier of an engine's loads connects on first use. Its seed node accepts
    connections and never answers: the first chunk's read fails within the deadline
    (timeout), its node's breaker opens, and the load's other chunks (read by four threads
    at once, as an engine's readers do), a push and a lookup are skipped at once. Before,
    each call connected again: five deadlines, one per remote.breaker_failures."""
    with socket.create_server((HOST, 0), backlog=64) as silent:  # never accepts, never answers
        port = silent.getsockname()[1]
        config = RemoteTierConfig(url=f"redis://{HOST}:{port}", timeout_seconds=TIMEOUT)
        keys = [key_of(i, 45) for i in range(8)]
        with RemoteTier(config, NS, 0, PAYLOAD, lazy=True, role="loads and pushes") as tier, \
                ThreadPoolExecutor(4) as readers:
            started = time.monotonic()
            outcomes = list(readers.map(lambda key: outcome(tier, key), keys))
            took = time.monotonic() - started
            with pytest.raises(RemoteError) as pushed:
                tier.put_many([(keys[0], payload_of(keys[0]))])
            with pytest.raises(RemoteError) as looked:
                tier.exists_many(keys)
            stats = tier.statistics()
    assert sorted(outcomes) == ["skipped"] * 7 + ["timeout"]
    assert took < TIMEOUT + SLACK, took  # 5 deadlines before
    assert pushed.value.skipped and looked.value.skipped
    assert (stats.errors, dict(stats.causes), stats.breaker_opens) == (1, {"timeout": 1}, 1)
    assert dict(stats.breakers)[f"{HOST}:{port}"] == 1


@pytest.mark.parametrize("seeds", ["another master", "every master"])
def test_a_first_connect_with_a_master_stalled_serves_the_others(cluster: RedisCluster,
                                                                 seeds: str) -> None:
    """The master of slot 0 (to which redis-py sent its COMMAND while connecting) stalls
    before the tier's first call: the other masters' chunks are served, its own fail.
    Before, every connect failed on it, and so did every chunk. remote.url names another
    master, or every master: a connect that asked the stalled one first fails (one
    deadline, its breaker opens) and the next leaves it out."""
    keys = [key_of(i, 46) for i in range(24)]
    with open_tier(cluster) as writer:
        writer.put_many([(key, payload_of(key)) for key in keys])
    port = cluster.ports[0]
    assert 0 in cluster.slots_of(port)
    stalled = on_node(cluster, port, keys)
    url = ",".join(f"redis://{HOST}:{each}" for each in cluster.ports) \
        if seeds == "every master" else f"redis://{HOST}:{cluster.ports[1]}"
    config = RemoteTierConfig(url=url, timeout_seconds=TIMEOUT)
    with RemoteTier(config, NS, 0, PAYLOAD, lazy=True) as tier, stopped(cluster, port):
        outcomes = {key: outcome(tier, key) for key in keys}
        if {outcomes[key] for key in keys if key not in stalled} != {"ok"}:
            assert seeds == "every master"  # the connect asked the stalled seed first
            assert tier.statistics().causes == (("timeout", 1),)
            outcomes = {key: outcome(tier, key) for key in keys}
        stats = tier.statistics()
    assert {outcomes[key] for key in keys if key not in stalled} == {"ok"}
    assert {outcomes[key] for key in stalled} <= {"timeout", "skipped"}
    assert stats.errors <= 2 and set(dict(stats.causes)) == {"timeout"}


def test_the_cluster_down_fails_fast_and_opens_the_breaker(cluster: RedisCluster) -> None:
    """Past cluster-node-timeout the other masters answer CLUSTERDOWN: a call fails with
    that cause (no 0.25 s pause, no retries) and the cluster's breaker opens at once."""
    keys = [key_of(i, 43) for i in range(12)]
    port = cluster.ports[0]
    healthy = sorted(set(keys) - on_node(cluster, port, keys))
    other = next(p for p in cluster.ports if p != port)
    with open_tier(cluster, breaker_failures=5) as tier:
        tier.put_many([(key, payload_of(key)) for key in keys])
        with stopped(cluster, port):
            probe = ClusterClient(host=HOST, port=other)
            deadline = time.monotonic() + 30
            while probe.cluster_info(target_nodes=probe.get_node(HOST, other)).get(
                    "cluster_state") != "fail":
                assert time.monotonic() < deadline, "the cluster never said it is down"
                time.sleep(0.1)
            probe.close()
            assert outcome(tier, healthy[0]) == "cluster down"
            assert all(outcome(tier, key) == "skipped" for key in healthy[1:])
        stats = tier.statistics()
    assert dict(stats.causes) == {"cluster down": 1} and stats.breaker_opens == 1
    assert dict(stats.breakers)["cluster"] == 1


@pytest.mark.parametrize("which", [1, 0], ids=["another master", "the seed"])
def test_the_engine_with_a_stalled_master(cluster: RedisCluster, which: int) -> None:
    """Loads of chunks noted before the stop return within the deadline, as counted
    misses, and the engine's step (a lookup and a store) never waits on the node (the
    lookup waits its default 10 ms deadline, then says "not yet"). The stalled master may
    be remote.url's one seed: the engine's loads connected at its start, so they know the
    other masters (they connected on the first load, and failed every chunk)."""
    settings = dict(timeout_seconds=TIMEOUT, mark_seconds=600.0,
                    lookup_deadline_seconds=RemoteTierConfig.lookup_deadline_seconds)
    source = caches(11)
    conversations = [chunks_of(700 + i, 4) for i in range(6)]
    with TierKVStore(source, model_id="m", config=config(cluster.url)) as engine_a:
        for keys in conversations:
            store_all(engine_a, keys)
        push(engine_a)
        fingerprint = engine_a.namespace.fingerprint()
    port = cluster.ports[which]
    slots = set(cluster.slots_of(port))
    stalled = {key for keys in conversations for key in keys
               if key_slot(redis_key(b"tierkv:", fingerprint, 0, key)) in slots}
    assert stalled
    with TierKVStore(zeros(source), model_id="m",
                     config=config(cluster.url, **settings)) as engine_b:
        for keys in conversations:  # noted: remote hits
            deadline = time.monotonic() + 20
            while engine_b.lookup(keys) < 4:
                assert time.monotonic() < deadline, "the lookup never found A's chunks"
                time.sleep(0.01)
        with stopped(cluster, port):
            failed: list[bytes] = []
            started = time.perf_counter()
            slowest = 0.0
            for keys in conversations:
                began = time.perf_counter()
                count, lost = loaded(engine_b, keys)
                slowest = max(slowest, time.perf_counter() - began)
                assert count == 4
                failed += lost
            took = time.perf_counter() - started
            steps = []
            for i in range(5):  # the engine's step: a lookup and a store of new chunks
                keys = chunks_of(800 + i, 3)
                began = time.perf_counter()
                engine_b.lookup(keys)
                store_all(engine_b, keys)
                steps.append(time.perf_counter() - began)
            stats = engine_b.statistics()
    # Every chunk of the stalled node failed (recomputed), every other one landed.
    assert set(failed) == stalled
    assert stats.index.remote_failed == len(stalled)
    assert slowest < TIMEOUT + SLACK, slowest  # 3-6 s a load before
    assert took < TIMEOUT + 2 * SLACK, took  # one deadline for all six loads
    assert max(steps) < TIMEOUT, steps
    # One opening per tier that met the stalled node, not one per load: the loads' tier
    # and (its request took a deadline too) the lookup's.
    assert stats.remote is not None and 1 <= stats.remote.breaker_opens <= 2


def test_close_with_a_master_stalled_keeps_its_bound(cluster: RedisCluster) -> None:
    """Pushes to a stalled master are queued and one is in flight when the engine closes:
    close() ends within the deadline of that call (it took 14-17 s: 10 s waiting for the
    queue, then the push thread stuck in redis-py's retries)."""
    source = caches(14)
    engine = TierKVStore(source, model_id="m", config=config(cluster.url, timeout_seconds=TIMEOUT))
    try:
        store_all(engine, chunks_of(980, 2))
        push(engine)  # connected, pushing
        with stopped(cluster, cluster.ports[2]):
            for i in range(24):
                store_all(engine, chunks_of(1000 + i, 4))
            started = time.perf_counter()
            engine.close()
            closing = time.perf_counter() - started
        assert closing < TIMEOUT + SLACK, closing
    finally:
        engine.close()


def test_a_256_mib_value_is_refused_before_it_is_read(cluster: RedisCluster) -> None:
    keys = chunks_of(900, 2)
    source = caches(12)
    with TierKVStore(source, model_id="m", config=config(cluster.url)) as engine_a:
        store_all(engine_a, keys)
        push(engine_a)
        name = redis_key(b"tierkv:", engine_a.namespace.fingerprint(), 0, keys[1])
        chunk_bytes = engine_a.chunk_bytes
    raw = ClusterClient.from_url(cluster.url)
    raw.delete(name)
    raw.setrange(name, (256 << 20) - 1, b"\0")  # 256 MiB, built by the server
    kv_b = zeros(source)
    with TierKVStore(kv_b, model_id="m", config=config(cluster.url)) as engine_b:
        assert engine_b.lookup(keys) == 2
        started = time.perf_counter()
        count, failed = loaded(engine_b, keys)
        took = time.perf_counter() - started
        stats = engine_b.statistics()
    assert (count, failed) == (2, (keys[1],))
    assert took < 2.0 + SLACK, took  # config()'s timeout_seconds is 2.0; 6-13 s before
    assert stats.remote is not None and stats.index.remote_corrupt == 1
    tier = stats.remote
    assert (tier.corrupt, dict(tier.bad_values), tier.errors) == (1, {"size": 1}, 0)
    # It read at most one byte past a good value, not 256 MiB.
    assert tier.bytes_read <= 2 * value_bytes(chunk_bytes) + 1
    assert not raw.exists(name)  # deleted without being sent back
    raw.close()


@pytest.mark.parametrize("kind", ["list", "hash", "empty string"])
def test_a_key_of_another_type_is_a_corrupt_value_never_a_breaker_failure(
        cluster: RedisCluster, kind: str) -> None:
    keys = chunks_of(950, 3)
    source = caches(13)
    with TierKVStore(source, model_id="m", config=config(cluster.url)) as engine_a:
        store_all(engine_a, keys)
        push(engine_a)
        name = redis_key(b"tierkv:", engine_a.namespace.fingerprint(), 0, keys[2])
    raw = ClusterClient.from_url(cluster.url)
    raw.delete(name)
    {"list": lambda: raw.rpush(name, b"x"), "hash": lambda: raw.hset(name, "f", "v"),
     "empty string": lambda: raw.set(name, b"")}[kind]()
    kv_b = zeros(source)
    with TierKVStore(kv_b, model_id="m", config=config(cluster.url, breaker_failures=1)) \
            as engine_b:
        assert engine_b.lookup(keys) == 3  # EXISTS sees any type
        assert loaded(engine_b, keys) == (3, (keys[2],))
        assert not raw.exists(name)  # deleted
        assert engine_b.lookup(keys) == 2  # the good ones landed; the bad one is gone
        stats = engine_b.statistics()
    assert stats.remote is not None
    tier = stats.remote
    check = "size" if kind == "empty string" else "type"
    assert (tier.corrupt, dict(tier.bad_values)) == (1, {check: 1})
    assert (tier.errors, tier.calls_skipped, tier.breaker_opens) == (0, 0, 0)
    assert stats.index.remote_corrupt == 1
    raw.close()


def test_the_tier_s_verify_reports_and_repairs_a_key_of_another_type(
        cluster: RedisCluster) -> None:
    keys = [key_of(i, 44) for i in range(4)]
    raw = ClusterClient.from_url(cluster.url)
    with open_tier(cluster) as tier:
        tier.put_many([(key, payload_of(key)) for key in keys])
        name = redis_key(b"tierkv:", NS.fingerprint(), 0, keys[0])
        raw.delete(name)
        raw.sadd(name, b"x")
        assert tier.verify().bad_keys == (keys[0],) and raw.exists(name)
        assert tier.verify(repair=True).repaired == 1 and not raw.exists(name)
        assert tier.statistics().errors == 0
    raw.close()


def test_the_scrape_shows_calls_by_cause_bytes_pushes_bad_values_and_each_breaker(
        cluster: RedisCluster) -> None:
    """The library store's Prometheus scrape with a master stalled: calls by result and
    cause, bytes both ways, pushes, a bad value by its check, and the stalled node's breaker
    open (1) beside the others (0)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tierkv.engine.metrics import register_store_metrics

    source = caches(15)
    settings = dict(timeout_seconds=TIMEOUT, mark_seconds=600.0)
    keys = chunks_of(1100, 6)
    with TierKVStore(source, model_id="m", config=config(cluster.url)) as engine_a:
        store_all(engine_a, keys)
        push(engine_a)
        bad = redis_key(b"tierkv:", engine_a.namespace.fingerprint(), 0, keys[0])
    raw = ClusterClient.from_url(cluster.url)
    raw.set(bad, b"too short")
    raw.close()
    port = cluster.ports[1]  # not the seed: B's loads connect after the stop
    node = f"{HOST}:{port}"
    engine_b = TierKVStore(zeros(source), model_id="m", config=config(cluster.url, **settings))
    registry = CollectorRegistry()
    register_store_metrics(engine_b, registry, labels={"engine": "b"})
    try:
        assert engine_b.lookup(keys) == 6
        with stopped(cluster, port):
            loaded(engine_b, keys)
            samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                       for family in text_string_to_metric_families(
                           generate_latest(registry).decode()) for sample in family.samples}
    finally:
        engine_b.close()

    def value(name: str, **labels: str) -> float:
        return samples[(f"tierkv:{name}", tuple(sorted({"engine": "b", **labels}.items())))]

    assert value("remote_breaker_open", node=node) == 1
    assert {value("remote_breaker_open", node=f"{HOST}:{other}")
            for other in cluster.ports if other != port} == {0}
    assert value("remote_calls_total", result="timeout") >= 1
    assert value("remote_calls_total", result="ok") > 0
    loaded_ok = value("remote_bytes_total", direction="read")
    assert loaded_ok > 0 and value("remote_bytes_total", direction="written") == 0
    assert value("remote_bad_values_total", check="size") == \
        (0 if key_slot(bad) in set(cluster.slots_of(port)) else 1)
    assert value("remote_pushes_total", result="dropped") == 0
    info = [labels for (name, labels), _ in samples.items() if name == "tierkv:config_info"]
    assert len(info) == 1 and ("remote_timeout_seconds", str(TIMEOUT)) in info[0]
