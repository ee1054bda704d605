"""Cost-aware loads: is loading a hit faster than computing its tokens? (pure bookkeeping)

- :class:`DecayedLine` a decayed least-squares fit of ``y = intercept + slope * x``, pulled
  toward a prior line that fades as samples come: time against chunks for a tier's loads,
  time against tokens for the engine's steps. Each older sample weighs ``decay`` less.
- :class:`StepTimer` the engine's compute line from its steps: an engine that reports its
  steps' ends (``step_finished``) is timed by them; else the time from one plan to the
  next is the previous step's. Each sample teaches :meth:`CostModel.observe_compute`.
- :class:`CostModel` one line per tier (``cpu``, ``disk``, ``remote``) for the time from
  planning a load to its completion, and one for the engine's prefill (seconds a step
  takes for its scheduled tokens). :meth:`CostModel.best_prefix` picks how many chunks of a
  hit to load: the prefix (the whole hit, part of it, or none) whose load time plus the
  compute time of the tokens left is least, unless loading the whole hit costs at most
  DECLINE_MARGIN more, or the engine's compute has not been measured on a step of a chunk's
  tokens yet (then the whole hit: a decline weighs a measured load against a measured
  compute, never against the priors' guess).

Times are the engine's: a load's time runs from the step that planned it to the step that
saw it complete, so it includes the scheduler steps an asynchronous load costs; a same-step
CPU load costs its copy. Before enough has been measured the priors decide (documented in
docs/configuration.md with the figures that chose them; declared and checked as settings,
``cost_priors.<name>``). No threads, and no clock but the one StepTimer is given: the
adapter feeds samples and asks.

A sample is taken only when it is one (:func:`valid_sample`: a count in [1,
MAX_SAMPLE_COUNT], seconds in [0, MAX_SAMPLE_SECONDS]); any other (infinite, NaN, negative,
a count whose square overflows a float) is dropped and counted (``AdapterStats.
cost_samples_dropped``), and
a fit that would still come out non-finite keeps the line before it: one bad sample never
decides a load.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any

from tierkv.core.stats import TIERS, AdapterStats
from tierkv.errors import ConfigError
from tierkv.settings import check_settings, setting

DEFAULT_CHUNK_BYTES = 2 << 20  # for the priors, where the engine's chunk size is not given
# A load that took more than this many times its tier's estimate teaches the line this
# many times (from the tier's second load on): one spike moves the line a bounded step,
# a lasting slowdown compounds it (4x, 16x, ...) within two or three loads.
SPIKE_FACTOR = 4.0
# A decline must save more than this share of the whole hit's load estimate plus one engine
# step (the compute line's intercept). Closer than that the two choices are within the noise
# of one step's timing (a loaded machine flipped a 7-chunk restart hit on a 1 ms estimated
# gain), and a load at parity leaves the engine's compute to other requests.
DECLINE_MARGIN = 0.1
# What a timing sample may be: a step's tokens or a load's chunks up to 2^32 (no step or
# load comes near it; its square, 1.8e19, is far from a float's overflow at 1.8e308, and so
# are the decayed sums of squares the fit keeps), and seconds up to an hour (longer is a
# clock that jumped or a process that was stopped, not a step or a load). The priors'
# seconds are bounded alike.
MAX_SAMPLE_COUNT = 1 << 32
MAX_SAMPLE_SECONDS = 3600.0
MAX_BYTES_PER_SECOND = 1e15  # a prior's rate: 1 PB/s, beyond any tier


def valid_sample(count: object, seconds: object) -> bool:
    """Whether ``(count, seconds)`` is a timing sample the model takes: ``count`` an int
    (numpy's too; not a bool) in [1, MAX_SAMPLE_COUNT], ``seconds`` a real number (not a
    bool) in [0, MAX_SAMPLE_SECONDS] (NaN and infinities are not)."""
    if type(count) is int and type(seconds) is float:  # the engine's samples: checked fast
        return 1 <= count <= MAX_SAMPLE_COUNT and 0.0 <= seconds <= MAX_SAMPLE_SECONDS
    if isinstance(count, bool) or isinstance(seconds, bool) \
            or not isinstance(count, Integral) or not isinstance(seconds, Real):
        return False
    try:
        value = float(seconds)
    except (OverflowError, ValueError):  # a Fraction beyond a float
        return False
    return 1 <= int(count) <= MAX_SAMPLE_COUNT and 0.0 <= value <= MAX_SAMPLE_SECONDS


class DecayedLine:
    """``y = intercept + slope * x`` fitted to samples by least squares, each older sample
    weighing ``decay`` times less, and pulled toward a prior line: at first as strongly as
    ``prior_weight`` samples for the intercept and a fiftieth of that for the slope (a change
    measured at ``x_scale``), fading like a sample down to 1% of that. So the first samples,
    often all at one x, keep most of the prior's intercept (a tier's fixed cost) and set
    the slope (its speed); samples over several x set both."""

    __slots__ = ("_decay", "_prior", "_lambda_a", "_lambda_b", "_floor", "_w", "_x", "_y",
                 "_xx", "_xy", "_line", "_last", "samples")

    def __init__(self, prior: tuple[float, float], x_scale: float, decay: float = 0.9,
                 prior_weight: float = 0.5) -> None:
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"cost model: decay must be within (0, 1), got {decay!r}")
        if not 0 < x_scale <= MAX_SAMPLE_COUNT:
            raise ConfigError(f"cost model: x_scale must be within (0, {MAX_SAMPLE_COUNT}], "
                              f"got {x_scale!r}")
        if not all(math.isfinite(value) for value in prior):
            raise ConfigError(f"cost model: a prior line must be finite, got {prior!r}")
        self._decay = decay
        self._prior = prior
        self._lambda_a = prior_weight
        self._lambda_b = 0.02 * prior_weight * x_scale ** 2  # a change of slope, at x_scale
        self._floor = 0.01  # the prior fades like a sample, down to this share of its weight
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._line: tuple[float, float] | None = None  # cached fit, until the next sample
        self._last = (max(prior[0], 0.0), max(prior[1], 0.0))  # the last finite fit
        self.samples = 0

    def observe(self, x: float, y: float) -> bool:
        """Learn ``y`` at ``x``; False (and nothing learned) unless x is in [0,
        MAX_SAMPLE_COUNT] and y in [0, MAX_SAMPLE_SECONDS] (NaN fails every comparison)."""
        if not (0.0 <= x <= MAX_SAMPLE_COUNT and 0.0 <= y <= MAX_SAMPLE_SECONDS):
            return False
        decay = self._decay
        if self._floor < 1.0:  # the prior's pull fades with the samples (kept above 1%)
            self._lambda_a *= decay
            self._lambda_b *= decay
            self._floor /= decay
        self._w = self._w * decay + 1.0
        self._x = self._x * decay + x
        self._y = self._y * decay + y
        self._xx = self._xx * decay + x * x
        self._xy = self._xy * decay + x * y
        self._line = None
        self.samples += 1
        return True

    def line(self) -> tuple[float, float]:
        """``(intercept, slope)``, both at least 0 (a fit that says otherwise is noise), and
        finite: a fit that is not keeps the line before it."""
        if self._line is None:
            line = self._fit()
            if math.isfinite(line[0]) and math.isfinite(line[1]):
                self._last = line
            self._line = self._last
        return self._line

    def _fit(self) -> tuple[float, float]:
        a0, b0 = self._prior
        la, lb = self._lambda_a, self._lambda_b
        # The normal equations of the weighted least squares with the prior's penalties.
        m00, m01, m11 = self._w + la, self._x, self._xx + lb
        r0, r1 = self._y + la * a0, self._xy + lb * b0
        det = m00 * m11 - m01 * m01
        if not det > 0:  # positive in exact arithmetic (the priors' penalties)
            return math.nan, math.nan
        intercept = (r0 * m11 - m01 * r1) / det
        slope = (m00 * r1 - m01 * r0) / det
        if slope < 0:  # refit with the slope at 0
            slope, intercept = 0.0, r0 / m00
        return max(intercept, 0.0), slope

    def predict(self, x: float) -> float:
        intercept, slope = self.line()
        return intercept + slope * x


def _seconds(default: float, help: str) -> Any:
    """A prior's seconds: finite, in [0, MAX_SAMPLE_SECONDS]."""
    return setting(default, kind="number", low=0.0, high=MAX_SAMPLE_SECONDS, unit="seconds",
                   help=help)


def _rate(default: float, help: str) -> Any:
    """A prior's bytes per second: finite, in [1, MAX_BYTES_PER_SECOND] (never 0)."""
    return setting(default, kind="number", low=1.0, high=MAX_BYTES_PER_SECOND,
                   unit="bytes/second", help=help)


@dataclass(frozen=True)
class CostPriors:
    """What the model assumes before it has measured: per tier a load's fixed seconds and
    its bytes per second, and the engine's seconds per step and per prefill token. They are
    optimistic about loads (a tier is measured only by loads taken from it) and favour
    loading long hits; docs/configuration.md, "Cost-aware loads", has the figures. Each is a
    setting (``cost_priors.<name>``), checked when made."""

    cpu_load_seconds: float = _seconds(0.001, "a CPU-tier load's fixed cost: a same-step "
                                              "copy, or one more step when asynchronous")
    cpu_bytes_per_second: float = _rate(10e9, "a CPU-tier load's speed")
    disk_load_seconds: float = _seconds(0.005, "a disk-tier load's fixed cost")
    disk_bytes_per_second: float = _rate(2e9, "a disk-tier load's speed")
    remote_load_seconds: float = _seconds(0.005, "a remote-tier load's fixed cost")
    remote_bytes_per_second: float = _rate(1e9, "a remote-tier load's speed")
    step_seconds: float = _seconds(0.005, "an engine step's fixed cost")
    seconds_per_token: float = _seconds(0.000025, "a prefill token's compute (40k tokens/s)")

    def __post_init__(self) -> None:
        check_settings(self, "cost_priors")

    def load_prior(self, tier: str, chunk_bytes: int) -> tuple[float, float]:
        """(seconds a load, seconds a chunk) of ``tier``."""
        seconds, rate = {"cpu": (self.cpu_load_seconds, self.cpu_bytes_per_second),
                         "disk": (self.disk_load_seconds, self.disk_bytes_per_second),
                         "remote": (self.remote_load_seconds, self.remote_bytes_per_second),
                         }[tier]
        return seconds, chunk_bytes / rate

    def compute_prior(self) -> tuple[float, float]:
        """(seconds a step, seconds a token)."""
        return self.step_seconds, self.seconds_per_token


def check_priors(priors: object, where: str = "cost_priors") -> CostPriors:
    """``priors`` if it is a :class:`CostPriors` (whose fields it checked when made); else a
    ConfigError naming ``where``."""
    if not isinstance(priors, CostPriors):
        names = ", ".join(f.name for f in fields(CostPriors))
        raise ConfigError(f"{where} must be a CostPriors ({names}), got {priors!r:.80}")
    return priors


class CostModel:
    """Load lines per tier and the engine's compute line; see the module docstring.
    ``counts``: where dropped samples are counted (the adapter's statistics)."""

    def __init__(self, priors: CostPriors = CostPriors(), chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 decay: float = 0.9, load_bias: float = 1.0,
                 counts: AdapterStats | None = None) -> None:
        if not 0 < load_bias < math.inf:
            raise ConfigError(f"cost model: load_bias must be > 0 and finite, got "
                              f"{load_bias!r}")
        if chunk_bytes <= 0:
            raise ConfigError(f"cost model: chunk_bytes must be > 0, got {chunk_bytes!r}")
        self.priors = check_priors(priors)
        self.counts = AdapterStats() if counts is None else counts
        self.load_bias = load_bias
        self._decay = decay
        self._load_priors = {tier: priors.load_prior(tier, chunk_bytes) for tier in TIERS}
        self.loads = {tier: DecayedLine(self._load_priors[tier], 16.0, decay) for tier in TIERS}
        self.compute = DecayedLine(priors.compute_prior(), 1024.0, decay)
        self.widest_step = 0  # the most tokens a measured step computed

    def observe_load(self, tier: str, num_chunks: int, seconds: float,
                     restart: bool = False) -> bool:
        """A load of ``num_chunks`` from ``tier`` took ``seconds``; the line learns at most
        SPIKE_FACTOR times its estimate (but from the tier's first load, which it takes as
        it comes: the priors are a guess, a measurement is not). ``restart``: the line
        starts again from its prior and this load (:meth:`forget_loads`). False: not a
        sample (:func:`valid_sample`), dropped and counted, the line as it was."""
        if not valid_sample(num_chunks, seconds):
            self.counts.cost_samples_dropped += 1
            return False
        if restart:
            self.forget_loads(tier)
        line, x, y = self.loads[tier], float(num_chunks), float(seconds)
        if line.samples:  # the prior's estimate as a floor: a line near 0 stays a guide
            intercept, slope = self._load_priors[tier]
            y = min(y, SPIKE_FACTOR * max(line.predict(x), intercept + slope * x))
        return line.observe(x, y)

    def forget_loads(self, tier: str) -> None:
        """``tier``'s line starts again from its prior (what it measured no longer holds)."""
        self.loads[tier] = DecayedLine(self._load_priors[tier], 16.0, self._decay)

    def observe_compute(self, num_tokens: int, seconds: float) -> bool:
        """A step computed ``num_tokens`` in ``seconds``. False: not a sample
        (:func:`valid_sample`), dropped and counted, the line as it was."""
        if not valid_sample(num_tokens, seconds):
            self.counts.cost_samples_dropped += 1
            return False
        self.compute.observe(float(num_tokens), float(seconds))
        self.widest_step = max(self.widest_step, int(num_tokens))
        return True

    def compute_measured(self, tokens_per_chunk: int) -> bool:
        """Whether a step of at least a chunk's tokens was measured: before that the compute
        line's slope is the priors' (decodes and short prefills say little about a token's
        cost), and no hit is declined. Why: a restarted engine's first loads, cold and on a
        loaded machine, measured 58 ms for 5 chunks; against the priors' 25 us a token the
        next 7-chunk hit was declined though a chunk was never computed."""
        return self.widest_step >= tokens_per_chunk

    def load_seconds(self, chunks_by_tier: dict[str, int]) -> float:
        """Estimated time to load that many chunks from each tier (one load job: each tier
        it reads costs its latency once)."""
        return self.load_bias * sum(self.loads[tier].predict(count)
                                    for tier, count in chunks_by_tier.items() if count)

    def compute_seconds(self, num_tokens: int) -> float:
        """Estimated extra time to compute ``num_tokens`` more tokens of a prefill (the
        slope of the compute line: the step's fixed cost is paid either way)."""
        return self.compute.line()[1] * num_tokens if num_tokens > 0 else 0.0

    def never_pays(self, tier: str, tokens_per_chunk: int) -> bool:
        """Whether no run of ``tier``'s chunks, of any length and after any prefix, loads
        faster than its tokens compute: each chunk costs at least its compute time and the
        tier's latency is more than nothing. Its hits would all be declined, so a lookup
        there can be skipped."""
        intercept, slope = self.loads[tier].line()
        step, per_token = self.compute.line()
        chunk_compute = per_token * tokens_per_chunk
        kept = (1.0 - DECLINE_MARGIN) * self.load_bias  # what a load counts against compute
        # A run of n chunks is declined when kept * (intercept + n * slope) exceeds n chunks
        # of compute plus a step (best_prefix's margin): for every n when it does for n = 1
        # and each further chunk costs at least its compute.
        return (self.compute_measured(tokens_per_chunk) and kept * slope >= chunk_compute
                and kept * (intercept + slope) > chunk_compute + step)

    def best_prefix(self, runs: Sequence[tuple[str, int]], tokens_per_chunk: int,
                    first_chunk_tokens: int | None = None) -> tuple[int, float, float]:
        """How many of the hit's chunks to load (``runs``: the hit's chunks in prefix order
        as ``(tier, count)`` runs), and the estimated seconds of that choice and of loading
        them all. The choice minimizes load time of the prefix + compute time of the rest;
        loading everything wins unless the choice saves more than DECLINE_MARGIN of its
        estimate plus one engine step, and while compute is not measured
        (:meth:`compute_measured`). ``first_chunk_tokens``: the first chunk's new tokens
        when the engine's own prefix hit covers part of it."""
        count = sum(size for _, size in runs)
        if count == 0:
            return 0, 0.0, 0.0
        first = tokens_per_chunk if first_chunk_tokens is None else first_chunk_tokens
        per_token = self.compute.line()[1]
        bias = self.load_bias
        # Cost is linear inside a run (a tier's latency is paid by its first chunk): the
        # run's first and last chunk are the only candidates in it.
        best, best_cost = 0, per_token * (first + (count - 1) * tokens_per_chunk)
        seen: set[str] = set()
        loaded = 0
        load_seconds = 0.0
        for tier, size in runs:
            intercept, slope = self.loads[tier].line()
            if tier not in seen:
                seen.add(tier)
                load_seconds += bias * intercept
            for step in ((1, size - 1) if size > 1 else (1,)):
                loaded += step
                load_seconds += bias * slope * step
                cost = load_seconds + per_token * (count - loaded) * tokens_per_chunk
                if cost <= best_cost:
                    best, best_cost = loaded, cost
        if best < count and (not self.compute_measured(tokens_per_chunk)
                             or best_cost + DECLINE_MARGIN * load_seconds
                             + self.compute.line()[0] >= load_seconds):
            best, best_cost = count, load_seconds  # unmeasured, or too close to call
        return best, best_cost, load_seconds


MAX_STEP_SAMPLE_SECONDS = 2.0  # a longer gap between plans is an idle engine, not compute
MAX_UNFINISHED_STEPS = 8  # plans awaiting step_finished (asynchronous scheduling: 2)


class StepTimer:
    """Times the engine's steps from its plans (and, once reported, their ends)."""

    def __init__(self, costs: CostModel, clock: Callable[[], float]) -> None:
        self._costs = costs
        self._clock = clock
        self._last_plan: tuple[float, int] | None = None  # the last plan's (time, tokens)
        # Plans whose steps the engine has not reported finished (step_finished), oldest
        # first; once it reports, its steps are timed by it, not by the gaps between plans.
        self._unfinished: deque[tuple[float, int]] = deque(maxlen=MAX_UNFINISHED_STEPS)
        self._step_ends = False
        self._last_end = -float("inf")  # when the last reported step ended

    def planned(self, tokens: int) -> None:
        """A plan for a step of ``tokens`` scheduled tokens. Without reported step ends, the
        time since the previous plan is the previous step's (it also counts the engine's
        idle time before this plan): a gap over MAX_STEP_SAMPLE_SECONDS is an idle engine,
        not compute."""
        now = self._clock()
        self._unfinished.append((now, tokens))
        if self._step_ends:
            return
        last = self._last_plan
        if last is not None and last[1] > 0 and now - last[0] <= MAX_STEP_SAMPLE_SECONDS:
            self._costs.observe_compute(last[1], now - last[0])
        self._last_plan = (now, tokens)

    def step_finished(self) -> None:
        """The engine finished the step of its oldest plan not yet reported. That step's
        tokens took the time since its plan (or since the step before it ended): the
        compute line learns that, not the gaps between plans, which count the time an idle
        engine waited for its next request."""
        self._step_ends = True
        if not self._unfinished:
            return
        planned, tokens = self._unfinished.popleft()
        now = self._clock()
        # A step planned while the previous one ran (asynchronous scheduling) starts when
        # that one ends.
        seconds = now - max(planned, self._last_end)
        self._last_end = now
        if tokens > 0 and seconds <= MAX_STEP_SAMPLE_SECONDS:
            self._costs.observe_compute(tokens, seconds)


__all__ = ["MAX_STEP_SAMPLE_SECONDS", "MAX_UNFINISHED_STEPS", "StepTimer", "DECLINE_MARGIN", "DEFAULT_CHUNK_BYTES", "MAX_BYTES_PER_SECOND", "MAX_SAMPLE_COUNT",
           "MAX_SAMPLE_SECONDS", "SPIKE_FACTOR", "TIERS", "CostModel",
           "CostPriors", "DecayedLine", "check_priors", "valid_sample"]
