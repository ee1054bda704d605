"""tierkv's Prometheus metrics under vLLM: :data:`tierkv.engine.metrics.METRICS`, registered
with the metric classes and labels vLLM hands to ``build_prom_metrics`` (``model_name`` and
``engine``; vLLM merges the ranks' figures before they reach us, so there is no rank label),
and fed from the connector's stats payloads (:class:`TierKVConnectorStats`) by ``observe``.
They appear on vLLM's ``/metrics`` as ``tierkv:*``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from tierkv.engine.metrics import DURATION_BUCKETS, METRICS, PREFIX


class TierKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {"counter": self._counter_cls, "gauge": self._gauge_cls,
                   "histogram": self._histogram_cls}
        # (engine index, figure key) -> (kind, the metric with its labels bound)
        self._bound: dict[tuple[int, str], tuple[str, Any]] = {}
        for metric in METRICS:
            extra = [metric.label] if metric.label else []
            options: dict[str, Any] = {"buckets": DURATION_BUCKETS} \
                if metric.kind == "histogram" else {}
            family = classes[metric.kind](name=PREFIX + metric.name, documentation=metric.help,
                                          labelnames=[*labelnames, *extra], **options)
            for engine, values in per_engine_labelvalues.items():
                for label_value, key in metric.keys:
                    own = [label_value] if metric.label else []
                    self._bound[(engine, key)] = (metric.kind, family.labels(*values, *own))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            bound = self._bound.get((engine_idx, key))
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
