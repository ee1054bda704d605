"""The scheduler role of tierkv's vLLM connector: vLLM's Scheduler <-> EngineAdapter.

It runs in vLLM's EngineCore process, never blocks and never touches KV bytes. vLLM's
``SchedulerOutput`` carries block ids but no tokens, so requests are taken from the
``Request`` objects vLLM hands to ``on_new_request`` and kept until ``request_finished``.

One :class:`SchedulerSide` per engine maps each scheduler-role call onto the adapter as the
table in ``docs/vllm.md`` ("How it works") says: loads are always asynchronous, a lookup
answers ``None`` while a chunk is promoted from disk or stored, and a finished request's
blocks go back to vLLM at once (the adapter fences). At start, with a disk tier, the index
is rebuilt from every rank's environment (:func:`tierkv.engine.disk_start.rebuild_keys`).
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.core.controls import NO_CONTROLS, RequestControls, request_controls
from tierkv.core.jobs import NO_BLOCK
from tierkv.engine.adapter_config import REQUEST_LOAD_POLICIES
from tierkv.engine.metrics import collect_figures, since_last
from tierkv.engine.request_state import refuse_reuse
from tierkv.engine.requests import RequestView, StepInput, WorkerReport
from tierkv.engine.stack import build_adapter, build_index, build_remote_lookup
from tierkv.errors import ConfigError
from tierkv.integrations.vllm_config import ConnectorSettings, adapter_config, store_config
from tierkv.integrations.vllm_geometry import Geometry
from tierkv.integrations.vllm_event_blocks import ChunkEvent, EventBlocks
from tierkv.integrations.vllm_keys import adapter_key, chunk_key, epoch_key
from tierkv.integrations.vllm_messages import TierKVConnectorStats, TierKVMetadata, TierKVWorkerMetadata
from tierkv.keys import Namespace, Part
from tierkv.model_identity import model_fingerprint
from tierkv.tiers.disk.layout import StoreLayout

if TYPE_CHECKING:
    from tierkv.engine.disk_start import DiskShare

log = logging.getLogger("tierkv.vllm")

STATS_INTERVAL_SECONDS = 1.0
MAX_POLICY_WARNINGS = 64  # distinct bad request load policies warned about, at most
MAX_ADAPTERS = 4096  # LoRA adapters' fingerprints kept (the oldest goes first)
BUDGET_POLL_SECONDS = 1.0  # how often a step may stat the disk root for budget changes
EVENT_BATCH_CHUNKS = 512  # chunks' KV events per step at most (a start's snapshot: batches)


@dataclass(eq=False, slots=True)
class _Tracked:
    """What the connector keeps of a live request, on the adapter's record of it
    (``RequestState.engine``, dropped when it finishes): vLLM's object, its chunk keys so
    far (they grow with it) and the block hash each key was derived from."""

    request: Any
    keys: list[bytes] = field(default_factory=list)
    sources: list[bytes] = field(default_factory=list)
    epoch: bytes = b""  # the cache epoch its keys are derived in (see reset_cache)
    adapter: str = ""  # its LoRA adapter's fingerprint ("" without one; see adapter_of)
    load_policy: str | None = None  # its own, from kv_transfer_params (request_load_policy)
    controls: RequestControls = NO_CONTROLS  # its own, from kv_transfer_params (of_request)
    local_hit: int | None = None  # the block-aligned local hit its last lookup was given


def request_load_policy(request: Any, warned: set[str]) -> str | None:
    """The load policy a request asks for in ``kv_transfer_params`` (vLLM passes them from
    ``SamplingParams.extra_args["kv_transfer_params"]``, or an OpenAI request's body):
    ``{"tierkv": {"load_policy": "always" | "cost" | "recompute"}}``. None: the engine's
    ``load_policy``. Anything else is warned about once and ignored: a request never fails
    because of what it asked of the cache (``warned``: the values warned about)."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get("tierkv") if isinstance(params, dict) else None
    if not isinstance(ours, dict) or "load_policy" not in ours:
        return None
    policy = ours["load_policy"]
    if isinstance(policy, str) and policy in REQUEST_LOAD_POLICIES:
        return policy
    # A client's value: escaped and cut, and warned about a bounded number of times.
    text = repr(policy)[:80]
    if text not in warned and len(warned) < MAX_POLICY_WARNINGS:
        warned.add(text)
        log.warning("tierkv: request %s asks for kv_transfer_params tierkv.load_policy %s; "
                    "one of %s is understood, so the engine's load_policy applies",
                    request.request_id, text, list(REQUEST_LOAD_POLICIES))
    return None


# A request whose kv_transfer_params tierkv does not understand: served without the cache.
NO_CACHE = RequestControls(skip_load=True, skip_store=True)


def controls_of(request: Any, warned: set[str]) -> RequestControls:
    """The controls a request asks for in ``kv_transfer_params``
    (:func:`tierkv.core.controls.request_controls`). A value tierkv does not understand
    leaves the request without the cache (no load, no store: it computes as without
    tierkv) and is warned about, naming the parameter and what it takes: the request
    never fails, and never gets what it did not ask for."""
    try:
        return request_controls(getattr(request, "kv_transfer_params", None))
    except ConfigError as exc:
        text = str(exc)
        if text not in warned and len(warned) < MAX_POLICY_WARNINGS:
            warned.add(text)
            log.warning("tierkv: request %s is served without tierkv's cache: %s",
                        request.request_id, text)
        return NO_CACHE


class SchedulerSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        geometry: Geometry,
        namespace: Namespace,
        *,
        replica: int = 0,
        record_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.geometry = geometry
        self.namespace = namespace
        self.fingerprint = namespace.fingerprint()
        self.config = store_config(settings, geometry)
        self.index = build_index(self.config, geometry.num_slots, geometry.disk_capacity,
                                 clock=clock, record_events=record_events)
        # Asks the remote tier for every part of a chunk, under this engine's part count
        # first, then every other one a writer of another TP size would use.
        self.replica = replica
        self.source_counts = geometry.source_counts()
        self.remote = build_remote_lookup(
            self.config, namespace,
            [[Part(index, count) for index in range(count)] for count in self.source_counts],
            geometry.chunk_bytes)
        self.adapter = build_adapter(self.index, adapter_config(settings, geometry), clock,
                                     self.remote)
        # Chunks on disk only under another part count (found at start), with that count.
        self._disk_parts: dict[bytes, int] = {}
        self.found_on_disk_elsewhere = 0
        self.adapter.source_parts = self._source_parts
        self._clock = clock
        self._hpc = geometry.hashes_per_chunk
        self._grouped = bool(geometry.groups)  # vLLM's block ids per group, null blocks
        self._windowed = geometry.window_kept is not None
        self._warned: set[str] = set()  # request load policies warned about (once each)
        self._adapters: dict[tuple[int, str], str] = {}  # LoRA (id, path) -> fingerprint
        self._record_events = record_events
        self._event_meta: dict[bytes, ChunkEvent] = {}  # key -> what its events say (events only)
        self._prune_later: list[bytes] = []  # chunks of finished requests (events only)
        self._event_blocks: EventBlocks | None = None  # what disk chunks' events say (events only)
        self._step = 0
        self._epoch = b""  # b"": keys as the warm-up and other servers derive them
        self.resets = 0
        self._reported: dict[str, float] = {}
        self._last_report = -float("inf")
        self.stats_interval = STATS_INTERVAL_SECONDS
        self.found_on_disk = 0
        self.deleted_on_disk = 0
        self._share: DiskShare | None = None  # this engine's share of the disk cap
        if settings.disk_path is not None:
            self._rebuild_from_disk()

    def _source_parts(self, key: bytes, from_remote: bool) -> int:
        """The part count a load reads ``key`` from: 0 for this engine's own, else another
        TP size's (docs/on-disk-format.md, "Parts")."""
        own = self.geometry.num_parts
        if from_remote:
            count = self.index.remote.count_of(key)
        else:
            count = self._disk_parts.get(key, 0)
        return 0 if count == own else count

    # ------------------------------------------------------------------ start
    def _rebuild_from_disk(self) -> None:
        from tierkv.engine.disk_start import DiskShare, rebuild_index, rebuild_keys

        assert self.settings.disk_path is not None
        root = Path(self.settings.disk_path)
        started = time.perf_counter()
        own = self.geometry.num_parts
        keys, self.deleted_on_disk, self._disk_parts = rebuild_keys(
            self.namespace, own, self.config.disk, self.geometry.chunk_bytes,
            self.geometry.disk_capacity, counts=self.source_counts, replica=self.replica, log=log,
        )
        self.found_on_disk_elsewhere = len(self._disk_parts)
        # This engine's share of disk_bytes, one cap for every namespace under the disk path:
        # a budget per stored rank, each publishing its rank's share; the smallest plans.
        self._share = DiskShare(
            root, self.fingerprint,
            [StoreLayout.part_dir_name(Part(index, own), self.replica) for index in range(own)],
            self.settings.disk_bytes, self.geometry.chunk_bytes,
            check_seconds=self.config.disk.budget_check_seconds,
            min_step=self.geometry.num_slots, poll_seconds=BUDGET_POLL_SECONDS, clock=self._clock)
        capacity = self._share.start(len(keys), log)
        self.found_on_disk = rebuild_index(  # over the share: deleted next
            self.index, keys, capacity, root=root, namespace=self.namespace,
            cap=f"disk_bytes={self.settings.disk_bytes}", log=log)
        if self._record_events:  # the chunks found give the snapshot's events
            geometry = self.geometry
            self._event_blocks = EventBlocks(
                StoreLayout(root).event_blocks_dir(self.fingerprint, self.replica),
                geometry.disk_capacity,
                8 * geometry.tokens_per_chunk + 40 * (geometry.hashes_per_chunk + 1) + 64)
            self._event_meta.update(self._event_blocks.read(
                {key for key in keys if self.index.contains(key)}))
        log.info("tierkv: %d chunk(s) of namespace %s found on disk at %s in %.2f s (%d of "
                 "them as parts of another TP size)", self.found_on_disk, self.fingerprint[:8],
                 self.settings.disk_path, time.perf_counter() - started,
                 self.found_on_disk_elsewhere)

    # ------------------------------------------------------------------ requests
    def _view(self, tracked: _Tracked) -> RequestView:
        request = tracked.request
        keys, sources, hashes, hpc = tracked.keys, tracked.sources, request.block_hashes, self._hpc
        if sources:
            last = len(sources) * hpc - 1
            if len(hashes) <= last or hashes[last] != sources[-1]:
                self._rewind(tracked)
        for index in range(len(keys), len(hashes) // hpc):
            source = hashes[(index + 1) * hpc - 1]
            sources.append(source)
            keys.append(epoch_key(adapter_key(chunk_key(source), tracked.adapter), tracked.epoch))
            if self._record_events and keys[-1] not in self._event_meta:
                self._event_meta[keys[-1]] = self._chunk_event(request, index)
        released = 0
        if self._windowed:  # vLLM frees a window's blocks on the processed tokens
            released = self.geometry.released_blocks(
                request.num_computed_tokens - int(getattr(request, "num_in_flight_tokens", 0) or 0))
        return RequestView(request.request_id, keys, request.num_prompt_tokens, request.num_tokens,
                           request.num_computed_tokens, released, tracked.load_policy,
                           tracked.controls)

    def _block_ids(self, groups: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        """vLLM's per-group block lists as the adapter takes them (AdapterConfig.groups):
        as they are, but with several groups or a window vLLM's null block (id 0: a sliding
        window's block before the window) as NO_BLOCK."""
        if not self._grouped:
            return groups
        return [[NO_BLOCK if block == 0 else block for block in ids] for ids in groups]

    def _rewind(self, tracked: _Tracked) -> None:
        """vLLM rewrote block hashes (a streaming-input session dropped its last sampled
        token): drop the keys from the first chunk whose last block hash changed. The list
        is edited in place, so the adapter's view of the request follows."""
        hashes, hpc = tracked.request.block_hashes, self._hpc
        keep = 0
        for index, source in enumerate(tracked.sources):
            position = (index + 1) * hpc - 1
            if position >= len(hashes) or hashes[position] != source:
                break
            keep = index + 1
        del tracked.keys[keep:]
        del tracked.sources[keep:]

    def _tracked_for(self, request: Any) -> _Tracked:
        """What the connector keeps of ``request``, on the adapter's record of it (made now
        for a request vLLM names first). An id that comes back while the request that
        finished under it still has jobs in flight is refused (request ids are unique)."""
        record = self.adapter.request(request.request_id)
        tracked: _Tracked | None = record.engine
        if tracked is None or tracked.request is not request:
            if record.finished:
                refuse_reuse(request.request_id)
            tracked = record.engine = _Tracked(
                request, epoch=self._epoch,
                load_policy=request_load_policy(request, self._warned),
                controls=controls_of(request, self._warned), adapter=self.adapter_of(request))
        return tracked

    def on_new_request(self, request: Any) -> None:
        self._tracked_for(request)

    def adapter_of(self, request: Any) -> str:
        """The fingerprint of a request's LoRA adapter (:mod:`tierkv.model_identity`, ``auto``,
        of its ``lora_path``), computed once per adapter id and path; ``""`` without one. An
        adapter that cannot be read gets a fresh random value per request: its chunks are
        never served from a lower tier (who knows what weights computed them)."""
        lora = getattr(request, "lora_request", None)
        if not lora:
            return ""
        ident = (int(getattr(lora, "lora_int_id", 0) or 0), str(getattr(lora, "lora_path", "")))
        found = self._adapters.get(ident)
        if found is None:
            found = model_fingerprint(ident[1], "auto") if ident[1] else None
            if found is None:
                log.warning("tierkv: LoRA adapter %r (path %r) cannot be fingerprinted; its "
                            "requests are never served from tierkv's tiers",
                            getattr(lora, "lora_name", ""), ident[1])
            if len(self._adapters) >= MAX_ADAPTERS:
                self._adapters.pop(next(iter(self._adapters)))
            found = self._adapters[ident] = found or ""
        return found or "unknown:" + os.urandom(16).hex()

    def reset_cache(self, is_running: Callable[[Any], bool]) -> bool:
        """Serve nothing stored before now (vLLM's ``reset_prefix_cache`` after a weight
        update). Keys move to a new random epoch: chunks of the old one are never hits
        again and leave the CPU and disk tiers as they age out. Requests not running now
        (waiting, or preempted by the reset) are keyed in the new epoch; a running
        request's KV was computed before the reset, so its chunks stay in the old one.
        Refused (False, vLLM reports the reset as failed) while loads are in flight."""
        loads = self.adapter.loads_in_flight()
        if loads:
            log.warning("tierkv: reset_cache refused: %d load(s) in flight would hand "
                        "KV from before the reset to requests; retry after they finish", loads)
            return False
        self._epoch = os.urandom(16)
        self.resets += 1
        for record in self.adapter.records.values():
            tracked: _Tracked | None = record.engine
            if tracked is not None and not is_running(tracked.request):
                tracked.epoch, tracked.keys, tracked.sources = self._epoch, [], []
        log.warning("tierkv: cache reset (%d so far): chunks stored before now are no longer "
                    "served by this server; they age out of its tiers", self.resets)
        return True

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34 asks it as a request enters a waiting queue: with
        ``--max-num-inflight-kv-loads`` a request that may load asynchronously starts its
        load while the running batch is full. Cheap (the index's lookup of its chunks, no
        remote call): True when its hit would load asynchronously (a chunk on disk only,
        or promoting, or more than a step's same-step budget), or a remote tier may hold
        it. A hit all in the CPU tier loads in the step that schedules the request (a
        same-step load needs a running slot anyway): False, so that it never holds back
        vLLM's queue of asynchronous loads. vLLM's own prefix cache may cover a hit: a
        false positive, which costs the request a place in that queue."""
        view = self._view(self._tracked_for(request))
        if (view.load_policy or self.adapter.config.load_policy) == "recompute" \
                or view.controls.skip_load:
            return False
        keys = view.chunk_keys[:(view.num_tokens - 1) // self.geometry.tokens_per_chunk]
        if not keys:
            return False  # no whole chunk before the last token: nothing can load
        if self.remote is not None:
            return True
        found = self.index.lookup(keys)
        return found.pending or found.num_on_cpu < found.num_hits \
            or found.num_hits > self.adapter.config.sync_load_chunks

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._tracked_for(request)
        tokens = self.adapter.lookup(self._view(tracked), num_computed_tokens)
        if tokens is None:
            return None, False
        tracked.local_hit = num_computed_tokens
        # A same-step load: vLLM schedules the request now, the worker copies before the
        # forward; else vLLM parks it in WAITING_FOR_REMOTE_KVS until the load finishes.
        return tokens, tokens > 0 and not self.adapter.sync_load(request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked_for(request)
        local, tracked.local_hit = tracked.local_hit, None
        view = self._view(tracked)
        if local is not None:
            self.adapter.count_queried(view, local)
        if local:  # chunks served by vLLM's GPU prefix cache are being reused: refresh them
            self.adapter.touch(view, local // self.geometry.tokens_per_chunk)
        if num_external_tokens <= 0:  # no load: build_meta hands the blocks to the adapter
            return
        if local is None:
            local = request.num_computed_tokens - num_external_tokens
        block_ids = self._block_ids(blocks.get_block_ids())
        self.adapter.update_state_after_alloc(view, block_ids, num_external_tokens, local)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        cpu, disk, remote = self.adapter.take_load_sources(request.request_id)
        if num_external_tokens <= 0:
            return {}
        cpu = min(cpu, num_external_tokens)
        remote = min(remote, num_external_tokens - cpu)
        # vLLM 0.33 has no remote member: its "external_unspecified" is for remote stores.
        sources = {"host": cpu, "external_unspecified": remote,
                   "disk": num_external_tokens - cpu - remote}
        return {name: tokens for name, tokens in sources.items() if tokens}

    def request_finished(self, request: Any, aborted: bool) -> None:
        tracked = self._tracked_for(request)
        view = self._view(tracked)
        # The request used all its chunks (loaded, stored, or hit in vLLM's own GPU cache).
        # Not a reuse: loads and GPU hits were counted as reuses when they happened, and
        # stores are not reuses.
        self.adapter.touch(view, len(view.chunk_keys), reuse=False)
        self.adapter.request_finished(view, aborted=aborted)  # drops what the connector kept
        if self._record_events:
            self._prune_later += tracked.keys

    # ------------------------------------------------------------------ steps
    def build_meta(self, so: Any) -> TierKVMetadata:
        self._step += 1
        new_block_ids: dict[str, Sequence[Sequence[int]]] = {}
        replaced: set[str] = set()
        for new in so.scheduled_new_reqs:
            new_block_ids[new.req_id] = self._block_ids(new.block_ids)
            replaced.add(new.req_id)
        cached = so.scheduled_cached_reqs
        # vLLM 0.32/0.33's v1 runner resumes a request here with its whole table; its v2
        # runner and vLLM 0.34 (no such field) re-send it in scheduled_new_reqs instead.
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids):
            if req_id in resumed:
                replaced.add(req_id)
            if blocks is not None:
                new_block_ids[req_id] = self._block_ids(blocks)
        records = self.adapter.records
        views = {req_id: self._view(records[req_id].engine) for req_id in so.num_scheduled_tokens}
        step = StepInput(
            requests=views,
            num_scheduled_tokens=so.num_scheduled_tokens,
            new_block_ids=new_block_ids,
            replaced_blocks=frozenset(replaced),
            preempted=tuple(so.preempted_req_ids or ()),
        )
        prune, self._prune_later = self._prune_later, []
        if self._share is not None:
            self._share.rebalance(self.index)
        plan = self.adapter.build_plan(step)
        if self._disk_parts:
            for spill in plan.spills:  # written as this engine's own parts from now on
                for key, _ in spill.writes:
                    self._disk_parts.pop(bytes(key), None)
        for key in prune:  # their last chunk is planned now: forget keys never stored
            if not self.index.contains(key):
                self._event_meta.pop(key, None)
        return TierKVMetadata(plan, self.fingerprint, self._step)

    def update_connector_output(self, output: Any) -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(meta, TierKVWorkerMetadata):
            return
        if meta.step_done:  # the step of the oldest unreported plan ran: its compute time
            self.adapter.step_finished()
        if not meta.completions:
            return
        done = self.adapter.complete(WorkerReport(rank=-1, completions=tuple(meta.completions)))
        for completion in done:
            if not completion.ok and completion.error:
                log.warning("tierkv: job %s failed: %s", completion.job_id, completion.error)

    def has_pending_push_work(self) -> bool:
        """Jobs in flight (stores, loads, spills), finished requests whose last chunk is
        not planned yet, or stored chunks that write-through has yet to write to disk: the
        engine keeps stepping until they settle, so an idle server has its chunks on disk
        (a SIGTERM under ``vllm serve``'s default ``--shutdown-timeout 0`` kills the
        workers before any shutdown flush); or KV events to send (a start's snapshot goes
        out over the first, empty, steps)."""
        return (self.adapter.has_jobs_in_flight() or self.adapter.has_pending_work()
                or self.adapter.spills_wanted() or self.index.events_pending())

    # ------------------------------------------------------------------ events
    def _chunk_event(self, request: Any, index: int) -> ChunkEvent:
        hpc, tpc = self._hpc, self.geometry.tokens_per_chunk
        hashes = request.block_hashes
        parent = bytes(hashes[index * hpc - 1]) if index else None
        return ChunkEvent(tuple(bytes(h) for h in hashes[index * hpc:(index + 1) * hpc]), parent,
                          array("l", request.all_token_ids[index * tpc:(index + 1) * tpc]))

    def take_events(self, max_chunks: int = EVENT_BATCH_CHUNKS) -> list[tuple[str, str, ChunkEvent]]:
        """``("stored" | "removed", medium, chunk)`` since the last call, of at most
        ``max_chunks`` chunks, medium "CPU", "DISK" or "REMOTE". The first calls after a
        start send the chunks found on disk whose events were recorded before
        (:mod:`.vllm_event_blocks`); the disk's events update that record."""
        meta, out = self._event_meta, []
        contains = self.index.contains
        stored: list[tuple[bytes, ChunkEvent]] = []
        removed: list[bytes] = []
        for kind, medium, key in self.index.take_events(max_chunks):
            chunk = meta.get(key)
            if chunk is not None:
                out.append((kind, medium, chunk))
                if medium == "DISK":
                    if kind == "stored":
                        stored.append((key, chunk))
                    else:
                        removed.append(key)
                if kind == "removed" and not contains(key):
                    del meta[key]
        if self._event_blocks is not None and (stored or removed):
            self._event_blocks.update(stored, removed)
        return out

    # ------------------------------------------------------------------ stats
    def statistics(self) -> dict[str, float]:
        """Cumulative counters and the gauges, by figure key (tierkv.engine.metrics): the
        index's, the adapter's, the remote lookups' (their calls: the workers report their
        breakers, one view per node) and the usage; the workers report the paths."""
        remote = self.remote
        return collect_figures(
            self.index.statistics(), self.adapter.stats,
            chunk_bytes=self.geometry.chunk_bytes * self.geometry.world_size,
            tokens_per_chunk=self.geometry.tokens_per_chunk,
            remote=[] if remote is None else [remote.tier.statistics(), remote.statistics()],
            own_io=False,
            memory=None if remote is None else remote.server_memory(),
            stored_chunk_bytes=0 if remote is None else remote.stored_chunk_bytes)

    def stats_since_last(self, force: bool = False) -> TierKVConnectorStats | None:
        """Counters since the last report: at most once per ``stats_interval`` seconds while
        tierkv has work in flight, and at once when it has none (the engine may go idle
        after this step and call no more: a burst's last figures would wait for the next
        request otherwise)."""
        now = self._clock()
        if not force and now - self._last_report < self.stats_interval \
                and self.has_pending_push_work():
            return None
        self._last_report = now
        current = self.statistics()
        stats = TierKVConnectorStats(data=since_last(current, self._reported))
        self._reported = current
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        if self._event_blocks is not None:
            # The workers' shutdown flush writes what the CPU tier holds and the disk never
            # had: record those too (a record of a chunk that did not land goes at start).
            meta = self._event_meta
            self._event_blocks.update(((key, meta[key]) for key in self.index.unwritten_keys()
                                       if key in meta), ())
            self._event_blocks.close()
        if self.remote is not None:
            self.remote.shutdown()
        if self._share is not None:  # the share becomes what this engine leaves on disk
            self._share.release(self.index.disk_used)
        if self.adapter.jobs_in_flight():
            log.info("tierkv: scheduler shutting down with %d job(s) in flight; the workers "
                     "finish them and flush unspilled chunks to disk", self.adapter.jobs_in_flight())


__all__ = ["ChunkEvent", "SchedulerSide"]
