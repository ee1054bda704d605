"""CostPolicy: load_policy "cost" for the engine adapter (how much of a hit to load).

The cost model (:class:`tierkv.core.costs.CostModel`) picks the prefix of a hit whose load
plus the recompute of the rest is least; this module keeps what the adapter needs around
that choice: per tier, when a load was last taken, since when and for how many requests
its hits were declined, and when a declined tier is probed again (``probe_seconds``,
``probe_requests``). It also teaches the model each taken load's measured time.

:class:`LoadPolicy` is the protocol of an operator's own policy (``load_policy:
"module:Class"``, :func:`load_policy_class`): it gets what the built-in one decides on
(the hit's runs by tier, the chunk size, the first chunk's new tokens, the cost model) and
says how many chunks to load; the probes and measurements around it stay the built-in's.
An example: :mod:`tierkv.engine.example_load_policy` (docs/engine-adapter.md).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from tierkv.core.costs import CostModel
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion
from tierkv.core.plans import CpuState, Lookup
from tierkv.core.stats import TIERS, AdapterStats
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.errors import ConfigError

log = logging.getLogger("tierkv.load_policy")

__all__ = ["MAX_PROBE_REQUESTS", "CostPolicy", "Estimate", "LoadPolicy", "LoadStarted",
           "load_policy_class"]

MAX_PROBE_REQUESTS = 1 << 16  # probe_requests doubles up to this (probe_seconds still holds)

# A taken load's estimate: (slowest tier, chunks, estimated seconds, probe).
Estimate = tuple[str, int, float, bool]
# A planned load being timed: (planned at, slowest tier, chunks, estimate, probe, same-step).
LoadStarted = tuple[float, str, int, float, bool, bool]


@runtime_checkable
class LoadPolicy(Protocol):
    """An operator's load policy: ``load_policy: "module:Class"`` names a class whose
    instances (made with no argument, once per engine) have this method."""

    def choose(self, runs: Sequence[tuple[str, int]], tokens_per_chunk: int,
               first_chunk_tokens: int, costs: CostModel) -> int:
        """How many chunks of the hit to load, from its first. ``runs``: the hit's chunks
        in prefix order as ``(tier, count)`` runs, tier ``"cpu"``, ``"disk"`` or
        ``"remote"``; ``first_chunk_tokens``: the first chunk's tokens not in the engine's
        own prefix hit; ``costs``: the cost model the built-in "cost" policy asks
        (``costs.best_prefix(runs, tokens_per_chunk, first_chunk_tokens)[0]`` is its
        choice; ``load_seconds``, ``compute_seconds``: its estimates). The rest of the hit
        is recomputed; an answer outside ``[0, chunks of the hit]`` is clamped to it."""
        ...


def load_policy_class(path: str) -> LoadPolicy:
    """An instance of the class ``path`` names (``"module:Class"``); a :class:`ConfigError`
    naming the setting when it cannot be imported, made, or has no ``choose`` method."""
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"load_policy {path!r}: cannot import {class_name} from "
                          f"{module_name} ({type(exc).__name__}: {exc}); set load_policy to "
                          f"'always', 'cost' or an importable 'module:Class'") from exc
    if not callable(getattr(cls, "choose", None)):
        raise ConfigError(f"load_policy {path!r}: {class_name} has no choose(runs, "
                          f"tokens_per_chunk, first_chunk_tokens, costs) method (the "
                          f"LoadPolicy protocol of tierkv.engine.load_policy)")
    try:
        policy = cls()
    except Exception as exc:  # the operator's code: any failure is a setting that is wrong
        raise ConfigError(f"load_policy {path!r}: {class_name}() failed ({type(exc).__name__}: "
                          f"{exc}); a load policy is made with no argument") from exc
    return policy  # type: ignore[no-any-return]


class CostPolicy:
    """The adapter's cost-aware load decisions and the per-tier state behind them."""

    def __init__(self, index: BlockIndex, config: AdapterConfig, clock: Callable[[], float],
                 stats: AdapterStats) -> None:
        # The operator's own policy (load_policy "module:Class"), or None: the cost model's.
        self.custom: LoadPolicy | None = (load_policy_class(config.load_policy)
                                          if ":" in config.load_policy else None)
        self.custom_failures = 0  # its calls that raised (the model decided for them)
        self._index = index
        self._config = config
        self._clock = clock
        self._stats = stats
        self._tpc = config.tokens_per_chunk
        # The model (under either policy: a request may ask for "cost" itself; an "always"
        # engine estimates and measures only those requests' loads).
        self.costs = CostModel(config.cost_priors, config.chunk_bytes, load_bias=config.load_bias,
                               counts=stats)
        self.last_load = dict.fromkeys(TIERS, -float("inf"))  # a load taken, by tier
        self.declining: dict[str, float | None] = dict.fromkeys(TIERS)  # since when declined
        self.declined = dict.fromkeys(TIERS, 0)  # requests declined (or not asked) since
        self.probe_every = dict.fromkeys(TIERS, config.probe_requests)  # ... before a probe

    def runs(self, keys: Sequence[bytes], found: Lookup) -> list[tuple[str, int]]:
        """The hit's chunks as ``(tier, count)`` runs in prefix order; one tier (the common
        case) is read off the lookup without a walk."""
        hits = len(keys)
        if found.num_on_cpu == hits:
            return [("cpu", hits)]
        if found.num_remote == hits:
            return [("remote", hits)]
        if not found.num_on_cpu and not found.num_remote:
            return [("disk", hits)]
        runs: list[tuple[str, int]] = []
        entry_of = self._index.entry
        for key in keys:
            entry = entry_of(key)
            tier = ("remote" if entry is None  # a mark: on the remote tier only
                    else "cpu" if entry.cpu is CpuState.READY else "disk")
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, runs[-1][1] + 1)
            else:
                runs.append((tier, 1))
        return runs

    def in_tiers(self, keys: Sequence[bytes], found: Lookup, tiers: frozenset[str]) -> Lookup:
        """The hit ``found`` (of the first of ``keys``) up to its first chunk a load would
        read from a tier not in ``tiers`` (a request's load_tiers)."""
        hits = on_cpu = remote = 0
        for tier, size in self.runs(keys[:found.num_hits], found):
            if tier not in tiers:
                return Lookup(hits, False, on_cpu, remote)
            hits += size
            on_cpu += size if tier == "cpu" else 0
            remote += size if tier == "remote" else 0
        return found

    def choose_loads(self, keys: Sequence[bytes], start: int, found: Lookup,
                     num_local_tokens: int, decide: bool) -> tuple[int, int, Estimate | None]:
        """The prefix of the hit to load: the whole hit (a request that asks for "always"
        in a cost engine), or (``decide``) the prefix CostModel.best_prefix picks, the rest
        declined and counted by tier. The load taken is estimated either way (measured when
        it completes: the model learns from both). ``keys`` are the request's chunk keys.
        Returns (chunks, of them in the CPU tier, the taken load's estimate)."""
        costs = self.costs
        tpc, hits = self._tpc, found.num_hits
        runs = self.runs(keys[start:start + hits], found)
        first_tokens = (start + 1) * tpc - num_local_tokens
        take = chosen = hits
        if decide:
            take = chosen = self._choose(runs, first_tokens, hits)
            if take < hits:
                take = self._maybe_probe(runs, take)
        probe = take != chosen
        taken: dict[str, int] = {}
        position = 0
        stats = self._stats
        for tier, size in runs:
            keep = min(size, max(take - position, 0))
            if keep:
                taken[tier] = taken.get(tier, 0) + keep
            if keep < size:  # declined: the first chunk may be partly the engine's own hit
                declined = (size - keep) * tpc - (tpc - first_tokens if position + keep == 0
                                                  else 0)
                stats.tier[tier].declined_tokens += declined
            position += size
        if not take:
            return take, 0, None
        now = self._clock()
        for tier in taken:
            self.last_load[tier] = now
            if decide and take == chosen:  # the model's own choice, not a probe
                self.probe_every[tier] = self._config.probe_requests
        slowest = "remote" if "remote" in taken else "disk" if "disk" in taken else "cpu"
        return take, taken.get("cpu", 0), (slowest, take, costs.load_seconds(taken), probe)

    def _choose(self, runs: list[tuple[str, int]], first_tokens: int, hits: int) -> int:
        """The chunks to load: the operator's policy's choice (clamped), or the model's."""
        if self.custom is not None:
            try:
                return min(max(int(self.custom.choose(tuple(runs), self._tpc, first_tokens,
                                                      self.costs)), 0), hits)
            except Exception as exc:  # the operator's code: the model decides instead
                if not self.custom_failures:
                    log.warning("tierkv: load_policy %r failed (%s: %s); the cost model "
                                "decides while it fails",
                                self._config.load_policy, type(exc).__name__, exc)
                self.custom_failures += 1
        return self.costs.best_prefix(runs, self._tpc, first_chunk_tokens=first_tokens)[0]

    def remote_declined(self) -> bool:
        """load_policy "cost": the remote tier's hits are being declined, no load could pay
        (CostModel.never_pays) and its probe is not due: its lookups are skipped too, so a
        slow node costs the scheduler no round trip per request. Once its probe is due
        (probe_seconds, or probe_requests requests skipped), the next lookup asks it again
        and its hit is the probe."""
        since = self.declining["remote"]
        return (since is not None and since >= self.last_load["remote"]
                and self._clock() - since < self._config.probe_seconds
                and not self._probe_due("remote")
                and self.costs.never_pays("remote", self._tpc))

    def remote_skipped(self) -> None:
        """A request's answer skipped the remote tier (remote_declined): one more declined."""
        self._stats.remote_lookups_skipped += 1
        self.declined["remote"] += 1

    def _probe_due(self, tier: str) -> bool:
        """Whether ``tier`` was declined for its count of requests (probe_requests)."""
        every = self.probe_every[tier]
        return every > 0 and self.declined[tier] >= every

    def _maybe_probe(self, runs: list[tuple[str, int]], take: int) -> int:
        """A tier declined for ``probe_seconds``, or for its count of requests in a row
        (``probe_requests``, doubled by each probe), gets one load (a new measurement: a
        slow node may have recovered, a fast tier's slow load may have been a spike): the
        whole hit then."""
        position = 0
        tier = runs[-1][0]
        for tier, size in runs:  # the tier of the first declined chunk
            if position + size > take:
                break
            position += size
        now = self._clock()
        since = self.declining[tier]
        if since is None or since < self.last_load[tier]:  # declining from now on
            self.declining[tier] = now
            self.declined[tier] = 1
        elif now - since >= self._config.probe_seconds or self._probe_due(tier):
            self.declining[tier] = now
            self.declined[tier] = 0
            self.probe_every[tier] = min(2 * self.probe_every[tier], MAX_PROBE_REQUESTS)
            self._stats.load_probes += 1
            return sum(size for _, size in runs)
        else:
            self.declined[tier] += 1
        return take

    def measured_load(self, completion: Completion, started: LoadStarted) -> None:
        """A taken load completed: teach the model its time (the copy's, for a same-step
        load, whose step also ran the forward pass; else the steps it spanned) and count
        the estimate next to it. A probe that took less than half its estimate says the
        loads the tier's line was fitted to no longer hold (a spike, a node that
        recovered): the line starts again from the priors and this load. A time that is no
        sample (infinite, negative, over an hour: CostModel.observe_load) teaches nothing
        and is left out of the estimated and measured sums."""
        planned_at, tier, chunks, estimate, probe, sync = started
        seconds = completion.seconds if sync else self._clock() - planned_at
        restart = probe and seconds < estimate / 2
        if not self.costs.observe_load(tier, chunks, seconds, restart=restart):
            return  # not a sample (the model counted it): neither learned nor summed
        stats = self._stats
        if restart:
            stats.load_lines_restarted += 1
        figures = stats.tier[tier]
        figures.load_seconds_estimated += estimate
        figures.load_seconds_measured += seconds
