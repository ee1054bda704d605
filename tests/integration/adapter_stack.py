"""A full tierkv stack for engine-adapter tests: real CPU transfer thread, real LMDB."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.config import DiskTierConfig
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import LoadSpec, StoreSpec
from tierkv.core.plans import CpuState
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.worker import WorkerAdapter
from tierkv.keys import Namespace
from tierkv.testing import MiniEngine
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.tier import DiskTier, ReadStatus
from tierkv.transfer.cpu import CpuTransferEngine
from tierkv.transfer.tier_io import TierIO
from tierkv.transfer.executor import JobExecutor
from tierkv.transfer.layout import KVLayout

BLOCK = 4
BPC = 2
TPC_DEFAULT = BLOCK * BPC
WIDTH = 8
LAYERS = 2


@dataclass
class Stack:
    engine: MiniEngine
    adapter: EngineAdapter
    worker: WorkerAdapter
    index: BlockIndex
    slab: CpuSlab
    layout: KVLayout
    disk: DiskTier | None

    def drain(self) -> None:
        """Finish every job, flush dirty chunks to disk, finish again."""
        for _ in range(4):
            self.worker.wait_all()
            self.adapter.complete(self.worker.poll())
            plan = self.adapter.take_flush_spills()
            self.worker.start(plan)
            self.worker.wait_all()
            self.adapter.complete(self.worker.poll())
            if not self.adapter.jobs_in_flight() and not self.index.jobs_in_flight():
                break
        assert self.index.jobs_in_flight() == 0

    def stored_bytes(self, key: bytes) -> bytes | None:
        entry = self.index.entry(key)
        if entry is None:
            return None
        if entry.cpu is CpuState.READY and entry.slot is not None:
            return self.slab.view(entry.slot).numpy().tobytes()
        if entry.on_disk and self.disk is not None:
            out = bytearray(self.slab.slot_bytes)
            assert self.disk.read_into(key, memoryview(out)) is ReadStatus.OK
            return bytes(out)
        return None

    def expected_bytes(self, key: bytes) -> bytes:
        return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in self.engine.expected_chunk(key))

    def verify_stored(self) -> int:
        """Every chunk the tiers hold equals the KV the engine wrote for its prefix."""
        checked = 0
        for key in self.engine.key_prefix:
            got = self.stored_bytes(key)
            if got is None:
                continue
            assert got == self.expected_bytes(key), f"stored chunk {key[:4].hex()} holds wrong bytes"
            checked += 1
        return checked

    def close(self) -> None:
        self.worker.shutdown()
        if self.disk is not None:
            self.disk.close()


def slow_stores(seconds: float) -> Callable[[StoreSpec | LoadSpec], None]:
    def hook(spec: StoreSpec | LoadSpec) -> None:
        if isinstance(spec, StoreSpec):
            time.sleep(seconds)

    return hook


def build_stack(
    tmp_path: Path | None,
    *,
    num_blocks: int = 64,
    num_slots: int = 64,
    disk_chunks: int = 0,
    token_budget: int = 32,
    async_scheduling: bool = False,
    before_copy: Callable[[StoreSpec | LoadSpec], None] | None = None,
    write_through: bool = False,
    key_lag_tokens: int = 0,
    worker_order=None,  # type: ignore[no-untyped-def]
    adapter_config: AdapterConfig | None = None,
    worker_clock: Callable[[], float] = time.monotonic,
    disk_type: type[DiskTier] = DiskTier,
) -> Stack:
    kv = [torch.zeros((num_blocks, BLOCK, WIDTH), dtype=torch.int32) for _ in range(LAYERS)]
    layout = KVLayout.from_tensors(kv)
    chunk_bytes = layout.chunk_bytes(BPC)
    slab = CpuSlab(num_slots, chunk_bytes, "never")
    transfer = CpuTransferEngine(layout, slab, BPC, before_copy=before_copy)
    disk = disk_io = None
    if disk_chunks:
        assert tmp_path is not None
        namespace = Namespace("adapter-test", "int32", "LBNHC", chunk_bytes // BPC // LAYERS, BLOCK * BPC, LAYERS)
        disk = disk_type(tmp_path / "disk", namespace, 0, DiskTierConfig(path=tmp_path / "disk", max_bytes=64 << 20),
                        chunk_bytes)
        disk_io = TierIO(disk, slab, 1 << 20)
    index = BlockIndex(num_slots, disk_chunks, write_through=write_through, spill_ahead_fraction=0.25)
    adapter = EngineAdapter(index, adapter_config or AdapterConfig(BLOCK, BPC))
    worker = WorkerAdapter(JobExecutor(transfer, disk_io), clock=worker_clock)
    engine = MiniEngine(adapter, worker, kv, num_blocks=num_blocks, token_budget=token_budget,
                        async_scheduling=async_scheduling, key_lag_tokens=key_lag_tokens,
                        worker_order=worker_order)
    return Stack(engine, adapter, worker, index, slab, layout, disk)
