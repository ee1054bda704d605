"""KVLayout: registration of the four engine layouts, the slot byte layout, bad inputs.

The reference for every byte check is independent of the layout code: the KV tensors are
views over one raw uint8 buffer (or one per layer), and the page of (layer, block) is
found by plain offset arithmetic on that buffer.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
from tierkv.errors import ConfigError, UsageError
from tierkv.transfer.layout import KVLayout, consecutive_runs

KINDS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)


class KV:
    """KV tensors of one layout over raw byte buffers, plus the reference offsets.

    vLLM-like: per layer a logical ``[B, H, N, C]`` tensor. ``LB..`` layouts are
    layer-outermost (one buffer viewed per layer, or one buffer per layer when
    ``separate``); ``BL..`` layouts are block-outermost (one buffer, strided per layer).
    ``..NHC`` keeps tokens outside heads in memory, so its pages are permuted views.
    """

    def __init__(self, kind: str, layers: int = 3, blocks: int = 12, tokens: int = 4,
                 heads: int = 2, dim: int = 8, dtype: torch.dtype = torch.float16,
                 separate: bool = False, seed: int = 0) -> None:
        self.kind, self.layers, self.blocks = kind, layers, blocks
        size = torch.empty((), dtype=dtype).element_size()
        self.page = tokens * heads * dim * size
        inner = (tokens, heads, dim) if kind.endswith("NHC") else (heads, tokens, dim)
        generator = torch.Generator().manual_seed(seed)

        def raw(count: int) -> torch.Tensor:
            return torch.randint(0, 256, (count * self.page,), dtype=torch.uint8,
                                 generator=generator)

        def logical(t: torch.Tensor) -> torch.Tensor:  # [B, *inner] -> [B, H, N, C]
            return t.permute(0, 2, 1, 3) if kind.endswith("NHC") else t

        if kind.startswith("LB"):
            self.raws = [raw(blocks) for _ in range(layers)] if separate else [raw(layers * blocks)]
            shaped = [r.view(dtype).view(-1, blocks, *inner) for r in self.raws]
            views = [shaped[l][0] if separate else shaped[0][l] for l in range(layers)]
        else:
            self.raws = [raw(layers * blocks)]
            whole = self.raws[0].view(dtype).view(blocks, layers, *inner)
            views = [whole[:, l] for l in range(layers)]
        self.tensors = [logical(v) for v in views]
        self.separate = separate

    def page_at(self, layer: int, block: int) -> torch.Tensor:
        """The reference bytes of (layer, block), from offsets in the raw buffer."""
        if self.kind.startswith("LB"):
            raw = self.raws[layer] if self.separate else self.raws[0]
            index = block if self.separate else layer * self.blocks + block
        else:
            raw, index = self.raws[0], block * self.layers + layer
        return raw[index * self.page:(index + 1) * self.page]

    def chunk(self, block_ids: list[int]) -> torch.Tensor:
        """Reference slot bytes: layer-major, then block order."""
        return torch.cat([self.page_at(l, b) for l in range(self.layers) for b in block_ids])

    def snapshot(self) -> list[torch.Tensor]:
        return [r.clone() for r in self.raws]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_four_layouts_gather_and_scatter_byte_exact(kind: str, dtype: torch.dtype) -> None:
    kv = KV(kind, dtype=dtype)
    layout = KVLayout.from_tensors(kv.tensors)
    assert (layout.num_layers, layout.num_blocks, layout.device) == (3, 12, torch.device("cpu"))
    assert layout.page_bytes == (kv.page,) * 3
    assert layout.chunk_bytes(4) == 4 * 3 * kv.page
    assert len(layout.groups) == 1  # one buffer: all layers move in one op
    assert layout.groups[0].word_bytes == 8  # 64-byte pages or more: 8-byte words

    slab = torch.zeros((3, layout.chunk_bytes(4) + 16), dtype=torch.uint8)
    views = layout.chunk_views(slab, 4)
    layout.gather(views, 1, torch.tensor([7, 2, 3, 4]))
    assert torch.equal(slab[1, :layout.chunk_bytes(4)], kv.chunk([7, 2, 3, 4]))
    assert not slab[1, layout.chunk_bytes(4):].any()  # past chunk_bytes: untouched
    assert not slab[0].any() and not slab[2].any()

    before = kv.snapshot()
    expected = kv.chunk([7, 2, 3, 4])
    layout.scatter_batch(views, 1, torch.tensor([[10, 11, 0, 5]]))  # one index_put_
    assert torch.equal(kv.chunk([10, 11, 0, 5]), expected)
    for layer in range(3):  # every other block unchanged
        for block in (1, 2, 3, 4, 6, 7, 8, 9):
            page = kv.page_at(layer, block)
            reference = KV.page_at(_with_raws(kv, before), layer, block)
            assert torch.equal(page, reference)


def _with_raws(kv: KV, raws: list[torch.Tensor]) -> KV:
    clone = object.__new__(KV)
    clone.__dict__.update(kv.__dict__, raws=raws)
    return clone


@pytest.mark.parametrize("kind", ("LBNHC", "LBHNC"))
def test_separate_layer_tensors_form_one_group_each(kind: str) -> None:
    kv = KV(kind, layers=4, separate=True)
    layout = KVLayout.from_tensors({f"model.layers.{l}.attn": t for l, t in enumerate(kv.tensors)})
    assert len(layout.groups) == 4
    assert layout.layer_names[2] == "model.layers.2.attn"
    slab = torch.zeros((2, layout.chunk_bytes(3)), dtype=torch.uint8)
    views = layout.chunk_views(slab, 3)
    layout.gather(views, 0, torch.tensor([5, 6, 1]))
    assert torch.equal(slab[0], kv.chunk([5, 6, 1]))


def test_slot_layer_views_follow_the_documented_offsets() -> None:
    kv = KV("BLHNC", layers=3)
    layout = KVLayout.from_tensors(kv.tensors)
    slot = torch.arange(layout.chunk_bytes(2) + 5, dtype=torch.int64).to(torch.uint8)
    views = layout.slot_layer_views(slot, 2)
    assert [tuple(v.shape) for v in views] == [(2, kv.page)] * 3
    for layer, view in enumerate(views):  # offset(l, i) = n * sum(page[:l]) + i * page[l]
        assert view.data_ptr() == slot.data_ptr() + 2 * kv.page * layer
        assert view[1].data_ptr() == view.data_ptr() + kv.page
    with pytest.raises(UsageError, match="at least"):
        layout.slot_layer_views(slot[:10], 2)


def test_mixed_page_sizes_and_batches() -> None:
    small = torch.randint(0, 100, (6, 2, 3), dtype=torch.int16)  # 12-byte pages
    big = torch.randn(6, 5)  # 20-byte pages
    odd = torch.randint(0, 100, (6, 3), dtype=torch.uint8)  # 3-byte pages: word size 1
    layout = KVLayout.from_tensors([small, big, odd])
    assert layout.page_bytes == (12, 20, 3)
    assert layout.chunk_bytes(2) == 2 * 35
    staging = torch.zeros((3, layout.chunk_bytes(2)), dtype=torch.uint8)
    views = layout.chunk_views(staging, 2)
    layout.gather_batch(views, 0, torch.tensor([[0, 1], [4, 2], [5, 3]]))
    row = staging[1].clone()  # a fresh, aligned copy to view as other dtypes
    assert torch.equal(row[:24].view(torch.int16).view(2, 2, 3), small[[4, 2]])
    assert torch.equal(row[24:64].view(torch.float32).view(2, 5), big[[4, 2]])
    assert torch.equal(row[64:70].view(2, 3), odd[[4, 2]])
    originals = [t.clone() for t in (small, big, odd)]
    # rows 1..2, positions 1.. only (a load with skip_blocks=1): blocks 2 <- 4's data? no:
    # position 1 of row 1 is block 2's page, of row 2 block 3's page; write them to 0 and 1
    layout.scatter_batch(views, 1, torch.tensor([[0], [1]]), first_position=1)
    for tensor, original in zip((small, big, odd), originals):
        assert torch.equal(tensor[0], original[2]) and torch.equal(tensor[1], original[3])
        assert torch.equal(tensor[2:], original[2:])  # position 0 (skipped) not written


def test_describe_and_dtype_name() -> None:
    nhc = KVLayout.from_tensors(KV("BLNHC", dtype=torch.bfloat16).tensors)
    hnc = KVLayout.from_tensors(KV("BLHNC", dtype=torch.bfloat16).tensors)
    assert nhc.dtype_name == "bfloat16"
    # same logical shape [H, N, C], different memory order: different slot bytes
    assert nhc.describe() != hnc.describe()
    assert hnc.describe() == "slot-v1 layer-major 3xbfloat16[2, 4, 8](0,1,2)"
    assert KVLayout.from_tensors(KV("LBHNC", dtype=torch.bfloat16, separate=True).tensors
                                 ).describe() == hnc.describe()  # addresses don't matter
    mixed = KVLayout.from_tensors([torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.int8)])
    assert mixed.dtype_name == "float32,int8"


def test_consecutive_runs() -> None:
    assert consecutive_runs([4, 5, 6, 1, 9, 10]) == [(0, 4, 3), (3, 1, 1), (4, 9, 2)]
    assert consecutive_runs([3]) == [(0, 3, 1)]
    assert consecutive_runs([]) == []


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([], "no KV cache tensors"),
        (torch.zeros(4, 4), "sequence or mapping"),
        ([torch.zeros(4, 4), "x"], "'layer 1' is a str"),
        ([torch.tensor(1.0)], "0-dimensional"),
        ([torch.zeros(0, 4)], "is empty"),
        ([torch.zeros(4, 0)], "is empty"),
        ([torch.zeros(4, 8), torch.zeros(5, 8)], "has 5 blocks on cpu"),
        ([torch.zeros(4, 8, 2)[:, ::2]], "not one dense region"),
        ([torch.zeros(8, 4).t()], "not one dense region"),  # block dim not first
        ([torch.zeros(1, 8).expand(4, 8)], "blocks overlap"),
        ([torch.zeros(4, 8, device="meta")], "meta device"),
        ([torch.zeros(4, 8).to_sparse()], "dense strided"),
        ([torch.zeros(4, 2, dtype=torch.complex64).conj()], "conj"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_bad_inputs_raise_config_error(tensors: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVLayout.from_tensors(tensors)  # type: ignore[arg-type]


def test_shared_memory_and_devices_are_refused() -> None:
    cache = torch.zeros(4, 8)
    with pytest.raises(ConfigError, match=r"'k' and 'v' share memory"):
        KVLayout.from_tensors({"k": cache, "v": cache})
    buffer = torch.zeros(4, 16)
    with pytest.raises(ConfigError, match="share memory"):  # half-overlapping windows
        KVLayout.from_tensors([buffer[:, 0:8], buffer[:, 4:12]])
    flat = buffer.view(-1)
    with pytest.raises(ConfigError, match="share memory"):  # different strides, overlapping
        KVLayout.from_tensors([flat[:32].view(4, 8), flat.view(4, 16)[:, 8:]])
    KVLayout.from_tensors([buffer[:, 0:8], buffer[:, 8:16]])  # interleaved, disjoint: fine
    KVLayout.from_tensors([flat[:32].view(4, 8), flat[32:].view(4, 8)])  # stacked: fine


def test_bad_chunk_sizes_and_buffers() -> None:
    layout = KVLayout.from_tensors([torch.zeros(4, 8)])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="blocks_per_chunk"):
            layout.chunk_bytes(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="chunk buffer"):
        layout.chunk_views(torch.zeros(2, 10, dtype=torch.uint8), 2)  # rows < 64 bytes
    with pytest.raises(UsageError, match="chunk buffer"):
        layout.chunk_views(torch.zeros(2, 64), 2)


# ------------------------------------------------------------------ property test
@st.composite
def layouts(draw: st.DrawFn) -> tuple[KV, int, list[int], list[int], int]:
    kind = draw(st.sampled_from(KINDS))
    kv = KV(kind, layers=draw(st.integers(1, 4)), blocks=draw(st.integers(2, 10)),
            tokens=draw(st.integers(1, 3)), heads=draw(st.integers(1, 3)),
            dim=draw(st.integers(1, 5)), dtype=draw(st.sampled_from(DTYPES)),
            separate=draw(st.booleans()), seed=draw(st.integers(0, 1000)))
    per_chunk = draw(st.integers(1, kv.blocks))
    blocks = st.lists(st.integers(0, kv.blocks - 1), min_size=per_chunk, max_size=per_chunk,
                      unique=True)
    return kv, per_chunk, draw(blocks), draw(blocks), draw(st.integers(0, per_chunk - 1))


@thorough(60)
@given(layouts())
def test_gather_then_scatter_matches_reference(
        case: tuple[KV, int, list[int], list[int], int]) -> None:
    kv, per_chunk, sources, targets, skip = case
    layout = KVLayout.from_tensors(kv.tensors)
    slab = torch.zeros((2, layout.chunk_bytes(per_chunk)), dtype=torch.uint8)
    views = layout.chunk_views(slab, per_chunk)
    layout.gather(views, 1, torch.tensor(sources))
    assert torch.equal(slab[1], kv.chunk(sources))
    layout.gather_batch(views, 0, torch.tensor([targets, sources]))  # batch path agrees
    assert torch.equal(slab[1], kv.chunk(sources)) and torch.equal(slab[0], kv.chunk(targets))
    for layer in range(kv.layers):  # wipe the targets, then scatter from position skip
        for block in targets:
            kv.page_at(layer, block).zero_()
    layout.scatter_batch(views, 1, torch.tensor([targets[skip:]]), skip)
    for layer in range(kv.layers):
        for position, block in enumerate(targets):
            want = slab[1, (layer * per_chunk + position) * kv.page:][:kv.page]
            page = kv.page_at(layer, block)
            assert torch.equal(page, want) if position >= skip else not page.any()
