"""The disk opener (tiers/disk/opener.py) and the one write-batch loop
(``LowerTier.put_in_batches``), on real LMDB files in ``tmp_path``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.config import DiskTierConfig
from tierkv.errors import ClosedError, ConfigError, UsageError
from tierkv.keys import Namespace, Part
from tierkv.tiers.disk import opener
from tierkv.tiers.disk.opener import close_disk, open_disk

PAYLOAD = 4096
NS = Namespace(model_id="opener", dtype="float16", kv_layout="NHD", page_bytes=512,
               tokens_per_chunk=16)


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_a_scan_shares_the_writers_handle_and_a_second_writer_is_refused(tmp_path: Path) -> None:
    config = DiskTierConfig(path=tmp_path, max_bytes=64 << 20)
    writer = open_disk(config, NS, Part(0, 1), "writer", payload_bytes=PAYLOAD)
    try:
        assert writer.claimed
        scan = open_disk(config, NS, Part(0, 1), "scan", payload_bytes=PAYLOAD)
        assert scan is writer  # one LMDB handle per environment and process
        with pytest.raises(ConfigError, match=r"^engine X: no \(.*in use by this process"):
            open_disk(config, NS, Part(0, 1), "writer", payload_bytes=PAYLOAD,
                      refusal="engine X: no")
        close_disk(scan)
        writer.put_many([(_key(1), bytes(PAYLOAD))])  # still open: the writer holds it
    finally:
        close_disk(writer, writer=True)
    assert opener._HELD == {}
    with pytest.raises(ClosedError):
        writer.put_many([(_key(2), bytes(PAYLOAD))])
    # a writer again once the last one is gone; a tool reads it, read-only
    again = open_disk(config, NS, Part(0, 1), "writer", payload_bytes=PAYLOAD)
    close_disk(again, writer=True)
    tool = open_disk(config, NS, Part(0, 1), "tool", payload_bytes=PAYLOAD)
    try:
        assert tool.read_only and [r.key for r in tool.scan()] == [_key(1)]
        with pytest.raises(UsageError):
            tool.put_many([(_key(3), bytes(PAYLOAD))])
    finally:
        close_disk(tool)


def test_put_in_batches_writes_transactions_of_batch_bytes_and_stops_at_an_error(
        tmp_path: Path) -> None:
    config = DiskTierConfig(path=tmp_path, max_bytes=64 << 20)
    tier = open_disk(config, NS, Part(0, 1), "writer", payload_bytes=PAYLOAD)
    try:
        items = [(_key(i), bytes([i]) * PAYLOAD) for i in range(7)]
        done = tier.put_in_batches(items, 3 * PAYLOAD)
        assert done.txns == 3 and done.error is None  # 3 + 3 + 1
        assert sorted(done.written) == sorted(key for key, _ in items) and done.full == []
        bad = [(_key(10), bytes(PAYLOAD)), (_key(11), bytes(PAYLOAD)), (b"short", b"x")]
        done = tier.put_in_batches(bad, 2 * PAYLOAD)  # the second transaction is refused
        assert done.txns == 1 and isinstance(done.error, UsageError)  # a 5-byte key
        assert sorted(done.written) == [_key(10), _key(11)]
    finally:
        close_disk(tier, writer=True)
