"""Cost-aware loads on the real engine: a tier made slow on purpose (a remote node behind
a proxy that sends 2 MiB/s) has its hits declined once it has been measured, so the request
costs about a recompute, where load_policy "always" loads them at the node's pace; a fast
tier keeps every hit; greedy outputs equal the run without tierkv in every case."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from tests.engine.conftest import References
from tests.engine.engines import Engine, compare, prompt
from tests.redis_cluster import RedisServer
from tests.throttle_proxy import ThrottleProxy

SLOW_BYTES_PER_SECOND = 2 << 20


def ttft(engine: Engine, tokens: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    output = engine.one(tokens, max_tokens=1)
    return time.perf_counter() - started, output.num_cached_tokens


def model_state(engine: Engine) -> str:
    """The figures and the cost model's lines, for a failure's message."""
    adapter = engine.connector._scheduler_side().adapter
    lines = {tier: line.line() for tier, line in adapter.costs.loads.items()}
    return (f"figures {json.dumps({k: v for k, v in engine.figures().items() if v})}; compute "
            f"line {adapter.costs.compute.line()}; load lines {lines}; declining "
            f"{adapter.policy.declining}, declined {adapter.policy.declined}, last loads "
            f"{adapter.policy.last_load}")


def test_a_slow_tier_is_declined_and_a_fast_tier_kept(
        models: dict[str, Path], reference: References, logprob_tolerance: float,
        tmp_path: Path) -> None:
    prompts = [prompt(1500, seed=90 + index) for index in range(4)]
    refs = reference("llama", prompts)
    with RedisServer(tmp_path / "redis") as server:
        remote = {"key_prefix": f"costs-{uuid.uuid4().hex[:8]}:", "timeout_seconds": 30.0}
        # A fast tier keeps every hit: the CPU tier of the engine that stores (and pushes).
        with Engine(models["llama"], tierkv={"cpu_bytes": 64 << 20, "remote_url": server.url,
                                             "remote": remote}) as first:
            first.generate(prompts)
            hits = first.generate(prompts)
            per_chunk = first.connector.geometry.tokens_per_chunk
            for hit, ref in zip(hits, refs):
                assert hit.num_cached_tokens == (1500 - 1) // per_chunk * per_chunk, (
                    [h.num_cached_tokens for h in hits],
                    {k: v for k, v in first.figures().items() if v})
                compare(hit, ref, logprob_tolerance, "CPU-tier hit under load_policy cost")
            assert first.figures()["declined_tokens_cpu"] == 0
            first.settle()
        with ThrottleProxy(server.port, bytes_per_second=SLOW_BYTES_PER_SECOND) as proxy:
            slow = {"cpu_bytes": 64 << 20, "remote_url": proxy.url, "remote": remote}
            with Engine(models["llama"], tierkv=slow) as engine:  # load_policy "cost"
                engine.one(prompt(700, seed=99))  # a few steps: the compute line
                measured, cached = ttft(engine, prompts[0])  # the priors say: load it
                assert cached > 0, "the first remote hit should be loaded (and measured): " + \
                    model_state(engine)
                declined, cached = ttft(engine, prompts[1])
                assert cached == 0, "the measured slow tier was not declined"
                figures = engine.figures()
                assert figures["declined_tokens_remote"] > 0
                assert figures["load_seconds_measured_remote"] > 1.0  # ~2.8 s at 2 MiB/s
                compare(engine.one(prompts[1]), refs[1], logprob_tolerance, "declined hit")
                # No remote hit can pay now: the next request does not even ask the node.
                before = engine.figures()
                skipped = engine.one(prompts[3], max_tokens=1).num_cached_tokens
                after = engine.figures()
                assert skipped == 0 and after["remote_lookups_skipped"] >= 1, \
                    f"{skipped} {before} " + model_state(engine)
                # A request may ask for its own policy: "recompute" loads nothing (prompt 0
                # sits in the CPU tier since its load), "always" loads the slow hit.
                assert engine.one(prompts[0], 1, load_policy="recompute").num_cached_tokens == 0
                assert engine.figures()["lookups_recompute"] >= 1
                started = time.perf_counter()
                forced = engine.one(prompts[2], max_tokens=1, load_policy="always")
                always = time.perf_counter() - started
                assert forced.num_cached_tokens > 0
                compare(engine.one(prompts[2]), refs[2], logprob_tolerance,
                        "slow hit (the request's always), then from the CPU tier")
            with Engine(models["llama"], tierkv={**slow, "load_policy": "always"}) as engine:
                engine.one(prompt(700, seed=99))
                cached = engine.one(prompts[3], max_tokens=1).num_cached_tokens
                assert cached > 0  # the engine's "always": the slow hit loaded
    print(f"TTFT: first slow load {measured:.3f} s, declined {declined:.3f} s, "
          f"always {always:.3f} s")
    assert declined < always / 2  # the slow load costs seconds; the recompute 0.1-0.3 s
