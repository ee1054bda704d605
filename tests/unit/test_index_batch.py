"""``prepare_store_many`` (one job for several requests' runs) decides exactly what one
store per run, in order, decides: the same keys get the same slots, the same chunks are
evicted, the same counts. The reference is the plain per-run algorithm (below, written
against the index's internals): find the new keys, take free slots, evict for the rest
outside the run's guard, store a prefix. Checked with hypothesis on indexes brought to the
same random state (ready, dirty, spilling, read and on-disk chunks, a full tier).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, SlotId
from tierkv.core.state import CpuState, Entry

KEYS = [bytes([i]) * 8 for i in range(16)]

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True)
# History: ("store", keys) stores and completes; ("read", keys) leaves a load in flight
# (readers); ("spill", n) starts write-back and leaves it in flight; ("done", n) completes
# the oldest spill.
history_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), key_lists),
        st.tuples(st.just("read"), key_lists),
        st.tuples(st.just("spill"), st.integers(0, 3)),
        st.tuples(st.just("done"), st.integers(0, 3)),
    ),
    max_size=12,
)
# A run: a request's key list, the chunks already handled (first) and the new end.
runs_strategy = st.lists(
    key_lists.flatmap(lambda keys: st.tuples(
        st.just(keys), st.integers(0, len(keys))).flatmap(
        lambda kf: st.tuples(st.just(kf[0]), st.just(kf[1]), st.integers(kf[1], len(kf[0]))))),
    min_size=1,
    max_size=5,
)


def replay(num_slots: int, disk_capacity: int, history: list[tuple[str, object]]) -> BlockIndex:
    index = BlockIndex(num_slots, disk_capacity, clock=lambda: 0.0)
    spills = []
    for op, arg in history:
        if op == "store":
            plan = index.prepare_store(arg)  # type: ignore[arg-type]
            if plan.job_id is not None:
                index.complete_store(Completion(plan.job_id, ok=True))
        elif op == "read":
            keys = arg[: index.lookup(arg).num_hits]  # type: ignore[index]
            index.prepare_load(keys)
        elif op == "spill":
            spec = index.take_spills(at_least=arg)  # type: ignore[arg-type]
            if spec is not None:
                spills.append(spec)
        elif spills:
            index.complete_spill(Completion(spills.pop(0).job_id, ok=True))
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
    for key, slot in zip(new, slots):
        entries[key] = Entry(key, slot, CpuState.STORING)
    return list(zip(new, slots))


def snapshot(index: BlockIndex) -> object:
    entries = {key: (e.slot, e.cpu, e.readers, e.disk) for key in KEYS if (e := index.entry(key))}
    spill = index.take_spills()  # how much write-back the decisions asked for
    return entries, index.statistics(), spill.writes if spill is not None else None


@settings(max_examples=500, deadline=None)
@given(num_slots=st.integers(1, 8), disk_capacity=st.sampled_from([0, 3, 20]),
       history=history_ops, runs=runs_strategy)
def test_a_batch_decides_as_one_store_per_run(num_slots: int, disk_capacity: int,
                                              history: list[tuple[str, object]],
                                              runs: list[tuple[list[bytes], int, int]]) -> None:
    batched = replay(num_slots, disk_capacity, history)
    reference = replay(num_slots, disk_capacity, history)
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
