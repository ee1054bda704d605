"""The operator commands over a store, whichever tier holds it: ``tierkv inspect``,
``tierkv verify``, ``tierkv rm`` (a store root, ``disk.path``, or a remote store's
``redis://`` / ``rediss://`` URL) and ``tierkv ping URL`` (``docs/warmup.md`` and
``docs/remote.md`` show their output).

This module parses the arguments and prints; what each command finds and changes is the
tier's own tools' view, which reaches the bytes only through the tier:
:mod:`tierkv.tiers.disk.tools` (:func:`inspect_store`, :func:`verify_store`,
:func:`remove_namespace`), :mod:`tierkv.tiers.remote.tools` (:func:`inspect_remote`,
:func:`verify_remote`, :func:`remove_remote`) and :mod:`tierkv.tiers.remote.ping`.

- Exit codes of ``tierkv verify``: 0 clean, 1 bad chunks or damaged environments found
  (also when ``--repair`` fixed them: a rerun then answers 0), 2 error. ``tierkv rm``: 0
  deleted (or ``--dry-run``), 1 not deleted (``--yes`` missing), 2 refused or error.
  ``tierkv ping``: 0 usable and set up as a cache, 1 usable with problems, 2 cannot connect.
- Long checks print progress on stderr (:class:`ProgressLine`), at most once per
  ``PROGRESS_SECONDS``; ``--json`` prints one JSON document instead of the lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import TierKVError
from tierkv.keys import FORMAT_VERSION
from tierkv.tiers.base import Progress
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.tier import SHARDS, written_at
from tierkv.tiers.disk.tools import inspect_store, remove_namespace, repair_plan, utc, verify_store
from tierkv.tiers.remote.ping import SLOTS, ping_remote
from tierkv.tiers.remote.tools import (OLD_FORMAT, inspect_remote, is_remote, remove_remote,
                                       verify_remote)
from tierkv.units import format_bytes, format_rate

PROGRESS_SECONDS = 1.0  # at most one progress line per second


class ProgressLine:
    """Progress of a long check on ``stream`` (stderr): :meth:`update` is the ``progress``
    callback of :func:`verify_store` and :func:`verify_remote`, and prints
    ``verify: 12,345 / 50,000 chunks, 1.2 GiB, 850.00 MiB/s`` at most once per ``interval``
    seconds (None: never); :meth:`summary` is the closing line."""

    def __init__(self, what: str, interval: float | None = PROGRESS_SECONDS,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.interval = interval
        self.stream = sys.stderr if stream is None else stream
        self._clock = clock
        self.started = self._last = clock()
        self.chunks, self.num_bytes = 0, 0
        self._shown = -1  # the chunk count of the last line (no line twice for one count)

    def update(self, chunks: int, num_bytes: int, total: int | None = None) -> None:
        self.chunks, self.num_bytes = chunks, num_bytes
        now = self._clock()
        if self.interval is None or now - self._last < self.interval or chunks == self._shown:
            return
        self._last, self._shown = now, chunks
        of = "" if total is None else f" / {total:,}"
        print(f"{self.what}: {chunks:,}{of} chunks, {format_bytes(num_bytes, 1)}, "
              f"{format_rate(num_bytes, now - self.started)}", file=self.stream, flush=True)

    def summary(self) -> str:
        seconds = self._clock() - self.started
        return (f"{self.what}: checked {self.chunks:,} chunks, {format_bytes(self.num_bytes, 2)} "
                f"in {seconds:.1f} s ({format_rate(self.num_bytes, seconds)})")


# ------------------------------------------------------------------------------ CLI
def add_store_argument(parser: argparse.ArgumentParser) -> None:
    """The store a command works on: inspect, verify and rm take either tier's."""
    parser.add_argument("store", help="store root (the disk tier's disk.path / disk_path), or "
                                      "a remote store's redis:// or rediss:// URL")


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    add_remote_arguments(parser)


def run_inspect(args: argparse.Namespace) -> int:
    if is_remote(args.store):
        return _run_inspect_remote(args)
    args.store = Path(args.store)
    reports = inspect_store(args.store)
    chunks = sum(rank.chunks for report in reports for rank in report.ranks)
    payload = sum(rank.payload_bytes for report in reports for rank in report.ranks)
    if args.json:
        print(json.dumps([asdict(report) for report in reports], default=str, indent=1))
        return 0
    print(f"store {args.store}: {len(reports)} namespace(s)")
    for report in reports:
        desc = report.description
        print(f"namespace {report.fingerprint} (format version {report.format_version})"
              + (f"  PROBLEM: {report.problem}" if report.problem else ""))
        if report.format_version is not None and report.format_version != FORMAT_VERSION:
            print(f"  another tierkv format: this tierkv (format {FORMAT_VERSION}) never reads "
                  f"it; delete it when no older tierkv uses it: tierkv rm {args.store} "
                  f"--namespace {report.fingerprint} --yes")
        for name in ("model_id", "model_fingerprint", "dtype", "kv_layout", "page_bytes",
                     "tokens_per_chunk", "blocks_per_chunk", "num_layers", "num_kv_heads",
                     "tp_size", "rank_layout", "hash_scheme", "extra"):
            if name in desc:
                print(f"  {name + ':':18s} {desc[name]}" if len(name) >= 17 else
                      f"  {name + ':':18s}{desc[name]}")
        names = desc.get("layer_names")
        if isinstance(names, list) and names:
            shown = ", ".join(map(str, names[:2])) + (f", ... {names[-1]}" if len(names) > 2 else "")
            print(f"  {'layer_names:':18s}{len(names)}: {shown}")
        for rank in report.ranks:
            if rank.problem:
                print(f"  {rank.label}: DAMAGED: {rank.problem}")
                continue
            for shard, why in sorted(rank.damaged_shards.items()):
                print(f"  {rank.label}: DAMAGED {StoreLayout.shard_name(shard)}: {why}; "
                      f"{repair_plan(shard)}")
            ends = ""
            if rank.oldest and rank.newest:
                ends = ", ".join(["", *(f"{what} {key[:8]} (written {utc(written_at(seq))})"
                                        for what, (key, seq) in (("oldest", rank.oldest),
                                                                 ("newest", rank.newest)))])
            shards = "" if not rank.damaged_shards else " in shards " + ", ".join(
                str(shard) for shard in range(SHARDS) if shard not in rank.damaged_shards)
            print(f"  {rank.label}: {rank.chunks} chunks{shards}, "
                  f"{format_bytes(rank.payload_bytes, 2)}"
                  f" (file {format_bytes(rank.file_bytes, 2)}){ends}, last write {rank.last_write}")
        for name in report.broken:
            print(f"  moved aside: {name}")
    print(f"inspected {len(reports)} namespace(s): {chunks} chunks ({format_bytes(payload, 2)}) "
          f"in {args.store}")
    return 0


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    add_remote_arguments(parser)
    parser.add_argument("--repair", action="store_true",
                        help="delete bad chunks; move damaged environments aside")
    parser.add_argument("--namespace", metavar="PREFIX",
                        help="only namespaces whose fingerprint starts with PREFIX")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines on stderr while it runs (the result and the "
                             "closing speed line are still printed)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of the result lines (exit "
                             "codes unchanged)")


def run_verify(args: argparse.Namespace) -> int:
    progress = ProgressLine("verify", None if args.no_progress else PROGRESS_SECONDS)
    if is_remote(args.store):
        code = _run_verify_remote(args, progress.update)
    else:
        code = _run_verify_disk(args, progress.update)
    print(progress.summary(), file=sys.stderr)
    return code


def _run_verify_disk(args: argparse.Namespace, progress: Progress) -> int:
    args.store = Path(args.store)
    started = time.perf_counter()
    outcome = verify_store(args.store, repair=args.repair, only=args.namespace,
                           progress=progress)
    if args.json:
        print(json.dumps({"store": str(args.store), **asdict(outcome), "clean": outcome.clean,
                          "repair": args.repair}))
        return 0 if outcome.clean else 1
    for line in outcome.lines:
        print(line)
    seconds = time.perf_counter() - started
    what = f"verified {outcome.checked} chunks in {outcome.namespaces} namespace(s)"
    if outcome.clean:
        print(f"{what}: clean ({seconds:.1f} s)")
        return 0
    parts = [f"{outcome.bad} bad"]
    if outcome.damaged:
        parts.append(f"{outcome.damaged} damaged environment(s)")
    parts.append(f"deleted {outcome.deleted}, moved aside {outcome.moved_aside}" if args.repair
                 else "run with --repair to delete them" + (
                     " and move the damaged environments aside (their chunks are lost, the "
                     "rest are kept)" if outcome.damaged else ""))
    print(f"{what}: {', '.join(parts)} ({seconds:.1f} s)")
    return 1


def add_rm_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_argument(parser)
    parser.add_argument("--namespace", metavar="PREFIX", required=True,
                        help="the namespace to delete: its fingerprint or a prefix of it that "
                             "no other namespace starts with (tierkv inspect lists them)")
    parser.add_argument("--dry-run", action="store_true",
                        help="only print what would be deleted")
    parser.add_argument("--yes", action="store_true",
                        help="delete it; without --yes only what would be deleted is printed")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of the result lines (exit "
                             "codes unchanged)")
    add_remote_arguments(parser)


def run_rm(args: argparse.Namespace) -> int:
    if is_remote(args.store):
        return _run_rm_remote(args)
    args.store = Path(args.store)
    delete = args.yes and not args.dry_run
    removal = remove_namespace(args.store, args.namespace, delete=delete)
    report = removal.report
    code = 0 if removal.deleted or args.dry_run else 1
    if args.json:
        print(json.dumps({"store": str(args.store), "fingerprint": report.fingerprint,
                          "path": str(report.path), "description": report.description,
                          "format_version": report.format_version, "parts": len(report.ranks),
                          "chunks": removal.chunks, "unread": removal.unread,
                          "moved_aside": report.broken, "file_bytes": removal.file_bytes,
                          "deleted": removal.deleted, "dry_run": bool(args.dry_run)},
                         default=str))
        return code
    model = report.description.get("model_id", "?")
    extra = [f"{len(report.broken)} moved-aside environment(s)"] if report.broken else []
    extra += [f"{removal.unread} environment(s) not readable, their chunks not counted"] \
        if removal.unread else []
    print(f"namespace {report.fingerprint} ({model}, format version {report.format_version}) in "
          f"{args.store}: {len(report.ranks)} part(s), {removal.chunks} chunks, "
          f"{format_bytes(removal.file_bytes, 2)} of files"
          + "".join(f", {part}" for part in extra))
    if removal.deleted:
        print(f"removed namespace {report.fingerprint[:8]} from {args.store}: {removal.chunks} "
              f"chunks, {format_bytes(removal.file_bytes, 2)} freed")
        return 0
    if args.dry_run:
        print(f"dry run: would delete {report.path}; nothing deleted")
        return 0
    print(f"not deleted: add --yes to delete {report.path}")
    return 1


# ------------------------------------------------------------------------------ remote
def _remote_config(args: argparse.Namespace) -> RemoteTierConfig:
    return RemoteTierConfig(url=str(args.store), key_prefix=args.key_prefix,
                            timeout_seconds=args.timeout)


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key-prefix", default="tierkv:",
                        help="remote store: the key prefix (remote.key_prefix)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="remote store: seconds per network operation")


def _other_type(count: int) -> str:
    return f", {count} key(s) of another type" if count else ""


def _run_inspect_remote(args: argparse.Namespace) -> int:
    report = inspect_remote(_remote_config(args))
    if args.json:
        print(json.dumps([{"fingerprint": fingerprint, "part": label, "chunks": chunks,
                           "value_bytes": report.value_bytes[(fingerprint, label)],
                           "wrong_type": report.wrong_type[(fingerprint, label)]}
                          for (fingerprint, label), chunks in sorted(report.chunks.items())]))
        return 0
    store = safe_url(str(args.store))
    print(f"remote store {store} (prefix {args.key_prefix!r}): "
          f"{len({fp for fp, _ in report.chunks})} namespace(s)")
    for (fingerprint, label), chunks in sorted(report.chunks.items()):
        old = (f" (never read by this tierkv; tierkv rm {store} --namespace {fingerprint} "
               f"--yes deletes it)" if label.endswith(OLD_FORMAT) else "")
        print(f"  namespace {fingerprint} {'' if old else 'part '}{label}: {chunks} chunks, "
              f"{format_bytes(report.value_bytes[(fingerprint, label)], 2)}"
              f"{_other_type(report.wrong_type[(fingerprint, label)])}{old}")
    total = sum(report.value_bytes.values())
    others = sum(report.wrong_type.values())
    print(f"inspected {sum(report.chunks.values())} chunks ({format_bytes(total, 2)})"
          + (f"; {others} key(s) of another type: tierkv verify --repair deletes them"
             if others else ""))
    return 0


def _run_verify_remote(args: argparse.Namespace, progress: Progress | None = None) -> int:
    outcome = verify_remote(_remote_config(args), repair=args.repair, only=args.namespace,
                            progress=progress)
    store = safe_url(str(args.store))
    if getattr(args, "json", False):
        print(json.dumps({"store": store, "checked": outcome.checked,
                          "checked_bytes": outcome.checked_bytes, "clean": not outcome.bad,
                          "bad": [{"fingerprint": fingerprint, "part": label, "key": key.hex(),
                                   "problem": problem}
                                  for fingerprint, label, key, problem in outcome.bad],
                          "repair": args.repair, "deleted": outcome.deleted}))
        return 1 if outcome.bad else 0
    for fingerprint, label, key, problem in outcome.bad:
        print(f"  bad chunk namespace {fingerprint[:8]} "
              f"{'' if label.endswith(OLD_FORMAT) else 'part '}{label} {key.hex()}: {problem}")
    what = f"verified {outcome.checked} chunks in {store}"
    if not outcome.bad:
        print(f"{what}: clean")
        return 0
    tail = f"deleted {outcome.deleted}" if args.repair else "run with --repair to delete them"
    print(f"{what}: {len(outcome.bad)} bad, {tail}")
    return 1


def _run_rm_remote(args: argparse.Namespace) -> int:
    """``tierkv rm URL --namespace PREFIX [--dry-run] [--yes]``: exit codes as for a disk store."""
    delete = args.yes and not args.dry_run
    removal = remove_remote(_remote_config(args), args.namespace, delete=delete)
    total = sum(removal.chunks.values())
    store = safe_url(str(args.store))
    code = 0 if delete or args.dry_run else 1
    if getattr(args, "json", False):
        print(json.dumps({"store": store, "prefix": args.key_prefix,
                          "fingerprint": removal.fingerprint, "keys": total,
                          "keys_per_part": {label: count for label, count
                                            in sorted(removal.chunks.items())},
                          "value_bytes": removal.value_bytes, "wrong_type": removal.wrong_type,
                          "deleted": removal.deleted, "dry_run": bool(args.dry_run)}))
        return code
    ranks = ", ".join(f"{'' if label.endswith(OLD_FORMAT) else 'part '}{label}: {count}"
                      for label, count in sorted(removal.chunks.items()))
    print(f"namespace {removal.fingerprint} in {store} (prefix {args.key_prefix!r}): "
          f"{total} chunks ({ranks}), {format_bytes(removal.value_bytes, 2)}"
          f"{_other_type(removal.wrong_type)}")
    if delete:
        print(f"removed namespace {removal.fingerprint[:8]} from {store}: {removal.deleted} "
              f"chunks, {format_bytes(removal.value_bytes, 2)} freed")
    elif args.dry_run:
        print(f"dry run: would delete {total} keys; nothing deleted")
    else:
        print(f"not deleted: add --yes to delete its {total} keys")
    return code


# ------------------------------------------------------------------------------ ping
def add_ping_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", metavar="URL",
                        help="the remote tier's redis:// or rediss:// URL (remote.url)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    add_remote_arguments(parser)


def run_ping(args: argparse.Namespace) -> int:
    if not is_remote(args.store):
        raise TierKVError(f"tierkv ping takes a redis:// or rediss:// URL, got "
                          f"{safe_url(str(args.store))!r}")
    result = ping_remote(RemoteTierConfig(url=str(args.store), key_prefix=args.key_prefix,
                                          timeout_seconds=args.timeout))
    code = 1 if result.problems else 0
    if args.json:
        print(json.dumps(asdict(result)))
        return code
    kind = "cluster" if result.cluster else "plain server"
    print(f"remote store {result.store} ({kind}, prefix {result.prefix!r}): password "
          f"{result.password}")
    for node in result.nodes:
        if node.problem is not None:
            print(f"  node {node.node} {node.role}: DOWN: {node.problem}")
            continue
        memory = "" if node.used_memory is None else \
            f", {format_bytes(node.used_memory, 1)} used of " + \
            (format_bytes(node.maxmemory, 1) if node.maxmemory else "no maxmemory")
        print(f"  node {node.node} {node.role}: {node.latency_ms:.2f} ms, {node.slots} slots"
              f"{memory}, maxmemory-policy {node.policy}")
    state = f" (cluster_state {result.cluster_state})" if result.cluster_state else ""
    print(f"  slots: {result.slots_covered} of {SLOTS} covered{state}")
    missing = f" (not counted: {', '.join(result.not_counted)})" if result.not_counted else ""
    print(f"  prefix {result.prefix!r}: {result.chunks} chunks, "
          f"{format_bytes(result.value_bytes, 2)} in {result.namespaces} namespace(s){missing}")
    for problem in result.problems:
        print(f"  problem: {problem}")
    print(f"pinged {len(result.nodes)} node(s): "
          + (f"{len(result.problems)} problem(s)" if result.problems else "ready for tierkv"))
    return code
