"""The one way the index is rebuilt from the disk tier at start (engine/disk_start.py),
shared by TierKVStore and the vLLM connector's scheduler."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tierkv.core.index import BlockIndex
from tierkv.engine.disk_start import FoundOnDisk, rebuild_index
from tierkv.keys import Namespace
from tierkv.tiers.base import ChunkRecord

NS = Namespace(model_id="start", dtype="float16", kv_layout="NHD", page_bytes=64,
               tokens_per_chunk=16)


class Records:
    """A tier as the scan sees it: its index records only."""

    def __init__(self, *records: tuple[bytes, int]) -> None:
        self.records = [ChunkRecord(key, 16, seq) for key, seq in records]

    def scan(self) -> list[ChunkRecord]:
        return self.records


def test_keys_are_ordered_by_their_newest_write_over_every_part() -> None:
    found = FoundOnDisk()
    found.scan(Records((b"a", 5), (b"b", 1), (b"c", 3)))
    found.scan(Records((b"a", 2), (b"c", 9)))
    assert found.holders == {b"a": 2, b"b": 1, b"c": 2}
    assert found.oldest_first() == [b"b", b"a", b"c"]
    assert found.oldest_first([b"c", b"a"]) == [b"a", b"c"]


def test_the_index_holds_what_the_capacity_allows_and_says_what_goes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    index = BlockIndex(num_slots=2, disk_capacity=1)
    log = logging.getLogger("tierkv.test")
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        found = rebuild_index(index, [b"a", b"b", b"c", b"d"], 3, root=tmp_path,
                              namespace=NS, cap="disk.max_bytes=3", log=log)
    assert found == 3 and index.disk_capacity == 3 and index.disk_used == 3
    (warning,) = [record.getMessage() for record in caplog.records]
    assert warning.startswith("tierkv: deleting 1 of the 4 chunk(s) found on disk at start")
    assert "(3 chunks) of disk.max_bytes=3" in warning and str(tmp_path) in warning
