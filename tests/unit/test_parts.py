"""Parts across TP sizes: heads cut out of slot bytes and put back exactly, names of parts,
and the namespace that no longer depends on the TP size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tierkv.errors import ConfigError
from tierkv.integrations.vllm_config import build_namespace
from tierkv.integrations.vllm_geometry import Geometry
from tierkv.keys import Part, as_part, parse_part, part_counts
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.transfer.parts import HeadLayout, PartReader, assemble_heads, copy_heads, split_heads

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 3, 2, 4, 4, 6  # CONTENT: K and V bytes of a head


def per_head_kv(seed: int = 0) -> torch.Tensor:
    """uint8 [layers, blocks, heads, tokens, content]: every head's K and V, per token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYERS, BLOCKS, HEADS, TOKENS, CONTENT), generator=generator,
                         dtype=torch.uint8)


def rank_slot(kv: torch.Tensor, first: int, end: int, order: str) -> torch.Tensor:
    """The slot a rank holding heads [first, end) fills, built as the worker lays it out
    (layer-major; each block's page in memory order: HND [h, N, C], NHD [N, h, C])."""
    pages = []
    for layer in range(LAYERS):
        for block in range(BLOCKS):
            cells = kv[layer, block, first:end]  # [h, N, C]
            page = cells if order == "HND" else cells.transpose(0, 1)  # NHD: [N, h, C]
            pages.append(page.contiguous().reshape(-1))
    return torch.cat(pages)


def layout_of(order: str) -> HeadLayout:
    return HeadLayout.of_pages(pieces=LAYERS * BLOCKS, page_bytes=HEADS * TOKENS * CONTENT,
                               page_heads=HEADS, page_order=order, tokens_per_page=TOKENS,
                               model_heads=HEADS)


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("count", [2, 4])
def test_split_and_assemble_are_exact_inverses_against_per_head_kv(order: str, count: int) -> None:
    kv = per_head_kv()
    layout = layout_of(order)
    whole = rank_slot(kv, 0, HEADS, order)  # TP=1's slot
    expected = [rank_slot(kv, p * HEADS // count, (p + 1) * HEADS // count, order)
                for p in range(count)]  # the TP=count ranks' slots
    parts = split_heads(layout, whole, count)
    assert [part.numel() for part in parts] == [whole.numel() // count] * count
    for part, slot in zip(parts, expected):
        assert torch.equal(part, slot)  # every head, K and V, every layer and block
    assert torch.equal(assemble_heads(layout, expected), whole)


@pytest.mark.parametrize("order", ["HND", "NHD"])
def test_copy_heads_moves_one_range_between_part_counts(order: str) -> None:
    kv = per_head_kv(1)
    layout = layout_of(order)
    two_of_four = rank_slot(kv, 2, 3, order)  # heads [2, 3): part 2 of 4
    first_half = torch.zeros(layout.part_bytes(2), dtype=torch.uint8)  # heads [0, 2)
    assert copy_heads(layout, first_half, (0, 2), two_of_four, (2, 3)) == (2, 2)  # disjoint
    second_half = torch.zeros(layout.part_bytes(2), dtype=torch.uint8)  # heads [2, 4)
    assert copy_heads(layout, second_half, (2, 4), two_of_four, (2, 3)) == (2, 3)
    copy_heads(layout, second_half, (2, 4), rank_slot(kv, 3, 4, order), (3, 4))
    assert torch.equal(second_half, rank_slot(kv, 2, 4, order))


class FakeParts:
    """Parts of one count in memory, as a tier of that count reads them."""

    def __init__(self, slots: dict[Part, torch.Tensor], corrupt: set[Part] = frozenset()) -> None:
        self.slots, self.corrupt, self.reads = slots, corrupt, []

    def read_part_into(self, key: bytes, part: Part, out: memoryview) -> ReadStatus:
        self.reads.append(part)
        # A whole value lands in a page-aligned buffer, as a rank's own chunks do (the disk
        # tier reads it with O_DIRECT only then).
        assert torch.frombuffer(out, dtype=torch.uint8).data_ptr() % 4096 == 0
        if part not in self.slots:
            return ReadStatus.MISSING
        if part in self.corrupt:
            return ReadStatus.CORRUPT
        data = self.slots[part].numpy().tobytes()
        out[: len(data)] = data
        return ReadStatus.OK


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize("own_count,source_count", [(2, 1), (1, 2), (2, 4), (4, 2), (1, 4)])
def test_a_part_reader_fills_every_rank_of_one_count_from_another(
        order: str, own_count: int, source_count: int) -> None:
    kv = per_head_kv(2)
    layout = layout_of(order)
    stored = {Part(p, source_count): rank_slot(kv, p * HEADS // source_count,
                                               (p + 1) * HEADS // source_count, order)
              for p in range(source_count)}
    for index in range(own_count):
        own = Part(index, own_count)
        source = FakeParts(stored)
        reader = PartReader(layout, own, lambda count: source if count == source_count else None)
        slot = torch.full((layout.part_bytes(own_count),), 7, dtype=torch.uint8)
        assert reader.read(b"k" * 32, source_count, memoryview(slot.numpy())) is ReadStatus.OK
        first, end = layout.heads(own)
        assert torch.equal(slot, rank_slot(kv, first, end, order))
        # only the parts holding this rank's heads are read, each whole
        assert source.reads == reader.covering(source_count)
        assert len(source.reads) == max(1, source_count // own_count)


def test_a_missing_or_corrupt_part_fails_the_whole_chunk() -> None:
    kv = per_head_kv(3)
    layout = layout_of("NHD")
    stored = {Part(p, 4): rank_slot(kv, p, p + 1, "NHD") for p in range(4)}
    slot = torch.zeros(layout.part_bytes(1), dtype=torch.uint8)
    reader = PartReader(layout, Part(0, 1), lambda count: FakeParts(
        {k: v for k, v in stored.items() if k != Part(2, 4)}))
    assert reader.read(b"k" * 32, 4, memoryview(slot.numpy())) is ReadStatus.MISSING
    reader = PartReader(layout, Part(0, 1), lambda count: FakeParts(stored, {Part(3, 4)}))
    assert reader.read(b"k" * 32, 4, memoryview(slot.numpy())) is ReadStatus.CORRUPT
    assert reader.read(b"k" * 32, 3, memoryview(slot.numpy())) is ReadStatus.MISSING  # 4 % 3
    none = PartReader(layout, Part(0, 1), lambda count: None)
    assert none.read(b"k" * 32, 2, memoryview(slot.numpy())) is ReadStatus.MISSING


def test_part_names_directories_and_candidate_counts() -> None:
    assert Part(1, 2).name == "1of2" and parse_part("1of2") == Part(1, 2)
    for bad in ("2of2", "1of0", "01of2", "1of", "of2", "x", "1of2x", "-1of2"):
        assert parse_part(bad) is None, bad
    assert as_part(0) == Part(0, 1)
    with pytest.raises(ConfigError):
        as_part(1)  # a rank is not a part: its count must be given
    with pytest.raises(ConfigError):
        as_part(Part(2, 2))
    assert StoreLayout.part_dir_name(Part(0, 2)) == "part-0of2"
    assert StoreLayout.part_dir_name(Part(0, 2), 1) == "part-0of2-dp1"
    assert StoreLayout.parse_part_dir("part-0of2-dp1") == (Part(0, 2), 1)
    assert StoreLayout.parse_part_dir("part-3of4") == (Part(3, 4), 0)
    for bad in ("rank-0", "part-0of2-dp0", "part-0of2-dpx", "part-2of2", "part-0of2.broken-x"):
        assert StoreLayout.parse_part_dir(bad) is None, bad
    assert part_counts(8) == (1, 2, 4, 8)
    assert part_counts(6) == (1, 2, 6)
    assert part_counts(1) == (1,)


def geometry(world_size: int, heads: int = 8, **changes: object) -> Geometry:
    per_rank = max(heads // world_size, 1)
    fields: dict[str, object] = dict(
        layer_names=("model.layers.0.attn", "model.layers.1.attn"), block_size=16,
        hash_block_size=16, blocks_per_chunk=4, page_bytes=per_rank * 16 * 256,
        num_heads=per_rank, content_bytes=256, dtype="float16", layout="LBNHC",
        page_order="NHD", world_size=world_size, num_slots=4, disk_capacity=0,
        total_heads=heads)
    fields.update(changes)
    return Geometry(**fields)  # type: ignore[arg-type]


def namespace_of(geometry: Geometry, model: str = "m") -> str:
    config = SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, quantization=None),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256", cache_dtype="auto"),
        num_hash_lookahead_tokens=0)
    return build_namespace(config, geometry, "0.33.0", {}).fingerprint()


def test_the_namespace_is_one_across_tp_sizes_and_changes_with_what_bytes_mean() -> None:
    same = {namespace_of(geometry(tp)) for tp in (1, 2, 4, 8, 16)}
    assert len(same) == 1  # TP 16 > 8 heads: ranks share parts, still one namespace
    base = next(iter(same))
    others = [
        namespace_of(geometry(1), model="other"),
        namespace_of(geometry(1, heads=4)),  # another head count
        namespace_of(geometry(1, content_bytes=512, page_bytes=8 * 16 * 512)),  # head size
        namespace_of(geometry(1, dtype="bfloat16")),
        namespace_of(geometry(1, page_order="HND", layout="LBHNC")),
        namespace_of(geometry(1, layer_names=("model.layers.1.attn", "model.layers.0.attn"))),
        namespace_of(geometry(1, blocks_per_chunk=2, block_size=32,
                              hash_block_size=32, page_bytes=8 * 32 * 256)),
        namespace_of(geometry(1, attention="mla", num_heads=1, total_heads=1,
                              page_bytes=16 * 256)),
    ]
    assert base not in others and len(set(others)) == len(others)


def test_part_geometry_per_rank() -> None:
    two = geometry(2)
    assert two.num_parts == 2 and two.part_of(1) == Part(1, 2) and two.part_heads(Part(1, 2)) == (4, 8)
    assert two.source_counts() == (2, 1, 4, 8)
    many = geometry(16)  # 8 heads, 16 ranks: ranks 2i and 2i+1 hold head i
    assert many.num_parts == 8
    assert [many.part_of(rank).index for rank in range(4)] == [0, 0, 1, 1]
    assert [many.stored_rank(rank) for rank in range(4)] == [0, 0, 2, 2]
    mla = geometry(4, attention="mla", num_heads=1, total_heads=1, page_bytes=16 * 256)
    assert mla.num_parts == 1 and mla.source_counts() == (1,)
    assert {mla.part_of(rank) for rank in range(4)} == {Part(0, 1)}
    assert [mla.stored_rank(rank) for rank in range(4)] == [0, 0, 0, 0]
