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
  keeps failing is never offered to it again).
- ``update_state_after_alloc(view, block_ids, num_external_tokens)``: the engine gave the
  request its blocks; plans the load of the promised chunks (sent with the next plan).
  ``take_load_sources(req_id)``: the load's tokens by tier, ``(cpu, disk, remote)``.
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

The store watermarks, the fence and why it is kept per request (the per-chunk cost of a
step) are in docs/engine-adapter.md and docs/design.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

from tierkv.core.costs import DEFAULT_CHUNK_BYTES, TIERS, CostModel, CostPriors
from tierkv.core.index import BlockIndex, Lookup
from tierkv.core.state import CpuState
from tierkv.core.jobs import (NO_BLOCK, ChunkCopy, Completion, CompletionTracker, JobId, JobKind,
                              LoadSpec, StoreSpec)
from tierkv.engine.requests import LoadRequest, RequestView, StepInput, StepPlan, WorkerReport
from tierkv.errors import ConfigError, UsageError


class RemoteAsker(Protocol):
    """What the adapter needs of a remote tier's lookups
    (:class:`tierkv.transfer.remote_lookup.RemoteLookup`): the prefix of ``keys`` whose
    every rank's value exists, or None ("not yet")."""

    def ask(self, keys: Sequence[bytes]) -> list[bytes] | None: ...


def lookup_tiers(index: BlockIndex, remote: RemoteAsker | None,
                 keys: Sequence[bytes]) -> tuple[Lookup, bool]:
    """The index's lookup of ``keys``, the chunks past its hits asked of the remote tier
    first (noted in the index when it has them), and whether the remote tier has not
    answered yet ("not yet")."""
    found = index.lookup(keys)
    if remote is None or found.pending or found.num_hits >= len(keys) \
            or index.contains(keys[found.num_hits]):
        return found, False
    answer = remote.ask(keys[found.num_hits:])
    if answer is None:
        return found, True
    if answer and index.note_remote(answer):
        found = index.lookup(keys)
    return found, False


LOAD_POLICIES = ("always", "cost")
# What one request may ask for itself (RequestView.load_policy): an engine's policy, or
# "recompute": load nothing, ask no tier (the counterfactual of a load, in the same engine).
REQUEST_LOAD_POLICIES = (*LOAD_POLICIES, "recompute")
MAX_STEP_SAMPLE_SECONDS = 2.0  # a longer gap between plans is an idle engine, not compute
MAX_UNFINISHED_STEPS = 8  # plans awaiting step_finished (asynchronous scheduling: 2)
MAX_PROBE_REQUESTS = 1 << 16  # probe_requests doubles up to this (probe_seconds still holds)


@dataclass(frozen=True)
class AdapterConfig:
    tokens_per_block: int
    blocks_per_chunk: int
    world_size: int = 1
    offload_prompt_only: bool = False
    max_chunks_per_request: int | None = None
    promotion_wait_seconds: float = 5.0
    wait_for_stores: bool = False
    # Block ids per token block: one per KV cache group of the engine. A request's block
    # list then holds the ids of each block position side by side (position-major: ids
    # [p * groups, (p + 1) * groups) are position p's, group 0 first); NO_BLOCK where a
    # group holds no page (a sliding-window group before its window). A chunk's jobs list
    # its ids group-major (blocks_per_chunk ids of group 0, then of group 1, ...).
    groups: int = 1
    # The engine may free a running request's blocks (a sliding-window group frees those
    # that left the window): a block handed out again while a store job still reads it
    # waits for that job (a fence), as for the blocks of requests that finished.
    frees_running_blocks: bool = False
    # Same-step loads: a hit whose chunks all sit in the CPU tier is copied before this
    # step's forward pass, up to this many chunks per step (0: every load is asynchronous
    # and the request waits a step or two for it). See sync_load().
    sync_load_chunks: int = 0
    # Cost-aware loads: "always" loads every hit; "cost" loads the prefix of a hit whose
    # estimated load time plus the compute time of the rest is least (tierkv.core.costs:
    # measured per tier and from the engine's steps, priors until then). load_bias scales
    # the load estimates (above 1 favours recompute).
    load_policy: str = "always"
    load_bias: float = 1.0
    cost_priors: CostPriors = field(default_factory=CostPriors)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # one chunk on one rank (the priors' unit)
    # A tier whose loads were declined for this long is tried again with the next hit
    # on it (a slow node may have recovered): one load is its new measurement. So is one
    # declined for probe_requests requests in a row (0: never), a number that doubles
    # with each probe until the model itself loads from the tier again: one slow load
    # (a spike) costs a fast tier a few requests, not probe_seconds of them, and a slow
    # tier's probes thin out.
    probe_seconds: float = 30.0
    probe_requests: int = 8

    def __post_init__(self) -> None:
        if self.load_policy not in LOAD_POLICIES:
            raise ConfigError(f"adapter: load_policy must be one of {list(LOAD_POLICIES)}, got "
                              f"{self.load_policy!r}")
        if isinstance(self.load_bias, bool) or not isinstance(self.load_bias, (int, float)) \
                or not self.load_bias > 0:
            raise ConfigError(f"adapter: load_bias must be a number > 0, got {self.load_bias!r}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) \
                or self.chunk_bytes <= 0:
            raise ConfigError(f"adapter: chunk_bytes must be a positive int, got "
                              f"{self.chunk_bytes!r}")
        if isinstance(self.probe_requests, bool) or not isinstance(self.probe_requests, int) \
                or self.probe_requests < 0:
            raise ConfigError(f"adapter: probe_requests must be an int >= 0, got "
                              f"{self.probe_requests!r}")
        if isinstance(self.sync_load_chunks, bool) or not isinstance(self.sync_load_chunks, int) \
                or self.sync_load_chunks < 0:
            raise ConfigError(f"adapter: sync_load_chunks must be an int >= 0, got "
                              f"{self.sync_load_chunks!r}")
        for name in ("tokens_per_block", "blocks_per_chunk", "world_size", "groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"adapter.{name} must be a positive int, got {value!r}")
        if self.max_chunks_per_request is not None and self.max_chunks_per_request < 0:
            raise ConfigError(
                f"adapter.max_chunks_per_request must be >= 0, got {self.max_chunks_per_request!r}"
            )

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk


@dataclass(slots=True)
class _Request:
    view: RequestView
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0  # chunks [0, stored_chunks) were planned for store (or present)
    jobs: set[JobId] = field(default_factory=set)
    finished: bool = False
    aborted: bool = False
    released: int = 0  # block positions of view.num_released_blocks noted for the fence


class _Candidates:
    """Chunks to store in one job, laid end to end: a run per request (its keys and GPU
    blocks), ``ends`` where each run ends, ``owners`` the request of each run."""

    __slots__ = ("keys", "block_ids", "ends", "owners")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.block_ids: list[int] = []
        self.ends: list[int] = []
        self.owners: list[_Request] = []

    def add(self, state: _Request, first: int, end: int, blocks_per_chunk: int) -> None:
        self.keys += state.view.chunk_keys[first:end]
        self.block_ids += state.block_ids[first * blocks_per_chunk : end * blocks_per_chunk]
        self.ends.append(len(self.keys))
        self.owners.append(state)


@dataclass
class AdapterStats:
    lookups: int = 0
    hit_tokens: int = 0
    not_yet: int = 0
    loads_planned: int = 0
    loads_failed_chunks: int = 0
    stores_planned: int = 0
    flushes: int = 0
    requests_freed: int = 0
    waits_on_stores: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    hit_tokens_remote: int = 0
    remote_not_yet: int = 0
    # Tokens past the engine's own prefix hit of requests that were allocated (the engine
    # reports them with count_queried); hit_tokens_* / queried_tokens is tierkv's hit rate.
    queried_tokens: int = 0
    # Chunks not stored because the engine no longer held one of their pages (several
    # groups: a sliding-window block freed, or never given, before the chunk was stored).
    stores_without_pages: int = 0
    sync_loads: int = 0  # loads copied in the step that asked for them (sync_load_chunks)
    # load_policy "cost": hit tokens declined (recomputed instead) by the tier that held
    # them, and the taken loads' estimated and measured seconds by their slowest tier.
    load_probes: int = 0  # loads taken against the estimate, to measure a declined tier
    load_lines_restarted: int = 0  # probes that beat their estimate 2x: the tier's line anew
    remote_lookups_skipped: int = 0  # requests not asked of a remote tier being declined
    lookups_recompute: int = 0  # lookups of requests that asked for load_policy "recompute"
    declined_tokens_cpu: int = 0
    declined_tokens_disk: int = 0
    declined_tokens_remote: int = 0
    load_seconds_estimated_cpu: float = 0.0
    load_seconds_estimated_disk: float = 0.0
    load_seconds_estimated_remote: float = 0.0
    load_seconds_measured_cpu: float = 0.0
    load_seconds_measured_disk: float = 0.0
    load_seconds_measured_remote: float = 0.0


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
        self._tpc = config.tokens_per_chunk
        self._groups = config.groups
        # Block lists that may lack pages (NO_BLOCK, released blocks): checked per chunk.
        self._grouped = config.groups > 1 or config.frees_running_blocks
        self._bpc = config.blocks_per_chunk * config.groups  # block ids per chunk
        self._prompt_only = config.offload_prompt_only
        self._max_chunks = config.max_chunks_per_request if config.max_chunks_per_request is not None else 1 << 62
        self._tracker = CompletionTracker(config.world_size)
        self._requests: dict[str, _Request] = {}
        # The requests whose chunks a job in flight moves (a step's store job is shared).
        self._job_owners: dict[JobId, list[_Request]] = {}
        # GPU blocks of requests that left (finished, aborted) while jobs of theirs may be
        # in flight: block -> request. Written once per request, not per chunk.
        self._released: dict[int, str] = {}
        self._pending_since: dict[str, float] = {}
        self._store_wait_since: dict[str, float] = {}
        self._finishing: set[bytes] = set()  # chunks of requests that finished since the plan
        self._load_sources: dict[str, tuple[int, int, int]] = {}
        self._finished_queue: list[str] = []
        # Requests that finished and whose state is not freed yet (last plan to come, or
        # jobs in flight): their id may not come back as a new request (see _refuse_reuse).
        self._departed: set[str] = set()
        self._pending_loads: list[LoadRequest] = []
        self._allocated: dict[int, str] = {}  # block -> request, allocated since the last plan
        # Requests whose load lost a chunk: the engine recomputes them, and their next
        # lookups hit nothing (a chunk whose copy keeps failing is not loaded forever).
        self._reloads_refused: set[str] = set()
        # frees_running_blocks: blocks a running request released (view.num_released_blocks)
        # while a job of it was in flight -> the request; recorded once, when released.
        self._fence_running = config.frees_running_blocks
        self._freed_running: dict[int, str] = {}
        # Same-step loads decided by this step's lookups (request -> chunks), and the
        # chunks of the step's budget they took.
        self._sync: dict[str, int] = {}
        self._sync_budget = config.sync_load_chunks
        # Cost-aware loads: the model (under either policy: a request may ask for "cost"
        # itself; an "always" engine estimates and measures only those requests' loads),
        # each taken load's (planned at, slowest tier, chunks, estimate, probe, same-step),
        # and the last plan's (time, tokens) for the compute line.
        self.costs = CostModel(config.cost_priors, config.chunk_bytes, load_bias=config.load_bias)
        self._last_load = dict.fromkeys(TIERS, -float("inf"))  # a load taken, by tier
        self._declining: dict[str, float | None] = dict.fromkeys(TIERS)  # since when declined
        self._declined = dict.fromkeys(TIERS, 0)  # requests declined (or not asked) since
        self._probe_every = dict.fromkeys(TIERS, config.probe_requests)  # ... before a probe
        self._estimates: dict[str, tuple[str, int, float, bool]] = {}
        self._load_started: dict[JobId, tuple[float, str, int, float, bool, bool]] = {}
        self._last_plan: tuple[float, int] | None = None
        # Plans whose steps the engine has not reported finished (step_finished), oldest
        # first; once it reports, its steps are timed by it, not by the gaps between plans.
        self._unfinished: deque[tuple[float, int]] = deque(maxlen=MAX_UNFINISHED_STEPS)
        self._step_ends = False
        self._last_end = -float("inf")  # when the last reported step ended
        self.stats = AdapterStats()

    # ------------------------------------------------------------------ lookup
    def lookup(self, view: RequestView, num_local_tokens: int) -> int | None:
        self.stats.lookups += 1
        self._sync_budget += self._sync.pop(view.req_id, 0)  # asked again: the last answer is void
        if view.req_id in self._reloads_refused:
            return 0
        policy = view.load_policy or self.config.load_policy
        if policy not in REQUEST_LOAD_POLICIES:
            raise UsageError(f"engine adapter: request {view.req_id!r} asks for load_policy "
                             f"{policy!r}; a request may ask for one of "
                             f"{list(REQUEST_LOAD_POLICIES)} (or None: the adapter's)")
        if policy == "recompute":
            self.stats.lookups_recompute += 1
            return 0
        tpc = self._tpc
        start = num_local_tokens // tpc
        # At least one token must be left to compute, and only whole chunks load.
        end = max(min((view.num_tokens - 1) // tpc, len(view.chunk_keys)), start)
        remote = self.remote
        skipped = remote is not None and policy == "cost" and self._remote_declined()
        if skipped:
            remote = None  # every remote hit would be declined: not worth a round trip
        found, asking = lookup_tiers(self.index, remote, view.chunk_keys[start:end])
        if asking and self._may_wait(self._pending_since, view.req_id):
            self.stats.not_yet += 1
            self.stats.remote_not_yet += 1
            return None
        if found.pending and self._may_wait(self._pending_since, view.req_id):
            self.stats.not_yet += 1
            return None
        self._pending_since.pop(view.req_id, None)
        stop = start + found.num_hits
        if self.config.wait_for_stores and stop < end and self._stored_soon(view, stop):
            self.stats.waits_on_stores += 1
            return None
        self._store_wait_since.pop(view.req_id, None)
        hits, on_cpu = found.num_hits, found.num_on_cpu
        if hits and (policy == "cost" or self.config.load_policy == "cost"):
            hits, on_cpu = self._choose_loads(view, start, found, num_local_tokens,
                                              decide=policy == "cost")
            stop = start + hits
        tokens = max(stop * tpc - num_local_tokens, 0) if hits else 0
        if skipped:  # counted once per answer (a request may hear "not yet" many times)
            self.stats.remote_lookups_skipped += 1
            self._declined["remote"] += 1
        self.stats.hit_tokens += tokens
        if tokens and on_cpu == hits <= self._sync_budget:
            self._sync[view.req_id] = hits
            self._sync_budget -= hits
        return tokens

    def _runs(self, keys: Sequence[bytes], found: Lookup) -> list[tuple[str, int]]:
        """The hit's chunks as ``(tier, count)`` runs in prefix order; one tier (the common
        case) is read off the lookup without a walk."""
        hits = len(keys)
        if found.num_on_cpu == hits:
            return [("cpu", hits)]
        if found.num_remote == hits:
            return [("remote", hits)]
        if not found.num_on_cpu and not found.num_remote:
            return [("disk", hits)]
        runs: list[tuple[str, int]] = []
        entry_of = self.index.entry
        for key in keys:
            entry = entry_of(key)
            tier = ("remote" if entry is None  # a mark: on the remote tier only
                    else "cpu" if entry.cpu is CpuState.READY else "disk")
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, runs[-1][1] + 1)
            else:
                runs.append((tier, 1))
        return runs

    def _choose_loads(self, view: RequestView, start: int, found: Lookup,
                      num_local_tokens: int, decide: bool) -> tuple[int, int]:
        """The prefix of the hit to load: the whole hit (a request that asks for "always"
        in a cost engine), or (``decide``) the prefix CostModel.best_prefix picks, the rest
        declined and counted by tier. The load taken is estimated either way (measured when
        it completes: the model learns from both). Returns (chunks, of them in the CPU
        tier)."""
        costs = self.costs
        tpc, hits = self._tpc, found.num_hits
        runs = self._runs(view.chunk_keys[start:start + hits], found)
        first_tokens = (start + 1) * tpc - num_local_tokens
        take = chosen = hits
        if decide:
            take = chosen = costs.best_prefix(runs, tpc, first_chunk_tokens=first_tokens)[0]
            if take < hits:
                take = self._maybe_probe(runs, take)
        probe = take != chosen
        taken: dict[str, int] = {}
        position = 0
        stats = self.stats
        for tier, size in runs:
            keep = min(size, max(take - position, 0))
            if keep:
                taken[tier] = taken.get(tier, 0) + keep
            if keep < size:  # declined: the first chunk may be partly the engine's own hit
                declined = (size - keep) * tpc - (tpc - first_tokens if position + keep == 0
                                                  else 0)
                setattr(stats, f"declined_tokens_{tier}",
                        getattr(stats, f"declined_tokens_{tier}") + declined)
            position += size
        if take:
            now = self._clock()
            for tier in taken:
                self._last_load[tier] = now
                if decide and take == chosen:  # the model's own choice, not a probe
                    self._probe_every[tier] = self.config.probe_requests
            slowest = "remote" if "remote" in taken else "disk" if "disk" in taken else "cpu"
            self._estimates[view.req_id] = (slowest, take, costs.load_seconds(taken), probe)
        else:
            self._estimates.pop(view.req_id, None)
        return take, taken.get("cpu", 0)

    def _remote_declined(self) -> bool:
        """load_policy "cost": the remote tier's hits are being declined, no load could pay
        (CostModel.never_pays) and its probe is not due: its lookups are skipped too, so a
        slow node costs the scheduler no round trip per request. Once its probe is due
        (probe_seconds, or probe_requests requests skipped), the next lookup asks it again
        and its hit is the probe."""
        since = self._declining["remote"]
        return (since is not None and since >= self._last_load["remote"]
                and self._clock() - since < self.config.probe_seconds
                and not self._probe_due("remote")
                and self.costs.never_pays("remote", self._tpc))

    def _probe_due(self, tier: str) -> bool:
        """Whether ``tier`` was declined for its count of requests (probe_requests)."""
        every = self._probe_every[tier]
        return every > 0 and self._declined[tier] >= every

    def _maybe_probe(self, runs: list[tuple[str, int]], take: int) -> int:
        """A tier declined for ``probe_seconds``, or for its count of requests in a row
        (``probe_requests``, doubled by each probe), gets one load (a new measurement: a
        slow node may have recovered, a fast tier's slow load may have been a spike): the
        whole hit then."""
        position = 0
        tier = runs[-1][0]
        for tier, size in runs:  # the tier of the first declined chunk
            if position + size > take:
                break
            position += size
        now = self._clock()
        since = self._declining[tier]
        if since is None or since < self._last_load[tier]:  # declining from now on
            self._declining[tier] = now
            self._declined[tier] = 1
        elif now - since >= self.config.probe_seconds or self._probe_due(tier):
            self._declining[tier] = now
            self._declined[tier] = 0
            self._probe_every[tier] = min(2 * self._probe_every[tier], MAX_PROBE_REQUESTS)
            self.stats.load_probes += 1
            return sum(size for _, size in runs)
        else:
            self._declined[tier] += 1
        return take

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """A custom engine's measured prefill: ``seconds`` to compute ``num_tokens`` (one
        step). It teaches the cost model what recompute costs; the vLLM connector reports
        every step itself (build_plan)."""
        self.costs.observe_compute(num_tokens, seconds)

    def sync_load(self, req_id: str) -> bool:
        """Whether the hit the last :meth:`lookup` of ``req_id`` found loads in the same step
        (the engine then schedules the request at once, and the worker copies its chunks
        before the forward pass): every chunk of it is in the CPU tier and the step's
        ``sync_load_chunks`` budget holds it. Else the load is asynchronous."""
        return req_id in self._sync

    def _stored_soon(self, view: RequestView, chunk: int) -> bool:
        """Whether chunk ``chunk`` of ``view`` is being stored, or is a finished request's
        that the next plan stores (and the request may still wait for it)."""
        key = view.chunk_keys[chunk]
        entry = self.index.entry(key)
        if not (key in self._finishing if entry is None else entry.cpu is CpuState.STORING):
            return False
        return self._may_wait(self._store_wait_since, view.req_id)

    def _may_wait(self, since: dict[str, float], req_id: str) -> bool:
        """Whether ``req_id`` may hear "not yet" again: ``since`` holds when it first did,
        and it may for ``promotion_wait_seconds`` from then."""
        first = since.setdefault(req_id, self._clock())
        return self._clock() - first < self.config.promotion_wait_seconds

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

    def update_state_after_alloc(
        self, view: RequestView, block_ids: Iterable[int], num_external_tokens: int, num_local_tokens: int
    ) -> None:
        if view.req_id in self._departed:
            self._refuse_reuse(view.req_id)
        state = self._requests.get(view.req_id)
        if state is None:
            state = self._requests[view.req_id] = _Request(view)
        state.view = view
        state.block_ids = list(block_ids)
        # The first block id past the local hit (ids of `groups` groups per block position)
        first_new = num_local_tokens // self.config.tokens_per_block * self._groups
        if self._released or self._fence_running:  # blocks a job may still read: fence them
            self._allocated.update(dict.fromkeys(state.block_ids[first_new:], view.req_id))
        if num_external_tokens <= 0:
            return
        tpc, bpc = self._tpc, self._bpc
        start = num_local_tokens // tpc
        end = (num_local_tokens + num_external_tokens) // tpc
        plan = self.index.prepare_load(view.chunk_keys[start:end])
        skip_first = first_new - start * bpc
        chunks = []
        cpu_tokens = disk_tokens = remote_tokens = 0
        from_remote = plan.from_remote
        for position, (key, slot, from_disk) in enumerate(plan.chunks):
            chunk = start + position
            skip = skip_first if position == 0 else 0
            if not self._grouped:
                blocks = tuple(state.block_ids[chunk * bpc : (chunk + 1) * bpc])
            else:  # the local hit's pages (leading, position-major) as NO_BLOCK: untouched
                ids = state.block_ids[chunk * bpc : (chunk + 1) * bpc]
                blocks = tuple(self._group_major([NO_BLOCK] * skip + ids[skip:]))
                skip = 0
            remote = key in from_remote
            parts = self.source_parts(key, remote) if (from_disk or remote) \
                and self.source_parts is not None else 0
            chunks.append(ChunkCopy(key, slot, blocks, from_disk, skip, remote, parts))
            tokens = min(tpc, (chunk + 1) * tpc - num_local_tokens)  # only the first is partial
            if from_disk:
                disk_tokens += tokens
            elif remote:
                remote_tokens += tokens
            else:
                cpu_tokens += tokens
        lost_from = (start + len(plan.chunks)) * bpc
        lost = tuple(block for block in state.block_ids[max(lost_from, first_new) : end * bpc]
                     if block != NO_BLOCK)
        if lost:
            self._reloads_refused.add(view.req_id)
        spec = None
        sync = view.req_id in self._sync
        if plan.job_id is not None:
            spec = LoadSpec(plan.job_id, tuple(chunks))
            self._track(plan.job_id, view.req_id)
            self.stats.loads_planned += len(chunks)
            estimate = self._estimates.pop(view.req_id, None)
            if estimate is not None:
                self._load_started[plan.job_id] = (self._clock(), *estimate, sync)
        self._load_sources[view.req_id] = (cpu_tokens, disk_tokens, remote_tokens)
        self.stats.hit_tokens_cpu += cpu_tokens
        self.stats.hit_tokens_disk += disk_tokens
        self.stats.hit_tokens_remote += remote_tokens
        self.stats.loads_failed_chunks += end - start - len(plan.chunks)
        if sync:
            del self._sync[view.req_id]
            self.stats.sync_loads += 1
        self._pending_loads.append(LoadRequest(view.req_id, spec, lost, sync))

    def take_load_sources(self, req_id: str) -> tuple[int, int, int]:
        """Tokens of the request's last planned load from the CPU, disk and remote tiers."""
        return self._load_sources.pop(req_id, (0, 0, 0))

    def request_finished(self, view: RequestView, aborted: bool = False) -> None:
        self._reloads_refused.discard(view.req_id)
        self._store_wait_since.pop(view.req_id, None)
        self._load_sources.pop(view.req_id, None)
        self._finishing.update(view.chunk_keys)
        state = self._requests.get(view.req_id)
        if state is None:
            return
        state.view = view
        state.finished = True
        state.aborted = aborted
        self._pending_since.pop(view.req_id, None)
        self._finished_queue.append(view.req_id)
        self._departed.add(view.req_id)
        self._released.update(dict.fromkeys(state.block_ids, view.req_id))

    # ------------------------------------------------------------------ planning
    def _add_departed_run(self, state: _Request, batch: _Candidates) -> None:
        """The chunks a finished request may still store: up to ``max(prompt, tokens - 1)``
        (never the last sampled token's slot) and never past what was computed; aborted:
        what was computed."""
        view = state.view
        if state.aborted:
            mark = view.num_computed_tokens
        else:
            mark = min(max(view.num_prompt_tokens, view.num_tokens - 1), view.num_computed_tokens)
        if self._prompt_only and mark > view.num_prompt_tokens:
            mark = view.num_prompt_tokens
        target = min(mark // self._tpc, len(view.chunk_keys), len(state.block_ids) // self._bpc, self._max_chunks)
        first = state.stored_chunks
        if target > first:
            state.stored_chunks = target
            if not self._grouped:
                batch.add(state, first, target, self._bpc)
            else:
                self._add_grouped(batch, state, first, target)

    def _group_major(self, ids: list[int]) -> list[int]:
        """One chunk's position-major block ids, group-major (see AdapterConfig.groups)."""
        groups = self._groups
        out = ids[0::groups]
        for group in range(1, groups):
            out += ids[group::groups]
        return out

    def _add_grouped(self, batch: _Candidates, state: _Request, first: int, end: int) -> None:
        """``batch.add`` for block lists that may lack pages: each chunk's ids group-major,
        and the chunks with a page the engine no longer holds (NO_BLOCK, or a released
        block: ``view.num_released_blocks``) left out: never storable."""
        keys, bpc, added = state.view.chunk_keys, self._bpc, False
        released = state.view.num_released_blocks
        positions = self.config.blocks_per_chunk
        for chunk in range(first, end):
            ids = state.block_ids[chunk * bpc : (chunk + 1) * bpc]
            if chunk * positions < released or NO_BLOCK in ids:
                if not self.index.contains(keys[chunk]):  # stored already: nothing lost
                    self.stats.stores_without_pages += 1
                continue
            batch.keys.append(keys[chunk])
            batch.block_ids += self._group_major(ids)
            added = True
        if added:
            batch.ends.append(len(batch.keys))
            batch.owners.append(state)

    def _store_job(self, batch: _Candidates) -> StoreSpec | None:
        """One store job for the candidate chunks (see BlockIndex.prepare_store_many)."""
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
        block_ids = batch.block_ids
        owners = candidates
        if plan.placed is not None:  # some keys were present or found no room
            bpc, ends = self._bpc, batch.ends
            all_blocks, block_ids, owners = block_ids, [], []
            run = 0
            for i in plan.placed:
                while i >= ends[run]:
                    run += 1
                if not owners or owners[-1] is not candidates[run]:
                    owners.append(candidates[run])  # only requests with a chunk in the job
                block_ids += all_blocks[i * bpc : (i + 1) * bpc]
        for owner in owners:
            owner.jobs.add(job_id)
        self._job_owners[job_id] = owners
        self.stats.stores_planned += len(plan.keys)
        return StoreSpec(job_id, plan.keys, plan.slots, tuple(block_ids))

    def _refuse_reuse(self, req_id: str) -> NoReturn:
        raise UsageError(
            f"engine adapter: request id {req_id!r} came back before the request that "
            f"finished under it was let go (its last stores planned, none of its jobs in "
            f"flight); request ids must be unique (the fence tells requests apart by id: a "
            f"block of the old request handed to the new one would not be flushed). Nothing "
            f"was changed.")

    def build_plan(self, step: StepInput) -> StepPlan:
        self._observe_step(step)
        if self._departed:  # before any state changes: a refused step changes nothing
            for req_id in self._departed:
                if req_id in step.requests or req_id in step.new_block_ids:
                    self._refuse_reuse(req_id)
        flush: dict[JobId, None] = {}
        # Loads planned since the last plan target blocks allocated since: never flushed
        # (a request preempted and re-admitted in one step has such a load).
        fences = step.preempted or self._released or self._fence_running
        fresh = ({load.spec.job_id for load in self._pending_loads if load.spec is not None}
                 if self._pending_loads and fences else set())
        for req_id in step.preempted:
            state = self._requests.get(req_id)
            if state is not None:
                flush.update(dict.fromkeys(j for j in state.jobs if j not in fresh))
                if not state.jobs & fresh:
                    state.block_ids = []
        allocated, self._allocated = self._allocated, {}
        for req_id, blocks in step.new_block_ids.items():
            state = self._requests.get(req_id)
            if state is not None:
                if req_id in step.replaced_blocks:
                    state.block_ids = list(blocks)
                    state.released = 0
                else:
                    state.block_ids.extend(blocks)
            if self._released:
                allocated.update(dict.fromkeys(blocks, req_id))
        # Finished requests first: their last full chunk is stored now, in a job of its
        # own: its bytes are on the GPU already, so a fence may flush it before the forward
        # pass; the running requests' job needs this step's forward pass.
        finished, self._finished_queue = self._finished_queue, []
        finished_job = None
        if finished:
            batch = _Candidates()
            for req_id in finished:
                state = self._requests.get(req_id)
                if state is not None:
                    self._add_departed_run(state, batch)
            finished_job = self._store_job(batch)
        # Fence: a block handed out this step (to a scheduled request or an async load)
        # that a departed request's job may still use: that request's jobs finish first.
        allocated.pop(NO_BLOCK, None)
        for block, req_id in allocated.items() if self._released else ():
            owner = self._released.get(block)
            if owner is not None and owner != req_id:
                owner_state = self._requests.get(owner)
                if owner_state is not None:
                    flush.update(dict.fromkeys(j for j in owner_state.jobs if j not in fresh))
        for req_id in finished:
            self._maybe_free(req_id)
        # One store job for every running request's new chunks (per-job costs paid once).
        requests = self._requests
        scheduled = step.num_scheduled_tokens
        tpc, bpc, max_chunks, prompt_only = self._tpc, self._bpc, self._max_chunks, self._prompt_only
        grouped, fence_running = self._grouped, self._fence_running
        batch = _Candidates()
        keys_to_store, blocks_to_store, ends, owners = batch.keys, batch.block_ids, batch.ends, batch.owners
        for req_id, view in step.requests.items():
            state = requests.get(req_id)
            if state is None:
                state = requests[req_id] = _Request(view, list(step.new_block_ids.get(req_id, ())))
            state.view = view
            if fence_running and view.num_released_blocks > state.released:
                self._note_released(state, view.num_released_blocks)
            # The running watermark, inline (this loop is the scheduler's hot path).
            mark = view.num_computed_tokens + scheduled.get(req_id, 0)
            if prompt_only and mark > view.num_prompt_tokens:
                mark = view.num_prompt_tokens
            first = state.stored_chunks
            target = mark // tpc
            if target <= first:  # most steps: no chunk completes
                continue
            keys = view.chunk_keys
            if target > len(keys):
                target = len(keys)
            if target * bpc > len(state.block_ids):
                target = len(state.block_ids) // bpc
            if target > max_chunks:
                target = max_chunks
            if target > first:  # batch.add, inline
                state.stored_chunks = target
                if grouped:
                    self._add_grouped(batch, state, first, target)
                    continue
                keys_to_store += keys[first:target]
                blocks_to_store += state.block_ids[first * bpc : target * bpc]
                ends.append(len(keys_to_store))
                owners.append(state)
        if self._freed_running:  # new blocks are in `allocated` only with departed requests
            self._fence_freed_running(
                (allocated, *(() if self._released else step.new_block_ids.values())),
                flush, fresh)
        stores = tuple(job for job in (finished_job, self._store_job(batch)) if job is not None)
        loads, self._pending_loads = tuple(self._pending_loads), []
        self._sync.clear()  # a lookup whose request was not scheduled: its budget is back
        self._estimates.clear()
        self._sync_budget = self.config.sync_load_chunks
        self._finishing.clear()
        spill = self.index.take_spills()
        self.stats.flushes += len(flush)
        idle = not any(step.num_scheduled_tokens.values())
        return StepPlan(loads, stores, (spill,) if spill is not None else (), tuple(flush), idle)

    def _observe_step(self, step: StepInput) -> None:
        """The engine's compute line from its steps. An engine that reports its steps'
        ends (step_finished) is timed by them; else the time from one plan to the next is
        the previous step's (its forward pass computed its scheduled tokens), which also
        counts the engine's idle time before the next plan. A gap over
        MAX_STEP_SAMPLE_SECONDS is an idle engine, not compute."""
        now = self._clock()
        tokens = sum(step.num_scheduled_tokens.values())
        self._unfinished.append((now, tokens))
        if self._step_ends:
            return
        last = self._last_plan
        if last is not None and last[1] > 0 and now - last[0] <= MAX_STEP_SAMPLE_SECONDS:
            self.costs.observe_compute(last[1], now - last[0])
        self._last_plan = (now, tokens)

    def step_finished(self) -> None:
        """The engine finished the step of its oldest plan not yet reported (forward pass
        and sampling done; the vLLM connector reports each step's output). That step's
        tokens took the time since its plan (or since the step before it ended): the
        compute line learns that, not the gaps between plans, which count the time an idle
        engine waited for its next request."""
        self._step_ends = True
        if not self._unfinished:
            return
        planned, tokens = self._unfinished.popleft()
        now = self._clock()
        # A step planned while the previous one ran (asynchronous scheduling) starts when
        # that one ends.
        seconds = now - max(planned, self._last_end)
        self._last_end = now
        if tokens > 0 and seconds <= MAX_STEP_SAMPLE_SECONDS:
            self.costs.observe_compute(tokens, seconds)

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
            if (not merged.ok or merged.failed_keys) \
                    and self.index.job_kind(merged.job_id) is JobKind.LOAD:
                self._reloads_refused.update(
                    owner.view.req_id for owner in self._job_owners.get(merged.job_id, ()))
            if self._load_started:
                started = self._load_started.pop(merged.job_id, None)
                if started is not None and merged.ok and not merged.failed_keys:
                    self._measured_load(merged, *started)
            self.index.complete(merged)
            self._untrack(merged.job_id)
            done.append(merged)
        return done

    def _measured_load(self, completion: Completion, planned_at: float, tier: str, chunks: int,
                       estimate: float, probe: bool, sync: bool) -> None:
        """A taken load completed: teach the model its time (the copy's, for a same-step
        load, whose step also ran the forward pass; else the steps it spanned) and count
        the estimate next to it. A probe that took less than half its estimate says the
        loads the tier's line was fitted to no longer hold (a spike, a node that
        recovered): the line starts again from the priors and this load."""
        seconds = completion.seconds if sync else self._clock() - planned_at
        if probe and seconds < estimate / 2:
            self.costs.forget_loads(tier)
            self.stats.load_lines_restarted += 1
        self.costs.observe_load(tier, chunks, seconds)
        stats = self.stats
        setattr(stats, f"load_seconds_estimated_{tier}",
                getattr(stats, f"load_seconds_estimated_{tier}") + estimate)
        setattr(stats, f"load_seconds_measured_{tier}",
                getattr(stats, f"load_seconds_measured_{tier}") + seconds)

    def _track(self, job_id: JobId, req_id: str) -> None:
        state = self._requests[req_id]
        self._job_owners[job_id] = [state]
        state.jobs.add(job_id)

    def _note_released(self, state: _Request, released: int) -> None:
        """The request released block positions up to ``released`` (a sliding window moved
        on): while a job of it is in flight, the fence keeps their blocks."""
        if state.jobs:
            groups = self._groups
            ids = state.block_ids[state.released * groups : released * groups]
            self._freed_running.update(dict.fromkeys(ids, state.view.req_id))
        state.released = released

    def _fence_freed_running(self, handed_out: Iterable[Iterable[int]],
                             flush: dict[JobId, None], fresh: set[JobId]) -> None:
        """A block a running request released while a job of it was in flight, handed out
        this step (even to the same request: its next forward writes it): the request's
        jobs finish first. Each block is fenced once, when handed out."""
        freed, requests = self._freed_running, self._requests
        for blocks in handed_out:
            for block in blocks:
                owner = freed.pop(block, None)
                state = requests.get(owner) if owner is not None else None
                if state is not None:
                    flush.update(dict.fromkeys(j for j in state.jobs if j not in fresh))

    def _untrack(self, job_id: JobId) -> None:
        for state in self._job_owners.pop(job_id, ()):
            state.jobs.discard(job_id)
            if state.finished:
                self._maybe_free(state.view.req_id)

    def _maybe_free(self, req_id: str) -> None:
        state = self._requests.get(req_id)
        if state is None or not state.finished or state.jobs or req_id in self._finished_queue:
            return
        del self._requests[req_id]
        self._departed.discard(req_id)
        released = self._released
        for block in state.block_ids:
            if released.get(block) == req_id:
                del released[block]
        self.stats.requests_freed += 1

    # ------------------------------------------------------------------ reports
    def has_pending_work(self) -> bool:
        """True while a finished request awaits its final plan or a job is in flight: the
        engine should keep stepping (empty steps are fine) until this turns False."""
        return bool(self._finished_queue or self._job_owners or self._pending_loads)

    def num_requests(self) -> int:
        return len(self._requests)

    def jobs_in_flight(self) -> int:
        return len(self._job_owners)

    def loads_in_flight(self) -> int:
        """Loads planned and not yet finished (their KV is still on its way to the GPU)."""
        kind = self.index.job_kind
        return len(self._pending_loads) + sum(1 for job_id in self._job_owners
                                              if kind(job_id) is JobKind.LOAD)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def spills_wanted(self) -> bool:
        """The index has chunks to write to disk now (write-through; see BlockIndex)."""
        return self.index.spills_wanted()

    def has_jobs_in_flight(self) -> bool:
        """Any job (store, load, spill) the index waits for."""
        return bool(self.index.jobs_in_flight())
