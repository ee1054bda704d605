"""The vLLM target of the warm-up: chunks keyed and laid out as tierkv's vLLM connector
stores them, so a vLLM 0.33 server over the store serves them as prefix hits.

- :func:`vllm_block_hashes` vLLM 0.33's ``request.block_hashes`` (:func:`vllm_hash_function`,
  :func:`vllm_none_hash`: ``vllm/utils/hashing.py``'s, checked against vLLM's in the tests).
- :class:`VllmTarget` the engine the chunks are for: its geometry and namespace are the
  connector's (:mod:`tierkv.integrations.vllm_config`, one definition); ``chunk_keys`` as
  the connector derives them (:mod:`tierkv.integrations.vllm_keys`); :meth:`VllmTarget.pack`
  turns HF-style K/V into the worker's bytes. :mod:`tierkv.warmup` writes them.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tierkv import model_identity
from tierkv.checks import check_int
from tierkv.config import DiskTierConfig, disk_chunk_capacity
from tierkv.engine.store_inputs import content_cache_dir
from tierkv.errors import ConfigError
from tierkv.integrations.vllm_config import (DEFAULT_TOKENS_PER_CHUNK, KNOWN_HASHES, PAGE_ORDER,
                                             STABLE_HASHES, ConnectorSettings, build_namespace,
                                             check_hash_stability, store_config)
from tierkv.integrations.vllm_geometry import Geometry
from tierkv.integrations.vllm_versions import check_vllm_version
from tierkv.integrations.vllm_keys import chunk_keys_from_block_hashes
from tierkv.integrations.vllm_versions import target_vllm_version
from tierkv.keys import Namespace, Part

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM 0.33 kv_cache_utils, PYTHONHASHSEED unset
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def warmup_model_fingerprint(model_dir: Path, model_id: str | None, revision: str | None,
                             mode: str = "auto", store: Path | None = None) -> str:
    """The model fingerprint the connector computes for a vLLM that serves ``model_id``
    (its ``--model``; None: ``model_dir``), from the weights the warm-up reads in
    ``model_dir``: a hub id's commit (``model_dir`` a snapshot of the hub cache, or the
    cache's snapshot of ``model_id``), else the directory's own fingerprint."""
    if not model_identity.is_mode(mode):
        return f"name:{mode}"
    if model_id and not Path(model_id).expanduser().exists():  # vLLM serves a hub id
        commit = model_identity.snapshot_commit(model_dir)
        if commit is None:
            snapshot = model_identity.resolve_hub_snapshot(model_id, revision)
            commit = None if snapshot is None else snapshot.name
        if commit is None:
            raise ConfigError(
                f"warmup: vLLM serves the hub model {model_id!r} (--model-id), whose chunks "
                f"are named by the commit its snapshot resolves to, and no snapshot of it is "
                f"in this machine's hub cache; pass --model with the snapshot directory "
                f"(.../snapshots/<commit>), or set model_fingerprint to a name on both sides "
                f"(--model-fingerprint)")
        return f"hub:{commit}"
    source = Path(model_id).expanduser() if model_id else model_dir
    found = model_identity.model_fingerprint(source, mode, cache_dir=content_cache_dir(store))
    if found is None:
        raise ConfigError(f"warmup: the model at {source} cannot be read for its fingerprint")
    return found


def vllm_hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM 0.33's ``prefix_caching_hash_algo`` functions (``vllm/utils/hashing.py``):
    pickle (protocol HIGHEST) or canonical CBOR, then SHA-256 or xxh3-128."""
    if algorithm not in KNOWN_HASHES:
        raise ConfigError(f"warmup: hash algorithm {algorithm!r} (--hash-algo) is not one of "
                          f"{list(KNOWN_HASHES)}")
    serialize: Callable[[Any], bytes] = partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
    if algorithm.endswith("_cbor"):
        import cbor2

        serialize = partial(cbor2.dumps, canonical=True)
    if algorithm.startswith("sha256"):
        return lambda obj: hashlib.sha256(serialize(obj)).digest()
    import xxhash

    return lambda obj: bytes(xxhash.xxh3_128_digest(serialize(obj)))


def vllm_none_hash(algorithm: str, hash_seed: str | None) -> bytes:
    """vLLM's NONE_HASH (the first block's parent): ``hash(PYTHONHASHSEED)``, or of the
    fixed default seed for the SHA-256 algorithms when PYTHONHASHSEED is unset."""
    if hash_seed is None:
        if algorithm not in STABLE_HASHES:
            raise ConfigError(f"warmup: --hash-algo {algorithm} without a seed gives block hashes "
                              f"that vLLM draws at random on every start; pass --hash-seed with "
                              f"the vLLM server's PYTHONHASHSEED, or use sha256 / sha256_cbor")
        hash_seed = DEFAULT_NONE_HASH_SEED
    return vllm_hash_function(algorithm)(hash_seed)


MultiModalInput = tuple[str, int, int]  # (identifier: vLLM's mm hash, offset, length)


def vllm_block_hashes(token_ids: Sequence[int], hash_block_size: int, algorithm: str = "sha256",
                      hash_seed: str | None = None, cache_salt: str | None = None,
                      lora: tuple[str, str] | None = None,
                      multimodal: Sequence[MultiModalInput] = ()) -> list[bytes]:
    """The ``request.block_hashes`` vLLM 0.33 computes for a request without prompt
    embeddings: block ``i`` hashes ``(parent, tuple(tokens of block i), extra_keys)`` where
    ``parent`` is the previous block's hash (NONE_HASH first) and ``extra_keys`` is vLLM's
    ``generate_block_hash_extra_keys``: ``("lora", name, path)`` of a LoRA request, then
    ``("mm", identifier, offset - block start)`` of each multimodal input whose placeholder
    tokens overlap the block (in offset order), then ``("cache_salt", salt)`` on the first
    block of a salted request; None when there are none."""
    hash_fn = vllm_hash_function(algorithm)
    parent = vllm_none_hash(algorithm, hash_seed)
    images = sorted(multimodal, key=lambda item: item[1])
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - hash_block_size + 1, hash_block_size):
        end = start + hash_block_size
        keys: list[tuple[Any, ...]] = [("lora", *lora)] if lora else []
        keys += [("mm", ident, offset - start) for ident, offset, length in images
                 if offset < end and start < offset + length]
        keys += [("cache_salt", cache_salt)] if start == 0 and cache_salt else []
        block = tuple(int(token) for token in token_ids[start:end])
        parent = hash_fn((parent, block, tuple(keys) if keys else None))
        hashes.append(parent)
    return hashes


# ------------------------------------------------------------------------------ vLLM target
@dataclass(frozen=True)
class VllmTarget:
    """The vLLM engine (with tierkv's connector) that the warmed chunks are for. Each
    field mirrors a vLLM or connector setting (a wrong one gives chunks no engine looks up):
    ``model_id`` is vLLM's ``--model`` as given, ``hash_seed`` the server's PYTHONHASHSEED
    (None: unset), ``tokens_per_chunk`` and ``disk_bytes`` the connector's settings,
    ``vllm_version`` the serving vLLM's ``__version__`` (default: the installed one)."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float16"
    head_size_v: int | None = None
    block_size: int = 16
    tokens_per_chunk: int | None = None
    hash_block_size: int | None = None
    kv_cache_layout: str = "LBNHC"
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    tensor_parallel_size: int = 1
    disk_bytes: int = ConnectorSettings.disk_bytes
    revision: str | None = None
    vllm_version: str = field(default_factory=target_vllm_version)  # the installed vLLM's
    # The weights' fingerprint (tierkv.model_identity); None: of model_id, as the connector
    # computes it for vLLM's --model.
    model_fingerprint: str | None = None

    def __post_init__(self) -> None:
        for name, option in (("num_layers", "--model"), ("num_kv_heads", "--model"),
                             ("head_size", "--model"), ("block_size", "--block-size"),
                             ("tensor_parallel_size", "--tensor-parallel-size"),
                             ("disk_bytes", "--disk-bytes")):
            check_int(f"warmup: {name} ({option})", getattr(self, name), low=1)
        if self.dtype not in _DTYPES:
            raise ConfigError(f"warmup: dtype {self.dtype!r} (--dtype) must be one of {list(_DTYPES)}")
        if self.kv_cache_layout not in PAGE_ORDER:
            raise ConfigError(f"warmup: KV cache layout {self.kv_cache_layout!r} (--kv-cache-layout) "
                              f"must be one of {list(PAGE_ORDER)}")
        check_vllm_version(self.vllm_version)
        tpc, hbs = self.chunk_tokens, self.hash_block
        if tpc <= 0 or hbs <= 0 or tpc % self.block_size or tpc % hbs:
            raise ConfigError(f"warmup: tokens_per_chunk={tpc} (--tokens-per-chunk) must be a "
                              f"multiple of the block size {self.block_size} (--block-size) and of "
                              f"the hash block size {hbs} (--hash-block-size)")
        heads, tp = self.num_kv_heads, self.tensor_parallel_size
        if (heads % tp) if heads >= tp else (tp % heads):
            raise ConfigError(f"warmup: {heads} KV heads do not split over --tensor-parallel-size {tp}")
        vllm_none_hash(self.hash_algo, self.hash_seed)  # refuses unstable hashes
        if self.disk_capacity < 1:
            raise ConfigError(f"warmup: disk_bytes={self.disk_bytes} (--disk-bytes) holds no chunk "
                              f"of {self.chunk_bytes} bytes x {tp} rank(s)")

    @property
    def chunk_tokens(self) -> int:
        if self.tokens_per_chunk is not None:
            return self.tokens_per_chunk
        return -(-DEFAULT_TOKENS_PER_CHUNK // self.block_size) * self.block_size

    @property
    def hash_block(self) -> int:
        return self.hash_block_size or self.block_size

    @property
    def heads_per_rank(self) -> int:
        return max(self.num_kv_heads // self.tensor_parallel_size, 1)

    @property
    def content_bytes(self) -> int:
        element = _DTYPES[self.dtype].itemsize
        return (self.head_size + (self.head_size_v or self.head_size)) * element

    @property
    def chunk_bytes(self) -> int:  # one chunk on one rank: the disk payload
        return self.geometry().chunk_bytes

    @property
    def disk_capacity(self) -> int:  # chunks the connector keeps (it trims the oldest at start)
        return self.geometry().disk_capacity

    def geometry(self) -> Geometry:
        """The connector's :class:`~tierkv.integrations.vllm_geometry.Geometry` of this engine."""
        blocks = self.chunk_tokens // self.block_size
        page = self.heads_per_rank * self.block_size * self.content_bytes
        return Geometry(
            layer_names=tuple(f"model.layers.{index}.self_attn.attn" for index in range(self.num_layers)),
            block_size=self.block_size, hash_block_size=self.hash_block, blocks_per_chunk=blocks,
            page_bytes=page, num_heads=self.heads_per_rank, content_bytes=self.content_bytes,
            dtype=self.dtype, layout=self.kv_cache_layout, page_order=PAGE_ORDER[self.kv_cache_layout],
            world_size=self.tensor_parallel_size, num_slots=1,
            disk_capacity=disk_chunk_capacity(self.disk_bytes, page * self.num_layers * blocks,
                                              min(self.tensor_parallel_size, self.num_kv_heads)),
            total_heads=self.num_kv_heads)

    def parts(self) -> list[Part]:
        """The parts the connector stores each chunk as (one per rank's slice of the heads)."""
        count = self.geometry().num_parts
        return [Part(index, count) for index in range(count)]

    def _environ(self) -> dict[str, str]:
        return {} if self.hash_seed is None else {"PYTHONHASHSEED": self.hash_seed}

    def namespace(self) -> Namespace:
        """The connector's namespace for this engine (``vllm_config.build_namespace``)."""
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=self.model_id, revision=self.revision, quantization=None),
            cache_config=SimpleNamespace(prefix_caching_hash_algo=self.hash_algo, cache_dtype="auto"),
            num_hash_lookahead_tokens=0)
        return build_namespace(vllm_config, self.geometry(), self.vllm_version, self._environ(),
                               model_fingerprint=self.model_fingerprint)

    def disk_config(self, store_dir: Path) -> DiskTierConfig:
        """The per-rank disk tier config the connector opens the store with."""
        settings = ConnectorSettings(disk_path=str(store_dir), disk_bytes=self.disk_bytes,
                                     tokens_per_chunk=self.chunk_tokens)
        check_hash_stability(self.hash_algo, settings, self._environ())
        return store_config(settings, self.geometry()).disk

    def chunk_keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Keys of the full chunks of ``token_ids``, as the connector derives them."""
        full = len(token_ids) // self.chunk_tokens * self.chunk_tokens
        hashes = vllm_block_hashes(token_ids[:full], self.hash_block, self.hash_algo,
                                   self.hash_seed, cache_salt)
        return chunk_keys_from_block_hashes(hashes, self.chunk_tokens // self.hash_block)

    def pack(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per part (:meth:`parts`), ``uint8 [num_chunks, chunk_bytes]`` from HF-style per-layer K and V
        (``[kv_heads, seq, head]`` or ``[1, kv_heads, seq, head]``, ``seq`` a multiple of the
        chunk): pages as vLLM's paged cache holds them (``[N, H, C]`` NHD, ``[H, N, C]`` HND,
        ``C`` = K then V of one head and token), in the slot byte layout (layer-major)."""
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ConfigError(f"warmup: got K/V of {len(keys)}/{len(values)} layers, the model "
                              f"has {self.num_layers}")
        dtype, tpc, bs = _DTYPES[self.dtype], self.chunk_tokens, self.block_size
        per_layer: list[torch.Tensor] = []
        for layer, (key, value) in enumerate(zip(keys, values)):
            key, value = (key[0] if key.dim() == 4 else key), (value[0] if value.dim() == 4 else value)
            heads, seq, _ = key.shape
            if (heads != self.num_kv_heads or key.shape[2] != self.head_size or seq % tpc
                    or value.shape[:2] != key.shape[:2]
                    or value.shape[2] != (self.head_size_v or self.head_size)):
                raise ConfigError(
                    f"warmup: layer {layer} K {tuple(key.shape)} / V {tuple(value.shape)} do not "
                    f"match {self.num_kv_heads} KV heads of size {self.head_size} over a multiple "
                    f"of {tpc} tokens")
            per_layer.append(torch.cat([key.to(dtype), value.to(dtype)], dim=-1))  # [H, S, C]
        num_chunks = per_layer[0].shape[1] // tpc
        out: list[torch.Tensor] = []
        geometry = self.geometry()
        for stored in self.parts():
            first, end = geometry.part_heads(stored)
            rows = []
            for cells in per_layer:
                part = cells[first:end]  # [h, S, C]
                if PAGE_ORDER[self.kv_cache_layout] == "HND":
                    part = part.reshape(len(part), -1, bs, part.shape[-1])  # [h, blocks, N, C]
                # pages first: NHD [S, h, C] (a block is [N, h, C]), HND [blocks, h, N, C]
                rows.append(part.transpose(0, 1).reshape(num_chunks, -1))
            chunk = torch.stack(rows, dim=1).contiguous()  # [chunks, L, page elements x blocks]
            out.append(chunk.view(num_chunks, -1).view(torch.uint8).to("cpu"))
        return out
