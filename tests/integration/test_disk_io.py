"""TierIO: the writer and reader threads over a real LMDB disk tier and a CPU slab.

To hold the writer still, a test opens a write transaction on the tier's own environment:
LMDB lets one writer in at a time, so queued spill jobs pile up behind it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tierkv.config import DiskTierConfig
from tierkv.core.jobs import ChunkCopy, Completion, JobId, JobKind, SlotId, SpillSpec
from tierkv.errors import (
    BrokenError,
    ClosedError,
    JobTimeoutError,
    TransferError,
    UnknownJobError,
    UsageError,
)
from tierkv.keys import Namespace
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.tier import DiskTier, ReadStatus
from tierkv.tiers.disk.format import HEADER_BLOCK, slot_bytes_for, unpack_index
from tierkv.transfer.tier_io import TierIO, ReadOutcome

PAYLOAD = 16 * 1024
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=1024,
               tokens_per_chunk=16)


def key_of(i: int) -> bytes:
    return bytes([0x5A]) + i.to_bytes(31, "big")


def fill(slab: CpuSlab, slot: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(slab.slot_bytes)
    slab.memoryview(slot)[:] = data
    return data


@pytest.fixture()
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    disk = DiskTier(tmp_path, NS, 0, DiskTierConfig(path=tmp_path), PAYLOAD)
    yield disk
    disk.close()


@pytest.fixture()
def slab() -> CpuSlab:
    return CpuSlab(num_slots=24, slot_bytes=PAYLOAD, pin_memory="never")


@pytest.fixture()
def disk_io(tier: DiskTier, slab: CpuSlab) -> Iterator[TierIO]:
    io = TierIO(tier, slab, write_batch_bytes=4 * PAYLOAD)
    yield io
    io.shutdown()


@contextmanager
def writer_blocked(tier: DiskTier) -> Iterator[None]:
    txn = tier._shard(key_of(0))._env.begin(write=True)  # LMDB's single-writer lock
    try:
        yield
    finally:
        txn.abort()


def spill(job_id: int, writes: list[tuple[int, int]], deletes: tuple[int, ...] = ()) -> SpillSpec:
    return SpillSpec(JobId(job_id), tuple((key_of(k), SlotId(s)) for k, s in writes),
                     tuple(key_of(k) for k in deletes))


def stored(tier: DiskTier, i: int) -> bytes | None:
    out = bytearray(PAYLOAD)
    return bytes(out) if tier.read_into(key_of(i), memoryview(out)) is ReadStatus.OK else None


def test_submit_returns_at_once_and_completion_is_polled(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    data = fill(slab, 0, seed=1)
    with writer_blocked(tier):  # nothing commits meanwhile; the submit did not wait for it
        disk_io.submit_spill(spill(1, [(1, 0)]))
        assert disk_io.poll_finished() == []  # not committed yet: not reported
    disk_io.wait([JobId(1)], timeout=10)
    disk_io.wait([JobId(1)], timeout=10)  # waiting again is fine
    (completion,) = disk_io.poll_finished()  # wait did not consume it
    assert completion.job_id == 1 and completion.ok and completion.kind is JobKind.SPILL
    assert completion.num_bytes == PAYLOAD and completion.seconds >= 0
    assert disk_io.poll_finished() == []
    assert stored(tier, 1) == data


def test_queued_jobs_share_one_transaction_in_order(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    data = {i: fill(slab, i, seed=i) for i in range(1, 6)}
    with writer_blocked(tier):
        for i in range(1, 6):
            disk_io.submit_spill(spill(i, [(i, i)]))
        time.sleep(0.05)
    disk_io.wait([JobId(i) for i in range(1, 6)], timeout=10)
    assert [c.job_id for c in disk_io.poll_finished()] == [1, 2, 3, 4, 5]
    # job 1 may have been taken alone before the others queued; 2-5 (4 payloads) fit one txn
    assert tier.statistics().write_txns <= 2
    assert all(stored(tier, i) == data[i] for i in data)


def test_a_job_bigger_than_a_batch_spans_txns_and_reports_once(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    data = {i: fill(slab, i, seed=i) for i in range(10)}
    disk_io.submit_spill(spill(7, [(i, i) for i in range(10)]))
    disk_io.wait([JobId(7)], timeout=10)
    (completion,) = disk_io.poll_finished()
    assert completion.ok and completion.num_bytes == 10 * PAYLOAD
    assert tier.statistics().write_txns == 3  # 4 + 4 + 2 payloads
    assert all(stored(tier, i) == data[i] for i in data)


def test_deletes_and_writes_keep_submission_order(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    fill(slab, 0, seed=0)
    newer = fill(slab, 1, seed=11)
    with writer_blocked(tier):
        disk_io.submit_spill(spill(1, [(1, 0), (2, 0)]))
        disk_io.submit_spill(spill(2, [], deletes=(1,)))  # deletes a key job 1 wrote
        disk_io.submit_spill(spill(3, [(2, 1)], deletes=(2,)))  # its own delete runs first
    disk_io.flush()
    assert stored(tier, 1) is None
    assert stored(tier, 2) == newer
    assert all(c.ok for c in disk_io.poll_finished())


def test_map_full_is_reported_per_job(tmp_path: Path, slab: CpuSlab) -> None:
    size = PAYLOAD
    config = DiskTierConfig(path=tmp_path, max_bytes=8 * size)  # one job fills the slab
    with DiskTier(tmp_path, NS, 0, config, size) as small:
        io = TierIO(small, slab, write_batch_bytes=8 * size)
        for slot in range(8):
            fill(slab, slot, seed=slot)
        for job in range(60):
            io.submit_spill(spill(job, [(job * 8 + s, s) for s in range(8)]))
        io.flush()
        completions = io.poll_finished()
        assert len(completions) == 60
        full = [c for c in completions if c.full_keys]
        assert full and all(not c.ok and set(c.full_keys) <= set(c.failed_keys) for c in full)
        assert completions[0].ok and stored(small, 0) is not None  # reads keep working
        io.shutdown()


def test_reads_land_in_slots_and_their_outcome_waits_for_a_poll(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    data = {i: fill(slab, i, seed=i) for i in range(3)}
    disk_io.submit_spill(spill(1, [(i, i) for i in range(3)]))
    disk_io.wait([JobId(1)])
    for slot in range(10, 13):
        slab.memoryview(slot)[:] = bytes(PAYLOAD)
    chunks = [ChunkCopy(key_of(i), SlotId(10 + i), (), True) for i in range(3)]
    chunks.append(ChunkCopy(key_of(99), SlotId(13), (), True))
    disk_io.submit_read(JobId(2), chunks)
    disk_io.wait([JobId(2)])
    (outcome,) = disk_io.poll_reads()
    assert disk_io.poll_reads() == []  # each outcome once
    assert outcome.ok_keys == tuple(key_of(i) for i in range(3))
    assert outcome.missing_keys == (key_of(99),) and not outcome.ok
    assert outcome.num_bytes == 3 * PAYLOAD
    assert all(bytes(slab.memoryview(10 + i)) == data[i] for i in range(3))


def test_corrupt_value_is_reported_and_deleted(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    fill(slab, 0, seed=0)
    disk_io.submit_spill(spill(1, [(1, 0)]))
    disk_io.flush()
    shard = tier._shard(key_of(0))
    with shard._env.begin(db=shard.index) as txn:  # flip the last payload byte in place
        entry = unpack_index(txn.get(key_of(1)))
    assert entry is not None and shard.slab is not None
    with open(shard.slab.path, "r+b") as slab_file:
        slab_file.seek(entry.slot * slot_bytes_for(PAYLOAD) + HEADER_BLOCK + PAYLOAD - 1)
        last = slab_file.read(1)[0]
        slab_file.seek(-1, 1)
        slab_file.write(bytes([last ^ 0x01]))
    disk_io.submit_read(JobId(2), [ChunkCopy(key_of(1), SlotId(5), ())])
    disk_io.flush()
    outcomes = disk_io.poll_reads()
    assert outcomes[0].corrupt_keys == (key_of(1),) and outcomes[0].ok_keys == ()
    assert stored(tier, 1) is None and tier.statistics().corrupt == 1


def test_wait_on_a_job_never_submitted_raises(disk_io: TierIO) -> None:
    with pytest.raises(UnknownJobError, match="disk io: wait on job 42, which was never submitted"):
        disk_io.wait([JobId(42)])


def test_a_wait_that_times_out_raises_and_the_job_still_completes(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    with writer_blocked(tier):
        disk_io.submit_spill(spill(1, [(1, 0)]))
        with pytest.raises(JobTimeoutError, match=r"disk io: job\(s\) \[1\] still running") as info:
            disk_io.wait([JobId(1)], timeout=0.05)
        assert isinstance(info.value, TimeoutError)  # what TierIO raised before
    disk_io.wait([JobId(1)], timeout=10)
    assert [c.job_id for c in disk_io.poll_finished()] == [1]


def test_a_spill_job_id_is_taken_once(disk_io: TierIO) -> None:
    """TierIO refused an id only while its job was in flight: a finished spill's id was
    taken again, so a wait on it could no longer tell the two jobs apart."""
    disk_io.submit_spill(spill(1, [(1, 0)]))
    with pytest.raises(TransferError, match="job 1 was already submitted"):
        disk_io.submit_spill(spill(1, [(2, 1)]))  # in flight
    disk_io.wait([JobId(1)], timeout=10)
    with pytest.raises(TransferError, match="job 1 was already submitted"):
        disk_io.submit_spill(spill(1, [(2, 1)]))  # finished


def test_bad_specs_raise_at_submit(disk_io: TierIO) -> None:
    with pytest.raises(UsageError, match="out of range"):
        disk_io.submit_spill(spill(1, [(1, 999)]))
    with pytest.raises(UsageError, match="32 bytes"):
        disk_io.submit_spill(SpillSpec(JobId(2), ((b"short", SlotId(0)),)))


def test_shutdown_flushes_and_is_idempotent(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    data = fill(slab, 3, seed=3)
    syncs_before = tier.statistics().syncs
    disk_io.submit_spill(spill(1, [(1, 3)]))
    disk_io.shutdown()
    disk_io.shutdown()
    assert [c.job_id for c in disk_io.poll_finished()] == [1]
    assert tier.statistics().syncs > syncs_before and stored(tier, 1) == data
    with pytest.raises(ClosedError, match="disk io"):
        disk_io.submit_spill(spill(2, [(2, 3)]))


def test_a_tier_failing_underneath_surfaces_as_broken(
        tier: DiskTier, slab: CpuSlab, disk_io: TierIO) -> None:
    tier.close()
    disk_io.submit_spill(spill(1, [(1, 0)]))
    disk_io.wait([JobId(1)], timeout=10)
    (completion,) = disk_io.poll_finished()
    assert isinstance(completion, Completion) and not completion.ok
    assert completion.failed_keys == (key_of(1),) and "ClosedError" in (completion.error or "")
    with pytest.raises(BrokenError, match="disk tier failed underneath"):
        disk_io.submit_spill(spill(2, [(2, 0)]))
    with pytest.raises(BrokenError):
        disk_io.flush()


def test_a_broken_tier_is_named_by_its_medium_and_setting(
        tier: DiskTier, slab: CpuSlab) -> None:
    """The message names the tier the threads serve and its setting, both the tier's own
    (the remote tier's reads once said "disk tier ... check disk.path")."""
    from tierkv.tiers.remote.tier import RemoteTier

    assert (RemoteTier.medium, RemoteTier.setting) == ("remote", "remote.url")
    io = TierIO(tier, slab, write_batch_bytes=4 * PAYLOAD)
    try:
        tier.close()
        io.submit_spill(spill(1, [(1, 0)]))
        io.wait([JobId(1)], timeout=10)
        with pytest.raises(BrokenError, match="disk io: the disk tier failed underneath") \
                as info:
            io.submit_spill(spill(2, [(2, 0)]))
        assert "check disk.path" in str(info.value)
    finally:
        io.shutdown()


def test_idle_writer_syncs_periodically(tmp_path: Path, slab: CpuSlab) -> None:
    now = [0.0]
    config = DiskTierConfig(path=tmp_path, sync_every_seconds=0.02, sync_every_bytes=1 << 40)
    with DiskTier(tmp_path, NS, 0, config, PAYLOAD, clock=lambda: now[0]) as disk:
        io = TierIO(disk, slab, write_batch_bytes=4 * PAYLOAD)
        io.submit_spill(spill(1, [(1, 0)]))
        io.wait([JobId(1)], timeout=10)
        assert disk.statistics().syncs == 0  # no fsync per transaction
        now[0] = 1.0  # sync_every_seconds passed; no more writes arrive
        deadline = time.monotonic() + 5
        while disk.statistics().syncs == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert disk.statistics().syncs == 1
        io.shutdown()


def test_a_read_the_tier_cannot_serve_reports_every_key_as_not_landed(
        tier: DiskTier, disk_io: TierIO) -> None:
    tier.close()
    chunks = [ChunkCopy(key_of(i), SlotId(i), ()) for i in range(3)]
    disk_io.submit_read(JobId(1), chunks)
    with pytest.raises(BrokenError):
        disk_io.flush()  # waits for the read first
    (outcome,) = disk_io.poll_reads()
    keys = tuple(key_of(i) for i in range(3))
    assert outcome.ok_keys == () and outcome.missing_keys == keys == outcome.failed_keys
    assert not outcome.ok and "ClosedError" in (outcome.error or "")
