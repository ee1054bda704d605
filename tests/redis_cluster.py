"""Real Redis Cluster processes for the remote tier's tests and benchmark.

:class:`RedisCluster` starts ``masters`` redis-server processes (cluster mode, no
persistence, ``allkeys-lru``) on free loopback ports in a directory of its own, joins them
with ``redis-cli --cluster create`` (no replicas), waits until every node says
``cluster_state:ok``, and stops them by pid. ``scripts/install_redis.sh`` installs the
server; where it is missing the fixture fails with what to run (it is never mocked).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback port that is free, and whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            port = int(probe.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind((HOST, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair for a Redis cluster node")


def _cli(port: int, *args: str, timeout: float = 10) -> str:
    done = subprocess.run(["redis-cli", "-h", HOST, "-p", str(port), *args],
                          capture_output=True, text=True, timeout=timeout)
    return done.stdout


class RedisCluster:
    """``masters`` cluster nodes on loopback; a context manager (see the module docstring)."""

    def __init__(self, root: Path, masters: int = 3, maxmemory: str = "256mb") -> None:
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found: run scripts/install_redis.sh (make test "
                                   f"does) or install Redis 7+ / Valkey 8+")
        self.root = Path(root)
        self.ports = [free_port() for _ in range(masters)]
        self.maxmemory = maxmemory
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.ports[0]}"

    def start_node(self, port: int) -> None:
        node_dir = self.root / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", HOST, "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--dir", str(node_dir), "--save", "",
             "--appendonly", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--cluster-node-timeout", "2000",
             "--logfile", str(node_dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while _cli(port, "PING").strip() != "PONG":
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start (see "
                                   f"{node_dir / 'redis.log'})")
            time.sleep(0.02)

    def stop_node(self, port: int, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(port, None)
        if proc is None:
            return
        os.kill(proc.pid, sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def wait_ok(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not all("cluster_state:ok" in _cli(port, "CLUSTER", "INFO")
                      for port in self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def __enter__(self) -> RedisCluster:
        try:
            for port in self.ports:
                self.start_node(port)
            done = subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"{HOST}:{p}" for p in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-500:]}"
                                   f"{done.stderr[-500:]}")
            self.wait_ok()
        except BaseException:
            self.close()
            raise
        return self

    def flushall(self) -> None:
        for port in self.procs:
            _cli(port, "FLUSHALL")

    def close(self) -> None:
        for port in list(self.procs):
            self.stop_node(port)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class RedisServer:
    """One plain (not cluster) redis-server on a free loopback port; a context manager.
    ``args`` are extra server options (``--requirepass x``)."""

    def __init__(self, root: Path, *args: str) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "",
             "--appendonly", "no", "--dir", str(self.root), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        auth = ["-a", self.args[self.args.index("--requirepass") + 1], "--no-auth-warning"] \
            if "--requirepass" in self.args else []
        while _cli(self.port, *auth, "PING").strip() != "PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
