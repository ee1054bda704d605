"""TierKVStore: the library API for custom engines, both sides in one process.

    store = TierKVStore(kv_caches, model_id="my-model", tokens_per_block=16,
                        config=StoreConfig(blocks_per_chunk=16,
                                           cpu=CpuTierConfig(max_bytes=8 << 30),
                                           disk=DiskTierConfig(path="/var/cache/tierkv")))
    keys = chunk_keys(token_ids, store.tokens_per_chunk)
    num_hit = store.lookup(keys)                 # ready prefix across CPU and disk
    job = store.load(keys[:num_hit], block_ids)  # async disk -> CPU -> GPU
    store.wait([job.job_id]); done = store.poll()
    store.store(keys, block_ids)                 # async GPU -> CPU (-> disk by spill)
    store.close()                                # flushes the CPU tier to disk

Primitives:
- ``lookup(keys) -> int``: chunks in the ready, contiguous prefix (no side effects).
- ``store(keys, block_ids) -> JobId | None``: copies the chunks not yet present. When
  the CPU tier is full of chunks not yet on disk it writes the oldest back first (a
  blocking disk write); when nothing can be freed, "no room" is counted in
  ``statistics()``, never raised.
- ``load(keys, block_ids) -> LoadHandle``: loads the ready prefix; the completion's
  ``failed_keys`` name chunks that did not land (recompute those; never a false hit).
- ``poll() -> list[Completion]``: finished store and load jobs, each once.
- ``wait(job_ids)``; ``statistics()``; ``close()`` (idempotent; use after raises).

``block_ids`` is one list per chunk (``blocks_per_chunk`` ids each) or one flat list.
Not thread-safe: call it from one engine thread. Spills and completions advance on every
call; ``poll()`` in the engine loop keeps them moving.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.config import StoreConfig
from tierkv.core.index import BlockIndex, IndexStats
from tierkv.core.jobs import ChunkCopy, Completion, JobId, JobIds, JobKind, LoadSpec, StoreSpec
from tierkv.engine.executor import JobExecutor
from tierkv.errors import BrokenError, ClosedError, ConfigError
from tierkv.keys import Namespace
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk import DiskTier
from tierkv.transfer.disk_io import DiskIO
from tierkv.transfer.factory import make_transfer_engine
from tierkv.transfer.layout import KVLayout

log = logging.getLogger(__name__)

# Per-chunk disk overhead assumed for capacity accounting (value header + LMDB pages).
DISK_OVERHEAD_BYTES = 8192


@dataclass(frozen=True)
class LoadHandle:
    job_id: JobId | None
    num_chunks: int  # chunks the job loads (a prefix of the keys asked for)
    num_from_disk: int


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


def build_namespace(
    layout: KVLayout, model_id: str, tokens_per_block: int, config: StoreConfig, tp_size: int = 1
) -> Namespace:
    return Namespace(
        model_id=model_id,
        dtype=layout.dtype_name,
        kv_layout=layout.describe(),
        page_bytes=sum(layout.page_bytes),
        tokens_per_chunk=tokens_per_block * config.blocks_per_chunk,
        num_layers=layout.num_layers,
        tp_size=tp_size,
    )


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
        self.config = config or StoreConfig()
        cfg = self.config
        self.layout = KVLayout.from_tensors(kv_caches)
        if namespace is None:
            if not model_id:
                raise ConfigError("store: pass model_id (or a Namespace) so stored KV is tied to its model")
            namespace = build_namespace(self.layout, model_id, tokens_per_block, cfg)
        self.namespace = namespace
        self.blocks_per_chunk = cfg.blocks_per_chunk
        self.tokens_per_chunk = namespace.tokens_per_chunk
        self.chunk_bytes = self.layout.chunk_bytes(cfg.blocks_per_chunk)
        num_slots = cfg.cpu.max_bytes // self.chunk_bytes
        if num_slots < 1:
            raise ConfigError(
                f"cpu tier: cpu.max_bytes={cfg.cpu.max_bytes} holds no chunk of "
                f"{self.chunk_bytes} bytes (raise cpu.max_bytes or lower blocks_per_chunk)"
            )
        self.slab = CpuSlab(num_slots, self.chunk_bytes, cfg.cpu.pin_memory)
        transfer = make_transfer_engine(cfg.device, self.layout, self.slab, cfg.blocks_per_chunk)
        self.disk: DiskTier | None = None
        disk_io: DiskIO | None = None
        disk_capacity = 0
        if cfg.disk.path is not None:
            self.disk = DiskTier(Path(cfg.disk.path), namespace, cfg.rank, cfg.disk, self.chunk_bytes)
            disk_io = DiskIO(self.disk, self.slab, cfg.disk.write_batch_bytes)
            disk_capacity = max(cfg.disk.max_bytes // (self.chunk_bytes + DISK_OVERHEAD_BYTES), 0)
            if disk_capacity < 1:
                log.warning("disk tier: disk.max_bytes=%d holds no chunk; the disk tier stays empty",
                            cfg.disk.max_bytes)
        self.executor = JobExecutor(transfer, disk_io)
        self.index = BlockIndex(
            num_slots,
            disk_capacity,
            write_through=cfg.disk.write_through,
            spill_ahead_fraction=cfg.cpu.spill_ahead_fraction,
            retry_after_full_seconds=cfg.disk.retry_after_full_seconds,
            job_ids=JobIds(),
        )
        if self.disk is not None:
            records = sorted(self.disk.scan(), key=lambda record: record.seq)
            self.index.add_on_disk(record.key for record in records)
        self._bytes = {kind: [0, 0.0] for kind in JobKind}
        self._ready: list[Completion] = []
        self._closed = False

    # ------------------------------------------------------------------ API
    def lookup(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        self._pump()
        return self.index.lookup(keys).num_hits

    def store(self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]) -> JobId | None:
        self._check_open()
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

    def load(self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]) -> LoadHandle:
        self._check_open()
        per_chunk = self._split_blocks(keys, block_ids)
        self._pump()
        hits = self.index.lookup(keys).num_hits
        plan = self.index.prepare_load(keys[:hits])
        if plan.job_id is None:
            return LoadHandle(None, 0, 0)
        chunks = tuple(
            ChunkCopy(key, slot, per_chunk[position], from_disk)
            for position, (key, slot, from_disk) in enumerate(plan.chunks)
        )
        self.executor.submit(LoadSpec(plan.job_id, chunks))
        return LoadHandle(plan.job_id, len(chunks), sum(c.from_disk for c in chunks))

    def poll(self) -> list[Completion]:
        self._check_open()
        self._pump()
        ready, self._ready = self._ready, []
        return ready

    def wait(self, job_ids: Iterable[JobId | None]) -> None:
        self._check_open()
        self.executor.wait([job_id for job_id in job_ids if job_id is not None])
        self._pump()

    def drain(self) -> None:
        """Wait until every job in flight (spills included) has finished."""
        while self.index.jobs_in_flight():
            in_flight = self.executor.in_flight_ids()
            assert in_flight, "block index holds jobs the worker never received"
            self.executor.wait(in_flight)
            self._pump()

    def flush(self) -> None:
        """Write every chunk of the CPU tier that is not on disk yet, and wait."""
        self._check_open()
        self.drain()
        spec = self.index.take_spills(flush=True)
        if spec is not None:
            self.executor.submit(spec)
        self.drain()
        if self.disk is not None:
            self.disk.sync()

    def statistics(self) -> StoreStats:
        def path(kind: JobKind) -> PathStats:
            num_bytes, seconds = self._bytes[kind]
            return PathStats(int(num_bytes), float(seconds))

        return StoreStats(
            index=self.index.statistics(),
            gpu_to_cpu=path(JobKind.STORE),
            cpu_to_gpu=path(JobKind.LOAD),
            cpu_to_disk=path(JobKind.SPILL),
            chunk_bytes=self.chunk_bytes,
        )

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self.disk is not None:
                self.flush()
            else:
                self.drain()
        except (BrokenError, ClosedError) as exc:
            # A disk tier that broke underneath loses its unflushed chunks; closing the
            # store must still succeed (the engine never fails because its cache did).
            log.warning("tierkv: close could not flush the CPU tier to disk: %s", exc)
        finally:
            self._closed = True
            self.executor.shutdown()
            if self.disk is not None:
                self.disk.close()

    def __enter__(self) -> TierKVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("store: used after close()")

    def _split_blocks(
        self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]
    ) -> list[tuple[int, ...]]:
        bpc = self.blocks_per_chunk
        if block_ids and not isinstance(block_ids[0], int):
            per_chunk = [tuple(int(b) for b in chunk) for chunk in block_ids]  # type: ignore[union-attr]
        else:
            flat = [int(b) for b in block_ids]  # type: ignore[arg-type]
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

    def _make_room(self, num_chunks: int) -> bool:
        """Write back the oldest chunks not on disk yet and wait for them, so that their
        slots can take new chunks. The library store blocks here (a disk write) rather
        than drop a store; the engine adapter never blocks and relies on spill-ahead."""
        spec = self.index.take_spills(at_least=num_chunks)
        if spec is None:
            return False
        self.executor.submit(spec)
        self.executor.wait([spec.job_id])
        self._pump()
        return True

    def _pump(self) -> None:
        """Apply finished jobs to the index and start the spills it asks for."""
        for completion in self.executor.poll_finished():
            kind = self.index.job_kind(completion.job_id)
            self.index.complete(completion)
            if kind is not None:
                totals = self._bytes[kind]
                totals[0] += completion.num_bytes
                totals[1] += completion.seconds
            if kind in (JobKind.STORE, JobKind.LOAD):
                self._ready.append(completion)
            if completion.error and not completion.ok:
                log.warning("tierkv: job %s failed: %s", completion.job_id, completion.error)
        spec = self.index.take_spills()
        if spec is not None:
            self.executor.submit(spec)

