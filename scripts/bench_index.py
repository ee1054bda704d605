#!/usr/bin/env python3
"""Bookkeeping cost per chunk in the pure BlockIndex (no bytes move).

Each phase of a chunk's life is timed separately: prepare_store + complete_store (with an
LRU eviction once the CPU tier is full), take_spills + complete_spill (write-back to a
disk tier), lookup, prepare_load + complete_load. Jobs carry --chunks-per-job chunks. Baseline in the same run: a bare
dict + OrderedDict LRU doing the same inserts, evictions and lookups, the floor any
Python bookkeeping pays.

Then the cost of statistics() at each of --stats-entries READY chunks, and the write-back's
behaviour for each disk size of --disk-ratios (times --slots): chats (each turn opens one,
or continues one of the last slots/4 chats at random: looks it up, loads the hit prefix,
stores the rest), spills planned every turn. Write amplification = chunks written to disk /
chunks evicted from the CPU tier; hits = chunks loaded / chunks a turn could reuse.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import timeit
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tierkv

from tierkv.core.index import BlockIndex  # noqa: E402
from tierkv.core.stats import IndexStats  # noqa: E402
from tierkv.core.jobs import Completion, JobKind  # noqa: E402
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
            index.complete_store(Completion(plan.job_id, JobKind.STORE, ok=True))
        t1 = clock()
        spill = index.take_spills()
        if spill is not None:
            index.complete_spill(Completion(spill.job_id, JobKind.SPILL, ok=True))
        t2 = clock()
        hits = index.lookup(batch).num_hits
        t3 = clock()
        load = index.prepare_load(batch[:hits])
        if load.job_id is not None:
            index.complete_load(Completion(load.job_id, JobKind.LOAD, ok=True))
        t4 = clock()
        spent["store"] += t1 - t0
        spent["spill"] += t2 - t1
        spent["lookup"] += t3 - t2
        spent["load"] += t4 - t3
    return {phase: seconds / len(keys) for phase, seconds in spent.items()}


def statistics_cost(num_entries: int, args: argparse.Namespace) -> list[float]:
    """Seconds per statistics() call on an index of ``num_entries`` READY chunks."""
    index = BlockIndex(num_entries, eviction_policy=args.policy)
    plan = index.prepare_store([i.to_bytes(8, "big") for i in range(num_entries)])
    if plan.job_id is not None:
        index.complete_store(Completion(plan.job_id, JobKind.STORE, ok=True))
    timer = timeit.Timer(index.statistics)
    number, _ = timer.autorange()
    return [seconds / number for seconds in timer.repeat(args.repeats, number)]


def run_chats(disk_chunks: int, args: argparse.Namespace) -> tuple[IndexStats, int]:
    """The index after --turns turns of chats (module docstring), and the chunks the turns
    could have reused (those their chats had stored before)."""
    rng = random.Random(0)
    index = BlockIndex(args.slots, disk_chunks, spill_ahead_fraction=args.spill_ahead,
                       eviction_policy=args.policy)
    chats: list[list[bytes]] = []
    next_key = reusable = 0
    for _ in range(args.turns):
        if len(chats) < args.slots // 4 or rng.random() < 0.25:
            chat: list[bytes] = []
            chats.append(chat)
        else:
            chat = chats[rng.randrange(len(chats) - args.slots // 4, len(chats))]
        reusable += len(chat)
        load = index.prepare_load(chat[: index.lookup(chat).num_hits])
        if load.job_id is not None:
            index.complete_load(Completion(load.job_id, JobKind.LOAD, ok=True))
        new = 4 if chat else 8
        chat += [key.to_bytes(8, "big") for key in range(next_key, next_key + new)]
        next_key += new
        plan = index.prepare_store(chat)
        if plan.job_id is not None:
            index.complete_store(Completion(plan.job_id, JobKind.STORE, ok=True))
        spill = index.take_spills()
        if spill is not None:
            index.complete_spill(Completion(spill.job_id, JobKind.SPILL, ok=True))
    return index.statistics(), reusable


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
    parser.add_argument("--stats-entries", default="1000,1000000",
                        help="index sizes (READY chunks) to time statistics() at")
    parser.add_argument("--disk-ratios", default="0.1,0.25,0.5,1,2,4",
                        help="disk sizes, times --slots, for the write-back sweep ('' skips it)")
    parser.add_argument("--turns", type=int, default=20_000, help="chat turns per disk size")
    parser.add_argument("--spill-ahead", type=float, default=0.25,
                        help="spill_ahead_fraction in the sweep")
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
    costs = {int(n): [s * 1e6 for s in statistics_cost(int(n), args)]
             for n in args.stats_entries.split(",")}
    print("statistics() per call: " + ", ".join(
        f"{n} entries {statistics.median(us):.2f} us [{min(us):.2f}-{max(us):.2f}]"
        for n, us in costs.items()))
    if not args.disk_ratios:
        return
    print(f"write-back sweep: {args.turns} chat turns, {args.slots} CPU slots, "
          f"spill_ahead_fraction {args.spill_ahead}\n  disk/CPU  disk chunks   written  "
          f"evicted  written/evicted  hits of reusable (cpu + disk)")
    worst = 0.0
    for ratio in map(float, args.disk_ratios.split(",")):
        disk = max(round(ratio * args.slots), 1)
        stats, reusable = run_chats(disk, args)
        amplification = stats.spills_ok / max(stats.cpu_evictions, 1)
        worst = max(worst, amplification)
        cpu, disk_hits = (hits / max(reusable, 1) for hits in (stats.loads_cpu, stats.loads_disk))
        print(f"  {ratio:8g}  {disk:11d}  {stats.spills_ok:8d}  {stats.cpu_evictions:7d}  "
              f"{amplification:15.2f}  {cpu + disk_hits:.3f} ({cpu:.3f} + {disk_hits:.3f})")
    verdict = "met" if worst <= 1.2 else "missed"
    print(f"worst write amplification {worst:.2f} (target <= 1.2: {verdict})")

if __name__ == "__main__":
    main()
