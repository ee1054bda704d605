"""tierkv.tiers.remote.spread: a call's per-node parts run at once, each under the caller's
one deadline; a part's failure stays its own (no network: the parts are plain callables)."""

from __future__ import annotations

import threading

import pytest

from tierkv.tiers.remote.client import RemoteError, current, deadline
from tierkv.tiers.remote.spread import Spread, by_node, served


def test_parts_run_at_once_under_the_caller_s_deadline() -> None:
    together = threading.Barrier(3, timeout=30)  # passes only if all three run at once
    spread = Spread("tierkv-test-spread")

    def part(answer: str) -> tuple[str, float | None]:
        together.wait()
        call = current()
        return answer, None if call is None else call.until

    try:
        with deadline(60) as call:
            results = spread.run([lambda: part("a"), lambda: part("b"), lambda: part("c")])
        assert results == [("a", call.until), ("b", call.until), ("c", call.until)]
        assert spread.run([lambda: current()]) == [None]  # no deadline: none made up
    finally:
        spread.close()
    assert not [thread for thread in threading.enumerate()
                if thread.name.startswith("tierkv-test-spread")]
    with pytest.raises(RuntimeError, match="after close"):
        spread.run([lambda: 1, lambda: 2])


def test_a_part_s_failure_is_its_own() -> None:
    spread = Spread("tierkv-test-spread")

    def stalled() -> int:
        raise RemoteError("node b failed: timeout", "timeout", "b")

    try:
        results = spread.run([lambda: 1, stalled, lambda: 3])
    finally:
        spread.close()
    assert results[0] == 1 and results[2] == 3 and isinstance(results[1], RemoteError)
    assert served([[0], [1, 2], [3]], results) == [([0], 1), ([3], 3)]


def test_served_raises_only_when_no_node_served() -> None:
    skipped = RemoteError("skipped", "timeout", "a", skipped=True)
    failed = RemoteError("failed", "connection refused", "b")
    with pytest.raises(RemoteError) as info:
        served([[0], [1]], [skipped, failed])
    assert info.value is failed  # a real failure says more than a skip
    with pytest.raises(RemoteError) as info:
        served([[0]], [skipped])
    assert info.value is skipped
    with pytest.raises(ZeroDivisionError):  # a bug is no node's failure
        served([[0], [1]], [1, ZeroDivisionError("bug")])
    assert served([], []) == []


def test_by_node_keeps_each_node_s_positions_in_order() -> None:
    nodes = ["b", "a", "b", "c", "a"]
    assert by_node(range(5), nodes.__getitem__) == {"b": [0, 2], "a": [1, 4], "c": [3]}
