"""redis-py as the remote tier uses it: calls under a total deadline, failures by cause.

Primitives and contracts:

- :func:`deadline` ``(seconds)``: a context manager around one remote call. Every network
  operation redis-py makes in this thread meanwhile (connecting, the handshake, each
  command sent, each wait for a reply, its retries and topology refreshes included) gets at
  most what is left of the deadline, measured on ``time.monotonic``: the call as a whole
  ends within it, whatever redis-py does inside. Once it has passed, no new command or
  connection starts (:class:`DeadlinePassed`); bytes that already arrived are still read.
  Nested deadlines keep the earlier end. It yields a :class:`Call`: which nodes answered
  and which failed, and how (``timeout``, ``connection refused``, ``connection lost``),
  so a breaker can blame the node that failed, not the call's other nodes.
- :func:`connect` ``(config, name, seeds=None)``: a client of ``config.url`` (of its seed
  URLs :func:`seed_urls`, only ``seeds`` when given: the tier leaves out a seed whose breaker
  is open, named by :func:`seed_node`) and whether it is a cluster (detected; more seed
  nodes after commas make it one), with redis-py's own retries
  off (one attempt; the deadline bounds it) and its connections keeping deadlines. redis-py
  pauses 0.25 s and refreshes the topology on a ``CLUSTERDOWN`` reply to one command: that
  reply is turned into :class:`ClusterDown`, an error redis-py passes straight up.
- :func:`cause_of` ``(exc)``: one of :data:`~tierkv.tiers.remote.health.CAUSES`
  (``"timeout"``, ``"auth refused"``, ``"cluster down"``, ...); ``HINTS`` there says for
  each what to check.
- :func:`scrub` ``(config, text)``: the text with the password (from the URL or the
  environment) masked; :func:`scan_names` every key matching a pattern on every primary,
  one ``SCAN`` page per :func:`deadline` of ``page_seconds``; :func:`memory_of` a node's
  ``INFO memory`` (``tierkv ping``, the capacity gauges), through :func:`node_client`.

Why deadlines in the connections (docs/remote.md, "Deadlines"): redis-py's cluster client
retries, refreshes its view of the cluster after each timeout and pauses on ``CLUSTERDOWN``,
so one read of a chunk on a stalled master took 4-6 s with ``timeout_seconds`` 0.5. A
deadline that each socket operation honours bounds all of that on the calling thread, with
no thread hand-off per call (a hand-off measured up to +0.2 ms per EXISTS round trip and
+2-9 % per 2 MiB GET here) and no abandoned call still writing into a slot.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, PythonRespSerializer, SSLConnection
from redis.exceptions import (AuthenticationError, ClusterDownError, NoPermissionError,
                              OutOfMemoryError, ReadOnlyError, RedisClusterException,
                              RedisError, ResponseError, SlotNotCoveredError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from tierkv.config import RemoteTierConfig
from tierkv.errors import BrokenError
from tierkv.tiers.remote.health import HINTS

_local = threading.local()


class RemoteError(BrokenError):
    """A remote call failed (``skipped``: refused at once by an open breaker); ``cause`` is
    one of :data:`~tierkv.tiers.remote.health.CAUSES`, ``node`` the node blamed, if one."""

    def __init__(self, message: str, cause: str, node: str | None = None,
                 skipped: bool = False) -> None:
        super().__init__(message)
        self.cause, self.node, self.skipped = cause, node, skipped


class DeadlinePassed(RedisTimeoutError):
    """The call's deadline passed before this operation started (blames no node)."""


class ClusterDown(ResponseError):
    """A ``CLUSTERDOWN`` / ``MASTERDOWN`` reply, as an error redis-py does not retry."""


class Call:
    """One call's deadline (``until``, monotonic seconds) and what its connections saw; a
    context manager (:func:`deadline` makes one)."""

    __slots__ = ("until", "answered", "failed", "_outer")

    def __init__(self, until: float) -> None:
        self.until = until
        self.answered: set[str] = set()  # nodes ("host:port") that replied
        self.failed: dict[str, str] = {}  # node -> timeout, connection refused or lost
        self._outer: Call | None = None

    def left(self) -> float:
        return self.until - time.monotonic()

    def __enter__(self) -> Call:
        outer = self._outer = getattr(_local, "call", None)
        if outer is not None and outer.until < self.until:
            self.until = outer.until
        _local.call = self
        return self

    def __exit__(self, *exc: object) -> None:
        outer = _local.call = self._outer
        if outer is not None:
            outer.answered |= self.answered
            outer.failed.update(self.failed)


def current() -> Call | None:
    call: Call | None = getattr(_local, "call", None)
    return call


def deadline(seconds: float) -> Call:
    """See the module docstring (a class, not a generator: it runs once per chunk read)."""
    return Call(time.monotonic() + seconds)


def _node_cause(exc: BaseException) -> str:
    if isinstance(exc, (RedisTimeoutError, socket.timeout)):
        return "timeout"
    refused = isinstance(exc, ConnectionRefusedError) or "refused" in str(exc).lower()
    return "connection refused" if refused else "connection lost"


class _Deadlines:
    """Connection methods that keep the calling thread's :func:`deadline`; see there."""

    host: str
    port: int
    _sock: Any
    socket_timeout: float | None
    socket_connect_timeout: float | None
    _buffer_cutoff: int
    encoder: Any

    def _construct_command_packer(self, packer: Any) -> Any:
        """Big values go to the socket as they are. redis-py packs commands with hiredis
        when it is installed, and that copies every argument into one buffer: pipelined
        SETs of 2 MiB values ran at 0.47 GiB/s that way and at 1.12 GiB/s with redis-py's
        own packer, which hands values over the buffer cutoff to the socket untouched
        (docs/benchmarks/remote.md). Replies are still parsed by hiredis."""
        return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    def set_parser(self, parser_class: Any) -> None:
        super().set_parser(_deadline_parser(parser_class))  # type: ignore[misc]

    def _node(self) -> str:
        """``host:port``, as the cluster client names the node (made once)."""
        name: str | None = self.__dict__.get("_tierkv_node")
        if name is None:
            name = self.__dict__["_tierkv_node"] = f"{self.host}:{self.port}"
        return name

    def _note(self, call: Call | None, exc: BaseException) -> None:
        if call is not None and not isinstance(exc, (DeadlinePassed, AuthenticationError)):
            call.failed[self._node()] = _node_cause(exc)

    def _arm(self, call: Call) -> None:
        """Bound the socket's next waits by what is left, and by ``socket_timeout`` (a
        short poll once it passed: bytes already there are read, nothing is waited for).
        A timeout within 2 ms of the one set is left as it is: no system call per reply
        of a pipeline."""
        configured = self.socket_timeout
        left = call.until - time.monotonic()
        target = max(left if configured is None else min(left, configured), 1e-4)
        armed = self._sock.gettimeout()
        if armed is None or abs(armed - target) > 0.002:
            self._sock.settimeout(target)

    def _connect(self) -> Any:
        call = current()
        if call is None:
            return super()._connect()  # type: ignore[misc]
        left = call.left()
        if left <= 0:
            raise DeadlinePassed(f"the call's deadline passed before connecting to "
                                 f"{self.host}:{self.port}")
        saved = self.socket_connect_timeout
        self.socket_connect_timeout = left if saved is None else min(saved, left)
        try:
            return super()._connect()  # type: ignore[misc]
        except OSError as exc:
            self._note(call, exc)
            raise
        finally:
            self.socket_connect_timeout = saved

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        call = current()
        if call is not None:
            if call.left() <= 0:
                raise DeadlinePassed(f"the call's deadline passed before a command to "
                                     f"{self._node()}")
            if not self._sock:
                self.connect()  # type: ignore[attr-defined]
            self._arm(call)
            self.__dict__["_tierkv_call"] = call
        elif self._sock:
            self._sock.settimeout(self.socket_timeout)
        try:
            super().send_packed_command(command, check_health)  # type: ignore[misc]
        except (RedisTimeoutError, RedisConnectionError) as exc:
            self._note(call, exc)
            raise

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        call: Call | None = getattr(_local, "call", None)
        own = self.__dict__
        if call is not None and own.get("_tierkv_call") is not call and self._sock:
            self._arm(call)  # once per call: the parser's reads keep it as the deadline nears
            own["_tierkv_call"] = call
        try:
            response = super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (RedisTimeoutError, RedisConnectionError) as exc:
            self._note(call, exc)
            raise
        except ResponseError:
            if call is not None:
                call.answered.add(self._node())
            raise
        if call is not None:
            call.answered.add(self._node())
        return response


class _Connection(_Deadlines, Connection):
    pass


class _SSLConnection(_Deadlines, SSLConnection):
    pass


class _DeadlineParser:
    """A reply parser that turns ``CLUSTERDOWN`` into :class:`ClusterDown` and, past the
    deadline, waits for no more bytes (hiredis's reads; each other wait is bounded by what
    was left when the reply was first waited for)."""

    _sock: Any

    @classmethod
    def parse_error(cls, response: str) -> Exception:
        error: Exception = super().parse_error(response)  # type: ignore[misc]
        if isinstance(error, ClusterDownError):
            return ClusterDown(f"CLUSTERDOWN {error}")
        return error

    def read_from_socket(self, *args: Any, **kwargs: Any) -> Any:
        call: Call | None = getattr(_local, "call", None)
        sock = self._sock
        if call is not None and sock is not None and not args and not kwargs:
            left = call.until - time.monotonic()
            armed = sock.gettimeout()
            if armed is None or left < armed - 0.002:  # re-arm at most every 2 ms
                sock.settimeout(max(left, 1e-4))
        return super().read_from_socket(*args, **kwargs)  # type: ignore[misc]


@functools.lru_cache(maxsize=None)
def _deadline_parser(parser_class: type) -> type:
    if issubclass(parser_class, _DeadlineParser):
        return parser_class
    return type(f"Deadline{parser_class.__name__}", (_DeadlineParser, parser_class), {})


class _Cluster(RedisCluster):
    """redis-py's cluster client, but the ``COMMAND`` it sends while it is made (its
    commands table) goes to a node that answered the connect (``CLUSTER SLOTS``), not to
    the first slot's master, which may be the one stalled: a stalled master then failed
    every connect, so every chunk's load, the healthy masters' included."""

    def command(self, **kwargs: Any) -> Any:
        call = current()
        if call is not None and "target_nodes" not in kwargs:
            node = next((node for node in self.get_nodes()  # type: ignore[no-untyped-call]
                         if node.name in call.answered), None)
            if node is not None:
                self.set_default_node(node)  # type: ignore[no-untyped-call]
                kwargs["target_nodes"] = node
        return super().command(**kwargs)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current_exc: BaseException | None = exc
    while current_exc is not None and id(current_exc) not in seen:
        seen.add(id(current_exc))
        yield current_exc
        current_exc = current_exc.__cause__ or current_exc.__context__


def cause_of(exc: BaseException) -> str:
    """Why a call failed: one of :data:`~tierkv.tiers.remote.health.CAUSES`."""
    for error in _chain(exc):
        text = str(error)
        if isinstance(error, AuthenticationError) or text.startswith(("WRONGPASS", "NOAUTH")):
            return "auth refused"
        if isinstance(error, NoPermissionError):
            return "no permission"
        if isinstance(error, OutOfMemoryError):
            return "out of memory"
        if isinstance(error, (ClusterDown, ClusterDownError, SlotNotCoveredError)):
            return "cluster down"
        if isinstance(error, ReadOnlyError):
            return "read only"
        if isinstance(error, (RedisTimeoutError, socket.timeout)):
            return "timeout"
        if isinstance(error, (RedisConnectionError, ConnectionError)):
            return _node_cause(error)
    return "error"


def is_wrong_type(exc: BaseException) -> bool:
    """``exc`` says the key holds another type than a string (a list, a hash, ...)."""
    return isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")


def password_of(config: RemoteTierConfig) -> str | None:
    """The password tierkv sends: the URL's, else the one in ``config.password_env``."""
    for url in config.url.split(","):
        try:
            password = urlsplit(url.strip()).password
        except ValueError:
            continue
        if password:
            return password
    return os.environ.get(config.password_env) or None


def scrub(config: RemoteTierConfig, text: object) -> str:
    """``text`` with the password masked."""
    shown = str(text)
    password = password_of(config)
    return shown.replace(password, "***") if password else shown


NO_RETRY = Retry(NoBackoff(), 0)  # redis-py's own retries: none (the deadline bounds a call)


def seed_urls(config: RemoteTierConfig) -> list[str]:
    """The seed nodes' URLs of ``remote.url`` (comma separated)."""
    return [url.strip() for url in config.url.split(",") if url.strip()]


def seed_node(url: str) -> str:
    """``host:port`` of a seed URL, as its connections name the node (a bad port: the
    address as written; the connect then says what is wrong)."""
    parts = urlsplit(url)
    try:
        return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}"
    except ValueError:
        return parts.netloc.rpartition("@")[2]


def _at(url: str, seed: str) -> str:
    """``url`` (its scheme, user, password and options) pointed at ``seed``'s address."""
    parts, address = urlsplit(url), urlsplit(seed).netloc.rpartition("@")[2]
    user, at, _ = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}{at}{address}"))


def connect(config: RemoteTierConfig, name: str, read_bytes: int = 1 << 16,
            seeds: Sequence[str] | None = None) -> tuple[Any, bool]:
    """A client of ``config.url`` and whether it is a cluster. A failure is a
    :class:`RemoteError` that starts with ``name``, says why (:func:`cause_of`) and what
    to check; it never shows the password. Runs under a :func:`deadline` of
    ``timeout_seconds`` unless one is in force; the nodes that failed are in its
    :class:`Call`. ``seeds``: the seed URLs to ask (default: all); the first URL's scheme,
    credentials and options apply to each. ``read_bytes``: each connection's receive
    buffer (a 2 MiB reply: 32 reads of 64 KiB, or 2 of 1 MiB, which read 1.2-1.3x as
    fast here; docs/benchmarks/remote.md)."""
    configured = seed_urls(config)
    urls = [_at(configured[0], url) for url in (configured if seeds is None else seeds)]
    options: dict[str, Any] = dict(
        socket_timeout=config.timeout_seconds, socket_connect_timeout=config.timeout_seconds,
        socket_read_size=read_bytes,
        connection_class=_SSLConnection if urls[0].startswith("rediss://") else _Connection)
    if urlsplit(urls[0]).password is None and os.environ.get(config.password_env):
        options["password"] = os.environ[config.password_env]
    seeds_left = [ClusterNode(urlsplit(url).hostname or "127.0.0.1",  # type: ignore[no-untyped-call]
                              urlsplit(url).port or 6379) for url in urls[1:]]
    try:
        with deadline(config.timeout_seconds):
            try:
                client: Any = _Cluster.from_url(
                    urls[0], **options, retry=NO_RETRY,
                    **({"startup_nodes": seeds_left} if seeds_left else {}))
                return client, True
            except RedisClusterException as exc:
                if "cluster mode is not enabled" not in str(exc).lower() or \
                        len(configured) > 1:
                    raise
            client = redis.Redis.from_url(urls[0], **options, retry=NO_RETRY)
            client.ping()
            return client, False
    except (RedisError, RedisClusterException, OSError, ValueError) as exc:  # a bad URL too
        cause = cause_of(exc)
        raise RemoteError(f"{name}: cannot connect: {cause} ({type(exc).__name__}: "
                          f"{scrub(config, exc)}); {HINTS[cause]}; check remote.url and that "
                          f"the server runs", cause) from None


def primaries(client: Any, cluster: bool) -> list[Any]:
    """The cluster's primaries (None for a plain server: the client itself)."""
    return list(client.get_primaries()) if cluster else [None]


def node_client(client: Any, node: Any) -> Any:
    """A client of one node of a cluster (``client`` itself for a plain server's None)."""
    return client if node is None else (node.redis_connection or
                                        client.get_redis_connection(node))


@dataclass(frozen=True)
class NodeMemory:
    """A node's ``INFO memory``: bytes in use, ``maxmemory`` (0: none) and its policy."""

    used: int
    maximum: int
    policy: str | None


def memory_of(target: Any) -> NodeMemory:
    """``INFO memory`` of ``target`` (a node's client, :func:`node_client`), as redis-py
    parses it; under the caller's deadline."""
    memory = target.info("memory")
    return NodeMemory(int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0)),
                      str(memory.get("maxmemory_policy", "")) or None)


def node_name(client: Any, cluster: bool, node: Any) -> str:
    """``host:port`` of a primary :func:`primaries` gave."""
    if node is not None:
        return str(node.name)
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}"


def scan_names(client: Any, cluster: bool, pattern: bytes, batch: int,
               page_seconds: float | None = None,
               run: Callable[[str, Callable[[], Any]], Any] | None = None) -> Iterator[bytes]:
    """Every key matching ``pattern``, from each primary; each ``SCAN`` page is one call
    under a :func:`deadline` of ``page_seconds`` (None: the caller's), or run by ``run(what,
    call)`` (a tool's: its own deadline and failure line), as is the listing of primaries."""
    def timed(what: str, call: Callable[[], Any]) -> Any:
        with deadline(page_seconds) if page_seconds is not None else nullcontext():
            return call()

    run = run or timed
    for node in run("listing the primaries", lambda: primaries(client, cluster)):
        cursor = 0
        while True:
            def page(cursor: int = cursor, node: Any = node) -> tuple[int, list[bytes]]:
                if node is None:
                    found, names = client.scan(cursor, match=pattern, count=batch)
                    return int(found), list(names)
                # a cluster answers {node name: cursor}
                cursors, names = client.scan(cursor, match=pattern, count=batch,
                                             target_nodes=node)
                return int(cursors[node.name]), list(names)

            cursor, names = run(f"scanning {node_name(client, cluster, node)}", page)
            yield from names
            if not cursor:
                break
