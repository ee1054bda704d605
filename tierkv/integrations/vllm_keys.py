"""Chunk keys from vLLM's block hashes (no torch, no vLLM import).

The key of chunk ``i`` of a request (chunks of ``hashes_per_chunk`` entries of
``request.block_hashes``, i.e. ``tokens_per_chunk`` tokens) is::

    key_i = sha256(b"tierkv/vllm/chunk-key/v1\\x00"
                   || group_id as 4 bytes big-endian
                   || block_hashes[(i + 1) * hashes_per_chunk - 1])          (32 bytes)

vLLM's block hashes are chained (each hashes its parent, its tokens and its extra keys:
LoRA, multimodal inputs, ``cache_salt``), so the hash of a chunk's last block fingerprints
the whole token prefix up to the end of the chunk, tenant salt included. Hashing it once
more gives every algorithm (32-byte sha256, 16-byte xxhash) the same 32-byte key and keeps
tierkv's keys apart from vLLM's own prefix-cache keys. ``group_id`` is the KV cache group
(always 0: tierkv stores models with one full-attention group).

An offline warm-up reproduces a key by computing vLLM's block hashes exactly as the engine
does (same hash algorithm, same ``PYTHONHASHSEED`` or its absence, same block size, same
extra keys) and calling :func:`chunk_keys_from_block_hashes`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_DOMAIN = b"tierkv/vllm/chunk-key/v1\x00"


_GROUP0 = KEY_DOMAIN + bytes(4)


def chunk_key(last_block_hash: bytes, group_id: int = 0) -> bytes:
    """The tierkv key of a chunk whose last block has ``last_block_hash``."""
    prefix = _GROUP0 if group_id == 0 else KEY_DOMAIN + group_id.to_bytes(4, "big")
    return hashlib.sha256(prefix + bytes(last_block_hash)).digest()


def extend_chunk_keys(keys: list[bytes], block_hashes: Sequence[bytes], hashes_per_chunk: int,
                      group_id: int = 0) -> list[bytes]:
    """Append the keys of the full chunks that ``block_hashes`` gained since ``keys`` was
    last extended (vLLM appends block hashes as tokens arrive); returns ``keys``."""
    num_chunks = len(block_hashes) // hashes_per_chunk
    prefix = KEY_DOMAIN + group_id.to_bytes(4, "big")
    sha256 = hashlib.sha256
    for index in range(len(keys), num_chunks):
        keys.append(sha256(prefix + bytes(block_hashes[(index + 1) * hashes_per_chunk - 1])).digest())
    return keys


def chunk_keys_from_block_hashes(block_hashes: Sequence[bytes], hashes_per_chunk: int,
                                 group_id: int = 0) -> list[bytes]:
    """Keys of every full chunk of a sequence whose vLLM block hashes are given."""
    return extend_chunk_keys([], block_hashes, hashes_per_chunk, group_id)


def last_block_hash(block_hashes: Sequence[bytes], chunk_index: int, hashes_per_chunk: int) -> bytes:
    return bytes(block_hashes[(chunk_index + 1) * hashes_per_chunk - 1])
