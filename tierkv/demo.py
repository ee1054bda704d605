"""`tierkv demo`: a multi-turn chat workload through the library API, on CPU tensors.

Each conversation grows turn by turn; every turn looks up its prompt's chunk keys, loads
the hits (from the CPU tier or, after spills, from disk) into freshly allocated "GPU"
blocks, checks every loaded byte against the KV the prefix must have, "computes" the
rest, and stores the prompt's full chunks. The disk tier lives under ``--dir``, so a
second run over the same directory is served from the disk the first run wrote.
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.keys import ChunkKey, chunk_keys
from tierkv.units import MiB


@dataclass
class DemoTotals:
    chunks_asked: int = 0
    hits_cpu: int = 0
    hits_disk: int = 0
    verified_bytes: int = 0


def expected_block(key: bytes, block_in_chunk: int, page_shape: tuple[int, ...]) -> torch.Tensor:
    """The KV a block must hold: a pure function of its chunk key (i.e. of the prefix)."""
    seed = int.from_bytes(key[:8], "little") ^ block_in_chunk
    gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randn(page_shape, generator=gen).to(torch.float16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=Path(".tierkv-demo"), help="disk tier directory (default: %(default)s)")
    parser.add_argument("--conversations", type=int, default=24, help="(default: %(default)s)")
    parser.add_argument("--turns", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--cpu-chunks", type=int, default=48, help="CPU tier size in chunks (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--fresh", action="store_true", help="delete --dir first")


def run(args: argparse.Namespace) -> int:
    if args.fresh and args.dir.exists():
        shutil.rmtree(args.dir)
    block_size, blocks_per_chunk, heads, head_dim = 16, 4, 4, 64
    page_shape = (2, heads, block_size, head_dim)  # K and V halves, HND inside a block
    tokens_per_chunk = block_size * blocks_per_chunk
    num_blocks = 512
    kv = [torch.zeros((num_blocks, *page_shape), dtype=torch.float16) for _ in range(args.layers)]
    chunk_bytes = args.layers * blocks_per_chunk * kv[0][0].numel() * 2
    config = StoreConfig(
        blocks_per_chunk=blocks_per_chunk,
        cpu=CpuTierConfig(max_bytes=args.cpu_chunks * chunk_bytes),
        disk=DiskTierConfig(path=args.dir, max_bytes=1 << 30),
        device="cpu",
    )
    rng = random.Random(args.seed)
    system_prompt = [rng.randrange(32000) for _ in range(3 * tokens_per_chunk)]
    histories = [list(system_prompt) for _ in range(args.conversations)]
    totals = DemoTotals()
    started = time.perf_counter()
    with TierKVStore(kv, model_id="tierkv-demo", tokens_per_block=block_size, config=config) as store:
        free_blocks = list(range(num_blocks))
        for turn in range(args.turns):
            for history in histories:
                history.extend(rng.randrange(32000) for _ in range(rng.randrange(40, 200)))
                keys = chunk_keys(history, tokens_per_chunk)
                per_chunk = [[free_blocks.pop() for _ in range(blocks_per_chunk)] for _ in keys]
                handle = store.load(keys, per_chunk)
                store.wait([handle.job_id])
                landed = handle.num_chunks
                for completion in store.poll():
                    if completion.job_id == handle.job_id and completion.failed_keys:
                        landed = min(keys.index(ChunkKey(k)) for k in completion.failed_keys)
                totals.chunks_asked += len(keys)
                totals.hits_disk += min(handle.num_from_disk, landed)
                totals.hits_cpu += landed - min(handle.num_from_disk, landed)
                for position, key in enumerate(keys):
                    for j, block in enumerate(per_chunk[position]):
                        want = expected_block(key, j, page_shape)
                        if position < landed:  # loaded: must equal the prefix's KV exactly
                            for layer in kv:
                                if not torch.equal(layer[block], want):
                                    raise SystemExit(f"demo: wrong KV loaded for chunk {key[:4].hex()}")
                                totals.verified_bytes += want.numel() * 2
                        else:  # "compute" it
                            for layer in kv:
                                layer[block].copy_(want)
                job = store.store(keys, per_chunk)
                store.wait([job])
                store.poll()
                free_blocks.extend(block for blocks in per_chunk for block in blocks)
                history.extend(rng.randrange(32000) for _ in range(rng.randrange(20, 120)))  # reply
        stats = store.statistics()
    seconds = time.perf_counter() - started
    idx = stats.index
    computed = totals.chunks_asked - totals.hits_cpu - totals.hits_disk
    print(f"tierkv demo: {args.conversations} conversations x {args.turns} turns, "
          f"{args.layers} layers, chunk {chunk_bytes / MiB:.2f} MiB, CPU tier {idx.num_slots} chunks, disk {args.dir}")
    print(f"  chunks asked {totals.chunks_asked}: hits from CPU {totals.hits_cpu}, "
          f"hits from disk {totals.hits_disk}, computed {computed}")
    print(f"  verified {totals.verified_bytes / MiB:.1f} MiB of loaded KV byte-exact")
    for name, path in (("GPU->CPU", stats.gpu_to_cpu), ("CPU->GPU (incl. disk reads)", stats.cpu_to_gpu),
                       ("CPU->disk", stats.cpu_to_disk)):
        print(f"  {name:28s} {path.num_bytes / MiB:9.1f} MiB  {path.gbps:6.2f} GB/s")
    print(f"  evictions {idx.cpu_evictions}, spills {idx.spills_ok}, on disk {idx.on_disk} chunks, "
          f"no room {idx.stores_no_room}, corrupt {idx.corrupt}")
    hit_rate = (totals.hits_cpu + totals.hits_disk) / max(totals.chunks_asked, 1)
    print(f"demo done: {hit_rate:.0%} of chunks served from tiers in {seconds:.1f} s "
          f"(run again: the disk tier under {args.dir} serves the first turns)")
    return 0
