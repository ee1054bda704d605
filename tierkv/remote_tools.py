"""``tierkv inspect URL`` and ``tierkv verify [--repair] URL`` over a remote tier (Redis /
Valkey, standalone or Cluster): ``tierkv.tools`` hands them every store argument that
starts with ``redis://`` or ``rediss://``.

- :func:`inspect_remote` counts chunks and value bytes per namespace fingerprint and rank
  under ``--key-prefix`` (``SCAN`` on every primary, ``STRLEN`` in pipelines); nothing is read
  or changed.
- :func:`verify_remote` reads every value and checks it against the fingerprint, rank and
  key its Redis key names (``tierkv.tiers.remote_format.check_value``); ``repair`` deletes a
  bad value only while it still holds the same bytes. Exit codes as for a disk store: 0
  clean, 1 bad values found (also when repaired), 2 error.
- Both print progress to stderr every ``PROGRESS_EVERY`` keys on long scans; the password is
  never printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tierkv.config import RemoteTierConfig, safe_url
from tierkv.extras import needs
from tierkv.tiers.remote_format import HEADER_BYTES, check_value, parse_redis_key
from tierkv.units import format_bytes

PROGRESS_EVERY = 10_000


def is_remote(store: str) -> bool:
    return str(store).startswith(("redis://", "rediss://"))


def _remote() -> Any:
    """:mod:`tierkv.tiers.remote` (redis-py: the 'remote' extra), imported on first use."""
    with needs("remote", "tierkv inspect / verify of a redis:// store"):
        from tierkv.tiers import remote
    return remote


def _entries(client: Any, cluster: bool, prefix: bytes,
             batch: int = 1000) -> Iterator[tuple[bytes, str, int, bytes]]:
    """(redis key, fingerprint, rank, chunk key) of every tierkv key under ``prefix``."""
    seen = 0
    for name in _remote().scan_names(client, cluster, prefix + b"*", batch):
        seen += 1
        if seen % PROGRESS_EVERY == 0:
            print(f"  ... {seen} keys scanned", file=sys.stderr, flush=True)
        parsed = parse_redis_key(prefix, name)
        if parsed is not None:
            yield (name, *parsed)


@dataclass
class RemoteReport:
    chunks: Counter[tuple[str, int]] = field(default_factory=Counter)
    value_bytes: Counter[tuple[str, int]] = field(default_factory=Counter)


def inspect_remote(config: RemoteTierConfig) -> RemoteReport:
    client, cluster = _remote().connect(config, f"tierkv inspect {safe_url(config.url)}")
    report = RemoteReport()
    try:
        entries = list(_entries(client, cluster, config.key_prefix.encode()))
        for first in range(0, len(entries), 500):
            group = entries[first : first + 500]
            pipe = client.pipeline() if cluster else client.pipeline(transaction=False)
            for name, _, _, _ in group:
                pipe.strlen(name)
            for (_, fingerprint, rank, _), size in zip(group, pipe.execute()):
                report.chunks[(fingerprint, rank)] += 1
                report.value_bytes[(fingerprint, rank)] += int(size)
    finally:
        client.close()
    return report


@dataclass
class RemoteVerify:
    checked: int = 0
    bad: list[tuple[str, int, bytes, str]] = field(default_factory=list)
    deleted: int = 0


def verify_remote(config: RemoteTierConfig, repair: bool = False) -> RemoteVerify:
    client, cluster = _remote().connect(config, f"tierkv verify {safe_url(config.url)}")
    outcome = RemoteVerify()
    delete_if_same = client.register_script(_remote().DELETE_IF_SAME)
    try:
        for name, fingerprint, rank, key in list(_entries(client, cluster,
                                                          config.key_prefix.encode())):
            value = client.get(name)
            if value is None:
                continue  # gone meanwhile (evicted, expired, deleted)
            outcome.checked += 1
            size = max(len(value) - HEADER_BYTES, 0)
            problem = check_value(fingerprint, rank, key, value, size,
                                  memoryview(bytearray(size)))
            if problem is not None:
                outcome.bad.append((fingerprint, rank, key, problem))
                if repair:
                    outcome.deleted += int(delete_if_same(keys=[name], args=[value]))
    finally:
        client.close()
    return outcome


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


def run_verify(args: argparse.Namespace) -> int:
    outcome = verify_remote(_config(args), repair=args.repair)
    for fingerprint, rank, key, problem in outcome.bad:
        print(f"  bad chunk namespace {fingerprint[:8]} rank {rank} {key.hex()}: {problem}")
    what = f"verified {outcome.checked} chunks in {safe_url(str(args.store))}"
    if not outcome.bad:
        print(f"{what}: clean")
        return 0
    tail = f"deleted {outcome.deleted}" if args.repair else "run with --repair to delete them"
    print(f"{what}: {len(outcome.bad)} bad, {tail}")
    return 1
