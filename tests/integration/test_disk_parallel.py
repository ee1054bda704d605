"""The disk tier's parallel paths: reads split across reader threads, the periodic fsync on
its own thread (never on the writer), and an index scan without read-ahead."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tierkv.config import DiskTierConfig
from tierkv.core.jobs import ChunkCopy, JobId, SlotId, SpillSpec
from tierkv.keys import Namespace
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk import readahead as disk_readahead
from tierkv.tiers.disk.tier import SHARDS, DiskTier, ReadStatus
from tierkv.transfer.tier_io import TierIO, ReadOutcome

PAYLOAD = 256 * 1024
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=4096,
               tokens_per_chunk=16)


def key_of(i: int) -> bytes:
    return bytes([0x6B]) + i.to_bytes(31, "big")


def payload_of(i: int) -> bytes:
    return random.Random(i).randbytes(PAYLOAD)


def open_tier(root: Path, **config: object) -> DiskTier:
    return DiskTier(root, NS, 0, DiskTierConfig(path=root, **config), PAYLOAD)  # type: ignore[arg-type]


@contextmanager
def advice_recorded() -> Iterator[list[tuple[int, int, int]]]:
    """Every madvise the disk tier makes meanwhile: (start, length, advice)."""
    advice: list[tuple[int, int, int]] = []
    real = disk_readahead._madvise
    assert real is not None

    def recorded(start: int, length: int, how: int) -> int:
        advice.append((start, length, how))
        return real(start, length, how)

    disk_readahead._madvise = recorded
    try:
        yield advice
    finally:
        disk_readahead._madvise = real


@pytest.mark.skipif(sys.platform != "linux", reason="the map is found through /proc/self/maps")
def test_a_scan_reads_the_index_with_the_maps_read_ahead(tmp_path: Path) -> None:
    """A restart walks the index with the map's read-ahead on: since format 4 the map holds
    little but the index, and a cold scan under MADV_RANDOM took 1.4-2x as long for 17-47%
    fewer bytes (docs/benchmarks/disk.md, "Restart per tier size")."""
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(i), payload_of(i)) for i in range(3)])
        with advice_recorded() as advice:
            assert [record.key for record in tier.scan()] == sorted(key_of(i) for i in range(3))
        out = memoryview(bytearray(PAYLOAD))
        assert tier.read_into(key_of(2), out) is ReadStatus.OK and bytes(out) == payload_of(2)
    assert advice == []  # no MADV_RANDOM around the scan


@pytest.mark.skipif(sys.platform != "linux", reason="the map is found through /proc/self/maps")
def test_opening_reads_the_meta_records_without_read_ahead(tmp_path: Path) -> None:
    """Opening checks each shard's meta records and sub-db roots: a few pages, each of
    which pulled a read-ahead window with it (52.6 MiB read to open and scan 50k chunks
    over four shards, 12.7x the index; 4.9 MiB, 1.2x, with the advice)."""
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(i), payload_of(i)) for i in range(3)])
    with advice_recorded() as advice:
        tier = open_tier(tmp_path)
    with tier:
        spans = [disk_readahead.map_span(shard._data_fd) for shard in tier._shards]
    assert advice == [(*span, how) for span in spans if span is not None for how in (1, 0)]
    assert len(advice) == 2 * SHARDS


def spill(job: int, writes: list[tuple[int, int]]) -> SpillSpec:
    return SpillSpec(JobId(job), tuple((key_of(i), SlotId(slot)) for i, slot in writes), ())


def test_one_read_job_is_split_across_reader_threads(tmp_path: Path) -> None:
    slab = CpuSlab(num_slots=40, slot_bytes=PAYLOAD, pin_memory="never")
    with open_tier(tmp_path) as tier:
        io = TierIO(tier, slab, write_batch_bytes=4 * PAYLOAD, reader_threads=4)
        try:
            for i in range(16):
                slab.memoryview(i)[:] = payload_of(i)
            io.submit_spill(spill(1, [(i, i) for i in range(16)]))
            io.wait([JobId(1)])
            readers: set[str] = set()
            original = tier.read_many_into  # a reader's share of the job: one call
            gate = threading.Barrier(4, timeout=10)

            def read_many_into(items: Sequence[tuple[bytes, Any]]) -> list[ReadStatus]:
                reader = f"{threading.current_thread().name} {threading.get_ident()}"
                if reader not in readers:
                    readers.add(reader)
                    try:
                        gate.wait()  # four threads inside at once, or this times out
                    except threading.BrokenBarrierError:
                        pass
                return original(items)

            tier.read_many_into = read_many_into  # type: ignore[method-assign]
            chunks = [ChunkCopy(key_of(i), SlotId(20 + i), (), True) for i in range(16)]
            chunks.append(ChunkCopy(key_of(99), SlotId(39), (), True))
            io.submit_read(JobId(2), chunks)
            io.wait([JobId(2)])
            (outcome,) = io.poll_reads()
            assert not gate.broken
            assert len(readers) == 4
            assert outcome.ok_keys == tuple(key_of(i) for i in range(16))  # in job order
            assert outcome.missing_keys == (key_of(99),)
            for i in range(16):
                assert bytes(slab.memoryview(20 + i)) == payload_of(i)
        finally:
            io.shutdown()


def test_periodic_fsync_runs_on_its_own_thread(tmp_path: Path) -> None:
    slab = CpuSlab(num_slots=8, slot_bytes=PAYLOAD, pin_memory="never")
    syncs: list[str] = []
    with open_tier(tmp_path, sync_every_bytes=PAYLOAD) as tier:
        original = tier.sync

        def sync() -> None:
            syncs.append(threading.current_thread().name)
            original()

        tier.sync = sync  # type: ignore[method-assign]
        io = TierIO(tier, slab, write_batch_bytes=PAYLOAD)
        try:
            for job in range(1, 6):
                slab.memoryview(job)[:] = payload_of(job)
                io.submit_spill(spill(job, [(job, job)]))
                io.wait([JobId(job)])
            for _ in range(200):
                if syncs:
                    break
                threading.Event().wait(0.01)
        finally:
            io.shutdown()
    assert syncs[0] == "tierkv-disk-sync"  # due after the first commit, synced off the writer
    assert "tierkv-disk-writer" not in syncs  # (the last one is shutdown's flush)


def test_sync_during_commits_keeps_their_bytes_unsynced(tmp_path: Path) -> None:
    """Bytes committed while an fsync runs still count toward the next sync (format 4: a
    commit may land during the slab's bulk fdatasync; the index fsync after it runs with
    the shard's commits held, so it never covers a payload not yet durable)."""
    with open_tier(tmp_path, sync_every_bytes=1 << 40, sync_every_seconds=3600) as tier:
        tier.sync_inline = False
        tier.put_many([(key_of(1), payload_of(1))])
        slab = tier._shard(key_of(0)).slab
        assert slab is not None
        real_sync = slab.sync
        raced: list[bool] = []

        def racing_sync() -> None:
            if not raced:
                raced.append(True)
                tier.put_many([(key_of(2), payload_of(2))])  # commits during the fsync
            real_sync()

        slab.sync = racing_sync  # type: ignore[method-assign]
        try:
            tier.sync()
        finally:
            del slab.sync
        assert raced and tier._unsynced_bytes == PAYLOAD


def test_small_chunks_are_not_split_into_pieces(tmp_path: Path) -> None:
    """A piece is at least 1 MiB: 16 chunks of 16 KiB are read by one thread, not four
    (a hand-off per small chunk costs more than the overlap gains)."""
    small = 16 * 1024
    slab = CpuSlab(num_slots=40, slot_bytes=small, pin_memory="never")
    with DiskTier(tmp_path, NS, 0, DiskTierConfig(path=tmp_path), small) as tier:
        io = TierIO(tier, slab, write_batch_bytes=64 * small, reader_threads=4)
        try:
            for i in range(16):
                slab.memoryview(i)[:] = payload_of(i)[:small]
            io.submit_spill(spill(1, [(i, i) for i in range(16)]))
            io.wait([JobId(1)])
            readers: list[int] = []
            original = tier.read_many_into

            def read_many_into(items: Sequence[tuple[bytes, Any]]) -> list[ReadStatus]:
                readers.append(threading.get_ident())
                threading.Event().wait(0.005)  # slow enough that idle threads would join in
                return original(items)

            tier.read_many_into = read_many_into  # type: ignore[method-assign]
            chunks = [ChunkCopy(key_of(i), SlotId(20 + i), (), True) for i in range(16)]
            io.submit_read(JobId(2), chunks)
            io.wait([JobId(2)])
            outcomes: list[ReadOutcome] = io.poll_reads()
            assert len(readers) == 1  # one call, on one thread
            assert outcomes[0].ok_keys == tuple(key_of(i) for i in range(16))
            for i in range(16):
                assert bytes(slab.memoryview(20 + i)) == payload_of(i)[:small]
        finally:
            io.shutdown()
