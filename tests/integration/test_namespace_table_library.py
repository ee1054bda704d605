"""The namespace dimensions table (docs/on-disk-format.md; issue 40, point 3), row by row,
through the library API: :class:`~tierkv.engine.store.TierKVStore` over real LMDB and slab
files in a temporary directory.

Each row flips one dimension between a writer and a reader over one disk path. The writer
stores a few chunks of known bytes and closes (its chunks on disk). The reader, with that
one dimension changed, must find nothing on disk (``on_disk == 0``) and hit nothing: not
under the keys it derives itself, and not under the writer's very key bytes (what an
engine whose keys collide would ask for: the namespace alone must keep them apart). Then a
store with the writer's settings again finds every chunk, hits every one and loads the
writer's bytes exactly (the control: the flip made the miss, and the reader destroyed
nothing).

Rows whose dimension is in the chunk keys, not the namespace (the cache salt), find the
writer's chunks on disk by design and must still hit none. ``ROWS`` lists the row ids (the
pytest ids), for a test that holds the docs table to them.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore, build_namespace
from tierkv.keys import FORMAT_VERSION, ROOT_KEY, chunk_keys, salted_root
from tierkv.tiers.disk.tier import SHARDS
from tierkv.transfer.layout import KVLayout

ROWS = ("model-id", "dtype", "layout", "block-size", "chunk-size", "layers", "layer-order",
        "kv-heads", "head-size", "tp-part", "cache-salt", "format-version", "hash-algorithm")

NUM_BLOCKS = 32
NUM_CHUNKS = 4
TOKENS = [(7 * i + 3) % 1000 for i in range(160)]  # 5 chunks of 32 tokens (2 of 64)


@dataclass(frozen=True)
class Engine:
    """One engine's paged KV (one tensor per layer, ``[blocks, K/V, tokens, heads, size]``)
    and its store settings."""

    model_id: str = "tiny-model"
    dtype: torch.dtype = torch.float16
    num_layers: int = 2
    num_heads: int = 2
    head_size: int = 8
    tokens_per_block: int = 16
    blocks_per_chunk: int = 2
    heads_outer: bool = False  # pages in [K/V, heads, tokens, size] memory order
    names: tuple[str, ...] = ()  # registered as a dict of named tensors, in this order
    rank: int = 0
    tp_size: int = 1
    salt: str | None = None  # the chunk keys' root: salted_root(salt)
    namespace: dict[str, Any] = field(default_factory=dict)  # replaced in the built one

    def kv(self) -> list[torch.Tensor] | dict[str, torch.Tensor]:
        shape = (2, self.tokens_per_block, self.num_heads, self.head_size)
        tensors = []
        for _ in range(self.num_layers):
            if self.heads_outer:
                tensor = torch.zeros((NUM_BLOCKS, 2, self.num_heads, self.tokens_per_block,
                                      self.head_size), dtype=self.dtype).transpose(2, 3)
            else:
                tensor = torch.zeros((NUM_BLOCKS, *shape), dtype=self.dtype)
            assert tensor.shape[1:] == shape
            tensors.append(tensor)
        if not self.names:
            return tensors
        return dict(zip(self.names, tensors))

    def config(self, root: Path) -> StoreConfig:
        return StoreConfig(blocks_per_chunk=self.blocks_per_chunk,
                           cpu=CpuTierConfig(max_bytes=1 << 20, pin_memory="never"),
                           disk=DiskTierConfig(path=root, max_bytes=16 << 20), device="cpu",
                           rank=self.rank, tp_size=self.tp_size)

    def open(self, root: Path, kv: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
             ) -> TierKVStore:
        config = self.config(root)
        if not self.namespace:
            return TierKVStore(kv, model_id=self.model_id, tokens_per_block=self.tokens_per_block,
                               config=config)
        built = build_namespace(KVLayout.from_tensors(kv), self.model_id, self.tokens_per_block,
                                config)
        return TierKVStore(kv, config=config,
                           namespace=dataclasses.replace(built, **self.namespace))

    def keys(self) -> list[bytes]:
        parent = ROOT_KEY if self.salt is None else salted_root(self.salt)
        tokens_per_chunk = self.tokens_per_block * self.blocks_per_chunk
        return [bytes(key) for key in chunk_keys(TOKENS, tokens_per_chunk, parent)]


def layers(kv: list[torch.Tensor] | dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return list(kv.values()) if isinstance(kv, dict) else kv


def blocks(engine: Engine, first: int = 0) -> list[int]:
    return list(range(first, first + NUM_CHUNKS * engine.blocks_per_chunk))


@dataclass
class Written:
    keys: list[bytes]
    pages: list[torch.Tensor]  # per layer, the stored blocks' bytes


def write(engine: Engine, root: Path) -> Written:
    kv = engine.kv()
    generator = torch.Generator().manual_seed(40)
    stored = blocks(engine)
    for layer in layers(kv):  # random bytes, through an integer view (any dtype)
        raw = layer.view(torch.int16) if layer.element_size() == 2 else layer.view(torch.uint8)
        raw[stored] = torch.randint(-2000, 2000, raw[stored].shape, generator=generator,
                                    dtype=raw.dtype)
    keys = engine.keys()[:NUM_CHUNKS]
    with engine.open(root, kv) as store:
        store.wait([store.store(keys, stored)])
        assert all(done.ok for done in store.poll())
    return Written(keys, [layer[stored].clone() for layer in layers(kv)])


@dataclass(frozen=True)
class Seen:
    on_disk: int  # chunks found on disk at open
    own_keys: int  # hits under the keys the reader derives
    writer_keys: int  # hits under the writer's key bytes


def read(engine: Engine, root: Path, written: Written) -> Seen:
    with engine.open(root, engine.kv()) as store:
        return Seen(store.statistics().index.on_disk, store.lookup(engine.keys()[:NUM_CHUNKS]),
                    store.lookup(written.keys))


def assert_control(engine: Engine, root: Path, written: Written) -> None:
    """The writer's settings again: every chunk found, hit and loaded byte-exact."""
    kv = engine.kv()
    with engine.open(root, kv) as store:
        assert store.statistics().index.on_disk == NUM_CHUNKS
        assert store.lookup(written.keys) == NUM_CHUNKS
        targets = blocks(engine, first=NUM_BLOCKS // 2)
        handle = store.load(written.keys, targets)
        store.wait([handle.job_id])
        assert all(done.ok and not done.failed_keys for done in store.poll())
    for layer, pages in zip(layers(kv), written.pages):
        assert torch.equal(layer[targets].view(torch.uint8), pages.view(torch.uint8))


MISS = Seen(0, 0, 0)
BASE = Engine()

# The reader's changes, one dimension each.
TABLE: dict[str, dict[str, Any]] = {
    "model-id": {"model_id": "other-model"},
    "dtype": {"dtype": torch.bfloat16},  # the same page bytes, other numbers
    "layout": {"heads_outer": True},  # the same page shape in another memory order
    # 32-token blocks, one a chunk: the same 32 tokens and bytes per chunk in another
    # block split (the keys are the same bytes: only the namespace tells them apart)
    "block-size": {"tokens_per_block": 32, "blocks_per_chunk": 1},
    "chunk-size": {"blocks_per_chunk": 4},
    # 4 layers of half the head size: the same chunk bytes (a chunk of another size is
    # refused by its size too; here only the namespace tells them apart)
    "layers": {"num_layers": 4, "head_size": 4},
    "kv-heads": {"num_heads": 4},
    "head-size": {"head_size": 16},
    "format-version": {"namespace": {"format_version": FORMAT_VERSION + 1}},
    "hash-algorithm": {"namespace": {"hash_scheme": "another-hash-scheme"}},
}
# Rows whose writer differs from BASE too.
WRITERS: dict[str, Engine] = {
    "layer-order": Engine(names=("layers.0", "layers.1")),
}
TABLE["layer-order"] = {"names": ("layers.1", "layers.0")}


@pytest.mark.parametrize("row", list(TABLE), ids=list(TABLE))
def test_a_flipped_dimension_finds_and_hits_nothing(row: str, tmp_path: Path) -> None:
    writer = WRITERS.get(row, BASE)
    written = write(writer, tmp_path)
    assert read(dataclasses.replace(writer, **TABLE[row]), tmp_path, written) == MISS
    assert_control(writer, tmp_path, written)


@pytest.mark.parametrize("row", ["tp-part"])
def test_a_part_read_as_another_part_is_never_served(row: str, tmp_path: Path) -> None:
    """Rank 0 of a TP 2 engine stores part 0 of 2. Rank 1 finds nothing of it; rank 1
    over rank 0's directory (moved to ``part-1of2``, an operator's mistake) finds nothing
    either: the environment is bound to its part and is moved aside, intact. The library
    keeps TP sizes apart (``build_namespace``); the vLLM connector shares them by design
    (its table's tp-part row)."""
    writer = Engine(rank=0, tp_size=2)
    written = write(writer, tmp_path)
    assert_control(writer, tmp_path, written)
    reader = dataclasses.replace(writer, rank=1)
    assert read(reader, tmp_path, written) == MISS
    (ns_dir,) = tmp_path.glob("ns-*")
    shutil.rmtree(ns_dir / "part-1of2")
    (ns_dir / "part-0of2").rename(ns_dir / "part-1of2")
    assert read(reader, tmp_path, written) == MISS
    assert len(list((ns_dir / "part-1of2").glob("shard-*.foreign-*"))) == SHARDS  # kept aside
    assert read(dataclasses.replace(writer, tp_size=1), tmp_path, written) == MISS


@pytest.mark.parametrize("row", ["cache-salt"])
def test_another_cache_salt_hits_nothing(row: str, tmp_path: Path) -> None:
    """A tenant's chunks hang under its own root key (``salted_root``): the same namespace
    (found on disk), keys no other salt, nor none, derives."""
    writer = Engine(salt="tenant-a")
    written = write(writer, tmp_path)
    for other in ("tenant-b", None):
        assert read(dataclasses.replace(writer, salt=other), tmp_path, written) == \
            Seen(NUM_CHUNKS, 0, NUM_CHUNKS)  # the writer's keys are its own: they hit
    assert_control(writer, tmp_path, written)


def row_ids(names: Mapping[str, Any]) -> list[str]:
    """The row ids of a module's tests (``globals()``): their ``row`` parameter's ids."""
    ids: list[str] = []
    for name, test in names.items():
        for mark in getattr(test, "pytestmark", []) if name.startswith("test_") else []:
            if mark.name == "parametrize" and mark.args[0] == "row":
                ids.extend(mark.kwargs.get("ids") or mark.args[1])
    return ids


def test_the_rows_are_the_tests_ids() -> None:
    assert sorted(row_ids(globals())) == sorted(ROWS)
