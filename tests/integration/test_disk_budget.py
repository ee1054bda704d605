"""One cap per disk path: ``disk.max_bytes`` bounds every namespace under ``disk.path``
together (docs/operations.md, "One cap per disk path"), through the library API on real
LMDB files: namespaces written one after another (a new model, TP size or chunk size each
time), stores of different namespaces open at once, a tool reading meanwhile, and the
start-up line that names the other namespaces."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.keys import chunk_keys
from tierkv.tiers.disk.tools import inspect_store

PAGE_SHAPE = (2, 16, 4, 256)  # 64 KiB of float16 per block and layer
LAYERS, BPC, TOKENS_PER_BLOCK = 2, 2, 16
# 256 KiB: a store's index files and claims (about 200 KiB, counted by the cap) stay under
# a chunk, so the shares below are whole chunks apart
CHUNK_BYTES = LAYERS * BPC * 2 * 16 * 4 * 256 * 2
UNIT = CHUNK_BYTES + 8192  # a chunk and its overhead: what the cap counts per chunk
CAP_CHUNKS = 24
CAP = CAP_CHUNKS * UNIT
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def open_store(root: Path, model_id: str, check_seconds: float | None = None,
               cap: int = CAP) -> TierKVStore:
    kv = [torch.zeros((64, *PAGE_SHAPE), dtype=torch.float16) for _ in range(LAYERS)]
    often = {} if check_seconds is None else {"budget_check_seconds": check_seconds}
    config = StoreConfig(blocks_per_chunk=BPC, device="cpu",
                         cpu=CpuTierConfig(max_bytes=8 * CHUNK_BYTES),
                         disk=DiskTierConfig(path=root, max_bytes=cap, write_through=True,
                                             **often))  # type: ignore[arg-type]
    return TierKVStore(kv, model_id=model_id, tokens_per_block=TOKENS_PER_BLOCK, config=config)


def whole_cap(store: TierKVStore, cap: int = CAP) -> int:
    """The chunks a store alone on the path holds: the cap less its index files and claims
    (measured at its last plan), in units of a chunk and its overhead."""
    assert store._share is not None
    return (cap - store._share.budgets[0].fixed_bytes) // UNIT


def allocated(root: Path) -> int:
    """Disk space every file under ``root`` takes: what the cap bounds."""
    return sum(os.lstat(os.path.join(folder, name)).st_blocks * 512
               for folder, _, files in os.walk(root) for name in files)


def keys_of(seed: int, num_chunks: int) -> list[bytes]:
    """The keys :func:`store_chunks` stores for ``seed``."""
    return [key for batch in range(0, num_chunks, 4) for key in chunk_keys(
        list(range((seed * 1000 + batch) * BPC * TOKENS_PER_BLOCK,
                   (seed * 1000 + batch + 4) * BPC * TOKENS_PER_BLOCK)),
        BPC * TOKENS_PER_BLOCK)]


def store_chunks(store: TierKVStore, seed: int, num_chunks: int) -> None:
    """``num_chunks`` new chunks (:func:`keys_of`), 4 at a time, each batch written to disk."""
    keys = keys_of(seed, num_chunks)
    for batch in range(0, num_chunks, 4):
        store.wait([store.store(keys[batch : batch + 4], list(range(8)))])
        store.flush()


def held_chunks(root: Path) -> dict[str, int]:
    """Chunks on disk per model id, as ``tierkv inspect`` counts them."""
    return {str(report.description.get("model_id")): sum(rank.chunks for rank in report.ranks)
            for report in inspect_store(root)}


def test_namespaces_written_one_after_another_stay_within_one_cap(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: the cap was per namespace, so every new namespace on the same path (a
    vLLM upgrade, a TP or chunk-size change) added up to a cap of its own: three held 3x."""
    for number in range(3):
        with caplog.at_level(logging.INFO, logger="tierkv"):
            with open_store(tmp_path, f"model-{number}") as store:
                store_chunks(store, number, 40)
                whole = whole_cap(store)
                assert store.index.disk_capacity == whole
        held = held_chunks(tmp_path)
        assert sum(held.values()) <= CAP_CHUNKS and allocated(tmp_path) <= CAP, held
        assert held[f"model-{number}"] == whole  # the newest got the whole cap
    assert list(held) == ["model-2"]  # the older ones were deleted, oldest first
    deleted = [r.getMessage() for r in caplog.records if "deleted namespace" in r.getMessage()]
    assert len(deleted) == 2 and "model model-0" in deleted[0] and "model model-1" in deleted[1]
    assert "no engine claimed it (least recently used first)" in deleted[0]


def test_room_is_taken_from_the_least_recently_used_unclaimed_namespace_first(tmp_path: Path) -> None:
    """(Issue 41: a store's share is what it holds and a step more, its CPU slots here, as
    far as the others' files leave room; before, it took all they left at once.)"""
    olds = []
    for number in range(2):  # two old namespaces of 8 chunks, no engine on them any more
        with open_store(tmp_path, f"old-{number}") as store:
            store_chunks(store, number, 8)
            olds.append(store.disk.namespace_dir)  # type: ignore[union-attr]
    with open_store(tmp_path, "new") as store:
        fixed = store._share.budgets[0].fixed_bytes  # type: ignore[union-attr]
        left = CAP - sum(allocated(old) for old in olds) - fixed
        assert store.index.disk_capacity == left // UNIT < 8  # what they leave
        old_1 = allocated(olds[1])
        store_chunks(store, 10, 12)  # the path fills: one old namespace goes
        fixed = store._share.budgets[0].fixed_bytes  # type: ignore[union-attr]
        assert store.index.disk_capacity == (CAP - old_1 - fixed) // UNIT
    held = held_chunks(tmp_path)
    assert "old-0" not in held and held["old-1"] == 8, held  # one was enough: the oldest
    assert held["new"] == 12 and sum(held.values()) <= CAP_CHUNKS
    assert allocated(tmp_path) <= CAP


def test_a_stopped_rank_of_the_same_namespace_keeps_its_chunks_and_leaves_the_rest(
        tmp_path: Path) -> None:
    """Ranks of one namespace share the cap; one that stopped counts with the bytes of its
    files (issue 41: what the cap bounds) and is never deleted."""
    kv = [torch.zeros((64, *PAGE_SHAPE), dtype=torch.float16) for _ in range(LAYERS)]

    def rank_store(rank: int) -> TierKVStore:
        config = StoreConfig(blocks_per_chunk=BPC, device="cpu", rank=rank, tp_size=2,
                             cpu=CpuTierConfig(max_bytes=8 * CHUNK_BYTES),
                             disk=DiskTierConfig(path=tmp_path, max_bytes=CAP, write_through=True))
        return TierKVStore(kv, model_id="tp", tokens_per_block=TOKENS_PER_BLOCK, config=config)

    with rank_store(0) as first:
        with rank_store(1) as second:
            first.poll()
            second.poll()  # each holds a step of room, its CPU slots (issue 41: not half each)
            assert [first.index.disk_capacity, second.index.disk_capacity] == [8, 8]
            store_chunks(first, 1, 12)
            store_chunks(second, 2, 8)  # 7 or 8 of them fit beside rank 0's reservation
            rank_1, stopped_with = second.disk.path, second.index.disk_used  # type: ignore[union-attr]
            assert stopped_with >= 7
        first.poll()  # rank 1 stopped with its chunks: rank 0 may use the rest
        fixed = first._share.budgets[0].fixed_bytes  # type: ignore[union-attr]
        rest = (CAP - allocated(rank_1) - fixed) // UNIT
        assert first.index.disk_capacity == rest > 12
        store_chunks(first, 3, 16)
        assert first.index.disk_used == rest
    assert held_chunks(tmp_path) == {"tp": stopped_with + rest}
    assert allocated(tmp_path) <= CAP


def test_stores_of_three_namespaces_open_at_once_share_the_cap(tmp_path: Path) -> None:
    """Shares move at the stores' next calls (the root directory's mtime tells them), not
    after disk.budget_check_seconds (10 s here)."""
    stores = [open_store(tmp_path, f"engine-{number}") for number in range(3)]
    tool_errors: list[str] = []
    runs: list[int] = []
    stop = threading.Event()

    def tool() -> None:  # an operator's inspect in another process, while the stores run
        while not stop.is_set():
            done = subprocess.run([sys.executable, "-m", "tierkv", "inspect", str(tmp_path)],
                                  capture_output=True, text=True, timeout=120, env=ENV)
            runs.append(done.returncode)
            if done.returncode not in (0, 2) or "Traceback" in done.stderr:
                tool_errors.append(done.stderr[-2000:])

    reader = threading.Thread(target=tool)
    reader.start()
    try:
        for round_number in range(8):
            for number, store in enumerate(stores):
                store_chunks(store, 100 * number + round_number, 4)
                capacities = [other.index.disk_capacity for other in stores]
                assert sum(capacities) <= CAP_CHUNKS, capacities
                on_disk = [other.index.disk_used for other in stores]
                assert sum(on_disk) <= CAP_CHUNKS, on_disk
                assert allocated(tmp_path) <= CAP
        for store in stores:
            store.poll()  # each plans its share once more
        assert [store.index.disk_capacity for store in stores] == [
            (CAP // 3 - store._share.budgets[0].fixed_bytes) // UNIT  # type: ignore[union-attr]
            for store in stores]
    finally:
        stop.set()
        reader.join()
        for store in stores:
            store.close()
    assert tool_errors == [] and runs
    held = held_chunks(tmp_path)
    assert sum(held.values()) <= CAP_CHUNKS and len(held) == 3, held


def test_the_start_up_line_names_the_other_namespaces_and_tierkv_rm(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with open_store(tmp_path, "old-model") as store:
        store_chunks(store, 1, 4)
        old = store.namespace.fingerprint()
    running = open_store(tmp_path, "running-model")
    try:
        with caplog.at_level(logging.INFO, logger="tierkv"):
            open_store(tmp_path, "new-model").close()
    finally:
        running.close()
    (line,) = [r for r in caplog.records if "holds 2 other namespace(s)" in r.getMessage()]
    message = line.getMessage()
    assert line.levelno == logging.WARNING  # one of them holds room no engine uses
    assert f"disk.path {tmp_path} holds 2 other namespace(s), within the one cap" in message
    assert f"{old[:8]} (model old-model, " in message and "KiB, last written" in message
    assert "no engine: deleted first when room is needed" in message
    assert "(model running-model, " in message and "in use by this process" in message
    assert f"delete one now with: tierkv rm {tmp_path} --namespace {old[:8]} --yes" in message


def test_an_engines_part_budgets_do_not_count_each_other_as_other_engines(tmp_path: Path) -> None:
    """Regression (vLLM at TP = 2, the workers' claims taken before the scheduler plans):
    the second part's budget counted the first's published share as another engine's and
    the engine's capacity fell to nothing. Each part's budget is blind to its siblings,
    plans the engine's whole chunks and publishes its part's share, so another store sees
    the engine's reservation once."""
    from tierkv.tiers.disk.opener import close_disk, open_disk
    from tierkv.keys import Namespace, Part
    from tierkv.tiers.disk.budget import DiskBudget, survey
    from tierkv.tiers.disk.layout import StoreLayout

    namespace = Namespace(model_id="tp2", dtype="float16", kv_layout="test", page_bytes=4096,
                          tokens_per_chunk=16, chunk_bytes=2 * CHUNK_BYTES)
    parts = (Part(0, 2), Part(1, 2))
    disk = DiskTierConfig(path=tmp_path, max_bytes=CAP)
    # the workers claim their parts first
    tiers = [open_disk(disk, namespace, part, "writer", payload_bytes=CHUNK_BYTES)
             for part in parts]
    try:
        names = tuple(StoreLayout.part_dir_name(part) for part in parts)
        unit = 2 * UNIT  # a chunk of both parts
        budgets = [DiskBudget(tmp_path, namespace.fingerprint(), name, CAP, unit,
                              check_seconds=10.0, parts=2, siblings=names) for name in names]
        plans = [budget.plan(0, 1000) for budget in budgets]
        assert plans == [(CAP - budgets[0].fixed_bytes) // unit] * 2  # the engine's index files
        assert [budget.plan(0, 1000) for budget in budgets] == plans  # again: stable
        (holding,) = survey(tmp_path)  # another store's view: the whole reservation, once
        reserved = sum((plan * unit + budget.fixed_bytes) // 2
                       for plan, budget in zip(plans, budgets))
        # (a share file written since a plan measured may differ by its 4 KiB block)
        assert len(holding.shares) == 2 and abs(holding.held(0) - reserved) <= 8192
        # and what it wants, up to another store's entitlement
        assert holding.held(CAP // 2) == max(holding.held(0), CAP // 2 // 2 * 2)
    finally:
        for tier in tiers:
            close_disk(tier, writer=True)


# ------------------------------------------------------------------ issue 41, item 7
# Room is shared by what each namespace uses, not by what a running store may take: a
# store started beside a running one gets room at once, nothing is deleted while the path
# has room, and a store that restarts gets its chunks back.


def test_a_store_started_beside_a_running_one_gets_room_and_deletes_nothing(
        tmp_path: Path) -> None:
    """Regression: a running store reserved all the room it might take (here the whole cap
    less the stopped namespace), so a store started beside it got room 0, counted itself
    full and deleted the stopped namespace, whose engine was only restarting, with the path
    at a third of its cap; then its spills found no room."""
    with open_store(tmp_path, "restarting") as store:  # its engine is restarting meanwhile
        store_chunks(store, 1, 4)
    running = open_store(tmp_path, "running")
    try:
        store_chunks(running, 2, 4)  # holds little
        with open_store(tmp_path, "started") as started:
            assert started.index.disk_capacity > 0  # room at once, without waiting on anyone
            store_chunks(started, 3, 8)
            assert started.index.disk_used == 8  # on disk, none evicted
            assert allocated(tmp_path) <= CAP
        running.poll()
        assert running.index.disk_used == 4
    finally:
        running.close()
    assert held_chunks(tmp_path) == {"restarting": 4, "running": 4, "started": 8}
    assert allocated(tmp_path) <= CAP


def test_a_store_that_restarts_beside_a_running_one_gets_its_chunks_back(tmp_path: Path) -> None:
    """Regression: while one store was stopped, the other, running with the path well under
    its cap, counted itself full once it held what the cap less the stopped one left, less
    its headroom (an eighth of the cap), and deleted the stopped namespace; the returning
    store found nothing, and got capacity 0."""
    cap = 4 * CAP  # 96 chunks
    with open_store(tmp_path, "returning", cap=cap) as store:
        store_chunks(store, 1, 4)
    running = open_store(tmp_path, "running", cap=cap, check_seconds=1e-9)  # plans at each call
    try:
        store_chunks(running, 2, 84)  # the path at 88 chunks and the files of two stores
        with open_store(tmp_path, "returning", cap=cap) as returned:
            assert returned.index.disk_capacity >= 4
            assert returned.lookup(keys_of(1, 4)) == 4  # hits: on disk, not deleted
            assert returned.index.disk_used == 4
        assert running.lookup(keys_of(2, 84)) == 84
    finally:
        running.close()
    assert held_chunks(tmp_path) == {"returning": 4, "running": 84}
    assert allocated(tmp_path) <= cap


def test_a_store_with_a_smaller_cap_keeps_its_chunks_when_it_restarts(tmp_path: Path) -> None:
    """Regression (unequal caps on one path): a store with twice the cap reserved more than
    the other's whole cap, so the other, restarting, got capacity 0 and deleted all its own
    chunks at start. A store keeps what it holds up to its entitlement (its cap split
    between the running stores)."""
    small, large = CAP, 3 * CAP
    with open_store(tmp_path, "small", cap=small) as store:
        store_chunks(store, 1, 8)  # less than half of its cap
    running = open_store(tmp_path, "large", cap=large)
    try:
        store_chunks(running, 2, 16)
        with open_store(tmp_path, "small", cap=small) as returned:
            assert returned.index.disk_used == 8
            assert returned.lookup(keys_of(1, 8)) == 8
    finally:
        running.close()
    assert held_chunks(tmp_path) == {"small": 8, "large": 16}


def test_write_through_spills_past_the_planned_step_evict_nothing_under_the_cap(
        tmp_path: Path) -> None:
    """Regression (issue 41, the SIGKILL rounds of tests/reliability/test_crash.py): a store
    planned again only once the chunks on disk filled its capacity (what it held at start
    and a step more). Chunks written through to disk, three at a time, then came to a
    capacity their spills would pass: the spills evicted the oldest chunks on disk for room
    the cap still had. The plan is due once what is on disk and what is to be written fill
    the capacity."""
    with open_store(tmp_path, "restarts") as store:
        store_chunks(store, 1, 8)
    with open_store(tmp_path, "restarts", check_seconds=1e9) as store:  # plans when full
        assert store.index.disk_capacity < 8 + 12 <= whole_cap(store)
        new = keys_of(2, 12)
        for batch in range(0, 12, 3):
            store.wait([store.store(new[batch : batch + 3], list(range(6)))])
            store.flush()
        assert store.lookup(keys_of(1, 8)) == 8  # the first chunks are still on disk
        assert store.index.disk_used == 20
    assert held_chunks(tmp_path) == {"restarts": 20}
