"""Scripted BlockIndex scenarios; each comment states the expected result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobId, JobKind
from tierkv.core.plans import CpuState, DiskState
from tierkv.errors import InvariantError, UsageError

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def done(job_id, kind, **kw) -> Completion:  # type: ignore[no-untyped-def]
    return Completion(job_id, kind, ok=not (kw.get("failed_keys") or kw.get("full_keys")), **kw)


def test_storing_is_not_a_hit_until_complete() -> None:
    index = BlockIndex(num_slots=4)
    plan = index.prepare_store([A, B])
    assert [k for k, _ in plan.chunks] == [A, B]
    assert index.lookup([A, B]).num_hits == 0  # copies in flight: not hits yet
    index.complete_store(done(plan.job_id, JobKind.STORE))
    assert index.lookup([A, B, C]).num_hits == 2  # contiguous ready prefix
    assert index.lookup([B]).num_hits == 1
    assert index.lookup([C, A]).num_hits == 0  # a miss first stops the walk
    index.check()


def test_lookup_has_no_side_effects() -> None:
    index = BlockIndex(num_slots=1)
    index.complete_store(done(index.prepare_store([A]).job_id, JobKind.STORE))
    for _ in range(3):
        index.lookup([A])
    plan = index.prepare_store([B])  # A is evictable: lookups added no readers
    assert plan.chunks and plan.num_no_room == 0
    assert index.entry(A) is None


def test_present_keys_are_skipped_and_no_room_is_a_counted_value() -> None:
    index = BlockIndex(num_slots=2)
    first = index.prepare_store([A, B])
    again = index.prepare_store([A, B, C])
    assert again.num_present == 2  # A and B are already being stored
    assert again.num_no_room == 1  # C: both slots hold STORING chunks, nothing evictable
    assert again.job_id is None
    assert index.statistics().stores_no_room == 1
    index.complete_store(done(first.job_id, JobKind.STORE))
    index.check()


def test_eviction_spares_readers_and_the_requests_own_keys() -> None:
    index = BlockIndex(num_slots=2)
    index.complete_store(done(index.prepare_store([A, B]).job_id, JobKind.STORE))
    load = index.prepare_load([A])  # A has a reader now: LOADING(1)
    assert index.entry(A).readers == 1
    plan = index.prepare_store([C], protected=[B])  # A in use, B protected: no victim
    assert plan.num_no_room == 1
    index.complete_load(done(load.job_id, JobKind.LOAD))
    plan = index.prepare_store([C], protected=[B])  # now A is the victim
    assert plan.chunks and index.entry(A) is None
    index.check()


def test_write_back_spills_oldest_dirty_then_evicts_clean() -> None:
    clock = Clock()
    index = BlockIndex(num_slots=2, disk_capacity=10, spill_ahead_fraction=0.5, clock=clock)
    index.complete_store(done(index.prepare_store([A, B]).job_id, JobKind.STORE))
    # Both dirty, none free: the clean reserve (1 slot) asks for the oldest to spill.
    spill = index.take_spills()
    assert spill is not None and [k for k, _ in spill.writes] == [A]
    assert index.prepare_store([C]).num_no_room == 1  # A pinned while spilling, B dirty
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert index.entry(A).disk is DiskState.ON_DISK
    plan = index.prepare_store([C])  # A is clean now: evicted at once
    assert plan.chunks
    assert index.entry(A).cpu is None and index.entry(A).on_disk  # still a disk hit
    assert index.lookup([A]).num_hits == 1
    index.check()


def test_promotion_answers_not_yet_then_hits_from_cpu() -> None:
    index = BlockIndex(num_slots=2, disk_capacity=4)
    index.add_on_disk([A, B])
    assert index.lookup([A, B]).num_hits == 2  # disk hits count
    load = index.prepare_load([A])
    assert load.chunks[0][2] is True  # from disk
    assert index.lookup([A, B]) == index.lookup([A, B]).__class__(0, True, 0)  # "not yet"
    index.complete_load(done(load.job_id, JobKind.LOAD))
    assert index.entry(A).cpu is CpuState.READY and index.entry(A).on_disk
    assert index.lookup([A, B]).num_on_cpu == 1
    index.check()


def test_corrupt_chunk_is_gone_and_counted() -> None:
    index = BlockIndex(num_slots=2, disk_capacity=4)
    index.add_on_disk([A])
    load = index.prepare_load([A])
    result = index.complete_load(done(load.job_id, JobKind.LOAD, failed_keys=(A,), corrupt_keys=(A,)))
    assert result.failed_keys == (A,)
    assert index.entry(A) is None and index.lookup([A]).num_hits == 0
    assert index.statistics().corrupt == 1 and index.statistics().free_slots == 2
    index.check()


def test_disk_full_backs_off_then_resumes() -> None:
    clock = Clock()
    index = BlockIndex(num_slots=2, disk_capacity=10, write_through=True,
                       retry_after_full_seconds=1.0, clock=clock)
    index.complete_store(done(index.prepare_store([A]).job_id, JobKind.STORE))
    spill = index.take_spills()
    index.complete_spill(done(spill.job_id, JobKind.SPILL, full_keys=(A,), failed_keys=(A,)))
    assert index.entry(A).disk is None and index.statistics().disk_no_room == 1
    assert index.take_spills() is None  # backing off
    clock.now += 1.5
    spill = index.take_spills()  # space may have returned: try again
    assert spill is not None and spill.writes[0][0] == A
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert index.entry(A).on_disk
    index.check()


def test_disk_capacity_deletes_ride_in_spill_jobs() -> None:
    index = BlockIndex(num_slots=4, disk_capacity=1, write_through=True)
    index.complete_store(done(index.prepare_store([A]).job_id, JobKind.STORE))
    index.complete_spill(done(index.take_spills().job_id, JobKind.SPILL))
    index.complete_store(done(index.prepare_store([B]).job_id, JobKind.STORE))
    spill = index.take_spills()
    assert spill.deletes == (A,) and [k for k, _ in spill.writes] == [B]
    assert index.statistics().disk_evictions == 1
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    index.check()


def test_over_capacity_on_open_the_oldest_are_deleted() -> None:
    # Regression: chunks found on disk come oldest first; over the capacity, the newest
    # were deleted, so a restart lost what was stored last (a flaky full-disk test: 0 of
    # 4 new chunks after a reopen). The oldest go now, as disk_start.rebuild_keys does.
    index = BlockIndex(num_slots=1, disk_capacity=2)
    assert index.add_on_disk([A, B, C]) == 2
    spill = index.take_spills()
    assert spill is not None and spill.deletes == (A,) and not spill.writes
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert index.lookup([B, C]).num_hits == 2


def test_no_victim_asks_the_next_spill_for_room_even_with_a_clean_reserve() -> None:
    # Regression (found by the vLLM connector tests, an async-scheduling livelock): the
    # clean reserve consisted of chunks in use, so spill-ahead saw "enough clean" and
    # never spilled; every promotion failed for lack of a slot, forever.
    index = BlockIndex(num_slots=3, disk_capacity=10, spill_ahead_fraction=0.3)  # reserve: 1
    index.add_on_disk([D])
    index.complete_store(done(index.prepare_store([A, B]).job_id, JobKind.STORE))
    index.complete_spill(done(index.take_spills(at_least=1).job_id, JobKind.SPILL))  # A: the clean reserve
    busy = index.prepare_load([A])  # ... which is now in use
    index.complete_store(done(index.prepare_store([C]).job_id, JobKind.STORE))  # C: dirty, tier full
    assert index.take_spills() is None  # A counts as clean: the reserve looks full
    assert index.prepare_load([D]).job_id is None  # no victim: A has a reader, B, C dirty
    spill = index.take_spills()
    assert spill is not None and len(spill.writes) == 1  # the failed promotion asked for room
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert index.prepare_load([D]).job_id is not None  # room now
    index.complete_load(done(busy.job_id, JobKind.LOAD))
    index.check()


def test_a_disk_smaller_than_the_cpu_tier_writes_a_chunk_once_per_stay() -> None:
    # Regression (spills thrashed, 17x writes per eviction): the disk evicted the copy of a
    # chunk still in the CPU tier, which became dirty, was written again and pushed out the
    # next such copy, so every take_spills wrote the same chunks anew.
    index = BlockIndex(num_slots=4, disk_capacity=2, write_through=True)
    index.complete_store(done(index.prepare_store([A, B]).job_id, JobKind.STORE))
    index.complete_spill(done(index.take_spills().job_id, JobKind.SPILL))  # A and B on disk: it is full
    index.complete_store(done(index.prepare_store([C]).job_id, JobKind.STORE))
    spill = index.take_spills()
    assert [k for k, _ in spill.writes] == [C] and spill.deletes == (A,)  # the disk's LRU
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert index.entry(A).disk is DiskState.EVICTED  # still a CPU hit, and clean
    assert index.lookup([A]).num_hits == 1
    assert index.take_spills() is None  # A was written once in this stay: not again
    assert index.statistics().spills_ok == 3
    index.complete_store(done(index.prepare_store([D]).job_id, JobKind.STORE))  # the free slot
    assert index.prepare_store([bytes(32)], protected=[B, C]).chunks  # evicts A (D is dirty)
    assert index.entry(A) is None  # on neither tier now: forgotten
    index.check()


def test_the_spill_ahead_reserve_is_bounded_by_the_disk() -> None:
    index = BlockIndex(num_slots=8, disk_capacity=2, spill_ahead_fraction=0.5)
    keys = [bytes([i]) * 32 for i in range(8)]
    index.complete_store(done(index.prepare_store(keys).job_id, JobKind.STORE))
    spill = index.take_spills()
    assert len(spill.writes) == 1  # half the disk (1), not half the slots (4)
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert index.take_spills() is None
    index.check()


def test_a_flush_writes_evicted_chunks_into_free_disk_room_only() -> None:
    index = BlockIndex(num_slots=3, disk_capacity=2, write_through=True)
    index.add_on_disk([D])
    index.complete_store(done(index.prepare_store([A]).job_id, JobKind.STORE))
    index.complete_spill(done(index.take_spills().job_id, JobKind.SPILL))  # D, A on disk: full
    index.touch([D])  # A is the disk's LRU chunk now
    index.complete_store(done(index.prepare_store([B]).job_id, JobKind.STORE))
    index.complete_spill(done(index.take_spills().job_id, JobKind.SPILL))  # B evicts A's copy
    assert index.entry(A).disk is DiskState.EVICTED
    assert index.take_spills(flush=True) is None  # the disk is full: no room for A
    load = index.prepare_load([D])  # D is found corrupt: the disk has room again
    index.complete_load(done(load.job_id, JobKind.LOAD, failed_keys=(D,), corrupt_keys=(D,)))
    spill = index.take_spills(flush=True)
    assert [k for k, _ in spill.writes] == [A] and not spill.deletes  # into the free room
    index.complete_spill(done(spill.job_id, JobKind.SPILL, failed_keys=(A,)))
    assert index.entry(A).disk is DiskState.EVICTED  # not written: as it was, clean
    assert index.take_spills() is None  # only a flush writes it again
    index.complete_spill(done(index.take_spills(flush=True).job_id, JobKind.SPILL))
    assert index.entry(A).on_disk
    index.check()


# misuse and broken invariants --------------------------------------------------------------


def test_completing_a_job_not_in_flight_is_a_usage_error_naming_it() -> None:
    # Regression: a bare KeyError came out of the index for misuse.
    index = BlockIndex(num_slots=2)
    job = index.prepare_store([A]).job_id
    index.complete_store(done(job, JobKind.STORE))
    with pytest.raises(UsageError, match=f"no store job {job} in flight"):
        index.complete_store(done(job, JobKind.STORE))  # completed twice
    with pytest.raises(UsageError, match="no store job 999 in flight"):
        index.complete(done(JobId(999), JobKind.STORE))  # never planned
    index.check()


def test_completing_a_job_as_another_kind_changes_nothing() -> None:
    # Regression: the job record was dropped before its kind was checked, so the store
    # stayed STORING forever (its slot leaked) and its real completion failed too.
    index = BlockIndex(num_slots=2)
    job = index.prepare_store([A]).job_id
    with pytest.raises(UsageError, match=f"job {job} is a store job, not a load job"):
        index.complete_load(done(job, JobKind.LOAD))
    assert index.jobs_in_flight() == 1  # still in flight
    index.complete_store(done(job, JobKind.STORE))  # ... and completes as what it is
    assert index.lookup([A]).num_hits == 1
    index.check()


def test_runs_that_do_not_cover_the_keys_are_a_usage_error() -> None:
    # Regression: runs ending early raised IndexError deep in the loop (or, when every
    # key found a free slot, went unnoticed); now nothing is planned and the error says why.
    index = BlockIndex(num_slots=1)
    index.complete_store(done(index.prepare_store([D]).job_id, JobKind.STORE))  # full: the general loop runs
    with pytest.raises(UsageError, match="3 keys were given"):
        index.prepare_store_many([A, B, C], [1], lambda run: ())
    assert index.statistics().stores_planned == 1 and index.jobs_in_flight() == 0
    index.check()


def test_check_raises_an_invariant_error_on_a_broken_invariant() -> None:
    index = BlockIndex(num_slots=2)
    index.complete_store(done(index.prepare_store([A]).job_id, JobKind.STORE))
    index.entry(A).readers = 1  # a reader no load job accounts for
    with pytest.raises(InvariantError, match="readers"):
        index.check()


def test_statistics_keeps_state_counts_that_check_recounts() -> None:
    index = BlockIndex(num_slots=4, disk_capacity=4)
    index.add_on_disk([D])
    store = index.prepare_store([A, B])
    index.complete_store(done(index.prepare_store([C]).job_id, JobKind.STORE))
    load = index.prepare_load([C, D])  # C from the CPU tier, D promoted from disk
    stats = index.statistics()
    assert (stats.storing, stats.promoting, stats.cpu_ready, stats.free_slots) == (2, 1, 1, 0)
    index.complete_store(done(store.job_id, JobKind.STORE, failed_keys=(B,)))  # A lands, B is forgotten
    index.complete_load(done(load.job_id, JobKind.LOAD))
    stats = index.statistics()
    assert (stats.storing, stats.promoting, stats.cpu_ready, stats.free_slots) == (0, 0, 3, 1)
    index.check()
    index._num_storing += 1  # a count that drifted from the entries
    with pytest.raises(InvariantError, match="0 chunks storing, counted 1"):
        index.check()


def test_check_survives_python_dash_o() -> None:
    # Regression: check() was made of asserts, which ``python -O`` strips: a broken index
    # passed it. The child runs this checkout's tierkv.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from tierkv.core.index import BlockIndex\n"
        "from tierkv.core.jobs import Completion, JobKind\n"
        "from tierkv.errors import InvariantError\n"
        "assert False, 'asserts are on'\n"  # stripped under -O
        "index = BlockIndex(2)\n"
        "index.complete_store(Completion(index.prepare_store([b'a' * 32]).job_id, JobKind.STORE, ok=True))\n"
        "index.entry(b'a' * 32).readers = 1\n"
        "try:\n"
        "    index.check()\n"
        "except InvariantError as exc:\n"
        "    print('caught', type(exc).__name__)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-O", "-c", code, root], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "caught InvariantError"


def test_write_through_asks_for_a_step_until_its_chunks_are_spilled() -> None:
    # Regression (a real vLLM server, SIGTERM under --shutdown-timeout 0): the engine steps
    # only while the connector has work; a stored chunk waiting for its spill was not work,
    # so an idle server kept it on the CPU tier only, and lost it to the kill.
    clock = Clock()
    index = BlockIndex(num_slots=4, disk_capacity=2, write_through=True,
                       retry_after_full_seconds=1.0, clock=clock)
    store = index.prepare_store([A, B, C])
    assert not index.spills_wanted()  # storing: nothing to write yet
    index.complete_store(done(store.job_id, JobKind.STORE))
    assert index.spills_wanted()  # dirty chunks: a step should plan their spill
    spill = index.take_spills()
    assert [k for k, _ in spill.writes] == [A, B]  # the disk holds two
    assert not index.spills_wanted()  # C waits for room: no busy loop meanwhile
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert index.spills_wanted()  # a job completed: room may have come
    again = index.take_spills()  # C evicts the disk's LRU chunk
    assert again is not None and [k for k, _ in again.writes] == [C]
    index.complete_spill(done(again.job_id, JobKind.SPILL, full_keys=(C,), failed_keys=(C,)))
    assert not index.spills_wanted()  # a full disk: wait out the retry delay
    clock.now += 1.5
    assert index.spills_wanted()
    assert not BlockIndex(num_slots=2, disk_capacity=2).spills_wanted()  # write-back: never
    index.check()


def _key(number: int) -> bytes:
    return bytes([number]) * 32


def _stored_and_spilled(index: BlockIndex, keys: list[bytes]) -> None:
    index.complete_store(done(index.prepare_store(keys).job_id, JobKind.STORE))
    spill = index.take_spills(flush=True)
    assert spill is not None
    index.complete_spill(done(spill.job_id, JobKind.SPILL))


def test_a_smaller_disk_capacity_evicts_the_least_recently_used_at_once() -> None:
    """A shared disk budget moved (another store started on the same path): the disk
    capacity shrinks and the oldest chunks on disk go, their deletes in the next spill."""
    index = BlockIndex(num_slots=8, disk_capacity=8, disk_tier=True)
    keys = [_key(i) for i in range(1, 7)]
    _stored_and_spilled(index, keys)
    assert index.disk_used == 6
    assert index.set_disk_capacity(4) == 2  # the two least recently used
    assert (index.disk_capacity, index.disk_used) == (4, 4)
    assert [index.entry(key).disk for key in keys[:2]] == [DiskState.EVICTED] * 2  # type: ignore[union-attr]
    index.check()
    spill = index.take_spills(flush=True)
    assert spill is not None and set(spill.deletes) == set(keys[:2])
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    index.check()
    assert index.set_disk_capacity(10) == 0 and index.disk_capacity == 10


def test_a_capacity_of_zero_is_no_room_not_no_disk_tier() -> None:
    """Another store's share took the whole cap: the disk tier stays (chunks are dirty
    until written), spills find no room, and stores still find slots (dirty chunks are
    dropped while the disk backs off), never stuck."""
    clock = Clock()
    index = BlockIndex(num_slots=2, disk_capacity=0, disk_tier=True, clock=clock)
    assert index.has_disk
    index.complete_store(done(index.prepare_store([A, B]).job_id, JobKind.STORE))
    assert index.take_spills() is None  # no room on disk: nothing written
    plan = index.prepare_store([C])
    assert plan.job_id is not None and index.statistics().dirty_dropped == 1
    index.check()
    with pytest.raises(UsageError):
        BlockIndex(num_slots=2).set_disk_capacity(4)  # no disk tier at all
