"""Per-request controls on the library's engine API (EngineAdapter + WorkerAdapter, real
CPU copies, real LMDB): skip_store, skip_load, load_tiers and load_deadline_ms. The
MiniEngine checks every computed position's KV before each forward pass, so a load of
wrong bytes, or a late copy into blocks handed to another request, fails at once."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.integration.adapter_stack import TPC_DEFAULT as TPC
from tests.integration.adapter_stack import build_stack
from tierkv.core.controls import RequestControls
from tierkv.core.plans import CpuState
from tierkv.keys import chunk_keys
from tierkv.tiers.disk.tier import DiskTier, ReadStatus


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104_729) % 50_000 for i in range(length)]


class GatedDisk(DiskTier):
    """A real disk tier whose reads wait until the test opens ``gate`` (a node that answers
    only when the test says so: no sleep, no wall clock)."""

    gate = threading.Event()

    def read_into(self, key: bytes, out: memoryview) -> ReadStatus:
        self.gate.wait()
        return super().read_into(key, out)

    def read_many_into(self, items: Sequence[tuple[bytes, Any]]) -> list[ReadStatus]:
        self.gate.wait()  # the I/O threads' reads: many chunks in one call
        return super().read_many_into(items)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_skip_store_skip_load_and_load_tiers_on_the_library_api(tmp_path: Path) -> None:
    stack = build_stack(tmp_path, num_blocks=32, disk_chunks=64)
    engine, index = stack.engine, stack.index
    tokens = prompt(3 * TPC + 1, 1)
    keys = chunk_keys(tokens, TPC)
    engine.add_request("skip-store", tokens, 2, RequestControls(skip_store=True))
    engine.run(100)
    assert not any(index.contains(key) for key in keys)
    engine.add_request("stores", tokens, 2)
    engine.run(100)
    assert all(index.contains(key) for key in keys)
    loaded = engine.loaded_tokens
    for req_id, controls in (("skip-load", RequestControls(skip_load=True)),
                             ("disk-only", RequestControls(load_tiers=frozenset({"disk"}))),
                             ("no-tier", RequestControls(load_tiers=frozenset()))):
        engine.add_request(req_id, tokens, 2, controls)
        engine.run(100)
        assert engine.loaded_tokens == loaded, req_id  # held in the CPU tier: not loaded
    engine.add_request("cpu", tokens, 2, RequestControls(load_tiers=frozenset({"cpu"})))
    engine.run(100)
    assert engine.loaded_tokens == loaded + 3 * TPC
    stack.drain()
    assert stack.verify_stored() == 3
    stack.close()


def test_a_load_past_its_deadline_is_recomputed_and_never_lands_later(tmp_path: Path) -> None:
    """A disk load that has not read its chunks by the request's deadline is cut: the
    request computes them (the engine checks its KV), and when the reads land at last,
    their chunks reach the CPU tier only, never the blocks the request left, which another
    request computes into meanwhile (the fence does not wait for the cut load)."""
    clock = Clock()
    GatedDisk.gate = threading.Event()
    GatedDisk.gate.set()
    stack = build_stack(tmp_path, num_blocks=16, num_slots=4, disk_chunks=64, token_budget=TPC,
                        worker_clock=clock, disk_type=GatedDisk)
    engine, index = stack.engine, stack.index
    tokens = prompt(3 * TPC + 1, 2)
    keys = chunk_keys(tokens, TPC)
    engine.add_request("first", tokens, 1)
    engine.run(100)
    stack.drain()  # on disk, clean
    engine.add_request("filler", prompt(4 * TPC + 1, 3), 1)
    engine.run(100)
    stack.drain()
    entries = [index.entry(key) for key in keys]
    assert all(e is not None and e.cpu is None and e.on_disk for e in entries)  # disk only

    GatedDisk.gate.clear()  # the disk answers no read until the test says so
    engine.add_request("late", tokens, 2, RequestControls(load_deadline_ms=5))
    engine.step()
    engine.step()
    late = engine.requests["late"]
    assert late.status == "loading" and late.external == 3 * TPC
    clock.now += 0.004
    engine.step()
    assert late.status == "loading" and stack.worker.loads_cut == 0
    clock.now += 0.002  # past the deadline: cut, the request computes its tokens
    engine.step()
    assert stack.worker.loads_cut == 1 and late.status == "running"
    assert late.num_computed <= TPC  # from the start (one step of compute so far)
    for _ in range(40):
        if late.status == "done":
            break
        engine.step()
    assert late.status == "done" and engine.loaded_tokens == 0
    assert index.entry(keys[0]).cpu is CpuState.PROMOTING  # its reads still wait

    # Another request is handed the blocks "late" left (LIFO: at once) and computes into
    # them; the reads land meanwhile, and the engine checks its KV every step.
    engine.add_request("next", prompt(3 * TPC + 1, 4), 6)
    engine.step()
    engine.step()
    assert set(engine.requests["next"].block_ids) & set(range(16))
    GatedDisk.gate.set()
    for _ in range(60):
        if engine.requests["next"].status == "done":
            break
        engine.step()
    assert engine.requests["next"].status == "done"
    engine.run(100)
    stack.drain()
    # The cut load's chunks landed in the CPU tier: the next request loads them.
    assert all(index.entry(key).cpu is CpuState.READY for key in keys)  # type: ignore[union-attr]
    engine.add_request("again", tokens, 2)
    engine.run(100)
    assert engine.loaded_tokens == 3 * TPC
    index.check()
    stack.close()
