#!/usr/bin/env python3
"""GPU check of the CUDA transfer path: byte-exactness first, then GB/s against the
physical baseline, in one run sized for a lent GPU (well under 3 minutes).

1. Correctness (exit status 1 on any failure): for the layouts LBNHC, LBHNC, BLNHC, BLHNC
   (one buffer viewed per layer) and LBHNC with one tensor per layer, in bfloat16, float32
   and float8: stores of scattered blocks into runs of slots, compared with a reference
   built by offset arithmetic on the raw buffers; loads into other blocks (one chunk with
   ``skip_blocks``, whose skipped blocks must stay untouched); staging smaller than a job
   (batches), padded slots; a store issued right after a slow kernel wrote its blocks on
   the compute stream (no sync in between); a slow load followed by
   ``make_compute_wait`` and a read on the compute stream; FIFO completions with a failed
   job among them.
2. Bandwidth: per page size (``--page-bytes``), KV layout (``--layouts``: ``BL`` one
   block-outermost buffer, ``separate`` one tensor per layer) and job size
   (``--chunks-per-job``), ``--total-mib`` per direction moves through CudaTransferEngine
   (submit every job, wait for all; host wall time, and the jobs' own event time), against
   one large pinned ``copy_`` of the same total bytes timed with events in the same run.
   Random block ids. Round 0 is a warm-up; medians and min-max of ``--repeats`` rounds.

Without CUDA it prints that it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.core.jobs import ChunkCopy, Completion, JobId, LoadSpec, SlotId, StoreSpec  # noqa: E402
from tierkv.tiers.cpu import CpuSlab  # noqa: E402
from tierkv.transfer.cuda import CudaTransferEngine  # noqa: E402  (imports without CUDA)
from tierkv.testing import LayoutKV
from tierkv.transfer.layout import KVLayout  # noqa: E402

MiB = 1 << 20
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="KV layers")
    parser.add_argument("--blocks-per-chunk", type=int, default=16, help="blocks per chunk")
    parser.add_argument("--page-bytes", default="4096,16384",
                        help="comma-separated bytes of one layer's block")
    parser.add_argument("--layouts", default="BL,separate", help="comma-separated")
    parser.add_argument("--chunks-per-job", default="32,1", help="comma-separated")
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per layer")
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per direction, round")
    parser.add_argument("--staging-mib", type=int, default=64, help="engine staging per direction")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds after warm-up")
    parser.add_argument("--skip-bandwidth", action="store_true", help="correctness only")
    return parser.parse_args(argv)


def KV(kind: str, layers: int, blocks: int, inner: tuple[int, int, int],
       dtype: torch.dtype, separate: bool = False) -> LayoutKV:
    """Per layer a logical [B, H, N, C] CUDA tensor over raw uint8 buffers."""
    return LayoutKV(kind, layers, blocks, inner, dtype, separate, device="cuda")

class Checks:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            print(f"  FAIL {what}", flush=True)


def engine_for(kv: LayoutKV, bpc: int, slots: int, staging_chunks: float,
               pad: int = 0) -> CudaTransferEngine:
    engine: CudaTransferEngine = kv.engine(bpc, slots, staging_chunks, pad)
    return engine


def cc(key: int, slot: int, blocks: tuple[int, ...], skip: int = 0) -> ChunkCopy:
    return ChunkCopy(key.to_bytes(32, "big"), SlotId(slot), blocks, skip_blocks=skip)


def check_round_trip(checks: Checks, kind: str, dtype: torch.dtype, separate: bool,
                     staging_chunks: float, pad: int) -> None:
    bpc, blocks = 8, 64
    name = f"{kind}{'-separate' if separate else ''} {dtype} staging={staging_chunks} pad={pad}"
    kv = KV(kind, 4, blocks, (16, 4, 32), dtype, separate)
    engine = engine_for(kv, bpc, 16, staging_chunks, pad)
    slots = [3, 4, 5, 0, 9, 10]
    sources = [tuple((i * 5 + s * 3) % blocks for s in range(bpc)) for i in range(len(slots))]
    engine.submit_store(StoreSpec.of(JobId(1), tuple(
        cc(i, slot, sources[i]) for i, slot in enumerate(slots))))
    engine.wait([JobId(1)])
    done = engine.poll_finished()
    checks.expect(len(done) == 1 and done[0].ok, f"{name}: store completion {done}")
    expected = {slot: kv.chunk(sources[i]) for i, slot in enumerate(slots)}
    for slot, reference in expected.items():
        got = engine.slab.view(slot)[:reference.numel()]
        checks.expect(torch.equal(got, reference), f"{name}: slot {slot} bytes")
    targets = [tuple(range(i * bpc, (i + 1) * bpc))[::-1] for i in range(len(slots))]
    before = kv.chunk(targets[0])
    engine.submit_load(LoadSpec(JobId(2), tuple(
        cc(i, slot, targets[i], skip=3 if i == 0 else 0) for i, slot in enumerate(slots))))
    engine.make_compute_wait([JobId(2)])
    per_layer = bpc * kv.page
    for i, slot in enumerate(slots):
        got, want = kv.chunk(targets[i]), expected[slot]
        if i == 0:
            for layer in range(kv.layers):
                lo, hi = layer * per_layer, (layer + 1) * per_layer
                checks.expect(torch.equal(got[lo + 3 * kv.page:hi], want[lo + 3 * kv.page:hi]),
                              f"{name}: load with skip, layer {layer}")
                checks.expect(torch.equal(got[lo:lo + 3 * kv.page], before[lo:lo + 3 * kv.page]),
                              f"{name}: skipped blocks untouched, layer {layer}")
        else:
            checks.expect(torch.equal(got, want), f"{name}: load chunk {i} bytes")
    done = engine.poll_finished()
    checks.expect(len(done) == 1 and done[0].ok, f"{name}: load completion {done}")
    engine.shutdown()


def check_ordering(checks: Checks) -> None:
    kv = KV("BLNHC", 4, 64, (16, 4, 32), torch.bfloat16)
    engine = engine_for(kv, 8, 16, 4)
    blocks = tuple(range(10, 18))
    torch.cuda._sleep(SLEEP_CYCLES)  # the "forward": slow, then it writes the blocks
    for step, block in enumerate(blocks):
        for layer in range(kv.layers):
            kv.page_at(layer, block).fill_(step + 1)
    engine.submit_store(StoreSpec.of(JobId(1), (cc(1, 0, blocks),)))
    engine.wait([JobId(1)])
    slot = engine.slab.view(0).view(kv.layers, 8, kv.page)
    checks.expect(all(bool((slot[:, s] == s + 1).all()) for s in range(8)),
                  "store after a slow forward copies what the forward wrote")

    engine.slab.view(1).fill_(7)
    with torch.cuda.stream(engine._load.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the load runs late
    engine.submit_load(LoadSpec(JobId(2), (cc(2, 1, tuple(range(30, 38))),)))
    engine.make_compute_wait([JobId(2)])
    seen = torch.stack([kv.page_at(l, b) for l in range(kv.layers) for b in range(30, 38)])
    checks.expect(bool((seen == 7).all()), "make_compute_wait orders the forward after a load")

    with torch.cuda.stream(engine._store.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    for job in range(3, 11):
        engine.submit_store(StoreSpec.of(JobId(job), (cc(job, job, blocks),)))
    engine.submit_store(StoreSpec.of(JobId(11), (cc(11, 99, blocks),)))
    finished: list[Completion] = []
    deadline = time.monotonic() + 10
    while len(finished) < 10 and time.monotonic() < deadline:  # job 2 (load) + 3..11
        finished.extend(engine.poll_finished())
    stores = [c.job_id for c in finished if c.job_id >= 3]
    checks.expect(stores == list(range(3, 12)), f"FIFO store completions: {stores}")
    failed = [c for c in finished if c.job_id == 11]
    checks.expect(len(failed) == 1 and not failed[0].ok
                  and "out of range" in (failed[0].error or ""),
                  "a failed job is reported in order, not raised")
    engine.shutdown()


def random_chunks(num_blocks: int, bpc: int, count: int,
                  generator: torch.Generator) -> list[tuple[int, ...]]:
    """Random block ids; the chunks of each aligned window of num_blocks // bpc are
    disjoint, so a load job inside one window never writes a block twice."""
    per_window = num_blocks // bpc
    chunks: list[tuple[int, ...]] = []
    while len(chunks) < count:
        order = torch.randperm(num_blocks, generator=generator).tolist()
        chunks.extend(tuple(order[i * bpc:(i + 1) * bpc]) for i in range(per_window))
    return chunks[:count]


def median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} GB/s [{min(values):6.2f} - {max(values):6.2f}]"


def bandwidth(args: argparse.Namespace, checks: Checks) -> None:
    bpc, layers = args.blocks_per_chunk, args.layers
    for page in [int(p) for p in args.page_bytes.split(",")]:
        chunk_bytes = layers * bpc * page
        num_chunks = max(1, args.total_mib * MiB // chunk_bytes)
        total = num_chunks * chunk_bytes
        slab = CpuSlab(num_chunks, chunk_bytes, pin_memory="always")
        device_buffer = torch.empty(total, dtype=torch.uint8, device="cuda")
        flat = slab.tensor.view(-1)
        base: dict[str, list[float]] = {"d2h": [], "h2d": []}
        for round_index in range(args.repeats + 1):
            for direction in ("d2h", "h2d"):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                if direction == "d2h":
                    flat.copy_(device_buffer, non_blocking=True)
                else:
                    device_buffer.copy_(flat, non_blocking=True)
                end.record()
                end.synchronize()
                if round_index:
                    base[direction].append(total / (start.elapsed_time(end) / 1e3) / 1e9)
        del device_buffer
        print(f"page {page} B, chunk {chunk_bytes / MiB:.2f} MiB, {total / MiB:.0f} MiB per round")
        print(f"  baseline one pinned copy   D2H {median_spread(base['d2h'])}   "
              f"H2D {median_spread(base['h2d'])}", flush=True)
        generator = torch.Generator().manual_seed(3)
        for layout_name in args.layouts.split(","):
            if layout_name == "BL":
                whole = torch.randint(0, 256, (args.num_blocks, layers, page), dtype=torch.uint8,
                                      device="cuda")
                tensors = [whole[:, layer] for layer in range(layers)]
            else:
                tensors = [torch.randint(0, 256, (args.num_blocks, page), dtype=torch.uint8,
                                         device="cuda") for _ in range(layers)]
            layout = KVLayout.from_tensors(tensors)
            ids = random_chunks(args.num_blocks, bpc, num_chunks, generator)
            for per_job in [int(c) for c in args.chunks_per_job.split(",")]:
                per_job = min(per_job, args.num_blocks // bpc)  # disjoint blocks per load job
                engine = CudaTransferEngine(layout, slab, bpc,
                                            staging_bytes=args.staging_mib * MiB)
                rates: dict[str, list[float]] = {key: [] for key in
                                                 ("store", "load", "store-ev", "load-ev")}
                job = 0
                for round_index in range(args.repeats + 1):
                    for kind in ("store", "load"):
                        torch.cuda.synchronize()
                        submitted: list[JobId] = []
                        start = time.perf_counter()
                        for first in range(0, num_chunks, per_job):
                            job += 1
                            chunks = tuple(cc(i, i, ids[i])
                                           for i in range(first, min(first + per_job, num_chunks)))
                            if kind == "store":
                                engine.submit_store(StoreSpec.of(JobId(job), chunks))
                            else:
                                engine.submit_load(LoadSpec(JobId(job), chunks))
                            submitted.append(JobId(job))
                        engine.wait(submitted)
                        elapsed = time.perf_counter() - start
                        done = engine.poll_finished()
                        checks.expect(all(c.ok for c in done), f"bandwidth {kind}: {done[:1]}")
                        if round_index:
                            rates[kind].append(total / elapsed / 1e9)
                            rates[f"{kind}-ev"].append(total / sum(c.seconds for c in done) / 1e9)
                sample = ids[num_chunks // 2]  # the last load wrote slot -> same blocks: stable
                got = slab.view(num_chunks // 2)[:chunk_bytes]
                want = torch.cat([layout.layer_pages[l][list(sample)].reshape(-1)
                                  for l in range(layers)]).cpu()
                checks.expect(torch.equal(got, want), f"bandwidth {layout_name}: sample bytes")
                engine.shutdown()
                d2h, h2d = statistics.median(base["d2h"]), statistics.median(base["h2d"])
                store, load = (statistics.median(rates[k]) for k in ("store", "load"))
                print(f"  {layout_name:<8} {per_job:>3} chunks/job  store "
                      f"{median_spread(rates['store'])} = {store / d2h:4.2f}x   load "
                      f"{median_spread(rates['load'])} = {load / h2d:4.2f}x   (event time: "
                      f"store {statistics.median(rates['store-ev']):.1f}, load "
                      f"{statistics.median(rates['load-ev']):.1f} GB/s)", flush=True)
            del tensors, layout
        del slab


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: skipped: CUDA not available (torch.cuda.is_available() is False)")
        return 0
    started = time.monotonic()
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}", flush=True)
    checks = Checks()
    dtypes = [torch.bfloat16, torch.float32] + (
        [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
    print("correctness:", flush=True)
    for kind, separate in [("LBNHC", False), ("LBHNC", False), ("BLNHC", False),
                           ("BLHNC", False), ("LBHNC", True)]:
        for dtype in dtypes:
            for staging_chunks, pad in [(4, 0), (1.5, 0), (8, 512)]:
                check_round_trip(checks, kind, dtype, separate, staging_chunks, pad)
    check_ordering(checks)
    print(f"  {'all passed' if not checks.failures else f'{len(checks.failures)} FAILED'} "
          f"({time.monotonic() - started:.1f} s)", flush=True)
    if not args.skip_bandwidth:
        print("bandwidth (random block ids; ratio = engine / one pinned copy):", flush=True)
        bandwidth(args, checks)
    print(f"gpu_check: {'ok' if not checks.failures else 'FAILED'} in "
          f"{time.monotonic() - started:.1f} s", flush=True)
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
