"""The disk tier (slab files indexed by LMDB) on real files in ``tmp_path``.

Faults are injected at tierkv's own boundary: the test closes the tier, opens the same
environment with ``lmdb`` and the slab file directly (``tests.reliability.support.raw_env``:
a value is the slot's header and payload), rewrites a stored value, and reopens the tier.
"""

from __future__ import annotations

import logging
import os
import random
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from tests.profiles import thorough
from tests.reliability import support
from tierkv.config import DiskTierConfig
from tierkv.errors import ClosedError, NamespaceMismatchError, UsageError
from tierkv.keys import FORMAT_VERSION, Namespace, Part
from tierkv.tiers.disk.tier import SHARDS, DiskTier, ReadStatus, list_namespaces, map_size_for, shard_of
from tierkv.tiers.disk.format import MAGIC, binding_of, checksum, pack_header

PAYLOAD = 8192
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=512,
               tokens_per_chunk=16)
OTHER_NS = Namespace(model_id="tiny", dtype="bfloat16", kv_layout="NHD", page_bytes=512,
                     tokens_per_chunk=16)
BINDING = binding_of(NS.fingerprint(), 0)  # what every value of NS, rank 0 is bound to


def key_of(i: int) -> bytes:
    return bytes([0xA5]) + i.to_bytes(31, "big")


def env_dir(tier: DiskTier) -> Path:
    """The environment (shard) that every ``key_of`` key lives in."""
    return tier.shard_paths[shard_of(key_of(0))]


def payload_of(i: int, size: int = PAYLOAD) -> bytes:
    return random.Random(i).randbytes(size)


def open_tier(root: Path, payload_bytes: int = PAYLOAD, namespace: Namespace = NS,
              **config: Any) -> DiskTier:
    return DiskTier(root, namespace, 0, DiskTierConfig(path=root, **config), payload_bytes)


@contextmanager
def raw_chunks(tier: DiskTier) -> Iterator[tuple[Any, str]]:
    """Write access to the (closed) tier's values: index and slab opened directly."""
    with support.raw_env(tier.path) as (txn, chunks, _):
        yield txn, chunks


def read(tier: DiskTier, key: bytes) -> tuple[ReadStatus, bytes]:
    out = bytearray(tier.payload_bytes)
    status = tier.read_into(key, memoryview(out))
    return status, bytes(out)


def tamper(root: Path, payload_bytes: int, edit: Callable[[bytes], bytes]) -> DiskTier:
    """Store one chunk, rewrite its value with ``edit``, reopen; returns the open tier."""
    tier = open_tier(root, payload_bytes)
    tier.put_many([(key_of(1), payload_of(1, payload_bytes))])
    tier.close()
    with raw_chunks(tier) as (txn, db):
        txn.put(key_of(1), edit(bytes(txn.get(key_of(1), db=db))), db=db)
    return open_tier(root, payload_bytes)


def assert_corrupt_and_gone(tier: DiskTier) -> None:
    status, _ = read(tier, key_of(1))
    assert status is ReadStatus.CORRUPT
    assert read(tier, key_of(1))[0] is ReadStatus.MISSING  # deleted on detection
    stats = tier.statistics()
    assert (stats.corrupt, stats.hits, stats.chunks) == (1, 0, 0)
    assert [r.key for r in tier.scan()] == []  # its index entry went too


def test_round_trip_is_byte_exact(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        items = [(key_of(i), payload_of(i)) for i in range(12)]
        result = tier.put_many(items[:5])
        tier.put_many([(k, memoryview(bytearray(v))) for k, v in items[5:]])
        assert result.written == tuple(k for k, _ in items[:5]) and result.full == ()
        for key, payload in items:
            assert read(tier, key) == (ReadStatus.OK, payload)
        assert read(tier, key_of(99))[0] is ReadStatus.MISSING
        stats = tier.statistics()
        assert (stats.chunks, stats.puts, stats.hits, stats.misses) == (12, 12, 12, 1)
        assert stats.bytes_written == stats.bytes_read == 12 * PAYLOAD


def test_read_into_a_larger_slot_fills_the_front(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(1), payload_of(1))])
        out = bytearray(b"\xee" * (PAYLOAD + 10))
        assert tier.read_into(key_of(1), memoryview(out)) is ReadStatus.OK
        assert bytes(out[:PAYLOAD]) == payload_of(1) and out[PAYLOAD:] == b"\xee" * 10


def test_reopen_is_warm_and_sequence_continues(tmp_path: Path) -> None:
    items = [(key_of(i), payload_of(i)) for i in range(30)]
    with open_tier(tmp_path) as tier:
        for start in range(0, 30, 7):
            tier.put_many(items[start : start + 7])
    with open_tier(tmp_path) as tier:
        records = list(tier.scan(batch=4))  # several short txns, resumed by key
        assert sorted(r.key for r in records) == sorted(k for k, _ in items)
        assert {r.payload_len for r in records} == {PAYLOAD}
        seqs = sorted(r.seq for r in records)
        assert len(set(seqs)) == 30
        for key, payload in items:
            assert read(tier, key) == (ReadStatus.OK, payload)
        tier.put_many([(key_of(100), payload_of(100))])
        new = [r for r in tier.scan() if r.key == key_of(100)]
        assert new[0].seq > seqs[-1]


def test_other_namespace_under_the_same_root_sees_nothing(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(1), payload_of(1))])
    with open_tier(tmp_path, namespace=OTHER_NS) as other:
        assert read(other, key_of(1))[0] is ReadStatus.MISSING
        assert list(other.scan()) == []
    infos = {info.fingerprint: info for info in list_namespaces(tmp_path)}
    assert set(infos) == {NS.fingerprint(), OTHER_NS.fingerprint()}
    info = infos[NS.fingerprint()]
    assert info.description == NS.describe() and info.parts == ((Part(0, 1), 0),)
    assert info.format_version == FORMAT_VERSION


def test_namespace_record_mismatch_raises(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.close()
    env = lmdb.open(str(env_dir(tier)), map_size=tier.map_size // SHARDS, max_dbs=4)
    with env.begin(write=True) as txn:
        record = {"fingerprint": OTHER_NS.fingerprint(), "format_version": FORMAT_VERSION,
                  "namespace": OTHER_NS.describe()}
        txn.put(b"namespace", msgpack.packb(record), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(NamespaceMismatchError, match="disk tier"):
        DiskTier(tmp_path, NS, 0, DiskTierConfig(path=tmp_path), PAYLOAD, repair=False)
    with pytest.raises(NamespaceMismatchError, match="disk tier"):
        DiskTier(tmp_path, NS, 0, DiskTierConfig(path=tmp_path), PAYLOAD, read_only=True)
    with open_tier(tmp_path) as tier:  # may repair: moved aside, kept, started empty
        assert list(tier.scan()) == [] and tier.statistics().rebuilds == 1
    (aside,) = env_dir(tier).parent.glob(f"{env_dir(tier).name}.foreign-*")
    assert (aside / "data.mdb").exists()


def _flip(position: int, mask: int = 0xFF) -> Callable[[bytes], bytes]:
    def edit(value: bytes) -> bytes:
        data = bytearray(value)
        data[position % len(data)] ^= mask
        return bytes(data)
    return edit


HEADER_END = len(pack_header(BINDING, key_of(1), payload_of(1), 1))


@pytest.mark.parametrize("position", [*range(HEADER_END), HEADER_END, HEADER_END + 100, -1])
def test_flipping_a_byte_is_corrupt(tmp_path: Path, position: int) -> None:
    with tamper(tmp_path, PAYLOAD, _flip(position)) as tier:
        assert_corrupt_and_gone(tier)


@thorough(40,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, 255 + 30), mask=st.integers(1, 255))
def test_flipping_any_bits_is_corrupt(tmp_path: Path, position: int, mask: int) -> None:
    root = tmp_path / f"p{position}-m{mask}"
    with tamper(root, 256, _flip(position, mask)) as tier:
        assert_corrupt_and_gone(tier)


def test_value_copied_under_another_key_is_corrupt(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.put_many([(key_of(1), payload_of(1)), (key_of(2), payload_of(2))])
    tier.close()
    with raw_chunks(tier) as (txn, db):
        txn.put(key_of(1), bytes(txn.get(key_of(2), db=db)), db=db)
    with open_tier(tmp_path) as tier:
        assert read(tier, key_of(1))[0] is ReadStatus.CORRUPT
        assert read(tier, key_of(2)) == (ReadStatus.OK, payload_of(2))


def _value(fields: Any, payload: bytes, header_len: int | None = None,
           magic: bytes = MAGIC) -> bytes:
    header = fields if isinstance(fields, bytes) else msgpack.packb(fields)
    size = len(header) if header_len is None else header_len
    return magic + size.to_bytes(2, "little") + header + payload


def _good_fields(payload: bytes, version: int = FORMAT_VERSION, length: int | None = None,
                 seq: int = 7) -> list[int]:
    length = len(payload) if length is None else length
    return [version, length, seq, checksum(BINDING, key_of(1), version, length, seq, payload)]


BAD_VALUES: dict[str, Callable[[bytes], bytes]] = {
    "truncated payload": lambda v: v[:-1],
    "truncated header": lambda v: v[:6],
    "only the prefix": lambda v: v[:3],
    "empty": lambda v: b"",
    "extra payload byte": lambda v: v + b"\0",
    "oversized header length": lambda v: _value(v[4:], b"", header_len=65535),
    "header length past the end": lambda v: v[:2] + (40).to_bytes(2, "little") + v[4:30],
    "bad magic": lambda v: b"XX" + v[2:],
    "header is a map": lambda v: _value({"version": 1}, v[-PAYLOAD:]),
    "header is a string": lambda v: _value("hello", v[-PAYLOAD:]),
    "header has a float": lambda v: _value([1.0, PAYLOAD, 1, 1], v[-PAYLOAD:]),
    "header has a bool": lambda v: _value([True, PAYLOAD, 1, 1], v[-PAYLOAD:]),
    "header has a negative int": lambda v: _value([1, PAYLOAD, -1, 1], v[-PAYLOAD:]),
    "header has 5 fields": lambda v: _value([*_good_fields(v[-PAYLOAD:]), 0], v[-PAYLOAD:]),
    "header is not msgpack": lambda v: _value(b"\xc1\xc1\xc1", v[-PAYLOAD:]),
    "header is a pickle": lambda v: _value(b"\x80\x04K\x01.", v[-PAYLOAD:]),
    "non-canonical header": lambda v: _value(
        b"\x94\xcd\x00\x01" + msgpack.packb(_good_fields(v[-PAYLOAD:]))[2:], v[-PAYLOAD:]),
    "older version": lambda v: _value(_good_fields(v[-PAYLOAD:], version=FORMAT_VERSION - 1),
                                      v[-PAYLOAD:]),
    "wrong version": lambda v: _value(_good_fields(v[-PAYLOAD:], version=FORMAT_VERSION + 1), v[-PAYLOAD:]),
    "length field differs from the tier's": lambda v: _value(
        _good_fields(v[-PAYLOAD:-1], length=PAYLOAD - 1), v[-PAYLOAD:-1]),
    "length field differs from the payload": lambda v: _value(
        _good_fields(v[-PAYLOAD:], length=PAYLOAD), v[-PAYLOAD:] + b"\0"),
}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_malformed_values_are_corrupt(tmp_path: Path, name: str) -> None:
    with tamper(tmp_path, PAYLOAD, BAD_VALUES[name]) as tier:
        assert_corrupt_and_gone(tier)


def test_a_well_formed_crafted_value_is_accepted(tmp_path: Path) -> None:
    """The crafted-value helpers build good values; the cases above differ by one fault."""
    payload = payload_of(3)
    with tamper(tmp_path, PAYLOAD, lambda v: _value(_good_fields(payload), payload)) as tier:
        assert read(tier, key_of(1)) == (ReadStatus.OK, payload)


def test_map_full_is_a_value_and_reads_keep_working(tmp_path: Path, caplog: Any) -> None:
    size = 64 * 1024
    with open_tier(tmp_path, size, max_bytes=4 * size) as tier:
        written: list[bytes] = []
        full: list[bytes] = []
        for start in range(0, 160, 8):
            batch = [(key_of(i), payload_of(i, size)) for i in range(start, start + 8)]
            result = tier.put_many(batch)
            written += result.written
            full += result.full
        assert written and full and len(written) + len(full) == 160
        assert "slab full writing chunk" in caplog.text
        assert "raise disk.max_bytes, now 256 KiB" in caplog.text
        stats = tier.statistics()
        assert stats.full == len(full) and stats.chunks == len(written)
        for key in written[:5] + written[-5:]:
            assert read(tier, key)[0] is ReadStatus.OK
        assert read(tier, full[0])[0] is ReadStatus.MISSING
        # deleting makes room again (deletes run first: their slots take the puts)
        result = tier.put_many([(full[0], payload_of(0, size))], deletes=written[:8])
        assert result.written == (full[0],) and result.deleted == min(8, len(written))
        assert read(tier, full[0]) == (ReadStatus.OK, payload_of(0, size))


def test_deletes_run_before_puts(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(1), payload_of(1)), (key_of(2), payload_of(2))])
        result = tier.put_many([(key_of(1), payload_of(5))], deletes=[key_of(1), key_of(2)])
        assert result.deleted == 2
        assert read(tier, key_of(1)) == (ReadStatus.OK, payload_of(5))
        assert read(tier, key_of(2))[0] is ReadStatus.MISSING
        assert tier.delete_many([key_of(1), key_of(3)]) == 1
        assert tier.statistics().chunks == 0


def test_verify_and_repair(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.put_many([(key_of(i), payload_of(i)) for i in range(6)])
    tier.close()
    with raw_chunks(tier) as (txn, db):
        txn.put(key_of(1), bytes(txn.get(key_of(1), db=db))[:-5], db=db)
        txn.put(key_of(2), b"XX" + bytes(txn.get(key_of(2), db=db))[2:], db=db)  # header only
    with open_tier(tmp_path) as tier:
        report = tier.verify()
        assert (report.checked, sorted(report.bad_keys), report.repaired) == (
            6, [key_of(1), key_of(2)], 0)
        assert tier.verify(repair=True).repaired == 2
        assert tier.verify() .bad_keys == ()
        assert tier.statistics().chunks == 4


def test_files_are_private(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with open_tier(root) as tier:
        tier.put_many([(key_of(1), payload_of(1))])
    for path in (root, tier.namespace_dir, tier.path, *tier.shard_paths):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in (tier.namespace_dir / "namespace.json", env_dir(tier) / "data.mdb",
                 env_dir(tier) / "lock.mdb", env_dir(tier) / "slab-0.kv"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_damaged_environment_is_moved_aside(tmp_path: Path, caplog: Any) -> None:
    with open_tier(tmp_path) as tier:
        tier.put_many([(key_of(1), payload_of(1))])
    (env_dir(tier) / "data.mdb").write_bytes(os.urandom(16384))
    with caplog.at_level(logging.WARNING, logger="tierkv.disk"), open_tier(tmp_path) as tier:
        assert "is damaged" in caplog.text
        assert read(tier, key_of(1))[0] is ReadStatus.MISSING
        tier.put_many([(key_of(2), payload_of(2))])
        assert read(tier, key_of(2)) == (ReadStatus.OK, payload_of(2))
    aside = list(env_dir(tier).parent.glob(f"{env_dir(tier).name}.broken-*"))
    assert len(aside) == 1 and (aside[0] / "data.mdb").exists()


def test_truncated_data_file_is_moved_aside_not_faulted(tmp_path: Path, caplog: Any) -> None:
    """Pages past the end of a cut file would raise SIGBUS when mapped: caught at open."""
    with open_tier(tmp_path, 64 * 1024) as tier:
        tier.put_many([(key_of(i), payload_of(i, 64 * 1024)) for i in range(8)])
    data = env_dir(tier) / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with open_tier(tmp_path, 64 * 1024) as tier:
        assert "meta page needs" in caplog.text
        assert read(tier, key_of(1))[0] is ReadStatus.MISSING
    assert len(list(env_dir(tier).parent.glob(f"{env_dir(tier).name}.broken-*"))) == 1


def test_damaged_meta_record_is_moved_aside(tmp_path: Path, caplog: Any) -> None:
    tier = open_tier(tmp_path)
    tier.close()
    env = lmdb.open(str(env_dir(tier)), map_size=tier.map_size // SHARDS, max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"namespace", b"\xc1garbage", db=env.open_db(b"meta", txn=txn))
    env.close()
    with open_tier(tmp_path) as tier:
        assert "is damaged" in caplog.text
        assert tier.statistics().chunks == 0
    assert len(list(env_dir(tier).parent.glob(f"{env_dir(tier).name}.broken-*"))) == 1


def test_close_is_idempotent_and_later_calls_raise(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.close()
    tier.close()
    for call in (lambda: tier.put_many([]), lambda: read(tier, key_of(1)),
                 lambda: list(tier.scan()), tier.statistics, tier.sync, tier.verify):
        with pytest.raises(ClosedError, match="disk tier"):
            call()


def test_bad_arguments_raise_usage_errors(tmp_path: Path) -> None:
    with open_tier(tmp_path) as tier:
        with pytest.raises(UsageError, match="32 bytes"):
            tier.put_many([(b"short", payload_of(1))])
        with pytest.raises(UsageError, match="stores 8192"):
            tier.put_many([(key_of(1), b"x" * 10)])
        with pytest.raises(UsageError, match="writable"):
            tier.read_into(key_of(1), memoryview(bytearray(10)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_periodic_sync_by_bytes_and_seconds(tmp_path: Path) -> None:
    clock = FakeClock()
    config = DiskTierConfig(path=tmp_path, sync_every_bytes=3 * PAYLOAD, sync_every_seconds=5.0)
    with DiskTier(tmp_path, NS, 0, config, PAYLOAD, clock=clock) as tier:
        tier.put_many([(key_of(1), payload_of(1))])
        assert tier.statistics().syncs == 0  # no fsync per txn
        tier.put_many([(key_of(2), payload_of(2)), (key_of(3), payload_of(3))])
        assert tier.statistics().syncs == 1  # 3 payloads reached sync_every_bytes
        tier.put_many([(key_of(4), payload_of(4))])
        assert not tier.sync_if_due()
        clock.now = 6.0
        assert tier.sync_if_due() and tier.statistics().syncs == 2
        assert not tier.sync_if_due()  # nothing unsynced


def test_close_mode_syncs_only_at_close(tmp_path: Path) -> None:
    clock = FakeClock()
    config = DiskTierConfig(path=tmp_path, sync_mode="close", sync_every_bytes=1)
    tier = DiskTier(tmp_path, NS, 0, config, PAYLOAD, clock=clock)
    tier.put_many([(key_of(i), payload_of(i)) for i in range(4)])
    clock.now = 100.0
    assert not tier.sync_if_due() and tier.statistics().syncs == 0
    tier.close()
    assert tier._counts.syncs == 1


def test_index_map_is_small_and_never_fills_before_the_slabs(tmp_path: Path) -> None:
    """The LMDB map holds the index only (format 4): 64 GiB of 2 MiB chunks take a map of
    tens of MiB, and a tier written to its slabs' limit with the smallest payloads (the
    most entries per byte) is told "slab full", never "index map full"."""
    gib = 1 << 30
    size = map_size_for(64 * gib, 2 << 20)
    assert 32768 * 256 < size < 64 << 20
    assert map_size_for(1, 4096) >= 8 << 20
    payload = 4096
    with open_tier(tmp_path, payload, max_bytes=1500 * payload) as tier:
        keys = [random.Random(i).randbytes(32) for i in range(4000)]
        results = [tier.put_many([(key, bytes(payload)) for key in keys[start:start + 200]])
                   for start in range(0, len(keys), 200)]
        written = sum(len(result.written) for result in results)
        assert written >= 1500 and any(result.full for result in results)
        assert all("slab full" in result.message for result in results if result.message)
        assert tier.statistics().chunks == written
