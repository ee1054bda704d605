"""Cost-aware loads: is loading a hit faster than computing its tokens? (pure bookkeeping)

- :class:`DecayedLine` a decayed least-squares fit of ``y = intercept + slope * x``, started
  from prior points: time against chunks for a tier's loads, time against tokens for the
  engine's steps. Each new sample counts ``1 - decay`` of the weight; older ones fade.
- :class:`CostModel` one line per tier (``cpu``, ``disk``, ``remote``) for the time from
  planning a load to its completion, and one for the engine's prefill (seconds a step
  takes for its scheduled tokens). :meth:`CostModel.best_prefix` picks how many chunks of a
  hit to load: the prefix (the whole hit, part of it, or none) whose load time plus the
  compute time of the tokens left is least.

Times are the engine's: a load's time runs from the step that planned it to the step that
saw it complete, so it includes the scheduler steps an asynchronous load costs; a same-step
CPU load costs its copy. Before enough has been measured the priors decide (documented in
docs/configuration.md with the figures that chose them). No clock, no threads: the adapter
feeds samples and asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.errors import ConfigError

TIERS = ("cpu", "disk", "remote")
DEFAULT_CHUNK_BYTES = 2 << 20  # for the priors, where the engine's chunk size is not given


class DecayedLine:
    """A least-squares line through samples, each new one weighing ``1 - decay`` and the
    old ones fading by ``decay``; two prior points (weight ``prior_weight`` each) keep it
    defined before samples arrive and fade like any sample."""

    __slots__ = ("_decay", "_w", "_x", "_y", "_xx", "_xy", "samples")

    def __init__(self, prior: tuple[tuple[float, float], tuple[float, float]],
                 decay: float = 0.9, prior_weight: float = 1.0) -> None:
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"cost model: decay must be within (0, 1), got {decay!r}")
        self._decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.samples = 0
        for x, y in prior:
            self._add(x, y, prior_weight)

    def _add(self, x: float, y: float, weight: float) -> None:
        self._w += weight
        self._x += weight * x
        self._y += weight * y
        self._xx += weight * x * x
        self._xy += weight * x * y

    def observe(self, x: float, y: float) -> None:
        decay = self._decay
        self._w *= decay
        self._x *= decay
        self._y *= decay
        self._xx *= decay
        self._xy *= decay
        self._add(x, y, 1.0 - decay)
        self.samples += 1

    def line(self) -> tuple[float, float]:
        """``(intercept, slope)``, both at least 0 (a fit that says otherwise is noise)."""
        w = self._w
        mean_x, mean_y = self._x / w, self._y / w
        spread = self._xx / w - mean_x * mean_x
        if spread <= 1e-12 * max(mean_x * mean_x, 1.0):
            slope = mean_y / mean_x if mean_x > 0 else 0.0  # one x seen: through the origin
        else:
            slope = (self._xy / w - mean_x * mean_y) / spread
        slope = max(slope, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope

    def predict(self, x: float) -> float:
        intercept, slope = self.line()
        return intercept + slope * x


@dataclass(frozen=True)
class CostPriors:
    """What the model assumes before it has measured: per tier a load's fixed seconds and
    its bytes per second, and the engine's seconds per step and per prefill token. They are
    optimistic about loads (a tier is measured only by loads taken from it) and favour
    loading long hits; docs/configuration.md, "Cost-aware loads", has the figures."""

    cpu_load_seconds: float = 0.001  # a same-step copy, or one more step when asynchronous
    cpu_bytes_per_second: float = 10e9
    disk_load_seconds: float = 0.005
    disk_bytes_per_second: float = 2e9
    remote_load_seconds: float = 0.005
    remote_bytes_per_second: float = 1e9
    step_seconds: float = 0.005  # a step's fixed cost
    seconds_per_token: float = 0.000025  # prefill: 40k tokens/s

    def load_prior(self, tier: str, chunk_bytes: int
                   ) -> tuple[tuple[float, float], tuple[float, float]]:
        latency = getattr(self, f"{tier}_load_seconds")
        per_chunk = chunk_bytes / getattr(self, f"{tier}_bytes_per_second")
        return (1.0, latency + per_chunk), (16.0, latency + 16 * per_chunk)

    def compute_prior(self) -> tuple[tuple[float, float], tuple[float, float]]:
        return ((64.0, self.step_seconds + 64 * self.seconds_per_token),
                (2048.0, self.step_seconds + 2048 * self.seconds_per_token))


class CostModel:
    """Load lines per tier and the engine's compute line; see the module docstring."""

    def __init__(self, priors: CostPriors = CostPriors(), chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 decay: float = 0.9, load_bias: float = 1.0) -> None:
        if not load_bias > 0:
            raise ConfigError(f"cost model: load_bias must be > 0, got {load_bias!r}")
        if chunk_bytes <= 0:
            raise ConfigError(f"cost model: chunk_bytes must be > 0, got {chunk_bytes!r}")
        self.priors = priors
        self.load_bias = load_bias
        self.loads = {tier: DecayedLine(priors.load_prior(tier, chunk_bytes), decay)
                      for tier in TIERS}
        self.compute = DecayedLine(priors.compute_prior(), decay)

    def observe_load(self, tier: str, num_chunks: int, seconds: float) -> None:
        if num_chunks > 0 and seconds >= 0:
            self.loads[tier].observe(float(num_chunks), seconds)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds >= 0:
            self.compute.observe(float(num_tokens), seconds)

    def load_seconds(self, chunks_by_tier: dict[str, int]) -> float:
        """Estimated time to load that many chunks from each tier (one load job: each tier
        it reads costs its latency once)."""
        return self.load_bias * sum(self.loads[tier].predict(count)
                                    for tier, count in chunks_by_tier.items() if count)

    def compute_seconds(self, num_tokens: int) -> float:
        """Estimated extra time to compute ``num_tokens`` more tokens of a prefill (the
        slope of the compute line: the step's fixed cost is paid either way)."""
        return self.compute.line()[1] * num_tokens if num_tokens > 0 else 0.0

    def best_prefix(self, tiers: Sequence[str], tokens_per_chunk: int,
                    first_chunk_tokens: int | None = None) -> tuple[int, float, float]:
        """How many of the hit's chunks to load (``tiers``: each chunk's tier, in prefix
        order), and the estimated seconds of that choice and of loading them all. The
        choice minimizes load time of the prefix + compute time of the rest; loading
        everything wins ties. ``first_chunk_tokens``: the first chunk's new tokens when
        the engine's own prefix hit covers part of it."""
        count = len(tiers)
        if count == 0:
            return 0, 0.0, 0.0
        first = tokens_per_chunk if first_chunk_tokens is None else first_chunk_tokens
        total_tokens = first + (count - 1) * tokens_per_chunk

        def tokens_after(loaded: int) -> int:
            if loaded == 0:
                return total_tokens
            return (count - loaded) * tokens_per_chunk

        best, best_cost = count, float("inf")
        chunks: dict[str, int] = {}
        costs = [(0, self.compute_seconds(total_tokens))]
        for position, tier in enumerate(tiers, start=1):
            chunks[tier] = chunks.get(tier, 0) + 1
            starts = position == 1 or tiers[position - 2] != tier
            ends = position == count or tiers[position] != tier
            if starts or ends:  # linear inside a run of one tier: its ends are enough
                costs.append((position, self.load_seconds(chunks)
                              + self.compute_seconds(tokens_after(position))))
        all_cost = costs[-1][1]
        for loaded, cost in reversed(costs):  # the longest prefix first: it wins ties
            if cost < best_cost:
                best, best_cost = loaded, cost
        return best, best_cost, all_cost


__all__ = ["DEFAULT_CHUNK_BYTES", "TIERS", "CostModel", "CostPriors", "DecayedLine"]
