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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.errors import ConfigError
from tierkv.keys import ChunkKey, chunk_keys
from tierkv.units import format_bytes, format_rate


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


def chat_prompts(seed: int, conversations: int, turns: int,
                 tokens_per_chunk: int) -> Iterator[tuple[int, int, list[int]]]:
    """(turn, conversation, prompt tokens) of the demo's chat, turn by turn, the
    conversations in turn: they share a system prompt of 3 chunks; each prompt is the
    history so far plus 40-200 new user tokens, and a reply of 20-120 joins the history
    after it. The same seed gives the same prompts, so a run of fewer turns sees the first
    prompts of a longer one exactly."""
    rng = random.Random(seed)
    system_prompt = [rng.randrange(32000) for _ in range(3 * tokens_per_chunk)]
    histories = [list(system_prompt) for _ in range(conversations)]
    for turn in range(turns):
        for number, history in enumerate(histories):
            history.extend(rng.randrange(32000) for _ in range(rng.randrange(40, 200)))
            yield turn, number, list(history)
            history.extend(rng.randrange(32000) for _ in range(rng.randrange(20, 120)))


@dataclass
class Served:
    """What one prompt got from the tiers (see :func:`serve_prompt`)."""

    asked: int  # full chunks of the prompt
    landed: int  # the loaded prefix
    from_disk: int
    from_remote: int
    failed: int  # chunks whose load failed (recomputed)
    verified_bytes: int
    wrong: int  # loaded chunks whose bytes are not the prefix's KV

    @property
    def from_cpu(self) -> int:
        return self.landed - self.from_disk - self.from_remote


def serve_prompt(store: TierKVStore, kv: list[torch.Tensor], keys: list[ChunkKey],
                 free_blocks: list[int], page_shape: tuple[int, ...]) -> Served:
    """One prompt through the library API: load the tiers' hits into fresh blocks, check
    every loaded byte against :func:`expected_block`, "compute" the rest, store the prompt's
    full chunks, give the blocks back. Which tier a landed chunk came from is exact unless a
    chunk failed (then the prefix before it counts disk first, then remote, then CPU)."""
    bpc = store.blocks_per_chunk
    per_chunk = [[free_blocks.pop() for _ in range(bpc)] for _ in keys]
    handle = store.load(keys, per_chunk)
    store.wait([handle.job_id])
    landed, failed = handle.num_chunks, 0
    for completion in store.poll():
        if completion.job_id == handle.job_id and completion.failed_keys:
            failed += len(completion.failed_keys)
            landed = min(keys.index(ChunkKey(k)) for k in completion.failed_keys)
    disk = min(handle.num_from_disk, landed)
    served = Served(len(keys), landed, disk, min(handle.num_from_remote, landed - disk), failed,
                    0, 0)
    for position, key in enumerate(keys):
        for j, block in enumerate(per_chunk[position]):
            want = expected_block(key, j, page_shape)
            if position < landed:  # loaded: must equal the prefix's KV exactly
                wrong = False
                for layer in kv:
                    wrong |= not torch.equal(layer[block], want)
                    served.verified_bytes += want.numel() * 2
                served.wrong += wrong
            else:  # "compute" it
                for layer in kv:
                    layer[block].copy_(want)
    store.wait([store.store(keys, per_chunk)])
    store.poll()
    free_blocks.extend(block for blocks in per_chunk for block in blocks)
    return served


def _count(name: str, maximum: int) -> Callable[[str], int]:
    """An argparse type: an int within ``[1, maximum]``, else a message naming ``name``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"{name} must be a whole number from 1 to {maximum}, got {text!r}")
        return value

    return parse


MAX_TURNS = 64  # a conversation's last prompt then holds at most ~21k tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=Path(".tierkv-demo"), help="disk tier directory (default: %(default)s)")
    parser.add_argument("--conversations", type=_count("--conversations", 4096), default=24,
                        help="(default: %(default)s; 1 to 4096)")
    parser.add_argument("--turns", type=_count("--turns", MAX_TURNS), default=4,
                        help=f"(default: %(default)s; 1 to {MAX_TURNS})")
    parser.add_argument("--layers", type=_count("--layers", 64), default=8,
                        help="(default: %(default)s; 1 to 64)")
    parser.add_argument("--cpu-chunks", type=_count("--cpu-chunks", 1 << 20), default=48,
                        help="CPU tier size in chunks (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--fresh", action="store_true",
                        help="delete --dir first (only a demo store: anything else is refused)")


DEMO_MODEL_ID = "tierkv-demo"


def check_demo_dir(path: Path, fresh: bool) -> None:
    """Refuse a ``--dir`` that is not the demo's own: a file, or a directory that holds
    anything but demo namespaces (``--fresh`` would delete it; a run would add the demo's
    namespace to a real store). A missing or empty directory is the demo's."""
    from tierkv.tiers.disk.files import list_namespaces
    from tierkv.tiers.disk.layout import StoreLayout

    if not path.exists():
        return
    action = ("--fresh would delete it" if fresh else
              "the demo would write its namespace into it")
    if not path.is_dir():
        raise ConfigError(f"demo: --dir {path} is not a directory; pick a new directory")
    strangers = sorted(entry.name for entry in path.iterdir()
                       if not StoreLayout.is_namespace_name(entry.name))
    others = sorted({str(info.description.get("model_id")) for info in list_namespaces(path)
                     if info.description.get("model_id") != DEMO_MODEL_ID})
    if strangers or others:
        held = (f"files that are not a tierkv store ({', '.join(strangers[:3])})" if strangers
                else f"a tierkv store of other models ({', '.join(others[:3])})")
        raise ConfigError(f"demo: --dir {path} holds {held}: it is not a demo store and "
                          f"{action}; pick an empty or new directory for the demo")


def run(args: argparse.Namespace) -> int:
    check_demo_dir(args.dir, args.fresh)
    if args.fresh and args.dir.exists():
        shutil.rmtree(args.dir)
    block_size, blocks_per_chunk, heads, head_dim = 16, 4, 4, 64
    page_shape = (2, heads, block_size, head_dim)  # K and V halves, HND inside a block
    tokens_per_chunk = block_size * blocks_per_chunk
    # A prompt of the last turn: the system prompt and at most 199 + 119 tokens a turn.
    longest = 3 * tokens_per_chunk + args.turns * (199 + 119)
    num_blocks = max(512, -(-longest // block_size) + blocks_per_chunk)
    kv = [torch.zeros((num_blocks, *page_shape), dtype=torch.float16) for _ in range(args.layers)]
    chunk_bytes = args.layers * blocks_per_chunk * kv[0][0].numel() * 2
    config = StoreConfig(
        blocks_per_chunk=blocks_per_chunk,
        cpu=CpuTierConfig(max_bytes=args.cpu_chunks * chunk_bytes),
        disk=DiskTierConfig(path=args.dir, max_bytes=1 << 30),
        device="cpu",
    )
    totals = DemoTotals()
    started = time.perf_counter()
    with TierKVStore(kv, model_id=DEMO_MODEL_ID, tokens_per_block=block_size,
                     config=config) as store:
        free_blocks = list(range(num_blocks))
        for _, _, prompt in chat_prompts(args.seed, args.conversations, args.turns,
                                         tokens_per_chunk):
            served = serve_prompt(store, kv, chunk_keys(prompt, tokens_per_chunk), free_blocks,
                                  page_shape)
            if served.wrong:
                raise SystemExit("demo: wrong KV loaded")
            totals.chunks_asked += served.asked
            totals.hits_disk += served.from_disk
            totals.hits_cpu += served.landed - served.from_disk
            totals.verified_bytes += served.verified_bytes
        stats = store.statistics()
    seconds = time.perf_counter() - started
    idx = stats.index
    computed = totals.chunks_asked - totals.hits_cpu - totals.hits_disk
    print(f"tierkv demo: {args.conversations} conversations x {args.turns} turns, "
          f"{args.layers} layers, chunk {format_bytes(chunk_bytes, 2)}, CPU tier {idx.num_slots} chunks, disk {args.dir}")
    print(f"  chunks asked {totals.chunks_asked}: hits from CPU {totals.hits_cpu}, "
          f"hits from disk {totals.hits_disk}, computed {computed}")
    print(f"  verified {format_bytes(totals.verified_bytes, 1)} of loaded KV byte-exact")
    for name, path in (("GPU->CPU", stats.path["gpu_to_cpu"]),
                       ("disk->CPU", stats.path["disk_to_cpu"]),
                       ("CPU->GPU", stats.path["cpu_to_gpu"]),
                       ("CPU->disk", stats.path["cpu_to_disk"])):
        print(f"  {name:28s} {format_bytes(path.bytes, 1):>10s}  "
              f"{format_rate(path.bytes, path.seconds):>12s}")
    print(f"  evictions {idx.cpu_evictions}, spills {idx.spills_ok}, on disk {idx.on_disk} chunks, "
          f"no room {idx.stores_no_room}, corrupt {idx.corrupt}")
    hit_rate = (totals.hits_cpu + totals.hits_disk) / max(totals.chunks_asked, 1)
    print(f"demo done: {hit_rate:.0%} of chunks served from tiers in {seconds:.1f} s "
          f"(run again: the disk tier under {args.dir} serves the first turns)")
    return 0
