"""WorkerAdapter: executes a StepPlan on one worker (one GPU rank). Decides no policy.

Per step, in the engine's order (why: docs/design.md, "Worker order and when stores start"):

1. ``handle_preemptions(plan)`` before the forward pass: the plan's stores named in
   ``jobs_to_flush`` join the pending list, **every** pending store is submitted, and only
   then does it wait on ``jobs_to_flush`` (waiting on a job never submitted is the race of
   docs/engine-adapter.md, "Flush order").
2. ``start(plan)``: submits pending stores, the plan's loads and spills, and waits for
   its same-step loads (``LoadRequest.sync``: the engine calls ``start`` before the forward
   pass when a plan has them, and that forward reads them).
3. the engine's forward pass writes KV into the scheduled slots.
4. ``after_forward()``: submits the plan's remaining stores (their chunks were completed
   by this forward; on CUDA the copy stream waits on the compute stream).
5. ``poll() -> WorkerReport``: finished jobs, finished loads by request, and the GPU block
   ids of chunks that failed to load with the requests they belong to (the engine
   recomputes them). A load with a deadline (``LoadRequest.deadline_seconds``, from its
   start on the worker's ``clock``) whose disk or remote reads are still running then is
   cut (``JobExecutor.cut``): its request is reported finished with every block of the
   load failed, and no copy of it reaches those blocks later (they are recomputed, and
   may be handed out again); its reads finish into their CPU slots, its job completes as
   usual. A load whose copy to the GPU has started is waited for (a memory copy).

What the worker's slots hold (``track_slots=True``, with a disk tier): the worker keeps,
per CPU slot, the key whose bytes the slot holds and whether that chunk is still to be
written to disk (stored, and neither spilled nor promoted from disk since), from the jobs
it ran (each finished job's spec comes with its completion from the executor's record).
``unspilled_chunks()`` lists the slots holding valid bytes never written to disk: a worker
in another process than the scheduler's index (vLLM's workers) writes them to disk at
shutdown, so a restart is warm even for chunks the scheduler never got to spill. A chunk
the disk deleted (its cap evicted it as the coldest) is not written back.
``statistics()``: bytes, seconds and failed jobs per path (gpu_to_cpu, cpu_to_gpu,
cpu_to_disk, and a load's reads: disk_to_cpu, remote_to_cpu), cumulative.

Idle steps yield: ``poll()`` after an idle plan with jobs in flight sleeps
``IDLE_YIELD_SECONDS`` first, or an engine loop with nothing to compute starves the copy
and disk threads of the GIL (docs/design.md, "Threads and the GIL").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tierkv.core.figures import values
from tierkv.core.jobs import (NO_BLOCK, Completion, JobId, JobKind, JobSpec, LoadSpec,
                              SpillSpec, StoreSpec, failed_set)
from tierkv.engine.metrics import DURATION_KEY, Durations
from tierkv.engine.requests import StepPlan, WorkerReport
from tierkv.engine.store_stats import PATH_NAMES, StoreStats
from tierkv.transfer.executor import JobExecutor

IDLE_YIELD_SECONDS = 0.0005


class SlotResidency:
    """Which key's valid bytes each CPU slot holds, and which of them were never written
    to disk."""

    def __init__(self) -> None:
        self._holding: dict[int, bytes] = {}  # slot -> key
        self._held: dict[bytes, int] = {}  # key -> slot
        self._unspilled: set[bytes] = set()

    def finished(self, completion: Completion, spec: JobSpec) -> None:
        """What a job the executor ran did to the slots (``spec``: the executor's record
        of it; a spill the worker skipped never ran, and changed nothing)."""
        if isinstance(spec, SpillSpec):
            # A chunk the disk deleted (its cap's LRU, a smaller share, a trim at start)
            # was written once and is not written back: a shutdown flush of it would push
            # out hotter chunks at the next start (they are older on disk).
            for key in spec.deletes:  # deletes run before the job's writes
                self._unspilled.discard(key)
            failed = failed_set(completion, tuple(key for key, _ in spec.writes))
            for key, slot in spec.writes:
                if key not in failed and self._holding.get(slot) == key:
                    self._unspilled.discard(key)
        elif isinstance(spec, StoreSpec):
            failed = failed_set(completion, spec.keys)
            for key, slot in zip(spec.keys, spec.slots):
                self._hold(slot, None if key in failed else key, on_disk=False)
        else:
            promoted = [chunk for chunk in spec.chunks if chunk.from_disk or chunk.from_remote]
            if promoted:  # a promotion rewrote these slots from disk (or the remote tier)
                failed = failed_set(completion, tuple(chunk.key for chunk in spec.chunks))
                for chunk in promoted:
                    self._hold(chunk.slot, None if chunk.key in failed else chunk.key,
                               on_disk=chunk.from_disk)

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

    def unspilled(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every slot holding valid bytes not known to be on disk."""
        return sorted(((key, self._held[key]) for key in self._unspilled), key=lambda item: item[1])


def _written(block_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The blocks a load writes of these (its NO_BLOCK positions stay untouched)."""
    return block_ids if NO_BLOCK not in block_ids else tuple(b for b in block_ids if b != NO_BLOCK)


@dataclass
class _LoadInFlight:
    req_id: str
    blocks_by_key: dict[bytes, tuple[int, ...]]
    lost: tuple[int, ...]
    sync: bool = False  # a same-step load: no finished load is reported for it
    deadline: float | None = None  # on the worker's clock; None: none (or no longer)
    cut: bool = False  # reported finished at its deadline (JobExecutor.cut)


class WorkerAdapter:
    def __init__(self, executor: JobExecutor, rank: int = 0, track_slots: bool = False,
                 writes_disk: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.executor = executor
        self._clock = clock
        self._timed = 0  # loads in flight with a deadline
        self.loads_cut = 0  # loads cut at their deadline (their tokens recomputed)
        self.rank = rank
        # False: another rank writes the one disk copy every rank loads (MLA); this rank's
        # spill jobs are reported done at once, and write or delete nothing.
        self.writes_disk = writes_disk
        self._skipped: list[Completion] = []
        self._residency = SlotResidency() if track_slots else None
        self._paths = StoreStats()  # of it, the paths
        self._durations: dict[str, Durations] = {}
        self._pending: list[StoreSpec] = []  # stores planned but not yet submitted
        self._loads: dict[JobId, _LoadInFlight] = {}
        self._finished_loads: list[str] = []
        self._failed_blocks: list[int] = []
        self._failed_loads: list[str] = []
        self._handled: StepPlan | None = None
        self._idle = False

    # ------------------------------------------------------------------ steps
    def handle_preemptions(self, plan: StepPlan) -> None:
        flush = set(plan.jobs_to_flush)
        submitted = self.executor.submitted
        for spec in plan.stores:
            if spec.job_id in flush and not submitted(spec.job_id):
                self._pending.append(spec)
        self.submit_pending()
        self.executor.wait(plan.jobs_to_flush)
        self._handled = plan

    def start(self, plan: StepPlan) -> None:
        if self._handled is not plan:
            self.handle_preemptions(plan)
        self.submit_pending()
        self._idle = plan.idle
        sync: list[JobId] = []
        for load in plan.loads:
            if load.spec is None:
                if not load.sync:
                    self._finished_loads.append(load.req_id)
                self._failed_blocks.extend(load.failed_block_ids)
                if load.failed_block_ids:
                    self._failed_loads.append(load.req_id)
                continue
            blocks = {c.key: _written(c.block_ids[c.skip_blocks:]) for c in load.spec.chunks}
            deadline = None  # a same-step load copies from the CPU tier: nothing to cut
            if load.deadline_seconds is not None and not load.sync:
                deadline = self._clock() + load.deadline_seconds
                self._timed += 1
            self._loads[load.spec.job_id] = _LoadInFlight(load.req_id, blocks,
                                                          load.failed_block_ids, load.sync,
                                                          deadline)
            self.executor.submit(load.spec)
            if load.sync:
                sync.append(load.spec.job_id)
        for spill in plan.spills:
            if self.writes_disk:
                self.executor.submit(spill)
            else:
                self._skipped.append(Completion(spill.job_id, spill.kind, ok=True))
        # The plan's other stores wait for the forward pass that completes their chunks.
        submitted = self.executor.submitted
        self._pending.extend(s for s in plan.stores if not submitted(s.job_id))
        if sync:  # this step's forward reads them: they land first (the engine calls start
            self.executor.wait(sync)  # before its forward when a plan has same-step loads)

    def after_forward(self) -> None:
        self.submit_pending()

    def submit_pending(self) -> None:
        pending, self._pending = self._pending, []
        executor = self.executor
        for spec in pending:
            if not executor.submitted(spec.job_id):  # a flush may have submitted it first
                executor.submit(spec)

    # ------------------------------------------------------------------ reports
    def poll(self) -> WorkerReport:
        if self._idle and self.executor.in_flight_ids():
            self.executor.advance()  # a load whose reads are in starts its copy before ...
            time.sleep(IDLE_YIELD_SECONDS)  # ... the copy and disk threads run (see above)
        jobs = self.executor.poll_finished_jobs()  # advances too
        completions = [completion for completion, _ in jobs]
        residency = self._residency
        for completion, spec in jobs:
            self._account(completion)
            if residency is not None and spec is not None:
                residency.finished(completion, spec)
            load = self._loads.pop(completion.job_id, None)
            if load is not None:
                self._finish_load(load, completion)
        if self._timed:
            self._cut_late_loads()
        if self._skipped:  # nothing moved: not accounted
            completions, self._skipped = [*completions, *self._skipped], []
        finished, self._finished_loads = self._finished_loads, []
        failed, self._failed_blocks = self._failed_blocks, []
        failed_loads, self._failed_loads = self._failed_loads, []
        return WorkerReport(self.rank, tuple(completions), tuple(finished), tuple(failed),
                            tuple(failed_loads))

    def _cut_late_loads(self) -> None:
        """Cut the loads past their deadline (see the module docstring)."""
        now = self._clock()
        for job_id, load in self._loads.items():
            if load.deadline is None or now < load.deadline:
                continue
            load.deadline = None
            self._timed -= 1
            if not self.executor.cut(job_id):
                continue  # its copy to the GPU is under way: it lands as usual
            load.cut = True
            self.loads_cut += 1
            self._finished_loads.append(load.req_id)
            self._failed_blocks.extend(load.lost)
            for blocks in load.blocks_by_key.values():
                self._failed_blocks.extend(blocks)
            self._failed_loads.append(load.req_id)

    def _finish_load(self, load: _LoadInFlight, completion: Completion) -> None:
        if load.deadline is not None:
            self._timed -= 1
        if load.cut:  # reported at its deadline: its chunks reached no block
            return
        failed_keys = failed_set(completion, tuple(load.blocks_by_key))
        if not load.sync:
            self._finished_loads.append(load.req_id)
        self._failed_blocks.extend(load.lost)
        for key in failed_keys:
            self._failed_blocks.extend(load.blocks_by_key.get(key, ()))
        if failed_keys or load.lost:
            self._failed_loads.append(load.req_id)

    def _account(self, completion: Completion) -> None:
        self._paths.add(completion)
        key = DURATION_KEY[PATH_NAMES[completion.kind]]
        self._durations.setdefault(key, Durations()).observe(completion.seconds)

    def statistics(self) -> dict[str, float]:
        """Bytes, seconds and failed jobs per path (``StoreStats.path``), the figures that
        moved (a path with no job, no failure: absent)."""
        return {name: value for name, value in values(self._paths).items() if value}

    def take_durations(self) -> dict[str, list[float]]:
        """Seconds of each job finished since the last call, by figure key (``durations_<path>``)."""
        return {key: taken for key, durations in self._durations.items()
                if (taken := durations.take())}

    def unspilled_chunks(self) -> list[tuple[bytes, int]]:
        """See the module docstring; empty without ``track_slots``."""
        return self._residency.unspilled() if self._residency is not None else []

    def drain(self) -> None:
        """Submit everything pending and poll until no job is in flight."""
        self.submit_pending()
        while self.executor.in_flight_ids():
            self.executor.wait(self.executor.in_flight_ids())
            self.poll()

    def wait_all(self) -> None:
        """Submit everything pending and wait for every job in flight."""
        self.submit_pending()
        self.executor.wait(self.executor.in_flight_ids())

    def shutdown(self) -> None:
        self.submit_pending()
        self.executor.shutdown()
