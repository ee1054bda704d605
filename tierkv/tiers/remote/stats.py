"""What the remote tier and its users count, declared once (:mod:`tierkv.core.figures`),
one record per object; each ``statistics()`` is its record's snapshot.

- :class:`RemoteStatistics`        :class:`~tierkv.tiers.remote.tier.RemoteTier`'s calls,
  values and bytes (its snapshot: with the breakers' state and the failures by cause and
  by value check; a store's: with the pushes and the lookups over the tier).
- :class:`RemoteLookupStatistics`  :class:`~tierkv.tiers.remote.lookup.RemoteLookup`'s asks.
- :class:`RemoteIOStatistics`      :class:`~tierkv.tiers.remote.pushes.RemoteIO`'s pushes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.core.figures import Record, counter, gauge


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


@dataclass(eq=False)
class RemoteLookupStatistics(Record):
    """The lookup's running counts; ``statistics()`` is their snapshot."""

    asks: int = counter("Calls of ask()")
    not_yet: int = counter("Asks answered None (the deadline passed)")
    requests: int = counter("Pipelines sent (each at most one round trip per node)")
    keys_asked: int = counter("Keys asked of the remote tier")
    keys_found: int = counter("Keys the remote tier had")
    errors: int = counter("Requests the tier failed (their keys count as absent)")
    seconds: float = counter("Seconds spent in requests")


@dataclass(eq=False, kw_only=True)
class RemoteIOStatistics(Record):
    """The pushes' running counts; ``statistics()`` is their snapshot, with the queue's
    bytes. The reported ones are the pushes by fate (``tierkv:remote_pushes{result=...}``);
    ``queued`` (their sum, and those still queued) and ``bytes_pushed`` (the tier's
    ``bytes_written`` counts them) are kept, not reported."""

    queued: int = counter("Pushes accepted", reported=False)
    pushed: int = counter("Chunks sent (already stored by another engine included)")
    failed: int = counter("Chunks the tier did not store (a failed or skipped call, a "
                          "refusal)")
    dropped: int = counter("Pushes skipped: the queue was full")
    abandoned: int = counter("Chunks still queued at shutdown, never sent")
    bytes_pushed: int = counter("Payload bytes of the chunks sent", reported=False)
    queue_bytes_now: int = gauge("Payload bytes queued now")


__all__ = ["RemoteIOStatistics", "RemoteLookupStatistics", "RemoteStatistics"]
