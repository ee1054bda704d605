"""BlockIndex against a dict reference model, driven by a hypothesis state machine.

A simulated worker gives the index's plans real effects on model "bytes": every key has
a unique value; GPU stores write it into a slot, spills copy slots to a disk dict, loads
read slots (after reading the disk for promotions). Jobs finish in FIFO order per queue
(transfer, disk reader, disk writer), queues interleaved at random, with injected
failures: a full disk, a corrupt chunk, a failed copy. Every load must deliver the value
of its own key; after a drain nothing is left in flight and no slot or reader leaks; a
chunk is written at most once per stay in the CPU tier (a flush may write a chunk whose
disk copy was evicted again, into free room). The index runs with each eviction policy
(drawn when it opens), touches included.
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobId, SpillSpec
from tierkv.core.policy import policy_names
from tierkv.core.state import CpuState, DiskState

KEYS = [bytes([i]) * 4 for i in range(12)]


def value_of(key: bytes) -> str:
    return "v-" + key.hex()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.index: BlockIndex | None = None
        self.slots: dict[int, str] = {}
        self.disk: dict[bytes, str] = {}
        self.transfer: deque[tuple[str, JobId, tuple]] = deque()
        self.reader: deque[tuple[str, JobId, tuple]] = deque()
        self.writer: deque[tuple[SpillSpec, frozenset[bytes]]] = deque()  # spec, rewrites
        self.written: dict[bytes, int] = {}  # writes of chunks in their stay in the CPU tier
        self.delivered = 0

    @rule(
        num_slots=st.integers(1, 6),
        disk_capacity=st.sampled_from([0, 2, 5, 20]),
        write_through=st.booleans(),
        spill_ahead=st.sampled_from([0.0, 0.25, 1.0]),
        policy=st.sampled_from(policy_names()),
    )
    @precondition(lambda self: self.index is None)
    def open(self, num_slots: int, disk_capacity: int, write_through: bool, spill_ahead: float,
             policy: str) -> None:
        self.index = BlockIndex(
            num_slots,
            disk_capacity,
            write_through=write_through,
            spill_ahead_fraction=spill_ahead,
            retry_after_full_seconds=1.0,
            clock=self.clock,
            eviction_policy=policy,
        )

    # ---------------------------------------------------------------- plans
    @precondition(lambda self: self.index is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
          protected=st.lists(st.sampled_from(KEYS), max_size=2))
    def store(self, keys: list[bytes], protected: list[bytes]) -> None:
        assert self.index is not None
        plan = self.index.prepare_store(keys, protected)
        assert plan.num_present + len(plan.chunks) + plan.num_no_room == len(keys)
        if plan.job_id is not None:
            self.transfer.append(("store", plan.job_id, plan.chunks))

    @precondition(lambda self: self.index is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def load(self, keys: list[bytes]) -> None:
        assert self.index is not None
        hits = self.index.lookup(keys)
        plan = self.index.prepare_load(keys[: hits.num_hits])
        # Every reported hit can be loaded unless a promotion lacks a slot.
        assert len(plan.chunks) <= hits.num_hits
        if plan.job_id is None:
            return
        if any(from_disk for _, _, from_disk in plan.chunks):
            self.reader.append(("load", plan.job_id, plan.chunks))
        else:
            self.transfer.append(("load", plan.job_id, plan.chunks))

    @precondition(lambda self: self.index is not None)
    @rule(flush=st.booleans())
    def spill(self, flush: bool) -> None:
        assert self.index is not None
        self._take_spills(flush)

    def _take_spills(self, flush: bool) -> None:
        assert self.index is not None
        evicted = {key for key in KEYS if (entry := self.index.entry(key)) is not None
                   and entry.disk is DiskState.EVICTED}
        spec = self.index.take_spills(flush=flush)
        if spec is not None:
            assert len(set(spec.deletes)) == len(spec.deletes)
            rewrites = frozenset(key for key, _ in spec.writes if key in evicted)
            assert flush or not rewrites, "a spill that is no flush wrote an EVICTED chunk"
            self.writer.append((spec, rewrites))

    @precondition(lambda self: self.index is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4), reuse=st.booleans())
    def touch(self, keys: list[bytes], reuse: bool) -> None:
        assert self.index is not None
        before = self.index.statistics()
        self.index.touch(keys, reuse=reuse)
        assert self.index.statistics() == before  # order only: no state or counter moves

    @precondition(lambda self: self.index is not None)
    @rule(seconds=st.sampled_from([0.5, 2.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    # ---------------------------------------------------------------- worker
    @precondition(lambda self: bool(self.transfer))
    @rule(fail=st.booleans())
    def finish_transfer(self, fail: bool) -> None:
        kind, job_id, chunks = self.transfer.popleft()
        self._finish(kind, job_id, chunks, fail, corrupt=False)

    @precondition(lambda self: bool(self.reader))
    @rule(fail=st.booleans(), corrupt=st.booleans())
    def finish_read(self, fail: bool, corrupt: bool) -> None:
        kind, job_id, chunks = self.reader.popleft()
        self._finish(kind, job_id, chunks, fail, corrupt)

    @precondition(lambda self: bool(self.writer))
    @rule(full=st.booleans())
    def finish_spill(self, full: bool) -> None:
        assert self.index is not None
        spec, rewrites = self.writer.popleft()
        for key in spec.deletes:
            self.disk.pop(key, None)
        full_keys = []
        for position, (key, slot) in enumerate(spec.writes):
            if full and position == len(spec.writes) - 1:
                full_keys.append(key)
                continue
            assert self.slots[slot] == value_of(key), "spill of a slot that holds another key"
            self.disk[key] = self.slots[slot]
            if key not in rewrites:
                self.written[key] = self.written.get(key, 0) + 1
                assert self.written[key] == 1, "a chunk written twice in one stay in the CPU tier"
        self.index.complete_spill(
            Completion(spec.job_id, ok=not full_keys, full_keys=tuple(full_keys),
                       failed_keys=tuple(full_keys))
        )

    def _finish(self, kind: str, job_id: JobId, chunks: tuple, fail: bool, corrupt: bool) -> None:
        assert self.index is not None
        if kind == "store":
            failed = (chunks[-1][0],) if fail else ()
            for key, slot in chunks:
                if key not in failed:
                    self.slots[slot] = value_of(key)
            self.index.complete_store(Completion(job_id, ok=not failed, failed_keys=failed))
            return
        failed_keys: list[bytes] = []
        corrupt_keys: list[bytes] = []
        for key, slot, from_disk in chunks:
            if from_disk:
                if corrupt and not corrupt_keys:
                    del self.disk[key]  # the worker deletes what fails its checksum
                    corrupt_keys.append(key)
                    continue
                self.slots[slot] = self.disk[key]
            if fail and not failed_keys:
                failed_keys.append(key)
                continue
            assert self.slots[slot] == value_of(key), "a load delivered another key's bytes"
            self.delivered += 1
        result = self.index.complete_load(
            Completion(job_id, ok=not (failed_keys or corrupt_keys),
                       failed_keys=tuple(failed_keys), corrupt_keys=tuple(corrupt_keys))
        )
        assert set(result.failed_keys) == set(failed_keys) | set(corrupt_keys)

    # ---------------------------------------------------------------- checks
    @invariant()
    def index_invariants(self) -> None:
        if self.index is not None:
            self.index.check()

    @invariant()
    def stays_end_when_chunks_leave_the_cpu_tier(self) -> None:
        # A stay cannot end and start again within one step: an eviction spares the keys
        # being stored or loaded.
        if self.index is not None:
            for key in list(self.written):
                entry = self.index.entry(key)
                if entry is None or entry.cpu is None:
                    del self.written[key]

    @invariant()
    def on_disk_means_on_model_disk(self) -> None:
        if self.index is None:
            return
        pending_deletes = {k for spec, _ in self.writer for k in spec.deletes}
        for key in KEYS:
            entry = self.index.entry(key)
            if entry is not None and entry.on_disk and key not in pending_deletes:
                assert self.disk.get(key) == value_of(key)

    def teardown(self) -> None:
        if self.index is None:
            return
        # Drain: finish everything without failures, then flush dirty chunks to disk.
        for _ in range(3):
            while self.transfer:
                self._finish(*self.transfer.popleft(), fail=False, corrupt=False)
            while self.reader:
                self._finish(*self.reader.popleft(), fail=False, corrupt=False)
            self.clock.now += 10
            self._take_spills(flush=True)
            while self.writer:
                self.finish_spill(full=False)
        self.index.check()
        assert self.index.jobs_in_flight() == 0
        for key in KEYS:
            entry = self.index.entry(key)
            if entry is None:
                continue
            assert entry.readers == 0
            assert entry.cpu in (None, CpuState.READY)
            stats = self.index.statistics()
            if self.index.has_disk and stats.on_disk < stats.disk_capacity:
                assert entry.on_disk, "a flushed store left a chunk only in the CPU tier"


IndexMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
