"""EngineAdapter with several KV cache groups (a hybrid model: full attention + sliding
window): block ids per group, chunks group after group, pages an engine no longer holds, and
the fence for blocks freed while their request runs. Scripted, pure."""

from __future__ import annotations

import pytest

from tierkv.core.index import BlockIndex
from tierkv.core.jobs import NO_BLOCK, Completion
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.requests import RequestView, StepInput, WorkerReport
from tierkv.errors import UsageError
from tierkv.keys import chunk_keys

BLOCK = 4
BPC = 2
TPC = BLOCK * BPC  # 8 tokens per chunk
X = NO_BLOCK


def make(**kw) -> EngineAdapter:  # type: ignore[no-untyped-def]
    return EngineAdapter(BlockIndex(num_slots=64), AdapterConfig(BLOCK, BPC, groups=2, **kw))


def view(req_id: str, tokens: list[int], prompt: int, computed: int) -> RequestView:
    return RequestView(req_id, chunk_keys(tokens, TPC), prompt, len(tokens), computed)


def done(adapter: EngineAdapter, plan) -> None:  # type: ignore[no-untyped-def]
    specs = [*plan.stores, *(l.spec for l in plan.loads if l.spec)]
    adapter.complete(WorkerReport(0, tuple(Completion(s.job_id, s.kind, ok=True) for s in specs)))


def positions(*pairs: tuple[int, int]) -> tuple[list[int], list[int]]:
    """Each group's block list from (group 0, group 1) pairs, one pair per position."""
    return [pair[0] for pair in pairs], [pair[1] for pair in pairs]


def test_a_chunk_lists_each_groups_blocks_in_turn() -> None:
    adapter = make()
    tokens = list(range(17))
    # Four positions: group 0 (full attention) blocks 1-4, group 1 (sliding window) 11-14.
    ids = positions((1, 11), (2, 12), (3, 13), (4, 14))
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 17, 0)}, {"r": 16}, {"r": ids},
                                        frozenset({"r"})))
    [spec] = plan.stores
    assert [c.block_ids for c in spec.chunks] == [(1, 2, 11, 12), (3, 4, 13, 14)]


def test_a_chunk_with_a_page_the_engine_no_longer_holds_is_never_stored() -> None:
    adapter = make()
    tokens = list(range(17))
    # The sliding-window group holds no block at positions 0 and 1 (before its window).
    ids = positions((1, X), (2, X), (3, 13), (4, 14))
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 17, 0)}, {"r": 16}, {"r": ids},
                                        frozenset({"r"})))
    [spec] = plan.stores
    assert spec.keys == (chunk_keys(tokens, TPC)[1],)  # chunk 0 lacks two pages
    assert [c.block_ids for c in spec.chunks] == [(3, 4, 13, 14)]
    assert adapter.stats.stores_without_pages == 1
    done(adapter, plan)
    adapter.request_finished(view("r", tokens, 17, 16))
    assert adapter.build_plan(StepInput()).stores == ()  # and not at finish either


def test_a_load_leaves_the_local_hit_and_missing_pages_untouched() -> None:
    adapter = make()
    tokens = list(range(25))
    seed = positions(*((p, 10 + p) for p in range(1, 7)))
    done(adapter, adapter.build_plan(StepInput({"s": view("s", tokens, 25, 0)}, {"s": 24},
                                               {"s": seed}, frozenset({"s"}))))
    v = view("r", tokens, 25, 0)
    assert adapter.lookup(v, 4) == 20  # one block on the GPU; load the rest of 3 chunks
    # Group 1 has no blocks before position 3 (its window); position 0 is the local hit.
    ids = positions((21, 31), (22, X), (23, X), (24, 34), (25, 35), (26, 36), (27, 37))
    adapter.update_state_after_alloc(v, ids, 20, 4)
    [load] = adapter.build_plan(StepInput()).loads
    assert load.spec is not None
    assert [c.block_ids for c in load.spec.chunks] == [
        (X, 22, X, X), (23, 24, X, 34), (25, 26, 35, 36)]
    assert all(c.skip_blocks == 0 for c in load.spec.chunks)


def test_lost_blocks_of_a_load_never_name_a_missing_page() -> None:
    adapter = make()
    tokens = list(range(25))
    seed = positions(*((p, 10 + p) for p in range(1, 5)))  # two chunks stored, not three
    done(adapter, adapter.build_plan(StepInput({"s": view("s", tokens[:17], 17, 0)}, {"s": 16},
                                               {"s": seed}, frozenset({"s"}))))
    v = view("r", tokens, 25, 0)
    assert adapter.lookup(v, 0) == 16
    # Promised 24 tokens (the third chunk went between the lookup and the allocation).
    ids = positions((21, X), (22, X), (23, 33), (24, 34), (25, 35), (26, 36), (27, 37))
    adapter.update_state_after_alloc(v, ids, 24, 0)
    [load] = adapter.build_plan(StepInput()).loads
    assert load.failed_block_ids == (25, 26, 35, 36)


def test_a_block_freed_while_its_request_runs_waits_for_the_store_that_reads_it() -> None:
    adapter = make(frees_running_blocks=True)
    tokens = list(range(40))

    def at(computed: int, released: int) -> RequestView:
        return RequestView("r", chunk_keys(tokens, TPC), 40, 40, computed, released)

    plan = adapter.build_plan(StepInput({"r": at(0, 0)}, {"r": 8},
                                        {"r": positions((1, 11), (2, 12))}, frozenset({"r"})))
    [spec] = plan.stores  # in flight, reading 1, 2, 11, 12
    # The sliding-window group released position 0 (block 11: out of the window) and the
    # engine gives block 11 back to the same request for a new position at once: its
    # store must finish before the forward pass that writes it.
    plan = adapter.build_plan(StepInput({"r": at(8, 1)}, {"r": 4}, {"r": positions((3, 11))}))
    assert spec.job_id in plan.jobs_to_flush
    adapter.complete(WorkerReport(0, (Completion(spec.job_id, spec.kind, ok=True),)))
    done(adapter, plan)
    # Position 1 (block 12) released with no job in flight: nothing to wait for.
    plan = adapter.build_plan(StepInput({"r": at(12, 2)}, {"r": 4}, {"r": positions((4, 12))}))
    assert plan.jobs_to_flush == ()


def test_an_allocation_before_the_plan_that_notes_the_release_is_fenced_too() -> None:
    # vLLM frees the window's blocks and hands them to another request's async load before
    # it builds the step's plan, which is where the adapter learns of the release.
    adapter = make(frees_running_blocks=True)
    tokens = list(range(40))
    keys = chunk_keys(tokens, TPC)
    plan = adapter.build_plan(StepInput({"r": RequestView("r", keys, 40, 40, 0)}, {"r": 8},
                                        {"r": positions((1, 11), (2, 12))}, frozenset({"r"})))
    [spec] = plan.stores
    other = RequestView("o", chunk_keys(list(range(100, 124)), TPC), 24, 24, 0)
    adapter.update_state_after_alloc(other, positions((60, 11), (61, 62)), 0, 0)
    plan = adapter.build_plan(StepInput({"r": RequestView("r", keys, 40, 40, 8, 1)}, {"r": 4},
                                        {"r": positions((3, 13))}))
    assert spec.job_id in plan.jobs_to_flush


def test_without_frees_running_blocks_a_running_requests_blocks_need_no_fence() -> None:
    adapter = make()
    tokens = list(range(40))
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 40, 0)}, {"r": 8},
                                        {"r": positions((1, 11), (2, 12))}, frozenset({"r"})))
    assert plan.stores
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 40, 8)}, {"r": 4},
                                        {"r": positions((3, 11))}))
    assert plan.jobs_to_flush == ()


def test_chunks_over_blocks_a_sliding_window_released_are_not_stored() -> None:
    # One sliding-window group: no ids are missing, but the engine released the first
    # three block positions (the window moved on) before the chunks were stored.
    adapter = EngineAdapter(BlockIndex(num_slots=64),
                            AdapterConfig(BLOCK, BPC, frees_running_blocks=True))
    tokens = list(range(25))
    v = RequestView("r", chunk_keys(tokens, TPC), 25, 25, 0, num_released_blocks=3)
    plan = adapter.build_plan(StepInput({"r": v}, {"r": 24}, {"r": list(range(1, 7))},
                                        frozenset({"r"})))
    [spec] = plan.stores
    assert spec.keys == (chunk_keys(tokens, TPC)[2],)  # chunks 0 and 1 overlap the released
    assert [c.block_ids for c in spec.chunks] == [(5, 6)]
    assert adapter.stats.stores_without_pages == 2


def test_a_block_list_that_does_not_match_the_groups_is_refused_and_changes_nothing() -> None:
    adapter = make()
    v = view("r", list(range(17)), 17, 0)
    # Two groups take one list per group: a flat list, or three lists, are refused.
    with pytest.raises(UsageError, match="AdapterConfig.groups is 2"):
        adapter.update_state_after_alloc(v, [1, 11, 2, 12], 0, 0)
    with pytest.raises(UsageError, match="3 block lists"):
        adapter.build_plan(StepInput({"r": v}, {"r": 16}, {"r": ([1, 2], [11, 12], [21, 22])},
                                     frozenset({"r"})))
    assert adapter.num_requests() == 0 and adapter.jobs_in_flight() == 0
    plan = adapter.build_plan(StepInput({"r": v}, {"r": 16}, {"r": ([1, 2], [11, 12])},
                                        frozenset({"r"})))
    [spec] = plan.stores
    assert [c.block_ids for c in spec.chunks] == [(1, 2, 11, 12)]


def test_one_group_takes_a_flat_list_or_a_list_per_group_alike() -> None:
    tokens = list(range(17))
    chunks = []
    for ids in ([1, 2, 3, 4], ([1, 2, 3, 4],), range(1, 5), (1, 2, 3, 4)):
        adapter = EngineAdapter(BlockIndex(num_slots=64), AdapterConfig(BLOCK, BPC))
        plan = adapter.build_plan(StepInput({"r": view("r", tokens, 17, 0)}, {"r": 16},
                                            {"r": ids}, frozenset({"r"})))
        chunks.append([c.block_ids for c in plan.stores[0].chunks])
    assert chunks == [[(1, 2), (3, 4)]] * 4


def test_groups_that_grow_unevenly_store_only_the_positions_every_group_holds() -> None:
    adapter = make()
    tokens = list(range(25))
    # Group 0 gets two positions' blocks in the first step, group 1 one: chunk 0 (positions
    # 0 and 1) lacks group 1's second page until the next step brings it.
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 25, 0)}, {"r": 8},
                                        {"r": ([1, 2], [11])}, frozenset({"r"})))
    assert plan.stores == ()
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 25, 8)}, {"r": 8},
                                        {"r": ([], [12])}))
    [spec] = plan.stores
    assert [c.block_ids for c in spec.chunks] == [(1, 2, 11, 12)]
