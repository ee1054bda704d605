"""The remote tier: chunk payloads of one namespace and rank on Redis / Valkey (Cluster).

Keys and values are :mod:`tierkv.tiers.remote_format` (``docs/remote.md``). Primitives and
contracts: those of :class:`~tierkv.tiers.base.LowerTier`, and:

- ``put_many(items, deletes)``: one pipeline (at most one round trip per node): the
  deletes, then ``SET NX`` of each value (``EX`` when ``remote.ttl_seconds``). A value
  another engine stored already is left as it is and counts as written (``already``).
- ``exists_many(keys)``: which keys have a value, in one pipeline of ``EXISTS``.
  ``exists_on_ranks(keys, ranks)``: which chunks have a value for every rank, in one
  pipeline of one ``EXISTS`` per chunk (its ranks share a hash slot): one round trip per
  node, for the scheduler side's lookups.
- ``read_into(key, out)``: one ``GET``; ``OK`` only for a value that passes every check;
  ``MISSING`` when it is gone (evicted, expired, deleted by another engine); ``CORRUPT``
  otherwise, and the value is deleted only if it is still the same bad value (a script
  compares before it deletes: another engine may have stored a good one meanwhile).
- ``scan()`` lists this namespace and rank's chunks on every primary (``SCAN MATCH``);
  ``verify(repair)`` reads each one.
- Every network failure (timeout, refused connection, a node gone) raises
  :class:`BrokenError` naming the tier, the address (never the password) and the setting;
  redis-py reconnects on the next call and follows ``MOVED``/``ASK`` during resharding.
  ``lazy=True`` connects on the first call instead of at construction (an engine starts
  while the server is down, and uses it once it is up).
- **Circuit breaker**: after ``remote.breaker_failures`` failed calls in a row, calls fail
  at once (:class:`BrokenError` saying so, no network) for ``remote.breaker_seconds``, with
  one warning; the first call after that probes the server, and a success closes it.
- ``sync`` is a no-op (durability is the server's); nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, PythonRespSerializer, SSLConnection
from redis.exceptions import RedisClusterException, RedisError

from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import BrokenError, ClosedError, ConfigError, short_key
from tierkv.keys import KEY_BYTES, Namespace
from tierkv.tiers.base import ChunkRecord, LowerTier, PutResult, ReadStatus, VerifyReport
from tierkv.tiers.malloc_tuning import tune_malloc
from tierkv.tiers.remote_format import check_value, pack_value, parse_redis_key, redis_key

logger = logging.getLogger("tierkv.remote")
_T = TypeVar("_T")
# Delete KEYS[1] only while it still holds ARGV[1] (the bad value that was read).
DELETE_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then " \
                  "return redis.call('DEL', KEYS[1]) end return 0"


class _ZeroCopy:
    """A connection that sends big values as they are. redis-py packs commands with
    hiredis when it is installed, and that copies every argument into one buffer: pipelined
    SETs of 2 MiB values ran at 0.47 GiB/s that way and at 1.12 GiB/s with redis-py's own
    packer, which hands values over the buffer cutoff to the socket untouched (measured on
    a loopback cluster; docs/benchmarks/remote.md). Replies are still parsed by hiredis."""

    _buffer_cutoff: int
    encoder: Any

    def _construct_command_packer(self, packer: Any) -> Any:
        return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class _Connection(_ZeroCopy, Connection):
    pass


class _SSLConnection(_ZeroCopy, SSLConnection):
    pass


def scrub(config: RemoteTierConfig, exc: BaseException) -> str:
    """The text of ``exc`` with the password (from the URL or the environment) masked."""
    text = str(exc)
    password = urlsplit(config.url).password or os.environ.get(config.password_env)
    return text.replace(password, "***") if password else text


def connect(config: RemoteTierConfig, name: str) -> tuple[Any, bool]:
    """A client of ``config.url`` and whether it is a cluster (detected; more seed nodes
    after commas make it one). A failure is a :class:`BrokenError` that starts with ``name``."""
    urls = [url.strip() for url in config.url.split(",") if url.strip()]
    options: dict[str, Any] = dict(
        socket_timeout=config.timeout_seconds, socket_connect_timeout=config.timeout_seconds,
        connection_class=_SSLConnection if urls[0].startswith("rediss://") else _Connection)
    if urlsplit(urls[0]).password is None and os.environ.get(config.password_env):
        options["password"] = os.environ[config.password_env]
    seeds = [ClusterNode(urlsplit(url).hostname or "127.0.0.1",  # type: ignore[no-untyped-call]
                         urlsplit(url).port or 6379) for url in urls[1:]]
    try:
        try:
            client: Any = RedisCluster.from_url(
                urls[0], **options, **({"startup_nodes": seeds} if seeds else {}))
            return client, True
        except RedisClusterException as exc:
            if "cluster mode is not enabled" not in str(exc).lower() or seeds:
                raise
        client = redis.Redis.from_url(urls[0], **options)
        client.ping()
        return client, False
    except (RedisError, RedisClusterException, OSError) as exc:
        raise BrokenError(f"{name}: cannot connect ({type(exc).__name__}: "
                          f"{scrub(config, exc)}); check remote.url and that the server "
                          f"runs") from None


def scan_names(client: Any, cluster: bool, pattern: bytes, batch: int) -> Iterator[bytes]:
    """Every key matching ``pattern``, from each primary of a cluster."""
    if not cluster:
        yield from client.scan_iter(match=pattern, count=batch)
        return
    for node in client.get_primaries():
        yield from client.scan_iter(match=pattern, count=batch, target_nodes=node)


@dataclass(frozen=True)
class RemoteStatistics:
    """Counters since open."""

    puts: int
    already: int  # values another engine had stored (SET NX left them)
    bytes_written: int
    reads: int
    hits: int
    misses: int
    corrupt: int
    errors: int  # calls that failed on the network
    skipped: int  # calls refused at once while the breaker was open
    breaker_opens: int
    cluster: bool


class RemoteTier(LowerTier):
    """One namespace and rank on a Redis server or cluster; see the module docstring."""

    write_lanes = 1
    transient_failures = True

    def __init__(self, config: RemoteTierConfig, namespace: Namespace, rank: int,
                 payload_bytes: int, clock: Callable[[], float] = time.monotonic,
                 *, lazy: bool = False) -> None:
        if not isinstance(config, RemoteTierConfig):
            raise ConfigError(f"remote tier: config must be a RemoteTierConfig, got {config!r}")
        for name, value, low in (("payload_bytes", payload_bytes, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"remote tier: {name} must be an int >= {low}, got {value!r}")
        if config.tune_malloc:  # a put's values and a read's reply: chunk-sized buffers
            tune_malloc(16 * payload_bytes)  # a push batch of 16 chunks
        self.config = config
        self.namespace = namespace
        self.rank = rank
        self.payload_bytes = payload_bytes
        self.read_only = False
        self.fingerprint = namespace.fingerprint()
        self.url = safe_url(config.url.split(",")[0])
        self._name = f"remote tier {self.url} (namespace {self.fingerprint[:8]}, rank {rank})"
        self._prefix = config.key_prefix.encode()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("puts", "already", "bytes_written", "reads", "hits",
                                      "misses", "corrupt", "errors", "skipped",
                                      "breaker_opens"), 0)
        self._clock = clock
        self._failures = 0  # consecutive failed calls
        self._open_until: float | None = None  # the breaker is open until then
        self._client: Any = None
        self._delete_if_same: Any = None
        self.cluster = False
        self._closed = False
        if not lazy:
            self._connect()

    def warm_up(self) -> bool:
        """Connect now if not yet (a lookup thread does it at start, so the first lookup
        does not pay for it); False, counted as a failed call, when the server is down."""
        try:
            self._run("connecting", lambda: None)
            return True
        except BrokenError:
            return False

    def _connect(self) -> Any:
        """The client, connected now if it was not (a failure is a BrokenError)."""
        with self._lock:
            if self._client is None:
                client, self.cluster = connect(self.config, self._name)
                self._delete_if_same = client.register_script(DELETE_IF_SAME)
                self._client = client
            return self._client

    # -- connection ------------------------------------------------------------------------

    def _scrub(self, exc: BaseException) -> str:
        return scrub(self.config, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self._name}: used after close(); open a new RemoteTier")

    def _run(self, action: str, work: Callable[[], _T], key: bytes | None = None) -> _T:
        self._check_open()
        what = action if key is None else f"{action} {short_key(key)}"
        with self._lock:
            skip = self._open_until is not None and self._clock() < self._open_until
            if skip:
                self._counts["skipped"] += 1
        if skip:
            raise BrokenError(f"{self._name}: {what} skipped: the circuit breaker is open after "
                              f"{self.config.breaker_failures} failed calls in a row "
                              f"(remote.breaker_failures); the server is probed again after "
                              f"remote.breaker_seconds ({self.config.breaker_seconds} s)")
        try:
            if self._client is None:
                self._connect()
            answer = work()
        except BrokenError:  # could not connect (the message says so)
            self._failed()
            raise
        except (RedisError, RedisClusterException, OSError) as exc:
            self._failed()
            raise BrokenError(f"{self._name}: {what} failed ({type(exc).__name__}: "
                              f"{self._scrub(exc)}); raise remote.timeout_seconds (now "
                              f"{self.config.timeout_seconds} s) if the server is slow") from None
        with self._lock:
            self._failures, self._open_until = 0, None
        return answer

    def _failed(self) -> None:
        with self._lock:
            self._counts["errors"] += 1
            self._failures += 1
            if self._failures < self.config.breaker_failures:
                return
            opened_now = self._open_until is None
            self._open_until = self._clock() + self.config.breaker_seconds
            if opened_now:
                self._counts["breaker_opens"] += 1
        if opened_now:
            logger.warning("%s: %d failed calls in a row; skipping the remote tier for %s s "
                           "(remote.breaker_seconds), then probing it again", self._name,
                           self.config.breaker_failures, self.config.breaker_seconds)

    def _pipeline(self) -> Any:
        return self._client.pipeline() if self.cluster else \
            self._client.pipeline(transaction=False)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _key(self, key: bytes) -> bytes:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ConfigError(f"{self._name}: a chunk key must be {KEY_BYTES} bytes, "
                              f"got {key!r:.40}")
        return redis_key(self._prefix, self.fingerprint, self.rank, bytes(key))

    # -- writes ----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, Any]],
                 deletes: Sequence[bytes] = ()) -> PutResult:
        self._check_open()
        values = []
        for key, payload in items:
            size = memoryview(payload).nbytes
            if size != self.payload_bytes:
                raise ConfigError(f"{self._name}: chunk {short_key(key)} has {size} bytes, "
                                  f"the tier stores {self.payload_bytes}")
            values.append((key, self._key(key),
                           pack_value(self.fingerprint, self.rank, bytes(key), payload)))
        drops = [self._key(key) for key in deletes]
        ttl = None if self.config.ttl_seconds is None else \
            max(1, int(round(self.config.ttl_seconds)))

        def work() -> list[Any]:
            pipe = self._pipeline()
            for name in drops:
                pipe.delete(name)
            for _, name, value in values:
                pipe.set(name, value, nx=True, ex=ttl)
            return list(pipe.execute())

        answers = self._run("writing chunks", work) if values or drops else []
        deleted = sum(int(answer or 0) for answer in answers[:len(drops)])
        stored = answers[len(drops):]
        already = sum(1 for answer in stored if not answer)
        written = tuple(key for key, _, _ in values)
        num_bytes = (len(values) - already) * self.payload_bytes
        self._count(puts=len(values) - already, already=already, bytes_written=num_bytes)
        return PutResult(written, (), deleted, num_bytes)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        names = [self._key(key) for key in keys]

        def work() -> int:
            pipe = self._pipeline()
            for name in names:
                pipe.delete(name)
            return sum(int(answer or 0) for answer in pipe.execute())

        return self._run("deleting chunks", work) if names else 0

    # -- reads -----------------------------------------------------------------------------

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has a value, in one pipeline (one round trip per node)."""
        self._check_open()
        names = [self._key(key) for key in keys]

        def work() -> list[bool]:
            pipe = self._pipeline()
            for name in names:
                pipe.exists(name)
            return [bool(answer) for answer in pipe.execute()]

        return self._run("looking up chunks", work) if names else []

    def exists_on_ranks(self, keys: Sequence[bytes], ranks: Sequence[int]) -> list[bool]:
        """Whether each chunk has a value for every rank in ``ranks``: one ``EXISTS`` of its
        ranks' keys per chunk (one hash slot: the hash tag), one pipeline."""
        self._check_open()
        for key in keys:
            self._key(key)  # checks the key
        names = [[redis_key(self._prefix, self.fingerprint, rank, bytes(key)) for rank in ranks]
                 for key in keys]

        def work() -> list[bool]:
            pipe = self._pipeline()
            for chunk in names:
                pipe.exists(*chunk)
            return [int(answer) == len(ranks) for answer in pipe.execute()]

        return self._run("looking up chunks", work) if names and ranks else [False] * len(keys)

    def read_into(self, key: bytes, out: Any) -> ReadStatus:
        name = self._key(key)
        view = memoryview(out).cast("B") if memoryview(out).format != "B" else memoryview(out)
        if view.readonly or len(view) < self.payload_bytes:
            raise ConfigError(f"{self._name}: the read buffer for chunk {short_key(key)} must "
                              f"be writable and hold {self.payload_bytes} bytes")
        value = self._run("reading chunk", lambda: self._client.get(name), key)
        if value is None:
            self._count(reads=1, misses=1)
            return ReadStatus.MISSING
        problem = check_value(self.fingerprint, self.rank, bytes(key), value,
                              self.payload_bytes, view)
        if problem is None:
            self._count(reads=1, hits=1)
            return ReadStatus.OK
        self._count(reads=1, misses=1, corrupt=1)
        deleted = self._run("deleting a bad chunk",
                            lambda: self._delete_if_same(keys=[name], args=[value]), key)
        logger.warning("%s: corrupt chunk %s (%s); %s", self._name, short_key(key), problem,
                       "deleted it" if deleted else "another value replaced it meanwhile")
        return ReadStatus.CORRUPT

    def _names(self, batch: int) -> Iterator[bytes]:
        pattern = b"%s%s:{*}:%d" % (self._prefix, self.fingerprint.encode(), self.rank)
        return scan_names(self._client, self.cluster, pattern, batch)

    def scan(self, batch: int = 1024) -> Iterator[ChunkRecord]:
        names = self._run("scanning", lambda: list(self._names(batch)))
        for name in names:
            parsed = parse_redis_key(self._prefix, name)
            if parsed is not None and parsed[:2] == (self.fingerprint, self.rank):
                yield ChunkRecord(parsed[2], self.payload_bytes, 0)

    def verify(self, repair: bool = False, batch: int = 64,
               progress: Callable[[int], None] | None = None) -> VerifyReport:
        bad: list[bytes] = []
        checked = 0
        scratch = memoryview(bytearray(self.payload_bytes))
        for record in list(self.scan(batch)):
            name = self._key(record.key)
            value = self._run("verifying", lambda: self._client.get(name), record.key)
            if value is None:
                continue  # gone meanwhile: nothing to judge
            checked += 1
            if progress is not None and checked % batch == 0:
                progress(checked)
            if check_value(self.fingerprint, self.rank, record.key, value, self.payload_bytes,
                           scratch) is not None:
                bad.append(record.key)
                if repair:
                    self._run("repairing", lambda: self._delete_if_same(keys=[name],
                                                                         args=[value]))
        return VerifyReport(checked, tuple(bad), len(bad) if repair else 0)

    # -- life cycle ------------------------------------------------------------------------

    def sync(self) -> None:
        """Nothing to do: what the server holds is as durable as its own settings make it."""

    def sync_if_due(self) -> bool:
        return False

    @property
    def sync_every_seconds(self) -> float | None:
        return None

    def statistics(self) -> RemoteStatistics:
        with self._lock:
            return RemoteStatistics(**self._counts, cluster=self.cluster)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._client is not None:
                self._client.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
