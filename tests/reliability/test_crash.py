"""Crash safety: a writer killed with SIGKILL loses nothing it had committed.

A child process (``crash_child.py``, started from a forkserver that has torch and tierkv
imported) writes to one disk tier under load and reports every commit after it is known.
The test kills it at a random moment, 20 times, alternating the DiskTier + TierIO path
(batched spill jobs with deletes) and the TierKVStore path (write-through spills). After
each kill the parent reopens the store through the public API and checks that the
environment opens without being moved aside, ``verify()`` finds nothing, every chunk
reported committed is there, every chunk whose delete was reported committed is gone, and
every chunk the store serves is byte-exact.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from tests.reliability import crash_child, support
from tierkv.tiers.disk.tier import list_namespaces

ROUNDS = 20


class Ledger:
    """What the parent knows from the children's reports."""

    def __init__(self) -> None:
        self.must_have: set[bytes] = set()
        self.must_not: set[bytes] = set()
        self.commits = 0
        self.deletes = 0

    def apply(self, lines: list[str]) -> None:
        for line in lines:
            tag, _, body = line.partition(" ")
            if tag in ("R", "E"):
                continue
            keys = {bytes.fromhex(word) for word in body.split()}
            if tag == "C":  # committed
                self.must_have |= keys
                self.must_not -= keys
                self.commits += len(keys)
            elif tag == "W":  # a write in flight: a deleted chunk may come back
                self.must_not -= keys
            elif tag == "D":  # a delete in flight: either way is fine
                self.must_have -= keys
                self.must_not -= keys
            elif tag == "X":  # the delete committed
                self.must_not |= keys
                self.deletes += len(keys)
            else:
                raise AssertionError(f"unknown report line {line!r}")


def read_report(path: Path) -> list[str]:
    """Complete lines only: a kill may cut the last write short."""
    if not path.exists():
        return []
    text = path.read_text()
    return text.split("\n")[:-1]


def wait_ready(proc: object, path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = read_report(path)
        errors = [line for line in lines if line.startswith("E ")]
        assert not errors, errors
        if any(line.startswith("R ") for line in lines):
            return
        assert proc.is_alive(), f"child exited with {proc.exitcode} before it was ready"  # type: ignore[attr-defined]
        time.sleep(0.005)
    raise AssertionError(f"child not ready after {timeout} s")


def check_after_crash(root: Path, ledger: Ledger) -> int:
    """Reopen through the public API and check everything; returns the chunks on disk."""
    assert not list(root.glob("ns-*/part-*/shard-*.broken-*")), "a crash must not damage them"
    if not list(root.glob("ns-*/part-0of2/shard-*/data.mdb")):
        assert not ledger.must_have
        return 0
    kv = support.make_kv()
    with support.open_store(root, kv) as store:
        assert store.disk is not None
        report = store.disk.verify()
        assert report.bad_keys == (), f"verify found {len(report.bad_keys)} bad chunk(s)"
        on_disk = {record.key for record in store.disk.scan()}
        assert report.checked == len(on_disk)
        lost = ledger.must_have - on_disk
        assert not lost, f"{len(lost)} committed chunk(s) lost, e.g. {sorted(lost)[0].hex()}"
        back = ledger.must_not & on_disk
        assert not back, f"{len(back)} chunk(s) whose delete committed came back"
        keys = sorted(on_disk)
        for start in range(0, len(keys), 8):
            group = keys[start : start + 8]
            assert store.lookup(group) == len(group)
            blocks = [support.chunk_blocks(i, 32) for i in range(len(group))]
            support.poison(kv, [b for chunk in blocks for b in chunk])
            num, completion = support.load_chunks(store, group, first_block=32)
            assert num == len(group) and completion is not None and completion.ok, completion
            for key, chunk in zip(group, blocks):
                assert support.chunk_matches(kv, key, chunk), f"chunk {key.hex()[:8]} differs"
        stats = store.statistics().index
        assert stats.corrupt == 0 and stats.loads_failed == 0
    assert [info.fingerprint for info in list_namespaces(root)] == [
        support.namespace_of().fingerprint()]
    return len(keys)


def test_sigkill_at_random_moments_loses_nothing_committed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    context = support.forkserver()
    ledger = Ledger()
    rng = random.Random(20240601)
    rounds_with_commits = 0
    on_disk = 0
    for round_number in range(ROUNDS):
        mode = "diskio" if round_number % 2 == 0 else "store"
        report = tmp_path / f"report-{round_number:02d}.txt"
        proc = context.Process(target=crash_child.run_child,
                               args=(mode, str(root), str(report), round_number), daemon=True)
        proc.start()
        if round_number % 5 == 4:  # a random moment of start-up (opening, first commits)
            time.sleep(rng.uniform(0.0, 0.08))
        else:
            wait_ready(proc, report)
            time.sleep(rng.uniform(0.02, 0.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        lines = read_report(report)
        errors = [line for line in lines if line.startswith("E ")]
        assert not errors, f"round {round_number} ({mode}): child failed: {errors}"
        assert proc.exitcode == -signal.SIGKILL, (
            f"round {round_number} ({mode}): child ended with {proc.exitcode} before the kill")
        before = ledger.commits
        ledger.apply(lines)
        rounds_with_commits += ledger.commits > before
        on_disk = check_after_crash(root, ledger)
    # the kills landed while the children were writing, not before or after
    assert rounds_with_commits >= ROUNDS // 2, rounds_with_commits
    assert ledger.deletes > 0 and on_disk >= 64, (ledger.deletes, on_disk)
