#!/usr/bin/env python3
"""Scheduler-side cost of the engine adapter per step and per chunk decision.

Workload: --requests running requests of --chunks chunks each. Every step each request
computes --chunks-per-step more chunks of its prompt (1: one store decision, and one job,
per request per step; --chunks: the whole prompt in one step) and a lookup of its whole
key list is made (the cost a new request pays). Then decode steps (one token per request,
no chunk completes) are timed. Jobs complete at once (the scheduler side alone is
measured: no bytes move).

Baseline in the same run: a bare dict doing the same decisions (key present? else insert
with a slot id) for the same keys, which is the floor any bookkeeping pays in Python.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tierkv

from tierkv.core.index import BlockIndex  # noqa: E402
from tierkv.core.stats import IndexStats  # noqa: E402
from tierkv.core.jobs import Completion  # noqa: E402
from tierkv.core.policy import DEFAULT_POLICY, policy_names  # noqa: E402
from tierkv.engine.adapter import AdapterConfig, EngineAdapter  # noqa: E402
from tierkv.engine.requests import RequestView, StepInput, WorkerReport  # noqa: E402
from tierkv.keys import chunk_keys  # noqa: E402


def build_views(num_requests: int, num_chunks: int, tokens_per_chunk: int,
                shared_chunks: int = 0) -> list[tuple[str, list[bytes]]]:
    """Each request's chunk keys; the first ``shared_chunks`` are the same for all (a
    common system prompt: one request stores them, the others find them present)."""
    out = []
    shared = shared_chunks * tokens_per_chunk
    for r in range(num_requests):
        tokens = [i % 50_000 if i < shared else (r * 7919 + i) % 50_000
                  for i in range(num_chunks * tokens_per_chunk)]
        out.append((f"req-{r}", chunk_keys(tokens, tokens_per_chunk)))
    return out


def adapter_config(args: argparse.Namespace) -> AdapterConfig:
    """--groups > 1: a hybrid model's KV cache groups, one with a sliding window (its
    blocks may be freed while their request runs: the fence tracks what stores read)."""
    return AdapterConfig(args.block_size, args.blocks_per_chunk, groups=args.groups,
                         frees_running_blocks=args.groups > 1, load_policy=args.load_policy)


def block_lists(args: argparse.Namespace, num_chunks: int,
                request: int) -> list[int] | tuple[list[int], ...]:
    """A request's block ids: a flat list with one group, else one list per group."""
    per_group = num_chunks * args.blocks_per_chunk
    first = request * per_group * args.groups
    lists = tuple(list(range(first + group * per_group, first + (group + 1) * per_group))
                  for group in range(args.groups))
    return lists[0] if args.groups == 1 else lists


def run_adapter(views: list[tuple[str, list[bytes]]], args: argparse.Namespace,
                stats: list[IndexStats] | None = None) -> tuple[float, float, int]:
    tpc = args.block_size * args.blocks_per_chunk
    num_requests, num_chunks = len(views), len(views[0][1])
    index = BlockIndex(num_slots=args.cpu_slots or num_requests * num_chunks + 16, disk_capacity=0,
                       eviction_policy=args.policy)
    adapter = EngineAdapter(index, adapter_config(args))
    blocks = {req_id: block_lists(args, num_chunks, r) for r, (req_id, _) in enumerate(views)}
    decisions = 0
    plan_seconds = 0.0
    lookup_seconds = 0.0
    total_tokens = num_chunks * tpc
    per_step = args.chunks_per_step
    for step in range(0, num_chunks, per_step):
        requests = {
            req_id: RequestView(req_id, keys, total_tokens, total_tokens, step * tpc) for req_id, keys in views
        }
        scheduled = dict.fromkeys(requests, tpc * per_step)
        new_blocks = {req_id: blocks[req_id] for req_id in requests} if step == 0 else {}
        replaced = frozenset(requests) if step == 0 else frozenset()
        t0 = time.perf_counter()
        plan = adapter.build_plan(StepInput(requests, scheduled, new_blocks, replaced))
        adapter.complete(WorkerReport(0, tuple(Completion(s.job_id, s.kind, ok=True) for s in plan.stores)))
        t1 = time.perf_counter()
        for req_id, view in requests.items():
            adapter.lookup(view, 0)
        t2 = time.perf_counter()
        plan_seconds += t1 - t0
        lookup_seconds += t2 - t1
        decisions += num_requests * per_step
    if stats is not None:
        stats.append(index.statistics())
    return plan_seconds, lookup_seconds, decisions


def run_decode_steps(views: list[tuple[str, list[bytes]]], args: argparse.Namespace, steps: int = 32) -> float:
    """Seconds per decode step (one token per request, no chunk completes): what every
    request costs the plan on the steps that store nothing, which are most steps."""
    tpc = args.block_size * args.blocks_per_chunk
    num_chunks = len(views[0][1])
    index = BlockIndex(num_slots=len(views) * num_chunks + 16, disk_capacity=0, eviction_policy=args.policy)
    adapter = EngineAdapter(index, adapter_config(args))
    computed = num_chunks * tpc - tpc // 2  # mid-chunk: no chunk completes for a while
    blocks = {req_id: block_lists(args, num_chunks, 0) for req_id, _ in views}
    first = {req_id: RequestView(req_id, keys, computed, computed + 1, computed) for req_id, keys in views}
    adapter.build_plan(StepInput(first, dict.fromkeys(first, 1), blocks, frozenset(first)))
    seconds = 0.0
    for step in range(1, steps + 1):
        requests = {req_id: RequestView(req_id, keys, computed, computed + step + 1, computed + step)
                    for req_id, keys in views}
        scheduled = dict.fromkeys(requests, 1)
        t0 = time.perf_counter()
        plan = adapter.build_plan(StepInput(requests, scheduled))
        seconds += time.perf_counter() - t0
        assert not plan.stores
    return seconds / steps


def run_baseline(views: list[tuple[str, list[bytes]]], per_step: int) -> tuple[float, float, int]:
    table: dict[bytes, int] = {}
    num_chunks = len(views[0][1])
    plan_seconds = 0.0
    lookup_seconds = 0.0
    decisions = 0
    slot = 0
    for step in range(0, num_chunks, per_step):
        t0 = time.perf_counter()
        for _, keys in views:
            for key in keys[step : step + per_step]:
                if key not in table:
                    table[key] = slot
                    slot += 1
        t1 = time.perf_counter()
        for _, keys in views:
            hits = 0
            for key in keys:
                if key not in table:
                    break
                hits += 1
        t2 = time.perf_counter()
        plan_seconds += t1 - t0
        lookup_seconds += t2 - t1
        decisions += len(views) * per_step
    return plan_seconds, lookup_seconds, decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks-per-chunk", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cpu-slots", type=int, default=0,
                        help="CPU tier size in chunks; 0 = room for every chunk (no eviction). "
                             "Smaller, with one chunk per step: every store past the first fill "
                             "evicts the oldest chunk (a single step larger than the tier finds "
                             "no room for the rest: counted, as printed)")
    parser.add_argument("--shared-chunks", type=int, default=0,
                        help="leading chunks every request shares (a common system prompt)")
    parser.add_argument("--chunks-per-step", type=int, default=1,
                        help="chunks each request completes per step: 1 = decode-like steady "
                             "state, --chunks = the whole prompt in one prefill step")
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=policy_names(),
                        help="the CPU tier's eviction policy")
    parser.add_argument("--load-policy", default="always", choices=("always", "cost"),
                        help="cost: every lookup with hits also decides, from the cost model, "
                             "how much of its hit to load (tierkv.core.costs)")
    parser.add_argument("--groups", type=int, default=1,
                        help="KV cache groups (2: a hybrid model's full-attention and "
                             "sliding-window groups, a chunk holding both groups' pages)")
    args = parser.parse_args()
    tpc = args.block_size * args.blocks_per_chunk
    views = build_views(args.requests, args.chunks, tpc, args.shared_chunks)
    run_adapter(views[:8], args)  # warm-up
    rows = {"adapter": [], "dict": []}
    stats: list[IndexStats] = []
    for _ in range(args.repeats):
        plan, lookup, decisions = run_adapter(views, args, stats)
        rows["adapter"].append((plan, lookup, decisions))
        plan, lookup, decisions = run_baseline(views, args.chunks_per_step)
        rows["dict"].append((plan, lookup, decisions))
    steps = -(-args.chunks // args.chunks_per_step)
    slots = f"{args.cpu_slots} CPU slots (evicting)" if args.cpu_slots else "room for every chunk"
    if args.shared_chunks:
        slots += f", first {args.shared_chunks} chunks shared by all"
    groups = f", {args.groups} KV cache groups" if args.groups > 1 else ""
    policy = f", load_policy {args.load_policy}" if args.load_policy != "always" else ""
    print(f"{args.policy}{groups}{policy}: {args.requests} running requests x {args.chunks} chunks, {args.chunks_per_step} chunk(s) per "
          f"request per step ({steps} steps), {slots}, {args.repeats} repeats (median [min-max])")
    medians = {}
    for name, runs in rows.items():
        per_step = [p / steps * 1e6 for p, _, _ in runs]
        per_decision = [p / d * 1e6 for p, _, d in runs]
        per_lookup_chunk = [lk / (args.requests * args.chunks * steps) * 1e6 for _, lk, _ in runs]
        medians[name] = statistics.median(per_decision)
        print(
            f"  {name:8s} plan {statistics.median(per_step):9.1f} us/step "
            f"[{min(per_step):.1f}-{max(per_step):.1f}]  "
            f"{statistics.median(per_decision):6.2f} us/chunk decision  "
            f"lookup {statistics.median(per_lookup_chunk):6.3f} us/chunk "
            f"({statistics.median(per_lookup_chunk) * args.chunks:6.2f} us/request)"
        )
    last = stats[-1]
    print(f"  what the index did (one repeat): {last.stores_planned} chunks stored, "
          f"{last.cpu_evictions} evictions, {last.stores_no_room} found no room")
    decode = [run_decode_steps(views, args) * 1e6 for _ in range(args.repeats)]
    print(f"  decode step, no chunk completes: {statistics.median(decode):.1f} us/step "
          f"[{min(decode):.1f}-{max(decode):.1f}], {statistics.median(decode) / args.requests:.2f} us per request")
    print(f"adapter / bare dict per chunk decision: {medians['adapter'] / medians['dict']:.1f}x "
          f"(target <= 2 us per decision: {'met' if medians['adapter'] <= 2.0 else 'missed'})")


if __name__ == "__main__":
    main()
