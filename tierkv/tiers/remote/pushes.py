"""RemoteIO: write-behind pushes of chunk payloads to the remote tier, never in the way.

Primitives and contracts:

- ``push(key, payload)`` copies ``payload`` into a queue bounded by ``queue_bytes`` and
  returns at once: True when queued, False when the queue had no room (the push is skipped
  and counted in ``pushes_dropped``). It never waits on the network, whatever the server
  does. The copy is what lets the caller reuse the slot at once.
- One thread sends what is queued in batches of up to ``batch`` chunks (one
  ``put_many``: one pipeline of ``SET NX`` per node, the nodes at once). The chunks of a
  batch the tier did not store (their node failed or stalled, a breaker skipped it, the
  server refused them for want of memory) are counted in ``pushes_failed`` and dropped:
  the remote tier is a cache; the other nodes' chunks are stored.
- ``flush(timeout=None)`` waits until everything pushed so far was sent or dropped
  (True) or the timeout passed (False). ``shutdown(timeout)`` returns within ``timeout``
  seconds: it flushes while a batch in flight can still end in time (a batch's call ends
  within ``tier.call_seconds(its bytes)``), then drops what is left
  (``pushes_abandoned``) and stops the thread; idempotent. ``statistics()``: the
  ``pushes_*`` of a :class:`~tierkv.tiers.remote.stats.RemoteStatistics`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from tierkv.checks import check_int
from tierkv.errors import ClosedError, TierKVError
from tierkv.tiers.base import LowerTier
from tierkv.tiers.remote.stats import RemoteStatistics

logger = logging.getLogger("tierkv.remote")


class RemoteIO:
    """The write-behind thread over a remote tier; see the module docstring."""

    def __init__(self, tier: LowerTier, queue_bytes: int, batch: int = 16) -> None:
        for name, value in (("queue_bytes", queue_bytes), ("batch", batch)):
            check_int(f"remote io: {name}", value, low=1)
        self.tier = tier
        self.queue_bytes = queue_bytes
        self.batch = batch
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._queued_bytes = 0
        self._in_flight = 0
        self._closed = False
        self._counts = RemoteStatistics()  # pushes_* only (the tier counts its calls)
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
                self._counts.pushes_dropped += 1
                return False
            self._queue.append((bytes(key), bytes(memoryview(payload).cast("B"))))
            self._queued_bytes += size
            self._counts.pushes_queued += 1
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
            written = 0
            try:
                written = len(self.tier.put_many(items).written)
            except TierKVError as exc:  # the tier counted and logged it; a cache drops
                logger.debug("remote io: a batch of %d push(es) failed: %s", len(items), exc)
            except Exception:
                logger.exception("remote io: a batch of %d push(es) failed", len(items))
            with self._cond:
                counts = self._counts
                counts.pushes_pushed += written
                counts.pushes_failed += len(items) - written
                counts.pushes_bytes += written * self.tier.payload_bytes
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
        """Flush, then stop the thread, all within ``timeout`` seconds (None: flush all);
        idempotent."""
        if self._closed:
            return
        seconds = getattr(self.tier, "call_seconds", None)  # a batch's, if the tier says
        call = float(seconds(self.batch * self.tier.payload_bytes)) if seconds else 0.0
        ends = None if timeout is None else time.monotonic() + timeout
        if not self.flush(None if timeout is None else max(timeout - call, 0.0)):
            logger.warning("remote io: %d push(es) still queued at shutdown (remote.timeout_"
                           "seconds %.1f s per batch); dropped", len(self._queue), call)
        with self._cond:
            self._closed = True
            self._counts.pushes_abandoned += len(self._queue)
            self._queued_bytes -= sum(len(payload) for _, payload in self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(None if ends is None else max(ends - time.monotonic(), 0.0))

    def statistics(self) -> RemoteStatistics:
        with self._cond:
            return self._counts.snapshot(pushes_queue_bytes=self._queued_bytes)
