"""Prometheus metrics, scraped in the text format after a scripted workload: the library
store's collector (custom engines) and the vLLM connector's metrics under the real 0.33
Scheduler, through vLLM's own ``KVConnectorProm``. Values are checked against what the
workload must give, not only against tierkv's own counters."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tierkv import StoreConfig, TierKVStore
from tierkv.config import CpuTierConfig, DiskTierConfig
from tierkv.engine.metrics import GAUGE_KEYS, METRICS, PREFIX, register_store_metrics
from tierkv.integrations.vllm_messages import TierKVConnectorStats

from .test_vllm_connector import CHAT, HarnessConfig, MultiTurnWorkload, Run, assert_clean, \
    expected_chat_hits, tierkv_config


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the text format by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(PREFIX + name, tuple(sorted(labels.items())))]


def test_a_store_scrape_shows_queries_hits_usage_and_job_times(tmp_path: Path) -> None:
    kv = [torch.randn(32, 2, 4, 2, 8) for _ in range(2)]  # 32 blocks of 4 tokens, 2 layers
    config = StoreConfig(blocks_per_chunk=2, device="cpu", cpu=CpuTierConfig(max_bytes=4 << 20),
                         disk=DiskTierConfig(path=str(tmp_path), max_bytes=64 << 20))
    keys = [bytes([index]) * 32 for index in range(1, 9)]
    registry = CollectorRegistry()
    with TierKVStore(kv, model_id="m", tokens_per_block=4, config=config) as store:
        register_store_metrics(store, registry, labels={"engine": "a"})
        chunk = store.chunk_bytes
        store.wait([store.store(keys[:4], list(range(8)))])
        assert store.lookup(keys[:6]) == 4  # 6 chunks asked, 4 in the CPU tier
        store.wait([store.load(keys[:4], list(range(8, 16))).job_id])
        store.flush()  # the 4 chunks reach disk too
        samples = scrape(registry)
    tpc = 8
    assert value(samples, "queried_tokens_total", engine="a") == 6 * tpc
    assert value(samples, "hit_tokens_total", engine="a", tier="cpu") == 4 * tpc
    assert value(samples, "hit_tokens_total", engine="a", tier="disk") == 0
    assert value(samples, "usage_bytes", engine="a", tier="cpu") == 4 * chunk
    assert value(samples, "usage_bytes", engine="a", tier="disk") == 4 * chunk
    assert value(samples, "capacity_bytes", engine="a", tier="cpu") == (4 << 20) // chunk * chunk
    assert value(samples, "transfer_bytes_total", engine="a", path="gpu_to_cpu") == 4 * chunk
    assert value(samples, "transfer_bytes_total", engine="a", path="cpu_to_gpu") == 4 * chunk
    assert value(samples, "spills_total", engine="a", result="ok") == 4
    # One store job and one load job, each counted once in its histogram.
    for path in ("gpu_to_cpu", "cpu_to_gpu"):
        assert value(samples, "transfer_duration_seconds_count", engine="a", path=path) == 1
        assert value(samples, "transfer_duration_seconds_bucket", engine="a", path=path,
                     le="+Inf") == 1
    assert value(samples, "corrupt_chunks_total", engine="a", tier="disk") == 0
    # Every metric of the table is in the scrape, with every label value (a dynamic one,
    # a remote node's breaker, only once a node is seen: none here).
    names = {name for name, _ in samples}
    for metric in METRICS:
        if metric.dynamic is not None:
            continue
        suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}[metric.kind]
        assert PREFIX + metric.name + suffix in names, metric.name


class _TestProm:
    """vLLM's KVConnectorProm with its metric classes bound to a registry of the test's own
    (the default registry is process-wide)."""

    @staticmethod
    def build(vllm_config: Any, registry: CollectorRegistry) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

        class Prom(KVConnectorProm):
            _gauge_cls = functools.partial(Gauge, registry=registry)
            _counter_cls = functools.partial(Counter, registry=registry)
            _histogram_cls = functools.partial(Histogram, registry=registry)

        return Prom(vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})


def test_each_byte_moved_is_counted_on_one_path(tmp_path: Path) -> None:
    """Regression: a load from disk added its disk read to transfer_bytes{path="cpu_to_gpu"},
    so rates built from it ran up to 2x high. Here 4 of 8 loaded chunks come from disk: each
    path counts what crossed it, and the paths add up to the bytes moved."""
    kv = [torch.randn(32, 2, 4, 2, 8) for _ in range(2)]
    config = StoreConfig(blocks_per_chunk=2, device="cpu", cpu=CpuTierConfig(max_bytes=4 << 20),
                         disk=DiskTierConfig(path=str(tmp_path), max_bytes=64 << 20))
    keys = [bytes([index]) * 32 for index in range(1, 9)]
    registry = CollectorRegistry()
    with TierKVStore(kv, model_id="m", tokens_per_block=4, config=config) as store:
        chunk = store.chunk_bytes
        store.wait([store.store(keys[:4], list(range(8)))])
        store.flush()
    with TierKVStore(kv, model_id="m", tokens_per_block=4, config=config) as store:  # warm
        register_store_metrics(store, registry, labels={"engine": "a"})
        store.wait([store.store(keys[4:], list(range(8)))])
        handle = store.load(keys, list(range(16, 32)))
        store.wait([handle.job_id])
        assert (handle.num_chunks, handle.num_from_disk) == (8, 4)
        stats = store.statistics()
        samples = scrape(registry)
    moved = {"cpu_to_gpu": 8 * chunk, "gpu_to_cpu": 4 * chunk, "disk_to_cpu": 4 * chunk,
             "cpu_to_disk": stats.index.spills_ok * chunk, "remote_to_cpu": 0}
    for path, num_bytes in moved.items():
        assert value(samples, "transfer_bytes_total", engine="a", path=path) == num_bytes, path
    assert {path: stats.path[path].bytes for path in moved} == moved
    assert sum(value(samples, "transfer_bytes_total", engine="a", path=path)
               for path in moved) == sum(moved.values())
    assert stats.path["disk_to_cpu"].seconds > 0 and stats.path["cpu_to_gpu"].seconds > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_vllm_scrape_shows_the_chat_workloads_hits_and_queries(async_scheduling: bool) -> None:
    cfg = HarnessConfig(async_scheduling=async_scheduling, enable_prefix_caching=False,
                        num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    run.side.stats_interval = 0.0  # a payload every step
    registry = CollectorRegistry()
    prom = _TestProm.build(run.harness.vllm_config, registry)
    payloads: list[dict[str, Any]] = []
    scheduler = run.engine.scheduler
    update = scheduler.update_from_output

    def observed(*args: Any, **kwargs: Any) -> Any:
        outputs = update(*args, **kwargs)
        for engine_outputs in outputs.values():
            stats = engine_outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                payloads.append(stats.kv_connector_stats)
                prom.observe(stats.kv_connector_stats, 0)
        return outputs

    scheduler.update_from_output = observed
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)
    samples = scrape(registry)
    labels = {"model_name": "tiny", "engine": "0"}

    hits = sum(expected_chat_hits(result, CHAT["user_turn_len"]).values())
    assert hits > 0
    assert value(samples, "hit_tokens_total", tier="cpu", **labels) == hits
    assert value(samples, "hit_tokens_total", tier="disk", **labels) == 0
    # No prefix caching in vLLM: every prompt token was asked of tierkv, once per request.
    queried = sum(len(spec.prompt_token_ids) for spec in result.prompts.values())
    assert value(samples, "queried_tokens_total", **labels) == queried
    counts = run.side.statistics()
    assert value(samples, "usage_bytes", tier="cpu", **labels) == counts["cpu_used_bytes"] > 0
    assert value(samples, "capacity_bytes", tier="cpu", **labels) == counts["cpu_capacity_bytes"]
    # The workers' figures reached the scrape through vLLM's output aggregator.
    stored = value(samples, "transfer_bytes_total", path="gpu_to_cpu", **labels)
    assert stored == counts["stores_planned"] * run.side.geometry.chunk_bytes > 0
    jobs = value(samples, "transfer_duration_seconds_count", path="gpu_to_cpu", **labels)
    assert 0 < jobs <= counts["stores_planned"]
    # vLLM's interval log line: rounded, with the hit rate.
    from tierkv.integrations.vllm_messages import TierKVConnectorStats

    merged = TierKVConnectorStats(data=dict(payloads[0]))
    for payload in payloads[1:]:
        merged = merged.aggregate(TierKVConnectorStats(data=dict(payload)))
    line = merged.reduce()
    assert line["hit_rate"] == round(hits / queried, 3)
    assert all(len(repr(number).split(".")[-1]) <= 3 for number in line.values()
               if isinstance(number, float))
    run.shutdown()


def test_config_info_shows_the_tokens_per_chunk_in_use() -> None:
    """Regression: config_info showed tokens_per_chunk="None" where 128 was in use."""
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                        kv_transfer_config=tierkv_config(tokens_per_chunk=None))
    run = Run(cfg)
    registry = CollectorRegistry()
    _TestProm.build(run.harness.vllm_config, registry)
    info = [dict(labels) for (name, labels), _ in scrape(registry).items()
            if name == PREFIX + "config_info"]
    in_use = run.side.geometry.tokens_per_chunk
    run.shutdown()
    assert in_use == 128 and len(info) == 1
    assert info[0]["tokens_per_chunk"] == str(in_use)


def test_payloads_merge_counters_durations_and_gauges() -> None:
    a = TierKVConnectorStats(data={"hit_tokens_cpu": 32, "queried_tokens": 96,
                                   "durations_gpu_to_cpu": [0.001], "cpu_used_bytes": 10})
    b = TierKVConnectorStats(data={"hit_tokens_disk": 16, "queried_tokens": 32,
                                   "durations_gpu_to_cpu": [0.003], "cpu_used_bytes": 20,
                                   "seconds_gpu_to_cpu": 0.123456})
    merged = a.aggregate(b)
    assert merged.data["queried_tokens"] == 128
    assert merged.data["durations_gpu_to_cpu"] == [0.001, 0.003]
    assert merged.data["cpu_used_bytes"] == 20  # a gauge: the later value, not a sum
    assert a.data["durations_gpu_to_cpu"] == [0.001]  # the inputs are not changed
    line = merged.reduce()
    assert line["hit_tokens"] == 48 and line["hit_rate"] == 0.375
    assert line["seconds_gpu_to_cpu"] == 0.123 and line["median_ms_gpu_to_cpu"] == 2.0
    assert "cpu_used_bytes" not in line
    assert TierKVConnectorStats(data={name: 5 for name in GAUGE_KEYS}).is_empty()
