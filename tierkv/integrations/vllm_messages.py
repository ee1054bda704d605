"""What tierkv's vLLM connector sends between its roles, in vLLM's own containers.

- :class:`TierKVMetadata`        scheduler -> every worker, once per step: the adapter's
  :class:`~tierkv.engine.requests.StepPlan` (job ids, keys, slots, block ids: plain data)
  and the namespace fingerprint, which the worker checks once against its own.
- :class:`TierKVWorkerMetadata`  worker -> scheduler, once per step: the jobs this rank
  finished since its last report. vLLM's output aggregator merges the ranks of one step
  with ``aggregate`` (a concatenation); the scheduler's ``CompletionTracker`` counts a job
  complete once ``world_size`` reports of it arrived, over one step or several.
- :class:`TierKVConnectorStats`  counters since the last report, from both roles; vLLM sums
  them over ranks and intervals and logs ``reduce()``.

Requests whose load finished and the GPU blocks of chunks that failed to load travel in
vLLM's own fields (``finished_recving``, ``invalid_block_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tierkv.engine.requests import Completion, StepPlan


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    plan: StepPlan
    namespace: str  # fingerprint of the scheduler's namespace
    step: int


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    completions: list[Completion] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, TierKVWorkerMetadata):
            raise TypeError(f"tierkv: cannot aggregate worker metadata of type {type(other).__name__}")
        return TierKVWorkerMetadata(self.completions + other.completions)


@dataclass
class TierKVConnectorStats(KVConnectorStats):
    """Counters (ints or float seconds) since the previous report; all sum on aggregate."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged: dict[str, Any] = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value
        return TierKVConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: value for name, value in sorted(self.data.items()) if value}
        hits = self.data.get("hit_tokens_cpu", 0) + self.data.get("hit_tokens_disk", 0)
        if hits:
            out["hit_tokens"] = hits
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())
