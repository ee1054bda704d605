#!/usr/bin/env python3
"""Benchmark what the library API's safe default costs: ``store()`` that returns once its
source blocks are copied (``store_mode="copied"``) against ``"async"``, on CPU tensors.

An engine step here: ``store()`` of ``--chunks`` new chunks (``--layers`` x
``--blocks-per-chunk`` pages of ``--page-kib`` KiB), then a "forward pass" of
``--compute-ms`` of matrix products that touch no stored block, then a rewrite of the
stored blocks (the next step's KV). The async engine must ``fence()`` the blocks before
that rewrite (else it stores torn KV: tests/integration/test_store_lifetime.py), so its
copy overlaps the forward pass only. Per mode, after ``--warmup`` steps:

- ``store() call``   the call alone (copied: includes the copy; async: the hand-off)
- ``step``           store + forward pass + fence (async) + rewrite

Baseline in the same run: one raw ``copy_`` of the same bytes into a preallocated buffer
(what the copy itself costs) and the forward pass alone. Modes run round-robin per round
so drift hits both alike; median with the min-max spread over ``--repeats`` rounds.
Results: docs/benchmarks/copy.md ("store() modes").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.config import CpuTierConfig, StoreConfig  # noqa: E402
from tierkv.engine.store import TierKVStore  # noqa: E402
from tierkv.keys import chunk_keys  # noqa: E402

MODES = ("copied", "async")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="KV layers")
    parser.add_argument("--blocks-per-chunk", type=int, default=16, help="blocks per chunk")
    parser.add_argument("--page-kib", type=int, default=4, help="KiB of one layer's block")
    parser.add_argument("--chunks", type=int, default=4, help="chunks stored per step")
    parser.add_argument("--compute-ms", type=float, default=5.0,
                        help="the forward pass's target time (matrix products)")
    parser.add_argument("--steps", type=int, default=20, help="steps per mode and round")
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed, per round")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser.parse_args(argv)


class Engine:
    """One store over its own KV tensors, and the step an engine runs."""

    def __init__(self, args: argparse.Namespace, mode: str) -> None:
        self.args = args
        self.bpc = args.blocks_per_chunk
        self.blocks = args.chunks * self.bpc
        page = args.page_kib * 1024
        self.kv = [torch.zeros((2 * self.blocks, page), dtype=torch.uint8)
                   for _ in range(args.layers)]
        chunk_bytes = args.layers * self.bpc * page
        config = StoreConfig(blocks_per_chunk=self.bpc, device="cpu", store_mode=mode,
                             cpu=CpuTierConfig(max_bytes=4 * args.chunks * chunk_bytes,
                                               pin_memory="never"))
        self.store = TierKVStore(self.kv, model_id=f"bench-{mode}", tokens_per_block=16,
                                 config=config)
        self.mode = mode
        self.step_number = 0
        self.sources = list(range(self.blocks))

    def step(self, forward: Callable[[], None]) -> tuple[float, float]:
        """(seconds of the store() call, seconds of the whole step)."""
        tokens = self.args.chunks * self.bpc * 16
        first = self.step_number * tokens
        self.step_number += 1
        keys = chunk_keys(list(range(first, first + tokens)), self.bpc * 16)
        started = time.perf_counter()
        self.store.store(keys, self.sources)
        stored = time.perf_counter()
        forward()
        if self.mode == "async":
            self.store.fence(self.sources)
        for layer in self.kv:  # the next step's KV into the same blocks
            layer[: self.blocks].fill_(self.step_number % 251)
        self.store.poll()
        return stored - started, time.perf_counter() - started

    def close(self) -> None:
        self.store.close()


def make_forward(target_ms: float) -> Callable[[], None]:
    """Matrix products sized to take about ``target_ms``."""
    size = 256
    left, right = torch.randn(size, size), torch.randn(size, size)
    started = time.perf_counter()
    for _ in range(20):
        torch.mm(left, right)
    per_product = (time.perf_counter() - started) / 20
    products = max(1, round(target_ms / 1000 / per_product))

    def forward() -> None:
        for _ in range(products):
            torch.mm(left, right)

    return forward


def spread(values: list[float], scale: float = 1000.0) -> str:
    values = [value * scale for value in values]
    return f"{statistics.median(values):8.3f} [{min(values):.3f} .. {max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    forward = make_forward(args.compute_ms)
    engines = {mode: Engine(args, mode) for mode in MODES}
    step_bytes = args.chunks * engines["copied"].store.chunk_bytes
    source = torch.ones(step_bytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    calls: dict[str, list[float]] = {mode: [] for mode in MODES}
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    raw: list[float] = []
    alone: list[float] = []
    try:
        for _ in range(args.repeats):
            for mode, engine in engines.items():
                for _ in range(args.warmup):
                    engine.step(forward)
                timed = [engine.step(forward) for _ in range(args.steps)]
                calls[mode].append(statistics.median(call for call, _ in timed))
                steps[mode].append(statistics.median(step for _, step in timed))
            started = time.perf_counter()
            for _ in range(args.steps):
                target.copy_(source)
            raw.append((time.perf_counter() - started) / args.steps)
            started = time.perf_counter()
            for _ in range(args.steps):
                forward()
            alone.append((time.perf_counter() - started) / args.steps)
    finally:
        for engine in engines.values():
            engine.close()
    print(f"store of {args.chunks} chunk(s) of {engines['copied'].store.chunk_bytes >> 10} KiB "
          f"({step_bytes / 2**20:.1f} MiB) a step; forward pass ~{args.compute_ms} ms; "
          f"median ms [min .. max] of {args.repeats} rounds x {args.steps} steps")
    print(f"  baseline raw copy_ of the step's bytes   {spread(raw)}")
    print(f"  baseline forward pass alone              {spread(alone)}")
    for mode in MODES:
        print(f"  store() call, store_mode={mode:6s}        {spread(calls[mode])}")
    for mode in MODES:
        label = "copied" if mode == "copied" else "async + fence"
        print(f"  step, store_mode={label:13s}          {spread(steps[mode])}")
    cost = statistics.median(steps["copied"]) / statistics.median(steps["async"])
    print(f"verdict: the safe default (copied) costs {cost:.2f}x the async step "
          f"({(statistics.median(steps['copied']) - statistics.median(steps['async'])) * 1e3:+.3f} "
          f"ms a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
