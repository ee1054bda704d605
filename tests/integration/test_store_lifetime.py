"""A block's lifetime on the library API (TierKVStore): what an engine that is its own
scheduler may do with its blocks around ``store()`` and ``load()``, on real CPU tensors.

- Torn KV: blocks rewritten at several points after ``store()`` returns never reach the
  stored chunk; with ``store_mode="async"``, ``fence()`` before the rewrite does the same.
- A lookup's hits are loadable: ``load()`` makes room the way ``store()`` does, and what a
  lookup promised and a load did not deliver is counted with its cause.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.keys import chunk_keys

from tests.integration.test_store import load_into

# Big enough that a store's copy takes milliseconds: 8 layers x 64 blocks of 64 KiB pages.
LAYERS = 8
PAGE_SHAPE = (2, 16, 8, 128)  # K/V, tokens, heads, head dim: 64 KiB of float16
BPC = 4
TOKENS_PER_BLOCK = 16
NUM_BLOCKS = 64
CHUNK_BYTES = LAYERS * BPC * 2 * 16 * 8 * 128 * 2


def make_kv(num_blocks: int = NUM_BLOCKS) -> list[torch.Tensor]:
    return [torch.zeros((num_blocks, *PAGE_SHAPE), dtype=torch.float16) for _ in range(LAYERS)]


def open_store(kv: list[torch.Tensor], cpu_chunks: int, disk: Path | None = None,
               **options: object) -> TierKVStore:
    config = StoreConfig(
        blocks_per_chunk=BPC, cpu=CpuTierConfig(max_bytes=cpu_chunks * CHUNK_BYTES),
        disk=DiskTierConfig(path=disk, max_bytes=256 * (CHUNK_BYTES + 8192)) if disk
        else DiskTierConfig(), device="cpu", **options)  # type: ignore[arg-type]
    return TierKVStore(kv, model_id="lifetime", tokens_per_block=TOKENS_PER_BLOCK, config=config)


def keys_of(seed: int, num_chunks: int) -> list[bytes]:
    tokens = [(seed * 7919 + i) % 32000 for i in range(num_chunks * BPC * TOKENS_PER_BLOCK)]
    return chunk_keys(tokens, BPC * TOKENS_PER_BLOCK)


def spin(rounds: int) -> None:
    """A delay measured in work, not in wall-clock time."""
    total = 0
    for number in range(rounds):
        total += number


# ------------------------------------------------------------------------------ torn KV
@pytest.mark.parametrize("delay", [0, 100, 10_000, 1_000_000, "thread"])
def test_blocks_rewritten_after_store_never_reach_the_stored_chunk(delay: int | str) -> None:
    """Regression: store() was asynchronous even on CPU, so an engine that refilled its
    blocks at once got chunks of mixed old and new bytes (means of 1.95-2.00 per layer),
    checksummed as they were and served as hits."""
    kv = make_kv()
    keys = keys_of(1, 8)
    sources = list(range(len(keys) * BPC))
    with open_store(kv, cpu_chunks=16) as store:
        for layer in kv:
            layer[sources] = 1.0
        rewrite = threading.Thread(target=lambda: [layer.__setitem__(sources, 2.0) for layer in kv])
        job = store.store(keys, sources)
        if delay == "thread":  # another thread of the engine rewrites them meanwhile
            rewrite.start()
            rewrite.join()
        else:
            spin(int(delay))
            for layer in kv:
                layer[sources] = 2.0
        store.wait([job])
        targets = list(range(32, 32 + len(keys) * BPC))
        assert load_into(store, keys, targets) == (len(keys), ())
        for number, layer in enumerate(kv):
            loaded = layer[targets].float()
            assert torch.equal(loaded, torch.ones_like(loaded)), (
                f"layer {number}: mean {loaded.mean().item():.3f}, bytes other than those "
                f"present at store()")


def test_async_stores_are_safe_after_a_fence_of_their_blocks() -> None:
    kv = make_kv()
    keys = keys_of(2, 8)
    sources = list(range(len(keys) * BPC))
    with open_store(kv, cpu_chunks=16, store_mode="async") as store:
        for layer in kv:
            layer[sources] = 1.0
        job = store.store(keys, sources)
        store.fence(sources[-BPC:])  # any block of the job: the whole job is done
        for layer in kv:
            layer[sources] = 2.0
        store.wait([job])
        targets = list(range(32, 32 + len(keys) * BPC))
        assert load_into(store, keys, targets) == (len(keys), ())
        assert all(torch.equal(layer[targets], torch.ones_like(layer[targets])) for layer in kv)
        store.fence(None)  # nothing in flight: returns at once
        store.fence([[60, 61, 62, 63]])  # blocks no job touches


# ------------------------------------------------------------------------------ shortfall
def test_a_lookup_s_hits_load_after_a_burst_of_stores(tmp_path: Path) -> None:
    """Regression: after a burst of stores into a small CPU tier every slot held a chunk
    not yet on disk, and load() found no slot to load through: lookup() said 6 hits, load()
    brought back 0-2 (it did not make room the way store() does)."""
    kv = make_kv(num_blocks=96)
    wanted = keys_of(3, 6)
    with open_store(kv, cpu_chunks=8, disk=tmp_path / "store") as store:
        for layer in kv:
            for block in range(6 * BPC):
                layer[block] = float(block)
        store.wait([store.store(wanted, list(range(6 * BPC)))])
        for burst in range(4):  # other requests fill the CPU tier with chunks not on disk
            store.wait([store.store(keys_of(100 + burst, 8), list(range(32, 64)))])
        assert store.statistics().index.free_slots == 0
        assert store.lookup(wanted) == 6
        targets = list(range(64, 64 + 6 * BPC))
        assert load_into(store, wanted, targets) == (6, ())
        for layer in kv:
            for position, block in enumerate(targets):
                assert torch.equal(layer[block], torch.full_like(layer[block], float(position)))
        assert store.statistics().load_shortfall.no_room == 0
        # bytes_completed is every finished job's bytes on every path (it was 0 here: only
        # the vLLM scheduler side counted it)
        stats, figures = store.statistics(), store.figures()
        assert figures["bytes_completed"] == sum(path.bytes for path in stats.path.values()) > 0


def test_what_a_load_does_not_deliver_of_a_lookup_is_counted_with_its_cause(tmp_path: Path) -> None:
    kv = make_kv(num_blocks=96)
    with open_store(kv, cpu_chunks=4) as store:  # no disk tier: evicted chunks are gone
        first = keys_of(4, 4)
        store.store(first, list(range(16)))
        assert store.lookup(first) == 4
        store.store(keys_of(5, 4), list(range(16, 32)))  # evicts every chunk of ``first``
        assert load_into(store, first, list(range(32, 48))) == (0, ())
        assert store.statistics().load_shortfall.gone == 4
    with open_store(kv, cpu_chunks=4, disk=tmp_path / "store") as store:
        many = keys_of(6, 6)  # on disk, but a load of 6 cannot pass through 4 slots at once
        for part in (many[:3], many[3:]):
            store.store(part, list(range(12)))
        store.flush()
        assert store.lookup(many) == 6
        loaded, failed = load_into(store, many, list(range(48, 72)))
        shortfall = store.statistics().load_shortfall
        assert failed == () and loaded < 6 and shortfall.no_room == 6 - loaded
        assert shortfall.gone == shortfall.failed == 0


# ------------------------------------------------------------------------------ the API's word
def test_every_public_method_says_what_it_does_never_does_and_raises() -> None:
    """Regression: TierKVStore and its store, load, lookup, wait, poll and statistics had
    no docstrings, so help() and IDE hovers showed nothing."""
    import inspect
    import re

    assert "fence(" in (inspect.getdoc(TierKVStore) or "")
    missing = []
    for name, member in vars(TierKVStore).items():
        if name.startswith("_") or not callable(member):
            continue
        doc = inspect.getdoc(member) or ""
        if not (re.search(r"\bnever\b", doc, re.I) and re.search(r"\braises?\b", doc, re.I)
                and len(doc.split()) > 20):
            missing.append(name)
    assert missing == []
    for name in ("lookup", "store", "load", "fence", "poll", "wait", "statistics", "close"):
        assert name in vars(TierKVStore)
