"""TierKVStore against a dict reference model (hypothesis state machine).

KV tensors -> CPU slots -> disk -> CPU -> KV tensors in random orders, with a CPU tier of a
few chunks and a small disk cap so that evictions, spills, promotions and disk deletes
all happen; restarts reopen the same directory. Every chunk that lands must equal the
bytes stored under its key; every hit must be a key that was stored; the index invariants
hold after each step; after a drain no slot, reader or job is left. Each run draws the CPU
tier's eviction policy (cpu.eviction_policy) and keeps it across restarts.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.profiles import thorough
from tierkv.core.policies import POLICIES
from tierkv.engine.store import TierKVStore

from .test_store import BPC, INDEX_FILES, NUM_BLOCKS, PAGE_SHAPE, keys_for, make_kv, open_store

KEYS = keys_for(7, 10)  # a chain; rules use single chunks and short runs of it


def content(key_index: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + key_index)
    return [torch.randn((BPC, *PAGE_SHAPE), generator=gen).to(torch.float16) for _ in range(3)]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierkv-store-machine-"))
        self.kv = make_kv()
        self.store: TierKVStore | None = None
        self.cpu_chunks = 3
        self.disk_chunks = 6
        self.policy = "lru"
        self.stored: set[int] = set()  # key indexes whose store was submitted
        self.pending: list[tuple[object, list[int], list[int]]] = []  # (handle, key idx, blocks)
        self.store_jobs: list[tuple[object, set[int]]] = []  # stores in flight and their blocks

    def _open(self) -> None:
        self.store = open_store(self.dir, self.kv, cpu_chunks=self.cpu_chunks, disk_chunks=self.disk_chunks,
                                eviction_policy=self.policy, files_bytes=INDEX_FILES)
        assert self.store.index.eviction_policy == self.policy

    @precondition(lambda self: self.store is None)
    @rule(cpu=st.sampled_from([2, 3, 5]), disk=st.sampled_from([3, 6, 20]),
          policy=st.sampled_from(sorted(POLICIES)))
    def open(self, cpu: int, disk: int, policy: str) -> None:
        self.cpu_chunks, self.disk_chunks, self.policy = cpu, disk, policy
        self._open()

    @precondition(lambda self: self.store is not None)
    @rule(first=st.integers(0, 9), length=st.integers(1, 3), base=st.integers(0, NUM_BLOCKS // BPC - 3))
    def store_chunks(self, first: int, length: int, base: int) -> None:
        assert self.store is not None
        idx = list(range(first, min(first + length, len(KEYS))))
        blocks = list(range(base * BPC, (base + len(idx)) * BPC))
        self._quiesce(set(blocks))  # a pending copy may still use these blocks
        for position, key_index in enumerate(idx):
            for layer, chunk in zip(self.kv, content(key_index)):
                layer[blocks[position * BPC : (position + 1) * BPC]] = chunk
        self.store_jobs.append((self.store.store([KEYS[i] for i in idx], blocks), set(blocks)))
        self.stored.update(idx)

    @precondition(lambda self: self.store is not None and bool(self.stored))
    @rule(data=st.data(), length=st.integers(1, 4), base=st.integers(0, NUM_BLOCKS // BPC - 4),
          wait_now=st.booleans())
    def load_chunks(self, data: st.DataObject, length: int, base: int, wait_now: bool) -> None:
        assert self.store is not None
        first = data.draw(st.sampled_from(sorted(self.stored)))  # mostly hits
        idx = list(range(first, min(first + length, len(KEYS))))
        hits = self.store.lookup([KEYS[i] for i in idx])
        assert set(idx[:hits]) <= self.stored, "a hit for a key never stored"
        blocks = list(range(base * BPC, (base + len(idx)) * BPC))
        self._quiesce(set(blocks))
        for layer in self.kv:
            layer[blocks] = 0
        handle = self.store.load([KEYS[i] for i in idx], blocks)
        self.pending.append((handle, idx[: handle.num_chunks], blocks))
        if wait_now:
            self._finish_loads()

    def _quiesce(self, blocks: set[int] | None = None) -> None:
        """Like an engine's fence: blocks are rewritten only once no copy uses them.
        Copies on other blocks stay in flight, so evictions meet chunks being read."""
        assert self.store is not None
        busy = [job for job, used in self.store_jobs if blocks is None or used & blocks]
        self.store.wait(busy)  # type: ignore[arg-type]
        self.store_jobs = [(j, u) for j, u in self.store_jobs if j not in busy]
        if blocks is None or any(set(b) & blocks for _, _, b in self.pending):
            self._finish_loads()

    def _finish_loads(self) -> None:
        assert self.store is not None
        if not self.pending:
            return
        self.store.wait([h.job_id for h, _, _ in self.pending])  # type: ignore[attr-defined]
        done = {c.job_id: c for c in self.store.poll()}
        for handle, idx, blocks in self.pending:
            completion = done.get(handle.job_id)  # type: ignore[attr-defined]
            if completion is None:
                continue  # polled by an earlier call already: nothing left to check
            # No fault is injected here: every planned chunk must land.
            assert completion.ok and not completion.failed_keys, completion.error
            for position, key_index in enumerate(idx):
                for layer, chunk in zip(self.kv, content(key_index)):
                    got = layer[blocks[position * BPC : (position + 1) * BPC]]
                    assert torch.equal(got, chunk), f"chunk {key_index} landed with wrong bytes"
        self.pending.clear()

    @precondition(lambda self: self.store is not None)
    @rule()
    def poll(self) -> None:
        self._finish_loads()

    @precondition(lambda self: self.store is not None)
    @rule()
    def flush(self) -> None:
        assert self.store is not None
        self._finish_loads()
        self.store.flush()

    @precondition(lambda self: self.store is not None)
    @rule()
    def restart(self) -> None:
        assert self.store is not None
        self._quiesce()
        self.store.close()
        self._open()

    @invariant()
    def index_holds(self) -> None:
        if self.store is not None:
            self.store.index.check()

    def teardown(self) -> None:
        try:
            if self.store is not None:
                self._finish_loads()
                self.store.drain()
                index = self.store.index
                index.check()
                stats = index.statistics()
                assert stats.storing == stats.promoting == stats.spilling == 0
                assert index.jobs_in_flight() == 0 and not self.store.executor.in_flight_ids()
                for key in KEYS:
                    entry = index.entry(key)
                    assert entry is None or entry.readers == 0
                self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = thorough(40, 30)
TestStoreMachine = StoreMachine.TestCase
