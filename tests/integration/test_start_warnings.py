"""What a store says when it opens: a store opened under other settings than its chunks'
warns and names the settings that differ; chunks deleted at start (over the disk cap) are
a warning too, through the library API."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tierkv import StoreConfig, TierKVStore, chunk_keys
from tierkv.config import CpuTierConfig, DiskTierConfig


def open_store(path: Path, model_id: str = "m", max_bytes: int = 1 << 30,
               dtype: torch.dtype = torch.float16) -> TierKVStore:
    kv = [torch.ones(16, 2, 16, 2, 8, dtype=dtype)]
    return TierKVStore(kv, model_id=model_id, config=StoreConfig(
        blocks_per_chunk=2, device="cpu", cpu=CpuTierConfig(max_bytes=1 << 22),
        disk=DiskTierConfig(path=path, max_bytes=max_bytes)))


def fill(path: Path, chunks: int = 4) -> None:
    with open_store(path) as store:
        keys = chunk_keys(list(range(32 * chunks)), 32)
        store.wait([store.store(keys, list(range(chunks * 2)))])
        store.flush()


def test_a_store_opened_under_other_settings_warns_and_names_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        open_store(tmp_path).close()  # the same settings: its chunks, no warning
        assert not [r for r in caplog.records if "0 chunks found" in r.getMessage()]
        open_store(tmp_path, model_id="m-2", dtype=torch.bfloat16).close()
    warnings = [r.getMessage() for r in caplog.records if "0 chunks found" in r.getMessage()]
    assert len(warnings) == 1 and "model_id is 'm' there, 'm-2' here" in warnings[0]
    assert "dtype is 'float16' there, 'bfloat16' here" in warnings[0]


def test_chunks_deleted_at_start_are_a_warning(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    fill(tmp_path, chunks=4)
    one_chunk = 2 * 2 * 16 * 2 * 8 * 2 + 8192  # payload + the per-chunk overhead
    with open_store(tmp_path) as store:  # the cap counts the index files too (issue 41)
        files = store._share.budgets[0].fixed_bytes  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        open_store(tmp_path, max_bytes=2 * one_chunk + files).close()
    assert any("deleting 2 of the 4 chunk(s) found on disk at start" in r.getMessage()
               and r.levelno == logging.WARNING for r in caplog.records)
