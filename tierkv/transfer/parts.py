"""Parts of a chunk across tensor-parallel sizes: cutting KV heads out of slot bytes.

A writer at TP size ``t`` stores each chunk as ``P = min(t, H)`` parts, part ``p`` being
exactly the slot bytes of the rank that holds heads ``[p * H / P, (p + 1) * H / P)``
(:class:`tierkv.keys.Part`; ``docs/on-disk-format.md``, "Parts"). A reader at another TP
size reads whole values and re-slices heads in memory. Primitives:

- :class:`HeadLayout`: where a head's bytes are in a slot. The slot is ``pieces`` pages
  (layers x blocks, :mod:`tierkv.transfer.layout`), each page one dense ``[outer, heads,
  inner]`` region in memory order: ``outer = 1`` for HND pages (heads outermost), ``outer =
  tokens per block`` for NHD pages (tokens outermost, heads inside). So a slot of ``h``
  heads viewed as ``uint8 [pieces, outer, h, head_bytes]`` puts every byte of head ``i``
  (K and V, every layer and block) at ``[:, :, i, :]``, and one strided copy moves a head
  range of a whole chunk.
- :func:`copy_heads`: heads ``[first, end)`` from one such buffer into another.
- :func:`split_heads` / :func:`assemble_heads`: a whole-model buffer into parts and back
  (the tests' reference; the warm-up writes parts with them).
- :class:`PartReader`: ``read(key, count, out)`` fills a rank's slot from the parts of a
  writer of ``count`` parts: each part that covers the rank's heads is read whole into a
  staging buffer and **verified** by its tier (the per-value checksum), then its heads are
  copied into the slot. ``OK`` only when every needed part was read and verified; the
  first part that is missing or corrupt ends the read with that answer (the slot's bytes
  are then unspecified, and the chunk is a failed load, never partial bytes served).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierkv.checks import check_int
from tierkv.errors import ConfigError, UsageError
from tierkv.keys import Part
from tierkv.tiers.base import ReadStatus


@dataclass(frozen=True)
class HeadLayout:
    """Where each KV head's bytes are in a chunk's slot (see the module docstring)."""

    pieces: int  # pages per chunk: layers x blocks per chunk
    outer: int  # 1 (HND pages) or tokens per block (NHD pages)
    head_bytes: int  # bytes of one head per outer step
    model_heads: int

    def __post_init__(self) -> None:
        for name in ("pieces", "outer", "head_bytes", "model_heads"):
            check_int(f"head layout: {name}", getattr(self, name), low=1)

    @classmethod
    def of_pages(cls, *, pieces: int, page_bytes: int, page_heads: int, page_order: str,
                 tokens_per_page: int, model_heads: int) -> HeadLayout:
        """From one rank's pages of ``page_heads`` heads, in ``page_order``."""
        outer = tokens_per_page if page_order == "NHD" else 1
        if page_order not in ("NHD", "HND") or page_bytes % (outer * page_heads):
            raise ConfigError(f"head layout: a {page_order} page of {page_bytes} bytes does not "
                              f"split into {page_heads} heads x {outer} tokens")
        return cls(pieces, outer, page_bytes // (outer * page_heads), model_heads)

    def heads(self, part: Part) -> tuple[int, int]:
        """Heads ``[first, end)`` of ``part``."""
        return (part.index * self.model_heads // part.count,
                (part.index + 1) * self.model_heads // part.count)

    def bytes_of(self, num_heads: int) -> int:
        """Bytes of a chunk of ``num_heads`` heads."""
        return self.pieces * self.outer * num_heads * self.head_bytes

    def part_bytes(self, count: int) -> int:
        """Bytes of one part of ``count``."""
        return self.bytes_of(self.model_heads // count)

    def view(self, buffer: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``buffer``'s first :meth:`bytes_of` bytes as ``[pieces, outer, heads, head_bytes]``."""
        flat = buffer.reshape(-1)
        if flat.dtype != torch.uint8 or flat.numel() < self.bytes_of(num_heads):
            raise UsageError(f"head layout: need a uint8 buffer of {self.bytes_of(num_heads)} "
                              f"bytes, got {flat.dtype} x {flat.numel()}")
        return flat[: self.bytes_of(num_heads)].view(self.pieces, self.outer, num_heads,
                                                      self.head_bytes)


def copy_heads(layout: HeadLayout, dst: torch.Tensor, dst_heads: tuple[int, int],
               src: torch.Tensor, src_heads: tuple[int, int]) -> tuple[int, int]:
    """Copy the heads both hold from ``src`` (holding heads ``src_heads``) into ``dst``
    (holding ``dst_heads``); returns the heads copied ``[first, end)``."""
    first, end = max(dst_heads[0], src_heads[0]), min(dst_heads[1], src_heads[1])
    if first >= end:
        return first, first
    into = layout.view(dst, dst_heads[1] - dst_heads[0])
    out_of = layout.view(src, src_heads[1] - src_heads[0])
    into[:, :, first - dst_heads[0]: end - dst_heads[0]].copy_(
        out_of[:, :, first - src_heads[0]: end - src_heads[0]])
    return first, end


def split_heads(layout: HeadLayout, whole: torch.Tensor, count: int) -> list[torch.Tensor]:
    """A chunk of every head as ``count`` parts' slot bytes."""
    parts = []
    for index in range(count):
        heads = layout.heads(Part(index, count))
        out = torch.empty(layout.bytes_of(heads[1] - heads[0]), dtype=torch.uint8)
        copy_heads(layout, out, heads, whole, (0, layout.model_heads))
        parts.append(out)
    return parts


def assemble_heads(layout: HeadLayout, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`split_heads`."""
    whole = torch.empty(layout.bytes_of(layout.model_heads), dtype=torch.uint8)
    for index, part in enumerate(parts):
        copy_heads(layout, whole, (0, layout.model_heads), part,
                   layout.heads(Part(index, len(parts))))
    return whole


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor."""
    array: Any = tensor.numpy()
    return memoryview(array).cast("B")


class PartSource(Protocol):
    """A tier that reads any part of one part count (a remote tier of that count, the
    disk's other parts): ``read_part_into`` verifies what it reads."""

    def read_part_into(self, key: bytes, part: Part, out: Any) -> ReadStatus: ...


class PartReader:
    """Fills the slot of ``own`` (a rank's part) from another part count's parts; see
    the module docstring. ``source(count)`` gives the tier of that count's parts (None:
    none, every read of it is ``MISSING``)."""

    def __init__(self, layout: HeadLayout, own: Part,
                 source: Callable[[int], PartSource | None]) -> None:
        if layout.model_heads % own.count:
            raise ConfigError(f"part reader: {layout.model_heads} heads do not split into "
                              f"{own.count} parts")
        self.layout, self.own, self._source = layout, own, source
        self._heads = layout.heads(own)
        self._local = threading.local()

    def _staging(self, size: int) -> torch.Tensor:
        """This thread's staging buffer of ``size`` bytes: an anonymous map, page-aligned,
        so a whole value is read as the rank's own chunks are (``O_DIRECT`` into it)."""
        buffer: torch.Tensor | None = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < size:
            self._local.map = mmap.mmap(-1, max(size, 1))
            buffer = torch.frombuffer(self._local.map, dtype=torch.uint8)
            self._local.buffer = buffer
        return buffer[:size]

    def covering(self, count: int) -> list[Part]:
        """The parts of ``count`` that hold some of this rank's heads."""
        heads = self.layout.model_heads
        first, end = self._heads
        return [Part(index, count) for index in range(count)
                if index * heads // count < end and (index + 1) * heads // count > first]

    def read(self, key: bytes, count: int, out: Any) -> ReadStatus:
        """Read the chunk ``key`` stored as ``count`` parts into this rank's slot ``out``."""
        layout = self.layout
        if count < 1 or layout.model_heads % count:
            return ReadStatus.MISSING  # no writer cuts these heads so
        source = self._source(count)
        if source is None:
            return ReadStatus.MISSING
        size = layout.part_bytes(count)
        slot = torch.frombuffer(out, dtype=torch.uint8)
        for part in self.covering(count):
            staging = self._staging(size)
            status = source.read_part_into(key, part, _bytes_view(staging))
            if status is not ReadStatus.OK:
                return status
            copy_heads(layout, slot, self._heads, staging, layout.heads(part))
        return ReadStatus.OK
