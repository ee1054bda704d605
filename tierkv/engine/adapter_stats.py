"""AdapterStats: the engine adapter's counters (plain data; ``EngineAdapter.stats``), each
declared once as a figure (:mod:`tierkv.core.figures`): its own, and the cost model's
(:class:`tierkv.core.costs.CostCounts`, which the model counts in this record).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.core.costs import CostCounts
from tierkv.core.figures import counter

__all__ = ["AdapterStats"]


@dataclass
class AdapterStats(CostCounts):
    lookups: int = counter("Requests looked up")
    hit_tokens: int = counter("Tokens found, all tiers (reported as hit_tokens_<tier>)",
                              reported=False)
    not_yet: int = counter("Lookups answered \"not yet\" (a load or a remote answer pending)")
    loads_planned: int = counter("Chunks planned for a load (the index counts them by tier)",
                                 reported=False)
    loads_failed_chunks: int = counter("Chunks of planned loads that failed (the index "
                                       "counts them: loads_failed)", reported=False)
    stores_planned: int = counter("Chunks planned for a store (the index counts them)",
                                  reported=False)
    flushes: int = counter("Jobs flushed (waited for) before their blocks were reused")
    requests_freed: int = counter("Requests freed", reported=False)
    waits_on_stores: int = counter("Lookups answered \"not yet\" waiting on a store of "
                                   "their prefix (wait_for_stores)")
    hit_tokens_cpu: int = counter("Tokens found in the CPU tier")
    hit_tokens_disk: int = counter("Tokens found in the disk tier")
    hit_tokens_remote: int = counter("Tokens found in the remote tier")
    remote_not_yet: int = counter("Lookups answered \"not yet\" waiting on the remote "
                                  "tier's answer")
    # hit_tokens_* / queried_tokens is tierkv's hit rate.
    queried_tokens: int = counter("Tokens looked up in tierkv: under vLLM a prompt's tokens "
                                  "past vLLM's own prefix cache, in the library API the "
                                  "lookup()'s chunks")
    stores_without_pages: int = counter("Chunks not stored because the engine had released "
                                        "one of their pages first (a sliding-window group's "
                                        "block that left the window)")
    sync_loads: int = counter("Loads copied in the step that asked for them "
                              "(sync_load_chunks)")
    # load_policy "cost": hit tokens declined (recomputed instead) by the tier that held
    # them, and the taken loads' estimated and measured seconds by their slowest tier.
    load_probes: int = counter("Loads taken against the estimate, to measure a declined tier")
    load_lines_restarted: int = counter("Probes that beat their estimate 2x: the tier's line "
                                        "anew")
    remote_lookups_skipped: int = counter("Requests not asked of a remote tier being declined")
    lookups_recompute: int = counter("Lookups of requests that asked for load_policy "
                                     "\"recompute\"")
    declined_tokens_cpu: int = counter("Hit tokens in the CPU tier recomputed instead")
    declined_tokens_disk: int = counter("Hit tokens in the disk tier recomputed instead")
    declined_tokens_remote: int = counter("Hit tokens in the remote tier recomputed instead")
    load_seconds_estimated_cpu: float = counter("Estimated seconds of loads slowest on CPU",
                                                default=0.0)
    load_seconds_estimated_disk: float = counter("Estimated seconds of loads slowest on disk",
                                                 default=0.0)
    load_seconds_estimated_remote: float = counter("Estimated seconds of loads slowest on the "
                                                   "remote tier", default=0.0)
    load_seconds_measured_cpu: float = counter("Measured seconds of loads slowest on CPU",
                                               default=0.0)
    load_seconds_measured_disk: float = counter("Measured seconds of loads slowest on disk",
                                                default=0.0)
    load_seconds_measured_remote: float = counter("Measured seconds of loads slowest on the "
                                                  "remote tier", default=0.0)
