"""``prepare_store_many`` (one job for several requests' runs) decides exactly what one
store per run, in order, decides: the same keys get the same slots, the same chunks are
evicted, the same counts. The reference is the plain per-run algorithm (below, written
against the index's internals): find the new keys, take free slots, evict for the rest
outside the run's guard, store a prefix. Checked with hypothesis on indexes brought to the
same random state (ready, dirty, spilling, read, storing and on-disk chunks, failed
stores, a full disk that lets dirty chunks be dropped, a full tier), with every eviction
policy.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
from tierkv.core.index import BlockIndex
from tierkv.core.plans import CLEAN, DIRTY, CpuState, Entry
from tierkv.core.jobs import Completion, JobKind, SlotId
from tierkv.core.policies import POLICIES

KEYS = [bytes([i]) * 8 for i in range(16)]

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True)
# History: ("store", keys) stores and completes; ("storing", keys) leaves the store in
# flight; ("store_fails", keys) completes it with all but its first chunk failed;
# ("read", keys) leaves a load in flight (readers); ("spill", n) starts write-back and
# leaves it in flight; ("done", _) completes the oldest spill, ("full", _) fails it for a
# full disk (dirty chunks may then be dropped on eviction).
history_ops = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["store", "storing", "store_fails", "read"]), key_lists),
        st.tuples(st.sampled_from(["spill", "done", "full"]), st.integers(0, 3)),
    ),
    max_size=14,
)
# A run: a request's key list, the chunks already handled (first) and the new end.
runs_strategy = st.lists(
    key_lists.flatmap(lambda keys: st.tuples(
        st.just(keys), st.integers(0, len(keys))).flatmap(
        lambda kf: st.tuples(st.just(kf[0]), st.just(kf[1]), st.integers(kf[1], len(kf[0]))))),
    min_size=1,
    max_size=5,
)


def replay(num_slots: int, disk_capacity: int, history: list[tuple[str, object]],
           policy: str = "lru") -> BlockIndex:
    index = BlockIndex(num_slots, disk_capacity, clock=lambda: 0.0, eviction_policy=policy)
    spills = []
    for op, arg in history:
        if op in ("store", "storing", "store_fails"):
            plan = index.prepare_store(arg)  # type: ignore[arg-type]
            if plan.job_id is not None and op == "store":
                index.complete_store(Completion(plan.job_id, JobKind.STORE, ok=True))
            elif plan.job_id is not None and op == "store_fails":
                failed = tuple(key for key, _ in plan.chunks[1:])
                index.complete_store(Completion(plan.job_id, JobKind.STORE, ok=not failed, failed_keys=failed))
        elif op == "read":
            keys = arg[: index.lookup(arg).num_hits]  # type: ignore[index]
            index.prepare_load(keys)
        elif op == "spill":
            spec = index.take_spills(at_least=arg)  # type: ignore[arg-type]
            if spec is not None:
                spills.append(spec)
        elif spills:
            spec = spills.pop(0)
            full = tuple(key for key, _ in spec.writes) if op == "full" else ()
            index.complete_spill(Completion(spec.job_id, JobKind.SPILL, ok=not full, failed_keys=full, full_keys=full))
    return index


def reference_store(index: BlockIndex, keys: list[bytes], protected: list[bytes]) -> list[tuple[bytes, SlotId]]:
    """One run, the plain way (what prepare_store did before batches existed)."""
    entries = index._entries
    new = [key for key in keys if key not in entries]
    slots = index._slots.allocate_many(len(new))
    guard = set(protected) | set(keys)
    while len(slots) < len(new):
        slot = index._evict_for(guard)
        if slot is None:
            break
        slots.append(slot)
    index._counters.stores_present += len(keys) - len(new)
    index._counters.stores_no_room += len(new) - len(slots)
    index._counters.stores_planned += len(slots)
    index._num_storing += len(slots)
    for key, slot in zip(new, slots):
        entries[key] = Entry(key, slot, CpuState.STORING)
    return list(zip(new, slots))


def snapshot(index: BlockIndex) -> object:
    """Everything a decision can change, internals included: entries, counters, the free
    slots in the order they will be handed out, the victim orders (clean, dirty, disk), the
    policy's own state (ARC: its lists, ghosts and target), the write-back demand."""
    return (
        {key: (e.slot, e.cpu, e.readers, e.disk) for key, e in index._entries.items()},
        index.statistics(),
        list(index._slots._free),
        [list(index._cpu.victims(CLEAN)), list(index._cpu.victims(DIRTY)),
         list(index._disk._order.victims(0))],
        {name: value for name, value in vars(index._cpu).items() if name != "_at"},
        index._disk._room_wanted,
    )


@pytest.mark.parametrize("policy", sorted(POLICIES))
@thorough(500)
@given(num_slots=st.integers(1, 8), disk_capacity=st.sampled_from([0, 3, 20]),
       history=history_ops, runs=runs_strategy)
def test_a_batch_decides_as_one_store_per_run(policy: str, num_slots: int, disk_capacity: int,
                                              history: list[tuple[str, object]],
                                              runs: list[tuple[list[bytes], int, int]]) -> None:
    batched = replay(num_slots, disk_capacity, history, policy)
    reference = replay(num_slots, disk_capacity, history, policy)
    assert snapshot(batched) == snapshot(reference)
    before = reference.statistics()

    flat: list[bytes] = []
    ends: list[int] = []
    for keys, first, end in runs:
        flat += keys[first:end]
        ends.append(len(flat))
    batch = batched.prepare_store_many(flat, ends, lambda run: runs[run][0][: runs[run][2]])

    stored: list[tuple[bytes, SlotId]] = []
    for keys, first, end in runs:
        stored += reference_store(reference, keys[first:end], keys[:first])
    after = reference.statistics()

    assert list(zip(batch.keys, batch.slots)) == stored
    assert batch.num_present == after.stores_present - before.stores_present
    assert batch.num_no_room == after.stores_no_room - before.stores_no_room
    assert len(batch.keys) + batch.num_present + batch.num_no_room == len(flat)
    if batch.placed is not None:
        assert [flat[i] for i in batch.placed] == list(batch.keys)
    assert (batch.job_id is None) == (not stored)
    assert snapshot(batched) == snapshot(reference)
    batched.check()


def test_a_key_twice_in_one_batch_is_stored_once() -> None:
    index = BlockIndex(num_slots=4)
    a, b = KEYS[0], KEYS[1]
    batch = index.prepare_store_many([a, b, a], [2, 3], lambda run: ())
    assert batch.keys == (a, b) and batch.placed == [0, 1] and batch.num_present == 1
    assert index.statistics().free_slots == 2
    index.complete_store(Completion(batch.job_id, JobKind.STORE, ok=True))
    index.check()
