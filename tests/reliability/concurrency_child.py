"""Child processes of ``test_concurrency.py``.

- :func:`worker`: one tensor-parallel rank: a TierKVStore with ``rank=<r>`` under the shared
  root, storing requests with write-through and a disk cap small enough that the store
  evicts (deletes) chunks on disk all the time, loading some back, flushing now and then.
- :func:`inspector`: an operator's tool running meanwhile: ``list_namespaces``, then for
  each rank a DiskTier opened from the namespace description it found, ``scan``,
  ``verify()`` (no repair) and a few reads, again and again until told to stop.

Each writes one JSON result file; an exception is recorded there with its traceback.
"""

from __future__ import annotations

import json
import random
import time
import traceback
from pathlib import Path
from typing import Any

from tests.reliability import support

DISK_CHUNKS = 24  # one cap the two ranks share: far fewer than they store, so evictions go on
REQUESTS = 36


def _write(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result))


def worker(rank: int, root: str, result_path: str) -> None:
    result: dict[str, Any] = {"rank": rank, "error": None}
    try:
        kv = support.make_kv()
        rng = random.Random(rank)
        with support.open_store(Path(root), kv, rank=rank, disk_chunks=DISK_CHUNKS,
                                write_through=True,
                                write_batch_bytes=2 * support.CHUNK_BYTES) as store:
            stored: list[bytes] = []
            for number in range(REQUESTS):
                keys = support.request_keys(rank * 10_000 + number)
                completion = support.store_chunks(store, kv, keys)
                if completion is not None and not completion.ok:
                    raise AssertionError(f"store failed: {completion}")
                stored += keys
                if number % 4 == 3:
                    store.flush()
                    again = support.request_keys(rank * 10_000 + rng.randrange(number + 1))
                    hits = store.lookup(again)
                    if hits:
                        blocks = [support.chunk_blocks(i, 32) for i in range(hits)]
                        num, completion = support.load_chunks(store, again[:hits], 32)
                        failed = set(completion.failed_keys) if completion else set()
                        for key, chunk in zip(again[:num], blocks):
                            if key not in failed and not support.chunk_matches(kv, key, chunk):
                                raise AssertionError(f"rank {rank}: chunk {key.hex()[:8]} differs")
            stats = store.statistics().index
            result.update(stored=len(set(stored)), disk_evictions=stats.disk_evictions,
                          spills_ok=stats.spills_ok, corrupt=stats.corrupt,
                          keys=sorted({key.hex() for key in stored}))
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        _write(result_path, result)


def inspector(root: str, result_path: str, stop_path: str) -> None:
    from tierkv.keys import Namespace
    from tierkv.tiers.disk.tier import DiskTier, ReadStatus, list_namespaces

    result: dict[str, Any] = {"error": None, "rounds": 0, "verified": {}, "bad": 0, "reads_ok": 0,
                              "reads_missing": 0, "reads_corrupt": 0, "namespaces": []}
    config = support.store_config(Path(root), disk_chunks=DISK_CHUNKS).disk
    out = memoryview(bytearray(support.CHUNK_BYTES))
    try:
        last = False
        while not last:
            last = Path(stop_path).exists()  # one more full round after the workers ended
            infos = list_namespaces(Path(root))
            result["namespaces"] = sorted({info.fingerprint for info in infos})
            for info in infos:
                namespace = Namespace(**info.description)
                for part, _ in info.parts:
                    rank = part.index
                    with DiskTier(Path(root), namespace, part, config, support.CHUNK_BYTES) as tier:
                        keys = [record.key for record in tier.scan()]
                        report = tier.verify(batch=4)  # many short txns: writers run between them
                        result["bad"] += len(report.bad_keys)
                        verified = result["verified"]
                        verified[str(rank)] = verified.get(str(rank), 0) + 1
                        for key in keys[:: max(1, len(keys) // 6)]:
                            status = tier.read_into(key, out)
                            if status is ReadStatus.OK:
                                if bytes(out) != support.payload_for(key):
                                    raise AssertionError(f"rank {rank}: chunk {key.hex()[:8]} differs")
                                result["reads_ok"] += 1
                            elif status is ReadStatus.MISSING:  # evicted since the scan
                                result["reads_missing"] += 1
                            else:
                                result["reads_corrupt"] += 1
            result["rounds"] += 1
            time.sleep(0.005)
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        _write(result_path, result)
