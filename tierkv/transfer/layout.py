"""The engine's KV cache as tierkv sees it: per layer, ``num_blocks`` pages of raw bytes.

Input contract of ``KVLayout.from_tensors`` (checked; a violation raises
:class:`ConfigError` naming the layer):
- One tensor per layer (or per layer group), in registration order: the order of the
  sequence, or the mapping's iteration order. Any dtype, any shape, **block dim first**.
- All tensors have the same ``num_blocks`` (dim 0) and live on the same device.
- ``tensor[b]`` (a *page*) is one dense region of memory: its elements fill
  ``page_bytes = tensor[b].numel() * element_size`` consecutive bytes with no gap and no
  overlap. The dims of a page may be permuted (vLLM's logical ``[H, N, C]`` view over
  ``N, H, C`` memory is fine); the block stride may exceed the page (a per-layer strided
  view over one block-outermost buffer, as vLLM builds for BLNHC / BLHNC).
- Pages never overlap: not two blocks of one layer, not two layers.

Slot byte layout -- also the payload of a disk or remote value (docs/on-disk-format.md,
format version :data:`~tierkv.keys.FORMAT_VERSION`):
    A chunk of ``n = blocks_per_chunk`` blocks with ids ``b_0 .. b_{n-1}`` fills the first
    ``chunk_bytes(n) = n * (page_bytes[0] + ... + page_bytes[L-1])`` bytes of its slot,
    **layer-major**: the page of block ``b_i`` of layer ``l`` sits at byte offset

        offset(l, i) = n * (page_bytes[0] + ... + page_bytes[l-1]) + i * page_bytes[l]

    and is the raw memory of ``tensor_l[b_i]`` in address order, i.e. the bytes
    ``[tensor_l[b_i].data_ptr(), + page_bytes[l])`` (memory order, not logical dim order;
    the host's byte order, little-endian on every supported machine). Bytes of a slot
    past ``chunk_bytes`` are never read or written.

Copy groups keep that byte layout with fewer ops: consecutive layers that share one
storage, page size and block stride, their first pages a constant multiple of the page
size apart without overlap (per-layer views of one ``[L, B, ...]`` or ``[B, L, ...]``
buffer), are copied by one gather/scatter over a ``[rows, page]`` tiling of the storage,
in the widest word (8/4/2/1 bytes) that every offset and stride allows.

Primitives (device-agnostic torch ops; none synchronizes anything):
- ``from_tensors(tensors)``: validate and register; ``chunk_bytes(blocks_per_chunk)``.
- ``slot_layer_views(slot, bpc)`` / ``chunk_views(buffer, bpc)``: a slot cut per layer, a
  2-D buffer of chunk rows (the slab, or GPU staging) cut per copy group.
- ``gather`` (one chunk) / ``gather_batch`` / ``scatter_batch`` (chunks in consecutive
  rows): one op per copy group; a scatter leaves a load's ``skip_blocks`` untouched.
- ``row_index(plan, block_ids)``: a group's page rows, for engines with own copy loops.
- ``dtype_name`` and ``describe()``: canonical strings for the store's namespace.
- ``check_tokens_per_block(n)``: a page of two or more dims must have a dim of ``n`` (its
  tokens); flat pages name no token dim and are not checked.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tierkv.checks import check_int
from tierkv.errors import ConfigError, UsageError

_WORD_DTYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16,
                                         1: torch.uint8}


def _word_bytes(*values: int) -> int:
    """The widest word size (8, 4, 2 or 1) dividing every value."""
    return math.gcd(8, *values)


def _is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when a strided region of these sizes/strides fills its extent exactly once."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(sizes, strides) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def consecutive_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first_block, length)`` for each run of consecutive block ids."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for position in range(1, len(block_ids) + 1):
        if position == len(block_ids) or block_ids[position] != block_ids[position - 1] + 1:
            runs.append((start, block_ids[start], position - start))
            start = position
    return runs


@dataclass(frozen=True)
class LayerInfo:
    """Where one registered layer's pages live in its storage."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    page_bytes: int
    block_stride_bytes: int
    offset_bytes: int  # the page of block 0, from the start of the storage
    storage_ptr: int
    storage_bytes: int
    memory_strides: tuple[int, ...]  # strides of a page's dims, in elements

    def extent(self, num_blocks: int) -> tuple[int, int]:
        end = self.offset_bytes + (num_blocks - 1) * self.block_stride_bytes + self.page_bytes
        return self.offset_bytes, end


@dataclass(frozen=True)
class CopyGroup:
    """Consecutive layers copied by one op: the page of (layer ``j``, block ``b``) is
    row ``j * layer_step + b * block_step`` of ``rows``."""

    first_layer: int
    num_layers: int
    page_bytes: int
    page_offset: int  # sum of the page bytes of the layers before: slot offset / bpc
    word_bytes: int  # widest word the storage geometry allows
    rows: torch.Tensor  # uint8 [num_rows, page_bytes]
    pages: torch.Tensor  # uint8 [num_layers, num_blocks, page_bytes]
    layer_step: int
    block_step: int


@dataclass(frozen=True)
class GroupPlan:
    """One copy group against one chunk buffer, all in the group's word size ``word``:
    KV ``rows`` / ``pages`` and the buffer's ``chunk_rows`` ``[num_rows, G * bpc, words]``
    and ``chunk_pages`` ``[num_rows, G, bpc, words]``."""

    group: CopyGroup
    word: int
    rows: torch.Tensor
    pages: torch.Tensor
    layer_rows: torch.Tensor  # [G, 1]: row offset of each layer
    chunk_rows: torch.Tensor
    chunk_pages: torch.Tensor
    direct: bool  # one layer, block_step 1: the block ids are the row ids


@dataclass(frozen=True)
class ChunkViews:
    """A 2-D uint8 buffer of chunk rows (slab or staging) cut per copy group."""

    buffer: torch.Tensor
    blocks_per_chunk: int
    plans: tuple[GroupPlan, ...]


class KVLayout:
    """Registered KV cache tensors as byte pages; see the module docstring."""

    def __init__(self, layers: Sequence[LayerInfo], pages: Sequence[torch.Tensor],
                 num_blocks: int, device: torch.device) -> None:
        self._layers = tuple(layers)
        self._pages = tuple(pages)
        self._num_blocks = num_blocks
        self._device = device
        self._groups = self._build_groups()

    # ---------------------------------------------------------------- registration
    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
                     ) -> KVLayout:
        named: list[tuple[str, object]]
        if isinstance(tensors, Mapping):
            named = [(str(name), tensor) for name, tensor in tensors.items()]
        elif isinstance(tensors, Sequence) and not isinstance(tensors, (str, bytes)):
            named = [(f"layer {index}", tensor) for index, tensor in enumerate(tensors)]
        else:
            raise ConfigError(f"kv layout: expected a sequence or mapping of tensors, "
                              f"got {type(tensors).__name__}")
        if not named:
            raise ConfigError("kv layout: no KV cache tensors registered (need one per layer)")
        registered = [_register_one(name, tensor) for name, tensor in named]
        infos = [info for info, _ in registered]
        pages = [page_view for _, page_view in registered]
        num_blocks, device = int(pages[0].shape[0]), pages[0].device
        for info, page_view in registered[1:]:
            if page_view.shape[0] != num_blocks or page_view.device != device:
                raise ConfigError(
                    f"kv layout: layer {info.name!r} has {page_view.shape[0]} blocks on "
                    f"{page_view.device}, layer {infos[0].name!r} has {num_blocks} on {device}; "
                    f"all layers need the same num_blocks (dim 0) and device"
                )
        for first, second in itertools.combinations(infos, 2):
            if _pages_overlap(first, second, num_blocks):
                raise ConfigError(
                    f"kv layout: layers {first.name!r} and {second.name!r} share memory "
                    f"(their pages overlap); register each layer's pages once"
                )
        return cls(infos, pages, num_blocks, device)

    def _build_groups(self) -> tuple[CopyGroup, ...]:
        groups: list[CopyGroup] = []
        first = page_offset = 0
        while first < len(self._layers):
            count, layer_step = 1, 0
            while first + count < len(self._layers):
                step = self._merge_step(first, count)
                if step is None or (count > 1 and step != layer_step):
                    break
                layer_step, count = step, count + 1
            groups.append(self._make_group(first, count, layer_step, page_offset))
            page_offset += sum(info.page_bytes for info in self._layers[first:first + count])
            first += count
        return tuple(groups)

    def _merge_step(self, first: int, count: int) -> int | None:
        """The row step from layer ``first + count - 1`` to the next, if they can merge."""
        head, prev = self._layers[first], self._layers[first + count - 1]
        nxt = self._layers[first + count]
        page, stride = head.page_bytes, head.block_stride_bytes
        if (nxt.storage_ptr != head.storage_ptr or nxt.page_bytes != page
                or nxt.block_stride_bytes != stride or stride % page != 0):
            return None
        delta = nxt.offset_bytes - prev.offset_bytes
        if delta <= 0 or delta % page != 0:
            return None
        layer_step, block_step = delta // page, stride // page
        interleaved = count * layer_step < block_step  # rows j*step + b*block_step distinct
        stacked = layer_step >= self._num_blocks * block_step
        return layer_step if interleaved or stacked else None

    def _make_group(self, first: int, count: int, layer_step: int, page_offset: int) -> CopyGroup:
        head = self._layers[first]
        page = head.page_bytes
        base = self._pages[first]  # uint8 [num_blocks, page], storage offset = head.offset
        flat = torch.empty(0, dtype=torch.uint8, device=self._device).set_(base.untyped_storage())
        if count == 1:
            rows = base
            block_step, row_stride = 1, head.block_stride_bytes
            pages = base.unsqueeze(0)
        else:
            block_step, row_stride = head.block_stride_bytes // page, page
            num_rows = (head.storage_bytes - head.offset_bytes) // page
            rows = torch.as_strided(flat, (num_rows, page), (page, 1), head.offset_bytes)
            pages = torch.as_strided(
                flat, (count, self._num_blocks, page),
                (layer_step * page, head.block_stride_bytes, 1), head.offset_bytes,
            )
        word = _word_bytes(page, row_stride, head.offset_bytes, page_offset,
                           base.data_ptr() - head.offset_bytes)
        return CopyGroup(first, count, page, page_offset, word, rows, pages, layer_step, block_step)

    # ---------------------------------------------------------------- properties
    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def page_bytes(self) -> tuple[int, ...]:
        return tuple(info.page_bytes for info in self._layers)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(info.name for info in self._layers)

    @property
    def layers(self) -> tuple[LayerInfo, ...]:
        return self._layers

    @property
    def layer_pages(self) -> tuple[torch.Tensor, ...]:
        """Per layer a uint8 ``[num_blocks, page_bytes]`` view of its pages (no copy)."""
        return self._pages

    @property
    def groups(self) -> tuple[CopyGroup, ...]:
        return self._groups

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        check_int("kv layout: blocks_per_chunk", blocks_per_chunk, low=1)
        return blocks_per_chunk * sum(info.page_bytes for info in self._layers)

    def check_tokens_per_block(self, tokens_per_block: int) -> None:
        """Refuse a ``tokens_per_block`` that no dim of a layer's page can hold: keys of
        ``tokens_per_block`` tokens over blocks of another count would cover the wrong
        tokens. A page of two or more dims has its tokens on one dim; a flat page names
        none and is not checked."""
        check_int("store: tokens_per_block", tokens_per_block, low=1)
        for info in self._layers:
            page = info.shape[1:]
            if sum(size > 1 for size in page) < 2 or tokens_per_block in page:
                continue
            raise ConfigError(
                f"kv layout: tokens_per_block={tokens_per_block} is no dim of layer "
                f"{info.name!r}'s pages {list(page)} (tensor[b]); pass the number of tokens "
                f"one block holds (its dim in the page), or register flat pages "
                f"(tensor.view(num_blocks, -1)) if the tokens are on no dim of their own")

    @property
    def dtype_name(self) -> str:
        """The layers' dtype (``"bfloat16"``), or the distinct ones joined by ``","``."""
        names = dict.fromkeys(str(info.dtype).removeprefix("torch.") for info in self._layers)
        return ",".join(names)

    def describe(self) -> str:
        """A canonical string of what fixes the slot byte layout (for the namespace): per
        run of alike layers, the count, dtype, page shape and the page's memory order
        (dims of size > 1, outermost first). Block counts and addresses are left out."""
        texts: list[str] = []
        for info in self._layers:
            dims = [(stride, dim) for dim, (size, stride)
                    in enumerate(zip(info.shape[1:], info.memory_strides)) if size > 1]
            order = ",".join(str(dim) for _, dim in sorted(dims, reverse=True))
            texts.append(f"{str(info.dtype).removeprefix('torch.')}{list(info.shape[1:])}({order})")
        runs = [f"{len(list(alike))}x{text}" for text, alike in itertools.groupby(texts)]
        return "slot-v1 layer-major " + " ".join(runs)

    def __repr__(self) -> str:
        return (f"KVLayout({self.num_layers} layers, {self._num_blocks} blocks, "
                f"{sum(self.page_bytes)} page bytes per block, {len(self._groups)} copy groups, "
                f"{self._device})")

    # ---------------------------------------------------------------- slot views
    def slot_layer_views(self, slot: torch.Tensor, blocks_per_chunk: int) -> list[torch.Tensor]:
        """Per layer a ``[blocks_per_chunk, page_bytes]`` view of a 1-D uint8 slot."""
        need = self.chunk_bytes(blocks_per_chunk)
        if slot.dtype != torch.uint8 or slot.dim() != 1 or slot.numel() < need:
            raise UsageError(
                f"kv layout: a slot must be a 1-D uint8 tensor of at least {need} bytes "
                f"(chunk_bytes({blocks_per_chunk})), got {slot.dtype} {tuple(slot.shape)}"
            )
        sizes = [blocks_per_chunk * info.page_bytes for info in self._layers]
        return [part.view(blocks_per_chunk, info.page_bytes)
                for part, info in zip(torch.split(slot[:need], sizes), self._layers)]

    def chunk_views(self, buffer: torch.Tensor, blocks_per_chunk: int) -> ChunkViews:
        """Cut a 2-D uint8 ``[num_rows, >= chunk_bytes]`` buffer of chunk rows per copy group."""
        need = self.chunk_bytes(blocks_per_chunk)
        if (buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] < need
                or buffer.stride(1) != 1):
            raise UsageError(
                f"kv layout: a chunk buffer must be a 2-D uint8 tensor with rows of at least "
                f"{need} bytes and unit column stride, got {buffer.dtype} {tuple(buffer.shape)} "
                f"strides {buffer.stride()}"
            )
        if buffer.device != self._device:
            raise UsageError(f"kv layout: chunk buffer on {buffer.device}, "
                              f"layout on {self._device}")
        plans: list[GroupPlan] = []
        for group in self._groups:
            offset = blocks_per_chunk * group.page_offset
            length = blocks_per_chunk * group.num_layers * group.page_bytes
            word = _word_bytes(group.word_bytes, buffer.data_ptr() + offset, buffer.stride(0))
            dtype, words = _WORD_DTYPES[word], group.page_bytes // word
            region = buffer[:, offset:offset + length].view(dtype)
            layer_rows = torch.arange(group.num_layers, device=self._device) * group.layer_step
            plans.append(GroupPlan(
                group, word, group.rows.view(dtype), group.pages.view(dtype),
                layer_rows.view(-1, 1), region.view(buffer.shape[0], -1, words),
                region.view(buffer.shape[0], group.num_layers, blocks_per_chunk, words),
                group.num_layers == 1 and group.block_step == 1))
        return ChunkViews(buffer, blocks_per_chunk, tuple(plans))

    # ---------------------------------------------------------------- copies
    @staticmethod
    def row_index(plan: GroupPlan, block_ids: torch.Tensor) -> torch.Tensor:
        """Row indices ``[..., G, n]`` of the pages of ``block_ids`` ``[..., n]``."""
        group = plan.group
        scaled = block_ids if group.block_step == 1 else block_ids * group.block_step
        if group.num_layers == 1:
            return scaled.unsqueeze(-2)
        return plan.layer_rows + scaled.unsqueeze(-2)

    def gather(self, views: ChunkViews, row: int, block_ids: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` (int64 ``[bpc]`` on the layout's device) into chunk row
        ``row`` of ``views``: one ``index_select`` per copy group."""
        for plan in views.plans:
            index = block_ids if plan.direct else self.row_index(plan, block_ids).view(-1)
            torch.index_select(plan.rows, 0, index, out=plan.chunk_rows[row])

    def gather_batch(self, views: ChunkViews, first_row: int, block_ids: torch.Tensor) -> None:
        """Copy ``block_ids`` (int64 ``[C, bpc]``) into rows ``first_row .. first_row + C``:
        one ``index_select`` per group, straight into the rows when they are contiguous."""
        count = int(block_ids.shape[0])
        for plan in views.plans:
            out = plan.chunk_pages[first_row:first_row + count]
            index = self.row_index(plan, block_ids)  # [C, G, bpc]
            if count == 1 or out.is_contiguous():
                torch.index_select(plan.rows, 0, index.reshape(-1),
                                   out=out.view(-1, out.shape[-1]))
            else:
                out.copy_(plan.rows[index])

    def scatter_batch(self, views: ChunkViews, first_row: int, block_ids: torch.Tensor,
                      first_position: int = 0) -> None:
        """Copy rows ``first_row .. first_row + C``, positions ``first_position ..
        first_position + n``, into ``block_ids`` (int64 ``[C, n]``, no duplicates): one
        ``index_put_`` per group."""
        count, width = int(block_ids.shape[0]), int(block_ids.shape[1])
        end = first_position + width
        for plan in views.plans:
            source = plan.chunk_pages[first_row:first_row + count, :, first_position:end]
            plan.rows.index_put_((self.row_index(plan, block_ids),), source)


def _register_one(name: str, tensor: object) -> tuple[LayerInfo, torch.Tensor]:
    """Validate one layer's tensor; return its info and a uint8 [num_blocks, page] view."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"kv layout: layer {name!r} {what}")

    if not isinstance(tensor, torch.Tensor):
        raise bad(f"is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise bad(f"has layout {tensor.layout}; need a dense strided tensor")
    if tensor.device.type == "meta":
        raise bad("is on the meta device and holds no bytes")
    if tensor.is_conj() or tensor.is_neg():
        raise bad("is a lazy conj/neg view; register the tensor it views")
    if tensor.dim() < 1:
        raise bad("is 0-dimensional; the block dim must come first")
    shape, strides = tuple(int(size) for size in tensor.shape), tuple(tensor.stride())
    num_blocks, element = shape[0], tensor.element_size()
    page_bytes = math.prod(shape[1:]) * element
    if num_blocks == 0 or page_bytes == 0:
        raise bad(f"is empty (shape {shape}); need blocks of at least one byte")
    if not _is_dense(shape[1:], strides[1:]):
        raise bad(f"(shape {shape}, strides {strides}): a block tensor[b] is not one dense "
                  f"region of memory; the block dim must be first and each block's elements "
                  f"contiguous")
    block_stride = strides[0] * element if num_blocks > 1 else page_bytes
    if block_stride < page_bytes:
        raise bad(f"(shape {shape}, strides {strides}): blocks overlap (block stride "
                  f"{block_stride} bytes < page {page_bytes} bytes); is the block dim first?")
    storage = tensor.untyped_storage()
    offset, storage_bytes = int(tensor.storage_offset()) * element, storage.nbytes()
    if offset + (num_blocks - 1) * block_stride + page_bytes > storage_bytes:
        raise bad(f"reaches past the end of its {storage_bytes}-byte storage")
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    pages = torch.as_strided(flat, (num_blocks, page_bytes), (block_stride, 1), offset)
    info = LayerInfo(name, tensor.dtype, shape, page_bytes, block_stride, offset,
                     storage.data_ptr(), storage_bytes, strides[1:])
    return info, pages


def _pages_overlap(first: LayerInfo, second: LayerInfo, num_blocks: int) -> bool:
    """True when some page of ``first`` shares a byte with some page of ``second``."""
    if first.storage_ptr != second.storage_ptr:
        return False
    first_start, first_end = first.extent(num_blocks)
    second_start, second_end = second.extent(num_blocks)
    if first_end <= second_start or second_end <= first_start:
        return False
    if first.block_stride_bytes == second.block_stride_bytes:
        # page i of first and page i + k of second overlap iff
        # delta - second.page < k * stride < delta + first.page, with |k| < num_blocks
        stride = first.block_stride_bytes
        delta = first.offset_bytes - second.offset_bytes
        low = (delta - second.page_bytes) // stride + 1
        high = -((-(delta + first.page_bytes)) // stride) - 1
        return max(low, -(num_blocks - 1)) <= min(high, num_blocks - 1)
    blocks = torch.arange(num_blocks, dtype=torch.int64)
    starts = torch.cat([first.offset_bytes + blocks * first.block_stride_bytes,
                        second.offset_bytes + blocks * second.block_stride_bytes])
    sizes = torch.tensor([first.page_bytes, second.page_bytes]).repeat_interleave(num_blocks)
    order = torch.argsort(starts)
    return bool((starts[order][1:] < (starts + sizes)[order][:-1]).any())
