"""The start-time cost of the model fingerprint (tierkv.model_identity) on synthetic
checkpoints, with a cold page cache.

For each size it writes a checkpoint (a config.json and weight shards of at most
``--shard-gib`` GiB of pseudo-random bytes), fsyncs it and drops its pages from the page
cache (``posix_fadvise(DONTNEED)``, no root needed), then times ``auto`` (cold, then warm)
and, with ``--content``, ``content`` (cold, then with its hash cache) and a plain
sequential read of every byte (the baseline ``content`` cannot beat). Medians of
``--repeats`` runs, the cache dropped before each cold one.

    python scripts/bench_fingerprint.py --sizes-gib 1 16 --dir /var/tmp/tierkv-fp --content
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tierkv

from tierkv.model_identity import path_fingerprint  # noqa: E402

BLOCK = 64 << 20


def write_checkpoint(folder: Path, size: int, shard: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "size": size}))
    pattern = os.urandom(BLOCK)
    left, index = size, 0
    while left > 0:
        this = min(shard, left)
        path = folder / f"model-{index:05d}.safetensors"
        with open(path, "wb") as handle:
            written = 0
            while written < this:
                step = min(BLOCK, this - written)
                # Vary every block so no two windows read alike.
                handle.write(written.to_bytes(8, "big") + pattern[8:step])
                written += step
            handle.flush()
            os.fsync(handle.fileno())
        left -= this
        index += 1


def drop_cache(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(folder: Path) -> None:
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as handle:
            while handle.read(8 << 20):
                pass


def timed(run: Callable[[], object], repeats: int, before: Callable[[], None] | None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 16])
    parser.add_argument("--shard-gib", type=float, default=4.0)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/tierkv-fingerprint"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--content", action="store_true", help="time 'content' and a full read")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args()
    print("| checkpoint | files | auto, cold cache | auto, warm | content, cold | content, "
          "cached | full read, cold |")
    print("|---|---|---|---|---|---|---|")
    for gib in args.sizes_gib:
        folder = args.dir / f"ckpt-{gib:g}g"
        size = int(gib * (1 << 30))
        if not (folder / "config.json").exists():
            write_checkpoint(folder, size, int(args.shard_gib * (1 << 30)))
        files = len(list(folder.iterdir()))

        def cold() -> None:
            drop_cache(folder)

        auto_cold = timed(lambda: path_fingerprint(folder, "auto"), args.repeats, cold)
        auto_warm = timed(lambda: path_fingerprint(folder, "auto"), args.repeats, None)
        row = [f"{gib:g} GiB", str(files), f"{auto_cold * 1e3:.1f} ms", f"{auto_warm * 1e3:.1f} ms"]
        if args.content:
            cache = args.dir / "hashes"

            def cold_uncached() -> None:
                shutil.rmtree(cache, ignore_errors=True)
                drop_cache(folder)

            content_cold = timed(lambda: path_fingerprint(folder, "content", cache), 1,
                                 cold_uncached)
            content_cached = timed(lambda: path_fingerprint(folder, "content", cache),
                                   args.repeats, cold)
            full = timed(lambda: read_all(folder), 1, cold)
            row += [f"{content_cold:.2f} s", f"{content_cached * 1e3:.1f} ms", f"{full:.2f} s"]
        else:
            row += ["-", "-", "-"]
        print("| " + " | ".join(row) + " |", flush=True)
        if not args.keep:
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
