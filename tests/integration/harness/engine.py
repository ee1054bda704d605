"""The harness's wired objects and EngineCore's loop over them: Harness, HarnessEngine,
workloads, step records and run results (see ``vllm_harness``)."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from .config import HarnessConfig, make_request
from .runner import FakeModelRunner
from .values import HarnessError, reference_generate

# --------------------------------------------------------------------------------------------
# The harness and its engine loop
# --------------------------------------------------------------------------------------------


@dataclass
class Harness:
    cfg: HarnessConfig
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    layout: KVCacheLayout
    scheduler: Scheduler
    runner: FakeModelRunner
    worker_connector: KVConnectorBase_V1 | None
    block_hasher: Callable[[Request], list[Any]]

    @property
    def scheduler_connector(self) -> KVConnectorBase_V1 | None:
        return self.scheduler.connector


def assert_preempted_requests_came_back(result: RunResult, model_runner: str) -> None:
    """A preempted request comes back as a "resumed" cached request under the v1 model
    runner, as a new request under v2 (vLLM sends v2 the whole request again)."""
    resumed = [req for r in result.records for req in r.resumed_req_ids]
    admitted = [req for r in result.records for req in r.new_req_ids]
    if model_runner == "v1":
        assert resumed and len(admitted) == len(result.outputs)
    else:
        assert not resumed and len(admitted) > len(result.outputs)


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    lora_request: Any = None  # a vllm.lora.request.LoRARequest: its name and path are hashed


@dataclass
class StepRecord:
    index: int
    num_scheduled_tokens: dict[str, int]
    new_req_ids: list[str]
    resumed_req_ids: set[str]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    has_sync_kv_loads: bool
    kv_connector_metadata: KVConnectorMetadata | None
    # num_computed_tokens of each scheduled request before the step (its first new position)
    computed_before: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class RunResult:
    prompts: dict[str, RequestSpec]
    outputs: dict[str, list[int]]
    records: list[StepRecord]
    num_steps: int
    num_checked_slots: int
    seconds: float

    @property
    def num_preemptions(self) -> int:
        return sum(len(record.preempted_req_ids) for record in self.records)

    @property
    def max_batch_tokens(self) -> int:
        return max((sum(r.num_scheduled_tokens.values()) for r in self.records), default=0)

    def mismatched_outputs(self, vocab_size: int) -> list[str]:
        """Request ids whose outputs differ from reference_generate."""
        return [
            req_id
            for req_id, spec in self.prompts.items()
            if self.outputs.get(req_id) != reference_generate(spec.prompt_token_ids, spec.max_tokens, vocab_size)
        ]


class Workload:
    """Requests to start with, and follow-ups to add when a request finishes."""

    def initial_requests(self) -> list[RequestSpec]:
        raise NotImplementedError

    def on_finished(self, request_id: str, all_token_ids: list[int]) -> list[RequestSpec]:
        return []


class MultiTurnWorkload(Workload):
    """Conversations sharing a system prompt; turn k+1 = turn k's prompt + its output + new tokens."""

    def __init__(
        self,
        *,
        num_conversations: int = 4,
        num_turns: int = 3,
        system_prompt_len: int = 40,
        first_user_len: int = 30,
        user_turn_len: int = 20,
        max_tokens: int = 8,
        vocab_size: int = 1000,
        seed: int = 0,
        cache_salts: Sequence[str | None] | None = None,
    ) -> None:
        self.num_conversations = num_conversations
        self.num_turns = num_turns
        self.max_tokens = max_tokens
        self.user_turn_len = user_turn_len
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._system = self._tokens(system_prompt_len)
        self._first = [self._tokens(first_user_len) for _ in range(num_conversations)]
        self._salts = list(cache_salts) if cache_salts is not None else [None] * num_conversations

    def _tokens(self, count: int) -> list[int]:
        return [self._rng.randrange(self.vocab_size) for _ in range(count)]

    @staticmethod
    def request_id(conversation: int, turn: int) -> str:
        return f"conv{conversation}-turn{turn}"

    def initial_requests(self) -> list[RequestSpec]:
        return [
            RequestSpec(self.request_id(c, 0), self._system + self._first[c], self.max_tokens, self._salts[c])
            for c in range(self.num_conversations)
        ]

    def on_finished(self, request_id: str, all_token_ids: list[int]) -> list[RequestSpec]:
        conversation_text, turn_text = request_id.split("-")
        conversation, turn = int(conversation_text[4:]), int(turn_text[4:])
        if turn + 1 >= self.num_turns:
            return []
        prompt = list(all_token_ids) + self._tokens(self.user_turn_len)
        return [RequestSpec(self.request_id(conversation, turn + 1), prompt, self.max_tokens, self._salts[conversation])]


class StaticWorkload(Workload):
    def __init__(self, requests: Sequence[RequestSpec]) -> None:
        self._requests = list(requests)

    def initial_requests(self) -> list[RequestSpec]:
        return list(self._requests)


class HarnessEngine:
    """EngineCore's loop over the real scheduler and the fake runner (vllm/v1/engine/core.py).

    Sync scheduling follows EngineCore.step: schedule, execute, update_from_output. Async
    scheduling follows step_with_batch_queue with a queue of max_concurrent_batches (2): step N+1
    is scheduled and executed before update_from_output(N). The runner executes a step as soon
    as it is scheduled, as the GPU would.
    """

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.scheduler = harness.scheduler
        self.runner = harness.runner
        self.requests: dict[str, Request] = {}
        self.specs: dict[str, RequestSpec] = {}
        self.outputs: dict[str, list[int]] = {}
        self.records: list[StepRecord] = []
        self.finished: list[str] = []
        # Called right after the runner executed a step (before update_from_output).
        self.after_execute: Callable[[HarnessEngine, SchedulerOutput], None] | None = None
        # Called by run() after each step and its follow-up requests (between steps).
        self.on_step_end: Callable[[HarnessEngine], None] | None = None
        self._batch_queue: deque[tuple[ModelRunnerOutput, SchedulerOutput]] = deque()
        self._queue_size = harness.vllm_config.max_concurrent_batches

    def add_request(self, spec: RequestSpec) -> Request:
        request = make_request(
            spec.request_id, spec.prompt_token_ids, spec.max_tokens, self.harness.block_hasher, spec.cache_salt,
            spec.lora_request,
        )
        self.requests[spec.request_id] = request
        self.specs[spec.request_id] = spec
        self.outputs[spec.request_id] = []
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def _schedule_and_execute(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        so = self.scheduler.schedule()
        record = StepRecord(
            index=len(self.records) + 1,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            new_req_ids=[new.req_id for new in so.scheduled_new_reqs],
            resumed_req_ids=set(getattr(so.scheduled_cached_reqs, "resumed_req_ids", ())),
            preempted_req_ids=set(so.preempted_req_ids or ()),
            finished_req_ids=set(so.finished_req_ids),
            has_sync_kv_loads=so.has_sync_kv_loads,
            kv_connector_metadata=so.kv_connector_metadata,
            computed_before={new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs},
        )
        cached = so.scheduled_cached_reqs
        record.computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        self.records.append(record)
        output = self.runner.execute_model(so)
        record.kv_connector_output = output.kv_connector_output
        if self.after_execute is not None:
            self.after_execute(self, so)
        return so, output

    def _update(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[str]:
        finished: list[str] = []
        for engine_outputs in self.scheduler.update_from_output(so, output).values():
            for item in engine_outputs.outputs:
                self.outputs[item.request_id].extend(item.new_token_ids)
                if item.finish_reason is not None:
                    finished.append(item.request_id)
        self.finished.extend(finished)
        return finished

    def step(self) -> list[str]:
        """One engine step; returns the ids of requests that finished in it."""
        if self._queue_size <= 1:
            if not self.scheduler.has_requests():
                return []
            so, output = self._schedule_and_execute()
            return self._update(so, output)
        return self._step_with_batch_queue()

    def _step_with_batch_queue(self) -> list[str]:
        queue = self._batch_queue
        if self.scheduler.has_requests():
            so, output = self._schedule_and_execute()
            executed = so.total_num_scheduled_tokens > 0
            queue.appendleft((output, so))
            if len(queue) < self._queue_size and (executed or self.scheduler.has_requests()):
                return []
        elif not queue:
            return []
        output, so = queue.pop()
        return self._update(so, output)

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self._batch_queue)

    def run(self, workload: Workload, max_steps: int = 2000) -> RunResult:
        started = time.perf_counter()
        for spec in workload.initial_requests():
            self.add_request(spec)
        steps = 0
        while self.busy():
            steps += 1
            if steps > max_steps:
                raise HarnessError(f"no quiescence after {max_steps} steps ({len(self.scheduler.requests)} left)")
            for request_id in self.step():
                request = self.requests[request_id]
                for spec in workload.on_finished(request_id, list(request.all_token_ids)):
                    self.add_request(spec)
            if self.on_step_end is not None:
                self.on_step_end(self)
        return RunResult(
            prompts=dict(self.specs),
            outputs=dict(self.outputs),
            records=list(self.records),
            num_steps=steps,
            num_checked_slots=self.runner.num_checked_slots,
            seconds=time.perf_counter() - started,
        )
