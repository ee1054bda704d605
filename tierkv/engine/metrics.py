"""tierkv's figures as Prometheus metrics: one table, :data:`METRICS`, read by both exporters.

- Under vLLM, ``TierKVConnector.build_prom_metrics`` registers them with vLLM's metric classes
  and labels (``model_name``, ``engine``) and observes the connector's stats payloads
  (:mod:`tierkv.integrations.vllm_metrics`).
- A custom engine calls :func:`register_store_metrics` once: a ``prometheus_client``
  collector that reads :meth:`TierKVStore.figures` at each scrape.

Both read *figures*: a flat mapping of figure keys (``hit_tokens_cpu``, ``bytes_gpu_to_cpu``,
``cpu_used_bytes``, ...) to numbers, or, for job durations, to :class:`Durations` (library)
or lists of seconds (vLLM payloads). A metric lists which figure key each of its label values
reads, so a figure has one name everywhere (``docs/operations.md``, "Metrics", lists them);
a metric with a ``dynamic`` prefix reads every figure key that starts with it, the rest of
the key being its label value (``remote_breaker_open/10.0.0.5:7000``: one per node seen).
:func:`remote_figures` makes the remote tier's figures from its statistics, and
:func:`config_info` the labels of ``tierkv:config_info`` (the effective settings, no secret).

The figures of the index, the engine adapter, the paths and the remote tier are declared
once, as fields of their records (:class:`~tierkv.core.stats.IndexStats`,
:class:`~tierkv.core.stats.AdapterStats` with its per-tier ``tier[...]``,
:class:`~tierkv.engine.store_stats.StoreStats` with its per-path ``path[...]``, the remote
tier's; :mod:`tierkv.core.figures`): a metric that reads one of them takes its kind and
help text, or its label values and keys, from that declaration. :func:`collect_figures`
is the one assembly of the flat figures, for the library store's ``figures()`` and the
vLLM scheduler side's payloads alike.

Counters are exposed with ``_total`` (``tierkv:hit_tokens_total{tier="disk"}``); byte figures
are bytes and times are seconds, as Prometheus conventions ask.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tierkv.core.figures import figures, values
from tierkv.core.stats import TIERS, AdapterStats, IndexStats
from tierkv.engine.store_stats import PATHS, StoreStats
from tierkv.extras import needs
from tierkv.tiers.remote.health import CAUSES
from tierkv.tiers.remote.stats import RemoteStatistics, combined
from tierkv.tiers.remote.usage import ServerMemory

PREFIX = "tierkv:"
Kind = Literal["counter", "gauge", "histogram"]
USAGE_TIERS = TIERS  # the tiers with usage gauges (the remote tier's: its whole servers')
# Seconds per job: a 2 MiB chunk copies in ~0.1 ms on a GPU, a disk batch can take seconds.
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_PENDING_DURATIONS = 4096  # per path between two reports; beyond, a report samples


@dataclass(frozen=True)
class Metric:
    name: str  # without PREFIX (and without _total)
    kind: Kind
    help: str
    label: str | None  # the metric's own label (tier, path, ...), besides the exporter's
    keys: tuple[tuple[str, str], ...]  # (label value, figure key); label value "" if no label
    dynamic: str | None = None  # a figure-key prefix: every key with it, the rest the label


# The remote tier's calls by result, its pushes by fate, its values by the check they failed.
REMOTE_RESULTS = ("ok", "skipped", *(cause.replace(" ", "_") for cause in CAUSES))
# The remote record's reported fields, each the figure remote_<field>: remote_calls_ok,
# remote_lookup_requests, remote_pushes_pushed, ...
REMOTE_FIGURES = tuple(figure.name for figure in figures(RemoteStatistics) if figure.reported)
PUSH_RESULTS = tuple(name.removeprefix("pushes_") for name in REMOTE_FIGURES
                     if name.startswith("pushes_"))
VALUE_CHECKS = ("size", "type", "header", "checksum")
BREAKER_OPEN = "remote_breaker_open/"  # + node: a dynamic gauge
CONFIG_INFO = "config_info"


def _each(template: str, values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple((value, template.format(value)) for value in values)


def _one(key: str) -> tuple[tuple[str, str], ...]:
    return (("", key),)


# A job path's durations (not a record's figure: a histogram), by path: durations_<path>.
DURATION_KEY = dict(_each("durations_{}", PATHS))


def _per(record: type, field: str, keys: Sequence[str] | None = None
         ) -> tuple[tuple[str, str], ...]:
    """(key, figure) of the sub-records' ``field`` of ``record`` (``stats.tier[...]``,
    ``stats.path[...]``) as its declaration names them: the label values of a metric by
    tier or by path (only ``keys`` if given)."""
    return tuple((figure.key, figure.name) for figure in figures(record)
                 if figure.field == field and figure.key is not None
                 and (keys is None or figure.key in keys))


# The tokens found, by tier: (tier, figure key); their sum over queried_tokens is the hit rate.
HIT_TOKENS = _per(AdapterStats, "hit_tokens")


def _figure(record: type, key: str, name: str | None = None) -> Metric:
    """The metric of one figure (named ``name``, else as the figure), its kind and help as
    the figure's record declares them (:mod:`tierkv.core.figures`)."""
    figure = next(figure for figure in figures(record) if figure.name == key)
    return Metric(name or key, figure.kind, figure.help, None, _one(key))


METRICS: tuple[Metric, ...] = (
    _figure(AdapterStats, "queried_tokens"),
    Metric("hit_tokens", "counter", "Tokens found in tierkv, by the tier that held them",
           "tier", HIT_TOKENS),
    Metric("transfer_bytes", "counter", "Bytes moved by finished jobs, by path (each byte "
           "on one path: a load from disk counts disk_to_cpu, then cpu_to_gpu)", "path",
           _per(StoreStats, "bytes")),
    Metric("transfer_seconds", "counter", "Seconds spent moving bytes, by path", "path",
           _per(StoreStats, "seconds")),
    Metric("transfer_duration_seconds", "histogram", "Seconds per finished job, by path", "path",
           tuple(DURATION_KEY.items())),
    Metric("failed_jobs", "counter", "Jobs that failed (their chunks are misses), by path",
           "path", _per(StoreStats, "failed_jobs", PATHS)),
    _figure(IndexStats, "loads_failed", "failed_loads"),
    _figure(IndexStats, "cpu_evictions"),
    _figure(IndexStats, "dirty_dropped"),
    Metric("spills", "counter", "Chunks written from the CPU tier to disk, by result",
           "result", (("ok", "spills_ok"), ("failed", "spills_failed"))),
    _figure(IndexStats, "disk_evictions"),
    Metric("no_room", "counter", "Chunks not stored or loaded for want of room (all slots "
           "busy, or the disk full), by what was refused", "what",
           (("store", "stores_no_room"), ("load", "loads_no_room"), ("disk", "disk_no_room"))),
    _figure(AdapterStats, "stores_without_pages"),
    Metric("corrupt_chunks", "counter", "Chunks whose bytes failed their checks on read "
           "(served as misses, deleted), by tier", "tier",
           (("disk", "corrupt"), ("remote", "remote_corrupt"))),
    Metric("declined_tokens", "counter", "Hit tokens recomputed instead of loaded because "
           "loading them was estimated slower (load_policy \"cost\"), by the tier that held "
           "them", "tier", _per(AdapterStats, "declined_tokens")),
    Metric("load_seconds_estimated", "counter", "Estimated seconds of the loads taken, by "
           "their slowest tier (next to load_seconds_measured: the cost model's error)",
           "tier", _per(AdapterStats, "load_seconds_estimated")),
    Metric("load_seconds_measured", "counter", "Measured seconds of the loads taken (plan to "
           "completion; a same-step load's copy), by their slowest tier", "tier",
           _per(AdapterStats, "load_seconds_measured")),
    Metric("usage_bytes", "gauge", "Bytes of KV held, by tier (all ranks; remote: the "
           "servers' used_memory, shared, as last polled)", "tier",
           _each("{}_used_bytes", USAGE_TIERS)),
    Metric("capacity_bytes", "gauge", "Bytes of KV a tier can hold (all ranks; remote: the "
           "servers' maxmemory, NaN when one has none)", "tier",
           _each("{}_capacity_bytes", USAGE_TIERS)),
    Metric("usage_tokens", "gauge", "Tokens of KV held, by tier (remote: the KV-equivalent "
           "of the servers' used memory)", "tier", _each("{}_used_tokens", USAGE_TIERS)),
    Metric("capacity_tokens", "gauge", "Tokens of KV a tier can hold (remote: NaN when "
           "unbounded)", "tier", _each("{}_capacity_tokens", USAGE_TIERS)),
    Metric("remote_calls", "counter", "Calls to the remote tier by result: ok; skipped at "
           "once by an open circuit breaker (no network); or why they failed (timeout, "
           "connection_refused, auth_refused, cluster_down, out_of_memory, ...)", "result",
           _each("remote_calls_{}", REMOTE_RESULTS)),
    Metric("remote_bytes", "counter", "Value bytes read from and written to the remote tier",
           "direction", (("read", "remote_bytes_read"), ("written", "remote_bytes_written"))),
    Metric("remote_pushes", "counter", "Chunks offered to the remote tier's push queue, by "
           "what became of them: pushed; failed (the tier did not store them); dropped (the "
           "queue was full: remote.queue_bytes); abandoned (still queued at close)", "result",
           _each("remote_pushes_{}", PUSH_RESULTS)),
    Metric("remote_bad_values", "counter", "Remote values that failed a check when read "
           "(misses, deleted), by check: size (before it was read), type (a key of another "
           "type), header, checksum", "check", _each("remote_bad_values_{}", VALUE_CHECKS)),
    Metric("remote_breaker_open", "gauge", "1 while the remote tier's circuit breaker is open "
           "(its calls skipped) for a node; node=\"cluster\": every node (the cluster is down, "
           "the password refused); node=\"writes\": a full server's writes", "node", (),
           dynamic=BREAKER_OPEN),
)

GAUGE_KEYS = frozenset(key for metric in METRICS if metric.kind == "gauge"
                       for _, key in metric.keys) | frozenset(
    figure.name for figure in figures(IndexStats) if figure.kind == "gauge")
DYNAMIC_GAUGES = tuple(metric.dynamic for metric in METRICS
                       if metric.kind == "gauge" and metric.dynamic)


def is_gauge(key: str) -> bool:
    """Whether figure ``key`` is a gauge (a value now), not a counter."""
    return key in GAUGE_KEYS or key.startswith(DYNAMIC_GAUGES)


def since_last(current: Mapping[str, Any], reported: Mapping[str, Any]) -> dict[str, Any]:
    """A report's figures: the counters of ``current`` that moved since ``reported`` (the
    previous report's ``current``), by how much, and the gauges' values now."""
    out = {name: moved for name, value in current.items()
           if not is_gauge(name) and (moved := value - reported.get(name, 0))}
    out.update((name, value) for name, value in current.items() if is_gauge(name))
    return out


def metric_keys(metric: Metric, figures: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """(label value, figure key) pairs ``metric`` reads from ``figures``."""
    if metric.dynamic is None:
        return metric.keys
    return tuple((key[len(metric.dynamic):], key) for key in sorted(figures)
                 if key.startswith(metric.dynamic))


def remote_figures(records: Sequence[RemoteStatistics],
                   own_io: bool = True) -> dict[str, float]:
    """The remote tier's figures from the statistics of the objects that use it (an
    engine's lookups and its loads and pushes have a tier each; a lookup and a pusher count
    their own, :func:`~tierkv.tiers.remote.stats.combined` sums them): a node's breaker
    open if any tier's is. ``own_io=False`` (the vLLM scheduler side, whose workers load
    and push and report those): no breaker gauges and no pushes."""
    total = combined(records)
    out: dict[str, float] = dict.fromkeys(
        [f"remote_calls_{result}" for result in REMOTE_RESULTS]
        + [f"remote_bad_values_{check}" for check in VALUE_CHECKS], 0)
    out.update((f"remote_{name}", getattr(total, name)) for name in REMOTE_FIGURES
               if own_io or not name.startswith("pushes_"))
    for cause, count in total.causes:
        out[f"remote_calls_{cause.replace(' ', '_')}"] += count
    for check, count in total.bad_values:
        out[f"remote_bad_values_{check}"] += count
    for node, state in total.breakers if own_io else ():
        out[BREAKER_OPEN + node] = state
    return out


def config_info(settings: Any, **extra: str) -> dict[str, str]:
    """The labels of ``tierkv:config_info``: every setting of ``settings`` (a
    :class:`~tierkv.config.StoreConfig`, or the vLLM connector's settings) by its dotted
    name with dots as underscores (``remote_timeout_seconds``), the remote URL without its
    password, and ``extra`` (the version, the namespace)."""
    from dataclasses import fields, is_dataclass

    from tierkv.config import safe_url

    out: dict[str, str] = {}

    def walk(value: Any, prefix: str) -> None:
        for item in fields(value):
            got = getattr(value, item.name)
            name = f"{prefix}{item.name}"
            if is_dataclass(got) and not isinstance(got, type):
                walk(got, f"{name}_")
            else:
                out[name] = safe_url(got) if item.name == "url" and isinstance(got, str) \
                    else str(got)

    walk(settings, "")
    out.update(extra)
    return out


@dataclass(frozen=True)
class TierUsage:
    """One tier's capacity and use, in bytes of KV (all ranks) and in tokens. The remote
    tier's are its servers' as last polled, shared with other engines; its capacity is
    None when unbounded (a primary without ``maxmemory``). Its figures (the usage gauges)
    are ``<tier>_<field>``: ``cpu_used_bytes``, ``remote_capacity_tokens`` (NaN: None)."""

    capacity_bytes: int | None
    used_bytes: int
    capacity_tokens: int | None
    used_tokens: int


def local_usage(index: IndexStats, chunk_bytes: int,
                tokens_per_chunk: int) -> dict[str, TierUsage]:
    """The CPU and disk tiers' usage from the index's counts (``chunk_bytes`` is one chunk
    on all ranks). The CPU tier holds its used slots (chunks being stored or promoted
    included), the disk its chunks on disk (spills in flight not yet)."""
    return {tier: TierUsage(capacity * chunk_bytes, used * chunk_bytes,
                            capacity * tokens_per_chunk, used * tokens_per_chunk)
            for tier, used, capacity in (
                ("cpu", index.num_slots - index.free_slots, index.num_slots),
                ("disk", index.on_disk, index.disk_capacity))}


def remote_usage(memory: ServerMemory | None, stored_chunk_bytes: int,
                 tokens_per_chunk: int) -> dict[str, TierUsage]:
    """The remote tier's usage from its servers' memory as last polled (none before the
    first answer): bytes as the servers count them (every namespace's and other data's),
    tokens as the whole chunks of ``stored_chunk_bytes`` (all parts, keys and headers)
    they would hold."""
    if memory is None:
        return {}

    def tokens(size: int) -> int:
        return size // stored_chunk_bytes * tokens_per_chunk

    most = memory.max_bytes
    return {"remote": TierUsage(most, memory.used_bytes, None if most is None else tokens(most),
                                tokens(memory.used_bytes))}


def usage_figures(usage: Mapping[str, TierUsage]) -> dict[str, float]:
    """The usage gauges of ``usage``: ``<tier>_<field>`` (NaN where a capacity is None)."""
    return {f"{tier}_{name}": math.nan if value is None else value
            for tier, each in usage.items() for name, value in vars(each).items()}


def collect_figures(index: IndexStats, adapter: AdapterStats, *, chunk_bytes: int,
                    tokens_per_chunk: int, store: StoreStats | None = None,
                    durations: Mapping[str, Durations] | None = None,
                    remote: Sequence[RemoteStatistics] = (), own_io: bool = True,
                    memory: ServerMemory | None = None, stored_chunk_bytes: int = 0,
                    ) -> dict[str, Any]:
    """The figures, by figure key, of both entry points: :meth:`TierKVStore.figures` and
    the vLLM scheduler side's ``statistics()`` (whose workers report the paths and the
    durations). The index's (counters and gauges) and the adapter's; the ``store``'s paths
    and the jobs' ``durations`` (by figure key), if given; the ``remote`` records' (the
    tiers', the lookup's, the pushes': :func:`remote_figures`, ``own_io`` as there); the
    usage gauges (``chunk_bytes``: a chunk on all ranks), the remote servers' from their
    ``memory`` as last polled."""
    out: dict[str, Any] = values(index)
    out.update(values(adapter))
    if store is not None:
        out.update(values(store))
    out.update(durations or {})
    if remote:
        out.update(remote_figures(remote, own_io))
    out.update(usage_figures({**local_usage(index, chunk_bytes, tokens_per_chunk),
                              **remote_usage(memory, stored_chunk_bytes, tokens_per_chunk)}))
    return out


@dataclass
class Durations:
    """Seconds per job on one path: cumulative buckets (a scrape reads them) and the values
    since the last :meth:`take` (vLLM's payloads carry them; at most
    :data:`MAX_PENDING_DURATIONS`, every other one kept beyond that)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0
    pending: list[float] = field(default_factory=list)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds
        if len(self.pending) >= MAX_PENDING_DURATIONS:
            del self.pending[::2]
        self.pending.append(seconds)

    def take(self) -> list[float]:
        pending, self.pending = self.pending, []
        return pending

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as the text format lists them, ``+Inf`` last."""
        out, running = [], 0
        for bound, count in zip((*DURATION_BUCKETS, float("inf")), self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


CONFIG_INFO_HELP = ("tierkv's effective settings as labels (value 1; the remote URL without "
                    "its password)")


class FigureSource(Protocol):
    """What the exporter reads: :meth:`TierKVStore.figures` (or an engine's own figures);
    a ``config_info()`` method, if it has one, gives ``tierkv:config_info``'s labels."""

    def figures(self) -> Mapping[str, float | Durations]: ...


class StoreCollector:
    """A ``prometheus_client`` collector over one :class:`TierKVStore` (any
    :class:`FigureSource`): every scrape reads its figures. ``labels`` are constant labels
    of every sample."""

    def __init__(self, store: FigureSource, labels: Mapping[str, str] | None = None) -> None:
        self.store = store
        self.labels = dict(labels or {})

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only (figures are read from the store then)

    def collect(self) -> Iterator[Any]:
        with needs("metrics", "tierkv's Prometheus exporter"):
            from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                                HistogramMetricFamily)
        figures = self.store.figures()
        names, values = list(self.labels), list(self.labels.values())
        for metric in METRICS:
            labelnames = names + ([metric.label] if metric.label else [])
            name = PREFIX + metric.name
            family: Any
            if metric.kind == "counter":
                family = CounterMetricFamily(name, metric.help, labels=labelnames)
            elif metric.kind == "gauge":
                family = GaugeMetricFamily(name, metric.help, labels=labelnames)
            else:
                family = HistogramMetricFamily(name, metric.help, labels=labelnames)
            for label_value, key in metric_keys(metric, figures):
                labelvalues = values + ([label_value] if metric.label else [])
                if metric.kind == "gauge" and key not in figures:
                    continue  # not known (the remote tier's before its first poll)
                value = figures.get(key, 0)
                if isinstance(value, Durations):
                    family.add_metric(labelvalues, buckets=value.cumulative(),
                                      sum_value=value.total)
                elif metric.kind != "histogram":
                    family.add_metric(labelvalues, float(value))
            yield family
        info = getattr(self.store, "config_info", None)
        if callable(info):
            settings = info()
            family = GaugeMetricFamily(PREFIX + CONFIG_INFO, CONFIG_INFO_HELP,
                                       labels=names + list(settings))
            family.add_metric(values + list(settings.values()), 1.0)
            yield family


def register_store_metrics(store: FigureSource, registry: Any = None,
                           labels: Mapping[str, str] | None = None) -> StoreCollector:
    """Expose ``store``'s figures to Prometheus (``prometheus_client``'s default registry
    unless ``registry``); serve them with ``prometheus_client.start_http_server``. Returns
    the collector (``registry.unregister(collector)`` removes it)."""
    with needs("metrics", "tierkv's Prometheus exporter"):
        import prometheus_client
    collector = StoreCollector(store, labels)
    (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
    return collector


__all__ = ["CONFIG_INFO", "DURATION_BUCKETS", "Durations", "FigureSource", "METRICS", "Metric",
           "DURATION_KEY", "HIT_TOKENS", "PREFIX", "StoreCollector", "collect_figures", "config_info", "is_gauge",
           "metric_keys", "register_store_metrics", "remote_figures", "since_last",
           "local_usage", "remote_usage", "TierUsage", "usage_figures"]
