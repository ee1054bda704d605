"""The worker role of tierkv's vLLM connector: one per GPU rank, it moves bytes and decides
nothing. Imported only when vLLM builds a worker-role connector (it loads torch's transfer
code and LMDB).

- :meth:`WorkerSide.register_kv_caches` takes vLLM 0.33's per-layer views: logical
  ``[B, H, N, C]`` over one shared buffer, in any of the layouts LBNHC, LBHNC (layer
  outermost) and BLNHC, BLHNC (block outermost: the views have a block stride of every
  layer's page). Views split into kernel blocks (``[B * r, H, N / r, C]``) are regrouped
  per vLLM block (NHD pages only: their bytes are the same either way). Layers are taken
  in the KV cache group's order. It builds the :class:`CpuSlab`, the transfer engine, the
  rank's :class:`DiskTier` with its :class:`DiskIO`, the :class:`JobExecutor` and the
  :class:`WorkerAdapter`, and checks ``chunk_bytes`` against the scheduler's arithmetic.
- Per step (vLLM's order): ``handle_preemptions(plan)`` before the forward;
  ``start(plan)`` from ``start_load_kv``; ``after_forward()`` from ``wait_for_save``;
  ``poll()`` from ``get_finished``.
- Shutdown flush: the worker remembers, per CPU slot, the key whose bytes the slot holds
  and whether that chunk is on disk (spilled, or promoted from disk, and not deleted
  since). :meth:`shutdown` drains every job, then writes every slot that holds valid,
  unspilled bytes to the disk tier, so a restart is warm even for chunks the scheduler
  never got to spill. Chunks past the disk capacity are trimmed by the index at the next
  start.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from tierkv.core.jobs import Completion, JobId, JobKind, LoadSpec, SpillSpec, StoreSpec, failed_set
from tierkv.engine.requests import StepPlan, WorkerReport
from tierkv.engine.worker import WorkerAdapter
from tierkv.errors import ConfigError
from tierkv.integrations.vllm_config import ConnectorSettings, Geometry, disk_tier_config
from tierkv.keys import Namespace
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk import DiskTier
from tierkv.transfer.disk_io import DiskIO
from tierkv.transfer.executor import JobExecutor
from tierkv.transfer.factory import make_transfer_engine
from tierkv.transfer.layout import KVLayout

log = logging.getLogger("tierkv.vllm")

_KIND_NAMES = {JobKind.STORE: "gpu_to_cpu", JobKind.LOAD: "cpu_to_gpu", JobKind.SPILL: "cpu_to_disk"}


def page_order_of(view: torch.Tensor) -> str | None:
    """``"NHD"`` or ``"HND"`` from a logical ``[B, H, N, C]`` view's strides (None when
    one of H, N is 1 and both orders are the same bytes)."""
    _, heads, tokens, _ = view.shape
    if heads == 1 or tokens == 1:
        return None
    return "NHD" if view.stride(2) > view.stride(1) else "HND"


def regroup_layer(name: str, view: torch.Tensor, num_blocks: int, page_order: str) -> torch.Tensor:
    """A ``[num_blocks, ...]`` tensor whose ``tensor[b]`` is the page of vLLM block ``b``."""
    if view.dim() != 4:
        raise ConfigError(f"tierkv vLLM connector: layer {name!r} has shape {tuple(view.shape)}; "
                          f"expected vLLM's logical [B, H, N, C] attention view")
    rows = int(view.shape[0])
    if rows == num_blocks:
        return view
    if rows % num_blocks:
        raise ConfigError(f"tierkv vLLM connector: layer {name!r} has {rows} blocks, the KV cache "
                          f"config {num_blocks}")
    if page_order != "NHD" and int(view.shape[1]) > 1:
        raise ConfigError(
            f"tierkv vLLM connector: layer {name!r} is split into {rows // num_blocks} kernel "
            f"blocks per block with HND pages, whose bytes differ from an unsplit page; use an "
            f"NHD layout (VLLM_KV_CACHE_LAYOUT=LBNHC) with this attention backend")
    return view.view(num_blocks, rows // num_blocks, *view.shape[1:])  # splitting dim 0: a view


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, geometry: Geometry, namespace: Namespace,
                 num_blocks: int, rank: int, disk_rank: int) -> None:
        self.settings = settings
        self.geometry = geometry
        self.namespace = namespace
        self.fingerprint = namespace.fingerprint()
        self.num_blocks = num_blocks
        self.rank = rank
        self.disk_rank = disk_rank
        self.layout: KVLayout | None = None
        self.slab: CpuSlab | None = None
        self.disk: DiskTier | None = None
        self.executor: JobExecutor | None = None
        self.worker: WorkerAdapter | None = None
        self._specs: dict[JobId, StoreSpec | LoadSpec | SpillSpec] = {}
        self._recorded: StepPlan | None = None
        # Shutdown flush bookkeeping (disk tier only): slot -> key of its valid bytes, and
        # the keys held in a slot that are not known to be on disk.
        self._holding: dict[int, bytes] = {}
        self._held: dict[bytes, int] = {}
        self._unspilled: set[bytes] = set()
        self._counts: dict[str, float] = {}
        self._reported: dict[str, float] = {}
        self._closed = False

    # ------------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        geometry = self.geometry
        ordered: dict[str, torch.Tensor] = {}
        for name in geometry.layer_names:
            view = kv_caches.get(name)
            if view is None:
                raise ConfigError(f"tierkv vLLM connector: layer {name!r} of the KV cache group "
                                  f"was not registered (got {sorted(kv_caches)[:4]}...)")
            order = page_order_of(view) if view.dim() == 4 else None
            if order is not None and order != geometry.page_order:
                raise ConfigError(
                    f"tierkv vLLM connector: layer {name!r} has {order} pages but the KV cache "
                    f"layout {geometry.layout} means {geometry.page_order}")
            ordered[name] = regroup_layer(name, view, self.num_blocks, geometry.page_order)
        layout = KVLayout.from_tensors(ordered)
        chunk_bytes = layout.chunk_bytes(geometry.blocks_per_chunk)
        if chunk_bytes != geometry.chunk_bytes:
            raise ConfigError(
                f"tierkv vLLM connector: rank {self.rank} registered chunks of {chunk_bytes} bytes, "
                f"the scheduler sizes them as {geometry.page_bytes} page bytes x "
                f"{geometry.num_layers} layers x {geometry.blocks_per_chunk} blocks = "
                f"{geometry.chunk_bytes}; the KV cache views do not match the KV cache config")
        settings = self.settings
        self.layout = layout
        self.slab = CpuSlab(geometry.num_slots, chunk_bytes, settings.pin_memory)
        disk_io = None
        if settings.disk_path is not None:
            from tierkv.integrations.vllm_disk import acquire_tier, claim_env, release_tier

            config = disk_tier_config(settings, geometry)
            self.disk = acquire_tier(Path(settings.disk_path), self.namespace, self.disk_rank,
                                     config, chunk_bytes)
            try:
                claim_env(self.disk)
            except BaseException:
                release_tier(self.disk)
                self.disk = None
                raise
            disk_io = DiskIO(self.disk, self.slab, config.write_batch_bytes)
        transfer = make_transfer_engine(settings.device, layout, self.slab, geometry.blocks_per_chunk)
        self.executor = JobExecutor(transfer, disk_io)
        self.worker = WorkerAdapter(self.executor, self.rank)
        log.info("tierkv: rank %d registered %r; %d CPU slots of %d bytes%s", self.rank, layout,
                 geometry.num_slots, chunk_bytes,
                 f", disk tier at {self.disk.path}" if self.disk is not None else "")

    def _live(self) -> WorkerAdapter:
        if self.worker is None:
            raise ConfigError("tierkv vLLM connector: the worker got a step before register_kv_caches")
        return self.worker

    # ------------------------------------------------------------------ steps
    def _record(self, plan: StepPlan) -> None:
        if self._recorded is plan:
            return
        self._recorded = plan
        specs = self._specs
        for spec in plan.stores:
            specs[spec.job_id] = spec
        for load in plan.loads:
            if load.spec is not None:
                specs[load.spec.job_id] = load.spec
        for spill in plan.spills:
            specs[spill.job_id] = spill

    def handle_preemptions(self, plan: StepPlan) -> None:
        worker = self._live()
        self._record(plan)
        worker.handle_preemptions(plan)

    def start(self, plan: StepPlan) -> None:
        worker = self._live()
        self._record(plan)
        worker.start(plan)

    def after_forward(self) -> None:
        self._live().after_forward()

    def poll(self) -> WorkerReport:
        report = self._live().poll()
        for completion in report.completions:
            spec = self._specs.pop(completion.job_id, None)
            if spec is not None:
                self._account(spec, completion)
        return report

    def _account(self, spec: StoreSpec | LoadSpec | SpillSpec, completion: Completion) -> None:
        name = _KIND_NAMES[spec.kind]
        counts = self._counts
        counts[f"bytes_{name}"] = counts.get(f"bytes_{name}", 0) + completion.num_bytes
        counts[f"seconds_{name}"] = counts.get(f"seconds_{name}", 0.0) + completion.seconds
        if not completion.ok:
            counts[f"failed_jobs_{name}"] = counts.get(f"failed_jobs_{name}", 0) + 1
        if self.disk is None:
            return
        if isinstance(spec, SpillSpec):
            for key in spec.deletes:  # deletes run before the job's writes
                if key in self._held:
                    self._unspilled.add(key)
            failed = failed_set(completion, tuple(key for key, _ in spec.writes))
            for key, slot in spec.writes:
                if key not in failed and self._holding.get(slot) == key:
                    self._unspilled.discard(key)
            return
        if isinstance(spec, StoreSpec):
            failed = failed_set(completion, spec.keys)
            for key, slot in zip(spec.keys, spec.slots):
                self._hold(slot, None if key in failed else key, on_disk=False)
            return
        disk_chunks = [chunk for chunk in spec.chunks if chunk.from_disk]
        if disk_chunks:  # a promotion rewrote these slots from disk
            failed = failed_set(completion, tuple(chunk.key for chunk in spec.chunks))
            for chunk in disk_chunks:
                self._hold(chunk.slot, None if chunk.key in failed else chunk.key, on_disk=True)

    def _hold(self, slot: int, key: bytes | None, on_disk: bool) -> None:
        """Slot ``slot`` now holds the valid bytes of ``key`` (None: nothing valid)."""
        old = self._holding.pop(slot, None)
        if old is not None and self._held.get(old) == slot:
            del self._held[old]
            self._unspilled.discard(old)
        if key is None:
            return
        previous = self._held.get(key)
        if previous is not None and previous != slot:  # the key moved: the old slot is stale
            self._holding.pop(previous, None)
        self._holding[slot] = key
        self._held[key] = slot
        if on_disk:
            self._unspilled.discard(key)
        else:
            self._unspilled.add(key)

    # ------------------------------------------------------------------ stats
    def stats_since_last(self) -> dict[str, float]:
        delta = {name: value - self._reported.get(name, 0) for name, value in self._counts.items()}
        self._reported = dict(self._counts)
        return {name: value for name, value in delta.items() if value}

    # ------------------------------------------------------------------ shutdown
    def drain(self) -> None:
        """Submit everything pending and wait until no job is in flight."""
        worker, executor = self._live(), self.executor
        assert executor is not None
        worker.submit_pending()
        while executor.in_flight_ids():
            executor.wait(executor.in_flight_ids())
            self.poll()

    def unspilled_chunks(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every slot holding valid bytes not known to be on disk."""
        return sorted(((key, self._held[key]) for key in self._unspilled), key=lambda item: item[1])

    def shutdown(self) -> int:
        """Drain, flush unspilled chunks to disk, stop threads; returns chunks flushed."""
        if self._closed or self.worker is None:
            self._closed = True
            return 0
        self._closed = True
        flushed = 0
        try:
            self.drain()
        except Exception as exc:  # shutting down: never raise from here
            log.warning("tierkv: rank %d could not drain its jobs at shutdown: %s", self.rank, exc)
        finally:
            self.worker.shutdown()
        if self.disk is not None:
            try:
                if self.settings.flush_on_shutdown and self._unspilled:
                    flushed = self._flush_unspilled()
            finally:
                from tierkv.integrations.vllm_disk import release_tier, unclaim_env

                unclaim_env(self.disk)
                release_tier(self.disk)
        return flushed

    def _flush_unspilled(self) -> int:
        from tierkv.integrations.vllm_disk import write_chunks

        assert self.disk is not None and self.slab is not None
        chunks = self.unspilled_chunks()
        written = write_chunks(
            self.disk, self.slab, chunks, self.geometry.chunk_bytes,
            disk_tier_config(self.settings, self.geometry).write_batch_bytes,
            on_error=lambda exc: log.warning("tierkv: flush at shutdown failed: %s", exc),
        )
        log.info("tierkv: rank %d wrote %d of %d unspilled chunk(s) to disk at shutdown",
                 self.rank, written, len(chunks))
        return written
