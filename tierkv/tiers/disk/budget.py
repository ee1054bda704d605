"""One cap per disk path: every namespace under a store root (``disk.path``) shares
``disk.max_bytes`` (docs/operations.md, "One cap per disk path"), which bounds the bytes the
files under the root take on disk (allocated blocks, ``st_blocks``).

Room is shared by what each namespace USES, not by what it may take. Who uses what under
the root (:func:`survey`), per ``ns-<fingerprint>/part-<p>of<P>``:

- every rank uses the bytes its files take on disk (measured at each plan);
- a rank a running store claims (``tierkv-owner.lock``, :func:`claimant`) that publishes a
  ``tierkv-share.json`` also holds what that store reserved (its capacity, what it uses and
  a bounded step more) and, up to a fair share, what it wants (it is full and wants to
  grow): that much room is left to it by the others;
- a rank no running store plans for (stopped, a warm-up's, the vLLM connector's workers
  without a share, an older tierkv's) holds only the bytes of its files.

:class:`DiskBudget` is one store's share, planned under a lock on the root (one plan at a
time, so two stores never give themselves the same free room): with ``n`` running stores a
store's entitlement is ``cap // n``; its capacity is what it wants (what it holds and a
step more) as far as the others' holdings leave room, and never less than what it holds or
its entitlement, whichever is less (a store that restarts keeps its chunks; one over its
entitlement shrinks to it only while another store wants the room). A namespace no engine
claims is deleted only when the root is full: what every namespace uses leaves no room for
one more chunk of a store that holds less than its entitlement and wants more; then the
least recently used (last written) first, each claimed as an engine would claim it (so no
engine starts on it meanwhile; refused while anyone holds it), renamed out of the root and
deleted. Then the store's own eviction does the rest. Stores plan again at their next call
whenever the root directory changed (a store started, stopped or moved its share, which it
signals by making and removing a file there; a namespace came or went), every
``disk.budget_check_seconds``, and whenever they are full below their entitlement. Safe
with several stores and tools on one root: every decision reads the files anew, deletions
take the claims first, and tools that read (inspect, verify) only see a namespace disappear.

Also here, shared with ``tierkv rm``: :func:`environments`, :func:`claimant`,
:func:`claim_namespace`, :func:`tree_bytes`, :func:`allocated_bytes` and :func:`delete_tree`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.checks import is_int
from tierkv.errors import BrokenError, ConfigError
from tierkv.tiers.disk.files import (OWNER_FILE, OwnerLock, Trust, check_dir, read_private_file,
                                     write_private_file)
from tierkv.tiers.disk.env import SHARDS
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.slab import SLAB_NAME
from tierkv.units import format_bytes

logger = logging.getLogger("tierkv.disk")

SHARE_FILE = "tierkv-share.json"
_MAX_SHARE_BYTES = 4096
# What a shard's index files may grow between two plans (LMDB pages: copy-on-write and the
# free list); measured: under 16 KiB a plan apart in tests/integration/test_disk_budget.py.
INDEX_GROWTH_BYTES = 16 << 10


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
    return _walk_bytes(path, lambda info: info.st_size)


def allocated_bytes(path: Path, skip: frozenset[str] = frozenset()) -> int:
    """Disk space every file under ``path`` takes (``st_blocks * 512``: what the cap
    bounds; a sparse file's holes take none), files named in ``skip`` left out."""
    if path.is_file() and not path.is_symlink():
        with suppress(OSError):
            return os.lstat(path).st_blocks * 512
        return 0
    return _walk_bytes(path, lambda info: info.st_blocks * 512, skip)


def _walk_bytes(path: Path, size: Callable[[os.stat_result], int],
                skip: frozenset[str] = frozenset()) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            if name not in skip:
                with suppress(OSError):
                    total += size(os.lstat(os.path.join(folder, name)))
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
@dataclass(frozen=True)
class Share:
    """What a store published for its rank (``tierkv-share.json``), in bytes of the cap."""

    reserved: int  # its capacity (what it holds, a step more, its index files)
    wanted: int  # what it would take now, up to its entitlement
    running: bool
    parts: int = 1  # the engine's parts, each publishing its part's share


@dataclass
class Holding:
    """One namespace under the root (other than the surveying store's own rank)."""

    fingerprint: str
    path: Path
    model_id: str
    file_bytes: int = 0  # disk space of every file under it (own ranks left out)
    last_used: float = 0.0  # the newest write of its data files (seconds since the epoch)
    claimed_by: list[str] = field(default_factory=list)  # holders of its ranks' claims
    engines: int = 0  # claimed ranks that publish a share (running stores)
    used: int = 0  # disk space its files take (what deleting it frees)
    shares: list[tuple[Share, int]] = field(default_factory=list)  # running ranks': (share, used)

    @property
    def deletable(self) -> bool:
        return not self.claimed_by

    def held(self, entitlement: int) -> int:
        """What counts against the cap for another store whose entitlement is
        ``entitlement``: the bytes its files take, and for a running store's rank the room it
        reserved and, up to ``entitlement``, the room it wants."""
        running = sum(used for _, used in self.shares)
        return self.used - running + sum(
            max(share.reserved, min(share.wanted, entitlement // share.parts), used)
            for share, used in self.shares)


def _share_of(rank_dir: Path) -> Share | None:
    """What the store of ``rank_dir`` published, when it says so."""
    raw = read_private_file(rank_dir / SHARE_FILE, _MAX_SHARE_BYTES)
    if raw is None or len(raw) > _MAX_SHARE_BYTES:
        return None
    try:
        record = json.loads(raw.decode())
        reserved, running = record["reserved_bytes"], record.get("running", True)
        wanted, parts = record.get("wanted_bytes", reserved), record.get("parts", 1)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None
    if not is_int(reserved, low=0) or not is_int(wanted, low=0) or not is_int(parts, low=1):
        return None
    return Share(reserved, wanted, running is True, parts)


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
            holding.file_bytes += allocated_bytes(entry)
            continue
        if entry.is_symlink() or not entry.is_dir():
            continue
        if not StoreLayout.is_part_dir(entry.name):
            rest += allocated_bytes(entry)
            continue
        if own is not None and own[0] == fingerprint and entry.name in own[1]:
            continue
        rank_bytes = allocated_bytes(entry)
        holding.file_bytes += rank_bytes
        holding.used += rank_bytes
        for data in StoreLayout.data_files(entry):
            with suppress(OSError):
                holding.last_used = max(holding.last_used, data.stat().st_mtime)
        who = next((found for env in _rank_environments(entry)
                    if (found := claimant(env)) is not None), None)
        share = _share_of(entry)
        if who is not None:
            holding.claimed_by.append(who)
            if share is not None and share.running:  # a running store's share
                holding.engines += 1
                holding.shares.append((share, rank_bytes))
    holding.file_bytes += rest
    holding.used += rest  # on disk too (the store's own namespace.json is its own count)
    if own is None or own[0] != fingerprint:
        holding.used = holding.file_bytes
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

    ``min_step``: the chunks the store may spill between two plans (its CPU slots), the
    least room it asks for beyond what it holds (:meth:`step`).

    An engine that writes ``parts`` parts of each chunk (the vLLM connector at TP > 1) has
    one budget per part, each over ``unit_bytes`` of a whole chunk (every part) and blind
    to its ``siblings`` (the engine's other part directories): they plan the same capacity
    and each publishes its part's share (``1 / parts`` of it), so other engines see the
    engine's whole reservation once. (Before, the second rank's budget counted the first
    rank's published share as another holder's and the engine's capacity fell to a chunk
    or two once the workers had created their directories before the scheduler planned.)"""

    def __init__(self, root: Path, fingerprint: str, part_dir: str, cap_bytes: int,
                 unit_bytes: int, *, check_seconds: float, parts: int = 1,
                 siblings: tuple[str, ...] = (), min_step: int = 1,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.fingerprint, self.part_dir = fingerprint, part_dir
        self.parts = max(parts, 1)
        self._own_dirs = frozenset((part_dir, *siblings))
        self.cap_bytes, self.unit_bytes = cap_bytes, unit_bytes
        self.check_seconds = check_seconds
        self.min_step = max(min_step, 1)
        self._clock, self._wall_clock = clock, wall_clock
        self._rank_dir = StoreLayout(self.root).namespace_dir(fingerprint) / part_dir
        self._checked = -float("inf")
        self._seen: int | None = -1  # the root's mtime when last planned (see due())
        self._published: Share | None = None
        self.capacity = 0  # chunks, as last planned
        self.fixed_bytes = 0  # bytes of its files other than slots, as last planned
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
        store is ``full`` below its entitlement (more room may be there, or be freed)."""
        return self._stamp() != self._seen or self._clock() - self._checked >= self.check_seconds \
            or (full and self.capacity * self.unit_bytes + self.fixed_bytes < self.entitlement)

    def step(self) -> int:
        """The chunks a store wants beyond what it holds: an eighth of its entitlement, and
        at least ``min_step`` (what it may spill between two plans: its CPU slots), so it
        reserves room in steps as it fills, not all it may take."""
        return max(self.min_step, self.entitlement // self.unit_bytes // 8)

    def _own_fixed(self) -> int:
        """The disk space of this store's files other than its slabs' slots (its index
        files, claims, share file and its namespace's ``namespace.json``), measured, and
        :data:`INDEX_GROWTH_BYTES` per shard for what the index may grow before the next
        plan."""
        ns_dir = self._rank_dir.parent
        total = allocated_bytes(ns_dir / "namespace.json")
        for name in self._own_dirs:
            total += allocated_bytes(ns_dir / name, skip=frozenset((SLAB_NAME,)))
        if not (self._rank_dir / SHARE_FILE).exists():  # this plan writes it: a block
            with suppress(OSError):
                total += os.statvfs(self.root).f_frsize
        return total + INDEX_GROWTH_BYTES * SHARDS * len(self._own_dirs)

    @contextmanager
    def _planning(self, wait: bool) -> Iterator[bool]:
        """One plan at a time under the root (every process): an exclusive ``flock`` on the
        root directory itself (no file of its own there), so two stores never give
        themselves the same free room. Yields whether this one may plan: without ``wait``,
        not while another plans (or deletes a namespace): a store's call never waits on
        another's."""
        fd, mine = None, True
        with suppress(OSError):
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                mine = False
        try:
            yield mine
        finally:
            if fd is not None:
                os.close(fd)

    def plan(self, held_chunks: int, wanted_chunks: int | None = None, *,
             wait: bool = True) -> int:
        """The store's capacity in chunks now, holding ``held_chunks`` and wanting
        ``wanted_chunks`` (default: a :meth:`step` more); see the module docstring.
        Unclaimed namespaces are deleted, least recently used first, only while the root is
        full and the store is below its entitlement. Published in its rank's share file.
        Without ``wait``, while another store plans, the capacity stays as it was and the
        plan is due again at the next call."""
        with self._planning(wait) as mine:
            if not mine:
                self._seen = None
                return self.capacity
            self._checked = self._clock()
            self._seen = self._stamp()  # before the survey: what changes meanwhile is seen next
            others = survey(self.root, (self.fingerprint, self._own_dirs))
            engines = 1 + sum(holding.engines for holding in others)
            entitlement = self.cap_bytes // engines
            fixed, unit = self._own_fixed(), self.unit_bytes
            own = max(held_chunks, 0) * unit + fixed
            wanted = held_chunks + self.step() if wanted_chunks is None else wanted_chunks
            want = max(wanted * unit + fixed, own)
            deletable = sorted((h for h in others if h.deletable and h.fingerprint != self.fingerprint),
                               key=lambda holding: holding.last_used)
            while deletable and own + unit <= min(want, entitlement) and \
                    sum(h.used for h in others) + own + unit > self.cap_bytes:
                victim = deletable.pop(0)  # the root is full: the least recently used goes
                if self._delete(victim):
                    others.remove(victim)
            room = self.cap_bytes - sum(h.held(entitlement) for h in others)
            reserved = max(min(own, entitlement), min(want, room))
            self.others, self.entitlement, self.fixed_bytes = others, entitlement, fixed
            self.deletable = len(deletable)
            self.capacity = max(reserved - fixed, 0) // unit
            self._publish(self.capacity * unit + fixed, min(want, max(entitlement, own)))
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

    def _publish(self, reserved: int, wanted: int, running: bool = True) -> None:
        """Write the share file when it changed (each part's ``1 / parts``), and tell the
        other stores."""
        share = Share(reserved // self.parts, wanted // self.parts, running, self.parts)
        if share == self._published:
            return
        record = {"pid": os.getpid(), "reserved_bytes": share.reserved,
                  "wanted_bytes": share.wanted, "running": running, "parts": self.parts}
        with suppress(OSError):
            write_private_file(self._rank_dir / SHARE_FILE,
                               (json.dumps(record) + "\n").encode())
            self._published = share
        self._signal()

    def _signal(self) -> None:
        """Change the root's mtime (a file made and removed at once), so that every store
        on the root plans again at its next call (:meth:`due`)."""
        name = self.root / f".tierkv-budget-{os.getpid()}-{time.time_ns()}"
        with suppress(OSError):
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            os.unlink(name)

    def release(self, held_chunks: int) -> None:
        """The store closes (its claim goes with it): it plans for nothing any more, and
        counts with the bytes its files take, like any namespace no store runs on."""
        self._published = None
        held = max(held_chunks, 0) * self.unit_bytes + self.fixed_bytes
        self._publish(held, held, running=False)

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
