"""The statistics model (tierkv.core.figures): each figure declared once, on its record, and
read from there by statistics(), the vLLM figures and the Prometheus table. The names users
see are pinned here: renaming a field is a breaking change."""

from __future__ import annotations

import dataclasses

import pytest

from tierkv.core.figures import Record, counter, figures, gauge, values
from tierkv.core.jobs import Completion, JobId, JobKind, TierRead
from tierkv.core.stats import TIERS, AdapterStats, IndexStats, TierStats
from tierkv.engine.metrics import (GAUGE_KEYS, HIT_TOKENS, METRICS, PUSH_RESULTS,
                                   collect_figures, is_gauge, remote_figures)
from tierkv.engine.store_stats import LoadShortfall, PathStats, StoreStats
from tierkv.tiers.disk.env import DiskStatistics
from tierkv.tiers.remote.stats import RemoteStatistics, combined

INDEX_COUNTERS = {
    "stores_planned", "stores_present", "stores_no_room", "stores_failed", "loads_cpu",
    "loads_disk", "loads_failed", "loads_no_room", "corrupt", "disk_missing", "cpu_evictions",
    "dirty_dropped", "disk_evictions", "spills_ok", "spills_failed", "disk_no_room",
    "loads_remote", "remote_missing", "remote_corrupt", "remote_failed",
}
INDEX_GAUGES = {"num_slots", "free_slots", "cpu_ready", "storing", "promoting", "spilling",
                "on_disk", "disk_capacity", "remote_marks"}
# AdapterStats' figures the vLLM connector reports (its statistics() and log line).
ADAPTER_OWN = {
    "lookups", "not_yet", "flushes", "waits_on_stores", "remote_not_yet", "queried_tokens",
    "stores_without_pages", "sync_loads", "load_probes", "load_lines_restarted",
    "remote_lookups_skipped", "lookups_recompute", "cost_samples_dropped", "bytes_completed",
}
# Per tier (stats.tier[tier]): reported as <figure>_<tier> (hit_tokens_disk, ...).
TIER_FIGURES = ("hit_tokens", "declined_tokens", "load_seconds_estimated",
                "load_seconds_measured")
ADAPTER_REPORTED = ADAPTER_OWN | {f"{figure}_{tier}" for figure in TIER_FIGURES for tier in TIERS}
GAUGES_NOW = dict.fromkeys(INDEX_GAUGES, 0)


def snapshot(**counts: int) -> IndexStats:
    return IndexStats(**counts).snapshot(**GAUGES_NOW)


def test_the_index_figures_are_declared_once_and_keep_their_names() -> None:
    # IndexStats is the index's one record: its counters and (in a snapshot) its gauges.
    assert {f.name for f in figures(IndexStats) if f.kind == "counter"} == INDEX_COUNTERS
    assert {f.name for f in figures(IndexStats) if f.kind == "gauge"} == INDEX_GAUGES
    assert {f.name for f in dataclasses.fields(IndexStats)} == INDEX_COUNTERS | INDEX_GAUGES
    assert all(figure.help for figure in figures(IndexStats))
    assert {f.record for f in figures(IndexStats)} == {"IndexStats"}


def test_the_adapter_figures_keep_their_names() -> None:
    assert set(values(AdapterStats())) == ADAPTER_REPORTED
    left_out = {f.name for f in figures(AdapterStats) if not f.reported}
    assert left_out == {"hit_tokens", "loads_planned", "loads_failed_chunks", "stores_planned",
                        "requests_freed"}
    assert {f.name for f in dataclasses.fields(AdapterStats)} == ADAPTER_OWN | left_out | {"tier"}
    assert [f.name for f in dataclasses.fields(TierStats)] == list(TIER_FIGURES)
    assert HIT_TOKENS == tuple((tier, f"hit_tokens_{tier}") for tier in TIERS)


def test_a_per_tier_figure_is_a_sub_record_keyed_by_medium() -> None:
    stats = AdapterStats()
    stats.tier["disk"].declined_tokens += 16  # the hot path: a plain attribute
    stats.tier["remote"].load_seconds_measured += 0.5
    assert values(stats)["declined_tokens_disk"] == 16
    assert values(stats)["load_seconds_measured_remote"] == 0.5
    figure = next(f for f in figures(AdapterStats) if f.name == "declined_tokens_disk")
    assert (figure.field, figure.key, figure.kind) == ("declined_tokens", "disk", "counter")
    frozen = stats.snapshot()
    stats.tier["disk"].declined_tokens += 1  # the snapshot keeps what it saw
    assert frozen.tier["disk"].declined_tokens == 16 and isinstance(frozen, AdapterStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.tier["disk"].declined_tokens = 0
    with pytest.raises(TypeError):
        frozen.tier["disk"] = TierStats()  # type: ignore[index]


def test_an_index_snapshot_is_a_read_only_copy_of_the_same_record() -> None:
    counters = IndexStats()
    counters.loads_cpu += 2  # the hot path: a plain attribute
    stats = counters.snapshot(**GAUGES_NOW)
    counters.loads_cpu += 1
    assert isinstance(stats, IndexStats) and type(stats).__name__ == "IndexStats"
    assert stats.loads_cpu == 2 and stats == snapshot(loads_cpu=2)
    assert stats == IndexStats(loads_cpu=2) and stats != IndexStats(loads_cpu=3)
    assert hash(stats) == hash(snapshot(loads_cpu=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.loads_cpu = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del stats.num_slots
    assert dataclasses.replace(stats, loads_cpu=5).loads_cpu == 5


def test_values_reads_a_records_reported_figures_of_a_kind() -> None:
    @dataclasses.dataclass(kw_only=True)
    class Record:
        hits: int = counter("hits")
        total: int = counter("a sum of hits", reported=False)
        seconds: float = counter("seconds", default=0.0)
        plain: int = 0  # not a figure
        held: int = gauge("held now")

    record = Record(held=3)
    record.hits += 1
    assert values(record) == {"hits": 1, "seconds": 0.0, "held": 3}
    assert values(record, "counter") == {"hits": 1, "seconds": 0.0}
    assert values(record, "gauge") == {"held": 3}
    assert [f.kind for f in figures(Record)] == ["counter", "counter", "counter", "gauge"]


def test_metrics_of_one_figure_take_its_declared_kind_and_help() -> None:
    declared = {f.name: f for record in (IndexStats, AdapterStats) for f in figures(record)}
    single = {metric.name: metric for metric in METRICS if metric.label is None}
    for name, key in (("queried_tokens", "queried_tokens"), ("failed_loads", "loads_failed"),
                      ("cpu_evictions", "cpu_evictions"), ("dirty_dropped", "dirty_dropped"),
                      ("disk_evictions", "disk_evictions"),
                      ("stores_without_pages", "stores_without_pages")):
        metric = single[name]
        assert metric.keys == (("", key),)
        assert (metric.kind, metric.help) == (declared[key].kind, declared[key].help)


def test_the_index_gauges_are_gauges_to_the_payloads() -> None:
    assert INDEX_GAUGES <= GAUGE_KEYS
    assert is_gauge("cpu_used_bytes") and is_gauge("remote_marks")
    assert not any(is_gauge(name) for name in INDEX_COUNTERS | ADAPTER_REPORTED)


def test_the_load_shortfall_is_a_snapshot_of_the_stores_counts() -> None:
    stats = StoreStats()
    stats.load_shortfall.gone += 4
    shortfall = stats.snapshot().load_shortfall
    stats.load_shortfall.gone += 1  # the snapshot keeps what it saw
    assert shortfall == LoadShortfall(gone=4) and shortfall.no_room == shortfall.failed == 0
    assert [f.name for f in figures(LoadShortfall)] == ["gone", "no_room", "failed"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        shortfall.gone = 0
    assert hash(shortfall) == hash(LoadShortfall(gone=4).snapshot())


def test_a_snapshot_needs_every_gauge() -> None:
    with pytest.raises(AssertionError):
        IndexStats().snapshot(num_slots=1)


def test_a_report_carries_the_counters_that_moved_and_the_gauges_now() -> None:
    from tierkv.engine.metrics import since_last

    reported = {"lookups": 3, "cpu_used_bytes": 10, "flushes": 1}
    current = {"lookups": 5, "cpu_used_bytes": 7, "flushes": 1, "sync_loads": 2}
    # lookups moved by 2, flushes did not (left out), sync_loads is new; a gauge is its value
    assert since_last(current, reported) == {"lookups": 2, "sync_loads": 2, "cpu_used_bytes": 7}
    assert since_last(current, current) == {"cpu_used_bytes": 7}


def test_every_metric_reads_its_declared_figures_as_their_kind() -> None:
    declared = {f.name: f for record in (IndexStats, AdapterStats) for f in figures(record)}
    read = [(metric, key) for metric in METRICS for _, key in metric.keys if key in declared]
    assert len(read) >= 20  # hits, evictions, spills, no room, corrupt, declined, seconds...
    for metric, key in read:
        assert metric.kind == declared[key].kind, (metric.name, key)
        assert declared[key].reported, key  # a metric reads what the reports carry


def test_the_per_path_figures_keep_their_names_and_count_one_job_each() -> None:
    # StoreStats.path is the store's and the worker's one accounting: path[<path>].bytes,
    # reported as bytes_<path>, ...
    paths = ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_cpu", "remote_to_cpu")
    names = {f"{what}_{path}" for what in ("bytes", "seconds", "failed_jobs") for path in paths}
    assert set(values(StoreStats())) == names
    assert all(figure.kind == "counter" and figure.help for figure in figures(StoreStats))
    read = {key for metric in METRICS if metric.label == "path" for _, key in metric.keys}
    assert names - {"failed_jobs_disk_to_cpu", "failed_jobs_remote_to_cpu"} <= read
    counts = StoreStats()
    counts.add(Completion(JobId(1), JobKind.STORE, True, num_bytes=4096, seconds=0.5))
    counts.add(Completion(JobId(2), JobKind.STORE, False, num_bytes=0, seconds=0.25))
    counts.add(Completion(JobId(3), JobKind.SPILL, True, num_bytes=1024, seconds=1.0))
    assert {name: value for name, value in values(counts).items() if value} == {
        "bytes_gpu_to_cpu": 4096, "seconds_gpu_to_cpu": 0.75, "failed_jobs_gpu_to_cpu": 1,
        "bytes_cpu_to_disk": 1024, "seconds_cpu_to_disk": 1.0}
    assert counts.path["gpu_to_cpu"].bytes == 4096
    assert counts.path["cpu_to_gpu"].seconds == 0.0
    assert counts.snapshot().path["gpu_to_cpu"].gbps == 4096 / 0.75 / 1e9
    # A load's reads count on their own paths; its copy (the job less its slowest read) on
    # cpu_to_gpu: each byte and second once.
    counts = StoreStats()
    counts.add(Completion(JobId(4), JobKind.LOAD, True, num_bytes=300, seconds=2.5,
                          reads=(TierRead("disk", 100, 2.0), TierRead("remote", 200, 1.0))))
    assert {name: value for name, value in values(counts).items() if value} == {
        "bytes_cpu_to_gpu": 300, "seconds_cpu_to_gpu": 0.5, "bytes_disk_to_cpu": 100,
        "seconds_disk_to_cpu": 2.0, "bytes_remote_to_cpu": 200, "seconds_remote_to_cpu": 1.0}
    assert counts.path["remote_to_cpu"].bytes == 200 and isinstance(counts.path["remote_to_cpu"],
                                                                     PathStats)


def test_the_remote_tiers_counters_are_declared_on_a_record() -> None:
    # The reported counters are the figures remote_<field>; the rest are kept, not reported
    # (the labelled ones are figures by label: remote_calls_<cause>, remote_bad_values_...).
    assert [f.name for f in figures(RemoteStatistics) if f.reported] == [
        "calls_ok", "calls_skipped", "bytes_written", "bytes_read", "lookup_requests",
        "lookup_errors", "pushes_pushed", "pushes_failed", "pushes_dropped", "pushes_abandoned"]
    counts = RemoteStatistics()
    counts.calls_ok += 2
    counts.calls_skipped += 1
    counts.corrupt += 1  # not remote_corrupt: that figure is the index's chunks
    tier = counts.snapshot(breaker_opens=0, cluster=False, causes=(("timeout", 3),),
                           bad_values=(), breakers=(("n1", 1),))
    got = remote_figures([tier, tier])
    assert (got["remote_calls_ok"], got["remote_calls_skipped"]) == (4, 2)
    assert (got["remote_calls_timeout"], got["remote_breaker_open/n1"]) == (6, 1)
    assert "remote_corrupt" not in got and "remote_errors" not in got
    closed = counts.snapshot(breakers=(("n1", 0), ("n2", 0)), causes=(("refused", 1),))
    both = combined([tier, closed])
    assert both.breakers == (("n1", 1), ("n2", 0)) and both.calls_ok == 4
    assert both.causes == (("refused", 1), ("timeout", 3))


def test_the_remote_pushes_and_lookups_count_on_the_remote_record() -> None:
    # A lookup and a pusher keep a RemoteStatistics each (lookup_*, pushes_*); a field's
    # figure is remote_<field>, and remote_figures lists the pushes' reported ones:
    # tierkv:remote_pushes{result=...}.
    assert PUSH_RESULTS == ("pushed", "failed", "dropped", "abandoned")
    counts = RemoteStatistics()
    counts.pushes_pushed += 3
    counts.pushes_dropped += 1
    pushes = counts.snapshot(pushes_queue_bytes=7)
    lookups = RemoteStatistics(lookup_requests=2, lookup_asks=5).snapshot()
    got = remote_figures([pushes, lookups])
    assert (got["remote_pushes_pushed"], got["remote_lookup_requests"]) == (3, 2)
    assert {key for key in got if key.startswith("remote_pushes_")} == \
        {f"remote_pushes_{result}" for result in PUSH_RESULTS}
    assert "remote_lookup_asks" not in got and "remote_pushes_queued" not in got  # kept only
    # The vLLM scheduler side does no I/O: its workers report the pushes (and breakers).
    scheduler = remote_figures([lookups], own_io=False)
    assert scheduler["remote_lookup_requests"] == 2
    assert not any(key.startswith("remote_pushes_") for key in scheduler)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pushes.pushes_pushed = 4
    both = combined([pushes, lookups, pushes])
    assert (both.pushes_pushed, both.pushes_queue_bytes, both.lookup_asks) == (6, 14, 5)


def test_the_disk_tiers_counters_are_declared_on_records() -> None:
    # DiskStatistics: the tier's counts, its environments' (summed over shards) and gauges.
    assert {f.name for f in figures(DiskStatistics) if f.kind == "counter"} == {
        "bytes_written", "bytes_read", "puts", "reads", "hits", "misses", "corrupt", "full",
        "syncs", "write_txns", "rebuilds", "stale_readers", "map_adopted"}
    assert {f.name for f in figures(DiskStatistics) if f.kind == "gauge"} == {"chunks",
                                                                               "map_size"}
    stats = DiskStatistics(puts=2).snapshot(chunks=2, map_size=1 << 20, rebuilds=1)
    assert (stats.puts, stats.rebuilds, stats.chunks) == (2, 1, 2)


def test_both_entry_points_assemble_one_set_of_figures_with_one_name_each() -> None:
    # collect_figures is the library store's figures() and the vLLM scheduler side's
    # statistics(): the index's chunk loads are loads_<tier> in both (no hit_chunks_<tier>).
    index = IndexStats(loads_cpu=3, loads_remote=1).snapshot(**GAUGES_NOW)
    adapter = AdapterStats(queried_tokens=64)
    adapter.tier["cpu"].hit_tokens += 48
    got = collect_figures(index, adapter, chunk_bytes=1, tokens_per_chunk=16)
    assert (got["loads_cpu"], got["loads_remote"], got["hit_tokens_cpu"]) == (3, 1, 48)
    assert not any(key.startswith("hit_chunks") for key in got)
    assert set(values(index)) | set(values(adapter)) <= set(got)
    with_paths = collect_figures(index, adapter, chunk_bytes=1, tokens_per_chunk=16,
                                 store=StoreStats())
    assert set(with_paths) - set(got) == set(values(StoreStats()))


def test_records_are_few_and_each_snapshot_is_its_own_class() -> None:
    # One record per object, at most 8 record classes (the remote tier's users count on its
    # record), and no twin class declared for a snapshot.
    import ast
    from pathlib import Path

    import tierkv

    records = {IndexStats, AdapterStats, TierStats, PathStats, LoadShortfall, StoreStats,
               DiskStatistics, RemoteStatistics}
    declared = {node.name for path in Path(tierkv.__file__).parent.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ClassDef)
                and any(getattr(base, "id", None) == "Record" for base in node.bases)}
    assert declared == {record.__name__ for record in records} and len(records) <= 8
    for record in records:
        frozen = record().snapshot(**{f.name: 0 for f in figures(record)
                                      if f.kind == "gauge" and f.key is None})
        assert isinstance(frozen, record) and frozen == record()


def test_a_snapshot_pickles_as_a_read_only_copy() -> None:
    import pickle

    stats = StoreStats()
    stats.path["gpu_to_cpu"].bytes += 7
    stats.load_shortfall.gone += 1
    frozen = stats.snapshot(index=snapshot(loads_cpu=2))
    again = pickle.loads(pickle.dumps(frozen))
    assert again == frozen and again.path["gpu_to_cpu"].bytes == 7
    assert again.index.loads_cpu == 2 and again.load_shortfall.gone == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.chunk_bytes = 1
