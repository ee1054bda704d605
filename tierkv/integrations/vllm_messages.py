"""What tierkv's vLLM connector sends between its roles, in vLLM's own containers.

- :class:`TierKVMetadata`        scheduler -> every worker, once per step: the adapter's
  :class:`~tierkv.engine.requests.StepPlan` (job ids, keys, slots, block ids: plain data)
  and the namespace fingerprint, which the worker checks once against its own.
- :class:`TierKVWorkerMetadata`  worker -> scheduler, once per step: the jobs this rank
  finished since its last report. vLLM's output aggregator merges the ranks of one step
  with ``aggregate`` (a concatenation); the scheduler's ``CompletionTracker`` counts a job
  complete once ``world_size`` reports of it arrived, over one step or several.
- :class:`TierKVConnectorStats`  figures since the last report, from both roles; vLLM merges
  them over ranks and intervals, logs ``reduce()`` and hands each payload to the connector's
  Prometheus metrics (:mod:`.vllm_metrics`).

Requests whose load finished and the GPU blocks of chunks that failed to load travel in
vLLM's own fields (``finished_recving``, ``invalid_block_ids``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tierkv.core.jobs import Completion
from tierkv.engine.metrics import HIT_TOKENS, is_gauge
from tierkv.engine.requests import StepPlan


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    plan: StepPlan
    namespace: str  # fingerprint of the scheduler's namespace
    step: int


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    completions: list[Completion] = field(default_factory=list)
    # Sent after every step the worker ran (so vLLM reports every step's output to the
    # scheduler side, which times the step from its plan: the cost model's compute line).
    step_done: bool = False

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TierKVWorkerMetadata):
            raise TypeError(f"tierkv: cannot aggregate worker metadata of type {type(other).__name__}")
        return TierKVWorkerMetadata(self.completions + other.completions,
                                    self.step_done or other.step_done)


@dataclass
class TierKVConnectorStats(KVConnectorStats):
    """Figures since the previous report (figure keys of :mod:`tierkv.engine.metrics`):
    counters sum on aggregate, job durations (lists of seconds) concatenate, usage gauges
    keep the latest value."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged: dict[str, Any] = dict(self.data)
        for name, value in other.data.items():
            if is_gauge(name) or name not in merged:
                merged[name] = list(value) if isinstance(value, list) else value
            else:
                merged[name] = merged[name] + value
        return TierKVConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """The interval's log line: counters (seconds to the ms), tokens queried and hit,
        the hit rate, and the median job time per path in ms."""
        out: dict[str, int | float] = {}
        for name, value in sorted(self.data.items()):
            if isinstance(value, list):
                if value:
                    out[f"{name.replace('durations_', 'median_ms_')}"] = round(
                        statistics.median(value) * 1e3, 3)
            elif not is_gauge(name) and value:
                out[name] = round(value, 3) if isinstance(value, float) else value
        hits = sum(self.data.get(key, 0) for _, key in HIT_TOKENS)
        if hits:
            out["hit_tokens"] = hits
        queried = self.data.get("queried_tokens", 0)
        if queried:
            out["hit_rate"] = round(hits / queried, 3)
        return out

    def is_empty(self) -> bool:
        return not any(value for name, value in self.data.items() if not is_gauge(name))
