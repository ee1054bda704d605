"""`make redis-cluster` / `make redis-cluster-stop` (scripts/redis_cluster.py): a local
3-master cluster that `tierkv ping` finds ready, started once, stopped by port."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "redis_cluster.py"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=180,
                          cwd=ROOT)


def answers(port: int) -> bool:
    done = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), "PING"],
                          capture_output=True, text=True, timeout=10)
    return done.stdout.strip() == "PONG"


def test_start_gives_a_cluster_tierkv_pings_and_stop_shuts_it_down(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    try:
        started = run(str(SCRIPT), "start", "--dir", str(root))
        assert started.returncode == 0, started.stderr
        state = json.loads((root / "cluster.json").read_text())
        url, ports = state["url"], state["ports"]
        assert len(ports) == 3 and f"url: {url}" in started.stdout
        pinged = run("-m", "tierkv", "ping", url)
        assert pinged.returncode == 0, pinged.stdout + pinged.stderr
        assert "16384 of 16384 covered (cluster_state ok)" in pinged.stdout
        again = run(str(SCRIPT), "start", "--dir", str(root))  # running: the same cluster
        assert again.returncode == 0 and "already running" in again.stdout
        assert f"url: {url}" in again.stdout
    finally:
        stopped = run(str(SCRIPT), "stop", "--dir", str(root))
    assert stopped.returncode == 0 and "stopped (3 servers)" in stopped.stdout
    assert not any(answers(port) for port in ports)
    assert not root.exists()


def test_the_make_targets_run_the_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^redis-cluster: .*\n((?:\t.*\n)+)", makefile, re.M)
    stop = re.search(r"^redis-cluster-stop: .*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and "$(BIN)/python scripts/redis_cluster.py start" in recipe.group(1)
    assert "scripts/install_redis.sh" in recipe.group(1)
    assert stop and "$(BIN)/python scripts/redis_cluster.py stop" in stop.group(1)
    assert "make redis-cluster" in (ROOT / "docs" / "remote.md").read_text()
