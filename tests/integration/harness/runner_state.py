"""What the fake model runner tracks per request and step (see ``runner``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionMetadata

from .values import HarnessError

# vLLM's null block (BlockPool holds block 0 back): a sliding-window group's block table
# shows it for blocks outside the window. Nothing may write it.
NULL_BLOCK_ID = 0


@dataclass
class _RequestState:
    token_ids: list[int]
    # One block table per KV cache group, as the model runner's block tables. A
    # sliding-window group keeps the ids of blocks vLLM freed out of the window (stale).
    group_block_ids: list[list[int]]
    num_prompt_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table (the only one without sliding-window layers)."""
        return self.group_block_ids[0]


@dataclass(frozen=True)
class _ScheduledRequest:
    request_id: str
    start: int  # num_computed_tokens before this step
    num_tokens: int  # scheduled this step
    token_ids: list[int]
    group_block_ids: tuple[list[int], ...]  # per KV cache group
    resumed_or_new: bool
    num_prompt_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]


@dataclass
class FakeAttentionMetadata(AttentionMetadata):
    """Stands in for a backend's metadata in forward_context and save_kv_layer."""

    slot_mapping: torch.Tensor



def _reconcile(request_id: str, old: Sequence[int] | None, provided: Sequence[int], replace: bool) -> list[int]:
    """Token ids after the scheduler re-sent them; both sides must agree on their common prefix."""
    provided = list(provided)
    if old is None:
        return provided
    common = min(len(old), len(provided))
    if list(old[:common]) != provided[:common]:
        raise HarnessError(f"request {request_id}: runner and scheduler disagree on token ids")
    if replace or len(provided) >= len(old):
        return provided
    return list(old)
