"""The remote tier's tools' view: what ``tierkv inspect URL``, ``tierkv verify [--repair] URL``
and ``tierkv rm URL`` find and change in a remote tier (Redis / Valkey, standalone or
Cluster). :mod:`tierkv.tools` hands them every store argument that starts with ``redis://``
or ``rediss://`` and prints (``tierkv ping URL`` is :mod:`tierkv.tiers.remote.ping`).

- :func:`inspect_remote` counts chunks and value bytes per namespace fingerprint and part
  (``0of2``; keys of tierkv format 4, one per rank, as ``rank <r>, format 4``: never read,
  ``tierkv rm`` deletes them) under ``--key-prefix`` (``SCAN`` on every primary, ``STRLEN`` in pipelines), and the keys
  of another type than a string (a list under a chunk's name); nothing is read or changed.
- :func:`verify_remote` checks every value (of the namespaces whose fingerprint starts with
  ``only``) against the fingerprint, part and key its Redis key names. Sizes are checked
  before values are read: ``STRLEN`` and the 80-byte header of each key (pipelined), a
  namespace's chunk size is the payload length most of its headers give, and a value of
  another length, or a key of another type, is bad unread. The values of the right size
  are read and checked by the tier itself (:meth:`RemoteTier.verify_chunk`, one tier per
  namespace and part count: the load's read and checks), never by a loop of the tool's
  own. ``repair`` deletes a bad value by what it was (its type, length or digest:
  ``DELETE_BAD``), never by sending it back. ``progress`` is called
  after each value (chunks and value bytes so far; the total is not known). Exit codes as
  for a disk store: 0 clean, 1 bad values found (also when repaired), 2 error.
- :func:`remove_remote` finds the one namespace whose fingerprint starts with a prefix
  (``SCAN`` by prefix on every primary), counts its keys and bytes and, with ``delete``,
  deletes them (``DEL`` in pipelines, whatever their type). A remote store has no claim:
  an engine running with that namespace keeps writing it, so stop it first.
- Every network operation runs under a deadline of ``--timeout`` seconds; a node that is
  down, stalled or refuses the password ends the command with one line (exit 2) naming the
  node, the cause and what to do (:class:`~tierkv.tiers.remote.client.RemoteError`).
- Long scans of inspect and rm print ``... N keys scanned`` to stderr every
  ``PROGRESS_EVERY`` keys; the password is never printed. ``--json`` prints one JSON
  document instead of the lines (inspect, verify, rm).
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import ConfigError
from tierkv.extras import needs
from tierkv.keys import FORMAT_VERSION, Part, parse_part
from tierkv.tiers.base import Progress, ReadStatus
from tierkv.tiers.remote.format import (DELETE_BAD, header_payload_bytes, read_header,
                                        parse_old_key, parse_redis_key, value_bytes)
from tierkv.tiers.remote.health import HINTS

PROGRESS_EVERY = 10_000
BATCH = 500  # keys per pipeline
_HEX = re.compile(r"[0-9a-f]*")
_T = TypeVar("_T")
WRONG_TYPE = "the key holds another type than a string"


def is_remote(store: str) -> bool:
    """Whether a store argument is a remote store's URL; one that looks like a mistyped URL
    (``redis//:pw@host``) is refused without showing what precedes its ``@``."""
    text = str(store)
    if text.startswith(("redis://", "rediss://")):
        return True
    if re.match(r"(?i)rediss?\b", text) and "@" in text:
        shown = "***@" + text.rsplit("@", 1)[1]
        raise ConfigError(f"{shown!r} looks like a remote store's URL but does not start with "
                          f"redis:// or rediss:// (its part before '@' is not shown: it may "
                          f"hold a password)")
    return False


def _client_module() -> Any:
    """:mod:`tierkv.tiers.remote.client` (redis-py: the 'remote' extra), on first use."""
    with needs("remote", "tierkv inspect / verify / rm / ping of a redis:// store"):
        from tierkv.tiers.remote import client as remote_client
    return remote_client


class Session:
    """One tool's connection: every operation under a deadline of ``--timeout``, a failure
    one :class:`RemoteError` line that names the node and what to do."""

    def __init__(self, config: RemoteTierConfig, changes: str = "nothing was changed") -> None:
        self.config = config
        self.where = safe_url(config.url)
        self.changes = changes  # what the failure line says of the store
        self.rc = _client_module()
        self.client, self.cluster = self.rc.connect(config, self.where)

    def run(self, what: str, work: Callable[[], _T]) -> _T:
        rc = self.rc
        from redis.exceptions import RedisClusterException, RedisError

        with rc.deadline(self.config.timeout_seconds) as call:
            try:
                return work()
            except (RedisError, RedisClusterException, OSError) as exc:
                cause = rc.cause_of(exc)
                nodes = sorted(call.failed) or [None]
                who = f"node {', '.join(nodes)}" if nodes != [None] else "the server"
                raise rc.RemoteError(
                    f"{self.where}: {what}: {who} failed: {cause} ({type(exc).__name__}: "
                    f"{rc.scrub(self.config, exc)}); {HINTS[cause]}; {self.changes}; rerun "
                    f"once every node answers (tierkv ping {self.where} shows them; a slow "
                    f"node: raise --timeout, now {self.config.timeout_seconds} s)", cause,
                    nodes[0]) from None

    def pipeline(self, what: str, names: list[bytes],
                 commands: Callable[[Any, bytes], None]) -> list[Any]:
        """``commands(pipe, name)`` for every name, in pipelines of :data:`BATCH` keys (a
        deadline each); answers in order, errors (WRONGTYPE) as values."""
        answers: list[Any] = []
        for first in range(0, len(names), BATCH):
            def batch(first: int = first) -> list[Any]:
                pipe = self.client.pipeline() if self.cluster else \
                    self.client.pipeline(transaction=False)
                for name in names[first : first + BATCH]:
                    commands(pipe, name)
                got = list(pipe.execute(raise_on_error=False))
                for answer in got:  # a node's failure fails the call; WRONGTYPE is an answer
                    if isinstance(answer, Exception) and not self.rc.is_wrong_type(answer):
                        raise answer
                return got

            answers += self.run(what, batch)
        return answers

    def close(self) -> None:
        self.client.close()


OLD_FORMAT = ", format 4"  # the label's end for a key of tierkv format 4 (one per rank)


def scan_entries(session: Session, only: str = "", report_every: int | None = PROGRESS_EVERY
                 ) -> list[tuple[bytes, str, str, bytes]]:
    """(redis key, fingerprint, part label, chunk key) of every tierkv key under the prefix
    whose fingerprint starts with ``only`` (a hex prefix also narrows the ``SCAN``
    pattern). The label is the part (``0of2``), or ``rank <r>, format 4`` for a key of
    tierkv format 4 (one value per rank), which this tierkv never reads."""
    prefix = session.config.key_prefix.encode()
    pattern = prefix + (only.encode() if _HEX.fullmatch(only) else b"") + b"*"
    out = []
    names = session.rc.scan_names(session.client, session.cluster, pattern, 1000,
                                  run=session.run)  # a SCAN page per deadline
    for seen, name in enumerate(names, 1):
        if report_every and seen % report_every == 0:
            print(f"  ... {seen} keys scanned", file=sys.stderr, flush=True)
        parsed = parse_redis_key(prefix, name)
        if parsed is not None and parsed[0].startswith(only):
            out.append((name, parsed[0], parsed[1].name, parsed[2]))
            continue
        old = parse_old_key(prefix, name)
        if old is not None and old[0].startswith(only):
            out.append((name, old[0], f"rank {old[1]}{OLD_FORMAT}", old[2]))
    return out


def _old_format_problem(url: str, fingerprint: str) -> str:
    return (f"a value of tierkv format 4 (one value per rank), which this tierkv (format "
            f"{FORMAT_VERSION}) never reads; delete its namespace: tierkv rm {url} "
            f"--namespace {fingerprint} --yes")


def _sizes(session: Session, names: list[bytes]) -> list[int | None]:
    """``STRLEN`` of every key (0: gone meanwhile; None: a key of another type)."""
    answers = session.pipeline("reading value sizes", names, lambda pipe, name: pipe.strlen(name))
    return [None if isinstance(size, Exception) else int(size) for size in answers]


@dataclass
class RemoteReport:
    chunks: Counter[tuple[str, str]] = field(default_factory=Counter)
    value_bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    wrong_type: Counter[tuple[str, str]] = field(default_factory=Counter)


def inspect_remote(config: RemoteTierConfig) -> RemoteReport:
    session = Session(config)
    report = RemoteReport()
    try:
        entries = scan_entries(session)
        sizes = _sizes(session, [name for name, _, _, _ in entries])
        for (_, fingerprint, rank, _), size in zip(entries, sizes):
            report.chunks[(fingerprint, rank)] += 1
            if size is None:
                report.wrong_type[(fingerprint, rank)] += 1
            else:
                report.value_bytes[(fingerprint, rank)] += size
    finally:
        session.close()
    return report


@dataclass
class RemoteVerify:
    checked: int = 0
    checked_bytes: int = 0  # value bytes read
    bad: list[tuple[str, str, bytes, str]] = field(default_factory=list)
    deleted: int = 0


def _chunk_sizes(entries: list[tuple[bytes, str, str, bytes]], sizes: list[int | None],
                 headers: list[Any]) -> dict[str, int]:
    """Per fingerprint and part count: the payload length most of its values' headers give
    and match."""
    votes: dict[str, Counter[int]] = {}
    for (_, fingerprint, label, _), size, header in zip(entries, sizes, headers):
        fingerprint = f"{fingerprint}/{label.partition('of')[2]}"
        length = header_payload_bytes(header)
        if length is not None and size == value_bytes(length):
            votes.setdefault(fingerprint, Counter())[length] += 1
    return {fingerprint: counts.most_common(1)[0][0] for fingerprint, counts in votes.items()}


def verify_remote(config: RemoteTierConfig, repair: bool = False, only: str | None = None,
                  progress: Progress | None = None) -> RemoteVerify:
    """Check every value (of the namespaces whose fingerprint starts with ``only``); see the
    module docstring."""
    session = Session(config)
    tiers = _Tiers(config)
    outcome = RemoteVerify()
    try:
        entries = scan_entries(session, only or "", report_every=None)
        names = [name for name, _, _, _ in entries]
        sizes = _sizes(session, names)
        headers = session.pipeline("reading headers", names,
                                   read_header)
        chunk = _chunk_sizes(entries, sizes, headers)
        delete_bad = session.client.register_script(DELETE_BAD) if repair else None
        for (name, fingerprint, label, key), size in zip(entries, sizes):
            if size == 0:
                continue  # gone meanwhile (evicted, expired, deleted)
            if label.endswith(OLD_FORMAT):  # never read, never repaired: tierkv rm
                outcome.checked += 1
                outcome.bad.append((fingerprint, label, key,
                                    _old_format_problem(safe_url(config.url), fingerprint)))
                continue
            part = parse_part(label)
            assert part is not None
            payload = chunk.get(f"{fingerprint}/{part.count}")
            good = None if payload is None else value_bytes(payload)
            problem: str | None = None
            repaired = False  # the tier read it, and deleted it if bad under repair
            if size is None:
                problem = WRONG_TYPE
            elif good is None:
                problem = "no value of this namespace has a readable header"
            elif size != good:
                problem = f"value of {size} bytes; this namespace's values have {good} " \
                          f"(a payload of {payload})"
            else:  # the right size: the tier reads and checks it (and repairs it)
                assert payload is not None
                check = tiers.of(fingerprint, part.count, payload).verify_chunk(
                    key, part, repair=repair)
                if check.status is ReadStatus.MISSING:
                    continue  # gone meanwhile
                outcome.checked_bytes += check.bytes_read
                problem, repaired = check.problem, True
                outcome.deleted += check.deleted
            outcome.checked += 1
            if progress is not None:
                progress(outcome.checked, outcome.checked_bytes, None)
            if problem is not None:
                outcome.bad.append((fingerprint, label, key, problem))
                if delete_bad is not None and not repaired:  # bad unread: by type or size
                    outcome.deleted += int(session.run(
                        "deleting a bad value",
                        lambda: delete_bad(keys=[name], args=[good or 0, ""])))
    finally:
        tiers.close()
        session.close()
    if only and not outcome.checked:
        raise ConfigError(f"no namespace in {safe_url(config.url)} (prefix "
                          f"{config.key_prefix!r}) starts with {only!r} (--namespace); tierkv "
                          f"inspect {safe_url(config.url)} lists them")
    return outcome


class _Tiers:
    """The tier of each (fingerprint, part count, payload length) :func:`verify_remote`
    reads through, opened at its first value, on the tool's settings (``--timeout``)."""

    def __init__(self, config: RemoteTierConfig) -> None:
        self.config = config
        self._open: dict[tuple[str, int, int], Any] = {}

    def of(self, fingerprint: str, count: int, payload: int) -> Any:
        found = self._open.get((fingerprint, count, payload))
        if found is None:
            with needs("remote", "tierkv verify of a redis:// store"):
                from tierkv.tiers.remote.tier import RemoteTier
            found = RemoteTier(self.config, fingerprint, Part(0, count), payload,
                               role="tierkv verify")
            self._open[(fingerprint, count, payload)] = found
        return found

    def close(self) -> None:
        for tier in self._open.values():
            tier.close()
        self._open.clear()


@dataclass
class RemoteRemoval:
    """The one namespace :func:`remove_remote` found, and what it deleted."""

    fingerprint: str
    chunks: Counter[str] = field(default_factory=Counter)  # per part label
    value_bytes: int = 0
    wrong_type: int = 0  # keys of another type (deleted with the rest)
    deleted: int = 0


def remove_remote(config: RemoteTierConfig, prefix: str, delete: bool = False) -> RemoteRemoval:
    """The namespace whose fingerprint starts with ``prefix`` (exactly one, else a
    :class:`ConfigError`) and its keys' count and bytes; ``delete``: delete them."""
    where = f"{safe_url(config.url)} (prefix {config.key_prefix!r})"
    if not prefix or not _HEX.fullmatch(prefix):
        raise ConfigError(f"--namespace {prefix!r} is not the start of a namespace "
                          f"fingerprint (hex digits); tierkv inspect {safe_url(config.url)} "
                          f"lists them")
    session = Session(config, "nothing was deleted")
    try:
        entries = scan_entries(session, prefix)
        found = sorted({fingerprint for _, fingerprint, _, _ in entries})
        if not found:
            raise ConfigError(f"no namespace in {where} starts with {prefix!r} "
                              f"(--namespace); nothing deleted; tierkv inspect "
                              f"{safe_url(config.url)} lists them")
        if len(found) > 1:
            raise ConfigError(f"{len(found)} namespaces in {where} start with {prefix!r}: "
                              f"{', '.join(found)}; nothing deleted; give a longer --namespace "
                              f"prefix")
        removal = RemoteRemoval(found[0])
        names = [name for name, _, _, _ in entries]
        removal.chunks.update(label for _, _, label, _ in entries)
        sizes = _sizes(session, names)
        removal.value_bytes = sum(size or 0 for size in sizes)
        removal.wrong_type = sum(size is None for size in sizes)
        if delete:
            for first in range(0, len(names), BATCH):
                session.changes = f"deleted {removal.deleted} of its {len(names)} keys " \
                                  f"before that (rerun tierkv rm to delete the rest)"
                # one key per DEL: a cluster's keys lie in many slots
                removal.deleted += sum(int(count) for count in session.pipeline(
                    "deleting keys", names[first : first + BATCH],
                    lambda pipe, name: pipe.delete(name)))
    finally:
        session.close()
    return removal
