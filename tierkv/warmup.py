"""Warm-up: write KV chunks into a store's disk tier before any engine ran the prompts.

A warmed chunk is one the engine could have stored itself: same namespace, key and payload
bytes, so an engine starting over the store serves it as a prefix hit (``docs/warmup.md``).
Primitives (``tierkv warmup``, :mod:`tierkv.warmup_hf`, drives them from a HF model):

- :class:`ChunkWriter`  one namespace, one or more ranks: skips keys present on every rank
  (a rerun resumes) or queued earlier, writes transactions of ~``disk.write_batch_bytes``,
  stops at ``capacity`` chunks or a full map (``full_message``); ``close()`` flushes, syncs.
- :func:`warmup_tokens`  custom engines: token id sequences and a caller's KV producer ->
  chunks keyed by :func:`tierkv.keys.chunk_keys` (or ``key_fn``) under ``namespace``.
- :func:`gather_chunks`  a producer's helper: copy blocks of the engine's own KV tensors
  into chunk payloads with :class:`~tierkv.transfer.layout.KVLayout`, byte for byte what
  the worker stores.
- :class:`VllmTarget`  the vLLM 0.33 engine the chunks are for: keys from vLLM's block hashes
  (:func:`vllm_block_hashes`) via :mod:`tierkv.integrations.vllm_keys`, geometry and namespace
  via :mod:`tierkv.integrations.vllm_config` (one definition, shared with the connector);
  :meth:`VllmTarget.pack` turns HF-style K/V into the worker's bytes.
- :class:`WarmupReport`  the counts and the one summary line.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tierkv.config import DiskTierConfig
from tierkv.errors import ConfigError
from tierkv.integrations.vllm_config import (DEFAULT_TOKENS_PER_CHUNK, DISK_OVERHEAD_BYTES,
                                             KNOWN_HASHES, PAGE_ORDER, STABLE_HASHES,
                                             ConnectorSettings, Geometry, build_namespace,
                                             check_hash_stability, check_vllm_version,
                                             disk_tier_config)
from tierkv.integrations.vllm_keys import chunk_keys_from_block_hashes
from tierkv.keys import ROOT_KEY, Namespace, chunk_keys
from tierkv.tiers.disk import DiskTier
from tierkv.units import format_bytes
from tierkv.transfer.layout import KVLayout

Payload = Any  # bytes-like, numpy array or torch tensor of exactly chunk_bytes bytes
KVProducer = Callable[[list[int]], Iterable[Payload]]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM 0.33 kv_cache_utils, PYTHONHASHSEED unset
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# ------------------------------------------------------------------------------ writing
@dataclass
class WarmupReport:
    """What a warm-up did. ``chunks_present``: already in the store or earlier in the run."""

    fingerprint: str = ""
    prompts: int = 0
    prompts_short: int = 0  # shorter than one chunk: nothing to warm
    chunks_written: int = 0
    chunks_present: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    full_message: str | None = None  # writing stopped: capacity or map full
    started: float = field(default_factory=time.perf_counter, repr=False)

    def summary(self) -> str:
        line = (f"warmed {self.chunks_written} chunks ({format_bytes(self.bytes_written, 2)}) "
                f"in {self.seconds:.1f} s")
        extras = [text for flag, text in (
            (self.chunks_present, f"{self.chunks_present} already present"),
            (self.prompts_short, f"{self.prompts_short} prompt(s) shorter than a chunk"),
            (self.full_message, "stopped: store full")) if flag]
        return line + (f" ({', '.join(extras)})" if extras else "")


def as_buffer(payload: Payload, chunk_bytes: int, what: str) -> memoryview:
    """A flat byte view of one chunk payload, checked to be ``chunk_bytes`` long."""
    if isinstance(payload, torch.Tensor):
        flat = payload.detach().to("cpu").contiguous().reshape(-1)
        view = flat.view(torch.uint8).numpy().data
    elif isinstance(payload, np.ndarray):
        view = np.ascontiguousarray(payload).data.cast("B")
    else:
        try:
            view = memoryview(payload).cast("B")
        except TypeError as exc:
            raise ConfigError(f"warmup: {what} is a {type(payload).__name__}, not bytes, a numpy "
                              f"array or a torch tensor") from exc
    if len(view) != chunk_bytes:
        raise ConfigError(f"warmup: {what} has {len(view)} bytes, a chunk here has {chunk_bytes}")
    return view


class ChunkWriter:
    """Writes chunks of one namespace to the disk tiers of ``ranks``; see the module docstring."""

    def __init__(self, root: Path, namespace: Namespace, chunk_bytes: int, *,
                 ranks: Sequence[int] = (0,), disk_config: DiskTierConfig | None = None,
                 capacity: int | None = None) -> None:
        self.root = Path(root)
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.config = disk_config or DiskTierConfig(path=self.root)
        self.capacity = capacity
        self.tiers: list[DiskTier] = []
        self.num_ranks = len(ranks)
        self._pending: list[tuple[bytes, tuple[memoryview, ...]]] = []
        self._closed = False
        try:
            for rank in ranks:  # claimed: an engine running over the store is refused
                self.tiers.append(DiskTier(self.root, namespace, rank, self.config, chunk_bytes,
                                           exclusive=True))
            held = [{record.key for record in tier.scan()} for tier in self.tiers]
        except BaseException:
            self.close()
            raise
        self._present: set[bytes] = set.intersection(*held) if held else set()
        self._stored = max((len(keys) for keys in held), default=0)
        self._queued: set[bytes] = set()
        self._per_txn = max(1, self.config.write_batch_bytes // chunk_bytes)
        self.written = 0
        self.full_message: str | None = None

    def has(self, key: bytes) -> bool:
        return key in self._present or key in self._queued

    def add(self, key: bytes, payloads: Sequence[Payload]) -> bool:
        """Queue one chunk (one payload per rank); False once writing has stopped."""
        if self.full_message is not None:
            return False
        if len(payloads) != len(self.tiers):
            raise ConfigError(f"warmup: chunk {key[:4].hex()} has {len(payloads)} payload(s), "
                              f"the writer has {len(self.tiers)} rank(s)")
        if self.has(key):
            return True
        if self.capacity is not None and self._stored + len(self._pending) >= self.capacity:
            self.full_message = f"the store reached its capacity of {self.capacity} chunks"
            return False
        buffers = tuple(as_buffer(p, self.chunk_bytes, f"chunk {key[:4].hex()}") for p in payloads)
        self._pending.append((bytes(key), buffers))
        self._queued.add(bytes(key))
        if len(self._pending) >= self._per_txn:
            self.flush()
        return self.full_message is None

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        landed: set[bytes] | None = None
        for position, tier in enumerate(self.tiers):
            result = tier.put_many([(key, buffers[position]) for key, buffers in pending])
            landed = set(result.written) if landed is None else landed & set(result.written)
            if result.full and self.full_message is None:
                self.full_message = result.message or "the disk map is full"
        assert landed is not None
        self._queued.difference_update(key for key, _ in pending)
        self._present.update(landed)
        self._stored += len(landed)
        self.written += len(landed)

    def close(self) -> None:
        """Flush what is queued, sync and close; idempotent."""
        if self._closed:
            return
        try:
            if self.tiers:
                self.flush()
        finally:
            self._closed = True
            tiers, self.tiers = self.tiers, []
            for tier in tiers:
                tier.close()

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def warm_sequence(writer: ChunkWriter, report: WarmupReport, token_ids: Sequence[int],
                  keys: Sequence[bytes], tokens_per_chunk: int,
                  produce: Callable[[list[int]], Sequence[Sequence[Payload]]],
                  on_chunks: Callable[[int], None] | None = None) -> bool:
    """Write the chunks of one sequence that the store lacks. ``produce(prefix)`` gets the
    token ids up to the end of the last missing chunk and returns, per chunk of that prefix,
    one payload per rank. Returns False once the writer stopped (full)."""
    missing = [index for index, key in enumerate(keys) if not writer.has(key)]
    report.chunks_present += len(keys) - len(missing)
    if on_chunks is not None:
        on_chunks(len(keys) - len(missing))
    if not missing:
        return True
    upto = missing[-1] + 1
    chunks = produce([int(token) for token in token_ids[: upto * tokens_per_chunk]])
    if len(chunks) != upto:
        raise ConfigError(f"warmup: the KV producer returned {len(chunks)} chunk payload(s) "
                          f"for {upto * tokens_per_chunk} tokens ({upto} chunks)")
    for index in missing:
        if not writer.add(keys[index], chunks[index]):
            return False
        if on_chunks is not None:
            on_chunks(1)
    return True


def finish_report(report: WarmupReport, writer: ChunkWriter) -> WarmupReport:
    """Fill in what the writer did and the time taken."""
    report.chunks_written = writer.written
    report.bytes_written = writer.written * writer.chunk_bytes * writer.num_ranks
    report.full_message = writer.full_message
    report.seconds = time.perf_counter() - report.started
    return report


def warmup_tokens(
    store_dir: Path | str,
    namespace: Namespace,
    token_ids_iter: Iterable[Sequence[int]],
    kv_producer: KVProducer,
    *,
    chunk_bytes: int,
    tokens_per_chunk: int | None = None,
    rank: int = 0,
    parent: bytes = ROOT_KEY,
    extra: Any = None,
    key_fn: Callable[[Sequence[int]], list[bytes]] | None = None,
    disk_config: DiskTierConfig | None = None,
    capacity: int | None = None,
) -> WarmupReport:
    """Warm a custom engine's store from token ids.

    ``namespace`` and ``chunk_bytes`` are the engine's (``store.namespace`` and
    ``store.chunk_bytes`` of a :class:`~tierkv.engine.store.TierKVStore`); keys default to
    ``chunk_keys(token_ids, tokens_per_chunk, parent, extra)``. ``kv_producer(prefix)`` gets
    the token ids up to the end of the last chunk the store lacks and returns one payload per
    chunk of that prefix, in order, in the slot byte layout (:func:`gather_chunks`)."""
    tpc = namespace.tokens_per_chunk if tokens_per_chunk is None else tokens_per_chunk
    if tpc != namespace.tokens_per_chunk:
        raise ConfigError(f"warmup: tokens_per_chunk={tpc} but the namespace has "
                          f"{namespace.tokens_per_chunk}")

    def default_keys(token_ids: Sequence[int]) -> list[bytes]:
        return list(chunk_keys(token_ids, tpc, parent, extra))

    def produce(prefix: list[int]) -> list[tuple[Payload]]:
        return [(payload,) for payload in kv_producer(prefix)]

    keys_of = key_fn or default_keys
    report = WarmupReport(fingerprint=namespace.fingerprint())
    writer = ChunkWriter(Path(store_dir), namespace, chunk_bytes, ranks=(rank,),
                         disk_config=disk_config, capacity=capacity)
    try:
        for token_ids in token_ids_iter:
            report.prompts += 1
            keys = keys_of(token_ids)
            if not keys:
                report.prompts_short += 1
            elif not warm_sequence(writer, report, token_ids, keys, tpc, produce):
                break
    finally:
        writer.close()
        finish_report(report, writer)
    return report


def gather_chunks(layout: KVLayout, blocks_per_chunk: int,
                  block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Chunk payloads ``uint8 [len(block_ids), chunk_bytes]`` on the layout's device: row
    ``c`` holds blocks ``block_ids[c]`` of the registered KV tensors in the slot byte layout,
    exactly what the worker copies into a CPU slot."""
    rows = [[int(block) for block in chunk] for chunk in block_ids]
    if any(len(row) != blocks_per_chunk for row in rows):
        raise ConfigError(f"warmup: gather_chunks needs {blocks_per_chunk} block ids per chunk, "
                          f"got {[len(row) for row in rows]}")
    out = torch.empty((len(rows), layout.chunk_bytes(blocks_per_chunk)), dtype=torch.uint8,
                      device=layout.device)
    if rows:
        ids = torch.tensor(rows, dtype=torch.int64, device=layout.device)
        layout.gather_batch(layout.chunk_views(out, blocks_per_chunk), 0, ids)
    return out


# ------------------------------------------------------------------------------ vLLM keys
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


def vllm_block_hashes(token_ids: Sequence[int], hash_block_size: int, algorithm: str = "sha256",
                      hash_seed: str | None = None, cache_salt: str | None = None) -> list[bytes]:
    """The ``request.block_hashes`` vLLM 0.33 computes for a text-only request without LoRA:
    block ``i`` hashes ``(parent, tuple(tokens of block i), extra_keys)`` where ``parent``
    is the previous block's hash (NONE_HASH first) and ``extra_keys`` is
    ``(("cache_salt", salt),)`` on the first block of a salted request, else None."""
    hash_fn = vllm_hash_function(algorithm)
    parent = vllm_none_hash(algorithm, hash_seed)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - hash_block_size + 1, hash_block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        block = tuple(int(token) for token in token_ids[start : start + hash_block_size])
        parent = hash_fn((parent, block, extra))
        hashes.append(parent)
    return hashes


# ------------------------------------------------------------------------------ vLLM target
@dataclass(frozen=True)
class VllmTarget:
    """The vLLM 0.33 engine (with tierkv's connector) that the warmed chunks are for. Each
    field mirrors a vLLM or connector setting (a wrong one gives chunks no engine looks up):
    ``model_id`` is vLLM's ``--model`` as given, ``hash_seed`` the server's PYTHONHASHSEED
    (None: unset), ``tokens_per_chunk`` and ``disk_bytes`` the connector's settings."""

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
    vllm_version: str = "0.33.0"

    def __post_init__(self) -> None:
        for name, option in (("num_layers", "--model"), ("num_kv_heads", "--model"),
                             ("head_size", "--model"), ("block_size", "--block-size"),
                             ("tensor_parallel_size", "--tensor-parallel-size"),
                             ("disk_bytes", "--disk-bytes")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"warmup: {name}={value!r} ({option}) must be a positive int")
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

    def rank_heads(self, rank: int) -> slice:
        """KV heads of ``rank``: contiguous runs, replicated when heads < ranks (as vLLM)."""
        per = self.heads_per_rank
        first = rank * per if self.num_kv_heads >= self.tensor_parallel_size else \
            rank * self.num_kv_heads // self.tensor_parallel_size
        return slice(first, first + per)

    @property
    def content_bytes(self) -> int:
        element = torch.empty((), dtype=_DTYPES[self.dtype]).element_size()
        return (self.head_size + (self.head_size_v or self.head_size)) * element

    @property
    def chunk_bytes(self) -> int:  # one chunk on one rank: the disk payload
        return self.geometry().chunk_bytes

    @property
    def disk_capacity(self) -> int:  # chunks the connector keeps (it trims the oldest at start)
        return self.geometry().disk_capacity

    def geometry(self) -> Geometry:
        """The connector's :class:`~tierkv.integrations.vllm_config.Geometry` of this engine."""
        blocks = self.chunk_tokens // self.block_size
        page = self.heads_per_rank * self.block_size * self.content_bytes
        return Geometry(
            layer_names=tuple(f"model.layers.{index}.self_attn.attn" for index in range(self.num_layers)),
            block_size=self.block_size, hash_block_size=self.hash_block, blocks_per_chunk=blocks,
            page_bytes=page, num_heads=self.heads_per_rank, content_bytes=self.content_bytes,
            dtype=self.dtype, layout=self.kv_cache_layout, page_order=PAGE_ORDER[self.kv_cache_layout],
            world_size=self.tensor_parallel_size, num_slots=1,
            disk_capacity=self.disk_bytes // ((page * self.num_layers * blocks + DISK_OVERHEAD_BYTES)
                                              * self.tensor_parallel_size))

    def _environ(self) -> dict[str, str]:
        return {} if self.hash_seed is None else {"PYTHONHASHSEED": self.hash_seed}

    def namespace(self) -> Namespace:
        """The connector's namespace for this engine (``vllm_config.build_namespace``)."""
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=self.model_id, revision=self.revision, quantization=None),
            cache_config=SimpleNamespace(prefix_caching_hash_algo=self.hash_algo, cache_dtype="auto"),
            num_hash_lookahead_tokens=0)
        return build_namespace(vllm_config, self.geometry(), self.vllm_version, self._environ())

    def disk_config(self, store_dir: Path) -> DiskTierConfig:
        """The per-rank disk tier config the connector opens the store with."""
        settings = ConnectorSettings(disk_path=str(store_dir), disk_bytes=self.disk_bytes,
                                     tokens_per_chunk=self.chunk_tokens)
        check_hash_stability(self.hash_algo, settings, self._environ())
        config: DiskTierConfig = disk_tier_config(settings, self.geometry())
        return config

    def chunk_keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Keys of the full chunks of ``token_ids``, as the connector derives them."""
        full = len(token_ids) // self.chunk_tokens * self.chunk_tokens
        hashes = vllm_block_hashes(token_ids[:full], self.hash_block, self.hash_algo,
                                   self.hash_seed, cache_salt)
        return chunk_keys_from_block_hashes(hashes, self.chunk_tokens // self.hash_block)

    def pack(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per rank, ``uint8 [num_chunks, chunk_bytes]`` from HF-style per-layer K and V
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
        for rank in range(self.tensor_parallel_size):
            rows = []
            for cells in per_layer:
                part = cells[self.rank_heads(rank)]  # [h, S, C]
                h, _, c = part.shape
                if PAGE_ORDER[self.kv_cache_layout] == "NHD":
                    pages = part.permute(1, 0, 2)  # [S, h, C]: each block's page is [N, h, C]
                else:
                    pages = part.reshape(h, num_chunks * tpc // bs, bs, c).permute(1, 0, 2, 3)
                rows.append(pages.reshape(num_chunks, -1))
            chunk = torch.stack(rows, dim=1).contiguous()  # [chunks, L, page elements x blocks]
            out.append(chunk.view(num_chunks, -1).view(torch.uint8).to("cpu"))
        return out
