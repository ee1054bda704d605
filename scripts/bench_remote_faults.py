#!/usr/bin/env python3
"""Time what remote-tier faults cost the engine, on a real 3-master Redis Cluster.

Starts its own cluster on free loopback ports (``tests/redis_cluster.py``, ``maxmemory``
``--maxmemory`` per node) and engines on it (the library API, CPU tensors, no disk tier),
with ``remote.timeout_seconds`` = ``--timeout``, ``remote.mark_seconds`` 600 (a chunk found
stays a remote hit through the run) and the other settings at their defaults. Engine A
stores ``--conversations`` conversations of ``--chunks`` chunks (spread over every master)
and pushes them; engine B looks them all up (noting them as remote hits).
Then, each against the configured timeout (the baseline: what the design promises):

- **stalled master, loads**: one master is SIGSTOPped; B loads each conversation (load,
  wait), first while the other masters still serve (the first
  ``cluster-node-timeout``, 2 s), then ``--down-wait`` seconds later, when the cluster says
  it is down. Per load: wall seconds and chunks that failed (recomputed). Also the
  slowest ``lookup`` + ``store`` of B meanwhile (the engine's step).
- **close() with a master stalled**: engine C stores ``--close-chunks`` chunks while the
  master is stopped (its pushes queue), then closes: wall seconds of ``close()``.
- **256 MiB value**: a value of ``--big-mib`` MiB is put under one chunk's key (as any
  client that may write the prefix can); B loads that chunk: wall seconds of the load, whether
  it failed, the tier's corrupt count, and whether the key is gone afterwards; B's peak RSS
  growth (``ru_maxrss``) over the load.

Every stopped master is continued (SIGCONT) in a ``finally``. Prints one line per figure,
then a verdict line. The figures of docs/remote.md, "Failure modes", come from it.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from redis.cluster import RedisCluster as ClusterClient  # noqa: E402

from tests.redis_cluster import RedisCluster  # noqa: E402
from tierkv import chunk_keys  # noqa: E402
from tierkv.config import CpuTierConfig, RemoteTierConfig, StoreConfig  # noqa: E402
from tierkv.engine.store import TierKVStore  # noqa: E402
from tierkv.tiers.remote.format import redis_key  # noqa: E402

BLOCKS, TPB, BPC, LAYERS = 256, 16, 2, 2
TPC = TPB * BPC


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--timeout", type=float, default=0.5, help="remote.timeout_seconds")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--chunks", type=int, default=4, help="chunks per conversation")
    parser.add_argument("--down-wait", type=float, default=3.0,
                        help="seconds after the stop until the loads of the second phase")
    parser.add_argument("--close-chunks", type=int, default=96)
    parser.add_argument("--big-mib", type=int, default=256)
    parser.add_argument("--maxmemory", default="1gb", help="per master")
    parser.add_argument("--only", nargs="+", choices=["loads", "close", "big"],
                        default=["loads", "close", "big"], help="which measurements")
    return parser.parse_args(argv)


def caches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, 2, TPB, 2, 8, generator=generator).to(torch.float16)
            for _ in range(LAYERS)]


def conversation(i: int, chunks: int) -> list[bytes]:
    return chunk_keys([(i * 1000 + t) % 30000 for t in range(chunks * TPC)], TPC)


def config(url: str, timeout: float) -> StoreConfig:
    return StoreConfig(blocks_per_chunk=BPC, cpu=CpuTierConfig(max_bytes=1 << 22), device="cpu",
                       remote=RemoteTierConfig(url=url, timeout_seconds=timeout,
                                               mark_seconds=600.0))


def store_all(store: TierKVStore, keys: list[bytes]) -> None:
    job = store.store(keys, list(range(len(keys) * BPC)))
    if job is not None:
        store.wait([job])
    store.poll()


def timed_load(store: TierKVStore, keys: list[bytes]) -> tuple[float, int, int]:
    """(seconds, chunks loaded, chunks failed) of one load and its wait."""
    started = time.perf_counter()
    handle = store.load(keys, list(range(len(keys) * BPC)))
    failed = 0
    if handle.job_id is not None:
        store.wait([handle.job_id])
        failed = sum(len(c.failed_keys) for c in store.poll())
    return time.perf_counter() - started, handle.num_chunks, failed


def show(name: str, seconds: list[float], baseline: float) -> None:
    print(f"{name}: median {statistics.median(seconds):.3f} s, max {max(seconds):.3f} s over "
          f"{len(seconds)} (remote.timeout_seconds {baseline} s)", flush=True)


def stalled_loads(cluster: RedisCluster, args: argparse.Namespace) -> None:
    url = cluster.url
    with TierKVStore(caches(1), model_id="m", config=config(url, args.timeout)) as engine_a:
        for i in range(args.conversations):
            store_all(engine_a, conversation(i, args.chunks))
    engine_b = TierKVStore(caches(2), model_id="m", config=config(url, args.timeout))
    victim = cluster.procs[cluster.ports[1]].pid
    try:
        for i in range(args.conversations):  # noted in B's index: remote hits
            deadline = time.monotonic() + 10
            while engine_b.lookup(conversation(i, args.chunks)) < args.chunks:
                assert time.monotonic() < deadline, "the lookup never found A's chunks"
                time.sleep(0.01)
        half = args.conversations // 2
        os.kill(victim, signal.SIGSTOP)
        stopped = time.perf_counter()
        phases: list[tuple[str, list[float], int]] = []
        steps: list[float] = []
        for name, first, end in (("stalled", 0, half), ("down", half, args.conversations)):
            if name == "down":
                time.sleep(max(0.0, args.down_wait - (time.perf_counter() - stopped)))
            seconds, failed = [], 0
            for i in range(first, end):
                took, _, lost = timed_load(engine_b, conversation(i, args.chunks))
                seconds.append(took)
                failed += lost
                started = time.perf_counter()
                engine_b.lookup(conversation(500 + i, args.chunks))
                store_all(engine_b, conversation(500 + i, args.chunks))
                steps.append(time.perf_counter() - started)
            phases.append((name, seconds, failed))
        for name, seconds, failed in phases:
            show(f"stalled master, loads ({name}, {failed} chunks failed)", seconds, args.timeout)
        show("stalled master, lookup + store (the engine's step)", steps, args.timeout)
    finally:
        os.kill(victim, signal.SIGCONT)
        engine_b.close()
    cluster.wait_ok()


def close_while_stalled(cluster: RedisCluster, args: argparse.Namespace) -> None:
    victim = cluster.procs[cluster.ports[2]].pid
    engine = TierKVStore(caches(3), model_id="m", config=config(cluster.url, args.timeout))
    try:
        store_all(engine, conversation(900, 2))  # connected, pushing
        os.kill(victim, signal.SIGSTOP)
        for i in range(args.close_chunks // args.chunks):
            store_all(engine, conversation(1000 + i, args.chunks))
        started = time.perf_counter()
        engine.close()
        show("close() with a master stalled", [time.perf_counter() - started], args.timeout)
    finally:
        os.kill(victim, signal.SIGCONT)
        engine.close()
    cluster.wait_ok()


def open_finding(cluster: RedisCluster, timeout: float, keys: list[bytes], tries: int = 4
                 ) -> tuple[TierKVStore, float]:
    """A store whose lookup finds ``keys``' first chunk on the remote tier, and its
    ``remote.timeout_seconds``. A node that answers its first connect late (a loaded
    machine, a master just resumed) has its breaker opened by that store: a store opened
    again connects afresh, with twice the timeout (make test runs this beside real vLLM
    engines on 2 cores, where 0.5 s was not always enough). Each try first waits for the
    cluster to say it is up: a master stalled by an earlier measurement can be marked
    failed late, and the cluster then answers "cluster down" for a while."""
    for attempt in range(tries):
        cluster.wait_ok()
        engine = TierKVStore(caches(5), model_id="m", config=config(cluster.url, timeout))
        if engine.lookup(keys) == 1:
            return engine, timeout
        engine.close()
        timeout *= 2
        print(f"note: try {attempt + 1}: the remote tier did not answer in time (a loaded "
              f"machine); opening the store again with remote.timeout_seconds {timeout}",
              flush=True)
    raise AssertionError(f"the remote tier never answered a lookup in {tries} stores")


def big_value(cluster: RedisCluster, args: argparse.Namespace) -> None:
    keys = conversation(2000, 1)
    with TierKVStore(caches(4), model_id="m", config=config(cluster.url, args.timeout)) as engine_a:
        store_all(engine_a, keys)
        name = redis_key(b"tierkv:", engine_a.namespace.fingerprint(), 0, keys[0])
    raw = ClusterClient.from_url(cluster.url)
    raw.delete(name)
    raw.setrange(name, (args.big_mib << 20) - 1, b"\0")  # built by the server: no copy here
    engine_b, timeout = open_finding(cluster, args.timeout, keys)
    with engine_b:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        took, loaded, failed = timed_load(engine_b, keys)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        stats = engine_b.statistics().remote
        corrupt = stats.corrupt if stats is not None else -1
    gone = not raw.exists(name)
    raw.close()
    print(f"{args.big_mib} MiB value under a chunk's key: load {took:.3f} s, {failed} of "
          f"{loaded} failed, corrupt counted {corrupt}, deleted {gone}, peak RSS +"
          f"{grown / 1024:.0f} MiB (remote.timeout_seconds {timeout} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with RedisCluster(Path(tempfile.mkdtemp(prefix="tierkv-faults-")),
                      maxmemory=args.maxmemory) as cluster:
        for name, measure in (("loads", stalled_loads), ("close", close_while_stalled),
                              ("big", big_value)):
            if name in args.only:
                measure(cluster, args)
    print(f"verdict: remote faults timed against remote.timeout_seconds ({args.timeout} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
