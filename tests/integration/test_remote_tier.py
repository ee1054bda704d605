"""The remote tier on real Redis processes: a 3-master cluster (the session's
``redis_cluster`` fixture) and, where a test says so, one plain server of its own.
Everything talks to 127.0.0.1 only."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from tests.redis_cluster import HOST, RedisCluster, RedisServer, free_port
from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import BrokenError, ClosedError, ConfigError
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.client import RemoteError
from tierkv.tiers.remote.format import redis_key

PAYLOAD = 8192
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=512,
               tokens_per_chunk=16)
OTHER = Namespace(model_id="tiny-b", dtype="float16", kv_layout="NHD", page_bytes=512,
                  tokens_per_chunk=16)


def key_of(i: int, salt: int = 0) -> bytes:
    return random.Random(i * 7919 + salt).randbytes(32)


def payload_of(key: bytes) -> bytes:
    return random.Random(key).randbytes(PAYLOAD)


def read(tier: RemoteTier, key: bytes) -> tuple[ReadStatus, bytes]:
    out = bytearray(PAYLOAD)
    return tier.read_into(key, memoryview(out)), bytes(out)


@pytest.fixture()
def cluster(redis_cluster: RedisCluster) -> Iterator[RedisCluster]:
    redis_cluster.flushall()
    yield redis_cluster


# Calls of tests that are not about deadlines get this much (the default, 0.5 s, is a
# production figure: a loaded 2-core CI box once took longer to connect with ACL auth).
RELAXED = 5.0


def open_tier(cluster: RedisCluster, namespace: Namespace = NS, rank: Part | int = 0,
              **config: object) -> RemoteTier:
    config.setdefault("timeout_seconds", RELAXED)
    return RemoteTier(RemoteTierConfig(url=cluster.url, **config),  # type: ignore[arg-type]
                      namespace, rank, PAYLOAD)


def raw(cluster: RedisCluster) -> ClusterClient:
    return ClusterClient.from_url(cluster.url)


def test_chunks_round_trip_byte_exact_over_every_master(cluster: RedisCluster) -> None:
    keys = [key_of(i) for i in range(60)]
    with open_tier(cluster) as tier:
        assert tier.cluster
        result = tier.put_many([(key, payload_of(key)) for key in keys])
        assert result.written == tuple(keys) and result.num_bytes == 60 * PAYLOAD
        assert tier.exists_many(keys + [key_of(999)]) == [True] * 60 + [False]
        for key in keys:
            assert read(tier, key) == (ReadStatus.OK, payload_of(key))
        assert sorted(record.key for record in tier.scan()) == sorted(keys)
        stats = tier.statistics()
        assert (stats.puts, stats.hits, stats.corrupt) == (60, 60, 0)
    client = raw(cluster)
    sizes = [client.dbsize(target_nodes=node) for node in client.get_primaries()]
    assert len(sizes) == 3 and all(size > 0 for size in sizes) and sum(sizes) == 60
    client.close()


def test_what_another_engine_stored_is_left_and_counted(cluster: RedisCluster) -> None:
    key = key_of(1)
    with open_tier(cluster) as first, open_tier(cluster) as second:
        first.put_many([(key, payload_of(key))])
        result = second.put_many([(key, payload_of(key))])
        assert result.written == (key,) and result.num_bytes == 0
        assert second.statistics().already == 1
        assert read(second, key) == (ReadStatus.OK, payload_of(key))


def received(cluster: RedisCluster) -> int:
    """Bytes every master has received so far (``INFO stats``)."""
    client = raw(cluster)
    try:
        return sum(int(client.info("stats", target_nodes=node)["total_net_input_bytes"])
                   for node in client.get_primaries())
    finally:
        client.close()


def test_values_the_server_holds_are_not_sent_again(cluster: RedisCluster) -> None:
    """A push of chunks the tier has (another engine's, or this one's after a request that
    recomputed a stored prefix) costs lookups, not the values: a slow or shared link is
    not spent on them."""
    keys = [key_of(i, salt=5) for i in range(12)]
    with open_tier(cluster) as first, open_tier(cluster) as second:
        before = received(cluster)
        first.put_many([(key, payload_of(key)) for key in keys[:8]])
        sent_fresh = received(cluster) - before
        assert sent_fresh > 8 * PAYLOAD
        before = received(cluster)
        result = second.put_many([(key, payload_of(key)) for key in keys])
        sent_again = received(cluster) - before
        assert result.written == tuple(keys) and result.num_bytes == 4 * PAYLOAD
        assert second.statistics().already == 8
        assert 4 * PAYLOAD < sent_again < 5 * PAYLOAD, (sent_fresh, sent_again)
        for key in keys:
            assert read(second, key) == (ReadStatus.OK, payload_of(key))


def exists_calls(cluster: RedisCluster) -> int:
    client = raw(cluster)
    try:
        return sum(int(client.info("commandstats", target_nodes=node)
                       .get("cmdstat_exists", {}).get("calls", 0))
                   for node in client.get_primaries())
    finally:
        client.close()


def test_pushes_ask_first_only_while_values_turn_out_held(cluster: RedisCluster) -> None:
    """The round trip that spares held values is paid while held values are common: a tier
    pushing new chunks soon stops asking, and one pushing held chunks starts again."""
    batches = [[key_of(i, salt=100 + batch) for i in range(16)] for batch in range(10)]
    with open_tier(cluster) as tier:
        asked = []
        for keys in batches:
            before = exists_calls(cluster)
            tier.put_many([(key, payload_of(key)) for key in keys])
            asked.append(exists_calls(cluster) - before)
        assert asked[0] == 16 and asked[-4:] == [0] * 4, asked
        asked = []
        for keys in batches:  # all held now
            before = exists_calls(cluster)
            assert tier.put_many([(key, payload_of(key)) for key in keys]).num_bytes == 0
            asked.append(exists_calls(cluster) - before)
        assert asked[0] == 0 and asked[-4:] == [16] * 4, asked


def test_another_namespace_or_rank_never_hits(cluster: RedisCluster) -> None:
    key = key_of(2)
    with open_tier(cluster) as tier, open_tier(cluster, OTHER) as other, \
            open_tier(cluster, rank=Part(1, 2)) as rank1:
        tier.put_many([(key, payload_of(key))])
        assert other.exists_many([key]) == [False] and read(other, key)[0] is ReadStatus.MISSING
        assert rank1.exists_many([key]) == [False] and read(rank1, key)[0] is ReadStatus.MISSING
        assert list(other.scan()) == [] and list(rank1.scan()) == []


def test_a_planted_or_damaged_value_is_a_miss_counted_and_deleted(cluster: RedisCluster) -> None:
    good, planted, flipped = key_of(3), key_of(4), key_of(5)
    client = raw(cluster)
    with open_tier(cluster) as tier, open_tier(cluster, OTHER) as other:
        tier.put_many([(good, payload_of(good)), (flipped, payload_of(flipped))])
        other.put_many([(planted, payload_of(planted))])
        # another namespace's valid value, and another key's, put under this tier's keys
        client.set(redis_key(b"tierkv:", NS.fingerprint(), 0, planted),
                   client.get(redis_key(b"tierkv:", OTHER.fingerprint(), 0, planted)))
        value = bytearray(client.get(redis_key(b"tierkv:", NS.fingerprint(), 0, flipped)))
        value[-1] ^= 1
        client.set(redis_key(b"tierkv:", NS.fingerprint(), 0, flipped), bytes(value))
        assert set(tier.verify().bad_keys) == {planted, flipped}
        for key in (planted, flipped):
            assert read(tier, key)[0] is ReadStatus.CORRUPT
            assert tier.exists_many([key]) == [False]  # deleted
        assert read(tier, good) == (ReadStatus.OK, payload_of(good))
        assert tier.statistics().corrupt == 2 and tier.verify().bad_keys == ()
        assert read(other, planted) == (ReadStatus.OK, payload_of(planted))  # its own is kept
    client.close()


@pytest.mark.parametrize("damage", ["flipped", "truncated", "list"])
def test_a_bad_value_replaced_meanwhile_is_not_deleted(cluster: RedisCluster, damage: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the read of a bad value and its delete, another engine stores a good one:
    the good one stays (the delete compares the value's type, length and digest, never the
    value sent back)."""
    key = key_of(6)
    name = redis_key(b"tierkv:", NS.fingerprint(), 0, key)
    client = raw(cluster)
    with open_tier(cluster) as tier:
        tier.put_many([(key, payload_of(key))])
        good = client.get(name)
        if damage == "flipped":
            client.set(name, good[:-1] + bytes([good[-1] ^ 1]))  # the right length
        elif damage == "truncated":
            client.set(name, good[:-1])
        else:
            client.delete(name)
            client.rpush(name, b"x")
        real = tier._judge  # noqa: SLF001

        def judge_then_replace(*args: object) -> object:
            verdict = real(*args)  # type: ignore[arg-type]
            client.delete(name)
            client.set(name, good)  # the other engine's store lands now
            return verdict

        monkeypatch.setattr(tier, "_judge", judge_then_replace)
        assert read(tier, key)[0] is ReadStatus.CORRUPT
        monkeypatch.setattr(tier, "_judge", real)
        assert read(tier, key) == (ReadStatus.OK, payload_of(key))
    client.close()


def test_a_value_gone_between_lookup_and_load_is_missing(cluster: RedisCluster) -> None:
    key = key_of(7)
    with open_tier(cluster) as tier, open_tier(cluster) as other_engine:
        tier.put_many([(key, payload_of(key))])
        assert tier.exists_many([key]) == [True]
        other_engine.delete_many([key])  # or the server evicted it
        assert read(tier, key)[0] is ReadStatus.MISSING
        assert tier.statistics().misses == 1


def test_deletes_and_ttl(cluster: RedisCluster) -> None:
    keys = [key_of(i, 1) for i in range(4)]
    with open_tier(cluster, ttl_seconds=2) as tier:
        tier.put_many([(key, payload_of(key)) for key in keys[:2]])
        result = tier.put_many([(key, payload_of(key)) for key in keys[2:]], deletes=keys[:1])
        assert result.deleted == 1 and tier.exists_many(keys) == [False, True, True, True]
        assert tier.delete_many(keys[1:2] + [key_of(500)]) == 1
        # PTTL: TTL rounds to whole seconds, so a slow machine read 0 from a 1 s TTL.
        ttl = raw(cluster).pttl(redis_key(b"tierkv:", NS.fingerprint(), 0, keys[2]))
        assert 0 < ttl <= 2000
        deadline = time.monotonic() + 10
        while tier.exists_many(keys[2:]) != [False, False]:  # expired: a normal miss
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_a_node_that_stops_fails_loudly_and_the_tier_reconnects(cluster: RedisCluster) -> None:
    keys = [key_of(i, 2) for i in range(30)]
    with open_tier(cluster, timeout_seconds=0.3) as tier:
        tier.put_many([(key, payload_of(key)) for key in keys])
        port = cluster.ports[1]
        cluster.stop_node(port)
        try:
            with pytest.raises(BrokenError, match="remote tier redis://127.0.0.1") as info:
                for key in keys:
                    read(tier, key)
            assert "remote.timeout_seconds" in str(info.value)
        finally:
            cluster.start_node(port)  # same nodes.conf: it rejoins (its data is gone)
            cluster.wait_ok()
        deadline = time.monotonic() + 20
        while True:
            try:
                statuses = {read(tier, key)[0] for key in keys}
                break
            except BrokenError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert ReadStatus.OK in statuses and ReadStatus.CORRUPT not in statuses


def test_one_plain_server_with_a_password_that_is_never_shown(tmp_path: Path) -> None:
    secret = "s3cret-pw"
    with RedisServer(tmp_path, "--requirepass", secret) as server:
        url = f"redis://:{secret}@{HOST}:{server.port}"
        with RemoteTier(RemoteTierConfig(url=url, timeout_seconds=RELAXED), NS, 0,
                        PAYLOAD) as tier:
            assert not tier.cluster and secret not in tier._name
            key = key_of(8)
            tier.put_many([(key, payload_of(key))])
            assert read(tier, key) == (ReadStatus.OK, payload_of(key))
            assert [record.key for record in tier.scan()] == [key]
        os.environ["TIERKV_TEST_PW"] = "wrong-" + secret
        try:
            with pytest.raises(BrokenError) as info:
                RemoteTier(RemoteTierConfig(url=server.url, password_env="TIERKV_TEST_PW"),
                           NS, 0, PAYLOAD)
            assert secret not in str(info.value) and "remote.url" in str(info.value)
        finally:
            del os.environ["TIERKV_TEST_PW"]
        assert safe_url(url) == f"redis://***@{HOST}:{server.port}"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_skips_a_dead_server_fast_warns_once_and_probes_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A refused connection opens the breaker at once (a dead server costs one call, not
    remote.breaker_failures of them); one warning names the cause; the probe after
    breaker_seconds (a fake clock) finds the server back, and one line says so."""
    key = key_of(9)
    clock = FakeClock()
    with RedisServer(tmp_path) as server:
        config = RemoteTierConfig(url=server.url, timeout_seconds=0.2, breaker_failures=3,
                                  breaker_seconds=0.5)
        with RemoteTier(config, NS, 0, PAYLOAD, clock=clock) as tier:
            tier.put_many([(key, payload_of(key))])
            server.stop()
            with caplog.at_level("WARNING", logger="tierkv.remote"):
                with pytest.raises(RemoteError, match="connection refused") as info:
                    tier.exists_many([key])
                assert not info.value.skipped and info.value.cause == "connection refused"
                for _ in range(5):
                    with pytest.raises(RemoteError, match="circuit breaker is open") as info:
                        tier.exists_many([key])
                    assert info.value.skipped
            assert caplog.text.count("fails: connection refused") == 1
            assert "check that the node runs" in caplog.text
            stats = tier.statistics()
            assert (stats.errors, stats.calls_skipped, stats.breaker_opens) == (1, 5, 1)
            assert dict(stats.causes) == {"connection refused": 1}
            assert dict(stats.breakers)[f"127.0.0.1:{server.port}"] == 1
            server.start()  # same port; its data is gone (no persistence)
            with pytest.raises(RemoteError, match="circuit breaker is open"):
                tier.exists_many([key])  # still within breaker_seconds
            clock.now += 0.6
            caplog.clear()
            with caplog.at_level("WARNING", logger="tierkv.remote"):
                assert tier.exists_many([key]) == [False]  # the probe
            assert "answers again after 0.6 s of failures (connection refused); skipped " \
                   "meanwhile: 6 lookups" in caplog.text
            assert dict(tier.statistics().breakers)[f"127.0.0.1:{server.port}"] == 0
            tier.put_many([(key, payload_of(key))])
            assert read(tier, key) == (ReadStatus.OK, payload_of(key))


def test_other_failures_open_the_breaker_after_breaker_failures_in_a_row(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cause that may pass (here the server's ACL refusing EXISTS) opens the breaker only
    after remote.breaker_failures calls in a row; it is logged once, not per call."""
    with RedisServer(tmp_path) as server:
        node = redis.Redis(host=HOST, port=server.port)
        node.execute_command("ACL", "SETUSER", "no-exists", "on", ">pw-3", "~*",  # type: ignore[no-untyped-call]
                             "+@all", "-exists")
        node.close()
        url = f"redis://no-exists:pw-3@{HOST}:{server.port}"
        config = RemoteTierConfig(url=url, breaker_failures=3)
        with RemoteTier(config, NS, 0, PAYLOAD, clock=FakeClock()) as tier, \
                caplog.at_level("WARNING", logger="tierkv.remote"):
            for _ in range(3):
                with pytest.raises(RemoteError, match="no permission") as info:
                    tier.exists_many([key_of(1)])
                assert not info.value.skipped
            with pytest.raises(RemoteError, match="circuit breaker is open"):
                tier.exists_many([key_of(1)])
            assert (tier.statistics().errors, tier.statistics().calls_skipped) == (3, 1)
        # once as it starts failing, once as its breaker opens; not once per call
        assert caplog.text.count("fails: no permission") == 2
        assert "1 of remote.breaker_failures (3) failed calls in a row" in caplog.text
        assert "its calls are skipped for 10.0 s" in caplog.text and "pw-3" not in caplog.text


def test_calls_after_close_raise_even_with_nothing_to_do(cluster: RedisCluster) -> None:
    tier = open_tier(cluster)
    tier.close()
    tier.close()  # idempotent
    for call in (lambda: tier.put_many([]), lambda: tier.delete_many([]),
                 lambda: tier.exists_many([]), lambda: tier.read_into(key_of(1), bytearray(PAYLOAD))):
        with pytest.raises(ClosedError, match="after close"):
            call()


ACL = ("~tierkv:* resetchannels -@all +get +getrange +strlen +type +set +exists +del +scan "
       "+evalsha +eval "
       "+script|load +ping +cluster|slots +cluster|shards +command +info +readonly +hello "
       "+auth")  # docs/remote.md, "Security"


def test_an_acl_user_limited_to_its_prefix_is_enough(cluster: RedisCluster) -> None:
    for port in cluster.ports:
        node = redis.Redis(host=HOST, port=port)
        assert node.execute_command("ACL", "SETUSER", "tierkv-test", "on", ">pw-7",  # type: ignore[no-untyped-call]
                                    *ACL.split())
        node.close()
    url = f"redis://tierkv-test:pw-7@{HOST}:{cluster.ports[0]}"
    tier = RemoteTier(RemoteTierConfig(url=url, timeout_seconds=RELAXED), NS, 0, PAYLOAD)
    keys = [key_of(i) for i in range(12)]
    tier.put_many([(key, payload_of(key)) for key in keys])
    assert tier.exists_on_parts(keys, [Part(0, 1)]) == [True] * 12
    assert read(tier, keys[0]) == (ReadStatus.OK, payload_of(keys[0]))
    raw(cluster).set(redis_key(b"tierkv:", NS.fingerprint(), 0, keys[1]), b"bad")
    assert read(tier, keys[1])[0] is ReadStatus.CORRUPT  # the delete-if-same script runs
    assert tier.verify(repair=True).checked == 11 and len(list(tier.scan())) == 11
    assert tier.delete_many(keys) == 11
    outside = RemoteTier(RemoteTierConfig(url=url, key_prefix="other:", timeout_seconds=RELAXED),
                         NS, 0, PAYLOAD)
    with pytest.raises(BrokenError, match="NoPermission|permission"):
        outside.put_many([(keys[0], payload_of(keys[0]))])  # the ACL keeps it to its prefix
    tier.close()
    outside.close()


def test_tls_with_rediss_and_a_ca_file(tmp_path: Path) -> None:
    """``rediss://`` speaks TLS (the zero-copy connection class included); the CA file
    comes from the URL's ``ssl_ca_certs`` query parameter, and a server whose certificate
    the CA did not sign is refused."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not found: it makes the test's certificates")
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", HOST, "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
         "--tls-auth-clients", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"rediss://{HOST}:{port}?ssl_ca_certs={cert}"
        deadline = time.monotonic() + 20
        while True:
            try:
                tier = RemoteTier(RemoteTierConfig(url=url, timeout_seconds=RELAXED), NS, 0,
                                  PAYLOAD)
                break
            except BrokenError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.05)
        keys = [key_of(i) for i in range(4)]
        tier.put_many([(key, payload_of(key)) for key in keys])
        assert all(read(tier, key) == (ReadStatus.OK, payload_of(key)) for key in keys)
        assert not tier.cluster
        tier.close()
        other = tmp_path / "other.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                        "1", "-subj", "/CN=other", "-keyout", str(tmp_path / "other.key"),
                        "-out", str(other)], check=True, capture_output=True)
        with pytest.raises(BrokenError, match="cannot connect"):
            RemoteTier(RemoteTierConfig(url=f"rediss://{HOST}:{port}?ssl_ca_certs={other}"),
                       NS, 0, PAYLOAD)
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.parametrize("tune", [True, False])
def test_opening_the_tier_tunes_malloc_unless_told_not_to(cluster: RedisCluster,
                                                          tune: bool) -> None:
    """remote.tune_malloc (docs/benchmarks/remote.md: 2 MiB puts 0.72x -> 1.17x, reads
    0.60x -> 0.80x of redis-benchmark); a fresh process, since the tuning is per process."""
    code = ("import sys; from tierkv.config import RemoteTierConfig; from tierkv.keys import "
            "Namespace; from tierkv.tiers import tuning; from tierkv.tiers.remote.tier "
            "import RemoteTier; ns = Namespace(model_id='t', dtype='f', kv_layout='NHD', "
            "page_bytes=1, tokens_per_chunk=1); "
            f"RemoteTier(RemoteTierConfig(url=sys.argv[1], tune_malloc={tune}), ns, 0, 1 << 20)"
            ".close(); print('tuned', tuning._malloc_tuned)")
    done = subprocess.run([sys.executable, "-c", code, cluster.url], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "TIERKV_MALLOPT": "1"})
    assert done.returncode == 0, done.stderr[-1000:]
    assert f"tuned {tune}" in done.stdout


def test_a_full_server_refuses_writes_pushes_are_skipped_and_reads_go_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """maxmemory with noeviction: the server answers OOM to SETs. The refused values are
    "no room" (PutResult.full, never an exception), the writes' breaker opens at once with
    one warning that names the cause and the policy to set, and reads go on."""
    keys = [key_of(i, 3) for i in range(256)]  # 2 MiB of values
    with RedisServer(tmp_path, "--maxmemory", "1200kb", "--maxmemory-policy", "noeviction") \
            as server, RemoteTier(RemoteTierConfig(url=server.url), NS, 0, PAYLOAD,
                                  clock=FakeClock()) as tier, \
            caplog.at_level("WARNING", logger="tierkv.remote"):
        stored: list[bytes] = []
        full: tuple[bytes, ...] = ()
        for first in range(0, len(keys), 16):
            result = tier.put_many([(key, payload_of(key)) for key in keys[first:first + 16]])
            stored += result.written
            if result.full:
                full = result.full
                assert result.message is not None and "allkeys-lru" in result.message
                break
        assert stored and full  # some fit, then the server refused the rest
        with pytest.raises(RemoteError, match="skipped") as info:
            tier.put_many([(keys[-1], payload_of(keys[-1]))])  # writes skipped at once
        assert info.value.skipped and info.value.node == "writes"
        assert read(tier, stored[0]) == (ReadStatus.OK, payload_of(stored[0]))  # reads go on
        stats = tier.statistics()
        assert dict(stats.causes) == {"out of memory": 1} and dict(stats.breakers)["writes"] == 1
    assert caplog.text.count("writes fails: out of memory") == 1
