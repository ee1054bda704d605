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

The remote tier: a "remote store" dict (key -> value) that other engines fill and the
server evicts from (or corrupts); ``note_remote`` is told runs of keys it has, sometimes
with keys it does not have (stale answers). Loads of remote-only chunks are served from
that dict (gone: ``missing_keys``; corrupt: ``corrupt_keys``, deleted there; a network
error: failed). The model mirrors the marks (``remote_mark_seconds``, ``max_remote_marks``)
and the failed keys' back-off, so every ``note_remote`` count and every lookup is checked
against it; a key's remote load never fails twice within ``remote_mark_seconds`` (no
phantom loop). Events ("stored"/"removed") are recorded and must stay balanced: exactly
the chunks that are hits or being promoted from the disk tier are "stored".
"""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.profiles import thorough
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobId, JobKind, SpillSpec
from tierkv.core.policies import POLICIES
from tierkv.core.plans import CpuState, DiskState, Lookup

KEYS = [bytes([i]) * 4 for i in range(12)]
MARK_SECONDS = 3.0  # a few of the machine's ticks (0.5 s, 2 s); "age" ticks past it
REMOTE_COUNTERS = ("loads_remote", "remote_missing", "remote_corrupt", "remote_failed")
# A queued store or load: (kind, job, the plan's chunks, the keys read from the remote tier).
Queued = tuple[str, JobId, tuple[Any, ...], frozenset[bytes]]


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
        self.transfer: deque[Queued] = deque()
        self.reader: deque[Queued] = deque()  # loads that read the disk or remote tier
        self.writer: deque[tuple[SpillSpec, frozenset[bytes]]] = deque()  # spec, rewrites
        self.written: dict[bytes, int] = {}  # writes of chunks in their stay in the CPU tier
        self.delivered = 0
        # The remote tier: the server's store, and the model of the index's part of it.
        self.remote: dict[bytes, str] = {}
        self.marks: dict[bytes, float] = {}  # key -> when noted, oldest first (as the index)
        self.gone: dict[bytes, float] = {}  # key -> when its remote load failed
        self.last_remote_failure: dict[bytes, float] = {}
        self.max_marks = 0
        self.remote_counts = dict.fromkeys(REMOTE_COUNTERS, 0)
        self.live: set[tuple[str, bytes]] = set()  # (medium, key) "stored", not "removed" since

    @rule(
        num_slots=st.integers(1, 6),
        disk_capacity=st.sampled_from([0, 2, 5, 20]),
        write_through=st.booleans(),
        spill_ahead=st.sampled_from([0.0, 0.25, 1.0]),
        policy=st.sampled_from(sorted(POLICIES)),
        max_marks=st.sampled_from([2, 5, 64]),
    )
    @precondition(lambda self: self.index is None)
    def open(self, num_slots: int, disk_capacity: int, write_through: bool, spill_ahead: float,
             policy: str, max_marks: int) -> None:
        self.max_marks = max_marks
        self.index = BlockIndex(
            num_slots,
            disk_capacity,
            write_through=write_through,
            spill_ahead_fraction=spill_ahead,
            retry_after_full_seconds=1.0,
            clock=self.clock,
            eviction_policy=policy,
            record_events=True,
            remote_mark_seconds=MARK_SECONDS,
            max_remote_marks=max_marks,
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
            self.transfer.append(("store", plan.job_id, plan.chunks, frozenset[bytes]()))

    @precondition(lambda self: self.index is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def load(self, keys: list[bytes]) -> None:
        self._load(keys)

    @precondition(lambda self: self.index is not None and bool(self.marks))
    @rule(count=st.integers(1, 4), extra=st.sampled_from(KEYS))
    def load_noted(self, count: int, extra: bytes) -> None:
        """Load a run of the newest marks (random keys seldom start with one), then a key."""
        keys = list(reversed(self.marks))[:count]
        self._load(keys + [extra] if extra not in keys else keys)

    def _load(self, keys: list[bytes]) -> None:
        assert self.index is not None
        hits = self.index.lookup(keys)
        assert hits == self._expected_lookup(keys)
        no_room = self.index.statistics().loads_no_room
        plan = self.index.prepare_load(keys[: hits.num_hits])
        # Every reported hit can be loaded unless a promotion lacks a slot (counted, once).
        assert len(plan.chunks) <= hits.num_hits
        assert [key for key, _, _ in plan.chunks] == keys[: len(plan.chunks)]
        stopped = len(plan.chunks) < hits.num_hits
        assert self.index.statistics().loads_no_room == no_room + stopped
        # The remote hits among them, and only they, are promoted from the remote tier.
        assert len(plan.from_remote) == hits.num_remote or len(plan.chunks) < hits.num_hits
        for key, _, from_disk in plan.chunks:
            if key in plan.from_remote:
                entry = self.index.entry(key)
                assert entry is not None and not from_disk
                assert (entry.cpu, entry.readers, entry.disk) == (CpuState.PROMOTING, 1, None)
                assert self._fresh(key), "a promotion from the remote tier without a mark"
                del self.marks[key]  # the index's entry now
        assert plan.from_remote <= {key for key, _, _ in plan.chunks}
        self.remote_counts["loads_remote"] += len(plan.from_remote)
        if plan.job_id is None:
            return
        if plan.from_remote or any(from_disk for _, _, from_disk in plan.chunks):
            self.reader.append(("load", plan.job_id, plan.chunks, plan.from_remote))
        else:
            self.transfer.append(("load", plan.job_id, plan.chunks, plan.from_remote))

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

    @precondition(lambda self: self.index is not None)
    @rule(past=st.sampled_from([0.0, 0.5]))
    def age(self, past: float) -> None:
        """Every mark (and failed key) ages out (0.0: exactly at the boundary, still in)."""
        self.clock.now += MARK_SECONDS + past

    # ---------------------------------------------------------------- remote tier
    @precondition(lambda self: self.index is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True),
          corrupt=st.booleans())
    def remote_put(self, keys: list[bytes], corrupt: bool) -> None:
        """Another engine stores chunks in the remote tier (``corrupt``: the first one's
        value is damaged there)."""
        for key in keys:
            self.remote[key] = value_of(key)
        if corrupt:
            self.remote[keys[0]] = "damaged-" + keys[0].hex()

    @precondition(lambda self: bool(self.remote))
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def remote_evict(self, keys: list[bytes]) -> None:
        """The server evicts chunks (marks of them are stale now)."""
        for key in keys:
            self.remote.pop(key, None)

    @precondition(lambda self: self.index is not None)
    @rule(start=st.integers(0, len(KEYS) - 1), length=st.integers(1, 6), stale=st.booleans())
    def remote_note(self, start: int, length: int, stale: bool) -> None:
        """The remote tier answers that it has a run of keys (``stale``: also keys it does
        not have, or no longer has)."""
        assert self.index is not None
        keys = KEYS[start : start + length]
        if not stale:
            keys = [key for key in keys if key in self.remote]
        now = self.clock.now
        since = now - MARK_SECONDS
        for key in [key for key, when in self.gone.items() if when < since]:
            del self.gone[key]
        expected = 0
        for key in keys:
            if self.index.contains(key) or key in self.gone:
                continue
            self.marks.pop(key, None)
            self.marks[key] = now
            expected += 1
        while self.marks and (len(self.marks) > self.max_marks
                              or next(iter(self.marks.values())) < since):
            del self.marks[next(iter(self.marks))]
        assert self.index.note_remote(keys) == expected
        for key in keys:
            if key in self.gone:  # failed lately: a phantom is never a hit twice
                assert self.index.lookup([key]).num_remote == 0

    def _fresh(self, key: bytes) -> bool:
        seen = self.marks.get(key)
        return seen is not None and seen >= self.clock.now - MARK_SECONDS

    def _expected_lookup(self, keys: list[bytes]) -> Lookup:
        assert self.index is not None
        hits = on_cpu = remote = 0
        for key in keys:
            entry = self.index.entry(key)
            if entry is None:
                if not self._fresh(key):
                    break
                remote += 1
            elif entry.cpu is CpuState.READY:
                on_cpu += 1
            elif entry.cpu is CpuState.PROMOTING:
                return Lookup(hits, True, on_cpu, remote)
            elif not (entry.cpu is None and entry.on_disk):
                break
            hits += 1
        return Lookup(hits, False, on_cpu, remote)

    # ---------------------------------------------------------------- worker
    @precondition(lambda self: bool(self.transfer))
    @rule(fail=st.booleans())
    def finish_transfer(self, fail: bool) -> None:
        self._finish(*self.transfer.popleft(), fail=fail, corrupt=False)

    @precondition(lambda self: bool(self.reader))
    @rule(fail=st.booleans(), corrupt=st.booleans(), network=st.booleans())
    def finish_read(self, fail: bool, corrupt: bool, network: bool) -> None:
        self._finish(*self.reader.popleft(), fail=fail, corrupt=corrupt, network=network)

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
            Completion(spec.job_id, spec.kind, ok=not full_keys, full_keys=tuple(full_keys),
                       failed_keys=tuple(full_keys))
        )

    def _finish(self, kind: str, job_id: JobId, chunks: tuple[Any, ...],
                from_remote: frozenset[bytes], fail: bool, corrupt: bool,
                network: bool = False) -> None:
        assert self.index is not None
        if kind == "store":
            failed = (chunks[-1][0],) if fail else ()
            for key, slot in chunks:
                if key not in failed:
                    self.slots[slot] = value_of(key)
            self.index.complete_store(Completion(job_id, JobKind.STORE, ok=not failed, failed_keys=failed))
            return
        failed_keys: list[bytes] = []
        corrupt_keys: list[bytes] = []
        missing_keys: list[bytes] = []  # as the worker reports them: failed keys too
        for key, slot, from_disk in chunks:
            if key in from_remote:
                value = self.remote.get(key)
                if value is None:  # a phantom: evicted by the server, or a stale answer
                    missing_keys.append(key)
                    continue
                if value != value_of(key):  # fails its checks: deleted there
                    del self.remote[key]
                    corrupt_keys.append(key)
                    continue
                if network:  # the read failed (timeout, breaker): no bytes
                    network = False
                    failed_keys.append(key)
                    continue
                self.slots[slot] = value
            elif from_disk:
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
            Completion(job_id, JobKind.LOAD, ok=not (failed_keys or corrupt_keys or missing_keys),
                       failed_keys=tuple(failed_keys + missing_keys),
                       corrupt_keys=tuple(corrupt_keys), missing_keys=tuple(missing_keys))
        )
        bad = set(failed_keys) | set(corrupt_keys) | set(missing_keys)
        assert set(result.failed_keys) == bad
        assert set(result.ok_keys) == {key for key, _, _ in chunks} - bad
        now = self.clock.now
        for key in from_remote:
            entry = self.index.entry(key)
            if key not in bad:
                assert entry is not None and entry.cpu is CpuState.READY
                assert entry.disk is None  # dirty with a disk tier, clean without
                continue
            assert entry is None, "a failed remote chunk stays in the index"
            counter = ("remote_corrupt" if key in corrupt_keys else
                       "remote_missing" if key in missing_keys else "remote_failed")
            self.remote_counts[counter] += 1
            last = self.last_remote_failure.get(key)
            assert last is None or now - last > MARK_SECONDS, "a remote load failed again too soon"
            self.last_remote_failure[key] = now
            self.gone.pop(key, None)
            self.gone[key] = now

    # ---------------------------------------------------------------- checks
    @invariant()
    def index_invariants(self) -> None:
        if self.index is not None:
            self.index.check()

    @invariant()
    def lookups_match_the_model(self) -> None:
        if self.index is None:
            return
        for key in KEYS:
            assert self.index.lookup([key]) == self._expected_lookup([key])
        assert self.index.lookup(KEYS) == self._expected_lookup(KEYS)
        marked = [key for key in reversed(self.marks) if self._fresh(key)]
        assert self.index.lookup(marked) == self._expected_lookup(marked)

    @invariant()
    def remote_counters_match_the_model(self) -> None:
        if self.index is None:
            return
        stats = self.index.statistics()
        assert {name: getattr(stats, name) for name in REMOTE_COUNTERS} == self.remote_counts
        fresh = sum(1 for key in self.marks if self._fresh(key) and not self.index.contains(key))
        assert fresh <= stats.remote_marks <= min(len(self.marks), self.max_marks)

    @invariant()
    def events_are_balanced(self) -> None:
        """Per tier, "stored" and "removed" alternate, and what was stored and not removed
        is what the entries say each tier holds now (CPU: READY; DISK: written)."""
        if self.index is None:
            return
        for event, medium, key in self.index.take_events():
            if medium == "REMOTE":  # what the engine learned of the remote tier: no state
                assert event == "removed" or key in self.marks, "stored remote, never noted"
                continue
            if event == "stored":
                assert (medium, key) not in self.live, "stored twice without a removal"
                self.live.add((medium, key))
            else:
                assert event == "removed" and (medium, key) in self.live, "removed, never stored"
                self.live.remove((medium, key))
        held = set()
        for key in KEYS:
            entry = self.index.entry(key)
            if entry is None:
                continue
            if entry.cpu is CpuState.READY:
                held.add(("CPU", key))
            if entry.disk is DiskState.ON_DISK:
                held.add(("DISK", key))
        assert self.live == held

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
            while self.reader:  # remote phantoms still fail: the server's state
                self._finish(*self.reader.popleft(), fail=False, corrupt=False)
            self.clock.now += 10
            self._take_spills(flush=True)
            while self.writer:
                self.finish_spill(full=False)
        self.index.check()
        assert self.index.jobs_in_flight() == 0
        self.events_are_balanced()
        self.remote_counters_match_the_model()
        self.lookups_match_the_model()
        for key in KEYS:
            entry = self.index.entry(key)
            if entry is None:
                continue
            assert entry.readers == 0
            assert entry.cpu in (None, CpuState.READY)
            stats = self.index.statistics()
            if self.index.has_disk and stats.on_disk < stats.disk_capacity:
                assert entry.on_disk, "a flushed store left a chunk only in the CPU tier"


IndexMachine.TestCase.settings = thorough(300, 50)
TestIndexMachine = IndexMachine.TestCase
