#!/usr/bin/env python3
"""Benchmark the command line's start: ``tierkv --help`` and ``tierkv --version`` as new
processes, each ``--runs`` times (after one warm-up run: the page cache holds the files).

Rows: this checkout, and every ``--compare`` checkout (e.g. the commit before a change,
checked out with ``git worktree add``), each imported through ``PYTHONPATH`` and run from
its own directory. Baselines in
the same run: the bare interpreter (``python -c pass``) and ``python -c "import torch"``
(what a command that imports torch pays at least). Target: ``tierkv --help`` under 0.5 s.
Results: docs/benchmarks/plumbing.md ("The command line's start").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET_SECONDS = 0.5


def timed(argv: list[str], checkout: Path, runs: int) -> list[float]:
    """Wall seconds of ``runs`` runs of ``argv`` (one warm-up run first, not counted)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    seconds: list[float] = []
    for run in range(runs + 1):
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, check=False, cwd=checkout)  # -m: the cwd comes first
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {done.stderr[-500:]}")
        if run:
            seconds.append(elapsed)
    return seconds


def row(name: str, seconds: list[float]) -> str:
    return (f"{name:44s} median {statistics.median(seconds):6.3f} s  "
            f"[{min(seconds):.3f} .. {max(seconds):.3f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="measured runs of each command")
    parser.add_argument("--compare", type=Path, nargs="*", default=[],
                        help="other checkouts whose tierkv to time the same way")
    args = parser.parse_args(argv)
    python = sys.executable
    print(row("baseline: python -c pass", timed([python, "-c", "pass"], REPO, args.runs)))
    print(row("baseline: python -c 'import torch'",
              timed([python, "-c", "import torch"], REPO, args.runs)))
    ours = 0.0
    for checkout in [REPO, *args.compare]:
        label = "this checkout" if checkout == REPO else str(checkout)
        for command in ("--version", "--help"):
            seconds = timed([python, "-m", "tierkv", command], checkout, args.runs)
            print(row(f"tierkv {command} ({label})", seconds))
            if checkout == REPO and command == "--help":
                ours = statistics.median(seconds)
    verdict = "meets" if ours < TARGET_SECONDS else "misses"
    print(f"verdict: tierkv --help takes {ours:.3f} s, {verdict} the target of "
          f"< {TARGET_SECONDS} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
