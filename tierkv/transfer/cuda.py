"""CudaTransferEngine: the :class:`TransferEngine` between CUDA KV blocks and the pinned slab.

The only module of tierkv that touches ``torch.cuda``; it imports on a CPU-only machine
(nothing runs at import) and its constructor raises :class:`ConfigError` without CUDA.

How a job runs (contracts in :mod:`tierkv.transfer.base`):
- Each direction has its own CUDA stream, a GPU staging buffer of ``staging_bytes``
  (whole chunks, at least one) and a lock, so concurrent submitters (the worker thread,
  the disk reader threads) enqueue whole jobs one by one.
- Both directions first wait on the compute stream (``wait_stream``): a store must copy
  what the forward pass wrote, a load's blocks may have been freed and reallocated while
  an earlier forward still reads them. Then per batch of chunks that fits in staging:
  a store gathers the pages into staging (one ``index_select`` per copy group, block ids
  sent through pinned memory), then copies each run of consecutive slots into the slab in
  one ``non_blocking`` copy; a load copies the other way and scatters (``index_put_``),
  leaving each chunk's ``skip_blocks`` and ``NO_BLOCK`` ids untouched (one scatter per
  run of positions it writes, for chunks in a row that write the same positions).
- Staging reuse is safe by stream order: each staging buffer is allocated on, and only
  used by, its own stream, so a batch cannot overwrite staging before the previous copy
  out of it finished. Pinned index tensors come from PyTorch's caching host allocator,
  which records an event per async copy before it reuses the memory.
- Each job records a start and an end event: ``poll_finished`` queries end events in
  FIFO order per direction (a poll that sees one finishes the job in the ledger), ``wait``
  synchronizes them, ``seconds`` is ``start.elapsed_time(end)``.

The caller's duties, besides ordering loads before the forward pass that reads them:
- ``compute_stream`` is the forward pass's stream (default: the constructing thread's
  current stream). Do not touch a slot while a job that uses it is in flight, nor free
  the KV cache before ``shutdown``.
- An asynchronous CUDA error (e.g. a device-side assert) poisons the CUDA context: polls
  and waits then raise :class:`BrokenError`; the worker must be restarted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from tierkv.core.jobs import ChunkCopy, Completion, JobId, LoadSpec, StoreSpec
from tierkv.errors import BrokenError, ClosedError, ConfigError
from tierkv.tiers.cpu import CpuSlab
from tierkv.transfer.base import (TransferEngine, check_spec, direction_name, failed_completion,
                                  load_runs)
from tierkv.transfer.layout import ChunkViews, KVLayout
from tierkv.transfer.ledger import REMEMBER_FINISHED, JobLedger

DEFAULT_STAGING_BYTES = 64 << 20


class _Job:
    __slots__ = ("spec", "start", "end", "enqueued", "num_bytes", "error")

    def __init__(self, spec: StoreSpec | LoadSpec) -> None:
        self.spec = spec
        self.start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.enqueued = threading.Event()  # set once ``end`` is recorded
        self.num_bytes = 0
        self.error: str | None = None


class _Direction:
    """One direction's stream, staging buffer and FIFO of enqueued jobs."""

    def __init__(self, layout: KVLayout, blocks_per_chunk: int, chunks_per_batch: int) -> None:
        self.stream = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):  # staging belongs to this stream alone
            self.staging = torch.empty((chunks_per_batch, layout.chunk_bytes(blocks_per_chunk)),
                                       dtype=torch.uint8, device=layout.device)
        self.views: ChunkViews = layout.chunk_views(self.staging, blocks_per_chunk)
        self.lock = threading.Lock()
        self.fifo: deque[_Job] = deque()


def _finished(job: _Job) -> bool:
    """The job's end event has completed (raises RuntimeError on a CUDA error)."""
    return bool(job.end.query())  # type: ignore[no-untyped-call]


def _slot_runs(chunks: Sequence[ChunkCopy], merge: bool) -> list[tuple[int, int, int]]:
    """``(first_position, count, first_slot)`` per run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for position, chunk in enumerate(chunks):
        if merge and runs and runs[-1][2] + runs[-1][1] == chunk.slot:
            first, count, slot = runs[-1]
            runs[-1] = (first, count + 1, slot)
        else:
            runs.append((position, 1, chunk.slot))
    return runs


class CudaTransferEngine(TransferEngine):
    """CUDA KV blocks <-> pinned slab slots; streams, staging and events per direction."""

    def __init__(
        self,
        layout: KVLayout,
        slab: CpuSlab,
        blocks_per_chunk: int,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        compute_stream: torch.cuda.Stream | None = None,
        remember_finished: int = REMEMBER_FINISHED,
    ) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(
                "transfer: CudaTransferEngine needs CUDA, but torch.cuda.is_available() is "
                "False (use device='cpu', or 'auto' to pick by the KV tensors' device)"
            )
        if layout.device.type != "cuda":
            raise ConfigError(f"transfer: CudaTransferEngine needs the KV cache on a CUDA "
                              f"device, it is on {layout.device} (use device='cpu' or 'auto')")
        super().__init__(layout, slab, blocks_per_chunk)
        if not slab.tensor.is_pinned():
            raise ConfigError(
                "cpu tier: the slab is not pinned, so CUDA copies would be synchronous and "
                "slow; set cpu.pin_memory to 'auto' or 'always'"
            )
        if staging_bytes <= 0:
            raise ConfigError(f"transfer: staging_bytes must be > 0, got {staging_bytes}")
        self.device = layout.device
        self.chunks_per_batch = max(1, staging_bytes // self.chunk_bytes)
        self._merge_slots = slab.slot_bytes == self.chunk_bytes
        with torch.cuda.device(self.device):
            self.compute_stream = compute_stream or torch.cuda.current_stream(self.device)
            self._store = _Direction(layout, blocks_per_chunk, self.chunks_per_batch)
            self._load = _Direction(layout, blocks_per_chunk, self.chunks_per_batch)
        self._lock = threading.Lock()
        self._ledger: JobLedger[_Job] = JobLedger("cuda transfer engine", remember_finished)
        self._closed = False

    # ------------------------------------------------------------------ submit
    def _submit(self, spec: StoreSpec | LoadSpec) -> None:
        direction = self._store if isinstance(spec, StoreSpec) else self._load
        job = _Job(spec)
        with self._lock:
            if self._closed:
                raise ClosedError(f"cuda transfer engine: job {spec.job_id} submitted after "
                                  f"shutdown")
            self._ledger.add(spec.job_id, job)  # a concurrent wait now blocks on job.enqueued
        job.error = check_spec(spec, self.layout.num_blocks, self.slab.num_slots,
                               self.blocks_per_chunk)
        with direction.lock:
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(direction.stream):
                    direction.stream.wait_stream(self.compute_stream)
                    job.start.record(direction.stream)
                    try:
                        if job.error is None:
                            if isinstance(spec, StoreSpec):
                                self._store_chunks(spec.chunks, direction, job)
                            else:
                                self._load_chunks(spec.chunks, direction, job)
                    except Exception as exc:  # reported in the completion, not raised
                        job.error = f"{type(exc).__name__}: {exc}"
                    finally:
                        job.end.record(direction.stream)
            finally:
                with self._lock:
                    direction.fifo.append(job)
                job.enqueued.set()

    def _device_ids(self, chunks: Sequence[ChunkCopy]) -> torch.Tensor:
        """Block ids ``[len(chunks), bpc]`` on the device, sent through pinned memory."""
        host = torch.tensor([chunk.block_ids for chunk in chunks], dtype=torch.int64,
                            pin_memory=True)
        return host.to(self.device, non_blocking=True)

    def _slot_rows(self, slot: int, count: int) -> torch.Tensor:
        if self._merge_slots:
            return self.slab.tensor[slot:slot + count]
        return self.slab.tensor[slot:slot + 1, :self.chunk_bytes]

    def _store_chunks(self, chunks: Sequence[ChunkCopy], direction: _Direction,
                      job: _Job) -> None:
        for first in range(0, len(chunks), self.chunks_per_batch):
            batch = chunks[first:first + self.chunks_per_batch]
            self.layout.gather_batch(direction.views, 0, self._device_ids(batch))
            for position, count, slot in _slot_runs(batch, self._merge_slots):
                self._slot_rows(slot, count).copy_(
                    direction.staging[position:position + count], non_blocking=True)
            job.num_bytes += len(batch) * self.chunk_bytes

    def _load_chunks(self, chunks: Sequence[ChunkCopy], direction: _Direction,
                     job: _Job) -> None:
        for first in range(0, len(chunks), self.chunks_per_batch):
            batch = chunks[first:first + self.chunks_per_batch]
            for position, count, slot in _slot_runs(batch, self._merge_slots):
                direction.staging[position:position + count].copy_(
                    self._slot_rows(slot, count), non_blocking=True)
            block_ids = self._device_ids(batch)
            runs = [load_runs(chunk) for chunk in batch]
            position = 0
            while position < len(batch):  # chunks in a row that write the same positions
                end = position + 1
                while end < len(batch) and runs[end] == runs[position]:
                    end += 1
                for start, stop in runs[position]:  # one run unless skips or NO_BLOCKs
                    self.layout.scatter_batch(direction.views, position,
                                              block_ids[position:end, start:stop], start)
                    job.num_bytes += (end - position) * (stop - start) * self.block_bytes
                position = end

    # ------------------------------------------------------------------ completions
    def _completion(self, job: _Job) -> Completion:
        seconds = job.start.elapsed_time(job.end) / 1000.0
        if job.error is not None:
            return failed_completion(job.spec, job.error, seconds=seconds)
        return Completion(job.spec.job_id, job.spec.kind, True, job.num_bytes, seconds)

    def poll_finished(self) -> list[Completion]:
        finished: list[Completion] = []
        with self._lock:
            for direction in (self._store, self._load):
                try:
                    while direction.fifo and _finished(direction.fifo[0]):
                        job = direction.fifo.popleft()
                        finished.append(self._completion(job))
                        self._ledger.finish(job.spec.job_id)
                except RuntimeError as exc:
                    raise BrokenError(f"cuda transfer engine: CUDA failed under a "
                                      f"{direction_name(direction.fifo[0].spec)} ({exc}); "
                                      f"the CUDA context is unusable, restart the worker") from exc
        return finished

    def _jobs(self, job_ids: Iterable[JobId], timeout: float | None = None) -> list[_Job]:
        """The jobs not yet polled, once their end events are recorded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = list(self._ledger.pending(job_ids).values())
        for job in jobs:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not job.enqueued.wait(remaining):
                raise self._ledger.timed_out([job.spec.job_id], timeout)
        return jobs

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for job in self._jobs(job_ids, timeout):
                if deadline is None:
                    job.end.synchronize()
                    continue
                while not _finished(job):
                    if time.monotonic() >= deadline:
                        raise self._ledger.timed_out([job.spec.job_id], timeout)
                    time.sleep(0.0002)
        except RuntimeError as exc:
            raise BrokenError(f"cuda transfer engine: CUDA failed while waiting ({exc}); the "
                              f"CUDA context is unusable, restart the worker") from exc

    def make_compute_wait(self, job_ids: Iterable[JobId],
                          stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the compute stream) wait on these jobs' end events,
        without blocking the host. Jobs already polled are complete and need nothing."""
        target = stream or self.compute_stream
        for job in self._jobs(job_ids):
            target.wait_event(job.end)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for direction in (self._store, self._load):
            with direction.lock:  # an enqueue in progress finishes first
                direction.stream.synchronize()
