#!/usr/bin/env python3
"""Benchmark the LMDB disk tier against baselines measured in the same run.

Write paths (each run writes ``--chunks`` chunks of ``--chunk-mib`` MiB into a fresh place and
ends durable, i.e. after an fsync of everything it wrote):

- tierkv periodic   ``DiskTier.put_many`` in batches of ``--batch-mib``, then ``sync()``
                    (the default policy: no fsync per transaction)
- tierkv DiskIO     the same through ``DiskIO``'s writer thread, then ``flush()``
- tierkv always     ``sync_mode='always'``: LMDB fsyncs every transaction
- dd fdatasync      ``dd if=/dev/zero of=F bs=<chunk>M count=N conv=fdatasync``
- bare lmdb         raw payloads, one txn per ``--batch-mib``, ``sync=False``, ``env.sync()``
- file per chunk    temp file + fsync + rename per chunk, then one directory fsync

Cold reads (page cache dropped with ``sync; echo 3 > /proc/sys/vm/drop_caches`` before each,
environments closed so no mapping pins pages): tierkv ``read_into`` of every chunk in write
order and in random order, bare file-per-chunk reads, and ``dd if=F of=/dev/null``.

Opening a DiskTier tunes glibc malloc for the whole process (``tune_malloc``; the bare lmdb
baseline shares it); run with ``TIERKV_MALLOPT=0`` to measure without.

All write rounds run first, then all read rounds. Methods run round-robin inside each round
so drift hits all of them alike; the first round of each phase is a warm-up and is not
reported. Prints median MiB/s with min-max spread, then the ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierkv.config import DiskTierConfig  # noqa: E402
from tierkv.core.jobs import JobId, SlotId, SpillSpec  # noqa: E402
from tierkv.keys import Namespace  # noqa: E402
from tierkv.tiers.cpu import CpuSlab  # noqa: E402
from tierkv.tiers.disk import DiskTier, ReadStatus, tune_malloc  # noqa: E402
from tierkv.transfer.disk_io import DiskIO  # noqa: E402

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunk-mib", type=float, default=2.0, help="payload size of a chunk")
    parser.add_argument("--chunks", type=int, default=256, help="chunks written per run")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (after warm-up)")
    parser.add_argument("--batch-mib", type=float, default=8.0,
                        help="bytes per write transaction (disk.write_batch_bytes)")
    parser.add_argument("--dir", type=Path, default=REPO / ".bench",
                        help="scratch directory (must be on the disk under test, not tmpfs)")
    parser.add_argument("--no-always", action="store_true", help="skip sync_mode='always'")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-read section")
    return parser.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.chunk_bytes = int(args.chunk_mib * MiB)
        self.batch_bytes = int(args.batch_mib * MiB)
        self.num_chunks = args.chunks
        self.total = self.chunk_bytes * self.num_chunks
        self.dir = args.dir / f"bench_disk-{os.getpid()}"  # only this is created and removed
        self.slab = CpuSlab(self.num_chunks, self.chunk_bytes, pin_memory="never")
        rng = np.random.default_rng(1234)
        self.slab.tensor.numpy()[:] = rng.integers(0, 256, self.slab.tensor.shape, np.uint8)
        self.keys = [rng.bytes(32) for _ in range(self.num_chunks)]
        self.namespace = Namespace(model_id="bench", dtype="bfloat16", kv_layout="NHD",
                                   page_bytes=self.chunk_bytes, tokens_per_chunk=256)
        self.per_txn = max(1, self.batch_bytes // self.chunk_bytes)
        self.can_drop = True

    # -- helpers ---------------------------------------------------------------------------

    def fresh(self, name: str) -> Path:
        path = self.dir / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def tier(self, root: Path, sync_mode: str = "periodic") -> DiskTier:
        config = DiskTierConfig(path=root, max_bytes=self.total * 2, sync_mode=sync_mode,
                                write_batch_bytes=self.batch_bytes)
        return DiskTier(root, self.namespace, 0, config, self.chunk_bytes)

    def drop_caches(self) -> None:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as handle:
                handle.write("3\n")
        except OSError as exc:
            if self.can_drop:
                print(f"note: cannot drop the page cache ({exc}): cold numbers are warm")
            self.can_drop = False

    # -- writes ----------------------------------------------------------------------------

    def write_tierkv(self, sync_mode: str) -> float:
        root = self.fresh(f"tierkv-{sync_mode}")
        tier = self.tier(root, sync_mode)
        start = time.perf_counter()
        for first in range(0, self.num_chunks, self.per_txn):
            items = [(self.keys[i], self.slab.memoryview(i))
                     for i in range(first, min(first + self.per_txn, self.num_chunks))]
            result = tier.put_many(items)
            assert not result.full, result.message
        tier.sync()
        seconds = time.perf_counter() - start
        tier.close()
        return seconds

    def write_disk_io(self) -> float:
        root = self.fresh("tierkv-diskio")
        tier = self.tier(root)
        disk_io = DiskIO(tier, self.slab, self.batch_bytes)
        start = time.perf_counter()
        for first in range(0, self.num_chunks, self.per_txn):
            writes = tuple((self.keys[i], SlotId(i))
                           for i in range(first, min(first + self.per_txn, self.num_chunks)))
            disk_io.submit_spill(SpillSpec(JobId(first + 1), writes))
        disk_io.flush()
        seconds = time.perf_counter() - start
        assert all(c.ok for c in disk_io.poll_finished())
        disk_io.shutdown()
        tier.close()
        return seconds

    def write_dd(self) -> float:
        target = self.fresh("dd") / "dd.bin"
        command = ["dd", "if=/dev/zero", f"of={target}", f"bs={self.chunk_bytes}",
                   f"count={self.num_chunks}", "conv=fdatasync", "status=none"]
        start = time.perf_counter()
        subprocess.run(command, check=True)
        return time.perf_counter() - start

    def write_bare_lmdb(self) -> float:
        root = self.fresh("lmdb")
        env = lmdb.open(str(root), map_size=self.total * 2, sync=False, metasync=False,
                        writemap=False, readahead=True)
        start = time.perf_counter()
        for first in range(0, self.num_chunks, self.per_txn):
            with env.begin(write=True) as txn:
                for i in range(first, min(first + self.per_txn, self.num_chunks)):
                    txn.put(self.keys[i], self.slab.memoryview(i))
        env.sync(True)
        seconds = time.perf_counter() - start
        env.close()
        return seconds

    def write_files(self) -> float:
        root = self.fresh("files")
        start = time.perf_counter()
        for i in range(self.num_chunks):
            final = root / self.keys[i].hex()
            tmp = root / f".{final.name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = self.slab.memoryview(i)
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        dir_fd = os.open(root, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
        return time.perf_counter() - start

    # -- cold reads ------------------------------------------------------------------------

    def read_tierkv(self, shuffled: bool) -> float:
        order = list(range(self.num_chunks))
        if shuffled:
            random.Random(7).shuffle(order)
        self.drop_caches()
        tier = self.tier(self.dir / "tierkv-periodic")
        start = time.perf_counter()
        for slot, i in enumerate(order):
            status = tier.read_into(self.keys[i], self.slab.memoryview(slot))
            assert status is ReadStatus.OK, status
        seconds = time.perf_counter() - start
        tier.close()
        return seconds

    def read_files(self) -> float:
        self.drop_caches()
        root = self.dir / "files"
        start = time.perf_counter()
        for i in range(self.num_chunks):
            with open(root / self.keys[i].hex(), "rb", buffering=0) as handle:
                handle.readinto(self.slab.memoryview(i))
        return time.perf_counter() - start

    def read_dd(self) -> float:
        self.drop_caches()
        command = ["dd", f"if={self.dir / 'dd' / 'dd.bin'}", "of=/dev/null",
                   f"bs={self.chunk_bytes}", "status=none"]
        start = time.perf_counter()
        subprocess.run(command, check=True)
        return time.perf_counter() - start


def summarize(name: str, seconds: list[float], total: int) -> float:
    rates = sorted(total / MiB / s for s in seconds)
    median = statistics.median(rates)
    print(f"  {name:<28} {median:8.0f} MiB/s   (min {rates[0]:.0f}, max {rates[-1]:.0f}, "
          f"n={len(rates)})")
    return median


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    bench.dir.mkdir(parents=True, exist_ok=True)
    tuned = tune_malloc(bench.batch_bytes)  # what opening a DiskTier does; once per process
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(bench.dir)], capture_output=True,
                        text=True).stdout.strip()
    print(f"disk tier benchmark: {args.chunks} chunks x {args.chunk_mib:g} MiB = "
          f"{bench.total / MiB:.0f} MiB per run, {args.batch_mib:g} MiB per txn, "
          f"{args.repeats} rounds + 1 warm-up, dir {args.dir} ({fs}), malloc tuned: "
          f"{'yes' if tuned else 'no (TIERKV_MALLOPT=0 or not glibc)'}")
    writes: dict[str, Callable[[], float]] = {
        "tierkv periodic + sync": lambda: bench.write_tierkv("periodic"),
        "tierkv DiskIO + flush": bench.write_disk_io,
        "dd conv=fdatasync": bench.write_dd,
        "bare lmdb + sync": bench.write_bare_lmdb,
        "file per chunk + fsync": bench.write_files,
    }
    if not args.no_always:
        writes["tierkv sync_mode=always"] = lambda: bench.write_tierkv("always")
    reads: dict[str, Callable[[], float]] = {} if args.no_cold else {
        "tierkv read_into (in order)": lambda: bench.read_tierkv(False),
        "tierkv read_into (random)": lambda: bench.read_tierkv(True),
        "file per chunk": bench.read_files,
        "dd of=/dev/null": bench.read_dd,
    }
    results: dict[str, list[float]] = {name: [] for name in [*writes, *reads]}
    try:
        # Writes first, then reads: a page-cache drop between writes would hand some writers
        # freshly reclaimed memory and others the pages their own deleted output freed.
        for phase in (writes, reads):
            for round_number in range(args.repeats + 1 if phase else 0):
                for name, run in phase.items():
                    seconds = run()
                    if round_number > 0:
                        results[name].append(seconds)
                label = "warm-up" if round_number == 0 else f"round {round_number}/{args.repeats}"
                kind = "writes" if phase is writes else "cold reads"
                print(f"  ... {kind} {label} done", file=sys.stderr)
    finally:
        shutil.rmtree(bench.dir, ignore_errors=True)
    print("durable writes:")
    medians = {name: summarize(name, results[name], bench.total) for name in writes}
    if reads:
        print("cold reads" + ("" if bench.can_drop else " (page cache NOT dropped: warm)") + ":")
        medians.update({name: summarize(name, results[name], bench.total) for name in reads})
    print("ratios (of medians):")
    pairs = [
        ("tierkv periodic / dd write", "tierkv periodic + sync", "dd conv=fdatasync", 0.7),
        ("tierkv periodic / file-per-chunk", "tierkv periodic + sync", "file per chunk + fsync",
         3.0),
        ("tierkv DiskIO / dd write", "tierkv DiskIO + flush", "dd conv=fdatasync", 0.7),
        ("tierkv always / dd write", "tierkv sync_mode=always", "dd conv=fdatasync", None),
        ("tierkv always / file-per-chunk", "tierkv sync_mode=always", "file per chunk + fsync",
         None),
        ("tierkv / bare lmdb write", "tierkv periodic + sync", "bare lmdb + sync", None),
        ("tierkv / dd cold read", "tierkv read_into (in order)", "dd of=/dev/null", 0.7),
        ("tierkv random / dd cold read", "tierkv read_into (random)", "dd of=/dev/null", None),
        ("tierkv / file-per-chunk cold read", "tierkv read_into (in order)", "file per chunk",
         None),
    ]
    for label, top, bottom, target in pairs:
        if top in medians and bottom in medians:
            ratio = medians[top] / medians[bottom]
            verdict = "" if target is None else (
                f"   target >= {target:g}: {'met' if ratio >= target else 'MISSED'}")
            print(f"  {label:<34} {ratio:5.2f}x{verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
