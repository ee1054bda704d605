"""One remote call's parts, one per node, run at once under the call's one deadline.

Primitives and contracts:

- :func:`by_node` ``(positions, node_of)``: ``positions`` grouped by the node that holds
  each (``node_of(position)``), in the order nodes first appear.
- :func:`served` ``(groups, outcomes)``: the groups whose part returned, with what it
  returned; when none did, the first :class:`RemoteError` (one not ``skipped`` first) is
  raised; another exception is raised at once.
- :class:`Spread` ``(name)``: ``run(parts)`` runs each of ``parts`` (callables) and returns
  what each returned or the exception it raised, in order: the first on the calling thread,
  the others at the same time on threads of the spread's own (named ``name``, made on
  first need, at most :data:`THREADS`), each under the calling thread's
  :func:`~tierkv.tiers.remote.client.deadline` (the same end: a part never outlives the
  call). One part runs inline, with no thread hand-off. ``close()`` stops the threads
  (a part in flight ends by its deadline).

Why (docs/remote.md, "Deadlines"): one pipeline over every node (redis-py's cluster
pipeline) fails as a whole when one node stalls, and the stalled node takes the whole
deadline, so a push batch or a lookup lost every node's keys to one stalled master. Node
by node in turn, a stalled node first would leave the others no time. At once, each node's
part ends within the same deadline and fails alone: its keys fail, the others' are served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from tierkv.tiers.remote.client import Call, RemoteError, current

_N = TypeVar("_N", bound=Hashable)
_T = TypeVar("_T")
THREADS = 16  # nodes served at once per tier; more nodes' parts wait for a thread


def by_node(positions: Iterable[int], node_of: Callable[[int], _N]) -> dict[_N, list[int]]:
    """``positions`` grouped by their node, nodes in the order they first appear."""
    groups: dict[_N, list[int]] = {}
    for position in positions:
        groups.setdefault(node_of(position), []).append(position)
    return groups


def served(groups: Sequence[list[int]],
           outcomes: Sequence[_T | BaseException]) -> list[tuple[list[int], _T]]:
    """See the module docstring."""
    shares: list[tuple[list[int], _T]] = []
    errors: list[RemoteError] = []
    for group, outcome in zip(groups, outcomes):
        if isinstance(outcome, RemoteError):
            errors.append(outcome)
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            shares.append((group, outcome))
    if errors and not shares:
        raise next((error for error in errors if not error.skipped), errors[0])
    return shares


class Spread:
    """See the module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def _threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: used after close()")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix=self.name)
            return self._pool

    @staticmethod
    def _within(until: float | None, part: Callable[[], _T]) -> _T | BaseException:
        try:
            if until is None:
                return part()
            with Call(until):
                return part()
        except Exception as exc:  # handed to the caller, in its part's place
            return exc

    def run(self, parts: Sequence[Callable[[], _T]]) -> list[_T | BaseException]:
        if not parts:
            return []
        call = current()
        until = None if call is None else call.until
        futures: list[Future[_T | BaseException]] = []
        if len(parts) > 1:
            pool = self._threads()
            futures = [pool.submit(self._within, until, part) for part in parts[1:]]
        first = self._within(None, parts[0])  # this thread keeps its own deadline
        return [first, *(future.result() for future in futures)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)  # idle threads end at once, a busy one by its deadline
