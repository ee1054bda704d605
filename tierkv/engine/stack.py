"""The one place that builds a tierkv stack from one :class:`~tierkv.config.StoreConfig`.

Both halves are built here, for the library store (both in one process) and for the two
vLLM connector roles (one each, in their own processes):

- :func:`build_index` the scheduler side's :class:`BlockIndex`, sized by
  :func:`~tierkv.config.cpu_slot_count` and :func:`~tierkv.config.disk_chunk_capacity`.
- :func:`build_adapter` the :class:`EngineAdapter` over an index (engines that plan steps).
- :func:`build_remote_lookup` the scheduler side's questions to the remote tier
  (``config.remote``; None without one), for every rank of the engine.
- :func:`build_worker` the worker side: the CPU slab, the transfer engine, the disk tier
  (:func:`~tierkv.tiers.disk.opener.open_disk`, as the writer or a follower) with its I/O
  threads, the remote tier with its reader and push threads, each given the reader of
  another part count's chunks, and the :class:`JobExecutor` over them, as a
  :class:`WorkerStack`. A failure while building releases what was built (threads, slab,
  disk tier, remote connection).
- :func:`make_transfer_engine` the GPU <-> CPU transfer engine for a registered layout:
  ``device="auto"`` the CUDA one for tensors on a CUDA device, else the CPU one;
  ``"cuda"`` / ``"cpu"`` that engine, which raises :class:`ConfigError` for tensors
  elsewhere (or no CUDA). Its module is imported only when chosen, so a CPU-only process
  never loads the CUDA one.
- :func:`start_line` the one INFO line a store logs when it opens, the library's and each
  rank of the vLLM connector alike: its tiers with their sizes in binary units, the disk
  cap, tokens per chunk and the namespace's :func:`short_id` (the first 8 hex digits of
  :meth:`Namespace.fingerprint`, as ``tierkv inspect`` and the warm-up show it). A remote
  URL is shown without its password.

A new tier plugs in here (docs/design.md, "Where a new tier plugs in").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierkv.config import StoreConfig, safe_url
from tierkv.core.index import BlockIndex
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.tier_lookup import RemoteAsker
from tierkv.extras import needs
from tierkv.errors import ConfigError
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import ReadStatus
from tierkv.units import format_bytes

if TYPE_CHECKING:  # the worker half loads torch's transfer code and LMDB: only when built
    from tierkv.transfer.executor import JobExecutor
    from tierkv.tiers.cpu import CpuSlab
    from tierkv.tiers.disk.tier import DiskTier
    from tierkv.tiers.remote.tier import RemoteTier
    from tierkv.transfer.base import TransferEngine
    from tierkv.transfer.tier_io import TierIO
    from tierkv.transfer.layout import KVLayout
    from tierkv.tiers.remote.pushes import RemoteIO
    from tierkv.tiers.remote.lookup import RemoteLookup

log = logging.getLogger("tierkv")


def library_part(config: StoreConfig) -> Part:
    """The part a library store writes and reads: part ``rank`` of ``tp_size``."""
    if config.rank >= config.tp_size:
        raise ConfigError(f"store: rank={config.rank} is not below tp_size={config.tp_size} "
                          f"(rank r of a tensor-parallel engine of tp_size ranks stores part "
                          f"r of tp_size of each chunk)")
    return Part(config.rank, config.tp_size)


def build_index(config: StoreConfig, num_slots: int, disk_capacity: int, *,
                clock: Callable[[], float] = time.monotonic,
                record_events: bool = False, disk_tier: bool | None = None) -> BlockIndex:
    """The scheduler side's bookkeeping for ``num_slots`` CPU slots and ``disk_capacity``
    disk chunks (0: no disk tier, unless ``disk_tier`` says there is one: a capacity that
    a shared disk budget may raise later)."""
    return BlockIndex(
        num_slots,
        disk_capacity,
        write_through=config.disk.write_through,
        spill_ahead_fraction=config.cpu.spill_ahead_fraction,
        retry_after_full_seconds=config.disk.retry_after_full_seconds,
        clock=clock,
        record_events=record_events,
        eviction_policy=config.cpu.eviction_policy,
        remote_mark_seconds=config.remote.mark_seconds if config.remote else 10.0,
        disk_tier=disk_tier,
    )


def build_adapter(index: BlockIndex, config: AdapterConfig,
                  clock: Callable[[], float] = time.monotonic,
                  remote: RemoteAsker | None = None) -> EngineAdapter:
    return EngineAdapter(index, config, clock=clock, remote=remote)


def build_remote_lookup(config: StoreConfig, namespace: Namespace,
                        part_sets: Sequence[Sequence[Part]],
                        chunk_bytes: int) -> RemoteLookup | None:
    """The remote tier's lookups for chunks of ``namespace`` that have every part of one of
    ``part_sets`` (the first is this engine's own, whose parts hold ``chunk_bytes``)
    (connected on first use: a server down at start is a miss, not a failed start)."""
    if config.remote is None:
        return None
    with needs("remote", "the remote tier (StoreConfig.remote, vLLM's remote_url)"):
        from tierkv.tiers.remote.tier import RemoteTier
        from tierkv.tiers.remote.lookup import RemoteLookup

    remote = config.remote
    tier = RemoteTier(remote, namespace, part_sets[0][0], chunk_bytes, lazy=True,
                      role="lookups")
    return RemoteLookup(tier, part_sets, remote.lookup_deadline_seconds, remote.lookup_chunks,
                        usage_seconds=remote.usage_seconds)


PartsReader = Callable[[bytes, int, Any], ReadStatus]  # (key, part count, slot) -> status


@dataclass
class WorkerStack:
    """What one worker moves bytes with; ``close()`` stops the threads, then gives back the
    disk tier (:func:`~tierkv.tiers.disk.opener.close_disk`) and the remote tier's
    connection."""

    slab: CpuSlab
    transfer: TransferEngine
    disk: DiskTier | None
    disk_io: TierIO | None
    executor: JobExecutor
    writer: bool = True  # the disk tier's writer (else a follower: read-only)
    remote: RemoteTier | None = None

    def close(self) -> None:
        _release(self.executor, (), self.disk, self.writer, self.remote)


def _release(executor: JobExecutor | None,
             parts: Sequence[TierIO | TransferEngine | RemoteIO | None],
             disk: DiskTier | None, writer: bool, remote: RemoteTier | None) -> None:
    """Stop threads (the executor's, or ``parts`` before it owned them), then release the
    tiers; every step runs even if one fails."""
    try:
        if executor is not None:
            executor.shutdown()
        else:
            for part in parts:
                if part is not None:
                    part.shutdown()
    except Exception as exc:  # noqa: BLE001 - releasing must go on
        log.warning("tierkv: stopping the worker's threads failed: %s", exc)
    finally:
        try:
            if remote is not None:
                remote.close()
        finally:
            if disk is not None:
                from tierkv.tiers.disk.opener import close_disk

                close_disk(disk, writer=writer)


DEVICES = ("auto", "cpu", "cuda")


def make_transfer_engine(device: str, layout: KVLayout, slab: CpuSlab, blocks_per_chunk: int,
                         **engine_options: Any) -> TransferEngine:
    """The transfer engine for ``layout``'s device (``engine_options``: its constructor's);
    see the module docstring."""
    if device not in DEVICES:
        raise ConfigError(f"transfer: device must be one of {DEVICES}, got {device!r}")
    if device == "cuda" or device == "auto" and layout.device.type == "cuda":
        from tierkv.transfer.cuda import CudaTransferEngine

        return CudaTransferEngine(layout, slab, blocks_per_chunk, **engine_options)
    from tierkv.transfer.cpu import CpuTransferEngine

    return CpuTransferEngine(layout, slab, blocks_per_chunk, **engine_options)


def build_worker(config: StoreConfig, layout: KVLayout, num_slots: int, *,
                 namespace: Namespace | None = None, part: Part | None = None,
                 replica: int = 0, writer: bool = True, refusal: str | None = None,
                 other_disk: PartsReader | None = None,
                 other_remote: PartsReader | None = None) -> WorkerStack:
    """The worker side over ``layout``'s tensors: a slab of ``num_slots`` chunks, the
    transfer engine for ``config.device``, (``config.disk.path`` set) the disk tier of
    ``namespace``'s ``part`` (default: the library's :func:`library_part`) with its I/O
    threads, opened as its writer (claimed; ``refusal`` words a refusal) or, ``writer``
    False, as a follower (read-only), and (``config.remote`` set) the remote tier of that
    part, connected on first use, with its reader threads and its push thread (none with
    ``remote.push="read_only"``). ``other_disk`` / ``other_remote`` read a chunk another
    part count wrote (:class:`tierkv.transfer.parts.PartReader`; None: such a chunk is a
    miss). The disk tier is opened first: a store path that is refused costs no slab and
    no thread."""
    from tierkv.transfer.executor import JobExecutor
    from tierkv.tiers.cpu import CpuSlab
    from tierkv.tiers.disk.opener import open_disk
    from tierkv.transfer.tier_io import TierIO

    chunk_bytes = layout.chunk_bytes(config.blocks_per_chunk)
    if (config.remote is not None or config.disk.path is not None) and namespace is None:
        raise ValueError("build_worker: a disk or remote tier needs the namespace of its chunks")
    part = part if part is not None else library_part(config)
    disk = None
    if config.disk.path is not None and namespace is not None:
        disk = open_disk(config.disk, namespace, part, "writer" if writer else "follower",
                         payload_bytes=chunk_bytes, replica=replica, refusal=refusal)
    slab: CpuSlab | None = None
    transfer: TransferEngine | None = None
    disk_io: TierIO | None = None
    remote: RemoteTier | None = None
    remote_io: TierIO | None = None
    pusher: RemoteIO | None = None
    try:
        slab = CpuSlab(num_slots, chunk_bytes, config.cpu.pin_memory)
        transfer = make_transfer_engine(config.device, layout, slab, config.blocks_per_chunk)
        if disk is not None:
            disk_io = TierIO(disk, slab, config.disk.write_batch_bytes, config.disk.reader_threads,
                             other_parts=other_disk)
        settings = config.remote
        if settings is not None and namespace is not None:
            with needs("remote", "the remote tier (StoreConfig.remote, vLLM's remote_url)"):
                from tierkv.tiers.remote.tier import RemoteTier
                from tierkv.tiers.remote.pushes import RemoteIO

            remote = RemoteTier(settings, namespace, part, chunk_bytes, lazy=True,
                                role="loads and pushes")
            # Connected now, within remote.timeout_seconds (a server down now is a miss
            # later, never a failed start): a node that stalls later fails its own chunks
            # only, the cluster's nodes being known; on first use, a stalled seed failed all.
            remote.warm_up()
            remote_io = TierIO(remote, slab, chunk_bytes, settings.reader_threads,
                               other_parts=other_remote)
            if settings.push != "read_only":
                pusher = RemoteIO(remote, settings.queue_bytes)
        executor = JobExecutor(transfer, disk_io, remote_io=remote_io, pusher=pusher,
                               push_on=settings.push if settings else "on_store")
    except BaseException:
        _release(None, (disk_io, remote_io, pusher, transfer), disk, writer, remote)
        raise
    return WorkerStack(slab, transfer, disk, disk_io, executor, writer, remote)


def short_id(namespace: Namespace) -> str:
    """The namespace's short id: the first 8 hex digits of its fingerprint."""
    return namespace.fingerprint()[:8]


def start_line(who: str, config: StoreConfig, namespace: Namespace, *, num_slots: int,
               chunk_bytes: int) -> str:
    """``who`` (``"store"``, ``"rank 0"``) opened with ``num_slots`` CPU slots of
    ``chunk_bytes`` over ``config``'s tiers, for chunks of ``namespace``."""
    tiers = [f"CPU {format_bytes(num_slots * chunk_bytes)} ({num_slots} chunks)"]
    disk = config.disk
    if disk.path is not None:
        tiers.append(f"disk at {disk.path} capped at {format_bytes(disk.max_bytes)}")
    else:
        tiers.append("no disk tier")
    if config.remote is not None:
        tiers.append(f"remote {safe_url(config.remote.url)}")
    return (f"tierkv: {who} open, namespace {short_id(namespace)}: {', '.join(tiers)}; "
            f"{namespace.tokens_per_chunk} tokens a chunk of {format_bytes(chunk_bytes)}")
