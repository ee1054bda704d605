"""vLLM 0.34's --max-num-inflight-kv-loads, and the v2 runner's deferred finalize.

With ``max_num_inflight_kv_loads`` set, vLLM 0.34 asks the connector's ``may_load_async`` as
a request enters a waiting queue and starts the loads of the requests it admits while
the running batch is full, so their KV is there when a slot frees. Under a speculator,
vLLM's v2 runner collects a step's transfer results before ``wait_for_save`` and calls it
later (``post_forward(defer_finalize=True)``, then ``finalize_step``). Both through vLLM's
real Scheduler and its worker/gpu/kv_connector.py wrapper, with exact KV checks.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vllm installed")

from . import vllm_harness as harness_lib
from .test_vllm_connector import CHAT, Run, assert_clean, expected_chat_hits, tierkv_config

HarnessConfig = harness_lib.HarnessConfig
MultiTurnWorkload = harness_lib.MultiTurnWorkload

MAX_SEQS = 2
# Six conversations through two running slots: a later turn arrives while others run.
INFLIGHT_CHAT = {**CHAT, "num_conversations": 6}


def inflight_run(limit: int | None, async_scheduling: bool, **extra: Any
                 ) -> tuple[Run, list[int], dict[str, bool]]:
    """A chat whose hits all load asynchronously (sync_load_bytes 0, unless ``extra`` says
    otherwise); returns the run, the running batch's size at each load vLLM admitted, and
    may_load_async's answers."""
    cfg = HarnessConfig(async_scheduling=async_scheduling, enable_prefix_caching=False,
                        num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=MAX_SEQS,
                        max_num_inflight_kv_loads=limit,
                        kv_transfer_config=tierkv_config(**{"sync_load_bytes": 0, **extra}))
    run = Run(cfg)
    scheduler, connector = run.harness.scheduler, run.connector
    running_at_load: list[int] = []
    answers: dict[str, bool] = {}
    admit, ask = connector.update_state_after_alloc, connector.may_load_async

    def spy_admit(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            running_at_load.append(len(scheduler.running))
        admit(request, blocks, num_external_tokens)

    def spy_ask(request: Any) -> bool:
        answers[request.request_id] = answer = ask(request)
        return bool(answer)

    connector.update_state_after_alloc, connector.may_load_async = spy_admit, spy_ask
    return run, running_at_load, answers


@pytest.mark.skipif(not harness_lib.VLLM_RELEASE.inflight_kv_loads,
                    reason="vLLM before 0.34 has no --max-num-inflight-kv-loads")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_loads_start_while_the_running_batch_is_full(async_scheduling: bool) -> None:
    for limit in (None, 4):
        run, running_at_load, answers = inflight_run(limit, async_scheduling)
        result = run.run(MultiTurnWorkload(**INFLIGHT_CHAT))
        assert_clean(result, run.cfg.vocab_size)
        expected = expected_chat_hits(result, INFLIGHT_CHAT["user_turn_len"])
        assert {req: run.external.get(req, 0) for req in expected} == expected
        if limit is None:  # vLLM's default: a load starts only when a running slot is free
            assert answers == {} and max(running_at_load) < MAX_SEQS
        else:
            # Later turns may load (their first chunk is on the CPU tier); first turns
            # share no chunk (30 system tokens < a 32-token chunk).
            assert answers == {req: not req.endswith("-turn0") for req in result.prompts}
            assert max(running_at_load) == MAX_SEQS, running_at_load
        stats = run.side.statistics()
        assert stats["loads_failed"] == 0 and stats["sync_loads"] == 0
        run.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_speculators_deferred_finalize_keeps_every_hit(async_scheduling: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    harness_lib.use_model_runner("v2", monkeypatch)
    cfg = HarnessConfig(async_scheduling=async_scheduling, enable_prefix_caching=False,
                        num_gpu_blocks=48, max_num_batched_tokens=64, defer_kv_finalize=True,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    assert run.harness.runner.mrv2 is not None  # vLLM's worker/gpu/kv_connector.py wrapper
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    assert {req: run.external.get(req, 0) for req in expected} == expected
    stats = run.side.statistics()
    assert stats["loads_failed"] == stats["stores_failed"] == 0
    run.shutdown()


@pytest.mark.skipif(not harness_lib.VLLM_RELEASE.inflight_kv_loads,
                    reason="vLLM before 0.34 has no --max-num-inflight-kv-loads")
def test_same_step_hits_wait_for_a_running_slot_in_the_plain_queue() -> None:
    """A hit all in the CPU tier loads in the step that schedules its request (same-step
    loads on): may_load_async says False, so it never holds back vLLM's queue of
    asynchronous loads, and it still hits every chunk."""
    run, running_at_load, answers = inflight_run(4, False, sync_load_bytes=64 << 20)
    result = run.run(MultiTurnWorkload(**INFLIGHT_CHAT))
    assert_clean(result, run.cfg.vocab_size)
    expected = expected_chat_hits(result, INFLIGHT_CHAT["user_turn_len"])
    assert {req: run.external.get(req, 0) for req in expected} == expected
    assert set(answers) == set(result.prompts) and not any(answers.values())
    assert run.side.statistics()["sync_loads"] == len(expected)
    run.shutdown()
