"""The contract of :class:`~tierkv.tiers.base.LowerTier`, one suite run on both lower tiers:
the disk tier on real slab files and LMDB indexes in ``tmp_path``, the remote tier on the
session's real 3-master Redis Cluster. Each test asserts what ``tierkv/tiers/base.py``
promises, or what one tier's own suite (test_disk_tier.py, test_remote_tier.py) checks and
the other must do alike. Where the two differ by design it is a :class:`Backend` field,
with why.

Stored values are rewritten at tierkv's own boundary, never mocked: the disk tier's index
and slab opened directly with the tier closed (``tests.reliability.support.raw_env``), the
remote tier's keys with a plain cluster client.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster as ClusterClient

from tests.integration.test_remote_tier import RELAXED
from tests.reliability import support
from tierkv.config import DiskTierConfig, RemoteTierConfig
from tierkv.errors import ClosedError, UsageError
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import LowerTier, ReadStatus
from tierkv.tiers.disk.tier import DiskTier
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.format import redis_key
from tierkv.units import MiB

PAYLOAD = 4096
NS = Namespace(model_id="contract", dtype="float16", kv_layout="NHD", page_bytes=512,
               tokens_per_chunk=16)
OTHER_NS = Namespace(model_id="contract", dtype="bfloat16", kv_layout="NHD", page_bytes=512,
                     tokens_per_chunk=16)
PART = Part(0, 1)
OTHER_PART = Part(1, 2)


def key_of(i: int) -> bytes:
    return random.Random(i * 7919 + 17).randbytes(32)


def payload_of(i: int) -> bytes:
    return random.Random(-i - 1).randbytes(PAYLOAD)


def read(tier: LowerTier, key: bytes) -> tuple[ReadStatus, bytes]:
    out = bytearray(tier.payload_bytes)
    return tier.read_into(key, memoryview(out)), bytes(out)


def flip_last(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 1])


@dataclass
class Backend:
    """One lower tier over storage of its own, for one test."""

    name: str  # how the tier's messages start
    open: Callable[..., LowerTier]  # open(namespace=NS, part=PART)
    # copy(src, key, dst, dst_key): the bytes src stores for key, stored as dst's value of
    # dst_key; returns (src, dst), reopened where the storage is rewritten closed (disk)
    copy: Callable[[LowerTier, bytes, LowerTier, bytes], tuple[LowerTier, LowerTier]]
    # damage(tier, key): the last byte of key's stored value flipped; returns the tier to use
    damage: Callable[[LowerTier, bytes], LowerTier]
    # Designed differences:
    transient_failures: bool  # a disk failure is final; a network tier reconnects
    # A second put of a key: the disk tier replaces the value (last put wins); the remote
    # tier's SET NX leaves what the server holds (another engine's copy of the chunk is
    # as good, and is not sent again), counting it as ``already``, not as a put.
    second_put_wins: bool
    # After close(): the disk tier's statistics() and sync() raise ClosedError like every
    # other call (test_disk_tier.py); the remote tier's statistics() answers its in-memory
    # counters and sync() is a no-op (durability is the server's), so neither raises.
    closed_stats_and_sync_raise: bool
    opened: list[LowerTier] = field(default_factory=list)


def disk_backend(root: Path) -> Backend:
    config = DiskTierConfig(path=root, max_bytes=64 * MiB)

    def open_tier(namespace: Namespace = NS, part: Part = PART) -> LowerTier:
        tier = DiskTier(root, namespace, part, config, PAYLOAD)
        backend.opened.append(tier)
        return tier

    def reopen(tier: Any) -> LowerTier:
        return open_tier(tier.namespace, tier.part)

    def copy(src: LowerTier, key: bytes, dst: LowerTier,
             dst_key: bytes) -> tuple[LowerTier, LowerTier]:
        same = src is dst
        src.close()
        dst.close()
        with support.raw_env(src.path) as (txn, chunks, _):  # type: ignore[attr-defined]
            value = bytes(txn.get(key, db=chunks))
        with support.raw_env(dst.path) as (txn, chunks, _):  # type: ignore[attr-defined]
            txn.put(dst_key, value, db=chunks)
        dst = reopen(dst)
        return (dst if same else reopen(src)), dst

    def damage(tier: LowerTier, key: bytes) -> LowerTier:
        tier.close()
        with support.raw_env(tier.path) as (txn, chunks, _):  # type: ignore[attr-defined]
            txn.put(key, flip_last(bytes(txn.get(key, db=chunks))), db=chunks)
        return reopen(tier)

    backend = Backend("disk tier", open_tier, copy, damage, transient_failures=False,
                      second_put_wins=True, closed_stats_and_sync_raise=True)
    return backend


def remote_backend(url: str) -> Backend:
    client = ClusterClient.from_url(url)

    def open_tier(namespace: Namespace = NS, part: Part = PART) -> LowerTier:
        tier = RemoteTier(RemoteTierConfig(url=url, timeout_seconds=RELAXED), namespace, part,
                          PAYLOAD)
        backend.opened.append(tier)
        return tier

    def name(tier: Any, key: bytes) -> bytes:
        return redis_key(tier.config.key_prefix.encode(), tier.fingerprint, tier.part, key)

    def copy(src: LowerTier, key: bytes, dst: LowerTier,
             dst_key: bytes) -> tuple[LowerTier, LowerTier]:
        client.set(name(dst, dst_key), client.get(name(src, key)))
        return src, dst

    def damage(tier: LowerTier, key: bytes) -> LowerTier:
        client.set(name(tier, key), flip_last(client.get(name(tier, key))))
        return tier

    backend = Backend("remote tier", open_tier, copy, damage, transient_failures=True,
                      second_put_wins=False, closed_stats_and_sync_raise=False)
    backend.opened.append(client)  # type: ignore[arg-type]  # closed with the tiers
    return backend


@pytest.fixture(params=["disk", "remote"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "disk":
        made = disk_backend(tmp_path / "cache")
    else:
        cluster = request.getfixturevalue("redis_cluster")  # started only for these
        cluster.flushall()
        made = remote_backend(cluster.url)
    yield made
    for opened in made.opened:
        opened.close()


@pytest.fixture()
def tier(backend: Backend) -> LowerTier:
    return backend.open()


def test_declared_attributes(backend: Backend, tier: LowerTier) -> None:
    assert isinstance(tier, LowerTier)
    assert tier.payload_bytes == PAYLOAD and tier.read_only is False
    assert tier.write_lanes >= 1
    assert all(0 <= tier.lane_of(key_of(i)) < tier.write_lanes for i in range(64))
    assert tier.transient_failures is backend.transient_failures
    assert tier.sync_every_seconds is None or tier.sync_every_seconds > 0
    tier.put_many([(key_of(1), payload_of(1))])
    tier.sync()  # the durability point; nothing to answer
    assert isinstance(tier.sync_if_due(), bool)


def test_round_trip_is_byte_exact_from_any_contiguous_buffer(tier: LowerTier) -> None:
    keys = [key_of(i) for i in range(8)]
    payloads = [payload_of(i) for i in range(8)]
    kinds: list[Callable[[bytes], Any]] = [
        bytes, bytearray, lambda p: memoryview(bytearray(p)),
        lambda p: memoryview(bytearray(p)).cast("f"),  # a float32 view of the same bytes
    ]
    items = [(key, kinds[i % len(kinds)](payload))
             for i, (key, payload) in enumerate(zip(keys, payloads))]
    result = tier.put_many(items)
    assert result.written == tuple(keys) and result.full == ()
    assert (result.deleted, result.num_bytes, result.message) == (0, 8 * PAYLOAD, None)
    for key, payload in zip(keys, payloads):
        assert read(tier, key) == (ReadStatus.OK, payload)


def test_payloads_are_copied_before_put_many_returns(tier: LowerTier) -> None:
    slot = bytearray(payload_of(1))
    tier.put_many([(key_of(1), memoryview(slot))])
    slot[:] = bytes(PAYLOAD)  # the CPU slot is reused at once
    assert read(tier, key_of(1)) == (ReadStatus.OK, payload_of(1))


def test_a_key_never_put_is_missing(tier: LowerTier) -> None:
    assert read(tier, key_of(1))[0] is ReadStatus.MISSING
    tier.put_many([(key_of(2), payload_of(2))])
    assert read(tier, key_of(1))[0] is ReadStatus.MISSING


def test_read_into_a_larger_or_shaped_buffer(tier: LowerTier) -> None:
    tier.put_many([(key_of(1), payload_of(1))])
    out = bytearray(b"\xee" * (PAYLOAD + 10))
    assert tier.read_into(key_of(1), memoryview(out)) is ReadStatus.OK
    assert bytes(out[:PAYLOAD]) == payload_of(1) and out[PAYLOAD:] == b"\xee" * 10
    for shape in ("f", (64, PAYLOAD // 64)):  # float32 elements; a 2-D byte array
        raw = bytearray(PAYLOAD)
        view = memoryview(raw).cast("B", shape) if isinstance(shape, tuple) else \
            memoryview(raw).cast(shape)
        assert tier.read_into(key_of(1), view) is ReadStatus.OK, shape
        assert bytes(raw) == payload_of(1), shape


def test_wrong_sizes_and_keys_are_usage_errors_naming_the_tier(backend: Backend,
                                                                tier: LowerTier) -> None:
    for size in (10, PAYLOAD - 1, PAYLOAD + 1):
        with pytest.raises(UsageError, match=f"^{backend.name} .*has {size} bytes, "
                                              f"the tier stores {PAYLOAD}"):
            tier.put_many([(key_of(1), payload_of(1)), (key_of(2), bytes(size))])
    assert read(tier, key_of(1))[0] is ReadStatus.MISSING  # a refused batch writes nothing
    for call in (lambda: tier.put_many([(b"short", payload_of(1))]),
                 lambda: tier.read_into(b"short", bytearray(PAYLOAD)),
                 lambda: tier.delete_many([b"short"]),
                 lambda: tier.put_many([], deletes=[b"k" * 33])):
        with pytest.raises(UsageError, match=f"^{backend.name} .*32 bytes"):
            call()
    tier.put_many([(key_of(1), payload_of(1))])
    for out in (bytearray(PAYLOAD - 1), bytes(PAYLOAD), memoryview(bytes(PAYLOAD))):
        with pytest.raises(UsageError, match=f"^{backend.name} .*writable"):
            tier.read_into(key_of(1), out)
    assert read(tier, key_of(1)) == (ReadStatus.OK, payload_of(1))


def test_delete_then_read_is_missing(tier: LowerTier) -> None:
    tier.put_many([(key_of(i), payload_of(i)) for i in range(3)])
    assert tier.delete_many([key_of(0), key_of(99)]) == 1  # absent keys are ignored
    assert tier.delete_many([key_of(0)]) == 0 and tier.delete_many([]) == 0
    assert read(tier, key_of(0))[0] is ReadStatus.MISSING
    assert read(tier, key_of(1)) == (ReadStatus.OK, payload_of(1))
    assert sorted(record.key for record in tier.scan()) == sorted([key_of(1), key_of(2)])


def test_put_many_deletes_first_then_stores(tier: LowerTier) -> None:
    """``deletes`` run before ``items``: a key in both ends up with the new value."""
    tier.put_many([(key_of(1), payload_of(1)), (key_of(2), payload_of(2))])
    result = tier.put_many([(key_of(1), payload_of(5))], deletes=[key_of(1), key_of(2)])
    assert result.deleted == 2 and result.written == (key_of(1),)
    assert read(tier, key_of(1)) == (ReadStatus.OK, payload_of(5))
    assert read(tier, key_of(2))[0] is ReadStatus.MISSING
    assert tier.put_many([], deletes=[key_of(1), key_of(3)]).deleted == 1
    assert read(tier, key_of(1))[0] is ReadStatus.MISSING


def test_putting_a_key_twice_keeps_one_value(backend: Backend, tier: LowerTier) -> None:
    key = key_of(1)
    for _ in range(2):
        assert tier.put_many([(key, payload_of(1))]).written == (key,)
    assert [record.key for record in tier.scan()] == [key]
    assert read(tier, key) == (ReadStatus.OK, payload_of(1))
    assert tier.put_many([(key, payload_of(2))]).written == (key,)
    kept = payload_of(2) if backend.second_put_wins else payload_of(1)
    assert read(tier, key) == (ReadStatus.OK, kept)
    assert [record.key for record in tier.scan()] == [key]
    assert tier.delete_many([key]) == 1  # one value: one delete leaves none
    assert read(tier, key)[0] is ReadStatus.MISSING


def test_another_namespace_or_part_sees_nothing(backend: Backend, tier: LowerTier) -> None:
    keys = [key_of(i) for i in range(4)]
    tier.put_many([(key, payload_of(i)) for i, key in enumerate(keys)])
    for other in (backend.open(OTHER_NS, PART), backend.open(NS, OTHER_PART)):
        assert all(read(other, key)[0] is ReadStatus.MISSING for key in keys)
        assert list(other.scan()) == [] and other.verify().checked == 0
        assert other.delete_many(keys) == 0
    assert all(read(tier, key) == (ReadStatus.OK, payload_of(i)) for i, key in enumerate(keys))


@pytest.mark.parametrize("target", ["namespace", "part", "key"])
def test_a_value_moved_to_another_namespace_part_or_key_is_never_served(
        backend: Backend, tier: LowerTier, target: str) -> None:
    """``OK`` only for verified bytes of this namespace, part and key: a good value of
    another's, stored where this tier looks, is ``CORRUPT`` (and deleted), never ``OK``."""
    src_key, dst_key = key_of(1), key_of(1) if target != "key" else key_of(2)
    dst = {"namespace": lambda: backend.open(OTHER_NS, PART),
           "part": lambda: backend.open(NS, OTHER_PART), "key": lambda: tier}[target]()
    tier.put_many([(src_key, payload_of(1))])
    src, dst = backend.copy(tier, src_key, dst, dst_key)
    assert dst_key in {record.key for record in dst.scan()}  # it is there to be read
    assert read(dst, dst_key)[0] is ReadStatus.CORRUPT
    assert read(dst, dst_key)[0] is ReadStatus.MISSING  # a writable tier deletes it
    assert dst.statistics().corrupt == 1
    assert read(src, src_key) == (ReadStatus.OK, payload_of(1))  # the original stays


def test_a_damaged_value_is_corrupt_counted_and_deleted(backend: Backend,
                                                        tier: LowerTier) -> None:
    tier.put_many([(key_of(i), payload_of(i)) for i in range(3)])
    tier = backend.damage(tier, key_of(1))
    assert read(tier, key_of(1))[0] is ReadStatus.CORRUPT
    assert read(tier, key_of(1))[0] is ReadStatus.MISSING
    assert sorted(record.key for record in tier.scan()) == sorted([key_of(0), key_of(2)])
    stats = tier.statistics()
    assert (stats.corrupt, stats.hits) == (1, 0)
    assert read(tier, key_of(2)) == (ReadStatus.OK, payload_of(2))


def test_verify_finds_damage_and_repair_deletes_it(backend: Backend, tier: LowerTier) -> None:
    tier.put_many([(key_of(i), payload_of(i)) for i in range(5)])
    report = tier.verify()
    assert (report.checked, report.bad_keys, report.repaired) == (5, (), 0)
    tier = backend.damage(tier, key_of(3))
    report = tier.verify()
    assert (report.checked, report.bad_keys, report.repaired) == (5, (key_of(3),), 0)
    report = tier.verify(repair=True)
    assert (report.bad_keys, report.repaired) == ((key_of(3),), 1)
    assert tier.verify().checked == 4 and tier.verify().bad_keys == ()
    assert read(tier, key_of(3))[0] is ReadStatus.MISSING
    assert read(tier, key_of(4)) == (ReadStatus.OK, payload_of(4))
    assert tier.statistics().reads == 2  # verify's own reads are not loads


def test_scan_lists_every_stored_chunk(tier: LowerTier) -> None:
    keys = [key_of(i) for i in range(20)]
    tier.put_many([(key, payload_of(i)) for i, key in enumerate(keys)])
    for batch in (1024, 3):
        records = list(tier.scan(batch=batch))
        assert sorted(record.key for record in records) == sorted(keys)
        assert {record.payload_len for record in records} == {PAYLOAD}
    tier.delete_many(keys[:5])
    assert sorted(record.key for record in tier.scan()) == sorted(keys[5:])


def test_statistics_count_puts_and_reads(backend: Backend, tier: LowerTier) -> None:
    tier.put_many([(key_of(i), payload_of(i)) for i in range(3)])
    for i in (0, 1, 2, 7):
        read(tier, key_of(i))
    stats = tier.statistics()
    assert (stats.puts, stats.bytes_written) == (3, 3 * PAYLOAD)
    assert (stats.reads, stats.hits, stats.misses, stats.corrupt) == (4, 3, 1, 0)
    tier = backend.damage(tier, key_of(0))  # the disk tier's counters restart at a reopen
    before = tier.statistics()
    read(tier, key_of(0))
    after = tier.statistics()
    assert (after.reads - before.reads, after.hits - before.hits,
            after.misses - before.misses, after.corrupt - before.corrupt) == (1, 0, 1, 1)


def test_close_is_idempotent_and_later_calls_raise(backend: Backend, tier: LowerTier) -> None:
    tier.put_many([(key_of(1), payload_of(1))])
    tier.close()
    tier.close()
    calls: list[Callable[[], object]] = [
        lambda: tier.put_many([]), lambda: tier.put_many([(key_of(2), payload_of(2))]),
        lambda: tier.put_many([], deletes=[key_of(1)]), lambda: tier.delete_many([]),
        lambda: tier.delete_many([key_of(1)]), lambda: read(tier, key_of(1)),
        lambda: list(tier.scan()), tier.verify]
    if backend.closed_stats_and_sync_raise:
        calls += [tier.statistics, tier.sync]
    else:
        assert tier.statistics().puts == 1
        tier.sync()
    for call in calls:
        with pytest.raises(ClosedError, match=f"^{backend.name} "):
            call()
    # nothing a refused call did holds the storage (the refused put's key included): a new
    # tier over it writes and reads
    again = backend.open()
    assert again.put_many([(key_of(2), payload_of(2))]).written == (key_of(2),)
    assert read(again, key_of(1)) == (ReadStatus.OK, payload_of(1))
