"""TIERKV_CONFIG (a YAML file) and the TIERKV_* settings variables, through from_dict and the
declarations (tierkv.config_env): defaults, then the file, then the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.config import RemoteTierConfig, StoreConfig
from tierkv.config_env import environment_settings, from_environment, variables
from tierkv.errors import ConfigError
from tierkv.settings import declared
from tierkv.units import GiB

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_nothing_set_is_the_defaults() -> None:
    assert from_environment({"HOME": "/root", "TIERKV_MALLOPT": "0"}) == StoreConfig()


def test_the_file_then_the_variables(tmp_path: Path) -> None:
    path = tmp_path / "tierkv.yaml"
    path.write_text("blocks_per_chunk: 8\n"
                    "cpu:\n  max_bytes: 8GiB\n  eviction_policy: lru\n"
                    "disk:\n  path: /var/cache/tierkv\n  max_bytes: 64GiB\n")
    config = from_environment({
        "TIERKV_CONFIG": str(path), "TIERKV_CPU_MAX_BYTES": "1GiB",
        "TIERKV_DISK_WRITE_THROUGH": "true", "TIERKV_DISK_DIRECT_IO": "off",
        "TIERKV_REMOTE_URL": "redis://127.0.0.1:7000", "TIERKV_REMOTE_TIMEOUT_SECONDS": "0.25",
        "TIERKV_REMOTE_TTL_SECONDS": "none", "TIERKV_REMOTE_LOOKUP_CHUNKS": "32",
        "TIERKV_STORE_MODE": "async", "TIERKV_REMOTE_PASSWORD": "not-a-setting"})
    assert config.blocks_per_chunk == 8 and config.store_mode == "async"
    assert (config.cpu.max_bytes, config.cpu.eviction_policy) == (1 * GiB, "lru")
    assert config.disk.path == Path("/var/cache/tierkv") and config.disk.max_bytes == 64 * GiB
    assert config.disk.write_through is True and config.disk.direct_io is False
    assert config.remote == RemoteTierConfig(url="redis://127.0.0.1:7000", timeout_seconds=0.25,
                                             ttl_seconds=None, lookup_chunks=32)


def test_every_declared_setting_has_a_variable() -> None:
    names = set(variables())
    assert {f"TIERKV_{name.upper()}" for name in declared(StoreConfig)} <= names
    for section in ("cpu", "disk", "remote"):
        cls = type(getattr(StoreConfig(), section)) if section != "remote" else RemoteTierConfig
        assert {f"TIERKV_{section.upper()}_{name.upper()}" for name in declared(cls)} <= names
    assert "TIERKV_REMOTE_URL" in names and "TIERKV_REMOTE_PASSWORD" not in names


@pytest.mark.parametrize("environ,message", [
    ({"TIERKV_CPU_MAX_BYTES": "lots"}, r"TIERKV_CPU_MAX_BYTES must be an int >= 1 \(bytes\) "
                                       r"or a size such as '32GiB'.*got 'lots'"),
    ({"TIERKV_DISK_PAHT": "/x"}, r"TIERKV_DISK_PAHT names no setting; the disk settings' "
                                 r"variables are \['TIERKV_DISK_BUDGET_CHECK_SECONDS'"),
    ({"TIERKV_DISK_WRITE_THROUGH": "maybe"}, r"TIERKV_DISK_WRITE_THROUGH must be"),
    ({"TIERKV_REMOTE_TIMEOUT_SECONDS": "1"}, r"remote.url is required"),
    ({"TIERKV_DEVICE": "tpu"}, r"TIERKV_DEVICE must be one of \['auto', 'cpu', 'cuda'\], got 'tpu'"),
])
def test_a_bad_variable_is_an_error_that_names_it(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_environment(environ)


def test_a_password_variable_is_no_setting_and_never_shown() -> None:
    environ = {"TIERKV_REMOTE_PASSWORD_ENV": "TIERKV_REMOTE_PW", "TIERKV_REMOTE_PW": "s3cret",
               "TIERKV_REMOTE_PASSWORD": "s3cret", "TIERKV_REMOTE_URL": "redis://h:1"}
    assert environment_settings(environ) == {
        "remote": {"password_env": "TIERKV_REMOTE_PW", "url": "redis://h:1"}}
    with pytest.raises(ConfigError) as raised:
        from_environment({**environ, "TIERKV_REMOTE_LOOKUP_CHUNKS": "0"})
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize("text,message", [
    ("cpu:\n  max_byte: 1GiB\n", r"unknown setting\(s\) \['cpu.max_byte'\].*TIERKV_CONFIG="),
    ("- a list\n", r"must hold a mapping of settings"),
    ("cpu: [unclosed\n", r"is not valid YAML"),
])
def test_a_bad_file_is_an_error_that_names_it(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        from_environment({"TIERKV_CONFIG": str(path)})
    with pytest.raises(ConfigError, match=r"TIERKV_CONFIG='/nowhere.yaml' cannot be read"):
        from_environment({"TIERKV_CONFIG": "/nowhere.yaml"})


def test_the_docs_describe_the_file_and_the_variables() -> None:
    text = (DOCS / "configuration.md").read_text()
    assert "TIERKV_CONFIG" in text and "TIERKV_CPU_MAX_BYTES" in text
