"""StepTimer: the engine's compute line from its steps, for the adapter's cost model.

An engine that reports its steps' ends (``step_finished``) is timed by them; else the time
from one plan to the next is the previous step's (its forward pass computed its scheduled
tokens). Each sample teaches :meth:`tierkv.core.costs.CostModel.observe_compute` what
recompute costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tierkv.core.costs import CostModel

__all__ = ["MAX_STEP_SAMPLE_SECONDS", "MAX_UNFINISHED_STEPS", "StepTimer"]

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
