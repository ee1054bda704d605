#!/usr/bin/env python3
"""Benchmark a disk tier's restart: open it and scan its index, cold and warm.

Writes ``--chunks`` chunks of ``--chunk-kib`` KiB into a fresh tier, closes it, then per
round: drop the tier's files from the page cache (``--cold``: ``posix_fadvise(DONTNEED)``
on each, no root needed; or ``drop_caches``, the whole page cache, needs root), open the
tier and ``scan()`` it, recording the bytes this process read from disk (``read_bytes`` of
``/proc/self/io``) and the time; then the same warm. The index's own bytes are its B-tree
pages (``txn.stat`` of the "index" sub-db). Baseline in the same run, interleaved: the same
open and scan under ``MADV_RANDOM`` (the map's read-ahead off: what tierkv did before).
Targets: cold reads at most 4x the index's bytes, warm at most 10 us a chunk. Several
``--chunks``: a fresh tier of each, in turn; ``--plot`` draws the medians against them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_plots, page_cache

from bench_plots import Panel, lines, pyplot  # noqa: E402
from page_cache import cold_method, drop_caches, drop_file_pages  # noqa: E402
from tierkv.config import DiskTierConfig  # noqa: E402
from tierkv.keys import Namespace  # noqa: E402
from tierkv.tiers.disk.tier import DiskTier  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NS = Namespace(model_id="bench-restart", dtype="bfloat16", kv_layout="bench", page_bytes=4096,
               tokens_per_chunk=16)
MiB = 1 << 20


def read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes"))


COLD = {"drop_caches": "page cache dropped (drop_caches)",
        "fadvise": "the tier's file pages dropped (posix_fadvise DONTNEED)"}


def drop_page_cache(root: Path, method: str) -> None:
    """Make the next open of the tier at ``root`` cold (``method``, see
    :func:`page_cache.cold_method`); no tier is open here, so none of its pages stays
    mapped."""
    if method == "drop_caches":
        drop_caches("3")
    else:
        drop_file_pages(path for path in root.rglob("*") if path.is_file())


def restart(root: Path, config: DiskTierConfig, payload: int, readahead: bool
            ) -> tuple[int, float, int]:
    """(bytes read from disk, seconds, chunks) of one open + scan."""
    before, start = read_bytes(), time.perf_counter()
    tier = DiskTier(root, NS, 0, config, payload)
    with ExitStack() as advice:
        if not readahead:  # the baseline: the scan under MADV_RANDOM, as before
            for shard in tier._shards:
                advice.enter_context(shard.random_access())
        chunks = sum(1 for _ in tier.scan())
    seconds, got = time.perf_counter() - start, read_bytes() - before
    tier.close()
    return got, seconds, chunks


def fresh_tier(root: Path, chunks: int, payload: int) -> tuple[DiskTierConfig, int]:
    """Write ``chunks`` chunks into a new tier at ``root``: its config, and its index's own
    bytes (every shard's index B-tree pages, ``txn.stat``)."""
    shutil.rmtree(root, ignore_errors=True)
    config = DiskTierConfig(path=root, max_bytes=2 * chunks * payload)
    with DiskTier(root, NS, 0, config, payload) as tier:
        value = os.urandom(payload)
        for first in range(0, chunks, 256):
            tier.put_many([(os.urandom(32), value) for _ in range(min(256, chunks - first))])
        index_bytes = 0
        for shard in tier._shards:  # every shard's index
            assert shard._env is not None
            with shard._env.begin() as txn:
                stat = txn.stat(shard.index)
            index_bytes += (stat["branch_pages"] + stat["leaf_pages"]) * stat["psize"]
    return config, index_bytes


def measure(args: argparse.Namespace, chunks: int, cold_method: str) -> dict[str, Any]:
    """One tier of ``chunks`` chunks: the medians of the interleaved cold rounds (tierkv,
    then the MADV_RANDOM baseline) and of the warm ones, and every run."""
    root = args.dir / "restart"
    payload = args.chunk_kib * 1024
    config, index_bytes = fresh_tier(root, chunks, payload)
    rows: dict[str, list[tuple[int, float, int]]] = {"tierkv": [], "random access": []}
    for _ in range(args.rounds):
        for name in rows:  # interleaved
            drop_page_cache(root, cold_method)
            rows[name].append(restart(root, config, payload, name == "tierkv"))
    warm = [restart(root, config, payload, True) for _ in range(args.rounds)]
    shutil.rmtree(root, ignore_errors=True)
    assert all(run[2] == chunks for runs in (*rows.values(), warm) for run in runs), "lost chunks"
    medians = {"index MiB": index_bytes / MiB}
    runs: dict[str, list[float]] = {}
    for name, found in (*rows.items(), ("warm", warm)):
        cold = "" if name == "warm" else "cold "
        runs[f"{cold}{name}: ms"] = [1e3 * run[1] for run in found]
        if cold:
            runs[f"{cold}{name}: MiB read"] = [run[0] / MiB for run in found]
    medians.update({row: statistics.median(values) for row, values in runs.items()})
    return {"medians": medians, "runs": runs}


def report(chunks: int, chunk_kib: int, figures: dict[str, Any]) -> str:
    medians = figures["medians"]
    index = medians["index MiB"]
    out = [f"{chunks} chunks of {chunk_kib} KiB; index {index:.2f} MiB"]
    for name in ("tierkv", "random access"):
        got = medians[f"cold {name}: MiB read"]
        out.append(f"  cold {name:13s} read {got:8.1f} MiB = {got / index:6.2f}x the index, "
                   f"{medians[f'cold {name}: ms'] / 1e3:.3f} s")
    warm_us = medians["warm: ms"] / chunks * 1e3
    ratio = medians["cold tierkv: MiB read"] / index
    out.append(f"  warm tierkv {warm_us:.2f} us per chunk")
    out.append(f"verdict: cold read {ratio:.2f}x the index (target <= 4), warm {warm_us:.2f} us "
               f"per chunk (target <= 10)")
    return "\n".join(out)


PLOTTED = [
    Panel("open + scan (median)", "ms", [
        ("cold tierkv: ms", "cold, tierkv (map read-ahead on)", "C0-o"),
        ("cold random access: ms", "cold, MADV_RANDOM (before)", "C3--s"),
        ("warm: ms", "warm, tierkv", "C2-^")]),
    Panel("read from disk by a cold open + scan (median)", "MiB", [
        ("cold tierkv: MiB read", "tierkv (map read-ahead on)", "C0-o"),
        ("cold random access: MiB read", "MADV_RANDOM (before)", "C3--s"),
        ("index MiB", "the index's own B-tree pages", "k:")]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[50_000],
                        help="chunks in the tier; several: one tier each, in turn")
    parser.add_argument("--chunk-kib", type=int, default=16, help="payload size of a chunk")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--dir", type=Path, default=REPO / ".bench", help="scratch directory")
    parser.add_argument("--cold", choices=sorted(COLD), default="fadvise",
                        help="how a round is made cold: drop the pages of the tier's files "
                             "(no root needed, leaves other processes' cache alone) or the "
                             "whole page cache")
    parser.add_argument("--out-json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="a PNG of the open + scan time and the bytes read per tier size")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: print the report (and --plot) of an --out-json")
    args = parser.parse_args(argv)
    if args.plot is not None:
        pyplot()  # before minutes of measuring
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
    else:
        args.dir.mkdir(parents=True, exist_ok=True)
        method = cold_method(args.cold)
        saved = {"header": f"{args.rounds} rounds, cold: {COLD[method]}",
                 "chunk_kib": args.chunk_kib,
                 "by_chunks": {str(n): measure(args, n, method) for n in args.chunks}}
    print(f"restart of a disk tier: {saved['header']}")
    for chunks, figures in saved["by_chunks"].items():
        print(report(int(chunks), saved["chunk_kib"], figures))
    if args.out_json is not None and args.from_json is None:
        args.out_json.write_text(json.dumps(saved, indent=1))
    if args.plot is not None:
        by_chunks: dict[float, dict[str, float]] = {int(n): f["medians"]
                                                    for n, f in saved["by_chunks"].items()}
        lines(args.plot, by_chunks, PLOTTED,
              xlabel="chunks in the tier", tick=lambda n: f"{n / 1000:g}k",
              rounds={int(n): f["runs"] for n, f in saved["by_chunks"].items()},
              title=f"disk tier restart, chunks of {saved['chunk_kib']} KiB: {saved['header']}; "
                    "band: interquartile range of the rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
