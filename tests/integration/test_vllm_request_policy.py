"""A request's own load policy under vLLM: ``kv_transfer_params={"tierkv": {"load_policy":
...}}``. Here rather than in tests/unit because it imports vLLM, which costs the unit suite
seconds (the cost model's own tests are tests/unit/test_costs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tierkv.integrations.vllm_scheduler import request_load_policy


def test_a_vllm_request_asks_for_its_policy_in_kv_transfer_params(
        caplog: pytest.LogCaptureFixture) -> None:
    """``{"tierkv": {"load_policy": ...}}`` in kv_transfer_params; anything else is warned
    about once per value and the engine's policy applies (the request never fails)."""
    def asks(params: object) -> SimpleNamespace:
        return SimpleNamespace(request_id="req-7", kv_transfer_params=params)

    warned: set[str] = set()
    for policy in ("always", "cost", "recompute"):
        assert request_load_policy(asks({"tierkv": {"load_policy": policy}}), warned) == policy
    for params in (None, {}, {"do_remote_prefill": True}, {"tierkv": {}}, {"tierkv": "cost"}):
        assert request_load_policy(asks(params), warned) is None
    assert not caplog.records
    with caplog.at_level("WARNING", logger="tierkv.vllm"):
        assert request_load_policy(asks({"tierkv": {"load_policy": "fast"}}), warned) is None
        assert request_load_policy(asks({"tierkv": {"load_policy": "fast"}}), warned) is None
        assert request_load_policy(asks({"tierkv": {"load_policy": 3}}), warned) is None
    assert [r.getMessage().split(" asks")[0] for r in caplog.records] == ["tierkv: request req-7"] * 2
    assert "'fast'" in caplog.records[0].getMessage()
    assert "engine's load_policy applies" in caplog.records[1].getMessage()
    for number in range(1000):  # a client's many values: a bounded set, bounded warnings
        assert request_load_policy(asks({"tierkv": {"load_policy": f"x{number}"}}), warned) is None
    assert len(warned) == 64 and len(caplog.records) == 64


def test_a_request_whose_controls_are_not_understood_is_served_without_the_cache(
        caplog: pytest.LogCaptureFixture) -> None:
    """kv_transfer_params tierkv does not understand: no load, no store (the request
    computes as vLLM alone would), and a warning that names the parameter, once per text."""
    from tierkv.integrations.vllm_scheduler import NO_CACHE, controls_of

    def asks(params: object) -> SimpleNamespace:
        return SimpleNamespace(request_id="req-8", kv_transfer_params=params)

    warned: set[str] = set()
    asked = controls_of(asks({"tierkv": {"skip_store": True}, "kv_load_tiers": ["cpu"]}), warned)
    assert asked.skip_store and not asked.skip_load and asked.load_tiers == {"cpu"}
    assert not caplog.records
    with caplog.at_level("WARNING", logger="tierkv.vllm"):
        for _ in range(2):
            assert controls_of(asks({"kv_load_tiers": [{"medium": "gpu"}]}), warned) is NO_CACHE
    assert NO_CACHE.skip_load and NO_CACHE.skip_store
    [record] = caplog.records
    assert "req-8 is served without tierkv's cache" in record.getMessage()
    assert "kv_load_tiers must be a list" in record.getMessage()
