"""``tierkv inspect URL``, ``tierkv verify [--repair] URL`` and ``tierkv rm URL`` over a
remote tier (Redis / Valkey, standalone or Cluster): ``tierkv.tools`` hands them every store
argument that starts with ``redis://`` or ``rediss://``.

- :func:`inspect_remote` counts chunks and value bytes per namespace fingerprint and rank
  under ``--key-prefix`` (``SCAN`` on every primary, ``STRLEN`` in pipelines); nothing is read
  or changed.
- :func:`verify_remote` reads every value as ``SCAN`` finds it and checks it against the
  fingerprint, rank and key its Redis key names (``tierkv.tiers.remote_format.check_value``);
  ``repair`` deletes a bad value only while it still holds the same bytes; ``progress`` is
  called after each value (chunks and value bytes so far; the total is not known). Exit
  codes as for a disk store: 0 clean, 1 bad values found (also when repaired), 2 error.
- :func:`remove_remote` finds the one namespace whose fingerprint starts with a prefix
  (``SCAN`` by prefix on every primary), counts its keys and bytes and, with ``delete``,
  deletes them (``DEL`` in pipelines). A remote store has no claim: an engine running with
  that namespace keeps writing it, so stop it first.
- Long scans of inspect and rm print ``... N keys scanned`` to stderr every
  ``PROGRESS_EVERY`` keys; the password is never printed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import ConfigError
from tierkv.extras import needs
from tierkv.tiers.remote_format import HEADER_BYTES, check_value, parse_redis_key
from tierkv.units import format_bytes

PROGRESS_EVERY = 10_000
# (chunks, bytes) so far and the total when known: what ``tierkv verify`` prints on stderr
Progress = Callable[[int, int, int | None], None]
_HEX = re.compile(r"[0-9a-f]*")


def is_remote(store: str) -> bool:
    return str(store).startswith(("redis://", "rediss://"))


def _remote() -> Any:
    """:mod:`tierkv.tiers.remote` (redis-py: the 'remote' extra), imported on first use."""
    with needs("remote", "tierkv inspect / verify / rm of a redis:// store"):
        from tierkv.tiers import remote
    return remote


def _entries(client: Any, cluster: bool, prefix: bytes, only: str = "", batch: int = 1000,
             report_every: int | None = PROGRESS_EVERY) -> Iterator[tuple[bytes, str, int, bytes]]:
    """(redis key, fingerprint, rank, chunk key) of every tierkv key under ``prefix`` whose
    fingerprint starts with ``only`` (a hex prefix also narrows the ``SCAN`` pattern)."""
    pattern = prefix + (only.encode() if _HEX.fullmatch(only) else b"") + b"*"
    seen = 0
    for name in _remote().scan_names(client, cluster, pattern, batch):
        seen += 1
        if report_every and seen % report_every == 0:
            print(f"  ... {seen} keys scanned", file=sys.stderr, flush=True)
        parsed = parse_redis_key(prefix, name)
        if parsed is not None and parsed[0].startswith(only):
            yield (name, *parsed)


def _sizes(client: Any, cluster: bool, names: list[bytes]) -> list[int]:
    """``STRLEN`` of every key, in pipelines of 500 (0: gone meanwhile)."""
    sizes: list[int] = []
    for first in range(0, len(names), 500):
        pipe = client.pipeline() if cluster else client.pipeline(transaction=False)
        for name in names[first : first + 500]:
            pipe.strlen(name)
        sizes += [int(size) for size in pipe.execute()]
    return sizes


@dataclass
class RemoteReport:
    chunks: Counter[tuple[str, int]] = field(default_factory=Counter)
    value_bytes: Counter[tuple[str, int]] = field(default_factory=Counter)


def inspect_remote(config: RemoteTierConfig) -> RemoteReport:
    client, cluster = _remote().connect(config, f"tierkv inspect {safe_url(config.url)}")
    report = RemoteReport()
    try:
        entries = list(_entries(client, cluster, config.key_prefix.encode()))
        sizes = _sizes(client, cluster, [name for name, _, _, _ in entries])
        for (_, fingerprint, rank, _), size in zip(entries, sizes):
            report.chunks[(fingerprint, rank)] += 1
            report.value_bytes[(fingerprint, rank)] += size
    finally:
        client.close()
    return report


@dataclass
class RemoteVerify:
    checked: int = 0
    checked_bytes: int = 0  # value bytes read
    bad: list[tuple[str, int, bytes, str]] = field(default_factory=list)
    deleted: int = 0


def verify_remote(config: RemoteTierConfig, repair: bool = False, only: str | None = None,
                  progress: Progress | None = None) -> RemoteVerify:
    """Check every value (of the namespaces whose fingerprint starts with ``only``); see the
    module docstring."""
    client, cluster = _remote().connect(config, f"tierkv verify {safe_url(config.url)}")
    outcome = RemoteVerify()
    delete_if_same = client.register_script(_remote().DELETE_IF_SAME)
    try:
        for name, fingerprint, rank, key in _entries(client, cluster, config.key_prefix.encode(),
                                                     only or "", report_every=None):
            value = client.get(name)
            if value is None:
                continue  # gone meanwhile (evicted, expired, deleted)
            outcome.checked += 1
            outcome.checked_bytes += len(value)
            if progress is not None:
                progress(outcome.checked, outcome.checked_bytes, None)
            size = max(len(value) - HEADER_BYTES, 0)
            problem = check_value(fingerprint, rank, key, value, size,
                                  memoryview(bytearray(size)))
            if problem is not None:
                outcome.bad.append((fingerprint, rank, key, problem))
                if repair:
                    outcome.deleted += int(delete_if_same(keys=[name], args=[value]))
    finally:
        client.close()
    if only and not outcome.checked:
        raise ConfigError(f"no namespace in {safe_url(config.url)} (prefix "
                          f"{config.key_prefix!r}) starts with {only!r} (--namespace); tierkv "
                          f"inspect {safe_url(config.url)} lists them")
    return outcome


@dataclass
class RemoteRemoval:
    """The one namespace :func:`remove_remote` found, and what it deleted."""

    fingerprint: str
    chunks: Counter[int] = field(default_factory=Counter)  # per rank
    value_bytes: int = 0
    deleted: int = 0


def remove_remote(config: RemoteTierConfig, prefix: str, delete: bool = False) -> RemoteRemoval:
    """The namespace whose fingerprint starts with ``prefix`` (exactly one, else a
    :class:`ConfigError`) and its keys' count and bytes; ``delete``: delete them."""
    where = f"{safe_url(config.url)} (prefix {config.key_prefix!r})"
    if not prefix or not _HEX.fullmatch(prefix):
        raise ConfigError(f"--namespace {prefix!r} is not the start of a namespace "
                          f"fingerprint (hex digits); tierkv inspect {safe_url(config.url)} "
                          f"lists them")
    client, cluster = _remote().connect(config, f"tierkv rm {safe_url(config.url)}")
    try:
        entries = list(_entries(client, cluster, config.key_prefix.encode(), prefix))
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
        removal.chunks.update(rank for _, _, rank, _ in entries)
        removal.value_bytes = sum(_sizes(client, cluster, names))
        if delete:
            for first in range(0, len(names), 500):
                pipe = client.pipeline() if cluster else client.pipeline(transaction=False)
                for name in names[first : first + 500]:
                    pipe.delete(name)  # one key per DEL: a cluster's keys lie in many slots
                removal.deleted += sum(int(count) for count in pipe.execute())
    finally:
        client.close()
    return removal


def _config(args: argparse.Namespace) -> RemoteTierConfig:
    return RemoteTierConfig(url=str(args.store), key_prefix=args.key_prefix,
                            timeout_seconds=args.timeout)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key-prefix", default="tierkv:",
                        help="remote store: the key prefix (remote.key_prefix)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="remote store: seconds per network operation")


def run_inspect(args: argparse.Namespace) -> int:
    report = inspect_remote(_config(args))
    if args.json:
        print(json.dumps([{"fingerprint": fingerprint, "rank": rank, "chunks": chunks,
                           "value_bytes": report.value_bytes[(fingerprint, rank)]}
                          for (fingerprint, rank), chunks in sorted(report.chunks.items())]))
        return 0
    print(f"remote store {safe_url(str(args.store))} (prefix {args.key_prefix!r}): "
          f"{len({fp for fp, _ in report.chunks})} namespace(s)")
    for (fingerprint, rank), chunks in sorted(report.chunks.items()):
        print(f"  namespace {fingerprint} rank {rank}: {chunks} chunks, "
              f"{format_bytes(report.value_bytes[(fingerprint, rank)], 2)}")
    total = sum(report.value_bytes.values())
    print(f"inspected {sum(report.chunks.values())} chunks ({format_bytes(total, 2)})")
    return 0


def run_verify(args: argparse.Namespace, progress: Progress | None = None) -> int:
    outcome = verify_remote(_config(args), repair=args.repair, only=args.namespace,
                            progress=progress)
    for fingerprint, rank, key, problem in outcome.bad:
        print(f"  bad chunk namespace {fingerprint[:8]} rank {rank} {key.hex()}: {problem}")
    what = f"verified {outcome.checked} chunks in {safe_url(str(args.store))}"
    if not outcome.bad:
        print(f"{what}: clean")
        return 0
    tail = f"deleted {outcome.deleted}" if args.repair else "run with --repair to delete them"
    print(f"{what}: {len(outcome.bad)} bad, {tail}")
    return 1


def run_rm(args: argparse.Namespace) -> int:
    """``tierkv rm URL --namespace PREFIX [--dry-run] [--yes]``: exit codes as for a disk store."""
    delete = args.yes and not args.dry_run
    removal = remove_remote(_config(args), args.namespace, delete=delete)
    ranks = ", ".join(f"rank {rank}: {count}" for rank, count in sorted(removal.chunks.items()))
    total = sum(removal.chunks.values())
    store = safe_url(str(args.store))
    print(f"namespace {removal.fingerprint} in {store} (prefix {args.key_prefix!r}): "
          f"{total} chunks ({ranks}), {format_bytes(removal.value_bytes, 2)}")
    if delete:
        print(f"removed namespace {removal.fingerprint[:8]} from {store}: {removal.deleted} "
              f"chunks, {format_bytes(removal.value_bytes, 2)} freed")
        return 0
    if args.dry_run:
        print(f"dry run: would delete {total} keys; nothing deleted")
        return 0
    print(f"not deleted: add --yes to delete its {total} keys")
    return 1
