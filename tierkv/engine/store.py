"""TierKVStore: the library API for custom engines, both sides in one process (a runnable
example: README.md).

Primitives (each method's docstring says what it does, never does, and raises):
- ``lookup(keys) -> int``: chunks in the ready, contiguous prefix (no side effects).
- ``store(keys, block_ids) -> JobId | None``: copies the chunks not yet present. When
  the CPU tier is full of chunks not yet on disk it writes the oldest back first (a
  blocking disk write); when nothing can be freed, "no room" is counted in
  ``statistics()``, never raised.
- ``load(keys, block_ids) -> LoadHandle``: loads the ready prefix, making room the way
  ``store()`` does; the completion's ``failed_keys`` name chunks that did not land
  (recompute those; never a false hit). What a lookup promised and a load did not deliver
  is counted with its cause (``statistics().load_shortfall``).
- ``fence(block_ids)``: waits for every job that reads or writes those blocks (the vLLM
  adapter's fence, for engines that are their own scheduler): call it before handing
  blocks out again.
- With a remote tier (``config.remote``), ``lookup`` and ``load`` also ask it for the chunks
  past the local prefix and wait at most ``remote.lookup_deadline_seconds`` for the answer
  (a late answer serves the next call); what it has is loaded remote -> CPU slot -> GPU.
  Stored chunks are pushed to it in the background (``remote.push``).
- ``poll() -> list[Completion]``: finished store and load jobs, each once.
- ``wait(job_ids)``; ``drain()``; ``flush()``; ``statistics()``; ``close()`` (idempotent;
  use after raises).
- ``usage()``: each tier's capacity and use in bytes and tokens; ``take_events()`` (with
  ``record_events=True``): which tiers chunks entered and left (docs/engine-adapter.md).

**A block's lifetime** (docs/engine-adapter.md, "TierKVStore: a block's lifetime"): a
store's source blocks must not be written, and a load's target blocks must not be read or
handed out again, until the job is done. With ``store_mode="copied"`` (the default),
``store()`` returns only once its source bytes are copied (the CUDA engine: work queued
later on the compute stream runs after the copy), so rewriting the blocks afterwards can
never reach the stored chunk; ``"async"`` returns at once and trusts the engine to call
``fence()`` (or ``wait()``) before it writes them (docs/benchmarks/copy.md, "store()
modes", has the cost). Loads are always asynchronous.

Inputs are checked before anything changes (:mod:`tierkv.engine.store_inputs`):
:class:`UsageError` naming a bad argument, :class:`ConfigError` a namespace given that does
not describe these tensors and this config.

Not thread-safe, and not for a forked child: a call that overlaps another one, or any call
from a child, raises :class:`UsageError` and changes nothing
(:mod:`tierkv.engine.store_exit`). Opening claims the disk environment (a second store on
it is refused); a failed construction releases all it took.
Why: docs/operations.md ("Fork", "Threads", "One writer per environment"). Spills and
completions advance on every call; ``poll()`` in the engine loop keeps them moving.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tierkv.config import DISK_OVERHEAD_BYTES, StoreConfig, cpu_slot_count, disk_chunk_capacity
from tierkv.config_env import from_environment
from tierkv.core.jobs import ChunkCopy, Completion, JobId, JobKind, LoadSpec, StoreSpec
from tierkv.core.stats import AdapterStats
from tierkv.engine import store_exit
from tierkv.engine.store_exit import one_caller
from tierkv.engine.disk_start import DiskShare, FoundOnDisk, rebuild_index
from tierkv.engine.metrics import (DURATION_KEY, Durations, TierUsage, collect_figures,
                                   config_info, local_usage, remote_usage)
from tierkv.engine.stack import (build_index, build_remote_lookup, build_worker, library_part,
                                 short_id, start_line)
from tierkv.engine.store_inputs import (block_set, build_namespace, check_keys, check_namespace,
                                        split_blocks)
from tierkv.engine.store_inputs import job_ids as job_ids_of
from tierkv.engine.store_stats import (PATH_NAMES, LoadHandle, LoadShortfall, PathStats,
                                       StoreStats)
from tierkv.engine.tier_lookup import lookup_tiers
from tierkv.errors import ClosedError, ConfigError, TierKVError, UsageError
from tierkv.keys import Namespace
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.remote.stats import RemoteStatistics, combined
from tierkv.transfer.layout import KVLayout

__all__ = ["LoadHandle", "LoadShortfall", "PathStats", "StoreStats",
           "TierKVStore", "build_namespace"]

log = logging.getLogger(__name__)

MAX_PROMISES = 4096  # lookups remembered for the load shortfall (load() forgets its own)


class TierKVStore:
    """A tiered KV-cache store over an engine's paged KV tensors (one per layer, block
    dimension first), both sides in one process: the CPU slab, the disk tier under
    ``config.disk.path`` and the remote tier of ``config.remote``.

    The engine is its own scheduler, so it keeps the rule the vLLM adapter keeps for
    vLLM: a store's source blocks are not written, and a load's target blocks not read or
    given to another request, until the job is done. ``store_mode="copied"`` (default)
    keeps the store half for it: ``store()`` returns once its bytes are copied.
    ``fence(block_ids)`` waits for every job on blocks about to be reused.

    Construction raises :class:`ConfigError` for bad settings or tensors (naming the
    setting, the value and the limit), for a ``tokens_per_block`` that no dim of the pages
    (``tensor[b]``) holds (flat pages are not checked), and for a disk environment another
    process holds;
    it never leaves threads, memory or claims behind when it raises.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        model_id: str | None = None,
        tokens_per_block: int = 16,
        config: StoreConfig | None = None,
        namespace: Namespace | None = None,
        record_events: bool = False,
    ) -> None:
        self._pid = os.getpid()
        self._busy = threading.Lock()
        self._closed = True  # until it is open: the finalizer leaves a failed start alone
        # No config: the defaults, TIERKV_CONFIG's YAML file and the TIERKV_* variables.
        self.config = config if config is not None else from_environment()
        if not isinstance(self.config, StoreConfig):
            raise UsageError(f"store: config must be a StoreConfig, got a "
                              f"{type(self.config).__name__} (StoreConfig.from_dict reads a dict)")
        cfg = self.config
        self.layout = KVLayout.from_tensors(kv_caches)
        if namespace is None:
            if not model_id or not isinstance(model_id, str):
                raise UsageError("store: pass model_id (or a Namespace) so stored KV is tied to its model")
            namespace = build_namespace(self.layout, model_id, tokens_per_block, cfg)
        else:
            check_namespace(namespace, self.layout, cfg)
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
        if cfg.disk.path is not None and disk_chunk_capacity(cfg.disk.max_bytes,
                                                             self.chunk_bytes) < 1:
            least = self.chunk_bytes + DISK_OVERHEAD_BYTES
            raise ConfigError(
                f"disk tier: disk.max_bytes={cfg.disk.max_bytes} holds no chunk: one takes "
                f"{least} bytes ({self.chunk_bytes} of KV + {DISK_OVERHEAD_BYTES} of "
                f"overhead); raise disk.max_bytes to at least {least}, or set "
                f"disk.path=None for no disk tier")
        self._stack = build_worker(cfg, self.layout, num_slots, namespace=namespace)
        self.slab, self.disk, self.executor = self._stack.slab, self._stack.disk, self._stack.executor
        self._remote = None
        self._share: DiskShare | None = None
        try:
            self._remote = build_remote_lookup(cfg, namespace, [[library_part(cfg)]],
                                               self.chunk_bytes)
            self.index = build_index(cfg, num_slots, 0, record_events=record_events,
                                     disk_tier=self.disk is not None)
            if self.disk is not None:
                self._open_share(num_slots)
        except BaseException:
            self._closed = True
            self._close_parts()
            raise
        self._stats = StoreStats()  # the paths and the load shortfall
        self._durations = {kind: Durations() for kind in JobKind}
        self._lookups = AdapterStats()  # of its figures, the lookups' (queried, hit per tier)
        # and the jobs' bytes_completed
        self._ready: list[Completion] = []
        # What the last lookup of keys starting with a key promised (load() counts the
        # shortfall). fence() asks the executor which jobs touch given blocks.
        self._promised: dict[bytes, int] = {}
        self._closed = False
        store_exit.track(self)  # flushed at interpreter exit if never closed
        log.info("%s", start_line("store", cfg, namespace, num_slots=num_slots,
                                  chunk_bytes=self.chunk_bytes))

    def _open_share(self, num_slots: int) -> None:
        """Warm the index with the chunks on disk, over this store's share of the disk cap,
        which every namespace under ``disk.path`` shares (:class:`DiskShare`)."""
        assert self.disk is not None and self.config.disk.path is not None
        cfg, namespace, root = self.config, self.namespace, Path(self.config.disk.path)
        found_on_disk = FoundOnDisk()
        found_on_disk.scan(self.disk)
        keys = found_on_disk.oldest_first()
        self._share = DiskShare(root, namespace.fingerprint(),
                                [StoreLayout.part_dir_name(library_part(cfg))],
                                cfg.disk.max_bytes, self.chunk_bytes,
                                check_seconds=cfg.disk.budget_check_seconds, min_step=num_slots)
        capacity = self._share.start(len(keys), log)  # its chunks back, and a step of room more
        budget = self._share.budgets[0]
        files, unit = budget.fixed_bytes, budget.unit_bytes
        if cfg.disk.max_bytes - files < unit:  # the cap counts the index files too
            raise ConfigError(
                f"disk tier: disk.max_bytes={cfg.disk.max_bytes} holds no chunk beside this "
                f"store's index files and claims ({files} bytes under {root}); raise "
                f"disk.max_bytes to at least {files + unit}, or set disk.path=None for no "
                f"disk tier")
        rebuild_index(self.index, keys, capacity, root=root, namespace=namespace,
                      cap=f"disk.max_bytes={cfg.disk.max_bytes}", log=log)

    # ------------------------------------------------------------------ API
    @one_caller
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many chunks of ``keys``, from the first, are ready to load in some tier
        (CPU, disk, or remote within ``remote.lookup_deadline_seconds``).

        Never changes what is stored or reserves anything (a ``load()`` of the same keys
        counts what it does not deliver of this answer in ``statistics().load_shortfall``);
        never blocks longer than the remote tier's lookup deadline. Raises
        :class:`UsageError` for keys that are not 32-byte ``bytes``, :class:`ClosedError`
        after ``close()``, :class:`UsageError` from another thread or a forked child."""
        self._check_open()
        check_keys(keys)
        self._pump()
        found = lookup_tiers(self.index, self._remote, keys)[0]
        counts, tier, tpc = self._lookups, self._lookups.tier, self.tokens_per_chunk
        counts.lookups += 1
        counts.queried_tokens += len(keys) * tpc
        tier["cpu"].hit_tokens += found.num_on_cpu * tpc
        tier["remote"].hit_tokens += found.num_remote * tpc
        tier["disk"].hit_tokens += (found.num_hits - found.num_on_cpu - found.num_remote) * tpc
        if found.num_hits:
            self._promise(keys[0], found.num_hits)
        return found.num_hits

    @one_caller
    def store(self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]) -> JobId | None:
        """Copy the chunks of ``keys`` not yet present from their blocks (``block_ids``: one
        sequence of ``blocks_per_chunk`` ids per key, or one flat sequence) into the CPU
        tier; they become hits when the job completes, and go to disk when evicted.
        Returns the job id, or None when there is nothing to copy.

        With ``store_mode="copied"`` it returns once the blocks' bytes are copied (CUDA:
        work queued later on the compute stream runs after the copy), so the engine may
        rewrite the blocks at once; with ``"async"`` the blocks must not be written until
        the job is done (``fence()``, ``wait()``). Never stores a chunk already present,
        never evicts data in use, and never raises for lack of room: when the CPU tier is
        full of chunks not on disk yet it writes the oldest back first (a blocking disk
        write), and what still finds no room is counted (``statistics().index
        .stores_no_room``). Raises :class:`UsageError` for bad keys or block ids (before
        anything changes), :class:`ClosedError` after ``close()``, :class:`UsageError`
        from another thread or a forked child, :class:`BrokenError` when the copy thread
        or the device died."""
        self._check_open()
        check_keys(keys)
        per_chunk = split_blocks(keys, block_ids, self.blocks_per_chunk, self.layout.num_blocks)
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
        if self.config.store_mode == "copied":
            self.executor.transfer.make_compute_wait([plan.job_id])
        return plan.job_id

    @one_caller
    def load(self, keys: Sequence[bytes], block_ids: Sequence[int] | Sequence[Sequence[int]]) -> LoadHandle:
        """Start loading the ready prefix of ``keys`` into ``block_ids`` (one sequence per
        key, or one flat sequence): from the CPU tier, or through a CPU slot from the disk
        or remote tier. Like ``store()``, it first writes chunks back to disk when every
        CPU slot holds one not on disk yet, so a lookup's hits find a slot.

        Asynchronous: the target blocks hold the chunks only once the job is done
        (``wait([handle.job_id])``, ``poll()``); do not read them, or give them to another
        request, before (``fence()``). Never reports a hit for data that did not land: the
        completion's ``failed_keys`` name the chunks to recompute. What the last
        ``lookup()`` of keys starting with ``keys[0]`` counted and this load does not
        deliver is counted by cause (``statistics().load_shortfall``), never raised.
        Raises :class:`UsageError` for bad keys or block ids (before anything changes),
        :class:`ClosedError` after ``close()``, :class:`UsageError` from another thread or
        a forked child."""
        self._check_open()
        check_keys(keys)
        per_chunk = split_blocks(keys, block_ids, self.blocks_per_chunk, self.layout.num_blocks)
        self._pump()
        promised = min(self._promised.pop(keys[0], 0), len(keys)) if keys else 0
        hits = lookup_tiers(self.index, self._remote, keys)[0].num_hits
        short = self.index.shortfall(keys[:hits], load=True)
        if short:
            self._make_room(short)
            hits = self.index.lookup(keys[:hits]).num_hits  # a spill may evict on disk
        plan = self.index.prepare_load(keys[:hits])
        shortfall = self._stats.load_shortfall
        shortfall.gone += max(promised - hits, 0)
        shortfall.no_room += max(min(promised, hits) - len(plan.chunks), 0)
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

    @one_caller
    def fence(self, block_ids: Any = None) -> None:
        """Before blocks are handed out again (to another request, to a new ``load()``, or
        rewritten): wait for every store job that reads and every load job that writes
        any of ``block_ids`` (one flat sequence or one per chunk; None: every job in
        flight), so no copy in flight can mix their old and new bytes. Every job of this
        store is submitted when ``store()`` or ``load()`` returns, so there is nothing left
        to submit first.

        Never waits on jobs of other blocks, spills included. Raises :class:`UsageError`
        for block ids that are not ints, :class:`ClosedError` after ``close()``,
        :class:`UsageError` from another thread or a forked child, :class:`BrokenError`
        when the copy thread or the device died."""
        self._check_open()
        wanted = None if block_ids is None else block_set(block_ids)
        jobs = self.executor.jobs_touching(wanted)
        if jobs:
            self.executor.wait(jobs)
        self._pump()

    @one_caller
    def poll(self) -> list[Completion]:
        """Finished store and load jobs since the last call, each once (``failed_keys``:
        the chunks that did not land; recompute those). Also moves spills along.

        Never blocks and never raises for a failed job (it is in the completion). Raises
        :class:`ClosedError` after ``close()``, :class:`UsageError` from another thread or
        a forked child."""
        self._check_open()
        self._pump()
        ready, self._ready = self._ready, []
        return ready

    @one_caller
    def wait(self, job_ids: Iterable[JobId | None]) -> None:
        """Block until the jobs ``job_ids`` (what ``store()`` and ``load()`` returned; None
        is skipped) are done; their completions then come from ``poll()``.

        Never waits on other jobs. Raises :class:`UsageError` for what is not a job id,
        :class:`UnknownJobError` for an id this store never returned, :class:`ClosedError`
        after ``close()``, :class:`UsageError` from another thread or a forked child."""
        self._check_open()
        self.executor.wait(job_ids_of(job_ids))
        self._pump()

    @one_caller
    def drain(self) -> None:
        """Wait until every job in flight (spills included) has finished.

        Never starts new spills beyond those the finished jobs ask for. Raises
        :class:`ClosedError` after ``close()``, :class:`UsageError` from another thread or
        a forked child."""
        self._check_open()
        self._drain()

    @one_caller
    def flush(self) -> None:
        """Write every chunk of the CPU tier that is not on disk yet, wait, and sync the
        disk tier (without one: a drain).

        Never drops a chunk to make room. Raises :class:`ClosedError` after ``close()``,
        :class:`UsageError` from another thread or a forked child, :class:`BrokenError`
        when the disk tier broke underneath."""
        self._check_open()
        self._flush()

    @one_caller
    def statistics(self) -> StoreStats:
        """A snapshot of the counters since the store opened: the index's (hits, evictions,
        "no room", corrupt chunks), bytes and seconds per path (``path["gpu_to_cpu"]``...),
        the remote tier's (``remote``: its calls, the lookups' and the pushes', summed over
        the objects that use it, as the figures count them), and the load shortfall by cause.

        Never blocks on jobs and never changes anything; works after ``close()``. Raises
        :class:`UsageError` from another thread or a forked child."""
        records = self._remote_records()
        return self._stats.snapshot(index=self.index.statistics(), chunk_bytes=self.chunk_bytes,
                                    remote=combined(records) if records else None)

    def _remote_records(self) -> list[RemoteStatistics]:
        """The records of the loads' tier, the lookup's tier, the lookup and the pushes."""
        remote, pusher = self._remote, self.executor.pusher
        if remote is None or self._stack.remote is None:
            return []
        return [self._stack.remote.statistics(), remote.tier.statistics(), remote.statistics(),
                *([] if pusher is None else [pusher.statistics()])]

    def figures(self) -> dict[str, float | Durations]:
        """The figures :mod:`tierkv.engine.metrics` exports (counters since the store opened,
        usage now), by figure key. Unlike the other methods, safe to call from another thread
        (a Prometheus scrape): it only reads counters.

        Never blocks, never changes anything and never raises (after ``close()`` too)."""
        remote = self._remote
        return collect_figures(
            self.index.statistics(), self._lookups, store=self._stats,
            durations={DURATION_KEY[PATH_NAMES[kind]]: taken
                       for kind, taken in self._durations.items()},
            chunk_bytes=self.chunk_bytes, tokens_per_chunk=self.tokens_per_chunk,
            remote=self._remote_records(),
            memory=None if remote is None else remote.server_memory(),
            stored_chunk_bytes=0 if remote is None else remote.stored_chunk_bytes)

    def usage(self) -> dict[str, TierUsage]:
        """Each tier's capacity and use in bytes and tokens, as ``tierkv:capacity_tokens``
        etc.: ``"cpu"``, ``"disk"`` now; ``"remote"`` (once its servers answered) their
        whole memory as last polled (``remote.usage_seconds``; no network call here),
        capacity None if unbounded. Safe from another thread like :meth:`figures`; never raises."""
        remote = self._remote
        return {**local_usage(self.index.statistics(), self.chunk_bytes, self.tokens_per_chunk),
                **({} if remote is None else remote_usage(
                    remote.server_memory(), remote.stored_chunk_bytes, self.tokens_per_chunk))}

    @one_caller
    def take_events(self, max_chunks: int | None = None) -> list[tuple[str, str, bytes]]:
        """With ``record_events=True``: ``("stored" | "removed", medium, key)`` for each tier
        a chunk entered or left since the last call, medium ``"CPU"``, ``"DISK"`` or
        ``"REMOTE"``, of at most ``max_chunks`` chunks (the rest come next time). The first
        calls after opening give the chunks found on disk (docs/engine-adapter.md, "KV
        events"). Call it often: events wait here until taken. It never waits on a tier
        (it applies finished jobs first). Raises :class:`UsageError` from another thread or
        a forked child."""
        if not self._closed:
            self._pump()
        return self.index.take_events(max_chunks)

    def config_info(self) -> dict[str, str]:
        """The labels of ``tierkv:config_info``: the effective settings, tierkv's version
        and the namespace fingerprint, each as a string. It never shows a secret (a remote
        password is left out, a URL's credentials masked) and never touches a tier; it
        raises nothing, also after :meth:`close`."""
        from tierkv import __version__

        return config_info(self.config, version=__version__,
                           namespace=self.namespace.fingerprint(),
                           tokens_per_chunk=str(self.tokens_per_chunk))

    @one_caller
    def close(self) -> None:
        """Flush the CPU tier to disk (so the next process over the same directory starts
        warm), stop the threads, release the disk tier and its claim; idempotent.

        Never raises for what the store's cache did (a broken disk tier is logged, its
        unflushed chunks lost): the engine never fails because its cache did. Raises
        :class:`UsageError` from another thread or a forked child."""
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
            store_exit.forget(self)
            self._close_parts()

    def _close_parts(self) -> None:
        try:
            if self._remote is not None:
                self._remote.shutdown()
        finally:
            try:
                self._stack.close()
            finally:
                if self._share is not None:
                    index = getattr(self, "index", None)  # None: construction failed
                    self._share.release(index.disk_used if index is not None else 0)

    def __del__(self) -> None:
        """A store collected without ``close()`` warns (ResourceWarning and a log line) and
        is closed here, its CPU tier flushed (:mod:`tierkv.engine.store_exit`)."""
        if not getattr(self, "_closed", True):
            store_exit.collected_unclosed(self)

    def _describe(self) -> str:
        disk = self.config.disk.path
        where = f"disk tier {disk}" if disk is not None else "no disk tier"
        return f"TierKVStore of namespace {short_id(self.namespace)} ({where})"

    def __enter__(self) -> TierKVStore:
        """The store itself; leaving the ``with`` block calls ``close()``."""
        return self

    def __exit__(self, *exc: object) -> None:
        """``close()``; never swallows the block's exception."""
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

    def _promise(self, first_key: bytes, num_hits: int) -> None:
        """Remember what a lookup of keys starting with ``first_key`` answered (the newest
        :data:`MAX_PROMISES` lookups)."""
        promised = self._promised
        promised.pop(first_key, None)
        promised[first_key] = num_hits
        if len(promised) > MAX_PROMISES:
            del promised[next(iter(promised))]

    def _pump(self) -> None:
        """Apply finished jobs to the index and start the spills it asks for."""
        for completion in self.executor.poll_finished():
            kind = completion.kind
            self.index.complete(completion)
            if kind is JobKind.LOAD:
                self._stats.load_shortfall.failed += len(completion.failed_keys)
            self._stats.add(completion)
            self._lookups.bytes_completed += completion.bytes_moved
            self._durations[kind].observe(completion.seconds)
            if kind is not JobKind.SPILL:
                self._ready.append(completion)
            if completion.error and not completion.ok:
                log.warning("tierkv: job %s failed: %s", completion.job_id, completion.error)
        if self._share is not None:
            self._share.rebalance(self.index)
        spec = self.index.take_spills()
        if spec is not None:
            self.executor.submit(spec)

