"""``tierkv rm``: remove one namespace of a store (``docs/warmup.md`` shows its output).

:func:`remove_namespace` finds the one namespace whose fingerprint starts with a prefix and
counts what it holds; with ``delete`` it claims every environment of it (refused while a
running engine holds one: the engine's own claim, ``tierkv-owner.lock``), moves the
``ns-<fingerprint>`` directory out of the store's view and deletes it (every part, shard and
moved-aside leftover). Only a real directory directly under the root is deleted, never a link
or what one points at. Exit codes of ``tierkv rm``: 0 deleted (or ``--dry-run``), 1 not
deleted (``--yes`` missing), 2 refused or error.

A ``redis://`` store is handled by :func:`tierkv.remote_tools.remove_remote`.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tierkv import remote_tools
from tierkv.errors import ConfigError
from tierkv.tiers.disk_budget import claim_namespace, claimant, delete_tree, environments, tree_bytes
from tierkv.tiers.disk_files import OwnerLock, Trust, check_dir
from tierkv.tools import NamespaceReport, _add_ranks, _read_namespace, _store_dirs
from tierkv.units import format_bytes

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


def _in_use(root: Path, prefix: str, ns_dir: Path, env_dir: Path, who: str) -> ConfigError:
    return ConfigError(f"namespace {ns_dir.name[3:11]} (--namespace {prefix}) in "
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
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of the result lines (exit "
                             "codes unchanged)")
    remote_tools.add_arguments(parser)


def run_rm(args: argparse.Namespace) -> int:
    if remote_tools.is_remote(args.store):
        return remote_tools.run_rm(args)
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
