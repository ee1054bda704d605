"""Real Redis Cluster processes for the remote tier's tests and benchmark.

:class:`RedisCluster` starts ``masters`` redis-server processes (cluster mode, no
persistence, ``allkeys-lru``) on free loopback ports in a directory of its own, joins them
with ``redis-cli --cluster create`` (no replicas), waits until every node says
``cluster_state:ok``, and stops them by pid. ``scripts/install_redis.sh`` installs the
server; where it is missing the fixture fails with what to run (it is never mocked).
:meth:`RedisCluster.reshard` moves slots and their keys between masters while clients run,
the way ``redis-cli --cluster reshard`` does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

HOST = "127.0.0.1"
PORT_TRIES = 5  # a node whose port was taken between free_port() and its bind moves on


class PortTaken(RuntimeError):
    """A node's port (or its cluster bus port, +10000) was taken before it bound: other
    processes on the machine (the real-engine suite runs beside this one) open ports too."""


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


def _command(node: redis.Redis, *args: object) -> Any:
    """``node.execute_command(*args)``, the command name given word by word: redis-py then
    applies no reply callback (its ``CLUSTER GETKEYSINSLOT`` one decodes binary keys to str,
    replacing what is not UTF-8)."""
    return node.execute_command(*args)  # type: ignore[no-untyped-call]


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
        while not self._pongs(port):
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                log = node_dir / "redis.log"
                said = log.read_text(errors="replace") if log.exists() else ""
                error = PortTaken if "Address already in use" in said else RuntimeError
                raise error(f"redis-server on port {port} did not start (see {log})")
            time.sleep(0.02)

    @staticmethod
    def _pongs(port: int) -> bool:
        """Whether a server on ``port`` answers PING (another process's listener that never
        answers: no, after a second)."""
        try:
            return _cli(port, "PING", timeout=1).strip() == "PONG"
        except subprocess.TimeoutExpired:
            return False

    def stop_node(self, port: int, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(port, None)
        if proc is None or proc.poll() is not None:  # never started, or exited already
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
            for i in range(len(self.ports)):
                self._start_on_a_free_port(i)
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

    def _start_on_a_free_port(self, i: int) -> None:
        """Node ``i``, on another free port each time its port was taken before it bound."""
        for attempt in range(PORT_TRIES):
            try:
                self.start_node(self.ports[i])
                return
            except PortTaken:
                self.stop_node(self.ports[i])
                if attempt == PORT_TRIES - 1:
                    raise
                self.ports[i] = free_port()

    def node_id(self, port: int) -> str:
        """The cluster node id of the master on ``port``."""
        return _cli(port, "CLUSTER", "MYID").strip()

    def slots_of(self, port: int) -> list[int]:
        """The slots the master on ``port`` owns, as it says itself (ascending)."""
        myself = next(line for line in _cli(port, "CLUSTER", "NODES").splitlines()
                      if "myself" in line.split()[2].split(","))
        slots: list[int] = []
        for part in myself.split()[8:]:
            if part.startswith("["):
                continue  # [slot->-id] / [slot-<-id]: a slot being migrated or imported
            low, _, high = part.partition("-")
            slots.extend(range(int(low), int(high or low) + 1))
        return sorted(slots)

    def reshard(self, source_port: int, target_port: int, num_slots: int,
                pause: float = 0.0, batch: int = 100) -> int:
        """Move the ``num_slots`` lowest slots of the master on ``source_port`` to the one on
        ``target_port`` with their keys (:meth:`move_slots`). Returns the keys moved."""
        slots = self.slots_of(source_port)
        if len(slots) < num_slots:
            raise ValueError(f"port {source_port} owns {len(slots)} slots, not {num_slots}")
        return self.move_slots(slots[:num_slots], source_port, target_port, pause, batch)

    def move_slots(self, slots: Iterable[int], source_port: int, target_port: int,
                   pause: float = 0.0, batch: int = 100) -> int:
        """Move each of ``slots`` (owned by ``source_port``) and its keys to ``target_port``
        as ``redis-cli --cluster reshard`` does, slot by slot: IMPORTING on the target,
        MIGRATING on the source, ``MIGRATE`` ``batch`` keys at a time until none is left,
        then NODE on the target, the source and every other master. ``pause`` seconds are
        slept after each ``MIGRATE`` and before the NODEs, while the slot is open (clients
        get ``ASK`` for its keys that moved). Returns the number of keys moved."""
        ids = {port: self.node_id(port) for port in self.procs}
        nodes = {port: redis.Redis(host=HOST, port=port) for port in self.procs}
        source, target = nodes[source_port], nodes[target_port]
        others = [nodes[port] for port in nodes if port not in (source_port, target_port)]
        moved = 0
        try:
            for slot in slots:
                _command(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source_port])
                _command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target_port])
                while keys := _command(source, "CLUSTER", "GETKEYSINSLOT", slot, batch):
                    _command(source, "MIGRATE", HOST, target_port, "", 0, 5000, "KEYS", *keys)
                    moved += len(keys)
                    time.sleep(pause)
                time.sleep(pause)
                for node in (target, source, *others):
                    _command(node, "CLUSTER", "SETSLOT", slot, "NODE", ids[target_port])
        finally:
            for node in nodes.values():
                node.close()
        return moved

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

    def flushall(self) -> None:
        _cli(self.port, "FLUSHALL")

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
