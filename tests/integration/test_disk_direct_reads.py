"""Slab payloads are read with O_DIRECT straight into a page-aligned buffer, in pieces many
at a time under a bound of bytes in flight (tierkv.tiers.disk.reads), and buffered where
the filesystem refuses O_DIRECT or the buffer is not aligned: every path serves the exact
bytes, and every read keeps the slot-header check (real LMDB and slab files)."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import threading
from pathlib import Path

import pytest

from tierkv.config import DiskTierConfig
from tierkv.keys import Namespace
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.disk import slab as slab_module
from tierkv.tiers.disk.reads import MIN_PIECE_BYTES, ReadPool
from tierkv.tiers.disk.tier import DiskTier

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
