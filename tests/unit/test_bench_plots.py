"""The ``--plot`` of scripts/bench_remote.py and scripts/bench_restart.py, drawn from a small
fixed ``--out-json`` (``--from-json``: nothing measured, no redis-server, no disk tier), and
the line a run without matplotlib stops on, before it measures anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

MIB_PER_SECOND = {"redis-benchmark SET": 800.0, "redis-benchmark GET": 1600.0, "tierkv put": 400.0,
                  "tierkv get": 800.0, "redis-py put": 600.0, "redis-py get": 1000.0,
                  "redis-py put, one node": 700.0, "redis-py get, one node": 1500.0}
REMOTE = {
    "header": "3-master Redis Cluster (fixed figures of a test)",
    "args": {"batch": 16, "ranks": 4, "lookup_chunks": 40, "ask_chunks": 64, "ask_samples": 5,
             "rounds": 2, "share_conversations": 2, "share_turns": 2, "share_cpu_chunks": 8,
             "share_splits": []},
    # tierkv put is half of redis-benchmark SET at every size: the report's ratio says 0.50x
    "throughput": {str(kib): {"chunks": 8, "runs": {row: [value * kib / 256] * 2
                                                    for row, value in MIB_PER_SECOND.items()}}
                   for kib in (256, 1024, 2048)},
    "lookup": {}, "asks": {}, "share": {},
}
RESTART = {
    "header": "2 rounds, cold: fixed figures of a test",
    "chunk_kib": 16,
    "by_chunks": {str(n): {"medians": {"index MiB": n / 10_000, "cold tierkv: ms": n / 100,
                                       "cold tierkv: MiB read": 1.1 * n / 10_000,
                                       "cold random access: ms": n / 200,
                                       "cold random access: MiB read": 2 * n / 10_000,
                                       "warm: ms": n / 1000},
                           "runs": {}}
                  for n in (10_000, 20_000, 40_000)},
}


def run(script: str, *args: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """The script run from the checkout's root, as the docs run it (and as make test's
    coverage of subprocesses needs: it finds pyproject.toml there; from elsewhere it
    measured lines only, and combining that with the branch data failed make test)."""
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True,
                          text=True, timeout=120, cwd=SCRIPTS.parent, env=env)


@pytest.mark.parametrize(("script", "figures", "reported"), [
    ("bench_remote.py", REMOTE, "ratio tierkv put / redis-benchmark SET: 0.50x"),
    ("bench_restart.py", RESTART, "verdict: cold read 1.10x the index"),
])
def test_plot_is_drawn_from_saved_figures(script: str, figures: dict[str, object],
                                          reported: str, tmp_path: Path) -> None:
    saved, png = tmp_path / "figures.json", tmp_path / "plot.png"
    saved.write_text(json.dumps(figures))
    done = run(script, "--from-json", str(saved), "--plot", str(png))
    assert done.returncode == 0, done.stderr[-2000:]
    assert reported in done.stdout, done.stdout[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# Small sizes, should the check come after the measuring after all.
SMALL = {"bench_remote.py": ["--chunk-kib", "16", "--total-mib", "1", "--benchmark-mib", "1",
                             "--lookup-chunks", "4", "--ask-samples", "2", "--share-turns", "2"],
         "bench_restart.py": ["--chunks", "100"],
         "bench_disk.py": ["--chunk-sizes", "0.25", "--total-mib", "1", "--no-always", "--no-cold",
                           "--no-vllm"]}


@pytest.mark.parametrize("script", sorted(SMALL))
def test_plot_without_matplotlib_names_what_installs_it(script: str, tmp_path: Path) -> None:
    blocked = tmp_path / "blocked" / "matplotlib"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('matplotlib blocked by a test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(blocked.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    dir_option = [] if script == "bench_remote.py" else ["--dir", str(tmp_path)]
    done = run(script, "--plot", str(tmp_path / "plot.png"), "--rounds", "1", *dir_option,
               *SMALL[script], env=env)
    assert done.returncode != 0
    assert "--plot needs matplotlib" in done.stderr and "requirements/dev.txt" in done.stderr
    assert "verdict" not in done.stdout and not (tmp_path / "plot.png").exists()
