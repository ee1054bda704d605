"""AdapterStats: the engine adapter's counters (plain data; ``EngineAdapter.stats``).

:mod:`tierkv.engine.adapter` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AdapterStats"]


@dataclass
class AdapterStats:
    lookups: int = 0
    hit_tokens: int = 0
    not_yet: int = 0
    loads_planned: int = 0
    loads_failed_chunks: int = 0
    stores_planned: int = 0
    flushes: int = 0
    requests_freed: int = 0
    waits_on_stores: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    hit_tokens_remote: int = 0
    remote_not_yet: int = 0
    # Tokens past the engine's own prefix hit of requests that were allocated (the engine
    # reports them with count_queried); hit_tokens_* / queried_tokens is tierkv's hit rate.
    queried_tokens: int = 0
    # Chunks not stored because the engine no longer held one of their pages (several
    # groups: a sliding-window block freed, or never given, before the chunk was stored).
    stores_without_pages: int = 0
    sync_loads: int = 0  # loads copied in the step that asked for them (sync_load_chunks)
    # load_policy "cost": hit tokens declined (recomputed instead) by the tier that held
    # them, and the taken loads' estimated and measured seconds by their slowest tier.
    load_probes: int = 0  # loads taken against the estimate, to measure a declined tier
    load_lines_restarted: int = 0  # probes that beat their estimate 2x: the tier's line anew
    remote_lookups_skipped: int = 0  # requests not asked of a remote tier being declined
    lookups_recompute: int = 0  # lookups of requests that asked for load_policy "recompute"
    declined_tokens_cpu: int = 0
    declined_tokens_disk: int = 0
    declined_tokens_remote: int = 0
    load_seconds_estimated_cpu: float = 0.0
    load_seconds_estimated_disk: float = 0.0
    load_seconds_estimated_remote: float = 0.0
    load_seconds_measured_cpu: float = 0.0
    load_seconds_measured_disk: float = 0.0
    load_seconds_measured_remote: float = 0.0
