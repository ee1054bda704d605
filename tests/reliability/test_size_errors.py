"""Sizes and settings this machine or LMDB cannot honour fail at once with a
:class:`ConfigError` that names the setting, the value and the limit, never a raw torch or
LMDB error, and never a warning after which the store runs without a tier. A refused store
leaves nothing claimed: the same path opens afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.errors import ConfigError

PAGE_SHAPE = (2, 4, 8)
BPC = 2


def make_kv() -> list[torch.Tensor]:
    return [torch.zeros((8, *PAGE_SHAPE), dtype=torch.float16) for _ in range(2)]


CHUNK_BYTES = 2 * BPC * 2 * 4 * 8 * 2  # layers x blocks x page elements x 2 bytes


def open_store(tmp_path: Path | None, **settings: object) -> TierKVStore:
    cpu = settings.pop("cpu", CpuTierConfig(max_bytes=4 * CHUNK_BYTES))
    disk = DiskTierConfig(path=tmp_path / "store", **settings) if tmp_path else DiskTierConfig()  # type: ignore[arg-type]
    config = StoreConfig(blocks_per_chunk=BPC, cpu=cpu, disk=disk, device="cpu")  # type: ignore[arg-type]
    return TierKVStore(make_kv(), model_id="m", tokens_per_block=4, config=config)


def test_a_cpu_tier_larger_than_the_machine_names_the_setting_and_the_memory(tmp_path: Path) -> None:
    assert os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 10 << 40
    with pytest.raises(ConfigError) as error:
        open_store(tmp_path, cpu=CpuTierConfig(max_bytes="10TiB"))  # type: ignore[arg-type]
    message = str(error.value)
    assert "cpu.max_bytes" in message and "10.00 TiB" in message and "machine's memory" in message
    with open_store(tmp_path) as store:  # the disk tier the failed store opened was released
        assert store.disk is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory works with CUDA")
def test_pinned_memory_without_cuda_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cpu.pin_memory='always' needs CUDA.*'auto'.*'never'"):
        open_store(tmp_path, cpu=CpuTierConfig(max_bytes=4 * CHUNK_BYTES, pin_memory="always"))
    with open_store(tmp_path, cpu=CpuTierConfig(max_bytes=4 * CHUNK_BYTES, pin_memory="never")):
        pass


@pytest.mark.parametrize("cap", ["60TiB", "100TiB", "1000TiB"])
def test_a_disk_cap_past_what_lmdb_can_map_names_the_largest_that_fits(tmp_path: Path, cap: str) -> None:
    with pytest.raises(ConfigError) as error:
        open_store(tmp_path, max_bytes=cap)
    message = str(error.value)
    assert f"disk.max_bytes={cap[:-3]} TiB" in message and "LMDB maps" in message
    largest = message.rsplit("at most ", 1)[1]  # depends on the chunk size (a page each)
    assert largest.endswith("TiB") and 1 < float(largest.split()[0]) < 60
    with open_store(tmp_path, max_bytes="1GiB") as store:  # nothing claimed, nothing left open
        assert store.index.disk_capacity > 0


@pytest.mark.parametrize("cap", [1, 4096, CHUNK_BYTES + 8191])
def test_a_disk_cap_below_one_chunk_is_an_error_not_a_warning(tmp_path: Path, cap: int) -> None:
    with pytest.raises(ConfigError) as error:
        open_store(tmp_path, max_bytes=cap)
    message = str(error.value)
    assert f"disk.max_bytes={cap} holds no chunk" in message
    assert f"at least {CHUNK_BYTES + 8192}" in message and "disk.path=None" in message
    with pytest.raises(ConfigError) as error:  # the cap counts the index files too (issue 41)
        open_store(tmp_path, max_bytes=CHUNK_BYTES + 8192)
    message = str(error.value)
    assert f"disk.max_bytes={CHUNK_BYTES + 8192} holds no chunk beside this store's index " \
           f"files" in message and "disk.path=None" in message
    least = int(message.split("at least ")[1].split(",")[0])
    with open_store(tmp_path, max_bytes=least) as store:  # the least it names holds one
        assert store.index.disk_capacity == 1
