#!/usr/bin/env python3
"""`make demo-cluster`: two engines share KV through a local 3-master Redis Cluster.

Starts a 3-master Redis Cluster on free loopback ports (``tests/redis_cluster.py``; needs
redis-server 7+ and redis-cli, see ``scripts/install_redis.sh``), then runs two engines,
each in a process of its own, each a :class:`~tierkv.engine.store.TierKVStore` with its own
CPU tier and its own temporary disk tier, both with ``StoreConfig.remote`` on the cluster:

- engine A runs a multi-turn chat workload (the ``tierkv demo`` one: conversations share a
  system prompt and grow turn by turn; the "KV cache" is CPU tensors) and closes, which
  flushes its push queue to the cluster;
- engine B then runs the first ``--b-turns`` turns of the same conversations: what it has
  not stored itself, A computed, and the remote tier serves it.

Every loaded byte is checked against the KV its prefix must have (a pure function of the
chunk key, as in ``tierkv demo``), i.e. what A computed. Exits 1 when B got no remote hit
or a byte differs. The cluster is always stopped (and its directory removed) at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BLOCK_SIZE, BLOCKS_PER_CHUNK, HEADS, HEAD_DIM = 16, 4, 4, 64
PAGE_SHAPE = (2, HEADS, BLOCK_SIZE, HEAD_DIM)  # K and V halves, HND inside a block (as the demo)
TOKENS_PER_CHUNK = BLOCK_SIZE * BLOCKS_PER_CHUNK
NUM_BLOCKS = 512
MODEL_ID = "tierkv-demo-cluster"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4, help="turns engine A runs")
    parser.add_argument("--b-turns", type=int, default=2, help="first turns engine B runs")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cpu-chunks", type=int, default=48, help="each engine's CPU tier, chunks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lookup-deadline", type=float, default=None,
                        help="remote.lookup_deadline_seconds (default: the setting's default)")
    # One engine's process (the orchestrator starts these):
    parser.add_argument("--engine", choices=("A", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.b_turns <= args.turns:
        parser.error(f"--b-turns must be within [1, --turns={args.turns}]")
    return args


def run_engine(args: argparse.Namespace) -> int:
    """One engine: the workload's first ``turns`` turns through a TierKVStore on the
    cluster; writes its figures to ``args.result`` as JSON."""
    import torch

    from tierkv.config import CpuTierConfig, DiskTierConfig, RemoteTierConfig, StoreConfig
    from tierkv.demo import chat_prompts, serve_prompt
    from tierkv.engine.store import TierKVStore
    from tierkv.keys import chunk_keys

    turns = args.turns if args.engine == "A" else args.b_turns
    kv = [torch.zeros((NUM_BLOCKS, *PAGE_SHAPE), dtype=torch.float16) for _ in range(args.layers)]
    chunk_bytes = args.layers * BLOCKS_PER_CHUNK * kv[0][0].numel() * 2
    config = StoreConfig(
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        cpu=CpuTierConfig(max_bytes=args.cpu_chunks * chunk_bytes),
        disk=DiskTierConfig(path=args.dir, max_bytes=1 << 30),
        device="cpu",
        remote=RemoteTierConfig(url=args.url, **({} if args.lookup_deadline is None else
                                                 {"lookup_deadline_seconds": args.lookup_deadline})),
    )
    counts = dict.fromkeys(("prompts", "chunks_asked", "cpu", "disk", "remote", "computed",
                            "failed_chunks", "verified_bytes", "wrong_chunks"), 0)
    started = time.perf_counter()
    store = TierKVStore(kv, model_id=MODEL_ID, tokens_per_block=BLOCK_SIZE, config=config)
    with store:
        free_blocks = list(range(NUM_BLOCKS))
        for _, _, prompt in chat_prompts(args.seed, args.conversations, turns, TOKENS_PER_CHUNK):
            served = serve_prompt(store, kv, chunk_keys(prompt, TOKENS_PER_CHUNK),
                                  free_blocks, PAGE_SHAPE)
            counts["prompts"] += 1
            counts["chunks_asked"] += served.asked
            counts["disk"] += served.from_disk
            counts["remote"] += served.from_remote
            counts["cpu"] += served.from_cpu
            counts["computed"] += served.asked - served.landed
            counts["failed_chunks"] += served.failed
            counts["verified_bytes"] += served.verified_bytes
            counts["wrong_chunks"] += served.wrong
    seconds = time.perf_counter() - started
    stats = store.statistics()  # after close: the push queue is flushed
    result: dict[str, Any] = {"engine": args.engine, "turns": turns, "seconds": seconds,
                              "chunk_bytes": chunk_bytes, "cpu_slots": stats.index.num_slots,
                              "no_room": stats.index.stores_no_room, **counts}
    if stats.remote is not None:
        remote = stats.remote  # the tiers', the lookup's and the pushes' counts, summed
        result.update(remote_reads=remote.reads, remote_read_hits=remote.hits,
                      remote_misses=remote.misses, remote_corrupt=remote.corrupt,
                      remote_errors=remote.errors, lookup_asks=remote.lookup_asks,
                      lookup_not_yet=remote.lookup_not_yet,
                      lookup_requests=remote.lookup_requests,
                      lookup_keys_found=remote.lookup_keys_found)
        result.update(pushed=remote.pushes_pushed, push_dropped=remote.pushes_dropped,
                      push_failed=remote.pushes_failed, mib_pushed=remote.pushes_bytes / (1 << 20))
    args.result.write_text(json.dumps(result))
    return 0


def engine_process(args: argparse.Namespace, engine: str, url: str, scratch: Path) -> dict[str, Any]:
    """Run one engine in a process of its own and return its figures."""
    result = scratch / f"engine-{engine}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--engine", engine, "--url", url,
               "--dir", str(scratch / f"disk-{engine}"), "--result", str(result),
               "--conversations", str(args.conversations), "--turns", str(args.turns),
               "--b-turns", str(args.b_turns), "--layers", str(args.layers),
               "--cpu-chunks", str(args.cpu_chunks), "--seed", str(args.seed),
               *([] if args.lookup_deadline is None else
                 ["--lookup-deadline", str(args.lookup_deadline)])]
    done = subprocess.run(command, cwd=REPO, timeout=300)
    if done.returncode != 0 or not result.exists():
        raise SystemExit(f"demo-cluster: engine {engine} failed (exit {done.returncode})")
    figures: dict[str, Any] = json.loads(result.read_text())
    return figures


def report(figures: dict[str, Any]) -> None:
    print(f"  engine {figures['engine']} (own process, own CPU tier of {figures['cpu_slots']} "
          f"chunks and own disk tier): {figures['prompts']} prompts over {figures['turns']} "
          f"turn(s) in {figures['seconds']:.1f} s")
    print(f"    chunks asked {figures['chunks_asked']}: hits from CPU {figures['cpu']}, "
          f"from disk {figures['disk']}, from remote {figures['remote']}; "
          f"recomputed {figures['computed']}")
    print(f"    verified {figures['verified_bytes'] / (1 << 20):.1f} MiB of loaded KV, "
          f"{figures['wrong_chunks']} chunk(s) wrong, {figures['failed_chunks']} failed load(s); "
          f"chunks not stored (no room in the CPU tier) {figures['no_room']}")
    if "lookup_asks" in figures:
        print(f"    remote: {figures['remote_read_hits']} chunk reads ok of "
              f"{figures['remote_reads']} (missing {figures['remote_misses']}, corrupt "
              f"{figures['remote_corrupt']}, errors {figures['remote_errors']}); lookups "
              f"{figures['lookup_asks']} asked, {figures['lookup_requests']} pipelines, "
              f"{figures['lookup_not_yet']} not yet")
    if "pushed" in figures:
        print(f"    pushed {figures['pushed']} chunks ({figures['mib_pushed']:.1f} MiB), "
              f"dropped {figures['push_dropped']}, failed {figures['push_failed']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine is not None:
        return run_engine(args)
    from tests.redis_cluster import RedisCluster

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-cluster-") as tmp:
        scratch = Path(tmp)
        with RedisCluster(scratch / "cluster") as cluster:
            print(f"tierkv demo-cluster: 3-master Redis Cluster on 127.0.0.1 {cluster.ports}; "
                  f"{args.conversations} conversations, {args.layers} layers")
            a = engine_process(args, "A", cluster.url, scratch)
            report(a)
            b = engine_process(args, "B", cluster.url, scratch)
            report(b)
        # the cluster is stopped here, whatever happened above
    wrong = a["wrong_chunks"] + b["wrong_chunks"]
    if wrong:
        print(f"demo-cluster FAILED: {wrong} loaded chunk(s) differ from the KV engine A computed")
        return 1
    if b["remote"] == 0:
        print("demo-cluster FAILED: engine B got no hit from the remote tier")
        return 1
    served = (b["chunks_asked"] - b["computed"]) / max(b["chunks_asked"], 1)
    print(f"demo-cluster done in {time.perf_counter() - started:.1f} s: engine B was served "
          f"{served:.0%} of its chunks ({b['remote']} from the remote tier, computed by A) and "
          f"recomputed {b['computed']} (A recomputed {a['computed']} of {a['chunks_asked']}); "
          f"every loaded byte equals what A computed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
