"""A part directory in the wrong place (issue 41, item 2): ``part-0of2`` and ``part-1of2``
swapped, or one restored where the other belongs. It holds another part's chunks, so it is
never read; like a damaged part it is skipped with one warning that names the directory,
what it holds and what was expected: at the vLLM connector's start (the scheduler's scan)
and in a worker's reader of another TP size's parts. Never a crash, never a reopen on
every read. Real LMDB environments in a temporary directory."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

import pytest

from tierkv.config import DiskTierConfig
from tierkv.core.jobs import ChunkCopy, JobId, SlotId
from tierkv.integrations.vllm_config import ConnectorSettings
from tierkv.integrations.vllm_geometry import Geometry
from tierkv.tiers.disk.opener import OtherParts
from tierkv.tiers.disk.files import OWNER_FILE
from tierkv.integrations.vllm_scheduler import SchedulerSide
from tierkv.keys import Namespace, Part
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.tier import DiskTier
from tierkv.transfer.parts import HeadLayout, PartReader
from tierkv.transfer.tier_io import ReadOutcome, TierIO

NAMESPACE = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=2048,
                      tokens_per_chunk=32)
MODEL_CHUNK = 4096  # one chunk of both heads: a TP = 1 engine's value
HALF = MODEL_CHUNK // 2  # one part of two (one head)


def geometry(world_size: int) -> Geometry:
    """Two KV heads, two layers, chunks of 4096 bytes in all (each rank's its share)."""
    return Geometry(layer_names=("a", "b"), block_size=16, hash_block_size=16,
                    blocks_per_chunk=2, page_bytes=1024 // world_size, num_heads=2 // world_size,
                    content_bytes=32, dtype="float16", layout="LBNHC", page_order="NHD",
                    world_size=world_size, num_slots=8, disk_capacity=100)


def key(i: int, salt: int = 0) -> bytes:
    return bytes([i, salt]) * 16


def write(root: Path, part: Part, keys: list[bytes], payload_bytes: int) -> None:
    with DiskTier(root, NAMESPACE, part, DiskTierConfig(path=root, max_bytes=1 << 24),
                  payload_bytes) as tier:
        assert len(tier.put_many([(k, bytes([part.index + 1]) * payload_bytes)
                                  for k in keys]).written) == len(keys)


def two_parts(root: Path, keys: list[bytes]) -> Path:
    """A TP = 2 engine's chunks (both parts); returns the namespace directory."""
    for index in (0, 1):
        write(root, Part(index, 2), keys, HALF)
    return StoreLayout(root).namespace_dir(NAMESPACE.fingerprint())


def swap(ns_dir: Path) -> None:
    (ns_dir / "part-0of2").rename(ns_dir / "swap")
    (ns_dir / "part-1of2").rename(ns_dir / "part-0of2")
    (ns_dir / "swap").rename(ns_dir / "part-1of2")


def scheduler(root: Path, world_size: int) -> SchedulerSide:
    settings = ConnectorSettings(disk_path=str(root), disk_bytes=1 << 24)
    return SchedulerSide(settings, geometry(world_size), NAMESPACE)


def misplaced_warnings(caplog: pytest.LogCaptureFixture, directory: Path) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno == logging.WARNING and str(directory) in record.getMessage()
            and "holds format version" in record.getMessage()]


def test_swapped_parts_of_another_tp_size_are_skipped_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A TP = 1 engine starts beside a TP = 2 engine's swapped parts: it used to raise
    NamespaceMismatchError from the scheduler's start-up scan."""
    ns_dir = two_parts(tmp_path, [key(i, 2) for i in range(4)])
    own = [key(i, 1) for i in range(3)]
    write(tmp_path, Part(0, 1), own, MODEL_CHUNK)
    swap(ns_dir)
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        side = scheduler(tmp_path, world_size=1)
    try:
        assert side.found_on_disk == len(own) and side.found_on_disk_elsewhere == 0
        assert side.index.lookup(own).num_hits == len(own)
    finally:
        side.shutdown()
    (warning,) = misplaced_warnings(caplog, ns_dir / "part-0of2" / "shard-0")
    assert "part '1of2', shard 0; expected" in warning and "part 0of2" in warning
    assert sorted(path.name for path in ns_dir.iterdir() if path.is_dir()) == [
        "part-0of1", "part-0of2", "part-1of2"]  # another engine's: nothing moved or deleted


def test_swapped_own_parts_claimed_by_their_workers_are_skipped_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A TP = 2 engine's own parts swapped while its workers hold them (their claims):
    the scheduler may not move them aside, and used to raise NamespaceMismatchError."""
    ns_dir = two_parts(tmp_path, [key(i) for i in range(4)])
    swap(ns_dir)
    fds = [os.open(shard / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o600)
           for part in ("part-0of2", "part-1of2")
           for shard in StoreLayout.shard_dirs(ns_dir / part)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the workers hold them
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            side = scheduler(tmp_path, world_size=2)
        try:
            assert side.found_on_disk == 0
        finally:
            side.shutdown()
    finally:
        for fd in fds:
            os.close(fd)
    for part in ("part-0of2", "part-1of2"):
        assert len(misplaced_warnings(caplog, ns_dir / part / "shard-0")) == 1
    assert not list(ns_dir.glob("**/*.foreign-*"))  # a worker's: not moved by the scheduler


def test_a_part_restored_to_the_wrong_place_is_a_miss_for_the_other_tp_reader(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A TP = 1 worker loads a TP = 2 engine's chunk; ``part-1of2`` was restored from a
    copy of ``part-0of2``. The read job used to fail with NamespaceMismatchError (the disk
    reader then broken), and every read reopened the part."""
    chunk = key(7, 2)
    ns_dir = two_parts(tmp_path, [chunk])
    shutil.rmtree(ns_dir / "part-1of2")
    shutil.copytree(ns_dir / "part-0of2", ns_dir / "part-1of2")
    config = DiskTierConfig(path=tmp_path, max_bytes=1 << 24)
    slab = CpuSlab(num_slots=2, slot_bytes=MODEL_CHUNK, pin_memory="never")
    other = OtherParts(NAMESPACE, config, MODEL_CHUNK)
    layout = HeadLayout(pieces=1, outer=1, head_bytes=HALF, model_heads=2)
    reader = PartReader(layout, Part(0, 1), lambda count: other)
    outcomes: list[ReadOutcome] = []
    with DiskTier(tmp_path, NAMESPACE, Part(0, 1), config, MODEL_CHUNK) as own:
        io = TierIO(own, slab, write_batch_bytes=1 << 20, reader_threads=1,
                    other_parts=reader.read)
        try:
            with caplog.at_level(logging.WARNING, logger="tierkv"):
                for job in (1, 2):
                    io.submit_read(JobId(job), [ChunkCopy(chunk, SlotId(0), (), parts=2)])
                    io.wait([JobId(job)])
                    outcomes += io.poll_reads()
        finally:
            io.shutdown()
            other.close()
    for outcome in outcomes:
        assert outcome.error is None and outcome.missing_keys == (chunk,), outcome
        assert outcome.failed_keys == () and outcome.ok_keys == ()
    counts = other.counts()
    assert counts.skipped == 1 and counts.opened == 1  # part 0 read; part 1 opened once
    (warning,) = misplaced_warnings(caplog, ns_dir / "part-1of2" / "shard-0")
    assert "part '0of2', shard 0; expected" in warning and "part 1of2" in warning
