"""docs/vllm.md, "Run it on CPU": the copy-paste recipe's shell blocks run as they are (the
engine venv's python for `.venv-engine/bin/python`, a free port for 8000) and show a tierkv
hit on the repeated prompt: cached tokens in the answer, tier="cpu" in /metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.engine.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


def recipe_blocks() -> list[str]:
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text.split("\n## Run it on CPU\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def test_the_cpu_recipe_runs_and_shows_a_tierkv_hit(tmp_path: Path) -> None:
    model, server, requests, metrics = recipe_blocks()
    python = sys.executable
    script = "\n".join([
        "set -e",
        model.replace(".venv-engine/bin/python", python),
        f"PORT={free_port()}",
        server.replace(".venv-engine/bin/python", python).replace(
            "SERVER=$!", "SERVER=$!\ntrap 'kill $SERVER' EXIT"),
        requests, metrics])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log = (tmp_path / "server.log").read_text(errors="replace")[-3000:] \
        if (tmp_path / "server.log").exists() else ""
    assert process.returncode == 0, err[-3000:] + log
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(answers) == 2, out
    first, second = answers
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 256, second
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    hits = {match[1]: float(match[2]) for match in re.finditer(
        r'^tierkv:hit_tokens_total\{.*tier="(\w+)".*\} ([\d.e+]+)$', out, re.M)}
    assert hits.get("cpu") == 256.0 and hits.get("disk") == 0.0, out
