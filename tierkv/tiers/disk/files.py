"""The disk tier's files and directories: created private, trusted only when they are.

Primitives and contracts:

- :func:`prepare_root` makes ``disk.path`` usable or refuses it with a
  :class:`ConfigError` that names the path and ``disk.path``: missing directories (and
  parents) are created 0o700 whatever the umask; an existing root must be a directory
  owned by this process's user and writable by no one else. A file in its place, a
  parent that cannot be written, a read-only filesystem: all are ``ConfigError``.
- :func:`check_dir` / :func:`check_file` judge one entry below the root (never following
  a symbolic link): ``MISSING``, ``OK`` (owned by this user and writable by no one else; a
  group or other *read* bit is cleared, with a warning), or ``FOREIGN`` (another owner,
  writable by others, a link, a FIFO, a device, a directory where a file belongs ...):
  never used, the caller moves it aside.
- :func:`make_private_dir`, :func:`write_private_file` (atomic, 0o600),
  :func:`move_aside` (``<name>.<why>-<UTC time>[-n]``, kept for inspection).
- :func:`namespace_record` (what ``namespace.json`` and the meta record hold) and
  :func:`list_namespaces` (the ``namespace.json`` files under a root, for operators;
  unreadable or untrusted ones are skipped with a warning).
- :class:`OwnerLock`: an exclusive ``flock`` on ``tierkv-owner.lock`` inside an
  environment, held by the one process that writes it. It dies with the process: a child
  forked meanwhile closes its inherited copy at once, so it never keeps the claim alive.

What this defends against: another local user who plants, replaces or reads a store's
files (``docs/reliability.md``). Not against root, or against this user's own processes.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import pwd
import re
import secrets
import stat
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.errors import ConfigError
from tierkv.keys import FORMAT_VERSION, Namespace, Part
from tierkv.tiers.disk.layout import StoreLayout

logger = logging.getLogger("tierkv.disk")

DIR_MODE = 0o700
FILE_MODE = 0o600
OWNER_FILE = "tierkv-owner.lock"


class Trust(enum.Enum):
    MISSING = "missing"
    OK = "ok"
    FOREIGN = "foreign"


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:  # a uid without a passwd entry
        return f"uid {uid}"


def _path_error(path: Path, exc: OSError, doing: str) -> ConfigError:
    reason = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
              errno.EROFS: "read-only filesystem", errno.ENOTDIR: "a path component is a file",
              errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}.get(
                  exc.errno or 0, exc.strerror or str(exc))
    return ConfigError(f"disk tier: cannot {doing} {path}: {reason} (point disk.path at a "
                       f"directory this user can create and write)")


def make_private_dir(path: Path) -> None:
    """Create ``path`` and its missing parents as 0o700, whatever the umask (``mkdir -p``
    would leave the parents at the umask's mode); an existing directory is left as it is.
    OS errors come back as :class:`ConfigError` naming the path."""
    try:
        if path.is_dir():
            return
        missing: list[Path] = []
        current = path
        while not os.path.lexists(current) and current != current.parent:
            missing.append(current)
            current = current.parent
        if not current.is_dir():
            raise ConfigError(f"disk tier: {current} is not a directory, so {path} cannot be "
                              f"created (point disk.path at a directory)")
        for directory in reversed(missing):
            try:
                directory.mkdir(mode=DIR_MODE)
            except FileExistsError:  # created meanwhile (another rank): judged by the caller
                continue
            os.chmod(directory, DIR_MODE)
    except OSError as exc:
        raise _path_error(path, exc, "create") from exc


def prepare_root(root: Path) -> None:
    """Create the store root or check an existing one; see the module docstring."""
    make_private_dir(root)
    try:
        info = os.stat(root)  # a symbolic link to the real root is the user's choice
    except OSError as exc:
        raise _path_error(root, exc, "read") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"disk tier: disk.path {root} is not a directory (point disk.path "
                          f"at a directory)")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"disk tier: disk.path {root} is owned by {_owner(info.st_uid)}, not by this "
            f"process's user ({_owner(os.geteuid())}); another user could have planted KV there "
            f"or could read what the engine writes. Point disk.path at a directory of this "
            f"user's (tierkv creates it 0o700)")
    if info.st_mode & 0o022:
        raise ConfigError(
            f"disk tier: disk.path {root} is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):#o}); anyone could plant or swap chunks there. "
            f"Run chmod 700 {root}, or point disk.path at a private directory")


def _judge(path: Path, want_dir: bool, mode: int, fix: bool) -> Trust:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Trust.MISSING
    kind_ok = stat.S_ISDIR(info.st_mode) if want_dir else stat.S_ISREG(info.st_mode)
    writable_by_others = stat.S_IMODE(info.st_mode) & 0o022  # they could have written it
    if not kind_ok or info.st_uid != os.geteuid() or writable_by_others:
        what = "directory" if want_dir else "regular file"
        logger.warning("disk tier: %s is not a %s that only this user can write (%s, owner %s); "
                       "it is not used", path, what, stat.filemode(info.st_mode),
                       _owner(info.st_uid))
        return Trust.FOREIGN
    if fix and stat.S_IMODE(info.st_mode) & 0o077:  # group or other bits: made private
        logger.warning("disk tier: %s had mode %#o; made it %#o (store files are private)",
                       path, stat.S_IMODE(info.st_mode), mode)
        os.chmod(path, mode)
    return Trust.OK


def check_dir(path: Path, fix: bool = True) -> Trust:
    """Whether directory ``path`` can be trusted (see the module docstring); ``fix=False``
    (read-only callers) changes no mode."""
    return _judge(path, True, DIR_MODE, fix)


def check_file(path: Path, fix: bool = True) -> Trust:
    """Whether regular file ``path`` can be trusted (see :func:`check_dir`)."""
    return _judge(path, False, FILE_MODE, fix)


def write_private_file(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically with a 0o600 file holding ``data`` (whatever was there,
    a foreign file or a FIFO included, is replaced, never opened; the temporary file is a
    new one, never an existing name)."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_NONBLOCK, FILE_MODE)
            break
        except FileExistsError:
            continue
    try:
        os.write(fd, data)
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_private_file(path: Path, limit: int) -> bytes | None:
    """The first ``limit + 1`` bytes of ``path`` when it is a trusted regular file, else
    None (never blocks on a FIFO, never follows a link)."""
    if check_file(path, fix=False) is not Trust.OK:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


def move_aside(path: Path, why: str = "broken") -> Path:
    """Rename ``path`` to ``<name>.<why>-<UTC time>[-n]`` beside it; returns the new path."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.{why}-{stamp}")
    counter = 0
    while os.path.lexists(target):
        counter += 1
        target = path.with_name(f"{path.name}.{why}-{stamp}-{counter}")
    os.rename(path, target)
    return target


_HELD: weakref.WeakSet[OwnerLock] = weakref.WeakSet()


def _forget_claims_in_child() -> None:
    """After fork, in the child: close the inherited claims (closing, not unlocking: the
    parent's lock stays; it must not outlive the parent because of the child)."""
    for lock in list(_HELD):
        lock.release(unlock=False)


os.register_at_fork(after_in_child=_forget_claims_in_child)


class InUseError(ConfigError):
    """A writer's claim refused: another writer holds the environment (the disk opener
    raises it as a plain :class:`ConfigError`, worded for its caller)."""


def in_use_message(what: str, env_dir: Path, who: str) -> str:
    return (f"{what}: the environment {env_dir} is in use by {who}; one process writes an "
            f"environment at a time (two would evict each other's chunks). Give each engine "
            f"its own disk.path (or rank), or close the other store first")


class OwnerLock:
    """The exclusive claim of one environment directory by one writing process."""

    def __init__(self, env_dir: Path, what: str) -> None:
        path = env_dir / OWNER_FILE
        if check_file(path) is Trust.FOREIGN:
            aside = move_aside(path, "foreign")
            logger.warning("%s: %s was not this user's private file; moved it to %s",
                           what, path, aside.name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
        except OSError as exc:
            raise _path_error(path, exc, "create") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = "this process" if holder == str(os.getpid()) else (
                f"process {holder}" if holder else "another process")
            raise InUseError(in_use_message(what, env_dir, who)) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd
        _HELD.add(self)

    def release(self, unlock: bool = True) -> None:
        """Give up the claim; ``unlock=False`` only closes this process's copy (what a
        forked child inherited)."""
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is not None:
            try:
                if unlock:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace directory as ``namespace.json`` describes it."""

    fingerprint: str
    path: Path
    description: dict[str, Any]
    format_version: int
    parts: tuple[tuple[Part, int], ...] = ()  # (part, replica) of each part directory


def namespace_record(fingerprint: str, description: dict[str, Any],
                     part: Part | None = None) -> dict[str, Any]:
    """What ``namespace.json`` holds; the "meta" sub-db's record adds the ``part``."""
    record = {"fingerprint": fingerprint, "format_version": FORMAT_VERSION,
              "namespace": description}
    if part is not None:
        record["part"] = part.name
    return record


MAX_NAMESPACE_JSON_BYTES = 1 << 20  # tierkv writes a few hundred bytes


def list_namespaces(root: Path) -> list[NamespaceInfo]:
    """Namespaces under ``root`` from their ``namespace.json`` (unreadable ones are skipped:
    missing, too big, not JSON, nested too deep, or not the shape tierkv writes)."""
    infos: list[NamespaceInfo] = []
    for ns_dir in StoreLayout(root).namespace_dirs():
        if check_dir(ns_dir, fix=False) is not Trust.OK:
            continue
        try:
            raw = read_private_file(ns_dir / "namespace.json", MAX_NAMESPACE_JSON_BYTES)
            if raw is None:
                raise ValueError("missing, or not a regular file of this user's")
            if len(raw) > MAX_NAMESPACE_JSON_BYTES:
                raise ValueError(f"larger than {MAX_NAMESPACE_JSON_BYTES} bytes")
            record = json.loads(raw.decode())
            description = dict(record["namespace"])
            version = int(record["format_version"])
            fingerprint = str(record["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            logger.warning("disk tier: skipping %s: unreadable namespace.json (%s)", ns_dir, exc)
            continue
        parts = sorted(found for found in (StoreLayout.parse_part_dir(entry.name)
                                           for entry in StoreLayout.part_dirs(ns_dir)) if found)
        infos.append(NamespaceInfo(fingerprint, ns_dir, description, version, tuple(parts)))
    return infos


def closest_namespace(root: Path, namespace: Namespace) -> tuple[NamespaceInfo, list[str]] | None:
    """Of the *other* namespaces under ``root``, the one that differs from ``namespace`` in
    the fewest settings, with those settings' names; None when there is none."""
    ours, fingerprint = namespace.describe(), namespace.fingerprint()
    others = [info for info in list_namespaces(root) if info.fingerprint != fingerprint]
    if not others:
        return None

    def differences(info: NamespaceInfo) -> list[str]:
        return [name for name in ours if info.description.get(name) != ours[name]]

    closest = min(others, key=lambda info: len(differences(info)))
    return closest, differences(closest)


# What each namespace field is, in words, for the lines that say how two namespaces differ.
DIMENSIONS = {
    "model_id": "the model", "dtype": "the KV dtype", "kv_layout": "the KV page layout",
    "page_bytes": "bytes per page", "tokens_per_chunk": "tokens per chunk",
    "num_layers": "layers", "rank_layout": "MLA or per-head parts",
    "hash_scheme": "the token hashing (vLLM's hash algorithm, PYTHONHASHSEED, hash block size)",
    "format_version": "tierkv's value format", "extra": "the caller's extra",
    "layer_names": "the layers' names and order", "blocks_per_chunk": "engine blocks per chunk",
    "chunk_bytes": "bytes per chunk", "num_kv_heads": "KV heads",
    "model_fingerprint": "the weights and config",
}
_VLLM_EXTRA = re.compile(r"^vllm-(\d+\.\d+)")


def _dimension(name: str, there: Any, here: Any) -> str:
    """What field ``name`` is, and for the vLLM minor version how to match it."""
    minors = [_VLLM_EXTRA.match(value) if isinstance(value, str) else None
              for value in (there, here)]
    if name == "extra" and minors[0] and minors[1] and minors[0][1] != minors[1][1]:
        return (f"the vLLM minor version: vLLM {minors[1][1]} never reads chunks written for "
                f"vLLM {minors[0][1]}; warm up for the serving vLLM with `tierkv warmup "
                f"--vllm-version <its version>` (the default from the engine's venv), or "
                f"serve with vLLM {minors[0][1]}")
    return DIMENSIONS.get(name, name)


def describe_differences(info: NamespaceInfo, names: list[str], namespace: Namespace,
                         hints: dict[str, str] | None = None) -> str:
    """``model_id is 'a' there, 'b' here (the model; hint); ...`` for the settings
    ``names``: each value, what the setting is (:data:`DIMENSIONS`) and, given ``hints``,
    the option that sets it."""
    ours = namespace.describe()
    out = []
    for name in names:
        there = info.description.get(name)
        notes = [_dimension(name, there, ours[name])] + (
            [hints[name]] if hints and name in hints else [])
        out.append(f"{name} is {there!r} there, {ours[name]!r} here ({'; '.join(notes)})")
    return "; ".join(out)


def empty_namespace_warning(root: Path, namespace: Namespace, found: int) -> str | None:
    """The warning for a store opened with no chunk of its namespace while ``root`` holds
    others (a setting that changed since they were written, most likely), or None."""
    if found:
        return None
    closest = closest_namespace(root, namespace)
    if closest is None:
        return None
    info, names = closest
    return (f"0 chunks found for namespace {namespace.fingerprint()[:8]} under {root}, which "
            f"holds other namespaces; the closest, {info.fingerprint[:8]}, differs in: "
            f"{describe_differences(info, names, namespace)}. Chunks stored under other "
            f"settings are never served; match them to use those chunks")
