"""Health of a remote tier's nodes: a circuit breaker per node, and its log lines.

Primitives and contracts (thread-safe; time from the injected ``clock``):

- :data:`CAUSES`: why a remote call fails (``timeout``, ``auth refused``, ``cluster down``,
  ...; metric label values with underscores); :data:`HINTS`: what to check for each.
- A *node* is ``host:port``; :data:`TIER` (``"cluster"``) stands for failures no one node
  caused (the cluster says it is down, the password is refused, a connect failed with no
  seed node to blame: a seed that timed out or refused is blamed itself), and
  :data:`WRITES` for a server that refuses writes (out of memory): pushes only.
- ``usable(node) -> bool``: False while the node's breaker or the tier's is open; the
  caller skips the call (no network) and counts it with ``skipped(node, kind, chunks)``.
  Once ``breaker_seconds`` passed, one caller is let through as the probe (half open); the
  others still skip until it reports, or for at most ``probe_seconds``.
- ``failed(node, cause)``: a failed call. A node that timed out or refused the connection,
  the cluster down, a refused password, a server that refuses connections and a full
  server open the breaker at once (a stalled node costs one deadline, not one per call);
  other causes (a timeout no node is blamed for, a lost connection, an ACL refusal) open
  it after ``breaker_failures`` in a row.
- ``answered(nodes, whole)``: those nodes answered; their breakers close, and the tier's
  when the whole call succeeded.
- Log lines, once per change of state: a WARNING when a node (or the tier) starts failing,
  with the cause and what to check, when its breaker opens, and when the cause changes; a WARNING too when
  it answers again (an operator who saw the first sees the end), with the outage's length and the chunks skipped meanwhile (pushes,
  loads, lookups). Probes that fail the same way log nothing new.
- ``open_nodes()`` (per node: 1 open or probing, 0 closed; every node seen) for the
  breaker gauge; ``opens`` counts breakers opened.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Why a call failed (metric label values: spaces become underscores).
CAUSES = ("timeout", "connection refused", "connection lost", "auth refused", "no permission",
          "cluster down", "out of memory", "read only", "error")
HINTS = {
    "timeout": "no answer within remote.timeout_seconds: the node is stalled, overloaded or "
               "unreachable (raise remote.timeout_seconds only if it is merely slow)",
    "connection refused": "nothing listens there: check that the node runs",
    "connection lost": "the connection broke during the call: check the node and the network",
    "auth refused": "the server refused the password: check the URL's password or the "
                    "variable remote.password_env names (TIERKV_REMOTE_PASSWORD)",
    "no permission": "the server's ACL refuses a command or key: see docs/remote.md, Security",
    "cluster down": "the cluster says it is down (a master is unreachable): check CLUSTER INFO "
                    "on the nodes",
    "out of memory": "the server is full and refuses writes: give it maxmemory-policy "
                     "allkeys-lru (docs/remote.md, Setup)",
    "read only": "the node is a replica: give remote.url a master",
    "error": "see the message",
}


TIER = "cluster"
WRITES = "writes"  # the servers' refusal to store more (out of memory): pushes only
# Causes that open a breaker at once: a node stalled or dead; the cluster down, a refused
# password or a server that refuses connections (the cluster's); a full server (writes').
# Others open it after breaker_failures calls in a row (a lost connection, a timeout of no node).
AT_ONCE = {TIER: frozenset(("cluster down", "auth refused", "connection refused")),
           WRITES: frozenset(("out of memory",))}
NODE_AT_ONCE = frozenset(("timeout", "connection refused"))
_WHO = {TIER: "every node", WRITES: "writes"}


def who(node: str) -> str:
    """How log lines and messages name a node or :data:`TIER` / :data:`WRITES`."""
    return _WHO.get(node, f"node {node}")


@dataclass
class _State:
    failures: int = 0  # in a row
    cause: str | None = None  # of the outage in progress
    since: float | None = None  # when it began
    open_until: float | None = None
    probe_until: float | None = None  # a probe is in flight until then
    skipped: Counter[str] = field(default_factory=Counter)  # chunks, by kind, this outage


class NodeHealth:
    """See the module docstring."""

    def __init__(self, name: str, breaker_failures: int, breaker_seconds: float,
                 probe_seconds: float, clock: Callable[[], float],
                 logger: logging.Logger) -> None:
        import threading

        self.name = name  # the tier, as messages start
        self.breaker_failures = breaker_failures
        self.breaker_seconds = breaker_seconds
        self.probe_seconds = probe_seconds
        self._clock = clock
        self._log = logger
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {}
        self._troubled = 0  # states with a failure or an open breaker: 0 is the fast path
        self.opens = 0

    def _state(self, node: str) -> _State:
        state = self._states.get(node)
        if state is None:
            state = self._states[node] = _State()
        return state

    def _blocked(self, state: _State, now: float) -> bool:
        if state.open_until is None:
            return False
        if now < state.open_until:
            return True
        if state.probe_until is not None and now < state.probe_until:
            return True  # another caller probes
        state.probe_until = now + self.probe_seconds
        return False

    def usable(self, node: str) -> bool:
        if not self._troubled:
            return True
        with self._lock:
            now = self._clock()
            if node == TIER:
                tier = self._states.get(TIER)
                return tier is None or not self._blocked(tier, now)
            tier = self._states.get(TIER)
            if tier is not None and tier.open_until is not None and now < tier.open_until:
                return False
            state = self._states.get(node)
            return state is None or not self._blocked(state, now)

    def any_open(self) -> bool:
        """Whether some breaker is open or probing (calls must look at their nodes)."""
        if not self._troubled:
            return False
        with self._lock:
            return any(state.open_until is not None for state in self._states.values())

    def blocked_cause(self, node: str) -> tuple[str, str | None]:
        """(what is open: the node or :data:`TIER`, its cause) for a skip's message."""
        with self._lock:
            tier = self._states.get(TIER)
            if tier is not None and tier.open_until is not None:
                return TIER, tier.cause
            return node, self._state(node).cause

    def skipped(self, node: str, kind: str, chunks: int = 1) -> None:
        with self._lock:
            tier = self._states.get(TIER)
            state = tier if tier is not None and tier.open_until is not None else \
                self._state(node)
            state.skipped[kind] += chunks

    def failed(self, node: str, cause: str) -> None:
        with self._lock:
            state = self._state(node)
            now = self._clock()
            state.failures += 1
            state.probe_until = None
            starting = state.since is None
            changed = not starting and cause != state.cause
            if starting:
                state.since = now
                self._troubled += 1
            state.cause = cause
            at_once = cause in AT_ONCE.get(node, NODE_AT_ONCE)
            opening = state.open_until is None and (at_once or
                                                    state.failures >= self.breaker_failures)
            if state.open_until is not None or opening:
                state.open_until = now + self.breaker_seconds
            if opening:
                self.opens += 1
        if starting or changed or opening:
            then = (f"its calls are skipped for {self.breaker_seconds} s "
                    f"(remote.breaker_seconds), then it is probed" if state.open_until else
                    f"{state.failures} of remote.breaker_failures ({self.breaker_failures}) "
                    f"failed calls in a row")
            self._log.warning("%s: %s fails: %s: %s; %s", self.name, who(node), cause,
                              HINTS.get(cause, cause), then)

    def answered(self, nodes: Iterable[str], whole: bool) -> None:
        states = self._states
        if not self._troubled and all(node in states for node in nodes):
            return  # every node known and healthy: nothing changes (the common case)
        recovered: list[tuple[str, str | None, float, Counter[str]]] = []
        with self._lock:
            now = self._clock()
            for node in (*nodes, *((TIER,) if whole else ())):
                state = states.get(node)
                if state is None:
                    states[node] = _State()
                    continue
                if state.since is not None:
                    recovered.append((node, state.cause, now - state.since, state.skipped))
                    self._troubled -= 1
                states[node] = _State()
        for node, cause, seconds, skipped in recovered:
            parts = [f"{skipped[kind]} {plural}" for kind, plural in
                     (("push", "pushes"), ("load", "loads"), ("lookup", "lookups")) if skipped[kind]]
            self._log.warning("%s: %s answers again after %.1f s of failures (%s); skipped "
                              "meanwhile: %s", self.name, who(node), seconds, cause,
                           ", ".join(parts) or "nothing")

    def open_nodes(self) -> dict[str, int]:
        """Every node seen: 1 while its breaker is open or probing, else 0."""
        with self._lock:
            return {node: int(state.open_until is not None)
                    for node, state in sorted(self._states.items())}
