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


def test_fresh_and_dir_refuse_what_is_not_a_demo_store(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: ``demo --fresh --dir X`` deleted whatever X held (a user's notes, a warm
    store), and ``demo --dir`` wrote the demo's namespace into a real store."""
    from tierkv.cli import main

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    assert main(["demo", "--fresh", "--dir", str(notes), "--conversations", "1"]) == 2
    assert (notes / "todo.txt").read_text() == "keep me"
    assert "not a demo store and --fresh would delete it" in capsys.readouterr().err
    store = tmp_path / "store"  # a real store of another model
    import torch

    from tierkv import StoreConfig, TierKVStore
    from tierkv.config import DiskTierConfig

    kv = [torch.zeros(8, 2, 16, 2, 8, dtype=torch.float16)]
    with TierKVStore(kv, model_id="llama", config=StoreConfig(
            blocks_per_chunk=2, device="cpu", disk=DiskTierConfig(path=store))):
        pass
    before = sorted(p.name for p in store.iterdir())
    for argv in (["demo", "--dir", str(store)], ["demo", "--fresh", "--dir", str(store)]):
        assert main([*argv, "--conversations", "1"]) == 2
        assert "a tierkv store of other models (llama)" in capsys.readouterr().err
    assert sorted(p.name for p in store.iterdir()) == before
    demo_store = tmp_path / "demo"  # the demo's own: --fresh starts it over
    run_demo(demo_store, capsys)
    assert main(["demo", "--fresh", "--dir", str(demo_store), "--conversations", "2",
                 "--turns", "1", "--layers", "2"]) == 0
