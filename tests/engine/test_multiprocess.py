"""A multiprocess engine (vLLM's default: the connector's scheduler role in EngineCore's
process, its worker role in the worker's) stores, and a second one reloads from disk, with
the greedy tokens and log-probabilities of a run without tierkv. In-process engines are
every other test of this suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.engine.conftest import References
from tests.engine.engines import Output, compare, prompt
from tests.engine.processes import cpu_environment


# Tests of exact hits across processes load every hit: the async load of a multiprocess
# engine costs about a step, which is what a tiny model's recompute costs too, so
# load_policy "cost" may rightly decline near that parity (test_costs.py tests the policy).
ALWAYS = {"load_policy": "always"}


def run_child(spec: dict[str, Any]) -> list[Output]:
    done = subprocess.run([sys.executable, "-m", "tests.engine.child_engine", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600,
                          env=cpu_environment(), cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-4000:]
    return [Output.from_json(data) for data in json.loads(done.stdout.strip().splitlines()[-1])]


def test_a_multiprocess_engine_restarts_warm_from_disk(
        models: dict[str, Path], reference: References, logprob_tolerance: float,
        tmp_path: Path) -> None:
    tokens = [prompt(700, seed=70), prompt(1000, seed=71)]
    refs = reference("llama", tokens)
    spec = {"model": str(models["llama"]), "max_tokens": 8, "prompts": tokens,
            "tierkv": {"cpu_bytes": 64 << 20, "disk_path": str(tmp_path / "kv"), **ALWAYS}}
    first = run_child(spec)
    assert [output.num_cached_tokens for output in first] == [0, 0]
    second = run_child(spec)
    assert [output.num_cached_tokens for output in second] == [640, 896]  # 128-token chunks
    for output, ref in zip([*first, *second], [*refs, *refs]):
        compare(output, ref, logprob_tolerance, "multiprocess engine")


# vLLM's CPU backend runs TP = 2 with its multiprocess executor, one OpenMP thread bound to
# each core (VLLM_CPU_OMP_THREADS_BIND), nothing reserved.
TP2 = {"engine_args": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
       "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}


def test_an_engine_of_another_tp_size_loads_what_one_stored(
        models: dict[str, Path], reference: References, logprob_tolerance: float,
        tmp_path: Path) -> None:
    """One namespace for every TP size (format 5, on-disk-format.md "Parts"): a TP = 1
    engine stores prompt A on disk; a TP = 2 engine loads A (each rank reads the one part
    whole, verifies it, keeps its KV heads) and stores B as two parts; a TP = 1 engine loads
    B (reading both parts). Greedy tokens and log-probabilities as without tierkv. Three
    engines, not four: each start costs about a minute on 2 cores."""
    first, second = prompt(700, seed=72), prompt(700, seed=73)
    refs = reference("llama", [first, second])
    spec = {"model": str(models["llama"]), "max_tokens": 8,
            "tierkv": {"cpu_bytes": 64 << 20, "disk_path": str(tmp_path), **ALWAYS}}
    stored = run_child({**spec, "prompts": [first]})
    both = run_child({**spec, **TP2, "prompts": [first, second]})
    loaded = run_child({**spec, "prompts": [second]})
    hits = [output.num_cached_tokens for output in [*stored, *both, *loaded]]
    print(f"cross-TP hits (tokens of 700): TP 1 stores A {hits[0]}, TP 2 loads A {hits[1]} "
          f"and stores B {hits[2]}, TP 1 loads B {hits[3]}")
    assert hits == [0, 640, 0, 640]  # every full chunk of 128 tokens, each way
    (ns_dir,) = tmp_path.glob("ns-*")
    assert sorted(path.name for path in ns_dir.glob("part-*")) == \
        ["part-0of1", "part-0of2", "part-1of2"]
    for output, ref, where in zip([*stored, *both, *loaded], [refs[0], *refs, refs[1]],
                                  ("TP 1 stores A", "TP 2 loads A", "TP 2 stores B",
                                   "TP 1 loads B")):
        compare(output, ref, logprob_tolerance, where)
