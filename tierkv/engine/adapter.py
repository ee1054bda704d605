"""EngineAdapter: turns each scheduler step into tiered store and load jobs (scheduler side).

It never blocks and never touches tensor bytes. Primitives:

- ``lookup(view, num_local_tokens) -> int | None``: tokens of whole chunks, beyond the
  engine's local hit, that the tiers can load; ``None`` = "not yet" (a chunk is being
  promoted from disk: ask again next step), bounded by ``promotion_wait_seconds``. With
  ``wait_for_stores``, also "not yet" while the chunk after the hit is being stored, or
  belongs to a request that finished and is stored by the next plan (the next turn of a
  chat then hits what its previous turn completed), bounded the same way.
  With a remote tier (``remote``: a :class:`RemoteAsker`), the chunks past the local hit
  are asked of it (one batched request, a short deadline): what every rank's value exists
  for is noted in the index (``note_remote``) and hits; no answer yet is "not yet",
  bounded the same way. Otherwise side-effect free on the index. A request whose load
  lost a chunk hits nothing from then on: the engine recomputes it (a chunk whose copy
  keeps failing is never offered to it again). ``view.controls``: docs/engine-adapter.md.
- ``update_state_after_alloc(view, block_ids, num_external_tokens)``: the engine gave the
  request its blocks (a list per KV cache group, or one group's flat list); plans the
  load of the promised chunks (sent with the next plan).
  ``take_load_sources(req_id)``: the load's tokens by tier, ``(cpu, disk, remote)``.
- ``records``: request id -> :class:`~.request_state.RequestState`, all kept of a request
  (from its first lookup to its last job); else only tables keyed by job or block.
- ``touch(view, num_chunks)``: the engine reused the first chunks from its own cache;
  they become the most recently used (tail first).
- ``request_finished(view, aborted=False)``: the request's state survives; the next plan
  stores its last full chunk and frees the state only when none of its
  jobs is in flight. Until then its id may not come back as a new request (request ids
  must be unique): ``build_plan`` and ``update_state_after_alloc`` refuse it. A step's
  store job lists as owners only the requests with a chunk in it.
- ``build_plan(step) -> StepPlan``: loads, stores up to each request's watermark,
  spills, and ``jobs_to_flush`` (fences). A step's stores are at most two jobs: one for
  the requests that finished (a fence may flush it before the forward pass) and one for
  every running request (written by this step's forward pass).
- ``complete(report)``: a worker's report; a job counts once all ``world_size`` workers
  reported it.

The store watermarks, the fence and why it is kept per request: docs/engine-adapter.md,
docs/design.md. The request records: :mod:`.request_state`; cost-aware loads:
:mod:`.load_policy`; step timing: :class:`~tierkv.core.costs.StepTimer`; settings and counters:
:mod:`.adapter_config`, :mod:`tierkv.core.stats`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from itertools import chain

from tierkv.core.costs import CostModel, StepTimer
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import (NO_BLOCK, Completion, CompletionTracker, JobId, JobKind, LoadSpec,
                              StoreSpec)
from tierkv.core.plans import CpuState
from tierkv.core.stats import AdapterStats
from tierkv.engine.adapter_config import REQUEST_LOAD_POLICIES, AdapterConfig
from tierkv.engine.load_policy import CostPolicy, Estimate, LoadStarted
from tierkv.engine.request_state import GroupLists, RequestState, StoreBatch, per_group, refuse_reuse
from tierkv.engine.requests import (BlockIds, LoadRequest, RequestView, StepInput, StepPlan,
                                    WorkerReport)
from tierkv.engine.tier_lookup import RemoteAsker, lookup_tiers
from tierkv.errors import UsageError

__all__ = ["EngineAdapter"]


class EngineAdapter:
    def __init__(
        self,
        index: BlockIndex,
        config: AdapterConfig,
        clock: Callable[[], float] = time.monotonic,
        remote: RemoteAsker | None = None,
    ) -> None:
        self.index = index
        self.remote = remote
        # (key, from_remote) -> the part count a disk or remote chunk is read from, 0 for this
        # engine's own (the vLLM connector sets it: chunks another TP size wrote).
        self.source_parts: Callable[[bytes, bool], int] | None = None
        self.config = config
        self._clock = clock
        self._tracker = CompletionTracker(config.world_size)
        self.stats = AdapterStats()
        # One record per request (request id -> RequestState), from its first lookup until
        # its last job is done: everything kept of a request is on it. The engine's
        # integration reads it (and keeps its own fields on it: RequestState.engine).
        self.records: dict[str, RequestState] = {}
        # The requests whose chunks a job in flight moves (a step's store job is shared).
        self._job_owners: dict[JobId, list[RequestState]] = {}
        # The fence's blocks. GPU blocks of requests that left (finished, aborted) while
        # jobs of theirs may be in flight: block -> request, written once per request.
        self._released: dict[int, str] = {}
        self._allocated: dict[int, str] = {}  # block -> request, allocated since the last plan
        # frees_running_blocks: blocks a running request released (view.num_released_blocks)
        # while a job of it was in flight -> the request; recorded once, when released.
        self._freed_running: dict[int, str] = {}
        self._finishing: set[bytes] = set()  # chunks of requests that finished since the plan
        self._finished: list[RequestState] = []  # finished since the plan: its last stores
        # Records that finished and are not released yet (their last plan to come, or jobs
        # in flight): their id may not come back as a new request (see refuse_reuse).
        self._departed = 0
        self._pending_loads: list[LoadRequest] = []
        # Plans built so far: a lookup's decisions (RequestState.decided) last until the
        # next plan; the step's budget of same-step load chunks they take from.
        self._plans = 0
        self._sync_budget = config.sync_load_chunks
        # Cost-aware loads (load_policy "cost", or a request's own): the decisions, each
        # taken load's timing, and the compute line from the engine's steps.
        self.policy = CostPolicy(index, config, clock, self.stats)
        self._timer = StepTimer(self.policy.costs, clock)

    @property
    def costs(self) -> CostModel:  # the cost model of cost-aware loads (tierkv.core.costs)
        return self.policy.costs

    # ------------------------------------------------------------------ lookup
    def lookup(self, view: RequestView, num_local_tokens: int) -> int | None:
        self.stats.lookups += 1
        state = self.records.get(view.req_id)
        if state is not None:
            if state.decided == self._plans:  # asked again: the last answer is void
                self._sync_budget += state.sync_chunks
                state.sync_chunks = 0
            if state.reloads_refused or state.load_job is not None:
                return 0  # a load of it lost a chunk, or was cut at its deadline and still runs
        policy = view.load_policy or self.config.load_policy
        custom = self.policy.custom is not None and policy == self.config.load_policy
        if policy not in REQUEST_LOAD_POLICIES and not custom:
            raise UsageError(f"engine adapter: request {view.req_id!r} asks for load_policy "
                             f"{policy!r}; a request may ask for one of "
                             f"{list(REQUEST_LOAD_POLICIES)} (or None: the adapter's)")
        if state is None:  # its record, from now until its last job is done
            state = self.records[view.req_id] = self._record(view)
        controls = view.controls
        if policy == "recompute" or controls.skip_load:  # ask no tier
            self.stats.lookups_recompute += policy == "recompute"
            return 0
        tpc = self.config.tokens_per_chunk
        start = num_local_tokens // tpc
        # At least one token must be left to compute, and only whole chunks load.
        end = max(min((view.num_tokens - 1) // tpc, len(view.chunk_keys)), start)
        remote = self.remote
        skipped = remote is not None and policy == "cost" and self.policy.remote_declined()
        if skipped or not controls.allows("remote"):
            remote = None  # every remote hit would be declined: not worth a round trip
        found, asking = lookup_tiers(self.index, remote, view.chunk_keys[start:end])
        if controls.load_tiers is not None and found.num_hits:
            found = self.policy.in_tiers(view.chunk_keys[start:], found, controls.load_tiers)
        wait = controls.deadline_seconds(self.config.load_deadline_ms)  # bounds "not yet"
        if (asking or found.pending) and self._may_wait(state, False, wait):
            self.stats.not_yet += 1
            self.stats.remote_not_yet += asking
            return None
        state.not_yet_since = None
        stop = start + found.num_hits
        if self.config.wait_for_stores and stop < end and self._stored_soon(state, view, stop):
            self.stats.waits_on_stores += 1
            return None
        state.store_wait_since = None
        hits, on_cpu = found.num_hits, found.num_on_cpu
        decide = policy == "cost" or custom
        if state.decided != self._plans:  # the decisions of an earlier step are void
            state.decided, state.sync_chunks, state.estimate = self._plans, 0, None
        if hits and (decide or self.config.load_policy != "always"):
            hits, on_cpu, state.estimate = self.policy.choose_loads(
                view.chunk_keys, start, found, num_local_tokens, decide=decide)
            stop = start + hits
        tokens = max(stop * tpc - num_local_tokens, 0) if hits else 0
        if skipped:  # counted once per answer (a request may hear "not yet" many times)
            self.policy.remote_skipped()
        self.stats.hit_tokens += tokens
        if tokens and on_cpu == hits <= self._sync_budget:
            state.sync_chunks = hits
            self._sync_budget -= hits
        return tokens

    def _record(self, view: RequestView) -> RequestState:
        return RequestState(view, tuple([] for _ in range(self.config.groups)))

    def request(self, req_id: str) -> RequestState:
        """The record of ``req_id``, created (with an empty view until its first lookup)
        when the engine names a request before its first lookup: the engine's integration
        keeps its own fields of the request on it (``RequestState.engine``)."""
        state = self.records.get(req_id)
        if state is None:
            state = self.records[req_id] = self._record(RequestView(req_id, (), 0, 0, 0))
        return state

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """A custom engine's measured prefill step (``num_tokens`` in ``seconds``): it teaches
        the cost model what recompute costs (the vLLM connector reports each step itself)."""
        self.costs.observe_compute(num_tokens, seconds)

    def sync_load(self, req_id: str) -> bool:
        """Whether the hit the last :meth:`lookup` of ``req_id`` found loads in the same step
        (the engine then schedules the request at once, and the worker copies its chunks
        before the forward pass): every chunk of it is in the CPU tier and the step's
        ``sync_load_chunks`` budget holds it. Else the load is asynchronous."""
        state = self.records.get(req_id)
        return state is not None and state.decided == self._plans and state.sync_chunks > 0

    def _stored_soon(self, state: RequestState, view: RequestView, chunk: int) -> bool:
        """Whether chunk ``chunk`` of ``view`` is being stored, or is a finished request's
        that the next plan stores (and the request may still wait for it)."""
        key = view.chunk_keys[chunk]
        entry = self.index.entry(key)
        if not (key in self._finishing if entry is None else entry.cpu is CpuState.STORING):
            return False
        return self._may_wait(state, True)

    def _may_wait(self, state: RequestState, on_store: bool, most: float | None = None) -> bool:
        """Whether the request may hear "not yet" again (waiting on a promotion or the
        remote tier, or ``on_store``): for ``promotion_wait_seconds`` (or ``most``, when
        less) from when it first did."""
        now = self._clock()
        first = state.store_wait_since if on_store else state.not_yet_since
        if first is None:
            first = now
            if on_store:
                state.store_wait_since = now
            else:
                state.not_yet_since = now
        wait = self.config.promotion_wait_seconds
        return self._clock() - first < (wait if most is None else min(wait, most))

    def touch(self, view: RequestView, num_chunks: int, reuse: bool = True) -> None:
        """The engine used the first ``num_chunks`` chunks of ``view`` again (``reuse``: from
        its own cache, which a policy may count; else recency only): refresh them, tail
        first, so the prefix head is the most recent (evicting a chain from its tail keeps
        the rest a usable prefix)."""
        if num_chunks > 0:
            self.index.touch(reversed(view.chunk_keys[:num_chunks]), reuse=reuse)

    def count_queried(self, view: RequestView, num_local_tokens: int) -> None:
        """The engine allocated ``view`` after a lookup: its tokens past the engine's own
        prefix hit (``num_local_tokens``) were asked of tierkv (the hit rate's denominator)."""
        self.stats.queried_tokens += max(view.num_tokens - num_local_tokens, 0)

    def update_state_after_alloc(self, view: RequestView, block_ids: BlockIds | Iterable[int],
                                 num_external_tokens: int, num_local_tokens: int) -> None:
        state = self.records.get(view.req_id)
        if state is not None and state.finished:
            refuse_reuse(view.req_id)
        lists = per_group(block_ids, self.config.groups, view.req_id)
        if state is None:
            state = self.records[view.req_id] = RequestState(view, lists)
        state.view, state.block_ids = view, lists
        first_new = num_local_tokens // self.config.tokens_per_block  # position past the hit
        if self._released or self.config.frees_running_blocks:  # blocks a job may still read
            self._allocated.update(dict.fromkeys(state.blocks(first_new), view.req_id))
        if num_external_tokens > 0:
            self._plan_load(state, num_local_tokens, num_external_tokens, first_new)

    def _plan_load(self, state: RequestState, num_local_tokens: int, num_external_tokens: int,
                   first_new: int) -> None:
        """The load of the promised chunks into the request's new blocks (from block
        position ``first_new``), sent with the next plan."""
        view, config = state.view, self.config
        tpc, bpc, sparse = config.tokens_per_chunk, config.blocks_per_chunk, config.sparse_blocks
        start, end = num_local_tokens // tpc, (num_local_tokens + num_external_tokens) // tpc
        plan = self.index.prepare_load(view.chunk_keys[start:end])
        chunks, (cpu_tokens, disk_tokens, remote_tokens) = state.load_copies(
            plan, start, first_new, num_local_tokens, tpc, bpc, sparse, self.source_parts)
        lost_from = max((start + len(plan.chunks)) * bpc, first_new)
        lost = tuple(block for block in state.blocks(lost_from, end * bpc) if block != NO_BLOCK)
        if lost:
            state.reloads_refused = True
        spec = None
        decided = state.decided == self._plans
        sync = decided and state.sync_chunks > 0
        if plan.job_id is not None:
            spec = LoadSpec(plan.job_id, tuple(chunks))
            self._job_owners[plan.job_id] = [state]
            state.load_job = plan.job_id
            state.jobs.add(plan.job_id)
            self.stats.loads_planned += len(chunks)
            estimate, state.estimate = state.estimate if decided else None, None
            state.load_started = None if estimate is None else (self._clock(), *estimate, sync)
        state.load_sources = (cpu_tokens, disk_tokens, remote_tokens)
        tier = self.stats.tier
        tier["cpu"].hit_tokens += cpu_tokens
        tier["disk"].hit_tokens += disk_tokens
        tier["remote"].hit_tokens += remote_tokens
        self.stats.loads_failed_chunks += end - start - len(plan.chunks)
        if sync:
            state.sync_chunks = 0
            self.stats.sync_loads += 1
        self._pending_loads.append(LoadRequest(view.req_id, spec, lost, sync, view.controls
                                               .deadline_seconds(config.load_deadline_ms)))

    def take_load_sources(self, req_id: str) -> tuple[int, int, int]:
        """Tokens of the request's last planned load from the CPU, disk and remote tiers."""
        state = self.records.get(req_id)
        if state is None or state.load_sources is None:
            return (0, 0, 0)
        sources, state.load_sources = state.load_sources, None
        return sources

    def request_finished(self, view: RequestView, aborted: bool = False) -> None:
        if not view.controls.skip_store:  # its chunks are stored by the next plan
            self._finishing.update(view.chunk_keys)
        state = self.records.get(view.req_id)
        if state is None or state.finished:
            return
        if not state.jobs and not any(state.block_ids):  # nothing to store, nothing to fence
            del self.records[view.req_id]
            self.stats.requests_freed += 1
            return
        state.reloads_refused = False
        state.load_sources = state.engine = None
        state.not_yet_since = state.store_wait_since = None
        state.view = view
        state.finished = state.last_plan_due = True
        state.aborted = aborted
        self._finished.append(state)
        self._departed += 1
        self._released.update(dict.fromkeys(state.blocks(), view.req_id))

    # ------------------------------------------------------------------ planning
    def build_plan(self, step: StepInput) -> StepPlan:
        """The step's plan, in named steps: refuse a departed request's id; flush what a
        preempted request's jobs hold, note the new blocks, store the finished requests'
        last chunks (their own job), fence blocks handed out that a departed request's jobs
        may still use, store the running requests' completed chunks (one job), then loads,
        spills and flushes."""
        self._timer.planned(sum(step.num_scheduled_tokens.values()))
        records = self.records
        if self._departed:  # before any state changes: a refused step changes nothing
            for req_id in chain(step.requests, step.new_block_ids):
                state = records.get(req_id)
                if state is not None and state.finished:
                    refuse_reuse(req_id)
        groups = self.config.groups
        new = {req_id: per_group(blocks, groups, req_id)  # refused: nothing changed
               for req_id, blocks in step.new_block_ids.items()}
        flush: dict[JobId, None] = {}
        # Loads planned since the last plan target blocks allocated since: never flushed
        # (a request preempted and re-admitted in one step has such a load).
        fences = step.preempted or self._released or self.config.frees_running_blocks
        fresh = ({load.spec.job_id for load in self._pending_loads if load.spec is not None}
                 if self._pending_loads and fences else set())
        for req_id in step.preempted:
            state = records.get(req_id)
            if state is not None:
                self._flush_jobs(state, flush, fresh)
                if not state.jobs & fresh:
                    state.block_ids = tuple([] for _ in state.block_ids)
        allocated = self._take_new_blocks(step, new)
        # Finished requests first: their last full chunk is stored now, in a job of its
        # own: its bytes are on the GPU already, so a fence may flush it before the forward
        # pass; the running requests' job needs this step's forward pass.
        finished, self._finished = self._finished, []
        finished_job = self._store_finished(finished) if finished else None
        allocated.pop(NO_BLOCK, None)
        if self._released:
            self._fence_departed(allocated, flush, fresh)
        for state in finished:
            state.last_plan_due = False
            self._maybe_free(state)
        # One store job for every running request's new chunks (per-job costs paid once).
        batch = self._store_batch()
        self._add_running(step, batch, new)
        if self._freed_running:  # new blocks are in `allocated` only with departed requests
            self._fence_freed_running(
                (allocated, *(() if self._released else chain.from_iterable(new.values()))),
                flush, fresh)
        stores = tuple(job for job in (finished_job, self._store_job(batch)) if job is not None)
        return self._finish_plan(step, stores, flush)

    @staticmethod
    def _flush_jobs(state: RequestState, flush: dict[JobId, None], fresh: set[JobId]) -> None:
        """The request's jobs in flight finish before the step (but this step's loads)."""
        flush.update(dict.fromkeys(j for j in state.jobs if j not in fresh))

    def _take_new_blocks(self, step: StepInput, new: dict[str, GroupLists]) -> dict[int, str]:
        """The step's new blocks (``new``: per group) into the requests' states; returns the
        blocks handed out since the last plan (block -> request) that a departed request
        may still use."""
        allocated, self._allocated = self._allocated, {}
        records, released = self.records, self._released
        for req_id, lists in new.items():
            state = records.get(req_id)
            if state is not None:
                state.take_blocks(lists, req_id in step.replaced_blocks)
            if released:
                allocated.update(dict.fromkeys(chain.from_iterable(lists), req_id))
        return allocated

    def _store_finished(self, finished: list[RequestState]) -> StoreSpec | None:
        """The finished requests' last chunks: up to ``max(prompt, tokens - 1)`` (never the
        last sampled token's slot) and never past what was computed; aborted: what was
        computed. One job."""
        batch = self._store_batch()
        config = self.config
        for state in finished:
            view = state.view
            if view.controls.skip_store:
                continue
            if state.aborted:
                mark = view.num_computed_tokens
            else:
                mark = min(max(view.num_prompt_tokens, view.num_tokens - 1),
                           view.num_computed_tokens)
            if config.offload_prompt_only and mark > view.num_prompt_tokens:
                mark = view.num_prompt_tokens
            target = min(mark // config.tokens_per_chunk, len(view.chunk_keys),
                         state.positions() // config.blocks_per_chunk, config.chunk_limit)
            if target > state.stored_chunks:
                batch.add(state, state.stored_chunks, target)
        return self._store_job(batch)

    def _fence_departed(self, allocated: dict[int, str], flush: dict[JobId, None],
                        fresh: set[JobId]) -> None:
        """Fence: a block handed out this step (to a scheduled request or an async load)
        that a departed request's job may still use: that request's jobs finish first."""
        for block, req_id in allocated.items():
            owner = self._released.get(block)
            if owner is not None and owner != req_id:
                owner_state = self.records.get(owner)
                if owner_state is not None:
                    self._flush_jobs(owner_state, flush, fresh)

    def _store_batch(self) -> StoreBatch:
        config = self.config
        return StoreBatch(config.blocks_per_chunk, config.groups, config.sparse_blocks,
                          self.index.contains)

    def _add_running(self, step: StepInput, batch: StoreBatch, new: dict[str, GroupLists]) -> None:
        """Each scheduled request's chunks completed up to its running watermark (this loop
        is the scheduler's hot path: most steps complete no chunk)."""
        records, config = self.records, self.config
        scheduled = step.num_scheduled_tokens
        tpc, bpc, max_chunks = config.tokens_per_chunk, config.blocks_per_chunk, config.chunk_limit
        prompt_only, fence_running = config.offload_prompt_only, config.frees_running_blocks
        add = batch.add
        for req_id, view in step.requests.items():
            state = records.get(req_id)
            if state is None:
                lists = new.get(req_id) or tuple([] for _ in range(config.groups))
                state = records[req_id] = RequestState(view, lists)
            state.view = view
            if fence_running and view.num_released_blocks > state.released:
                self._note_released(state, view.num_released_blocks)
            if view.controls.skip_store:
                continue
            mark = view.num_computed_tokens + scheduled.get(req_id, 0)
            if prompt_only and mark > view.num_prompt_tokens:
                mark = view.num_prompt_tokens
            first = state.stored_chunks
            target = mark // tpc
            if target <= first:  # most steps: no chunk completes
                continue
            if target > len(view.chunk_keys):
                target = len(view.chunk_keys)
            for ids in state.block_ids:  # positions every group holds (they may grow unevenly)
                if target * bpc > len(ids):
                    target = len(ids) // bpc
            if target > max_chunks:
                target = max_chunks
            if target > first:
                add(state, first, target)

    def _finish_plan(self, step: StepInput, stores: tuple[StoreSpec, ...],
                     flush: dict[JobId, None]) -> StepPlan:
        """The plan: the loads planned since the last one, the stores, spills and flushes;
        this step's lookup decisions end here."""
        loads, self._pending_loads = tuple(self._pending_loads), []
        self._plans += 1  # a lookup whose request was not scheduled: its budget is back
        self._sync_budget = self.config.sync_load_chunks
        self._finishing.clear()
        spill = self.index.take_spills()
        self.stats.flushes += len(flush)
        idle = not any(step.num_scheduled_tokens.values())
        return StepPlan(loads, stores, (spill,) if spill is not None else (), tuple(flush), idle)

    def _store_job(self, batch: StoreBatch) -> StoreSpec | None:
        """One store job for the candidate chunks (see BlockIndex.prepare_store_many)."""
        self.stats.stores_without_pages += batch.without_pages
        if not batch.keys:
            return None
        candidates = batch.owners

        def protected(run: int) -> Sequence[bytes]:  # a request's chunks up to its new end
            owner = candidates[run]
            return owner.view.chunk_keys[: owner.stored_chunks]

        plan = self.index.prepare_store_many(batch.keys, batch.ends, protected)
        job_id = plan.job_id
        if job_id is None:
            return None
        block_ids, owners = batch.block_ids, candidates
        if plan.placed is not None:  # some keys were present or found no room
            block_ids, owners = batch.placed(plan.placed)
        for owner in owners:
            owner.jobs.add(job_id)
        self._job_owners[job_id] = owners
        self.stats.stores_planned += len(plan.keys)
        return StoreSpec(job_id, plan.keys, plan.slots, tuple(block_ids))

    def step_finished(self) -> None:
        """The engine finished the step of its oldest plan not yet reported (forward pass
        and sampling done; the vLLM connector reports each step's output): see StepTimer."""
        self._timer.step_finished()

    def take_flush_spills(self) -> StepPlan:
        """A plan that writes every dirty CPU chunk to disk (clean shutdown)."""
        spill = self.index.take_spills(flush=True)
        return StepPlan(spills=(spill,) if spill is not None else ())

    # ------------------------------------------------------------------ completions
    def complete(self, report: WorkerReport) -> list[Completion]:
        """Apply one worker's report; returns the jobs that are now complete everywhere."""
        done: list[Completion] = []
        for part in report.completions:
            merged = self._tracker.report(part)
            if merged is None:
                continue
            if merged.kind is JobKind.LOAD:
                for owner in self._job_owners.get(merged.job_id, ()):
                    owner.load_job = None
                    owner.reloads_refused |= not merged.ok or bool(merged.failed_keys)
                    started, owner.load_started = owner.load_started, None
                    if started is not None and merged.ok and not merged.failed_keys:
                        self.policy.measured_load(merged, started)
            self.index.complete(merged)
            self._untrack(merged.job_id)
            self.stats.bytes_completed += merged.bytes_moved
            done.append(merged)
        return done

    def _note_released(self, state: RequestState, released: int) -> None:
        """The request released block positions up to ``released`` (a sliding window moved
        on): while a job of it is in flight, the fence keeps their blocks."""
        if state.jobs:
            self._freed_running.update(dict.fromkeys(state.blocks(state.released, released),
                                                     state.view.req_id))
        state.released = released

    def _fence_freed_running(self, handed_out: Iterable[Iterable[int]],
                             flush: dict[JobId, None], fresh: set[JobId]) -> None:
        """A block a running request released while a job of it was in flight, handed out
        this step (even to the same request: its next forward writes it): the request's
        jobs finish first. Each block is fenced once, when handed out."""
        freed, records = self._freed_running, self.records
        for blocks in handed_out:
            for block in blocks:
                owner = freed.pop(block, None)
                state = records.get(owner) if owner is not None else None
                if state is not None:
                    self._flush_jobs(state, flush, fresh)

    def _untrack(self, job_id: JobId) -> None:
        for state in self._job_owners.pop(job_id, ()):
            state.jobs.discard(job_id)
            if state.finished:
                self._maybe_free(state)

    def _maybe_free(self, state: RequestState) -> None:
        """Release a finished request's record once its last stores are planned and none of
        its jobs is in flight (its id may then come back)."""
        req_id = state.view.req_id
        if state.jobs or state.last_plan_due or self.records.get(req_id) is not state:
            return
        del self.records[req_id]
        self._departed -= 1
        released = self._released
        for block in state.blocks():
            if released.get(block) == req_id:
                del released[block]
        self.stats.requests_freed += 1

    # ------------------------------------------------------------------ reports
    def has_pending_work(self) -> bool:
        """True while a finished request awaits its final plan or a job is in flight: the
        engine should keep stepping (empty steps are fine) until this turns False."""
        return bool(self._finished or self._job_owners or self._pending_loads)

    def num_requests(self) -> int:
        return len(self.records)

    def jobs_in_flight(self) -> int:
        return len(self._job_owners)

    def loads_in_flight(self) -> int:
        """Loads planned and not yet finished, each once (a job's KV is on its way)."""
        return sum(state.load_job is not None for state in self.records.values()) \
            + sum(load.spec is None for load in self._pending_loads)

    def has_request(self, req_id: str) -> bool:
        return req_id in self.records

    def spills_wanted(self) -> bool:
        """The index has chunks to write to disk now (write-through; see BlockIndex)."""
        return self.index.spills_wanted()

    def has_jobs_in_flight(self) -> bool:
        """Any job (store, load, spill) the index waits for."""
        return bool(self.index.jobs_in_flight())
