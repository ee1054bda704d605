"""The one INFO line a library store logs when it opens: tiers with binary sizes, the disk
cap, tokens per chunk and the namespace's short id (the vLLM connector's ranks log the same
line: tests/integration/test_vllm_logging.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tierkv.units import format_bytes

from tests.integration.test_store import TOKENS_PER_BLOCK, BPC, make_kv, open_store


def test_a_store_logs_one_line_with_its_tiers_sizes_and_namespace(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: the library store logged nothing when it opened."""
    with caplog.at_level(logging.INFO, logger="tierkv"):
        with open_store(tmp_path, make_kv(), cpu_chunks=4, disk_chunks=64) as store:
            short = store.namespace.fingerprint()[:8]
            chunk, cap = store.chunk_bytes, store.config.disk.max_bytes
    lines = [record for record in caplog.records if " open, namespace " in record.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage() == (
        f"tierkv: store open, namespace {short}: CPU {format_bytes(4 * chunk)} (4 chunks), "
        f"disk at {tmp_path / 'store'} capped at {format_bytes(cap)}; "
        f"{BPC * TOKENS_PER_BLOCK} tokens a chunk of {format_bytes(chunk)}")


def test_a_store_without_disk_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierkv"):
        with open_store(None, make_kv(), cpu_chunks=2):
            pass
    line = next(r.getMessage() for r in caplog.records if " open, namespace " in r.getMessage())
    assert "no disk tier" in line and "remote" not in line


def test_config_info_shows_the_tokens_per_chunk_in_use() -> None:
    with open_store(None, make_kv(), cpu_chunks=2) as store:
        info = store.config_info()
    assert info["tokens_per_chunk"] == str(BPC * TOKENS_PER_BLOCK)
    assert info["namespace"] == store.namespace.fingerprint()
