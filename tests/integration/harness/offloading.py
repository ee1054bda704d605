"""vLLM's OffloadingConnector with a CPU stand-in for its CUDA-only worker (see ``vllm_harness``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import KVTransferConfig
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from .engine import Harness

OFFLOADING_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"


# --------------------------------------------------------------------------------------------
# vLLM's OffloadingConnector with a CPU stand-in for its CUDA-only worker
# --------------------------------------------------------------------------------------------


@dataclass
class StandInStats:
    stores: int = 0
    loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    waits: int = 0


class StandInOffloadingWorker(OffloadingWorker):
    """A CPU OffloadingWorker. copy=True moves bytes (at submit, in order); copy=False only
    reports success, so loaded blocks keep stale bytes (check_kv must catch that).
    Completion is reported at the next get_finished, like an event that was polled."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int, blocks_per_chunk: int, copy: bool) -> None:
        self._gpu = [tensor.tensor for tensor in kv_caches.tensors]
        self._page = [tensor.page_size_bytes for tensor in kv_caches.tensors]
        self._refs = kv_caches.group_data_refs
        self._blocks_per_chunk = blocks_per_chunk
        self._copy = copy
        self._cpu = [
            torch.zeros(num_chunks, blocks_per_chunk * page, dtype=torch.int8) if copy else torch.empty(0)
            for page in self._page
        ]
        self._finished: list[TransferResult] = []
        self.stats = StandInStats()

    # The GPU side: vLLM 0.33 passes a GPULoadStoreSpec, 0.34 the blocks' DevicePointers.
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, CPULoadStoreSpec)
        size = self._transfer(src_spec, dst_spec, to_cpu=True)
        self.stats.stores += 1
        self.stats.bytes_stored += size
        self._finished.append(TransferResult(job_id, True, size, 0.0))
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False
    ) -> bool:
        assert isinstance(src_spec, CPULoadStoreSpec)
        size = self._transfer(dst_spec, src_spec, to_cpu=False)
        self.stats.loads += 1
        self.stats.bytes_loaded += size
        self._finished.append(TransferResult(job_id, True, size, 0.0))
        return True

    def _gpu_groups(self, gpu_side: Any) -> list[tuple[int, list[int]]]:
        """Per KV cache group: the logical index of its first GPU block, and the block ids."""
        if isinstance(gpu_side, GPULoadStoreSpec):  # vLLM 0.33
            ids, offset, groups = gpu_side.block_ids.tolist(), 0, []
            for size, index in zip(gpu_side.group_sizes, gpu_side.block_indices):
                groups.append((index, ids[offset : offset + size]))
                offset += size
            return groups
        # vLLM 0.34: DevicePointers, a (pointer, size) per block and data ref of each group in
        # turn; the "device" is this process's memory, so a pointer gives its block back.
        offset, groups = 0, []
        for group, (size, refs, index) in enumerate(zip(
                gpu_side.group_block_counts, gpu_side.group_data_ref_counts, gpu_side.block_indices)):
            tensor = self._gpu[self._refs[group][0].tensor_idx] if size else None
            ptrs = gpu_side.ptrs[offset : offset + size].tolist()
            row = tensor.stride(0) * tensor.element_size() if tensor is not None else 1
            groups.append((index, [(ptr - tensor.data_ptr()) // row for ptr in ptrs] if tensor is not None else []))
            offset += size * refs
        return groups

    def _transfer(self, gpu_side: Any, cpu_spec: CPULoadStoreSpec, to_cpu: bool) -> int:
        # Same addressing as vLLM's CPUOffloadingWorker: per group, block_indices[g] is the
        # logical index of the group's first GPU block; the chunk side skips that many
        # sub-blocks modulo blocks_per_chunk.
        per_chunk = self._blocks_per_chunk
        chunk_ids = cpu_spec.block_ids.tolist()
        chunk_offset = num_bytes = 0
        for group, (block_index, group_gpu) in enumerate(self._gpu_groups(gpu_side)):
            group_size = len(group_gpu)
            if group_size == 0:
                continue
            skip = block_index % per_chunk
            num_chunks = -(-(group_size + skip) // per_chunk)
            group_chunks = chunk_ids[chunk_offset : chunk_offset + num_chunks]
            for index, gpu_block in enumerate(group_gpu):
                logical = skip + index
                chunk, sub_block = group_chunks[logical // per_chunk], logical % per_chunk
                for ref in self._refs[group]:
                    page = self._page[ref.tensor_idx]
                    size = ref.page_size_bytes
                    num_bytes += size
                    if not self._copy:
                        continue
                    gpu_row = self._gpu[ref.tensor_idx][gpu_block, :size]
                    cpu_row = self._cpu[ref.tensor_idx][chunk, sub_block * page : sub_block * page + size]
                    if to_cpu:
                        cpu_row.copy_(gpu_row)
                    else:
                        gpu_row.copy_(cpu_row)
            chunk_offset += num_chunks
        return num_bytes

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        self.stats.waits += 1  # transfers already ran at submit


class HarnessCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPUOffloadingSpec (real CPUOffloadingManager on the scheduler side) whose worker is
    a StandInOffloadingWorker, because CPUOffloadingSpec.get_worker requires CUDA or XPU.
    Selected by kv_connector_extra_config spec_name/spec_module_path; 'stand_in_copy' picks
    the copying or the non-copying worker."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._stand_in: StandInOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._stand_in is None:
            self._stand_in = StandInOffloadingWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                copy=bool(self.extra_config.get("stand_in_copy", True)),
            )
        return self._stand_in


def offloading_transfer_config(
    cpu_bytes_to_use: int = 8 << 20, copy: bool = True, **extra: Any
) -> KVTransferConfig:
    """vLLM's OffloadingConnector, loaded through kv_connector_module_path, with the CPU stand-in."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_connector_module_path=OFFLOADING_CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={
            "cpu_bytes_to_use": cpu_bytes_to_use,
            "spec_name": HarnessCPUOffloadingSpec.__name__,
            "spec_module_path": HarnessCPUOffloadingSpec.__module__,
            "stand_in_copy": copy,
            **extra,
        },
    )


def stand_in_worker(harness: Harness) -> StandInOffloadingWorker:
    """The stand-in behind the worker-role OffloadingConnector of a harness."""
    connector: Any = harness.worker_connector
    worker = connector.connector_worker.worker
    assert isinstance(worker, StandInOffloadingWorker)
    return worker
