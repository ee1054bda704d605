"""TierKVStore(config=None) opens with TIERKV_CONFIG's file and the TIERKV_* variables."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierkv.engine.store import TierKVStore


def test_a_store_without_a_config_reads_the_file_and_the_variables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "store.yaml"
    path.write_text(f"blocks_per_chunk: 2\ndevice: cpu\n"
                    f"cpu: {{max_bytes: 1MiB, pin_memory: never}}\n"
                    f"disk: {{path: {tmp_path / 'disk'}, max_bytes: 64MiB}}\n")
    monkeypatch.setenv("TIERKV_CONFIG", str(path))
    monkeypatch.setenv("TIERKV_CPU_MAX_BYTES", "512KiB")
    kv = [torch.zeros((16, 2, 4, 8), dtype=torch.float16) for _ in range(2)]
    with TierKVStore(kv, model_id="m", tokens_per_block=4) as store:
        assert store.config.disk.path == tmp_path / "disk" and store.blocks_per_chunk == 2
        assert store.config.cpu.max_bytes == 512 << 10
        assert store.disk is not None
