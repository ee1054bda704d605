"""With the LRU policy the index decides exactly as it did before eviction policies were
pluggable (commit ce484b3, where LRU was wired into the index): a seeded random workload
drives every primitive (stores, batched stores with guards, lookups, loads and promotions,
spills with full disks, failures, corrupt and missing chunks, touches, a rebuild from disk,
a fake clock), and every decision it returns (plans, slots, spill writes and deletes, load
results, shortfalls, statistics) is hashed. The digest was recorded by this same driver
at that commit; a change to it is a change of LRU behaviour.

Re-recorded once, for a deliberate change of write-back (a disk smaller than the CPU tier
thrashed): the spill-ahead reserve is bounded by the disk's size too, and a chunk whose disk
copy is evicted while it is in the CPU tier becomes EVICTED (clean) instead of dirty. With
those two rules put back as they were, this driver gave ce484b3's digest (ec09beeb...) on
the new code: they are the only decisions that changed.

Re-recorded a second time, for a bug fix: chunks found on disk at open beyond the disk
capacity were deleted newest first; the oldest go now (``BlockIndex.add_on_disk``). With the old
rule put back, this driver gives the previous digest (4564fe3a...).
"""

from __future__ import annotations

import hashlib
import inspect
import random
from dataclasses import fields
from typing import Any

from tierkv.core.figures import figures
from tierkv.core.index import BlockIndex
from tierkv.core.plans import LoadPlan, Lookup
from tierkv.core.stats import IndexStats
from tierkv.core.jobs import Completion, JobKind

RECORDED = "11a7832d0ee43a559d16236f11f53ff585eaf2a803c0043e45c7bf34440429d1"  # see above
KEYS = [bytes([i]) * 8 for i in range(24)]


class _Recorded:
    """Prints as ``Name(field=value, ...)`` over the given fields, as a NamedTuple or
    dataclass of the recording commit did."""

    def __init__(self, item: Any, names: tuple[str, ...]) -> None:
        self.text = f"{type(item).__name__}(" + ", ".join(
            f"{name}={getattr(item, name)!r}" for name in names) + ")"

    def __repr__(self) -> str:
        return self.text


# The fields the recording commit had; the remote tier's (added later) are always at
# their defaults here: this driver notes nothing on a remote tier.
_OLD_FIELDS = {Lookup: ("num_hits", "pending", "num_on_cpu"), LoadPlan: ("job_id", "chunks")}
_NEW_STATS = ("remote_marks", "loads_remote", "remote_missing", "remote_corrupt",
              "remote_failed")
_GAUGES = {figure.name for figure in figures(IndexStats) if figure.kind == "gauge"}


def _as_recorded(item: object) -> object:
    """``item`` as the recording commit printed it."""
    if isinstance(item, (Lookup, LoadPlan)):
        names = _OLD_FIELDS[type(item)]
        assert not any(item[len(names):])
        return _Recorded(item, names)
    if isinstance(item, IndexStats):
        assert not any(getattr(item, name) for name in _NEW_STATS)
        # The recording commit declared the gauges first, then the counters.
        names = sorted((f.name for f in fields(item) if f.name not in _NEW_STATS),
                       key=lambda name: name not in _GAUGES)
        return _Recorded(item, tuple(names))
    return item


def drive(seed: int, steps: int = 300) -> str:
    rng = random.Random(seed)
    now = [0.0]
    extra = {"eviction_policy": "lru"} if "eviction_policy" in inspect.signature(BlockIndex).parameters else {}
    index = BlockIndex(rng.choice([2, 3, 6, 10]), rng.choice([0, 0, 3, 8, 30]),
                       write_through=rng.random() < 0.2,
                       spill_ahead_fraction=rng.choice([0.0, 0.25, 0.5, 1.0]),
                       retry_after_full_seconds=1.0, clock=lambda: now[0], **extra)
    digest = hashlib.sha256()

    def record(*items: object) -> None:
        digest.update(repr(tuple(_as_recorded(item) for item in items)).encode())

    if index.has_disk and rng.random() < 0.5:
        record("open", index.add_on_disk(rng.sample(KEYS, rng.randrange(1, 10))))
    stores: list[tuple[int, tuple[bytes, ...]]] = []
    loads: list[tuple[int, tuple[tuple[bytes, int, bool], ...]]] = []
    spills: list[tuple[int, tuple[bytes, ...]]] = []
    for _ in range(steps):
        op = rng.randrange(11)
        conversation = KEYS[rng.randrange(3) * 8:][: rng.randrange(1, 9)]
        if op == 0:
            plan = index.prepare_store(conversation, rng.sample(KEYS, rng.randrange(3)))
            record("store", plan)
            if plan.job_id is not None:
                stores.append((plan.job_id, tuple(k for k, _ in plan.chunks)))
        elif op == 1:
            runs = [rng.sample(KEYS, rng.randrange(1, 5)) for _ in range(rng.randrange(1, 4))]
            flat = [key for run in runs for key in run]
            ends = [sum(map(len, runs[: i + 1])) for i in range(len(runs))]
            batch = index.prepare_store_many(flat, ends, lambda r: runs[r])
            record("batch", batch)
            if batch.job_id is not None:
                stores.append((batch.job_id, batch.keys))
        elif op == 2:
            hits = index.lookup(conversation)
            plan = index.prepare_load(conversation[: hits.num_hits])
            record("load", hits, plan, index.shortfall(conversation))
            if plan.job_id is not None:
                loads.append((plan.job_id, plan.chunks))
        elif op == 3 and stores:
            job_id, keys = stores.pop(rng.randrange(len(stores)) if rng.random() < 0.3 else 0)
            failed = tuple(k for k in keys if rng.random() < 0.15)
            index.complete_store(Completion(job_id, JobKind.STORE, ok=not failed, failed_keys=failed))
            record("stored", job_id, failed)
        elif op == 4 and loads:
            job_id, chunks = loads.pop(0)
            disk_keys = [k for k, _, from_disk in chunks if from_disk]
            corrupt = tuple(k for k in disk_keys if rng.random() < 0.1)
            missing = tuple(k for k in disk_keys if k not in corrupt and rng.random() < 0.1)
            failed = tuple(k for k, _, _ in chunks if rng.random() < 0.1) + corrupt + missing
            result = index.complete_load(Completion(job_id, JobKind.LOAD, ok=not failed, failed_keys=failed,
                                                    corrupt_keys=corrupt, missing_keys=missing))
            record("loaded", result)
        elif op == 5:
            spec = index.take_spills(flush=rng.random() < 0.1, at_least=rng.randrange(3))
            record("spill", spec)
            if spec is not None:
                spills.append((spec.job_id, tuple(k for k, _ in spec.writes)))
        elif op == 6 and spills:
            job_id, keys = spills.pop(0)
            full = tuple(k for k in keys[-1:] if rng.random() < 0.2)
            failed = full + tuple(k for k in keys if k not in full and rng.random() < 0.1)
            index.complete_spill(Completion(job_id, JobKind.SPILL, ok=not failed, failed_keys=failed, full_keys=full))
            record("spilled", job_id, failed)
        elif op == 7:
            index.touch(reversed(rng.sample(KEYS, rng.randrange(1, 6))))
        elif op == 8:
            now[0] += rng.choice([0.3, 1.5])
        record(index.statistics())
    index.check()
    return digest.hexdigest()


def test_lru_decides_as_before_policies_were_pluggable() -> None:
    combined = hashlib.sha256("".join(drive(seed) for seed in range(40)).encode()).hexdigest()
    assert combined == RECORDED
