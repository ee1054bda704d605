"""The remote tier's per-node breakers and their log lines (tierkv.tiers.remote.health),
with a fake clock: no network, no sleep."""

from __future__ import annotations

import logging

import pytest

from tierkv.tiers.remote.health import TIER, WRITES, NodeHealth


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


NODE, OTHER = "10.0.0.5:7000", "10.0.0.6:7000"


@pytest.fixture()
def health() -> tuple[NodeHealth, Clock]:
    clock = Clock()
    return NodeHealth("remote tier t", 3, 10.0, 1.0, clock, logging.getLogger("tierkv.t")), clock


def test_a_timeout_opens_that_node_only_at_once(health: tuple[NodeHealth, Clock],
                                               caplog: pytest.LogCaptureFixture) -> None:
    nodes, _ = health
    nodes.answered([NODE, OTHER], whole=True)
    assert not nodes.any_open()
    with caplog.at_level(logging.WARNING, logger="tierkv.t"):
        nodes.failed(NODE, "timeout")
    assert nodes.any_open() and not nodes.usable(NODE) and nodes.usable(OTHER)
    assert nodes.open_nodes() == {NODE: 1, OTHER: 0, TIER: 0}
    assert nodes.opens == 1
    assert caplog.text.count("node 10.0.0.5:7000 fails: timeout") == 1
    assert "skipped for 10.0 s" in caplog.text


def test_other_causes_open_after_breaker_failures_in_a_row(
        health: tuple[NodeHealth, Clock], caplog: pytest.LogCaptureFixture) -> None:
    nodes, _ = health
    with caplog.at_level(logging.WARNING, logger="tierkv.t"):
        for _ in range(2):
            nodes.failed(NODE, "connection lost")
        assert nodes.usable(NODE)  # 2 of 3
        nodes.failed(NODE, "connection lost")
    assert not nodes.usable(NODE) and nodes.opens == 1
    # the first failure and the opening; not the one between
    assert caplog.text.count("fails: connection lost") == 2


def test_the_cluster_and_writes_open_for_their_own_causes(
        health: tuple[NodeHealth, Clock]) -> None:
    nodes, _ = health
    nodes.failed(TIER, "timeout")  # no node blamed: counted, not at once
    assert nodes.usable(TIER) and nodes.usable(NODE)
    nodes.failed(WRITES, "out of memory")
    assert not nodes.usable(WRITES) and nodes.usable(NODE)  # reads go on
    nodes.failed(TIER, "cluster down")
    assert not nodes.usable(TIER) and not nodes.usable(NODE)  # every node skipped


def test_one_caller_probes_after_breaker_seconds_and_its_success_closes_it(
        health: tuple[NodeHealth, Clock], caplog: pytest.LogCaptureFixture) -> None:
    nodes, clock = health
    nodes.failed(NODE, "timeout")
    for kind, chunks in (("load", 4), ("push", 7), ("lookup", 2)):
        nodes.skipped(NODE, kind, chunks)
    clock.now += 9.9
    assert not nodes.usable(NODE)
    clock.now += 0.2
    assert nodes.usable(NODE)  # the probe
    assert not nodes.usable(NODE)  # the others still skip while it runs
    clock.now += 1.1
    assert nodes.usable(NODE)  # the probe never reported: another may probe
    nodes.failed(NODE, "timeout")  # it failed the same way: open again, nothing new logged
    assert not nodes.usable(NODE) and nodes.opens == 1
    clock.now += 10.1
    assert nodes.usable(NODE)
    with caplog.at_level(logging.WARNING, logger="tierkv.t"):
        nodes.answered([NODE], whole=True)
    assert nodes.usable(NODE) and not nodes.any_open()
    assert "node 10.0.0.5:7000 answers again after 21.3 s of failures (timeout); skipped " \
           "meanwhile: 7 pushes, 4 loads, 2 lookups" in caplog.text


def test_a_changed_cause_is_logged_again(health: tuple[NodeHealth, Clock],
                                         caplog: pytest.LogCaptureFixture) -> None:
    nodes, clock = health
    with caplog.at_level(logging.WARNING, logger="tierkv.t"):
        nodes.failed(NODE, "timeout")
        clock.now += 11
        assert nodes.usable(NODE)
        nodes.failed(NODE, "connection refused")
    assert "fails: timeout" in caplog.text and "fails: connection refused" in caplog.text
