"""The records of the index's and the engine adapter's figures, declared once
(:mod:`tierkv.core.figures`), one record per object:

- :class:`IndexStats`    the block index's counts (it increments them) and gauges;
  ``BlockIndex.statistics()`` is its snapshot.
- :class:`AdapterStats`  the engine adapter's counts (``EngineAdapter.stats``): its own,
  the cost model's dropped samples, the bytes of the jobs it completed, and per
  tier (``stats.tier["disk"]``) a :class:`TierStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.core.figures import Record, counter, gauge, per

TIERS = ("cpu", "disk", "remote")  # the media a chunk is found on, fastest first


@dataclass(eq=False, kw_only=True)
class IndexStats(Record):
    """The index's running counts and, in a snapshot, its gauges (0 while it counts)."""

    stores_planned: int = counter("Chunks planned for a store (GPU -> CPU)")
    stores_present: int = counter("Chunks asked to store that the index already held")
    stores_no_room: int = counter("Chunks not stored for want of a free CPU slot")
    stores_failed: int = counter("Chunks whose store job failed")
    loads_cpu: int = counter("Chunks loaded from the CPU tier")
    loads_disk: int = counter("Chunks loaded from the disk tier (through a CPU slot)")
    loads_failed: int = counter("Chunk loads that failed; their tokens are recomputed")
    loads_no_room: int = counter("Chunk loads refused for want of a CPU slot")
    corrupt: int = counter("Chunks read from disk whose bytes failed their checks")
    disk_missing: int = counter("Chunks the index held on disk that were gone when loaded")
    cpu_evictions: int = counter("Chunks evicted from the CPU tier")
    dirty_dropped: int = counter("Chunks evicted from the CPU tier before they reached disk")
    disk_evictions: int = counter("Chunks evicted from the disk tier")
    spills_ok: int = counter("Chunks written from the CPU tier to disk")
    spills_failed: int = counter("Chunks whose write to disk failed")
    disk_no_room: int = counter("Chunks not written to disk for want of room")
    loads_remote: int = counter("Chunks loaded from the remote tier")
    remote_missing: int = counter("Phantoms: chunks noted remotely, gone when loaded")
    remote_corrupt: int = counter("Chunks read from the remote tier whose bytes failed a check")
    remote_failed: int = counter("Remote loads that failed otherwise (network, breaker)")
    num_slots: int = gauge("CPU slots")
    free_slots: int = gauge("CPU slots free")
    cpu_ready: int = gauge("Chunks ready in the CPU tier")
    storing: int = gauge("Chunks being stored into the CPU tier")
    promoting: int = gauge("Chunks being read from disk into the CPU tier")
    spilling: int = gauge("Chunks being written to disk")
    on_disk: int = gauge("Chunks on disk")
    disk_capacity: int = gauge("Chunks the disk tier can hold")
    remote_marks: int = gauge("Remote marks held (aged ones until the next note_remote drops "
                              "them)")


@dataclass(eq=False)
class TierStats(Record):
    """What the adapter counts per tier (``stats.tier[tier]``): the hits it found there,
    those load_policy "cost" declined (recomputed instead), and the taken loads' estimated
    and measured seconds, by their slowest tier."""

    hit_tokens: int = counter("Tokens found in the tier")
    declined_tokens: int = counter("Hit tokens in the tier recomputed instead")
    load_seconds_estimated: float = counter("Estimated seconds of loads slowest on the tier",
                                            default=0.0)
    load_seconds_measured: float = counter("Measured seconds of loads slowest on the tier",
                                           default=0.0)


@dataclass(eq=False)
class AdapterStats(Record):
    lookups: int = counter("Requests looked up")
    hit_tokens: int = counter("Tokens found, all tiers (reported by tier: hit_tokens_<tier>)",
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
    remote_not_yet: int = counter("Lookups answered \"not yet\" waiting on the remote "
                                  "tier's answer")
    # tier[*].hit_tokens / queried_tokens is tierkv's hit rate.
    queried_tokens: int = counter("Tokens looked up in tierkv: under vLLM a prompt's tokens "
                                  "past vLLM's own prefix cache, in the library API the "
                                  "lookup()'s chunks")
    stores_without_pages: int = counter("Chunks not stored because the engine had released "
                                        "one of their pages first (a sliding-window group's "
                                        "block that left the window)")
    sync_loads: int = counter("Loads copied in the step that asked for them "
                              "(sync_load_chunks)")
    load_probes: int = counter("Loads taken against the estimate, to measure a declined tier")
    load_lines_restarted: int = counter("Probes that beat their estimate 2x: the tier's line "
                                        "anew")
    remote_lookups_skipped: int = counter("Requests not asked of a remote tier being declined")
    lookups_recompute: int = counter("Lookups of requests that asked for load_policy "
                                     "\"recompute\"")
    cost_samples_dropped: int = counter("Timing samples the cost model dropped: a step's or "
                                        "a load's time not finite, negative or over an hour, "
                                        "or a count of tokens or chunks not in [1, 2^32]")
    bytes_completed: int = counter("Bytes moved by the jobs the workers reported finished, "
                                   "every path (a load's reads included)")
    tier: dict[str, TierStats] = per(TIERS, TierStats)


__all__ = ["AdapterStats", "IndexStats", "TIERS", "TierStats"]
