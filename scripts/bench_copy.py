#!/usr/bin/env python3
"""Benchmark the CPU fallback copies (CpuTransferEngine) against raw copy_ in the same run.

A chunk is ``--layers`` x ``--blocks-per-chunk`` pages of ``--page-bytes`` (2 MiB by
default). Per KV layout (``--layouts``: ``separate`` = one tensor per layer, ``LB`` = one
layer-outermost buffer viewed per layer, ``BL`` = one block-outermost buffer viewed per
layer, as vLLM builds them) and block-id pattern (``--ids``: ``consecutive`` or
``random``), each round times, for the same ``--jobs`` chunks:

- engine store   store jobs through CpuTransferEngine: submit all, then wait for all
                 (the worker thread, its queue and the copies; ``copy`` = the jobs' own
                 copy seconds, without the hand-off)
- engine load    the same chunks as load jobs
- block loop     one ``copy_`` per (layer, block) page into the slot: what gathering avoids
- raw copy_      one ``slot.copy_(source_row)`` per chunk: the baseline (all intra-op
                 threads), and the same with ``torch.set_num_threads(1)``

KV, slab and source buffers are each larger than the CPU caches and the chunks rotate
through them, so copies read cold memory, as in serving. Methods run round-robin inside
each round so drift hits all of them alike; the first round is a warm-up and is not
reported. Prints median GB/s with min-max spread and the ratio to raw copy_.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.core.jobs import ChunkCopy, JobId, LoadSpec, SlotId, StoreSpec  # noqa: E402
from tierkv.tiers.cpu import CpuSlab  # noqa: E402
from tierkv.transfer.cpu import CpuTransferEngine  # noqa: E402
from tierkv.transfer.layout import KVLayout  # noqa: E402

LAYOUTS = ("separate", "LB", "BL")
PATTERNS = ("consecutive", "random")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="KV layers")
    parser.add_argument("--blocks-per-chunk", type=int, default=16, help="blocks per chunk")
    parser.add_argument("--page-bytes", type=int, default=4096, help="bytes of one layer's block")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks per layer")
    parser.add_argument("--slots", type=int, default=64, help="slab slots (chunks rotate through)")
    parser.add_argument("--jobs", type=int, default=64, help="chunks timed per method and round")
    parser.add_argument("--chunks-per-job", type=int, default=1, help="chunks per engine job")
    parser.add_argument("--repeats", type=int, default=7, help="measured rounds (after warm-up)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated")
    parser.add_argument("--ids", default=",".join(PATTERNS), help="comma-separated")
    parser.add_argument("--no-block-loop", action="store_true", help="skip the slow baseline")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); 1 resists other "
                             "processes stalling a parallel op on a shared machine")
    return parser.parse_args(argv)


def kv_tensors(layout: str, layers: int, num_blocks: int, page: int) -> list[torch.Tensor]:
    if layout == "separate":
        return [torch.full((num_blocks, page), layer, dtype=torch.uint8) for layer in range(layers)]
    if layout == "LB":
        buffer = torch.ones((layers, num_blocks, page), dtype=torch.uint8)
        return [buffer[layer] for layer in range(layers)]
    buffer = torch.ones((num_blocks, layers, page), dtype=torch.uint8)
    return [buffer[:, layer] for layer in range(layers)]


class Case:
    """One layout x id pattern: its engine, its chunks and its timed methods."""

    def __init__(self, args: argparse.Namespace, layout: str, pattern: str) -> None:
        self.args, self.name = args, f"{layout}/{pattern}"
        self.tensors = kv_tensors(layout, args.layers, args.num_blocks, args.page_bytes)
        self.layout = KVLayout.from_tensors(self.tensors)
        self.chunk_bytes = self.layout.chunk_bytes(args.blocks_per_chunk)
        self.slab = CpuSlab(args.slots, self.chunk_bytes, pin_memory="never")
        self.slab.tensor.fill_(0)
        self.engine = CpuTransferEngine(self.layout, self.slab, args.blocks_per_chunk)
        rng = np.random.default_rng(7)
        bpc, span, per_job = args.blocks_per_chunk, args.num_blocks, args.chunks_per_job
        if per_job * bpc > span:
            raise SystemExit(f"--chunks-per-job {per_job} x {bpc} blocks exceeds --num-blocks")
        self.chunks: list[ChunkCopy] = []
        for index in range(args.jobs):
            position = index % per_job  # chunks of one job never share a block
            if position == 0:
                order = rng.permutation(span // bpc if pattern == "consecutive" else span)
            if pattern == "consecutive":
                blocks = tuple(range(order[position] * bpc, (order[position] + 1) * bpc))
            else:
                blocks = tuple(int(b) for b in order[position * bpc:(position + 1) * bpc])
            self.chunks.append(ChunkCopy(index.to_bytes(32, "big"), SlotId(index % args.slots),
                                         blocks))
        self.next_job = 1
        self.copy_seconds: dict[str, list[float]] = {"store": [], "load": []}

    def run_engine(self, kind: str) -> float:
        per_job = self.args.chunks_per_job
        ids: list[JobId] = []
        start = time.perf_counter()
        for first in range(0, len(self.chunks), per_job):
            job = JobId(self.next_job)
            self.next_job += 1
            chunks = tuple(self.chunks[first:first + per_job])
            if kind == "store":
                self.engine.submit_store(StoreSpec.of(job, chunks))
            else:
                self.engine.submit_load(LoadSpec(job, chunks))
            ids.append(job)
        self.engine.wait(ids)
        elapsed = time.perf_counter() - start
        done = self.engine.poll_finished()
        assert all(c.ok for c in done), [c.error for c in done if not c.ok]
        self.copy_seconds[kind].append(sum(c.seconds for c in done))
        return elapsed

    def run_block_loop(self) -> float:
        pages = self.layout.layer_pages
        start = time.perf_counter()
        for chunk in self.chunks:
            views = self.layout.slot_layer_views(self.slab.view(chunk.slot), len(chunk.block_ids))
            for layer_pages, view in zip(pages, views):
                for position, block in enumerate(chunk.block_ids):
                    view[position].copy_(layer_pages[block])
        return time.perf_counter() - start


def run_raw(slab: torch.Tensor, source: torch.Tensor, count: int, threads: int | None) -> float:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rows = slab.shape[0]
    start = time.perf_counter()
    for index in range(count):
        slab[index % rows].copy_(source[(index * 5 + 1) % rows])
    elapsed = time.perf_counter() - start
    torch.set_num_threads(before)
    return elapsed


def summary(name: str, gbps: list[float], baseline: float | None) -> str:
    median = statistics.median(gbps)
    ratio = f"{median / baseline:6.2f}x" if baseline else "    - "
    return f"{name:<34} {median:8.2f} GB/s  [{min(gbps):6.2f} - {max(gbps):6.2f}]  {ratio}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [Case(args, layout, pattern) for layout in args.layouts.split(",")
             for pattern in args.ids.split(",")]
    chunk_bytes = cases[0].chunk_bytes
    total = chunk_bytes * args.jobs
    slab = torch.zeros((args.slots, chunk_bytes), dtype=torch.uint8)
    source = torch.ones((args.slots, chunk_bytes), dtype=torch.uint8)
    print(f"bench_copy: {args.jobs} chunks of {chunk_bytes / 2**20:.2f} MiB ({args.layers} layers "
          f"x {args.blocks_per_chunk} blocks x {args.page_bytes} B), {args.chunks_per_job} per "
          f"job; torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} CPUs, {platform.machine()}, load average "
          f"{os.getloadavg()[0]:.2f} (other processes skew a shared machine)")
    results: dict[str, list[float]] = {}
    methods: list[tuple[str, Callable[[], float]]] = [
        ("raw copy_", lambda: run_raw(slab, source, args.jobs, None)),
        ("raw copy_ (1 thread)", lambda: run_raw(slab, source, args.jobs, 1)),
    ]
    for case in cases:
        methods.append((f"{case.name} engine store", lambda c=case: c.run_engine("store")))
        methods.append((f"{case.name} engine load", lambda c=case: c.run_engine("load")))
        if not args.no_block_loop:
            methods.append((f"{case.name} block loop", case.run_block_loop))
    for round_index in range(args.repeats + 1):
        for name, method in methods:
            seconds = method()
            if round_index > 0:  # round 0 is the warm-up
                results.setdefault(name, []).append(total / seconds / 1e9)
    for case in cases:  # copy seconds of the measured rounds only
        for kind in ("store", "load"):
            seconds = case.copy_seconds[kind][1:]
            results[f"{case.name} engine {kind} (copy)"] = [total / s / 1e9 for s in seconds]
        case.engine.shutdown()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    raw = statistics.median(results["raw copy_"])
    print(f"{'method':<34} {'median':>13}  {'[min - max]':>17}  vs raw copy_")
    for name in [name for name, _ in methods[:2]]:
        print(summary(name, results[name], raw))
    for case in cases:
        for suffix in ("engine store", "engine store (copy)", "engine load",
                       "engine load (copy)", "block loop"):
            name = f"{case.name} {suffix}"
            if name in results:
                print(summary(name, results[name], raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
