"""The disk tier's shards: one LMDB environment per shard of a part, written in parallel.

Keys here are made to land in a chosen shard (``shard_of`` is the key's first byte modulo
``SHARDS``). To hold one shard's writer still, a test opens a write transaction on that
shard's environment: LMDB lets one writer in at a time, per environment.
"""

from __future__ import annotations

import fcntl
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest

from tierkv.config import DiskTierConfig
from tierkv.core.jobs import JobId, SlotId, SpillSpec
from tierkv.errors import ConfigError
from tierkv.keys import Namespace
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.tier import SHARDS, DiskTier, ReadStatus, shard_of
from tierkv.tiers.disk.files import OWNER_FILE
from tierkv.tiers.disk.format import (HEADER_BLOCK, IndexEntry, pack_index, seal,
                                      slot_bytes_for)
from tierkv.tiers.disk.slab import SLAB_NAME
from tierkv.transfer.tier_io import TierIO

PAYLOAD = 16 * 1024
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=1024,
               tokens_per_chunk=16)


def key_in(shard: int, i: int) -> bytes:
    key = bytes([shard]) + i.to_bytes(31, "big")
    assert shard_of(key) == shard
    return key


def payload_of(key: bytes) -> bytes:
    return random.Random(key).randbytes(PAYLOAD)


def open_tier(root: Path) -> DiskTier:
    return DiskTier(root, NS, 0, DiskTierConfig(path=root), PAYLOAD)


def read(tier: DiskTier, key: bytes) -> tuple[ReadStatus, bytes]:
    out = bytearray(PAYLOAD)
    return tier.read_into(key, memoryview(out)), bytes(out)


@contextmanager
def shard_blocked(tier: DiskTier, shard: int) -> Iterator[None]:
    txn = tier._shards[shard]._env.begin(write=True)  # that shard's single-writer lock
    try:
        yield
    finally:
        txn.abort()


def stored_keys(env_dir: Path) -> set[bytes]:
    env = lmdb.open(str(env_dir), max_dbs=4, readonly=True)
    try:
        with env.begin(db=env.open_db(b"index", create=False)) as txn:
            return {bytes(key) for key, _ in txn.cursor()}
    finally:
        env.close()


def test_each_chunk_lives_in_the_environment_of_its_shard(tmp_path: Path) -> None:
    keys = [key_in(shard, i) for shard in range(SHARDS) for i in range(3)]
    with open_tier(tmp_path) as tier:
        result = tier.put_many([(key, payload_of(key)) for key in keys])
        assert result.written == tuple(keys) and tier.statistics().write_txns == SHARDS
        paths = tier.shard_paths
    assert [path.name for path in paths] == [f"shard-{s}" for s in range(SHARDS)]
    assert all(path.parent == tmp_path / f"ns-{NS.fingerprint()}" / "part-0of1" for path in paths)
    for shard, path in enumerate(paths):
        assert stored_keys(path) == {key for key in keys if shard_of(key) == shard}
    with open_tier(tmp_path) as tier:  # a restart finds every shard's chunks
        assert sorted(record.key for record in tier.scan()) == sorted(keys)
        assert tier.statistics().chunks == len(keys)
        for key in keys:
            assert read(tier, key) == (ReadStatus.OK, payload_of(key))
        assert tier.delete_many(keys[::2]) == len(keys[::2])
        assert tier.statistics().chunks == len(keys) - len(keys[::2])


def test_write_sequences_are_unique_and_follow_the_write_order_across_shards(
        tmp_path: Path) -> None:
    order = [key_in(i % SHARDS, i) for i in range(24)]
    random.Random(3).shuffle(order)
    with open_tier(tmp_path) as tier:
        for key in order:
            tier.put_many([(key, payload_of(key))])
        records = list(tier.scan())
    assert len({record.seq for record in records}) == len(order)
    assert [record.key for record in sorted(records, key=lambda r: r.seq)] == order


def test_a_blocked_shard_does_not_hold_up_writes_to_the_others(tmp_path: Path) -> None:
    """One writer thread per shard: a spill to shard 1 lands while shard 0's writer waits
    (with one environment, and one writer, it waited behind it). Completions still come
    in submission order."""
    slab = CpuSlab(num_slots=4, slot_bytes=PAYLOAD, pin_memory="never")
    slow, fast = key_in(0, 1), key_in(1, 2)
    slab.memoryview(0)[:] = payload_of(slow)
    slab.memoryview(1)[:] = payload_of(fast)
    with open_tier(tmp_path) as tier:
        io = TierIO(tier, slab, write_batch_bytes=4 * PAYLOAD)
        try:
            with shard_blocked(tier, 0):
                io.submit_spill(SpillSpec(JobId(1), ((slow, SlotId(0)),)))
                io.submit_spill(SpillSpec(JobId(2), ((fast, SlotId(1)),)))
                deadline = time.monotonic() + 10
                while read(tier, fast)[0] is not ReadStatus.OK:
                    assert time.monotonic() < deadline, "shard 1 waited for shard 0"
                    time.sleep(0.005)
                assert read(tier, slow)[0] is ReadStatus.MISSING
                assert io.poll_finished() == []  # job 1 comes first
            io.wait([JobId(1), JobId(2)], timeout=10)
            assert [c.job_id for c in io.poll_finished()] == [1, 2]
        finally:
            io.shutdown()
        assert read(tier, slow) == (ReadStatus.OK, payload_of(slow))


def test_a_job_over_several_shards_is_reported_once_all_landed(tmp_path: Path) -> None:
    slab = CpuSlab(num_slots=8, slot_bytes=PAYLOAD, pin_memory="never")
    keys = [key_in(shard, 7) for shard in range(SHARDS)]
    old = key_in(2, 99)
    for slot, key in enumerate(keys):
        slab.memoryview(slot)[:] = payload_of(key)
    with open_tier(tmp_path) as tier:
        tier.put_many([(old, payload_of(old))])
        io = TierIO(tier, slab, write_batch_bytes=4 * PAYLOAD)
        try:
            with shard_blocked(tier, 3):
                io.submit_spill(SpillSpec(JobId(5), tuple((key, SlotId(slot))
                                                          for slot, key in enumerate(keys)),
                                          (old,)))
                time.sleep(0.2)
                assert io.poll_finished() == []  # shard 3's part has not landed
            io.wait([JobId(5)], timeout=10)
            (done,) = io.poll_finished()
            assert done.ok and done.num_bytes == len(keys) * PAYLOAD
        finally:
            io.shutdown()
        assert all(read(tier, key) == (ReadStatus.OK, payload_of(key)) for key in keys)
        assert read(tier, old)[0] is ReadStatus.MISSING


def test_verify_flags_a_value_in_the_wrong_shard_and_repair_deletes_it_there(
        tmp_path: Path) -> None:
    """A valid value of key K copied into another shard's environment is never read (K is
    looked up in its own shard), and verify reports it and repair deletes only that copy."""
    key = key_in(1, 5)
    with open_tier(tmp_path) as tier:
        tier.put_many([(key, payload_of(key))])
        binding, wrong = tier._binding, tier.shard_paths[2]
    head, check = seal(binding, key, payload_of(key), 8)  # a valid slot of K, in shard 2
    with open(wrong / SLAB_NAME, "ab") as slab:
        slot = slab.tell() // slot_bytes_for(PAYLOAD)
        slab.write(head.ljust(HEADER_BLOCK, b"\0") + payload_of(key))
    env = lmdb.open(str(wrong), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(key, pack_index(IndexEntry(0, slot, PAYLOAD, 8, check)),
                db=env.open_db(b"index", txn=txn))
    env.close()
    with open_tier(tmp_path) as tier:
        report = tier.verify()
        assert report.bad_keys == (key,) and report.checked == 2
        assert tier.verify(repair=True).repaired == 1
        assert tier.verify().bad_keys == ()
        assert read(tier, key) == (ReadStatus.OK, payload_of(key))  # its own copy is kept
    assert stored_keys(wrong) == set()


def test_a_refused_claim_gives_back_the_shards_it_took(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        fd = os.open(tier.shard_paths[2] / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer holds shard 2
            with pytest.raises(ConfigError, match="in use"):
                tier.claim()
            assert not tier.claimed
        finally:
            os.close(fd)
        for path in tier.shard_paths[:2]:  # shards 0 and 1 were claimed, then given back
            probe = os.open(path / OWNER_FILE, os.O_RDWR)
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(probe)
        tier.claim()
        assert tier.claimed


def test_a_store_of_format_2_one_environment_per_rank_is_never_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Format 2 kept a rank in one environment (``rank-<r>/data.mdb``). Its namespace
    fingerprints differently, so this format starts empty beside it, says so, and leaves it."""
    import json
    from dataclasses import replace

    from tierkv.cli import main

    old = replace(NS, format_version=2)
    rank_dir = tmp_path / f"ns-{old.fingerprint()}" / "rank-0"
    rank_dir.mkdir(parents=True)
    for path in (tmp_path, rank_dir.parent, rank_dir):
        os.chmod(path, 0o700)
    record = {"fingerprint": old.fingerprint(), "format_version": 2, "namespace": old.describe()}
    (rank_dir.parent / "namespace.json").write_text(json.dumps(record))
    os.chmod(rank_dir.parent / "namespace.json", 0o600)
    key = key_in(0, 1)
    env = lmdb.open(str(rank_dir), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(key, payload_of(key), db=env.open_db(b"chunks", txn=txn))
    env.close()
    before = (rank_dir / "data.mdb").read_bytes()
    with caplog.at_level("WARNING", logger="tierkv.disk"), open_tier(tmp_path) as tier:
        assert list(tier.scan()) == [] and read(tier, key)[0] is ReadStatus.MISSING
    assert "another tierkv format" in caplog.text and "v2" in caplog.text
    assert (rank_dir / "data.mdb").read_bytes() == before  # never read, moved or deleted
    assert main(["verify", str(tmp_path)]) != 0
    out = capsys.readouterr()
    assert "format version 2" in out.out + out.err


def test_a_store_of_format_3_chunks_inside_lmdb_is_never_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Format 3 kept payloads inside LMDB (sub-db ``chunks`` of each shard). Format 4 does
    not migrate it: its namespace fingerprints differently, so the store starts empty
    beside it, and the warning names the directory and the ``tierkv rm`` that deletes it;
    ``tierkv verify`` refuses it. Its files are never read, moved or deleted."""
    import json
    from dataclasses import replace

    from tierkv.cli import main

    old = replace(NS, format_version=3)
    ns_dir = tmp_path / f"ns-{old.fingerprint()}"
    key = key_in(0, 1)
    for shard in range(SHARDS):
        shard_dir = ns_dir / "rank-0" / f"shard-{shard}"
        shard_dir.mkdir(parents=True)
        env = lmdb.open(str(shard_dir), max_dbs=4)
        with env.begin(write=True) as txn:
            txn.put(key, payload_of(key), db=env.open_db(b"chunks", txn=txn))
        env.close()
    for path in (tmp_path, *ns_dir.rglob("*"), ns_dir):
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
    record = {"fingerprint": old.fingerprint(), "format_version": 3, "namespace": old.describe()}
    (ns_dir / "namespace.json").write_text(json.dumps(record))
    os.chmod(ns_dir / "namespace.json", 0o600)
    before = {path: path.read_bytes() for path in ns_dir.rglob("*.mdb")}
    with caplog.at_level("WARNING", logger="tierkv.disk"), open_tier(tmp_path) as tier:
        assert list(tier.scan()) == [] and read(tier, key)[0] is ReadStatus.MISSING
    assert "another tierkv format" in caplog.text and f"{ns_dir} v3" in caplog.text
    assert f"tierkv rm {tmp_path} --namespace {old.fingerprint()} --yes" in caplog.text
    assert {path: path.read_bytes() for path in ns_dir.rglob("*.mdb")} == before
    assert main(["verify", str(tmp_path)]) != 0
    out = capsys.readouterr()
    assert "format version 3" in out.out + out.err
    assert main(["rm", str(tmp_path), "--namespace", old.fingerprint(), "--yes"]) == 0
    assert not ns_dir.exists()


def test_a_store_of_format_4_one_value_per_rank_is_refused_naming_tierkv_rm(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Format 4 kept one value per TP rank (``rank-<r>/shard-<s>``, index + slab) under a
    namespace that held the TP size. Format 5 never misreads it: its namespace
    fingerprints differently (format version, no ``tp_size``), the store starts empty
    beside it with a warning naming the directory and the ``tierkv rm`` that deletes it,
    ``tierkv verify`` refuses it, ``tierkv inspect`` lists its version, and its files are
    never read, moved or deleted until ``tierkv rm``."""
    import json

    from tierkv.cli import main

    description = NS.describe() | {"format_version": 4, "tp_size": 2, "rank_layout": "tp2"}
    del description["num_kv_heads"]
    fingerprint = "0123456789abcdef0123456789abcdef"  # format 4's own, whatever it was
    ns_dir = tmp_path / f"ns-{fingerprint}"
    key = key_in(0, 1)
    for rank in range(2):
        for shard in range(SHARDS):
            shard_dir = ns_dir / f"rank-{rank}" / f"shard-{shard}"
            shard_dir.mkdir(parents=True)
            env = lmdb.open(str(shard_dir), max_dbs=4)
            with env.begin(write=True) as txn:
                txn.put(key, bytes(36), db=env.open_db(b"index", txn=txn))
            env.close()
            (shard_dir / "slab-0.kv").write_bytes(bytes(8192))
    for path in (tmp_path, *ns_dir.rglob("*"), ns_dir):
        os.chmod(path, 0o700 if path.is_dir() else 0o600)
    record = {"fingerprint": fingerprint, "format_version": 4, "namespace": description}
    (ns_dir / "namespace.json").write_text(json.dumps(record))
    os.chmod(ns_dir / "namespace.json", 0o600)
    before = {path: path.read_bytes() for path in ns_dir.rglob("*") if path.is_file()}
    with caplog.at_level("WARNING", logger="tierkv.disk"), open_tier(tmp_path) as tier:
        assert list(tier.scan()) == [] and read(tier, key)[0] is ReadStatus.MISSING
    assert "another tierkv format" in caplog.text and f"{ns_dir} v4" in caplog.text
    assert f"tierkv rm {tmp_path} --namespace {fingerprint} --yes" in caplog.text
    assert {path: path.read_bytes() for path in ns_dir.rglob("*") if path.is_file()} == before
    assert main(["verify", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert "format version 4" in out.out + out.err
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(format version 4)" in out
    assert f"tierkv rm {tmp_path} --namespace {fingerprint} --yes" in out
    assert main(["rm", str(tmp_path), "--namespace", fingerprint, "--yes"]) == 0
    assert not ns_dir.exists()
