"""TransferEngine: moves chunks between the engine's KV blocks (GPU) and CPU slab slots.

Primitives and their contracts (every engine):
- ``submit_store(spec: StoreSpec)``: copy each chunk's blocks (``blocks_per_chunk`` of
  ``spec.block_ids`` per chunk; ``spec.chunks`` is the per-chunk view) into its slot, in
  the slot byte layout of :mod:`tierkv.transfer.layout`. Returns at once.
- ``submit_load(spec: LoadSpec)``: copy each chunk's slot into its blocks, except the
  first ``chunk.skip_blocks`` blocks (already on the GPU; never written) and every block
  id ``NO_BLOCK`` (-1: the engine holds no page there). Returns at once.
  ``from_disk`` is ignored: the caller has already read the disk tier into the slot.
- Both are thread-safe (disk reader threads submit loads). A spec that cannot run
  (wrong block count, block id or slot out of range, a load writing one block twice, one
  slot stored twice) is not raised: the job completes with ``ok=False`` and ``error``
  set, like a copy that raised. The engine keeps working.
- ``poll_finished()``: non-blocking; every finished job exactly once, in submission order
  per direction (stores among stores, loads among loads).
- ``wait(job_ids, timeout=None)``: blocks until every one of those jobs finished; a job
  already polled counts as finished. Job ids follow :mod:`tierkv.transfer.ledger`: reuse
  raises :class:`TransferError`, an id never submitted :class:`UnknownJobError`, an
  expired ``timeout`` :class:`JobTimeoutError`.
- ``make_compute_wait(job_ids)``: orders the engine's compute work after those loads. On
  CUDA the compute stream waits on the jobs' end events (no host sync); elsewhere it is a
  host ``wait``. Call it before the forward pass that reads loaded blocks.
- ``shutdown()``: waits for the jobs in flight, idempotent; submitting afterwards raises
  :class:`ClosedError`. Polling afterwards still returns what finished.
- ``Completion.num_bytes``: bytes that reached their destination (a store: whole chunks
  into slots; a load: the blocks written); ``seconds``: copy time (CUDA: from events).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from types import TracebackType

from tierkv.core.jobs import NO_BLOCK, ChunkCopy, Completion, JobId, LoadSpec, StoreSpec
from tierkv.errors import ConfigError, TransferError, short_key
from tierkv.tiers.cpu import CpuSlab
from tierkv.transfer.layout import KVLayout


class TransferEngine(ABC):
    """GPU blocks <-> CPU slab slots; see the module docstring for the contract."""

    def __init__(self, layout: KVLayout, slab: CpuSlab, blocks_per_chunk: int) -> None:
        self.layout = layout
        self.slab = slab
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_bytes = layout.chunk_bytes(blocks_per_chunk)
        self.block_bytes = sum(layout.page_bytes)
        if slab.slot_bytes < self.chunk_bytes:
            raise ConfigError(
                f"cpu tier: slots of {slab.slot_bytes} bytes cannot hold a chunk of "
                f"{self.chunk_bytes} bytes ({blocks_per_chunk} blocks x {self.block_bytes} "
                f"bytes); size the slab's slot_bytes from layout.chunk_bytes()"
            )

    def submit_store(self, spec: StoreSpec) -> None:
        """Start copying each chunk's blocks into its slot; returns at once."""
        if not isinstance(spec, StoreSpec):
            raise TransferError(f"transfer: submit_store takes a StoreSpec, "
                                f"got {type(spec).__name__}")
        self._submit(spec)

    def submit_load(self, spec: LoadSpec) -> None:
        """Start copying each chunk's slot into its blocks; returns at once."""
        if not isinstance(spec, LoadSpec):
            raise TransferError(f"transfer: submit_load takes a LoadSpec, "
                                f"got {type(spec).__name__}")
        self._submit(spec)

    @abstractmethod
    def _submit(self, spec: StoreSpec | LoadSpec) -> None:
        """Start ``spec`` (its type checked); returns at once."""

    @abstractmethod
    def poll_finished(self) -> list[Completion]:
        """Finished jobs, each once, FIFO per direction; never blocks."""

    @abstractmethod
    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> None:
        """Block until all ``job_ids`` finished; unknown ids raise UnknownJobError."""

    @abstractmethod
    def shutdown(self) -> None:
        """Wait for the jobs in flight and stop; idempotent."""

    def make_compute_wait(self, job_ids: Iterable[JobId]) -> None:
        """Order the compute work after these jobs (here: a host wait)."""
        self.wait(job_ids)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.shutdown()


def direction_name(spec: StoreSpec | LoadSpec) -> str:
    return "gpu->cpu store" if isinstance(spec, StoreSpec) else "cpu->gpu load"


def check_spec(spec: StoreSpec | LoadSpec, num_blocks: int, num_slots: int,
               blocks_per_chunk: int) -> str | None:
    """Why ``spec`` cannot run, or None when it can."""
    if isinstance(spec, StoreSpec):
        keys, to, blocks = spec.keys, spec.slots, spec.block_ids
        if len(to) != len(keys) or len(blocks) != len(keys) * blocks_per_chunk:
            return (f"store job {spec.job_id} has {len(blocks)} block ids and {len(to)} slots "
                    f"for {len(keys)} chunk(s); blocks_per_chunk is {blocks_per_chunk}")
        if not keys or (0 <= min(to) and max(to) < num_slots and 0 <= min(blocks)
                        and max(blocks) < num_blocks and len(set(to)) == len(to)):
            return None  # the common case, checked by columns; else find the chunk below
    is_load = isinstance(spec, LoadSpec)
    slots: set[int] = set()
    written: set[int] = set()
    for chunk in spec.chunks:
        where = f"chunk {short_key(chunk.key)}"
        if len(chunk.block_ids) != blocks_per_chunk:
            return (f"{where} has {len(chunk.block_ids)} block ids, "
                    f"blocks_per_chunk is {blocks_per_chunk}")
        if not 0 <= chunk.slot < num_slots:
            return f"{where}: slot {chunk.slot} out of range [0, {num_slots})"
        for block in chunk.block_ids:
            if not 0 <= block < num_blocks and not (is_load and block == NO_BLOCK):
                return f"{where}: block id {block} out of range [0, {num_blocks})"
        if is_load:
            if not 0 <= chunk.skip_blocks <= blocks_per_chunk:
                return f"{where}: skip_blocks {chunk.skip_blocks} out of [0, {blocks_per_chunk}]"
            targets = [block for block in chunk.block_ids[chunk.skip_blocks:] if block != NO_BLOCK]
            if len(set(targets)) != len(targets) or not written.isdisjoint(targets):
                return f"{where}: a load writes some block twice"
            written.update(targets)
        elif chunk.slot in slots:
            return f"{where}: slot {chunk.slot} is stored twice in one job"
        slots.add(chunk.slot)  # only stores read it back
    return None


def load_runs(chunk: ChunkCopy) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each run of positions a load writes: past ``skip_blocks``,
    without the ``NO_BLOCK`` ones. One run for a chunk without any."""
    ids, start = chunk.block_ids, chunk.skip_blocks
    if NO_BLOCK not in ids:
        return ((start, len(ids)),) if start < len(ids) else ()
    runs: list[tuple[int, int]] = []
    for position in range(start, len(ids) + 1):
        if position == len(ids) or ids[position] == NO_BLOCK:
            if position > start:
                runs.append((start, position))
            start = position + 1
    return tuple(runs)


def failed_completion(spec: StoreSpec | LoadSpec, error: str, first_failed: int = 0,
                      num_bytes: int = 0, seconds: float = 0.0) -> Completion:
    """A completion whose chunks from ``first_failed`` on did not land."""
    failed = (spec.keys[first_failed:] if isinstance(spec, StoreSpec)
              else tuple(chunk.key for chunk in spec.chunks[first_failed:]))
    return Completion(spec.job_id, spec.kind, False, num_bytes, seconds, failed_keys=failed,
                      error=f"{direction_name(spec)} job {spec.job_id}: {error}")

