"""An example of an operator's own load policy (``load_policy:
"tierkv.engine.example_load_policy:LocalFirst"``; the protocol:
:class:`tierkv.engine.load_policy.LoadPolicy`, docs/engine-adapter.md "Your own load
policy").

LocalFirst loads every chunk the local tiers (CPU and disk) hold at the head of the hit;
from the first remote chunk on, it loads only what the cost model says pays (the model's
best prefix of the whole hit, never less than the local head).
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.core.costs import CostModel

__all__ = ["LocalFirst"]


class LocalFirst:
    def choose(self, runs: Sequence[tuple[str, int]], tokens_per_chunk: int,
               first_chunk_tokens: int, costs: CostModel) -> int:
        local = 0
        for tier, size in runs:
            if tier == "remote":
                break
            local += size
        best = costs.best_prefix(runs, tokens_per_chunk, first_chunk_tokens)[0]
        return max(local, best)
