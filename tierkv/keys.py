"""Chunk keys and namespaces.

A *chunk* is `blocks_per_chunk` consecutive engine blocks of one request. Its key
fingerprints the whole token prefix up to and including the chunk, so equal keys mean
equal KV (under one namespace).

Custom engines use :func:`chunk_keys`: a chained sha256 over a canonical msgpack
encoding of ``[parent_key, token_ids, extra]``. The first chunk's parent is
:data:`ROOT_KEY` (32 zero bytes) unless the caller passes a salt-derived root (tenant
isolation: :func:`salted_root`). Never Python's ``hash()``; no per-process seeds.

A :class:`Namespace` names everything that decides what a chunk's bytes mean. Persistent
data lives under its fingerprint, every stored value is bound to it (and to its rank and
key), and a store opened under another namespace never serves it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NewType

import msgpack

from tierkv.errors import ConfigError

ChunkKey = NewType("ChunkKey", bytes)

FORMAT_VERSION = 4  # 2: values bound to namespace and rank, layers, block split; 3: shards;
# 4: payloads in slab files, LMDB holds the index only
KEY_BYTES = 32
ROOT_KEY = ChunkKey(bytes(KEY_BYTES))
HASH_SCHEME = "tierkv-sha256-msgpack-v1"


def _canonical(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def chunk_key(parent: bytes, token_ids: Sequence[int], extra: Any = None) -> ChunkKey:
    """Key of one chunk: sha256(msgpack([parent, list(token_ids), extra]))."""
    if len(parent) != KEY_BYTES:
        raise ConfigError(f"keys: parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    payload = _canonical([bytes(parent), [int(t) for t in token_ids], extra])
    return ChunkKey(hashlib.sha256(payload).digest())


def salted_root(salt: str | bytes) -> ChunkKey:
    """A root key per tenant salt: prefixes under different salts never share keys."""
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    return ChunkKey(hashlib.sha256(_canonical(["tierkv-salt", raw])).digest())


def chunk_keys(
    token_ids: Sequence[int],
    tokens_per_chunk: int,
    parent: bytes = ROOT_KEY,
    extra: Any = None,
) -> list[ChunkKey]:
    """Keys of every *full* chunk of ``token_ids``; a partial tail chunk has no key."""
    if tokens_per_chunk <= 0:
        raise ConfigError(f"keys: tokens_per_chunk must be > 0, got {tokens_per_chunk}")
    keys: list[ChunkKey] = []
    prev: bytes = parent
    for start in range(0, len(token_ids) - tokens_per_chunk + 1, tokens_per_chunk):
        prev = chunk_key(prev, token_ids[start : start + tokens_per_chunk], extra)
        keys.append(ChunkKey(prev))
    return keys


@dataclass(frozen=True)
class Namespace:
    """Everything that decides what stored KV bytes mean.

    ``layer_names`` are the registered layers in registration order (the slot layout is
    layer-major, so the same pages under another order are other bytes); empty only for
    namespaces built by hand. ``blocks_per_chunk`` is how the ``tokens_per_chunk`` split
    into engine blocks (the same tokens in another split are another byte layout).
    ``chunk_bytes`` is one chunk's payload on one rank (what a disk value holds)."""

    model_id: str
    dtype: str
    kv_layout: str
    page_bytes: int
    tokens_per_chunk: int
    num_layers: int = 1
    tp_size: int = 1
    rank_layout: str = "tp"
    hash_scheme: str = HASH_SCHEME
    format_version: int = FORMAT_VERSION
    extra: str = ""
    layer_names: tuple[str, ...] = ()
    blocks_per_chunk: int = 1
    chunk_bytes: int = 0  # payload bytes of one chunk on one rank; 0: not recorded

    def __post_init__(self) -> None:
        for name in ("page_bytes", "tokens_per_chunk", "num_layers", "tp_size",
                     "format_version", "blocks_per_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"namespace: {name} must be a positive int, got {value!r}")
        for name in ("model_id", "dtype", "kv_layout", "rank_layout", "hash_scheme", "extra"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"namespace: {name} must be a str, got {getattr(self, name)!r}")
        if not self.model_id:
            raise ConfigError("namespace: model_id must not be empty")
        names = self.layer_names
        if isinstance(names, (str, bytes)) or not isinstance(names, (tuple, list)) \
                or not all(isinstance(name, str) for name in names):
            raise ConfigError(f"namespace: layer_names must be a sequence of str, got {names!r}")
        object.__setattr__(self, "layer_names", tuple(names))  # lists from JSON records
        if names and len(names) != self.num_layers:
            raise ConfigError(f"namespace: {len(names)} layer_names for num_layers="
                              f"{self.num_layers}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) \
                or self.chunk_bytes < 0:
            raise ConfigError(f"namespace: chunk_bytes must be an int >= 0, got {self.chunk_bytes!r}")
        if self.tokens_per_chunk % self.blocks_per_chunk:
            raise ConfigError(f"namespace: tokens_per_chunk={self.tokens_per_chunk} is not a "
                              f"multiple of blocks_per_chunk={self.blocks_per_chunk}")

    def describe(self) -> dict[str, Any]:
        """Every field as plain data (JSON-ready: ``layer_names`` is a list)."""
        fields = asdict(self)
        fields["layer_names"] = list(self.layer_names)
        return fields

    def fingerprint(self) -> str:
        """32 hex digits of sha256 over the canonical encoding of every field."""
        fields = sorted(self.describe().items())
        return hashlib.sha256(_canonical(fields)).hexdigest()[:32]
