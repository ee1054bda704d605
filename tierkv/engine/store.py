"""TierKVStore: the library API for custom engines, both sides in one process (a runnable
example: README.md).

Primitives:
- ``lookup(keys) -> int``: chunks in the ready, contiguous prefix (no side effects).
- ``store(keys, block_ids) -> JobId | None``: copies the chunks not yet present. When
  the CPU tier is full of chunks not yet on disk it writes the oldest back first (a
  blocking disk write); when nothing can be freed, "no room" is counted in
  ``statistics()``, never raised.
- ``load(keys, block_ids) -> LoadHandle``: loads the ready prefix; the completion's
  ``failed_keys`` name chunks that did not land (recompute those; never a false hit).
- With a remote tier (``config.remote``), ``lookup`` and ``load`` also ask it for the chunks
  past the local prefix and wait at most ``remote.lookup_deadline_seconds`` for the answer
  (a late answer serves the next call); what it has is loaded remote -> CPU slot -> GPU.
  Stored chunks are pushed to it in the background (``remote.push``).
- ``poll() -> list[Completion]``: finished store and load jobs, each once.
- ``wait(job_ids)``; ``statistics()``; ``close()`` (idempotent; use after raises).

Inputs are checked before anything changes, with :class:`ConfigError` naming what is
wrong: keys are 32-byte ``bytes``; ``block_ids`` is one sequence per chunk
(``blocks_per_chunk`` ids each) or one flat sequence, of ints (numpy integers, integer
arrays and tensors too; never floats or bools) in ``[0, num_blocks)``; job ids are what
``store``/``load`` returned.

Not thread-safe, and not for a forked child: a call that overlaps another one, or any call
from a child, raises :class:`UsageError` and changes nothing. Opening claims the disk
environment (a second store on it is refused); a failed construction releases all it took.
Why: docs/operations.md ("Fork", "Threads", "One writer per environment"). Spills and
completions advance on every call; ``poll()`` in the engine loop keeps them moving.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from tierkv.config import StoreConfig, cpu_slot_count, disk_chunk_capacity
from tierkv.core.index import IndexStats
from tierkv.core.jobs import ChunkCopy, Completion, JobId, JobKind, LoadSpec, StoreSpec
from tierkv.engine.adapter import lookup_tiers
from tierkv.engine.metrics import PATH_NAMES, Durations, config_info, remote_figures, usage_figures
from tierkv.engine.stack import build_index, build_remote_lookup, build_worker
from tierkv.errors import ClosedError, ConfigError, TierKVError, UsageError
from tierkv.keys import KEY_BYTES, Namespace
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.disk_files import empty_namespace_warning
from tierkv.transfer.layout import KVLayout

if TYPE_CHECKING:
    from tierkv.tiers.remote import RemoteStatistics
    from tierkv.transfer.remote_io import RemoteIOStatistics
    from tierkv.transfer.remote_lookup import RemoteLookupStatistics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadHandle:
    job_id: JobId | None
    num_chunks: int  # chunks the job loads (a prefix of the keys asked for)
    num_from_disk: int
    num_from_remote: int = 0


@dataclass(frozen=True)
class PathStats:
    num_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class StoreStats:
    index: IndexStats
    gpu_to_cpu: PathStats
    cpu_to_gpu: PathStats  # includes disk -> CPU reads of promoted chunks
    cpu_to_disk: PathStats
    chunk_bytes: int
    remote: RemoteStats | None = None  # None: no remote tier


@dataclass(frozen=True)
class RemoteStats:
    """The remote tier's figures: its counters, its pushes and the lookups asked of it."""

    tier: RemoteStatistics
    pushes: RemoteIOStatistics | None  # None: remote.push="read_only"
    lookups: RemoteLookupStatistics


def build_namespace(
    layout: KVLayout, model_id: str, tokens_per_block: int, config: StoreConfig, tp_size: int = 1
) -> Namespace:
    """Everything that decides what this store's chunk bytes mean: the layout (dtype, page
    shapes and memory order), the layers' names in registration order, and how a chunk's
    tokens split into blocks."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) \
            or tokens_per_block <= 0:
        raise ConfigError(f"store: tokens_per_block must be a positive int, got {tokens_per_block!r}")
    return Namespace(
        model_id=model_id,
        dtype=layout.dtype_name,
        kv_layout=layout.describe(),
        page_bytes=sum(layout.page_bytes),
        tokens_per_chunk=tokens_per_block * config.blocks_per_chunk,
        num_layers=layout.num_layers,
        tp_size=tp_size,
        layer_names=layout.layer_names,
        blocks_per_chunk=config.blocks_per_chunk,
        chunk_bytes=layout.chunk_bytes(config.blocks_per_chunk),
    )


def _block_rows(block_ids: Any) -> list[Any]:
    """``block_ids`` (a sequence, numpy array or tensor of ints, or of such rows) as a list."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
            raise ConfigError(f"store: block ids must be integers, got a {block_ids.dtype} tensor")
        return list(block_ids.tolist()) if block_ids.dim() else [int(block_ids)]
    if isinstance(block_ids, np.ndarray):
        if block_ids.dtype.kind not in "iu":
            raise ConfigError(f"store: block ids must be integers, got a {block_ids.dtype} array")
        return list(block_ids.tolist()) if block_ids.ndim else [int(block_ids)]
    if isinstance(block_ids, (str, bytes, bytearray, Mapping)) or not isinstance(block_ids, Iterable):
        raise ConfigError(f"store: block ids must be a sequence of ints (one flat sequence, or one "
                          f"per chunk), got {block_ids!r:.60}")
    return list(block_ids)


def _block_id(block: Any) -> int:
    """One block id as an int: ints and numpy integers (never bools or floats)."""
    if isinstance(block, (bool, np.bool_)) or isinstance(block, (float, np.floating)):
        raise ConfigError(f"store: block id {block!r} is not an int")
    try:
        return operator.index(block)
    except TypeError as exc:
        raise ConfigError(f"store: block id {block!r:.40} is not an int") from exc


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_caller(method: Callable[Concatenate[TierKVStore, _P], _R]
                ) -> Callable[Concatenate[TierKVStore, _P], _R]:
    """Refuse a call from a forked child, or one that overlaps another call (two threads):
    misuse fails loudly before it changes anything, it never serves wrong KV."""

    @functools.wraps(method)
    def guarded(self: TierKVStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if os.getpid() != self._pid:
            raise UsageError(
                f"store: {method.__name__}() in a forked child (pid {os.getpid()}) of the "
                f"process that created the store (pid {self._pid}); its threads, LMDB "
                f"environment and CUDA streams do not survive fork(): create the store in "
                f"the child, or use the spawn start method")
        if not self._busy.acquire(blocking=False):
            raise UsageError(
                f"store: {method.__name__}() while another call is running (thread "
                f"{threading.current_thread().name}); the store is not thread-safe: call it "
                f"from one thread at a time, or give each thread its own store")
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return guarded


class TierKVStore:
    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        model_id: str | None = None,
        tokens_per_block: int = 16,
        config: StoreConfig | None = None,
        namespace: Namespace | None = None,
    ) -> None:
        self._pid = os.getpid()
        self._busy = threading.Lock()
        self._closed = False
        self.config = config or StoreConfig()
        if not isinstance(self.config, StoreConfig):
            raise ConfigError(f"store: config must be a StoreConfig, got a "
                              f"{type(self.config).__name__} (StoreConfig.from_dict reads a dict)")
        cfg = self.config
        self.layout = KVLayout.from_tensors(kv_caches)
        if namespace is None:
            if not model_id or not isinstance(model_id, str):
                raise ConfigError("store: pass model_id (or a Namespace) so stored KV is tied to its model")
            namespace = build_namespace(self.layout, model_id, tokens_per_block, cfg)
        else:
            self._check_namespace(namespace)
        self.namespace = namespace
        self.blocks_per_chunk = cfg.blocks_per_chunk
        self.tokens_per_chunk = namespace.tokens_per_chunk
        self.chunk_bytes = self.layout.chunk_bytes(cfg.blocks_per_chunk)
        num_slots = cpu_slot_count(cfg.cpu.max_bytes, self.chunk_bytes)
        if num_slots < 1:
            raise ConfigError(
                f"cpu tier: cpu.max_bytes={cfg.cpu.max_bytes} holds no chunk of "
                f"{self.chunk_bytes} bytes (raise cpu.max_bytes or lower blocks_per_chunk)"
            )
        open_disk = None if cfg.disk.path is None else functools.partial(
            DiskTier, cfg.disk.path, namespace, cfg.rank, cfg.disk, self.chunk_bytes,
            exclusive=True)
        self._stack = build_worker(cfg, self.layout, num_slots, open_disk=open_disk,
                                   namespace=namespace)
        self.slab, self.disk, self.executor = self._stack.slab, self._stack.disk, self._stack.executor
        self._remote = None
        try:
            self._remote = build_remote_lookup(cfg, namespace, (cfg.rank,), self.chunk_bytes)
            disk_capacity = 0
            if self.disk is not None:
                disk_capacity = disk_chunk_capacity(cfg.disk.max_bytes, self.chunk_bytes)
                if disk_capacity < 1:
                    log.warning("disk tier: disk.max_bytes=%d holds no chunk; the disk tier stays "
                                "empty", cfg.disk.max_bytes)
            self.index = build_index(cfg, num_slots, disk_capacity)
            if self.disk is not None:
                records = sorted(self.disk.scan(), key=lambda record: record.seq)
                found = self.index.add_on_disk(record.key for record in records)
                if found < len(records):  # the oldest over the cap, deleted with the next spill
                    log.warning("tierkv: deleting %d of the %d chunk(s) found on disk at start: "
                                "they are over disk.max_bytes=%d", len(records) - found,
                                len(records), cfg.disk.max_bytes)
                warning = empty_namespace_warning(Path(cfg.disk.path), namespace, found) \
                    if cfg.disk.path is not None else None
                if warning:
                    log.warning("tierkv: %s", warning)
        except BaseException:
            self._closed = True
            self._close_parts()
            raise
        self._bytes = {kind: [0, 0.0] for kind in JobKind}
        self._failed_jobs = dict.fromkeys(JobKind, 0)
        self._durations = {kind: Durations() for kind in JobKind}
        self._looked_up = dict.fromkeys(("queried", "cpu", "disk", "remote"), 0)  # chunks
        self._ready: list[Completion] = []

    def _check_namespace(self, namespace: Namespace) -> None:
        """A namespace given by the caller must describe these tensors and this config: what
        decides the bytes' meaning is not the caller's to choose (model id, TP size, hash
        scheme and extra are)."""
        if not isinstance(namespace, Namespace):
            raise ConfigError(f"store: namespace must be a Namespace, got {namespace!r}")
        bpc = self.config.blocks_per_chunk
        if namespace.tokens_per_chunk % bpc:
            raise ConfigError(f"store: namespace tokens_per_chunk={namespace.tokens_per_chunk} "
                              f"is not a multiple of blocks_per_chunk={bpc}")
        own = build_namespace(self.layout, namespace.model_id, namespace.tokens_per_chunk // bpc,
                              self.config, namespace.tp_size)
        for name in ("dtype", "kv_layout", "page_bytes", "num_layers", "layer_names",
                     "blocks_per_chunk", "chunk_bytes"):
            if getattr(namespace, name) != getattr(own, name):
                raise ConfigError(
                    f"store: the namespace says {name}={getattr(namespace, name)!r}, the KV "
                    f"tensors and config give {getattr(own, name)!r}; build it with "
                    f"tierkv.engine.store.build_namespace (and dataclasses.replace for model "
                    f"id, hash scheme or extra)")

    # ------------------------------------------------------------------ API
    @_one_caller
    def lookup(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        self._check_keys(keys)
        self._pump()
        found = lookup_tiers(self.index, self._remote, keys)[0]
        counts = self._looked_up
        counts["queried"] += len(keys)
        counts["cpu"] += found.num_on_cpu
        counts["remote"] += found.num_remote
        counts["disk"] += found.num_hits - found.num_on_cpu - found.num_remote
        return found.num_hits

    @_one_caller
    def store(self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]) -> JobId | None:
        self._check_open()
        self._check_keys(keys)
        per_chunk = self._split_blocks(keys, block_ids)
        self._pump()
        short = self.index.shortfall(keys)
        if short:
            self._make_room(short)
        plan = self.index.prepare_store(keys)
        if plan.job_id is None:
            return None
        blocks = dict(zip(keys, per_chunk))
        chunks = tuple(ChunkCopy(key, slot, blocks[key]) for key, slot in plan.chunks)
        self.executor.submit(StoreSpec.of(plan.job_id, chunks))
        return plan.job_id

    @_one_caller
    def load(self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]) -> LoadHandle:
        self._check_open()
        self._check_keys(keys)
        per_chunk = self._split_blocks(keys, block_ids)
        self._pump()
        hits = lookup_tiers(self.index, self._remote, keys)[0].num_hits
        plan = self.index.prepare_load(keys[:hits])
        if plan.job_id is None:
            return LoadHandle(None, 0, 0)
        chunks = tuple(
            ChunkCopy(key, slot, per_chunk[position], from_disk,
                      from_remote=key in plan.from_remote)
            for position, (key, slot, from_disk) in enumerate(plan.chunks)
        )
        self.executor.submit(LoadSpec(plan.job_id, chunks))
        return LoadHandle(plan.job_id, len(chunks), sum(c.from_disk for c in chunks),
                          len(plan.from_remote))

    @_one_caller
    def poll(self) -> list[Completion]:
        self._check_open()
        self._pump()
        ready, self._ready = self._ready, []
        return ready

    @_one_caller
    def wait(self, job_ids: Iterable[JobId | None]) -> None:
        self._check_open()
        if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
            raise ConfigError(f"store: wait() takes a list of job ids, got {job_ids!r:.60}")
        wanted: list[JobId] = []
        for job_id in job_ids:
            if job_id is None:
                continue
            if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)) or job_id < 1:
                raise ConfigError(f"store: wait() on {job_id!r:.40}, which is not a job id "
                                  f"(store() and load() return them)")
            wanted.append(JobId(int(job_id)))
        self.executor.wait(wanted)
        self._pump()

    @_one_caller
    def drain(self) -> None:
        """Wait until every job in flight (spills included) has finished."""
        self._check_open()
        self._drain()

    @_one_caller
    def flush(self) -> None:
        """Write every chunk of the CPU tier that is not on disk yet, and wait."""
        self._check_open()
        self._flush()

    @_one_caller
    def statistics(self) -> StoreStats:
        def path(kind: JobKind) -> PathStats:
            num_bytes, seconds = self._bytes[kind]
            return PathStats(int(num_bytes), float(seconds))

        remote = None
        if self._remote is not None and self._stack.remote is not None:
            pusher = self.executor.pusher
            remote = RemoteStats(self._stack.remote.statistics(),
                                 pusher.statistics() if pusher is not None else None,
                                 self._remote.statistics())
        return StoreStats(
            index=self.index.statistics(),
            gpu_to_cpu=path(JobKind.STORE),
            cpu_to_gpu=path(JobKind.LOAD),
            cpu_to_disk=path(JobKind.SPILL),
            chunk_bytes=self.chunk_bytes,
            remote=remote,
        )

    def figures(self) -> dict[str, float | Durations]:
        """The figures :mod:`tierkv.engine.metrics` exports (counters since the store opened,
        usage now), by figure key. Unlike the other methods, safe to call from another thread
        (a Prometheus scrape): it only reads counters."""
        tpc = self.tokens_per_chunk
        index = self.index.statistics()
        out: dict[str, float | Durations] = {name: value for name, value in vars(index).items()}
        out["queried_tokens"] = self._looked_up["queried"] * tpc
        for tier in ("cpu", "disk", "remote"):
            out[f"hit_tokens_{tier}"] = self._looked_up[tier] * tpc
        for kind, name in PATH_NAMES.items():
            out[f"bytes_{name}"], out[f"seconds_{name}"] = self._bytes[kind]
            out[f"failed_jobs_{name}"] = self._failed_jobs[kind]
            out[f"durations_{name}"] = self._durations[kind]
        out.update(usage_figures(index, self.chunk_bytes))
        if self._remote is not None and self._stack.remote is not None:
            pusher = self.executor.pusher
            out.update(remote_figures([self._stack.remote.statistics(),
                                       self._remote.tier.statistics()],
                                      pusher.statistics() if pusher is not None else None))
        return out

    def config_info(self) -> dict[str, str]:
        """The labels of ``tierkv:config_info``: the effective settings (no secret), the
        version and the namespace fingerprint."""
        from tierkv import __version__

        return config_info(self.config, version=__version__,
                           namespace=self.namespace.fingerprint())

    @_one_caller
    def close(self) -> None:
        """Flush the CPU tier to disk, stop the threads, release the disk tier; idempotent.
        Nothing the store's cache did can make it raise."""
        if self._closed:
            return
        try:
            self._flush()  # without a disk tier: a drain
        except TierKVError as exc:
            # A disk tier that broke underneath loses its unflushed chunks; closing the
            # store must still succeed (the engine never fails because its cache did).
            log.warning("tierkv: close could not flush the CPU tier to disk: %s", exc)
        finally:
            self._closed = True
            self._close_parts()

    def _close_parts(self) -> None:
        try:
            if self._remote is not None:
                self._remote.shutdown()
        finally:
            self._stack.close()

    def __enter__(self) -> TierKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("store: used after close()")

    def _drain(self) -> None:
        while self.index.jobs_in_flight():
            in_flight = self.executor.in_flight_ids()
            assert in_flight, "block index holds jobs the worker never received"
            self.executor.wait(in_flight)
            self._pump()

    def _flush(self) -> None:
        self._drain()
        spec = self.index.take_spills(flush=True)
        if spec is not None:
            self.executor.submit(spec)
        self._drain()
        if self.disk is not None:
            self.disk.sync()

    @staticmethod
    def _check_keys(keys: Sequence[bytes]) -> None:
        if isinstance(keys, (str, bytes, bytearray)) or not isinstance(keys, Sequence):
            raise ConfigError(f"store: keys must be a sequence of {KEY_BYTES}-byte chunk keys "
                              f"(tierkv.chunk_keys), got {type(keys).__name__}")
        for key in keys:
            if type(key) is not bytes or len(key) != KEY_BYTES:
                raise ConfigError(
                    f"store: chunk key {key!r:.48} is not {KEY_BYTES} bytes (use "
                    f"tierkv.chunk_keys, or bytes of a {KEY_BYTES}-byte hash)")

    def _split_blocks(
        self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]
    ) -> list[tuple[int, ...]]:
        bpc = self.blocks_per_chunk
        rows = _block_rows(block_ids)
        if rows and not isinstance(rows[0], (int, np.integer, torch.Tensor)):
            per_chunk = [tuple(_block_id(b) for b in _block_rows(chunk)) for chunk in rows]
        else:
            flat = [_block_id(b) for b in rows]
            per_chunk = [tuple(flat[i : i + bpc]) for i in range(0, len(flat), bpc)]
        if len(per_chunk) < len(keys) or any(len(chunk) != bpc for chunk in per_chunk[: len(keys)]):
            raise ConfigError(
                f"store: {len(keys)} chunk key(s) need {len(keys)} x {bpc} block ids "
                f"(blocks_per_chunk={bpc}), got {[len(c) for c in per_chunk]}"
            )
        num_blocks = self.layout.num_blocks
        for chunk in per_chunk[: len(keys)]:
            for block in chunk:
                if not 0 <= block < num_blocks:
                    raise ConfigError(f"store: block id {block} out of range [0, {num_blocks})")
        return per_chunk

    def _make_room(self, num_chunks: int) -> None:
        """Write back the oldest chunks not on disk yet and wait for every spill in flight,
        so that their slots can take new chunks. The library store blocks here (a disk
        write) rather than drop a store; the engine adapter never blocks and relies on
        spill-ahead."""
        spec = self.index.take_spills(at_least=num_chunks)
        if spec is not None:
            self.executor.submit(spec)
        spills = self.index.spill_jobs()
        if spills:
            self.executor.wait(spills)
            self._pump()

    def _pump(self) -> None:
        """Apply finished jobs to the index and start the spills it asks for."""
        for completion in self.executor.poll_finished():
            kind = self.index.job_kind(completion.job_id)
            self.index.complete(completion)
            if kind is not None:
                totals = self._bytes[kind]
                totals[0] += completion.num_bytes
                totals[1] += completion.seconds
                self._durations[kind].observe(completion.seconds)
                if not completion.ok:
                    self._failed_jobs[kind] += 1
            if kind in (JobKind.STORE, JobKind.LOAD):
                self._ready.append(completion)
            if completion.error and not completion.ok:
                log.warning("tierkv: job %s failed: %s", completion.job_id, completion.error)
        spec = self.index.take_spills()
        if spec is not None:
            self.executor.submit(spec)

