"""RemoteLookup: the scheduler side's questions to the remote tier, off the scheduler's thread.

Primitives and contracts:

- ``ask(keys) -> list[bytes] | None``: the longest prefix of ``keys`` (at most
  ``remote.lookup_chunks`` of them) whose chunks have a value for every part of one of
  the candidate sets of parts (``part_sets``, one per part count: this engine's own
  first, then those of other TP sizes), or None: "not yet" (the server did not answer within
  ``remote.lookup_deadline_seconds``; ask again). What is not known yet is asked in one
  request: one pipeline of one ``EXISTS`` per chunk and candidate count (a chunk's parts
  share a hash slot), so one round trip per node, never one per chunk.
  ``count_of(key)``: the part count a found chunk is under (the first candidate with every
  part), 0 when unknown.
  Answers are kept ``answer_seconds`` (50 ms: a request waiting for GPU blocks is not asked
  about again every step, and a chunk another engine pushes is found 50 ms later at most;
  what the server has is kept longer by the index: ``note_remote``), oldest dropped first.
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

from tierkv.errors import ClosedError, TierKVError
from tierkv.keys import KEY_BYTES, Part
from tierkv.tiers.remote.format import redis_key, value_bytes
from tierkv.tiers.remote.stats import RemoteLookupStatistics
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.usage import RemoteUsage, ServerMemory

logger = logging.getLogger("tierkv.remote")


class RemoteLookup:
    """See the module docstring."""

    def __init__(self, tier: RemoteTier, part_sets: Sequence[Sequence[Part]],
                 deadline_seconds: float, max_keys: int = 64, answer_seconds: float = 0.05,
                 max_answers: int = 1 << 16, clock: Callable[[], float] = time.monotonic,
                 usage_seconds: float = 0.0) -> None:
        self.tier = tier
        self._part_sets = [list(parts) for parts in part_sets]
        self.counts = tuple(parts[0].count for parts in self._part_sets)
        self._count_of: dict[bytes, int] = {}  # found keys' part counts, oldest first
        self.deadline_seconds = deadline_seconds
        self.max_keys = max_keys
        self.answer_seconds = answer_seconds
        self._max_answers = max_answers
        self._clock = clock
        self._cond = threading.Condition()
        self._answers: dict[bytes, tuple[bool, float]] = {}  # key -> (exists, when), oldest first
        self._wanted: dict[bytes, None] = {}  # asked, not sent yet
        self._sent: set[bytes] = set()  # in the request in flight
        self._closed = False
        self._counts = RemoteLookupStatistics()
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

    def ask(self, keys: Sequence[bytes]) -> list[bytes] | None:
        keys = keys[: self.max_keys]
        with self._cond:
            if self._closed:
                raise ClosedError("remote lookup: used after shutdown()")
            self._counts.asks += 1
            found, unknown = self._known(keys)
            if unknown is None:
                return found
            for key in keys[unknown:]:
                if key not in self._sent:
                    self._wanted[key] = None
            self._cond.notify_all()
            deadline = time.monotonic() + self.deadline_seconds
            while True:
                found, unknown = self._known(keys)
                left = deadline - time.monotonic()
                if unknown is None or left <= 0:
                    break
                self._cond.wait(left)
            if unknown is None:
                return found
            self._counts.not_yet += 1
            return None

    def _known(self, keys: Sequence[bytes]) -> tuple[list[bytes], int | None]:
        """The prefix of ``keys`` known to exist, and where the first key with no fresh
        answer is (None: the prefix ends at a known absence, or covers ``keys``)."""
        oldest = self._clock() - self.answer_seconds
        answers = self._answers
        for position, key in enumerate(keys):
            answer = answers.get(key)
            if answer is None or answer[1] < oldest:
                return list(keys[:position]), position
            if not answer[0]:
                return list(keys[:position]), None
        return list(keys), None

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
            exists = [count > 0 for count in part_counts]
            failed = False
        except TierKVError as exc:  # counted and logged by the tier (and its breaker)
            logger.debug("remote lookup: %d key(s) failed: %s", len(keys), exc)
            exists, failed = [False] * len(keys), True
        except Exception:
            logger.exception("remote lookup: %d key(s) failed", len(keys))
            exists, failed = [False] * len(keys), True
        with self._cond:
            now = self._clock()
            answers = self._answers
            for key, there, count in zip(keys, exists, part_counts):
                answers.pop(key, None)  # re-inserted: the newest
                answers[key] = (there, now)
                if there:
                    self._count_of.pop(key, None)
                    self._count_of[key] = count
            while len(answers) > self._max_answers:
                del answers[next(iter(answers))]
            while len(self._count_of) > self._max_answers:
                del self._count_of[next(iter(self._count_of))]
            counts = self._counts
            counts.requests += 1
            counts.keys_asked += len(keys)
            counts.keys_found += sum(exists)
            counts.errors += failed
            counts.seconds += time.perf_counter() - started
            self._sent = set()
            self._cond.notify_all()

    def server_memory(self) -> ServerMemory | None:
        """The servers' memory as last polled (None: not yet); no network, never waits on
        a poll (safe from a scrape's thread)."""
        if self.usage.due():
            with self._cond:  # held briefly only, never across a network call
                self._cond.notify_all()
        return self.usage.last()

    def count_of(self, key: bytes) -> int:
        """The part count ``key`` was last found under (0: never found)."""
        with self._cond:
            return self._count_of.get(bytes(key), 0)

    def statistics(self) -> RemoteLookupStatistics:
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
