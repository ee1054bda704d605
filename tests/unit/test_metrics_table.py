"""The metrics table and job-duration histograms (tierkv.engine.metrics), without a store."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tierkv.engine.metrics import (DURATION_BUCKETS, MAX_PENDING_DURATIONS, METRICS,
                                   Durations)


@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=200))
def test_buckets_count_each_value_at_or_below_each_bound(values: list[float]) -> None:
    durations = Durations()
    for seconds in values:
        durations.observe(seconds)
    cumulative = durations.cumulative()
    assert [le for le, _ in cumulative] == [*map(repr, DURATION_BUCKETS), "+Inf"]
    for (le, count), bound in zip(cumulative, (*DURATION_BUCKETS, float("inf"))):
        assert count == sum(1 for seconds in values if seconds <= bound), le
    assert durations.count == len(values) and durations.take() == values
    assert durations.take() == []  # taken once; the buckets stay
    assert durations.cumulative() == cumulative


def test_pending_values_stay_bounded_between_reports() -> None:
    durations = Durations()
    for _ in range(3 * MAX_PENDING_DURATIONS):
        durations.observe(0.001)
    assert len(durations.take()) <= MAX_PENDING_DURATIONS
    assert durations.count == 3 * MAX_PENDING_DURATIONS  # the buckets count every job


def test_every_figure_key_is_read_by_one_metric_only() -> None:
    keys = [key for metric in METRICS for _, key in metric.keys]
    assert len(keys) == len(set(keys))
    names = [metric.name for metric in METRICS]
    assert len(names) == len(set(names))
    for metric in METRICS:
        assert (metric.label is None) == (len(metric.keys) == 1 and metric.keys[0][0] == "")
