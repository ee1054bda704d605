"""Slab payloads are read with O_DIRECT straight into a page-aligned buffer, in pieces many
at a time under a bound of bytes in flight (tierkv.tiers.disk.reads), many chunks of one
caller at once (tierkv.tiers.disk.many), and buffered where
the filesystem refuses O_DIRECT or the buffer is not aligned: every path serves the exact
bytes, and every read keeps the slot-header check (real LMDB and slab files)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tierkv.config import DiskTierConfig
from tierkv.errors import ClosedError
from tierkv.core.jobs import ChunkCopy, JobId, SlotId
from tierkv.keys import Namespace
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.disk import slab as slab_module
from tierkv.tiers.disk.reads import MIN_PIECE_BYTES, ReadPool
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.tier import DiskTier, shard_of
from tierkv.transfer.tier_io import ReadOutcome, TierIO

# A payload with a tail that is no whole 4 KiB block, larger than one piece.
PAYLOAD = 3 * MIN_PIECE_BYTES * 4 + 100


def namespace(payload: int) -> Namespace:
    return Namespace(model_id="direct", dtype="float16", kv_layout="NHD", page_bytes=payload,
                     tokens_per_chunk=16)


def value(index: int, size: int) -> bytes:
    return random.Random(index).randbytes(size)


def key(index: int) -> bytes:
    return bytes([0x5A]) + index.to_bytes(31, "big")


def open_tier(root: Path, size: int, **config: object) -> DiskTier:
    return DiskTier(root, namespace(size), 0, DiskTierConfig(path=root, max_bytes=64 << 20,
                                                             **config), size)  # type: ignore[arg-type]


def aligned(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, size))  # anonymous maps are page-aligned


@pytest.mark.parametrize("size", [64 << 10, (64 << 10) + 100, PAYLOAD])
def test_direct_reads_serve_exact_bytes_into_aligned_and_unaligned_buffers(
        tmp_path: Path, size: int) -> None:
    with open_tier(tmp_path, size) as tier:
        tier.put_many([(key(i), value(i, size)) for i in range(6)])
        pieces = tier._reads.pieces
        for index in range(6):
            out = aligned(size)
            assert tier.read_into(key(index), out) is ReadStatus.OK
            assert bytes(out) == value(index, size)
            unaligned = memoryview(bytearray(size + 1))[1:]  # buffered: not page-aligned
            assert tier.read_into(key(index), unaligned) is ReadStatus.OK
            assert bytes(unaligned) == value(index, size)
        read_pieces = tier._reads.pieces - pieces
    # The large payload was read in pieces on the pool, the small ones on the caller alone.
    assert (read_pieces > 0) == (size > ReadPool.piece_for(size))


def test_a_damaged_slot_read_directly_is_still_refused(tmp_path: Path) -> None:
    with open_tier(tmp_path, PAYLOAD) as tier:
        tier.put_many([(key(1), value(1, PAYLOAD))])
        slab_path = next(tmp_path.rglob("slab-0.kv"))
    with open(slab_path, "r+b") as handle:  # a byte of the payload's last piece flipped
        handle.seek(4096 + PAYLOAD - 50)
        byte = handle.read(1)
        handle.seek(4096 + PAYLOAD - 50)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with open_tier(tmp_path, PAYLOAD) as tier:
        assert tier.read_into(key(1), aligned(PAYLOAD)) is ReadStatus.CORRUPT


def test_a_filesystem_that_refuses_o_direct_is_read_buffered_and_said_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """tmpfs (before Linux 6.6) and some FUSE filesystems refuse O_DIRECT at open; others
    take the open and refuse the read (EINVAL). Either way reads are buffered, exact, and
    the refusal is logged once per filesystem."""
    with open_tier(tmp_path, PAYLOAD) as tier:
        tier.put_many([(key(i), value(i, PAYLOAD)) for i in range(3)])
    real_open, real_preadv = os.open, os.preadv
    direct_fds: set[int] = set()

    def refusing_open(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    def refusing_preadv(fd: int, buffers: object, offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)  # type: ignore[arg-type]

    def tracking_open(path: object, flags: int, *args: object) -> int:
        fd = real_open(path, flags, *args)  # type: ignore[arg-type]
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    for opener, reader in ((refusing_open, real_preadv), (tracking_open, refusing_preadv)):
        slab_module._REFUSED.clear()
        caplog.clear()
        monkeypatch.setattr(slab_module.os, "open", opener)
        monkeypatch.setattr(slab_module.os, "preadv", reader)
        with caplog.at_level(logging.INFO, logger="tierkv.disk"):
            with open_tier(tmp_path, PAYLOAD) as tier:
                for index in (0, 1, 2, 0):
                    out = aligned(PAYLOAD)
                    assert tier.read_into(key(index), out) is ReadStatus.OK
                    assert bytes(out) == value(index, PAYLOAD)
                outs = [aligned(PAYLOAD) for _ in range(3)]  # many in flight: the same
                assert tier.read_many_into([(key(i), outs[i]) for i in range(3)]) == \
                    [ReadStatus.OK] * 3
                assert [bytes(out) for out in outs] == [value(i, PAYLOAD) for i in range(3)]
        refusals = [r for r in caplog.records if "refused O_DIRECT" in r.getMessage()]
        assert len(refusals) == 1
        monkeypatch.undo()
        for fd in direct_fds:  # closed with the tier (a refused read once leaked it)
            with pytest.raises(OSError):
                os.fstat(fd)
        direct_fds.clear()


def test_the_pieces_in_flight_never_pass_the_bound() -> None:
    """Six pieces of 1 MiB under a 3 MiB bound: three run at once, the submitter waits for
    room, and all six finish (no clock: the calls block on an event the test sets)."""
    pool = ReadPool(3 << 20)
    gate, changed = threading.Event(), threading.Condition()
    active, most = [0], [0]

    def call() -> int:
        with changed:
            active[0] += 1
            most[0] = max(most[0], active[0])
            changed.notify_all()
        gate.wait()
        with changed:
            active[0] -= 1
        return 1

    results: list[int] = []
    submitter = threading.Thread(target=lambda: results.extend(
        ReadPool.gather(pool.submit([(1 << 20, call)] * 6))))
    submitter.start()
    with changed:
        assert changed.wait_for(lambda: active[0] == 3, timeout=60)
    with pool._cond:
        assert pool._cond.wait_for(lambda: pool.waits >= 1, timeout=60)  # the 4th waits
    assert active[0] == 3
    gate.set()
    submitter.join(timeout=60)
    pool.close()
    assert results == [1] * 6 and most[0] == 3


SMALL = 128 << 10  # a chunk no larger than a piece: read in one call, no pieces


def test_one_reader_keeps_many_small_chunks_in_flight_up_to_the_bound(tmp_path: Path) -> None:
    """read_many_into starts every chunk's read before it checks the first: what one caller
    thread has started and not yet checked reaches the bytes-in-flight bound (a reader that
    read one chunk at a time held one), each chunk is one call on the pool (no pieces, one
    hand-off), and every byte served is exact."""
    count, bound = 40, 1 << 20
    with open_tier(tmp_path, SMALL, read_bytes_in_flight=bound) as tier:
        tier.put_many([(key(i), value(i, SMALL)) for i in range(count)])
        outs = [aligned(SMALL) for _ in range(count)]
        pool = tier._reads
        statuses = tier.read_many_into([(key(i), outs[i]) for i in range(count)])
        assert statuses == [ReadStatus.OK] * count
        assert [bytes(out) for out in outs] == [value(i, SMALL) for i in range(count)]
        per_chunk = SMALL + 4096  # the payload and its header block
        assert pool.deepest == (bound // per_chunk) * per_chunk  # filled, never past it
        assert pool.pieces == count
        stats = tier.statistics()
        assert (stats.reads, stats.hits, stats.bytes_read) == (count, count, count * SMALL)


@pytest.mark.parametrize("size", [SMALL, PAYLOAD])
def test_reading_many_answers_each_chunk_as_read_into_would(tmp_path: Path, size: int) -> None:
    """Good, missing and damaged chunks in one call: each status is read_into's (a damaged
    slot is CORRUPT and deleted, its neighbours OK), small and large payloads (a chunk alone
    in its shard is read in pieces), into aligned (O_DIRECT) and unaligned (buffered)
    buffers."""
    victim = 3
    with open_tier(tmp_path, size) as tier:
        tier.put_many([(key(i), value(i, size)) for i in range(8)])
        lm = tier._shard(key(victim))
        raw = lm.run("test", lambda env: env.begin(db=lm.index).get(key(victim)))
        entry = tier._entry_of(lm, key(victim), raw)
        assert not isinstance(entry, str) and lm.slab is not None
        slab_path, offset = lm.slab.path, entry.slot * lm.slab.slot_bytes + 4096 + size - 7
    with open(slab_path, "r+b") as handle:  # a byte of the payload's last block flipped
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with open_tier(tmp_path, size) as tier:
        wanted = [*range(8), 99]  # 99 was never written
        for make in (aligned, lambda n: memoryview(bytearray(n + 1))[1:]):
            outs = [make(size) for _ in wanted]
            statuses = tier.read_many_into([(key(i), out) for i, out in zip(wanted, outs)])
            for i, status, out in zip(wanted, statuses, outs):
                if i == 99 or (i == victim and make is not aligned):  # deleted by then
                    assert status is ReadStatus.MISSING
                elif i == victim:
                    assert status is ReadStatus.CORRUPT
                else:
                    assert status is ReadStatus.OK and bytes(out) == value(i, size)
        assert tier.statistics().corrupt == 1


def test_a_read_job_of_many_small_chunks_fills_the_bound_from_one_reader_thread(
        tmp_path: Path) -> None:
    """TierIO's reader hands its share of a job to the disk tier in one call: one reader
    thread alone keeps the bound's worth of small chunks in flight, one pool call each, and
    lands every chunk's exact bytes in its CPU slot."""
    count, bound = 20, 1 << 20
    keys = [k for k in (key(i) for i in range(400)) if shard_of(k) == shard_of(key(0))][:count]
    assert len(keys) == count
    slab = CpuSlab(num_slots=count, slot_bytes=SMALL, pin_memory="never")
    with open_tier(tmp_path, SMALL, read_bytes_in_flight=bound) as tier:
        tier.put_many([(k, value(i, SMALL)) for i, k in enumerate(keys)])
        io = TierIO(tier, slab, write_batch_bytes=8 * SMALL, reader_threads=1)
        io.submit_read(JobId(1), [ChunkCopy(k, SlotId(i), ()) for i, k in enumerate(keys)])
        io.wait([JobId(1)], timeout=60)
        io.shutdown()
        (outcome,) = io.poll_reads()
        assert outcome.ok and len(outcome.ok_keys) == count
        assert [bytes(slab.memoryview(i)) for i in range(count)] == \
            [value(i, SMALL) for i in range(count)]
        per_chunk = SMALL + 4096
        assert tier._reads.deepest == (bound // per_chunk) * per_chunk
        assert tier._reads.pieces == count


def test_many_small_read_jobs_queued_are_read_in_one_call_up_to_the_bound(
        tmp_path: Path) -> None:
    """Jobs of one chunk each (many requests) queued while the reader is busy: it hands the
    tier the ones that fit the bound in one read_many_into, not one call per job, and each
    job still gets its own outcome with exact bytes (no clock: the first call waits on an
    event the test sets once the rest are queued)."""
    count, bound = 21, 1 << 20
    slab = CpuSlab(num_slots=count, slot_bytes=SMALL, pin_memory="never")
    with open_tier(tmp_path, SMALL, read_bytes_in_flight=bound) as tier:
        tier.put_many([(key(i), value(i, SMALL)) for i in range(count)])
        io = TierIO(tier, slab, write_batch_bytes=8 * SMALL, reader_threads=1)
        calls: list[int] = []
        entered, gate = threading.Event(), threading.Event()
        original = tier.read_many_into

        def read_many_into(items: Sequence[tuple[bytes, Any]]) -> list[ReadStatus]:
            calls.append(len(items))
            entered.set()
            gate.wait()
            return original(items)

        tier.read_many_into = read_many_into  # type: ignore[method-assign]
        io.submit_read(JobId(0), [ChunkCopy(key(0), SlotId(0), ())])
        assert entered.wait(timeout=60)  # the reader is inside its first call
        for i in range(1, count):
            io.submit_read(JobId(i), [ChunkCopy(key(i), SlotId(i), ())])
        gate.set()
        io.wait([JobId(i) for i in range(count)], timeout=60)
        io.shutdown()
        outcomes: list[ReadOutcome] = io.poll_reads()
        assert calls == [1, 8, 8, 4]  # 8 chunks of 128 KiB fill the 1 MiB bound
        assert sorted(o.job_id for o in outcomes) == list(range(count))
        assert all(o.ok and o.num_bytes == SMALL for o in outcomes)
        assert [bytes(slab.memoryview(i)) for i in range(count)] == \
            [value(i, SMALL) for i in range(count)]


def slot_at(tier: DiskTier, k: bytes) -> tuple[Path, int]:
    """(the slab file, the offset of the slot) that ``k``'s index entry names."""
    lm = tier._shard(k)
    raw = lm.run("test", lambda env: env.begin(db=lm.index).get(k))
    entry = tier._entry_of(lm, k, raw)
    assert not isinstance(entry, str) and lm.slab is not None
    return lm.slab.path, entry.slot * lm.slab.slot_bytes


def test_one_window_of_reads_spans_the_shards_and_checks_every_slot(tmp_path: Path) -> None:
    """A call whose chunks lie in every shard keeps them all in flight at once (a window
    that drained at each shard's end held one shard's three), and still checks each slot:
    a slot in a middle shard carrying another write's valid header and a slot whose payload
    lost a byte are each CORRUPT, counted and deleted; every other chunk is served exact."""
    bound = 4 << 20
    wanted = list(range(12))  # three chunks in each of the four shards, interleaved

    def key(i: int) -> bytes:  # its first byte picks the shard
        return bytes([i]) + bytes([0x5A]) * 31

    chosen = {shard: [i for i in wanted if shard_of(key(i)) == shard] for shard in range(4)}
    assert all(len(ids) == 3 for ids in chosen.values())
    stale, flipped = chosen[1][1], chosen[2][0]
    with open_tier(tmp_path, SMALL, read_bytes_in_flight=bound) as tier:
        tier.put_many([(key(i), value(i, SMALL)) for i in wanted])
        (slab_1, stale_at), (_, donor_at) = slot_at(tier, key(stale)), \
            slot_at(tier, key(chosen[1][0]))
        slab_2, flipped_at = slot_at(tier, key(flipped))
    with open(slab_1, "r+b") as handle:  # a valid header, of another write
        handle.seek(donor_at)
        header = handle.read(4096)
        handle.seek(stale_at)
        handle.write(header)
    with open(slab_2, "r+b") as handle:
        handle.seek(flipped_at + 4096 + 5000)
        byte = handle.read(1)
        handle.seek(flipped_at + 4096 + 5000)
        handle.write(bytes([byte[0] ^ 0x01]))
    with open_tier(tmp_path, SMALL, read_bytes_in_flight=bound) as tier:
        outs = [aligned(SMALL) for _ in wanted]
        statuses = tier.read_many_into([(key(i), out) for i, out in zip(wanted, outs)])
        per_chunk = SMALL + 4096
        assert tier._reads.deepest == len(wanted) * per_chunk  # all four shards' at once
        for i, status, out in zip(wanted, statuses, outs):
            if i in (stale, flipped):
                assert status is ReadStatus.CORRUPT
            else:
                assert status is ReadStatus.OK and bytes(out) == value(i, SMALL)
        stats = tier.statistics()
        assert (stats.corrupt, stats.hits, stats.misses) == (2, len(wanted) - 2, 2)
        assert tier.read_many_into([(key(stale), outs[0]), (key(flipped), outs[1])]) == \
            [ReadStatus.MISSING, ReadStatus.MISSING]  # deleted


def spread_key(i: int) -> bytes:
    """A key in shard ``i % 4`` (its first byte picks the shard)."""
    return bytes([i % 256]) + bytes([0xA5]) + i.to_bytes(30, "big")


def test_a_later_shard_that_fails_raises_its_own_error_and_leaves_no_read_running(
        tmp_path: Path) -> None:
    """The window spans shards, each shard's call inside the one before: an error of a later
    shard reaches the caller as itself (naming that shard), not as the earlier shards'
    problem, and no read started for any shard is still running when it does."""
    with open_tier(tmp_path, SMALL) as tier:
        tier.put_many([(spread_key(i), value(i, SMALL)) for i in range(8)])
        tier._shards[2].close(sync=False)
        outs = [aligned(SMALL) for _ in range(8)]
        with pytest.raises(ClosedError, match="shard 2|shard-2"):
            tier.read_many_into([(spread_key(i), outs[i]) for i in range(8)])
        assert tier._reads._in_flight == 0
        assert tier.read_many_into([(spread_key(i), outs[i]) for i in (0, 1, 3)]) == \
            [ReadStatus.OK] * 3


def test_cross_shard_windows_stay_live_beside_writers_and_exclusive_sections(
        tmp_path: Path) -> None:
    """Readers whose calls hold several shards' sections at once, writers of other keys, and
    a thread per shard taking its exclusive section over and over (what a repair or a map
    adoption does), all at once: every call finishes (the lock order of
    tierkv.tiers.disk.many) and every chunk read is exact."""
    count, rounds = 16, 8
    tier = open_tier(tmp_path, SMALL, read_bytes_in_flight=1 << 20)
    tier.put_many([(spread_key(i), value(i, SMALL)) for i in range(count)])
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader(seed: int) -> None:
        order = list(range(count))
        outs = [aligned(SMALL) for _ in order]
        try:
            for _ in range(rounds):
                random.Random(seed).shuffle(order)
                seed += 1
                assert tier.read_many_into([(spread_key(i), outs[n]) for n, i in
                                            enumerate(order)]) == [ReadStatus.OK] * count
                assert all(bytes(outs[n]) == value(i, SMALL) for n, i in enumerate(order))
        except BaseException as exc:
            errors.append(exc)

    def writer() -> None:
        i = count
        while not stop.is_set():
            tier.put_many([(spread_key(i + j), value(j, SMALL)) for j in range(4)])
            i += 4

    def exclusive(shard: int) -> None:
        guard = tier._shards[shard]._guard
        while not stop.is_set():
            with guard.exclusive():
                pass

    # daemons, and the tier left open if they hang: a deadlock fails the test, not the run
    readers = [threading.Thread(target=reader, args=(seed * 1000,), daemon=True)
               for seed in range(3)]
    others = [threading.Thread(target=writer, daemon=True)] + \
        [threading.Thread(target=exclusive, args=(shard,), daemon=True)
         for shard in range(4)]
    for thread in readers + others:
        thread.start()
    deadline = time.monotonic() + 120  # a hang detector, not a speed bound
    for thread in readers:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stop.set()
    for thread in others:
        thread.join(timeout=max(1.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in readers + others), "deadlocked"
    tier.close()
    assert not errors, errors
