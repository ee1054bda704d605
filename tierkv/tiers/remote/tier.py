"""The remote tier: chunk payloads of one namespace and part on Redis / Valkey (Cluster).

Keys and values are :mod:`tierkv.tiers.remote.format` (``docs/remote.md``). Primitives and
contracts: those of :class:`~tierkv.tiers.base.LowerTier`, and:

- ``put_many(items, deletes)``: one pipeline per node: the deletes, then ``SET NX`` of
  each value (``EX`` when ``remote.ttl_seconds``). A value the server holds already is
  left as it is and counts as written (``already``). While a good share of the values
  pushed turn out held (:data:`HELD_SHARE_ASK`), a pipeline of ``EXISTS`` goes first and
  the held values are not sent. Values a full server refused are ``full`` and further
  pushes are skipped for ``remote.breaker_seconds``.
- ``exists_many(keys)``, ``exists_on_parts(keys, parts)`` (every part of each chunk: one
  ``EXISTS`` of its parts' keys, one hash slot), ``exists_under(keys, part_sets)`` (the
  same per candidate part count): one pipeline per node, for the scheduler's lookups.
- ``read_part_into(key, part, out)``: ``read_into`` of another part of the namespace (a
  reader at another tensor-parallel size reads the parts another engine wrote).
- ``read_into(key, out)``: one ``GETRANGE`` of at most a good value's length plus one
  byte, so a value of another length (256 MiB under a chunk's key) is bad before it is
  read; ``OK`` only for a value that passes every check; ``MISSING`` when it is gone
  (evicted, expired, deleted by another engine); ``CORRUPT`` otherwise, a key of another
  type (a list) included, and the bad value is deleted by what it was
  (:data:`~tierkv.tiers.remote.format.DELETE_BAD`, never by sending it back).
- ``scan()`` lists this namespace and part's chunks on every primary (``SCAN MATCH``, one
  deadline per page); ``verify(repair)`` reads each one through ``verify_chunk(key, part,
  repair)``: the read and checks of a load, uncounted, with what is wrong (the tools'
  ``tierkv verify URL`` reads every value through it too). A tier opened for a tool may be
  given the namespace's fingerprint alone (the tools know only the keys' names).
- **Deadlines.** Every call (a lookup, a read and the delete of what it found bad, a push
  batch, a delete, a scan page, ``each_primary``'s ``INFO``), the connect it may start included, ends within
  ``remote.timeout_seconds`` as a whole, plus its bytes at ``remote.min_mib_per_second``
  (``deadline_seconds``), whatever redis-py does inside
  (:func:`~tierkv.tiers.remote.client.deadline`). A call over several nodes sends each
  node's share at once under that one deadline (:mod:`~tierkv.tiers.remote.spread`): a
  node that fails or is skipped fails its own keys only (not written; absent), and the
  call raises only when every node's share failed: a :class:`RemoteError` (a
  :class:`BrokenError`) naming the tier, the address (never the password), the node,
  the cause and what to check.
- **Breakers** (:class:`~tierkv.tiers.remote.health.NodeHealth` says when they open, probe
  and log): one per node, one for the cluster as a whole. A node with an open breaker is
  skipped at once (no network); keys of healthy nodes go on being served.
  ``lazy=True`` connects on the first call instead of at construction (an engine starts
  while the server is down, and uses it once it is up). ``role`` ends the tier's name in
  messages (``lookups``; ``loads and pushes``): an engine has one tier per role.
- ``sync`` is the base's no-op (durability is the server's); nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import Any, TypeVar

from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from tierkv.checks import check_int
from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import BrokenError, ClosedError, UsageError, short_key
from tierkv.keys import KEY_BYTES, Namespace, Part, as_part
from tierkv.tiers.base import (ChunkCheck, ChunkRecord, LowerTier, PutResult, ReadStatus,
                               VerifyReport)
from tierkv.tiers.tuning import tune_malloc
from tierkv.tiers.remote.client import (DeadlinePassed, RemoteError, cause_of, connect,
                                        deadline, is_wrong_type, node_client, node_name,
                                        primaries, scan_names, scrub, seed_node, seed_urls)
from tierkv.tiers.remote.format import (DELETE_BAD, check_name, check_value, pack_value,
                                        parse_redis_key, redis_key, value_bytes)
from tierkv.tiers.remote.health import HINTS, TIER, WRITES, NodeHealth, who
from tierkv.tiers.remote.spread import Spread, by_node, served
from tierkv.tiers.remote.stats import RemoteStatistics
from tierkv.units import MiB

logger = logging.getLogger("tierkv.remote")
_T = TypeVar("_T")
_WRONG_TYPE = object()  # a read found a key of another type


# Pushes ask the server which values it holds before sending them while at least this share
# of the values pushed lately was held (a shared prefix many engines push, or one recomputed
# rather than loaded from a slow node): the round trip (a push of 16 chunks of 64 KiB ran
# 0.82x -> 0.62x redis-py's speed with it on every batch) is paid only where it saves whole
# values. A decayed share over batches, from half.
HELD_SHARE_ASK = 0.25
HELD_SHARE_WEIGHT = 0.25
HELD_SHARE_START = 0.5


class RemoteTier(LowerTier):
    """One namespace and part on a Redis server or cluster; see the module docstring."""

    medium = "remote"
    setting = "remote.url"
    write_lanes = 1
    transient_failures = True

    def __init__(self, config: RemoteTierConfig, namespace: Namespace | str, part: Part | int,
                 payload_bytes: int, clock: Callable[[], float] = time.monotonic,
                 *, lazy: bool = False, role: str = "") -> None:
        if not isinstance(config, RemoteTierConfig):
            raise UsageError(f"remote tier: config must be a RemoteTierConfig, got "
                              f"{type(config).__name__}")
        part = as_part(part)
        check_int("remote tier: payload_bytes", payload_bytes, low=1)
        if config.tune_malloc:  # a put's values and a read's reply: chunk-sized buffers
            tune_malloc(16 * payload_bytes)  # a push batch of 16 chunks
        self.config = config
        self.namespace = namespace
        self.part = part
        self.payload_bytes = payload_bytes
        self.read_only = False
        self.fingerprint = namespace if isinstance(namespace, str) else namespace.fingerprint()
        self.url = safe_url(config.url.split(",")[0])
        self._name = f"remote tier {self.url} (namespace {self.fingerprint[:8]}, part {part.name}" \
            f"{', ' + role if role else ''})"
        self._prefix = config.key_prefix.encode()
        self._value_bytes = value_bytes(payload_bytes)
        self._lock, self._connecting = threading.Lock(), threading.Lock()  # counters; connect
        self._counts = RemoteStatistics()
        self._causes: Counter[str] = Counter()
        self._bad: Counter[str] = Counter()
        self._held_share = HELD_SHARE_START  # decayed share of pushed values found held
        self._health = NodeHealth(self._name, config.breaker_failures, config.breaker_seconds,
                                  config.timeout_seconds + 0.5, clock, logger)
        self._client: Any = None
        self._spread = Spread("tierkv-remote-nodes")  # a call's nodes at once
        self._delete_bad: Any = None
        self._node: str | None = None  # a plain server's host:port
        self.cluster = False
        self._closed = False
        if not lazy:
            self._run("connecting", "connect", lambda: None)

    def deadline_seconds(self, num_bytes: int = 0) -> float:
        """The deadline of a call that moves ``num_bytes``: ``remote.timeout_seconds`` plus
        those bytes at ``remote.min_mib_per_second`` (a stall is still found within
        ``timeout_seconds``: each wait for bytes is bounded by it)."""
        return self.config.timeout_seconds + num_bytes / (self.config.min_mib_per_second * MiB)

    def call_seconds(self, num_bytes: int = 0) -> float:
        """The longest such a call takes: its deadline and a margin for Python's own work."""
        return self.deadline_seconds(num_bytes) + 0.1

    def warm_up(self) -> bool:
        """Connect now if not yet (engines do at start: the first lookup or load pays no
        discovery); False, counted as a failed call, when the server is down."""
        try:
            self._run("connecting", "connect", lambda: None)
            return True
        except BrokenError:
            return False

    def _connect(self, kind: str) -> Any:
        """The client, connected now if it was not (a failure is a RemoteError blaming the
        seeds that failed: a stalled seed costs one deadline, then its breaker leaves it
        out; none left, skipped at once). ``statistics()`` never waits on a connect."""
        with self._connecting:
            if self._client is None:
                seeds = [url for url in seed_urls(self.config)
                         if self._health.usable(seed_node(url))]
                if not seeds:
                    raise self._skip("connecting", seed_node(seed_urls(self.config)[0]),
                                     kind, 0)
                client, self.cluster = connect(self.config, self._name, min(max(  # a value
                    self._value_bytes, 1 << 16), 1 << 20), seeds)  # in a few socket reads
                self._delete_bad = client.register_script(DELETE_BAD)
                self._node = None if self.cluster else node_name(client, False, None)
                self._client = client
            return self._client

    # -- calls -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self._name}: used after close(); open a new RemoteTier")

    def _node_of(self, name: bytes) -> str:
        if not self.cluster:
            return self._node or TIER
        try:  # the slots' primaries as the client knows them (no lock: 4x as fast)
            return str(self._client.nodes_manager.slots_cache[key_slot(name)][0].name)
        except (KeyError, IndexError):
            return TIER

    def _skip(self, what: str, node: str, kind: str, chunks: int) -> RemoteError:
        self._health.skipped(node, kind, chunks)
        with self._lock:
            self._counts.calls_skipped += 1
        where, cause = self._health.blocked_cause(node)
        return RemoteError(f"{self._name}: {what} skipped: {who(where)} failed ({cause}) and its "
                           f"circuit breaker is open; it is probed again after "
                           f"remote.breaker_seconds ({self.config.breaker_seconds} s)",
                           cause or "error", where, skipped=True)

    def _run(self, action: str, kind: str, work: Callable[[], _T], key: bytes | None = None,
             node: str | None = None, chunks: int = 1, own_deadline: bool = True,
             refused: Callable[[_T], BaseException | None] | None = None,
             num_bytes: int = 0, tier_gate: bool = True) -> _T:
        """``work()`` as one call: skipped at once when the cluster's breaker (or
        ``node``'s) is open, under the deadline of a call that moves ``num_bytes`` (unless
        ``own_deadline`` is False: its parts keep their own), its failure counted, blamed
        on the node that failed and raised as a :class:`RemoteError`. ``refused(answer)``:
        an error the servers answered for part of it (the call counts as failed with its
        cause; the answer is returned). ``tier_gate`` False: the caller asked the cluster's
        breaker already."""
        self._check_open()
        what = action if key is None else f"{action} {short_key(key)}"
        for gate in (TIER if tier_gate else None, node):
            if gate is not None and not self._health.usable(gate):
                raise self._skip(what, gate, kind, chunks)
        with deadline(self.deadline_seconds(num_bytes)) if own_deadline else nullcontext() \
                as call:
            try:
                if self._client is None:
                    self._connect(kind)
                answer = work()
            except RemoteError as exc:  # could not connect: the seed nodes that failed are
                # blamed (a timeout or a refusal opens theirs at once), else the cluster
                if not exc.skipped:
                    self._failed(exc.cause, call)
                raise
            except (RedisError, RedisClusterException, OSError) as exc:
                cause = cause_of(exc)
                blamed = self._failed(cause, call, late=isinstance(exc, DeadlinePassed))
                raise RemoteError(
                    f"{self._name}: {what} failed: {cause}{f' on node {blamed}' if blamed else ''}"
                    f" ({type(exc).__name__}: {scrub(self.config, exc)}); {HINTS[cause]} "
                    f"(remote.timeout_seconds is {self.config.timeout_seconds} s)",
                    cause, blamed) from None
        problem = refused(answer) if refused is not None else None
        if problem is not None:
            self._failed(cause_of(problem), call)
            return answer
        if call is not None:
            self._health.answered(call.answered, whole=True)
        with self._lock:
            self._counts.calls_ok += 1
        return answer

    def _failed(self, cause: str, call: Any, late: bool = False) -> str | None:
        """Count a failed call and tell the breakers; the node blamed, if one. A call
        whose deadline had passed before it could start (``late``) blames no one."""
        with self._lock:
            self._counts.errors += 1
            self._causes[cause] += 1
        if call is not None:
            self._health.answered(call.answered - set(call.failed), whole=False)
            for node, node_cause in call.failed.items():
                self._health.failed(node, node_cause)
            if call.failed:
                return ", ".join(sorted(call.failed))
        if not late:
            self._health.failed(WRITES if cause == "out of memory" else TIER, cause)
        return None

    def _pipeline(self) -> Any:
        return self._client.pipeline() if self.cluster else \
            self._client.pipeline(transaction=False)

    def _key(self, key: bytes, part: Part | None = None) -> bytes:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise UsageError(f"{self._name}: a chunk key must be {KEY_BYTES} bytes, "
                              f"got {key!r:.40}")
        return redis_key(self._prefix, self.fingerprint, part or self.part, bytes(key))

    def _by_node(self, action: str, kind: str, names: Sequence[bytes],
                 work: Callable[[list[int]], _T], num_bytes: Callable[[list[int]], int] =
                 lambda group: 0, refused: Callable[[_T], BaseException | None] | None = None,
                 nodes: Callable[[], dict[str, list[int]]] | None = None
                 ) -> list[tuple[list[int], _T]]:
        """``work(positions)`` for each node's share of ``names``, all at once under one
        deadline (connecting, if needed, within it), each share a call of its own: skipped
        on its node's open breaker, failed, blamed and counted alone, so a stalled node
        fails its own keys only (:mod:`~tierkv.tiers.remote.spread`). The shares served,
        with what ``work`` returned; the first failure raised when none was. ``nodes()``
        (once connected) gives the shares instead of ``names``' nodes."""
        self._check_open()
        with deadline(self.deadline_seconds(num_bytes(list(range(len(names)))))):
            if self._client is None:
                self._run("connecting", kind, lambda: None)
            elif not self._health.usable(TIER):
                raise self._skip(action, TIER, kind, len(names))
            groups = nodes() if nodes is not None else \
                by_node(range(len(names)), lambda position: self._node_of(names[position]))
            outcomes = self._spread.run([functools.partial(
                self._run, action, kind, functools.partial(work, group), node=node,
                chunks=len(group), refused=refused, num_bytes=num_bytes(group), tier_gate=False)
                for node, group in groups.items()])
        return served(list(groups.values()), outcomes)

    def each_primary(self, action: str, work: Callable[[Any], _T]) -> dict[str, _T | None]:
        """``work(a node's client)`` on every primary, as :meth:`_by_node` runs its shares:
        by node, what it returned or None (failed, skipped); all failed: RemoteError."""
        pairs: list[tuple[str, Any]] = []

        def shares() -> dict[str, list[int]]:
            pairs[:] = [(node_name(self._client, self.cluster, node), node_client(
                self._client, node)) for node in primaries(self._client, self.cluster)]
            return {name: [position] for position, (name, _) in enumerate(pairs)}

        answered = {pairs[group[0]][0]: answer for group, answer in self._by_node(
            action, "lookup", (), lambda group: work(pairs[group[0]][1]), nodes=shares)}
        return {name: answered.get(name) for name, _ in pairs}

    # -- writes ----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, Any]],
                 deletes: Sequence[bytes] = ()) -> PutResult:
        self._check_open()
        names = []
        for key, payload in items:
            size = memoryview(payload).nbytes
            if size != self.payload_bytes:
                raise UsageError(f"{self._name}: chunk {short_key(key)} has {size} bytes, "
                                  f"the tier stores {self.payload_bytes}")
            names.append(self._key(key))
        drops = [self._key(key) for key in deletes]
        if not names and not drops:
            return PutResult(())
        if names and not self._health.usable(WRITES):
            raise self._skip("writing chunks", WRITES, "push", len(names))
        ttl = None if self.config.ttl_seconds is None else \
            max(1, int(round(self.config.ttl_seconds)))
        dropped = set(drops)
        ask_first = self._held_share >= HELD_SHARE_ASK
        count = len(names)  # positions from count on are the deletes

        def work(group: list[int]) -> tuple[set[int], list[Any], dict[int, Any]]:
            """(positions held already, the deletes' answers, each value's answer)"""
            writes = [position for position in group if position < count]
            gone = [drops[position - count] for position in group if position >= count]
            held: set[int] = set()
            # a key also in ``deletes`` is deleted first: what the server holds is no answer
            asked = [position for position in writes if names[position] not in dropped]
            if ask_first and asked:  # see HELD_SHARE_ASK
                pipe = self._pipeline()
                for position in asked:
                    pipe.exists(names[position])
                held = {position for position, answer in zip(asked, pipe.execute()) if answer}
            sent = [position for position in writes if position not in held]
            pipe = self._pipeline()
            for name in gone:
                pipe.delete(name)
            for position in sent:
                pipe.set(names[position], pack_value(
                    self.fingerprint, self.part, bytes(items[position][0]),
                    items[position][1]), nx=True, ex=ttl)
            answers = list(pipe.execute(raise_on_error=False)) if gone or sent else []
            for answer in answers:  # a refusal (out of memory) is an answer; others fail
                if isinstance(answer, Exception) and cause_of(answer) != "out of memory":
                    raise answer
            return held, answers[:len(gone)], dict(zip(sent, answers[len(gone):]))

        shares = self._by_node(
            "writing chunks", "push", names + drops, work,
            lambda group: sum(position < count for position in group) * self._value_bytes,
            refused=lambda got: next((answer for answer in (*got[1], *got[2].values())
                                      if isinstance(answer, Exception)), None))
        held: set[int] = set()
        answer_of: dict[int, Any] = {}
        stored: list[int] = []
        deleted = 0
        for group, (group_held, deleted_answers, answers) in shares:
            held |= group_held
            answer_of.update(answers)
            stored += [position for position in group if position < count]
            deleted += sum(int(answer or 0) for answer in deleted_answers
                           if not isinstance(answer, Exception))
        full = tuple(bytes(items[position][0]) for position in sorted(answer_of)
                     if isinstance(answer_of[position], Exception))
        written = tuple(bytes(items[position][0]) for position in sorted(stored)
                        if not isinstance(answer_of.get(position), Exception))
        already = len(held) + sum(1 for answer in answer_of.values() if answer is None)
        if stored:
            with self._lock:
                self._held_share += HELD_SHARE_WEIGHT * (already / len(stored) -
                                                         self._held_share)
        num_bytes = (len(written) - already) * self.payload_bytes
        with self._lock:
            counts = self._counts
            counts.puts += len(written) - already
            counts.already += already
            counts.bytes_written += num_bytes
        if full:
            return PutResult(written, full, deleted, num_bytes,
                             f"{self._name}: the server refused {len(full)} value(s): out of "
                             f"memory; {HINTS['out of memory']}")
        if answer_of:
            self._health.answered((WRITES,), whole=False)
        return PutResult(written, (), deleted, num_bytes)

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._check_open()
        names = [self._key(key) for key in keys]

        def work(group: list[int]) -> int:
            pipe = self._pipeline()
            for position in group:
                pipe.delete(names[position])
            return sum(int(answer or 0) for answer in pipe.execute())

        return sum(deleted for _, deleted in self._by_node("deleting chunks", "delete", names,
                                                           work)) if names else 0

    # -- reads -----------------------------------------------------------------------------

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has a value, in one pipeline (one round trip per node)."""
        return self.exists_on_parts(keys, [self.part])

    def exists_on_parts(self, keys: Sequence[bytes], parts: Sequence[Part]) -> list[bool]:
        """Whether each chunk has a value for every part in ``parts``: one ``EXISTS`` of its
        parts' keys per chunk (one hash slot: the hash tag), one pipeline. Chunks on a node
        whose breaker is open answer False (counted as skipped lookups)."""
        if not parts:
            self._check_open()
            return [False] * len(keys)
        return [found[0] for found in self.exists_under(keys, [parts])]

    def exists_under(self, keys: Sequence[bytes],
                     part_sets: Sequence[Sequence[Part]]) -> list[list[bool]]:
        """Per chunk, per set of parts in ``part_sets`` (one per candidate part count),
        whether every part of the set has a value: one ``EXISTS`` per chunk and set (a
        chunk's parts share a hash slot), all in one pipeline."""
        self._check_open()
        for key in keys:
            self._key(key)  # checks the key
        sets = [tuple(as_part(part) for part in parts) for parts in part_sets if parts]
        if not keys or not sets:
            return [[False] * len(part_sets) for _ in keys]
        names = [[[redis_key(self._prefix, self.fingerprint, part, bytes(key)) for part in parts]
                  for parts in sets] for key in keys]

        def work(group: list[int]) -> list[list[bool]]:
            pipe = self._pipeline()
            for position in group:
                for parts in names[position]:
                    pipe.exists(*parts)
            answers = iter(pipe.execute())
            return [[int(next(answers)) == len(parts) for parts in sets] for _ in group]

        found = {position: answer for group, answers in self._by_node(
            "looking up chunks", "lookup", [chunk[0][0] for chunk in names], work)
            for position, answer in zip(group, answers)}
        return [found.get(position, [False] * len(sets)) for position in range(len(keys))]

    def _get(self, name: bytes) -> Any:
        """At most a good value's length plus one byte of ``name``'s value; None when there
        is none, ``_WRONG_TYPE`` for a key of another type."""
        try:
            value = self._client.getrange(name, 0, self._value_bytes)
        except ResponseError as exc:
            if is_wrong_type(exc):
                return _WRONG_TYPE
            raise
        if not value and not self._client.exists(name):
            return None  # GETRANGE answers "" for a missing key and for an empty value
        return value

    def _judge(self, key: bytes, value: Any, out: memoryview,
               part: Part | None = None) -> tuple[str, str] | None:
        """None for a good value (its payload then in ``out``), else (check, what is wrong)."""
        if value is _WRONG_TYPE:
            return "type", "the key holds another type than a string"
        if len(value) != self._value_bytes:
            more = "more than " if len(value) > self._value_bytes else ""
            return "size", f"value of {more}{len(value)} bytes, a good one has " \
                           f"{self._value_bytes} (header and a payload of {self.payload_bytes})"
        problem = check_value(self.fingerprint, part or self.part, bytes(key), value,
                              self.payload_bytes, out)
        return None if problem is None else (check_name(problem), problem)

    def _read(self, key: bytes, out: memoryview, kind: str, delete: bool = True,
              part: Part | None = None) -> ChunkCheck:
        """Read, check and (``delete``) delete a bad value of ``key``, all within one
        deadline. Loads count in reads, hits, misses and the checks failed; verify's
        reads do not."""
        counted = kind == "load"
        name = self._key(key, part)
        with deadline(self.deadline_seconds(self._value_bytes)):
            node = self._node_of(name) if self._client is not None and \
                self._health.any_open() else None
            value = self._run("reading chunk", kind, lambda: self._get(name), key, node,
                              num_bytes=self._value_bytes)
            if value is None:
                with self._lock:
                    self._counts.reads += counted
                    self._counts.misses += counted
                return ChunkCheck(ReadStatus.MISSING)
            read = 0 if value is _WRONG_TYPE else len(value)
            with self._lock:
                self._counts.bytes_read += read
            verdict = self._judge(key, value, out, part)
            if verdict is None:
                with self._lock:
                    self._counts.reads += counted
                    self._counts.hits += counted
                return ChunkCheck(ReadStatus.OK, bytes_read=read)
            check, problem = verdict
            with self._lock:
                counts = self._counts
                counts.reads += counted
                counts.misses += counted
                counts.corrupt += counted
                self._bad[check] += counted
            if not delete:
                return ChunkCheck(ReadStatus.CORRUPT, problem, bytes_read=read)
            deleted = False
            digest = hashlib.sha1(value).hexdigest() if check in ("header", "checksum") else ""
            try:
                deleted = self._run("deleting a bad chunk", "delete", lambda: self._delete_bad(
                    keys=[name], args=[self._value_bytes, digest]), key, node)
                outcome = "deleted it" if deleted else "another value replaced it meanwhile"
            except BrokenError as exc:
                outcome = f"not deleted ({exc})"
        logger.warning("%s: corrupt chunk %s (%s); %s", self._name, short_key(key), problem,
                       outcome)
        return ChunkCheck(ReadStatus.CORRUPT, problem, bool(deleted), read)

    def _out_view(self, key: bytes, out: Any) -> memoryview:
        """``out`` as a flat writable byte view of at least ``payload_bytes`` (any element
        type or shape: a 2-D byte array's ``len`` is its rows)."""
        view = memoryview(out)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.readonly or len(view) < self.payload_bytes:
            raise UsageError(f"{self._name}: the read buffer for chunk {short_key(key)} must "
                              f"be writable and hold {self.payload_bytes} bytes")
        return view

    def read_into(self, key: bytes, out: Any) -> ReadStatus:
        return self._read(key, self._out_view(key, out), "load").status

    def read_part_into(self, key: bytes, part: Part, out: Any) -> ReadStatus:
        """``read_into`` of ``part`` of the chunk (another part of this tier's part count,
        whose values are this tier's ``payload_bytes``): the same checks, bound to that part."""
        return self._read(key, self._out_view(key, out), "load", part=as_part(part)).status

    def _names(self, batch: int) -> Iterator[bytes]:
        pattern = b"%s%s:{*}:%s" % (self._prefix, self.fingerprint.encode(),
                                    self.part.name.encode())
        return scan_names(self._client, self.cluster, pattern, batch, self.config.timeout_seconds)

    def scan(self, batch: int = 1024) -> Iterator[ChunkRecord]:
        names = self._run("scanning", "scan", lambda: list(self._names(batch)),
                          own_deadline=False)  # a deadline per SCAN page
        for name in names:
            parsed = parse_redis_key(self._prefix, name)
            if parsed is not None and parsed[:2] == (self.fingerprint, self.part):
                yield ChunkRecord(parsed[2], self.payload_bytes, 0)

    def verify(self, repair: bool = False, batch: int = 64,
               progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Read every chunk; ``repair`` deletes the bad ones."""
        bad: list[bytes] = []
        checked = 0
        scratch = memoryview(bytearray(self.payload_bytes))
        for record in list(self.scan(batch)):
            status = self.verify_chunk(record.key, repair=repair, out=scratch).status
            if status is ReadStatus.MISSING:
                continue  # gone meanwhile: nothing to judge
            checked += 1
            if progress is not None and checked % batch == 0:
                progress(checked)
            if status is ReadStatus.CORRUPT:
                bad.append(record.key)
        return VerifyReport(checked, tuple(bad), len(bad) if repair else 0)

    def verify_chunk(self, key: bytes, part: Part | None = None, repair: bool = False,
                     out: memoryview | None = None) -> ChunkCheck:
        """Read and check ``key``'s value (of ``part``, another part of this tier's count,
        if given) as a load does, within one deadline, uncounted in the loads' figures.
        ``repair`` deletes a bad value by what it was (``DELETE_BAD``); ``out``: where the
        payload goes."""
        scratch = memoryview(bytearray(self.payload_bytes)) if out is None else out
        return self._read(key, scratch, "verify", delete=repair,
                          part=None if part is None else as_part(part))

    # -- life cycle ------------------------------------------------------------------------

    def statistics(self) -> RemoteStatistics:
        with self._lock:
            return self._counts.snapshot(
                breaker_opens=self._health.opens, cluster=self.cluster,
                causes=tuple(sorted(self._causes.items())),
                bad_values=tuple(sorted(self._bad.items())),
                breakers=tuple(self._health.open_nodes().items()))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._spread.close()
            if self._client is not None:
                self._client.close()
