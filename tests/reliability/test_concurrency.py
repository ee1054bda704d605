"""Concurrency: two rank processes write their own environments under one store root
while a third process inspects the root, and nothing corrupts, nothing is reported bad
that is not, and no lock error reaches anyone.

The workers (``concurrency_child.worker``) are two tensor-parallel ranks of one model:
same namespace, ``rank-0`` and ``rank-1`` environments, write-through spills and a disk
cap small enough that every spill also deletes old chunks. The inspector
(``concurrency_child.inspector``) loops over ``list_namespaces``, opens each rank's
DiskTier from the namespace description it found, and runs ``scan``, ``verify()`` and
reads, all while the ranks write and delete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.reliability import concurrency_child, support
from tierkv.tiers.disk.tier import list_namespaces


def _result(path: Path) -> dict[str, Any]:
    assert path.exists(), f"{path.name}: the process wrote no result"
    result: dict[str, Any] = json.loads(path.read_text())
    assert result["error"] is None, result["error"]
    return result


def test_two_ranks_write_while_a_third_process_inspects(tmp_path: Path) -> None:
    root = tmp_path / "store"
    stop = tmp_path / "stop"
    context = support.forkserver()
    workers = [context.Process(target=concurrency_child.worker,
                               args=(rank, str(root), str(tmp_path / f"rank-{rank}.json")))
               for rank in (0, 1)]
    inspector = context.Process(target=concurrency_child.inspector,
                                args=(str(root), str(tmp_path / "inspector.json"), str(stop)))
    for process in workers:
        process.start()
    inspector.start()
    try:
        for process in workers:
            process.join(120)
        stop.touch()
        inspector.join(120)
    finally:
        for process in (*workers, inspector):
            if process.is_alive():
                process.kill()
                process.join()
    ranks = [_result(tmp_path / f"rank-{rank}.json") for rank in (0, 1)]
    seen = _result(tmp_path / "inspector.json")
    assert [process.exitcode for process in (*workers, inspector)] == [0, 0, 0]

    # the ranks really wrote and evicted (deleted) while the inspector ran
    for result in ranks:
        assert result["stored"] == 4 * concurrency_child.REQUESTS
        assert result["disk_evictions"] > 0 and result["spills_ok"] > 0
        assert result["corrupt"] == 0
    # the inspector saw both ranks many times, found nothing bad, read good bytes
    assert seen["namespaces"] == [support.namespace_of().fingerprint()]
    assert seen["rounds"] >= 3 and set(seen["verified"]) == {"0", "1"}, seen
    assert seen["bad"] == 0, f"verify reported {seen['bad']} bad chunk(s) in healthy stores"
    assert seen["reads_corrupt"] == 0 and seen["reads_ok"] > 0, seen

    # afterwards: one namespace, two environments, each with only its own rank's chunks
    (info,) = list_namespaces(root)
    assert [part.index for part, _ in info.parts] == [0, 1]
    for rank, result in zip((0, 1), ranks):
        own = {bytes.fromhex(key) for key in result["keys"]}
        kv = support.make_kv()
        # disk.max_bytes is one cap for the path, and the other rank's files count in it
        # (docs/operations.md, "One cap per disk path"): a cap that holds both, so the
        # reopen deletes none of this rank's chunks.
        with support.open_store(root, kv, rank=rank,
                                disk_chunks=8 * concurrency_child.DISK_CHUNKS) as store:
            assert store.disk is not None and store.disk.verify().bad_keys == ()
            on_disk = sorted(record.key for record in store.disk.scan())
            assert on_disk and set(on_disk) <= own
            for start in range(0, len(on_disk), 8):
                group = on_disk[start : start + 8]
                num, completion = support.load_chunks(store, group, first_block=32)
                assert num == len(group) and completion is not None and completion.ok
                for i, key in enumerate(group):
                    assert support.chunk_matches(kv, key, support.chunk_blocks(i, 32))


def test_verify_while_another_thread_writes_and_deletes_reports_nothing_bad(
        tmp_path: Path) -> None:
    """The same race, made dense: verify in small batches while a writer thread keeps
    deleting and rewriting chunks. A chunk deleted between two of verify's transactions is
    gone, not corrupt: verify must check each batch in one snapshot."""
    import threading

    from tierkv.tiers.disk.tier import DiskTier

    size = 4096
    keys = [support.pool_key(i, b"verify-race") for i in range(64)]
    config = support.store_config(tmp_path).disk
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, size) as tier:
        tier.put_many([(key, support.payload_for(key, size)) for key in keys])
        stop = threading.Event()
        errors: list[BaseException] = []

        def churn() -> None:
            try:
                turn = 0
                while not stop.is_set():
                    batch = keys[turn % 8 :: 8]
                    tier.delete_many(batch)
                    tier.put_many([(key, support.payload_for(key, size)) for key in batch])
                    turn += 1
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=churn)
        thread.start()
        try:
            reports = [tier.verify(batch=2) for _ in range(60)]
        finally:
            stop.set()
            thread.join()
        assert not errors, errors
        assert sum(len(report.bad_keys) for report in reports) == 0, [
            report for report in reports if report.bad_keys][:3]
        assert all(report.checked > 0 for report in reports)
        assert tier.verify().bad_keys == () and tier.statistics().chunks == len(keys)
