"""What :class:`~tierkv.tiers.remote.tier.RemoteTier` counts, declared once
(:mod:`tierkv.core.figures`).

- :class:`TierCounts`        the tier's running counts (its calls, values and bytes).
- :class:`RemoteStatistics`  ``statistics()``: a read-only snapshot of them, with the
  breakers' state and the failures by cause and by value check.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.core.figures import Snapshot, counter


@dataclass
class TierCounts:
    """The remote tier's running counts (:class:`RemoteStatistics` is their snapshot)."""

    puts: int = counter("Values stored")
    already: int = counter("Values another engine had stored (SET NX left them)")
    bytes_written: int = counter("Value bytes written to the remote tier")
    reads: int = counter("Values asked for")
    hits: int = counter("Values read and found good")
    misses: int = counter("Values asked for and absent (or failed a check)")
    corrupt: int = counter("Values that failed a check when read")
    errors: int = counter("Calls that failed")
    skipped: int = counter("Calls refused at once by an open circuit breaker")
    bytes_read: int = counter("Value bytes read from the remote tier (good or bad)")
    calls: int = counter("Calls that succeeded")


@dataclass(kw_only=True, unsafe_hash=True)
class RemoteStatistics(Snapshot, TierCounts):
    """``statistics()``: the counters since open (fields of :class:`TierCounts`) and the
    fields below. The labelled ones are not figures: ``remote_figures`` makes one figure
    per cause, check and node of them (``remote_calls_<cause>``, ...)."""

    breaker_opens: int = counter("Times a circuit breaker opened (the tier's NodeHealth "
                                 "counts them)")
    cluster: bool = False  # the server is a Redis Cluster
    causes: tuple[tuple[str, int], ...] = ()  # failed calls by cause
    bad_values: tuple[tuple[str, int], ...] = ()  # value checks failed, by check
    breakers: tuple[tuple[str, int], ...] = ()  # per node: 1 open (or probing), 0 closed


__all__ = ["RemoteStatistics", "TierCounts"]
