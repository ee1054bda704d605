"""RemoteUsage: the remote servers' memory for the capacity gauges, polled in the background
and read without a network call.

Primitives and contracts (thread-safe; time from the injected ``clock``):

- ``poll(tier)``: ``INFO memory`` of every primary (``tier.each_primary``: each node at
  once under the tier's deadline, skipped at once on an open breaker), on the caller's
  thread: the remote lookup's own, never a scrape's. A primary that does not answer keeps
  its last known figures (none before its first answer); a primary no longer in the
  cluster is forgotten. Each poll is counted (``polls``; ``failures``: none answered).
- ``due()``: whether ``every_seconds`` passed since the last poll (the first is due at
  once); never with ``every_seconds`` 0 (``remote.usage_seconds``: off).
  ``seconds_to_due()``: how long a thread may sleep before the next (None: never).
- ``last() -> ServerMemory | None``: the sums over the primaries last heard from (None
  before any answered); no network, never blocks on a poll.
- ``wait_polls(count, timeout)``: wait until ``count`` polls ended (tests, tools).

Why (docs/remote.md, "Capacity gauges"): the server is shared and may stall; a Prometheus
scrape must never wait on it, so the gauges show what the last poll found, at most
``remote.usage_seconds`` old while the server answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tierkv.errors import TierKVError

logger = logging.getLogger("tierkv.remote")


@dataclass(frozen=True)
class ServerMemory:
    """The remote servers' memory, summed over their primaries: ``used_memory`` and
    ``maxmemory`` (``max_bytes`` None: a primary has none, the capacity is unbounded)."""

    used_bytes: int
    max_bytes: int | None
    nodes: int  # primaries summed


class _Polled(Protocol):
    def each_primary(self, action: str, work: Callable[[Any], Any]) -> dict[str, Any]: ...


class RemoteUsage:
    """See the module docstring."""

    def __init__(self, every_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_seconds = every_seconds
        self._clock = clock
        self._cond = threading.Condition()
        self._nodes: dict[str, tuple[int, int]] = {}  # node -> (used_memory, maxmemory)
        self._next: float | None = clock() if every_seconds > 0 else None
        self.polls = 0
        self.failures = 0

    def due(self) -> bool:
        with self._cond:
            return self._next is not None and self._clock() >= self._next

    def seconds_to_due(self) -> float | None:
        with self._cond:
            return None if self._next is None else max(self._next - self._clock(), 0.0)

    def poll(self, tier: _Polled) -> None:
        from tierkv.tiers.remote.client import memory_of  # redis-py: the 'remote' extra

        with self._cond:
            self._next = self._clock() + self.every_seconds
        answers: dict[str, Any] | None = None
        try:
            answers = tier.each_primary("reading INFO memory", memory_of)
        except TierKVError as exc:  # counted and logged by the tier (and its breakers)
            logger.debug("remote usage: INFO memory failed on every node: %s", exc)
        except Exception:
            logger.exception("remote usage: INFO memory failed")
        with self._cond:
            if answers is not None:
                self._nodes = {node: (memory.used, memory.maximum) if memory is not None
                               else self._nodes[node] for node, memory in answers.items()
                               if memory is not None or node in self._nodes}
            self.polls += 1
            self.failures += answers is None
            self._cond.notify_all()

    def last(self) -> ServerMemory | None:
        with self._cond:
            nodes = list(self._nodes.values())
        if not nodes:
            return None
        unbounded = any(maximum == 0 for _, maximum in nodes)
        return ServerMemory(sum(used for used, _ in nodes),
                            None if unbounded else sum(maximum for _, maximum in nodes),
                            len(nodes))

    def wait_polls(self, count: int, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.polls >= count, timeout)


__all__ = ["RemoteUsage", "ServerMemory"]
