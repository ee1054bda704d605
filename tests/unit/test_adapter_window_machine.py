"""The engine adapter with a sliding-window group, against a reference model (hypothesis).

A small engine with two KV cache groups (full attention, and a window that frees a block
once all its tokens are ``kept`` tokens behind the processed ones, as vLLM's
SlidingWindowManager does) hands freed blocks out again at once (LIFO, as vLLM does with
blocks that have no hash). Store jobs stay in flight for random numbers of steps; a job the
plan names in ``jobs_to_flush`` finishes before the step's forward pass, as the worker
does. The reference model is the set of blocks each job in flight reads. Checked at every
step:

- a store never reads a page the engine no longer holds (a freed block, the null block);
- a block handed out while a job in flight reads it is flushed by that very plan;
- every chunk a request computed with all its pages held is stored (or present).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.profiles import thorough
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import NO_BLOCK, Completion, JobKind
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.requests import RequestView, StepInput, WorkerReport
from tierkv.keys import chunk_keys

BLOCK = 4
BPC = 2
TPC = BLOCK * BPC
NUM_BLOCKS = 40


@dataclass
class Req:
    req_id: str
    tokens: list[int]
    computed: int = 0
    tables: list[list[int]] = field(default_factory=lambda: [[], []])  # 0 = the null block
    released: int = 0

    def view(self) -> RequestView:
        return RequestView(self.req_id, chunk_keys(self.tokens, TPC), len(self.tokens),
                           len(self.tokens), self.computed, self.released)


class WindowMachine(RuleBasedStateMachine):
    kept = 7  # a window of 8 tokens (a chunk): sliding_window - 1 tokens are kept behind

    def __init__(self) -> None:
        super().__init__()
        self.adapter = EngineAdapter(BlockIndex(num_slots=256), AdapterConfig(
            BLOCK, BPC, groups=2, frees_running_blocks=True))
        self.free = list(range(1, NUM_BLOCKS + 1))  # front = next handed out
        self.running: dict[str, Req] = {}
        self.finished: list[Req] = []  # blocks go back at the next step
        self.reads: dict[int, set[int]] = {}  # job in flight -> blocks it reads
        self.count = 0
        self.stored: set[bytes] = set()
        self.storable: set[bytes] = set()  # chunks computed with every page held

    @precondition(lambda self: len(self.running) < 4)
    @rule(length=st.integers(1, 5 * TPC), shared=st.booleans())
    def add_request(self, length: int, shared: bool) -> None:
        self.count += 1
        base = 0 if shared else self.count * 1000
        self.running[f"r{self.count}"] = Req(f"r{self.count}", [base + i for i in range(length)])

    def _give(self, count: int) -> list[int] | None:
        if len(self.free) < count:
            return None
        given, self.free = self.free[:count], self.free[count:]
        return given

    @rule(budget=st.integers(1, 3 * TPC), data=st.data())
    def step(self, budget: int, data: st.DataObject) -> None:
        for req in self.finished:  # their blocks return now (LIFO, like unhashed blocks)
            self.free = [b for table in req.tables for b in table if b] + self.free
        self.finished = []
        views: dict[str, RequestView] = {}
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, tuple[list[int], ...]] = {}
        replaced: set[str] = set()
        handed: set[int] = set()
        for req in list(self.running.values()):
            left = len(req.tokens) - req.computed
            if left <= 0 or budget <= 0:
                continue
            count = min(left, budget, data.draw(st.integers(1, 2 * TPC)))
            # vLLM's allocate_slots: free what the window left behind, then allocate.
            released = max(0, req.computed - self.kept) // BLOCK
            window = req.tables[1]
            for position in range(req.released, min(released, len(window))):
                if window[position]:
                    self.free.insert(0, window[position])
                    window[position] = 0
            req.released = max(req.released, released)
            need = -(-(req.computed + count) // BLOCK) - len(req.tables[0])
            given = self._give(2 * need) if need > 0 else []
            if given is None:
                continue  # no room this step
            first = len(req.tables[0])
            for index in range(need):
                req.tables[0].append(given[2 * index])
                req.tables[1].append(given[2 * index + 1] if first + index >= req.released else 0)
                if req.tables[1][-1] == 0:
                    self.free.insert(0, given[2 * index + 1])
            handed.update(b for b in given if b not in self.free)
            ids = tuple([NO_BLOCK if b == 0 else b for b in table[first:]] for table in req.tables)
            if not req.computed and req.req_id not in replaced and first == 0:
                replaced.add(req.req_id)
            new_blocks[req.req_id] = ids
            views[req.req_id] = req.view()
            scheduled[req.req_id] = count
            budget -= count
        plan = self.adapter.build_plan(StepInput(views, scheduled, new_blocks, frozenset(replaced)))
        flushed = set(plan.jobs_to_flush)
        new_jobs = {spec.job_id for spec in plan.stores}
        # The forward pass writes every block handed out this step: no job still reading
        # one may be in flight past this point.
        for job_id, blocks in self.reads.items():
            if job_id in new_jobs or job_id in flushed:
                continue
            assert not blocks & handed, f"job {job_id} still reads {sorted(blocks & handed)}"
        self._finish(flushed)
        for spec in plan.stores:
            held = {b for req in self.running.values() for table in req.tables for b in table if b}
            assert NO_BLOCK not in spec.block_ids
            assert set(spec.block_ids) <= held, "a store reads a page the engine gave back"
            self.reads[spec.job_id] = set(spec.block_ids)
            self.stored.update(spec.keys)
        for req_id, count in scheduled.items():
            req = self.running[req_id]
            before = req.computed
            req.computed += count
            keys = chunk_keys(req.tokens, TPC)
            for chunk in range(before // TPC, req.computed // TPC):
                if chunk * BPC >= req.released:  # every page still held when completed
                    self.storable.add(keys[chunk])
            if req.computed == len(req.tokens):
                del self.running[req_id]
                self.adapter.request_finished(req.view())
                self.finished.append(req)

    def _finish(self, job_ids: set[int]) -> None:
        done = [job_id for job_id in job_ids if job_id in self.reads]
        for job_id in done:
            del self.reads[job_id]
        if done:
            self.adapter.complete(WorkerReport(0, tuple(Completion(j, JobKind.STORE, ok=True) for j in done)))

    @rule(data=st.data())
    def complete_some(self, data: st.DataObject) -> None:
        jobs = sorted(self.reads)
        if jobs:
            self._finish(set(data.draw(st.lists(st.sampled_from(jobs), unique=True))))

    @invariant()
    def computed_chunks_with_their_pages_are_stored(self) -> None:
        index = self.adapter.index
        for key in self.storable:
            assert key in self.stored or index.contains(key)

    def teardown(self) -> None:
        self._finish(set(self.reads))


class NarrowWindowMachine(WindowMachine):
    """A window of 4 tokens, narrower than a chunk (tierkv's connector refuses that, the
    adapter must still hold): a chunk computed over two steps has lost a page."""

    kept = 3


TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = thorough(150, 40)
TestNarrowWindowMachine = NarrowWindowMachine.TestCase
TestNarrowWindowMachine.settings = thorough(150, 40)
