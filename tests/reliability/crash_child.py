"""Child processes of ``test_crash.py``: write to the disk tier under load until killed.

Each child appends one line per event to a report file with a single ``os.write`` (the
kernel keeps it whatever happens to the process next):

    R                  ready: the store is open and writing starts
    C <hex key> ...    these chunks are committed (written *after* the commit is known)
    W <hex key> ...    a write of these chunks was submitted (a committed chunk stays)
    D <hex key> ...    a delete of these chunks was submitted (their state is now unknown)
    X <hex key> ...    those deletes are committed (the chunks must be gone)
    E <text>           the child failed (it never should before the kill)

Two modes, alternated by the test:
- ``diskio``: DiskTier + TierIO directly; spill jobs of 1-6 chunks with some deletes,
  up to 4 jobs queued so that the writer batches several jobs per transaction.
- ``store``: the TierKVStore library path with write-through (spills ride the same
  TierIO writer); every few requests ``flush()``, after which every chunk the index holds
  on disk is reported committed.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from collections import deque
from pathlib import Path

from tests.reliability import support

POOL = 256  # distinct keys per mode, so the files stay small however long a child runs
MAX_SECONDS = 30.0  # a child nobody kills stops by itself


class Report:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def line(self, tag: str, keys: list[bytes] | None = None, text: str = "") -> None:
        body = " ".join(key.hex() for key in keys) if keys is not None else text
        os.write(self.fd, f"{tag} {body}\n".encode())


def run_child(mode: str, root: str, report_path: str, seed: int) -> None:
    report = Report(report_path)
    try:
        if mode == "diskio":
            _diskio(Path(root), report, random.Random(seed))
        else:
            _store(Path(root), report, random.Random(seed))
    except BaseException:
        report.line("E", text=traceback.format_exc().replace("\n", " | "))
        raise


def _diskio(root: Path, report: Report, rng: random.Random) -> None:
    from tierkv.core.jobs import JobId, SlotId, SpillSpec
    from tierkv.tiers.cpu import CpuSlab
    from tierkv.tiers.disk.tier import DiskTier
    from tierkv.transfer.tier_io import TierIO

    config = support.store_config(root, write_batch_bytes=4 * support.CHUNK_BYTES).disk
    tier = DiskTier(root, support.namespace_of(), support.part(0), config, support.CHUNK_BYTES)
    slab = CpuSlab(num_slots=32, slot_bytes=support.CHUNK_BYTES, pin_memory="never")
    disk_io = TierIO(tier, slab, write_batch_bytes=config.write_batch_bytes)
    committed = {record.key for record in tier.scan()}
    busy: set[bytes] = set()  # keys with a write or delete in flight
    free_slots = list(range(slab.num_slots))
    jobs: dict[int, tuple[list[bytes], list[int], list[bytes]]] = {}
    order: deque[int] = deque()
    pool = [support.pool_key(i) for i in range(POOL)]
    report.line("R", text="diskio")
    deadline = time.monotonic() + MAX_SECONDS
    job_id = 0
    while time.monotonic() < deadline:
        while len(order) < 4 and len(free_slots) >= 6:
            job_id += 1
            idle = [key for key in pool if key not in busy]
            writes = rng.sample(idle, rng.randint(1, 6))
            deletable = sorted(committed - busy - set(writes))
            deletes = rng.sample(deletable, min(len(deletable), rng.choice((0, 0, 1, 3))))
            slots = [free_slots.pop() for _ in writes]
            for key, slot in zip(writes, slots):
                slab.memoryview(slot)[:] = support.payload_for(key)
            report.line("W", writes)
            if deletes:
                report.line("D", deletes)
                committed.difference_update(deletes)
            busy.update(writes)
            busy.update(deletes)
            disk_io.submit_spill(SpillSpec(JobId(job_id), tuple(
                (key, SlotId(slot)) for key, slot in zip(writes, slots)), tuple(deletes)))
            jobs[job_id] = (writes, slots, deletes)
            order.append(job_id)
        disk_io.wait([JobId(order[0])], timeout=10)
        for completion in disk_io.poll_finished():
            writes, slots, deletes = jobs.pop(completion.job_id)
            order.remove(completion.job_id)
            if not completion.ok:
                raise AssertionError(f"spill job failed: {completion}")
            if deletes:
                report.line("X", deletes)
            report.line("C", writes)
            committed.update(writes)
            busy.difference_update(writes)
            busy.difference_update(deletes)
            free_slots.extend(slots)


def _store(root: Path, report: Report, rng: random.Random) -> None:
    from tierkv.core.plans import DiskState

    kv = support.make_kv()
    store = support.open_store(root, kv, write_through=True,
                               write_batch_bytes=3 * support.CHUNK_BYTES)
    report.line("R", text="store")
    deadline = time.monotonic() + MAX_SECONDS
    pending: set[bytes] = set()
    requests = 0
    while time.monotonic() < deadline:
        keys = support.request_keys(rng.randrange(POOL // 4))
        report.line("W", keys)
        completion = support.store_chunks(store, kv, keys)
        if completion is not None:
            if not completion.ok:
                raise AssertionError(f"store job failed: {completion}")
            pending.update(keys)
        requests += 1
        if requests % 3 == 0:
            store.flush()
            on_disk = []
            for key in list(pending):
                entry = store.index.entry(key)
                if entry is not None and entry.disk is DiskState.ON_DISK:
                    on_disk.append(key)
            if on_disk:
                report.line("C", on_disk)
            pending.difference_update(on_disk)
