"""RemoteIO: write-behind pushes of chunk payloads to the remote tier, never in the way.

Primitives and contracts:

- ``push(key, payload)`` copies ``payload`` into a queue bounded by ``queue_bytes`` and
  returns at once: True when queued, False when the queue had no room (the push is skipped
  and counted as ``dropped``). It never waits on the network, whatever the server does. The
  copy is what lets the caller reuse the slot at once.
- One thread sends what is queued in batches of up to ``batch`` chunks (one
  ``put_many``: one pipeline of ``SET NX``). A failed batch (the server is down, the
  breaker is open) is counted as ``failed`` and dropped: the remote tier is a cache.
- ``flush(timeout=None)`` waits until everything pushed so far was sent or dropped
  (True) or the timeout passed (False). ``shutdown()`` flushes (at most ``timeout``
  seconds) and stops the thread; idempotent. ``statistics()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from tierkv.errors import ClosedError, ConfigError, TierKVError
from tierkv.tiers.base import LowerTier

logger = logging.getLogger("tierkv.remote")


@dataclass(frozen=True)
class RemoteIOStatistics:
    queued: int  # pushes accepted
    pushed: int  # chunks sent (already stored by another engine included)
    dropped: int  # pushes skipped: the queue was full
    failed: int  # chunks of batches the tier failed
    bytes_pushed: int
    queue_bytes_now: int


class RemoteIO:
    """The write-behind thread over a remote tier; see the module docstring."""

    def __init__(self, tier: LowerTier, queue_bytes: int, batch: int = 16) -> None:
        for name, value in (("queue_bytes", queue_bytes), ("batch", batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"remote io: {name} must be a positive int, got {value!r}")
        self.tier = tier
        self.queue_bytes = queue_bytes
        self.batch = batch
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._queued_bytes = 0
        self._in_flight = 0
        self._closed = False
        self._counts = dict.fromkeys(("queued", "pushed", "dropped", "failed",
                                      "bytes_pushed"), 0)
        self._thread = threading.Thread(target=self._main, name="tierkv-remote-push",
                                        daemon=True)
        self._thread.start()

    def push(self, key: bytes, payload: Any) -> bool:
        """Queue a copy of ``payload`` for ``key``; False (counted) when there is no room."""
        size = memoryview(payload).nbytes
        with self._cond:
            if self._closed:
                raise ClosedError("remote io: used after shutdown(); create a new RemoteIO")
            if self._queued_bytes + size > self.queue_bytes:
                self._counts["dropped"] += 1
                return False
            self._queue.append((bytes(key), bytes(memoryview(payload).cast("B"))))
            self._queued_bytes += size
            self._counts["queued"] += 1
            self._cond.notify_all()
        return True

    def _main(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                items = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
                self._in_flight = len(items)
            size = sum(len(payload) for _, payload in items)
            try:
                self.tier.put_many(items)
                ok = True
            except TierKVError as exc:  # the tier counted and logged it; a cache drops
                logger.debug("remote io: a batch of %d push(es) failed: %s", len(items), exc)
                ok = False
            except Exception:
                logger.exception("remote io: a batch of %d push(es) failed", len(items))
                ok = False
            with self._cond:
                self._counts["pushed" if ok else "failed"] += len(items)
                if ok:
                    self._counts["bytes_pushed"] += size
                self._queued_bytes -= size
                self._in_flight = 0
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything pushed so far was sent or dropped; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Flush (at most ``timeout`` seconds), then stop the thread; idempotent."""
        if self._closed:
            return
        if not self.flush(timeout):
            logger.warning("remote io: %d push(es) still queued at shutdown; dropped",
                           len(self._queue))
        with self._cond:
            self._closed = True
            self._counts["dropped"] += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout)

    def statistics(self) -> RemoteIOStatistics:
        with self._cond:
            return RemoteIOStatistics(**self._counts, queue_bytes_now=self._queued_bytes)
