"""Chunk keys from vLLM's block hashes (no torch, no vLLM import).

The key of chunk ``i`` of a request (chunks of ``hashes_per_chunk`` entries of
``request.block_hashes``, i.e. ``tokens_per_chunk`` tokens) is::

    key_i = sha256(b"tierkv/vllm/chunk-key/v1\\x00"
                   || group_id as 4 bytes big-endian
                   || block_hashes[(i + 1) * hashes_per_chunk - 1])          (32 bytes)

``group_id`` is the KV cache group (always 0: a chunk holds the pages of every group of a
hybrid model, under one key). vLLM's block hashes are chained, so a chunk's last one
fingerprints the whole token prefix, ``cache_salt`` included. Hashing it once more gives
every algorithm (32-byte sha256, 16-byte xxhash) the same 32-byte key and keeps tierkv's
keys apart from vLLM's own.
``docs/vllm.md`` ("Chunk keys") says how an offline warm-up reproduces them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_DOMAIN = b"tierkv/vllm/chunk-key/v1\x00"
_GROUP0 = KEY_DOMAIN + bytes(4)
EPOCH_DOMAIN = b"tierkv/vllm/epoch-key/v1\x00"
ADAPTER_DOMAIN = b"tierkv/vllm/adapter-key/v1\x00"


def chunk_key(last_block_hash: bytes, group_id: int = 0) -> bytes:
    """The tierkv key of a chunk whose last block has ``last_block_hash``."""
    prefix = _GROUP0 if group_id == 0 else KEY_DOMAIN + group_id.to_bytes(4, "big")
    return hashlib.sha256(prefix + bytes(last_block_hash)).digest()


def adapter_key(key: bytes, adapter: str) -> bytes:
    """``key`` of a request under a LoRA adapter whose content fingerprint is ``adapter``
    (itself without one, ``""``): vLLM's block hashes carry an adapter's name and path, not
    its content, so an adapter saved over another under the same name keys other chunks."""
    if not adapter:
        return key
    return hashlib.sha256(ADAPTER_DOMAIN + adapter.encode() + b"\x00" + key).digest()


def epoch_key(key: bytes, epoch: bytes) -> bytes:
    """``key`` in a cache epoch: itself in the first one (``b""``), else a new 32-byte key
    (after ``reset_cache``, see docs/vllm.md)."""
    return key if not epoch else hashlib.sha256(EPOCH_DOMAIN + epoch + key).digest()


def chunk_keys_from_block_hashes(block_hashes: Sequence[bytes], hashes_per_chunk: int,
                                 group_id: int = 0) -> list[bytes]:
    """Keys of every full chunk of a sequence whose vLLM block hashes are given."""
    return [chunk_key(block_hashes[end - 1], group_id)
            for end in range(hashes_per_chunk, len(block_hashes) + 1, hashes_per_chunk)]
