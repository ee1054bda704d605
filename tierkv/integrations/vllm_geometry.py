"""The shape of the vLLM connector's chunks: :class:`Geometry` (sizes, layout, parts) and
:class:`KVGroup` (one of vLLM's KV cache groups), plain frozen data and what follows from it.

:func:`tierkv.integrations.vllm_config.build_geometry` derives a :class:`Geometry` from
vLLM's config objects; both connector roles, the warm-up writer and the tests build on
it. Everything here is a pure function of the fields (no vLLM, torch or LMDB): the chunk
and part sizes, which part a rank holds and which rank writes it (``docs/on-disk-format.md``,
"Parts"), and the sliding windows' released blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tierkv.keys import Part, part_counts

__all__ = ["Geometry", "KVGroup"]


@dataclass(frozen=True)
class Geometry:
    """Sizes both roles derive from the KVCacheConfig."""

    layer_names: tuple[str, ...]
    block_size: int  # tokens per vLLM block
    hash_block_size: int  # tokens per entry of request.block_hashes
    blocks_per_chunk: int
    page_bytes: int  # one block of one layer on one rank (unpadded)
    num_heads: int  # KV heads of one rank's page
    content_bytes: int  # C of the [H, N, C] page, in bytes
    dtype: str
    layout: str  # vLLM's KV cache layout name
    page_order: str  # "NHD" or "HND": memory order of a page
    world_size: int
    num_slots: int
    disk_capacity: int  # chunks; 0 without a disk tier
    attention: str = "full"  # "full" (K and V per head) or "mla" (one latent vector a token)
    # Several KV cache groups (vLLM's hybrid KV cache manager): each group's kind and
    # layers. Groups alias one another's bytes (a block id belongs to one group at a time),
    # so ``layer_names`` are the widest group's, one per region, and a chunk holds each
    # region's page of every group's blocks (pages_per_chunk). Empty: one group.
    groups: tuple[KVGroup, ...] = ()
    # The model's KV heads (every rank's together); 0: num_heads x world_size.
    total_heads: int = 0

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def num_groups(self) -> int:
        return max(len(self.groups), 1)

    @property
    def pages_per_chunk(self) -> int:
        """Block ids a chunk's jobs copy per layer: ``blocks_per_chunk`` of each group."""
        return self.blocks_per_chunk * self.num_groups

    @property
    def chunk_bytes(self) -> int:  # on one rank
        return self.page_bytes * self.num_layers * self.pages_per_chunk

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """Per sliding-window group, the tokens it keeps behind a request's processed ones:
        vLLM frees a block once all its tokens are further back."""
        return tuple(group.sliding_window - 1 + group.extra_retained_tokens
                     for group in self.groups if group.sliding_window)

    @functools.cached_property
    def window_kept(self) -> int | None:
        """The smallest of those (None: no sliding-window group)."""
        return min(self.sliding_windows, default=None)

    def released_blocks(self, num_processed_tokens: int) -> int:
        """Leading blocks of a request whose pages some sliding-window group freed, once
        ``num_processed_tokens`` are computed (vLLM's SlidingWindowManager rule)."""
        kept = self.window_kept
        if kept is None:
            return 0
        return max(0, num_processed_tokens - kept) // self.block_size

    @property
    def model_heads(self) -> int:
        """The KV heads parts are cut from: the model's, or 1 under MLA (one latent that
        every rank holds whole)."""
        if self.attention == "mla":
            return 1
        return self.total_heads or self.num_heads * self.world_size

    @property
    def num_parts(self) -> int:
        """Parts each chunk is stored in (``docs/on-disk-format.md``, "Parts"): one per
        rank's slice of the KV heads, ``min(world_size, heads)``; one under MLA, whose ranks
        hold identical KV (rank 0 writes it, every rank loads it). Each part is one rank's
        slot bytes, so a part's value is ``chunk_bytes`` long."""
        return min(self.world_size, self.model_heads)

    def part_of(self, rank: int) -> Part:
        """The part ``rank`` holds: ranks that hold the same heads (heads < ranks, MLA)
        hold one part."""
        return Part(rank * self.num_parts // self.world_size, self.num_parts)

    def stored_rank(self, rank: int) -> int:
        """The rank that writes the part ``rank`` holds (the first rank holding it)."""
        return self.part_of(rank).index * self.world_size // self.num_parts

    def part_heads(self, part: Part) -> tuple[int, int]:
        """The KV heads ``[first, end)`` of ``part``."""
        heads = self.model_heads
        return part.index * heads // part.count, (part.index + 1) * heads // part.count

    @property
    def model_chunk_bytes(self) -> int:
        """One chunk of every part together (the namespace's ``chunk_bytes``)."""
        return self.chunk_bytes * self.num_parts

    def source_counts(self) -> tuple[int, ...]:
        """Part counts a chunk may be loaded from: this engine's own first, then every
        other that cuts the heads evenly (MLA: only 1)."""
        own = self.num_parts
        if self.attention == "mla":
            return (own,)
        return (own, *(count for count in part_counts(self.model_heads) if count != own))

    @property
    def hashes_per_chunk(self) -> int:
        return self.tokens_per_chunk // self.hash_block_size


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups as tierkv stores it."""

    kind: str  # "full" or "sliding_window"
    layer_names: tuple[str, ...]
    sliding_window: int = 0  # tokens (sliding_window groups)
    extra_retained_tokens: int = 0

    def describe(self) -> str:
        kind = self.kind if not self.sliding_window else f"sliding_window={self.sliding_window}" + (
            f"+{self.extra_retained_tokens}" if self.extra_retained_tokens else "")
        return f"{kind}:{len(self.layer_names)}"
