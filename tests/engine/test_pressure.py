"""The real engine under pressure: preemption in a KV cache too small for the batch, and
requests aborted while they prefill or while their chunks load. Every output still equals
the run without tierkv; later requests still hit what was stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.engine.conftest import References
from tests.engine.engines import Engine, compare, prompt

KV_TOKEN_BYTES = 4 * 2 * 2 * 64 * 4  # llama: layers x (K, V) x KV heads x head size x float32


def count_preemptions(engine: Engine) -> list[str]:
    """The ids of requests vLLM's scheduler preempts from now on (a spy around its own
    method: the preemption itself is vLLM's)."""
    scheduler = engine.scheduler
    preempted: list[str] = []
    original = scheduler._preempt_request

    def spy(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = spy
    return preempted


def test_preemption_in_a_kv_cache_too_small_for_the_batch(
        models: dict[str, Path], reference: References, logprob_tolerance: float) -> None:
    # Each prompt nearly fills 5 blocks: its decode needs a 6th, which the full cache lacks.
    batch = [prompt(630 + seed, seed=40 + seed) for seed in range(4)]
    refs = reference("llama", batch, max_tokens=24)
    # 16 blocks of 128 tokens: one request fits, four do not.
    with Engine(models["llama"], tierkv={"cpu_bytes": 64 << 20}, prefix_caching=True,
                kv_cache_bytes=16 * 128 * KV_TOKEN_BYTES, max_model_len=1024,
                max_num_batched_tokens=512) as engine:
        assert engine.core.vllm_config.cache_config.num_gpu_blocks <= 17
        preempted = count_preemptions(engine)
        first = engine.generate(batch, max_tokens=24)
        assert preempted, "the batch fitted: no preemption to test"
        for output, ref in zip(first, refs):
            compare(output, ref, logprob_tolerance, "a batch with preemptions")
        again = engine.generate(batch, max_tokens=24)
        for output, ref in zip(again, refs):
            compare(output, ref, logprob_tolerance, "the batch again")
        figures = engine.figures()
        # vLLM's own cache holds at most 16 blocks: the rest comes from tierkv.
        assert figures["hit_tokens_cpu"] > 0 and figures["loads_failed"] == 0


def scheduled(engine: Engine, request_id: str) -> Any:
    """vLLM's Request for the id given to add_request (vLLM appends a suffix of its own)."""
    found = [request for key, request in engine.scheduler.requests.items()
             if key == request_id or key.startswith(f"{request_id}-")]
    assert len(found) == 1, sorted(engine.scheduler.requests)
    return found[0]


def step_until(engine: Engine, done: Any, max_steps: int = 500) -> None:
    core = engine.llm.llm_engine
    for _ in range(max_steps):
        if done():
            return
        core.step()
    raise AssertionError(f"not reached in {max_steps} engine steps")


def test_aborted_requests_store_what_they_computed_and_never_poison_a_hit(
        models: dict[str, Path], reference: References, logprob_tolerance: float) -> None:
    """One request aborted halfway through its prefill (chunked, 256 tokens a step), one
    aborted while its chunks load from tierkv: the next requests for the same prompts get
    the reference's outputs, the first hitting the chunks computed before its abort."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    long, loaded = prompt(1400, seed=50), prompt(900, seed=51)
    refs = reference("llama", [long, loaded])
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    # Asynchronous loads only: a same-step load leaves no "while it loads" to abort in.
    with Engine(models["llama"], tierkv={"cpu_bytes": 64 << 20, "sync_load_bytes": 0},
                max_num_batched_tokens=256) as engine:
        llm_engine = engine.llm.llm_engine
        per_chunk = engine.connector.geometry.tokens_per_chunk
        # 1. Abort in the middle of a prefill.
        llm_engine.add_request("prefill", TokensPrompt(prompt_token_ids=long), params)
        request = scheduled(engine, "prefill")
        step_until(engine, lambda: request.num_computed_tokens >= 3 * per_chunk)
        computed = request.num_computed_tokens
        llm_engine.abort_request(["prefill"])
        engine.settle()
        hit = engine.one(long)
        assert hit.num_cached_tokens == computed // per_chunk * per_chunk > 0
        compare(hit, refs[0], logprob_tolerance, "after an abort mid-prefill")
        # 2. Abort while the chunks load (the request waits for them).
        engine.one(loaded)  # stored
        llm_engine.add_request("loading", TokensPrompt(prompt_token_ids=loaded), params)
        request = scheduled(engine, "loading")
        step_until(engine, lambda: request.status.name == "WAITING_FOR_REMOTE_KVS")
        llm_engine.abort_request(["loading"])
        engine.settle()
        after = engine.one(loaded)
        assert after.num_cached_tokens == (len(loaded) - 1) // per_chunk * per_chunk
        compare(after, refs[1], logprob_tolerance, "after an abort during a load")
        assert engine.figures()["loads_failed"] == 0
