"""The remote tier's password, fed through every input tierkv takes (the URL, the default
variable ``TIERKV_REMOTE_PASSWORD``, another one named by ``remote.password_env``, vLLM's
``kv_connector_extra_config``), never appears in any output: reprs, errors, log lines (every
logger, DEBUG and up), statistics, figures, metric labels and samples, CLI output. A real
3-master cluster of this module's own requires the password; a wrong one is refused with one
line that says so."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tests.integration.test_remote_store import BPC, TPC, caches, conversation, loaded, zeros
from tests.redis_cluster import HOST, RedisCluster
from tierkv import chunk_keys
from tierkv.cli import main
from tierkv.config import CpuTierConfig, RemoteTierConfig, StoreConfig
from tierkv.engine.metrics import register_store_metrics
from tierkv.engine.store import TierKVStore
from tierkv.errors import TierKVError
from tierkv.integrations import vllm_config

SECRET = "tierkv-S3cr3t-pw"


@pytest.fixture(scope="module")
def locked_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A cluster whose every node requires SECRET (set once the cluster is up)."""
    with RedisCluster(tmp_path_factory.mktemp("locked-cluster")) as cluster:
        for port in cluster.ports:
            node = redis.Redis(host=HOST, port=port)
            node.config_set("requirepass", SECRET)
            node.close()
        yield cluster


@pytest.fixture()
def outputs(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
            ) -> Iterator[list[str]]:
    """Everything printed or logged (every logger at DEBUG); the test adds what it made."""
    collected: list[str] = []
    with caplog.at_level(logging.DEBUG):
        yield collected
        out, err = capsys.readouterr()
        collected += [out, err, caplog.text]
        collected += [record.getMessage() for record in caplog.records]
    for text in collected:
        assert SECRET not in text, text[max(0, text.find(SECRET) - 200):][:400]
    assert any(collected)


def url_of(cluster: RedisCluster, password: str | None = None) -> str:
    return f"redis://:{password}@{HOST}:{cluster.ports[0]}" if password else cluster.url


def config_for(way: str, cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch,
               password: str = SECRET) -> RemoteTierConfig:
    """A remote config that gets ``password`` the given way (calls and lookups get 2 s: the
    library answers "not yet" after its deadline, and CI is slow)."""
    wait = {"lookup_deadline_seconds": 2.0, "timeout_seconds": 2.0}
    if way == "url":
        return RemoteTierConfig(url=url_of(cluster, password), **wait)
    if way == "env":
        monkeypatch.setenv("TIERKV_REMOTE_PASSWORD", password)
        return RemoteTierConfig(url=cluster.url, **wait)
    monkeypatch.setenv("TIERKV_TEST_OWN_VARIABLE", password)
    return RemoteTierConfig(url=cluster.url, password_env="TIERKV_TEST_OWN_VARIABLE", **wait)


def store_config(remote: RemoteTierConfig) -> StoreConfig:
    return StoreConfig(blocks_per_chunk=BPC, cpu=CpuTierConfig(max_bytes=1 << 22), device="cpu",
                       remote=remote)


def scrape(store: TierKVStore) -> str:
    registry = CollectorRegistry()
    register_store_metrics(store, registry, labels={"engine": "a"})
    return generate_latest(registry).decode()


@pytest.mark.parametrize("way", ["url", "env", "password_env"])
def test_a_password_given_any_way_works_and_is_never_shown(
        locked_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch, way: str,
        outputs: list[str]) -> None:
    remote = config_for(way, locked_cluster, monkeypatch)
    settings = store_config(remote)
    outputs += [repr(settings), str(settings), repr(remote)]
    keys = chunk_keys(conversation(1, 3), TPC)
    source = caches(1)
    with TierKVStore(source, model_id="m", config=settings) as engine_a:
        job = engine_a.store(keys, list(range(3 * BPC)))
        engine_a.wait([job])
        engine_a.poll()
    with TierKVStore(zeros(source), model_id="m", config=settings) as engine_b:
        assert engine_b.lookup(keys) == 3  # the password was accepted: a shared hit
        assert loaded(engine_b, keys) == (3, ())
        text = scrape(engine_b)
        assert 'tierkv:remote_calls_total{engine="a",result="ok"}' in text
        assert "remote_url=" in text  # the info metric names the store, without the password
        outputs += [text, repr(engine_b.statistics()), repr(engine_b.figures()),
                    repr(engine_b.config_info())]
    url = remote.url
    for argv in (["inspect", url], ["verify", url], ["ping", url],
                 ["rm", url, "--namespace", "0", "--dry-run"]):
        assert main(argv) in (0, 1, 2)


@pytest.mark.parametrize("way", ["url", "env", "password_env"])
def test_a_wrong_password_is_one_line_that_says_so_and_never_shown(
        locked_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch, way: str,
        capsys: pytest.CaptureFixture[str], outputs: list[str]) -> None:
    wrong = "wrong-" + SECRET
    remote = config_for(way, locked_cluster, monkeypatch, password=wrong)
    outputs += [repr(remote)]
    with TierKVStore(caches(2), model_id="m", config=store_config(remote)) as engine:
        keys = chunk_keys(conversation(2, 2), TPC)
        for _ in range(3):
            assert engine.lookup(keys) == 0  # a miss, never a failed call
        engine.wait([engine.store(keys, list(range(2 * BPC)))])
        engine.poll()
        figures = engine.figures()
        outputs += [repr(engine.statistics()), scrape(engine), repr(figures)]
    assert figures["remote_calls_auth_refused"] >= 1  # counted with its cause
    for argv in (["inspect"], ["verify"], ["rm", "--namespace", "0"], ["ping"]):
        assert main([*argv, remote.url, "--timeout", "2"]) == 2
        err = capsys.readouterr().err
        outputs.append(err)
        assert len(err.strip().splitlines()) == 1 and "auth refused" in err, err
        assert "TIERKV_REMOTE_PASSWORD" in err  # what to check


def test_the_tier_logs_a_refused_password_once_with_its_cause(
        locked_cluster: RedisCluster, caplog: pytest.LogCaptureFixture) -> None:
    from tierkv.keys import Namespace
    from tierkv.tiers.remote.tier import RemoteTier
    from tierkv.tiers.remote.client import RemoteError

    namespace = Namespace(model_id="s", dtype="f", kv_layout="NHD", page_bytes=1,
                          tokens_per_chunk=1)
    remote = RemoteTierConfig(url=url_of(locked_cluster, "wrong-" + SECRET))
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        tier = RemoteTier(remote, namespace, 0, 64, lazy=True)
        with pytest.raises(RemoteError) as info:
            tier.exists_many([bytes(32)])
        assert info.value.cause == "auth refused" and not info.value.skipped
        for _ in range(3):
            with pytest.raises(RemoteError, match="circuit breaker is open"):
                tier.exists_many([bytes(32)])  # open at once: a password does not heal
        tier.close()
    lines = [record.getMessage() for record in caplog.records]
    assert sum("fails: auth refused" in line for line in lines) == 1, lines
    assert all(SECRET not in line for line in lines) and SECRET not in str(info.value)


def test_config_errors_never_show_the_password(outputs: list[str]) -> None:
    url = f"redis://user:{SECRET}@{HOST}:7000"
    attempts: list[Any] = [
        lambda: StoreConfig(remote={"url": url}),  # type: ignore[arg-type]
        lambda: StoreConfig(cpu=url),  # type: ignore[arg-type]
        lambda: StoreConfig.from_dict(url),  # type: ignore[arg-type]
        lambda: StoreConfig.from_dict({"remote": {"url": url, "timeout_seconds": -1}}),
        lambda: StoreConfig.from_dict({"remote": {"url": url, "password": SECRET}}),
        lambda: RemoteTierConfig(url=f"redis//:{SECRET}@{HOST}:7000"),
        lambda: RemoteTierConfig(url=f"http://:{SECRET}@{HOST}:7000"),
        lambda: RemoteTierConfig(url=url, breaker_failures=0),
        lambda: TierKVStore([torch.zeros(4, 2, 4, 2, 8)], config={"remote": url}),  # type: ignore[arg-type]
    ]
    for attempt in attempts:
        with pytest.raises(TierKVError) as info:
            attempt()
        outputs.append(str(info.value))


def test_the_vllm_connector_warns_of_a_password_in_its_config_and_never_shows_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        outputs: list[str]) -> None:
    monkeypatch.setattr(vllm_config, "_warned", False)
    url = f"redis://:{SECRET}@{HOST}:7000"
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        settings = vllm_config.parse_settings({"remote_url": url, "remote": {"key_prefix": "a:"}})
        vllm_config.parse_settings({"remote_url": url})  # once a process
    warned = [r.getMessage() for r in caplog.records if "holds a password" in r.getMessage()]
    assert len(warned) == 1 and "remote_url" in warned[0]
    assert "TIERKV_REMOTE_PASSWORD" in warned[0] and "--kv-transfer-config" in warned[0]
    outputs += [repr(settings), str(settings)]
    monkeypatch.setattr(vllm_config, "_warned", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        vllm_config.parse_settings({"remote_url": f"redis://tierkv@{HOST}:7000"})
    assert not caplog.records  # a user without a password: nothing to warn of
    bad_configs: list[dict[str, Any]] = [
        {"remote": url},  # a URL where the mapping goes
        {"remote_url": url, "remote": {"url": url}},
        {"remote_url": url, "remote": {"password": SECRET}},
        {"remote_url": url, "remote": {"timeout_seconds": "x"}},
        {"remote_url": 7, "remote": {"key_prefix": SECRET}},
        {"remote_uri": url},  # a typo: an unknown key
        {"remote_password": SECRET},
    ]
    for raw in bad_configs:
        with pytest.raises(TierKVError) as info:
            vllm_config.parse_settings(raw)
        outputs.append(str(info.value))


def test_vllm_s_metrics_carry_the_settings_without_the_password(
        monkeypatch: pytest.MonkeyPatch, outputs: list[str]) -> None:
    pytest.importorskip("vllm")
    from tierkv.integrations.vllm_metrics import TierKVPromMetrics

    monkeypatch.setattr(vllm_config, "_warned", False)
    registry = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=registry)
                              for cls in (Gauge, Counter, Histogram)}
    extra = {"cpu_bytes": 1 << 20, "remote_url": f"redis://tierkv:{SECRET}@{HOST}:7000"}
    vllm = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    prom = TierKVPromMetrics(vllm, types, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({"remote_calls_ok": 3, "remote_calls_timeout": 1,
                  f"remote_breaker_open/{HOST}:7001": 1, "remote_bytes_read": 4096}, 0)
    text = generate_latest(registry).decode()
    assert f'tierkv:remote_breaker_open{{engine="0",model_name="tiny",node="{HOST}:7001"}} 1.0' \
        in text
    assert 'result="timeout"} 1.0' in text and "tierkv:config_info{" in text
    assert f'remote_url="redis://tierkv:***@{HOST}:7000"' in text
    outputs.append(text)


def test_tools_never_print_a_password_from_the_url_or_the_environment(
        locked_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch,
        outputs: list[str], tmp_path: Path) -> None:
    url = url_of(locked_cluster, SECRET)
    for argv in (["inspect", url, "--json"], ["verify", url, "--json"], ["ping", url, "--json"],
                 ["rm", url, "--namespace", "ab", "--json"], ["verify", url + "0"],
                 ["inspect", url.replace("redis://", "redis//")]):
        main(argv)
    monkeypatch.setenv("TIERKV_REMOTE_PASSWORD", SECRET)
    assert main(["ping", locked_cluster.url]) == 0
    assert os.environ["TIERKV_REMOTE_PASSWORD"] == SECRET


@pytest.mark.parametrize("way", ["remote_url", "env"])
def test_a_vllm_engine_given_the_password_serves_and_never_prints_it(
        locked_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        way: str, caplog: pytest.LogCaptureFixture, outputs: list[str]) -> None:
    """Two engines under the real vLLM Scheduler share chunks through the cluster that
    requires the password, given in remote_url (tierkv warns: vLLM logs it) or in
    TIERKV_REMOTE_PASSWORD (no warning); nothing tierkv or redis-py prints holds it."""
    pytest.importorskip("vllm")
    from tests.integration import vllm_harness as harness_lib
    from tests.integration.test_vllm_remote import Engine, assert_served, harness_config

    monkeypatch.setattr(vllm_config, "_warned", False)
    if way == "env":
        monkeypatch.setenv("TIERKV_REMOTE_PASSWORD", SECRET)
    url = url_of(locked_cluster, SECRET if way == "remote_url" else None)
    chat = dict(num_conversations=2, num_turns=2, system_prompt_len=30, first_user_len=30,
                user_turn_len=26, max_tokens=4)
    stats = []
    for name in ("a", "b"):
        engine = Engine(harness_config(url), tmp_path / "tiny-llama")  # one namespace
        result = engine.run(harness_lib.MultiTurnWorkload(**chat))
        assert_served(result, engine.cfg.vocab_size)
        stats.append(engine.stats())
        engine.shutdown()
        outputs += [repr(engine.stats()), repr(engine.connector.settings)]
    assert stats[1]["hit_tokens_remote"] > 0  # B loaded what A stored: the password worked
    warned = [r.getMessage() for r in caplog.records if "holds a password" in r.getMessage()]
    assert len(warned) == (1 if way == "remote_url" else 0)
