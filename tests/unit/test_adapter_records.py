"""EngineAdapter's request records: one per request, from its first lookup until its last
job is done, and nothing of a request kept anywhere else (scripted, completions by hand)."""

from __future__ import annotations

from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.requests import RequestView, StepInput, StepPlan, WorkerReport
from tierkv.keys import chunk_keys

BLOCK, BPC = 4, 2
TPC = BLOCK * BPC


def report(plans: list[StepPlan]) -> WorkerReport:
    specs = [spec for plan in plans
             for spec in (*plan.stores, *plan.spills, *(load.spec for load in plan.loads if load.spec))]
    return WorkerReport(0, tuple(Completion(spec.job_id, spec.kind, ok=True) for spec in specs))


def assert_released(adapter: EngineAdapter) -> None:
    """No record, no job and no fenced block is left, nor anything keyed by a request."""
    assert adapter.num_requests() == 0 and adapter.records == {}
    assert adapter.jobs_in_flight() == 0 and adapter.loads_in_flight() == 0
    assert not adapter.has_pending_work()
    tables = {name: value for name, value in vars(adapter).items()
              if isinstance(value, (dict, set, list))}
    assert all(not table for table in tables.values()), tables


def test_records_are_released_when_the_last_job_finishes_after_many_requests() -> None:
    clock = [0.0]
    adapter = EngineAdapter(BlockIndex(num_slots=512),
                            AdapterConfig(BLOCK, BPC, sync_load_chunks=4, wait_for_stores=True,
                                          promotion_wait_seconds=1.0),
                            clock=lambda: clock[0])
    prompt = list(range(3 * TPC + 1))  # 3 whole chunks every request shares, and one token
    in_flight: list[StepPlan] = []
    next_block = 0
    for wave in range(20):
        names = [f"w{wave}-{i}" for i in range(4)]
        views = {name: RequestView(name, chunk_keys(prompt, TPC), len(prompt), len(prompt), 0)
                 for name in names}
        for name in names:  # every request is looked up first: its record starts there
            adapter.lookup(views[name], 0)
        assert all(adapter.has_request(name) for name in names)
        blocks = {}
        for name in names[:3]:  # the last one is aborted while waiting: never allocated
            blocks[name] = list(range(next_block, next_block + 4 * BPC))
            next_block = (next_block + 4 * BPC) % 48  # blocks come back while jobs run
            hit = adapter.lookup(views[name], 0) or 0
            adapter.update_state_after_alloc(views[name], blocks[name], hit, 0)
        plan = adapter.build_plan(StepInput({n: views[n] for n in names[:3]},
                                            dict.fromkeys(names[:3], len(prompt)), blocks,
                                            frozenset(names[:3])))
        in_flight.append(plan)
        for name in names[:2]:
            done = RequestView(name, chunk_keys(prompt + [1], TPC), len(prompt), len(prompt) + 1,
                               len(prompt))
            adapter.request_finished(done)
        adapter.request_finished(views[names[3]], aborted=True)
        assert not adapter.has_request(names[3])  # nothing to store or fence: released at once
        in_flight.append(adapter.build_plan(StepInput()))  # the finished requests' last plan
        if wave % 3 == 2:  # jobs land late, a few waves at a time
            adapter.complete(report(in_flight))
            in_flight = []
        # The third request of the wave runs on and finishes later.
        adapter.request_finished(RequestView(names[2], chunk_keys(prompt + [1], TPC), len(prompt),
                                             len(prompt) + 1, len(prompt)), aborted=True)
        in_flight.append(adapter.build_plan(StepInput()))
        clock[0] += 0.1
    adapter.complete(report(in_flight))
    adapter.complete(report([adapter.take_flush_spills()]))
    assert adapter.stats.requests_freed == 80
    assert adapter.stats.flushes and adapter.stats.sync_loads and adapter.stats.waits_on_stores
    assert_released(adapter)


def test_a_request_only_looked_up_keeps_its_waits_on_its_record_and_is_released() -> None:
    clock = [0.0]
    adapter = EngineAdapter(BlockIndex(num_slots=64),
                            AdapterConfig(BLOCK, BPC, wait_for_stores=True, promotion_wait_seconds=1.0),
                            clock=lambda: clock[0])
    tokens = list(range(2 * TPC + 1))
    first = RequestView("a", chunk_keys(tokens, TPC), len(tokens), len(tokens), 0)
    plan = adapter.build_plan(StepInput({"a": first}, {"a": 2 * TPC}, {"a": list(range(6))},
                                        frozenset({"a"})))
    turn = RequestView("b", chunk_keys(tokens, TPC), len(tokens), len(tokens), 0)
    assert adapter.lookup(turn, 0) is None  # a's chunks are being stored: not yet
    assert adapter.records["b"].store_wait_since == 0.0
    adapter.request_finished(turn, aborted=True)  # it left before it was allocated
    assert not adapter.has_request("b")
    clock[0] = 0.5
    assert adapter.lookup(turn, 0) is None  # the id may come back at once: a new wait
    assert adapter.records["b"].store_wait_since == 0.5 and adapter.lookup(turn, 0) is None
    adapter.complete(report([plan]))
    assert adapter.lookup(turn, 0) == 2 * TPC and adapter.records["b"].store_wait_since is None
    adapter.request_finished(turn)
    adapter.request_finished(RequestView("a", chunk_keys(tokens, TPC), len(tokens), len(tokens),
                                         2 * TPC))
    adapter.complete(report([adapter.build_plan(StepInput())]))
    assert_released(adapter)
