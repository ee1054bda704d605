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
            "tierkv": {"cpu_bytes": 64 << 20, "disk_path": str(tmp_path / "kv")}}
    first = run_child(spec)
    assert [output.num_cached_tokens for output in first] == [0, 0]
    second = run_child(spec)
    assert [output.num_cached_tokens for output in second] == [640, 896]  # 128-token chunks
    for output, ref in zip([*first, *second], [*refs, *refs]):
        compare(output, ref, logprob_tolerance, "multiprocess engine")
