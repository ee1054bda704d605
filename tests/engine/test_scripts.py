"""The real engine's scripts run as the README says, on tiny options: ``scripts/bench_ttft.py``
(every row measured and checked: greedy tokens equal to the recompute, hits counted per tier)
and ``scripts/demo_vllm.py`` (a chat served through tierkv; run twice, the second run starts
warm from the disk the first one wrote).

Each runs in a child process of this interpreter (.venv-engine's python): an in-process
engine of its own, never beside this process's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_SECONDS = 600  # a cold start of vLLM on a loaded 2-core machine, several engines


def run_script(name: str, *args: str) -> str:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the script sets its own
    done = subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    assert done.returncode == 0, (f"{name} exited {done.returncode}\n--- stdout\n"
                                  f"{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    return done.stdout


def test_bench_ttft_measures_and_checks_every_row(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    plot = tmp_path / "ttft.png"
    stdout = run_script("bench_ttft.py", "--models", "llama", "--lengths", "300,600",
                        "--rounds", "1", "--warmup", "1", "--warmup-length", "300",
                        "--tiers", "cpu,disk,remote,slow", "--policies", "always,cost,recompute",
                        "--dir", str(tmp_path), "--out-json", str(out), "--plot", str(plot),
                        "--markdown")
    assert "every run equal to recompute, every hit as counted" in stdout
    assert "ERROR" not in stdout
    assert "| prompt tokens | 300 | 600 |" in stdout  # the markdown tables
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    figures = json.loads(out.read_text())["models"]["llama"]
    assert figures["errors"] == []
    rows = figures["rows"]
    tiers = ("cpu", "disk", "remote", "slow")
    assert set(rows) == {"recompute", "miss", "prefix", "disk_warm",
                         *(f"{tier}{policy}" for tier in tiers
                           for policy in ("", ":cost", ":recompute"))}
    assert "load_policy cost against the better of" in stdout
    assert "the better of 'always' and the same engine's recompute" in stdout
    chunk = figures["tokens_per_chunk"]
    for tier in tiers:
        assert rows[f"{tier}:cost"]["greedy_checked"] == 2  # declined or loaded, the same tokens
        # A request that asks to recompute is served nothing, in the engine that serves
        # the others their hits.
        assert rows[f"{tier}:recompute"]["cached_tokens"] == {"300": 0, "600": 0}
        assert rows[f"{tier}:recompute"]["greedy_checked"] == 2
    for row in ("cpu", "disk", "disk_warm", "remote", "slow"):
        assert rows[row]["greedy_checked"] == 2
        # 600 tokens: whole chunks, one token left to compute.
        assert rows[row]["cached_tokens"]["600"] == 599 // chunk * chunk > 0
    assert rows["recompute"]["cached_tokens"] == {"300": 0, "600": 0}
    assert rows["prefix"]["cached_tokens"]["600"] == 599 // figures["block_size"] \
        * figures["block_size"]
    # The cold disk hits read their chunks from the device, not from the page cache (the
    # process's storage reads, O_DIRECT included: /proc/self/io).
    cold = figures["cold_disk_reads"]
    assert len(cold) == 2 and all(read["device_read"] >= read["loaded_bytes"] // 2 > 0
                                  for read in cold)
    for length in ("300", "600"):
        assert all(len(row["seconds"][length]) == 1 for row in rows.values())


def turns(stdout: str) -> list[list[str]]:
    """The demo's per-turn lines, split in columns."""
    return [line.split() for line in stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+", line)]


def test_demo_vllm_twice_the_second_run_is_warm_from_disk(tmp_path: Path) -> None:
    options = ("--turns", "3", "--system", "300", "--user", "100", "--reply", "8",
               "--dir", str(tmp_path / "demo"))
    first = run_script("demo_vllm.py", *options)
    assert "a cold start" in first
    lines = turns(first)
    assert len(lines) == 3
    # Columns: turn, prompt, served by tierkv, cpu, disk. Turns 2 and 3 reuse the earlier
    # turns from the CPU tier.
    assert all(int(line[2]) == int(line[3]) > 0 for line in lines[1:])
    assert "greedy replies equal to vLLM without tierkv in 3/3 turns" in first

    second = run_script("demo_vllm.py", *options)
    assert "a warm start, the first turns are served from disk" in second
    lines = turns(second)
    assert len(lines) == 3
    assert int(lines[0][4]) > 0 and int(lines[0][4]) == int(lines[0][2])  # turn 1: from disk
    assert "(a warm start from disk)" in second
    assert "greedy replies equal to vLLM without tierkv in 3/3 turns" in second
