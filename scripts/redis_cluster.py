#!/usr/bin/env python3
"""`make redis-cluster` / `make redis-cluster-stop`: a local 3-master Redis Cluster on
loopback to try ``remote_url`` or ``tierkv ping`` against (docs/remote.md, "Try it").

``start`` starts the masters on free loopback ports (``tests/redis_cluster.py``, as the
tests and ``make demo-cluster`` do: no persistence, ``allkeys-lru``, no password), joins
them, writes what it started to ``DIR/cluster.json`` and prints the URL; the servers keep
running after it exits. Started again while they run, it prints the same URL. ``stop``
shuts each server down (``redis-cli SHUTDOWN NOSAVE`` on its port, never a pid) and removes
``DIR``. Needs redis-server 7+ and redis-cli (``scripts/install_redis.sh``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.redis_cluster import HOST, RedisCluster  # noqa: E402

DEFAULT_DIR = REPO / ".tierkv-redis"
STATE = "cluster.json"


def answers(port: int) -> bool:
    """Whether a server on ``port`` answers PING."""
    try:
        done = subprocess.run(["redis-cli", "-h", HOST, "-p", str(port), "PING"],
                              capture_output=True, text=True, timeout=2)
    except subprocess.TimeoutExpired:
        return False
    return done.stdout.strip() == "PONG"


def running(root: Path) -> dict[str, object] | None:
    """What ``start`` wrote under ``root``, if every one of its servers still answers."""
    state = root / STATE
    if not state.exists():
        return None
    found: dict[str, object] = json.loads(state.read_text())
    ports = found.get("ports")
    if isinstance(ports, list) and ports and all(answers(int(port)) for port in ports):
        return found
    return None


def start(root: Path, masters: int) -> int:
    found = running(root)
    if found is None:
        stop(root, quiet=True)  # what is left of a cluster half gone
        cluster = RedisCluster(root / "nodes", masters=masters)
        cluster.__enter__()  # left running: `stop` shuts it down
        found = {"url": cluster.url, "ports": list(cluster.ports)}
        (root / STATE).write_text(json.dumps(found))
        print(f"redis-cluster: {masters} masters on {HOST} ports "
              f"{', '.join(map(str, cluster.ports))} (data under {root})")
    else:
        print(f"redis-cluster: already running (ports {found['ports']})")
    url = found["url"]
    print(f"url: {url}\n"
          f"try: tierkv ping {url}\n"
          f"     StoreConfig(remote=RemoteTierConfig(url=\"{url}\")), or vLLM's "
          f"\"remote_url\": \"{url}\"\n"
          f"stop: make redis-cluster-stop")
    return 0


def stop(root: Path, quiet: bool = False) -> int:
    state = root / STATE
    ports = json.loads(state.read_text()).get("ports", []) if state.exists() else []
    for port in ports:
        subprocess.run(["redis-cli", "-h", HOST, "-p", str(port), "SHUTDOWN", "NOSAVE"],
                       capture_output=True, timeout=10)
    left = [port for port in ports if answers(int(port))]
    if left:
        print(f"redis-cluster: ports {left} still answer; data left under {root}")
        return 1
    shutil.rmtree(root, ignore_errors=True)
    if not quiet:
        print(f"redis-cluster: stopped ({len(ports)} servers)" if ports else
              f"redis-cluster: none running under {root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help="where the servers keep their files (default: %(default)s)")
    parser.add_argument("--masters", type=int, default=3)
    args = parser.parse_args(argv)
    if args.action == "start":
        args.dir.mkdir(parents=True, exist_ok=True)
        return start(args.dir, args.masters)
    return stop(args.dir)


if __name__ == "__main__":
    sys.exit(main())
