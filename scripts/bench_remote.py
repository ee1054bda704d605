#!/usr/bin/env python3
"""Benchmark the remote tier on a real 3-master Redis Cluster against redis-benchmark.

Starts its own cluster on free loopback ports (``tests/redis_cluster.py``; needs
redis-server 7+ and redis-cli, see ``scripts/install_redis.sh``) and stops it at the end.
Per chunk size (``--chunk-kib``), interleaved over ``--rounds`` rounds, medians:

- ``redis-benchmark --cluster -c 1 -d <value bytes> -r <chunks>``: the server's own C
  client, same value size, one connection, so one node (it tags every key for that node;
  the tier's keys spread over all): ``-t set -P <batch>`` (tierkv's put pipelines) and
  ``-t get -P 1`` (tierkv reads one chunk per GET), at least ``--benchmark-mib`` per run;
  timed by the servers' command counts, polled every 10 ms (its own figure and its wall
  time count 250 ms ticks).
- tierkv ``RemoteTier.put_many`` in batches of ``--batch`` chunks (one pipeline each) and
  ``read_into`` of every chunk (one GET each, verified), as MiB/s; every read is byte-exact.
- redis-py alone (the tier's client, as ``connect`` sets it up), the ceiling of a Python
  client: the same SETs (values of the tier's size, built beforehand) in cluster pipelines
  of ``--batch``, and one plain GET per key, unchecked; on keys spread over the nodes (as
  the tier's) and on keys of one node (as redis-benchmark's one client, which tags every
  key for the node it talks to).
- Lookup of ``--ranks`` ranks per chunk, for ``--lookup-chunks`` chunks, with the tier's
  key layout (a chunk's ranks share a hash tag, so one node) against the same keys without
  the tag (ranks spread over nodes): one pipelined ``EXISTS`` of everything, and one
  pipeline per chunk (a step that asks about one chunk), in us per chunk, with how many
  nodes one chunk's check touches.
- Lookup through the engine's path (``RemoteLookup.ask``): ``--ask-chunks`` candidate chunks
  beyond the local prefix, on each of ``--ask-ranks`` rank counts, every ask on chunks not
  asked before (the lookup keeps answers 50 ms): ms per ask (median and p90 of
  ``--ask-samples`` asks a round), pipelines sent (its ``requests``), nodes the chunks live
  on and read events per node (the servers' ``total_reads_processed``: one per round trip a
  node serves); against ``--ask-chunks`` sequential ``EXISTS`` (one round trip each) and one
  pipeline of them (the same request without the lookup thread), both with redis-py.
- Hit fraction of a shared chat workload (``--share-*``; the ``tierkv demo`` workload, CPU
  tensors, no disk tiers, the remote tier's default settings): one engine that sees every
  turn with a CPU tier of ``--share-cpu-chunks`` (and the remote tier), against engines A
  and B with half that CPU tier each, sharing the remote tier, each seeing half of the
  turns (``alternate``: a conversation's turns alternate between A and B; ``after``: B
  takes the conversations over after A ran their first half of turns), and the same
  split without a remote tier. The fraction of B's prompts' chunks served from a tier
  (every loaded byte checked), and the ratios to the one engine on the same prompts.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
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
sys.path.insert(0, str(REPO / "scripts"))  # bench_plots, bench_remote_share

from bench_plots import Panel, lines, pyplot  # noqa: E402
from bench_remote_share import share_round  # noqa: E402
from redis.cluster import RedisCluster as ClusterClient  # noqa: E402

from tests.redis_cluster import RedisCluster  # noqa: E402
from tierkv.config import RemoteTierConfig  # noqa: E402
from tierkv.keys import Namespace, Part  # noqa: E402
from tierkv.tiers.base import ReadStatus  # noqa: E402
from tierkv.tiers.remote.tier import RemoteTier, connect  # noqa: E402
from tierkv.tiers.remote.format import HEADER_BYTES, redis_key  # noqa: E402
from tierkv.tiers.remote.lookup import RemoteLookup  # noqa: E402

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
    parser.add_argument("--ask-chunks", type=int, default=64,
                        help="candidate chunks in one RemoteLookup.ask (remote.lookup_chunks)")
    parser.add_argument("--ask-ranks", type=int, nargs="+", default=[1, 4],
                        help="ranks per chunk in the RemoteLookup measurement")
    parser.add_argument("--ask-samples", type=int, default=50, help="asks per method and round")
    parser.add_argument("--share-conversations", type=int, default=24)
    parser.add_argument("--share-turns", type=int, default=6)
    parser.add_argument("--share-layers", type=int, default=2)
    parser.add_argument("--share-cpu-chunks", type=int, default=64,
                        help="the one engine's CPU tier; A and B get half each")
    parser.add_argument("--share-splits", nargs="+", default=["alternate", "after"],
                        choices=["alternate", "after"], help="how the turns split over A and B")
    parser.add_argument("--out-json", type=Path, default=None,
                        help="write every run of every figure here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="a PNG of MiB/s per chunk size against redis-benchmark and redis-py")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: print the report (and --plot) of an --out-json")
    return parser.parse_args(argv)


def _calls(nodes: list[Any], command: str) -> int:
    """How many ``command``s the servers have run so far (``INFO commandstats``)."""
    return sum(int(node.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))
               for node in nodes)


def redis_benchmark(cluster: RedisCluster, value_bytes: int, keys: int, pipeline: int,
                    at_least_mib: int, poll_seconds: float = 0.01) -> dict[str, float]:
    """MiB/s of redis-benchmark (one client, values of ``value_bytes`` over ``keys`` random
    keys): SET pipelined ``pipeline`` deep (as tierkv's put_many), then GET one at a time
    (as tierkv's read_into), 4 requests per key each (about 2% of the GETs miss) and at
    least ``at_least_mib``.

    Timed by the servers: in cluster mode redis-benchmark stops only on its 250 ms timer,
    so its own figure and its wall time both count whole ticks (up to 0.25 s too long: a
    fifth of a 2 MiB GET run of 2 GiB). Every ``poll_seconds``
    the servers' ``INFO commandstats`` are read; the rate is the requests they ran from
    the first poll that saw some to the first that saw them all, over that time."""
    import redis

    requests = max(4 * keys, -(-at_least_mib * MiB // value_bytes))
    requests = -(-requests // pipeline) * pipeline  # else its last pipeline aborts the run
    nodes = [redis.Redis(host="127.0.0.1", port=port) for port in cluster.ports]
    result = {}
    try:
        for test, depth in (("set", pipeline), ("get", 1)):
            base = _calls(nodes, test)
            process = subprocess.Popen(
                ["redis-benchmark", "-h", "127.0.0.1", "-p", str(cluster.ports[0]), "--cluster",
                 "-t", test, "-d", str(value_bytes), "-n", str(requests), "-r", str(keys),
                 "-P", str(depth), "-c", "1", "--csv"], stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
            started = time.perf_counter()
            first: tuple[float, int] | None = None
            last: tuple[float, int] | None = None
            deadline = time.perf_counter() + 600
            while process.poll() is None and time.perf_counter() < deadline:
                now, done = time.perf_counter(), _calls(nodes, test) - base
                if done and first is None:
                    first = (now, done)
                if done >= requests:
                    last = (now, done)
                    break
                time.sleep(poll_seconds)
            stdout, stderr = process.communicate(timeout=600)
            if not any(len(row) > 1 and row[0] == test.upper()
                       for row in csv.reader(io.StringIO(stdout))):
                raise RuntimeError(f"redis-benchmark -t {test} gave no figure: {stderr[-300:]}")
            if first is None or last is None or last[1] - first[1] < requests // 2:
                # too short a run to time by polling (a smoke test): start to exit
                first, last = (started, 0), (time.perf_counter(), requests)
            result[test.upper()] = (last[1] - first[1]) * value_bytes / MiB / (last[0] - first[0])
    finally:
        for node in nodes:
            node.close()
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


def redis_py_round(cluster: RedisCluster, value_bytes: int, num_chunks: int,
                   batch: int) -> dict[str, float]:
    """MiB/s of redis-py alone (the tier's client, as ``tierkv.tiers.remote.tier.connect`` sets
    it up, with no tier code around it): ``num_chunks`` SETs of ``value_bytes`` values built
    beforehand, in cluster pipelines of ``batch`` (as ``put_many``, less its value building
    and checks), then one plain GET per key, its reply unchecked (as ``read_into``, less its
    checks and copy): the ceiling of a Python client.
    Twice: keys spread over the nodes (as the tier's), and keys on one node (one hash tag:
    as redis-benchmark ``--cluster -c 1``, whose one client tags every key for its node)."""
    client, _ = connect(RemoteTierConfig(url=cluster.url, timeout_seconds=10), "redis-py")
    values = [os.urandom(value_bytes) for _ in range(min(num_chunks, 8))]
    total = num_chunks * value_bytes / MiB
    result = {}
    try:
        client.ping(target_nodes=ClusterClient.ALL_NODES)  # connected, as the tier is
        for label, tag in (("", None), (", one node", b"one")):
            names = [b"bench-py:{%s}:%d" % (tag or os.urandom(16).hex().encode(), i)
                     for i in range(num_chunks)]
            start = time.perf_counter()
            for first in range(0, num_chunks, batch):
                pipe = client.pipeline()
                for i in range(first, min(first + batch, num_chunks)):
                    pipe.set(names[i], values[i % len(values)])
                assert all(pipe.execute())
            put = time.perf_counter() - start
            start = time.perf_counter()
            for name in names:
                assert client.get(name) is not None
            get = time.perf_counter() - start
            for first in range(0, num_chunks, 500):
                for name in names[first : first + 500]:
                    client.delete(name)
            result[f"put{label}"], result[f"get{label}"] = total / put, total / get
    finally:
        client.close()
    return result


def lookups(cluster: RedisCluster, ranks: int, chunks: int,
            rounds: int) -> dict[str, float]:
    """us per chunk to check all ``ranks`` of each chunk: tagged (the tier's keys) and
    spread (the same keys without the hash tag); the layouts alternate, medians."""
    client: Any = ClusterClient.from_url(cluster.url)
    fingerprint = "ab" * 16
    keys = [os.urandom(32) for _ in range(chunks)]
    layouts = {
        "tagged": [[redis_key(b"bench:", fingerprint, Part(r, ranks), k) for r in range(ranks)]
                   for k in keys],
        "spread": [[redis_key(b"bench:", fingerprint, Part(r, ranks), k).replace(b"{", b"").replace(b"}", b"")
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


def _reads_per_node(nodes: dict[int, Any]) -> dict[int, int]:
    """Each server's read events so far (one per query buffer it read: a round trip)."""
    return {port: int(node.info("stats")["total_reads_processed"]) for port, node in nodes.items()}


def remote_asks(cluster: RedisCluster, ranks: int, chunks: int, samples: int,
                rounds: int) -> dict[str, float]:
    """``RemoteLookup.ask`` of ``chunks`` candidate chunks on ``ranks`` ranks, all present,
    each ask on chunks never asked before, against redis-py sequential ``EXISTS`` (one
    round trip per chunk) and one redis-py pipeline of them; the methods take turns
    (rotated each round), medians over rounds after a warm-up round."""
    import redis

    config = RemoteTierConfig(url=cluster.url, timeout_seconds=10)
    namespace = Namespace(model_id=f"bench-ask-{ranks}", dtype="float16", kv_layout="NHD",
                          page_bytes=4096, tokens_per_chunk=256)
    fingerprint, prefix = namespace.fingerprint(), config.key_prefix.encode()
    client: Any = ClusterClient.from_url(cluster.url)
    nodes = {port: redis.Redis(host="127.0.0.1", port=port) for port in cluster.ports}
    methods = ("RemoteLookup.ask", "redis-py sequential EXISTS", "redis-py one pipeline")
    sets = {name: [[os.urandom(32) for _ in range(chunks)] for _ in range(samples * (rounds + 1))]
            for name in methods}
    names = {key: [redis_key(prefix, fingerprint, Part(rank, ranks), key) for rank in range(ranks)]
             for group in sets.values() for keys in group for key in keys}
    pipe = client.pipeline()
    for count, redis_name in enumerate(n for group in names.values() for n in group):
        pipe.set(redis_name, b"x")
        if count % 5000 == 4999:
            pipe.execute()
            pipe = client.pipeline()
    pipe.execute()
    tier = RemoteTier(config, namespace, Part(0, ranks), 4096)
    lookup = RemoteLookup(tier, [[Part(rank, ranks) for rank in range(ranks)]],
                          deadline_seconds=10.0, max_keys=chunks)

    def ask(keys: list[bytes]) -> None:
        assert lookup.ask(keys) == dict.fromkeys(keys, ranks)

    def sequential(keys: list[bytes]) -> None:
        for key in keys:
            assert client.exists(*names[key]) == ranks

    def pipelined(keys: list[bytes]) -> None:
        pipe = client.pipeline()
        for key in keys:
            pipe.exists(*names[key])
        assert all(answer == ranks for answer in pipe.execute())

    run = dict(zip(methods, (ask, sequential, pipelined)))
    base = _reads_per_node(nodes)
    overhead = {port: count - base[port] for port, count in _reads_per_node(nodes).items()}
    times: dict[str, list[float]] = {name: [] for name in methods}
    reads: dict[str, list[float]] = {name: [] for name in methods}
    requests: list[float] = []
    try:
        for round_number in range(rounds + 1):  # round 0 warms the connections up
            order = methods[round_number % 3:] + methods[: round_number % 3]
            for name in order:
                before = _reads_per_node(nodes)
                asked_before = lookup.statistics().lookup_requests
                for i in range(samples):
                    keys = sets[name][round_number * samples + i]
                    start = time.perf_counter()
                    run[name](keys)
                    if round_number:
                        times[name].append((time.perf_counter() - start) * 1e3)
                after = _reads_per_node(nodes)
                if round_number:
                    reads[name].append(statistics.mean(
                        (after[port] - before[port] - overhead[port]) / samples
                        for port in nodes))
                    if name == methods[0]:
                        sent = lookup.statistics().lookup_requests - asked_before
                        requests.append(sent / samples)
        nodes_touched = statistics.mean(
            len({client.get_node_from_key(names[key][0]).name for key in keys})
            for keys in sets[methods[0]])
    finally:
        lookup.shutdown()
        tier.close()
        for start in range(0, len(names), 500):
            client.delete(*(n for key in list(names)[start : start + 500] for n in names[key]))
        client.close()
        for node in nodes.values():
            node.close()
    result: dict[str, float] = {"nodes the chunks live on (mean)": nodes_touched,
                                "RemoteLookup.ask: pipelines sent per ask": statistics.median(requests)}
    for name in methods:
        result[f"{name}: ms per ask (median)"] = statistics.median(times[name])
        result[f"{name}: ms per ask (p90)"] = statistics.quantiles(times[name], n=10)[-1] \
            if len(times[name]) > 1 else times[name][0]
        result[f"{name}: read events per node per ask"] = statistics.median(reads[name])
    return result


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of every section on a cluster of its own: the figures :func:`report`
    prints (every run of the rounds, not only their medians)."""
    saved: dict[str, Any] = {"throughput": {}, "asks": {}, "share": {}}
    with tempfile.TemporaryDirectory() as scratch, \
            RedisCluster(Path(scratch), maxmemory="2gb") as cluster:
        saved["header"] = (f"3-master Redis Cluster on loopback, {args.rounds} rounds, "
                           f"{args.total_mib} MiB per method and round")
        print(f"remote tier benchmark: {saved['header']} (ports {cluster.ports})", flush=True)
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
                for name, value in redis_py_round(cluster, chunk + HEADER_BYTES, num,
                                                  args.batch).items():
                    rows.setdefault(f"redis-py {name}", []).append(value)
                cluster.flushall()
            saved["throughput"][str(kib)] = {"chunks": num, "runs": rows}
            print(f"  ... chunk {kib} KiB measured", file=sys.stderr, flush=True)
        saved["lookup"] = lookups(cluster, args.ranks, args.lookup_chunks, args.rounds)
        for ranks in args.ask_ranks:
            saved["asks"][str(ranks)] = remote_asks(cluster, ranks, args.ask_chunks,
                                                    args.ask_samples, args.rounds)
        cluster.flushall()
        for round_number in range(args.rounds):
            for name, value in share_round(cluster, args, round_number).items():
                saved["share"].setdefault(name, []).append(value)
            cluster.flushall()
    return saved


def report(saved: dict[str, Any], args: dict[str, Any]) -> None:
    """Print the medians of ``saved`` (:func:`measure`) and their ratios; ``args``: the
    options it was measured with."""
    for kib, figures in saved["throughput"].items():
        rows = figures["runs"]
        medians = {name: statistics.median(values) for name, values in rows.items()}
        print(f"\n== chunk {kib} KiB ({figures['chunks']} chunks, pipelines of {args['batch']}):")
        for name, value in medians.items():
            spread = ", ".join(f"{v:.0f}" for v in rows[name])
            print(f"  {name:<24} {value:8.0f} MiB/s  ({spread})")
        for op, bench in (("put", "SET"), ("get", "GET")):
            if f"redis-benchmark {bench}" in medians:
                ratio = medians[f"tierkv {op}"] / medians[f"redis-benchmark {bench}"]
                print(f"  ratio tierkv {op} / redis-benchmark {bench}: {ratio:.2f}x")
                for label in ("", ", one node"):
                    ratio = medians[f"redis-py {op}{label}"] / \
                        medians[f"redis-benchmark {bench}"]
                    print(f"  ratio redis-py {op}{label} / redis-benchmark {bench}: "
                          f"{ratio:.2f}x")
            ratio = medians[f"tierkv {op}"] / medians[f"redis-py {op}"]
            print(f"  ratio tierkv {op} / redis-py {op}: {ratio:.2f}x")
    print(f"\n== lookup of {args['ranks']} ranks per chunk, {args['lookup_chunks']} chunks:")
    for name, value in saved["lookup"].items():
        unit = "" if "nodes" in name else " us per chunk"
        print(f"  {name:<40} {value:8.2f}{unit}")
    for ranks, found in saved["asks"].items():
        print(f"\n== RemoteLookup.ask of {args['ask_chunks']} candidate chunks, {ranks} rank(s) "
              f"each, {args['ask_samples']} asks per method and round, medians of "
              f"{args['rounds']} rounds:")
        for name, value in found.items():
            print(f"  {name:<56} {value:8.3f}")
        ratio = found["redis-py sequential EXISTS: ms per ask (median)"] / \
            found["RemoteLookup.ask: ms per ask (median)"]
        print(f"  ratio sequential EXISTS / RemoteLookup.ask: {ratio:.1f}x")
    rows = saved["share"]
    print(f"\n== hit fraction of engine B, {args['share_conversations']} conversations x "
          f"{args['share_turns']} turns, CPU tier {args['share_cpu_chunks']} chunks for one "
          f"engine, {args['share_cpu_chunks'] // 2} each for A and B, medians of "
          f"{args['rounds']} rounds (workload seed = round):")
    medians = {name: statistics.median(values) for name, values in rows.items()}
    for name, value in medians.items():
        spread = ", ".join(f"{v:.3f}" for v in rows[name])
        print(f"  {name:<68} {value:6.3f}  ({spread})")
    for split in args["share_splits"]:
        for name, label in (("A+B, shared remote tier", ""),
                            ("A+B, no remote tier", " [no remote tier]")):
            one = medians[f"{split}: one engine, on B's prompts{label}"]
            print(f"  ratio {split}: {name}, B / one engine{label}: "
                  f"{medians[f'{split}: {name}, B'] / one:.2f}x")


PLOTTED = [Panel(title, "MiB/s (median)", [
    (f"redis-benchmark {bench}", f"redis-benchmark {bench}{depth} (C, one node)", "k:^"),
    (f"redis-py {op}, one node", "redis-py alone, keys on one node", "C7--s"),
    (f"redis-py {op}", "redis-py alone, keys spread (as the tier's)", "C1-s"),
    (f"tierkv {op}", f"tierkv RemoteTier.{call}", "C0-o")])
    for title, op, bench, depth, call in (
        ("writes", "put", "SET", " pipelined", "put_many (pipelined)"),
        ("reads", "get", "GET", "", "read_into (one GET each, verified)"))]


def plot(saved: dict[str, Any], path: Path) -> None:
    """Median MiB/s of each client against the chunk size, writes and reads, each with the
    interquartile range of its rounds."""
    by_kib: dict[float, dict[str, float]] = {
        int(kib): {name: statistics.median(values) for name, values in f["runs"].items()}
        for kib, f in saved["throughput"].items()}
    lines(path, by_kib, PLOTTED, xlabel="chunk size (KiB)",
          rounds={int(kib): f["runs"] for kib, f in saved["throughput"].items()},
          title=f"remote tier against redis-benchmark: {saved['header']}; "
                "band: interquartile range of the rounds")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot is not None:
        pyplot()  # before minutes of measuring
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        print(f"remote tier benchmark: {saved['header']}")
    else:
        saved = measure(args)
        saved["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report(saved, saved["args"])
    if args.out_json is not None and args.from_json is None:
        args.out_json.write_text(json.dumps(saved, indent=1))
    if args.plot is not None:
        plot(saved, args.plot)
    print("verdict: remote tier measured against redis-benchmark on a 3-master cluster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
