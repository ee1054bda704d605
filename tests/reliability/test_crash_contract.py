"""The crash contract of format 4 (``docs/on-disk-format.md``, "Crash contract"), clause by
clause, each test run against the tier as built and against a copy with that clause's
ordering broken on purpose (patched at tierkv's own seams), which it must catch.

1. An index entry is committed only after its payload is written, and, with
   ``sync_mode="always"``, made durable (``fdatasync``).
2. In ``periodic`` (and ``close``) mode, the slab's ``fdatasync`` precedes every index sync
   that covers its payloads.
3. A slot is given back only after the index txn that dropped its entry committed; a slot
   may then be written again at once, because every read checks the slot's header against
   the entry (sequence, key-bound checksum): an entry a crash brings back never serves
   another key's bytes, nor an older or newer write of its own key.
4. A SIGKILL at any of those steps (mid-write, between payload and index, mid-delete,
   mid-free) never yields a hit with bytes other than the key's own committed ones.

The tier reports each step through its ``trace`` hook as ``(event, shard, slot)``;
:func:`check_order` replays a trace against clauses 1-3.
"""

from __future__ import annotations

import os
import random
import signal
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tests.reliability import support
from tierkv.config import DiskTierConfig
from tierkv.core.jobs import JobId, SlotId, SpillSpec
from tierkv.tiers.disk import tier as disk_module
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.tier import DiskTier, ReadStatus, shard_of
from tierkv.tiers.disk.format import IndexEntry, check_slot, unpack_index
from tierkv.tiers.disk.write import ShardWrites
from tierkv.transfer.tier_io import TierIO

SIZE = 8192
Event = tuple[str, int, int]


def check_order(events: list[Event], sync_mode: str) -> None:
    """Raise AssertionError at the first event that breaks clauses 1-3."""
    written: dict[tuple[int, int], int] = {}  # slot -> its payload write not yet indexed
    named: set[tuple[int, int]] = set()  # slots a committed entry names
    last_sync: dict[int, int] = defaultdict(lambda: -1)  # shard -> last payload fdatasync
    unsynced: dict[int, list[int]] = defaultdict(list)  # shard -> indexed writes since
    for position, (event, shard, slot) in enumerate(events):
        where = f"event {position} {event} shard {shard} slot {slot}"
        if event == "payload":
            assert (shard, slot) not in named, f"{where}: a slot rewritten while named"
            written[(shard, slot)] = position
        elif event == "payload-sync":
            last_sync[shard] = position
        elif event == "index-commit":
            write = written.pop((shard, slot), None)
            assert write is not None, f"{where}: an entry committed before its payload"
            if sync_mode == "always":
                assert last_sync[shard] > write, f"{where}: committed before it was durable"
            named.add((shard, slot))
            unsynced[shard].append(write)
        elif event == "index-delete":
            named.discard((shard, slot))
        elif event == "slot-free":
            assert (shard, slot) not in named, f"{where}: freed while an entry names it"
        elif event == "index-sync":
            assert all(last_sync[shard] > write for write in unsynced[shard]), (
                f"{where}: the index synced before the payloads it covers")
            unsynced[shard] = []


def run_workload(root: Path, sync_mode: str) -> list[Event]:
    """Puts, overwrites, deletes (alone and in put batches), reads and syncs, through the
    tier and through TierIO's writer threads (one per shard); returns the trace."""
    events: list[Event] = []
    config = DiskTierConfig(path=root, max_bytes=64 * SIZE, sync_mode=sync_mode,
                            sync_every_bytes=4 * SIZE)
    rng = random.Random(5)
    keys = [support.pool_key(i, b"contract") for i in range(24)]
    with DiskTier(root, support.namespace_of(), support.part(0), config, SIZE,
                  trace=lambda *event: events.append(event)) as tier:
        for round_number in range(6):
            batch = rng.sample(keys, 8)
            drops = rng.sample([key for key in keys if key not in batch], 3)
            tier.put_many([(key, support.payload_for(key, SIZE, bytes([round_number])))
                           for key in batch], deletes=drops)
            tier.delete_many(rng.sample(keys, 2))
            out = memoryview(bytearray(SIZE))
            for key in batch:
                tier.read_into(key, out)
            if round_number % 2:
                tier.sync()
        slab = CpuSlab(num_slots=8, slot_bytes=SIZE, pin_memory="never")
        io = TierIO(tier, slab, write_batch_bytes=2 * SIZE)
        try:
            for job in range(6):
                for slot in range(8):
                    slab.memoryview(slot)[:] = support.payload_for(keys[job + slot], SIZE)
                io.submit_spill(SpillSpec(JobId(job + 1), tuple(
                    (keys[job + slot], SlotId(slot)) for slot in range(8)),
                    (keys[(job + 12) % 24],)))
                io.flush()
        finally:
            io.shutdown()
        tier.sync()
    return events


@pytest.mark.parametrize("sync_mode", ["periodic", "always", "close"])
def test_the_tier_keeps_the_order_the_contract_names(tmp_path: Path, sync_mode: str) -> None:
    events = run_workload(tmp_path, sync_mode)
    kinds = {event for event, _, _ in events}
    assert {"payload", "index-commit", "index-delete", "slot-free", "index-sync",
            "payload-sync"} <= kinds, kinds
    check_order(events, sync_mode)


def _defer_payloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: each slot is written (and traced) after the index txn commits."""
    pending: list[tuple[Any, ...]] = []
    write, index_txn = ShardWrites._write_slots, ShardWrites._index_txn

    def deferred_write(self: ShardWrites, *args: Any) -> None:
        pending.append(args)

    def index_then_payloads(self: ShardWrites, *args: Any, **kwargs: Any) -> Any:
        result = index_txn(self, *args, **kwargs)
        while pending:
            write(self, *pending.pop(0))
        return result

    monkeypatch.setattr(ShardWrites, "_write_slots", deferred_write)
    monkeypatch.setattr(ShardWrites, "_index_txn", index_then_payloads)


def _skip_payload_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: the slab is never made durable."""
    monkeypatch.setattr(ShardWrites, "_sync_slab", lambda self, lm, slab: None)


def _index_sync_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: the index is synced before the slab's payloads."""
    def sync_shard(self: ShardWrites, lm: Any, env: lmdb.Environment) -> None:
        env.sync(True)
        self.trace_event("index-sync", lm.shard)
        if lm.slab is not None:
            self._sync_slab(lm, lm.slab)

    monkeypatch.setattr(ShardWrites, "sync_shard", sync_shard)


def _free_before_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: a delete gives its slot back before its index txn commits."""
    index_txn = ShardWrites._index_txn

    def free_first(self: ShardWrites, lm: Any, env: lmdb.Environment, entries: Any,
                   deletes: Any, expect: Any = None) -> Any:
        with env.begin(db=lm.index) as txn:
            slots = [entry.slot for key in deletes
                     if (entry := unpack_index(txn.get(key))) is not None]
        for slot in slots:
            self.trace_event("slot-free", lm.shard, slot)
        return index_txn(self, lm, env, entries, deletes, expect)

    monkeypatch.setattr(ShardWrites, "_index_txn", free_first)


@pytest.mark.parametrize(("breakage", "sync_mode", "clause"), [
    (_defer_payloads, "periodic", "committed before its payload"),
    (_skip_payload_sync, "always", "committed before it was durable"),
    (_index_sync_first, "periodic", "synced before the payloads"),
    (_free_before_commit, "periodic", "freed while an entry names it"),
])
def test_each_clause_fails_when_its_ordering_is_broken_on_purpose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breakage: Callable[..., None],
        sync_mode: str, clause: str) -> None:
    breakage(monkeypatch)
    events = run_workload(tmp_path, sync_mode)
    with pytest.raises(AssertionError, match=clause):
        check_order(events, sync_mode)


# -- clause 3: a slot reused under an entry a crash brought back --------------------------

@contextmanager
def index_of(tier_path: Path, key: bytes) -> Iterator[Any]:
    """A write txn on the (closed) index of ``key``'s shard, and its index db."""
    env = lmdb.open(str(tier_path / f"shard-{shard_of(key)}"), max_dbs=4)
    try:
        with env.begin(write=True) as txn:
            yield txn, env.open_db(b"index", txn=txn)
    finally:
        env.close()


def _resurrected_read(root: Path, same_key: bool) -> tuple[ReadStatus, bytes, bytes]:
    """Write K (slot s), keep its index entry, delete K, write K2 (another key, or K again
    with other bytes) which reuses slot s, then put K's old entry back, as a crash that lost
    the delete would: (status of reading K, bytes read, K2's bytes)."""
    config = DiskTierConfig(path=root, max_bytes=64 * SIZE)
    key = support.pool_key(7, b"resurrect")
    other = key if same_key else bytes([key[0]]) + support.pool_key(8, b"resurrect")[1:]
    assert shard_of(other) == shard_of(key)
    with DiskTier(root, support.namespace_of(), support.part(0), config, SIZE) as tier:
        tier.put_many([(key, support.payload_for(key, SIZE))])
        lm = tier._shard(key)
        with lm._env.begin(db=lm.index) as txn:  # the entry a crash could bring back
            old = bytes(txn.get(key))
        tier.delete_many([key])
        newer = support.payload_for(other, SIZE, b"newer")
        tier.put_many([(other, newer)])
        with lm._env.begin(db=lm.index) as txn:
            reused = unpack_index(txn.get(other))
        first = unpack_index(old)
        assert reused is not None and first is not None and reused.slot == first.slot
        path = tier.path
    with index_of(path, key) as (txn, db):
        txn.put(key, old, db=db)
    with DiskTier(root, support.namespace_of(), support.part(0), config, SIZE) as tier:
        out = bytearray(SIZE)
        status = tier.read_into(key, memoryview(out))
        if not same_key:
            again = bytearray(SIZE)
            assert tier.read_into(other, memoryview(again)) is ReadStatus.OK
            assert bytes(again) == newer
    return status, bytes(out), newer


@pytest.mark.parametrize("same_key", [False, True], ids=["another key", "a newer write"])
def test_an_entry_brought_back_over_a_reused_slot_is_never_a_hit(
        tmp_path: Path, same_key: bool) -> None:
    status, _, _ = _resurrected_read(tmp_path, same_key)
    assert status is ReadStatus.CORRUPT


def test_without_the_sequence_check_a_reused_slot_would_serve_another_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken on purpose: the read checks the slot's own header and checksum but not that
    they are the entry's. Then K's resurrected entry serves the newer write's bytes."""
    def self_consistent_only(binding: bytes, key: bytes, head: Any, entry: IndexEntry,
                             payload_bytes: int, out: memoryview) -> str | None:
        from tierkv.tiers.disk.format import parse_header

        parsed = parse_header(head)
        assert not isinstance(parsed, str)
        (_, length, seq, check), _ = parsed
        return check_slot(binding, key, head, IndexEntry(entry.slab, entry.slot, length, seq,
                                                         check), payload_bytes, out)

    monkeypatch.setattr(disk_module, "check_slot", self_consistent_only)
    status, got, newer = _resurrected_read(tmp_path, same_key=True)
    assert status is ReadStatus.OK and got == newer  # the hit the sequence check prevents


# -- clause 4: SIGKILL at each step -------------------------------------------------------

KILL_POINTS = ["payload", "payload-sync", "index-commit", "index-delete", "slot-free",
               "index-sync"]
POOL = 16


def _kill_child(root: str, report_path: str, event: str, nth: int, sync_mode: str) -> None:
    """Write rounds of overwrites and deletes; SIGKILL itself at the ``nth`` ``event``.
    Reports ``I <key hex>...`` before a batch's deletes, ``D <key hex>...`` after they
    committed and ``C <round> <key hex>...`` after its writes committed."""
    fd = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    seen = [0]

    def trace(name: str, shard: int, slot: int) -> None:
        if name == event:
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    config = DiskTierConfig(path=Path(root), max_bytes=4 * POOL * SIZE, sync_mode=sync_mode,
                            sync_every_bytes=3 * SIZE)
    rng = random.Random(nth)
    keys = [support.pool_key(i, b"kill") for i in range(POOL)]
    with DiskTier(Path(root), support.namespace_of(), support.part(0), config, SIZE, trace=trace) as tier:
        for round_number in range(1, 200):
            batch = rng.sample(keys, 4)
            drops = rng.sample([key for key in keys if key not in batch], 2)
            os.write(fd, f"I {' '.join(k.hex() for k in drops)}\n".encode())
            tier.put_many([(key, support.payload_for(key, SIZE, bytes([round_number])))
                           for key in batch], deletes=drops)
            os.write(fd, f"D {' '.join(k.hex() for k in drops)}\n".encode())
            os.write(fd, f"C {round_number} {' '.join(k.hex() for k in batch)}\n".encode())
    os.write(fd, b"E the kill point was never reached\n")


@pytest.mark.parametrize(("event", "sync_mode"), [
    (event, mode) for mode in ("periodic", "always") for event in KILL_POINTS
    if (event, mode) != ("index-sync", "always")])  # always: each index commit is synced
def test_a_sigkill_at_each_step_never_yields_a_wrong_hit(tmp_path: Path, event: str,
                                                         sync_mode: str) -> None:
    context = support.forkserver()
    report = tmp_path / "report.txt"
    root = tmp_path / "store"
    kept = 0  # committed chunks checked after the kills
    for nth in (3, 11, 26):
        child = context.Process(target=_kill_child,
                                args=(str(root), str(report), event, nth, sync_mode))
        child.start()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL, (event, nth, child.exitcode)
        newest: dict[bytes, int] = {}  # key -> its last reported committed round
        must_have: set[bytes] = set()  # committed, and no delete of it was started since
        for line in report.read_text().splitlines():
            tag, _, rest = line.partition(" ")
            assert tag != "E", line
            if tag in ("I", "D"):
                must_have.difference_update(bytes.fromhex(k) for k in rest.split())
            else:
                round_text, _, hexes = rest.partition(" ")
                committed = [bytes.fromhex(k) for k in hexes.split()]
                newest.update(dict.fromkeys(committed, int(round_text)))
                must_have.update(committed)
        kept += len(must_have)
        config = DiskTierConfig(path=root, max_bytes=4 * POOL * SIZE)
        with DiskTier(root, support.namespace_of(), support.part(0), config, SIZE) as tier:
            assert tier.statistics().rebuilds == 0
            out = memoryview(bytearray(SIZE))
            for key in (support.pool_key(i, b"kill") for i in range(POOL)):
                status = tier.read_into(key, out)
                assert status is not ReadStatus.CORRUPT, (event, nth, key.hex())
                if key in must_have:  # committed: it must still be there
                    assert status is ReadStatus.OK, (event, nth, key.hex())
                if status is ReadStatus.OK:  # its own bytes, of its last committed write or
                    rounds = range(max(newest.get(key, 0), 1), 200)  # one just after it
                    assert any(bytes(out) == support.payload_for(key, SIZE, bytes([r]))
                               for r in rounds), (event, nth, key.hex())
            assert tier.verify().bad_keys == ()
        report.unlink()
    assert kept > 0, "every kill came before the first commit"
