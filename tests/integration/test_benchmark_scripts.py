"""Every benchmark script (and ``make demo-cluster``'s) still runs, at toy sizes (they are not run by anything else, and
their numbers are what docs/benchmarks/ quotes). Speed is not asserted: only that each
script finishes and prints its verdict line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

CASES = {
    "adapter": (["bench_adapter.py", "--requests", "8", "--chunks", "4", "--repeats", "1"],
                "target <= 2 us per decision"),
    "adapter-full-tier-shared": (["bench_adapter.py", "--requests", "8", "--chunks", "4", "--repeats", "1",
                                  "--cpu-slots", "16", "--shared-chunks", "1"], "evictions"),
    "adapter-arc": (["bench_adapter.py", "--requests", "8", "--chunks", "4", "--repeats", "1",
                     "--cpu-slots", "16", "--policy", "arc"], "evictions"),
    "index": (["bench_index.py", "--chunks", "400", "--slots", "32", "--disk-chunks", "64",
               "--repeats", "1", "--stats-entries", "1000,10000", "--turns", "400"], "target <= 5"),
    "index-arc": (["bench_index.py", "--chunks", "400", "--slots", "32", "--disk-chunks", "64",
                   "--repeats", "1", "--policy", "arc", "--stats-entries", "1000,10000",
                   "--turns", "400"], "target <= 1.2"),
    "copy": (["bench_copy.py", "--layers", "2", "--num-blocks", "64", "--slots", "8", "--jobs", "8",
              "--repeats", "1", "--no-block-loop", "--layouts", "LB", "--ids", "consecutive"],
             "engine store"),
    "cli": (["bench_cli.py", "--runs", "1"], "verdict: tierkv --help takes"),
    "store": (["bench_store.py", "--layers", "2", "--chunks", "2", "--compute-ms", "0.5",
               "--steps", "3", "--warmup", "1", "--repeats", "1"], "verdict: the safe default"),
    "restart": (["bench_restart.py", "--chunks", "300", "--rounds", "1"], "verdict: cold read"),
    "remote": (["bench_remote.py", "--chunk-kib", "16", "--total-mib", "1", "--rounds", "1",
                "--lookup-chunks", "40", "--benchmark-mib", "16"], "verdict: remote tier"),
    "remote-faults": (["bench_remote_faults.py", "--conversations", "2", "--chunks", "2",
                       "--close-chunks", "8", "--big-mib", "4", "--maxmemory", "256mb"],
                      "verdict: remote faults"),
    "demo-cluster": (["demo_cluster.py", "--conversations", "6", "--turns", "3", "--layers", "2"],
                     "demo-cluster done"),
    "disk": (["bench_disk.py", "--chunks", "8", "--chunk-mib", "0.25", "--repeats", "1", "--parts",
              "--plot", "disk.png", "--out-json", "disk.json"], "parts: TP 1 from 2 / TP 1 own"),
    "fingerprint": (["bench_fingerprint.py", "--sizes-gib", "0.01", "--shard-gib", "0.004",
                     "--repeats", "1", "--content"], "| 0.01 GiB | 4 |"),
    "vllm": (["bench_vllm.py", "--conversations", "2", "--turns", "2", "--runs", "1"], "tierkv-cpu+disk/arc"),
    "vllm-scan": (["bench_vllm.py", "--conversations", "2", "--turns", "2", "--runs", "1", "--configs",
                   "gpu-only,tierkv-cpu", "--scan-prompts", "1", "--scan-len", "128"], "tierkv-cpu/arc"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_script_runs(name: str, tmp_path: Path) -> None:
    argv, expected = CASES[name]
    if name in ("disk", "restart", "fingerprint"):
        argv = [*argv, "--dir", str(tmp_path)]
    done = subprocess.run([sys.executable, str(SCRIPTS / argv[0]), *argv[1:]], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert expected in done.stdout, done.stdout[-2000:]
    if name == "disk":  # the plot and the figures it was drawn from
        assert (tmp_path / "disk.png").read_bytes()[:4] == b"\x89PNG"
        medians = json.loads((tmp_path / "disk.json").read_text())["0.25"]
        assert medians["load: tierkv TierIO one job"] > 0 and "probe: O_DIRECT, 32 in flight" in medians


@pytest.mark.parametrize("script", sorted(path.name for path in SCRIPTS.glob("*.py")))
def test_script_runs_this_checkouts_tierkv(script: str, tmp_path: Path) -> None:
    # Regression: bench_index.py, bench_adapter.py and bench_vllm.py imported whichever
    # tierkv was installed (in a second git worktree: another branch's code), so their
    # figures could be of other code than the checkout's.
    code = ("import runpy, sys\n"
            "sys.argv = [sys.argv[1], '--help']\n"
            "try:\n"
            "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "import tierkv\n"
            "print('tierkv from', tierkv.__file__)\n")
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPTS / script)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    root = SCRIPTS.parent / "tierkv"
    assert f"tierkv from {root / '__init__.py'}" in done.stdout, done.stdout[-500:]


def test_gpu_check_says_why_it_skips_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/gpu_check.py runs for real (see docs/benchmarks/gpu.md)")
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py")], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and "CUDA not available" in done.stdout + done.stderr
