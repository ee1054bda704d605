"""The misuse guard of :class:`~tierkv.engine.store.TierKVStore`'s methods.

:func:`one_caller` wraps a method so that a call from a forked child of the process that
created the store, or a call that overlaps another one (two threads), raises
:class:`UsageError` before it changes anything: misuse fails loudly, it never serves wrong
KV. Why: docs/operations.md ("Fork", "Threads").
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from tierkv.errors import UsageError

__all__ = ["Guarded", "one_caller"]


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
