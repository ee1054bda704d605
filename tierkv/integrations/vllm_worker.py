"""The worker role of tierkv's vLLM connector: one per GPU rank, it moves bytes and decides
nothing. Imported only when vLLM builds a worker-role connector (it loads torch's transfer
code and LMDB). What each worker-role call does is the table in ``docs/vllm.md``.

- :meth:`WorkerSide.register_kv_caches` takes vLLM 0.33's per-layer views: logical
  ``[B, H, N, C]`` over one shared buffer, in any of the layouts LBNHC, LBHNC (layer
  outermost) and BLNHC, BLHNC (block outermost: the views have a block stride of every
  layer's page). Views split into kernel blocks (``[B * r, H, N / r, C]``) are regrouped
  per vLLM block (NHD pages only: their bytes are the same either way). Layers are taken
  in the KV cache group's order; ``chunk_bytes`` must equal the scheduler's, or it raises.
- Each step's plan runs on the rank's :class:`WorkerAdapter` (:meth:`WorkerSide.adapter`).
- Shutdown flush: :meth:`shutdown` drains every job, then writes every slot that holds
  valid bytes not known to be on disk (:meth:`WorkerAdapter.unspilled_chunks`; the index
  that knows this lives in the scheduler's process) to the disk tier, so a restart is warm
  even for chunks the scheduler never got to spill. Chunks past the disk capacity are
  trimmed by the index at the next start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from tierkv.engine.metrics import remote_figures, since_last
from tierkv.engine.stack import PartsReader, WorkerStack, build_worker, start_line
from tierkv.engine.worker import WorkerAdapter
from tierkv.errors import ConfigError, UsageError
from tierkv.integrations.vllm_config import ConnectorSettings, store_config
from tierkv.integrations.vllm_geometry import Geometry
from tierkv.keys import Namespace, Part
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.opener import OtherParts
from tierkv.tiers.disk.tier import DiskTier
from tierkv.transfer.layout import KVLayout
from tierkv.transfer.parts import HeadLayout, PartReader

log = logging.getLogger("tierkv.vllm")


def page_order_of(view: torch.Tensor) -> str | None:
    """``"NHD"`` or ``"HND"`` from a logical ``[B, H, N, C]`` view's strides (None when
    one of H, N is 1 and both orders are the same bytes)."""
    _, heads, tokens, _ = view.shape
    if heads == 1 or tokens == 1:
        return None
    return "NHD" if view.stride(2) > view.stride(1) else "HND"


def check_block_tokens(name: str, view: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """The tokens a logical ``[B, H, N, C]`` view holds per vLLM block (``N`` times the
    kernel blocks a block is split into) must be the block size the keys are cut by: keys
    over blocks of another size would cover the wrong tokens."""
    rows, tokens = int(view.shape[0]), int(view.shape[2])
    split = rows // num_blocks if rows % num_blocks == 0 else 1
    if tokens * split != block_size:
        raise ConfigError(
            f"tierkv vLLM connector: layer {name!r} holds {tokens * split} tokens per block "
            f"(view {tuple(view.shape)}, N={tokens} x {split} kernel block(s)), the KV cache "
            f"config's block size is {block_size}; its keys would cover the wrong tokens")


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


def head_layout(geometry: Geometry) -> HeadLayout:
    """Where each KV head's bytes are in one rank's slot (:mod:`tierkv.transfer.parts`)."""
    return HeadLayout.of_pages(
        pieces=geometry.num_layers * geometry.pages_per_chunk, page_bytes=geometry.page_bytes,
        page_heads=geometry.model_heads // geometry.num_parts, page_order=geometry.page_order,
        tokens_per_page=geometry.block_size, model_heads=geometry.model_heads)


def check_groups_alias(geometry: Geometry, kv_caches: Mapping[str, torch.Tensor]) -> None:
    """With several KV cache groups, tierkv copies the widest group's layer views only:
    layer ``i`` of every group must view the same bytes as that group's layer ``i`` (vLLM's
    groups overlay one another from byte 0), or the other groups' pages would be missed."""
    for group in geometry.groups:
        for name, mine in zip(group.layer_names, geometry.layer_names):
            view, region = kv_caches.get(name), kv_caches[mine]
            if view is None:
                raise ConfigError(f"tierkv vLLM connector: layer {name!r} of a KV cache group "
                                  f"was not registered (got {sorted(kv_caches)[:4]}...)")
            if (view.data_ptr(), view.stride(0) * view.element_size()) != \
                    (region.data_ptr(), region.stride(0) * region.element_size()):
                raise ConfigError(
                    f"tierkv vLLM connector: layer {name!r} does not share its bytes with layer "
                    f"{mine!r} of the widest KV cache group; tierkv stores groups that overlay "
                    f"one another, as vLLM's KV cache planning lays them out (serve with "
                    f"--disable-hybrid-kv-cache-manager otherwise)")


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, geometry: Geometry, namespace: Namespace,
                 num_blocks: int, rank: int, replica: int = 0) -> None:
        self.settings = settings
        self.geometry = geometry
        self.namespace = namespace
        self.num_blocks = num_blocks
        self.rank = rank
        self.part = geometry.part_of(rank)  # what this rank stores and loads as its own
        self.replica = replica  # data-parallel engine: its own part directories
        self.config = store_config(settings, geometry, rank)
        self._other_disk: OtherParts | None = None
        self._other_remote: dict[int, Any] = {}  # part count -> RemoteTier of that count
        self._stack: WorkerStack | None = None
        self.slab: CpuSlab | None = None
        self.disk: DiskTier | None = None
        self.worker: WorkerAdapter | None = None
        self._reported: dict[str, float] = {}
        self._closed = False

    @property
    def writer(self) -> bool:
        """Whether this rank writes its part (the first rank holding it: every rank, or
        rank 0 under MLA)."""
        return self.geometry.stored_rank(self.rank) == self.rank

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
            if view.dim() == 4:
                check_block_tokens(name, view, self.num_blocks, geometry.block_size)
            if order is not None and order != geometry.page_order:
                raise ConfigError(
                    f"tierkv vLLM connector: layer {name!r} has {order} pages but the KV cache "
                    f"layout {geometry.layout} means {geometry.page_order}")
            ordered[name] = regroup_layer(name, view, self.num_blocks, geometry.page_order)
        check_groups_alias(geometry, kv_caches)
        layout = KVLayout.from_tensors(ordered)
        chunk_bytes = layout.chunk_bytes(geometry.pages_per_chunk)
        if chunk_bytes != geometry.chunk_bytes:
            raise ConfigError(
                f"tierkv vLLM connector: rank {self.rank} registered chunks of {chunk_bytes} bytes, "
                f"the scheduler sizes them as {geometry.page_bytes} page bytes x "
                f"{geometry.num_layers} layers x {geometry.pages_per_chunk} blocks = "
                f"{geometry.chunk_bytes}; the KV cache views do not match the KV cache config")
        # A rank that holds a part another rank writes (MLA: every rank but 0; heads fewer
        # than ranks: all but the first of each part) loads it and writes none: the disk
        # read-only, no pushes, its spills done at once.
        writer = self.writer
        config = self.config
        if not writer and config.remote is not None:
            config = replace(config, remote=replace(config.remote, push="read_only"))
        # The remote tier is shared by engines: its part is the one this rank holds (the
        # disk's directory is per data-parallel engine too).
        other_disk, other_remote = self._other_parts(config)
        self._stack = build_worker(
            config, layout, geometry.num_slots, namespace=self.namespace, part=self.part,
            replica=self.replica, writer=writer, other_disk=other_disk, other_remote=other_remote,
            refusal=f"tierkv vLLM connector: the disk tier at {config.disk.path} is in use by "
                    f"another tierkv worker (another vLLM server with the same model and "
                    f"disk_path?); give each server its own disk_path")
        self.slab, self.disk = self._stack.slab, self._stack.disk
        self.worker = WorkerAdapter(self._stack.executor, self.rank,
                                    track_slots=self.disk is not None and writer,
                                    writes_disk=writer)
        log.debug("tierkv: rank %d registered %r", self.rank, layout)
        log.info("%s", start_line(f"rank {self.rank}", config, self.namespace,
                                  num_slots=geometry.num_slots, chunk_bytes=chunk_bytes))

    def _other_parts(self, config: Any) -> tuple[PartsReader | None, PartsReader | None]:
        """The disk and remote readers of chunks another part count wrote (another TP
        size): each needed part read whole, verified, and its heads copied into the slot
        (:class:`tierkv.transfer.parts.PartReader`); None where there is no such tier."""
        geometry = self.geometry
        if len(geometry.source_counts()) < 2:
            return None, None  # MLA, or a model of one KV head: one part count only
        layout = head_layout(geometry)
        model_bytes = geometry.model_chunk_bytes
        read_disk = read_remote = None
        if config.disk.path is not None:
            other = self._other_disk = OtherParts(self.namespace, config.disk, model_bytes,
                                                  self.replica)
            read_disk = PartReader(layout, self.part, lambda count: other).read
        if config.remote is not None:
            settings, namespace, tiers = config.remote, self.namespace, self._other_remote
            lock = threading.Lock()

            def remote_source(count: int) -> Any:
                with lock:  # one tier per count, made once
                    if count not in tiers:
                        from tierkv.tiers.remote.tier import RemoteTier

                        tiers[count] = RemoteTier(settings, namespace, Part(0, count),
                                                  model_bytes // count, lazy=True,
                                                  role=f"loads of {count}-part chunks")
                    return tiers[count]

            read_remote = PartReader(layout, self.part, remote_source).read
        return read_disk, read_remote

    def adapter(self) -> WorkerAdapter:
        """The rank's :class:`WorkerAdapter`, which runs each step's plan."""
        if self.worker is None:
            raise UsageError("tierkv vLLM connector: the worker got a step before register_kv_caches")
        return self.worker

    def stats_since_last(self) -> dict[str, Any]:
        """Counters since the last call, and the seconds of each job finished since then."""
        if self.worker is None:
            return {}
        counts = self.worker.statistics()
        if self._stack is not None and self._stack.remote is not None:  # tierkv:remote_*
            pusher = self._stack.executor.pusher
            counts.update(remote_figures([self._stack.remote.statistics(),
                                          *([] if pusher is None else [pusher.statistics()])]))
        out = since_last(counts, self._reported)
        self._reported = counts
        out.update(self.worker.take_durations())
        return out

    def unspilled_chunks(self) -> list[tuple[bytes, int]]:
        return self.adapter().unspilled_chunks()

    def shutdown(self) -> int:
        """Drain, flush unspilled chunks to disk, stop threads; returns chunks flushed."""
        closed, self._closed = self._closed, True
        if closed or self.worker is None:
            return 0
        try:
            self.worker.drain()
        except Exception as exc:  # shutting down: never raise from here
            log.warning("tierkv: rank %d could not drain its jobs at shutdown: %s", self.rank, exc)
        assert self._stack is not None
        try:
            self.worker.shutdown()  # pending stores submitted, jobs finished, threads stopped
            flush = self.disk is not None and self.writer and self.settings.flush_on_shutdown
            return self._flush_unspilled() if flush else 0
        finally:
            self._stack.close()  # releases the disk tier
            if self._other_disk is not None:
                self._other_disk.close()
            for tier in self._other_remote.values():
                tier.close()

    def _flush_unspilled(self) -> int:
        assert self.disk is not None and self.slab is not None
        chunks = self.unspilled_chunks()
        if not chunks:
            return 0
        items = [(key, self.slab.memoryview(slot)[: self.geometry.chunk_bytes])
                 for key, slot in chunks]
        done = self.disk.put_in_batches(items, self.config.disk.write_batch_bytes,
                                        stop_when_full=True)
        if done.error is not None:  # the engine is shutting down: logged, never raised
            log.warning("tierkv: flush at shutdown failed: %s", done.error)
        log.info("tierkv: rank %d wrote %d of %d unspilled chunk(s) to disk at shutdown",
                 self.rank, len(done.written), len(chunks))
        return len(done.written)
