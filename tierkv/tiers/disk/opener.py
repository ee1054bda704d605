"""The one way a disk tier is opened (the library store, both vLLM connector roles, the
warm-up, the operator tools and why-miss), by what the opener is to it:

- ``"writer"``: the part's one writer (a store, a vLLM worker, the warm-up). Claimed at
  open, before anything is judged or moved (:class:`~tierkv.tiers.disk.files.OwnerLock`):
  a writer of another process is refused, and so is a second writer of this process
  (refused here, before LMDB opens the environment a second time). ``refusal`` (the vLLM
  connector's words) replaces the start of the message then.
- ``"scan"``: the vLLM scheduler at start. Writable (it deletes what only some parts hold,
  and what is over the cap) but unclaimed: it shares this process's handle of the
  environment when there is one, as LMDB allows one handle per environment and process.
- ``"follower"``: read-only, a part another rank writes, waited for (``wait_seconds``)
  while that rank creates it (both start at once).
- ``"tool"``: read-only (``repair=True``: writable, repairing what is damaged, the claim
  taken if no one holds it), for the CLI tools, why-miss and the readers of another part
  count; ``shards=`` opens some shards. :func:`tool_config` sizes its maps from the files.

:class:`OtherParts` reads the parts another part count wrote (another TP size), each
opened as a tool at its first read.

Writers and scans are kept in one process-wide registry (each handle counted):
:func:`close_disk` gives one back, and closes the tier when it was the last. Any other
tier is closed by :func:`close_disk` too (or ``tier.close()``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Literal

from tierkv.config import DiskTierConfig
from tierkv.errors import BrokenError, ConfigError, DamagedError
from tierkv.keys import Namespace, Part, as_part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.disk.files import InUseError, in_use_message
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.tier import DiskTier
from tierkv.units import MiB

__all__ = ["FOLLOWER_WAIT_SECONDS", "OtherParts", "Role", "close_disk", "open_disk",
           "tool_config"]

logger = logging.getLogger("tierkv.disk")

Role = Literal["writer", "scan", "follower", "tool"]
FOLLOWER_WAIT_SECONDS = 30.0  # for the writing rank to create its environment at start


@dataclass
class _Held:
    tier: DiskTier
    count: int  # writers and scans holding it
    writer: bool  # a writer holds it


_LOCK = threading.Lock()
_HELD: dict[Path, _Held] = {}  # this process's writable handles, by environment path


def tool_config(root: Path, file_bytes: int) -> DiskTierConfig:
    """The settings a tool reads an environment of ``file_bytes`` with: maps big enough for
    what is there, nothing synced until it closes."""
    return DiskTierConfig(path=Path(root), max_bytes=max(2 * file_bytes, 64 * MiB),
                          sync_mode="close")


def open_disk(config: DiskTierConfig, namespace: Namespace, part: Part | int, role: Role, *,
              payload_bytes: int, replica: int = 0, refusal: str | None = None,
              wait_seconds: float = FOLLOWER_WAIT_SECONDS, repair: bool = False,
              shards: Sequence[int] | None = None) -> DiskTier:
    """The disk tier of ``namespace``'s ``part`` under ``config.path``, opened for ``role``
    (see the module docstring)."""
    if config.path is None:
        raise ConfigError("disk tier: disk.path is None (no disk tier) but a disk tier was opened")
    root, part = Path(config.path), as_part(part)
    path = StoreLayout(root).part_dir(namespace.fingerprint(), part, replica)
    new = partial(DiskTier, root, namespace, part, config, payload_bytes, replica=replica)
    if role == "follower":
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                return new(read_only=True)
            except (ConfigError, DamagedError, BrokenError) as exc:  # not (fully) created yet
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        f"tierkv: {path} (the environment of part {part.name}, which another "
                        f"rank writes) could not be read within {wait_seconds:.0f} s: {exc}"
                    ) from exc
                time.sleep(0.05)
    if role == "tool":
        return new(read_only=not repair, repair=repair, shards=shards)
    writer = role == "writer"
    with _LOCK:
        held = _HELD.get(path.resolve())
        try:
            if held is None:
                held = _Held(new(exclusive=writer), 0, False)
            elif writer and held.writer:
                raise InUseError(in_use_message(
                    f"disk tier (namespace {namespace.fingerprint()[:8]}, part {part.name})",
                    path, "this process"))
            elif writer:
                held.tier.claim()
        except InUseError as exc:  # a ConfigError, and says so by its name too
            raise ConfigError(str(exc) if refusal is None else f"{refusal} ({exc})") from exc
        held.count += 1
        held.writer = held.writer or writer
        _HELD[path.resolve()] = held
        return held.tier


def close_disk(tier: DiskTier, *, writer: bool = False) -> None:
    """Give back a tier :func:`open_disk` opened (``writer``: as the part's writer); it is
    closed when no writer or scan of this process holds it any more."""
    with _LOCK:
        path = tier.path.resolve()
        held = _HELD.get(path)
        if held is not None and held.tier is tier:
            held.count -= 1
            held.writer = held.writer and not writer
            if held.count > 0:
                return
            del _HELD[path]
    tier.close()


@dataclass
class OtherPartsCounts:
    """What a worker's :class:`OtherParts` counts."""

    opened: int = 0  # parts of another part count opened for reading
    # Parts of another part count not read: damaged, misplaced or untrusted (warned about
    # once each, never reopened).
    skipped: int = 0


class OtherParts:
    """The parts of other part counts on disk, as one worker reads them: each part's
    environment opened read-only and unclaimed at its first read, kept open after (another
    engine writes it; this one never claims, writes or repairs it). ``read_part_into``
    answers ``MISSING`` for a part whose environment is not there, and for one that cannot
    be read (damaged, misplaced: another part's or namespace's directory in its place, or
    untrusted): that one is warned about once, counted in ``counts().skipped`` and
    remembered, never reopened by later reads."""

    def __init__(self, namespace: Namespace, config: DiskTierConfig, model_chunk_bytes: int,
                 replica: int = 0) -> None:
        self.namespace, self.config = namespace, config
        self.model_chunk_bytes, self.replica = model_chunk_bytes, replica
        self._tiers: dict[Part, DiskTier | None] = {}
        self._counts = OtherPartsCounts()
        self._lock = threading.Lock()

    def _tier(self, part: Part) -> DiskTier | None:
        with self._lock:
            if part in self._tiers:
                return self._tiers[part]
            tier: DiskTier | None
            try:
                tier = open_disk(self.config, self.namespace, part, "tool",
                                 payload_bytes=self.model_chunk_bytes // part.count,
                                 replica=self.replica)
                self._counts.opened += 1
            except (ConfigError, DamagedError, BrokenError) as exc:  # MisplacedError too
                logger.warning("tierkv: part %s on disk cannot be read, its chunks are misses "
                            "until a restart: %s", part.name, exc)
                self._counts.skipped += 1
                tier = None
            self._tiers[part] = tier
            return tier

    def counts(self) -> OtherPartsCounts:
        with self._lock:
            return replace(self._counts)

    def read_part_into(self, key: bytes, part: Part, out: memoryview) -> ReadStatus:
        tier = self._tier(part)
        if tier is None:
            return ReadStatus.MISSING
        return tier.read_into(key, out)

    def close(self) -> None:
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        for tier in tiers:
            if tier is not None:
                tier.close()
