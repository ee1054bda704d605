"""What the remote tier and its users count, declared once (:mod:`tierkv.core.figures`):
one record class, one record per object, each ``statistics()`` its record's snapshot.

- :class:`RemoteStatistics` what :class:`~tierkv.tiers.remote.tier.RemoteTier` counts (its
  calls, values and bytes; its snapshot: with the breakers' state and the failures by cause
  and by value check), :class:`~tierkv.tiers.remote.lookup.RemoteLookup` (``lookup_*``, its
  asks) and :class:`~tierkv.tiers.remote.pushes.RemoteIO` (``pushes_*``, its pushes). A
  reported field is the figure ``remote_<field>`` (``calls_ok`` is ``remote_calls_ok``,
  ``pushes_dropped`` is ``remote_pushes_dropped``).
- :func:`combined` the sum of several objects' records: a store's
  ``statistics().remote``, and what the figures count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.core.figures import Record, counter, figures


@dataclass(eq=False, kw_only=True)
class RemoteStatistics(Record):
    """The counters since open and, in a snapshot, the fields below them. A reported
    counter is the figure ``remote_<field>``; the others are kept, not reported. The
    labelled ones are not figures: ``remote_figures`` makes one figure per cause, check and
    node of them (``remote_calls_<cause>``, ...)."""

    calls_ok: int = counter("Calls that succeeded")
    calls_skipped: int = counter("Calls refused at once by an open circuit breaker")
    bytes_written: int = counter("Value bytes written to the remote tier")
    bytes_read: int = counter("Value bytes read from the remote tier (good or bad)")
    puts: int = counter("Values stored", reported=False)
    already: int = counter("Values another engine had stored (SET NX left them)",
                           reported=False)
    reads: int = counter("Values asked for", reported=False)
    hits: int = counter("Values read and found good", reported=False)
    misses: int = counter("Values asked for and absent (or failed a check)", reported=False)
    corrupt: int = counter("Values that failed a check when read (reported by check)",
                           reported=False)
    errors: int = counter("Calls that failed (reported by cause)", reported=False)
    breaker_opens: int = counter("Times a circuit breaker opened (the tier's NodeHealth "
                                 "counts them)", reported=False)
    # a lookup's (the scheduler side's questions)
    lookup_asks: int = counter("Calls of the lookup's ask()", reported=False)
    lookup_not_yet: int = counter("Asks answered None (the deadline passed)", reported=False)
    lookup_requests: int = counter("Lookup pipelines sent (each at most one round trip per "
                                   "node)")
    lookup_keys_asked: int = counter("Keys the lookups asked of the remote tier",
                                     reported=False)
    lookup_keys_found: int = counter("Keys the remote tier had", reported=False)
    lookup_errors: int = counter("Lookup requests the tier failed (their keys count as "
                                 "absent)")
    lookup_seconds: float = counter("Seconds spent in lookup requests", reported=False)
    # the pushes' (by fate: tierkv:remote_pushes{result=...}; queued is their sum and those
    # still queued, pushes_bytes what the tier's bytes_written counts)
    pushes_queued: int = counter("Pushes accepted", reported=False)
    pushes_pushed: int = counter("Chunks sent (already stored by another engine included)")
    pushes_failed: int = counter("Chunks the tier did not store (a failed or skipped call, "
                                 "a refusal)")
    pushes_dropped: int = counter("Pushes skipped: the queue was full")
    pushes_abandoned: int = counter("Chunks still queued at shutdown, never sent")
    pushes_bytes: int = counter("Payload bytes of the chunks sent", reported=False)
    pushes_queue_bytes: int = 0  # a snapshot's: payload bytes queued now
    cluster: bool = False  # the server is a Redis Cluster
    causes: tuple[tuple[str, int], ...] = ()  # failed calls by cause
    bad_values: tuple[tuple[str, int], ...] = ()  # value checks failed, by check
    breakers: tuple[tuple[str, int], ...] = ()  # per node: 1 open (or probing), 0 closed


def combined(records: Sequence[RemoteStatistics]) -> RemoteStatistics:
    """The sum of ``records`` (a tier's, a lookup's, a pusher's...), as a snapshot: the
    counters and the queued bytes summed, the failures by cause and by check summed per
    label, a node's breaker open if any record's is, a cluster if any record's is."""
    out = RemoteStatistics()
    causes, bad, breakers = Counter[str](), Counter[str](), dict[str, int]()
    for record in records:
        for figure in figures(RemoteStatistics):
            setattr(out, figure.name, getattr(out, figure.name) + getattr(record, figure.name))
        out.pushes_queue_bytes += record.pushes_queue_bytes
        out.cluster = out.cluster or record.cluster
        causes.update(dict(record.causes))
        bad.update(dict(record.bad_values))
        for node, state in record.breakers:
            breakers[node] = max(breakers.get(node, 0), state)
    return out.snapshot(causes=tuple(sorted(causes.items())),
                        bad_values=tuple(sorted(bad.items())),
                        breakers=tuple(sorted(breakers.items())))


__all__ = ["RemoteStatistics", "combined"]
