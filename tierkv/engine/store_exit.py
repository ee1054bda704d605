"""A :class:`~tierkv.engine.store.TierKVStore`'s lifetime: who may call it, and what becomes
of one that is never closed.

:func:`one_caller` wraps a method so that a call from a forked child of the process that
created the store, or a call that overlaps another one (two threads), raises
:class:`UsageError` before it changes anything: misuse fails loudly, it never serves wrong
KV. Why: docs/operations.md ("Fork", "Threads").

A store writes its CPU tier to disk on eviction and on ``close()``; one that a program
forgets to close (a plain ``sys.exit``, an exception past the ``with``-less code) used to
lose its whole CPU tier without a word. Here:

- :func:`track` remembers an open store (weakly: tracking never keeps a store alive).
- At interpreter exit, :func:`close_at_exit` closes every store of this process still open
  (its CPU tier flushed to disk), logging each one, and waits at most
  :data:`EXIT_FLUSH_SECONDS` for all of them together; what is not on disk by then is
  lost, and the log says so.
- :func:`collected_unclosed` is the store's finalizer: a store garbage-collected without
  ``close()`` warns (:class:`ResourceWarning`, shown under ``-X dev``, and a log line) and
  is closed there, like an unclosed file.

A forked child never closes its parent's stores (their threads and LMDB environment are
the parent's). Why the lifetime is so: docs/engine-adapter.md ("A store's lifetime").
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from tierkv.errors import UsageError

__all__ = ["EXIT_FLUSH_SECONDS", "Guarded", "close_at_exit", "collected_unclosed", "one_caller",
           "track"]

log = logging.getLogger(__name__)

EXIT_FLUSH_SECONDS = 30.0  # how long interpreter exit waits for unclosed stores to flush


class Closable(Protocol):
    """What this module reads of a store: the pid that opened it, a name for the log, and
    ``close()``."""

    _pid: int

    def close(self) -> None: ...

    def _describe(self) -> str: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def track(store: Closable) -> None:
    """Close ``store`` at interpreter exit unless it is closed (or collected) first."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(close_at_exit)
            _registered = True
        _open.add(store)


def forget(store: Closable) -> None:
    """``store`` is closed: interpreter exit has nothing to do for it."""
    with _lock:
        _open.discard(store)


def close_at_exit(seconds: float = EXIT_FLUSH_SECONDS,
                  clock: Callable[[], float] = time.monotonic) -> list[str]:
    """Close every store this process opened and never closed, waiting at most ``seconds``
    for all of them; returns the descriptions of those it gave up on (still flushing)."""
    with _lock:
        stores = [store for store in list(_open) if store._pid == os.getpid()]
    deadline = clock() + seconds
    given_up: list[str] = []
    for store in stores:
        name = store._describe()
        log.warning("tierkv: interpreter exit: %s was never closed; flushing its CPU tier "
                    "to disk (at most %.0f s in all; call close() or use `with`)", name, seconds)
        if not _close_within(store, max(deadline - clock(), 0.0)):
            log.error("tierkv: interpreter exit: gave up on %s after %.0f s: the chunks of "
                      "its CPU tier not on disk yet are lost", name, seconds)
            given_up.append(name)
    return given_up


def _close_within(store: Closable, seconds: float) -> bool:
    """Close ``store`` in a daemon thread, waiting at most ``seconds``; True: it closed."""
    done = threading.Event()

    def close() -> None:
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - exit goes on; the log says what failed
            log.error("tierkv: interpreter exit: closing %s failed: %s", store._describe(), exc)
        finally:
            done.set()

    try:
        threading.Thread(target=close, name="tierkv-exit-flush", daemon=True).start()
    except RuntimeError:  # no new threads this late in shutdown: close here, unbounded
        close()
    return done.wait(seconds)


def collected_unclosed(store: Closable) -> None:
    """``store`` is being garbage-collected without ``close()``: warn, then close it (its
    CPU tier goes to disk). Never raises (a finalizer must not)."""
    if store._pid != os.getpid():
        return
    name = store._describe()
    try:
        warnings.warn(f"unclosed {name}: call close() or use `with`; closing it now",
                      ResourceWarning, stacklevel=2, source=store)
    except Exception:  # noqa: BLE001 - warnings turned into errors must not escape __del__
        pass
    log.warning("tierkv: %s was garbage-collected without close(); flushing its CPU tier "
                "to disk now (call close() or use `with`)", name)
    try:
        store.close()
    except Exception as exc:  # noqa: BLE001 - a finalizer never raises
        log.error("tierkv: closing the collected %s failed: %s", name, exc)


class Guarded(Protocol):
    """What :func:`one_caller` reads of the store: the pid that created it and the lock a
    call holds."""

    _pid: int
    _busy: threading.Lock


_S = TypeVar("_S", bound=Guarded)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_caller(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Refuse a call from a forked child, or one that overlaps another call (two threads):
    misuse fails loudly before it changes anything, it never serves wrong KV."""

    @functools.wraps(method)
    def guarded(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if os.getpid() != self._pid:
            raise UsageError(
                f"store: {method.__name__}() in a forked child (pid {os.getpid()}) of the "
                f"process that created the store (pid {self._pid}); its threads, LMDB "
                f"environment and CUDA streams do not survive fork(): create the store in "
                f"the child, or use the spawn start method")
        if not self._busy.acquire(blocking=False):
            raise UsageError(
                f"store: {method.__name__}() while another call is running (thread "
                f"{threading.current_thread().name}); the store is not thread-safe: call it "
                f"from one thread at a time, or give each thread its own store")
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return guarded
