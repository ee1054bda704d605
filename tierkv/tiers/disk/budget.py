"""One cap per disk path: every namespace under a store root (``disk.path``) shares
``disk.max_bytes`` (docs/operations.md, "One cap per disk path").

Who holds what under the root (:func:`survey`), per ``ns-<fingerprint>/part-<p>of<P>``, in the
cap's units (chunks x (chunk + overhead), what a store's index enforces):

- a rank a running store claims (``tierkv-owner.lock``, :func:`claimant`) holds what it
  reserved in its ``tierkv-share.json`` (its disk capacity);
- a rank whose store stopped holds what that store left there, as it wrote at close (or,
  after a crash, the last it reserved);
- a rank without a share file (a warm-up's, the vLLM connector's, an older tierkv's)
  holds the bytes of its files.

:class:`DiskBudget` is one store's share: running stores that publish a share split the cap
equally (an entitlement of ``cap // n``), and a store's capacity is its entitlement or what
the others' reservations and the unclaimed namespaces leave, whichever is less. When a store
wants more than it has, room is taken first from namespaces no engine has claimed, least
recently used (last written) first: each is claimed as an engine would claim it (so no engine
starts on it meanwhile; refused while anyone holds it), renamed out of the root and deleted.
Then the store's own eviction does the rest. Stores recompute their share at their next
call whenever the root directory changed (a store started, stopped or moved its share, which
it signals by making and removing a file there; a namespace came or went), every
``disk.budget_check_seconds``, and whenever they are full: a store that starts beside a
running one gets its share once the running one has shrunk to its own (it never takes room
another has reserved). Safe with several stores and tools on one root: every decision reads
the files anew, deletions take the claims first, and tools that read (inspect, verify) only
see a namespace disappear.

Also here, shared with ``tierkv rm``: :func:`environments`, :func:`claimant`,
:func:`claim_namespace`, :func:`tree_bytes` and :func:`delete_tree`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.checks import is_int
from tierkv.errors import BrokenError, ConfigError
from tierkv.tiers.disk.files import (OWNER_FILE, OwnerLock, Trust, check_dir, read_private_file,
                                     write_private_file)
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.units import format_bytes

logger = logging.getLogger("tierkv.disk")

SHARE_FILE = "tierkv-share.json"
_MAX_SHARE_BYTES = 4096


# ------------------------------------------------------------------------------ claims
def environments(ns_dir: Path) -> list[Path]:
    """Where an engine holds its claim under ``ns_dir``: each ``part-<p>of<P>/shard-<s>``
    (older formats: ``rank-<r>/shard-<s>``, and ``rank-<r>`` itself where it is format 2's
    one environment per rank)."""
    found: list[Path] = []
    for rank_dir in sorted([*StoreLayout.part_dirs(ns_dir), *StoreLayout.old_rank_dirs(ns_dir)]):
        if not StoreLayout.is_part_dir(rank_dir.name) or rank_dir.is_symlink() or not rank_dir.is_dir():
            continue
        found += _rank_environments(rank_dir)
    return found


def _rank_environments(rank_dir: Path) -> list[Path]:
    found = [rank_dir] if any((rank_dir / name).exists()
                              for name in ("data.mdb", OWNER_FILE)) else []
    return found + [shard for shard in StoreLayout.shard_dirs(rank_dir)
                    if not shard.is_symlink() and shard.is_dir()]


def claimant(env_dir: Path) -> str | None:
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


def claim_namespace(ns_dir: Path, what: str,
                    refused: Callable[[Path, str], ConfigError]) -> list[OwnerLock]:
    """The claim of every environment of ``ns_dir``, as an engine takes it (so none starts
    on it meanwhile); ``refused(env_dir, who)`` is raised when someone holds one."""
    locks: list[OwnerLock] = []
    try:
        for env_dir in environments(ns_dir):
            try:
                locks.append(OwnerLock(env_dir, what))
            except ConfigError:
                who = claimant(env_dir)
                if who is None:
                    raise
                raise refused(env_dir, who) from None
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def tree_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (links are counted as links, never followed)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def delete_tree(root: Path, ns_dir: Path) -> None:
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


# ------------------------------------------------------------------------------ survey
@dataclass
class Holding:
    """One namespace under the root (other than the surveying store's own rank)."""

    fingerprint: str
    path: Path
    model_id: str
    file_bytes: int = 0  # every file under it (the surveying store's own rank left out)
    last_used: float = 0.0  # the newest write of its data files (seconds since the epoch)
    claimed_by: list[str] = field(default_factory=list)  # holders of its ranks' claims
    engines: int = 0  # claimed ranks that publish a share (running stores)
    held: int = 0  # what counts against the cap (see the module docstring)

    @property
    def deletable(self) -> bool:
        return not self.claimed_by


def _share_of(rank_dir: Path) -> tuple[int, bool] | None:
    """What the store of ``rank_dir`` reserved (or left, when it stopped) and whether it
    said it runs, when it says so."""
    raw = read_private_file(rank_dir / SHARE_FILE, _MAX_SHARE_BYTES)
    if raw is None or len(raw) > _MAX_SHARE_BYTES:
        return None
    try:
        record = json.loads(raw.decode())
        reserved, running = record["reserved_bytes"], record.get("running", True)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None
    if not is_int(reserved, low=0):
        return None
    return reserved, running is True


def _model_of(ns_dir: Path) -> str:
    raw = read_private_file(ns_dir / "namespace.json", 1 << 20)
    try:
        return str(json.loads((raw or b"{}").decode())["namespace"]["model_id"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "?"


def survey(root: Path, own: tuple[str, str | frozenset[str]] | None = None) -> list[Holding]:
    """Every ``ns-<fingerprint>`` directory under ``root`` with what it holds; ``own``
    (fingerprint, part directory name, or the names of every part of the surveying engine)
    is left out of its namespace. A
    namespace that disappears meanwhile (deleted by another store, ``tierkv rm``) is left
    out."""
    holdings: list[Holding] = []
    if own is not None and isinstance(own[1], str):
        own = (own[0], frozenset((own[1],)))
    for ns_dir in StoreLayout(root).namespace_dirs():
        try:
            if ns_dir.is_symlink() or check_dir(ns_dir, fix=False) is not Trust.OK:
                continue
            holdings.append(_holding(ns_dir, own))
        except OSError:
            continue
    return holdings


def _holding(ns_dir: Path, own: tuple[str, str | frozenset[str]] | None) -> Holding:
    fingerprint = StoreLayout.fingerprint_of(ns_dir)
    holding = Holding(fingerprint, ns_dir, _model_of(ns_dir))
    rest = 0  # moved-aside ranks and leftovers (namespace.json only names the namespace)
    for entry in sorted(ns_dir.iterdir()):
        if entry.name == "namespace.json":
            holding.file_bytes += entry.lstat().st_size
            continue
        if entry.is_symlink() or not entry.is_dir():
            continue
        if not StoreLayout.is_part_dir(entry.name):
            rest += tree_bytes(entry)
            continue
        if own is not None and own[0] == fingerprint and entry.name in own[1]:
            continue
        rank_bytes = tree_bytes(entry)
        holding.file_bytes += rank_bytes
        for data in StoreLayout.data_files(entry):
            with suppress(OSError):
                holding.last_used = max(holding.last_used, data.stat().st_mtime)
        who = next((found for env in _rank_environments(entry)
                    if (found := claimant(env)) is not None), None)
        share = _share_of(entry)
        if who is not None:
            holding.claimed_by.append(who)
            holding.engines += share is not None and share[1]  # a running store's share
        holding.held += rank_bytes if share is None else share[0]
    holding.file_bytes += rest
    if not holding.claimed_by and (own is None or own[0] != fingerprint):
        holding.held += rest  # part of what deleting it frees
    return holding


def _age(seconds: float) -> str:
    for unit, name in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if seconds >= unit:
            count = int(seconds // unit)
            return f"{count} {name}{'s' if count != 1 else ''} ago"
    return "just now"


# ------------------------------------------------------------------------------ budget
class DiskBudget:
    """One store's share of ``cap_bytes`` under ``root``, in chunks of ``unit_bytes``
    (chunk + per-chunk overhead); see the module docstring. Its own part directory is
    (``fingerprint``, ``part_dir``), which the store claims; :meth:`plan` publishes the
    share there, :meth:`release` withdraws it.

    An engine that writes ``parts`` parts of each chunk (the vLLM connector at TP > 1) has
    one budget per part, each over ``unit_bytes`` of a whole chunk (every part) and blind
    to its ``siblings`` (the engine's other part directories): they plan the same capacity
    and each publishes its part's share (``1 / parts`` of it), so other engines see the
    engine's whole reservation once. (Before, the second rank's budget counted the first
    rank's published share as another holder's and the engine's capacity fell to a chunk
    or two once the workers had created their directories before the scheduler planned.)"""

    def __init__(self, root: Path, fingerprint: str, part_dir: str, cap_bytes: int,
                 unit_bytes: int, *, check_seconds: float, parts: int = 1,
                 siblings: tuple[str, ...] = (),
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.fingerprint, self.part_dir = fingerprint, part_dir
        self.parts = max(parts, 1)
        self._own_dirs = frozenset((part_dir, *siblings))
        self.cap_bytes, self.unit_bytes = cap_bytes, unit_bytes
        self.check_seconds = check_seconds
        self._clock, self._wall_clock = clock, wall_clock
        self._rank_dir = StoreLayout(self.root).namespace_dir(fingerprint) / part_dir
        self._checked = -float("inf")
        self._seen: int | None = -1  # the root's mtime when last planned (see due())
        self._published: int | None = None
        self.capacity = 0  # chunks, as last planned
        self.entitlement = cap_bytes  # bytes: cap // running stores, as last planned
        self.deletable = 0  # namespaces no engine claims, as last surveyed
        self.deleted: list[str] = []  # fingerprints of the namespaces this budget deleted
        self.others: list[Holding] = []

    def _stamp(self) -> int | None:
        """The root directory's mtime: it changes when a namespace comes or goes, and when a
        store's share changes (:meth:`_signal`)."""
        try:
            return os.stat(self.root).st_mtime_ns
        except OSError:
            return None

    def due(self, full: bool) -> bool:
        """Whether to plan again: the root changed (a store started, stopped or moved its
        share; a namespace came or went: one ``stat``), ``check_seconds`` passed, or the
        store is ``full`` while unclaimed namespaces could give room."""
        return self._stamp() != self._seen or self._clock() - self._checked >= self.check_seconds \
            or (full and self.deletable > 0 and self.capacity * self.unit_bytes < self.entitlement)

    def plan(self, wanted_chunks: int) -> int:
        """The store's capacity in chunks now, having deleted least recently used unclaimed
        namespaces, one by one, while it has room for fewer than ``wanted_chunks`` and less
        than its entitlement; published in its rank's share file."""
        self._checked = self._clock()
        self._seen = self._stamp()  # before the survey: what changes meanwhile is seen next
        others = survey(self.root, (self.fingerprint, self._own_dirs))
        engines = 1 + sum(holding.engines for holding in others)
        entitlement = self.cap_bytes // engines
        wanted = min(wanted_chunks * self.unit_bytes, entitlement)
        deletable = sorted((h for h in others if h.deletable and h.fingerprint != self.fingerprint),
                           key=lambda holding: holding.last_used)

        def allowed() -> int:
            return min(entitlement, self.cap_bytes - sum(h.held for h in others))

        while allowed() < wanted and deletable:
            victim = deletable.pop(0)
            if self._delete(victim):
                others.remove(victim)
        self.others, self.entitlement = others, entitlement
        self.deletable = len(deletable)
        self.capacity = max(allowed(), 0) // self.unit_bytes
        self._publish(self.capacity * self.unit_bytes // self.parts)
        return self.capacity

    def _delete(self, victim: Holding) -> bool:
        def refused(env_dir: Path, who: str) -> ConfigError:
            return ConfigError(f"{env_dir} is claimed by {who}")

        try:
            locks = claim_namespace(victim.path, f"disk budget of {self.root}", refused)
        except (ConfigError, OSError) as exc:  # claimed meanwhile: it stays, and counts
            logger.info("tierkv: namespace %s not deleted to make room: %s",
                        victim.fingerprint[:8], exc)
            return False
        try:
            delete_tree(self.root, victim.path)
        except BrokenError as exc:
            logger.warning("tierkv: %s", exc)
            return False
        finally:
            for lock in locks:
                lock.release()
        self.deleted.append(victim.fingerprint)
        logger.warning(
            "tierkv: deleted namespace %s (model %s, %s, last written %s) under %s: "
            "disk.max_bytes=%s is one cap for every namespace there, and no engine "
            "claimed it (least recently used first)", victim.fingerprint[:8],
            victim.model_id, format_bytes(victim.file_bytes, 2),
            _age(self._wall_clock() - victim.last_used), self.root,
            format_bytes(self.cap_bytes))
        return True

    def _publish(self, reserved: int, running: bool = True) -> None:
        """Write the share file when the reservation changed, and tell the other stores."""
        if reserved == self._published:
            return
        record = {"pid": os.getpid(), "reserved_bytes": reserved, "running": running}
        with suppress(OSError):
            write_private_file(self._rank_dir / SHARE_FILE,
                               (json.dumps(record) + "\n").encode())
            self._published = reserved
        self._signal()

    def _signal(self) -> None:
        """Change the root's mtime (a file made and removed at once), so that every store
        on the root plans again at its next call (:meth:`due`)."""
        name = self.root / f".tierkv-budget-{os.getpid()}-{time.time_ns()}"
        with suppress(OSError):
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            os.unlink(name)

    def release(self, held_chunks: int) -> None:
        """The store closes (its claim goes with it): its share becomes what it leaves on
        disk, ``held_chunks``."""
        self._published = None
        self._publish(max(held_chunks, 0) * self.unit_bytes // self.parts, running=False)

    def start_line(self) -> str | None:
        """The start-up line: the other namespaces under the root, their sizes, ages and
        holders, this store's share, and how to delete one; None when there are none."""
        others = [h for h in self.others if h.fingerprint != self.fingerprint]
        if not others:
            return None
        now = self._wall_clock()
        parts = []
        for holding in sorted(others, key=lambda h: -h.file_bytes):
            holder = (f"in use by {', '.join(holding.claimed_by)}" if holding.claimed_by
                      else "no engine: deleted first when room is needed")
            parts.append(f"{holding.fingerprint[:8]} (model {holding.model_id}, "
                         f"{format_bytes(holding.file_bytes, 2)}, last written "
                         f"{_age(now - holding.last_used) if holding.last_used else 'never'}, "
                         f"{holder})")
        unclaimed = [h for h in others if h.deletable]
        advice = (f"; delete one now with: tierkv rm {self.root} --namespace "
                  f"{unclaimed[0].fingerprint[:8]} --yes" if unclaimed else
                  f"; tierkv rm {self.root} --namespace PREFIX --yes deletes one once its "
                  f"engine stopped")
        return (f"disk.path {self.root} holds {len(others)} other namespace(s), within the "
                f"one cap disk.max_bytes={format_bytes(self.cap_bytes)} for all: "
                + "; ".join(parts) + f". This store's share now: "
                f"{format_bytes(self.capacity * self.unit_bytes, 2)}" + advice)
