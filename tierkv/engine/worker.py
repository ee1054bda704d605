"""WorkerAdapter: executes a StepPlan on one worker (one GPU rank). Decides no policy.

Per step, in the engine's order:

1. ``handle_preemptions(plan)`` before the forward pass: the plan's stores named in
   ``jobs_to_flush`` join the pending list, **every** pending store is submitted, and only
   then does it wait on ``jobs_to_flush``. (Waiting on a job never submitted is the race
   that corrupted vLLM's offloading connector: the block would be overwritten while the
   store had not even started.)
2. ``start(plan)``: submits pending stores, the plan's loads and spills.
3. the engine's forward pass writes KV into the scheduled slots.
4. ``after_forward()``: submits the plan's remaining stores (their chunks were completed
   by this forward; on CUDA the copy stream waits on the compute stream).
5. ``poll() -> WorkerReport``: finished jobs, finished loads by request, and the GPU block
   ids of chunks that failed to load (the engine recomputes them).

Idle steps yield. When the engine computes nothing (every request waits for its load) it
loops as fast as it can; in one process that loop can starve the copy and disk threads of
the GIL for seconds (seen with vLLM's scheduler on CPU: spills stalled for 3000 steps). So
``poll()`` after an idle plan with jobs in flight sleeps ``IDLE_YIELD_SECONDS`` first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tierkv.core.jobs import Completion, JobId, StoreSpec, failed_set
from tierkv.engine.requests import StepPlan, WorkerReport
from tierkv.transfer.executor import JobExecutor

IDLE_YIELD_SECONDS = 0.0005


@dataclass
class _LoadInFlight:
    req_id: str
    blocks_by_key: dict[bytes, tuple[int, ...]]
    lost: tuple[int, ...]


class WorkerAdapter:
    def __init__(self, executor: JobExecutor, rank: int = 0) -> None:
        self.executor = executor
        self.rank = rank
        self._pending: list[StoreSpec] = []  # stores planned but not yet submitted
        self._submitted: set[JobId] = set()
        self._loads: dict[JobId, _LoadInFlight] = {}
        self._finished_loads: list[str] = []
        self._failed_blocks: list[int] = []
        self._handled: StepPlan | None = None
        self._idle = False

    # ------------------------------------------------------------------ steps
    def handle_preemptions(self, plan: StepPlan) -> None:
        flush = set(plan.jobs_to_flush)
        for spec in plan.stores:
            if spec.job_id in flush and spec.job_id not in self._submitted:
                self._pending.append(spec)
        self.submit_pending()
        self.executor.wait(plan.jobs_to_flush)
        self._handled = plan

    def start(self, plan: StepPlan) -> None:
        if self._handled is not plan:
            self.handle_preemptions(plan)
        self.submit_pending()
        self._idle = plan.idle
        for load in plan.loads:
            if load.spec is None:
                self._finished_loads.append(load.req_id)
                self._failed_blocks.extend(load.failed_block_ids)
                continue
            blocks = {c.key: c.block_ids[c.skip_blocks :] for c in load.spec.chunks}
            self._loads[load.spec.job_id] = _LoadInFlight(load.req_id, blocks, load.failed_block_ids)
            self.executor.submit(load.spec)
        for spill in plan.spills:
            self.executor.submit(spill)
        # The plan's other stores wait for the forward pass that completes their chunks.
        self._pending.extend(s for s in plan.stores if s.job_id not in self._submitted)

    def after_forward(self) -> None:
        self.submit_pending()

    def submit_pending(self) -> None:
        pending, self._pending = self._pending, []
        for spec in pending:
            if spec.job_id in self._submitted:
                continue
            self._submitted.add(spec.job_id)
            self.executor.submit(spec)

    # ------------------------------------------------------------------ reports
    def poll(self) -> WorkerReport:
        if self._idle and self.executor.in_flight_ids():
            time.sleep(IDLE_YIELD_SECONDS)  # let the copy and disk threads run (see above)
        completions = self.executor.poll_finished()
        for completion in completions:
            self._submitted.discard(completion.job_id)
            load = self._loads.pop(completion.job_id, None)
            if load is not None:
                self._finish_load(load, completion)
        finished, self._finished_loads = self._finished_loads, []
        failed, self._failed_blocks = self._failed_blocks, []
        return WorkerReport(self.rank, tuple(completions), tuple(finished), tuple(failed))

    def _finish_load(self, load: _LoadInFlight, completion: Completion) -> None:
        failed_keys = failed_set(completion, tuple(load.blocks_by_key))
        self._finished_loads.append(load.req_id)
        self._failed_blocks.extend(load.lost)
        for key in failed_keys:
            self._failed_blocks.extend(load.blocks_by_key.get(key, ()))

    def wait_all(self) -> None:
        """Submit everything pending and wait for every job in flight."""
        self.submit_pending()
        self.executor.wait(self.executor.in_flight_ids())

    def shutdown(self) -> None:
        self.submit_pending()
        self.executor.shutdown()
