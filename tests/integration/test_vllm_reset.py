"""reset_cache under the real vLLM 0.33 Scheduler (``Scheduler.reset_prefix_cache(...,
reset_connector=True)``, what ``/reset_prefix_cache`` calls after a weight update): nothing
stored before the reset is served after it, on the CPU or the disk tier; what is stored
after it is; a reset in the middle of a run, with running requests preempted, keeps every
output and every KV check exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from .test_vllm_connector import CHAT, HarnessConfig, MultiTurnWorkload, Run, assert_clean, \
    tierkv_config


class Named(MultiTurnWorkload):
    """The same conversations (same tokens) under other request ids (4-letter names: the
    workload reads ids as NAMEc-turnT)."""

    def __init__(self, name: str, **options: Any) -> None:
        super().__init__(**options)
        self.name = name

    def request_id(self, conversation: int, turn: int) -> str:  # type: ignore[override]
        return f"{self.name}{conversation}-turn{turn}"


def hits(run: Run, name: str) -> int:
    return sum(tokens for req, tokens in run.external.items() if req.startswith(name))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_nothing_stored_before_a_reset_is_served_after_it(async_scheduling: bool,
                                                            tmp_path: Path) -> None:
    cfg = HarnessConfig(async_scheduling=async_scheduling, enable_prefix_caching=False,
                        num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(disk_path=str(tmp_path)))
    run = Run(cfg)
    one_turn = {**CHAT, "num_turns": 2}
    for name in ("runa", "runb"):
        assert_clean(run.run(Named(name, **one_turn)), cfg.vocab_size)
    assert hits(run, "runb") > 0  # the control: the same prompts hit before a reset
    run.side.stats_interval = 0.0
    assert run.engine.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert run.side.resets == 1
    assert_clean(run.run(Named("runc", **one_turn)), cfg.vocab_size)
    # Turn 0 of "runc" found nothing of runa or runb (CPU or disk); turn 1 hits its turn 0.
    assert not any(tokens for req, tokens in run.external.items()
                   if req.startswith("runc") and req.endswith("turn0"))
    after = hits(run, "runc")
    assert_clean(run.run(Named("rund", **one_turn)), cfg.vocab_size)
    assert hits(run, "rund") > after >= 0  # stored after the reset: served
    run.shutdown()

    # A restart is keyed as before the reset (the model's weights are read again).
    again = Run(cfg)
    assert_clean(again.run(Named("rune", **one_turn)), cfg.vocab_size)
    assert hits(again, "rune") > 0
    again.shutdown()


def test_a_reset_mid_run_preempts_and_keeps_every_output_exact() -> None:
    # Sync scheduling only: under async scheduling vLLM 0.33's own reset_prefix_cache raises
    # mid-run (blocks of the step in flight stay in use), before it reaches the connector.
    cfg = HarnessConfig(async_scheduling=False, enable_prefix_caching=False,
                        num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    check = run.engine.on_step_end
    answers: list[bool] = []

    def reset_once(engine: Any) -> None:
        if check is not None:
            check(engine)
        # vLLM refuses a reset while a request waits for its load (it raises): between loads.
        if len(engine.finished) >= 2 and True not in answers \
                and not any(request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                            for request in engine.scheduler.requests.values()):
            answers.append(engine.scheduler.reset_prefix_cache(reset_running_requests=True,
                                                               reset_connector=True))

    run.engine.on_step_end = reset_once
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)  # exact outputs; the harness checked every KV slot
    assert True in answers and run.side.resets == 1
    run.shutdown()


def test_a_reset_is_refused_while_a_load_is_in_flight() -> None:
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    answers: list[tuple[int, bool]] = []

    def try_reset(engine: Any, so: Any) -> None:  # after the forward, before its outputs apply
        loads = run.side.adapter.loads_in_flight()
        if loads and not answers:
            answers.append((loads, run.connector.reset_cache()))

    run.engine.after_execute = try_reset
    assert_clean(run.run(MultiTurnWorkload(**CHAT)), cfg.vocab_size)
    assert answers and answers[0][0] > 0 and answers[0][1] is False
    assert run.side.resets == 0  # nothing changed: the keys stayed in their epoch
    assert run.connector.reset_cache() is True  # once the loads finished
    run.shutdown()
