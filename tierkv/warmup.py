"""Warm-up: write KV chunks into a store's disk tier before any engine ran the prompts.

A warmed chunk is one the engine could have stored itself: same namespace, key and payload
bytes, so an engine starting over the store serves it as a prefix hit (``docs/warmup.md``).
Primitives (``tierkv warmup``, :mod:`tierkv.warmup_hf`, drives them from a HF model):

- :class:`ChunkWriter`  one namespace, one or more ranks: skips keys present on every rank
  (a rerun resumes) or queued earlier, writes transactions of ~``disk.write_batch_bytes``,
  stops at ``capacity`` chunks or a full map (``full_message``); ``close()`` flushes, syncs.
- :func:`warmup_tokens`  custom engines: token id sequences and a KV producer -> chunks.
- :func:`gather_chunks`  a producer's helper: the engine's KV blocks -> the worker's bytes.
- :class:`WarmupReport`  the counts and the one summary line.

It knows no engine: the vLLM target is :mod:`tierkv.integrations.vllm_warmup`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv.config import DiskTierConfig
from tierkv.errors import ConfigError, UsageError
from tierkv.keys import ROOT_KEY, Namespace, Part, chunk_keys
from tierkv.tiers.disk.opener import close_disk, open_disk
from tierkv.tiers.disk.tier import DiskTier
from tierkv.transfer.layout import KVLayout
from tierkv.units import format_bytes

Payload = Any  # bytes-like, numpy array or torch tensor of exactly chunk_bytes bytes
KVProducer = Callable[[list[int]], Iterable[Payload]]


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
            raise UsageError(f"warmup: {what} is a {type(payload).__name__}, not bytes, a numpy "
                              f"array or a torch tensor") from exc
    if len(view) != chunk_bytes:
        raise UsageError(f"warmup: {what} has {len(view)} bytes, a chunk here has {chunk_bytes}")
    return view


class ChunkWriter:
    """Writes chunks of one namespace to the disk tiers of ``ranks``; see the module docstring."""

    def __init__(self, root: Path, namespace: Namespace, chunk_bytes: int, *,
                 ranks: Sequence[Part | int] = (0,), disk_config: DiskTierConfig | None = None,
                 capacity: int | None = None) -> None:
        self.root = Path(root)
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.config = replace(disk_config or DiskTierConfig(), path=self.root)
        self.capacity = capacity
        self.tiers: list[DiskTier] = []
        self.num_ranks = len(ranks)
        self._pending: list[tuple[bytes, tuple[memoryview, ...]]] = []
        try:
            for rank in ranks:  # claimed: an engine running over the store is refused
                self.tiers.append(open_disk(self.config, namespace, rank, "writer",
                                            payload_bytes=chunk_bytes))
            held = [{record.key for record in tier.scan()} for tier in self.tiers]
        except BaseException:
            self.close()
            raise
        self._present: set[bytes] = set.intersection(*held) if held else set()
        self._stored = max((len(keys) for keys in held), default=0)
        self._queued: set[bytes] = set()
        self.written = 0
        self.full_message: str | None = None

    def has(self, key: bytes) -> bool:
        return key in self._present or key in self._queued

    def add(self, key: bytes, payloads: Sequence[Payload]) -> bool:
        """Queue one chunk (one payload per rank); False once writing has stopped."""
        if self.full_message is not None:
            return False
        if len(payloads) != len(self.tiers):
            raise UsageError(f"warmup: chunk {key[:4].hex()} has {len(payloads)} payload(s), "
                              f"the writer has {len(self.tiers)} rank(s)")
        if self.has(key):
            return True
        if self.capacity is not None and self._stored + len(self._pending) >= self.capacity:
            self.full_message = f"the store reached its capacity of {self.capacity} chunks"
            return False
        buffers = tuple(as_buffer(p, self.chunk_bytes, f"chunk {key[:4].hex()}") for p in payloads)
        self._pending.append((bytes(key), buffers))
        self._queued.add(bytes(key))
        if len(self._pending) >= self.tiers[0].per_txn(self.config.write_batch_bytes):
            self.flush()  # whole write transactions only
        return self.full_message is None

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        results = []
        for position, tier in enumerate(self.tiers):
            result = tier.put_in_batches([(key, buffers[position]) for key, buffers in pending],
                                         self.config.write_batch_bytes)
            if result.error is not None:
                raise result.error
            results.append(result)
        landed = set.intersection(*(set(result.written) for result in results))
        full = [result.message for result in results if result.full]
        if full and self.full_message is None:
            self.full_message = full[0] or "the disk map is full"
        self._queued.difference_update(key for key, _ in pending)
        self._present.update(landed)
        self._stored += len(landed)
        self.written += len(landed)

    def close(self) -> None:
        """Flush what is queued, sync and close; idempotent."""
        try:
            if self.tiers:
                self.flush()
        finally:
            tiers, self.tiers = self.tiers, []
            for tier in tiers:
                close_disk(tier, writer=True)

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def warm_sequence(writer: ChunkWriter, report: WarmupReport, token_ids: Sequence[int],
                  keys: Sequence[bytes], tokens_per_chunk: int,
                  produce: Callable[[list[int]], Sequence[Sequence[Payload]]],
                  on_chunks: Callable[[int], None] = lambda count: None) -> bool:
    """Write the chunks of one sequence that the store lacks. ``produce(prefix)`` gets the
    token ids up to the end of the last missing chunk and returns, per chunk of that prefix,
    one payload per rank. Returns False once the writer stopped (full)."""
    missing = [index for index, key in enumerate(keys) if not writer.has(key)]
    report.chunks_present += len(keys) - len(missing)
    on_chunks(len(keys) - len(missing))
    if not missing:
        return True
    upto = missing[-1] + 1
    chunks = produce([int(token) for token in token_ids[: upto * tokens_per_chunk]])
    if len(chunks) != upto:
        raise UsageError(f"warmup: the KV producer returned {len(chunks)} chunk payload(s) "
                          f"for {upto * tokens_per_chunk} tokens ({upto} chunks)")
    for index in missing:
        if not writer.add(keys[index], chunks[index]):
            return False
        on_chunks(1)
    return True


def finish_report(report: WarmupReport, writer: ChunkWriter) -> WarmupReport:
    """Close ``writer`` and, even if closing raises, fill in what it did and the time taken."""
    try:
        writer.close()
    finally:
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
    rank: Part | int = 0,
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

    def produce(prefix: list[int]) -> list[tuple[Payload]]:
        return [(payload,) for payload in kv_producer(prefix)]

    keys_of = key_fn or (lambda token_ids: list(chunk_keys(token_ids, tpc, parent, extra)))
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
        finish_report(report, writer)
    return report


def gather_chunks(layout: KVLayout, blocks_per_chunk: int,
                  block_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Chunk payloads ``uint8 [len(block_ids), chunk_bytes]`` on the layout's device: row
    ``c`` holds blocks ``block_ids[c]`` of the registered KV tensors in the slot byte layout,
    exactly what the worker copies into a CPU slot."""
    rows = [[int(block) for block in chunk] for chunk in block_ids]
    if any(len(row) != blocks_per_chunk for row in rows):
        raise UsageError(f"warmup: gather_chunks needs {blocks_per_chunk} block ids per chunk, "
                          f"got {[len(row) for row in rows]}")
    out = torch.empty((len(rows), layout.chunk_bytes(blocks_per_chunk)), dtype=torch.uint8,
                      device=layout.device)
    if rows:
        ids = torch.tensor(rows, dtype=torch.int64, device=layout.device)
        layout.gather_batch(layout.chunk_views(out, blocks_per_chunk), 0, ids)
    return out
