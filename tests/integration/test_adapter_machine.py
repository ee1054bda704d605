"""Random engine steps against the whole stack (real copy thread, real LMDB).

Rules add requests that share prefixes, run steps (chunked prefill, decode, preemption
when the small block pool runs dry, LIFO reuse of freed blocks), abort requests, change
the copy delay and toggle key lag; the MiniEngine checks every computed KV position of
every scheduled request before each forward. After a drain nothing leaks and every chunk
the tiers hold equals the bytes the engine wrote for its prefix.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.profiles import thorough
from tierkv.core.jobs import LoadSpec, StoreSpec

from .adapter_stack import TPC_DEFAULT, Stack, build_stack

PREFIXES = [[(p * 977 + i * 13) % 50_000 for i in range(3 * TPC_DEFAULT)] for p in range(3)]


class AdapterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierkv-machine-"))
        self.delay = 0.0
        self.stack: Stack | None = None
        self.count = 0

    def hook(self, spec: StoreSpec | LoadSpec) -> None:
        if self.delay:
            time.sleep(self.delay)

    @precondition(lambda self: self.stack is None)
    @rule(async_scheduling=st.booleans(), num_slots=st.sampled_from([3, 8, 32]),
          num_blocks=st.sampled_from([14, 24, 48]), key_lag=st.sampled_from([0, 1]))
    def open(self, async_scheduling: bool, num_slots: int, num_blocks: int, key_lag: int) -> None:
        self.stack = build_stack(self.dir, num_blocks=num_blocks, num_slots=num_slots, disk_chunks=40,
                                 token_budget=2 * TPC_DEFAULT, async_scheduling=async_scheduling,
                                 before_copy=self.hook, key_lag_tokens=key_lag)

    @precondition(lambda self: self.stack is not None)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), prefix_len=st.integers(0, 3 * TPC_DEFAULT),
          suffix=st.integers(0, 2 * TPC_DEFAULT), max_tokens=st.integers(1, 6))
    def add_request(self, prefix: int, prefix_len: int, suffix: int, max_tokens: int) -> None:
        assert self.stack is not None
        self.count += 1
        tokens = PREFIXES[prefix][:prefix_len] + [(self.count * 31 + i) % 50_000 for i in range(suffix)]
        if not tokens:
            tokens = [self.count]
        self.stack.engine.add_request(f"r{self.count}", tokens, max_tokens)

    @precondition(lambda self: self.stack is not None)
    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        assert self.stack is not None
        for _ in range(steps):
            self.stack.engine.step()

    @precondition(lambda self: self.stack is not None and self.count > 0)
    @rule(which=st.integers(1, 40))
    def abort(self, which: int) -> None:
        assert self.stack is not None
        self.stack.engine.abort(f"r{1 + which % self.count}")

    @precondition(lambda self: self.stack is not None)
    @rule(delay=st.sampled_from([0.0, 0.0, 0.002, 0.01]))
    def set_delay(self, delay: float) -> None:
        self.delay = delay

    @invariant()
    def bookkeeping_holds(self) -> None:
        if self.stack is not None:
            self.stack.index.check()

    def teardown(self) -> None:
        try:
            if self.stack is None:
                return
            stack = self.stack
            self.delay = 0.0
            stack.engine.run(2_000)
            stack.drain()
            stack.index.check()
            stats = stack.index.statistics()
            assert stats.storing == stats.promoting == stats.spilling == 0, stats
            assert stack.adapter.num_requests() == 0 and stack.adapter.jobs_in_flight() == 0
            for key in stack.engine.key_prefix:
                entry = stack.index.entry(key)
                assert entry is None or entry.readers == 0, entry
            stack.verify_stored()
            stack.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


AdapterMachine.TestCase.settings = thorough(25, 20)
TestAdapterMachine = AdapterMachine.TestCase
