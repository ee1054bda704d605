"""tierkv's vLLM connector on a hybrid model (issue 15, point 1), under vLLM 0.33's real
Scheduler with its hybrid KV cache manager left on.

The model has four layers: 0 and 2 full attention, 1 and 3 a sliding window of 32 tokens,
so vLLM makes two KV cache groups that overlay one memory, and frees the window's blocks as
it moves (their table entries become the null block). Before every layer of every step the
harness checks each slot that layer reads (the whole prefix for full attention, the window
for the others) against a value that depends only on the token prefix, and each request's
output against ``reference_generate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM connector tests need vllm installed")

from . import vllm_harness as harness_lib
from .test_vllm_connector import (CHAT, TPC, Run, assert_clean, expected_chat_hits,
                                  one_torch_thread, random_engine_knobs, random_settings,
                                  resend_after_restart, run_random_chat,
                                  run_with_a_chunk_missing_on_disk, tierkv_config)

from tierkv.core.jobs import NO_BLOCK

HarnessConfig = harness_lib.HarnessConfig
MultiTurnWorkload = harness_lib.MultiTurnWorkload

WINDOW = 32  # tokens: one chunk (TPC) fits, as tierkv requires
HYBRID = dict(num_layers=4, sliding_window=WINDOW, sliding_window_layers=(1, 3))


__all__ = ["one_torch_thread"]  # the autouse fixture: the KV checks run on one torch thread


def hybrid(**options: Any) -> HarnessConfig:
    return HarnessConfig(**{**HYBRID, **options})


def load_chunks(result: harness_lib.RunResult) -> list[Any]:
    return [chunk for record in result.records if record.kv_connector_metadata is not None
            for load in record.kv_connector_metadata.plan.loads if load.spec is not None
            for chunk in load.spec.chunks]


def assert_hybrid(run: Run) -> None:
    """vLLM kept its hybrid KV cache manager on (tierkv supports it), with two groups."""
    assert run.harness.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kinds = [type(group.kv_cache_spec).__name__ for group in run.harness.kv_cache_config.kv_cache_groups]
    assert kinds == ["FullAttentionSpec", "SlidingWindowSpec"]
    geometry = run.connector.geometry
    assert geometry.num_groups == 2 and geometry.pages_per_chunk == 2 * geometry.blocks_per_chunk
    assert run.connector.namespace.kv_layout.endswith(f"groups=[full:2, sliding_window={WINDOW}:2]")


def test_vllm_keeps_its_hybrid_kv_cache_manager_on_with_tierkv() -> None:
    """The start-up warning vLLM prints for a connector without SupportsHMA ("Turning off
    hybrid kv cache manager because `--kv-transfer-config` selects a KV connector that does
    not support it") is gone with tierkv; vLLM's own record of it is caught here."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        cfg = hybrid(kv_transfer_config=harness_lib.recording_transfer_config())
        assert harness_lib.build_vllm_config(cfg, harness_lib._default_model_dir(cfg)) \
            .scheduler_config.disable_hybrid_kv_cache_manager is True
        assert any("Turning off hybrid kv cache manager" in text for text in records)
        records.clear()
        cfg = hybrid(kv_transfer_config=tierkv_config())
        assert harness_lib.build_vllm_config(cfg, harness_lib._default_model_dir(cfg)) \
            .scheduler_config.disable_hybrid_kv_cache_manager is False
        assert not any("hybrid kv cache manager" in text for text in records)
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chat_turns_of_a_hybrid_model_hit_every_chunk_of_the_previous_turn(
        async_scheduling: bool) -> None:
    cfg = hybrid(async_scheduling=async_scheduling, enable_prefix_caching=False,
                 num_gpu_blocks=96, max_num_batched_tokens=64, kv_transfer_config=tierkv_config())
    run = Run(cfg)
    assert_hybrid(run)
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    got = {req: run.external.get(req, 0) for req in expected}
    assert got == expected and all(got[f"conv{c}-turn2"] == 3 * TPC for c in range(3))
    stats = run.side.statistics()
    assert stats["hit_tokens_cpu"] == sum(expected.values())
    assert stats["loads_failed"] == stats["stores_failed"] == stats["stores_without_pages"] == 0
    # Loads leave the sliding window's positions before the window alone (vLLM's null
    # block there) and write both groups' blocks elsewhere.
    chunks = load_chunks(result)
    half = run.connector.geometry.blocks_per_chunk
    assert any(NO_BLOCK in chunk.block_ids[half:] for chunk in chunks)
    assert all(NO_BLOCK not in chunk.block_ids[:half] for chunk in chunks)
    assert any(NO_BLOCK not in chunk.block_ids for chunk in chunks)
    # vLLM hands a freed window block out again at once: a store still reading it is
    # waited for before the forward pass that writes it (the fence of frees_running_blocks).
    assert run.side.adapter.stats.flushes > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("model_runner", ["v1", "v2"])
def test_preemptions_of_a_hybrid_model(model_runner: str, async_scheduling: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    harness_lib.use_model_runner(model_runner, monkeypatch)
    cfg = hybrid(async_scheduling=async_scheduling, num_gpu_blocks=40, max_num_batched_tokens=48,
                 max_num_seqs=8, kv_transfer_config=tierkv_config())
    run = Run(cfg)
    assert_hybrid(run)
    result = run.run(MultiTurnWorkload(num_conversations=5, num_turns=2, max_tokens=20,
                                       first_user_len=40))
    assert_clean(result, cfg.vocab_size)
    assert result.num_preemptions > 0
    assert sum(run.external.values()) > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_hybrid_model_restarts_warm_from_disk(async_scheduling: bool, tmp_path: Path) -> None:
    cfg = hybrid(async_scheduling=async_scheduling, enable_prefix_caching=False,
                 num_gpu_blocks=96, max_num_batched_tokens=64,
                 kv_transfer_config=tierkv_config(disk_path=str(tmp_path), disk_bytes=64 << 20))
    first = Run(cfg)
    result = first.run(MultiTurnWorkload(**{**CHAT, "num_turns": 2}))
    assert_clean(result, cfg.vocab_size)
    stored = first.side.index.statistics()
    first.shutdown()

    second = Run(cfg)
    assert second.side.found_on_disk == stored.stores_planned - stored.stores_failed > 0
    _, stats = resend_after_restart(first, result, second)
    assert stats["hit_tokens_disk"] > 0 and stats["loads_failed"] == 0
    second.shutdown()


def test_a_lost_chunk_of_a_hybrid_model_fails_its_request_load_and_is_recomputed(
        tmp_path: Path) -> None:
    """With several groups vLLM takes load failures per request (failed_recving), not per
    block: the request is recomputed, and no wrong KV is read."""
    cfg = hybrid(enable_prefix_caching=False, num_gpu_blocks=96, max_num_batched_tokens=64,
                 kv_transfer_config=tierkv_config(disk_path=str(tmp_path)))
    second, again = run_with_a_chunk_missing_on_disk(cfg)
    outputs = [r.kv_connector_output for r in again.records if r.kv_connector_output]
    assert set().union(*(o.failed_recving or set() for o in outputs)) == {"again-conv1-turn0"}
    assert not any(o.invalid_block_ids for o in outputs)
    stats = second.side.statistics()
    assert stats["loads_failed"] == 1 and stats["disk_missing"] == 1
    second.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_hybrid_model_with_vllms_own_prefix_cache(async_scheduling: bool) -> None:
    """vLLM's GPU prefix cache serves what it still holds (for the window group only the
    blocks it kept); tierkv loads the rest, around vLLM's null blocks."""
    cfg = hybrid(async_scheduling=async_scheduling, num_gpu_blocks=64, max_num_batched_tokens=48,
                 kv_transfer_config=tierkv_config())
    run = Run(cfg)
    result = run.run(MultiTurnWorkload(**{**CHAT, "num_conversations": 4}))
    assert_clean(result, cfg.vocab_size)
    stats = run.side.statistics()
    assert stats["hit_tokens_cpu"] > 0 and stats["loads_failed"] == 0
    assert stats["stores_without_pages"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_window_block_vllm_hands_out_again_waits_for_the_store_that_reads_it(
        async_scheduling: bool) -> None:
    """vLLM frees the window's blocks while their request runs and hands them out again at
    once. Every store copy here is slowed (50 ms), so a store that was not waited for would
    copy bytes the next forward pass already overwrote. Then every chunk is read back with
    its window pages in use (a prompt ending at each chunk boundary: the window layers read
    the last chunk's pages), so a wrong page fails the run (KVMismatchError). tierkv
    flushes such a store before that forward pass."""
    import random
    import time as clock

    from tierkv.core.jobs import StoreSpec

    cfg = hybrid(async_scheduling=async_scheduling, enable_prefix_caching=False,
                 num_gpu_blocks=96, max_num_batched_tokens=64, kv_transfer_config=tierkv_config())
    run = Run(cfg)
    transfer: Any = run.harness.worker_connector._worker._stack.transfer  # type: ignore[union-attr]

    def slow_stores(spec: Any) -> None:
        if isinstance(spec, StoreSpec):
            clock.sleep(0.05)

    transfer._before_copy = slow_stores
    rng = random.Random(15)
    prompts = {f"long{i}": [rng.randrange(1, cfg.vocab_size) for _ in range(200)] for i in range(2)}
    first = run.run(harness_lib.StaticWorkload(
        [harness_lib.RequestSpec(req, tokens, max_tokens=2) for req, tokens in prompts.items()]))
    assert_clean(first, cfg.vocab_size)
    transfer._before_copy = None
    probes = [harness_lib.RequestSpec(f"{req}-at{end}", tokens[:end] + [5], max_tokens=1)
              for req, tokens in prompts.items() for end in range(TPC, 200, TPC)]
    again = run.run(harness_lib.StaticWorkload(probes))
    assert_clean(again, cfg.vocab_size)
    assert {spec.request_id: run.external.get(spec.request_id, 0) for spec in probes} == {
        spec.request_id: len(spec.prompt_token_ids) - 1 for spec in probes}
    assert run.side.adapter.stats.flushes > 0


@pytest.mark.parametrize("layers", ["hybrid", "one-group"])
def test_loads_that_keep_failing_are_recomputed_once_not_retried_forever(layers: str) -> None:
    """Every CPU -> GPU copy fails (a broken transfer engine): each request that was
    offered a hit is told its load failed (per request with several groups, per block
    with one), is recomputed, and is not offered the same chunks again. Before, vLLM put a
    request whose load failed from its first chunk back in the queue, tierkv offered it the
    same chunks, and the engine never got past it."""
    from tierkv.core.jobs import LoadSpec

    options: dict[str, Any] = dict(enable_prefix_caching=False, num_gpu_blocks=96,
                                   max_num_batched_tokens=64, kv_transfer_config=tierkv_config())
    cfg = hybrid(**options) if layers == "hybrid" else HarnessConfig(**options)
    run = Run(cfg)
    transfer: Any = run.harness.worker_connector._worker._stack.transfer  # type: ignore[union-attr]

    def broken_loads(spec: Any) -> None:
        if isinstance(spec, LoadSpec):
            raise RuntimeError("the copy engine is broken")

    transfer._before_copy = broken_loads
    result = run.run(MultiTurnWorkload(**CHAT), max_steps=1500)
    assert_clean(result, cfg.vocab_size)
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    assert {req: run.external.get(req, 0) for req in expected} == expected  # offered once each
    outputs = [r.kv_connector_output for r in result.records if r.kv_connector_output]
    failed = set().union(*(o.failed_recving or set() for o in outputs))
    invalid = set().union(*(o.invalid_block_ids or set() for o in outputs))
    if layers == "hybrid":
        assert failed == set(expected) and not invalid
    else:
        assert not failed and invalid
    assert run.side.statistics()["loads_failed"] == sum(expected.values()) // TPC


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("TIERKV_RANDOM_SEEDS", "16")) // 2))
def test_random_hybrid_configurations_keep_every_kv_slot_right(
        seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random windows and layer patterns (vLLM then makes two or more groups), chunk sizes
    up to the window, layouts, runners, sync or async, vLLM's prefix cache, a disk tier,
    pools small enough to preempt, and aborts: every slot each layer reads stays right."""
    import random

    rng = random.Random(1000 + seed)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", rng.choice(["0", "1"]))
    window = rng.choice([16, 32, 48, 64])
    layers = rng.choice([(1, 3), (1,), (0, 2), (1, 2, 3)])
    tokens_per_chunk = rng.choice([t for t in (16, 32, 48) if t <= window])
    chunk_bytes = tokens_per_chunk // 16 * 1024 * 8  # a generous bound over the groupings
    extra = random_settings(rng, tokens_per_chunk, chunk_bytes, tmp_path)
    knobs = random_engine_knobs(rng)
    cfg = HarnessConfig(num_layers=4, sliding_window=window, sliding_window_layers=layers,
                        num_gpu_blocks=rng.randint(28, 80), kv_transfer_config=tierkv_config(**extra),
                        **knobs)
    run = Run(cfg)
    assert run.connector.geometry.num_groups == len(run.harness.kv_cache_config.kv_cache_groups) >= 2
    stats = run_random_chat(run, rng, seed)
    assert stats["loads_failed"] == 0 and stats["stores_without_pages"] == 0
