"""Two real engines share KV through a real 3-master Redis cluster: what one computed, a
second engine (no disk, its own empty CPU tier) loads from the remote tier, with the
greedy tokens and log-probabilities of a run without tierkv."""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.engine.conftest import References
from tests.engine.engines import Engine, assert_distinct, changed, compare, prompt
from tests.redis_cluster import RedisCluster


def test_a_second_engine_loads_what_the_first_pushed(
        models: dict[str, Path], reference: References, logprob_tolerance: float,
        redis_cluster: RedisCluster) -> None:
    tokens = [prompt(800, seed=60), prompt(1100, seed=61)]
    other = changed(tokens[0])
    refs = reference("llama", [*tokens, other])
    assert_distinct(refs[2], refs[0], logprob_tolerance, "negative control")
    settings = {"cpu_bytes": 64 << 20, "remote_url": redis_cluster.url,
                "remote": {"key_prefix": f"engine-test-{uuid.uuid4().hex[:8]}:"}}
    with Engine(models["llama"], tierkv=settings) as first:
        first.generate(tokens)
        first.settle()
    # close() drained the pushes; a second engine with an empty CPU tier and no disk.
    with Engine(models["llama"], tierkv=settings) as second:
        per_chunk = second.connector.geometry.tokens_per_chunk
        expected = [(len(one) - 1) // per_chunk * per_chunk for one in tokens]
        hits = second.generate(tokens)
        assert [hit.num_cached_tokens for hit in hits] == expected
        for hit, ref in zip(hits, refs):
            compare(hit, ref, logprob_tolerance, "remote hit")
        figures = second.figures()
        assert figures["hit_tokens_remote"] == sum(expected)
        assert figures["hit_tokens_cpu"] == figures["hit_tokens_disk"] == 0
        assert figures["loads_failed"] == 0
        miss = second.one(other)  # negative control: a miss, and its own output
        assert miss.num_cached_tokens == 0
        compare(miss, refs[2], logprob_tolerance, "changed prompt")
