"""RemoteIO (write-behind pushes) on the real 3-master cluster: pushes land, a full queue
skips and counts, and a paused or dead server never holds up the pushing thread."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_cluster import HOST, RedisCluster, RedisServer
from tierkv.config import RemoteTierConfig
from tierkv.errors import ClosedError
from tierkv.keys import Namespace
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.pushes import RemoteIO

PAYLOAD = 16384
NS = Namespace(model_id="push", dtype="float16", kv_layout="NHD", page_bytes=512,
               tokens_per_chunk=16)


def key_of(i: int) -> bytes:
    return random.Random(i).randbytes(32)


def payload_of(key: bytes) -> bytes:
    return random.Random(key).randbytes(PAYLOAD)


@pytest.fixture()
def cluster(redis_cluster: RedisCluster) -> Iterator[RedisCluster]:
    redis_cluster.flushall()
    yield redis_cluster


def test_pushes_land_in_batches_and_the_slot_may_be_reused_at_once(
        cluster: RedisCluster) -> None:
    with RemoteTier(RemoteTierConfig(url=cluster.url, timeout_seconds=5), NS, 0, PAYLOAD) as tier:
        io = RemoteIO(tier, queue_bytes=64 * PAYLOAD, batch=8)
        slot = bytearray(PAYLOAD)
        keys = [key_of(i) for i in range(40)]
        for key in keys:
            slot[:] = payload_of(key)
            assert io.push(key, memoryview(slot))
        slot[:] = bytes(PAYLOAD)  # the slot is reused: the queued copies are unaffected
        assert io.flush(timeout=10)
        stats = io.statistics()
        assert (stats.pushes_queued, stats.pushes_pushed, stats.pushes_dropped,
                stats.pushes_failed) == (40, 40, 0, 0)
        assert stats.pushes_bytes == 40 * PAYLOAD and stats.pushes_queue_bytes == 0
        out = memoryview(bytearray(PAYLOAD))
        for key in keys:
            assert tier.read_into(key, out) is ReadStatus.OK and bytes(out) == payload_of(key)
        io.shutdown()
        with pytest.raises(ClosedError):
            io.push(keys[0], payload_of(keys[0]))


def test_a_paused_server_fills_the_queue_and_pushes_are_skipped_not_waited_for(
        cluster: RedisCluster) -> None:
    with RemoteTier(RemoteTierConfig(url=cluster.url, timeout_seconds=5), NS, 0,
                    PAYLOAD) as tier:
        io = RemoteIO(tier, queue_bytes=4 * PAYLOAD, batch=2)
        for port in cluster.ports:  # the server stops answering writes for 1.5 s
            subprocess.run(["redis-cli", "-h", HOST, "-p", str(port), "CLIENT", "PAUSE",
                            "1500", "WRITE"], check=True, capture_output=True)
        started = time.monotonic()
        accepted = [io.push(key_of(i), payload_of(key_of(i))) for i in range(20)]
        assert time.monotonic() - started < 0.5  # never waited on the paused server
        assert 2 <= sum(accepted) <= 6 and not all(accepted)  # the queue holds 4 (+ 2 sent)
        assert io.statistics().pushes_dropped == 20 - sum(accepted)
        assert io.flush(timeout=20)
        stats = io.statistics()
        assert stats.pushes_pushed == sum(accepted) and stats.pushes_failed == 0
        io.shutdown()


def test_a_dead_server_fails_batches_quietly_and_the_engine_goes_on(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        config = RemoteTierConfig(url=server.url, timeout_seconds=0.2, breaker_failures=2,
                                  breaker_seconds=30)
        with RemoteTier(config, NS, 0, PAYLOAD) as tier:
            io = RemoteIO(tier, queue_bytes=64 * PAYLOAD, batch=4)
            server.stop()
            started = time.monotonic()
            for i in range(32):
                assert io.push(key_of(i), payload_of(key_of(i)))
            assert time.monotonic() - started < 0.5
            assert io.flush(timeout=20)
            stats = io.statistics()
            assert stats.pushes_failed == 32 and stats.pushes_pushed == 0
            assert tier.statistics().calls_skipped >= 6  # the breaker spared most batches the wait
            io.shutdown()
