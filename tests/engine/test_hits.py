"""A real vLLM engine reads the KV tierkv loaded: the same greedy tokens and top-k
log-probabilities as the engine without tierkv, hits per tier as tierkv and vLLM count
them, and a negative control (one early token changed: a miss, and other tokens).

vLLM's own prefix cache is off unless a test says otherwise, so that a repeated prompt is
served by tierkv (with it on, vLLM's GPU cache would serve it first).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.conftest import References
from tests.engine.engines import Engine, assert_distinct, changed, compare, prompt

# Full attention (two shapes) and a hybrid model (sliding-window + full-attention layers,
# vLLM's hybrid KV cache manager on).
MODELS = ["llama", "qwen2", "gemma3"]


def hit_tokens(engine: Engine, length: int) -> int:
    """The tokens tierkv serves of a prompt of ``length`` tokens whose chunks it holds:
    whole chunks, leaving at least one token to compute."""
    per_chunk = engine.connector.geometry.tokens_per_chunk
    return (length - 1) // per_chunk * per_chunk


@pytest.mark.parametrize("model", MODELS)
def test_cpu_tier_hits_give_the_tokens_of_a_run_without_tierkv(
        model: str, models: dict[str, Path], reference: References,
        logprob_tolerance: float) -> None:
    first, second = prompt(700, seed=1), prompt(530, seed=2)
    other = changed(first)
    ref_first, ref_second, ref_other = reference(model, [first, second, other])
    assert_distinct(ref_other, ref_first, logprob_tolerance, "negative control")
    with Engine(models[model], tierkv={"cpu_bytes": 64 << 20}) as engine:
        misses = engine.generate([first, second])
        assert [output.num_cached_tokens for output in misses] == [0, 0]
        compare(misses[0], ref_first, logprob_tolerance, "first run")
        hits = engine.generate([first, second])
        expected = [hit_tokens(engine, 700), hit_tokens(engine, 530)]
        assert expected[0] >= 512 and expected[1] >= 256
        assert [output.num_cached_tokens for output in hits] == expected
        compare(hits[0], ref_first, logprob_tolerance, "CPU-tier hit")
        compare(hits[1], ref_second, logprob_tolerance, "CPU-tier hit")
        figures = engine.figures()
        assert figures["hit_tokens_cpu"] == sum(expected)
        assert figures["hit_tokens_disk"] == figures["hit_tokens_remote"] == 0
        assert figures["loads_failed"] == 0
        # A CPU-tier hit loads in the step that asks for it (one KV cache group: vLLM cannot
        # report a failed same-step load of a hybrid model's request, so never there).
        hybrid = engine.connector.geometry.num_groups > 1
        assert figures["sync_loads"] == 0 if hybrid else figures["sync_loads"] >= 1
        # Negative control: one early token changed is a miss, and other tokens.
        miss = engine.one(other)
        assert miss.num_cached_tokens == 0
        compare(miss, ref_other, logprob_tolerance, "changed prompt")
        assert_distinct(miss, hits[0], logprob_tolerance, "changed prompt against the hit")
        assert engine.figures()["hit_tokens_cpu"] == sum(expected)


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_disk_hits_after_an_engine_restart(model: str, models: dict[str, Path],
                                           reference: References, logprob_tolerance: float,
                                           tmp_path: Path) -> None:
    tokens = [prompt(600, seed=3), prompt(900, seed=4)]
    refs = reference(model, tokens)
    settings = {"cpu_bytes": 64 << 20, "disk_path": str(tmp_path / "kv")}
    with Engine(models[model], tierkv=settings) as engine:
        engine.generate(tokens)
        engine.settle()
    with Engine(models[model], tierkv=settings) as engine:
        assert engine.connector._scheduler_side().found_on_disk > 0
        hits = engine.generate(tokens)
        expected = [hit_tokens(engine, 600), hit_tokens(engine, 900)]
        assert [output.num_cached_tokens for output in hits] == expected
        for hit, ref in zip(hits, refs):
            compare(hit, ref, logprob_tolerance, "disk hit after a restart")
        figures = engine.figures()
        assert figures["hit_tokens_disk"] == sum(expected)
        assert figures["hit_tokens_cpu"] == 0 and figures["loads_failed"] == 0
        assert figures["sync_loads"] == 0  # disk reads are never same-step loads


def test_mla_on_vllms_cpu_backend_is_refused(models: dict[str, Path]) -> None:
    """vLLM's reference CPU MLA backend (CPU_MLA: what a CPU without AMX runs) runs MLA
    with chunked prefill and prefix caching forced off: its MLA prefill cannot attend to KV
    it did not compute in the same pass. Before tierkv refused it, a tierkv hit there gave
    other greedy tokens than a recompute (the engine read wrong KV); now the engine does not
    start with the connector, and the error says why (docs/vllm.md quotes it). The backend
    is asked for by name: on a CPU with AMX vLLM would pick AMX_MLA, which keeps both on
    (and takes no float32 weights: the engine failed in vLLM's kernel, not at tierkv's
    refusal, on such a machine)."""
    from tierkv.errors import ConfigError

    with pytest.raises(Exception) as raised:
        Engine(models["deepseek_v2"], tierkv={"cpu_bytes": 64 << 20},
               attention_backend="CPU_MLA")
    error = raised.value
    while not isinstance(error, ConfigError) and error.__cause__ is not None:
        error = error.__cause__
    assert isinstance(error, ConfigError), f"{type(raised.value).__name__}: {raised.value}"
    assert "MLA prefill cannot attend to KV computed before" in str(error)


def test_a_same_step_load_that_fails_is_recomputed(models: dict[str, Path],
                                                   reference: References,
                                                   logprob_tolerance: float) -> None:
    """A CPU-tier hit loads before the step's forward pass (a same-step load); when its copy
    fails, that forward has already run over the blocks it should have filled. vLLM then
    rewinds the request to the first failed block and recomputes (tierkv reports the blocks
    in that same step): the output is still the reference's."""
    from tierkv.core.jobs import LoadSpec

    tokens = prompt(900, seed=8)
    [ref] = reference("llama", [tokens])
    with Engine(models["llama"], tierkv={"cpu_bytes": 64 << 20}) as engine:
        engine.one(tokens)
        transfer = engine.worker()._worker._stack.transfer

        def broken(spec: object) -> None:
            if isinstance(spec, LoadSpec):
                raise RuntimeError("the copy engine is broken (test)")

        transfer._before_copy = broken
        compare(engine.one(tokens), ref, logprob_tolerance, "after a failed same-step load")
        figures = engine.figures()
        assert figures["sync_loads"] >= 1 and figures["loads_failed"] >= 1
