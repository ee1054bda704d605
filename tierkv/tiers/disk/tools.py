"""The disk tier's tools' view: what ``tierkv inspect``, ``tierkv verify`` and ``tierkv rm``
find and change under a store root (``disk.path``); :mod:`tierkv.tools` parses their
arguments and prints (``docs/warmup.md`` shows their output).

- :func:`inspect_store` opens every ``ns-<fingerprint>/part-<p>of<P>`` environment through a
  **read-only** :class:`DiskTier` and reads its index records only: nothing is changed.
- :func:`verify_store` checks every value's header and checksum and the index
  (:meth:`DiskTier.verify`), opening every environment read-only and reporting a damaged one
  (LMDB reports damage, its meta record is unreadable, or its files are not this user's).
  With ``repair`` it deletes bad chunks and moves a damaged environment aside and rebuilds it
  empty (what the engine itself does when it meets damage), unless a running engine claims it.
  ``progress`` is called as each environment's check goes (per batch of 64) and after it,
  with the chunks and payload bytes checked so far and the total the index records count; :class:`ProgressLine` prints it at most once
  per ``interval`` on stderr.
- :func:`remove_namespace` finds the one namespace whose fingerprint starts with a prefix
  and counts what it holds; with ``delete`` it claims every environment of it (refused while
  a running engine holds one: the engine's own claim, ``tierkv-owner.lock``), moves the
  namespace's directory out of the store's view and deletes it (every part, shard and
  moved-aside leftover). Only a real directory directly under the root is deleted, never a
  link or what one points at.

Inspect and verify are safe while an engine has the store open (LMDB is multi-process); a
chunk deleted by ``--repair`` under a running engine is a failed load there, which the
engine recomputes.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tierkv.errors import (BrokenError, ConfigError, DamagedError, NamespaceMismatchError,
                           short_key)
from tierkv.keys import FORMAT_VERSION, SINGLE_PART, Namespace, Part
from tierkv.tiers.base import Progress
from tierkv.tiers.disk.budget import (claim_namespace, claimant, delete_tree, environments,
                                      tree_bytes)
from tierkv.tiers.disk.files import (MAX_NAMESPACE_JSON_BYTES, OwnerLock, Trust, check_dir,
                                     check_file, read_private_file)
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.opener import open_disk, tool_config
from tierkv.tiers.disk.tier import SHARDS, DiskTier


@dataclass
class RankReport:
    """One ``part-<p>of<P>`` directory (its shards' environments)."""

    part: Part
    path: Path
    chunks: int = 0
    payload_bytes: int = 0  # sum over chunks
    payload_len: int = 0  # the most common payload length (0: none)
    file_bytes: int = 0
    oldest: tuple[str, int] | None = None  # (key hex, write sequence)
    newest: tuple[str, int] | None = None
    last_write: str | None = None  # newest data.mdb or slab mtime, UTC
    record: dict[str, Any] | None = None  # the authoritative namespace record (meta sub-db)
    problem: str | None = None  # not read at all: why
    # Shards that could not be read (shard -> why); the others' chunks are counted above.
    damaged_shards: dict[int, str] = field(default_factory=dict)
    replica: int = 0  # data-parallel engine (part-<p>of<P>-dp<d>)
    old_rank: int | None = None  # a rank-<r> directory of an older format (never read)

    @property
    def label(self) -> str:
        """``part 0of2`` (``part 0of2 dp1``; ``rank 0`` of an older format) for messages."""
        if self.old_rank is not None:
            return f"rank {self.old_rank}"
        return f"part {self.part.name}" + (f" dp{self.replica}" if self.replica else "")


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
    dirs = [path for path in StoreLayout(root).namespace_dirs() if path.is_dir()]
    if not dirs:
        raise ConfigError(f"{root} holds no tierkv store (no "
                          f"{StoreLayout.namespace_name('<fingerprint>')} directories)")
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
    payload = namespace.chunk_bytes // rank.part.count or rank.payload_len or 1
    return open_disk(tool_config(root, rank.file_bytes), namespace, rank.part, "tool",
                     payload_bytes=payload, replica=rank.replica, **how)


def utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def peek_rank(root: Path, namespace: Namespace, part: Part, path: Path,
              replica: int = 0) -> RankReport:
    """A :class:`RankReport` of one part directory (index records only, read-only). Each
    shard is opened on its own: a damaged one is named in ``damaged_shards`` and the others
    are still counted."""
    report = RankReport(part, path, replica=replica)
    infos = []
    for data in StoreLayout.data_files(path):
        with contextlib.suppress(OSError):  # deleted meanwhile (tierkv rm, a disk budget)
            if check_file(data, fix=False) is Trust.OK:
                infos.append(data.stat())
    if infos:
        report.file_bytes = sum(info.st_size for info in infos)
        report.last_write = utc(max(info.st_mtime for info in infos))
    lengths: collections.Counter[int] = collections.Counter()
    for shard in range(SHARDS):
        try:
            with _open_tier(root, namespace, report, shards=[shard]) as tier:
                records = list(tier.scan())
        except (DamagedError, NamespaceMismatchError, BrokenError) as exc:
            report.damaged_shards[shard] = str(exc)
            continue
        for record in records:
            report.chunks += 1
            report.payload_bytes += record.payload_len
            lengths[record.payload_len] += 1
            if report.oldest is None or record.seq < report.oldest[1]:
                report.oldest = (record.key.hex(), record.seq)
            if report.newest is None or record.seq > report.newest[1]:
                report.newest = (record.key.hex(), record.seq)
    report.payload_len = lengths.most_common(1)[0][0] if lengths else 0
    if len(report.damaged_shards) == SHARDS:  # nothing of it could be read
        reasons = dict.fromkeys(report.damaged_shards.values())
        report.problem = "; ".join(reasons)
        report.damaged_shards = {}
    return report


def repair_plan(shard: int) -> str:
    """What ``tierkv verify --repair`` does to a damaged shard, for messages."""
    name = StoreLayout.shard_name(shard)
    return (f"tierkv verify --repair moves {name} aside ({name}.broken-<time>) "
            f"and starts it empty: its chunks are lost, the other shards' are kept")


def _read_namespace(ns_dir: Path) -> NamespaceReport:
    """A :class:`NamespaceReport` of ``ns_dir`` from its ``namespace.json`` (no ranks yet)."""
    report = NamespaceReport(StoreLayout.fingerprint_of(ns_dir), ns_dir, None, {})
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
    """Peek at every ``part-<p>of<P>`` of ``report``'s directory; list moved-aside ones."""
    why = ""
    try:
        namespace: Namespace | None = _namespace_of(report)
    except ConfigError as exc:
        namespace, why = None, str(exc)
    for rank_dir in StoreLayout.part_dirs(report.path):
        parsed = StoreLayout.parse_part_dir(rank_dir.name)
        if parsed is not None and rank_dir.is_dir():
            part, replica = parsed
            if namespace is None:
                report.ranks.append(RankReport(part, rank_dir, replica=replica,
                                               problem=f"not read: {why}"))
            else:
                report.ranks.append(peek_rank(root, namespace, part, rank_dir, replica))
            report.broken += [f"{rank_dir.name}/{shard.name}" for shard in
                              StoreLayout.moved_aside_shards(rank_dir)]
        elif ".broken-" in rank_dir.name or ".foreign-" in rank_dir.name:
            report.broken.append(rank_dir.name)
    for rank_dir in StoreLayout.old_rank_dirs(report.path):  # older formats' (never read)
        old_rank = StoreLayout.old_rank_of(rank_dir.name)
        if old_rank is not None and rank_dir.is_dir():
            report.ranks.append(RankReport(
                SINGLE_PART, rank_dir, old_rank=old_rank,
                problem=f"not read: {why if namespace is None else 'another tierkv format'}"))
        elif ".broken-" in rank_dir.name or ".foreign-" in rank_dir.name:
            report.broken.append(rank_dir.name)


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


def _verify_rank(root: Path, namespace: Any, rank: RankReport, repair: bool,
                 outcome: VerifyOutcome, progress: Callable[[int], None] | None = None) -> None:
    """Check one environment through :class:`DiskTier` (``repair``: see the module
    docstring); without ``repair``, the shards beside a damaged one are checked."""
    name = f"namespace {namespace.fingerprint()[:8]} {rank.label}"
    if rank.problem is not None:
        outcome.damaged += 1
        outcome.lines.append(f"{name}: damaged environment {rank.path}: {rank.problem}")
        if not repair:
            return
    known = rank.problem is not None or bool(rank.damaged_shards)
    for shard, why in sorted(rank.damaged_shards.items()):
        outcome.damaged += 1
        outcome.lines.append(f"{name}: damaged environment "
                             f"{rank.path / StoreLayout.shard_name(shard)}: "
                             f"{why}")
        if not repair:
            outcome.lines.append(f"  not checked: {repair_plan(shard)}")
    good = [shard for shard in range(SHARDS) if shard not in rank.damaged_shards]
    if not good:
        return
    before = StoreLayout.moved_aside(rank.path)
    try:
        with _open_tier(root, namespace, rank, repair=repair,
                        shards=None if repair else good) as tier:
            result = tier.verify(repair=repair, progress=progress)
            rebuilt = tier.statistics().rebuilds > 0
            if rebuilt and not known:
                outcome.damaged += 1
                outcome.lines.append(f"{name}: damaged environment {rank.path}: "
                                     f"{result.damaged or 'found while opening it'}")
            _report_chunks(tier, name, result, repair, outcome)
            outcome.checked_bytes += (rank.payload_bytes if result.checked == rank.chunks
                                      else result.checked * rank.payload_len)
    except (DamagedError, NamespaceMismatchError) as exc:
        if not known:
            outcome.damaged += 1
            outcome.lines.append(f"{name}: damaged environment {rank.path}: {exc}")
        else:  # a known problem: only a repair got here
            outcome.lines.append(f"  not repaired: {exc}")
        return
    moved = sorted(StoreLayout.moved_aside(rank.path) - before)
    if moved:
        outcome.moved_aside += len(moved)
        outcome.lines.append(f"  repaired: moved it to {', '.join(p.name for p in moved)} "
                             f"and started an empty environment")
    elif known and repair:
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


def verify_store(root: Path, repair: bool = False, only: str | None = None,
                 progress: Progress | None = None) -> VerifyOutcome:
    """Verify every chunk of every namespace (or those whose fingerprint starts with ``only``);
    ``progress`` is called as each environment is checked (see the module docstring)."""
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
            def within(count: int, rank: RankReport = rank) -> None:  # during the rank's check
                if progress is not None:
                    progress(outcome.checked + count,
                             outcome.checked_bytes + count * rank.payload_len, total)

            _verify_rank(root, namespace, rank, repair, outcome, within)
            if progress is not None:
                progress(outcome.checked, outcome.checked_bytes, total)
    return outcome


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
    matches = [path for path in _store_dirs(root)
               if StoreLayout.fingerprint_of(path).startswith(prefix)]
    if not matches:
        raise ConfigError(f"no namespace in {root} starts with {prefix!r} (--namespace); "
                          f"nothing deleted; tierkv inspect {root} lists them")
    if len(matches) > 1:
        listed = "; ".join(f"{StoreLayout.fingerprint_of(path)} "
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


def _in_use(root: Path, prefix: str, ns_dir: Path, env_dir: Path, who: str) -> ConfigError:
    return ConfigError(f"namespace {StoreLayout.fingerprint_of(ns_dir)[:8]} (--namespace {prefix}) in "
                       f"{root} is in use: {env_dir} is claimed by {who}, a running engine (a "
                       f"vLLM server, a TierKVStore or a warm-up over {root}); nothing deleted: "
                       f"stop it, then rerun tierkv rm")


def remove_namespace(root: Path, prefix: str, delete: bool = False) -> Removal:
    """The namespace of ``root`` whose fingerprint starts with ``prefix`` and what it holds;
    ``delete``: delete it (see the module docstring). Refused with a :class:`ConfigError`
    (nothing deleted) when no namespace or several match, or a running engine claims one of
    its environments."""
    root = Path(root)
    ns_dir = _select(root, prefix)
    file_bytes = tree_bytes(ns_dir)  # before the claims add their lock files
    locks: list[OwnerLock] = []
    try:
        if delete:
            locks = claim_namespace(ns_dir, f"tierkv rm {root}",
                                    partial(_in_use, root, prefix, ns_dir))
        else:
            claimed = [(env_dir, who) for env_dir in environments(ns_dir)
                       if (who := claimant(env_dir)) is not None]
            if claimed:
                raise _in_use(root, prefix, ns_dir, *claimed[0])
        report = _read_namespace(ns_dir)
        _add_ranks(root, report)
        removal = Removal(report, sum(rank.chunks for rank in report.ranks),
                          sum((rank.problem is not None) + len(rank.damaged_shards)
                              for rank in report.ranks), file_bytes)
        if delete:
            delete_tree(root, ns_dir)
            removal.deleted = True
        return removal
    finally:
        for lock in locks:
            lock.release()
