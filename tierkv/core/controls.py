"""RequestControls: what one request asks of the cache (docs/engine-adapter.md, "Per-request
controls"), and :func:`request_controls`, which reads them from a vLLM request's
``kv_transfer_params``.

- ``skip_load``: load nothing for the request (ask no tier); its chunks are still stored.
- ``skip_store``: store none of the request's chunks; hits still load.
- ``load_tiers``: the tiers a load may read (``cpu``, ``disk``, ``remote``); a hit ends at
  its first chunk held in another tier (None: every tier).
- ``load_deadline_ms``: what has loaded by then is served, the rest is recomputed, never
  waited for (None: the engine's ``load_deadline_ms``).

In ``kv_transfer_params``: ``{"tierkv": {"skip_load": true, "skip_store": true,
"load_deadline_ms": 50}}`` and vLLM's own ``kv_load_tiers`` (a list of matchers
``{"medium": "cpu" | "storage", "locality": "local" | "remote"}``, each part optional, as
vLLM's OffloadingConnector reads it; tierkv's tier names ``"cpu"``, ``"disk"``,
``"remote"`` are taken too). tierkv's tiers are vLLM's (medium, locality) pairs
:data:`TIER_MEDIA`. A value not understood raises :class:`ConfigError` naming the parameter
and what it takes; an empty list is no tier at all, as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierkv.errors import ConfigError

__all__ = ["LOAD_TIERS_KEY", "NO_CONTROLS", "TIER_MEDIA", "RequestControls", "request_controls"]

LOAD_TIERS_KEY = "kv_load_tiers"  # vLLM's name (its OffloadingConnector's KV_LOAD_TIERS_KEY)
# tierkv's tiers as vLLM's kv_load_tiers matchers name them: (medium, locality).
TIER_MEDIA = {"cpu": ("cpu", "local"), "disk": ("storage", "local"),
              "remote": ("storage", "remote")}
MEDIA = ("cpu", "storage")
LOCALITIES = ("local", "remote")
FLAGS = ("skip_load", "skip_store")


@dataclass(frozen=True)
class RequestControls:
    skip_load: bool = False
    skip_store: bool = False
    load_tiers: frozenset[str] | None = None  # None: every tier
    load_deadline_ms: float | None = None  # None: the engine's

    def __post_init__(self) -> None:
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"request control {name} must be true or false, got "
                                  f"{_shown(getattr(self, name))}")
        if self.load_tiers is not None and not (isinstance(self.load_tiers, frozenset)
                                                and self.load_tiers <= set(TIER_MEDIA)):
            raise ConfigError(f"request control load_tiers must be a frozenset of "
                              f"{list(TIER_MEDIA)} or None, got {_shown(self.load_tiers)}")
        deadline = self.load_deadline_ms
        if deadline is not None and (isinstance(deadline, bool)
                                     or not isinstance(deadline, (int, float))
                                     or not math.isfinite(deadline) or deadline < 0):
            raise ConfigError(f"request control load_deadline_ms must be a number of "
                              f"milliseconds >= 0 or null, got {_shown(deadline)}")

    def deadline_seconds(self, default_ms: float | None) -> float | None:
        """The load's deadline in seconds: the request's, else ``default_ms`` (the
        engine's); None: none."""
        ms = default_ms if self.load_deadline_ms is None else self.load_deadline_ms
        return None if ms is None else ms / 1000

    def allows(self, tier: str) -> bool:
        """Whether a load may read chunks held in ``tier``."""
        return not self.skip_load and (self.load_tiers is None or tier in self.load_tiers)


NO_CONTROLS = RequestControls()


def _shown(value: Any) -> str:
    return repr(value)[:80]  # a client's value: escaped and cut


def _tiers(raw: Any) -> frozenset[str]:
    """vLLM's ``kv_load_tiers`` as tierkv's tiers (see the module docstring)."""
    need = (f"{LOAD_TIERS_KEY} must be a list of tier names {list(TIER_MEDIA)} or matchers "
            f"{{\"medium\": one of {list(MEDIA)}, \"locality\": one of {list(LOCALITIES)}}}")
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{need}, got {_shown(raw)}")
    tiers: set[str] = set()
    for entry in raw:
        if isinstance(entry, str) and entry.lower() in TIER_MEDIA:
            tiers.add(entry.lower())
            continue
        if not isinstance(entry, Mapping) or set(entry) - {"medium", "locality"}:
            raise ConfigError(f"{need}, got the entry {_shown(entry)}")
        medium, locality = entry.get("medium"), entry.get("locality")
        for value, allowed in ((medium, MEDIA), (locality, LOCALITIES)):
            if value is not None and not (isinstance(value, str) and value.lower() in allowed):
                raise ConfigError(f"{need}, got the entry {_shown(entry)}")
        tiers.update(tier for tier, (m, loc) in TIER_MEDIA.items()
                     if (medium is None or medium.lower() == m)
                     and (locality is None or locality.lower() == loc))
    return frozenset(tiers)


def request_controls(params: Any) -> RequestControls:
    """The controls a request's ``kv_transfer_params`` ask for (:data:`NO_CONTROLS` when
    none); raises :class:`ConfigError` naming the parameter when a value is not understood."""
    if not isinstance(params, Mapping):
        return NO_CONTROLS
    ours = params.get("tierkv")
    if ours is not None and not isinstance(ours, Mapping):
        raise ConfigError(f"kv_transfer_params tierkv must be a mapping of tierkv's request "
                          f"controls, got {_shown(ours)}")
    ours = ours or {}
    raw_tiers = params.get(LOAD_TIERS_KEY)
    known = {*FLAGS, "load_deadline_ms", "load_policy"}  # load_policy: vllm_scheduler's
    unknown = sorted(str(name) for name in ours if name not in known)
    if unknown:
        raise ConfigError(f"kv_transfer_params tierkv has unknown control(s) {unknown}; "
                          f"known: {sorted(known)}")
    if not (set(ours) - {"load_policy"}) and raw_tiers is None:
        return NO_CONTROLS
    flags = {}
    for name in FLAGS:
        value = ours.get(name, False)
        if not isinstance(value, bool):
            raise ConfigError(f"kv_transfer_params tierkv.{name} must be true or false, got "
                              f"{_shown(value)}")
        flags[name] = value
    deadline = ours.get("load_deadline_ms")
    try:
        return RequestControls(flags["skip_load"], flags["skip_store"],
                               None if raw_tiers is None else _tiers(raw_tiers), deadline)
    except ConfigError as exc:
        raise ConfigError(f"kv_transfer_params: {exc}") from None
