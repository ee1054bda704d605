"""Scripted BlockIndex scenarios with each eviction policy; each comment states the result.

The index's own rules win over any policy: victims are READY chunks with no readers outside
the request's keys, clean before dirty; within those, the policy decides the order, and
write-back spills dirty chunks in the same order.
"""

from __future__ import annotations

import pytest

from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobKind
from tierkv.core.plans import CLEAN, DIRTY
from tierkv.config import CpuTierConfig
from tierkv.core.policies import POLICIES, make_policy
from tierkv.core.policies.arc import T1, T2, ARCPolicy
from tierkv.core.policies.lru import LRUPolicy
from tierkv.errors import ConfigError, UsageError

A, B, C, D, E, F, G = (bytes([i]) * 32 for i in range(1, 8))


def done(job_id, kind, **kw) -> Completion:  # type: ignore[no-untyped-def]
    return Completion(job_id, kind, ok=not (kw.get("failed_keys") or kw.get("full_keys")), **kw)


def stored(index: BlockIndex, *keys: bytes) -> None:
    for key in keys:
        index.complete_store(done(index.prepare_store([key]).job_id, JobKind.STORE))


def loaded(index: BlockIndex, *keys: bytes) -> None:
    index.complete_load(done(index.prepare_load(list(keys)).job_id, JobKind.LOAD))


def arc(index: BlockIndex) -> ARCPolicy:
    assert isinstance(index._cpu, ARCPolicy)
    return index._cpu


@pytest.mark.parametrize(("policy", "survives"), [("lru", False), ("arc", True)])
def test_a_scan_of_one_off_chunks_and_a_reused_chunk(policy: str, survives: bool) -> None:
    index = BlockIndex(num_slots=3, eviction_policy=policy)
    stored(index, A)
    loaded(index, A)  # A is reused once
    stored(index, B, C)  # the tier is full: A, B, C
    stored(index, D, E, F, G)  # a scan: four chunks nobody asks for again
    # LRU: A was the oldest when the scan began, so the first scan chunk evicted it.
    # ARC: A is in T2 (reused); B, C and the scan chunks pass through T1 and go first.
    assert (index.lookup([A]).num_hits == 1) is survives
    assert index.lookup([F]).num_hits == 1 and index.lookup([G]).num_hits == 1
    assert index.statistics().cpu_evictions == 4
    index.check()


def test_arc_a_chunk_back_after_its_eviction_is_a_ghost_hit() -> None:
    index = BlockIndex(num_slots=3, eviction_policy="arc")
    stored(index, A, B)
    loaded(index, B)  # B: T2
    stored(index, C)  # full: T1 = A, C; T2 = B
    stored(index, D)  # evicts A (T1 holds more than its target 0): A's ghost in B1
    assert arc(index).ghosts() == ((A,), ())
    stored(index, A)  # A comes back: evicts C (T1 again, ghost in B1); A lands in T2
    assert arc(index).list_of(A) == T2
    assert arc(index).target == 1.0  # a B1 ghost hit: T1 may now keep one chunk
    assert arc(index).ghosts() == ((C,), ())
    stored(index, E)  # T1 (D) is not above the target (1): T2's oldest, B, goes
    assert index.entry(B) is None and index.lookup([D]).num_hits == 1
    assert arc(index).ghosts() == ((C,), (B,))
    index.check()


def test_arc_clean_before_dirty_wins_over_the_policys_preference() -> None:
    index = BlockIndex(num_slots=2, disk_capacity=10, spill_ahead_fraction=0.0,
                       eviction_policy="arc")
    stored(index, A)
    loaded(index, A)  # A: T2
    index.complete_spill(done(index.take_spills(at_least=1).job_id, JobKind.SPILL))  # A: clean, T2
    stored(index, B)  # B: dirty, T1 (the list ARC evicts from first)
    stored(index, C)  # needs a slot: the clean chunk goes, not ARC's favourite victim
    assert index.entry(A).cpu is None and index.entry(A).on_disk  # still a disk hit
    assert index.lookup([B]).num_on_cpu == 1
    index.check()


@pytest.mark.parametrize(("policy", "spilled"), [("lru", A), ("arc", B)])
def test_write_back_spills_the_policys_next_victim(policy: str, spilled: bytes) -> None:
    index = BlockIndex(num_slots=4, disk_capacity=10, spill_ahead_fraction=0.0,
                       eviction_policy=policy)
    stored(index, A)
    loaded(index, A)
    stored(index, B)
    spill = index.take_spills(at_least=1)
    # LRU: A is the least recently used dirty chunk. ARC: B (T1, never reused) goes
    # before A (T2), so B is made clean first.
    assert spill is not None and [key for key, _ in spill.writes] == [spilled]
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    index.check()


def test_arc_a_spilled_chunk_keeps_its_reuse() -> None:
    index = BlockIndex(num_slots=2, disk_capacity=10, eviction_policy="arc")
    stored(index, A)
    spill = index.take_spills(flush=True)  # A no victim while its spill is in flight
    loaded(index, A)  # reused meanwhile: T2, though written
    assert arc(index).list_of(A) == T2
    assert A not in [*arc(index).victims(CLEAN), *arc(index).victims(DIRTY)]
    index.complete_spill(done(spill.job_id, JobKind.SPILL))
    assert arc(index).list_of(A) == T2  # clean now, still protected from scans
    index.check()


def test_arc_a_refresh_is_not_a_reuse() -> None:
    index = BlockIndex(num_slots=2, eviction_policy="arc")
    stored(index, A, B)
    index.touch([A], reuse=False)  # A's own request finished: most recent of T1
    index.touch([B])  # a reuse (e.g. a hit in the engine's own cache): B to T2
    assert (arc(index).list_of(A), arc(index).list_of(B)) == (T1, T2)
    stored(index, C)  # T1 goes first: A, although it was used after B was stored
    assert index.entry(A) is None and index.lookup([B]).num_hits == 1
    index.check()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_readers_and_the_requests_own_keys_are_never_victims(policy: str) -> None:
    index = BlockIndex(num_slots=2, eviction_policy=policy)
    stored(index, A, B)
    load = index.prepare_load([A])  # A has a reader
    assert index.prepare_store([C], protected=[B]).num_no_room == 1  # A read, B protected
    index.complete_load(done(load.job_id, JobKind.LOAD))
    assert index.prepare_store([C], protected=[B]).chunks  # now A goes
    assert index.entry(A) is None
    index.check()


def test_arc_ghosts_stay_within_the_tiers_capacity() -> None:
    index = BlockIndex(num_slots=4, eviction_policy="arc")
    keys = [bytes([i, j]) * 16 for i in range(10) for j in range(10)]
    for key in keys:  # 100 chunks through 4 slots, each reused once (T2): 96 evictions
        stored(index, key)
        loaded(index, key)
    # Ghosts: at the last eviction 3 chunks were resident and |T1| + |T2| + |B1| + |B2|
    # <= 2 x 4, so the 5 latest evicted stay, in B2.
    assert arc(index).ghosts() == ((), tuple(keys[-9:-4]))
    scan = [key[:31] + b"\xff" for key in keys]
    for key in scan:  # then a scan: 100 chunks nobody reuses
        stored(index, key)
    # The first scan chunk took T2's oldest slot (T1 was empty); from then on T1 (one slot)
    # cycles through the scan and the three reused chunks left in T2 stay.
    assert all(index.lookup([key]).num_hits == 1 for key in keys[-3:])
    # Ghosts, as trimmed at the last eviction (T1 empty for a moment, T2 three chunks):
    # B1 keeps 4 - 0 = 4 scan chunks, B2 what is left of 2 x 4: the reused chunk the scan
    # evicted. Never more than 2 x 4 ghosts, whatever went through.
    assert arc(index).ghosts() == (tuple(scan[-5:-1]), (keys[-4],))
    index.check()


def test_an_unknown_policy_names_the_choices() -> None:
    # A program's call made wrongly is a UsageError; the setting's bad value a ConfigError.
    with pytest.raises(UsageError, match=r"'mru' is not one of \['arc', 'lru'\]"):
        BlockIndex(num_slots=2, eviction_policy="mru")
    with pytest.raises(ConfigError, match="eviction_policy"):
        CpuTierConfig(eviction_policy="mru")
    assert isinstance(make_policy("lru", 4), LRUPolicy)
