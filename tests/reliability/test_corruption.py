"""Corruption is detected as a miss and never served: through the public TierKVStore path
and through the DiskTier.

The DiskTier's single-fault matrix (every header byte flipped, hypothesis bit flips,
each malformed header shape, a value copied under another key) lives in
``tests/integration/test_disk_tier.py``; this file adds the store's view of the same
faults and bulk, mixed damage. Faults are injected at tierkv's boundary: the store is
closed, the index and slab opened directly (``support.raw_env``), a value rewritten, and the store
reopened (or, for bit rot, bytes of a slab file flipped in place).

Per fault, through the store: ``lookup`` still says hit (the index cannot know), the load
reports the chunk in ``failed_keys`` and ``corrupt_keys``, its destination blocks keep
their old bytes, the chunk is deleted on disk, counted (index and disk statistics), and
later lookups miss it; storing it again works.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from tests.reliability import support
from tierkv.keys import FORMAT_VERSION
from tierkv.tiers.disk.tier import DiskTier, ReadStatus, shard_of
from tierkv.tiers.disk.format import MAGIC, checksum

Edit = Callable[[bytes, bytes, bytes], bytes]  # (value, value of another key, key) -> value


def _flip(seed: int) -> Edit:
    def edit(value: bytes, other: bytes, key: bytes) -> bytes:
        rng = random.Random(seed)
        data = bytearray(value)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        return bytes(data)
    return edit


def _header(value: bytes) -> tuple[list[int], int]:
    size = int.from_bytes(value[2:4], "little")
    return msgpack.unpackb(value[4 : 4 + size]), 4 + size


def _rebuild(value: bytes, **changes: int) -> bytes:
    """The value with header fields changed; the checksum is left as it was."""
    (version, length, seq, check), start = _header(value)
    fields = dict(version=version, length=length, seq=seq, check=check) | changes
    header: bytes = msgpack.packb([fields["version"], fields["length"], fields["seq"], fields["check"]])
    return MAGIC + len(header).to_bytes(2, "little") + header + value[start:]


def _resealed_with_wrong_length(value: bytes, other: bytes, key: bytes) -> bytes:
    """A self-consistent value (checksum recomputed) whose payload is one byte short."""
    (_, _, seq, _), start = _header(value)
    payload = value[start:-1]
    header: bytes = msgpack.packb([FORMAT_VERSION, len(payload), seq,
                                   checksum(support.binding(), key, FORMAT_VERSION,
                                            len(payload), seq, payload)])
    return MAGIC + len(header).to_bytes(2, "little") + header + payload


FAULTS: dict[str, Edit] = {
    **{f"random flips {seed}": _flip(seed) for seed in range(8)},
    "truncated in the prefix": lambda v, o, k: v[:3],
    "truncated in the header": lambda v, o, k: v[:9],
    "truncated payload (one byte short)": lambda v, o, k: v[:-1],
    "truncated to half": lambda v, o, k: v[: len(v) // 2],
    "empty value": lambda v, o, k: b"",
    "extended by a byte": lambda v, o, k: v + b"\0",
    "value of another key": lambda v, o, k: o,
    "damaged magic": lambda v, o, k: b"KT" + v[2:],
    "damaged header length": lambda v, o, k: v[:2] + (200).to_bytes(2, "little") + v[4:],
    "header length one short": lambda v, o, k: v[:2] + (int.from_bytes(v[2:4], "little") - 1)
    .to_bytes(2, "little") + v[4:],
    "damaged seq": lambda v, o, k: _rebuild(v, seq=_header(v)[0][2] + 1),
    "damaged version": lambda v, o, k: _rebuild(v, version=FORMAT_VERSION + 1),
    "damaged length field": lambda v, o, k: _rebuild(v, length=_header(v)[0][1] + 1),
    "damaged checksum field": lambda v, o, k: _rebuild(v, check=_header(v)[0][3] ^ 1),
    "resealed with a short payload": _resealed_with_wrong_length,
}


def _stored_request(root: Path) -> list[bytes]:
    kv = support.make_kv()
    keys = support.request_keys(1, num_chunks=3)
    with support.open_store(root, kv) as store:
        completion = support.store_chunks(store, kv, keys)
        assert completion is not None and completion.ok
    return keys  # close() flushed them to disk


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_store_detects_corruption_as_a_miss_and_never_serves_it(tmp_path: Path,
                                                                 fault: str) -> None:
    keys = _stored_request(tmp_path)
    (env_dir,) = support.env_dirs(tmp_path)
    with support.raw_env(env_dir) as (txn, chunks, _):
        value, other = (bytes(txn.get(k, db=chunks)) for k in (keys[1], keys[0]))
        edited = FAULTS[fault](value, other, keys[1])
        assert edited != value
        txn.put(keys[1], edited, db=chunks)

    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        assert store.lookup(keys) == 3  # the index cannot know yet: a hit
        blocks = [support.chunk_blocks(i, 32) for i in range(3)]
        support.poison(kv, [b for chunk in blocks for b in chunk])
        num, completion = support.load_chunks(store, keys, first_block=32)
        assert num == 3 and completion is not None
        assert not completion.ok
        assert completion.failed_keys == (keys[1],) and completion.corrupt_keys == (keys[1],)
        assert support.chunk_matches(kv, keys[0], blocks[0])
        assert support.untouched(kv, blocks[1]), "bytes of a corrupt chunk landed"
        # the chunk after it may land or not, but never with wrong bytes
        assert support.chunk_matches(kv, keys[2], blocks[2]) or support.untouched(kv, blocks[2])
        # deleted and counted: a miss from now on, the others still hit
        assert store.lookup(keys) == 1 and store.lookup(keys[2:]) == 1
        stats = store.statistics().index
        assert (stats.corrupt, stats.loads_failed) == (1, 1)
        assert store.disk is not None
        disk_stats = store.disk.statistics()
        assert (disk_stats.corrupt, disk_stats.chunks) == (1, 2)
        assert keys[1] not in {record.key for record in store.disk.scan()}
        assert store.disk.verify().bad_keys == ()
        # the engine recomputes the chunk and stores it again: served byte-exact
        completion = support.store_chunks(store, kv, keys[1:2], first_block=48)
        assert completion is not None and completion.ok
        support.poison(kv, blocks[1])
        num, completion = support.load_chunks(store, keys[:2], first_block=32)
        assert num == 2 and completion is not None and completion.ok
        assert support.chunk_matches(kv, keys[1], blocks[1])


def test_a_chunk_gone_from_disk_is_a_miss_and_forgotten(tmp_path: Path) -> None:
    """An index entry whose value went away behind the store's back (another process's
    ``verify(repair=True)``, a hand edit): the load fails, nothing lands, and the store
    stops answering hit for it instead of failing the same load forever."""
    keys = _stored_request(tmp_path)
    (env_dir,) = support.env_dirs(tmp_path)
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        assert store.lookup(keys) == 3
        # the value disappears while this store runs (one short write txn of another opener
        # would do the same; here the tier's own delete stands in for it)
        assert store.disk is not None and store.disk.delete_many([keys[1]]) == 1
        blocks = [support.chunk_blocks(i, 32) for i in range(3)]
        support.poison(kv, [b for chunk in blocks for b in chunk])
        num, completion = support.load_chunks(store, keys, first_block=32)
        assert num == 3 and completion is not None and not completion.ok
        assert keys[1] in completion.failed_keys
        assert support.untouched(kv, blocks[1])
        assert store.lookup(keys) == 1, "a chunk the disk does not have still answers hit"
        assert store.lookup(keys[2:]) == 1
        stats = store.statistics().index
        assert (stats.disk_missing, stats.corrupt, stats.loads_failed) == (1, 0, 1)
    assert env_dir.exists()


def _bit_rot(data_file: Path, needle: bytes, rng: random.Random) -> int:
    """Flip one byte of ``needle``'s first occurrence inside ``data_file``, in place."""
    raw = bytearray(data_file.read_bytes())
    at = raw.find(needle)
    assert at >= 0, f"payload not found in {data_file.name}"
    position = at + rng.randrange(len(needle))
    raw[position] ^= 0x10
    data_file.write_bytes(bytes(raw))
    return position


def test_bit_rot_in_the_data_file_is_caught_for_every_damaged_chunk(tmp_path: Path) -> None:
    """Bytes flipped in the slab files themselves (the filesystem has no checksums): only
    tierkv's checksum can notice. A mixed bag of damaged chunks is found exactly, through reads,
    ``verify`` and the store."""
    rng = random.Random(7)
    kv = support.make_kv()
    keys = [key for seed in range(6) for key in support.request_keys(100 + seed, num_chunks=4)]
    with support.open_store(tmp_path, kv) as store:
        for start in range(0, len(keys), 4):
            completion = support.store_chunks(store, kv, keys[start : start + 4])
            assert completion is not None and completion.ok
    (env_dir,) = support.env_dirs(tmp_path)
    damaged = set(rng.sample(keys, 7))
    for key in sorted(damaged):
        payload = support.payload_for(key)
        start = rng.randrange(len(payload) - 64)
        _bit_rot(support.slab_files(env_dir)[shard_of(key)],
                 payload[start : start + 64], rng)
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), support.store_config(tmp_path).disk,
                  support.CHUNK_BYTES) as tier:
        report = tier.verify()
        assert set(report.bad_keys) == damaged and report.checked == len(keys)
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        served = failed = 0
        for start in range(0, len(keys), 4):
            request = keys[start : start + 4]
            for key in request:
                blocks = support.chunk_blocks(0, 32)
                support.poison(kv, blocks)
                num, completion = support.load_chunks(store, [key], first_block=32)
                assert num == 1 and completion is not None
                if key in damaged:
                    assert completion.corrupt_keys == (key,) and support.untouched(kv, blocks)
                    failed += 1
                else:
                    assert completion.ok and support.chunk_matches(kv, key, blocks)
                    served += 1
        assert (served, failed) == (len(keys) - len(damaged), len(damaged))
        assert store.statistics().index.corrupt == len(damaged)
        assert store.disk is not None and store.disk.verify().bad_keys == ()


def test_mixed_damage_is_found_exactly_by_reads_and_verify(tmp_path: Path) -> None:
    """Fifty chunks on a DiskTier, a random dozen damaged in random ways from FAULTS:
    ``read_into`` answers CORRUPT for exactly those and OK with the exact bytes for the
    rest; ``verify(repair=True)`` removes exactly those."""
    rng = random.Random(11)
    size = 4096
    keys = [support.pool_key(i, b"mixed") for i in range(50)]
    config = support.store_config(tmp_path).disk

    def open_tier() -> DiskTier:
        return DiskTier(tmp_path, support.namespace_of(), support.part(0), config, size)

    with open_tier() as tier:
        tier.put_many([(key, support.payload_for(key, size)) for key in keys])
    damaged = {key: rng.choice(sorted(FAULTS)) for key in rng.sample(keys, 12)}
    (env_dir,) = support.env_dirs(tmp_path)
    with support.raw_env(env_dir) as (txn, chunks, _):
        for key, fault in damaged.items():
            value = bytes(txn.get(key, db=chunks))
            other = bytes(txn.get(keys[0] if key != keys[0] else keys[1], db=chunks))
            txn.put(key, FAULTS[fault](value, other, key), db=chunks)
    with open_tier() as tier:
        report = tier.verify()
        assert set(report.bad_keys) == set(damaged) and report.repaired == 0
        out = bytearray(size)
        for key in keys[:25]:
            status = tier.read_into(key, memoryview(out))
            if key in damaged:
                assert status is ReadStatus.CORRUPT, damaged[key]
            else:
                assert status is ReadStatus.OK and bytes(out) == support.payload_for(key, size)
        report = tier.verify(repair=True)
        assert set(report.bad_keys) == {k for k in damaged if k not in keys[:25]}
        assert tier.verify().bad_keys == ()
        assert tier.statistics().chunks == len(keys) - len(damaged)
