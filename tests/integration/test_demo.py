"""``make demo`` (``tierkv demo``): the chat workload through the library API, every
loaded byte checked; a second run over the same directory is served from its disk."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tierkv import demo


def run_demo(directory: Path, capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--dir", str(directory), "--conversations", "6", "--turns", "3",
                              "--layers", "2", "--cpu-chunks", "16"])
    assert demo.run(args) == 0
    return capsys.readouterr().out


def test_the_demo_runs_and_a_second_run_is_served_from_disk(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = run_demo(tmp_path / "store", capsys)
    second = run_demo(tmp_path / "store", capsys)
    rates = [int(re.search(r"demo done: (\d+)% of chunks served", out).group(1))  # type: ignore[union-attr]
             for out in (first, second)]
    assert "byte-exact" in first and 0 < rates[0] < rates[1], (first, second)
    assert "hits from disk 0," not in second  # the second run's first turns: the disk's


def test_the_workload_is_the_same_for_the_same_seed() -> None:
    long = list(demo.chat_prompts(3, 4, 3, 64))
    short = list(demo.chat_prompts(3, 4, 2, 64))
    assert long[: len(short)] == short and len(long) == 12
    assert all(len(prompt) >= 3 * 64 for _, _, prompt in long)  # the shared system prompt
