"""A router's view of tierkv on vLLM's OpenAI server (issue 45): the KV events on vLLM's
own event socket (``--kv-events-config``, ZMQ, read back through its replay socket) name
the disk tier's stores and cap evictions (medium STORAGE, locality LOCAL); after a restart
the server sends what the disk holds, and those blocks are exactly what the next requests
hit; the capacity gauges of ``/metrics`` agree with ``tierkv inspect``.

One test, two server starts: the first with a disk cap of 6 chunks, which 9 stored chunks
overflow (the oldest 3 are evicted); the second with room for all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tests.engine.engines import prompt
from tests.engine.processes import Server, free_port, parse_metrics

TOKENS_PER_CHUNK = 128  # the connector's default on vLLM's CPU backend
CHUNK_BYTES = 4 * 2 * 2 * 64 * 4 * TOKENS_PER_CHUNK  # tiny llama: layers, K/V, heads, dim, fp32
DISK_CHUNKS = 6
INDEX_FILES = 320 << 10  # the rank's index files and claims, which the disk cap counts too
PROMPTS = [prompt(300, seed=60), prompt(400, seed=61), prompt(520, seed=62)]  # 2 + 3 + 4 chunks
SETTLE_SECONDS = 120.0


class Events:
    """A subscriber of one server's event socket that reads every batch back from its replay
    socket (the publisher's buffer), so that none published before it asked is missed."""

    def __init__(self) -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"tcp://127.0.0.1:{self.port}",
                                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
                                  "topic": "kv"})
        self._decode = msgspec.msgpack.Decoder(KVEventBatch)

    def all(self) -> list[Any]:
        """Every event published so far, in order."""
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{self.replay_port}")
        try:
            socket.send_multipart([b"", (0).to_bytes(8, "big")])
            events: list[Any] = []
            while True:
                assert socket.poll(60_000), "the replay socket did not answer"
                _, topic, seq, payload = socket.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) < 0:
                    return events
                assert topic == b"kv"
                events.extend(self._decode.decode(payload).events)
        finally:
            socket.close()

    def storage(self) -> list[Any]:
        return [event for event in self.all() if event.medium == "STORAGE"]


def inspect(disk: Path) -> tuple[int, int]:
    """(chunks, payload bytes) of the disk tier, as ``tierkv inspect --json`` counts them."""
    done = subprocess.run([sys.executable, "-m", "tierkv", "inspect", "--json", str(disk)],
                          capture_output=True, text=True, timeout=120, check=True)
    ranks = [rank for namespace in json.loads(done.stdout) for rank in namespace["ranks"]]
    return sum(rank["chunks"] for rank in ranks), sum(rank["payload_bytes"] for rank in ranks)


def settle(server: Server, check: Any) -> Any:
    """Poll until ``check()`` answers (a state the test waits for: write-behind and the
    gauges' next report); a tiny prompt between polls makes the engine step."""
    started = time.monotonic()
    while (answer := check()) is None:
        assert time.monotonic() - started < SETTLE_SECONDS, server.tail()
        server.complete(prompt(10, seed=69), max_tokens=1)
        time.sleep(0.5)  # polling a server's state, not ordering the test
    return answer


def gauges_agree_with_inspect(server: Server, disk: Path, chunks: int) -> Any:
    figures = parse_metrics(server.metrics())
    on_disk, payload = inspect(disk)
    disk_gauges = {key.split("{")[0]: value for key, value in figures.items()
                   if 'tier="disk"' in key}
    if on_disk != chunks or disk_gauges.get("tierkv:usage_tokens") != on_disk * TOKENS_PER_CHUNK:
        return None
    assert disk_gauges["tierkv:usage_bytes"] == payload == on_disk * CHUNK_BYTES
    return disk_gauges


def chain_hits(snapshot: list[BlockStored], tokens: list[int]) -> int:
    """Chunks of ``tokens`` a router would route to this server for, from the snapshot: the
    leading chunks whose tokens and parent hash chain match a stored block."""
    by_parent = {(event.parent_block_hash, tuple(event.token_ids)): event for event in snapshot}
    parent, hits = None, 0
    while (hits + 1) * TOKENS_PER_CHUNK < len(tokens):
        event = by_parent.get((parent, tuple(tokens[hits * TOKENS_PER_CHUNK:
                                                   (hits + 1) * TOKENS_PER_CHUNK])))
        if event is None:
            break
        parent, hits = event.block_hashes[-1], hits + 1
    return hits


def test_a_router_sees_the_disk_tier_and_a_restarts_snapshot(
        models: dict[str, Path], tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    settings = {"cpu_bytes": 64 << 20, "disk_path": str(disk), "load_policy": "always",
                "disk_bytes": DISK_CHUNKS * (CHUNK_BYTES + 8192) + INDEX_FILES}
    events = Events()
    with Server(models["llama"], tmp_path / "first.log", settings,
                args=["--kv-events-config", events.config]) as server:
        for tokens in PROMPTS:
            server.complete(tokens)
        stored = sum((len(tokens) - 1) // TOKENS_PER_CHUNK for tokens in PROMPTS)

        def disk_events() -> list[Any] | None:
            seen = events.storage()
            removed = [event for event in seen if isinstance(event, BlockRemoved)]
            return seen if len(seen) - len(removed) == stored and removed else None

        seen = settle(server, disk_events)
        assert all(event.locality == "LOCAL" for event in seen)
        held: dict[Any, BlockStored] = {}
        for event in seen:  # a router's index of the disk tier
            for block in event.block_hashes:
                if isinstance(event, BlockStored):
                    held[block] = event
                else:
                    del held[block]
        on_disk = {id(event): event for event in held.values()}
        assert len(on_disk) == DISK_CHUNKS and len(seen) == stored + stored - DISK_CHUNKS
        gauges = settle(server, lambda: gauges_agree_with_inspect(server, disk, DISK_CHUNKS))
        assert gauges["tierkv:capacity_tokens"] == DISK_CHUNKS * TOKENS_PER_CHUNK
        assert gauges["tierkv:capacity_bytes"] == DISK_CHUNKS * CHUNK_BYTES
        server.stop()

    events = Events()
    settings["disk_bytes"] = 64 << 20  # room for all: nothing evicted while it serves
    with Server(models["llama"], tmp_path / "second.log", settings,
                args=["--kv-events-config", events.config]) as server:
        # The snapshot goes out in the first steps after the start (the engine steps until
        # it is out); the replay socket gives it whenever the subscriber asks.
        snapshot = settle(server, lambda: (found if len(found := [
            event for event in events.storage() if isinstance(event, BlockStored)])
            >= DISK_CHUNKS else None))
        assert all(event.locality == "LOCAL" for event in snapshot)
        assert sorted(tuple(event.token_ids) for event in snapshot) == sorted(
            tuple(event.token_ids) for event in on_disk.values())
        for tokens in PROMPTS:
            hits = chain_hits(snapshot, tokens)
            assert server.complete(tokens).cached_tokens == hits * TOKENS_PER_CHUNK
        assert chain_hits(snapshot, PROMPTS[-1]) == 4  # the newest prompt stayed whole
