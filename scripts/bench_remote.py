#!/usr/bin/env python3
"""Benchmark the remote tier on a real 3-master Redis Cluster against redis-benchmark.

Starts its own cluster on free loopback ports (``tests/redis_cluster.py``; needs
redis-server 7+ and redis-cli, see ``scripts/install_redis.sh``) and stops it at the end.
Per chunk size (``--chunk-kib``), interleaved over ``--rounds`` rounds, medians:

- ``redis-benchmark --cluster -c 1 -d <value bytes> -r <chunks>``: the server's own C
  client, same value size, one connection: ``-t set -P <batch>`` (tierkv's put pipelines)
  and ``-t get -P 1`` (tierkv reads one chunk per GET); bytes over its wall time (its own
  ``rps`` counts 250 ms ticks), at least ``--benchmark-mib`` per run.
- tierkv ``RemoteTier.put_many`` in batches of ``--batch`` chunks (one pipeline each) and
  ``read_into`` of every chunk (one GET each, verified), as MiB/s; every read is byte-exact.
- Lookup of ``--ranks`` ranks per chunk, for ``--lookup-chunks`` chunks, with the tier's
  key layout (a chunk's ranks share a hash tag, so one node) against the same keys without
  the tag (ranks spread over nodes): one pipelined ``EXISTS`` of everything, and one
  pipeline per chunk (a step that asks about one chunk), in us per chunk, with how many
  nodes one chunk's check touches.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from redis.cluster import RedisCluster as ClusterClient  # noqa: E402

from tests.redis_cluster import RedisCluster  # noqa: E402
from tierkv.config import RemoteTierConfig  # noqa: E402
from tierkv.keys import Namespace  # noqa: E402
from tierkv.tiers.base import ReadStatus  # noqa: E402
from tierkv.tiers.remote import RemoteTier  # noqa: E402
from tierkv.tiers.remote_format import HEADER_BYTES, redis_key  # noqa: E402

MiB = 1 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunk-kib", type=int, nargs="+", default=[256, 2048],
                        help="payload sizes")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per method and round")
    parser.add_argument("--batch", type=int, default=16, help="chunks per put_many pipeline")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per chunk in the lookup")
    parser.add_argument("--lookup-chunks", type=int, default=2000, help="chunks looked up")
    parser.add_argument("--benchmark-mib", type=int, default=2048,
                        help="bytes each redis-benchmark run moves at least")
    return parser.parse_args(argv)


def redis_benchmark(cluster: RedisCluster, value_bytes: int, keys: int, pipeline: int,
                    at_least_mib: int) -> dict[str, float]:
    """MiB/s of redis-benchmark (one client, values of ``value_bytes`` over ``keys`` random
    keys): SET pipelined ``pipeline`` deep (as tierkv's put_many), then GET one at a time
    (as tierkv's read_into), 4 requests per key each (about 2% of the GETs miss) and at
    least ``at_least_mib``. Timed here, start to exit (its own figure counts 250 ms ticks)."""
    requests = max(4 * keys, -(-at_least_mib * MiB // value_bytes))
    requests = -(-requests // pipeline) * pipeline  # else its last pipeline aborts the run
    result = {}
    for test, depth in (("set", pipeline), ("get", 1)):
        start = time.perf_counter()
        done = subprocess.run(
            ["redis-benchmark", "-h", "127.0.0.1", "-p", str(cluster.ports[0]), "--cluster",
             "-t", test, "-d", str(value_bytes), "-n", str(requests), "-r", str(keys),
             "-P", str(depth), "-c", "1", "--csv"], capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - start  # its own rps comes in 250 ms ticks
        if not any(len(row) > 1 and row[0] == test.upper()
                   for row in csv.reader(io.StringIO(done.stdout))):
            raise RuntimeError(f"redis-benchmark -t {test} gave no figure: {done.stderr[-300:]}")
        result[test.upper()] = requests * value_bytes / MiB / seconds
    return result


def tierkv_round(cluster: RedisCluster, chunk_bytes: int, num_chunks: int,
                 batch: int, round_number: int) -> dict[str, float]:
    namespace = Namespace(model_id=f"bench-{round_number}", dtype="bfloat16", kv_layout="NHD",
                          page_bytes=chunk_bytes, tokens_per_chunk=256)
    keys = [os.urandom(32) for _ in range(num_chunks)]
    payloads = [os.urandom(chunk_bytes) for _ in range(min(num_chunks, 8))]
    out = memoryview(bytearray(chunk_bytes))
    with RemoteTier(RemoteTierConfig(url=cluster.url, timeout_seconds=10), namespace, 0,
                    chunk_bytes) as tier:
        start = time.perf_counter()
        for first in range(0, num_chunks, batch):
            tier.put_many([(keys[i], payloads[i % len(payloads)])
                           for i in range(first, min(first + batch, num_chunks))])
        put = time.perf_counter() - start
        start = time.perf_counter()
        for i, key in enumerate(keys):
            assert tier.read_into(key, out) is ReadStatus.OK
        get = time.perf_counter() - start
        for i in (0, num_chunks - 1):  # byte-exact (read_into verified every checksum)
            tier.read_into(keys[i], out)
            assert bytes(out) == payloads[i % len(payloads)]
        tier.delete_many(keys)
    total = num_chunks * chunk_bytes / MiB
    return {"put": total / put, "get": total / get}


def lookups(cluster: RedisCluster, ranks: int, chunks: int,
            rounds: int) -> dict[str, float]:
    """us per chunk to check all ``ranks`` of each chunk: tagged (the tier's keys) and
    spread (the same keys without the hash tag); the layouts alternate, medians."""
    client: Any = ClusterClient.from_url(cluster.url)
    fingerprint = "ab" * 16
    keys = [os.urandom(32) for _ in range(chunks)]
    layouts = {
        "tagged": [[redis_key(b"bench:", fingerprint, r, k) for r in range(ranks)] for k in keys],
        "spread": [[redis_key(b"bench:", fingerprint, r, k).replace(b"{", b"").replace(b"}", b"")
                    for r in range(ranks)] for k in keys],
    }
    for names in layouts.values():
        pipe = client.pipeline()
        for key in (key for group in names for key in group):
            pipe.set(key, b"x")
        pipe.execute()

    def check(groups: list[list[bytes]]) -> None:
        pipe = client.pipeline()
        for key in (key for group in groups for key in group):
            pipe.exists(key)
        assert all(pipe.execute())

    samples: dict[str, list[float]] = {}
    for _ in range(rounds + 1):  # the first round warms the connections up
        for name, names in layouts.items():
            start = time.perf_counter()
            check(names)
            samples.setdefault(f"{name}: all chunks, one pipeline", []).append(
                (time.perf_counter() - start) / chunks * 1e6)
            start = time.perf_counter()
            for group in names[:200]:
                check([group])
            samples.setdefault(f"{name}: one pipeline per chunk", []).append(
                (time.perf_counter() - start) / min(chunks, 200) * 1e6)
    result = {name: statistics.median(values[1:]) for name, values in samples.items()}
    for name, names in layouts.items():
        result[f"{name}: nodes per chunk (mean)"] = statistics.mean(
            len({client.get_node_from_key(key).name for key in group}) for group in names)
        for first in range(0, len(names), 500):
            for key in (key for group in names[first : first + 500] for key in group):
                client.delete(key)
    client.close()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch, \
            RedisCluster(Path(scratch), maxmemory="2gb") as cluster:
        print(f"remote tier benchmark: 3-master Redis Cluster on 127.0.0.1 "
              f"{cluster.ports}, {args.rounds} rounds, {args.total_mib} MiB per method and round")
        for kib in args.chunk_kib:
            chunk = kib * 1024
            num = max(args.batch, args.total_mib * MiB // chunk)
            rows: dict[str, list[float]] = {}
            for round_number in range(args.rounds):
                for name, value in redis_benchmark(cluster, chunk + HEADER_BYTES, num,
                                                   args.batch, args.benchmark_mib).items():
                    rows.setdefault(f"redis-benchmark {name}", []).append(value)
                for name, value in tierkv_round(cluster, chunk, num, args.batch,
                                                round_number).items():
                    rows.setdefault(f"tierkv {name}", []).append(value)
                cluster.flushall()
            medians = {name: statistics.median(values) for name, values in rows.items()}
            print(f"\n== chunk {kib} KiB ({num} chunks, pipelines of {args.batch}):")
            for name, value in medians.items():
                spread = ", ".join(f"{v:.0f}" for v in rows[name])
                print(f"  {name:<24} {value:8.0f} MiB/s  ({spread})")
            for op, bench in (("put", "SET"), ("get", "GET")):
                if f"redis-benchmark {bench}" in medians:
                    ratio = medians[f"tierkv {op}"] / medians[f"redis-benchmark {bench}"]
                    print(f"  ratio tierkv {op} / redis-benchmark {bench}: {ratio:.2f}x")
        print(f"\n== lookup of {args.ranks} ranks per chunk, {args.lookup_chunks} chunks:")
        for name, value in lookups(cluster, args.ranks, args.lookup_chunks, args.rounds).items():
            unit = "" if "nodes" in name else " us per chunk"
            print(f"  {name:<40} {value:8.2f}{unit}")
    print("verdict: remote tier measured against redis-benchmark on a 3-master cluster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
