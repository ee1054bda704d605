"""The engine adapter under a real engine loop: real CPU transfer thread, real LMDB.

Covers the two bugs tierkv exists to prevent: the last chunk of a finished request must be
stored (and never the slot of the last sampled token), and a deferred store must never be
raced by reuse of its GPU blocks (with a negative control that shows the race is real).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.core.jobs import Completion, JobId, JobKind, SlotId, SpillSpec, StoreSpec
from tierkv.engine.requests import StepPlan
from tierkv.engine.worker import SlotResidency, WorkerAdapter
from tierkv.keys import chunk_keys

from .adapter_stack import BLOCK, BPC, build_stack, slow_stores

TPC = BLOCK * BPC  # 8 tokens per chunk


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(length)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("offset", [-2, -1, 0, 1])
@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_last_chunk_stored_at_finish_never_the_last_token(offset: int, max_tokens: int, async_scheduling: bool) -> None:
    stack = build_stack(None, async_scheduling=async_scheduling)
    length = 3 * TPC + offset
    stack.engine.add_request("r", prompt(length, 1), max_tokens)
    stack.engine.run(100)
    stack.drain()
    req = stack.engine.requests["r"]
    keys = chunk_keys(req.tokens, TPC)
    # Tokens whose KV a forward pass wrote: all but the last sampled one.
    written = max(length, len(req.tokens) - 1)
    expect_stored = written // TPC
    for position, key in enumerate(keys):
        assert stack.index.contains(key) == (position < expect_stored), (
            f"chunk {position} of {len(keys)}: stored={stack.index.contains(key)}, "
            f"{written} tokens written"
        )
    assert stack.verify_stored() == expect_stored
    assert not stack.adapter.has_request("r")  # freed once its jobs landed
    stack.close()


def test_aborted_request_stores_only_computed_tokens() -> None:
    stack = build_stack(None, token_budget=2 * TPC)
    stack.engine.add_request("r", prompt(5 * TPC, 2), 4)
    stack.engine.step()  # computes 2 chunks of the 5-chunk prompt
    stack.engine.abort("r")
    stack.engine.step()
    stack.drain()
    keys = chunk_keys(stack.engine.requests["r"].tokens, TPC)
    assert [stack.index.contains(k) for k in keys] == [True, True, False, False, False]
    assert stack.verify_stored() == 2
    stack.close()


def wait_only_submitted(worker: WorkerAdapter, plan: StepPlan, forward) -> None:  # type: ignore[no-untyped-def]
    """vLLM's old bug: wait on the flush jobs already submitted; submit the rest later."""
    worker.executor.wait([j for j in plan.jobs_to_flush if worker.executor.submitted(j)])
    worker._handled = plan  # keep start() from running the real flush
    worker.start(plan)
    forward()
    worker.after_forward()


def no_flush(worker: WorkerAdapter, plan: StepPlan, forward) -> None:  # type: ignore[no-untyped-def]
    """No fence at all: copies still in flight race the forward pass."""
    worker._handled = plan  # keep start() from running the real flush
    worker.start(plan)
    forward()
    worker.after_forward()


def run_finish_reuse(order, slow: float = 0.0):  # type: ignore[no-untyped-def]
    """Request a's last chunk gets its key only at finish (key lag), so its store is
    planned in the very step whose allocation hands a's freed blocks (LIFO) to b."""
    stack = build_stack(None, num_blocks=16, token_budget=4 * TPC, key_lag_tokens=1,
                        before_copy=slow_stores(slow) if slow else None, worker_order=order)
    stack.engine.add_request("a", prompt(4 * TPC, 3), 1)
    stack.engine.step()  # a: prefill of 4 chunks, 3 of them keyed; a finishes, blocks freed
    stack.engine.add_request("b", prompt(4 * TPC, 4), 1)
    stack.engine.run(50)
    stack.drain()
    return stack


def test_finished_store_on_reused_blocks_is_submitted_then_waited() -> None:
    stack = run_finish_reuse(None)
    a_keys = chunk_keys(stack.engine.requests["a"].tokens, TPC)
    assert all(stack.index.contains(k) for k in a_keys)  # the 4th came from the finish path
    assert stack.adapter.stats.flushes >= 1
    assert stack.verify_stored() == 8  # 4 chunks each of a and b, all byte-exact
    stack.close()


def test_negative_control_wait_without_submit_stores_overwritten_bytes() -> None:
    with pytest.raises(AssertionError, match="wrong bytes"):
        run_finish_reuse(wait_only_submitted).verify_stored()


def test_slow_copies_in_flight_are_fenced_before_reuse() -> None:
    stack = run_finish_reuse(None, slow=0.05)
    assert stack.verify_stored() == 8
    stack.close()


def test_negative_control_without_fence_slow_copies_read_reused_blocks() -> None:
    with pytest.raises(AssertionError, match="wrong bytes"):
        run_finish_reuse(no_flush, slow=0.05).verify_stored()


def test_preemption_mid_store_and_mid_load_then_resume(tmp_path: Path) -> None:
    # A tiny block pool forces preemptions while stores are slow; a shared system prompt
    # makes later requests load from the tiers (CPU and disk).
    stack = build_stack(tmp_path, num_blocks=20, num_slots=6, disk_chunks=64, token_budget=3 * TPC,
                        before_copy=slow_stores(0.01))
    system = prompt(3 * TPC, 9)
    stack.engine.add_request("r0", system + prompt(TPC, 10), 6)
    stack.engine.run(100)  # r0 stores the system prompt's chunks
    for r in range(1, 7):
        stack.engine.add_request(f"r{r}", system + prompt(TPC + 3 * r, 10 + r), 6)
        stack.engine.step()
    stack.engine.run(400)
    stack.drain()
    assert stack.engine.preemptions >= 1
    assert stack.engine.loaded_tokens > 0
    assert stack.adapter.stats.flushes >= 1  # a preemption or reuse met a job still in flight
    stack.index.check()
    stats = stack.index.statistics()
    assert stats.storing == stats.promoting == stats.spilling == 0
    assert stack.adapter.num_requests() == 0 and stack.adapter.jobs_in_flight() == 0
    assert stack.verify_stored() > 0
    stack.close()


def test_the_worker_counts_each_job_under_the_kind_its_completion_carries(tmp_path: Path) -> None:
    # The worker keeps no job id -> spec table to account a job: stores, loads and spills
    # each land on their own path, by the kind their completion carries.
    stack = build_stack(tmp_path, num_blocks=20, num_slots=6, disk_chunks=64, token_budget=3 * TPC)
    system = prompt(3 * TPC, 9)
    stack.engine.add_request("r0", system + prompt(TPC, 10), 2)
    stack.engine.run(100)
    stack.drain()  # the system prompt's chunks on disk too
    for r in range(1, 4):
        stack.engine.add_request(f"r{r}", system + prompt(TPC + r, 10 + r), 2)
    stack.engine.run(200)
    stack.drain()
    counts, index = stack.worker.statistics(), stack.index.statistics()
    assert stack.engine.loaded_tokens > 0 and index.spills_ok > 0
    assert counts["bytes_gpu_to_cpu"] == index.stores_planned * stack.slab.slot_bytes
    assert counts["bytes_cpu_to_gpu"] > 0 and counts["bytes_cpu_to_disk"] > 0
    assert not any(name.startswith("failed_jobs") for name in counts)
    stack.close()


def test_a_rank_that_writes_no_disk_reports_its_spills_done_and_counts_nothing(tmp_path: Path) -> None:
    # MLA: another rank writes the one disk copy. This rank's spills are reported done at
    # once (as spills), move no bytes, and leave its slots' residency as it was.
    stack = build_stack(tmp_path, disk_chunks=64)
    worker = WorkerAdapter(stack.worker.executor, track_slots=True, writes_disk=False)
    key = b"\x01" * 32
    store = StoreSpec(JobId(1), (key,), (SlotId(0),), (0, 1))
    worker.start(StepPlan(stores=(store,)))
    worker.after_forward()
    worker.wait_all()
    assert [(c.job_id, c.kind) for c in worker.poll().completions] == [(1, JobKind.STORE)]
    assert worker.unspilled_chunks() == [(key, 0)]
    worker.start(StepPlan(spills=(SpillSpec(JobId(2), ((key, SlotId(0)),)),)))
    [done] = worker.poll().completions
    assert done.job_id == 2 and done.kind is JobKind.SPILL and done.ok
    assert worker.unspilled_chunks() == [(key, 0)]  # nothing was written
    assert "bytes_cpu_to_disk" not in worker.statistics()
    assert worker.statistics()["bytes_gpu_to_cpu"] == stack.slab.slot_bytes
    stack.close()


def test_a_job_that_failed_as_a_whole_changes_the_slots_by_its_spec() -> None:
    # A failed completion that names no keys failed as a whole: its spec (the executor's
    # record, handed over with the completion) says which chunks did not land.
    residency, key, other = SlotResidency(), b"\x01" * 32, b"\x02" * 32
    residency.finished(Completion(JobId(1), JobKind.STORE, ok=True),
                       StoreSpec(JobId(1), (key,), (SlotId(0),), (0, 1)))
    assert residency.unspilled() == [(key, 0)]
    residency.finished(Completion(JobId(2), JobKind.STORE, ok=False),
                       StoreSpec(JobId(2), (other,), (SlotId(0),), (2, 3)))
    assert residency.unspilled() == []  # slot 0 holds nothing valid now
    residency.finished(Completion(JobId(3), JobKind.STORE, ok=True),
                       StoreSpec(JobId(3), (key,), (SlotId(1),), (0, 1)))
    residency.finished(Completion(JobId(4), JobKind.SPILL, ok=False),
                       SpillSpec(JobId(4), ((key, SlotId(1)),)))
    assert residency.unspilled() == [(key, 1)]  # the spill wrote nothing
    residency.finished(Completion(JobId(5), JobKind.SPILL, ok=True),
                       SpillSpec(JobId(5), ((key, SlotId(1)),)))
    assert residency.unspilled() == []
