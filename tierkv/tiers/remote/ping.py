"""What ``tierkv ping URL`` finds: can engines use this remote tier, and is it set up as a
cache? (:mod:`tierkv.tools` prints it.)

:func:`ping_remote` connects as an engine would (the URL's password, else the one in
``$TIERKV_REMOTE_PASSWORD``; never printed) and reports, each operation under a deadline
of ``--timeout``:

- every node (primaries, and a cluster's replicas): whether it answers, its round trip
  (the median of three ``PING``), the slots it serves, its memory in use, ``maxmemory``
  and ``maxmemory-policy`` (``INFO memory``);
- the slots covered (a cluster's view; ``cluster_state`` where the ACL allows
  ``CLUSTER INFO``) and whether a password was sent and accepted;
- this prefix's chunks and value bytes (``SCAN`` and ``STRLEN`` on every primary that
  answers), and its namespaces;
- *problems*: a node that does not answer, slots not covered, a policy that does not suit
  a cache (``noeviction`` refuses writes once full; ``volatile-*`` never evicts tierkv's
  chunks, which have no TTL unless ``remote.ttl_seconds``; no ``maxmemory``).

Exit codes: 0 usable and set up as a cache, 1 usable or partly usable with problems
(listed), 2 cannot connect (a refused password included) or another error.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import TierKVError
from tierkv.tiers.remote.format import parse_redis_key
from tierkv.tiers.remote.health import HINTS
from tierkv.tiers.remote.tools import Session

SLOTS = 16384
CACHE_POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random")


@dataclass
class NodePing:
    node: str
    role: str  # "primary", "replica", "server"
    answers: bool = False
    latency_ms: float | None = None
    slots: int = 0
    used_memory: int | None = None
    maxmemory: int | None = None
    policy: str | None = None
    problem: str | None = None


@dataclass
class Ping:
    store: str
    prefix: str
    cluster: bool
    password: str  # "accepted" or "none sent"
    nodes: list[NodePing] = field(default_factory=list)
    slots_covered: int = 0
    cluster_state: str | None = None
    chunks: int = 0
    value_bytes: int = 0
    namespaces: int = 0
    not_counted: list[str] = field(default_factory=list)  # nodes whose chunks were not counted
    problems: list[str] = field(default_factory=list)


def _policy_problem(node: NodePing) -> str | None:
    if node.maxmemory == 0:
        return (f"node {node.node} has no maxmemory: it grows until the machine runs out of "
                f"memory; set maxmemory and maxmemory-policy allkeys-lru")
    if node.policy is None or node.policy in CACHE_POLICIES:
        return None
    if node.policy.startswith("volatile-"):
        return (f"node {node.node} has maxmemory-policy {node.policy}: it evicts only keys "
                f"with a TTL, and tierkv's chunks have none (unless remote.ttl_seconds), so "
                f"the server fills and then refuses writes; use allkeys-lru")
    return (f"node {node.node} has maxmemory-policy {node.policy}: a full server refuses "
            f"writes; use allkeys-lru")


def _field(info: Any, name: str) -> str | None:
    """``name``'s value in a ``CLUSTER INFO`` reply (text, or parsed into a dict)."""
    if isinstance(info, dict):
        value = info.get(name)
        return None if value is None else str(value)
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def _ping_node(session: Session, name: str, role: str, target: Any) -> NodePing:
    """One node's figures; a failure is the node's problem, not the command's."""
    ping = NodePing(name, role)
    try:
        rounds = []
        for _ in range(3):
            started = time.perf_counter()
            session.run(f"PING {name}", target.ping)
            rounds.append((time.perf_counter() - started) * 1e3)
        ping.answers, ping.latency_ms = True, round(statistics.median(rounds), 3)
        memory = session.run(f"INFO memory of {name}", lambda: session.rc.memory_of(target))
        ping.used_memory, ping.maxmemory, ping.policy = \
            memory.used, memory.maximum, memory.policy
    except session.rc.RemoteError as exc:
        ping.problem = f"{exc.cause}: {HINTS[exc.cause]}"
    return ping


def ping_remote(config: RemoteTierConfig) -> Ping:
    session = Session(config, "ping changes nothing")
    rc = session.rc
    client, cluster = session.client, session.cluster
    result = Ping(safe_url(config.url), config.key_prefix, cluster,
                  "accepted" if rc.password_of(config) else "none sent")
    try:
        if cluster:
            slots: dict[str, int] = {}
            for nodes in client.nodes_manager.slots_cache.values():
                slots[nodes[0].name] = slots.get(nodes[0].name, 0) + 1
            result.slots_covered = sum(slots.values())
            targets = [(node.name, "primary" if node.server_type == "primary" else "replica",
                        rc.node_client(client, node))
                       for node in client.get_nodes()]
        else:
            slots = {}
            result.slots_covered = SLOTS
            targets = [(rc.node_name(client, False, None), "server", client)]
        for name, role, target in sorted(targets, key=lambda item: item[0]):
            node = _ping_node(session, name, role, target)
            node.slots = slots.get(name, SLOTS if role == "server" else 0)
            result.nodes.append(node)
            if node.problem is None and cluster and result.cluster_state is None:
                try:
                    info = session.run("CLUSTER INFO", lambda: target.execute_command(
                        "CLUSTER", "INFO"))
                    result.cluster_state = _field(info, "cluster_state")
                except TierKVError:
                    pass  # an ACL without cluster|info: the slot count says enough
        _count_chunks(session, result)
    finally:
        session.close()
    for node in result.nodes:
        if node.problem is not None:
            result.problems.append(f"node {node.node} ({node.role}) does not answer: "
                                   f"{node.problem}")
        elif (problem := _policy_problem(node)) is not None:
            result.problems.append(problem)
    if result.slots_covered < SLOTS:
        result.problems.append(f"{SLOTS - result.slots_covered} of {SLOTS} slots are not "
                               f"covered: their chunks cannot be stored")
    if result.cluster_state not in (None, "ok"):
        result.problems.append(f"cluster_state is {result.cluster_state}: the nodes answer "
                               f"CLUSTERDOWN (a master is unreachable)")
    return result


def _count_chunks(session: Session, result: Ping) -> None:
    """This prefix's chunks and bytes on every primary that answers."""
    rc, prefix = session.rc, session.config.key_prefix.encode()
    answering = {node.node for node in result.nodes if node.problem is None}
    namespaces: set[str] = set()
    for primary in rc.primaries(session.client, session.cluster):
        name = rc.node_name(session.client, session.cluster, primary)
        if name not in answering:
            result.not_counted.append(name)
            continue
        keys = []
        cursor = 0
        while True:
            def page(cursor: int = cursor) -> tuple[int, list[bytes]]:
                if primary is None:
                    found, names = session.client.scan(cursor, match=prefix + b"*", count=1000)
                    return int(found), list(names)
                cursors, names = session.client.scan(cursor, match=prefix + b"*", count=1000,
                                                     target_nodes=primary)
                return int(cursors[primary.name]), list(names)

            cursor, names = session.run(f"scanning {name}", page)
            keys += [key for key in names if parse_redis_key(prefix, key) is not None]
            if not cursor:
                break
        sizes = session.pipeline(f"reading value sizes on {name}", keys,
                                 lambda pipe, key: pipe.strlen(key))
        result.chunks += len(keys)
        result.value_bytes += sum(size for size in sizes if isinstance(size, int))
        namespaces.update(parsed[0] for key in keys
                          if (parsed := parse_redis_key(prefix, key)) is not None)
    result.namespaces = len(namespaces)
