"""EngineAdapter planning, scripted (pure: completions are reported by hand)."""

from __future__ import annotations

import pytest

from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobKind, TierRead
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.requests import RequestView, StepInput, WorkerReport
from tierkv.errors import TierKVError
from tierkv.keys import chunk_keys

BLOCK = 4
BPC = 2
TPC = BLOCK * BPC  # 8 tokens per chunk


def make(world_size: int = 1, **kw) -> EngineAdapter:  # type: ignore[no-untyped-def]
    return EngineAdapter(BlockIndex(num_slots=64), AdapterConfig(BLOCK, BPC, world_size=world_size, **kw))


def view(req_id: str, tokens: list[int], prompt: int, computed: int, keys_upto: int | None = None) -> RequestView:
    known = tokens if keys_upto is None else tokens[:keys_upto]
    return RequestView(req_id, chunk_keys(known, TPC), prompt, len(tokens), computed)


def report(plan, rank: int = 0) -> WorkerReport:  # type: ignore[no-untyped-def]
    specs = [*plan.stores, *(l.spec for l in plan.loads if l.spec)]
    return WorkerReport(rank, tuple(Completion(s.job_id, s.kind, ok=True) for s in specs))


def stored_chunks(plan) -> int:  # type: ignore[no-untyped-def]
    return sum(len(s.chunks) for s in plan.stores)


def test_running_watermark_is_computed_plus_scheduled() -> None:
    adapter = make()
    tokens = list(range(20))
    v = view("r", tokens, 20, 0)
    plan = adapter.build_plan(StepInput({"r": v}, {"r": 12}, {"r": list(range(5))}, frozenset({"r"})))
    assert stored_chunks(plan) == 1  # 12 tokens computed by this step: 1 full chunk of 8
    adapter.complete(report(plan))
    v = view("r", tokens, 20, 12)
    plan = adapter.build_plan(StepInput({"r": v}, {"r": 8}, {}))
    assert stored_chunks(plan) == 1  # 20 tokens: chunk 2 of [8, 16)


def test_finished_request_stores_last_chunk_in_the_next_plan_not_the_last_token() -> None:
    adapter = make()
    tokens = list(range(17))  # prompt 15, then 2 sampled tokens: positions 15 and 16
    # Keys lag one token (async scheduling): while position 15 is computed, the running
    # plan cannot see chunk [8, 16) yet.
    v = view("r", tokens[:16], 15, 15, keys_upto=15)
    plan = adapter.build_plan(StepInput({"r": v}, {"r": 1}, {"r": list(range(5))}, frozenset({"r"})))
    assert stored_chunks(plan) == 1  # only chunk [0, 8)
    adapter.complete(report(plan))
    # Finished: 17 tokens, 16 computed; the slot of the last token (16) was never written.
    adapter.request_finished(view("r", tokens, 15, 16))
    plan = adapter.build_plan(StepInput())
    assert [c.key for s in plan.stores for c in s.chunks] == [chunk_keys(tokens, TPC)[1]]
    assert adapter.has_request("r")  # its store is in flight: state survives
    adapter.complete(report(plan))
    assert not adapter.has_request("r")  # freed once no job of it is in flight


def test_last_sampled_token_slot_is_never_stored() -> None:
    adapter = make()
    tokens = list(range(16))  # prompt 15, one sampled token at position 15 ends chunk 2
    v = view("r", tokens[:15], 15, 0)
    plan = adapter.build_plan(StepInput({"r": v}, {"r": 15}, {"r": list(range(4))}, frozenset({"r"})))
    adapter.complete(report(plan))
    adapter.request_finished(view("r", tokens, 15, 15))
    plan = adapter.build_plan(StepInput())
    assert stored_chunks(plan) == 0  # chunk [8, 16) would need position 15's KV


def test_aborted_request_stores_only_computed_tokens() -> None:
    adapter = make()
    tokens = list(range(24))
    v = view("r", tokens, 24, 0)
    plan = adapter.build_plan(StepInput({"r": v}, {"r": 4}, {"r": list(range(6))}, frozenset({"r"})))
    assert stored_chunks(plan) == 0
    adapter.request_finished(view("r", tokens, 24, 9), aborted=True)
    plan = adapter.build_plan(StepInput())
    assert stored_chunks(plan) == 1  # 9 computed tokens: one full chunk, not three


def test_reused_block_of_a_finished_store_is_flushed() -> None:
    adapter = make()
    tokens = list(range(17))
    v = view("a", tokens[:16], 16, 0)
    plan = adapter.build_plan(StepInput({"a": v}, {"a": 16}, {"a": [0, 1, 2, 3]}, frozenset({"a"})))
    first = plan.stores[0].job_id  # in flight, reading blocks 0..3
    adapter.request_finished(view("a", tokens, 16, 16))
    # Block 2 is handed to request b this very step: the store reading it must finish first.
    vb = view("b", list(range(100, 104)), 4, 0)
    plan = adapter.build_plan(StepInput({"b": vb}, {"b": 4}, {"b": [2]}, frozenset({"b"})))
    assert first in plan.jobs_to_flush


def test_own_async_load_is_not_flushed_but_a_preempted_requests_jobs_are() -> None:
    adapter = make()
    tokens = list(range(24))
    seed = view("s", tokens, 24, 0)
    plan = adapter.build_plan(StepInput({"s": seed}, {"s": 24}, {"s": list(range(6))}, frozenset({"s"})))
    adapter.complete(report(plan))
    v = view("r", tokens, 24, 0)
    assert adapter.lookup(v, 0) == 16  # 2 chunks; the last token stays to compute
    adapter.update_state_after_alloc(v, [10, 11, 12, 13], 16, 0)
    plan = adapter.build_plan(StepInput())
    load = plan.loads[0].spec
    assert load is not None and plan.jobs_to_flush == ()  # its own blocks: no flush
    plan = adapter.build_plan(StepInput(preempted=("r",)))
    assert load.job_id in plan.jobs_to_flush


def test_local_hit_skips_blocks_already_on_the_gpu() -> None:
    adapter = make()
    tokens = list(range(24))
    seed = view("s", tokens, 24, 0)
    adapter.complete(report(adapter.build_plan(StepInput({"s": seed}, {"s": 24}, {"s": list(range(6))}, frozenset({"s"})))))
    v = view("r", tokens, 24, 0)
    assert adapter.lookup(v, 4) == 12  # local hit of one block: load the rest of 2 chunks
    adapter.update_state_after_alloc(v, [20, 21, 22, 23], 12, 4)
    load = adapter.build_plan(StepInput()).loads[0].spec
    assert load is not None and load.chunks[0].skip_blocks == 1 and load.chunks[1].skip_blocks == 0


def test_a_job_completes_only_when_every_worker_reported_it() -> None:
    adapter = make(world_size=2)
    tokens = list(range(8))
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 8, 0)}, {"r": 8}, {"r": [0, 1]}, frozenset({"r"})))
    key = chunk_keys(tokens, TPC)[0]
    assert adapter.complete(report(plan, rank=0)) == []
    assert adapter.index.lookup([key]).num_hits == 0  # rank 1 still copying
    assert len(adapter.complete(report(plan, rank=1))) == 1
    assert adapter.index.lookup([key]).num_hits == 1


def test_the_adapter_counts_the_bytes_of_every_job_it_completes() -> None:
    # Counted by the adapter (any engine on it, not only the vLLM connector's scheduler):
    # a job's bytes and those of the reads before its copy.
    adapter = make()
    tokens = list(range(8))
    plan = adapter.build_plan(StepInput({"r": view("r", tokens, 8, 0)}, {"r": 8}, {"r": [0, 1]}, frozenset({"r"})))
    [store] = plan.stores
    read = TierRead("disk", 1000, 0.1)
    adapter.complete(WorkerReport(0, (Completion(store.job_id, store.kind, True, 4096,
                                                 reads=(read,)),)))
    assert adapter.stats.bytes_completed == 5096


def test_a_load_is_in_flight_until_every_worker_reported_it() -> None:
    # The adapter counts loads by the kind each completion carries (it asks the index
    # nothing): a store's completion leaves the count alone, a load's ends it once merged.
    adapter = make(world_size=2)
    tokens = list(range(16))
    seed = view("s", tokens, 16, 0)
    plan = adapter.build_plan(StepInput({"s": seed}, {"s": 16}, {"s": [0, 1, 2, 3]}, frozenset({"s"})))
    for rank in (0, 1):
        adapter.complete(report(plan, rank))  # the store: 2 chunks in the CPU tier
    v = view("r", tokens + [99], 17, 0)
    assert adapter.lookup(v, 0) == 16
    adapter.update_state_after_alloc(v, [10, 11, 12, 13], 16, 0)
    assert adapter.loads_in_flight() == 1  # planned, not in a plan yet
    plan = adapter.build_plan(StepInput())
    [load] = plan.loads
    assert load.spec is not None and adapter.loads_in_flight() == 1  # in flight
    [merged] = adapter.complete(report(plan, 0)) + adapter.complete(report(plan, 1))
    assert merged.kind is JobKind.LOAD and merged.job_id == load.spec.job_id
    assert adapter.loads_in_flight() == 0 and adapter.jobs_in_flight() == 0


def test_one_store_job_per_step_and_a_shared_chunk_is_stored_once() -> None:
    adapter = make()
    shared = list(range(16))  # two chunks every request starts with
    a = view("a", shared + list(range(100, 108)), 24, 0)
    b = view("b", shared + list(range(200, 208)), 24, 0)
    c = view("c", list(range(300, 316)), 16, 0)
    blocks = {"a": [0, 1, 2, 3, 4, 5], "b": [10, 11, 12, 13, 14, 15], "c": [20, 21, 22, 23]}
    plan = adapter.build_plan(StepInput({"a": a, "b": b, "c": c}, dict.fromkeys("abc", 24), blocks,
                                        frozenset("abc")))
    [spec] = plan.stores  # every running request's chunks in one job
    copies = {chunk.key: chunk.block_ids for chunk in spec.chunks}
    keys_a, keys_b, keys_c = a.chunk_keys, b.chunk_keys, c.chunk_keys
    assert len(spec.keys) == 6 and len(copies) == 6  # 3 + 3 + 2: the two shared ones once
    assert copies[keys_a[0]] == (0, 1) and copies[keys_a[1]] == (2, 3)  # a came first
    assert copies[keys_b[2]] == (14, 15) and copies[keys_c[1]] == (22, 23)
    assert adapter.index.statistics().stores_present == 2
    adapter.complete(report(plan))
    assert adapter.jobs_in_flight() == 0
    assert adapter.lookup(view("d", shared + [1, 2, 3], 19, 0), 0) == 16


def test_finished_requests_store_in_a_job_apart_from_the_running_ones() -> None:
    adapter = make()
    tokens = list(range(17))
    a = view("a", tokens[:16], 16, 8, keys_upto=8)
    b = view("b", list(range(100, 124)), 24, 0)
    plan = adapter.build_plan(StepInput({"a": a}, {"a": 8}, {"a": [0, 1, 2, 3]}, frozenset({"a"})))
    adapter.complete(report(plan))
    adapter.request_finished(view("a", tokens, 16, 16))
    # b reuses a's block 3 this step: a's final store is flushed before the forward pass,
    # b's chunks (written by that forward pass) must not be in the flushed job.
    plan = adapter.build_plan(StepInput({"b": b}, {"b": 24}, {"b": [3, 8, 9, 10, 11, 12]}, frozenset({"b"})))
    assert len(plan.stores) == 2
    finished, running = plan.stores
    assert finished.keys == (chunk_keys(tokens, TPC)[1],) and finished.block_ids == (2, 3)
    assert plan.jobs_to_flush == (finished.job_id,)
    assert running.job_id not in plan.jobs_to_flush and len(running.keys) == 3


def test_a_request_id_reused_while_its_finished_stores_are_in_flight_is_refused() -> None:
    # The fence tells requests apart by id: a new "r" reusing a block of the finished "r"
    # would not flush the old store reading it. The adapter refuses, naming the id,
    # before it changes any state; once the old jobs are done the id is free again.
    adapter = make()
    tokens = list(range(17))
    plan = adapter.build_plan(StepInput({"r": view("r", tokens[:16], 16, 0)}, {"r": 16}, {"r": [0, 1, 2, 3]},
                                        frozenset({"r"})))
    adapter.request_finished(view("r", tokens, 16, 16))
    again = view("r", list(range(50, 58)), 8, 0)
    with pytest.raises(TierKVError, match="'r'.*unique"):
        adapter.build_plan(StepInput({"r": again}, {"r": 8}, {"r": [2, 5]}, frozenset({"r"})))
    with pytest.raises(TierKVError, match="'r'.*unique"):
        adapter.update_state_after_alloc(again, [2, 5], 0, 0)
    assert adapter.has_request("r") and adapter.jobs_in_flight() == 1  # nothing changed
    adapter.complete(report(plan))
    adapter.build_plan(StepInput())  # the finished request's last plan: nothing left to store
    assert not adapter.has_request("r")
    plan = adapter.build_plan(StepInput({"r": again}, {"r": 8}, {"r": [2, 5]}, frozenset({"r"})))
    assert [s.keys for s in plan.stores] == [tuple(again.chunk_keys)]


def test_a_request_with_no_chunk_in_the_step_job_is_not_its_owner() -> None:
    # b's chunks are all a's (stored by a this step): b owns nothing in the job, so its
    # preemption flushes nothing.
    adapter = make()
    tokens = list(range(16))
    a, b = view("a", tokens, 16, 0), view("b", tokens, 16, 0)
    plan = adapter.build_plan(StepInput({"a": a, "b": b}, {"a": 16, "b": 16},
                                        {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}, frozenset("ab")))
    [spec] = plan.stores
    assert spec.block_ids == (0, 1, 2, 3)  # a's blocks only
    plan = adapter.build_plan(StepInput(preempted=["b"]))
    assert plan.jobs_to_flush == ()
    plan = adapter.build_plan(StepInput(preempted=["a"]))
    assert plan.jobs_to_flush == (spec.job_id,)


def test_wait_for_stores_answers_not_yet_while_the_next_chunk_is_stored() -> None:
    clock = [0.0]
    adapter = EngineAdapter(BlockIndex(num_slots=64),
                            AdapterConfig(BLOCK, BPC, wait_for_stores=True, promotion_wait_seconds=1.0),
                            clock=lambda: clock[0])
    tokens = list(range(3 * TPC + 1))
    first = view("a", tokens, len(tokens), 0)
    plan = adapter.build_plan(StepInput({"a": first}, {"a": 2 * TPC}, {"a": list(range(8))}, frozenset({"a"})))
    assert stored_chunks(plan) == 2  # chunks 0 and 1 are STORING now
    turn = view("b", tokens, len(tokens), 0)
    assert adapter.lookup(turn, 0) is None  # chunk 0 is being stored: not yet
    assert adapter.stats.waits_on_stores == 1
    adapter.complete(report(plan))
    assert adapter.lookup(turn, 0) == 2 * TPC  # both landed: the hit, at once
    # A request that finished: its last chunk is stored by the next plan, so "not yet" ...
    adapter.request_finished(view("a", tokens, len(tokens), 3 * TPC))
    assert adapter.lookup(turn, 0) is None
    clock[0] = 2.0  # ... for at most promotion_wait_seconds
    assert adapter.lookup(turn, 0) == 2 * TPC
    plain = make()  # without the setting: the ready prefix, never "not yet"
    plan = plain.build_plan(StepInput({"a": first}, {"a": 2 * TPC}, {"a": list(range(8))}, frozenset({"a"})))
    assert plain.lookup(turn, 0) == 0


def test_a_planned_load_tells_its_tokens_by_tier_and_touch_refreshes_the_prefix() -> None:
    index = BlockIndex(num_slots=64, disk_capacity=8)
    adapter = EngineAdapter(index, AdapterConfig(BLOCK, BPC))
    tokens = list(range(3 * TPC + 1))
    keys = chunk_keys(tokens, TPC)
    index.add_on_disk(keys[2:3])  # chunk 2 only on disk
    plan = adapter.build_plan(StepInput({"a": view("a", tokens, len(tokens), 0)}, {"a": 2 * TPC},
                                        {"a": list(range(8))}, frozenset({"a"})))
    adapter.complete(report(plan))  # chunks 0, 1 in the CPU tier
    turn = view("b", tokens, len(tokens), 0)
    assert adapter.lookup(turn, BLOCK) == 3 * TPC - BLOCK  # local hit of one block
    adapter.update_state_after_alloc(turn, list(range(10, 20)), 3 * TPC - BLOCK, BLOCK)
    assert adapter.take_load_sources("b") == (2 * TPC - BLOCK, TPC, 0)
    assert adapter.take_load_sources("b") == (0, 0, 0)  # taken once
    assert (adapter.stats.tier["cpu"].hit_tokens, adapter.stats.tier["disk"].hit_tokens) == (2 * TPC - BLOCK, TPC)
    adapter.touch(turn, 2)  # tail first: chunk 0 ends up the most recent
    spill = index.take_spills(flush=True)  # writes back the oldest first
    assert spill is not None and [key for key, _ in spill.writes] == [keys[1], keys[0]]


def test_a_request_whose_load_failed_is_not_offered_the_chunks_again() -> None:
    adapter = make()
    tokens = list(range(24))
    seed = view("s", tokens, 24, 0)
    adapter.complete(report(adapter.build_plan(StepInput({"s": seed}, {"s": 24}, {"s": list(range(6))}, frozenset({"s"})))))
    v = view("r", tokens, 24, 0)
    assert adapter.lookup(v, 0) == 16
    adapter.update_state_after_alloc(v, [10, 11, 12, 13], 16, 0)
    load = adapter.build_plan(StepInput()).loads[0].spec
    assert load is not None
    failed = Completion(load.job_id, load.kind, ok=False, failed_keys=tuple(c.key for c in load.chunks))
    adapter.complete(WorkerReport(0, (failed,)))
    # The engine puts the request back to recompute it: the chunks are still indexed (the
    # copy failed, not the chunk), but this request is not offered them again ...
    assert adapter.lookup(v, 0) == 0
    assert adapter.lookup(view("other", tokens, 24, 0), 0) == 16  # ... another one is
    adapter.request_finished(view("r", tokens, 24, 0), aborted=True)
