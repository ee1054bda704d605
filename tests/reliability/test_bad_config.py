"""Bad configuration fails at once, with an error that names the setting and the value.

Every field of CpuTierConfig, DiskTierConfig, RemoteTierConfig and StoreConfig has bad
values below (a remote tier's with a good ``url`` beside them), checked
through the dataclass and through ``StoreConfig.from_dict`` (the path JSON and vLLM's
``kv_connector_extra_config`` take). A test pins that the table covers every field, so a
new setting without a bad-value case fails here. Also: the vLLM connector refuses vLLM
versions it was not built for, with a message that says what to install.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from tierkv.config import CpuTierConfig, DiskTierConfig, RemoteTierConfig, StoreConfig
from tierkv.errors import ConfigError, TierKVError

NAN = math.nan
BAD: dict[str, dict[str, list[Any]]] = {
    "cpu": {
        "max_bytes": [0, -1, 1.5, 4e9, "4 GiBs", "-4GiB", "0GiB", "1.5B", True, None, NAN],
        "pin_memory": ["yes", "", None, True, 1],
        "spill_ahead_fraction": [-0.1, 1.5, NAN, "0.5", None, True],
        "eviction_policy": ["mru", "", "LRU", "lru ", None, 1, ["lru"]],
    },
    "disk": {
        "path": [123, "", b"/tmp/cache", "/tmp/a\0b", ["/tmp"]],
        "max_bytes": [0, -5, 2.5, "1 gigabyte", "G", True, None, NAN, math.inf],
        "write_through": ["yes", 1, None],
        "write_batch_bytes": [0, -1, 1.5, "8 megs", True, NAN],
        "sync_mode": ["sometimes", "", None, 1],
        "sync_every_bytes": [0, -1, 1.0, NAN, "256Q"],
        "sync_every_seconds": [0, -1, NAN, "5", None, True],
        "retry_after_full_seconds": [-1, NAN, "1", None, True],
        "reader_threads": [0, -1, 2.0, "4", True, None],
        "tune_malloc": ["no", 0, None],
        "direct_io": ["yes", 1, None],
        "read_bytes_in_flight": [0, -1, "lots", 1.5, None],
        "budget_check_seconds": [0, -1, NAN, "10", None, True],
    },
    "remote": {
        "url": ["http://x", "", None, 6379, "redis:/h", "localhost:6379"],
        "key_prefix": ["", "a{b", "a*", "a b", None, 1],
        "timeout_seconds": [0, -1, NAN, "0.5", None, True],
        "min_mib_per_second": [0, -1, NAN, "64", None, True],
        "ttl_seconds": [0, -1, NAN, "60", True],
        "password_env": [None, 1, b"X"],
        "breaker_failures": [0, -1, 1.5, "5", True, None],
        "breaker_seconds": [0, -1, NAN, "10", None],
        "queue_bytes": [0, -1, 1.5, "lots", True, None],
        "push": ["always", "", None, True, "on-store"],
        "lookup_deadline_seconds": [0, -0.1, NAN, "0.01", None, True],
        "lookup_chunks": [0, -1, 2.5, "64", True, None],
        "mark_seconds": [0, -1, NAN, "10", None],
        "reader_threads": [0, -1, 2.0, "4", True, None],
        "usage_seconds": [-1, NAN, "30", None, True],
        "tune_malloc": ["no", 0, None],
    },
    "store": {
        "blocks_per_chunk": [0, -1, 1.5, "16", True, None],
        "cpu": ["cpu", None, 4, {"max_bytes": 1}],
        "disk": ["/tmp/cache", None, {"path": "/tmp/cache"}],
        "device": ["gpu", "", None, 0],
        "rank": [-1, 1.5, "0", True, None],
        "tp_size": [0, -1, 1.5, "2", True, None, 1 << 16],
        "remote": ["redis://h:6379", 3, {"url": "redis://h"}],
        "store_mode": ["sync", "", "COPIED", None, 1, True],
        "model_path": [123, "", "/tmp/a\0b", ["/models/m"]],
        "model_fingerprint": ["", None, 1, "a\0b", True],
    },
}
CLASSES = {"cpu": CpuTierConfig, "disk": DiskTierConfig, "remote": RemoteTierConfig,
           "store": StoreConfig}
URL = "redis://127.0.0.1:6379"  # beside a bad remote setting: the one good field it needs
CASES = [(section, name, value) for section, table in BAD.items()
         for name, values in table.items() for value in values]
IDS = [f"{section}.{name}={value!r}" for section, name, value in CASES]
# A dict is how from_dict takes the cpu and disk sections: bad only for the dataclass.
DICT_CASES = [(case, case_id) for case, case_id in zip(CASES, IDS)
              if not (case[0] == "store" and isinstance(case[2], dict))]


def _check_message(error: ConfigError, section: str, name: str, value: Any) -> None:
    message = str(error)
    setting = name if section == "store" else f"{section}.{name}"
    assert setting in message, f"{message!r} does not name {setting}"
    assert repr(value) in message or str(value) in message, f"{message!r} does not show {value!r}"


def test_the_table_covers_every_setting() -> None:
    for section, cls in CLASSES.items():
        assert set(BAD[section]) == {f.name for f in fields(cls)}, section


@pytest.mark.parametrize(("section", "name", "value"), CASES, ids=IDS)
def test_bad_value_names_setting_and_value(section: str, name: str, value: Any) -> None:
    kwargs = {"url": URL} if section == "remote" else {}
    with pytest.raises(ConfigError) as raised:
        CLASSES[section](**{**kwargs, name: value})
    _check_message(raised.value, section, name, value)


@pytest.mark.parametrize(("section", "name", "value"), [case for case, _ in DICT_CASES],
                         ids=[case_id for _, case_id in DICT_CASES])
def test_bad_value_through_from_dict(section: str, name: str, value: Any) -> None:
    raw: dict[str, Any] = {name: value} if section == "store" else {section: {name: value}}
    if section == "remote":
        raw["remote"] = {"url": URL, **raw["remote"]}
    with pytest.raises(ConfigError) as raised:
        StoreConfig.from_dict(raw)
    _check_message(raised.value, section, name, value)


def test_good_values_pass_and_from_dict_builds_the_same_config(tmp_path: Path) -> None:
    """The bad values above are bad for their own reason: the same shapes with good
    values are accepted (so each case above fails on its value alone)."""
    raw: dict[str, Any] = {
        "blocks_per_chunk": 8, "device": "cpu", "rank": 1,
        "cpu": {"max_bytes": 1 << 20, "pin_memory": "never", "spill_ahead_fraction": 0.0},
        "disk": {"path": str(tmp_path), "max_bytes": 1 << 30, "write_through": True,
                 "write_batch_bytes": 1 << 20, "sync_mode": "always", "sync_every_bytes": 1,
                 "sync_every_seconds": 0.5, "retry_after_full_seconds": 0.0,
                 "reader_threads": 2, "tune_malloc": False}}
    config = StoreConfig.from_dict(raw)
    assert config == StoreConfig(blocks_per_chunk=8, device="cpu", rank=1,
                                 cpu=CpuTierConfig(**raw["cpu"]),
                                 disk=DiskTierConfig(**raw["disk"]))
    assert config.disk.path == tmp_path
    assert DiskTierConfig(sync_every_seconds=math.inf).sync_every_seconds == math.inf


def test_a_remote_tier_from_dict_and_what_it_refuses(tmp_path: Path) -> None:
    remote = {"url": "redis://u:secret@127.0.0.1:7000,redis://127.0.0.1:7001",
              "key_prefix": "fleet-a:", "push": "on_evict", "lookup_deadline_seconds": 0.05,
              "ttl_seconds": 3600, "queue_bytes": 1 << 20}
    config = StoreConfig.from_dict({"disk": {"path": str(tmp_path)}, "remote": remote})
    assert config.remote == RemoteTierConfig(**remote)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="remote.url is required"):
        StoreConfig.from_dict({"remote": {"key_prefix": "a:"}})
    with pytest.raises(ConfigError, match="remote.push='on_evict'.*disk.path"):
        StoreConfig.from_dict({"remote": remote})  # no disk tier to be evicted to
    with pytest.raises(ConfigError, match="remote.lookup_chunk") as raised:
        StoreConfig.from_dict({"remote": {"url": "redis://h", "lookup_chunk": 3}})
    assert "unknown setting" in str(raised.value)
    with pytest.raises(ConfigError) as raised:  # a bad URL is shown without its password
        RemoteTierConfig(url="http://user:hunter2@h:1")
    assert "hunter2" not in str(raised.value) and "***" in str(raised.value)


@pytest.mark.parametrize(("raw", "named"), [
    ({"blocks": 16}, "blocks"),
    ({"cpu": {"max_byte": 1}}, "cpu.max_byte"),
    ({"disk": {"pathh": "/tmp"}}, "disk.pathh"),
])
def test_unknown_settings_are_named(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match="unknown setting") as raised:
        StoreConfig.from_dict(raw)
    assert named in str(raised.value)


@pytest.mark.parametrize("raw", [None, [("cpu", {})], "cpu", 3])
def test_from_dict_needs_a_mapping(raw: Any) -> None:
    with pytest.raises(ConfigError) as raised:
        StoreConfig.from_dict(raw)
    assert repr(raw) in str(raised.value)


# -- vLLM version check -------------------------------------------------------------------

SUPPORTED = ["0.33.0", "0.33.1", "0.33.2rc1", "0.33.0+cu124", "0.32.0", "0.32.0+cpu", "0.32.9",
             "0.34.0", "0.34.1rc2"]
UNSUPPORTED = ["0.31.9", "0.35.0", "1.33.0", "0.3.3", "0.33", "33", "v0.33.0", "unknown", ""]


@pytest.mark.parametrize("version", SUPPORTED)
def test_supported_vllm_versions_pass(version: str) -> None:
    from tierkv.integrations.vllm_versions import check_vllm_version

    check_vllm_version(version)


@pytest.mark.parametrize("version", UNSUPPORTED)
def test_unsupported_vllm_version_gives_a_clear_message(version: str) -> None:
    from tierkv.integrations.vllm_versions import UnsupportedVersionError, check_vllm_version

    if version == "0.33":  # major.minor alone is a valid 0.33 version string
        check_vllm_version(version)
        return
    with pytest.raises(UnsupportedVersionError) as raised:
        check_vllm_version(version)
    message = str(raised.value)
    assert f"vLLM {version} is not supported" in message
    assert "0.32.x, 0.33.x and 0.34.x" in message and "pip install" in message
    assert isinstance(raised.value, TierKVError)


def test_importing_the_connector_under_another_vllm_fails_with_the_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector module checks the version it reads from ``vllm.__version__`` as it is
    imported (before it touches vLLM's connector API): a stand-in vllm module reporting
    0.35.0 makes the import fail with UnsupportedVersionError, not an AttributeError or
    ImportError from deep inside vLLM."""
    from tierkv.integrations.vllm_versions import UnsupportedVersionError

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.35.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delitem(sys.modules, "tierkv.integrations.vllm", raising=False)
    with pytest.raises(UnsupportedVersionError, match=r"vLLM 0\.35\.0 is not supported"):
        importlib.import_module("tierkv.integrations.vllm")
    assert "tierkv.integrations.vllm" not in sys.modules


def test_sizes_are_ints_or_size_strings_as_vllm_reads_them(tmp_path: Path) -> None:
    config = StoreConfig.from_dict({
        "cpu": {"max_bytes": "32GiB"}, "disk": {"path": str(tmp_path), "max_bytes": "64G",
                                                 "write_batch_bytes": "8MiB",
                                                 "sync_every_bytes": "500MB"},
        "remote": {"url": "redis://h", "queue_bytes": "1.5GiB"}})
    assert config.cpu.max_bytes == 32 << 30 and config.disk.max_bytes == 64 << 30
    assert config.disk.write_batch_bytes == 8 << 20 and config.disk.sync_every_bytes == 500 * 10**6
    assert config.remote is not None and config.remote.queue_bytes == 3 << 29
    assert CpuTierConfig(max_bytes=" 4 KiB ").max_bytes == 4096  # type: ignore[arg-type]
