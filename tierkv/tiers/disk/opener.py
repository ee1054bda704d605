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

Writers and scans are kept in one process-wide registry (each handle counted):
:func:`close_disk` gives one back, and closes the tier when it was the last. Any other
tier is closed by :func:`close_disk` too (or ``tier.close()``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from tierkv.config import DiskTierConfig
from tierkv.errors import BrokenError, ConfigError, DamagedError
from tierkv.keys import Namespace, Part, as_part
from tierkv.tiers.disk.files import InUseError, in_use_message
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.tier import DiskTier
from tierkv.units import MiB

__all__ = ["FOLLOWER_WAIT_SECONDS", "Role", "close_disk", "open_disk", "tool_config"]

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
                raise InUseError(in_use_message(f"disk tier (part {part.name})", path,
                                                "a writer of this process"))
            elif writer:
                held.tier.claim()
        except InUseError as exc:
            if refusal is None:
                raise
            raise ConfigError(f"{refusal} ({exc})") from exc
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
