"""The vLLM scheduler's KV-event records (tierkv.integrations.vllm_event_blocks), on real
LMDB files: they survive a reopen, a record of a chunk no longer on disk is dropped at start,
and damaged files are started anew with a warning, never an error."""

from __future__ import annotations

import logging
from array import array
from pathlib import Path

import pytest

from tierkv.integrations.vllm_event_blocks import ChunkEvent, EventBlocks

A, B = bytes([1]) * 32, bytes([2]) * 32


def chunk(seed: int) -> ChunkEvent:
    return ChunkEvent((bytes([seed]) * 32, bytes([seed + 1]) * 32),
                      None if seed == 0 else bytes([seed - 1]) * 32,
                      array("l", range(seed, seed + 16)))


def test_records_survive_a_reopen_and_follow_the_chunks_on_disk(tmp_path: Path) -> None:
    blocks = EventBlocks(tmp_path / "kv-events", 8, 512)
    blocks.update([(A, chunk(0)), (B, chunk(5))], [])
    blocks.close()
    blocks = EventBlocks(tmp_path / "kv-events", 8, 512)
    assert blocks.read({A}) == {A: chunk(0)}  # B is not on disk now: its record goes
    blocks.update([], [A])
    blocks.close()
    blocks = EventBlocks(tmp_path / "kv-events", 8, 512)
    assert blocks.read({A, B}) == {}
    blocks.close()


def test_damaged_records_start_anew_with_a_warning(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    blocks = EventBlocks(tmp_path / "kv-events", 8, 512)
    blocks.update([(A, chunk(0))], [])
    blocks.close()
    (tmp_path / "kv-events" / "data.mdb").write_bytes(b"not an LMDB file" * 512)
    with caplog.at_level(logging.WARNING, logger="tierkv.vllm"):
        blocks = EventBlocks(tmp_path / "kv-events", 8, 512)
    assert "starting them anew" in caplog.text
    assert blocks.read({A}) == {}
    blocks.update([(B, chunk(3))], [])
    assert blocks.read({B}) == {B: chunk(3)}
    blocks.close()


def test_a_record_of_another_shape_is_dropped_not_trusted(tmp_path: Path) -> None:
    """Regression: a record was unpacked without a check of its shape, so an integer where
    a block hash belongs became that many zero bytes (``bytes(n)``), an extension type was
    decoded, and a token id out of range raised OverflowError out of the start-up read."""
    import lmdb
    import msgpack

    blocks = EventBlocks(tmp_path / "kv-events", 8, 512)
    blocks.update([(A, chunk(0))], [])
    blocks.close()
    bad = [[[1 << 40], None, [1]], [[b"h"], None, [1 << 63]], [[b"h"], 7, [1]], [b"h"],
           msgpack.ExtType(1, b"x")]
    env = lmdb.open(str(tmp_path / "kv-events"), subdir=True)
    with env.begin(write=True) as txn:
        for number, record in enumerate(bad):
            txn.put(bytes([9, number]) * 16, msgpack.packb(record, use_bin_type=True))
    env.close()
    blocks = EventBlocks(tmp_path / "kv-events", 8, 512)
    keys = {A, *(bytes([9, number]) * 16 for number in range(len(bad)))}
    assert blocks.read(keys) == {A: chunk(0)}
    blocks.close()
