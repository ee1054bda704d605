"""Operator tools over a disk tier root: ``tierkv inspect``, ``tierkv verify`` and
``tierkv rm`` (``docs/warmup.md`` shows their output).

- :func:`inspect_store` opens every ``ns-<fingerprint>/rank-<r>`` environment through a
  **read-only** :class:`DiskTier` and reads its index records only: nothing is changed.
- :func:`verify_store` checks every value's header and checksum and the index
  (:meth:`DiskTier.verify`), opening every environment read-only and reporting a damaged one
  (LMDB reports damage, its meta record is unreadable, or its files are not this user's).
  With ``repair`` it deletes bad chunks and moves a damaged environment aside and rebuilds it
  empty (what the engine itself does when it meets damage), unless a running engine claims it.
  ``progress`` is called after each environment with the chunks and payload bytes checked so
  far and the total the index records count; :class:`ProgressLine` prints it at most once
  per ``interval`` on stderr.
- Exit codes of ``tierkv verify``: 0 clean, 1 bad chunks or damaged environments found (also
  when ``--repair`` fixed them: a rerun then answers 0), 2 error.
- :func:`remove_namespace` finds the one namespace whose fingerprint starts with a prefix and
  counts what it holds; with ``delete`` it claims every environment of it (refused while a
  running engine holds one: the engine's own claim, ``tierkv-owner.lock``), moves the
  ``ns-<fingerprint>`` directory out of the store's view and deletes it (every rank, shard
  and moved-aside leftover). Only a real directory directly under the root is deleted, never
  a link or what one points at. Exit codes of ``tierkv rm``: 0 deleted (or ``--dry-run``), 1
  not deleted (``--yes`` missing), 2 refused or error.

Inspect and verify are safe while an engine has the store open (LMDB is multi-process); a
chunk deleted by ``--repair`` under a running engine is a failed load there, which the
engine recomputes.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tierkv import remote_tools
from tierkv.config import DiskTierConfig
from tierkv.errors import (BrokenError, ConfigError, DamagedError, NamespaceMismatchError,
                           short_key)
from tierkv.keys import FORMAT_VERSION, Namespace
from tierkv.tiers.disk import DiskTier, written_at
from tierkv.tiers.disk_files import (MAX_NAMESPACE_JSON_BYTES, OWNER_FILE, OwnerLock, Trust,
                                     check_dir, check_file, read_private_file)
from tierkv.units import MiB, format_bytes, format_rate

PROGRESS_SECONDS = 1.0  # at most one progress line per second


@dataclass
class RankReport:
    """One ``rank-<r>`` environment."""

    rank: int
    path: Path
    chunks: int = 0
    payload_bytes: int = 0  # sum over chunks
    payload_len: int = 0  # the most common payload length (0: none)
    file_bytes: int = 0
    oldest: tuple[str, int] | None = None  # (key hex, write sequence)
    newest: tuple[str, int] | None = None
    last_write: str | None = None  # data.mdb mtime, UTC
    record: dict[str, Any] | None = None  # the authoritative namespace record (meta sub-db)
    problem: str | None = None  # damaged: why


@dataclass
class NamespaceReport:
    fingerprint: str
    path: Path
    format_version: int | None
    description: dict[str, Any]
    ranks: list[RankReport] = field(default_factory=list)
    # rank-<r>.broken-*, rank-<r>/shard-<s>.broken-* (and .foreign-*) directories
    broken: list[str] = field(default_factory=list)
    problem: str | None = None


def _store_dirs(root: Path) -> list[Path]:
    if not root.exists():
        raise ConfigError(f"no such store directory: {root}")
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory (expected a tierkv store root, disk.path)")
    dirs = sorted(path for path in root.glob("ns-*") if path.is_dir())
    if not dirs:
        raise ConfigError(f"{root} holds no tierkv store (no ns-<fingerprint> directories)")
    return dirs


def _namespace_of(report: NamespaceReport) -> Namespace:
    """The namespace ``namespace.json`` describes; ConfigError when it cannot be read as one
    of this tierkv's, or does not fingerprint as its directory's name."""
    if report.problem is not None:
        raise ConfigError(f"namespace {report.fingerprint[:8]}: {report.problem}")
    if report.format_version != FORMAT_VERSION:
        raise ConfigError(
            f"namespace {report.fingerprint[:8]} ({report.path}) has format version "
            f"{report.format_version}, written by another tierkv; this tierkv reads format "
            f"{FORMAT_VERSION} and never serves it (an engine starts that namespace empty). "
            f"Delete it when no such tierkv uses it (tierkv rm STORE --namespace "
            f"{report.fingerprint[:8]} --yes), or verify the rest with --namespace")
    try:
        namespace = Namespace(**report.description)
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"namespace {report.fingerprint[:8]}: cannot rebuild it from its "
                          f"record ({exc})") from exc
    if namespace.fingerprint() != report.fingerprint:
        raise ConfigError(f"{report.path}: its record fingerprints as "
                          f"{namespace.fingerprint()[:8]}, not as its directory name says")
    return namespace


def _open_tier(root: Path, namespace: Namespace, rank: RankReport, **how: Any) -> DiskTier:
    payload = namespace.chunk_bytes or rank.payload_len or 1
    config = DiskTierConfig(path=root, max_bytes=max(2 * rank.file_bytes, 64 * MiB),
                            sync_mode="close")
    return DiskTier(root, namespace, rank.rank, config, payload, **how)


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def peek_rank(root: Path, namespace: Namespace, rank: int, path: Path) -> RankReport:
    """A :class:`RankReport` of one environment (index records only, read-only)."""
    report = RankReport(rank, path)
    infos = [data.stat() for data in sorted(path.glob("shard-*/data.mdb"))
             if check_file(data, fix=False) is Trust.OK]
    if infos:
        report.file_bytes = sum(info.st_size for info in infos)
        report.last_write = _utc(max(info.st_mtime for info in infos))
    try:
        with _open_tier(root, namespace, report, read_only=True) as tier:
            lengths: collections.Counter[int] = collections.Counter()
            for record in tier.scan():
                report.chunks += 1
                report.payload_bytes += record.payload_len
                lengths[record.payload_len] += 1
                if report.oldest is None or record.seq < report.oldest[1]:
                    report.oldest = (record.key.hex(), record.seq)
                if report.newest is None or record.seq > report.newest[1]:
                    report.newest = (record.key.hex(), record.seq)
            report.payload_len = lengths.most_common(1)[0][0] if lengths else 0
    except (DamagedError, NamespaceMismatchError, BrokenError) as exc:
        report.problem = str(exc)
    return report


def _read_namespace(ns_dir: Path) -> NamespaceReport:
    """A :class:`NamespaceReport` of ``ns_dir`` from its ``namespace.json`` (no ranks yet)."""
    report = NamespaceReport(ns_dir.name[3:], ns_dir, None, {})
    try:
        raw = read_private_file(ns_dir / "namespace.json", MAX_NAMESPACE_JSON_BYTES)
        if raw is None or len(raw) > MAX_NAMESPACE_JSON_BYTES:
            raise ValueError("missing, too big, or not a regular file of this user's")
        record = json.loads(raw.decode())
        report.description = dict(record["namespace"])
        report.format_version = int(record["format_version"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        report.problem = f"namespace.json unreadable ({exc})"
    return report


def _add_ranks(root: Path, report: NamespaceReport) -> None:
    """Peek at every ``rank-<r>`` of ``report``'s directory; list moved-aside ones."""
    try:
        namespace: Namespace | None = _namespace_of(report)
    except ConfigError as exc:
        namespace, why = None, str(exc)
    for rank_dir in sorted(report.path.glob("rank-*")):
        suffix = rank_dir.name[5:]
        if suffix.isdigit() and rank_dir.is_dir():
            if namespace is None:
                report.ranks.append(RankReport(int(suffix), rank_dir, problem=f"not read: {why}"))
            else:
                report.ranks.append(peek_rank(root, namespace, int(suffix), rank_dir))
        elif ".broken-" in rank_dir.name or ".foreign-" in rank_dir.name:
            report.broken.append(rank_dir.name)
        if suffix.isdigit() and rank_dir.is_dir():
            report.broken += [f"{rank_dir.name}/{shard.name}" for shard in
                              sorted(rank_dir.glob("shard-*.*-*"))]


def inspect_store(root: Path) -> list[NamespaceReport]:
    """Every namespace under ``root`` and its environments, read-only."""
    reports = []
    for ns_dir in _store_dirs(Path(root)):
        report = _read_namespace(ns_dir)
        _add_ranks(Path(root), report)
        reports.append(report)
    return reports


# ------------------------------------------------------------------------------ verify
@dataclass
class VerifyOutcome:
    namespaces: int = 0
    checked: int = 0
    checked_bytes: int = 0  # payload bytes of the chunks checked (as the index records count)
    bad: int = 0  # chunks that failed their checks
    deleted: int = 0
    damaged: int = 0  # environments that could not be checked
    moved_aside: int = 0
    lines: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.bad == 0 and self.damaged == 0


def _moved_aside(rank_dir: Path) -> set[Path]:
    """What the engine moved aside of one rank: the rank directory, or one of its shards."""
    return set(rank_dir.parent.glob(f"{rank_dir.name}.*-*")) | set(rank_dir.glob("shard-*.*-*"))


def _verify_rank(root: Path, namespace: Any, rank: RankReport, repair: bool,
                 outcome: VerifyOutcome) -> None:
    """Check one environment through :class:`DiskTier` (``repair``: see the module docstring)."""
    name = f"namespace {namespace.fingerprint()[:8]} rank {rank.rank}"
    if rank.problem is not None:
        outcome.damaged += 1
        outcome.lines.append(f"{name}: damaged environment {rank.path}: {rank.problem}")
        if not repair:
            return
    before = _moved_aside(rank.path)
    try:
        with _open_tier(root, namespace, rank, repair=repair, read_only=not repair) as tier:
            result = tier.verify(repair=repair)
            rebuilt = tier.statistics().rebuilds > 0
            if rebuilt and rank.problem is None:
                outcome.damaged += 1
                outcome.lines.append(f"{name}: damaged environment {rank.path}: "
                                     f"{result.damaged or 'found while opening it'}")
            if not rebuilt:
                _report_chunks(tier, name, result, repair, outcome)
                outcome.checked_bytes += (rank.payload_bytes if result.checked == rank.chunks
                                          else result.checked * rank.payload_len)
    except (DamagedError, NamespaceMismatchError) as exc:
        if rank.problem is None:
            outcome.damaged += 1
            outcome.lines.append(f"{name}: damaged environment {rank.path}: {exc}")
        else:  # a known problem: only a repair got here
            outcome.lines.append(f"  not repaired: {exc}")
        return
    moved = sorted(_moved_aside(rank.path) - before)
    if moved:
        outcome.moved_aside += len(moved)
        outcome.lines.append(f"  repaired: moved it to {', '.join(p.name for p in moved)} "
                             f"and started an empty environment")
    elif rank.problem is not None:
        outcome.lines.append("  not repaired: the environment opened and verified cleanly "
                             "(rerun tierkv verify)")


def _report_chunks(tier: Any, name: str, result: Any, repair: bool,
                   outcome: VerifyOutcome) -> None:
    outcome.checked += result.checked
    outcome.bad += len(result.bad_keys)
    outcome.lines.append(f"{name}: {result.checked} chunks checked, {len(result.bad_keys)} bad")
    outcome.lines.extend(f"  bad chunk {key.hex()}" for key in result.bad_keys)
    if repair and result.bad_keys:
        remaining = {record.key for record in tier.scan()} & set(result.bad_keys)
        if remaining:
            raise BrokenError(f"{name}: {len(remaining)} bad chunk(s) could not be deleted, "
                              f"e.g. {short_key(next(iter(remaining)))} (map full? raise "
                              f"disk.max_bytes)")
        outcome.deleted += len(result.bad_keys)
        outcome.lines.append(f"  repaired: deleted {len(result.bad_keys)} bad chunk(s)")


Progress = remote_tools.Progress  # (chunks, bytes) so far, and the total when known


def verify_store(root: Path, repair: bool = False, only: str | None = None,
                 progress: Progress | None = None) -> VerifyOutcome:
    """Verify every chunk of every namespace (or those whose fingerprint starts with ``only``);
    ``progress`` is called after each environment (see the module docstring)."""
    root = Path(root)
    outcome = VerifyOutcome()
    reports = [report for report in inspect_store(root)
               if not only or report.fingerprint.startswith(only)]
    if only and not reports:
        raise ConfigError(f"no namespace under {root} starts with {only!r} (--namespace)")
    total = sum(rank.chunks for report in reports for rank in report.ranks)
    for report in reports:
        outcome.namespaces += 1
        namespace = _namespace_of(report)
        for rank in report.ranks:
            _verify_rank(root, namespace, rank, repair, outcome)
            if progress is not None:
                progress(outcome.checked, outcome.checked_bytes, total)
    return outcome


class ProgressLine:
    """Progress of a long check on ``stream`` (stderr): :meth:`update` is the ``progress``
    callback of :func:`verify_store` and :func:`remote_tools.verify_remote`, and prints
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

    def update(self, chunks: int, num_bytes: int, total: int | None = None) -> None:
        self.chunks, self.num_bytes = chunks, num_bytes
        now = self._clock()
        if self.interval is None or now - self._last < self.interval:
            return
        self._last = now
        of = "" if total is None else f" / {total:,}"
        print(f"{self.what}: {chunks:,}{of} chunks, {format_bytes(num_bytes, 1)}, "
              f"{format_rate(num_bytes, now - self.started)}", file=self.stream, flush=True)

    def summary(self) -> str:
        seconds = self._clock() - self.started
        return (f"{self.what}: checked {self.chunks:,} chunks, {format_bytes(self.num_bytes, 2)} "
                f"in {seconds:.1f} s ({format_rate(self.num_bytes, seconds)})")


# ------------------------------------------------------------------------------ rm
_FINGERPRINT_PREFIX = re.compile(r"[0-9a-f]{1,32}")


@dataclass
class Removal:
    """The namespace :func:`remove_namespace` found, what it holds, and whether it is gone."""

    report: NamespaceReport
    chunks: int  # as the index records of the environments that could be read count them
    unread: int  # environments that could not be read (their chunks are not counted)
    file_bytes: int  # every file under ns-<fingerprint>
    deleted: bool = False


def _select(root: Path, prefix: str) -> Path:
    """The one ``ns-<fingerprint>`` directory of ``root`` whose fingerprint starts with
    ``prefix``: a real directory directly under the root, else a :class:`ConfigError`."""
    if not _FINGERPRINT_PREFIX.fullmatch(prefix):
        raise ConfigError(f"--namespace {prefix!r} is not the start of a namespace "
                          f"fingerprint (1 to 32 hex digits); tierkv inspect {root} lists them")
    matches = [path for path in _store_dirs(root) if path.name[3:].startswith(prefix)]
    if not matches:
        raise ConfigError(f"no namespace in {root} starts with {prefix!r} (--namespace); "
                          f"nothing deleted; tierkv inspect {root} lists them")
    if len(matches) > 1:
        listed = "; ".join(f"{path.name[3:]} "
                           f"({_read_namespace(path).description.get('model_id', '?')})"
                           for path in matches)
        raise ConfigError(f"{len(matches)} namespaces in {root} start with {prefix!r}: "
                          f"{listed}; nothing deleted; give a longer --namespace prefix")
    ns_dir = matches[0]
    if ns_dir.is_symlink() or ns_dir.resolve().parent != root.resolve():
        raise ConfigError(f"{ns_dir} is a symbolic link (to {ns_dir.resolve()}); tierkv rm "
                          f"deletes only directories inside the store {root}; nothing deleted: "
                          f"remove the link by hand")
    if check_dir(ns_dir, fix=False) is not Trust.OK:
        raise ConfigError(f"{ns_dir} is not a directory of this user's that only it can "
                          f"write; nothing deleted: check who made it, then delete it by hand")
    return ns_dir


def _environments(ns_dir: Path) -> list[Path]:
    """Where an engine holds its claim under ``ns_dir``: each ``rank-<r>/shard-<s>`` (and
    ``rank-<r>`` itself where it is format 2's one environment per rank)."""
    found: list[Path] = []
    for rank_dir in sorted(ns_dir.glob("rank-*")):
        if not rank_dir.name[5:].isdigit() or rank_dir.is_symlink() or not rank_dir.is_dir():
            continue
        if any((rank_dir / name).exists() for name in ("data.mdb", OWNER_FILE)):
            found.append(rank_dir)
        found += [shard for shard in sorted(rank_dir.glob("shard-*")) if shard.name[6:].isdigit()
                  and not shard.is_symlink() and shard.is_dir()]
    return found


def _claimant(env_dir: Path) -> str | None:
    """Who holds the claim of ``env_dir`` (``process 1234``), or None; changes nothing: a
    shared ``flock`` on its ``tierkv-owner.lock``, if there is one, is tried and dropped."""
    try:
        fd = os.open(env_dir / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # none (never claimed), or a link: no engine's claim
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            with suppress(OSError):
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return "this process" if holder == str(os.getpid()) else (
                f"process {holder}" if holder else "another process")
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _in_use(root: Path, prefix: str, ns_dir: Path, env_dir: Path, who: str) -> ConfigError:
    return ConfigError(f"namespace {ns_dir.name[3:11]} (--namespace {prefix}) in "
                       f"{root} is in use: {env_dir} is claimed by {who}, a running engine (a "
                       f"vLLM server, a TierKVStore or a warm-up over {root}); nothing deleted: "
                       f"stop it, then rerun tierkv rm")


def _claim_all(root: Path, prefix: str, ns_dir: Path) -> list[OwnerLock]:
    """The claim of every environment of ``ns_dir``, as an engine takes it (so none starts
    on it meanwhile)."""
    locks: list[OwnerLock] = []
    try:
        for env_dir in _environments(ns_dir):
            try:
                locks.append(OwnerLock(env_dir, f"tierkv rm {root}"))
            except ConfigError:
                who = _claimant(env_dir)
                if who is None:
                    raise
                raise _in_use(root, prefix, ns_dir, env_dir, who) from None
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def _tree_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (links are counted as links, never followed)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _delete_tree(root: Path, ns_dir: Path) -> None:
    """Rename ``ns_dir`` out of the store's view at once (an engine starting now finds no
    namespace, not half of one), then delete it; links inside are removed, never followed."""
    aside = root / f".{ns_dir.name}.removing-{os.getpid()}-{time.time_ns()}"
    try:
        os.rename(ns_dir, aside)
    except OSError as exc:
        raise BrokenError(f"cannot move {ns_dir} aside to delete it ({exc}); nothing "
                          f"deleted") from exc
    try:
        shutil.rmtree(aside)
    except OSError as exc:
        raise BrokenError(f"{ns_dir.name} was moved to {aside} and could not be deleted "
                          f"completely ({exc}); delete what is left by hand") from exc


def remove_namespace(root: Path, prefix: str, delete: bool = False) -> Removal:
    """The namespace of ``root`` whose fingerprint starts with ``prefix`` and what it holds;
    ``delete``: delete it (see the module docstring). Refused with a :class:`ConfigError`
    (nothing deleted) when no namespace or several match, or a running engine claims one of
    its environments."""
    root = Path(root)
    ns_dir = _select(root, prefix)
    file_bytes = _tree_bytes(ns_dir)  # before the claims add their lock files
    locks: list[OwnerLock] = []
    try:
        if delete:
            locks = _claim_all(root, prefix, ns_dir)
        else:
            claimed = [(env_dir, who) for env_dir in _environments(ns_dir)
                       if (who := _claimant(env_dir)) is not None]
            if claimed:
                raise _in_use(root, prefix, ns_dir, *claimed[0])
        report = _read_namespace(ns_dir)
        _add_ranks(root, report)
        removal = Removal(report, sum(rank.chunks for rank in report.ranks),
                          sum(rank.problem is not None for rank in report.ranks), file_bytes)
        if delete:
            _delete_tree(root, ns_dir)
            removal.deleted = True
        return removal
    finally:
        for lock in locks:
            lock.release()


# ------------------------------------------------------------------------------ CLI
def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="store root (the disk tier's disk.path / disk_path), or "
                                      "a remote store's redis:// or rediss:// URL")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    remote_tools.add_arguments(parser)


def run_inspect(args: argparse.Namespace) -> int:
    if remote_tools.is_remote(args.store):
        return remote_tools.run_inspect(args)
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
        for name in ("model_id", "dtype", "kv_layout", "page_bytes", "tokens_per_chunk",
                     "blocks_per_chunk", "num_layers", "tp_size", "rank_layout", "hash_scheme",
                     "extra"):
            if name in desc:
                print(f"  {name + ':':18s}{desc[name]}")
        names = desc.get("layer_names")
        if isinstance(names, list) and names:
            shown = ", ".join(map(str, names[:2])) + (f", ... {names[-1]}" if len(names) > 2 else "")
            print(f"  {'layer_names:':18s}{len(names)}: {shown}")
        for rank in report.ranks:
            if rank.problem:
                print(f"  rank {rank.rank}: DAMAGED: {rank.problem}")
                continue
            ends = ""
            if rank.oldest and rank.newest:
                ends = ", ".join(["", *(f"{what} {key[:8]} (written {_utc(written_at(seq))})"
                                        for what, (key, seq) in (("oldest", rank.oldest),
                                                                 ("newest", rank.newest)))])
            print(f"  rank {rank.rank}: {rank.chunks} chunks, {format_bytes(rank.payload_bytes, 2)}"
                  f" (file {format_bytes(rank.file_bytes, 2)}){ends}, last write {rank.last_write}")
        for name in report.broken:
            print(f"  moved aside: {name}")
    print(f"inspected {len(reports)} namespace(s): {chunks} chunks ({format_bytes(payload, 2)}) "
          f"in {args.store}")
    return 0


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="store root (the disk tier's disk.path / disk_path), or "
                                      "a remote store's redis:// or rediss:// URL")
    remote_tools.add_arguments(parser)
    parser.add_argument("--repair", action="store_true",
                        help="delete bad chunks; move damaged environments aside")
    parser.add_argument("--namespace", metavar="PREFIX",
                        help="only namespaces whose fingerprint starts with PREFIX")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines on stderr while it runs (the result and the "
                             "closing speed line are still printed)")


def run_verify(args: argparse.Namespace) -> int:
    progress = ProgressLine("verify", None if args.no_progress else PROGRESS_SECONDS)
    if remote_tools.is_remote(args.store):
        code = remote_tools.run_verify(args, progress.update)
    else:
        code = _run_verify_disk(args, progress.update)
    print(progress.summary(), file=sys.stderr)
    return code


def _run_verify_disk(args: argparse.Namespace, progress: Progress) -> int:
    args.store = Path(args.store)
    started = time.perf_counter()
    outcome = verify_store(args.store, repair=args.repair, only=args.namespace,
                           progress=progress)
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
                 else "run with --repair to delete them")
    print(f"{what}: {', '.join(parts)} ({seconds:.1f} s)")
    return 1


def add_rm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="store root (the disk tier's disk.path / disk_path), or "
                                      "a remote store's redis:// or rediss:// URL")
    parser.add_argument("--namespace", metavar="PREFIX", required=True,
                        help="the namespace to delete: its fingerprint or a prefix of it that "
                             "no other namespace starts with (tierkv inspect lists them)")
    parser.add_argument("--dry-run", action="store_true",
                        help="only print what would be deleted")
    parser.add_argument("--yes", action="store_true",
                        help="delete it; without --yes only what would be deleted is printed")
    remote_tools.add_arguments(parser)


def run_rm(args: argparse.Namespace) -> int:
    if remote_tools.is_remote(args.store):
        return remote_tools.run_rm(args)
    args.store = Path(args.store)
    delete = args.yes and not args.dry_run
    removal = remove_namespace(args.store, args.namespace, delete=delete)
    report = removal.report
    model = report.description.get("model_id", "?")
    extra = [f"{len(report.broken)} moved-aside environment(s)"] if report.broken else []
    extra += [f"{removal.unread} environment(s) not readable, their chunks not counted"] \
        if removal.unread else []
    print(f"namespace {report.fingerprint} ({model}, format version {report.format_version}) in "
          f"{args.store}: {len(report.ranks)} rank(s), {removal.chunks} chunks, "
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
