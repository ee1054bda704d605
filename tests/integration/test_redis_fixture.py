"""The Redis Cluster fixture itself (tests/redis_cluster.py): the remote tier's tests and
the real-engine suite start clusters at the same time, so a port found free can be taken
before redis-server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from tests.redis_cluster import HOST, RedisCluster


@pytest.mark.parametrize("listens", [False, True], ids=["bound", "listening"])
def test_a_node_whose_port_was_taken_starts_on_another(tmp_path: Path, listens: bool) -> None:
    # Regression: a make test run failed at setup ("bind: Address already in use", then
    # ProcessLookupError stopping the node that had exited) while the engine suite ran.
    cluster = RedisCluster(tmp_path / "redis")
    with socket.socket() as squatter:
        squatter.bind((HOST, cluster.ports[0]))
        if listens:  # a server that never answers; else a bound socket (a client's port)
            squatter.listen()
        taken = cluster.ports[0]
        with cluster:
            assert taken not in cluster.ports and len(set(cluster.ports)) == 3
            client = redis.RedisCluster.from_url(cluster.url)
            try:
                client.set(b"k", b"v")
                assert client.get(b"k") == b"v"
            finally:
                client.close()
