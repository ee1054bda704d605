"""Errors, deterministic tokens and KV values of the vLLM harness (see ``vllm_harness``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_FINGERPRINT_SEED = 0x243F6A8885A308D3


class HarnessError(RuntimeError):
    """The harness itself found vLLM's outputs inconsistent (not a KV mismatch)."""


@dataclass(frozen=True)
class KVMismatch:
    request_id: str
    position: int
    layer: str
    block_id: int


class KVMismatchError(AssertionError):
    """A KV slot that a scheduled request's attention reads (below its num_computed_tokens;
    for a sliding-window layer, within the window) holds a wrong value."""

    def __init__(self, mismatches: Sequence[KVMismatch], step: int) -> None:
        self.mismatches = list(mismatches)
        self.step = step
        first = self.mismatches[0]
        super().__init__(
            f"step {step}: {len(self.mismatches)} wrong KV slot(s); first: request "
            f"{first.request_id} position {first.position} layer {first.layer} "
            f"block {first.block_id}"
        )


# --------------------------------------------------------------------------------------------
# Deterministic tokens and KV values
# --------------------------------------------------------------------------------------------


def _mix64(value: int) -> int:
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def extend_fingerprints(fingerprints: list[int], token_ids: Sequence[int]) -> None:
    """Append the prefix fingerprints of token_ids[len(fingerprints):] in place."""
    previous = fingerprints[-1] if fingerprints else _FINGERPRINT_SEED
    for token in token_ids[len(fingerprints) :]:
        previous = _mix64(previous ^ _mix64(token + 0x9E3779B97F4A7C15))
        fingerprints.append(previous)


def sample_token(fingerprint: int, vocab_size: int) -> int:
    """The token the fake model samples after the prefix whose fingerprint is given."""
    return fingerprint % vocab_size


def reference_generate(prompt_token_ids: Sequence[int], max_tokens: int, vocab_size: int) -> list[int]:
    """The output tokens every correct run produces for this prompt (ignoring EOS)."""
    tokens = list(prompt_token_ids)
    fingerprints: list[int] = []
    outputs: list[int] = []
    for _ in range(max_tokens):
        extend_fingerprints(fingerprints, tokens)
        token = sample_token(fingerprints[-1], vocab_size)
        outputs.append(token)
        tokens.append(token)
    return outputs


def _mix32(values: torch.Tensor) -> torch.Tensor:
    # values: int64 in [0, 2**32); multipliers below 2**31 keep every product below 2**63.
    values = values ^ (values >> 16)
    values = (values * 0x7FEB352D) & _MASK32
    values = values ^ (values >> 15)
    values = (values * 0x346CA68B) & _MASK32
    return values ^ (values >> 16)


_BITS_DTYPE = {2: torch.int16, 4: torch.int32}


class KVValueGenerator:
    """Expected KV bits for positions, as a [P, L, H, C] tensor of the cache's integer twin."""

    def __init__(self, num_layers: int, num_heads: int, num_elements: int, dtype: torch.dtype,
                 rank: int = 0, first_head: int = 0) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if itemsize not in _BITS_DTYPE:
            raise HarnessError(f"KV dtype {dtype} has {itemsize}-byte elements; use 2 or 4")
        self.bits_dtype = _BITS_DTYPE[itemsize]
        self._bits = 8 * itemsize
        layer = torch.arange(num_layers, dtype=torch.int64).view(-1, 1, 1)
        # first_head: the rank's heads by their index in the model (values then depend on
        # the head, not on the TP size: a chunk of one TP size checks exactly under another).
        head = torch.arange(first_head, first_head + num_heads, dtype=torch.int64).view(1, -1, 1)
        element = torch.arange(num_elements, dtype=torch.int64).view(1, 1, -1)
        # A tensor-parallel rank's heads get values of their own (rank 0: as without TP).
        salt = (layer * 0x10000 + head * 0x1000 + element + 1 + rank * 0x100000) * 0x01000193
        self._salt = _mix32(salt & _MASK32)  # [L, H, C]

    def values(self, fingerprints: Sequence[int]) -> torch.Tensor:
        low = torch.tensor([f & _MASK32 for f in fingerprints], dtype=torch.int64).view(-1, 1, 1, 1)
        high = torch.tensor([(f >> 32) & _MASK32 for f in fingerprints], dtype=torch.int64).view(-1, 1, 1, 1)
        mixed = _mix32(_mix32(high ^ self._salt) ^ low)  # [P, L, H, C], 32 random bits
        if self._bits == 16:
            # Clear bit 14 so float16/bfloat16 values are finite (no NaN/Inf payloads).
            mixed = mixed & 0xBFFF
            mixed = mixed - ((mixed >> 15) << 16)
        else:
            mixed = mixed & 0xBFFFFFFF
            mixed = mixed - ((mixed >> 31) << 32)
        return mixed.to(self.bits_dtype)
