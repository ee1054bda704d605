#!/usr/bin/env python3
"""Bookkeeping cost per chunk in the pure BlockIndex (no bytes move).

Each phase of a chunk's life is timed separately: prepare_store + complete_store (with an
LRU eviction once the CPU tier is full), take_spills + complete_spill (write-back to a
disk tier), lookup, prepare_load + complete_load. Jobs carry --chunks-per-job chunks. Baseline in the same run: a bare
dict + OrderedDict LRU doing the same inserts, evictions and lookups, the floor any
Python bookkeeping pays.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tierkv

from tierkv.core.index import BlockIndex  # noqa: E402
from tierkv.core.jobs import Completion  # noqa: E402
from tierkv.core.policy import DEFAULT_POLICY, policy_names  # noqa: E402
from tierkv.keys import chunk_keys  # noqa: E402


def run_index(keys: list[bytes], args: argparse.Namespace) -> dict[str, float]:
    """Seconds per chunk for each phase of a chunk's life."""
    index = BlockIndex(args.slots, args.disk_chunks, spill_ahead_fraction=0.25,
                       eviction_policy=args.policy)
    per = args.chunks_per_job
    clock = time.perf_counter
    spent = dict.fromkeys(("store", "spill", "lookup", "load"), 0.0)
    for start in range(0, len(keys), per):
        batch = keys[start : start + per]
        t0 = clock()
        plan = index.prepare_store(batch)
        if plan.job_id is not None:
            index.complete_store(Completion(plan.job_id, ok=True))
        t1 = clock()
        spill = index.take_spills()
        if spill is not None:
            index.complete_spill(Completion(spill.job_id, ok=True))
        t2 = clock()
        hits = index.lookup(batch).num_hits
        t3 = clock()
        load = index.prepare_load(batch[:hits])
        if load.job_id is not None:
            index.complete_load(Completion(load.job_id, ok=True))
        t4 = clock()
        spent["store"] += t1 - t0
        spent["spill"] += t2 - t1
        spent["lookup"] += t3 - t2
        spent["load"] += t4 - t3
    return {phase: seconds / len(keys) for phase, seconds in spent.items()}


def run_dict(keys: list[bytes], args: argparse.Namespace) -> float:
    table: OrderedDict[bytes, int] = OrderedDict()
    per = args.chunks_per_job
    t0 = time.perf_counter()
    slot = 0
    for start in range(0, len(keys), per):
        batch = keys[start : start + per]
        for key in batch:
            if key in table:
                continue
            if len(table) >= args.slots:
                table.popitem(last=False)
            table[key] = slot
            slot += 1
        for key in batch:
            if key not in table:
                break
            table.move_to_end(key)
    return (time.perf_counter() - t0) / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--chunks-per-job", type=int, default=4)
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--disk-chunks", type=int, default=32_768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=policy_names(),
                        help="the CPU tier's eviction policy")
    args = parser.parse_args()
    keys = chunk_keys(list(range(args.chunks * 4)), 4)
    run_index(keys[:2000], args)  # warm-up
    runs = [run_index(keys, args) for _ in range(args.repeats)]
    dict_us = [run_dict(keys, args) * 1e6 for _ in range(args.repeats)]
    print(f"{args.policy}: {args.chunks} chunks, {args.chunks_per_job} per job, {args.slots} CPU slots, "
          f"{args.disk_chunks} disk chunks, {args.repeats} repeats (median [min-max] us per chunk)")
    worst = 0.0
    for phase, label in (("store", "prepare_store + complete_store (evicting)"),
                         ("spill", "take_spills + complete_spill (write-back)"),
                         ("lookup", "lookup"),
                         ("load", "prepare_load + complete_load")):
        values = [run[phase] * 1e6 for run in runs]
        worst = max(worst, statistics.median(values))
        print(f"  {label:44s} {statistics.median(values):6.2f} [{min(values):.2f}-{max(values):.2f}]")
    total = [sum(run.values()) * 1e6 for run in runs]
    md = statistics.median(dict_us)
    print(f"  {'whole life of a chunk (all of the above)':44s} {statistics.median(total):6.2f}")
    print(f"  {'bare dict + OrderedDict LRU (insert, evict, lookup)':44s} {md:6.2f}")
    print(f"slowest decision {worst:.2f} us per chunk (target <= 5: {'met' if worst <= 5 else 'missed'}); "
          f"whole life / bare dict: {statistics.median(total) / md:.1f}x")


if __name__ == "__main__":
    main()
