#!/usr/bin/env python3
"""Benchmark a disk tier's restart: open it and scan its index, cold and warm.

Writes ``--chunks`` chunks of ``--chunk-kib`` KiB into a fresh tier, closes it, then per
round: drop the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``, needs root),
open the tier and ``scan()`` it, recording the bytes this process read from disk
(``read_bytes`` of ``/proc/self/io``) and the time; then the same warm. The index's own
bytes are its B-tree pages (``txn.stat`` of the "index" sub-db). Baseline in the same
run: the same open and scan with the map's read-ahead left on for the scan (what tierkv
did before). Targets: cold reads at most 4x the index's bytes, warm at most 10 us a chunk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.config import DiskTierConfig  # noqa: E402
from tierkv.keys import Namespace  # noqa: E402
from tierkv.tiers.disk.tier import DiskTier  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NS = Namespace(model_id="bench-restart", dtype="bfloat16", kv_layout="bench", page_bytes=4096,
               tokens_per_chunk=16)


def read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes"))


def drop_caches() -> bool:
    done = subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True,
                          capture_output=True)
    return done.returncode == 0


def restart(root: Path, config: DiskTierConfig, payload: int, readahead: bool
            ) -> tuple[int, float, int]:
    """(bytes read from disk, seconds, chunks) of one open + scan."""
    before, start = read_bytes(), time.perf_counter()
    tier = DiskTier(root, NS, 0, config, payload)
    if readahead:  # the baseline: scan with the map's read-ahead on
        for shard in tier._shards:
            shard.random_access = nullcontext  # type: ignore[method-assign]
    chunks = sum(1 for _ in tier.scan())
    seconds, got = time.perf_counter() - start, read_bytes() - before
    tier.close()
    return got, seconds, chunks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunks", type=int, default=50_000, help="chunks in the tier")
    parser.add_argument("--chunk-kib", type=int, default=16, help="payload size of a chunk")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--dir", type=Path, default=REPO / ".bench", help="scratch directory")
    args = parser.parse_args(argv)
    root = args.dir / "restart"
    shutil.rmtree(root, ignore_errors=True)
    payload = args.chunk_kib * 1024
    config = DiskTierConfig(path=root, max_bytes=2 * args.chunks * payload)
    with DiskTier(root, NS, 0, config, payload) as tier:
        value = os.urandom(payload)
        for first in range(0, args.chunks, 256):
            tier.put_many([(os.urandom(32), value)
                           for _ in range(min(256, args.chunks - first))])
        index_bytes = 0
        for shard in tier._shards:  # every shard's index
            assert shard._env is not None
            with shard._env.begin() as txn:
                stat = txn.stat(shard.index)
            index_bytes += (stat["branch_pages"] + stat["leaf_pages"]) * stat["psize"]
    cold = drop_caches()
    rows: dict[str, list[tuple[int, float, int]]] = {"tierkv": [], "readahead on": []}
    for _ in range(args.rounds):
        for name in rows:  # interleaved
            drop_caches()
            rows[name].append(restart(root, config, payload, name != "tierkv"))
    warm = [restart(root, config, payload, False) for _ in range(args.rounds)]
    print(f"{args.chunks} chunks of {args.chunk_kib} KiB; index {index_bytes / 2**20:.2f} MiB; "
          f"page cache dropped: {cold}")
    for name, runs in rows.items():
        got = statistics.median(run[0] for run in runs)
        seconds = statistics.median(run[1] for run in runs)
        print(f"  cold {name:13s} read {got / 2**20:8.1f} MiB = {got / index_bytes:6.2f}x the "
              f"index, {seconds:.3f} s")
    warm_us = statistics.median(run[1] for run in warm) / args.chunks * 1e6
    ratio = statistics.median(run[0] for run in rows["tierkv"]) / index_bytes
    print(f"  warm tierkv {warm_us:.2f} us per chunk")
    print(f"verdict: cold read {ratio:.2f}x the index (target <= 4), warm {warm_us:.2f} us per "
          f"chunk (target <= 10)")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
