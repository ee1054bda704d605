"""The disk tier's parallel paths: payloads read by pread, reads split across reader threads,
the periodic fsync on its own thread (never on the writer)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import lmdb
import pytest

from tierkv.config import DiskTierConfig
from tierkv.core.jobs import ChunkCopy, JobId, SlotId, SpillSpec
from tierkv.keys import Namespace
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk import PREAD_MIN_BYTES, DiskTier, ReadStatus
from tierkv.tiers.disk_env import LmdbEnv
from tierkv.transfer.disk_io import DiskIO, ReadOutcome

PAYLOAD = 4 * PREAD_MIN_BYTES  # large enough for the pread path
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=4096,
               tokens_per_chunk=16)


def key_of(i: int) -> bytes:
    return bytes([0x6B]) + i.to_bytes(31, "big")


def payload_of(i: int) -> bytes:
    return random.Random(i).randbytes(PAYLOAD)


def open_tier(root: Path, **config: object) -> DiskTier:
    return DiskTier(root, NS, 0, DiskTierConfig(path=root, **config), PAYLOAD)  # type: ignore[arg-type]


class CountingEnv:
    """Counts what ``LmdbEnv.pread_value`` answered, for one test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: list[bool] = []
        original = LmdbEnv.pread_value

        def counted(env: LmdbEnv, *args: object) -> bool:
            answer = original(env, *args)  # type: ignore[arg-type]
            self.answers.append(answer)
            return answer

        monkeypatch.setattr(LmdbEnv, "pread_value", counted)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="pread path needs Linux")
def test_large_payloads_are_read_by_pread_byte_exact(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingEnv(monkeypatch)
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(i), payload_of(i)) for i in range(6)])
        out = memoryview(bytearray(PAYLOAD + 100))
        for i in range(6):
            assert tier.read_into(key_of(i), out) is ReadStatus.OK
            assert bytes(out[:PAYLOAD]) == payload_of(i)
    assert counting.answers == [True] * 6  # every payload came by pread


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="pread path needs Linux")
def test_a_wrong_map_offset_falls_back_to_the_map(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingEnv(monkeypatch)
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(i), payload_of(i)) for i in range(3)])
        out = memoryview(bytearray(PAYLOAD))
        assert tier.read_into(key_of(0), out) is ReadStatus.OK
        env = tier._lmdb
        assert env._map_span is not None
        start, end, generation = env._map_span
        env._map_span = (start - 4096, end, generation)  # every offset now 4 KiB off
        for i in range(3):
            assert tier.read_into(key_of(i), out) is ReadStatus.OK  # never a false corrupt
            assert bytes(out) == payload_of(i)
        assert tier.statistics().corrupt == 0
    assert counting.answers[1] is False  # the wrong offset was caught, then found again
    assert counting.answers[2:] == [True, True]


def test_a_flipped_payload_byte_is_corrupt_on_the_pread_path(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(1), payload_of(1))])
        path = tier.path / "data.mdb"
    raw = bytearray(path.read_bytes())
    where = raw.find(payload_of(1)[:64])
    assert where > 0
    raw[where + PAYLOAD // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with open_tier(tmp_path) as tier:
        out = memoryview(bytearray(PAYLOAD))
        assert tier.read_into(key_of(1), out) is ReadStatus.CORRUPT
        assert tier.read_into(key_of(1), out) is ReadStatus.MISSING  # deleted, counted
        assert tier.statistics().corrupt == 1


def test_environment_maps_without_readahead(tmp_path: Path) -> None:
    """A restart reads the pages it touches, not megabytes of read-ahead around them."""
    with open_tier(tmp_path) as tier:
        assert tier._lmdb._env is not None
        assert tier._lmdb._env.flags()["readahead"] is False


def spill(job: int, writes: list[tuple[int, int]]) -> SpillSpec:
    return SpillSpec(JobId(job), tuple((key_of(i), SlotId(slot)) for i, slot in writes), ())


def test_one_read_job_is_split_across_reader_threads(tmp_path: Path) -> None:
    slab = CpuSlab(num_slots=40, slot_bytes=PAYLOAD, pin_memory="never")
    with open_tier(tmp_path) as tier:
        io = DiskIO(tier, slab, write_batch_bytes=4 * PAYLOAD, reader_threads=4)
        try:
            for i in range(16):
                slab.memoryview(i)[:] = payload_of(i)
            io.submit_spill(spill(1, [(i, i) for i in range(16)]))
            io.wait([JobId(1)])
            readers: set[str] = set()
            original = tier.read_into
            gate = threading.Barrier(4, timeout=10)

            def read_into(key: bytes, out: memoryview) -> ReadStatus:
                reader = f"{threading.current_thread().name} {threading.get_ident()}"
                if reader not in readers:
                    readers.add(reader)
                    try:
                        gate.wait()  # four threads inside at once, or this times out
                    except threading.BrokenBarrierError:
                        pass
                return original(key, out)

            tier.read_into = read_into  # type: ignore[method-assign]
            outcomes: list[ReadOutcome] = []
            chunks = [ChunkCopy(key_of(i), SlotId(20 + i), (), True) for i in range(16)]
            chunks.append(ChunkCopy(key_of(99), SlotId(39), (), True))
            io.submit_read(JobId(2), chunks, outcomes.append)
            io.wait([JobId(2)])
            (outcome,) = outcomes
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
        io = DiskIO(tier, slab, write_batch_bytes=PAYLOAD)
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
    """Bytes committed while an fsync runs still count toward the next sync."""
    with open_tier(tmp_path, sync_every_bytes=1 << 40, sync_every_seconds=3600) as tier:
        tier.sync_inline = False
        tier.put_many([(key_of(1), payload_of(1))])
        env = tier._lmdb._env
        assert env is not None
        real_sync = lmdb.Environment.sync

        class Racing:
            def __getattr__(self, name: str) -> object:
                return getattr(env, name)

            def sync(self, force: bool = False) -> None:
                tier.put_many([(key_of(2), payload_of(2))])  # commits during the fsync
                real_sync(env, force)

        tier._lmdb._env = Racing()  # type: ignore[assignment]
        try:
            tier.sync()
        finally:
            tier._lmdb._env = env
        assert tier._unsynced_bytes == PAYLOAD
