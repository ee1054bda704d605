"""tierkv's Prometheus metrics under vLLM: :data:`tierkv.engine.metrics.METRICS`, registered
with the metric classes and labels vLLM hands to ``build_prom_metrics`` (``model_name`` and
``engine``; vLLM merges the ranks' figures before they reach us, so there is no rank label),
and fed from the connector's stats payloads (:class:`TierKVConnectorStats`) by ``observe``.
A metric with a ``dynamic`` prefix (a remote node's breaker) is bound for each label value
as its first figure arrives, and so is every gauge: a gauge not known yet (the remote
tier's usage before its first poll, or without a remote tier) shows no sample, not 0. ``tierkv:config_info`` is set once, from the connector's
settings in ``kv_connector_extra_config`` (the remote URL without its password). They
appear on vLLM's ``/metrics`` as ``tierkv:*``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from tierkv.engine.metrics import (CONFIG_INFO, CONFIG_INFO_HELP, DURATION_BUCKETS, METRICS,
                                   PREFIX, config_info)


class TierKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {"counter": self._counter_cls, "gauge": self._gauge_cls,
                   "histogram": self._histogram_cls}
        # (engine index, figure key) -> (kind, the metric with its labels bound)
        self._bound: dict[tuple[int, str], tuple[str, Any]] = {}
        self._dynamic: list[tuple[str, str, Any]] = []  # (prefix, kind, family)
        self._gauges: dict[tuple[int, str], tuple[Any, list[object]]] = {}  # not bound yet
        self._engines = per_engine_labelvalues
        for metric in METRICS:
            extra = [metric.label] if metric.label else []
            options: dict[str, Any] = {"buckets": DURATION_BUCKETS} \
                if metric.kind == "histogram" else {}
            family = classes[metric.kind](name=PREFIX + metric.name, documentation=metric.help,
                                          labelnames=[*labelnames, *extra], **options)
            if metric.dynamic is not None:
                self._dynamic.append((metric.dynamic, metric.kind, family))
            for engine, values in per_engine_labelvalues.items():
                for label_value, key in metric.keys:
                    own = [label_value] if metric.label else []
                    if metric.kind == "gauge":
                        self._gauges[(engine, key)] = (family, [*values, *own])
                    else:
                        self._bound[(engine, key)] = (metric.kind, family.labels(*values, *own))
        self._set_config_info(vllm_config, classes["gauge"], labelnames)

    def _set_config_info(self, vllm_config: Any, gauge: Any, labelnames: list[str]) -> None:
        from tierkv import __version__
        from tierkv.integrations.vllm_config import parse_settings, settings_in_use

        transfer = getattr(vllm_config, "kv_transfer_config", None)
        settings = settings_in_use(
            parse_settings(getattr(transfer, "kv_connector_extra_config", None)), vllm_config)
        info = config_info(settings, version=__version__)
        family = gauge(name=PREFIX + CONFIG_INFO, documentation=CONFIG_INFO_HELP,
                       labelnames=[*labelnames, *info])
        for values in self._engines.values():
            family.labels(*values, *info.values()).set(1)

    def _bind(self, engine_idx: int, key: str) -> tuple[str, Any] | None:
        """A gauge's or dynamic metric's figure, bound as it first arrives (None: not
        exported)."""
        gauge = self._gauges.pop((engine_idx, key), None)
        if gauge is not None:
            bound = self._bound[(engine_idx, key)] = ("gauge", gauge[0].labels(*gauge[1]))
            return bound
        values = self._engines.get(engine_idx)
        for prefix, kind, family in self._dynamic:
            if values is not None and key.startswith(prefix):
                bound = self._bound[(engine_idx, key)] = (
                    kind, family.labels(*values, key[len(prefix):]))
                return bound
        return None

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            bound = self._bound.get((engine_idx, key)) or self._bind(engine_idx, key)
            if bound is None:
                continue  # a figure tierkv logs but does not export
            kind, metric = bound
            if kind == "counter":
                if value > 0:
                    metric.inc(value)
            elif kind == "gauge":
                metric.set(value)
            else:
                for seconds in value:
                    metric.observe(seconds)


__all__ = ["TierKVPromMetrics"]
