"""The command line's one handler, through ``tierkv.cli.main`` and as a real process: a
tierkv error is one line and exit 2, a reader that closes the pipe ends the command quietly,
``-v`` works before or after the command, ``demo`` refuses shapes it cannot run, and
``tierkv --help`` imports no command's module (so no torch: docs/benchmarks/plumbing.md has
its time)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.config import DiskTierConfig
from tierkv.keys import Namespace
from tierkv.tiers.disk.tier import DiskTier

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def make_store(root: Path, namespaces: int = 1) -> None:
    for number in range(namespaces):
        namespace = Namespace(model_id=f"model-{number}", dtype="float16", kv_layout="NHD",
                              page_bytes=512, tokens_per_chunk=16)
        with DiskTier(root, namespace, 0, DiskTierConfig(path=root, max_bytes=16 << 20), 4096) as tier:
            tier.put_many([(bytes([number]) + bytes(31), bytes(4096))])


class ClosedPipe(io.StringIO):
    """A stdout whose reader went away (``| head`` after its lines)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_pipe_ends_the_command_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    make_store(tmp_path)
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_a_broken_pipe_in_a_real_process_prints_no_traceback(tmp_path: Path) -> None:
    make_store(tmp_path, namespaces=3)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a byte
    try:
        done = subprocess.run([sys.executable, "-m", "tierkv", "inspect", str(tmp_path), "--json"],
                              stdout=write, stderr=subprocess.PIPE, env=ENV, timeout=120, text=True)
    finally:
        os.close(write)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]


@pytest.mark.parametrize("argv", [["-v", "inspect", "{store}"], ["inspect", "-v", "{store}"],
                                  ["inspect", "{store}", "--verbose"]])
def test_verbose_works_before_or_after_the_command(argv: list[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    make_store(tmp_path)
    levels: list[int] = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: levels.append(kw["level"]))
    assert main([arg.format(store=tmp_path) for arg in argv]) == 0
    assert levels == [logging.INFO]
    assert "inspected 1 namespace(s)" in capsys.readouterr().out
    levels.clear()
    assert main(["inspect", str(tmp_path)]) == 0
    assert levels == [logging.WARNING]


def test_a_tierkv_error_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("x")
    assert main(["verify", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tierkv verify: error: ") and "Traceback" not in err


@pytest.mark.parametrize("option,value", [("--layers", "0"), ("--layers", "-3"), ("--turns", "0"),
                                          ("--conversations", "0"), ("--cpu-chunks", "0"),
                                          ("--layers", "x"), ("--turns", "1000")])
def test_demo_refuses_shapes_it_cannot_run(option: str, value: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["demo", "--dir", str(tmp_path / "demo"), option, value])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {option} must be a whole number from 1 to" in err
    assert f"got {value!r}" in err and not (tmp_path / "demo").exists()


def test_help_imports_no_command_module() -> None:
    code = ("import sys\nfrom tierkv.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in ('torch', 'lmdb', 'tierkv.demo', "
            "'tierkv.tools', 'tierkv.warmup_hf', 'tierkv.tiers.disk.tools') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: tierkv" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"
