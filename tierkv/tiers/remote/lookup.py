"""RemoteLookup: the scheduler side's questions to the remote tier, off the scheduler's thread.

Primitives and contracts:

- ``ask(keys) -> dict[bytes, int] | None``: for each of the first ``remote.lookup_chunks``
  of ``keys``, the part count of the first of the candidate sets of parts (``part_sets``,
  one per part count: this engine's own first, then those of other TP sizes) that has a
  value for every part (0: none), or None: "not yet" (the server did not answer within
  ``remote.lookup_deadline_seconds``; ask again: the answers that come later are handed to
  the next ask: an absence within 50 ms, a chunk found within ``remote.mark_seconds``,
  however slow the engine's next step). They are asked in one request: one pipeline of one ``EXISTS`` per chunk and
  candidate count (a chunk's parts share a hash slot), so one round trip per node, never
  one per chunk. The lookup keeps only answers that came after an ask gave up, until the
  next ask takes them; what the server has is known by the asker
  (:class:`~tierkv.core.remote_marks.RemoteMarks`, the one record of it).
- The thread connects at once; the constructor waits for that (at most the tier's
  ``timeout_seconds``), so the first lookup pays a round trip, not a cluster discovery.
- A lookup that fails (a timeout, a node down, the breaker open) answers "absent" for those
  keys, counted in ``errors`` (never a silent zero: the tier logs and its breaker warns);
  a node that fails or is skipped does so for its own keys only (the tier asks each node
  at once and counts that node's failure), the others' are answered.
- One thread sends the questions; questions asked while one is in flight go out together
  in the next. Between them, at most every ``usage_seconds`` (0: never), it polls the
  servers' memory for the capacity gauges (:mod:`~tierkv.tiers.remote.usage`; the first
  poll right after connecting): ``server_memory()`` reads the last answer, no network (a
  call that finds a poll due wakes the thread for it); ``stored_chunk_bytes``: what one
  chunk of this engine (all its parts, their keys and the format's header) takes there.
  ``statistics()``; ``shutdown()`` (idempotent; it closes the tier, which the
  lookup owns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from tierkv.core.remote_marks import ANSWER_SECONDS
from tierkv.errors import ClosedError, TierKVError
from tierkv.keys import KEY_BYTES, Part
from tierkv.tiers.remote.format import redis_key, value_bytes
from tierkv.tiers.remote.stats import RemoteStatistics
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.usage import RemoteUsage, ServerMemory

logger = logging.getLogger("tierkv.remote")


class RemoteLookup:
    """See the module docstring."""

    def __init__(self, tier: RemoteTier, part_sets: Sequence[Sequence[Part]],
                 deadline_seconds: float, max_keys: int = 64,
                 clock: Callable[[], float] = time.monotonic,
                 usage_seconds: float = 0.0) -> None:
        self.tier = tier
        self._part_sets = [list(parts) for parts in part_sets]
        self.counts = tuple(parts[0].count for parts in self._part_sets)
        self.deadline_seconds = deadline_seconds
        self.max_keys = max_keys
        self._clock = clock
        self._cond = threading.Condition()
        # Answers come in, not yet handed to an ask (key -> (part count, 0: absent; when)),
        # oldest first: handed over by the next ask. An absence is dropped once
        # ANSWER_SECONDS old (not believed longer anyway); a chunk found is kept as long as
        # the index believes a mark (remote.mark_seconds): an ask that gave up ("not yet")
        # gets it at its next try however slow the engine's steps, never asks again.
        self._answers: dict[bytes, tuple[int, float]] = {}
        self._wanted: dict[bytes, None] = {}  # asked, not sent yet
        self._sent: set[bytes] = set()  # in the request in flight
        self._closed = False
        self._counts = RemoteStatistics()  # lookup_* only (the tier counts its calls)
        self.usage = RemoteUsage(usage_seconds, clock)
        parts = self._part_sets[0]
        self.stored_chunk_bytes = parts[0].count * (value_bytes(tier.payload_bytes) + len(
            redis_key(tier.config.key_prefix.encode(), tier.fingerprint, parts[0],
                      bytes(KEY_BYTES))))
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._main, name="tierkv-remote-lookup",
                                        daemon=True)
        self._thread.start()
        self._connected.wait(tier.config.timeout_seconds)

    def ask(self, keys: Sequence[bytes]) -> dict[bytes, int] | None:
        keys = keys[: self.max_keys]
        with self._cond:
            if self._closed:
                raise ClosedError("remote lookup: used after shutdown()")
            self._counts.lookup_asks += 1
            answers, now = self._answers, self._clock()
            if answers and next(iter(answers.values()))[1] < now - ANSWER_SECONDS:
                absent, found = now - ANSWER_SECONDS, now - self.tier.config.mark_seconds
                self._answers = answers = {key: (count, when) for key, (count, when)
                                           in answers.items()
                                           if when >= (found if count else absent)}
            for key in keys:
                if key not in answers and key not in self._sent:
                    self._wanted[key] = None
            self._cond.notify_all()
            deadline = time.monotonic() + self.deadline_seconds
            while True:
                done = all(key in answers for key in keys)
                left = deadline - time.monotonic()
                if done or left <= 0:
                    break
                self._cond.wait(left)
            if not done:
                self._counts.lookup_not_yet += 1
                return None
            self._answers = {}
            return {key: count for key, (count, _) in answers.items()}

    def _main(self) -> None:
        try:
            self.tier.warm_up()  # a server down now is a miss later, never a failed start
        finally:
            self._connected.set()
        usage = self.usage
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._closed or usage.due(),
                                    usage.seconds_to_due())
                if self._closed:
                    return
                keys = list(self._wanted)
                self._wanted.clear()
                self._sent = set(keys)
            if keys:  # the lookups first: a poll may take a deadline
                self._look_up(keys)
            if usage.due():
                usage.poll(self.tier)

    def _look_up(self, keys: list[bytes]) -> None:
        """One request for ``keys``; the answers noted, the askers woken."""
        started = time.perf_counter()
        part_counts: list[int] = [0] * len(keys)
        try:
            found = self.tier.exists_under(keys, self._part_sets)
            part_counts = [next((count for count, there in zip(self.counts, answer) if there),
                                0) for answer in found]
            failed = False
        except TierKVError as exc:  # counted and logged by the tier (and its breaker)
            logger.debug("remote lookup: %d key(s) failed: %s", len(keys), exc)
            failed = True
        except Exception:
            logger.exception("remote lookup: %d key(s) failed", len(keys))
            failed = True
        with self._cond:
            answers, now = self._answers, self._clock()
            for key, count in zip(keys, part_counts):
                answers.pop(key, None)  # re-inserted: the newest
                answers[key] = (count, now)
            while len(answers) > self.max_keys * 16:  # asks that gave up: the oldest go
                del answers[next(iter(answers))]
            counts = self._counts
            counts.lookup_requests += 1
            counts.lookup_keys_asked += len(keys)
            counts.lookup_keys_found += sum(count > 0 for count in part_counts)
            counts.lookup_errors += failed
            counts.lookup_seconds += time.perf_counter() - started
            self._sent = set()
            self._cond.notify_all()

    def server_memory(self) -> ServerMemory | None:
        """The servers' memory as last polled (None: not yet); no network, never waits on
        a poll (safe from a scrape's thread)."""
        if self.usage.due():
            with self._cond:  # held briefly only, never across a network call
                self._cond.notify_all()
        return self.usage.last()

    def statistics(self) -> RemoteStatistics:
        with self._cond:
            return self._counts.snapshot()

    def shutdown(self) -> None:
        """Stop the thread (a request in flight ends within the tier's timeout) and close
        the tier, which the lookup owns; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(self.tier.call_seconds())  # a request in flight ends by then
        self.tier.close()
