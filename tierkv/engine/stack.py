"""The one place that builds a tierkv stack from one :class:`~tierkv.config.StoreConfig`.

Both halves are built here, for the library store (both in one process) and for the two
vLLM connector roles (one each, in their own processes):

- :func:`build_index` the scheduler side's :class:`BlockIndex`, sized by
  :func:`~tierkv.config.cpu_slot_count` and :func:`~tierkv.config.disk_chunk_capacity`.
- :func:`build_adapter` the :class:`EngineAdapter` over an index (engines that plan steps).
- :func:`build_worker` the worker side: the CPU slab, the transfer engine, the disk tier
  with its I/O threads, and the :class:`JobExecutor` over them, as a :class:`WorkerStack`.
  A failure while building releases what was built (threads, slab, disk tier).

A new tier plugs in here (docs/design.md, "Where a new tier plugs in").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.config import StoreConfig
from tierkv.core.index import BlockIndex
from tierkv.engine.adapter import AdapterConfig, EngineAdapter

if TYPE_CHECKING:  # the worker half loads torch's transfer code and LMDB: only when built
    from tierkv.transfer.executor import JobExecutor
    from tierkv.tiers.cpu import CpuSlab
    from tierkv.tiers.disk import DiskTier
    from tierkv.transfer.base import TransferEngine
    from tierkv.transfer.disk_io import DiskIO
    from tierkv.transfer.layout import KVLayout

log = logging.getLogger("tierkv")


def build_index(config: StoreConfig, num_slots: int, disk_capacity: int, *,
                clock: Callable[[], float] = time.monotonic,
                record_events: bool = False) -> BlockIndex:
    """The scheduler side's bookkeeping for ``num_slots`` CPU slots and ``disk_capacity``
    disk chunks (0: no disk tier)."""
    return BlockIndex(
        num_slots,
        disk_capacity,
        write_through=config.disk.write_through,
        spill_ahead_fraction=config.cpu.spill_ahead_fraction,
        retry_after_full_seconds=config.disk.retry_after_full_seconds,
        clock=clock,
        record_events=record_events,
        eviction_policy=config.cpu.eviction_policy,
    )


def build_adapter(index: BlockIndex, config: AdapterConfig,
                  clock: Callable[[], float] = time.monotonic) -> EngineAdapter:
    return EngineAdapter(index, config, clock=clock)


@dataclass
class WorkerStack:
    """What one worker moves bytes with; ``close()`` stops the threads, then releases the
    disk tier (through ``release_disk``)."""

    slab: CpuSlab
    transfer: TransferEngine
    disk: DiskTier | None
    disk_io: DiskIO | None
    executor: JobExecutor
    release_disk: Callable[[DiskTier], None]

    def close(self) -> None:
        _release(self.executor, self.disk_io, self.transfer, self.disk, self.release_disk)


def _release(executor: JobExecutor | None, disk_io: DiskIO | None,
             transfer: TransferEngine | None, disk: DiskTier | None,
             release_disk: Callable[[DiskTier], None]) -> None:
    """Stop threads, then release the disk tier; every step runs even if one fails."""
    try:
        if executor is not None:
            executor.shutdown()
        else:  # the executor did not own them yet
            for part in (disk_io, transfer):
                if part is not None:
                    part.shutdown()
    except Exception as exc:  # noqa: BLE001 - releasing must go on
        log.warning("tierkv: stopping the worker's threads failed: %s", exc)
    finally:
        if disk is not None:
            release_disk(disk)


def _close_disk(disk: DiskTier) -> None:
    disk.close()


def build_worker(config: StoreConfig, layout: KVLayout, num_slots: int, *,
                 open_disk: Callable[[], DiskTier] | None = None,
                 release_disk: Callable[[DiskTier], None] = _close_disk) -> WorkerStack:
    """The worker side over ``layout``'s tensors: a slab of ``num_slots`` chunks, the
    transfer engine for ``config.device``, and (``open_disk`` given) the disk tier it opens
    with its I/O threads. The disk tier is opened first: a store path that is refused
    costs no slab and no thread."""
    from tierkv.transfer.executor import JobExecutor
    from tierkv.tiers.cpu import CpuSlab
    from tierkv.transfer.disk_io import DiskIO
    from tierkv.transfer.factory import make_transfer_engine

    chunk_bytes = layout.chunk_bytes(config.blocks_per_chunk)
    disk = open_disk() if open_disk is not None else None
    slab: CpuSlab | None = None
    transfer: TransferEngine | None = None
    disk_io: DiskIO | None = None
    try:
        slab = CpuSlab(num_slots, chunk_bytes, config.cpu.pin_memory)
        transfer = make_transfer_engine(config.device, layout, slab, config.blocks_per_chunk)
        if disk is not None:
            disk_io = DiskIO(disk, slab, config.disk.write_batch_bytes, config.disk.reader_threads)
        executor = JobExecutor(transfer, disk_io)
    except BaseException:
        _release(None, disk_io, transfer, disk, release_disk)
        raise
    return WorkerStack(slab, transfer, disk, disk_io, executor, release_disk)
