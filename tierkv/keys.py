"""Chunk keys and namespaces.

A *chunk* is `blocks_per_chunk` consecutive engine blocks of one request. Its key
fingerprints the whole token prefix up to and including the chunk, so equal keys mean
equal KV (under one namespace).

Custom engines use :func:`chunk_keys`: a chained sha256 over a canonical msgpack
encoding of ``[parent_key, token_ids, extra]``. The first chunk's parent is
:data:`ROOT_KEY` (32 zero bytes) unless the caller passes a salt-derived root (tenant
isolation: :func:`salted_root`). Never Python's ``hash()``; no per-process seeds.

A :class:`Namespace` names everything that decides what a chunk's bytes mean. Persistent
data lives under its fingerprint, every stored value is bound to it (and to its part and
key), and a store opened under another namespace never serves it.

A :class:`Part` names one stored value of a chunk: part ``index`` of ``count``. A writer at
tensor-parallel size ``t`` over a model of ``H`` KV heads writes ``count = min(t, H)`` parts,
part ``p`` holding heads ``[p * H / count, (p + 1) * H / count)`` in the engine's own page
layout; MLA (one latent replicated on every rank) writes one part. The namespace holds no
TP size: engines of one model at TP 1, 2 and 4 share one namespace and read each other's
parts (``docs/on-disk-format.md``, "Parts").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NewType

import msgpack

from tierkv.checks import check_int, is_int
from tierkv.errors import ConfigError, UsageError

ChunkKey = NewType("ChunkKey", bytes)

FORMAT_VERSION = 5  # 2: values bound to namespace and rank, layers, block split; 3: shards;
# 4: payloads in slab files, LMDB holds the index only; 5: one value per writer part (p of P),
# namespaces without the TP size
KEY_BYTES = 32
ROOT_KEY = ChunkKey(bytes(KEY_BYTES))
HASH_SCHEME = "tierkv-sha256-msgpack-v1"


def _canonical(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def chunk_key(parent: bytes, token_ids: Sequence[int], extra: Any = None) -> ChunkKey:
    """Key of one chunk: sha256(msgpack([parent, list(token_ids), extra]))."""
    if len(parent) != KEY_BYTES:
        raise UsageError(f"keys: parent key must be {KEY_BYTES} bytes, got {len(parent)}")
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


@dataclass(frozen=True, order=True)
class Part:
    """Part ``index`` of ``count``: one stored value of a chunk (see the module docstring)."""

    index: int
    count: int

    @property
    def name(self) -> str:
        """``<p>of<P>``: the disk directory's suffix and the Redis key's last field."""
        return f"{self.index}of{self.count}"

    def check(self) -> Part:
        for field_name, value in (("index", self.index), ("count", self.count)):
            check_int(f"part: {field_name}", value)
        if self.count < 1 or not 0 <= self.index < self.count or self.count > 0xFFFF:
            raise ConfigError(f"part: need 0 <= index < count <= 65535, got {self.index} of "
                              f"{self.count}")
        return self


SINGLE_PART = Part(0, 1)


def as_part(value: Part | int) -> Part:
    """A :class:`Part`; the int 0 means the one part of a single-part writer (TP 1, MLA)."""
    if isinstance(value, Part):
        return value.check()
    if is_int(value) and value == 0:
        return SINGLE_PART
    raise ConfigError(f"part: expected a Part(index, count) (or 0 for the one part of a "
                      f"single-part writer), got {value!r}")


def parse_part(text: str) -> Part | None:
    """``<p>of<P>`` back to a :class:`Part`; None for anything else."""
    index, sep, count = text.partition("of")
    if not sep or not index.isdigit() or not count.isdigit() or len(index) > 5 or len(count) > 5:
        return None
    if str(int(index)) != index or str(int(count)) != count:
        return None
    try:
        return Part(int(index), int(count)).check()
    except ConfigError:
        return None


def part_counts(num_kv_heads: int) -> tuple[int, ...]:
    """The part counts a chunk of a model with ``num_kv_heads`` KV heads can be stored
    under: every power of two up to the heads, and the heads themselves (dividing them)."""
    counts = {num_kv_heads}
    count = 1
    while count <= num_kv_heads:
        if num_kv_heads % count == 0:
            counts.add(count)
        count *= 2
    return tuple(sorted(counts))


@dataclass(frozen=True)
class Namespace:
    """Everything that decides what stored KV bytes mean.

    ``layer_names`` are the registered layers in registration order (the slot layout is
    layer-major, so the same pages under another order are other bytes); empty only for
    namespaces built by hand. ``blocks_per_chunk`` is how the ``tokens_per_chunk`` split
    into engine blocks (the same tokens in another split are another byte layout).
    ``page_bytes`` and ``chunk_bytes`` are the whole model's (every KV head): a value of
    part ``p`` of ``P`` holds ``chunk_bytes / P`` of them. ``num_kv_heads`` is the model's
    KV heads (0: not recorded, the library's namespaces, whose ``kv_layout`` names one
    rank's tensors). ``rank_layout`` is ``"heads"`` (ranks hold slices of the KV heads) or
    ``"mla"`` (every rank holds the same latent: one part). ``model_fingerprint`` names
    the weights and config that computed the KV (:mod:`tierkv.model_identity`). No TP
    size: see :class:`Part`."""

    model_id: str
    dtype: str
    kv_layout: str
    page_bytes: int
    tokens_per_chunk: int
    num_layers: int = 1
    rank_layout: str = "heads"
    hash_scheme: str = HASH_SCHEME
    format_version: int = FORMAT_VERSION
    extra: str = ""
    layer_names: tuple[str, ...] = ()
    blocks_per_chunk: int = 1
    chunk_bytes: int = 0  # payload bytes of one chunk, every part; 0: not recorded
    num_kv_heads: int = 0  # the model's KV heads; 0: not recorded
    # The weights and config that computed the KV (tierkv.model_identity): "auto:...",
    # "content:...", "hub:<commit>", "name:<operator's string>"; "": not recorded.
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        for name in ("page_bytes", "tokens_per_chunk", "num_layers",
                     "format_version", "blocks_per_chunk"):
            value = getattr(self, name)
            check_int(f"namespace: {name}", value, low=1)
        for name in ("model_id", "dtype", "kv_layout", "rank_layout", "hash_scheme", "extra",
                     "model_fingerprint"):
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
        for name in ("chunk_bytes", "num_kv_heads"):
            value = getattr(self, name)
            check_int(f"namespace: {name}", value, low=0)
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
