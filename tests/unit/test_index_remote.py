"""The remote tier's part of BlockIndex: marks (``note_remote``), remote hits in
``lookup``, promotions from the remote tier (``prepare_load``/``complete_load``), phantoms
and their back-off, events and counters. A fake clock drives every mark's age, and
``check()`` runs after each step."""

from __future__ import annotations

import pytest

from tierkv.core.index import BlockIndex
from tierkv.core.stats import IndexStats
from tierkv.core.jobs import Completion, JobId, JobKind
from tierkv.core.plans import CpuState, DiskState, Entry, Lookup

A, B, C, D, E = (bytes([i]) * 32 for i in range(1, 6))
SECONDS = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def local(events: list[tuple[str, str, bytes]]) -> list[tuple[str, str, bytes]]:
    """The events of the index's own tiers (the remote tier's are checked on their own)."""
    return [event for event in events if event[1] != "REMOTE"]


def make(num_slots: int = 4, disk_capacity: int = 0,
         **kw: object) -> tuple[BlockIndex, Clock]:
    clock = Clock()
    kw.setdefault("remote_mark_seconds", SECONDS)
    index = BlockIndex(num_slots, disk_capacity, clock=clock, record_events=True,
                       **kw)  # type: ignore[arg-type]
    return index, clock


def entry_of(index: BlockIndex, key: bytes) -> Entry:
    entry = index.entry(key)
    assert entry is not None, "not indexed"
    return entry


def ok(job_id: JobId | None, kind: JobKind) -> Completion:
    assert job_id is not None
    return Completion(job_id, kind, ok=True)


def store(index: BlockIndex, *keys: bytes) -> None:
    plan = index.prepare_store(list(keys))
    assert [k for k, _ in plan.chunks] == list(keys)
    index.complete_store(ok(plan.job_id, JobKind.STORE))
    index.check()


def land_remote(index: BlockIndex, *keys: bytes) -> None:
    """Note ``keys`` remotely and promote them, every one landing."""
    assert index.note_remote(keys) == len(keys)
    plan = index.prepare_load(list(keys))
    assert plan.from_remote == frozenset(keys)
    index.check()
    result = index.complete_load(ok(plan.job_id, JobKind.LOAD))
    assert result.ok_keys == tuple(keys) and result.failed_keys == ()
    index.check()


def fail(job_id: JobId | None, key: bytes, how: str) -> Completion:
    """A load completion in which ``key`` did not land, the way the worker reports it
    (a missing or corrupt key is a failed key too)."""
    assert job_id is not None
    if how == "missing":
        return Completion(job_id, JobKind.LOAD, ok=False, failed_keys=(key,), missing_keys=(key,))
    if how == "corrupt":
        return Completion(job_id, JobKind.LOAD, ok=False, failed_keys=(key,), corrupt_keys=(key,))
    return Completion(job_id, JobKind.LOAD, ok=False, failed_keys=(key,), error="network")


# ---------------------------------------------------------------- marks and lookups
def test_stats_have_remote_fields_at_zero() -> None:
    index, _ = make()
    stats = index.statistics()
    assert isinstance(stats, IndexStats)
    assert (stats.remote_marks, stats.loads_remote, stats.remote_missing, stats.remote_corrupt,
            stats.remote_failed) == (0, 0, 0, 0, 0)


def test_noted_chunks_are_remote_hits() -> None:
    index, _ = make()
    assert index.lookup([A, B]) == Lookup(0, False, 0, 0)
    assert index.note_remote([A, B]) == 2
    index.check()
    assert index.lookup([A, B, C]) == Lookup(2, False, 0, 2)
    assert index.lookup([B]) == Lookup(1, False, 0, 1)
    assert index.statistics().remote_marks == 2
    # A mark is no chunk of this index: no local event, but the remote tier holds them.
    assert index.take_events() == [("stored", "REMOTE", A), ("stored", "REMOTE", B)]
    assert index.note_remote([A, B]) == 2  # marked already: known, no event
    assert index.take_events() == []
    # Lookups have no side effects: the marks are still there, nothing was planned.
    assert index.lookup([A, B]).num_remote == 2
    assert index.jobs_in_flight() == 0 and index.statistics().free_slots == 4
    index.check()


def test_lookup_walks_across_every_tier_and_stops_at_a_key_that_is_neither() -> None:
    index, _ = make(num_slots=4, disk_capacity=4)
    store(index, A)  # CPU READY
    assert index.add_on_disk([B]) == 1  # on disk only
    assert index.note_remote([C]) == 1  # remote only
    index.check()
    assert index.lookup([A, B, C, D, E]) == Lookup(3, False, 1, 1)
    assert index.lookup([C, A, B]) == Lookup(3, False, 1, 1)
    assert index.lookup([A, D, C]) == Lookup(1, False, 1, 0)  # D: neither, the walk stops
    assert index.lookup([D, C]) == Lookup(0, False, 0, 0)
    assert index.note_remote([E]) == 1
    assert index.lookup([C, E, D, A]) == Lookup(2, False, 0, 2)
    index.check()


def test_lookup_stops_at_a_chunk_being_stored_even_if_noted_before() -> None:
    index, _ = make()
    assert index.note_remote([A, B]) == 2
    plan = index.prepare_store([B])  # STORING: in the index now, not a hit
    assert plan.job_id is not None
    assert index.lookup([A, B]) == Lookup(1, False, 0, 1)
    index.complete_store(ok(plan.job_id, JobKind.STORE))
    assert index.lookup([A, B]) == Lookup(2, False, 1, 1)  # B from the CPU tier now
    index.check()


def test_a_mark_ages_out_after_mark_seconds() -> None:
    index, clock = make()
    assert index.note_remote([A, B]) == 2
    clock.now = SECONDS  # exactly as old as allowed: still a hit, and loaded
    assert index.lookup([A, B]) == Lookup(2, False, 0, 2)
    assert index.prepare_load([B]).from_remote == frozenset({B})
    index.check()
    clock.now = SECONDS + 0.01
    assert index.lookup([A]) == Lookup(0, False, 0, 0)
    plan = index.prepare_load([A])  # an aged mark is not loaded either
    assert plan.job_id is None and plan.chunks == ()
    assert index.statistics().loads_remote == 1  # B only
    index.check()
    assert index.note_remote([]) == 0  # any note drops the aged marks
    assert index.statistics().remote_marks == 0
    index.check()


def test_noting_again_refreshes_a_mark() -> None:
    index, clock = make()
    assert index.note_remote([A, B]) == 2
    clock.now = 8.0
    assert index.note_remote([A]) == 1
    clock.now = 15.0  # B (noted at 0) aged out, A (noted again at 8) did not
    assert index.lookup([A]) == Lookup(1, False, 0, 1)
    assert index.lookup([B]) == Lookup(0, False, 0, 0)
    assert index.note_remote([]) == 0
    assert index.statistics().remote_marks == 1
    index.check()


def test_at_most_max_marks_are_kept_oldest_dropped() -> None:
    index, clock = make(max_remote_marks=3)
    for key in (A, B, C):
        assert index.note_remote([key]) == 1
        clock.now += 1
    assert index.statistics().remote_marks == 3
    assert index.note_remote([D]) == 1  # A, the oldest, is dropped
    index.check()
    assert index.statistics().remote_marks == 3
    assert index.lookup([A]).num_hits == 0
    assert index.lookup([B, C, D]) == Lookup(3, False, 0, 3)
    clock.now += 1
    assert index.note_remote([B]) == 1  # B is the newest now: C is the oldest
    clock.now += 1
    assert index.note_remote([E]) == 1
    index.check()
    assert index.lookup([C]).num_hits == 0
    assert index.lookup([D, B, E]) == Lookup(3, False, 0, 3)
    assert index.statistics().remote_marks == 3


def test_a_locally_present_chunk_is_not_noted_and_is_served_locally() -> None:
    index, _ = make(num_slots=4, disk_capacity=4)
    store(index, A)
    assert index.add_on_disk([B]) == 1
    plan = index.prepare_store([C])  # STORING
    assert index.note_remote([A, B, C, D]) == 1  # only D: the others are in the index
    index.complete_store(ok(plan.job_id, JobKind.STORE))
    index.check()
    assert index.lookup([A, B, C, D]) == Lookup(4, False, 2, 1)
    load = index.prepare_load([A, B, C, D])
    assert [(k, from_disk) for k, _, from_disk in load.chunks] == [
        (A, False), (B, True), (C, False), (D, False)]
    assert load.from_remote == frozenset({D})
    stats = index.statistics()
    assert (stats.loads_cpu, stats.loads_disk, stats.loads_remote) == (2, 1, 1)
    index.check()
    index.complete_load(ok(load.job_id, JobKind.LOAD))
    index.check()


def test_a_chunk_noted_first_then_stored_locally_is_served_from_the_cpu_tier() -> None:
    index, _ = make()
    assert index.note_remote([A]) == 1
    store(index, A)
    assert index.lookup([A]) == Lookup(1, False, 1, 0)
    plan = index.prepare_load([A])
    assert plan.from_remote == frozenset()
    assert plan.chunks[0][2] is False
    entry = index.entry(A)
    assert entry is not None and entry.cpu is CpuState.READY and entry.readers == 1
    assert index.statistics().loads_remote == 0
    index.check()
    index.complete_load(ok(plan.job_id, JobKind.LOAD))
    assert index.note_remote([A]) == 0  # present: skipped
    index.check()


# ---------------------------------------------------------------- promotions
def test_prepare_load_promotes_a_remote_chunk() -> None:
    index, _ = make(num_slots=4)
    store(index, A)
    assert index.note_remote([B, C]) == 2
    plan = index.prepare_load([A, B, C, D])  # D: neither, the plan stops there
    assert plan.job_id is not None
    assert [k for k, _, _ in plan.chunks] == [A, B, C]
    assert all(from_disk is False for _, _, from_disk in plan.chunks)
    assert plan.from_remote == frozenset({B, C})
    slots = [slot for _, slot, _ in plan.chunks]
    assert len(set(slots)) == 3
    for key in (B, C):
        entry = index.entry(key)
        assert entry is not None
        assert (entry.cpu, entry.readers, entry.disk) == (CpuState.PROMOTING, 1, None)
    stats = index.statistics()
    assert (stats.promoting, stats.loads_remote, stats.loads_cpu) == (2, 2, 1)
    assert stats.remote_marks == 0  # the marks became entries
    assert stats.free_slots == 1
    assert index.lookup([B]) == Lookup(0, True, 0, 0)  # promoting: "not yet"
    assert index.lookup([A, C]) == Lookup(1, True, 1, 0)
    assert index.note_remote([B, C]) == 0  # in the index now
    index.check()


def test_no_slot_for_a_remote_chunk_stops_the_plan() -> None:
    index, _ = make(num_slots=2)
    store(index, A)
    busy = index.prepare_load([A])  # A has a reader: not evictable
    assert index.note_remote([B, C]) == 2
    plan = index.prepare_load([B, C])  # B takes the free slot; nothing left for C
    assert [k for k, _, _ in plan.chunks] == [B]
    stats = index.statistics()
    assert stats.loads_no_room == 1 and stats.loads_remote == 1
    assert index.entry(C) is None
    assert index.lookup([C]) == Lookup(1, False, 0, 1)  # C's mark stays
    index.check()
    again = index.prepare_load([C])
    assert again.job_id is None and index.statistics().loads_no_room == 2
    index.check()
    index.complete_load(ok(busy.job_id, JobKind.LOAD))
    index.complete_load(ok(plan.job_id, JobKind.LOAD))
    index.check()
    third = index.prepare_load([C])  # room now (an evictable clean chunk)
    assert third.from_remote == frozenset({C})
    index.check()


def test_a_remote_promotion_evicts_but_never_a_key_of_its_own_load() -> None:
    index, _ = make(num_slots=2, eviction_policy="lru")
    store(index, A)
    store(index, B)  # A is the least recently used
    local(index.take_events())
    assert index.note_remote([C]) == 1
    plan = index.prepare_load([C, A])  # C's slot: A is guarded, so B goes
    assert [k for k, _, _ in plan.chunks] == [C, A]
    assert index.entry(B) is None and index.entry(A) is not None
    assert local(index.take_events()) == [("removed", "CPU", B)]
    assert index.statistics().cpu_evictions == 1
    index.check()
    index.complete_load(ok(plan.job_id, JobKind.LOAD))
    assert local(index.take_events()) == [("stored", "CPU", C)]
    index.check()


# ---------------------------------------------------------------- landings
def test_a_landed_remote_chunk_with_a_disk_tier_is_dirty_and_spilled() -> None:
    index, _ = make(num_slots=2, disk_capacity=4)
    land_remote(index, A)
    entry = index.entry(A)
    assert entry is not None
    assert (entry.cpu, entry.readers, entry.disk) == (CpuState.READY, 0, None)
    assert local(index.take_events()) == [("stored", "CPU", A)]
    assert index.lookup([A]) == Lookup(1, False, 1, 0)
    assert index.shortfall([B, C]) == 1  # dirty: not evictable at once
    spec = index.take_spills(flush=True)
    assert spec is not None and [k for k, _ in spec.writes] == [A]
    assert entry_of(index, A).disk is DiskState.SPILLING
    index.check()
    index.complete_spill(ok(spec.job_id, JobKind.SPILL))
    assert entry_of(index, A).disk is DiskState.ON_DISK
    assert index.statistics().spills_ok == 1
    index.check()
    # Clean now: two new chunks evict it from the CPU tier; it stays a hit on disk.
    store(index, B, C)
    assert entry_of(index, A).cpu is None and entry_of(index, A).on_disk
    assert index.lookup([A]) == Lookup(1, False, 0, 0)
    # A left the CPU tier and stays on disk: an event for each tier.
    assert local(index.take_events()) == [("removed", "CPU", A), ("stored", "DISK", A),
                                   ("stored", "CPU", B), ("stored", "CPU", C)]
    assert index.take_spills(flush=True) is not None  # B and C, not A again
    index.check()


def test_a_landed_remote_chunk_is_spilled_by_write_through() -> None:
    index, _ = make(num_slots=2, disk_capacity=4, write_through=True)
    land_remote(index, A)
    spec = index.take_spills()
    assert spec is not None and [k for k, _ in spec.writes] == [A]
    index.check()


def test_a_landed_remote_chunk_without_a_disk_is_clean_and_evictable() -> None:
    index, _ = make(num_slots=1)
    land_remote(index, A)
    entry = index.entry(A)
    assert entry is not None and (entry.cpu, entry.disk) == (CpuState.READY, None)
    assert index.take_spills(flush=True) is None  # nowhere to write it: clean
    assert index.shortfall([B]) == 0
    assert local(index.take_events()) == [("stored", "CPU", A)]
    plan = index.prepare_store([B])  # evicts A at once
    assert [k for k, _ in plan.chunks] == [B]
    assert index.entry(A) is None
    assert index.statistics().cpu_evictions == 1
    assert local(index.take_events()) == [("removed", "CPU", A)]
    index.check()
    index.complete_store(ok(plan.job_id, JobKind.STORE))
    assert local(index.take_events()) == [("stored", "CPU", B)]
    index.check()


def test_a_promotion_lands_even_if_its_mark_would_have_aged_out() -> None:
    index, clock = make()
    assert index.note_remote([A]) == 1
    plan = index.prepare_load([A])
    clock.now = 3 * SECONDS
    index.complete_load(ok(plan.job_id, JobKind.LOAD))
    assert index.lookup([A]) == Lookup(1, False, 1, 0)
    index.check()


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize("how, counter", [("missing", "remote_missing"),
                                          ("corrupt", "remote_corrupt"),
                                          ("failed", "remote_failed")])
def test_a_failed_remote_chunk_is_forgotten_and_counted(how: str, counter: str) -> None:
    index, _ = make(num_slots=2)
    assert index.note_remote([A]) == 1
    plan = index.prepare_load([A])
    assert index.statistics().free_slots == 1
    result = index.complete_load(fail(plan.job_id, A, how))
    assert result.failed_keys == (A,) and result.ok_keys == ()
    assert index.entry(A) is None
    stats = index.statistics()
    assert stats.free_slots == 2 and stats.promoting == 0
    assert stats.loads_failed == 1 and stats.loads_remote == 1
    counts = {name: getattr(stats, name)
              for name in ("remote_missing", "remote_corrupt", "remote_failed")}
    assert counts == {name: int(name == counter) for name in counts}
    assert stats.corrupt == 0 and stats.disk_missing == 0  # the disk tier's, not these
    # Never "stored" locally: no local "removed"; a value found missing or damaged is gone
    # from the remote tier, a failed call says nothing of it.
    gone = [("removed", "REMOTE", A)] if how != "failed" else []
    assert index.take_events() == [("stored", "REMOTE", A), *gone]
    assert index.lookup([A]) == Lookup(0, False, 0, 0)  # not a hit
    index.check()


def test_a_job_that_failed_as_a_whole_counts_its_remote_chunks_as_failed() -> None:
    index, _ = make(num_slots=4)
    store(index, A)
    assert index.note_remote([B, C]) == 2
    plan = index.prepare_load([A, B, C])
    assert plan.job_id is not None
    result = index.complete_load(Completion(plan.job_id, JobKind.LOAD, ok=False, error="boom"))
    assert set(result.failed_keys) == {A, B, C}
    stats = index.statistics()
    assert stats.remote_failed == 2 and stats.loads_failed == 3
    assert index.entry(B) is None and index.entry(C) is None
    assert entry_of(index, A).cpu is CpuState.READY and entry_of(index, A).readers == 0
    assert stats.free_slots == 3
    index.check()


def test_a_phantom_is_not_noted_again_until_mark_seconds_pass() -> None:
    index, clock = make()
    assert index.note_remote([A, B]) == 2
    plan = index.prepare_load([A, B])
    clock.now = 1.0
    index.complete_load(fail(plan.job_id, A, "missing"))
    index.check()
    assert index.statistics().remote_missing == 1
    # The remote tier keeps claiming A (a stale answer): never a hit, never a load loop.
    for now in (1.0, 2.0, 6.0, 1.0 + SECONDS):
        clock.now = now
        assert index.note_remote([A]) == 0
        assert index.lookup([A, B]) == Lookup(0, False, 0, 0)
        assert index.prepare_load([A]).job_id is None
        index.check()
    stats = index.statistics()
    assert stats.remote_missing == 1 and stats.loads_remote == 2 and stats.remote_marks == 0
    # B landed; other keys are noted meanwhile.
    assert index.lookup([B]) == Lookup(1, False, 1, 0)
    assert index.note_remote([C]) == 1
    clock.now = 1.0 + SECONDS + 0.01  # mark_seconds after the failure: noted again
    assert index.note_remote([A]) == 1
    assert index.lookup([A, B]) == Lookup(2, False, 1, 1)
    again = index.prepare_load([A])
    assert again.from_remote == frozenset({A})
    index.complete_load(ok(again.job_id, JobKind.LOAD))
    assert index.lookup([A]) == Lookup(1, False, 1, 0)
    assert local(index.take_events()) == [("stored", "CPU", A), ("stored", "CPU", B)]
    index.check()


def test_mixed_job_from_every_tier_with_a_remote_phantom() -> None:
    index, _ = make(num_slots=4, disk_capacity=4)
    store(index, A)
    assert index.add_on_disk([B]) == 1
    assert index.note_remote([C, D]) == 2
    local(index.take_events())
    plan = index.prepare_load([A, B, C, D])
    assert [(k, fd) for k, _, fd in plan.chunks] == [(A, False), (B, True), (C, False),
                                                     (D, False)]
    assert plan.from_remote == frozenset({C, D})
    index.check()
    result = index.complete_load(fail(plan.job_id, C, "missing"))
    assert result.ok_keys == (A, B, D) and result.failed_keys == (C,)
    index.check()
    stats = index.statistics()
    assert (stats.remote_missing, stats.disk_missing, stats.loads_failed) == (1, 0, 1)
    assert entry_of(index, B).cpu is CpuState.READY and entry_of(index, B).on_disk
    assert index.entry(C) is None
    d = index.entry(D)
    assert d is not None and (d.cpu, d.disk) == (CpuState.READY, None)  # dirty
    # B was promoted from disk into the CPU tier too; C was never a chunk of this index.
    assert local(index.take_events()) == [("stored", "CPU", B), ("stored", "CPU", D)]
    spec = index.take_spills(flush=True)
    assert spec is not None and {k for k, _ in spec.writes} == {A, D}  # B: on disk
    index.check()


def test_a_chunk_reported_missing_never_lands_even_in_an_ok_completion() -> None:
    """Regression: failed_set ignored missing_keys, so a completion that said ok but named a
    missing chunk made it READY (a phantom holding whatever its slot held)."""

    index = BlockIndex(num_slots=2, disk_capacity=0, clock=lambda: 0.0)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    index.note_remote([a, b])
    plan = index.prepare_load([a, b])
    result = index.complete_load(Completion(plan.job_id, JobKind.LOAD, ok=True, missing_keys=(a,)))
    assert result.failed_keys == (a,) and result.ok_keys == (b,)
    assert index.entry(a) is None and index.statistics().remote_missing == 1
    index.check()


# ---------------------------------------------------------------- event batches
def test_events_come_in_batches_of_at_most_max_chunks_in_order() -> None:
    index, _ = make(num_slots=8, disk_capacity=8)
    assert index.add_on_disk([A, B, C, D, E]) == 5  # a start's snapshot
    assert index.note_remote([bytes([9]) * 32]) == 1
    assert index.events_pending()
    assert index.take_events(max_chunks=2) == [("stored", "DISK", A), ("stored", "DISK", B)]
    assert index.take_events(max_chunks=2) == [("stored", "DISK", C), ("stored", "DISK", D)]
    assert index.take_events(max_chunks=2) == [("stored", "DISK", E),
                                               ("stored", "REMOTE", bytes([9]) * 32)]
    assert not index.events_pending() and index.take_events(max_chunks=2) == []
