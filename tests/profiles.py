"""Hypothesis profiles: ``dev``, the default (a unit suite that runs in seconds), and ``ci``,
the thorough one that ``make test`` asks for (``--hypothesis-profile=ci``; or set
``HYPOTHESIS_PROFILE=ci``). Tests give their counts under ``ci`` through :func:`thorough`,
which scales them to the loaded profile, so one line states both."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings

CI_EXAMPLES = 100  # hypothesis's own default: a test's counts are given at this scale
DEV_EXAMPLES = 10
MIN_EXAMPLES = 5

settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None)
settings.register_profile("dev", max_examples=DEV_EXAMPLES, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def thorough(max_examples: int, stateful_step_count: int | None = None,
             **more: Any) -> settings:
    """Settings with ``max_examples`` (and ``stateful_step_count``) as given under the ``ci``
    profile, scaled down under a lighter one; no deadline (machines are shared)."""
    scale = settings.default.max_examples / CI_EXAMPLES
    counts: dict[str, Any] = {"max_examples": max(MIN_EXAMPLES, round(max_examples * scale))}
    if stateful_step_count is not None:
        counts["stateful_step_count"] = stateful_step_count if scale >= 1 else \
            max(10, stateful_step_count // 2)
    return settings(deadline=None, **counts, **more)
