"""One ``vllm.LLM`` in multiprocess mode (vLLM's default: EngineCore and the worker in
processes of their own), run as ``python -m tests.engine.child_engine SPEC_JSON``: it
generates the spec's prompts with tierkv's connector and prints their outputs as JSON on
its last line. The test that starts it compares them with the reference."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.update(spec.get("env", {}))
    from tierkv.integrations.vllm_runner import Engine

    with Engine(spec["model"], tierkv=spec["tierkv"], **spec.get("engine_args", {})) as engine:
        outputs = [engine.one(tokens, spec["max_tokens"]) for tokens in spec["prompts"]]
    print(json.dumps([output.to_json() for output in outputs]), flush=True)


if __name__ == "__main__":
    main()
