"""What :class:`~tierkv.tiers.remote.tier.RemoteTier` counts, declared once
(:mod:`tierkv.core.figures`): :class:`RemoteStatistics`, the tier's running counts (its
calls, values and bytes); ``statistics()`` is its snapshot, with the breakers' state and
the failures by cause and by value check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.core.figures import Record, counter

if TYPE_CHECKING:
    from tierkv.tiers.remote.lookup import RemoteLookupStatistics
    from tierkv.tiers.remote.pushes import RemoteIOStatistics


@dataclass(eq=False, kw_only=True)
class RemoteStatistics(Record):
    """The counters since open and, in a snapshot, the fields below them. The labelled
    ones are not figures: ``remote_figures`` makes one figure per cause, check and node of
    them (``remote_calls_<cause>``, ...). A store's ``statistics().remote`` also carries
    the pushes and the lookups over the tier."""

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
    breaker_opens: int = counter("Times a circuit breaker opened (the tier's NodeHealth "
                                 "counts them)")
    cluster: bool = False  # the server is a Redis Cluster
    causes: tuple[tuple[str, int], ...] = ()  # failed calls by cause
    bad_values: tuple[tuple[str, int], ...] = ()  # value checks failed, by check
    breakers: tuple[tuple[str, int], ...] = ()  # per node: 1 open (or probing), 0 closed
    pushes: RemoteIOStatistics | None = None  # a store's: None when remote.push="read_only"
    lookups: RemoteLookupStatistics | None = None  # a store's: the lookups asked of it


__all__ = ["RemoteStatistics"]
