"""``tierkv inspect URL``, ``tierkv verify [--repair] URL`` and ``tierkv rm URL`` on the real
3-master cluster."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.cluster import RedisCluster as ClusterClient

from tests.redis_cluster import RedisCluster
from tierkv.cli import main
from tierkv.config import RemoteTierConfig
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.format import redis_key
from tierkv.units import format_bytes

PAYLOAD = 4096
NS = Namespace(model_id="tools", dtype="float16", kv_layout="NHD", page_bytes=512,
               tokens_per_chunk=16)
OTHER = Namespace(model_id="tools-b", dtype="float16", kv_layout="NHD", page_bytes=512,
                  tokens_per_chunk=16)


def relaxed(url: str) -> RemoteTierConfig:
    """The tier the tests seed through: 5 s a call, not the production 0.5 s that a loaded
    2-core CI box can miss while connecting."""
    return RemoteTierConfig(url=url, timeout_seconds=5.0)


@pytest.fixture()
def cluster(redis_cluster: RedisCluster) -> Iterator[RedisCluster]:
    redis_cluster.flushall()
    yield redis_cluster


def fill(cluster: RedisCluster) -> list[bytes]:
    keys = [random.Random(i).randbytes(32) for i in range(12)]
    for namespace, rank, count in ((NS, Part(0, 2), 12), (NS, Part(1, 2), 12), (OTHER, 0, 5)):
        with RemoteTier(relaxed(cluster.url), namespace, rank, PAYLOAD) as tier:
            tier.put_many([(key, random.Random(key).randbytes(PAYLOAD)) for key in keys[:count]])
    return keys


def test_inspect_counts_chunks_and_bytes_per_namespace_and_part(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    fill(cluster)
    raw = ClusterClient.from_url(cluster.url)
    raw.set(b"tierkv:not-a-chunk", b"x")  # under the prefix, not tierkv's: not counted
    raw.close()
    assert main(["inspect", cluster.url]) == 0
    out = capsys.readouterr().out
    value = PAYLOAD + 80  # header + payload
    assert f"namespace {NS.fingerprint()} part 0of2: 12 chunks, {format_bytes(12 * value, 2)}" in out
    assert f"namespace {NS.fingerprint()} part 1of2: 12 chunks" in out
    assert f"namespace {OTHER.fingerprint()} part 0of1: 5 chunks" in out
    assert "2 namespace(s)" in out and "inspected 29 chunks" in out
    assert main(["inspect", cluster.url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["fingerprint"], row["part"], row["chunks"], row["value_bytes"]) for row in rows} \
        == {(NS.fingerprint(), "0of2", 12, 12 * value), (NS.fingerprint(), "1of2", 12, 12 * value),
            (OTHER.fingerprint(), "0of1", 5, 5 * value)}
    assert main(["inspect", cluster.url, "--key-prefix", "elsewhere:"]) == 0
    assert "inspected 0 chunks" in capsys.readouterr().out


def test_verify_finds_bad_values_and_repair_deletes_them(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    keys = fill(cluster)
    raw = ClusterClient.from_url(cluster.url)
    flipped = redis_key(b"tierkv:", NS.fingerprint(), Part(0, 2), keys[3])
    value = bytearray(raw.get(flipped))
    value[100] ^= 1
    raw.set(flipped, bytes(value))
    moved = redis_key(b"tierkv:", NS.fingerprint(), Part(1, 2), keys[4])  # part 0's under 1
    raw.set(moved, raw.get(redis_key(b"tierkv:", NS.fingerprint(), Part(0, 2), keys[4])))
    assert main(["verify", cluster.url]) == 1
    out = capsys.readouterr().out
    assert out.count("bad chunk") == 2 and keys[3].hex() in out and keys[4].hex() in out
    assert "verified 29 chunks" in out and "run with --repair" in out
    assert raw.exists(flipped) and raw.exists(moved)  # verify alone changed nothing
    assert main(["verify", cluster.url, "--repair"]) == 1
    assert "2 bad, deleted 2" in capsys.readouterr().out
    assert not raw.exists(flipped) and not raw.exists(moved)
    assert main(["verify", cluster.url]) == 0
    assert "verified 27 chunks" in capsys.readouterr().out
    raw.close()


def test_verify_reads_every_value_through_the_tier(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tool has no read-and-check loop of its own: each value of the right size is read,
    checked and repaired by RemoteTier.verify_chunk, the load's own path."""
    keys = fill(cluster)
    raw = ClusterClient.from_url(cluster.url)
    flipped = redis_key(b"tierkv:", NS.fingerprint(), Part(1, 2), keys[2])
    value = bytearray(raw.get(flipped))
    value[-1] ^= 1
    raw.set(flipped, bytes(value))
    seen: list[tuple[str, bytes, str, bool]] = []
    real = RemoteTier.verify_chunk

    def spy(tier: RemoteTier, key: bytes, part: Part | None = None,
            repair: bool = False, out: memoryview | None = None) -> object:
        seen.append((tier.fingerprint, key, part.name if part else "", repair))
        return real(tier, key, part, repair, out)

    monkeypatch.setattr(RemoteTier, "verify_chunk", spy)
    assert main(["verify", cluster.url, "--repair"]) == 1
    assert "1 bad, deleted 1" in capsys.readouterr().out and not raw.exists(flipped)
    assert len(seen) == 29 and all(repair for *_, repair in seen)
    assert (NS.fingerprint(), keys[2], "1of2", True) in seen
    raw.close()


def test_a_server_that_is_not_there_is_an_error_naming_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.redis_cluster import free_port

    url = f"redis://:pw-not-shown@127.0.0.1:{free_port()}"
    assert main(["verify", url, "--timeout", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "cannot connect" in err and "pw-not-shown" not in err and "127.0.0.1" in err


def test_verify_shows_progress_and_speed_and_only_one_namespace(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv import tools

    fill(cluster)
    monkeypatch.setattr(tools, "PROGRESS_SECONDS", 0.0)
    assert main(["verify", cluster.url]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"verified 29 chunks in {cluster.url}: clean"]  # unchanged
    lines = err.splitlines()
    value = PAYLOAD + 80
    # Counted as they are read: no total; one line per value at interval 0.
    assert lines[0].startswith("verify: 1 chunks, 4.1 KiB, ") and lines[0].endswith("/s")
    assert lines[28].startswith(f"verify: 29 chunks, {format_bytes(29 * value, 1)}, ")
    assert lines[29].startswith(f"verify: checked 29 chunks, {format_bytes(29 * value, 2)} in ")
    assert len(lines) == 30
    assert main(["verify", cluster.url, "--no-progress", "--namespace", NS.fingerprint()[:6]]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("verified 24 chunks")  # both ranks of NS only
    assert len(err.splitlines()) == 1 and "verify: checked 24 chunks" in err  # the closing line
    assert main(["verify", cluster.url, "--namespace", "ffffffffffffffff"]) == 2
    assert "no namespace in" in capsys.readouterr().err


def test_rm_deletes_one_namespace_s_keys_and_leaves_the_rest(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    keys = fill(cluster)
    raw = ClusterClient.from_url(cluster.url)
    raw.set(b"tierkv:" + NS.fingerprint().encode() + b":not-a-chunk", b"x")  # not tierkv's
    value = PAYLOAD + 80
    prefix = NS.fingerprint()[:6]
    assert main(["rm", cluster.url, "--namespace", prefix, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"namespace {NS.fingerprint()} in {cluster.url} (prefix 'tierkv:'): 24 "
                      f"chunks (part 0of2: 12, part 1of2: 12), {format_bytes(24 * value, 2)}")
    assert out[-1] == "dry run: would delete 24 keys; nothing deleted"
    assert main(["rm", cluster.url, "--namespace", prefix]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "not deleted: add --yes to delete its 24 keys"
    assert raw.exists(redis_key(b"tierkv:", NS.fingerprint(), Part(1, 2), keys[0]))

    assert main(["rm", cluster.url, "--namespace", prefix, "--yes"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"removed namespace {NS.fingerprint()[:8]} from {cluster.url}: 24 chunks, "
        f"{format_bytes(24 * value, 2)} freed")
    assert not any(raw.exists(redis_key(b"tierkv:", NS.fingerprint(), Part(rank, 2), key))
                   for rank in (0, 1) for key in keys)
    assert raw.exists(b"tierkv:" + NS.fingerprint().encode() + b":not-a-chunk")
    assert main(["verify", cluster.url]) == 0
    assert "verified 5 chunks" in capsys.readouterr().out  # OTHER's, untouched
    with RemoteTier(relaxed(cluster.url), OTHER, 0, PAYLOAD) as tier:
        out_buffer = memoryview(bytearray(PAYLOAD))
        assert all(tier.read_into(key, out_buffer) is ReadStatus.OK and
                   bytes(out_buffer) == random.Random(key).randbytes(PAYLOAD) for key in keys[:5])
    assert main(["rm", cluster.url, "--namespace", prefix, "--yes"]) == 2  # gone now
    assert "no namespace in" in capsys.readouterr().err
    raw.close()


def test_rm_refuses_an_ambiguous_prefix(cluster: RedisCluster,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tests.integration.test_tools import twins

    first, second = twins()
    for namespace in (first, second):
        with RemoteTier(relaxed(cluster.url), namespace, 0, PAYLOAD) as tier:
            tier.put_many([(bytes(32), bytes(PAYLOAD))])
    assert main(["rm", cluster.url, "--namespace", first.fingerprint()[:1], "--yes"]) == 2
    err = capsys.readouterr().err
    assert f"2 namespaces in {cluster.url} (prefix 'tierkv:') start with" in err
    assert first.fingerprint() in err and second.fingerprint() in err
    assert "give a longer --namespace prefix" in err
    assert main(["inspect", cluster.url]) == 0
    assert "inspected 2 chunks" in capsys.readouterr().out  # nothing deleted


def plant_other_types(cluster: RedisCluster, keys: list[bytes]) -> list[bytes]:
    """A list and a hash under two of NS's part-0 chunk names: keys of another type."""
    raw = ClusterClient.from_url(cluster.url)
    names = [redis_key(b"tierkv:", NS.fingerprint(), Part(0, 2), key) for key in keys[:2]]
    raw.delete(*names[:1])
    raw.delete(*names[1:])
    raw.rpush(names[0], b"x", b"y")
    raw.hset(names[1], "field", "value")
    raw.close()
    return names


def test_keys_of_another_type_are_bad_values_for_every_tool(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """A tierkv-shaped key holding a list or a hash: inspect counts it, verify reports it
    (exit 1, never a traceback), --repair and rm delete it."""
    keys = fill(cluster)
    names = plant_other_types(cluster, keys)
    assert main(["inspect", cluster.url]) == 0
    out = capsys.readouterr().out
    assert f"namespace {NS.fingerprint()} part 0of2: 12 chunks" in out
    assert "2 key(s) of another type" in out
    assert main(["inspect", cluster.url, "--json"]) == 0
    rows = {(row["fingerprint"], row["part"]): row for row in json.loads(capsys.readouterr().out)}
    assert rows[(NS.fingerprint(), "0of2")]["wrong_type"] == 2
    assert main(["verify", cluster.url]) == 1
    out = capsys.readouterr().out
    assert out.count("the key holds another type than a string") == 2
    assert "verified 29 chunks" in out and "2 bad" in out
    assert main(["verify", cluster.url, "--repair"]) == 1
    assert "2 bad, deleted 2" in capsys.readouterr().out
    raw = ClusterClient.from_url(cluster.url)
    assert not any(raw.exists(name) for name in names)
    assert main(["verify", cluster.url]) == 0
    plant_other_types(cluster, keys)
    assert main(["rm", cluster.url, "--namespace", NS.fingerprint()[:8], "--yes"]) == 0
    out = capsys.readouterr().out
    assert "2 key(s) of another type" in out and "24 chunks" in out
    assert not any(raw.exists(name) for name in names)
    raw.close()


def test_a_value_of_another_size_is_bad_before_it_is_read(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    keys = fill(cluster)
    raw = ClusterClient.from_url(cluster.url)
    name = redis_key(b"tierkv:", NS.fingerprint(), Part(0, 2), keys[5])
    raw.setrange(name, 64 << 20, b"\0")  # its header kept, 64 MiB long
    assert main(["verify", cluster.url, "--json", "--no-progress"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == 29 and not report["clean"]
    assert [(bad["key"], bad["problem"][:14]) for bad in report["bad"]] == \
        [(keys[5].hex(), "value of 67108")]
    assert report["checked_bytes"] == 28 * (PAYLOAD + 80)  # the big one was not read
    assert main(["verify", cluster.url, "--repair", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["deleted"] == 1 and not raw.exists(name)
    raw.close()


def test_verify_and_rm_print_json(cluster: RedisCluster,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    fill(cluster)
    assert main(["verify", cluster.url, "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["checked"], report["clean"], report["bad"]) == (29, True, [])
    prefix = OTHER.fingerprint()[:6]
    assert main(["rm", cluster.url, "--namespace", prefix, "--json"]) == 1  # no --yes
    plan = json.loads(capsys.readouterr().out)
    assert (plan["fingerprint"], plan["keys"], plan["deleted"]) == (OTHER.fingerprint(), 5, 0)
    assert main(["rm", cluster.url, "--namespace", prefix, "--json", "--yes"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert (done["deleted"], done["keys_per_part"], done["value_bytes"]) == \
        (5, {"0of1": 5}, 5 * (PAYLOAD + 80))


def test_ping_reports_nodes_slots_password_chunks_and_policy(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    fill(cluster)
    assert main(["ping", cluster.url]) == 0
    out = capsys.readouterr().out
    assert out.count(" primary: ") == 3 and "maxmemory-policy allkeys-lru" in out
    assert "slots: 16384 of 16384 covered (cluster_state ok)" in out
    assert "29 chunks" in out and "2 namespace(s)" in out and "password none sent" in out
    assert out.splitlines()[-1] == "pinged 3 node(s): ready for tierkv"
    assert main(["ping", cluster.url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chunks"] == 29 and report["value_bytes"] == 29 * (PAYLOAD + 80)
    assert all(node["latency_ms"] is not None for node in report["nodes"])
    import redis

    node = redis.Redis(host="127.0.0.1", port=cluster.ports[1])
    node.config_set("maxmemory-policy", "noeviction")
    try:
        assert main(["ping", cluster.url]) == 1
        out = capsys.readouterr().out
        assert f"problem: node 127.0.0.1:{cluster.ports[1]} has maxmemory-policy noeviction" in out
    finally:
        node.config_set("maxmemory-policy", "allkeys-lru")
        node.close()


@pytest.fixture()
def own_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path / "redis") as started:
        yield started


def test_a_node_down_is_one_line_naming_it_for_every_tool(
        own_cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """A master killed: inspect, verify, verify --repair and rm exit 2 (error, not "bad
    found") with one line naming the node and what to do; ping exits 1 and lists it."""
    fill(own_cluster)
    victim = own_cluster.ports[1]
    own_cluster.stop_node(victim, signal.SIGKILL)
    for argv in (["inspect"], ["verify"], ["verify", "--repair"],
                 ["rm", "--namespace", NS.fingerprint()[:6], "--yes"]):
        assert main([*argv, own_cluster.url, "--timeout", "1"]) == 2, argv
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"node 127.0.0.1:{victim}" in err and "connection refused" in err
        assert "check that the node runs" in err and "rerun" in err
    assert main(["ping", own_cluster.url, "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert f"node 127.0.0.1:{victim} primary: DOWN: connection refused" in out


def test_a_stalled_node_costs_a_tool_one_timeout(
        own_cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    fill(own_cluster)
    pid = own_cluster.procs[own_cluster.ports[2]].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        assert main(["verify", own_cluster.url, "--timeout", "0.5"]) == 2
        took = time.perf_counter() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    err = capsys.readouterr().err
    assert f"node 127.0.0.1:{own_cluster.ports[2]}" in err and "timeout" in err
    assert "raise --timeout" in err
    assert took < 0.5 + 2.0, took  # one deadline, not redis-py's retries


def test_values_of_tierkv_format_4_are_named_and_refused_never_read(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """Format 4 kept one value per rank, keys ending in ``:<rank>``: this tierkv never reads
    them (its keys end in ``:<p>of<P>``, its fingerprints differ); inspect and verify name
    them with the ``tierkv rm`` that deletes them, --repair leaves them, rm deletes them."""
    old_fp = "0123456789abcdef0123456789abcdef"
    raw = ClusterClient.from_url(cluster.url)
    names = [b"tierkv:%s:{%s}:%d" % (old_fp.encode(), bytes([i]).hex().encode() * 32, rank)
             for i in range(3) for rank in (0, 1)]
    for name in names:
        raw.set(name, b"TKRV" + bytes(PAYLOAD + 76))
    assert main(["inspect", cluster.url]) == 0
    out = capsys.readouterr().out
    line = f"tierkv rm {cluster.url} --namespace {old_fp} --yes"
    assert f"namespace {old_fp} rank 0, format 4: 3 chunks" in out and line in out
    assert main(["verify", cluster.url, "--repair"]) == 1
    out = capsys.readouterr().out
    assert out.count("a value of tierkv format 4") == 6 and line in out
    assert all(raw.exists(name) for name in names)  # never repaired away
    assert main(["rm", cluster.url, "--namespace", old_fp, "--yes"]) == 0
    assert not any(raw.exists(name) for name in names)
    raw.close()


def test_a_long_scan_reports_its_progress_through_the_tiers_scan(
        cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """The tools list keys through the tier's one SCAN loop (``client.scan_names``), every
    page under the tool's deadline, and a long listing says how far it got."""
    from tierkv.tiers.remote.tools import Session, scan_entries

    keys = fill(cluster)
    session = Session(relaxed(cluster.url))
    try:
        entries = scan_entries(session, NS.fingerprint()[:6], report_every=10)
    finally:
        session.close()
    assert sorted(key for _, fingerprint, _, key in entries
                  if fingerprint == NS.fingerprint()) == sorted(keys + keys)
    assert "  ... 10 keys scanned\n  ... 20 keys scanned\n" in capsys.readouterr().err
